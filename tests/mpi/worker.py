"""One rank of the MPI tests of tests/test_distributed.py (run under mpiexec by them).

    mpiexec -n N python tests/mpi/worker.py SCENARIO DEVICE OUTDIR

Each rank trains a tiny model on its part of a fixed batch and writes what it ended with to
OUTDIR/rank<r>.npz (parameters, memory reports), which the test compares with a single
process's full-batch steps. SCENARIO: "ddp" (SGD with momentum, small buckets), "ddp-half"
(float16 and bfloat16 parameters, eagerly and inside runtime.graph), "zero" (Adam data
parallel beside ZeRO stages 1 and 2), "raise" / "die" / "raise-graph" (rank 1 fails before a
step, eagerly or between replays of a captured step; the others record whether their
parameters are as before it, then fail too), "raise-zero" and "raise-zero-graph" (rank 1
fails in its ZeRO optimizer step, eagerly or in a replay of the captured step, after the others
stepped their shards: they record whether their parameters, shards and shard state are as
before it).
"""

from __future__ import annotations

import os
import sys

import numpy as np

import backends
import runtime
from runtime import distributed, nn, tensor

STEPS = 3
BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return (rng.standard_normal((BATCH, 5)).astype(np.float32),
            rng.integers(0, 3, BATCH))


def model(seed: int) -> nn.Module:
    nn.manual_seed(seed)
    return nn.Sequential(nn.Dense(5, 16), nn.Tanh(), nn.Dense(16, 8), nn.ReLU(),
                         nn.Dense(8, 3))


def wide_model(seed: int) -> nn.Module:
    """Five layers, so that a small cap makes several buckets of about the same size."""
    nn.manual_seed(seed)
    layers = [nn.Dense(5, 16), nn.Tanh()]
    for _ in range(3):
        layers += [nn.Dense(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Dense(16, 3))


def local(x: np.ndarray, y: np.ndarray, group, device):
    part = BATCH // group.size
    rows = slice(group.rank * part, (group.rank + 1) * part)
    return tensor(x[rows], device=device), y[rows]


def params_of(m: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.numpy() for name, t in m.state_dict().items()}


def main() -> None:
    scenario, device_name, out = sys.argv[1], sys.argv[2], sys.argv[3]
    device = backends.get_device(device_name)

    runtime.set_default_device(device)
    group = distributed.init(timeout=float(os.environ.get("WORKER_TIMEOUT", "20")))
    x, y = data()
    xb, yb = local(x, y, group, device)
    result: dict[str, np.ndarray] = {}
    if scenario == "ddp":
        ddp = nn.DistributedDataParallel(model(1), group, bucket_cap_mb=0.0005)
        step = nn.train_step(ddp, nn.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
        for _ in range(STEPS):
            step(xb, yb)
        result.update(params_of(ddp.module))
        result["buckets"] = np.array(len(ddp.reducer.buckets))
        ddp.reducer.close()
        # the same inside runtime.graph's static plan, plain SGD too (its product fold)
        for momentum in (0.9, 0.0):
            ddp = nn.DistributedDataParallel(model(1), group, bucket_cap_mb=0.0005)
            step = runtime.graph(nn.train_step(ddp, nn.SGD(ddp.parameters(), lr=0.1,
                                                           momentum=momentum)))
            for _ in range(STEPS):  # NOTE: OpenCL and CUDA through a host copy, as eagerly
                step(xb, yb)
            for name, value in params_of(ddp.module).items():
                result[f"graph{momentum}/{name}"] = value
            ddp.reducer.close()
    elif scenario == "ddp-half":  # two-byte parameters, eagerly and inside runtime.graph
        for dtype in ("float16", "bfloat16"):
            for mode in ("eager", "graph"):
                nn.manual_seed(1)
                net = nn.Sequential(nn.Dense(5, 16, dtype=dtype), nn.Tanh(),
                                    nn.Dense(16, 3, dtype=dtype))
                for name, value in params_of(net).items():
                    result[f"{dtype}/start/{name}"] = value.astype(np.float32)
                ddp = nn.DistributedDataParallel(net, group, bucket_cap_mb=0.0005)
                step = nn.train_step(ddp, nn.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
                if mode == "graph":
                    step = runtime.graph(step)
                half = tensor(xb.numpy().astype(net[0].weight.dtype), device=device)
                for _ in range(STEPS):
                    step(half, yb)
                for name, value in params_of(ddp.module).items():
                    result[f"{dtype}/{mode}/{name}"] = value.astype(np.float32)
                ddp.reducer.close()
    elif scenario == "zero":
        for stage in (0, 1, 2):
            ddp = nn.DistributedDataParallel(wide_model(2), group, bucket_cap_mb=0.0011,
                                             zero_stage=stage)
            opt = (nn.Adam(ddp.parameters(), lr=0.01) if stage == 0
                   else nn.ZeroRedundancyOptimizer(ddp, nn.Adam, lr=0.01))
            step = nn.train_step(ddp, opt)
            for _ in range(STEPS):
                step(xb, yb)
            for name, value in params_of(ddp.module).items():
                result[f"stage{stage}/{name}"] = value
            # the same steps captured by runtime.graph (Note [ZeRO in a plan])
            gddp = nn.DistributedDataParallel(wide_model(2), group, bucket_cap_mb=0.0011,
                                              zero_stage=stage)
            graphed = runtime.graph(nn.train_step(
                gddp, nn.Adam(gddp.parameters(), lr=0.01) if stage == 0
                else nn.ZeroRedundancyOptimizer(gddp, nn.Adam, lr=0.01)))
            for _ in range(STEPS):
                graphed(xb, yb)
            for name, value in params_of(gddp.module).items():
                result[f"graph-stage{stage}/{name}"] = value
            result[f"graph-stage{stage}/planned"] = np.array(
                graphed.memory_report()["planned_bytes"])
            gddp.reducer.close()
            # the step's zero_grad dropped the gradients: count them after one more backward
            nn.softmax_cross_entropy(ddp(xb), yb).backward()
            report = ddp.memory_report(opt)
            for key, value in report.items():
                result[f"stage{stage}/report/{key}"] = np.array(value)
            opt.zero_grad()
            ddp.reducer.close()
    elif scenario in ("raise-zero", "raise-zero-graph"):  # rank 1 fails in its optimizer
        # step (eagerly) or just before its gather (in a graph), after the others stepped
        ddp = nn.DistributedDataParallel(wide_model(2), group, bucket_cap_mb=0.0011,
                                         zero_stage=2)
        opt = nn.ZeroRedundancyOptimizer(ddp, nn.Adam, lr=0.01)
        step = nn.train_step(ddp, opt)
        if scenario == "raise-zero-graph":
            step = runtime.graph(step)
            step(xb, yb)
        step(xb, yb)

        def shard_state() -> dict[str, np.ndarray]:
            found = {f"shard{k}": p.numpy().copy() for k, p in enumerate(opt.params)}
            for k, p in enumerate(opt.params):
                for name, value in opt.state[id(p)].items():
                    found[f"shard{k}/{name}"] = np.asarray(
                        value.numpy() if hasattr(value, "numpy") else value).copy()
            for k, t in enumerate(opt.optimizer.state_tensors()):
                found[f"state{k}"] = t.numpy().copy()
            return found

        before, shards = params_of(ddp.module), shard_state()
        if group.rank == 1:
            def fail(*args) -> None:
                error = ValueError("an injected failure in rank 1's optimizer step")
                group.fail(error)  # NOTE: as the reducer tells the others of a failed pass
                raise error
            if scenario == "raise-zero":
                opt.optimizer.step = fail
            else:  # NOTE: the replay's gather, which the graph calls through the reducer
                ddp.reducer._replay_gather = fail
            step(xb, yb)
        try:
            step(xb, yb)
        except distributed.DistributedError as error:
            same = all(np.array_equal(before[k], v) for k, v in params_of(ddp.module).items())
            after = shard_state()
            restored = after.keys() == shards.keys() and all(
                np.array_equal(shards[k], after[k]) for k in shards)
            np.savez(os.path.join(out, f"rank{group.rank}.npz"),
                     message=np.array(str(error)), unchanged=np.array(same),
                     restored=np.array(restored))
            raise
        raise SystemExit(f"rank {group.rank}: the step did not fail")
    elif scenario in ("raise", "die", "raise-graph"):
        ddp = nn.DistributedDataParallel(model(3), group)
        step = nn.train_step(ddp, nn.SGD(ddp.parameters(), lr=0.1, momentum=0.9))
        if scenario == "raise-graph":  # the failure meets a replay of the captured step
            step = runtime.graph(step)
            step(xb, yb)
        step(xb, yb)
        before = params_of(ddp.module)
        if group.rank == 1:
            if scenario != "die":
                raise ValueError("an injected failure on rank 1")
            os._exit(3)
        try:
            step(xb, yb)
        except distributed.DistributedError as error:
            same = all(np.array_equal(before[k], v) for k, v in params_of(ddp.module).items())
            np.savez(os.path.join(out, f"rank{group.rank}.npz"),
                     message=np.array(str(error)), unchanged=np.array(same))
            raise
        raise SystemExit(f"rank {group.rank}: the step did not fail")
    np.savez(os.path.join(out, f"rank{group.rank}.npz"), **result)


if __name__ == "__main__":
    main()
