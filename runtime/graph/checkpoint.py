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
    """Chen et al.'s sqrt(n) checkpointing on the instruction list.

    The forward instructions are cut into segments of about sqrt(n). The last result of each
    segment, and anything a later segment reads, is kept; the other forward results that the
    backward phase reads are recomputed: the segment's instructions are cloned, writing fresh
    blocks, just before the first backward instruction that needs them, and the backward reads
    are pointed at the clones.
    """
    forward = [i for i, instr in enumerate(program) if instr.phase == "forward"]
    n = len(forward)
    if n < 4:
        return program, 0
    size = max(2, math.ceil(math.sqrt(n)))
    segments = [forward[k:k + size] for k in range(0, n, size)]
    segment_of: dict[int, int] = {}
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].outputs:
                segment_of.setdefault(operand.block.id, s)
    later_reads: set[int] = set()  # forward results read by a later forward segment
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].inputs:
                home = segment_of.get(operand.block.id)
                if home is not None and home < s:
                    later_reads.add(operand.block.id)
    backward_reads: dict[int, int] = {}  # block -> first backward instruction reading it
    for i, instr in enumerate(program):
        if instr.phase != "forward":
            for operand in instr.inputs:
                backward_reads.setdefault(operand.block.id, i)
    insert_before: dict[int, list[Instruction]] = {}
    renamed: dict[int, Block] = {}
    count = 0
    for s, members in enumerate(segments):
        boundary = {o.block.id for o in program[members[-1]].outputs}
        wanted = {bid for bid, home in segment_of.items()
                  if home == s and bid in intermediate and bid in backward_reads
                  and bid not in boundary and bid not in later_reads}
        if not wanted or s == len(segments) - 1:
            continue  # NOTE: the last segment's results are used at once: nothing to drop
        clones: list[Instruction] = []
        local: dict[int, Block] = {}
        last_wanted = max(i for i in members if any(o.block.id in wanted
                                                      for o in program[i].outputs))
        for i in members:
            if i > last_wanted:
                break
            instr = program[i]
            outputs = []
            for operand in instr.outputs:
                shadow = local.get(operand.block.id)
                if shadow is None:
                    shadow = local[operand.block.id] = Block(operand.block.nbytes,
                                                             operand.block.allocator)
                outputs.append(_moved(operand, shadow))
            inputs = [_moved(o, local[o.block.id]) if o.block.id in local else o
                      for o in instr.inputs]
            clones.append(Instruction(instr.op, instr.policy, inputs, outputs, run=instr.run,
                                      scalars=instr.scalars, host=instr.host,
                                      phase="recompute"))
        count += len(clones)
        at = min(backward_reads[bid] for bid in wanted)
        insert_before.setdefault(at, []).extend(clones)
        for bid in wanted:
            renamed[bid] = local[bid]
    rewritten: list[Instruction] = []
    for i, instr in enumerate(program):
        rewritten.extend(insert_before.get(i, ()))
        if instr.phase != "forward":
            instr = Instruction(instr.op, instr.policy,
                                [_moved(o, renamed[o.block.id]) if o.block.id in renamed else o
                                 for o in instr.inputs], instr.outputs, run=instr.run,
                                scalars=instr.scalars, host=instr.host, phase=instr.phase)
        rewritten.append(instr)
    for index, instr in enumerate(rewritten):
        instr.index = index
    return rewritten, count


def _moved(operand: Operand, block: Block) -> Operand:
    return Operand(block, operand.offset, operand.shape, operand.strides, operand.dtype)
