"""Runtime configuration: BLOCKRT_ALLOCATOR read once, per-device defaults, memory_summary.

The environment is read at import, so those tests run a fresh interpreter; the in-process tests
work on empty copies of the config's per-device tables, so no other test sees their defaults.
"""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import allocators
import backends
import helpers
import runtime
from runtime import config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def fresh_defaults():
    """No default allocator or constant pool on any device, for one test."""
    with helpers.fresh_defaults():
        yield


def run_python(code: str, env_value: str | None) -> subprocess.CompletedProcess:
    """Run `code` in a new interpreter with BLOCKRT_ALLOCATOR set to `env_value` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != config.ALLOCATOR_ENV}
    if env_value is not None:
        env[config.ALLOCATOR_ENV] = env_value
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


# ---------------------------------------------------------------------- BLOCKRT_ALLOCATOR
REGISTER_TAGGED = """
    import allocators, runtime

    class Tagged(allocators.DirectAllocator):
        name = "tagged"

    allocators.register("tagged", Tagged)
"""
PRINT_DEFAULT = REGISTER_TAGGED + """
    print(type(runtime.get_default_allocator("cpu")).__name__, runtime.config.SETTINGS.allocator)
"""


@pytest.mark.parametrize(("value", "expected"), [
    (None, "CachingAllocator caching"),  # the built-in default
    ("", "CachingAllocator caching"),
    ("direct", "DirectAllocator direct"),
    ("tagged", "Tagged tagged"),  # registered after import, before first use: still counts
    ("caching", "CachingAllocator caching"),
])
def test_default_allocator_comes_from_the_environment(value, expected):
    result = run_python(PRINT_DEFAULT, value)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected.split()


def test_unknown_allocator_in_the_environment_raises_naming_it():
    code = """
        import numpy as np, runtime
        try:
            runtime.tensor(np.ones(2))
        except ValueError as exc:
            print(exc)
        else:
            print("no error")
    """
    result = run_python(code, "bogus")
    assert result.returncode == 0, result.stderr
    message = result.stdout
    assert "BLOCKRT_ALLOCATOR" in message
    assert "'bogus'" in message
    assert f"known: {', '.join(allocators.names())}" in message


def test_environment_is_read_once():
    code = REGISTER_TAGGED + """
    import os
    os.environ["BLOCKRT_ALLOCATOR"] = "bogus"          # set before first use, after import
    first = runtime.get_default_allocator("cpu")
    os.environ["BLOCKRT_ALLOCATOR"] = "direct"         # set after first use
    delattr(runtime.get_default_device(), runtime.config._ALLOCATOR)  # a new default next
    print(type(first).__name__, type(runtime.get_default_allocator("cpu")).__name__)
    """
    result = run_python(code, "tagged")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["Tagged", "Tagged"]


def test_settings_from_environ():
    assert config.Settings.from_environ({}) == config.Settings("caching", "built-in default")
    bogus = config.Settings.from_environ({"BLOCKRT_ALLOCATOR": " bogus "})
    assert bogus.allocator == "bogus"
    with pytest.raises(ValueError, match=r"BLOCKRT_ALLOCATOR is 'bogus'.*known: .*direct"):
        bogus.default_allocator_name()
    assert config.Settings.from_environ({"BLOCKRT_ALLOCATOR": "direct"}).default_allocator_name() \
        == "direct"


def test_bad_settings_surface_when_a_default_is_needed(fresh_defaults, monkeypatch):
    monkeypatch.setattr(config, "SETTINGS", config.Settings("nope", "environment variable X"))
    chosen = runtime.set_default_allocator("direct", "cpu")  # an explicit choice still works
    assert runtime.get_default_allocator("cpu") is chosen
    delattr(backends.get_device("cpu"), config._ALLOCATOR)  # NOTE: the fixture restores it
    with pytest.raises(ValueError, match="environment variable X is 'nope'"):
        runtime.zeros(2)


# ---------------------------------------------------------------------- set_default_allocator
def test_set_default_allocator_by_name_and_instance(fresh_defaults):
    dev = backends.get_device("cpu")
    by_name = runtime.set_default_allocator("direct", dev)
    assert isinstance(by_name, allocators.DirectAllocator) and by_name.device is dev
    assert runtime.get_default_allocator("cpu") is by_name
    assert runtime.tensor(np.ones(3)).block.allocator is by_name
    mine = allocators.create("direct", "cpu")
    assert runtime.set_default_allocator(mine, "cpu") is mine
    assert runtime.get_default_allocator() is mine
    assert runtime.tensor(np.ones(3)).block.allocator is mine
    assert config.default_allocators() == {dev: mine}


def test_set_default_allocator_errors(fresh_defaults):
    with pytest.raises(TypeError, match="name or an Allocator, got int"):
        runtime.set_default_allocator(42)
    with pytest.raises(TypeError, match="options"):
        runtime.set_default_allocator(allocators.create("direct"), "cpu", limit=3)
    with pytest.raises(ValueError, match="unknown allocator 'nope'"):
        runtime.set_default_allocator("nope")

    class Elsewhere(backends.Device):
        name = "elsewhere"

    stranger = allocators.create("direct", "cpu")
    stranger.device = Elsewhere()
    with pytest.raises(ValueError, match="lives on elsewhere, not on cpu"):
        runtime.set_default_allocator(stranger, "cpu")
    assert config.default_allocators() == {}


# ---------------------------------------------------------------------- memory_summary
CELL = re.compile(r"\S+(?: \S+)*")  # a cell: words joined by single spaces


def cells(table: str, label: str) -> dict[str, str]:
    """{column header: cell} for the row starting with `label` in the table holding it."""
    lines = table.splitlines()
    row = next(i for i, line in enumerate(lines) if re.split(r" {2,}", line)[0] == label)
    rule = next(i for i in range(row - 1, -1, -1) if set(lines[i]) == {"-"})
    header, values = ([(m.group(), m.start(), m.end()) for m in re.finditer(CELL, line)]
                      for line in (lines[rule - 1], lines[row]))
    assert len(header) == len(values), f"row {label!r} does not line up with its header"
    # Fixed width: the label column is left-aligned, every figure right-aligned under its header.
    assert header[0][1] == values[0][1] == 0
    assert [end for _, _, end in header[1:]] == [end for _, _, end in values[1:]]
    return {name: value for (name, _, _), (value, _, _) in zip(header, values)}


def test_summary_has_a_row_per_allocator_with_its_figures():
    first = allocators.create("direct", "cpu")
    second = allocators.create("direct", "cpu")
    kept = first.allocate(3 * 1024 * 1024)
    first.free(first.allocate(1024 * 1024))
    second.allocate(100)
    table = runtime.memory_summary({"first": first, "second": second})
    assert cells(table, "first") == {
        "allocator": "first", "allocated": "3.00 MiB", "peak allocated": "4.00 MiB",
        "reserved": "3.00 MiB", "cached": "0 B", "requested": "3.00 MiB", "allocs": "2",
        "frees": "1", "hit rate": "0.0%", "fragmentation": "0.0%", "OOMs": "0"}
    assert cells(table, "second")["allocated"] == "100 B"
    assert kept.live


class FixedStats(allocators.DirectAllocator):
    """An allocator whose stats are fixed and all different, to tell the columns apart."""

    def stats(self):
        return {"allocated_bytes": 1024, "peak_allocated_bytes": 2048, "reserved_bytes": 3072,
                "cached_bytes": 4096, "requested_bytes": 5120, "num_allocs": 6, "num_frees": 7,
                "hit_rate": 0.25, "fragmentation": 0.125, "num_ooms": 9}


def test_summary_columns_show_their_own_stats():
    table = runtime.memory_summary({"fixed": FixedStats("cpu")})
    assert cells(table, "fixed") == {
        "allocator": "fixed", "allocated": "1.00 KiB", "peak allocated": "2.00 KiB",
        "reserved": "3.00 KiB", "cached": "4.00 KiB", "requested": "5.00 KiB", "allocs": "6",
        "frees": "7", "hit rate": "25.0%", "fragmentation": "12.5%", "OOMs": "9"}


def test_summary_of_a_list_labels_rows_by_device_and_type():
    alloc = allocators.create("direct", "cpu")
    alloc.allocate(2048)
    table = runtime.memory_summary([alloc])
    assert cells(table, "cpu DirectAllocator")["allocated"] == "2.00 KiB"
    assert "constant pool" not in table
    class Wrapper(allocators.DirectAllocator):  # shaped like an adaptor: it has an upstream
        def __init__(self, upstream):
            super().__init__(upstream.device)
            self.upstream = upstream

    assert "cpu Wrapper(Wrapper(DirectAllocator))" in runtime.memory_summary([
        Wrapper(Wrapper(alloc))])
    with pytest.raises(TypeError, match="neither an allocators.Allocator"):
        runtime.memory_summary(["direct"])
    with pytest.raises(TypeError, match="list or dict"):
        runtime.memory_summary(42)


def test_default_summary_shows_default_allocators_and_constant_pools(fresh_defaults):
    mine = runtime.set_default_allocator(allocators.create("direct", "cpu"))
    kept = runtime.tensor(np.zeros(5 * 1024, np.float32))  # 20 KiB
    table = runtime.memory_summary()
    assert cells(table, "cpu DirectAllocator (default)")["allocated"] == "20.00 KiB"
    assert "constant pool" not in table  # no constant made yet, so no pool
    constants = [runtime.constant(np.ones(256)), runtime.constant(np.ones(256))]
    table = runtime.memory_summary()
    assert cells(table, "cpu DirectAllocator (default)")["allocated"] == "20.00 KiB"
    # the pool keeps its constants in read-only memory, from an allocator of its own
    assert cells(table, "cpu ReadOnlyAllocator (constants)")["allocated"] == "2.00 KiB"
    assert cells(table, "cpu ConstantPool") == {
        "constant pool": "cpu ConstantPool", "constants": "1", "bytes": "2.00 KiB",
        "lookups": "2", "hits": "1", "misses": "1", "hit rate": "50.0%", "collisions": "0"}
    # A new default allocator changes nothing for the pool.
    runtime.set_default_allocator("direct")
    table = runtime.memory_summary()
    assert cells(table, "cpu ReadOnlyAllocator (constants)")["allocated"] == "2.00 KiB"
    assert cells(table, "cpu DirectAllocator (default)")["allocated"] == "0 B"
    assert mine.stats()["allocated_bytes"] == 20 * 1024
    kept.release()
    for c in constants:
        c.release()
    table = runtime.memory_summary()
    assert cells(table, "cpu ReadOnlyAllocator (constants)")["allocated"] == "0 B"
    assert cells(table, "cpu ConstantPool")["constants"] == "0"


#: In a fresh interpreter: the summary before any allocator, then with one a user built, an
#: adaptor stack, and one that is gone.
LIVE_ALLOCATORS = """
    import gc
    import allocators, backends, runtime
    from allocators.adaptors import LimitAdaptor, StatisticsAdaptor
    from allocators.caching import CachingAllocator

    print(runtime.memory_summary())
    mine = CachingAllocator(backends.get_device("cpu"))
    kept = mine.allocate(7 * 1024)
    stack = StatisticsAdaptor(LimitAdaptor(allocators.create("direct", "cpu"), 1 << 20))
    held = stack.allocate(100)
    gone = allocators.create("direct", "cpu")
    gone.allocate(3 * 1024)
    del gone
    gc.collect()
    print(runtime.memory_summary())
"""


def test_the_default_summary_lists_every_live_allocator_whoever_made_it():
    result = run_python(LIVE_ALLOCATORS, None)
    assert result.returncode == 0, result.stderr
    before, after = result.stdout.split("blockrt memory summary")[1:]
    assert "(no allocators)" in before
    lines = after.splitlines()
    rule = next(i for i, line in enumerate(lines) if set(line) == {"-"})
    rows = [line.split("  ")[0] for line in lines[rule + 1:] if line.strip()]
    assert rows == ["cpu CachingAllocator", "cpu StatisticsAdaptor(LimitAdaptor(DirectAllocator))"]
    assert cells(after, "cpu CachingAllocator")["allocated"] == "7.00 KiB"
    assert cells(after, rows[1])["requested"] == "100 B"
    assert "3.00 KiB" not in after  # NOTE: the collected allocator is gone from the table


def test_the_default_summary_drops_an_allocator_once_it_is_collected():
    class Lonely(allocators.DirectAllocator):
        pass

    lonely = Lonely("cpu")
    lonely.allocate(5 * 1024)
    assert cells(runtime.memory_summary(), "cpu Lonely")["allocated"] == "5.00 KiB"
    del lonely
    gc.collect()
    assert "cpu Lonely" not in runtime.memory_summary()


def test_the_default_summary_numbers_rows_that_would_read_the_same():
    class Twin(allocators.DirectAllocator):
        pass

    twins = [Twin("cpu"), Twin("cpu")]
    twins[1].allocate(2048)
    table = runtime.memory_summary()
    assert cells(table, "cpu Twin #1")["allocated"] == "0 B"
    assert cells(table, "cpu Twin #2")["allocated"] == "2.00 KiB"


def test_the_default_device_comes_from_the_environment_once_and_can_be_set(monkeypatch):
    from runtime import config

    assert config.Settings.from_environ({"BLOCKRT_DEVICE": " opencl:1 "}).device == "opencl:1"
    assert config.Settings.from_environ({}).device == "cpu"
    monkeypatch.setitem(config._state, "device", None)
    monkeypatch.setattr(config, "SETTINGS", config.Settings(device="nosuch"))
    with pytest.raises(ValueError, match="BLOCKRT_DEVICE='nosuch'.*unknown device"):
        runtime.get_default_device()
    cpu = runtime.set_default_device("cpu")
    assert runtime.get_default_device() is cpu
    assert runtime.tensor([1.0]).device is cpu
