"""Memory of the graph runtime's plans on MLP training steps, and what checkpointing costs.

The step is the one of benchmarks/mlp_reference.py (`depth` hidden Dense layers of `width` with
ReLU, a Dense classifier to 10 classes, float32, softmax cross-entropy, plain SGD lr 0.01), written
with blockrt's nn and captured by `runtime.graph`; `opt.zero_grad()` ends the step, so gradients
are intermediates. Configurations (batch, width, depth): S = 64, 256, 8; M = 256, 1024, 4;
L = 1024, 4096, 4; D = 64, 256, 64.

Tables:
1. Bytes one training step holds beyond the model and its inputs, against what a user would run
   without blockrt's plans: PyTorch eager (when torch imports; its CPU allocator, as
   bench_budget measures it) and blockrt eager (no graph; measured through a StatisticsAdaptor),
   then the peak under each plan, "none" (the graph without reuse), "recycle", "static" and
   "static" with checkpoint="sqrt"; the static plan's lower bound; naive_bytes (every
   intermediate block its own buffer for the whole step, unfused: a figure no run reaches,
   shown only as memory_report() defines it); static against "none" and against eager.
2. Planned / lower bound over a suite: chains, these MLP training graphs with and without
   checkpointing, random DAG-shaped programs (goal <= 1.05).
3. Checkpointing on D: activation bytes (the most bytes of forward results live at once) and step
   time, static against static + sqrt, 30 interleaved rounds, best step of each and the median of
   the rounds' ratios (goal: >= 4x less activation memory at <= 1.35x step time).
4. The replay's check for freed blocks (issue 27): a replay first compares each block it reads
   or writes outside its plan with the generation it was captured at; the step's time with and
   without that check, interleaved, and the check alone.
5. The SGD fold (Note [a folded update's rounding]): the static plan with each weight update
   folded into its product, the default, against fold_updates=False: memory, whether three
   steps give eager's bits, and step time, interleaved.

Memory figures do not depend on the machine; the header names the CPU, the software, the CBLAS
the products run on and the load all the same, for the timings of table 3.

Run: python benchmarks/bench_graph.py [--quick] [--configs S,M,L,D]
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_reference import MLPConfig, blockrt_model, init_params, make_batch
from timing import blas_name, cpu_name, versions

import allocators
import runtime
from allocators import StatisticsAdaptor, format_bytes
from blockrt.models import CONFIGS
from runtime import nn, ops

QUICK = {"S": MLPConfig(16, 32, 8), "M": MLPConfig(32, 64, 4), "L": MLPConfig(64, 128, 4),
         "D": MLPConfig(16, 32, 64)}
VARIANTS = (("none", None), ("recycle", None), ("static", None), ("static", "sqrt"))


def training_graph(config: MLPConfig, plan: str = "static", device: Any = None,
                   **options: Any) -> runtime.Graph:
    """blockrt's model with the reference weights on `device`, its SGD step captured under
    `plan` (and `runtime.graph`'s other `options`)."""
    model, opt, _ = blockrt_model(init_params(config), device=device)
    return runtime.graph(nn.train_step(model, opt), plan=plan, **options)


def eager_peak(config: MLPConfig, x: np.ndarray, y: np.ndarray) -> int:
    """blockrt without a graph: the most bytes one eager training step held at once above what
    was held before it (the model, the inputs), through a StatisticsAdaptor over a direct
    allocator (nothing cached) made the default for the step."""
    stats = StatisticsAdaptor(allocators.create("direct"))
    before = runtime.get_default_allocator()
    runtime.set_default_allocator(stats)
    try:
        model, opt, _ = blockrt_model(init_params(config))
        step = nn.train_step(model, opt)
        inputs = runtime.tensor(x), runtime.tensor(y)
        held = stats.stats()["allocated_bytes"]
        step(*inputs)
        return stats.stats()["peak_allocated_bytes"] - held
    finally:
        runtime.set_default_allocator(before)


def torch_eager_peak(config: MLPConfig, x: np.ndarray, y: np.ndarray) -> int | None:
    """PyTorch CPU eager's step (bench_budget's: update after backward) measured as
    bench_budget measures it; None when torch does not import."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    from bench_budget import torch_model, torch_peak, torch_step

    model = torch_model(config)
    step = torch_step(model, model, x, y, in_backward=False)
    step()
    return torch_peak(step)


def memory_table(configs: dict[str, MLPConfig]) -> list[tuple[str, float]]:
    """Table 1; returns (case, planned / lower bound) rows for table 2."""
    print("| config | PyTorch eager | blockrt eager | none | recycle | static | static + sqrt "
          "| lower bound (static) | naive | static / none | static / eager (PyTorch, "
          "blockrt) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for name, config in configs.items():
        x, y = make_batch(config)
        torch_eager, eager = torch_eager_peak(config, x, y), eager_peak(config, x, y)
        peaks = {}
        naive = lower = 0
        for plan, checkpoint in VARIANTS:
            graph = training_graph(config, plan, checkpoint=checkpoint)
            graph(x, y)
            report = graph.memory_report()
            peaks[(plan, checkpoint)] = report["peak_bytes"]
            if plan == "static":
                ratios.append((f"MLP {name}{' sqrt' if checkpoint else ''}",
                               report["planned_bytes"] / report["lower_bound_bytes"]))
                if checkpoint is None:
                    naive, lower = report["naive_bytes"], report["lower_bound_bytes"]
            graph.release()
            del graph
            gc.collect()
            # NOTE: the caching allocator may hand the next arena a cached block up to 1 MiB
            # bigger (it keeps such leftovers whole, as PyTorch's does): each plan starts clean
            runtime.get_default_allocator().empty_cache()
        cells = [format_bytes(peaks[v]) for v in VARIANTS]
        static = peaks[("static", None)]
        against_torch = f"{static / torch_eager:.3f}" if torch_eager else "n/a"
        print(f"| {name} {config.batch}x{config.width}x{config.depth} | "
              f"{format_bytes(torch_eager) if torch_eager else 'n/a'} | {format_bytes(eager)} | "
              f"{' | '.join(cells)} | {format_bytes(lower)} | {format_bytes(naive)} | "
              f"{static / peaks[('none', None)]:.3f} | {against_torch}, {static / eager:.3f} |")
    return ratios


def chain_program(length: int, seed: int) -> tuple[runtime.Graph, np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 64, size=length)

    def fn(x: runtime.Tensor) -> runtime.Tensor:
        h = x
        for n in sizes:  # each result feeds only the next op: a chain of varied sizes
            h = ops.tanh(ops.matmul(h, runtime.constant(np.ones((h.shape[1], int(n))))))
        return ops.sum(h)

    return runtime.graph(fn, plan="static", fuse=False), rng.normal(size=(8, 16))


def dag_program(ops_count: int, seed: int) -> tuple[runtime.Graph, np.ndarray]:
    rng = np.random.default_rng(seed)
    picks = [(int(rng.integers(0, i + 1)), int(rng.integers(0, i + 1)),
              int(rng.integers(1, 9))) for i in range(ops_count)]

    def fn(x: runtime.Tensor) -> runtime.Tensor:
        values = [x]
        for a, b, rows in picks:  # random operands: long and short lifetimes, varied sizes
            left, right = values[a], values[b]
            mix_a = runtime.constant(np.full((rows, left.shape[0]), 0.5))
            mix_b = runtime.constant(np.full((rows, right.shape[0]), 0.25))
            values.append(ops.tanh(ops.add(ops.matmul(mix_a, left), ops.matmul(mix_b, right))))
        return ops.sum(values[-1])

    return runtime.graph(fn, plan="static"), rng.normal(size=(4, 32))


def suite_table(mlp_ratios: list[tuple[str, float]], quick: bool) -> None:
    rows = list(mlp_ratios)
    for length in (8, 32) if quick else (8, 64, 256):
        graph, x = chain_program(length, seed=length)
        graph(x)
        report = graph.memory_report()
        rows.append((f"chain of {length}", report["planned_bytes"] / report["lower_bound_bytes"]))
    for count in (20, 60) if quick else (50, 200, 500):
        graph, x = dag_program(count, seed=count)
        graph(x)
        report = graph.memory_report()
        rows.append((f"random DAG, {count} ops",
                     report["planned_bytes"] / report["lower_bound_bytes"]))
    print("\n| case | planned / lower bound |")
    print("|---|---|")
    for case, ratio in rows:
        print(f"| {case} | {ratio:.3f} |")
    print(f"| **worst** | **{max(r for _, r in rows):.3f}** |")


def interleaved(graphs: dict[str, runtime.Graph], x: np.ndarray, y: np.ndarray,
                rounds: int) -> dict[str, list[float]]:
    """Each graph's best of 3 steps in each of `rounds` rounds, the graphs in turn in each
    round (after two warm-up calls of each)."""
    for graph in graphs.values():
        graph(x, y)
        graph(x, y)
    per_round: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            fastest = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                graph(x, y)
                fastest = min(fastest, time.perf_counter() - start)
            per_round[name].append(fastest)
    return per_round


def checkpoint_table(config: MLPConfig, rounds: int) -> None:
    x, y = make_batch(config)
    graphs = {"static": training_graph(config),
              "static + sqrt": training_graph(config, checkpoint="sqrt")}
    per_round = interleaved(graphs, x, y, rounds)
    best = {name: min(times) for name, times in per_round.items()}
    paired = statistics.median(a / b for a, b in zip(per_round["static + sqrt"],
                                                    per_round["static"]))
    plain, sqrt = (graphs[k].memory_report() for k in graphs)
    print(f"\nCheckpointing on D ({config.batch}x{config.width}x{config.depth}), best step of "
          f"{rounds} interleaved rounds of 3 steps each (time ratio of the best steps; the median "
          f"over rounds of each round's ratio is {paired:.2f}):\n")
    print("| | activation bytes | peak bytes | recomputed ops | ms per step |")
    print("|---|---|---|---|---|")
    for name, report in (("static", plain), ("static + sqrt", sqrt)):
        print(f"| {name} | {format_bytes(report['activation_bytes'])} | "
              f"{format_bytes(report['peak_bytes'])} | {report['recompute_instructions']} | "
              f"{best[name] * 1e3:.2f} |")
    print(f"| **ratio** | **{plain['activation_bytes'] / sqrt['activation_bytes']:.2f}x less** | "
          f"{plain['peak_bytes'] / sqrt['peak_bytes']:.2f}x less | | "
          f"**{best['static + sqrt'] / best['static']:.2f}x time** |")


def fold_table(configs: dict[str, MLPConfig], rounds: int) -> None:
    """Table 5: the SGD fold (Note [a folded update's rounding]): the static plan with each
    weight update folded into its product (the default) and with fold_updates=False, side by
    side: planned and peak bytes, whether 3 steps equal eager's bits, and step time
    (interleaved rounds, best of each and the median of the rounds' ratios)."""
    print(f"\nThe SGD fold: static plan, fold_updates True (default) against False; best step "
          f"of {rounds} interleaved rounds of 3 steps each:\n")
    print("| config | folded updates | planned (fold / no fold) | peak (fold / no fold) | "
          "3 steps bit-equal to eager (fold / no fold) | ms per step (fold / no fold) | "
          "time, no fold / fold (best, median of rounds) |")
    print("|---|---|---|---|---|---|---|")
    for name, config in configs.items():
        x, y = make_batch(config)
        eager_model, eager_opt, _ = blockrt_model(init_params(config))
        eager_step = nn.train_step(eager_model, eager_opt)
        expected = [eager_step(runtime.tensor(x), runtime.tensor(y)).numpy().tobytes()
                    for _ in range(3)]
        expected += [p.numpy().tobytes() for p in eager_model.parameters()]
        graphs, equal = {}, {}
        for fold in (True, False):
            model, opt, _ = blockrt_model(init_params(config))
            graph = runtime.graph(nn.train_step(model, opt), fold_updates=fold)
            got = [graph(x, y).numpy().tobytes() for _ in range(3)]
            equal[fold] = got + [p.numpy().tobytes() for p in model.parameters()] == expected
            graphs[fold] = graph
        reports = {fold: graph.memory_report() for fold, graph in graphs.items()}
        per_round = interleaved({"fold": graphs[True], "no fold": graphs[False]}, x, y, rounds)
        best = {key: min(times) for key, times in per_round.items()}
        paired = statistics.median(a / b for a, b in zip(per_round["no fold"],
                                                        per_round["fold"]))

        pair = {key: f"{format_bytes(reports[True][key])} / {format_bytes(reports[False][key])}"
                for key in ("planned_bytes", "peak_bytes")}
        print(f"| {name} {config.batch}x{config.width}x{config.depth} | "
              f"{reports[True]['updates_folded']} | {pair['planned_bytes']} | "
              f"{pair['peak_bytes']} | {'yes' if equal[True] else 'no'} / "
              f"{'yes' if equal[False] else 'no'} | {best['fold'] * 1e3:.2f} / "
              f"{best['no fold'] * 1e3:.2f} | {best['no fold'] / best['fold']:.2f}, "
              f"{paired:.2f} |")
        for graph in graphs.values():
            graph.release()
        runtime.get_default_allocator().empty_cache()


def check_table(config: MLPConfig, rounds: int) -> None:
    """Table 4: the step with the replay's freed-block check and without it (the check swapped
    for a no-op), interleaved, best of each; and the check alone."""
    module = importlib.import_module("runtime.graph")  # NOTE: runtime.graph is the function
    check = module._check_live
    x, y = make_batch(config)
    graph = training_graph(config)
    graph(x, y)
    capture = graph._last
    calls = 10_000
    start = time.perf_counter()
    for _ in range(calls):
        check(capture)
    alone = (time.perf_counter() - start) / calls
    best = {"with the check": float("inf"), "without": float("inf")}
    try:
        for _ in range(rounds):
            for name in best:
                module._check_live = check if name == "with the check" else (lambda c: None)
                for _ in range(3):
                    start = time.perf_counter()
                    graph(x, y)
                    best[name] = min(best[name], time.perf_counter() - start)
    finally:
        module._check_live = check
    print(f"\nThe replay's freed-block check on {config.batch}x{config.width}x{config.depth} "
          f"({len(capture.outside)} blocks outside the plan), best step of {rounds} interleaved "
          f"rounds of 3 steps each: with the check {best['with the check'] * 1e3:.3f} ms, "
          f"without {best['without'] * 1e3:.3f} ms; the check alone {alone * 1e6:.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke runs)")
    parser.add_argument("--configs", default="S,M,L,D")
    args = parser.parse_args()
    table = QUICK if args.quick else CONFIGS
    configs = {name: table[name] for name in args.configs.split(",")}
    print(f"graph plans on {cpu_name()}; {versions()}; products on {blas_name()}; 1-minute load "
          f"average {os.getloadavg()[0]:.2f} at the start\n")
    ratios = memory_table(configs)
    suite_table(ratios, args.quick)
    if "D" in configs:
        checkpoint_table(configs["D"], rounds=2 if args.quick else 30)
    for config in configs.values():
        check_table(config, rounds=2 if args.quick else 30)
    fold_table(configs, rounds=2 if args.quick else 15)


if __name__ == "__main__":
    main()
