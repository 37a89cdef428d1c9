"""Invariant checks hold under `python -O` (issue 16, part 6): `check_invariants()` and the
conformance kit raise AssertionError explicitly, not through `assert` statements that -O strips.

Each check runs in a subprocess started with -O, on a state corrupted on purpose, and must
still raise. A test also checks that the library holds no `assert` statement at all.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("allocators", "backends", "runtime")

CORRUPTIONS = {
    "caching books": """
        import allocators
        alloc = allocators.create("caching", "cpu")
        a = alloc.allocate(1000)
        alloc._allocated_bytes += 512
        alloc.check_invariants()
    """,
    "caching layout": """
        import allocators
        alloc = allocators.create("caching", "cpu")
        a, b = alloc.allocate(1000), alloc.allocate(1000)
        alloc.free(a)
        next(iter(alloc._segments)).size += 512
        alloc.check_invariants()
    """,
    "statistics adaptor": """
        import allocators
        from allocators.adaptors import StatisticsAdaptor
        stack = StatisticsAdaptor(allocators.create("direct", "cpu"))
        stack.allocate(64)
        stack._histogram.clear()
        stack.check_invariants()
    """,
    "memory plan": """
        from runtime.planner import Lifetime, plan
        lifetimes = [Lifetime("x", 0, 1, 64), Lifetime("y", 1, 2, 64)]
        p = plan(lifetimes, alignment=64)
        object.__setattr__(p, "offsets", {"x": 0, "y": 0})
        p.check_invariants(lifetimes)
    """,
    "constant pool": """
        import numpy as np, runtime
        pool = runtime.ConstantPool()
        c = runtime.constant(np.arange(4.0), pool=pool)
        pool._counters["hits"] += 1
        pool.check_invariants()
    """,
    "conformance kit": """
        import allocators
        from allocators import Allocation
        from allocators.direct import DirectAllocator
        from allocators.testing import make_test_case

        class Misaligned(DirectAllocator):
            def _allocate(self, nbytes):
                raw = self._device_alloc(nbytes + 8)
                return Allocation(self.device, raw, 8, nbytes, nbytes)
            def _free(self, allocation):
                self._device_free(allocation.raw, allocation.size + 8)

        make_test_case(lambda: Misaligned("cpu"), max_examples=5)("runTest").runTest()
    """,
}


def run_optimized(code: str) -> subprocess.CompletedProcess:
    program = "assert False, 'asserts run: this is not -O'\n" + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-O", "-c", program], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_a_corrupted_state_is_caught_under_python_O(name):
    result = run_optimized(CORRUPTIONS[name])
    assert result.returncode != 0, f"{name}: nothing raised under -O\n{result.stdout}"
    raised = [line for line in result.stderr.splitlines() if line.startswith("AssertionError")]
    assert raised, result.stderr[-2000:]  # NOTE: hypothesis adds the failing case after it
    assert "this is not -O" not in result.stderr


def test_the_library_holds_no_assert_statement():
    found = []
    for package in LIBRARY:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            found += [f"{path.relative_to(ROOT)}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Assert)]
    assert not found, f"assert statements vanish under python -O: {found}"
