"""The examples run as a user runs them, and say what they claim."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, *args: str) -> str:
    result = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_sharing_memory_walks_through_the_seed_example():
    lines = run_example("sharing_memory.py").splitlines()
    step = {line[:2]: line for line in lines if line[:2] in ("1.", "2.", "3.", "4.")}
    assert "[[0.41 0.44]]" in step["1."] and "wrong" in step["1."]
    assert "[[0.44 0.44]]" in step["2."]
    assert "AliasingError" in step["3."]
    assert "[[0.44 0.44]]" in step["4."]
    message = lines[lines.index(step["3."]) + 1]
    assert "matmul" in message and "out" in message and "input b" in message
    assert "allocated yet? False" in lines[0]
    assert lines[-1] == "after the parameters go: 0 B in use"


def test_train_mlp_reaches_the_target_accuracy_and_prints_the_memory_summary():
    pytest.importorskip("sklearn", reason="the demo needs scikit-learn (the demo/test extras)")
    pytest.importorskip("tqdm", reason="the demo needs tqdm (the demo/test extras)")
    lines = run_example("train_mlp.py", "--no-progress").splitlines()
    result = next(line for line in lines if "test accuracy" in line)
    accuracy = float(result.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.97, result
    assert "blockrt memory summary" in lines
    assert any(line.startswith("cpu CachingAllocator") for line in lines)
