"""Memory budgets (issue 19): step time against measured peak memory, blockrt and its peers.

The step is bench_graph's MLP training step (`depth` Dense(width, width) + ReLU layers, a
Dense(width, 10) classifier, softmax cross-entropy, plain SGD lr 0.01, gradients dying inside the
step) on config D (64x256x64) and on a deeper, wider one, DW (64x512x128). Contenders:

- blockrt `runtime.graph(step, memory_budget=B)` (static plan) for budgets from the
  unconstrained peak (what a budget counts: the arena and the fused chains' scratch, at the
  allocator's sizes) down to the least any choice reaches, geometrically spaced;
- blockrt `checkpoint="sqrt"` (static plan), and the unconstrained static plan;
- blockrt with `lossy="bfloat16"` (issue 20) at half and a quarter of the unconstrained peak
  and at the 8x goal's budget: a family of its own, never part of blockrt's lossless curve;
- PyTorch CPU eager, and eager with `torch.utils.checkpoint.checkpoint_sequential` over several
  segment counts (the best of them is PyTorch's curve);
- PyTorch's activation memory budget: the model under `torch.compile` (Inductor) with
  `torch._functorch.config.activation_memory_budget` from 1.0 down to 0.0 (AOTAutograd's
  partitioner chooses what to save; the loss, backward call and SGD update stay eager).

Measured peak: the most bytes allocated at once during one step above what was allocated before it
(parameters, inputs). blockrt: the graph's allocator is a StatisticsAdaptor over a direct
allocator, read after the step (its peak, less its input copies and the loss: the plan's memory
and the fused chains' scratch, which the device made outside any allocator before issue 27): the
allocator's own number, not the plan's. PyTorch: the CPU allocator's allocations and frees as
`torch.profiler` (`profile_memory=True`) records them, summed in time order (op granularity:
memory an op takes and gives back before it returns is not seen). Time: the best step of
`--rounds` interleaved rounds of 3 steps each (2 cores, shared: every contender sees the same
load). blockrt's products run on NumPy's OpenBLAS unless BLOCKRT_BLAS says otherwise (auto would
measure both libraries during the first steps, and a short run's steps would alternate between
them).

Output: a Markdown table per configuration, the peers each blockrt point beats or not, and a
PNG of the curves (`--plot`, default benchmarks/budget_pareto.png; matplotlib).

Run: python benchmarks/bench_budget.py [--quick] [--configs D,DW] [--rounds N] [--plot PATH]
[--blockrt-only]
"""

from __future__ import annotations

import argparse
import builtins
import gc
import importlib
import os
import sys
import time
import types
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
# NOTE: one library from the first step: BLOCKRT_BLAS=auto measures both on the first ~30 s of
# products, which a short run can fall inside, so its steps would alternate libraries
os.environ.setdefault("BLOCKRT_BLAS", "openblas")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_graph import training_graph
from mlp_reference import LR, MLPConfig, init_params, make_batch, make_torch
from timing import interleaved_min, machine, versions

import allocators
import backends
import runtime
from allocators import StatisticsAdaptor, format_bytes
from blockrt.models import CONFIGS as MODELS
from runtime.graph.budget import rates

CONFIGS = {"D": MODELS["D"], "DW": MLPConfig(batch=64, width=512, depth=128)}
QUICK = {"D": MLPConfig(16, 32, 16), "DW": MLPConfig(16, 64, 24)}
#: blockrt budgets per configuration, from the unconstrained peak down to the least
POINTS = 10
SEGMENTS = (2, 4, 8, 16, 32, 64)
COMPILE_BUDGETS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.0)
MIB = 2**20
#: the legend of each family in the plot
LABELS = {"blockrt": "blockrt memory_budget", "blockrt sqrt": 'blockrt checkpoint="sqrt"',
          "blockrt lossy": "blockrt memory_budget, lossy bfloat16",
          "torch": "PyTorch eager", "torch checkpoint": "PyTorch checkpoint_sequential",
          "torch.compile budget": "torch.compile activation_memory_budget"}


class Point:
    """One contender: its step, measured peak, time, and what to print about it."""

    def __init__(self, family: str, label: str, step: Callable[[], Any], peak: int,
                 notes: str = "") -> None:
        self.family, self.label, self.step, self.peak, self.notes = family, label, step, peak, notes
        self.seconds = float("inf")


# ---------------------------------------------------------------------- blockrt
#: where blockrt's graphs run (--device); the PyTorch peers run on the CPU
DEVICE = "cpu"


def blockrt_graph(config: MLPConfig, **options: Any) -> tuple[runtime.Graph, StatisticsAdaptor]:
    """bench_graph's static training graph on DEVICE, on an allocator that measures its peak."""
    stats = StatisticsAdaptor(allocators.create("direct", DEVICE))
    return training_graph(config, device=stats.device, allocator=stats, **options), stats


def measured_peak(graph: runtime.Graph, stats: StatisticsAdaptor) -> int:
    """The allocator's own peak over the steps run so far, less what the graph holds outside
    its plan (its input copies, the loss): what a budget bounds."""
    capture = graph._last
    held = {id(b): b for b in [h.block for h in capture.placeholders if h is not None]
            + [b for b in capture.outside if b._allocation is not None and b.allocator is stats]}
    return stats.stats()["peak_allocated_bytes"] - sum(b._allocation.size for b in held.values())


def plan_seconds(config: MLPConfig, budget: int | None, x: np.ndarray, y: np.ndarray,
                 **options: Any) -> float:
    """Seconds `_build` (capture's phases: rewrite, schedule, fuse, plan) takes for `budget`."""
    module = importlib.import_module("runtime.graph")  # NOTE: runtime.graph is the function
    build, spent = module._build, []

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    module._build = timed
    try:
        graph, _ = blockrt_graph(config, memory_budget=budget, **options)
        graph(x, y)
        graph.release()
    finally:
        module._build = build
    return spent[0]


def budget_point(config: MLPConfig, budget: int, x: np.ndarray, y: np.ndarray,
                 lossy: str | None = None) -> Point:
    options = {"lossy": lossy} if lossy else {}
    graph, stats = blockrt_graph(config, memory_budget=budget, **options)
    graph(x, y)
    point = Point("blockrt lossy" if lossy else "blockrt",
                  f"budget {format_bytes(budget)}" + (f", lossy {lossy}" if lossy else ""),
                  lambda g=graph: g(x, y).item(), measured_peak(graph, stats))
    point.report, point.budget = graph.memory_report(), budget
    point.plan_s = plan_seconds(config, budget, x, y, **options)
    return point


def eightfold(config: MLPConfig, activations: int, least: int, top: int, x: np.ndarray,
              y: np.ndarray, **options: Any) -> int:
    """The largest budget whose choice (under `runtime.graph`'s `options`, lossy say) holds at
    most an eighth of the unconstrained plan's activation bytes (the issue's goal point), by
    bisection over budgets."""
    low, high, found = least, top, least
    while high - low > 1024:
        middle = (low + high) // 2
        graph, _ = blockrt_graph(config, memory_budget=middle, **options)
        graph(x, y)
        if graph.memory_report()["activation_bytes"] * 8 <= activations:
            found, low = middle, middle
        else:
            high = middle
        graph.release()
    return found


def blockrt_points(config: MLPConfig, x: np.ndarray, y: np.ndarray) -> list[Point]:
    points = []
    graph, stats = blockrt_graph(config)
    graph(x, y)
    full = graph.memory_report()
    points.append(Point("blockrt", "unconstrained", lambda g=graph: g(x, y).item(),
                        measured_peak(graph, stats),
                        f"activations {format_bytes(full['activation_bytes'])}"))
    points[-1].report = full
    points[-1].plan_s = plan_seconds(config, None, x, y)
    try:
        blockrt_graph(config, memory_budget=0)[0](x, y)
    except runtime.BudgetError as error:
        least = error.least_bytes
    top = max(graph.timeline())  # NOTE: what a budget counts: the arena and the scratch
    budgets = sorted({max(least, round(top * (least / top) ** (i / (POINTS - 1))))
                      for i in range(POINTS)}, reverse=True)
    goal = eightfold(config, full["activation_bytes"], least, top, x, y)
    budgets.append(goal)
    points += [budget_point(config, budget, x, y) for budget in sorted(set(budgets),
                                                                       reverse=True)]
    # NOTE: issue 20: lossy stores (bfloat16) at three of the budgets and at their own 8x
    # point, a family of their own
    lossy_goal = eightfold(config, full["activation_bytes"], least, top, x, y, lossy="bfloat16")
    points += [budget_point(config, budget, x, y, lossy="bfloat16")
               for budget in sorted({top // 2, top // 4, goal, lossy_goal}, reverse=True)]
    graph, stats = blockrt_graph(config, checkpoint="sqrt")
    graph(x, y)
    point = Point("blockrt sqrt", 'checkpoint="sqrt"', lambda g=graph: g(x, y).item(),
                  measured_peak(graph, stats))
    point.report = graph.memory_report()
    points.append(point)
    return points


# ---------------------------------------------------------------------- PyTorch
def torch_model(config: MLPConfig) -> Any:
    """mlp_reference.make_torch's model, with the reference weights."""
    return make_torch(init_params(config), *make_batch(config)).state[0]


def torch_step(model: Any, forward: Callable[[Any], Any], x: np.ndarray, y: np.ndarray,
               in_backward: bool = True) -> Callable[[], float]:
    """make_torch's step (gradients set to None, forward, loss, backward, SGD) with `forward`.

    `in_backward`: each parameter's SGD update runs in its post-accumulate-grad hook and drops
    the gradient at once (PyTorch's optimizer-in-backward recipe), so gradients do not pile up
    until the end of backward: what a PyTorch user fitting memory does, and what blockrt's
    schedule does for every graph. Without it, every gradient is live at the end of backward
    and checkpointing cannot lower the peak."""
    import torch
    import torch.nn.functional as F

    parameters = list(model.parameters())
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)

    def update(parameter: Any) -> None:
        with torch.no_grad():
            parameter.add_(parameter.grad, alpha=-LR)
        parameter.grad = None

    if in_backward:
        for parameter in parameters:
            parameter.register_post_accumulate_grad_hook(update)

    def step() -> float:
        for parameter in parameters:
            parameter.grad = None
        loss = F.cross_entropy(forward(tx), ty)
        loss.backward()
        if not in_backward:
            for parameter in parameters:
                update(parameter)
        return loss.item()

    return step


def torch_peak(step: Callable[[], float]) -> int:
    """The most bytes the CPU allocator held at once in one step, above what it held before,
    from torch.profiler's memory records summed in time order."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def _forward(tensor: Any) -> Any:
    return model(tensor)  # noqa: F821 - `model` is the global of each copy (torch_points)


def torch_saved(model: Any, forward: Callable[[Any], Any], x: np.ndarray,
                y: np.ndarray) -> int:
    """Bytes live after the forward pass and the loss (what autograd saved for backward, and
    the loss), as torch_peak counts them: PyTorch's activation memory."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = F.cross_entropy(forward(tx), ty)
    saved = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    for parameter in model.parameters():
        parameter.grad = None
    return saved


def torch_points(config: MLPConfig, x: np.ndarray, y: np.ndarray, quick: bool) -> list[Point]:
    try:
        import torch
        from torch.utils.checkpoint import checkpoint_sequential
    except ImportError as error:
        print(f"(PyTorch not importable: {error}; its curves are left out)")
        return []
    torch.set_num_threads(2)
    points = []
    model = torch_model(config)
    step = torch_step(model, model, x, y, in_backward=False)
    step()
    points.append(Point("torch", "eager, update after backward", step, torch_peak(step)))
    model = torch_model(config)
    step = torch_step(model, model, x, y)
    step()
    points.append(Point("torch", "eager, update in backward", step, torch_peak(step)))
    points[-1].saved = torch_saved(model, model, x, y)
    for segments in SEGMENTS:
        if segments > config.depth:
            continue
        model = torch_model(config)
        step = torch_step(model, lambda t, m=model, s=segments: checkpoint_sequential(
            m, s, t, use_reentrant=False), x, y)
        step()
        points.append(Point("torch checkpoint", f"checkpoint_sequential, {segments} segments",
                            step, torch_peak(step)))
        points[-1].saved = torch_saved(model, lambda t, m=model, s=segments: checkpoint_sequential(
            m, s, t, use_reentrant=False), x, y)
    import shutil

    if shutil.which("g++") is None and shutil.which("c++") is None:
        print("(torch.compile's Inductor needs a C++ compiler: its curve is left out)")
        return points
    import torch._dynamo
    import torch._functorch.config as functorch_config

    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    for budget in COMPILE_BUDGETS[::2] if quick else COMPILE_BUDGETS:
        model = torch_model(config)
        # NOTE: a function of its own code object per budget: TorchDynamo caches compiled
        # graphs on the code object, and its guards do not see the budget
        code = _forward.__code__.replace(co_name=f"forward_{str(budget).replace('.', '_')}")
        forward = types.FunctionType(code, {"model": model, "__builtins__": builtins})
        compiled = torch.compile(forward)
        step = torch_step(model, compiled, x, y)
        start = time.perf_counter()
        with functorch_config.patch(activation_memory_budget=budget):
            try:
                step()  # NOTE: compiles, under this budget
            except Exception as error:
                print(f"(torch.compile with activation_memory_budget={budget} failed: "
                      f"{type(error).__name__}: {error})")
                continue
        compile_s = time.perf_counter() - start
        step()
        points.append(Point("torch.compile budget", f"activation_memory_budget={budget}", step,
                            torch_peak(step), f"compiled in {compile_s:.0f} s"))
        points[-1].saved = torch_saved(model, compiled, x, y)
    return points


# ---------------------------------------------------------------------- the report
def measure(points: list[Point], rounds: int) -> None:
    def best_of_three(step: Callable[[], Any]) -> Callable[[], float]:
        def run() -> float:
            fastest = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                step()
                fastest = min(fastest, time.perf_counter() - start)
            return fastest
        return run

    best = interleaved_min({i: best_of_three(p.step) for i, p in enumerate(points)}, rounds)
    for i, point in enumerate(points):
        point.seconds = best[i]


def frontier(points: list[Point], family: str) -> list[Point]:
    """`family`'s points that no other point of it beats on both peak and time."""
    mine = sorted((p for p in points if p.family.startswith(family)), key=lambda p: p.peak)
    kept: list[Point] = []
    for point in mine:
        if not kept or point.seconds < kept[-1].seconds:
            kept.append(point)
    return kept


def blockrt_time_at(points: list[Point], peak: int) -> float:
    """blockrt's best step time among its points whose measured peak is at most `peak`."""
    times = [p.seconds for p in points if p.family == "blockrt" and p.peak <= peak]
    return min(times, default=float("inf"))


def report(name: str, config: MLPConfig, points: list[Point]) -> None:
    base = next(p for p in points if p.label == "unconstrained")
    full = base.report
    print(f"\n### {name} ({config.batch}x{config.width}x{config.depth})\n")
    print("| contender | measured peak | activations | ms per step | time vs unconstrained | "
          "recompute FLOPs | kept / recomputed | plan |")
    print("|---|---|---|---|---|---|---|---|")
    for point in points:
        r = getattr(point, "report", None)
        if r is not None:
            flops = r.get("recompute_flops")
            extra = f"+{flops / r['step_flops']:.0%}" if flops else "0" if flops == 0 else ""
            act = (f"{format_bytes(r['activation_bytes'])} "
                   f"({full['activation_bytes'] / r['activation_bytes']:.2f}x less)")
            kept = f"{r['kept']} / {r['recomputed']}" + (
                f" (+{len(r['lossy'])} lossy)" if r.get("lossy") else "")
            plan = (f"{r.get('schedule', 'everything kept')}, planned in "
                    f"{point.plan_s * 1e3:.0f} ms" if hasattr(point, "plan_s") else "")
        else:
            extra = kept = ""
            saved = getattr(point, "saved", None)
            act = f"{format_bytes(saved)} saved by forward" if saved is not None else ""
            plan = point.notes
        print(f"| {point.family}: {point.label} | {format_bytes(point.peak)} | {act} | "
              f"{point.seconds * 1e3:.2f} | {point.seconds / base.seconds:.2f}x | {extra} | "
              f"{kept} | {plan} |")
    for family, kind in (("blockrt", "lossless"), ("blockrt lossy", "lossy bfloat16 stores")):
        goal = [p for p in points if p.family == family and hasattr(p, "budget")
                and p.report["activation_bytes"] * 8 <= full["activation_bytes"]]
        if goal:
            best = min(goal, key=lambda p: p.seconds)
            print(f"\nGoal point (at least 8x less activation memory), {kind}: {best.label}, "
                  f"activations {full['activation_bytes'] / best.report['activation_bytes']:.2f}x"
                  f" less, {best.seconds / base.seconds:.2f}x the unconstrained step's time")
    print("\nPeers against blockrt's curve (blockrt's best step among its points whose measured "
          "peak is at most the peer's):\n")
    print("| peer point | its peak | its ms | blockrt's ms at that peak | blockrt at or below |")
    print("|---|---|---|---|---|")
    for point in points:
        if point.family == "blockrt":
            continue
        mine = blockrt_time_at(points, point.peak)
        verdict = "yes" if mine <= point.seconds else "**no**"
        mine_text = f"{mine * 1e3:.2f}" if mine < float("inf") else "none fits"
        print(f"| {point.family}: {point.label} | {format_bytes(point.peak)} | "
              f"{point.seconds * 1e3:.2f} | {mine_text} | {verdict} |")


def plot(results: dict[str, tuple[MLPConfig, list[Point]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8),
                                squeeze=False)
    styles = {"blockrt": ("C0", "o", "-"), "blockrt sqrt": ("C4", "*", ""),
              "blockrt lossy": ("C5", "v", ""),
              "torch": ("C3", "s", ""), "torch checkpoint": ("C1", "^", "--"),
              "torch.compile budget": ("C2", "D", ":")}
    for axis, (name, (config, points)) in zip(axes[0], results.items()):
        for family, (colour, marker, line) in styles.items():
            mine = sorted((p for p in points if p.family == family), key=lambda p: p.peak)
            if not mine:
                continue
            label = LABELS[family]
            axis.plot([p.peak / MIB for p in mine], [p.seconds * 1e3 for p in mine],
                      color=colour, marker=marker, linestyle=line or "none", label=label,
                      markersize=11 if marker == "*" else 6, zorder=3 if marker == "*" else 2)
        axis.set_xscale("log")
        axis.set_xlabel("measured peak of one step (MiB, log)")
        axis.set_ylabel("ms per step (best)")
        axis.set_title(f"{name}: batch {config.batch}, width {config.width}, depth {config.depth}")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke runs)")
    parser.add_argument("--configs", default="D,DW")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--blockrt-only", action="store_true",
                        help="leave out the PyTorch peers (a quick run of blockrt's points)")
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__),
                                                        "budget_pareto.png"))
    parser.add_argument("--device", default="cpu",
                        help="where blockrt's graphs run (a GPU: with --blockrt-only)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    table = QUICK if args.quick else CONFIGS
    rounds = args.rounds or (2 if args.quick else 7)
    device = backends.get_device(DEVICE)
    print(f"memory budgets on {machine(device)}; {versions()}; 1-minute load average "
          f"{os.getloadavg()[0]:.2f} at the start")
    if not device.capabilities.host_memory:
        measured = rates(device)
        print(f"measured rates on {device.name}: {measured.per_byte * 1e12:.3g} ps per byte "
              f"moved, {measured.per_flop * 1e12:.3g} ps per flop, "
              f"{measured.per_element * 1e12:.3g} ps per element cast, "
              f"{measured.per_call * 1e6:.3g} us per call")
    results = {}
    for name in args.configs.split(","):
        config = table[name]
        x, y = make_batch(config)
        points = blockrt_points(config, x, y)
        least = min(p.budget for p in points if hasattr(p, "budget"))
        peers = [p for p in points if p.family != "blockrt"] + (
            [] if args.blockrt_only else torch_points(config, x, y, args.quick))
        # NOTE: blockrt also runs at each peer's measured peak, so the curves compare there
        extra = sorted({p.peak for p in peers if least <= p.peak < points[0].peak
                        and p.family != "blockrt lossy"}, reverse=True)
        points += [budget_point(config, budget, x, y) for budget in extra]
        points = sorted((p for p in points if p.family == "blockrt"),
                        key=lambda p: -p.peak) + peers
        measure(points, rounds)
        report(name, config, points)
        results[name] = (config, points)
    print(f"\n1-minute load average {os.getloadavg()[0]:.2f} at the end")
    if args.plot:
        try:
            plot(results, args.plot)
        except ImportError as error:
            print(f"(no plot: matplotlib is not importable: {error})")


if __name__ == "__main__":
    main()
