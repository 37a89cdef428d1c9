"""The conformance kit's machine with a fixed opening, for tests that assert what the kit reached.

A test that says "the kit caught the planted bug" or "the kit drove the refusal path" must not
depend on what hypothesis happened to draw: a run of programs that never frees twice, never
empties a cache under a live allocation or never reaches a limit would fail it with no bug in
sight. `OpeningMachine` opens every program with the same short run of the kit's own rules, so
each rule, and the out-of-memory path of any allocator that refuses within 1 MiB, is reached in
every example; the drawn program follows as before.
"""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.stateful import initialize

from allocators.testing import AllocatorStateMachine

#: The opening's sizes: doubling from 1 KiB to 1 MiB, the largest size the kit's rules draw,
#: 2 MiB in all, so any limit below that refuses one (and a limit of 256 KiB by the 9th).
OPENING_SIZES = tuple(1 << k for k in range(10, 21))


class OpeningMachine(AllocatorStateMachine):
    """The kit's machine (`allocators.testing.AllocatorStateMachine`), each program opening with
    every rule once, in a fixed order, through the rules themselves (so their checks run, and the
    invariants after each):

    allocate OPENING_SIZES, keeping each, until the allocator refuses one; read each back;
    empty the cache and read each back; free one allocation of the other allocator through this
    one and one of this allocator through the other; free everything; free one twice. Nothing
    is left live, so the drawn program starts from an empty allocator, with the counters moved.

    Use it as `make_test_case(factory, machine=OpeningMachine)`. An allocator that injects faults
    from a fixed seed refuses at the same call of the opening in every example.
    """

    @initialize(data=st.data())
    def every_rule_once(self, data: st.DataObject) -> None:
        held = []
        for nbytes in OPENING_SIZES:
            refused = self.expected_ooms
            allocation = self.allocate(nbytes)
            self.allocator_is_consistent()
            if self.expected_ooms > refused:
                break
            held.append(allocation)
        for allocation in held:
            self.contents_survive(allocation)
        self.empty_cache()
        self.allocator_is_consistent()
        for allocation in held:
            self.contents_survive(allocation)
        self.foreign_free_is_refused(OPENING_SIZES[0])
        if held:
            self.free_through_another_allocator_is_refused(held[0])
        for allocation in held:
            self.free(allocation)
            self.allocator_is_consistent()
        if self.freed:
            self.double_free_is_refused(data)
        self.allocator_is_consistent()
