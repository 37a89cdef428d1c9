"""The shell scripts of .ci/ (CI's own and the GPU session's, most of which CI cannot run):
each is executable and parses (`bash -n`), so a GPU session's one call does not end on a
typo."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

CI = pathlib.Path(__file__).resolve().parent.parent / ".ci"
SCRIPTS = sorted(p for p in CI.iterdir()
                 if p.is_file() and p.read_text().startswith("#!/usr/bin/env bash"))


def test_the_gpu_session_scripts_are_among_them():
    names = {p.name for p in SCRIPTS}
    assert {"run", "cuda", "cuda-bench", "cuda-session", "cuda-compile"} <= names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_each_script_is_executable_and_parses(script):
    assert os.access(script, os.X_OK), f"{script} is not executable"
    parsed = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
