"""The direct allocator: every allocation is its own raw device allocation; nothing is cached."""

from __future__ import annotations

from allocators.base import Allocation, Allocator


class DirectAllocator(Allocator):
    """Each `allocate` asks the device, each `free` gives the memory straight back.

    The baseline every other allocator is measured against ("direct" in the registry).
    """

    name = "direct"

    def _allocate(self, nbytes: int) -> Allocation:
        raw = self._device_alloc(nbytes)
        return Allocation(self.device, raw, 0, nbytes, nbytes)

    def _free(self, allocation: Allocation) -> None:
        self._device_free(allocation.raw, allocation.size)
        allocation.raw = None  # NOTE: drop the reference so the memory really goes back
