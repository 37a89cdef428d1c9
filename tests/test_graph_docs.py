"""The figures of docs/graph.md that a test can check, parsed from the page and compared with what
the runtime gives now (issue 28, part 4: the page said "step 4 of 43" where the report said 42,
and named a configuration the command line does not have). Figures that need a long run or a
given machine carry their date and machine on the page instead. Also what `eager_bytes` claims
to be (issue 28, part 6): the least an eager step holds, next to what one measurably holds."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import pathlib
import re
import sys

import numpy as np
import pytest
from test_budget import activation_table

import allocators
import blockrt
import runtime
from allocators import StatisticsAdaptor, format_bytes
from blockrt import nn
from runtime.graph.budget import _table

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_graph import eager_peak, training_graph  # noqa: E402
from mlp_reference import make_batch  # noqa: E402

from blockrt.models import CONFIGS  # noqa: E402

PAGE = (ROOT / "docs" / "graph.md").read_text()
#: the page's text with every run of white space (line breaks included) as one space
FLAT = " ".join(PAGE.split())


def figure(pattern: str) -> re.Match:
    """The one match of `pattern` in the page's flattened text."""
    found = list(re.finditer(pattern, FLAT))
    assert len(found) == 1, f"docs/graph.md: {len(found)} matches of {pattern!r}"
    return found[0]


def folds_products() -> None:
    """The page's memory figures are of the CPU device's graphs, whose weight updates fold
    into one gemm."""
    device = runtime.get_default_device()
    if device.name != "cpu":
        pytest.skip(f"the page's memory figures are of the CPU device, not {device.name} "
                    "(its allocator's sizes)")
    if not device.capabilities.gemm_accumulates:
        pytest.skip("the CPU device's gemm does not accumulate here (no CBLAS): the page's "
                    "figures are of graphs that fold weight gradients into their updates")


def compiles_chains() -> None:
    """The page's peaks are of the CPU's compiled chains, which need no scratch."""
    if not runtime.get_default_device().capabilities.compiles_fused:
        pytest.skip("the default device runs fused chains in blocks with scratch here (the "
                    "CPU's C extension is not built): the page's peaks are of compiled chains")


def test_the_demos_commit_point_is_the_pages():
    found = figure(r"in the demo the commit point \(`commit_step`\) is step (\d+), counted "
                   r"from 0, of (\d+)")
    pytest.importorskip("sklearn", reason="the demo imports scikit-learn")
    pytest.importorskip("tqdm", reason="the demo imports tqdm")
    spec = importlib.util.spec_from_file_location("train_mlp", ROOT / "examples" /
                                                  "train_mlp.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    model = demo.make_model()
    step = blockrt.graph(nn.train_step(model, nn.Adam(model.parameters(), lr=demo.LR)))
    step(np.zeros((16, 64), np.float32), np.arange(16) % 10)  # NOTE: the demo's batch
    report = step.memory_report()
    assert (report["commit_step"], report["steps"]) == (int(found[1]), int(found[2]))
    assert len(step.timeline()) == report["steps"]


def peaks(config_name: str, plan: str) -> dict:
    """The memory report of bench_graph's training graph of a config under `plan`, on a caching
    allocator of its own (a shared one may hand an arena a larger cached block)."""
    config = CONFIGS[config_name]
    graph = training_graph(config, plan=plan, allocator=allocators.create("caching", "cpu"))
    graph(*make_batch(config))
    return graph.memory_report()


def test_recycle_and_static_peaks_are_the_pages():
    folds_products()
    compiles_chains()
    found = figure(r"recycle's peak \(`peak_bytes`, the fused chains' scratch included\) is "
                   r"(\S+ \S+) on S and (\S+ \S+) on D against static's (\S+ \S+) and "
                   r"(\S+ \S+)")
    got = [format_bytes(peaks(config, plan)["peak_bytes"])
           for plan in ("recycle", "static") for config in ("S", "D")]
    assert got == list(found.groups())


def test_the_savings_on_s_are_the_pages():
    """static's peak against blockrt's eager step (measured), plan "none" and naive_bytes."""
    folds_products()
    compiles_chains()
    found = figure(r"S: (\S+ \S+) against (\S+ \S+) eager and (\S+ \S+) under \"none\"; "
                   r"`naive_bytes` there is (\S+ \S+)\)")
    static = peaks("S", "static")
    got = [static["peak_bytes"], eager_peak(CONFIGS["S"], *make_batch(CONFIGS["S"])),
           peaks("S", "none")["peak_bytes"], static["naive_bytes"]]
    assert [format_bytes(b) for b in got] == list(found.groups())


@pytest.mark.parametrize("name", ["S", "M", pytest.param("D", marks=pytest.mark.slow)])
def test_eager_bytes_is_the_least_an_eager_step_holds(name: str):
    """eager_bytes (the recorded ops in their order, each block freed after its last use)
    against blockrt's eager step measured through its allocator: never more, and at most 6%
    less on the benchmark MLPs (an eager step holds some blocks a little past their last use);
    naive_bytes is far above both, plan "none" below."""
    config = CONFIGS[name]
    report = peaks(name, "static")
    measured = eager_peak(config, *make_batch(config))
    assert report["eager_bytes"] <= measured <= 1.06 * report["eager_bytes"]
    assert report["naive_bytes"] > 2 * measured
    assert peaks(name, "none")["peak_bytes"] < report["eager_bytes"]
    figure(r"measured eager steps hold at most 6% more on S, M and D")


def test_the_refusal_example_prints_what_the_page_shows():
    """The page's python block with a LimitAdaptor, run as it stands, prints the text of the
    block after it."""
    compiles_chains()
    fenced = r"((?:(?!```).)*)```"  # NOTE: a block's text, up to its own closing fence
    blocks = re.findall(r"```python\n" + fenced + r"\n\nprints[^\n]*\n\n```\n" + fenced,
                        PAGE, re.S)
    assert len(blocks) == 1
    code, shown = blocks[0]
    assert "LimitAdaptor(" in code
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/graph.md", "exec"), {})
    assert " ".join(printed.getvalue().split()) == " ".join(shown.split())


def test_the_programmes_figures_are_the_pages():
    """config D's 65 units at room 8: 86 extra unit forwards, 88 had the loss been a unit of
    its own, 79 counting results alone (docs/graph.md, "The model of cost")."""
    counted = figure(r"two extra unit forwards at room 8 \((\d+) where (\d+) do")
    alone = figure(r"e\.g\. (\d+) extra unit forwards in place of (\d+) for config D's (\d+) "
                   r"units with (\d+) held")
    units, room = int(alone[3]), int(alone[4])
    cost, _ = _table(units + 1)
    assert (cost[room, units + 1], cost[room, units]) == (int(counted[1]), int(counted[2]))
    assert (activation_table(units, room), cost[room, units]) == (int(alone[1]),
                                                                  int(alone[2]))


@pytest.mark.slow
def test_at_sqrts_peak_d_ties_with_sqrt_as_the_page_says():
    """On config D the budget at sqrt's own peak recomputes what sqrt does, over D's units."""
    folds_products()
    found = figure(r"on config D the two tie at (\d+) MFLOP")
    units = figure(r"for config D's (\d+) units")
    config = CONFIGS["D"]
    x, y = make_batch(config)
    sqrt = training_graph(config, checkpoint="sqrt",
                          allocator=StatisticsAdaptor(allocators.create("direct", "cpu")))
    sqrt(x, y)
    budget = training_graph(config, memory_budget=max(sqrt.timeline()),
                            allocator=StatisticsAdaptor(allocators.create("direct", "cpu")))
    budget(x, y)
    mine, theirs = budget.memory_report(), sqrt.memory_report()
    assert round(mine["recompute_flops"] / 1e6) == round(theirs["recompute_flops"] / 1e6) \
        == int(found[1])
    assert mine["units"] == int(units[1])


def test_the_page_names_only_configurations_the_command_line_has():
    """A configuration named in the page is one `blockrt plan --config` takes, or is said to
    be bench_budget's own."""
    for name in re.findall(r"config(?:uration)? ([A-Z]{1,2})\b", FLAT):
        assert name in CONFIGS or "bench_budget's config " + name in FLAT, name
