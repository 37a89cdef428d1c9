"""The training benchmark's contenders compute the same training steps as a plain NumPy reference.

Three steps at batch 8, width 16, depth 3 from the same weights and batch: losses and updated
weights must agree to float32 tolerance (benchmarks/mlp_reference.py says which).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

import mlp_reference


def assert_matches_reference(name: str) -> None:
    try:
        diff = mlp_reference.check_against_reference(mlp_reference.CONTENDERS[name])
    except mlp_reference.ContenderUnavailable as e:
        pytest.skip(str(e))
    assert diff["moved"] > 100 * mlp_reference.PARAM_ATOL  # the steps changed the weights
    assert diff["loss"] <= mlp_reference.LOSS_ATOL
    assert diff["params"] <= mlp_reference.PARAM_ATOL


def test_numpy_prealloc_matches_the_reference():
    assert_matches_reference("numpy-prealloc")


def test_numpy_prealloc_trains_its_own_copy_of_the_weights():
    config = mlp_reference.CHECK_CONFIG
    x, labels = mlp_reference.make_batch(config)
    start = mlp_reference.init_params(config)
    trainer = mlp_reference.make_numpy_prealloc(start, x, labels)
    first = trainer.step()
    for _ in range(20):
        last = trainer.step()
    assert last < first  # training on one batch lowers its loss
    for (weight, bias), (weight0, bias0) in zip(start, mlp_reference.init_params(config)):
        np.testing.assert_array_equal(weight, weight0)
        np.testing.assert_array_equal(bias, bias0)


def test_blockrt_eager_matches_the_reference():
    assert_matches_reference("blockrt-eager")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed (optional: pip install torch==2.13.0)")
def test_torch_matches_the_reference():
    assert_matches_reference("torch")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed (optional: pip install torch==2.13.0)")
# NOTE: torch.compile's own imports and tracing warn (deprecations, a .grad it reads itself)
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_torch_compile_matches_the_reference():
    # skipped (ContenderUnavailable) where Inductor has no C++ compiler
    assert_matches_reference("torch-compile")


def test_blockrt_static_mixed_matches_the_reference(monkeypatch):
    from backends import _blas

    monkeypatch.setattr(_blas, "_found", [])  # NOTE: it puts a route of its own there
    assert_matches_reference("blockrt-static-mixed")


@pytest.mark.skipif(importlib.util.find_spec("tinygrad") is None,
                    reason="tinygrad is not installed (optional: pip install tinygrad)")
def test_tinygrad_matches_the_reference():
    # skipped (ContenderUnavailable) where tinygrad's CPU device has no clang to compile with
    assert_matches_reference("tinygrad")


# ---------------------------------------------------------------------- the harness
import bench_train  # noqa: E402  (after the path insert above)

from backends import _blas  # noqa: E402


def test_ratios_pair_rounds_and_best_is_the_fastest_step():
    a = [[2.0, 1.0], [4.0, 5.0], [3.0]]
    b = [[2.0], [2.0, 8.0], [1.0]]
    assert bench_train.best_ms(a) == 1.0
    assert bench_train.best_ms([]) is None
    assert bench_train.paired_ratio(a, b) == 2.0  # the median of 0.5, 2.0 and 3.0
    assert bench_train.paired_ratio(a, None) is None
    assert bench_train.rounds_won(a, b) == (1, 3)  # only the 0.5 round
    assert bench_train.rounds_won(b, a) == (2, 3)
    assert bench_train.rounds_won(a, None) == (0, 0)
    members = bench_train.GROUPS["[static forced]"]
    rounds = {members[0]: a, members[1]: b}
    assert bench_train.rounds_of("[static forced]", rounds) == [[1.0], [2.0], [1.0]]
    assert bench_train.rounds_of(members[0], rounds) is a
    assert bench_train.rounds_of("[eager forced]", rounds) is None  # its contenders did not run


def test_a_quick_run_serves_rounds_from_long_lived_children():
    result = bench_train.run_config("S", ["numpy-prealloc", "blockrt-static"], rounds=2,
                                    quick=True, seconds=0.01)
    for name in ("numpy-prealloc", "blockrt-static"):
        rounds = result["rounds"][name]
        assert len(rounds) == 2 and all(len(r) >= 2 and min(r) > 0 for r in rounds)
        record = result["records"][name]
        assert record["status"] == "ok" and record["added_by_training_kib"] is not None
    assert bench_train.first_loss_spread(result["records"]) < 1e-3


def test_the_openblas_contender_runs_on_openblas():
    result = bench_train.run_config("S", ["blockrt-static", "blockrt-static-openblas"], rounds=1,
                                    quick=True, seconds=0.01)
    records = result["records"]
    assert records["blockrt-static-openblas"]["blas"].startswith("OpenBLAS")
    assert records["blockrt-static-openblas"]["blas"].endswith("(BLOCKRT_BLAS=openblas)")
    names = [lib.name for lib in _blas.present()]
    chosen, _, how = records["blockrt-static"]["blas"].partition(" (")
    if len(names) > 1:  # the quick S products are small: nothing measured, nothing chosen yet
        assert records["blockrt-static"]["blas"] == "not chosen yet (waiting)"
    else:
        assert chosen == names[0] and how == "the only CBLAS here)"
    for record in records.values():
        assert record["cpu"] == bench_train.cpu_name()


def test_the_check_runs_the_openblas_contender_on_openblas(capsys):
    assert bench_train.run_check(["blockrt-static-openblas"]) == 0
    out = capsys.readouterr().out
    assert "blockrt-static-openblas: ok" in out and "products on OpenBLAS" in out


def test_the_check_runs_each_forced_library_in_a_process_of_its_own(capsys):
    names = ["blockrt-static-mkl", "blockrt-eager-mkl", "blockrt-eager-openblas"]
    assert bench_train.run_check(names) == 0
    out = capsys.readouterr().out
    for name in names:
        library = "MKL" if name.endswith("mkl") else "OpenBLAS"
        if _blas.load(name.rpartition("-")[2]) is None:
            assert f"{name}: skipped" in out
        else:
            assert f"{name}: ok" in out and f"products on {library}" in out
