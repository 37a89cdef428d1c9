"""The examples run as a user runs them, and say what they claim."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import backends

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


def test_embed_own_queue_trains_on_the_framework_queue_or_says_why_not():
    result = subprocess.run([sys.executable, str(EXAMPLES / "embed_own_queue.py")],
                            capture_output=True, text=True, timeout=300, check=False)
    if "opencl" not in backends.available():
        assert result.returncode == 1 and "needs blockrt's OpenCL backend" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("blockrt device opencl:0@queue:0x")
    assert lines[0].endswith("the framework's queue True, its context True")
    first, last = (float(v) for v in lines[1].split()[2:5:2])
    assert last < first / 10, lines[1]
    assert float(lines[2].split()[2].rstrip(",")) >= 0.95, lines[2]
    assert lines[2].endswith("on its own queue")
    assert lines[3].endswith(", 0 still live")


def test_train_resnet_learns_at_small_size():
    """The ResNet demo at a size CI affords (the README's full command reaches 98.5%)."""
    for package in ("sklearn", "tqdm"):
        pytest.importorskip(package, reason=f"the demo needs {package} (the demo/test extras)")
    result = subprocess.run([sys.executable, str(EXAMPLES / "train_resnet.py"), "--no-progress",
                             "--epochs", "2", "--width", "8", "--batch", "16"],
                            capture_output=True, text=True, timeout=300, check=False)
    line = next(x for x in result.stdout.splitlines() if "test accuracy" in x)
    accuracy = float(line.split("test accuracy")[1].split()[0])
    assert accuracy >= 0.85, (line, result.stderr[-2000:])  # 0.94 seen
    assert "planned_bytes" in result.stdout and "blockrt memory summary" in result.stdout


def test_train_gpt_follows_pytorch_and_samples():
    """The GPT demo, small, beside the same model in PyTorch: the losses agree within 1% at
    every logged step, the loss falls, and it prints a sample."""
    pytest.importorskip("tqdm", reason="the demo needs tqdm (the demo/test extras)")
    pytest.importorskip("torch", reason="the comparison needs PyTorch (CI installs its CPU "
                                        "build)")
    out = run_example("train_gpt.py", "--no-progress", "--steps", "30", "--log-every", "10",
                      "--width", "32", "--heads", "2", "--context", "16", "--batch", "8",
                      "--chars", "20000", "--compare-torch", "--sample", "40")
    logged = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in logged] == ["step 1", "step 10", "step 20",
                                                       "step 30"], out
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in logged]
    assert losses[-1] < losses[0], losses
    assert "largest relative difference from PyTorch" in out
    assert "sample (40 characters after a prompt of 16):" in out
