"""MLP training step time: blockrt eager against hand-written NumPy and PyTorch CPU, 2 threads.

The model and step (see benchmarks/mlp_reference.py): `depth` hidden Dense layers of `width` x
`width` with ReLU after each, a Dense classifier `width` -> 10, float32; softmax cross-entropy
(mean over the batch, integer labels); plain SGD, lr 0.01, no momentum. One training step =
forward, loss, backward, parameter update. Every contender starts from the same weights (PyTorch's
uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)) from one seeded NumPy Generator) and trains on the same
fixed batch. Configurations (batch, width, depth): S = 64, 256, 8; M = 256, 1024, 4;
L = 1024, 4096, 4.

Contenders (benchmarks/mlp_reference.py): `numpy-prealloc` (every buffer allocated once: the
practical limit), `torch` and `torch-compile` (PyTorch CPU eager, `nn.Linear`, `F.cross_entropy`,
SGD as `optim.SGD` runs it on CPU, and the same step under `torch.compile`; optional, skipped when
torch is not importable), `blockrt-eager` and the graph plans, each blockrt mode also with each
CBLAS forced (`-openblas`, `-mkl`: BLOCKRT_BLAS set in its process), and on request `numpy-naive`
(the plain NumPy reference, a new array per result), `blockrt-static-mixed` (each product shape
on the library faster for it alone) and `tinygrad`.

Each contender runs in its own long-lived subprocess (`--serve NAME --config C`), with
OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set to 2 before NumPy loads and
`torch.set_num_threads(2)`. The child builds the model and warms up (at least 2 steps and half a
second: a graph's capture happens there; a blockrt contender also until its CBLAS is chosen, as
`BLOCKRT_BLAS=auto` measures the libraries on the first steps), then serves rounds: in each
round every contender in turn (order rotated per round, a `PAUSE_SECONDS` pause first so the
previous one's BLAS and OpenMP threads have stopped spinning) times whole steps for at least
`--seconds` (and at least 2).

Two figures come out. Each contender's **fastest step** over all rounds, and for each pair the
**median over rounds of the ratio of their fastest steps in that round** (against a group in
brackets, such as [static forced]: the faster of its contenders in that round). The ratio is the
one to read: this machine is shared, and it runs in slow and fast spells of tens of seconds (the
same GEMM takes 2.8 ms in one and 4.5 ms in the next), so two contenders measured minutes apart, or
even each one's best over a whole run, can differ by the spell they drew; within a round they
ran seconds apart. Every step time is in the `--json` records, with the CPU model and each
contender's BLAS. Each child also reports ru_maxrss after the data, after setup and after its
last round (process memory).

Run: python benchmarks/bench_train.py [--quick] [--configs S,M,L] [--contenders a,b] [--rounds N]
     [--seconds T] [--check] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

# NOTE: before NumPy loads its BLAS (mlp_reference imports NumPy); children get them from the parent
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np
from mlp_reference import (
    CHECK_CONFIG,
    CONFIGS,
    CONTENDER_ENV,
    CONTENDERS,
    LOSS_ATOL,
    LR,
    PARAM_ATOL,
    QUICK_CONFIGS,
    ContenderUnavailable,
    blas_summary,
    check_against_reference,
    init_params,
    make_batch,
)
from timing import ROOT, baseline_checkout, cpu_name

THREADS = 2  # as set above
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
DEFAULT_CONTENDERS = ("numpy-prealloc", "torch", "torch-compile", "blockrt-eager",
                      "blockrt-eager-openblas", "blockrt-eager-mkl", "blockrt-none",
                      "blockrt-recycle", "blockrt-static", "blockrt-static-openblas",
                      "blockrt-static-mkl")
#: A ratio's second term may be a group: round by round, the faster of its contenders there.
GROUPS = {"[static forced]": ("blockrt-static-openblas", "blockrt-static-mkl"),
          "[eager forced]": ("blockrt-eager-openblas", "blockrt-eager-mkl")}
RATIOS = (("blockrt-static", "[static forced]"), ("blockrt-static", "blockrt-static-openblas"),
          ("blockrt-static", "blockrt-static-mkl"), ("blockrt-eager", "[eager forced]"),
          ("blockrt-eager", "blockrt-eager-openblas"), ("blockrt-eager", "blockrt-eager-mkl"),
          ("blockrt-static", "torch"), ("blockrt-static", "torch-compile"),
          ("blockrt-eager", "torch"), ("blockrt-static", "blockrt-eager"),
          ("blockrt-static", "numpy-prealloc"), ("blockrt-eager", "numpy-prealloc"),
          ("torch", "numpy-prealloc"), ("torch-compile", "torch"),
          ("blockrt-static-mkl", "blockrt-static-openblas"),
          ("blockrt-eager-mkl", "blockrt-eager-openblas"),
          ("blockrt-static-mixed", "blockrt-static"),
          ("blockrt-static-openblas", "torch"), ("blockrt-static-mkl", "torch"))
ROUNDS = {"S": 30, "M": 20, "L": 8}
PAUSE_SECONDS = 0.25   # before each contender's turn: the last one's threads stop spinning
WARMUP_SECONDS = 0.5
#: The longest a blockrt contender warms up waiting for its CBLAS to be chosen (s).
CHOICE_SECONDS = 300.0


def cpu_model() -> str:
    """The CPU's family, model and stepping (what tells two CPUs of one name apart)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return "family unknown"
    return ", ".join(f"{key} {fields[key]}" for key in ("cpu family", "model", "stepping")
                     if key in fields) or "family unknown"


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


def blas_of(name: str) -> str | None:
    """The CBLAS a blockrt contender's products ran on in this process and how it was chosen
    (`backends._blas.Report.summary`); None for the other contenders."""
    if "backends._blas" not in sys.modules or not name.startswith("blockrt"):
        return None
    return blas_summary()


def blas_measured(name: str) -> dict[str, Any] | None:
    """Why a blockrt contender's CBLAS was chosen, where it was measured: the reason and each
    product shape's time (ms) on each library, as `blockrt info` prints them."""
    blas = sys.modules.get("backends._blas")
    chooser = blas.report().chooser if blas is not None and name.startswith("blockrt") else None
    if chooser is None or chooser.decision is None:
        return None
    return {"reason": chooser.decision.reason,
            "shapes": {str(product): {"calls": calls, **{lib: t * 1e3 for lib, t in times.items()
                                                         if t is not None}}
                       for product, calls, times, _ in chooser.table()}}


def torch_blas() -> str | None:
    """What PyTorch's CPU build says it multiplies with (its BLAS and MKL), where torch ran."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    found = []
    for line in torch.__config__.show().splitlines():
        words = line.replace("-", " ").split()
        if "Math Kernel Library" in line and "Version" in words:
            found.append("MKL " + words[words.index("Version") + 1] + " (its own)")
        elif line.strip().startswith("- Intel(R) MKL-DNN"):
            found.append("oneDNN " + line.split()[3])
    return ", ".join(found) or "its own"


def serve(name: str, config_name: str, quick: bool) -> None:
    """A contender kept alive for a whole configuration (`--serve`): build it, warm up, say
    "ready" (one JSON line), then answer each "run SECONDS" with one round (the step times of
    at least 2 steps and at least SECONDS) and "stop" with the closing record."""
    config = (QUICK_CONFIGS if quick else CONFIGS)[config_name]
    record: dict[str, Any] = {"contender": name, "config": config_name, **config._asdict()}
    params = init_params(config)
    x, labels = make_batch(config)
    rss_data = maxrss_kib()
    try:
        trainer = CONTENDERS[name](params, x, labels, LR)
    except ContenderUnavailable as e:
        print(json.dumps({**record, "status": "skipped", "reason": str(e)}), flush=True)
        return
    del params  # the contender holds its own copy
    threads = {variable: os.environ.get(variable) for variable in THREAD_VARIABLES}
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.set_num_threads(THREADS)
        threads["torch"] = torch.get_num_threads()
    rss_setup = maxrss_kib()
    rss_before = reset_peak_rss()
    start = time.perf_counter()  # warm up: first touch, caches, a capture's first call
    first_loss = trainer.step()
    warmup_steps = 1
    while warmup_steps < 2 or time.perf_counter() - start < WARMUP_SECONDS:
        trainer.step()
        warmup_steps += 1
    settled = trainer.settled or (lambda: True)
    while not settled() and time.perf_counter() - start < CHOICE_SECONDS:
        trainer.step()  # NOTE: BLOCKRT_BLAS=auto measures the libraries on the first steps
        warmup_steps += 1
    warmup_seconds = time.perf_counter() - start
    print(json.dumps({"status": "ready"}), flush=True)
    last_loss = first_loss
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] != "run":
            break
        seconds = float(command[1])
        times = []
        start = time.perf_counter()
        while len(times) < 2 or time.perf_counter() - start < seconds:
            begin = time.perf_counter()
            last_loss = trainer.step()
            times.append(time.perf_counter() - begin)
        print(json.dumps({"ms": [1e3 * t for t in times], "at": time.time()}), flush=True)
    print(json.dumps({
        **record, "status": "ok", "threads": threads, "cpu": cpu_name(),
        "blas": blas_of(name) or torch_blas(), "blas_measured": blas_measured(name),
        "first_loss": first_loss,
        "last_loss": last_loss, "warmup_steps": warmup_steps, "warmup_seconds": warmup_seconds,
        "maxrss_kib": {"data": rss_data, "setup": rss_setup, "after": maxrss_kib()},
        "added_by_training_kib": (None if rss_before is None
                                  else _status_kib("VmHWM") - rss_before)}), flush=True)


class Child:
    """One `--serve` subprocess, with the thread variables set. A contender named
    `NAME@REF` is NAME served by the baseline checkout's own bench_train.py, with its blockrt
    first on the path (`--baseline`)."""

    def __init__(self, name: str, config_name: str, quick: bool,
                 baseline: pathlib.Path | None = None) -> None:
        served, _, ref = name.partition("@")
        tree = baseline if ref else ROOT
        command = [sys.executable, str(tree / "benchmarks" / "bench_train.py"), "--serve",
                   served, "--config", config_name] + (["--quick"] if quick else [])
        env = {**os.environ, **dict.fromkeys(THREAD_VARIABLES, str(THREADS)),
               **CONTENDER_ENV.get(served, {}), "PYTHONPATH": str(tree)}
        self.name = name
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, cwd=tree)

    def reply(self) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            error = self.process.stderr.read().strip().splitlines()
            self.finish()
            return {"contender": self.name, "status": "error",
                    "reason": error[-1] if error else f"exit {self.process.returncode}"}
        return json.loads(line)

    def finish(self) -> None:
        """Wait for the child to exit and close its pipes."""
        for stream in (self.process.stdin, self.process.stdout, self.process.stderr):
            try:
                stream.close()
            except BrokenPipeError:
                pass
        self.process.wait()

    def ask(self, command: str) -> dict[str, Any]:
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # the reply says why
        return self.reply()

    def close(self) -> dict[str, Any]:
        record = self.ask("stop")
        self.finish()
        return record


def print_blas(results: dict[str, Any]) -> None:
    """Which BLAS each contender's products ran on, per configuration (`backends/_blas.py`
    for blockrt's; what torch.__config__ says for PyTorch's), and how long warm-up took."""
    print()
    print("| config | contender | BLAS | warm-up |")
    print("|---|---|---|---:|")
    for config_name, result in results.items():
        for name, record in result["records"].items():
            if record.get("status") != "ok":
                continue
            warmup = f"{record['warmup_steps']} steps, {record['warmup_seconds']:.1f} s"
            blas = record.get("blas") or ("NumPy's own" if name.startswith("numpy") else "-")
            print(f"| {config_name} | {name} | {blas} | {warmup} |")


def run_config(config_name: str, names: list[str], rounds: int, quick: bool,
               seconds: float, baseline: pathlib.Path | None = None) -> dict[str, Any]:
    """Every contender as one long-lived subprocess; `rounds` rounds in which each runs for
    `seconds` in turn (order rotated each round, a pause before each so the previous one's
    BLAS and OpenMP threads have stopped spinning). Contenders that are skipped or fail to
    start are dropped. Returns {"rounds": {name: [round's step times]}, "records": {name:
    closing record}}."""
    children = {}
    records: dict[str, dict[str, Any]] = {}
    for name in names:  # NOTE: one at a time, so no set-up runs beside another's warm-up
        child = Child(name, config_name, quick, baseline)
        ready = child.reply()
        if ready.get("status") == "ready":
            children[name] = child
        else:
            records[name] = ready
            child.finish()
            print(f"{config_name}: {name} {ready['status']}: {ready['reason']}", file=sys.stderr)
    times: dict[str, list[list[float]]] = {name: [] for name in children}
    active = list(children)
    for round_index in range(rounds):
        shift = round_index % len(active) if active else 0
        for name in active[shift:] + active[:shift]:
            time.sleep(PAUSE_SECONDS)
            answer = children[name].ask(f"run {seconds}")
            if "ms" not in answer:
                records[name] = answer
                children[name].finish()
                print(f"{config_name}: {name} failed: {answer.get('reason')}", file=sys.stderr)
                continue
            times[name].append(answer["ms"])
        active = [name for name in active if name not in records]
    for name in active:
        records[name] = children[name].close()
    return {"rounds": {name: times[name] for name in active}, "records": records}


def best_ms(rounds: list[list[float]] | None) -> float | None:
    """The fastest single step over all rounds, or None when no round ran."""
    return min(min(r) for r in rounds) if rounds else None


def rounds_of(name: str, rounds: dict[str, list[list[float]]]) -> list[list[float]] | None:
    """A contender's rounds, or a group's (`GROUPS`): in each round all of its contenders ran,
    the fastest step of the faster one."""
    if name not in GROUPS:
        return rounds.get(name)
    members = [rounds.get(member) for member in GROUPS[name]]
    if not all(members):
        return None
    return [[min(min(r) for r in same_round)] for same_round in zip(*members)]


def round_ratios(a: list[list[float]] | None, b: list[list[float]] | None) -> list[float]:
    """a's fastest step / b's fastest step, round by round (rounds both ran)."""
    return [min(x) / min(y) for x, y in zip(a or [], b or [])]


def paired_ratio(a: list[list[float]] | None, b: list[list[float]] | None) -> float | None:
    """The median over rounds of (a's fastest step / b's fastest step) in the same round: the
    two ran seconds apart, so a slow spell of the machine (they last tens of seconds
    here) hits both alike."""
    ratios = round_ratios(a, b)
    return statistics.median(ratios) if ratios else None


def rounds_won(a: list[list[float]] | None, b: list[list[float]] | None) -> tuple[int, int]:
    """(rounds in which a's fastest step beat b's, rounds both ran)."""
    ratios = round_ratios(a, b)
    return sum(r < 1 for r in ratios), len(ratios)


def first_loss_spread(records: dict[str, dict[str, Any]]) -> float:
    """The largest difference between contenders' first-step losses (same weights and batch)."""
    losses = [r["first_loss"] for r in records.values() if r.get("status") == "ok"]
    return max(losses) - min(losses) if losses else 0.0


def print_table(results: dict[str, dict[str, Any]], names: list[str], quick: bool) -> None:
    """Two Markdown tables: each contender's fastest step (ms), then, for each pair, the median
    over rounds of the ratio of their fastest steps in that round, with the rounds the first
    won (its fastest step the faster) out of all; each contender against its baseline."""
    present = set(names) | {group for group, members in GROUPS.items()
                            if all(member in names for member in members)}
    ratios = [(a, b) for a, b in RATIOS if a in present and b in present]
    ratios += [(name.partition("@")[0], name) for name in names
               if "@" in name and name.partition("@")[0] in names]
    print("| config | batch, width, depth | GFLOP/step | "
          + " | ".join(f"{name} (ms)" for name in names) + " |")
    print("|---|---|---:|" + "---:|" * len(names))
    for config_name, result in results.items():
        config = (QUICK_CONFIGS if quick else CONFIGS)[config_name]
        best = {name: best_ms(result["rounds"].get(name)) for name in names}
        cells = [f"{best[name]:.2f}" if best[name] is not None else "n/a" for name in names]
        print(f"| {config_name} | {config.batch}, {config.width}, {config.depth} | "
              f"{config.step_flop() / 1e9:.3g} | " + " | ".join(cells) + " |")
    if not ratios:
        return
    print()
    print("| config | " + " | ".join(f"{a} / {b}" for a, b in ratios) + " |")
    print("|---|" + "---:|" * len(ratios))
    for config_name, result in results.items():
        cells = []
        for a, b in ratios:
            first, second = rounds_of(a, result["rounds"]), rounds_of(b, result["rounds"])
            ratio = paired_ratio(first, second)
            won, total = rounds_won(first, second)
            cells.append(f"{ratio:.2f} ({won}/{total})" if ratio is not None else "n/a")
        print(f"| {config_name} | " + " | ".join(cells) + " |")


def print_memory_table(results: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Peak process memory added by training (peak reset after set-up, read after the last
    round), in MiB."""
    print("\n| config | " + " | ".join(f"{name} (MiB added)" for name in names) + " |")
    print("|---|" + "---:|" * len(names))
    for config_name, result in results.items():
        cells = []
        for name in names:
            added = result["records"].get(name, {}).get("added_by_training_kib")
            cells.append(f"{added / 1024:.0f}" if added is not None else "n/a")
        print(f"| {config_name} | " + " | ".join(cells) + " |")


def run_check(names: list[str]) -> int:
    """Every contender against the plain NumPy reference at CHECK_CONFIG; 1 if any disagrees."""
    print(f"Check: 3 steps at batch {CHECK_CONFIG.batch}, width {CHECK_CONFIG.width}, depth "
          f"{CHECK_CONFIG.depth} against the plain NumPy reference "
          f"(tolerances: loss {LOSS_ATOL:g}, params {PARAM_ATOL:g})")
    failures = 0
    for name in names:
        env = CONTENDER_ENV.get(name, {})
        if any(os.environ.get(key) != value for key, value in env.items()):
            # NOTE: the BLAS is chosen once per process: check this one in a process of its own
            child = subprocess.run([sys.executable, os.path.abspath(__file__), "--check",
                                    "--contenders", name], env={**os.environ, **env},
                                   capture_output=True, text=True)
            print("".join(child.stdout.splitlines(keepends=True)[1:]), end="")
            if child.returncode != 0:
                failures += 1
                error = child.stderr.strip().splitlines()
                print(f"  {name}: FAILED in its own process"
                      + (f" ({error[-1]})" if error else f" (exit {child.returncode})"))
            continue
        try:
            diff = check_against_reference(CONTENDERS[name])
        except ContenderUnavailable as e:
            print(f"  {name}: skipped ({e})")
            continue
        ok = diff["loss"] <= LOSS_ATOL and diff["params"] <= PARAM_ATOL
        failures += not ok
        blas = blas_of(name)
        print(f"  {name}: {'ok' if ok else 'MISMATCH'} (loss diff {diff['loss']:.2g}, params "
              f"diff {diff['params']:.2g}, params moved {diff['moved']:.2g})"
              + (f", products on {blas}" if blas is not None else ""))
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, one short round (for smoke runs)")
    parser.add_argument("--configs", default="S,M,L", help="comma-separated, of S, M, L")
    parser.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                        help=f"comma-separated, of {', '.join(CONTENDERS)}")
    parser.add_argument("--rounds", type=int, help="rounds per configuration (default: S 30, "
                        "M 20, L 8; 1 with --quick)")
    parser.add_argument("--seconds", type=float, help="timed seconds per contender per round, "
                        "at least 2 steps (default 0.3; 0.05 with --quick)")
    parser.add_argument("--check", action="store_true",
                        help="only check every contender against the NumPy reference")
    parser.add_argument("--json", metavar="PATH", help="also write every round's step times "
                        "and each contender's closing record here")
    parser.add_argument("--baseline", metavar="REF", help="also run the blockrt contenders of "
                        "--baseline-contenders from this commit, checked out beside this one, "
                        "each paired with this checkout's (e.g. before a refactor)")
    parser.add_argument("--baseline-contenders", default="blockrt-eager,blockrt-static",
                        help="comma-separated (default: blockrt-eager,blockrt-static)")
    parser.add_argument("--serve", metavar="NAME", help=argparse.SUPPRESS)  # child
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = args.contenders.split(",")
    configs = args.configs.split(",")
    based = args.baseline_contenders.split(",")
    unknown = sorted((set(names) | set(based)) - set(CONTENDERS)) + sorted(
        set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown contender or configuration: {', '.join(unknown)}")
    seconds = args.seconds if args.seconds is not None else (0.05 if args.quick else 0.3)
    if args.serve:
        serve(args.serve, args.config, args.quick)
        return
    if args.check:
        sys.exit(run_check(names))
    with contextlib.ExitStack() as stack:
        baseline = None
        if args.baseline:
            baseline = stack.enter_context(baseline_checkout(args.baseline))
            names += [f"{name}@{args.baseline}" for name in based]
        load_before = os.getloadavg()[0]
        results = {}
        for config_name in configs:
            rounds = args.rounds or (1 if args.quick else ROUNDS[config_name])
            results[config_name] = run_config(config_name, names, rounds, args.quick, seconds,
                                              baseline)
            spread = first_loss_spread(results[config_name]["records"])
            if spread > 1e-3:
                print(f"{config_name}: first-step losses differ by {spread:.3g} across "
                      f"contenders", file=sys.stderr)
    print(f"MLP training step on {cpu_name()} ({cpu_model()}), {THREADS} threads, Python "
          f"{platform.python_version()}, NumPy {np.__version__}: fastest step (ms) of each "
          f"contender; ratios are medians over rounds of the same round's fastest steps (rounds "
          f"the first won / all). 1-minute load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after:")
    print()
    print_table(results, names, args.quick)
    print_memory_table(results, names)
    print_blas(results)
    if args.json:
        with open(args.json, "w") as f:
            for config_name, result in results.items():
                for name, rounds in result["rounds"].items():
                    record = result["records"].get(name, {})
                    f.write(json.dumps({"config": config_name, "contender": name,
                                        "cpu": record.get("cpu"), "blas": record.get("blas"),
                                        "rounds_ms": rounds}) + "\n")
                for record in result["records"].values():
                    f.write(json.dumps(record) + "\n")

if __name__ == "__main__":
    main()
