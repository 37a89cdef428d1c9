"""Schedule: the data hazards between recorded instructions, and an order that frees early."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from runtime.graph.program import Recorded
from runtime.tape import Instruction

#: Ops whose kernels check their data and may raise (cross_entropy's labels).
_RAISES_ON_DATA = frozenset({"cross_entropy"})
#: Ops that run after every instruction recorded before them: a training step's held state
#: writes (Note [state writes wait for the commit point] in runtime/ops.py), which hazards
#: alone would let run as soon as their value is made, in the forward pass.
_BARRIERS = frozenset({"commit_state"})


def _dependencies(program: Sequence[Instruction],
                  intermediate: frozenset[int] = frozenset()) -> list[set[int]]:
    """Predecessors of each instruction: read-after-write, write-after-read, write-after-write
    on blocks (whole blocks: conservative for disjoint views of one block); a barrier
    (`_BARRIERS`) after every instruction before it; and a write to a block that outlives the
    step (state, outputs) waits for every earlier instruction that may raise on its data, so
    a replay that raises there has written nothing that lasts, as the function called
    directly would not have (an SGD momentum update needs no gradient and would otherwise
    run first)."""
    last_write: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    preds: list[set[int]] = []
    raisers: list[int] = []
    covered, barrier = 0, None  # NOTE: every instruction before `covered` precedes `barrier`
    for j, instr in enumerate(program):
        before: set[int] = set()
        if raisers and any(o.block.id not in intermediate for o in instr.outputs):
            before.update(raisers)
        if instr.op in _BARRIERS:
            before.update(range(covered, j))
            if barrier is not None:
                before.add(barrier)
            covered, barrier = j, j
        if instr.op in _RAISES_ON_DATA:
            raisers.append(j)
        for operand in instr.inputs:
            writer = last_write.get(operand.block.id)
            if writer is not None:
                before.add(writer)
        for operand in instr.outputs:
            bid = operand.block.id
            writer = last_write.get(bid)
            if writer is not None:
                before.add(writer)
            before.update(readers.get(bid, ()))
        before.discard(j)
        preds.append(before)
        for operand in instr.inputs:
            readers.setdefault(operand.block.id, []).append(j)
        for operand in instr.outputs:
            last_write[operand.block.id] = j
            readers[operand.block.id] = []
    return preds


def _scheduled(recorded: Recorded) -> list[Instruction]:
    """Phase 3: `recorded.program` in an order that respects its hazards and frees early."""
    return [recorded.program[i] for i in _schedule(recorded.program, recorded.intermediate)]


def _schedule(program: Sequence[Instruction], intermediate: frozenset[int]) -> list[int]:
    """A topological order of `program` that prefers, among ready instructions, one that adds
    no live bytes (it frees at least what it allocates), else the earliest in program order."""
    preds = _dependencies(program, intermediate)
    waiting = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in program]
    for j, before in enumerate(preds):
        for i in before:
            succs[i].append(j)
    uses: dict[int, int] = {}
    sizes: dict[int, int] = {}
    touched: list[tuple[int, ...]] = []  # NOTE: each instruction's intermediate blocks, once
    for instr in program:
        mine = {o.block.id: o for o in (*instr.inputs, *instr.outputs)
                if o.block.id in intermediate}
        touched.append(tuple(mine))
        for bid, operand in mine.items():
            uses[bid] = uses.get(bid, 0) + 1
            sizes[bid] = operand.block.nbytes
    born: set[int] = set()
    ready: list[int] = []  # NOTE: kept in program order
    order: list[int] = []

    def grows(j: int) -> bool:
        delta = 0
        for bid in touched[j]:
            if bid not in born:
                delta += sizes[bid]
            if uses[bid] == 1:
                delta -= sizes[bid]
        return delta > 0

    # NOTE: whether a ready instruction grows changes only when an instruction touching one
    # of its blocks runs, so it is kept (`growing`) and asked again only then; the ready ones
    # that do not grow are kept in program order too (`shrinking`), so each pick is the
    # first of those, else the first ready: the scan this replaces (the earliest that does
    # not grow, else the earliest) took 10 s of a 30 s ResNet-50 budget capture
    growing: dict[int, bool] = {}
    shrinking: list[int] = []
    waiting_on: dict[int, set[int]] = {}  # NOTE: block -> the ready instructions touching it

    def arrive(j: int) -> None:
        bisect.insort(ready, j)
        growing[j] = grows(j)
        if not growing[j]:
            bisect.insort(shrinking, j)
        for bid in touched[j]:
            waiting_on.setdefault(bid, set()).add(j)

    for j, count in enumerate(waiting):
        if count == 0:
            arrive(j)
    while ready:
        pick = shrinking[0] if shrinking else ready[0]
        ready.pop(bisect.bisect_left(ready, pick))
        if not growing.pop(pick):
            shrinking.pop(bisect.bisect_left(shrinking, pick))
        order.append(pick)
        affected: set[int] = set()
        for bid in touched[pick]:
            born.add(bid)
            uses[bid] -= 1
            others = waiting_on.get(bid)
            if others is not None:
                others.discard(pick)
                affected |= others
        for j in affected:
            now = grows(j)
            if now != growing[j]:
                growing[j] = now
                if now:
                    shrinking.pop(bisect.bisect_left(shrinking, j))
                else:
                    bisect.insort(shrinking, j)
        for j in succs[pick]:
            waiting[j] -= 1
            if waiting[j] == 0:
                arrive(j)
    if len(order) != len(program):
        raise AssertionError("the dependency graph has a cycle")  # program order is a witness
    return order


def _positions(instrs: Sequence[Instruction], side: str) -> dict[int, list[int]]:
    """Block id -> positions of the instructions that read it ("inputs") or write it
    ("outputs")."""
    found: dict[int, list[int]] = {}
    for position, instr in enumerate(instrs):
        for operand in getattr(instr, side):
            found.setdefault(operand.block.id, []).append(position)
    return found
