"""Conformance: the runtime's own suites, rerun with every other available backend as the default.

For each backend in `backends.available()` other than "cpu", the op, aliasing, autograd, nn, graph
and constant test files run in a subprocess with BLOCKRT_DEVICE naming it, so every tensor they make
without a device lands there. They must all pass (a test that is inherently about the cpu device
skips itself there, with its reason). To keep CI lean the subprocess uses the "conformance"
hypothesis profile (tests/conftest.py: 25 examples where a test does not set its own number).
Skipped when cpu is the only backend.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import backends

ROOT = Path(__file__).resolve().parent.parent
SUITES = ["tests/test_ops.py", "tests/test_aliasing.py", "tests/test_autograd.py",
          "tests/test_nn.py", "tests/test_graph.py", "tests/test_constant.py"]
OTHERS = [kind for kind in backends.available() if kind != "cpu"]


def _run(backend: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, BLOCKRT_DEVICE=backend)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.skipif(not OTHERS, reason="only the cpu backend is available here (no OpenCL or "
                                       "CUDA device), and the suites already run on it")
@pytest.mark.parametrize("backend", OTHERS or ["none"])
def test_the_runtime_suites_pass_with_the_backend_as_default(backend):
    probe = _run(backend, "-c", "import runtime; print(runtime.tensor([1.0]).device.name)",
                 timeout=120)
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().startswith(backend), probe.stdout  # the variable is obeyed

    result = _run(backend, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                  "--hypothesis-profile=conformance", *SUITES, timeout=1500)
    summary = result.stdout.strip().splitlines()[-1:] or ["(no output)"]
    assert result.returncode == 0, (f"the suites fail with BLOCKRT_DEVICE={backend}: {summary[0]}"
                                    f"\n{result.stdout[-8000:]}\n{result.stderr[-2000:]}")
    assert " passed" in summary[0]
