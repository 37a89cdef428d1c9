"""Issue 31's table in one call: the MLP training step on a GPU, PyTorch eager, PyTorch's step
captured as a CUDA graph, blockrt eager, blockrt static (replayed as one CUDA graph, as
`runtime.graph` does on CUDA) and blockrt static launch by launch (`device_graph=False`), in
float32 and in mixed bfloat16, with the device memory each step occupies (`.ci/cuda-bench` runs
it; GPU time is short).

The model and step are benchmarks/mlp_reference.py's (`depth` hidden Dense layers of `width`
with ReLU, a Dense classifier to 10 classes, softmax cross-entropy, plain SGD lr 0.01), every
contender from the same weights (`init_params`) on the same batch. Mixed bfloat16: blockrt's
`nn.train_step(..., precision="bfloat16")` (the forward pass and loss under
`amp.autocast`, float32 masters, no scaler), PyTorch's forward and loss under
`torch.autocast(device, torch.bfloat16)`.

PyTorch's CUDA graph: the whole step (forward, loss, backward, the SGD update) captured once
with `torch.cuda.graph` after warm-up steps on a side stream, the gradients set to None before
the capture so that its backward writes them (PyTorch's whole-network capture recipe), then
replayed; each replay reads the batch from the captured input tensors.

Time: ms per step, the contenders of one config and precision in one process (a fresh one each
on CUDA, so that a kernel error in one contender cannot end the other figures), each built and
warmed up in turn, then timed in rounds of `number` steps each followed by the device's
synchronize, the order rotated every round; the median over rounds of each contender's round
time per step. Memory (`--memory S,L`, CUDA only): each contender in a fresh
process, the driver's view (`cudaMemGetInfo`: total less free, every pool included) after its
warm-up less before its model was built.

`--device cpu` runs the same harness on the CPU (no CUDA graph, no memory table): it is how CI
checks the script while no GPU is at hand; its figures are not this issue's.

`--step-times L` prints instead the time of each step of blockrt's static replay, launch by
launch (CUDA events around each), the longest first: where a step's time goes.

Run: python benchmarks/bench_cuda.py [--device cuda] [--configs S,M,L] [--rounds 5]
     [--precisions float32,bfloat16] [--memory S,L] [--json PATH] [--step-times CONFIGS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlp_reference import (
    CONFIGS,
    LR,
    ContenderUnavailable,
    blockrt_model,
    init_params,
    make_batch,
    make_torch,
)
from timing import cpu_name

#: contender name -> (framework, mode); each runs in every precision asked for
CONTENDERS = {
    "torch-eager": ("torch", "eager"),
    "torch-graph": ("torch", "graph"),
    "blockrt-eager": ("blockrt", "eager"),
    "blockrt-static": ("blockrt", "static"),
    "blockrt-launches": ("blockrt", "launches"),
}
PRECISIONS = ("float32", "bfloat16")


def steps_per_round(config: Any, device: str) -> int:
    """Steps in one timed round: about 20 ms of work at 20 TFLOP/s on a GPU (50 GFLOP/s on a
    CPU), at least 2 and at most 50."""
    rate = 20e12 if device == "cuda" else 50e9
    flops = 6 * config.batch * config.width ** 2 * (config.depth + 1)
    return max(2, min(50, int(0.02 * rate // flops)))


def torch_step(config: Any, precision: str, mode: str, device: str) -> Callable[[], Any]:
    """PyTorch's step on `device`: eager, or (`mode="graph"`, CUDA only) captured once by
    `torch.cuda.graph` and replayed."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        raise ContenderUnavailable(f"torch is not importable ({e})") from e
    if device == "cuda" and not torch.cuda.is_available():
        raise ContenderUnavailable("torch has no CUDA device here")
    if mode == "graph" and device != "cuda":
        raise ContenderUnavailable("a CUDA graph needs a CUDA device")
    # NOTE: mlp_reference's PyTorch model (its layers, the same weights), moved to `device`
    model, _, tx, tlabels = make_torch(init_params(config), *make_batch(config)).state
    model = model.to(device)
    parameters = list(model.parameters())
    tx, tlabels = tx.to(device), tlabels.to(device)
    half = None if precision == "float32" else getattr(torch, precision)

    def step() -> Any:
        if mode == "eager":
            model.zero_grad(set_to_none=True)
        if half is None:
            loss = F.cross_entropy(model(tx), tlabels)
        else:
            with torch.autocast(device, dtype=half):
                loss = F.cross_entropy(model(tx), tlabels)
        loss.backward()
        with torch.no_grad():
            for parameter in parameters:
                parameter.add_(parameter.grad, alpha=-LR)
        return loss

    if mode == "eager":
        return step
    # NOTE: PyTorch's whole-network capture: warm up on a side stream, then capture one step
    # with the gradients set to None first, so that the captured backward writes them (into
    # the graph's own pool) rather than adding to them: each replay is one whole step
    initial = [p.detach().clone() for p in parameters]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():  # NOTE: the first replay is the first step, as every contender's
        for parameter, value in zip(parameters, initial):
            parameter.copy_(value)
    graph = torch.cuda.CUDAGraph()
    model.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = step()

    def replay() -> Any:
        graph.replay()
        return loss  # NOTE: the captured loss tensor, written by each replay

    # NOTE: the graph reads and writes the model's and the batch's memory at every replay, but
    # holds no reference to them: without these, they were freed when this function returned,
    # and their memory, handed to the next tensors PyTorch made, was written by each replay
    # (an H200 run failed nll_loss's label assertion in the next contender's step)
    replay.keep = (model, parameters, tx, tlabels, step)  # type: ignore[attr-defined]

    return replay


def blockrt_step(config: Any, precision: str, mode: str, device: str) -> Callable[[], Any]:
    """blockrt's step (`nn.train_step`) on `device`, eager or captured by `runtime.graph`
    under the static plan: replayed as one device graph where the device records one
    ("static"), or launch by launch ("launches", `device_graph=False`)."""
    import backends
    import runtime
    from runtime import nn

    if device not in backends.available():
        raise ContenderUnavailable(f"blockrt has no {device!r} backend here "
                                   f"(available: {', '.join(backends.available())})")
    x, labels = make_batch(config)
    model, opt, _ = blockrt_model(init_params(config), LR, device=device)
    step = nn.train_step(model, opt, precision=precision)
    tx, tlabels = runtime.tensor(x, device=device), runtime.tensor(labels, device=device)
    if mode == "eager":
        return lambda: step(tx, tlabels)
    run = runtime.graph(step, plan="static", device=device, device_graph=mode == "static")

    def replay() -> Any:
        return run(tx, tlabels)

    replay.graph = run  # type: ignore[attr-defined]  # NOTE: for its memory_report
    return replay


def make(name: str, config: Any, precision: str, device: str) -> Callable[[], Any]:
    """The contender's step: a call that queues one training step and returns its loss (a
    tensor of either framework, read with `.item()`)."""
    framework, mode = CONTENDERS[name]
    build = torch_step if framework == "torch" else blockrt_step
    return build(config, precision, mode, device)


def losses(config: Any, precision: str, device: str, steps: int = 3
           ) -> dict[str, list[float]]:
    """Each contender's losses over `steps` steps from the same weights and batch (the ones
    that run here): every contender trains the same model the same way."""
    found = {}
    for name in CONTENDERS:
        try:
            run = make(name, config, precision, device)
        except ContenderUnavailable:
            continue
        found[name] = [float(run().item()) for _ in range(steps)]
    return found


def synchronizer(device: str) -> Callable[[], None]:
    """Waits for everything queued on `device` by either framework: blockrt's device's own
    synchronize (None on the CPU, which has no queue), and PyTorch's where it has CUDA."""
    import backends

    calls = []
    if device in backends.available() and backends.get_device(device).home_queue is not None:
        calls.append(backends.get_device(device).synchronize)
    if device == "cuda":
        try:
            import torch
            if torch.cuda.is_available():
                calls.append(torch.cuda.synchronize)
        except ImportError:
            pass

    def sync() -> None:
        for call in calls:
            call()
    return sync


def time_group(key: str, precision: str, device: str, rounds: int,
               names: list[str] | None = None) -> tuple[dict[str, float], dict[str, str]]:
    """ms per step of every contender (of `names`, default all) that runs here in one
    precision, and why the others do not. Each contender is built and warmed up in turn (a
    capture, first touches, kernel builds), then all are timed in interleaved rounds."""
    config = CONFIGS[key]
    steps: dict[str, Callable[[], Any]] = {}
    missing: dict[str, str] = {}
    sync = synchronizer(device)
    for name in names or CONTENDERS:
        label = f"{name} {precision}"
        try:
            run = make(name, config, precision, device)
        except ContenderUnavailable as e:
            missing[label] = str(e)
            continue
        except Exception as e:  # NOTE: GPU time is short: the rest still runs
            missing[label] = f"failed: {type(e).__name__}: {e}"
            continue
        try:
            for _ in range(3):
                run()
            sync()
            steps[label] = run
        except Exception as e:  # NOTE: as above
            missing[label] = f"failed in warm-up: {type(e).__name__}: {e}"
    number = steps_per_round(config, device)
    times: dict[str, list[float]] = {label: [] for label in steps}
    order = list(steps)
    for r in range(rounds if order else 0):  # NOTE: none may have run
        for label in order[r % len(order):] + order[:r % len(order)]:
            run = steps[label]
            start = time.perf_counter()
            for _ in range(number):
                run()
            sync()
            times[label].append((time.perf_counter() - start) / number * 1e3)
    return {label: statistics.median(t) for label, t in times.items()}, missing


def time_config(key: str, device: str, precisions: list[str], rounds: int
                ) -> tuple[dict[str, float], dict[str, str]]:
    """`time_group` for each precision. On CUDA each framework's contenders run in a fresh
    process of their own: an error in one contender's kernel (a device-side assert) ends its
    process's CUDA context and every later figure with it (on an H200, 2026-11-28, PyTorch's
    CUDA-graph contender wrote into freed memory, since mended: `torch_step`)."""
    groups = ([[n for n, (f, _) in CONTENDERS.items() if f == framework]
               for framework in ("torch", "blockrt")] if device == "cuda" else [list(CONTENDERS)])
    ms: dict[str, float] = {}
    missing: dict[str, str] = {}
    for precision in precisions:
        for names in groups:
            if device != "cuda":
                found, why = time_group(key, precision, device, rounds, names)
            else:
                lines, failure = _child("--time-group",
                                        f"{key},{precision},{rounds},{'+'.join(names)}", 240)
                found, why = json.loads(lines[-1]) if failure is None else (
                    {}, {f"{name} {precision}": failure for name in names})
            ms.update(found)
            missing.update(why)
    return ms, missing


def _child(option: str, value: str, timeout: float) -> tuple[list[str], str | None]:
    """This script run in a fresh process with `option value`: its output's lines, and None,
    or why it failed (the first line of its error output that names an error: a CUDA
    context's teardown prints more after it)."""
    done = subprocess.run([sys.executable, __file__, option, value], capture_output=True,
                          text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return lines, None
    errors = [line for line in done.stderr.splitlines() if "rror" in line] or [
        (done.stderr.strip().splitlines() or ["no output"])[-1]]
    return lines, f"the process failed (exit {done.returncode}): {errors[0][:200]}"


def memory_of(key: str, name: str, precision: str) -> int:
    """Device bytes one contender's step occupies, measured in this (fresh) process."""
    import cupy

    sync = synchronizer("cuda")
    cupy.cuda.Device().use()
    try:
        import torch
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")  # NOTE: both contexts exist before the baseline
    except ImportError:
        pass
    sync()
    free, total = cupy.cuda.runtime.memGetInfo()
    before = total - free
    run = make(name, CONFIGS[key], precision, "cuda")
    for _ in range(3):
        run()
    sync()
    free, total = cupy.cuda.runtime.memGetInfo()
    graph = getattr(run, "graph", None)
    if graph is not None:  # NOTE: what the recording holds of it, on a line of its own
        report = graph.memory_report()
        print(f"# device_graph: {report['device_graph']}; device_graph_bytes "
              f"{report['device_graph_bytes']}; peak_bytes {report['peak_bytes']}")
    return total - free - before


def memory_table(keys: list[str], precisions: list[str]) -> dict[str, Any]:
    names = [name for name in CONTENDERS if name != "blockrt-launches"]  # NOTE: static's plan
    print("| config | precision | " + " | ".join(names) + " |")
    print("|---|---|" + "---:|" * len(names))
    found: dict[str, Any] = {}
    notes: list[str] = []
    for key in keys:
        for precision in precisions:
            cells = []
            for name in names:
                lines, failure = _child("--measure-memory", f"{key},{name},{precision}", 180)
                if failure is None and lines[-1].isdigit():
                    found[f"{key} {name} {precision}"] = int(lines[-1])
                    cells.append(f"{int(lines[-1]) / 2**20:.0f} MiB")
                    notes.extend(f"{key} {name} {precision}: {line[2:]}" for line in lines
                                 if line.startswith("# "))
                else:
                    cells.append(f"({(failure or 'no figure')[:60]})")
            print(f"| {key} | {precision} | " + " | ".join(cells) + " |")
    for note in notes:
        print(f"- {note}")
    return found


def step_times(key: str, precision: str, device: str, rounds: int = 3
               ) -> list[tuple[float, str]]:
    """The device time of each step of blockrt's static replay of `key` in `precision`, run
    launch by launch (`device_graph=False`): (ms, what the step runs), in replay order, the
    median over `rounds` replays. On CUDA two events around each step, each step waited for:
    about 0.1 ms on an H200 is the floor of this (the host's launch between the events), so it
    shows where large kernels go, not small ones. On the CPU the wall time of each step."""
    run = blockrt_step(CONFIGS[key], precision, "launches", device)
    for _ in range(3):
        run()
    capture = run.graph._last  # NOTE: the bound steps of the last capture (a benchmark's look)
    timings: list[list[float]] = [[] for _ in capture.views]
    sync = synchronizer(device)
    if device == "cuda":
        import cupy

        stream = capture.device.stream
    for _ in range(rounds):
        sync()
        for at, thunk in enumerate(capture.views):
            if device == "cuda":
                start, end = cupy.cuda.Event(), cupy.cuda.Event()
                start.record(stream)
                thunk()
                end.record(stream)
                end.synchronize()
                timings[at].append(cupy.cuda.get_elapsed_time(start, end))
            else:
                began = time.perf_counter()
                thunk()
                timings[at].append((time.perf_counter() - began) * 1e3)
    found = []
    for times, step in zip(timings, capture.steps):
        head, last = step.instructions[0], step.instructions[-1].outputs[0]
        operands = ", ".join(f"{o.dtype.name}{list(o.shape)}" for o in head.inputs[:2])
        what = (f"{'+'.join(i.op for i in step.instructions)} ({operands}) -> "
                f"{last.dtype.name}{list(last.shape)}")
        found.append((statistics.median(times), what))
    return found


def print_step_times(keys: list[str], precisions: list[str], device: str, top: int = 12) -> None:
    for key in keys:
        for precision in precisions:
            found = step_times(key, precision, device)
            print(f"\n{key} {precision}, static launch by launch: {len(found)} steps, "
                  f"{sum(ms for ms, _ in found):.3f} ms in all; the {top} longest:")
            print("| ms | step |\n|---:|---|")
            for ms, what in sorted(found, reverse=True)[:top]:
                print(f"| {ms:.3f} | {what} |")


def gpu_name() -> str:
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        return props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    except Exception as e:
        return f"no GPU name ({type(e).__name__})"


def versions() -> str:
    parts = [f"Python {sys.version.split()[0]}"]
    for module in ("numpy", "cupy", "torch"):
        try:
            parts.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            parts.append(f"no {module}")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--configs", default="S,M,L")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--memory", default="", metavar="CONFIGS",
                        help="configs of the device-memory table, such as S,L (CUDA only; a "
                             "fresh process a cell)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument("--step-times", default="", metavar="CONFIGS",
                        help="instead of the table: each step's time in blockrt's static "
                             "replay of these configs, launch by launch (where a step's time "
                             "goes)")
    parser.add_argument("--measure-memory", help=argparse.SUPPRESS)  # NOTE: the children
    parser.add_argument("--time-group", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.time_group:
        key, precision, rounds, names = args.time_group.split(",")
        print(json.dumps(time_group(key, precision, args.device, int(rounds),
                                    names.split("+"))))
        return
    if args.measure_memory:
        key, name, precision = args.measure_memory.split(",")
        print(memory_of(key, name, precision))
        return
    keys = [k for k in args.configs.split(",") if k]
    precisions = [p for p in args.precisions.split(",") if p]
    memory = [k for k in args.memory.split(",") if k]
    steps = [k for k in args.step_times.split(",") if k]
    unknown = (sorted(set(keys + memory + steps) - set(CONFIGS))
               + sorted(set(precisions) - set(PRECISIONS)))
    if unknown:
        parser.error(f"unknown configs or precisions {unknown}: configs are "
                     f"{sorted(CONFIGS)}, precisions {list(PRECISIONS)}")
    if args.device == "cuda":
        import backends
        if "cuda" not in backends.available():
            parser.error(f"blockrt has no CUDA device here (available: "
                         f"{', '.join(backends.available())}); --device cpu checks the harness")
    where = gpu_name() if args.device == "cuda" else "the CPU"
    print(f"The MLP step on {where}; host {cpu_name()}; {versions()}; "
          f"1-minute load {os.getloadavg()[0]:.2f}")
    if args.step_times:
        print_step_times(steps, precisions, args.device)
        return
    print()
    print("| config | precision | " + " | ".join(CONTENDERS) + " | blockrt static / torch graph "
          "| blockrt static / torch eager |")  # NOTE: blockrt-launches: static, device_graph=False
    print("|---|---|" + "---:|" * (len(CONTENDERS) + 2))
    record: dict[str, Any] = {"device": args.device, "gpu": where, "host": cpu_name(),
                              "versions": versions(), "ms": {}, "missing": {}}
    for key in keys:
        ms, missing = time_config(key, args.device, precisions, args.rounds)
        record["ms"][key], record["missing"][key] = ms, missing
        for precision in precisions:
            row = [ms.get(f"{name} {precision}") for name in CONTENDERS]
            cells = [f"{v:.3f}" if v is not None else "n/a" for v in row]
            mine = ms.get(f"blockrt-static {precision}")
            ratios = [f"{mine / ms[f'torch-{m} {precision}']:.2f}"
                      if mine and f"torch-{m} {precision}" in ms else "n/a"
                      for m in ("graph", "eager")]
            print(f"| {key} | {precision} | " + " | ".join(cells + ratios) + " |")
    reasons = {why for per in record["missing"].values() for why in per.values()}
    for why in sorted(reasons):
        print(f"- not run: {why}")
    if args.memory:
        print()
        if args.device != "cuda":
            print("- the memory table is CUDA's only (the driver's view)")
        else:
            record["memory_bytes"] = memory_table(memory, precisions)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
