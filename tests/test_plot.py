"""The memory-timeline plot (`blockrt.plot_memory_timeline`), which the demo and `blockrt plan
--plot` share: one line per plan, from 0, each visible where it lies on another, peaks named.
"""

from __future__ import annotations

import importlib.util

import pytest

import blockrt
from allocators import format_bytes
from blockrt import cli
from runtime import summary

plt = pytest.importorskip("matplotlib.pyplot", reason="the plot needs matplotlib (plot extra)")

KiB, MiB = 2**10, 2**20


def figure_of(timelines, title="t"):
    figure = summary._timeline_figure(plt, timelines, title)
    plt.close(figure)  # NOTE: the axes and lines stay readable
    axes = figure.axes[0]
    return axes, axes.get_lines()


def test_each_plan_is_one_line_from_zero_with_its_values_and_peak():
    timelines = {"none": [1 * MiB, 3 * MiB, 3 * MiB], "recycle": [1 * MiB, 2 * MiB, MiB // 2],
                 "static": [2 * MiB] * 3}
    axes, lines = figure_of(timelines)
    assert axes.get_ylim()[0] == 0
    assert axes.get_ylim()[1] >= 3
    assert axes.get_ylabel() == "MiB held by intermediates"
    assert len(lines) == 3
    for line, (name, values) in zip(lines, timelines.items()):
        assert list(line.get_ydata()) == [v / MiB for v in values] + [values[-1] / MiB]
        assert line.get_label() == f"{name}: peak {format_bytes(max(values))}"
    legend = [text.get_text() for text in axes.get_legend().get_texts()]
    assert legend == [line.get_label() for line in lines]


def test_lines_that_coincide_stay_visible():
    same = [5 * KiB, 7 * KiB, 7 * KiB]
    _, lines = figure_of({"none": same, "recycle": same, "static": same})
    widths = [line.get_linewidth() for line in lines]
    assert widths == sorted(widths, reverse=True) and len(set(widths)) == 3  # widest first
    assert len({line.get_color() for line in lines}) == 3


@pytest.mark.parametrize(("top", "unit"), [(3 * MiB, "MiB"), (MiB - 1, "KiB"), (KiB, "KiB"),
                                           (KiB - 1, "B"), (0, "B")])
def test_the_unit_follows_the_largest_value(top, unit):
    axes, _ = figure_of({"static": [0, top]})
    assert axes.get_ylabel() == f"{unit} held by intermediates"
    assert axes.get_ylim()[0] == 0 and axes.get_ylim()[1] > 0


@pytest.mark.parametrize(("timelines", "message"), [
    ({}, "at least one timeline"),
    ({"none": []}, "'none' must hold at least one"),
    ({"none": [3, -1]}, "none negative"),
])
def test_bad_timelines_are_refused_naming_the_problem(timelines, message):
    with pytest.raises(ValueError, match=message):
        summary._timeline_figure(plt, timelines, "t")


def test_the_plot_is_written_as_a_png(tmp_path):
    path = tmp_path / "t.png"
    assert blockrt.plot_memory_timeline({"static": [64, 128]}, str(path)) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_draws_a_line_per_plan_of_one_training_step():
    for module in cli.DEMO_MODULES:
        pytest.importorskip(module, reason=f"the demo needs {module} (the demo extra)")
    spec = importlib.util.spec_from_file_location("train_mlp", cli.ROOT / "examples" /
                                                  "train_mlp.py")
    train_mlp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_mlp)
    x_train, _, y_train, _ = train_mlp.load()
    lines = train_mlp.timelines(x_train[:16], y_train[:16])
    assert list(lines) == list(blockrt.PLANS)
    assert len({len(line) for line in lines.values()}) == 1  # the same schedule under each plan
    peaks = [max(line) for line in lines.values()]
    # NOTE: none above static; recycle never above static (runtime/graph/memory.py,
    # `_recycle_or_one_arena`): on the demo's step (Adam's commit point comes early) it takes
    # the static placement, and its line is static's
    assert peaks[0] > peaks[2] >= peaks[1] > 0, peaks
    assert len(set(lines["static"])) == 1  # one arena, held throughout
