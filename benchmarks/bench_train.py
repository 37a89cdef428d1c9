"""MLP training step time: blockrt eager against hand-written NumPy and PyTorch CPU, 2 threads.

The model and step (see benchmarks/mlp_reference.py): `depth` hidden Dense layers of `width` x
`width` with ReLU after each, a Dense classifier `width` -> 10, float32; softmax cross-entropy
(mean over the batch, integer labels); plain SGD, lr 0.01, no momentum. One training step =
forward, loss, backward, parameter update. Every contender starts from the same weights (PyTorch's
uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) from one seeded NumPy Generator) and trains on the same
fixed batch. Configurations (batch, width, depth): S = 64, 256, 8; M = 256, 1024, 4;
L = 1024, 4096, 4.

Contenders: `numpy-prealloc` (every buffer allocated once: the practical limit), `torch` (PyTorch
CPU eager, `nn.Linear`, `F.cross_entropy`, SGD as `optim.SGD` runs it on CPU; optional, skipped
when torch is not importable), `blockrt-eager` (blockrt's autograd and `runtime.nn`; skipped when
`runtime.nn` is missing), and on request `numpy-naive` (the plain NumPy reference, a new array per
result).

Each measurement runs in a fresh subprocess (`--only NAME --config C`, one JSON line out), with
OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set to 2 before NumPy loads and
`torch.set_num_threads(2)`. The child builds the model, warms up (at least one step), then times
each whole step for at least `--seconds` (and at least 2 steps). The parent interleaves the
contenders' subprocesses in rounds, rotating the order, so all contenders see the same machine
load, and reports each contender's **best step** (the fastest single step over all rounds). The
best is the figure because this machine is shared: other work comes in bursts of seconds and
slows a 2-thread OpenBLAS up to 20-fold (PyTorch's threads far less), so means and medians
measure the neighbours; every round's mean and fastest step are in the `--json` records. The
child also reports ru_maxrss after the data, after setup and after training (process memory).

Run: python benchmarks/bench_train.py [--quick] [--configs S,M,L] [--contenders a,b] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

# NOTE: before NumPy loads its BLAS (mlp_reference imports NumPy); children get them from the parent
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mlp_reference import (
    CHECK_CONFIG,
    CONFIGS,
    CONTENDERS,
    LOSS_ATOL,
    LR,
    PARAM_ATOL,
    QUICK_CONFIGS,
    ContenderUnavailable,
    check_against_reference,
    init_params,
    make_batch,
)

THREADS = 2  # as set above
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
DEFAULT_CONTENDERS = ("numpy-prealloc", "torch", "blockrt-eager", "blockrt-none",
                      "blockrt-recycle", "blockrt-static")
RATIOS = (("blockrt-eager", "numpy-prealloc"), ("blockrt-eager", "torch"),
          ("blockrt-static", "blockrt-eager"), ("blockrt-static", "numpy-prealloc"),
          ("blockrt-static", "torch"), ("torch", "numpy-prealloc"))
ROUNDS = {"S": 7, "M": 5, "L": 3}


def maxrss_kib() -> int:
    """The peak resident memory of this process so far, in KiB (Linux units)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def reset_peak_rss() -> int | None:
    """Reset this process's peak resident memory to what it holds now (Linux: writing 5 to
    /proc/self/clear_refs) and return that, in KiB; None where it cannot be reset. Setup
    transients (weights drawn in float64, copies) then no longer hide what training adds."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_kib("VmHWM")
    except OSError:
        return None


def _status_kib(field: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return None


def measure(name: str, config_name: str, quick: bool, seconds: float) -> dict[str, Any]:
    """One round of one contender in this process: what `--only` prints as a JSON line."""
    config = (QUICK_CONFIGS if quick else CONFIGS)[config_name]
    record: dict[str, Any] = {"contender": name, "config": config_name, **config._asdict()}
    params = init_params(config)
    x, labels = make_batch(config)
    rss_data = maxrss_kib()
    try:
        trainer = CONTENDERS[name](params, x, labels, LR)
    except ContenderUnavailable as e:
        return {**record, "status": "skipped", "reason": str(e)}
    del params  # the contender holds its own copy
    threads = {variable: os.environ.get(variable) for variable in THREAD_VARIABLES}
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_num_threads(THREADS)
        threads["torch"] = torch.get_num_threads()
    rss_setup = maxrss_kib()
    rss_before = reset_peak_rss()
    # Warm up: at least one step and a tenth of the measuring time (first touch, caches).
    start = time.perf_counter()
    first_loss = trainer.step()
    warmup_steps = 1
    while time.perf_counter() - start < seconds / 10:
        trainer.step()
        warmup_steps += 1
    times = []
    start = time.perf_counter()
    while len(times) < 2 or time.perf_counter() - start < seconds:
        begin = time.perf_counter()
        last_loss = trainer.step()
        times.append(time.perf_counter() - begin)
    return {**record, "status": "ok", "threads": threads, "first_loss": first_loss,
            "last_loss": last_loss, "warmup_steps": warmup_steps, "steps": len(times),
            "ms_per_step": 1e3 * sum(times) / len(times), "ms_min_step": 1e3 * min(times),
            "maxrss_kib": {"data": rss_data, "setup": rss_setup, "after": maxrss_kib()},
            "added_by_training_kib": (None if rss_before is None
                                      else _status_kib("VmHWM") - rss_before)}


def run_child(name: str, config_name: str, quick: bool, seconds: float) -> dict[str, Any]:
    """`measure` in a fresh subprocess with the thread variables set; its JSON record."""
    command = [sys.executable, os.path.abspath(__file__), "--only", name, "--config", config_name,
               "--seconds", str(seconds)] + (["--quick"] if quick else [])
    env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, str(THREADS))}
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = result.stdout.strip().splitlines()
    if result.returncode != 0 or not lines:
        return {"contender": name, "config": config_name, "status": "error",
                "reason": result.stderr.strip().splitlines()[-1:] or f"exit {result.returncode}"}
    return json.loads(lines[-1])


def run_config(config_name: str, names: list[str], rounds: int, quick: bool,
               seconds: float) -> dict[str, list[dict[str, Any]]]:
    """Interleaved rounds of subprocesses, the order rotated each round; records by contender.

    A contender that is skipped or fails in its first round is dropped from the later rounds.
    """
    records: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    active = list(names)
    for round_index in range(rounds):
        shift = round_index % len(active) if active else 0
        for name in active[shift:] + active[:shift]:
            record = run_child(name, config_name, quick, seconds)
            records[name].append(record)
            if record["status"] != "ok":
                print(f"{config_name}: {name} {record['status']}: {record['reason']}",
                      file=sys.stderr)
        active = [name for name in active if records[name][-1]["status"] == "ok"]
    return records


def best_ms(records: list[dict[str, Any]]) -> float | None:
    """The fastest single step over all rounds, or None when no round ran."""
    times = [record["ms_min_step"] for record in records if record["status"] == "ok"]
    return min(times) if times else None


def first_loss_spread(records: dict[str, list[dict[str, Any]]]) -> float:
    """The largest difference between contenders' first-step losses (same weights and batch)."""
    losses = [rs[0]["first_loss"] for rs in records.values() if rs and rs[0]["status"] == "ok"]
    return max(losses) - min(losses) if losses else 0.0


def print_table(results: dict[str, dict[str, list[dict[str, Any]]]], names: list[str],
                quick: bool) -> None:
    """The Markdown table: ms per step of each contender (best step) and the ratios."""
    ratios = [(a, b) for a, b in RATIOS if a in names and b in names]
    columns = [f"{name} (ms)" for name in names] + [f"{a} / {b}" for a, b in ratios]
    print("| config | batch, width, depth | GFLOP/step | " + " | ".join(columns) + " |")
    print("|---|---|---:|" + "---:|" * (len(names) + len(ratios)))
    for config_name, records in results.items():
        config = (QUICK_CONFIGS if quick else CONFIGS)[config_name]
        best = {name: best_ms(records[name]) for name in names}
        cells = [f"{best[name]:.2f}" if best[name] is not None else "n/a" for name in names]
        for a, b in ratios:
            ok = best[a] is not None and best[b] is not None
            cells.append(f"{best[a] / best[b]:.2f}" if ok else "n/a")
        print(f"| {config_name} | {config.batch}, {config.width}, {config.depth} | "
              f"{config.step_flop() / 1e9:.3g} | " + " | ".join(cells) + " |")


def print_memory_table(results: dict[str, dict[str, list[dict[str, Any]]]],
                       names: list[str]) -> None:
    """Peak process memory added by training (first round of each contender: a fresh process,
    peak reset after setup), in MiB."""
    print("\n| config | " + " | ".join(f"{name} (MiB added)" for name in names) + " |")
    print("|---|" + "---:|" * len(names))
    for config_name, records in results.items():
        cells = []
        for name in names:
            first = records[name][0] if records[name] else {}
            added = first.get("added_by_training_kib")
            cells.append(f"{added / 1024:.0f}" if added is not None else "n/a")
        print(f"| {config_name} | " + " | ".join(cells) + " |")


def run_check(names: list[str]) -> int:
    """Every contender against the plain NumPy reference at CHECK_CONFIG; 1 if any disagrees."""
    print(f"Check: 3 steps at batch {CHECK_CONFIG.batch}, width {CHECK_CONFIG.width}, depth "
          f"{CHECK_CONFIG.depth} against the plain NumPy reference "
          f"(tolerances: loss {LOSS_ATOL:g}, params {PARAM_ATOL:g})")
    failures = 0
    for name in names:
        try:
            diff = check_against_reference(CONTENDERS[name])
        except ContenderUnavailable as e:
            print(f"  {name}: skipped ({e})")
            continue
        ok = diff["loss"] <= LOSS_ATOL and diff["params"] <= PARAM_ATOL
        failures += not ok
        print(f"  {name}: {'ok' if ok else 'MISMATCH'} (loss diff {diff['loss']:.2g}, params "
              f"diff {diff['params']:.2g}, params moved {diff['moved']:.2g})")
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one short round (for smoke runs)")
    parser.add_argument("--configs", default="S,M,L", help="comma-separated, of S, M, L")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                        help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--rounds", type=int, help="rounds per configuration (default: S 7, "
                        "M 5, L 3; 1 with --quick)")
    parser.add_argument("--seconds", type=float,
                        help="timed seconds per round, at least 2 steps (default 1; 0.05 quick)")
    parser.add_argument("--check", action="store_true",
                        help="only check every contender against the NumPy reference")
    parser.add_argument("--json", metavar="PATH", help="also write every round's record here")
    parser.add_argument("--only", metavar="NAME", help=argparse.SUPPRESS)  # child: one round
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.contenders.split(",")
    configs = args.configs.split(",")
    unknown = sorted(set(names) - set(CONTENDERS)) + sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown contender or configuration: {', '.join(unknown)}")
    seconds = args.seconds if args.seconds is not None else (0.05 if args.quick else 1.0)
    if args.only:
        print(json.dumps(measure(args.only, args.config, args.quick, seconds)))
        return
    if args.check:
        sys.exit(run_check(names))
    load_before = os.getloadavg()[0]
    results = {}
    for config_name in configs:
        rounds = args.rounds or (1 if args.quick else ROUNDS[config_name])
        results[config_name] = run_config(config_name, names, rounds, args.quick, seconds)
        spread = first_loss_spread(results[config_name])
        if spread > 1e-3:
            print(f"{config_name}: first-step losses differ by {spread:.3g} across contenders",
                  file=sys.stderr)
    # NOTE: other work on the machine slows OpenBLAS's threads far more than PyTorch's
    print(f"MLP training step, {THREADS} threads, fastest step of interleaved rounds (ms); "
          f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after:")
    print()
    print_table(results, names, args.quick)
    print_memory_table(results, names)
    if args.json:
        with open(args.json, "w") as f:
            for records in results.values():
                for record_list in records.values():
                    for record in record_list:
                        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
