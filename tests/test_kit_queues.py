"""The conformance kit's queue check (`allocators.testing.check_queue_ordered_reuse`): it passes
blockrt's allocators and the example plugin, and catches plugins planted with the bugs a plugin
author can make (freeing past the base class, dropping recorded queues).

Skipped when pyopencl or an OpenCL device (PoCL counts) is missing; on the CPU the check runs
nothing and says so.
"""

from __future__ import annotations

from typing import Any

import pytest

import allocators
import backends
from allocators import Allocation
from allocators.caching import CachingAllocator
from allocators.testing import check_queue_ordered_reuse

pytest.importorskip("pyopencl", reason="pyopencl is not installed (pip install blockrt[opencl])")
if "opencl" not in backends.available():
    pytest.skip("no OpenCL device on this machine (PoCL from blockrt[opencl] provides a CPU one)",
                allow_module_level=True)


class RecyclesInFree(CachingAllocator):
    """Planted: overrides `free` with a quick recycle of its own, past the base class."""

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            del self._live[allocation.serial]
            self._give_back(allocation)


class ForgetsQueues(CachingAllocator):
    """Planted: a `record_queue` that records nothing."""

    def record_queue(self, allocation: Allocation, queue: Any) -> None:
        return None


@pytest.mark.parametrize("name", ["caching", "direct", "buddy"])
def test_the_queue_check_passes_blockrt_allocators_and_the_plugin(name):
    assert check_queue_ordered_reuse(lambda: allocators.create(name, "opencl")) is True


@pytest.mark.parametrize("planted", [RecyclesInFree, ForgetsQueues])
def test_the_queue_check_catches_a_planted_bug(planted):
    with pytest.raises(AssertionError, match=r"handed out allocation #\d+ of .* over memory that "
                                             r"a kernel queued on another queue"):
        check_queue_ordered_reuse(lambda: planted("opencl"))


def test_the_queue_check_runs_nothing_on_a_device_without_queues():
    assert check_queue_ordered_reuse(lambda: allocators.create("caching", "cpu")) is False
