"""benchmarks/bench_models.py's side-by-side mode (`--interleaved`), at its smoke size: every
contender is timed in every round, and the table's ratios are those of the rounds."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import statistics
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed (the benchmarks' PyTorch side)")


@pytest.fixture
def bench_models():
    """The module, imported with this process's environment kept as it was (the benchmarks
    set BLOCKRT_BLAS and thread counts for their own runs when they load)."""
    saved = dict(os.environ)
    try:
        yield importlib.import_module("bench_models")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_interleaved_rounds_time_every_contender_and_the_table_reads_them(bench_models):
    from runtime import nn

    model = bench_models.models(quick=True)[0]
    nn.manual_seed(0)
    least = bench_models.least_budget(model, model.make_blockrt())
    times = bench_models.interleaved(model, 3, [least])
    assert list(times)[:2] == ["PyTorch eager", 'plan="static"'] and len(times) == 3
    assert list(times)[2].startswith("budget ")
    assert all(len(values) == 3 and min(values) > 0 for values in times.values())
    text = bench_models.interleaved_table(model, times)
    static = times['plan="static"']
    ratio = statistics.median(a / b for a, b in zip(static, times["PyTorch eager"]))
    assert f'| plan="static" | {min(static):.3f} |' in text
    assert f"| {ratio:.2f} | 1.00 |" in text
