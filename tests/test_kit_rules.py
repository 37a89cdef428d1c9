"""The conformance kit's placement checks catch plugins planted with the bugs a plugin author can
make: an allocation 8 bytes off the device's alignment (the bug that once passed the kit and then
failed in the pyopencl hook), one past the end of its raw memory, one on another device. Each
planted allocator fails the kit with a message naming the rule; blockrt's own pass it on every
backend present.
"""

from __future__ import annotations

import pytest

import allocators
import backends
from allocators import Allocation
from allocators.direct import DirectAllocator
from allocators.testing import make_test_case
from kit_machines import OpeningMachine

BACKENDS = [kind for kind in ("cpu", "opencl") if kind in backends.available()]


class Misaligned(DirectAllocator):
    """Planted: every allocation starts 8 bytes into its raw memory."""

    def _allocate(self, nbytes: int) -> Allocation:
        raw = self._device_alloc(nbytes + 8)
        return Allocation(self.device, raw, 8, nbytes, nbytes)

    def _free(self, allocation: Allocation) -> None:
        self._device_free(allocation.raw, allocation.size + 8)
        allocation.raw = None


class PastTheEnd(DirectAllocator):
    """Planted: sets aside 64 bytes more than the raw memory holds."""

    def _allocate(self, nbytes: int) -> Allocation:
        raw = self._device_alloc(nbytes)
        return Allocation(self.device, raw, 0, nbytes, nbytes + 64)

    def _allocation_size(self, nbytes: int) -> int:
        return nbytes + 64  # NOTE: says so, so that only the placement is wrong

    def _free(self, allocation: Allocation) -> None:
        self._device_free(allocation.raw, allocation.size - 64)
        allocation.raw = None


class Understated(DirectAllocator):
    """Planted: rounds every allocation up to 4 KiB but says allocation_size(n) is n, so a
    budget or a limit that trusts it undercounts."""

    def _allocate(self, nbytes: int) -> Allocation:
        size = -(-max(nbytes, 1) // 4096) * 4096
        return Allocation(self.device, self._device_alloc(size), 0, nbytes, size)

    def _free(self, allocation: Allocation) -> None:
        self._device_free(allocation.raw, allocation.size)
        allocation.raw = None


class OtherDevice(DirectAllocator):
    """Planted: the allocation names another device than the one its memory is on."""

    def _allocate(self, nbytes: int) -> Allocation:
        allocation = super()._allocate(nbytes)
        allocation.device = backends.get_device("opencl" if self.device.name == "cpu" else "cpu")
        return allocation


def run_kit(factory) -> None:
    # NOTE: every program opens with every rule, so a planted bug is caught in each of them
    make_test_case(factory, machine=OpeningMachine, max_examples=20,
                   stateful_step_count=10)("runTest").runTest()


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize(("planted", "match"), [
    (Misaligned, r"starts at address 0x[0-9a-f]+ \(offset 8 in its raw memory\), not a multiple "
                 r"of .*'s alignment of \d+ bytes"),
    (PastTheEnd, r"spans bytes 0 to \d+ of a raw memory of \d+ bytes"),
    (Understated, r"sets aside 4096 bytes, more than allocation_size\(\d+\) = \d+"),
])
def test_the_kit_catches_a_planted_placement_bug(kind, planted, match):
    with pytest.raises(AssertionError, match=match):
        run_kit(lambda: planted(kind))


@pytest.mark.skipif("opencl" not in backends.available(), reason="needs a second device kind")
def test_the_kit_catches_an_allocation_on_another_device():
    with pytest.raises(AssertionError, match=r"is on opencl:0, its allocator on cpu"):
        run_kit(lambda: OtherDevice("cpu"))


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("name", ["direct", "caching", "buddy"])
def test_blockrt_allocators_and_the_plugin_keep_the_placement_rules(kind, name):
    made = []

    def factory():
        made.append(allocators.create(name, kind))
        return made[-1]

    run_kit(factory)  # NOTE: raises AssertionError naming a broken rule (the planted bugs above)
    assert made, "the kit never made an allocator"
    for allocator in made:
        allocator.check_invariants()
    assert sum(a.stats()["num_allocs"] for a in made) > 0, "the kit allocated nothing"


def test_the_kit_adds_the_queue_check_on_opencl_only():
    on_cpu = make_test_case(lambda: allocators.create("caching", "cpu"))
    assert not hasattr(on_cpu, "test_queue_ordered_reuse")
    if "opencl" in backends.available():
        on_opencl = make_test_case(lambda: allocators.create("caching", "opencl"))
        on_opencl("test_queue_ordered_reuse").test_queue_ordered_reuse()
