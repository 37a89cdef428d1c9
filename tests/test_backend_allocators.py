"""The allocator state machine (allocators.testing) on every non-CPU backend that runs here:
the same conformance kit third-party allocators use, over OpenCL buffers (and CUDA memory where a
GPU exists). The CPU runs are in test_allocators.py and test_caching.py."""

from __future__ import annotations

import pytest

import allocators
import backends
from allocators.testing import make_test_case

OTHER_BACKENDS = [kind for kind in backends.available() if kind != "cpu"]

for _kind in OTHER_BACKENDS:
    for _name in ("direct", "caching"):
        globals()[f"Test{_name.title()}On{_kind.title()}Conforms"] = make_test_case(
            lambda kind=_kind, name=_name: allocators.create(name, kind), max_examples=20,
            stateful_step_count=20)


def test_some_backend_besides_cpu_is_checked():
    if not OTHER_BACKENDS:
        pytest.skip("only the cpu backend runs here (pip install 'blockrt[opencl]' for PoCL)")
    assert all(f"Test{'Caching'}On{kind.title()}Conforms" in globals() for kind in OTHER_BACKENDS)
