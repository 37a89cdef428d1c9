"""Static memory planner: planned arena / lower bound on synthetic schedules, and planning time.

Cases (all seeded, so every run plans the same lifetimes):
- `chain`: op i writes buffer i and op i+1 reads it; sizes log-uniform 1 KiB .. 4 MiB.
- `chain-skip`: the same, but a buffer is read by the next one or two ops (lives 2-3 ops).
- `dag`: each op writes one buffer (sometimes two) and reads one to three earlier ones, mostly
  recent and one read in ten up to 64 buffers back (a skip connection); sizes drawn from a few
  dozen "shapes". `dag-wide`: the same, but those reads go back to any earlier buffer, so many
  buffers live long (harder than real networks).
- `mlp-train`: forward, loss and backward of an MLP, batch x width float32 activations kept until
  their backward use, short-lived gradients; `-fused` updates each weight as soon as its gradient
  exists, `-step` keeps all weight gradients until one optimizer step at the end. With 830
  layers (about 5,000 buffers) the saved activations are all live together at the turn: millions
  of conflicting pairs (issue 19).
- `dense`: about 5,000 buffers each live between two ops drawn uniformly from a few hundred, so
  about two pairs in three conflict (8 million pairs); `dense-local` draws lifetimes of up to a
  tenth of the schedule (about a million pairs).

Columns: buffers, conflicting pairs (pairs of buffers with bytes live at a common op), naive (sum
of sizes, no reuse), the lower bound (most bytes live at one op), planned (the arena
`runtime.planner.plan` returns), planned / lower bound, and the best of a few planning times,
interleaved with those of `--baseline REF`'s planner when given (its planned / lower bound and
time, and its time over ours). Sizes are rounded to 64 bytes everywhere, as `plan` does by
default. The header names the CPU, the software and the load the planning times were measured
with (no products run here).

Run: python benchmarks/bench_planner.py [--quick] [--match TEXT] [--baseline REF] [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import pathlib
import random
import sys
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import baseline_checkout, cpu_name, interleaved_min, versions

from runtime import planner
from runtime.planner import Lifetime

KiB = 1 << 10


def chain(n: int, seed: int, max_span: int = 1) -> list[Lifetime]:
    """Buffer i is written by op i and last read by op i + 1 .. i + max_span."""
    rng = random.Random(seed)
    return [Lifetime(i, i, i + rng.randint(1, max_span), int(KiB * 4096 ** rng.random()))
            for i in range(n)]


def dag(n_ops: int, seed: int, reach: int | None = 64) -> list[Lifetime]:
    """A random op DAG in schedule order: reads mostly recent buffers, sometimes older ones.

    One read in ten goes back up to `reach` buffers (a skip connection); `reach=None` lets it go
    back to any buffer at all, so many buffers live long: a harder case than real networks.
    """
    rng = random.Random(seed)
    shapes = [int(KiB * 2048 ** rng.random()) for _ in range(32)]
    first: list[int] = []
    last: list[int] = []
    nbytes: list[int] = []
    for op in range(n_ops):
        for _ in range(rng.randint(1, 3) if first else 0):
            if rng.random() < 0.9:  # a recent buffer
                j = max(0, len(first) - 1 - int(rng.expovariate(0.5)))
            elif reach is None:  # from anywhere before
                j = rng.randrange(len(first))
            else:  # a skip connection
                j = max(0, len(first) - 1 - rng.randrange(reach))
            last[j] = max(last[j], op)
        for _ in range(2 if rng.random() < 0.1 else 1):
            first.append(op)
            last.append(op)
            nbytes.append(rng.choice(shapes))
    return [Lifetime(i, f, la, b) for i, (f, la, b) in enumerate(zip(first, last, nbytes))]


def dense(n: int, n_ops: int, seed: int, reach: int | None = None) -> list[Lifetime]:
    """`n` buffers, each live from a uniformly drawn op to another one at most `reach` ops later
    (`None`: anywhere in the schedule); sizes log-uniform 1 KiB .. 4 MiB."""
    rng = random.Random(seed)
    result = []
    for i in range(n):
        if reach is None:
            first, last = sorted((rng.randrange(n_ops), rng.randrange(n_ops)))
        else:
            first = rng.randrange(n_ops)
            last = min(n_ops - 1, first + rng.randrange(reach + 1))
        result.append(Lifetime(i, first, last, int(KiB * 4096 ** rng.random())))
    return result


def conflicting_pairs(lifetimes: list[Lifetime]) -> int:
    """Pairs of buffers with bytes that are live at a common op (counted, not listed)."""
    first = np.array([lt.first for lt in lifetimes if lt.nbytes], dtype=np.int64)
    last = np.array([lt.last for lt in lifetimes if lt.nbytes], dtype=np.int64)
    # each buffer is live with those starting by its last op, less those ending before its
    # first op, less itself; each pair is seen from both ends
    live_with = (np.searchsorted(np.sort(first), last, side="right")
                 - np.searchsorted(np.sort(last), first, side="left") - 1)
    return int(live_with.sum()) // 2


def mlp_train(batch: int, widths: list[int], fused_update: bool) -> list[Lifetime]:
    """Lifetimes of one MLP training step (Dense + ReLU layers, softmax cross-entropy)."""
    spans: dict[str, list[int]] = {}  # name -> [first, last, nbytes]
    op = 0

    def write(name: str, nbytes: int) -> None:
        spans[name] = [op, op, nbytes]

    def read(*names: str) -> None:
        for name in names:
            spans[name][1] = op

    def step() -> None:
        nonlocal op
        op += 1

    # Forward: z = a @ W (+ b), a' = relu(z); z and the input a are saved for backward.
    depth = len(widths) - 1
    for layer in range(depth):
        if layer > 0:
            read(f"a{layer}")
        write(f"z{layer + 1}", batch * widths[layer + 1] * 4)
        step()
        read(f"z{layer + 1}")
        write(f"a{layer + 1}", batch * widths[layer + 1] * 4)
        step()
    read(f"a{depth}")
    write("loss", 4)
    write("dlogits", batch * widths[-1] * 4)
    step()
    read("loss")
    step()
    # Backward: dz = da * (z > 0); dW = a^T dz; db = sum(dz); da_prev = dz @ W^T.
    grad = "dlogits"
    for layer in range(depth, 0, -1):
        read(grad, f"z{layer}")
        write(f"dz{layer}", batch * widths[layer] * 4)
        step()
        if layer > 1:
            read(f"a{layer - 1}")
        read(f"dz{layer}")
        write(f"dW{layer}", widths[layer - 1] * widths[layer] * 4)
        step()
        read(f"dz{layer}")
        write(f"db{layer}", widths[layer] * 4)
        step()
        if fused_update:
            read(f"dW{layer}", f"db{layer}")
            step()
        if layer > 1:
            read(f"dz{layer}")
            write(f"da{layer - 1}", batch * widths[layer - 1] * 4)
            step()
            grad = f"da{layer - 1}"
    if not fused_update:
        for layer in range(1, depth + 1):
            read(f"dW{layer}", f"db{layer}")
            step()
    return [Lifetime(name, f, la, b) for name, (f, la, b) in spans.items()]


def suite(quick: bool) -> list[tuple[str, Callable[[], list[Lifetime]]]]:
    sizes = (50, 500) if quick else (50, 200, 1000, 2000)
    seeds = (0,) if quick else (0, 1, 2)
    cases: list[tuple[str, Callable[[], list[Lifetime]]]] = []
    for n in sizes:
        for seed in seeds:
            cases.append((f"chain n={n} seed={seed}", lambda n=n, s=seed: chain(n, s)))
            cases.append((f"chain-skip n={n} seed={seed}",
                          lambda n=n, s=seed: chain(n, s, max_span=2)))
            cases.append((f"dag ops={n} seed={seed}", lambda n=n, s=seed: dag(n, s)))
            cases.append((f"dag-wide ops={n} seed={seed}",
                          lambda n=n, s=seed: dag(n, s, reach=None)))
    for batch, width, depth in ((64, 256, 8), (256, 1024, 4), (128, 512, 32)):
        widths = [784] + [width] * depth + [10]
        for fused in (True, False):
            name = f"mlp-train-{'fused' if fused else 'step'} b={batch} w={width} d={depth}"
            cases.append((name, lambda b=batch, w=widths, f=fused: mlp_train(b, w, f)))
    # Dense schedules of about 5,000 buffers (issue 19): millions of conflicting pairs.
    cases.append(("dense n=5000 ops=300 seed=0", lambda: dense(5000, 300, 0)))
    if not quick:
        cases.append(("dense-local n=5000 ops=300 seed=0", lambda: dense(5000, 300, 0, 30)))
        for fused in (True, False):
            name = f"mlp-train-{'fused' if fused else 'step'} b=64 w=256 d=830"
            widths = [784] + [256] * 830 + [10]
            cases.append((name, lambda w=widths, f=fused: mlp_train(64, w, f)))
    return cases


def load_planner(tree: pathlib.Path) -> ModuleType:
    """The planner module of another checkout, imported beside ours under its own name."""
    path = tree / "runtime" / "planner.py"
    if not path.exists():
        raise SystemExit(f"the baseline has no {path.relative_to(tree)}")
    spec = importlib.util.spec_from_file_location("baseline_planner", path)
    module = importlib.util.module_from_spec(spec)
    # NOTE: dataclasses look the module up in sys.modules while a class is made
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def timed(module: ModuleType, lifetimes: list) -> Callable[[], float]:
    """A measure for interleaved_min: seconds to plan `lifetimes` with `module`'s planner."""
    def measure() -> float:
        start = time.perf_counter()
        module.plan(lifetimes)
        return time.perf_counter() - start
    return measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    parser.add_argument("--match", default="", help="only the cases whose name contains this")
    parser.add_argument("--baseline", metavar="REF", help="also plan every case with the planner "
                        "of this commit, checked out beside this one, timed in turn with ours")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds, the "
                        "best kept (default 3)")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        base = None
        if args.baseline:
            base = load_planner(stack.enter_context(baseline_checkout(args.baseline)))
        print(f"planner on {cpu_name()}; {versions()}; 1-minute load average "
              f"{os.getloadavg()[0]:.2f} at the start\n")
        extra = (f" | {args.baseline} planned / lower bound | {args.baseline} time (ms) "
                 f"| {args.baseline} time / time" if base else "")
        print("| case | buffers | conflicting pairs | naive | lower bound | planned "
              f"| planned / lower bound | planning time (ms){extra} |")
        print("|---|---:|---:|---:|---:|---:|---:|---:" + ("|---:|---:|---:|" if base else "|"))
        worst = {"ours": 1.0, "base": 1.0}
        for name, make in suite(args.quick):
            if args.match not in name:
                continue
            lifetimes = make()
            result = planner.plan(lifetimes)
            result.check_invariants(lifetimes)
            ratio = result.planned_bytes / result.lower_bound_bytes
            worst["ours"] = max(worst["ours"], ratio)
            measures = {"ours": timed(planner, lifetimes)}
            row = (f"| {name} | {len(lifetimes)} | {conflicting_pairs(lifetimes)} "
                   f"| {result.naive_bytes} | {result.lower_bound_bytes} "
                   f"| {result.planned_bytes} | {ratio:.4f} ")
            if base:
                theirs = [base.Lifetime(lt.key, lt.first, lt.last, lt.nbytes)
                          for lt in lifetimes]
                base_result = base.plan(theirs)
                base_ratio = base_result.planned_bytes / base_result.lower_bound_bytes
                worst["base"] = max(worst["base"], base_ratio)
                measures["base"] = timed(base, theirs)
            best = interleaved_min(measures, args.rounds)
            row += f"| {best['ours'] * 1e3:.1f} "
            if base:
                row += (f"| {base_ratio:.4f} | {best['base'] * 1e3:.1f} "
                        f"| {best['base'] / best['ours']:.2f} ")
            print(row + "|", flush=True)
        print(f"\nworst planned / lower bound: {worst['ours']:.4f}"
              + (f" ({args.baseline}: {worst['base']:.4f})" if base else "")
              + f"; 1-minute load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
