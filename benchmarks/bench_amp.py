"""Mixed-precision training (issue 20, part 3): the MLP training step in float32 against the same
step in mixed float16 (autocast, float32 masters, a GradScaler) and mixed bfloat16 (no scaler),
eager and under a static graph plan: step time and the graph's memory report.

The model is benchmarks/mlp_reference.py's (`depth` hidden Dense layers of `width` with ReLU, a
Dense classifier to 10 classes, softmax cross-entropy, SGD lr 0.01), built by
`nn.train_step(model, opt, precision=...)`. Contenders share one process and are timed in
interleaved rounds (`timing.interleaved_best`), so that all see the same machine load; ratios
are to float32 in the same mode. One BLAS thread unless OPENBLAS_NUM_THREADS is set, on
NumPy's OpenBLAS unless BLOCKRT_BLAS is set.

Memory: `activation_bytes` (the most bytes of forward results live at once) and
`planned_bytes` (the static arena of every intermediate, gradients included), from the
capture; they do not depend on the machine.

With --torch, PyTorch's own mixed precision on the CPU runs in the same interleaved rounds as
blockrt's eager steps: the same model and SGD step (mlp_reference.make_torch) in float32, under
`torch.autocast("cpu", float16)` with `torch.amp.GradScaler("cpu")`, and under
`torch.autocast("cpu", bfloat16)`; its ratios are to PyTorch's float32 step. A CPU without
half arithmetic makes both frameworks pay for the casts; this says how much PyTorch pays on
the same machine.

Run: .venv/bin/python benchmarks/bench_amp.py [--configs S,M] [--memory M,L] [--rounds 7]
     [--torch]
"""

from __future__ import annotations

import argparse
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

from mlp_reference import blockrt_model, init_params, make_batch, make_torch  # noqa: E402
from timing import (  # noqa: E402
    PRECISIONS,
    blas_name,
    cpu_name,
    interleaved_best,
    print_precision_header,
    print_precision_row,
    steps_per_round,
    versions,
)

import runtime  # noqa: E402
from allocators import format_bytes  # noqa: E402
from blockrt.models import CONFIGS, MLPConfig  # noqa: E402
from runtime import fastpath, nn  # noqa: E402


def training_step(config: MLPConfig, precision: str, graph: bool) -> Callable[..., Any]:
    """The reference MLP's SGD step in `precision` (the same weights for every contender)."""
    model, opt, _ = blockrt_model(init_params(config))
    step = nn.train_step(model, opt, precision=precision)
    return runtime.graph(step) if graph else step


def torch_step(config: MLPConfig, precision: str) -> Callable[[], Any]:
    """PyTorch's step (`make_torch`'s model, loss and SGD update) in `precision`: float32, or
    forward and loss under `torch.autocast("cpu", precision)`, float16 with
    `torch.amp.GradScaler("cpu")` as torch.amp's recipe has it."""
    import torch
    import torch.nn.functional as F

    x, y = make_batch(config)
    trainer = make_torch(init_params(config), x, y)
    if precision == "float32":
        return trainer.step
    model, parameters, tx, tlabels = trainer.state
    half = getattr(torch, precision)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "float16")
    opt = torch.optim.SGD(parameters, lr=0.01)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=half):
            loss = F.cross_entropy(model(tx), tlabels)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss.item()

    return step


def time_table(keys: list[str], rounds: int, torch: bool) -> None:
    print_precision_header()
    torch_rows = []
    for key in keys:
        config = CONFIGS[key]
        x, y = make_batch(config)
        number = steps_per_round(config)
        for graph in (False, True):
            steps = {p: training_step(config, p, graph) for p in PRECISIONS}
            data = x if graph else runtime.tensor(x)
            contenders = {p: (lambda s=s, d=data, t=y: s(d, t)) for p, s in steps.items()}
            if torch and not graph:  # NOTE: PyTorch's eager steps in the same rounds
                contenders |= {f"torch {p}": torch_step(config, p) for p in PRECISIONS}
            us = interleaved_best(contenders, number, rounds)
            ms = {p: us[p] / 1e3 for p in PRECISIONS}
            print_precision_row(key, graph, ms)
            if torch and not graph:
                torch_rows.append((key, ms, {p: us[f"torch {p}"] / 1e3 for p in PRECISIONS}))
    if torch_rows:
        print()
        print("| config | PyTorch float32 (ms) | float16 (ms) | bfloat16 (ms) | PyTorch float16 "
              "/ float32 | bfloat16 / float32 | blockrt eager float16 / float32 | bfloat16 / "
              "float32 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for key, mine, theirs in torch_rows:
            print(f"| {key} | {theirs['float32']:.2f} | {theirs['float16']:.2f} | "
                  f"{theirs['bfloat16']:.2f} | {theirs['float16'] / theirs['float32']:.2f} | "
                  f"{theirs['bfloat16'] / theirs['float32']:.2f} | "
                  f"{mine['float16'] / mine['float32']:.2f} | "
                  f"{mine['bfloat16'] / mine['float32']:.2f} |")


def memory_table(keys: list[str]) -> None:
    print("| config | precision | activation bytes | / float32 | planned bytes (arena) | "
          "/ float32 |")
    print("|---|---|---:|---:|---:|---:|")
    for key in keys:
        config = CONFIGS[key]
        x, y = make_batch(config)
        reports = {}
        for precision in PRECISIONS:
            graph = training_step(config, precision, True)
            graph(x, y)
            reports[precision] = graph.memory_report()
            del graph
        base = reports["float32"]
        for precision, report in reports.items():
            print(f"| {key} | {precision} | {format_bytes(report['activation_bytes'])} | "
                  f"{report['activation_bytes'] / base['activation_bytes']:.3f} | "
                  f"{format_bytes(report['planned_bytes'])} | "
                  f"{report['planned_bytes'] / base['planned_bytes']:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="S,M", help="timed configurations")
    parser.add_argument("--memory", default="M,L", help="configurations of the memory table")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--torch", action="store_true",
                        help="PyTorch's CPU autocast in the same rounds as blockrt's eager steps")
    args = parser.parse_args()
    print(f"Mixed precision on {cpu_name()}; {versions()}; products on {blas_name()}; "
          f"{os.environ['OPENBLAS_NUM_THREADS']} BLAS thread(s); C fast path "
          f"{'on' if fastpath.ACCELERATED else 'off'}; 1-minute load {os.getloadavg()[0]:.2f}")
    print()
    if args.memory:
        memory_table(args.memory.split(","))
        print()
    if args.configs:
        time_table(args.configs.split(","), args.rounds, args.torch)


if __name__ == "__main__":
    main()
