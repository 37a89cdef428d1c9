"""Checkpointing: recompute sqrt(n) segments of the forward pass during backward."""

from __future__ import annotations

import dataclasses
import math

from runtime.block import Block
from runtime.graph.program import Recorded
from runtime.tape import Instruction, Operand


def _checkpoint(recorded: Recorded) -> Recorded:
    """Phase 2 (checkpoint="sqrt"): `recorded` with forward results that backward reads
    recomputed from segment boundaries; the clones write new intermediate blocks."""
    program, count = _recompute_sqrt(recorded.program, recorded.intermediate)
    blocks = dict(recorded.blocks)
    made = {operand.block.id: operand.block for instr in program for operand in instr.outputs
            if operand.block.id not in blocks}
    blocks.update(made)
    return dataclasses.replace(recorded, program=program, blocks=blocks,
                               intermediate=recorded.intermediate.union(made),
                               recomputed=count)


def _recompute_sqrt(program: list[Instruction], intermediate: frozenset[int]
                    ) -> tuple[list[Instruction], int]:
    """Chen et al.'s sqrt(n) checkpointing on the instruction list: the forward instructions
    cut into segments of about sqrt(n) (none below 4), then `_recompute`."""
    forward = [i for i, instr in enumerate(program) if instr.phase == "forward"]
    if len(forward) < 4:
        return program, 0
    size = max(2, math.ceil(math.sqrt(len(forward))))
    segments = [forward[k:k + size] for k in range(0, len(forward), size)]
    return _recompute(program, intermediate, segments)


def _recompute(program: list[Instruction], intermediate: frozenset[int],
               segments: list[list[int]]) -> tuple[list[Instruction], int]:
    """Recompute forward results segment by segment; `segments` cut the forward instructions'
    positions in `program` into consecutive runs.

    The last result of each segment, and anything a later segment reads, is kept; the other
    forward results that the backward phase reads are recomputed: the segment's instructions
    (up to the last one that writes such a result) are cloned, writing fresh blocks, just before
    the first backward instruction that needs them, and the backward reads are pointed at the
    clones. Returns the rewritten program and the number of clones.
    """
    dropped = _dropped(program, intermediate, segments)
    backward_reads = _first_backward_reads(program)
    insert_before: dict[int, list[Instruction]] = {}
    renamed: dict[int, Block] = {}
    count = 0
    for members, wanted in zip(segments, dropped):
        if not wanted:
            continue
        clones, local = _clone_segment(program, members, wanted)
        count += len(clones)
        at = min(backward_reads[bid] for bid in wanted)
        insert_before.setdefault(at, []).extend(clones)
        renamed.update((bid, local[bid]) for bid in wanted)
    rewritten: list[Instruction] = []
    for i, instr in enumerate(program):
        rewritten.extend(insert_before.get(i, ()))
        if instr.phase != "forward":
            instr = _reading(instr, instr.phase, renamed)
        rewritten.append(instr)
    for index, instr in enumerate(rewritten):
        instr.index = index
    return rewritten, count


def _first_backward_reads(program: list[Instruction]) -> dict[int, int]:
    """Block id -> the position of the first instruction outside the forward phase reading it."""
    found: dict[int, int] = {}
    for i, instr in enumerate(program):
        if instr.phase != "forward":
            for operand in instr.inputs:
                found.setdefault(operand.block.id, i)
    return found


def _dropped(program: list[Instruction], intermediate: frozenset[int],
             segments: list[list[int]]) -> list[set[int]]:
    """Per segment, the forward results that need not stay live: intermediates that backward
    reads, other than the segment's last result and what a later segment reads. The last
    segment drops nothing: its results are used at once."""
    segment_of: dict[int, int] = {}
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].outputs:
                segment_of.setdefault(operand.block.id, s)
    later_reads: set[int] = set()
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].inputs:
                home = segment_of.get(operand.block.id)
                if home is not None and home < s:
                    later_reads.add(operand.block.id)
    backward_reads = _first_backward_reads(program)
    dropped: list[set[int]] = []
    for s, members in enumerate(segments):
        boundary = {o.block.id for o in program[members[-1]].outputs}
        dropped.append(set() if s == len(segments) - 1 else {
            bid for bid, home in segment_of.items()
            if home == s and bid in intermediate and bid in backward_reads
            and bid not in boundary and bid not in later_reads})
    return dropped


def _clone_segment(program: list[Instruction], members: list[int],
                   wanted: set[int]) -> tuple[list[Instruction], dict[int, Block]]:
    """Clones of a segment's instructions up to the last one writing a block in `wanted`, each
    writing a fresh block in place of the original's; and original block id -> fresh block.
    A clone reuses the original's `run` on other views, which is sound because `run` is a pure
    function of the views it is given (Note [closures hold no tensors] in runtime/autograd.py)."""
    last_wanted = max(i for i in members if any(o.block.id in wanted
                                                  for o in program[i].outputs))
    clones: list[Instruction] = []
    local: dict[int, Block] = {}
    for i in members:
        if i > last_wanted:
            break
        instr = program[i]
        for operand in instr.outputs:
            if operand.block.id not in local:
                local[operand.block.id] = Block(operand.block.nbytes, operand.block.allocator)
        clone = _reading(instr, "recompute", local)
        clone.outputs = [_moved(o, local[o.block.id]) for o in instr.outputs]
        clones.append(clone)
    return clones, local


def _reading(instr: Instruction, phase: str, renamed: dict[int, Block]) -> Instruction:
    """A copy of `instr` in `phase` whose inputs in `renamed` read the new blocks instead."""
    inputs = [_moved(o, renamed[o.block.id]) if o.block.id in renamed else o
              for o in instr.inputs]
    return Instruction(instr.op, instr.policy, inputs, instr.outputs, run=instr.run,
                       scalars=instr.scalars, host=instr.host, phase=phase)


def _moved(operand: Operand, block: Block) -> Operand:
    return Operand(block, operand.offset, operand.shape, operand.strides, operand.dtype)
