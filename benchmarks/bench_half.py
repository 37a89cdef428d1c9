"""Half-precision storage on the CPU: the MLP training step with every tensor (parameters,
activations, gradients) in float16 or bfloat16, against the same step in float32, eager and
under a static graph plan (issue 20, part 2: the CPU computes a two-byte float in float32 and
rounds each op's result once; goal at most 1.3x the float32 step on S and M).

Contenders share one process and are timed in interleaved rounds (`timing.interleaved_best`),
so that all see the same machine load; the ratio is to float32 in the same mode. One BLAS
thread unless OPENBLAS_NUM_THREADS is set (the step's overhead, not the product's threads, is
what the rule adds), on NumPy's OpenBLAS unless BLOCKRT_BLAS is set.

With --split, eager mode also times float32 with the elementwise ops on their Python path
(`ops._fast` off; products and reductions keep the C one): the path every half elementwise op
takes, since the C fast path (runtime/_dispatch.c) takes float32 and float64 only. Its ratio to
float32 is the part of the half step's cost that is the runtime's dispatch, not the rule.

On a device with a queue (--device cuda) each round ends with the device's synchronize.

Run: .venv/bin/python benchmarks/bench_half.py [--configs S,M] [--rounds 7] [--split]
     [--device cuda]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")
# NOTE: one CBLAS from the first step (BLOCKRT_BLAS=auto would measure both during the rounds)
os.environ.setdefault("BLOCKRT_BLAS", "openblas")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlp_reference import typed_step  # noqa: E402
from timing import (  # noqa: E402
    PRECISIONS,
    interleaved_best,
    machine,
    print_precision_header,
    print_precision_row,
    steps_per_round,
    versions,
)

import backends  # noqa: E402
from blockrt.models import CONFIGS  # noqa: E402
from runtime import fastpath, ops  # noqa: E402


@contextlib.contextmanager
def python_elementwise() -> Any:
    """The elementwise ops' C fast path off inside the block (products and reductions keep
    theirs): the dispatch a half elementwise op gets."""
    saved = ops._fast
    ops._fast = None
    try:
        yield
    finally:
        ops._fast = saved


def on_python_path(step: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with python_elementwise():
            return step()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="S,M")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--split", action="store_true",
                        help="also time eager float32 with elementwise ops on the Python path")
    parser.add_argument("--device", default="cpu",
                        help="where the steps run (e.g. cuda: each round ends with a sync)")
    args = parser.parse_args()
    device = backends.get_device(args.device)
    sync = None if device.home_queue is None else device.synchronize
    print(f"Half-precision storage on {machine(device)}; {versions()}; "
          f"{os.environ['OPENBLAS_NUM_THREADS']} BLAS thread(s); C fast path "
          f"{'on' if fastpath.ACCELERATED else 'off'}; 1-minute load {os.getloadavg()[0]:.2f}")
    print()
    print_precision_header()
    split = []
    for key in args.configs.split(","):
        config = CONFIGS[key]
        number = steps_per_round(config) if sync is None else 20
        for graph in (False, True):
            steps = {dtype: typed_step(config, dtype, graph, device) for dtype in PRECISIONS}
            if args.split and not graph:
                steps["python"] = on_python_path(typed_step(config, "float32", graph, device))
            us = interleaved_best(steps, number, args.rounds, sync)
            ms = {dtype: us[dtype] / 1e3 for dtype in steps}
            print_precision_row(key, graph, ms)
            if "python" in ms:
                split.append(f"| {key} | {ms['float32']:.2f} | {ms['python']:.2f} | "
                             f"{ms['python'] / ms['float32']:.2f} | "
                             f"{ms['float16'] / ms['python']:.2f} | "
                             f"{ms['bfloat16'] / ms['python']:.2f} |")
    if split:
        print()
        print("Eager, split: float32 with its elementwise ops on the Python path (where half ops "
              "went before the C fast path took them)")
        print()
        print("| config | float32 (ms) | float32, Python path (ms) | Python path / float32 | "
              "float16 / Python path | bfloat16 / Python path |")
        print("|---|---:|---:|---:|---:|---:|")
        for row in split:
            print(row)


if __name__ == "__main__":
    main()
