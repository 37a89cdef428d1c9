"""A third-party allocator found by entry point ("buddy", from examples/plugin_allocator), and
the pytest plugin that runs the conformance kit, end to end in a pytest subprocess.

`make test` installs the example package (see the Makefile), so "buddy" is registered here.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest
from hypothesis import Phase

import allocators
import allocators.pytest_plugin
from allocators.direct import DirectAllocator
from allocators.testing import make_test_case

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "plugin_allocator"


class LeakyAllocator(DirectAllocator):
    """Planted bug: freed memory never goes back to the device."""

    def _free(self, allocation: allocators.Allocation) -> None:
        pass


def run_pytest(directory: pathlib.Path, *args: str, autoload: bool = True) -> tuple[int, str]:
    """Run pytest in a fresh interpreter in `directory`; return (exit code, output)."""
    # NOTE: not an xdist worker itself, whatever ran this test (pytest-benchmark, for one,
    # reads xdist's variables and refuses to start)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(ROOT)
    env.pop("PYTEST_ADDOPTS", None)
    if autoload:
        env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    else:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                            cwd=directory, env=env, capture_output=True, text=True, timeout=120,
                            check=False)
    return result.returncode, result.stdout + result.stderr


# ---------------------------------------------------------------------- the "buddy" plugin
def test_buddy_is_registered_through_its_entry_point():
    assert "buddy" in allocators.names()
    (entry_point,) = [ep for ep in metadata.entry_points(group=allocators.ENTRY_POINT_GROUP)
                      if ep.name == "buddy"]
    assert entry_point.value == "blockrt_buddy:BuddyAllocator"
    alloc = allocators.create("buddy", "cpu", arena_nbytes=4096)
    assert type(alloc).__module__ == "blockrt_buddy"
    allocation = alloc.allocate(1000)
    assert allocation.size == 1024
    alloc.free(allocation)
    alloc.check_invariants()


TestBuddyConforms = make_test_case(lambda: allocators.create("buddy", "cpu"))


# ---------------------------------------------------------------------- the pytest plugin
def test_the_pytest_plugin_is_an_installed_entry_point(pytestconfig):
    entry_points = {ep.name: ep.value for ep in metadata.entry_points(group="pytest11")}
    assert entry_points.get("blockrt_allocators") == "allocators.pytest_plugin"
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        pytest.skip("plugin autoloading is disabled in this run")
    loaded = pytestconfig.pluginmanager.get_plugin("blockrt_allocators")
    assert loaded is allocators.pytest_plugin


def test_without_the_option_the_plugin_adds_no_tests(request):
    names = [item.name for item in request.session.items]
    assert not [name for name in names if name.startswith("blockrt-conformance")]


def test_run_conformance_passes_buddy_and_fails_a_leaky_allocator():
    allocators.pytest_plugin.run_conformance(lambda: allocators.create("buddy", "cpu"),
                                             max_examples=10)
    with pytest.raises(AssertionError, match="leaks after every allocation was freed"):
        allocators.pytest_plugin.run_conformance(lambda: LeakyAllocator("cpu"), max_examples=50,
                                                 database=None, phases=[Phase.generate])


CONFTEST = '''
    import allocators
    from allocators.direct import DirectAllocator


    class ForgetfulAllocator(DirectAllocator):
        """Planted bug: its stats() lacks a key every allocator reports."""

        def stats(self):
            stats = super().stats()
            del stats["cache_hits"]
            return stats


    allocators.register("forgetful", ForgetfulAllocator)
'''


def test_the_command_line_option_runs_the_kit_end_to_end(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_unrelated.py").write_text("def test_unrelated():\n    pass\n")
    code, output = run_pytest(tmp_path, "-p", "blockrt_allocators", "-v",
                              "--blockrt-allocator=buddy", "--blockrt-allocator=forgetful",
                              "--blockrt-max-examples=20", autoload=False)
    assert code == 1, output
    assert "::blockrt-conformance[buddy] PASSED" in output
    assert "::blockrt-conformance[forgetful] FAILED" in output
    assert "stats() lacks ['cache_hits']" in output
    assert "test_unrelated.py::test_unrelated PASSED" in output
    assert "1 failed, 2 passed" in output

    code, output = run_pytest(tmp_path, "-v")  # no option: only the file's own test
    assert code == 0, output
    assert "blockrt-conformance" not in output
    assert "1 passed" in output


def test_the_example_packages_own_tests_pass_through_the_fixture(tmp_path):
    # NOTE: run from a temporary directory, so hypothesis keeps its database there.
    code, output = run_pytest(tmp_path, str(EXAMPLE / "tests"), "-q")
    assert code == 0, output
    assert " passed" in output
    assert "failed" not in output
