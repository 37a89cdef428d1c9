"""PyTorch CPU's ways to trade time for training memory, measured as issue 19's Pareto benchmark
needs them: step time against the peak bytes a step allocates, on the MLPs of blockrt.models.

Contenders, each a training step of `mlp_reference.make_torch`'s model (`nn.Linear` and `ReLU`,
`F.cross_entropy`, plain SGD with gradients set to None first):
- `torch`: eager, everything kept.
- `torch-in-backward`: eager, with each parameter updated as soon as its gradient is
  accumulated (a post-accumulate-grad hook, PyTorch's recipe for fusing the optimizer into
  backward), so that the weight gradients are never all held at once (on D they are 16 MiB,
  twice the activations: without this no checkpointing lowers PyTorch's peak).
- `torch-checkpoint-N`: `torch-in-backward` with `torch.utils.checkpoint.checkpoint_sequential`
  over N segments (`use_reentrant=False`, PyTorch's recommended mode), for N over `SEGMENTS`:
  the forward results inside a segment are dropped and recomputed during backward.
- `torch-compile-budget-B`: the step under `torch.compile`, with
  `torch._functorch.config.activation_memory_budget = B` (PyTorch's min-cut partitioner then
  saves only that share of the activation memory and recomputes the rest, a knapsack over
  which activations to keep), for B over `BUDGETS`.

Peak: the most bytes the step holds at once beyond what lived before it (the parameters and
the batch): the process's peak resident memory during one step less its resident memory
before, each contender in a process of its own in which glibc maps every allocation of 16 KiB
or more by itself (MALLOC_MMAP_THRESHOLD_), so that freed memory leaves at once. (PyTorch's
profiler's memory events were tried first: summed op by op they gave checkpointing with one
segment less than the weight gradients alone, so they are not used.) Step time: the fastest
of `rounds` timed steps.

Run: .venv/bin/python benchmarks/torch_budget.py [--configs D] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mlp_reference as ref
from timing import cpu_name, versions

from blockrt.models import CONFIGS, MLPConfig

#: Segment counts tried for checkpoint_sequential (1: one segment, everything recomputed once).
SEGMENTS = (1, 2, 4, 8, 16, 32)
#: activation_memory_budget values tried under torch.compile (1.0: save what the default saves).
BUDGETS = (1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.0)
#: The deeper, wider configuration of the Pareto benchmark beside D.
DEEP_WIDE = MLPConfig(batch=64, width=512, depth=96)


def _model(config: MLPConfig, in_backward: bool = False) -> tuple[Any, Any, Any, list[Any]]:
    """The model, batch, labels and parameters; with `in_backward`, each parameter is updated
    (and its gradient dropped) as soon as backward has accumulated it, through a
    post-accumulate-grad hook (PyTorch's recipe for fusing the optimizer into backward), so
    that no two weight gradients need be held at once."""
    import torch

    params = ref.init_params(config)
    x, labels = ref.make_batch(config)
    trainer = ref.make_torch(params, x, labels)
    model, parameters, tx, tlabels = trainer.state
    if in_backward:
        def update(p: Any) -> None:
            with torch.no_grad():
                p.add_(p.grad, alpha=-ref.LR)
            p.grad = None

        for p in parameters:
            p.register_post_accumulate_grad_hook(update)
    return model, tx, tlabels, parameters


def _sgd(parameters: list[Any]) -> None:
    """The update, then the gradients dropped (as the next zero_grad() would), so that nothing
    the step made outlives it and the peak is measured from the parameters and the batch."""
    import torch

    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:  # NOTE: None where a hook has updated it in backward
                p.add_(p.grad, alpha=-ref.LR)
            p.grad = None


def eager_step(config: MLPConfig, in_backward: bool = False) -> Callable[[], Any]:
    import torch.nn.functional as F

    model, tx, tlabels, parameters = _model(config, in_backward)

    def step() -> Any:
        model.zero_grad()
        loss = F.cross_entropy(model(tx), tlabels)
        loss.backward()
        _sgd(parameters)
        return loss

    return step


def checkpoint_step(config: MLPConfig, segments: int) -> Callable[[], Any]:
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint_sequential

    model, tx, tlabels, parameters = _model(config, in_backward=True)
    tx.requires_grad_(True)  # NOTE: checkpoint_sequential needs an input that wants a gradient

    def step() -> Any:
        model.zero_grad()
        out = checkpoint_sequential(model, segments, tx, use_reentrant=False)
        loss = F.cross_entropy(out, tlabels)
        loss.backward()
        _sgd(parameters)
        return loss

    return step


def compile_step(config: MLPConfig, budget: float) -> Callable[[], Any]:
    import torch
    import torch._functorch.config as functorch_config
    import torch.nn.functional as F

    model, tx, tlabels, parameters = _model(config)
    torch._dynamo.reset()
    functorch_config.activation_memory_budget = budget

    def train_step() -> Any:
        for p in parameters:
            p.grad = None
        loss = F.cross_entropy(model(tx), tlabels)
        loss.backward()
        _sgd(parameters)
        return loss

    compiled = torch.compile(train_step)
    compiled()  # compiles under this budget (the config is read at compile time)
    return compiled


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_bytes(step: Callable[[], Any]) -> int:
    """The most bytes the step holds at once beyond what lived before it: the process's peak
    resident memory during the step (VmHWM, reset first through /proc/self/clear_refs) less
    its resident memory before. Exact only where freed memory leaves the process at once:
    `main` runs each contender in a process of its own with glibc's mmap threshold fixed
    low (MALLOC_MMAP_THRESHOLD_), so each tensor is mapped and unmapped by itself."""
    import gc

    step()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # NOTE: resets VmHWM to the current VmRSS (Linux 4.0 and later)
    before = _status("VmRSS")
    step()
    return _status("VmHWM") - before


def step_ms(step: Callable[[], Any], rounds: int) -> float:
    for _ in range(2):
        step()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        step().item()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def contenders(config: MLPConfig) -> list[tuple[str, Callable[[], Callable[[], Any]]]]:
    found: list[tuple[str, Callable[[], Callable[[], Any]]]] = [
        ("torch", lambda: eager_step(config)),
        ("torch-in-backward", lambda: eager_step(config, in_backward=True))]
    found += [(f"torch-checkpoint-{n}", lambda n=n: checkpoint_step(config, n))
              for n in SEGMENTS if n <= config.depth]
    found += [(f"torch-compile-budget-{b:g}", lambda b=b: compile_step(config, b))
              for b in BUDGETS]
    return found


def measure_one(config: MLPConfig, name: str, rounds: int) -> dict[str, Any]:
    """The row of one contender, measured in this process: name, ms, peak bytes; or the error
    that stopped it."""
    make = dict(contenders(config))[name]
    try:
        step = make()
        return {"contender": name, "ms": step_ms(step, rounds), "peak": peak_bytes(step)}
    except Exception as exc:
        return {"contender": name, "error": f"{type(exc).__name__}: {exc}"[:160]}


def measure(key: str, config: MLPConfig, rounds: int) -> list[dict[str, Any]]:
    """One row per contender, each measured in a process of its own (see `peak_bytes`)."""
    rows = []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "16384"}
    for name, _ in contenders(config):
        done = subprocess.run([sys.executable, __file__, "--one", key, name, "--rounds",
                               str(rounds)], env=env, capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        rows.append(json.loads(lines[-1]) if lines else
                    {"contender": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="D,DW", help="comma-separated, of S, M, L, D, DW")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "CONTENDER"),
                        help="measure one contender in this process and print its row as JSON")
    args = parser.parse_args()
    configs = {**CONFIGS, "DW": DEEP_WIDE}
    if args.one:
        print(json.dumps(measure_one(configs[args.one[0]], args.one[1], args.rounds)))
        return
    print(f"PyTorch's memory-for-time trades on {cpu_name()}; {versions()}; "
          f"1-minute load {os.getloadavg()[0]:.2f}")
    for key in args.configs.split(","):
        config = configs[key]
        print(f"\n{key} (batch {config.batch}, width {config.width}, depth {config.depth})\n")
        print("| contender | ms per step | peak MiB |")
        print("|---|---:|---:|")
        for row in measure(key, config, args.rounds):
            if "error" in row:
                print(f"| {row['contender']} | - | - ({row['error']}) |")
            else:
                print(f"| {row['contender']} | {row['ms']:.2f} | {row['peak'] / 2**20:.2f} |")


if __name__ == "__main__":
    main()
