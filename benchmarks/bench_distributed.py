"""Data-parallel training over MPI on this machine: step time, overlap, per-rank memory.

The model is the benchmark MLP of `--config` (blockrt/models.py; M: batch 256, width 1024,
4 hidden layers, 16.8 MB of float32 parameters), trained with `nn.train_step` and plain SGD,
eagerly and captured by `runtime.graph` (static plan). Three figures:

1. **Step time for the same global batch**, in interleaved rounds (each round runs every case
   once, in a fresh launch, so that all see the same machine load; the median of each case's
   steps in a round, then the median over rounds of each case's ratio to the baseline):
   - `1 process, 2 threads`: one process, the whole batch, OPENBLAS_NUM_THREADS=2 (baseline);
   - `1 rank, 1 thread`: the same under `mpiexec -n 1` with DistributedDataParallel;
   - `2 ranks, 1 thread each`: `mpiexec -n 2 -bind-to core`, half the batch per rank, the
     gradients all-reduced in buckets (the `--bucket-mb` cap) during backward; and again
     without the helper thread that moves MPI on during backward (Note [progress in the
     background] in runtime/distributed.py: `no progress thread`, eager only);
   each eagerly and under the static plan (`, static`; against the static baseline).
2. **Overlap**: in the eager 2-rank case, for each step, the share of the all-reduce time
   hidden behind backward: 1 - (the wait for the buckets after backward's end) / (the time
   the same buckets take to all-reduce with nothing else running, measured after the steps);
   and a timeline plot of one step of rank 0 (`--plot`): each bucket from its start to when
   the reducer saw it complete (MPI moves a transfer on only inside MPI calls, which the
   reducer makes between gradients).
3. **Memory per rank** with Adam on 2 ranks: data parallel, ZeRO stage 1 and stage 2
   (`DistributedDataParallel.memory_report`); and the same three captured by `runtime.graph`
   (static plan): step time against eager's, in launches side by side, and the plan's bytes.

Every run prints the CPU (lscpu) and the load (`os.getloadavg`) before and after.

Run: python benchmarks/bench_distributed.py [--config M] [--rounds 5] [--steps 8]
     [--bucket-mb 5] [--plot distributed_timeline.png] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

WARMUP = 3


# ---------------------------------------------------------------------- the ranks' side
def _model(cfg, seed: int = 0):
    import numpy as np

    from blockrt import nn
    from blockrt.models import CLASSES

    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(cfg.depth):
        layers += [nn.Dense(cfg.width, cfg.width, rng=rng), nn.ReLU()]
    return nn.Sequential(*layers, nn.Dense(cfg.width, CLASSES, rng=rng))


def _data(cfg):
    import numpy as np

    from blockrt.models import CLASSES

    rng = np.random.default_rng(1)
    x = rng.standard_normal((cfg.batch, cfg.width), dtype=np.float32)
    return x, rng.integers(0, CLASSES, size=cfg.batch)


def _exposed(timeline: dict) -> float:
    """Seconds of one step spent waiting for the all-reduces after backward's end."""
    return timeline["reduced"] - timeline["backward_end"]


def _alone(ddp, group, repeats: int = 5) -> float:
    """Seconds to all-reduce the step's buckets with nothing else running (the median of
    `repeats`): every bucket started at once, then waited for, as at backward's end."""
    import numpy as np

    buffers = [np.ones(bucket.padded, bucket.staging) for bucket in ddp.reducer.buckets]
    times = []
    for _ in range(repeats):
        group.barrier()
        start = time.perf_counter()
        group.wait_all([group.allreduce(buffer) for buffer in buffers])
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker(args: argparse.Namespace) -> None:
    """One process of a case: time `--steps` steps after the warm-up, print JSON (rank 0)."""
    import blockrt
    from blockrt import nn
    from blockrt.models import CONFIGS

    cfg = CONFIGS[args.config]
    x, y = _data(cfg)
    model = _model(cfg)
    report = {}
    if args.worker == "single":
        opt = nn.SGD(model.parameters(), lr=0.01)
        step = nn.train_step(model, opt)
        if args.plan != "eager":
            step = blockrt.graph(step, plan=args.plan)
        rows = slice(None)
        group = None
    else:
        from runtime import distributed

        group = distributed.init()
        group.background_progress = args.worker != "ddp-calls"
        if os.environ.get("BENCH_POLL"):  # NOTE: for trying other intervals by hand
            group.poll_interval = float(os.environ["BENCH_POLL"])
        zero = {"ddp": 0, "zero1": 1, "zero2": 2}.get(args.worker, 0)
        ddp = nn.DistributedDataParallel(model, group, bucket_cap_mb=args.bucket_mb,
                                         zero_stage=zero)
        if args.worker in ("ddp", "ddp-calls"):
            opt = nn.SGD(ddp.parameters(), lr=0.01)
        elif args.worker == "adam":
            opt = nn.Adam(ddp.parameters(), lr=1e-3)
        else:
            opt = nn.ZeroRedundancyOptimizer(ddp, nn.Adam, lr=1e-3)
        step = nn.train_step(ddp, opt)
        if args.plan != "eager":
            step = blockrt.graph(step, plan=args.plan)
        part = cfg.batch // group.size
        rows = slice(group.rank * part, (group.rank + 1) * part)
    undo: list[float] = []  # NOTE: ms of ZeRO's host copy for undo in each step
    if args.worker in ("zero1", "zero2"):
        keep = opt._saved

        def saved_timed() -> tuple:
            start = time.perf_counter()
            saved = keep()
            undo.append((time.perf_counter() - start) * 1e3)
            return saved

        opt._saved = saved_timed  # NOTE: Note [ZeRO's commit point is the gather]
    xb, yb = blockrt.tensor(x[rows]), y[rows]
    times, exposed, timelines = [], [], []
    for index in range(WARMUP + args.steps):
        if group is not None:
            group.barrier()  # NOTE: every rank starts the step together
        start = time.perf_counter()
        step(xb, yb)
        elapsed = time.perf_counter() - start
        if index >= WARMUP:
            times.append(elapsed * 1e3)
            if group is not None and group.size > 1 and args.plan == "eager":
                timeline = dict(ddp.reducer.timeline, step_start=start,
                                step_end=start + elapsed)
                exposed.append(_exposed(timeline))
                timelines.append(timeline)
    alone = _alone(ddp, group) if exposed else None
    if args.worker in ("adam", "zero1", "zero2"):
        # the gradients a step keeps, counted after a backward (the step's zero_grad drops them)
        nn.softmax_cross_entropy(ddp(xb), yb).backward()
        report = ddp.memory_report(opt)
        opt.zero_grad()
        if args.plan != "eager":  # NOTE: the captured step's own plan (Note [ZeRO in a plan])
            report["graph_planned_bytes"] = step.memory_report()["planned_bytes"]
    if group is not None:
        import numpy as np

        from runtime import distributed

        reports = [report]
        if group.size > 1 and args.worker in ("adam", "zero1", "zero2"):
            # NOTE: a tiny exchange of the reports through the group's own all-gather
            mine = np.array([report[k] for k in sorted(report)], np.float64)
            every = np.empty(mine.size * group.size, np.float64)
            group.allgather(mine, every).wait()
            reports = [dict(zip(sorted(report), (int(v) for v in row)))
                       for row in every.reshape(group.size, -1)]
        if group.rank:
            return
        del distributed
    else:
        reports = [report]
    print(json.dumps({"times_ms": times, "exposed": exposed, "alone": alone,
                      "reports": reports, "undo_ms": undo[-len(times):] if undo else [],
                      "timeline": timelines[len(timelines) // 2] if timelines else None}))


# ---------------------------------------------------------------------- the driver
CASES = {
    "1 process, 2 threads": ("single", 1, "2", "eager"),
    "1 rank, 1 thread": ("ddp", 1, "1", "eager"),
    "2 ranks, 1 thread each": ("ddp", 2, "1", "eager"),
    "2 ranks, no progress thread": ("ddp-calls", 2, "1", "eager"),
    "1 process, 2 threads, static": ("single", 1, "2", "static"),
    "1 rank, 1 thread, static": ("ddp", 1, "1", "static"),
    "2 ranks, 1 thread each, static": ("ddp", 2, "1", "static"),
}
#: each case's baseline: one process over the whole batch, two BLAS threads, the same mode
BASELINE = {"eager": "1 process, 2 threads", "static": "1 process, 2 threads, static"}


def launch(kind: str, ranks: int, threads: str, args: argparse.Namespace,
           plan: str = "eager") -> dict:
    from runtime import distributed

    env = dict(os.environ, OPENBLAS_NUM_THREADS=threads, OMP_NUM_THREADS=threads,
               MKL_NUM_THREADS=threads, BLOCKRT_BLAS="openblas")
    own = [sys.executable, __file__, "--worker", kind, "--config", args.config,
           "--steps", str(args.steps), "--bucket-mb", str(args.bucket_mb), "--plan", plan]
    if kind == "single":
        command = own
    else:
        command = [distributed.mpiexec(), "-bind-to", "core", "-n", str(ranks), *own]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(timeline: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = timeline["step_start"]
    fig, ax = plt.subplots(figsize=(9, 2.8))
    ms = [(timeline["backward_start"] - t0) * 1e3, (timeline["backward_end"] - t0) * 1e3]
    ax.broken_barh([(0, ms[0])], (3.6, 0.8), color="#9ecae1", label="forward")
    ax.broken_barh([(ms[0], ms[1] - ms[0])], (3.6, 0.8), color="#3182bd", label="backward")
    end = (timeline["step_end"] - t0) * 1e3
    reduced = (timeline["reduced"] - t0) * 1e3
    ax.broken_barh([(ms[1], reduced - ms[1])], (3.6, 0.8), color="#fdae6b",
                   label="waiting for the last all-reduce")
    ax.broken_barh([(reduced, end - reduced)], (3.6, 0.8), color="#31a354",
                   label="write back, SGD update")
    for row, (index, nbytes, started, completed) in enumerate(timeline["buckets"]):
        a, b = (started - t0) * 1e3, (completed - t0) * 1e3
        ax.broken_barh([(a, b - a)], (2.6 - row * 0.9, 0.7), color="#e6550d")
        ax.text(b + 0.2, 2.8 - row * 0.9, f"bucket {index}: {nbytes / 2**20:.1f} MiB",
                fontsize=7, va="center")
    ax.set_yticks([])
    ax.set_xlabel("ms since the step's start (rank 0)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower left", ncol=2)
    ax.set_ylim(2.6 - len(timeline["buckets"]) * 0.9, 5.6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def driver(args: argparse.Namespace) -> None:
    from timing import cpu_name

    load_before = os.getloadavg()
    print(f"CPU: {cpu_name()}; load {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f} (1, 5, 15 min) before")
    rounds: dict[str, list[float]] = {name: [] for name in CASES}
    ratios: dict[str, list[float]] = {name: [] for name in CASES}
    hidden: list[float] = []
    exposed: list[float] = []
    hidden_calls: list[float] = []
    exposed_calls: list[float] = []
    alone: list[float] = []
    timeline = None
    for _ in range(args.rounds):
        medians = {}
        for name, (kind, ranks, threads, plan) in CASES.items():
            result = launch(kind, ranks, threads, args, plan)
            medians[name] = statistics.median(result["times_ms"])
            rounds[name].append(medians[name])
            if ranks > 1 and plan == "eager":
                kind_hidden = [max(0.0, 1 - e / result["alone"]) for e in result["exposed"]]
                if kind == "ddp":
                    exposed.extend(result["exposed"])
                    alone.append(result["alone"])
                    hidden.extend(kind_hidden)
                    timeline = result["timeline"]
                else:
                    hidden_calls.extend(kind_hidden)
                    exposed_calls.extend(result["exposed"])
        for name, (*_, plan) in CASES.items():
            ratios[name].append(medians[name] / medians[BASELINE[plan]])
    cfg_line = f"config {args.config}, bucket cap {args.bucket_mb} MiB"
    print(f"\nstep time for the same global batch ({cfg_line}; {args.rounds} rounds of "
          f"{args.steps} steps after {WARMUP} warm-up):")
    print(f"{'case':<32} {'median ms':>10} {'best round':>11} {'x baseline':>11}")
    for name in CASES:
        print(f"{name:<32} {statistics.median(rounds[name]):>10.1f} {min(rounds[name]):>11.1f} "
              f"{statistics.median(ratios[name]):>11.2f}")
    print(f"\nall-reduce hidden behind backward (2 ranks, eager): median "
          f"{statistics.median(hidden):.0%} per step (min {min(hidden):.0%}, max "
          f"{max(hidden):.0%}), as 1 - (the wait after backward's end) / (the buckets' "
          f"all-reduce alone): waits of "
          f"{statistics.median(exposed) * 1e3:.1f} ms (median) against "
          f"{statistics.median(alone) * 1e3:.1f} ms alone")
    print(f"without the progress thread (MPI moved on only between gradients): median "
          f"{statistics.median(hidden_calls):.0%}, waits of "
          f"{statistics.median(exposed_calls) * 1e3:.1f} ms (median)")
    if args.plot and timeline is not None:
        plot(timeline, args.plot, f"data parallel, 2 ranks, {cfg_line}, eager: one step of "
                                  f"rank 0")
        print(f"timeline written to {args.plot}")

    print("\nmemory per rank with Adam, 2 ranks (DistributedDataParallel.memory_report), MiB:")
    keys = ("parameter_bytes", "gradient_bytes", "bucket_bytes", "optimizer_state_bytes")
    print(f"{'case':<18} {'rank':>4} " + " ".join(f"{k.replace('_bytes', ''):>16}"
                                                 for k in keys) + f" {'opt+grad+buckets':>17}")
    memory = {}
    undo: dict[str, tuple[float, float]] = {}
    for kind, label in (("adam", "data parallel"), ("zero1", "ZeRO stage 1"),
                        ("zero2", "ZeRO stage 2")):
        result = launch(kind, 2, "1", args)
        memory[label] = result["reports"]
        for report in result["reports"]:
            total = sum(report[k] for k in keys[1:])
            print(f"{label:<18} {report['rank']:>4} " + " ".join(
                f"{report[k] / 2**20:>16.2f}" for k in keys) + f" {total / 2**20:>17.2f}")
        if result["undo_ms"]:
            undo[label] = (statistics.median(result["undo_ms"]),
                           statistics.median(result["times_ms"]))
    print("\nthe same Adam steps captured by runtime.graph (static plan), 2 ranks, rank 0: step "
          "time against eager's (medians of the steps), and the plan's bytes:")
    captured = {}
    for kind, label in (("adam", "data parallel"), ("zero1", "ZeRO stage 1"),
                        ("zero2", "ZeRO stage 2")):
        eager_ms = statistics.median(launch(kind, 2, "1", args)["times_ms"])
        result = launch(kind, 2, "1", args, "static")
        static_ms = statistics.median(result["times_ms"])
        planned = result["reports"][0]["graph_planned_bytes"]
        captured[label] = {"eager_ms": eager_ms, "static_ms": static_ms,
                           "planned_bytes": planned}
        print(f"{label:<18} eager {eager_ms:7.1f} ms, static {static_ms:7.1f} ms "
              f"({static_ms / eager_ms:.2f}x), planned {planned / 2**20:.2f} MiB")
    for label, (copy_ms, step_ms) in undo.items():
        note = "Note [ZeRO's commit point is the gather]"
        print(f"{label}: the host copy kept for undo ({note}) took {copy_ms:.2f} ms of a "
              f"{step_ms:.1f} ms step on rank 0 ({copy_ms / step_ms:.1%}; medians of "
              f"{args.steps} steps)")
    load_after = os.getloadavg()
    print(f"\nload {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} after")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({
            "cpu": cpu_name(), "load_before": load_before, "load_after": load_after,
            "config": args.config, "rounds_ms": rounds, "ratios": ratios,
            "hidden": hidden, "exposed_s": exposed, "alone_s": alone,
            "hidden_without_thread": hidden_calls, "exposed_without_thread_s": exposed_calls,
            "memory": memory, "undo_ms": undo, "captured": captured},
            indent=1))


def main() -> None:
    from blockrt.models import CONFIGS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=list(CONFIGS), default="M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=5.0,
                        help="the bucket cap (default 5: a bucket per layer of M; PyTorch's "
                             "default 25 makes M one bucket, which nothing can overlap)")
    parser.add_argument("--plot", default="distributed_timeline.png")
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan", default="eager", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
