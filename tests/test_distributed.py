"""Data-parallel and sharded training over MPI (runtime/distributed.py, runtime/parallel.py,
nn.DistributedDataParallel, nn.ZeroRedundancyOptimizer).

The MPI tests start `mpiexec -n N` (the one the `mpich` wheel puts beside this Python) on
tests/mpi/worker.py with a hard timeout, one BLAS thread per rank, and compare what each rank
wrote with a single process's full-batch steps computed here. Without mpi4py or mpiexec they
skip, saying so. The gradient-ready hooks of autograd and the bucket plan are tested in this
process, without MPI.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import backends
import runtime
from runtime import autograd, nn, ops, parallel

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "mpi" / "worker.py"
sys.path.insert(0, str(WORKER.parent))
import worker  # noqa: E402 - the ranks' model and data, shared with the reference here


def _mpiexec() -> str | None:
    beside = pathlib.Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install -e '.[mpi]': mpi4py and mpich)"
    if _mpiexec() is None:
        return "no mpiexec (pip install mpich puts one beside python)"
    return None


needs_mpi = pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
DEVICES = ["cpu", pytest.param("opencl", marks=pytest.mark.skipif(
    "opencl" not in backends.available(), reason="no OpenCL device")),
    # NOTE: through the host, as OpenCL; every rank on the one GPU is fine for that
    pytest.param("cuda", marks=pytest.mark.skipif(
        "cuda" not in backends.available(), reason="no CUDA device (CuPy and a GPU)"))]


def _launch(ranks: int, scenario: str, device: str, out: pathlib.Path, *launcher: str,
            timeout: float = 60, worker_timeout: float = 20) -> subprocess.CompletedProcess:
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               BLOCKRT_BLAS="openblas", WORKER_TIMEOUT=str(worker_timeout),
               PYTHONPATH=str(ROOT))
    command = [_mpiexec(), *launcher, "-n", str(ranks), sys.executable, str(WORKER), scenario,
               device, str(out)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


def _ranks(out: pathlib.Path, ranks: int) -> list[dict[str, np.ndarray]]:
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(ranks)]


def _reference(model: nn.Module, optimizer: type, **options) -> dict[str, np.ndarray]:
    """One process, the whole batch, the workers' model and steps."""
    x, y = worker.data()
    step = nn.train_step(model, optimizer(model.parameters(), **options))
    for _ in range(worker.STEPS):
        step(runtime.tensor(x), y)
    return worker.params_of(model)


# ---------------------------------------------------------------------- over MPI
@needs_mpi
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ranks", [2, 3])
def test_ddp_equals_the_full_batch_step_and_ranks_stay_identical(ranks, device, tmp_path):
    done = _launch(ranks, "ddp", device, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = _ranks(tmp_path, ranks)
    reference = _reference(worker.model(1), nn.SGD, lr=0.1, momentum=0.9)
    plain = _reference(worker.model(1), nn.SGD, lr=0.1)
    assert int(results[0]["buckets"]) > 1  # the worker's small cap makes several buckets
    start = worker.params_of(worker.model(1))
    moved = 0.0
    for name, expected in reference.items():
        for result in results[1:]:
            assert np.array_equal(result[name], results[0][name]), name  # bit for bit
        np.testing.assert_allclose(results[0][name], expected, rtol=1e-5, atol=1e-6,
                                   err_msg=name)
        moved = max(moved, float(np.abs(expected - start[name]).max()))
        # inside runtime.graph (OpenCL through a host copy of each bucket), with and without
        # the fold of plain SGD into the product; with momentum, eager's bits
        assert np.array_equal(results[0][f"graph0.9/{name}"], results[0][name]), name
        for key, want in ((f"graph0.9/{name}", expected), (f"graph0.0/{name}", plain[name])):
            for result in results[1:]:
                assert np.array_equal(result[key], results[0][key]), key
            np.testing.assert_allclose(results[0][key], want, rtol=1e-5, atol=1e-6,
                                       err_msg=key)
    assert moved > 1e-3  # the steps changed the parameters: the comparison says something


@needs_mpi
@pytest.mark.parametrize("device", DEVICES)
def test_two_byte_parameters_train_data_parallel_inside_a_graph_as_eagerly(device, tmp_path):
    # gradients are summed in float32 and rounded back once (`_staging_dtype`); a captured
    # step does the same through its planned float32 bucket buffers
    done = _launch(2, "ddp-half", device, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = _ranks(tmp_path, 2)
    names = [k.split("/", 2)[2] for k in results[0] if k.startswith("float16/eager/")]
    assert names
    for dtype in ("float16", "bfloat16"):
        for name in names:
            eager = results[0][f"{dtype}/eager/{name}"]
            assert np.array_equal(results[0][f"{dtype}/graph/{name}"], eager), (dtype, name)
            assert np.array_equal(results[1][f"{dtype}/graph/{name}"], eager), (dtype, name)
            assert not np.array_equal(results[0][f"{dtype}/start/{name}"], eager), name


@needs_mpi
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ranks", [2, 3])
def test_zero_stages_equal_data_parallel_with_a_shard_of_the_state(ranks, device, tmp_path):
    done = _launch(ranks, "zero", device, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    results = _ranks(tmp_path, ranks)
    reference = _reference(worker.wide_model(2), nn.Adam, lr=0.01)
    for name, expected in reference.items():
        # NOTE: Adam divides by sqrt(v): a gradient near zero, summed in another order, moves
        # its step by more than its own rounding (1.3e-6 seen at lr 0.01 with 3 ranks)
        np.testing.assert_allclose(results[0][f"stage0/{name}"], expected, rtol=1e-4,
                                   atol=1e-5, err_msg=name)
        for result in results:
            assert np.array_equal(result[f"graph-stage0/{name}"], results[0][f"stage0/{name}"])
        for stage in (1, 2):
            for result in results:  # every rank, every stage, eager or in a graph: data
                # parallel's bits (Note [ZeRO in a plan] in runtime/parallel.py)
                for mode in ("stage", "graph-stage"):
                    assert np.array_equal(result[f"{mode}{stage}/{name}"],
                                          results[0][f"stage0/{name}"]), (mode, stage, name)
    for result in results:  # a captured ZeRO step plans less than a data-parallel one: its
        # gradients are 1/N and its buckets take turns in one buffer
        for stage in (1, 2):
            assert result[f"graph-stage{stage}/planned"] < result["graph-stage0/planned"]

    def report(result, stage):
        prefix = f"stage{stage}/report/"
        return {k[len(prefix):]: int(v) for k, v in result.items() if k.startswith(prefix)}

    for result in results:
        dp, one, two = (report(result, stage) for stage in (0, 1, 2))
        assert dp["buckets"] >= 4  # several buckets: stage 2 reuses two buffers among them
        padding = 4 * ranks * dp["buckets"]  # each bucket padded to a multiple of N floats
        for sharded in (one, two):  # 1/N of data parallel's optimizer state and gradients
            assert sharded["optimizer_state_bytes"] <= (
                dp["optimizer_state_bytes"] + 2 * padding) / ranks
            assert sharded["gradient_bytes"] <= (dp["gradient_bytes"] + padding) / ranks
        # the bound: each stage's optimizer state, gradients and buffers are 1/N of
        # data parallel's optimizer state and gradients, plus one bucket (stage 1 too: its
        # buckets take turns in one buffer, each part copied out once its all-reduce is done)
        dp_total = dp["optimizer_state_bytes"] + dp["gradient_bytes"]
        for sharded in (one, two):
            total = (sharded["optimizer_state_bytes"] + sharded["gradient_bytes"]
                     + sharded["bucket_bytes"])
            assert total <= (dp_total + 3 * padding) / ranks + sharded["largest_bucket_bytes"]
            assert (sharded["bucket_bytes"] == sharded["largest_bucket_bytes"]
                    < dp["bucket_bytes"] / 2)


@needs_mpi
@pytest.mark.parametrize("scenario", ["raise", "raise-graph"])
def test_a_rank_that_raises_makes_the_others_fail_at_once_unchanged(scenario, tmp_path):
    done = _launch(3, scenario, "cpu", tmp_path, timeout=60, worker_timeout=30)
    assert done.returncode != 0
    assert "ValueError: an injected failure on rank 1" in done.stderr
    for rank in (0, 2):
        result = dict(np.load(tmp_path / f"rank{rank}.npz"))
        # told by rank 1 long before the 30 s timeout, with rank 1's error
        assert "rank 1 failed: ValueError: an injected failure on rank 1" in str(
            result["message"])
        assert bool(result["unchanged"])  # the step stopped before its first write


@needs_mpi
@pytest.mark.parametrize("scenario", ["raise-zero", "raise-zero-graph"])
def test_a_zero_step_that_fails_in_the_gather_puts_back_the_shards_and_their_state(scenario,
                                                                                   tmp_path):
    # ranks 0 and 2 step their shards, Adam's moments and its bias corrections, then meet rank
    # 1's failure in the all-gather (Note [ZeRO's commit point is the gather] in
    # runtime/nn.py), eagerly or in a replay of the captured step
    done = _launch(3, scenario, "cpu", tmp_path, timeout=60, worker_timeout=30)
    assert done.returncode != 0
    assert "an injected failure in rank 1's optimizer step" in done.stderr
    for rank in (0, 2):
        result = dict(np.load(tmp_path / f"rank{rank}.npz"))
        assert "rank 1 failed" in str(result["message"])
        assert bool(result["unchanged"])
        assert bool(result["restored"])


@needs_mpi
def test_a_rank_that_dies_makes_the_others_time_out_unchanged(tmp_path):
    # the launcher keeps the others running: they must not hang, but time out, clearly
    done = _launch(2, "die", "cpu", tmp_path, "-disable-auto-cleanup", timeout=60,
                   worker_timeout=2)
    assert done.returncode != 0
    result = dict(np.load(tmp_path / "rank0.npz"))
    message = str(result["message"])
    assert "did not complete within 2 s" in message and "all-reduce of bucket" in message
    assert bool(result["unchanged"])


@needs_mpi
def test_a_rank_that_dies_under_the_default_launcher_ends_the_job(tmp_path):
    done = _launch(2, "die", "cpu", tmp_path, timeout=60, worker_timeout=30)
    assert done.returncode != 0  # MPICH's mpiexec ends the job, well within our timeout


# ---------------------------------------------------------------------- in this process
class _Recorder:
    """A ready hook that records what it saw, optionally taking the gradients."""

    def __init__(self, take: bool = False) -> None:
        self.take = take
        self.seen: list[tuple[str, np.ndarray]] = []
        self.finished = 0
        self.abandoned: list[BaseException] = []

    def ready(self, leaf, grad):
        self.seen.append((leaf.name, grad.numpy()))
        return self.take

    def finish(self):
        self.finished += 1
        return []

    def abandon(self, error):
        self.abandoned.append(error)


def _mlp() -> tuple[nn.Module, runtime.Tensor, np.ndarray]:
    nn.manual_seed(4)
    model = nn.Sequential(nn.Dense(3, 4), nn.Tanh(), nn.Dense(4, 2))
    x = runtime.tensor(np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32))
    return model, x, np.array([0, 1, 1, 0, 1])


def test_ready_hooks_see_each_whole_gradient_once_in_backward_order():
    model, x, y = _mlp()
    nn.softmax_cross_entropy(model(x), y).backward()
    expected = {name: p.grad.numpy() for name, p in model.named_parameters()}
    model.zero_grad()
    hook = _Recorder()
    removers = [autograd.register_ready_hook(p, hook) for p in model.parameters()]
    nn.softmax_cross_entropy(model(x), y).backward()
    names = [name for name, _ in hook.seen]
    assert sorted(names) == sorted(expected) and hook.finished == 1
    assert names.index("2.weight") < names.index("0.weight")  # the last layer is ready first
    for name, grad in hook.seen:
        assert np.array_equal(grad, expected[name])  # whole when reported
    for name, p in model.named_parameters():
        assert np.array_equal(p.grad.numpy(), expected[name])  # stored as without the hook
    for remove in removers:
        remove()


def test_a_leaf_used_twice_is_ready_after_its_last_use():
    w = runtime.tensor(np.array([1.0, 2.0], np.float32), requires_grad=True)
    w.name = "w"
    hook = _Recorder()
    remove = autograd.register_ready_hook(w, hook)
    ops.sum(ops.mul(ops.tanh(w), w)).backward()
    assert len(hook.seen) == 1
    t = np.tanh(np.array([1.0, 2.0]))
    np.testing.assert_allclose(hook.seen[0][1], (1 - t * t) * [1, 2] + t, rtol=1e-6)
    remove()


def test_a_hook_that_takes_the_gradients_leaves_grad_unset_and_frees_them():
    model, x, y = _mlp()
    hook = _Recorder(take=True)
    removers = [autograd.register_ready_hook(p, hook) for p in model.parameters()]
    nn.softmax_cross_entropy(model(x), y).backward()
    assert len(hook.seen) == 4
    assert all(p.grad is None for p in model.parameters())
    for remove in removers:
        remove()


def test_a_failing_hook_stores_nothing_and_every_hook_hears_of_it():
    model, x, y = _mlp()
    nn.softmax_cross_entropy(model(x), y).backward()
    before = {name: p.grad.numpy() for name, p in model.named_parameters()}

    class Failing(_Recorder):
        def finish(self):
            raise RuntimeError("the collective failed")

    hook = Failing()
    removers = [autograd.register_ready_hook(p, hook) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="the collective failed"):
        nn.softmax_cross_entropy(model(x), y).backward()
    assert len(hook.abandoned) == 1
    for name, p in model.named_parameters():  # accumulation did not happen: as before
        assert np.array_equal(p.grad.numpy(), before[name])
    for remove in removers:
        remove()


def test_ready_hooks_are_held_weakly_and_one_per_leaf():
    w = runtime.tensor(np.ones(2, np.float32), requires_grad=True)
    hook = _Recorder()
    autograd.register_ready_hook(w, hook)
    with pytest.raises(runtime.AutogradError, match="has a ready hook already"):
        autograd.register_ready_hook(w, _Recorder())
    del hook
    import gc

    gc.collect()
    assert id(w) not in autograd._ready_hooks
    remove = autograd.register_ready_hook(w, _Recorder())  # the old one died with its hook
    remove()
    with pytest.raises(runtime.AutogradError, match="leaf tensor that requires grad"):
        autograd.register_ready_hook(runtime.tensor(np.ones(2, np.float32)), _Recorder())


@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["float32", "float64"])),
                min_size=1, max_size=12), st.integers(4, 200))
def test_bucket_plan_covers_every_parameter_in_reverse_order_under_the_cap(shapes, cap):
    params = [runtime.tensor(np.zeros(n, dtype), requires_grad=True) for n, dtype in shapes]
    plan = parallel.bucket_plan(params, cap)
    order = [i for bucket in plan for i in bucket]
    assert order == list(reversed(range(len(params))))
    for bucket in plan:
        assert len({params[i].dtype for i in bucket}) == 1
        nbytes = sum(params[i].nbytes for i in bucket)
        assert nbytes <= cap or len(bucket) == 1
    for first, second in zip(plan, plan[1:]):  # a new bucket only where it had to be
        more = params[second[0]]
        assert (more.dtype != params[first[0]].dtype
                or sum(params[i].nbytes for i in first) + more.nbytes > cap)


def test_ddp_refuses_bad_arguments_clearly():
    model, _, _ = _mlp()
    with pytest.raises(TypeError, match="group must be a distributed.Group"):
        nn.DistributedDataParallel(model, object())
    with pytest.raises(TypeError, match="wraps a Module"):
        nn.DistributedDataParallel("model", object())


# ---------------------------------------------------------------------- the demo
@needs_mpi
def test_the_demo_on_two_ranks_reaches_one_process_accuracy(tmp_path):
    pytest.importorskip("sklearn", reason="the demo needs scikit-learn (the demo extra)")
    script = ROOT / "examples" / "train_mlp.py"
    common = ["--epochs", "1", "--batch", "32", "--no-progress", "--seed", "3", "--plot"]

    def accuracies(*more: str) -> tuple[float, float]:
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1", BLOCKRT_BLAS="openblas")
        done = subprocess.run([sys.executable, str(script), *common, *more], env=env,
                              capture_output=True, text=True, timeout=90, cwd=ROOT)
        found = re.search(r"train accuracy ([\d.]+), test accuracy ([\d.]+)", done.stdout)
        assert found, done.stdout[-2000:] + done.stderr[-2000:]
        return float(found[1]), float(found[2])

    one = accuracies(str(tmp_path / "one.png"))
    two = accuracies(str(tmp_path / "two.png"), "--ranks", "2")
    # the same steps within float32 rounding: at most one image of 1347 / 450 apart
    assert abs(one[0] - two[0]) <= 1 / 1347 + 1e-9 and abs(one[1] - two[1]) <= 1 / 450 + 1e-9
    assert one[1] > 0.9  # it learned
