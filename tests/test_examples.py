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


def test_train_mlp_reaches_the_target_accuracy_and_reports_memory(tmp_path):
    for package in ("sklearn", "tqdm", "matplotlib"):
        pytest.importorskip(package, reason=f"the demo needs {package} (the demo/test extras)")
    plot = tmp_path / "timeline.png"
    lines = run_example("train_mlp.py", "--no-progress", "--plot", str(plot)).splitlines()
    result = next(line for line in lines if "test accuracy" in line)
    accuracy = float(result.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.97, result
    report = {line.split()[0]: line.split(None, 1)[1] for line in lines
              if line.split() and line.split()[0].endswith("_bytes")}
    assert set(report) >= {"planned_bytes", "lower_bound_bytes", "naive_bytes", "peak_bytes"}
    assert "blockrt memory summary" in lines
    assert any(line.startswith("cpu CachingAllocator") for line in lines)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
