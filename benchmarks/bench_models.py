"""The seeds' tables on blockrt: ResNet-50 and a BERT-base-shaped encoder, peak memory and step
time of blockrt eager, its memory plans and budgets, against PyTorch eager, in one run.

SINGA (seed 003) cut ResNet-50's peak memory by 32-34% with its buffered graph at 1.03x the
time; Graphcore (seed 001) reports 2-3x from liveness-based reuse and about 4x from
recomputation. The networks and the training step are benchmarks/model_zoo.py's (ResNet-50 at
batch 4, 224x224, 1000 classes; the encoder at 12 layers, width 768, sequence 128, batch 4;
softmax cross-entropy, plain SGD lr 0.01, so no optimizer state: every byte above the
parameters and inputs is the step's own). Every contender starts from the same weights
(blockrt's, copied into PyTorch through state_dict) and runs the same fixed batch.

Contenders: PyTorch eager; blockrt eager; `runtime.graph(step, plan=...)` for "recycle" and
"static"; the static plan with checkpoint="pointwise" (Note [pointwise recompute]); the static
plan under `memory_budget` at half and a quarter of the static step's
peak and at the least any choice reaches (`BudgetError.least_bytes`).

Peak: the most bytes allocated at once during one step above what was allocated before it.
blockrt: every allocation of the contender (its parameters, the graph, eager temporaries) goes
through a StatisticsAdaptor over a direct allocator, the device's default while it runs; the
peak over its first step (a graph's capture runs the step once on its plan) less the bytes
allocated before the step (parameters) and what the graph holds outside its plan (its input
copies, the loss). PyTorch: the CPU allocator's allocations and frees as torch.profiler records
them in one warm step (bench_budget.torch_peak). Activations: what the plan keeps from forward
to backward (`memory_report()["activation_bytes"]`; PyTorch's is not reported). Time: the
fastest of `--steps` steps after the first; the contenders run one after another, PyTorch first
and again last, so a change of the machine's speed shows as two PyTorch times (2 threads
everywhere; these machines are shared and noisy).

With --interleaved ROUNDS, PyTorch eager, the static plan and the static plan under each
--budgets point are also timed side by side in one process, every contender once a round
(PyTorch first in even rounds, last in odd ones): the medians of the per-round ratios are the
figures to compare, since the sequential times carry the load of their own minute.

Run: python benchmarks/bench_models.py [--quick] [--models resnet50,bert] [--steps N]
                                       [--budgets MIB,...] [--interleaved ROUNDS]
                                       [--json PATH] [--plot PNG]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# NOTE: before NumPy loads its BLAS
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_budget import torch_peak
from model_zoo import (
    blockrt_encoder,
    blockrt_resnet50,
    copy_weights,
    torch_encoder,
    torch_resnet50,
)
from timing import cpu_name

import allocators
import runtime
from allocators import StatisticsAdaptor, format_bytes
from runtime import nn

LR = 0.01


@dataclass
class Model:
    """A network of the zoo, at a size, with its fixed batch."""

    name: str
    make_blockrt: Callable[[], nn.Module]
    make_torch: Callable[[], Any]
    x: np.ndarray
    labels: np.ndarray
    shape: str


@dataclass
class Result:
    contender: str
    peak: int
    step_s: float
    activations: int | None = None
    report: dict = field(default_factory=dict)
    #: a graph's most bytes at a scheduled step (what a budget counts)
    top: int = 0


def models(quick: bool) -> list[Model]:
    rng = np.random.default_rng(0)
    batch, side = (2, 64) if quick else (4, 224)
    layers, sequence = (2, 32) if quick else (12, 128)
    return [
        Model("resnet50", blockrt_resnet50, torch_resnet50,
              rng.standard_normal((batch, 3, side, side), dtype=np.float32),
              rng.integers(0, 1000, batch), f"batch {batch}, {side}x{side}"),
        Model("bert", lambda: blockrt_encoder(layers), lambda: torch_encoder(layers),
              rng.standard_normal((batch, sequence, 768), dtype=np.float32),
              rng.integers(0, 2, batch), f"{layers} layers, width 768, sequence {sequence}, "
                                         f"batch {batch}"),
    ]


def timed(step: Callable[[], Any], steps: int) -> float:
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best


def torch_step(model: Model, weights: nn.Module) -> Callable[[], float]:
    """PyTorch's training step from blockrt's `weights` (SGD, 2 threads), run once: warm."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(2)
    twin = model.make_torch()
    copy_weights(weights, twin)
    opt = torch.optim.SGD(twin.parameters(), lr=LR)
    x, y = torch.from_numpy(model.x), torch.from_numpy(model.labels)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(twin(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    step()
    return step


def blockrt_step(model: Model, weights: nn.Module) -> tuple[nn.Module, Callable[..., Any]]:
    """A new copy of the network holding `weights`, and its training step (SGD)."""
    net = model.make_blockrt()
    net.load_state_dict(weights.state_dict())
    return net, nn.train_step(net, nn.SGD(net.parameters(), lr=LR))


def run_torch(model: Model, weights: nn.Module, steps: int) -> Result:
    step = torch_step(model, weights)  # NOTE: warm: the profiler's peak is a later step's
    peak = torch_peak(step)
    return Result("PyTorch eager", peak, timed(step, steps))


def run_blockrt(model: Model, weights: nn.Module, steps: int, contender: str,
                **options: Any) -> Result:
    """One blockrt contender: eager (`options` None) or a graph with `options`."""
    stats = StatisticsAdaptor(allocators.create("direct", "cpu"))
    previous = runtime.get_default_allocator("cpu")
    runtime.set_default_allocator(stats, "cpu")
    try:
        net, train = blockrt_step(model, weights)
        x = runtime.tensor(model.x)
        before = stats.stats()["allocated_bytes"]
        if contender == "blockrt eager":
            train(x, model.labels).item()
            peak = stats.stats()["peak_allocated_bytes"] - before
            return Result(contender, peak, timed(lambda: train(x, model.labels).item(), steps))
        graph = runtime.graph(train, allocator=stats, **options)
        graph(x, model.labels).item()
        capture = graph._last
        # NOTE: what the graph holds outside its plan and made in the step (its input copies,
        # the loss); the module's state was there before
        state = {id(t.block) for t in net.state_dict().values()}
        held = {id(b): b for b in [h.block for h in capture.placeholders if h is not None]
                + [b for b in capture.outside if b._allocation is not None
                   and b.allocator is stats and id(b) not in state]}
        peak = (stats.stats()["peak_allocated_bytes"] - before
                - sum(b._allocation.size for b in held.values()))
        report = graph.memory_report()
        result = Result(contender, peak, timed(lambda: graph(x, model.labels).item(), steps),
                        report.get("activation_bytes"), report)
        result.top = max(graph.timeline())
        graph.release()
        return result
    finally:
        runtime.set_default_allocator(previous, "cpu")
        gc.collect()


def least_budget(model: Model, weights: nn.Module) -> int:
    """The least bytes any choice of the static plan reaches."""
    graph = runtime.graph(blockrt_step(model, weights)[1], memory_budget=0)
    try:
        graph(runtime.tensor(model.x), model.labels)
    except runtime.BudgetError as error:
        return error.least_bytes
    raise AssertionError("a budget of 0 bytes was met")


def measure(model: Model, steps: int, budgets: list[int] | None = None) -> list[Result]:
    nn.manual_seed(0)
    weights = model.make_blockrt()
    results = [run_torch(model, weights, steps),
               run_blockrt(model, weights, steps, "blockrt eager"),
               run_blockrt(model, weights, steps, 'plan="recycle"', plan="recycle"),
               run_blockrt(model, weights, steps, 'plan="static"', plan="static")]
    top = results[-1].top
    results.append(run_blockrt(model, weights, steps, 'checkpoint="pointwise"', plan="static",
                               checkpoint="pointwise"))
    if budgets is None:
        least = least_budget(model, weights)
        budgets = [max(least, top // 2), max(least, top // 4), least]
    for budget in sorted(set(budgets), reverse=True):
        try:
            results.append(run_blockrt(model, weights, steps, f"budget {format_bytes(budget)}",
                                       plan="static", memory_budget=budget))
        except runtime.BudgetError as error:
            print(f"{model.name}: budget {format_bytes(budget)} skipped, below the least "
                  f"any choice reaches ({format_bytes(error.least_bytes)})")
    again = run_torch(model, weights, steps)
    again.contender = "PyTorch eager, again"
    results.append(again)
    return results


def interleaved(model: Model, rounds: int, budgets: list[int]) -> dict[str, list[float]]:
    """Step times of PyTorch eager, the static plan and the static plan under each budget, all
    in this process, in `rounds` rounds that each run every contender once: PyTorch first in
    even rounds and last in odd ones, so that the machine's speed of the moment falls on all
    of them alike."""
    nn.manual_seed(0)
    weights = model.make_blockrt()
    steps = {"PyTorch eager": torch_step(model, weights)}
    x = runtime.tensor(model.x)
    configs = [('plan="static"', {})] + [(f"budget {format_bytes(b)}", {"memory_budget": b})
                                        for b in sorted(set(budgets), reverse=True)]
    for label, options in configs:
        graph = runtime.graph(blockrt_step(model, weights)[1], plan="static", **options)
        graph(x, model.labels).item()  # NOTE: the capture
        steps[label] = lambda graph=graph: graph(x, model.labels).item()
    times: dict[str, list[float]] = {label: [] for label in steps}
    order = list(steps.items())
    for r in range(rounds):
        for label, step in (order if r % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            step()
            times[label].append(time.perf_counter() - start)
    return times


def interleaved_table(model: Model, times: dict[str, list[float]]) -> str:
    """Best and median step of each contender, and the medians over rounds of its step's
    ratio to PyTorch's and to the static plan's in the same round."""
    def ratio(label: str, to: str) -> float:
        return statistics.median(a / b for a, b in zip(times[label], times[to]))

    lines = [f"{model.name} ({model.shape}), {len(times['PyTorch eager'])} interleaved rounds:",
             "", "| contender | best (s) | median (s) | / PyTorch (median of rounds) | "
             "/ static |", "|---|---:|---:|---:|---:|"]
    static = 'plan="static"'
    for label, values in times.items():
        lines.append(f"| {label} | {min(values):.3f} | {statistics.median(values):.3f} | "
                     f"{ratio(label, 'PyTorch eager'):.2f} | {ratio(label, static):.2f} |")
    return "\n".join(lines)


def table(model: Model, results: list[Result]) -> str:
    torch_peak_bytes = results[0].peak
    torch_s = min(results[0].step_s, results[-1].step_s)
    static = next(r for r in results if r.contender == 'plan="static"')
    lines = [f"{model.name} ({model.shape}):", "",
             "| contender | peak | peak / PyTorch | step (s) | time / PyTorch | activations | "
             "activations / static |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        acts = format_bytes(r.activations) if r.activations is not None else ""
        ratio = (f"{static.activations / r.activations:.2f}x less"
                 if r.activations and static.activations and r is not static else "")
        lines.append(f"| {r.contender} | {format_bytes(r.peak)} | "
                     f"{r.peak / torch_peak_bytes:.2f} | {r.step_s:.3f} | "
                     f"{r.step_s / torch_s:.2f} | {acts} | {ratio} |")
    return "\n".join(lines)


def plot_timelines(model: Model, path: str) -> None:
    """The bytes held at each scheduled step of one training step of `model` under the
    recycle and static plans and the static plan with checkpoint="pointwise", and the bytes
    of the intermediates live at each step (what any placement must hold there: the seeds'
    pictures), as a PNG."""
    nn.manual_seed(0)
    weights = model.make_blockrt()
    lines = {}
    # NOTE: "none" holds every buffer apart: off the scale
    for name, options in (("recycle", {"plan": "recycle"}), ("static", {"plan": "static"}),
                          ('static, checkpoint="pointwise"',
                           {"plan": "static", "checkpoint": "pointwise"})):
        graph = runtime.graph(blockrt_step(model, weights)[1], **options)
        graph(runtime.tensor(model.x), model.labels)
        lines[name] = graph.timeline()
        if name == "static":
            lines["live intermediates"] = graph.timeline(live=True)
        graph.release()
    runtime.plot_memory_timeline(lines, path, f"{model.name} ({model.shape}): one training "
                                              f"step (SGD)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    parser.add_argument("--models", default="resnet50,bert")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per contender")
    parser.add_argument("--json", help="write every figure here too")
    parser.add_argument("--plot", metavar="PNG", help="also draw resnet50's memory timeline "
                        "under each plan here (matplotlib)")
    parser.add_argument("--interleaved", type=int, metavar="ROUNDS", help="also time PyTorch, "
                        "the static plan and each --budgets point side by side in one process, "
                        "this many rounds")
    parser.add_argument("--budgets", metavar="MIB,...", help="the memory budgets to run, in "
                        "MiB (default: half and a quarter of the static step's peak, and the "
                        "least any choice reaches)")
    args = parser.parse_args()
    budgets = None
    if args.budgets:
        try:
            budgets = [int(float(b) * 2**20) for b in args.budgets.split(",")]
        except ValueError:
            parser.error(f"--budgets: {args.budgets!r} is not a list of numbers of MiB")
    wanted = args.models.split(",")
    chosen = [m for m in models(args.quick) if m.name in wanted]
    if not chosen:
        parser.error(f"--models: none of {wanted} is resnet50 or bert")
    print(f"{cpu_name()}, 2 threads, NumPy {np.__version__}; "
          f"load {os.getloadavg()[0]:.2f}")
    records = {}
    for model in chosen:
        results = measure(model, args.steps, budgets)
        print()
        print(table(model, results))
        records[model.name] = [{k: v for k, v in r.__dict__.items() if k != "report"}
                               for r in results]
    if args.interleaved:
        for model in chosen:
            times = interleaved(model, args.interleaved, budgets or [])
            print()
            print(interleaved_table(model, times))
            records[f"{model.name} interleaved"] = times
    print(f"\nload {os.getloadavg()[0]:.2f} after")
    if args.plot:
        plot_timelines(models(args.quick)[0], args.plot)
        print(f"memory timeline written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
