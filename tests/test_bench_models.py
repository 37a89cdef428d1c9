"""benchmarks/bench_models.py's side-by-side mode (`--interleaved`), at its smoke size: every
contender is timed in every round, and the table's ratios are those of the rounds."""

from __future__ import annotations

import importlib.util
import pathlib
import statistics
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="torch is not installed (the benchmarks' PyTorch side)")


def test_interleaved_rounds_time_every_contender_and_the_table_reads_them():
    import bench_models

    model = bench_models.models(quick=True)[0]
    times = bench_models.interleaved(model, 3, [8 << 20])
    assert list(times) == ["PyTorch eager", 'plan="static"', "budget 8.00 MiB"]
    assert all(len(values) == 3 and min(values) > 0 for values in times.values())
    text = bench_models.interleaved_table(model, times)
    ratio = statistics.median(a / b for a, b in zip(times['plan="static"'],
                                                   times["PyTorch eager"]))
    static = times['plan="static"']
    assert f'| plan="static" | {min(static):.3f} |' in text
    assert f"| {ratio:.2f} | 1.00 |" in text
