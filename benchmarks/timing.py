"""Side-by-side timing for the benchmarks: interleaved rounds, best round kept; the CPU, the
software and the BLAS every figure must name; a baseline commit checked out beside this one."""

from __future__ import annotations

import contextlib
import pathlib
import platform
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable, Iterator
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent


def cpu_name() -> str:
    """The CPU's model name and count (lscpu), e.g. "AMD EPYC, 2 CPUs": figures differ between
    the Intel and AMD machines here, so every table says which measured it."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    name = fields.get("Model name", "unknown CPU").strip()
    return f"{name}, {fields.get('CPU(s)', '?').strip()} CPUs"


def versions(opencl_device: Any = None) -> str:
    """"Python 3.11.7, NumPy 2.4.6", and with a blockrt OpenCL device, pyopencl's version, the
    device and its platform ("pyopencl 2026.1.4 on opencl:0 = pthread-AMD EPYC (OpenCL 3.0 PoCL
    3.0-rc2)"): the software a figure was measured with."""
    import numpy as np

    text = f"Python {platform.python_version()}, NumPy {np.__version__}"
    if opencl_device is not None:
        import pyopencl as cl

        cl_device = opencl_device.cl_device
        platform_version = " ".join(cl_device.platform.version.split()[:4])
        text += (f", pyopencl {cl.VERSION_TEXT} on {opencl_device.name} = {cl_device.name} "
                 f"({platform_version})")
    return text


def blas_name() -> str:
    """The CBLAS the CPU device's products run on in this process and how it was chosen
    (backends/_blas.py `Report.summary`), e.g. "OpenBLAS 0.3.31 (measured against MKL 2026.2)"
    or "none (np.matmul and an elementwise pass)"."""
    from backends import _blas

    return _blas.report().summary


def machine(device: Any) -> str:
    """What a figure on `device` was measured on: the CPU and its CBLAS for the CPU device,
    else the device's own name."""
    if device.name == "cpu":
        return f"{cpu_name()}; products on {blas_name()}"
    return device.name


@contextlib.contextmanager
def baseline_checkout(ref: str) -> Iterator[pathlib.Path]:
    """A temporary git worktree of `ref` with its C extension built in place (with this
    Python), removed afterwards; SystemExit with git's or the compiler's words when either
    fails (a shallow clone has no older commits)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = pathlib.Path(tmp) / "baseline"
        made = subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=ROOT,
                              capture_output=True, text=True)
        if made.returncode:
            raise SystemExit(f"cannot check out the baseline {ref} (a shallow clone?): "
                             f"{made.stderr.strip()}")
        try:
            built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"],
                                   cwd=tree, capture_output=True, text=True)
            if built.returncode or not list((tree / "allocators").glob("_speedups*.so")):
                raise SystemExit(f"cannot build the baseline's C extension:\n"
                                 f"{built.stderr[-2000:]}")
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           capture_output=True)


def interleaved_min(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """The smallest value each measure returns over `rounds` rounds.

    Every round runs each measure in turn, so all of them see the same machine load (these
    machines switch between speeds for seconds at a time; sequential runs would not compare).
    """
    best = dict.fromkeys(measures, float("inf"))
    for _ in range(rounds):
        for name, measure in measures.items():
            best[name] = min(best[name], measure())
    return best


def interleaved_best(contenders: dict[str, Callable[[], object]], number: int,
                     rounds: int, sync: Callable[[], object] | None = None) -> dict[str, float]:
    """Microseconds per call of each contender: the best round of `number` calls.

    Each contender is called once first to warm up (first-touch allocation, caches). `sync`
    (a device's synchronize) ends each round: the time of work queued on a device, not only
    of queueing it.
    """
    for fn in contenders.values():
        fn()

    def per_call(fn: Callable[[], object]) -> Callable[[], float]:
        if sync is None:
            return lambda: timeit.timeit(fn, number=number) / number * 1e6

        def batch() -> None:
            for _ in range(number):
                fn()
            sync()
        return lambda: timeit.timeit(batch, number=1) / number * 1e6

    return interleaved_min({name: per_call(fn) for name, fn in contenders.items()}, rounds)


# --- the float32 / float16 / bfloat16 step table (bench_half, bench_amp) ------------------------
PRECISIONS = ("float32", "float16", "bfloat16")


def steps_per_round(config: Any) -> int:
    """Steps of an MLP config in one timed round: about 40 ms of work at 50 GFLOP/s, at least 2."""
    return max(2, int(2e9 // (6 * config.batch * config.width ** 2 * (config.depth + 1) * 50)))


def print_precision_header() -> None:
    print("| config | mode | float32 (ms) | float16 (ms) | bfloat16 (ms) | float16 / float32 | "
          "bfloat16 / float32 |")
    print("|---|---|---:|---:|---:|---:|---:|")


def print_precision_row(key: str, graph: bool, ms: dict[str, float]) -> None:
    """One row: the step in each of `PRECISIONS` (ms) and the halves' ratios to float32."""
    print(f"| {key} | {'static graph' if graph else 'eager'} | {ms['float32']:.2f} | "
          f"{ms['float16']:.2f} | {ms['bfloat16']:.2f} | "
          f"{ms['float16'] / ms['float32']:.2f} | {ms['bfloat16'] / ms['float32']:.2f} |")
