"""Convolution speed (issue 30): forward + backward of ResNet-50's conv layer shapes, blockrt's
ops.conv2d (im2col and products, docs/layers.md) against PyTorch CPU's conv2d, side by side.

Each layer runs forward, then backward with a fixed gradient (x, weight and bias all get one),
in interleaved rounds: each round times blockrt and PyTorch in turn (the same machine load),
and the table shows each one's best round and the median of the per-round ratios. Two threads
everywhere (OMP / OPENBLAS / MKL_NUM_THREADS and torch.set_num_threads(2); OMP_NUM_THREADS=1
in the environment for one). Prints the CPU,
the libraries, the machine's load average (these machines are shared: a busy one slows both
sides, but not equally) and a Markdown table for BENCHMARKS.md.

Run: [OMP_NUM_THREADS=1] python benchmarks/bench_conv.py [--quick] [--rounds 15] [--batch 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import timeit
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "2")  # NOTE: before NumPy or PyTorch loads a BLAS
os.environ.setdefault("OPENBLAS_NUM_THREADS", os.environ["OMP_NUM_THREADS"])
os.environ.setdefault("MKL_NUM_THREADS", os.environ["OMP_NUM_THREADS"])

import numpy as np

import backends
import runtime
from runtime import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import blas_name, cpu_name, versions

#: Threads of every BLAS and of PyTorch (OMP_NUM_THREADS, 2 unless set)
THREADS = int(os.environ["OMP_NUM_THREADS"])

#: (name, in channels, out channels, kernel, stride, padding, input size): ResNet-50's
#: distinct conv shapes, stem to the last stage
LAYERS = [
    ("conv1 7x7/2, 3->64", 3, 64, 7, 2, 3, 224),
    ("1x1, 64->64", 64, 64, 1, 1, 0, 56),
    ("3x3, 64->64", 64, 64, 3, 1, 1, 56),
    ("1x1, 64->256", 64, 256, 1, 1, 0, 56),
    ("3x3/2, 128->128", 128, 128, 3, 2, 1, 56),
    ("3x3, 256->256", 256, 256, 3, 1, 1, 14),
    ("1x1, 2048->512", 2048, 512, 1, 1, 0, 7),
]

#: (name, kind, channels, input size, kernel, stride, padding): ResNet-50's pools (its last
#: is an adaptive average over the 7x7 map)
POOLS = [
    ("max pool 3x3/2, padding 1", "max", 64, 112, 3, 2, 1),
    ("avg pool 7x7", "avg", 2048, 7, 7, 1, 0),
]


def blockrt_step(x: np.ndarray, w: np.ndarray, b: np.ndarray, g: np.ndarray, stride: int,
                 padding: int) -> Callable[[], None]:
    """Forward and backward of one conv layer in blockrt."""
    tx = runtime.tensor(x, requires_grad=True)
    tw = runtime.tensor(w, requires_grad=True)
    tb = runtime.tensor(b, requires_grad=True)
    tg = runtime.tensor(g)

    def step() -> None:
        y = ops.conv2d(tx, tw, tb, stride, padding)
        y.backward(tg)
        tx.grad = tw.grad = tb.grad = None

    return step


def pool_steps(torch, kind: str, x: np.ndarray, kernel: int, stride: int,
               padding: int) -> dict[str, Callable[[], None]]:
    """Forward and backward of a pool in blockrt and in PyTorch."""
    ours, theirs = getattr(ops, f"{kind}_pool2d"), getattr(torch.nn.functional, f"{kind}_pool2d")
    out = (x.shape[2] + 2 * padding - kernel) // stride + 1
    g = np.random.default_rng(1).standard_normal((*x.shape[:2], out, out)).astype(np.float32)
    mx, mg = runtime.tensor(x, requires_grad=True), runtime.tensor(g)
    tx, tg = torch.tensor(x, requires_grad=True), torch.tensor(g)

    def blockrt() -> None:
        ours(mx, kernel, stride, padding).backward(mg)
        mx.grad = None

    def pytorch() -> None:
        theirs(tx, kernel, stride, padding).backward(tg)
        tx.grad = None

    return {"blockrt": blockrt, "torch": pytorch}


def whole_batch(step: Callable[[], None]) -> Callable[[], None]:
    """`step` with every convolution in one piece, the whole batch (before Note [convolution
    in pieces of images] in runtime/ops.py)."""

    def run() -> None:
        pieces = ops.CONV_PIECE_BYTES
        ops.CONV_PIECE_BYTES = 1 << 62
        try:
            step()
        finally:
            ops.CONV_PIECE_BYTES = pieces

    return run


def composed(step: Callable[[], None]) -> Callable[[], None]:
    """`step` on the CPU device with `conv_columns` off: the columns made of a padded copy and
    one strided copy, x's gradient of window adds into a padded tensor (wide rows where they
    apply), as before the C im2col and col2im (what a device without them runs)."""
    device = backends.get_device("cpu")
    off = dataclasses.replace(device.capabilities, conv_columns=False)

    def run() -> None:
        saved = device.capabilities
        device.capabilities = off
        try:
            step()
        finally:
            device.capabilities = saved

    return run


def torch_step(torch, x: np.ndarray, w: np.ndarray, b: np.ndarray, g: np.ndarray, stride: int,
               padding: int) -> Callable[[], None]:
    """The same in PyTorch."""
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(w, requires_grad=True)
    tb = torch.tensor(b, requires_grad=True)
    tg = torch.tensor(g)

    def step() -> None:
        y = torch.nn.functional.conv2d(tx, tw, tb, stride, padding)
        y.backward(tg)
        tx.grad = tw.grad = tb.grad = None

    return step


def measure(contenders: dict[str, Callable[[], None]], number: int,
            rounds: int) -> dict[str, list[float]]:
    """Milliseconds per call of each contender in each round (interleaved, after a warm-up)."""
    for fn in contenders.values():
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(timeit.timeit(fn, number=number) / number * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for smoke runs)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    rounds = 3 if args.quick else args.rounds
    print(f"Convolution forward + backward, batch {args.batch}, on {cpu_name()}; "
          f"{versions()}, PyTorch {torch.__version__}; {THREADS} threads; blockrt's products "
          f"on {blas_name()}; best of {rounds} interleaved rounds, "
          f"{datetime.date.today().isoformat()}; load average before: {load()}")
    print()
    print("| layer | input | pieces | blockrt (ms) | whole batch (ms) | composed columns (ms) | "
          "PyTorch (ms) | blockrt / PyTorch (median of rounds) | blockrt / whole batch | "
          "blockrt / composed |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    total = {"blockrt": 0.0, "torch": 0.0, "whole": 0.0, "composed": 0.0}
    cpu = backends.get_device("cpu")
    for name, c, o, k, s, p, size in LAYERS:
        x = rng.standard_normal((args.batch, c, size, size)).astype(np.float32)
        w = (rng.standard_normal((o, c, k, k)) / np.sqrt(c * k * k)).astype(np.float32)
        b = rng.standard_normal(o).astype(np.float32)
        out = (size + 2 * p - k) // s + 1
        g = rng.standard_normal((args.batch, o, out, out)).astype(np.float32)
        step = blockrt_step(x, w, b, g, s, p)
        pieces = len(ops._conv_pieces(x.shape, ops._geometry("conv2d", x.shape, (k, k), (s, s),
                                                            (p, p)), x.itemsize, cpu))
        contenders = {"blockrt": step, "torch": torch_step(torch, x, w, b, g, s, p)}
        if pieces > 1:
            contenders["whole"] = whole_batch(step)
        columns = k > 1 and cpu.capabilities.conv_columns  # NOTE: a 1x1 layer makes none
        if columns:
            contenders["composed"] = composed(step)
        times = measure(contenders, 1, rounds)
        best = {key: min(values) for key, values in times.items()}
        ratio = statistics.median(a / b for a, b in zip(times["blockrt"], times["torch"]))
        total["blockrt"] += best["blockrt"]
        total["torch"] += best["torch"]
        total["whole"] += best.get("whole", best["blockrt"])
        total["composed"] += best.get("composed", best["blockrt"])
        cells = {}
        for key in ("whole", "composed"):
            cells[key] = ("", "")
            if key in times:
                pairs = zip(times["blockrt"], times[key])
                cells[key] = (f"{best[key]:.1f}",
                              f"{statistics.median(a / b for a, b in pairs):.2f}")
        print(f"| {name} | {args.batch}x{c}x{size}x{size} | {pieces} | {best['blockrt']:.1f} | "
              f"{cells['whole'][0]} | {cells['composed'][0]} | {best['torch']:.1f} | "
              f"{ratio:.2f} | {cells['whole'][1]} | {cells['composed'][1]} |", flush=True)
    print(f"| all seven (sum of bests) | | | {total['blockrt']:.1f} | {total['whole']:.1f} | "
          f"{total['composed']:.1f} | {total['torch']:.1f} | "
          f"{total['blockrt'] / total['torch']:.2f} | {total['blockrt'] / total['whole']:.2f} | "
          f"{total['blockrt'] / total['composed']:.2f} |")
    for name, kind, c, size, k, s, p in POOLS:
        x = rng.standard_normal((args.batch, c, size, size)).astype(np.float32)
        times = measure(pool_steps(torch, kind, x, k, s, p), 1, rounds)
        best = {key: min(values) for key, values in times.items()}
        ratio = statistics.median(a / b for a, b in zip(times["blockrt"], times["torch"]))
        print(f"| {name} | {args.batch}x{c}x{size}x{size} | | {best['blockrt']:.1f} | | | "
              f"{best['torch']:.1f} | {ratio:.2f} | | |", flush=True)
    print(f"\nload average after: {load()}")


def load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


if __name__ == "__main__":
    main()
