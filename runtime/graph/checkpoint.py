"""Checkpointing: recompute segments of the forward pass during backward (sqrt(n) of them with
checkpoint="sqrt"; `budget.py` chooses nested segments to fit a memory budget), and recompute
pointwise results from what the backward pass keeps anyway (checkpoint="pointwise", and the
first rewrite a memory budget tries)."""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Any

from backends import optable
from runtime.block import Block
from runtime.graph.program import Recorded
from runtime.tape import Instruction, Operand


def _checkpoint(recorded: Recorded) -> Recorded:
    """Phase 2 (checkpoint="sqrt"): `recorded` with forward results that backward reads
    recomputed from segment boundaries; the clones write new intermediate blocks."""
    program, count = _recompute_sqrt(recorded.program, recorded.intermediate)
    return _with_clones(recorded, program, count)


def _with_clones(recorded: Recorded, program: list[Instruction], recomputed: int) -> Recorded:
    """`recorded` with `program` in place of its own: the blocks its clones write are added
    as intermediates, and `recomputed` counts the clones."""
    blocks = dict(recorded.blocks)
    made = {operand.block.id: operand.block for instr in program for operand in instr.outputs
            if operand.block.id not in blocks}
    blocks.update(made)
    return dataclasses.replace(recorded, program=program, blocks=blocks,
                               intermediate=recorded.intermediate.union(made),
                               recomputed=recomputed)


def _splice(program: list[Instruction], insert_before: dict[int, list[Instruction]],
            renamed: dict[int, tuple[int, Block]], start: int = 0,
            inside: set[int] | frozenset[int] = frozenset()) -> list[Instruction]:
    """`program` with clones inserted before positions (`insert_before`), and each read of a
    block in `renamed` (block id -> (from position, its clone's block)) at or after its from
    position, by an instruction not `inside`, pointed at the clone's block; positions from
    `start` are scanned and renumbered."""
    rewritten = program[:start]
    for i in range(start, len(program)):
        instr = program[i]
        rewritten.extend(insert_before.get(i, ()))
        if renamed and i not in inside:
            late = {o.block.id: renamed[o.block.id][1] for o in instr.inputs
                    if o.block.id in renamed and renamed[o.block.id][0] <= i}
            if late:
                instr = _reading(instr, instr.phase, late)
        rewritten.append(instr)
    for index in range(start, len(rewritten)):
        rewritten[index].index = index
    return rewritten


def _wanted(program: list[Instruction], intermediate: frozenset[int] | set[int]) -> set[int]:
    """Intermediates written by the forward pass that an instruction after it reads."""
    made = {o.block.id for instr in program if instr.phase == "forward" for o in instr.outputs}
    return {o.block.id for instr in program if instr.phase != "forward"
            for o in instr.inputs if o.block.id in made and o.block.id in intermediate}


# Note [pointwise recompute]: most of what a conv net keeps for its backward pass comes in
# pairs: batch norm's normalised x, and the ReLU of its affine map, which the next convolution
# reads (ResNet-50: 54% and 45% of the bytes at the backward pass's start). The second is a
# pointwise function of the first and two parameters, so it can be made again from what the
# backward pass keeps anyway at the cost of one fused pass over it, where recomputing a
# convolution costs hundreds of flops per element. checkpoint="pointwise" drops every forward
# result the backward pass reads that such a chain makes again: its recompute is a run of
# fusible elementwise instructions (`Op.fusible`, as the fused chains run) whose sources are
# data from outside the graph or results that stay kept, no source written between the
# original and the recompute, and no kept source read later than it would be anyway (so no
# lifetime grows and the peak cannot rise; a chain's own scratch is one fused row block).
# PyTorch's compiler makes the same call (its min-cut partitioner recomputes fusible pointwise
# ops rather than save their results); a memory budget starts from this rewrite, since it
# costs a few percent where segments cost a forward pass.
#: the longest chain recomputed for one result
_POINTWISE_CHAIN = 16


def _pointwise(recorded: Recorded, local: bool = False) -> Recorded:
    """checkpoint="pointwise": `recorded` with each forward result that the backward pass
    reads and that a pointwise chain makes again from kept data recomputed just before its
    first backward read (Note [pointwise recompute]).

    `local`: only results whose last forward read comes before the next result the backward
    pass reads is made (a ReLU between batch norm and the next convolution, not a residual
    block's output, which the block's last add reads). A memory budget's units are cut at
    such results; a result dropped across them leaves each unit that reads it unable to be
    recomputed from the units before it, so a whole residual block becomes one unit."""
    program, intermediate = recorded.program, recorded.intermediate
    wanted = _wanted(program, intermediate)
    writers: dict[int, list[int]] = {}
    reads: dict[int, list[int]] = {}
    for position, instr in enumerate(program):
        for operand in instr.outputs:
            writers.setdefault(operand.block.id, []).append(position)
        for operand in instr.inputs:
            reads.setdefault(operand.block.id, []).append(position)
    first_late = {bid: min((p for p in reads.get(bid, ()) if program[p].phase != "forward"),
                           default=None) for bid in wanted}

    def pointwise(position: int) -> bool:
        instr = program[position]
        op = optable.BY_NAME.get(instr.op)
        return (instr.phase == "forward" and instr.kind == "kernel" and op is not None
                and op.fusible and instr.policy == "elementwise" and len(instr.outputs) == 1
                and not _updates_state(instr, intermediate))

    def untouched(bid: int, after: int, before: int) -> bool:
        return not any(after < p < before for p in writers.get(bid, ()))

    # NOTE: result -> the positions that make it again. Results are taken in program order,
    # so a chain's sources (made before it) were decided first: none is dropped later
    dropped: dict[int, list[int]] = {}

    def chain(bid: int, at: int, members: set[int]) -> bool:
        """Collect the instructions that make `bid` again from kept data into `members`."""
        made_by = writers.get(bid, [])
        if len(made_by) != 1 or not pointwise(made_by[0]):
            return False
        position = made_by[0]
        if position in members:
            return True
        members.add(position)
        if len(members) > _POINTWISE_CHAIN:
            return False
        for operand in program[position].inputs:
            source = operand.block.id
            kept = source in wanted and source not in dropped
            if source not in intermediate or kept:
                if not untouched(source, position, at):
                    return False
                # NOTE: a kept source must outlive the recompute anyway
                if kept and max(reads[source]) < at:
                    return False
            elif not chain(source, at, members):
                return False
        return True

    made_at = sorted(writers[b][0] for b in wanted)
    for bid in sorted(wanted, key=lambda b: writers[b][0]):
        at = first_late[bid]
        if at is None:
            continue
        if local:
            following = bisect.bisect_right(made_at, writers[bid][0])
            last_forward = max((p for p in reads.get(bid, ()) if program[p].phase == "forward"),
                               default=-1)
            if following < len(made_at) and last_forward > made_at[following]:
                continue
        members: set[int] = set()
        if chain(bid, at, members):
            dropped[bid] = sorted(members)
    if not dropped:
        return recorded
    insert_before: dict[int, list[Instruction]] = {}
    renamed: dict[int, tuple[int, Block]] = {}  # NOTE: result -> (from position, its clone's)
    count = 0
    for bid, members in dropped.items():
        clones, fresh = _clone_segment(program, members, {bid}, intermediate)
        count += len(clones)
        insert_before.setdefault(first_late[bid], []).extend(clones)
        renamed[bid] = (first_late[bid], fresh[bid])
    return _with_clones(recorded, _splice(program, insert_before, renamed),
                        recorded.recomputed + count)


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
    clones. The last segment drops nothing: its results are used at once. Returns the rewritten
    program and the number of clones.
    """
    drop = [True] * (len(segments) - 1) + [False]
    rewritten, clones = _recompute_sweep(program, intermediate, segments, drop)
    return rewritten, sum(len(c) for c in clones)


def _recompute_sweep(program: list[Instruction], intermediate: frozenset[int] | set[int],
                     segments: list[list[int]], drop: list[bool],
                     keep: list[set[int]] | None = None
                     ) -> tuple[list[Instruction], list[list[Instruction]]]:
    """`_recompute` over one sweep: `segments` are consecutive runs of positions in `program`
    (the sweep: the forward pass, or the clones that recompute a part of it), and `drop` says
    which segments give up their results that instructions outside the sweep read (each keeps
    its last result, the blocks `keep` names for it, and what a later segment reads) and
    recompute them from their start just before the first such read. Returns the rewritten
    program and, per segment, its clones in order (a prefix of the segment's instructions;
    empty when nothing is dropped).

    Instructions outside the sweep that read no dropped result stay the same objects, so a
    caller can find a sweep's clones again after later rewrites (`budget._apply`)."""
    inside = {i for members in segments for i in members}
    # NOTE: nothing before the sweep reads what it makes: the scans start where it starts
    start = min(inside, default=len(program))
    outside_reads = _outside_reads(program, inside, start)
    dropped = _dropped(program, intermediate, segments, outside_reads, drop)
    if keep is not None:
        dropped = [found - kept for found, kept in zip(dropped, keep)]
    insert_before: dict[int, list[Instruction]] = {}
    renamed: dict[int, tuple[int, Block]] = {}
    made: list[list[Instruction]] = []
    for members, wanted in zip(segments, dropped):
        if not wanted:
            made.append([])
            continue
        clones, local = _clone_segment(program, members, wanted, intermediate)
        made.append(clones)
        at = min(outside_reads[bid] for bid in wanted)
        insert_before.setdefault(at, []).extend(clones)
        renamed.update((bid, (start, local[bid])) for bid in wanted)
    return _splice(program, insert_before, renamed, start, inside), made


def _outside_reads(program: list[Instruction], inside: set[int], start: int = 0
                   ) -> dict[int, int]:
    """Block id -> the position of the first instruction from `start` on, not in `inside`,
    reading it."""
    found: dict[int, int] = {}
    for i in range(start, len(program)):
        instr = program[i]
        if i not in inside:
            for operand in instr.inputs:
                found.setdefault(operand.block.id, i)
    return found


def _dropped(program: list[Instruction], intermediate: frozenset[int] | set[int],
             segments: list[list[int]], outside_reads: dict[int, int],
             drop: list[bool]) -> list[set[int]]:
    """Per segment, the results that need not stay live: intermediates that an instruction
    outside the sweep reads, other than the segment's last result and what a later segment
    reads; nothing for a segment `drop` does not mark."""
    segment_of: dict[int, int] = {}
    made: list[list[int]] = [[] for _ in segments]  # NOTE: each segment's blocks, by home
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].outputs:
                if operand.block.id not in segment_of:
                    segment_of[operand.block.id] = s
                    made[s].append(operand.block.id)
    later_reads: set[int] = set()
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].inputs:
                home = segment_of.get(operand.block.id)
                if home is not None and home < s:
                    later_reads.add(operand.block.id)
    # NOTE: a segment that writes into a block that held data before it began (made by an
    # earlier instruction, or read before any write: outside data) cannot run again: the block
    # holds the value after that write, and a clone would apply it twice (exp(e, out=e) run
    # again on the e that is exp(e) already). Such a segment keeps its results. A state
    # update (`_updates_state`: a dropout draw moving its generator's count on) is not run
    # again but copied (`_clone_segment`), so it does not keep its segment.
    # NOTE: only the sweep's own outputs are asked about, and their first write is in the
    # sweep, so the scan stops at its end (a nested sweep's clones sit late in the program,
    # the forward pass's sweep early: ResNet-50's budget captures called this 427 times)
    first_write: dict[int, int] = {}
    outside: set[int] = set()
    end = max((members[-1] for members in segments if members), default=-1) + 1
    for i in range(end):
        instr = program[i]
        for operand in instr.inputs:
            bid = operand.block.id
            if bid in segment_of and bid not in first_write:
                outside.add(bid)
        for operand in instr.outputs:
            bid = operand.block.id
            if bid in segment_of and bid not in first_write:
                first_write[bid] = i
    dropped: list[set[int]] = []
    for s, members in enumerate(segments):
        rewrites = any(o.block.id in outside or first_write[o.block.id] < members[0]
                       for i in members if not _updates_state(program[i], intermediate)
                       for o in program[i].outputs)
        if not drop[s] or not members or rewrites:
            dropped.append(set())
            continue
        boundary = {o.block.id for o in program[members[-1]].outputs}
        dropped.append({bid for bid in made[s]
                        if bid in intermediate and bid in outside_reads
                        and bid not in boundary and bid not in later_reads})
    return dropped


def _clone_segment(program: list[Instruction], members: list[int], wanted: set[int],
                   intermediate: frozenset[int] | set[int]
                   ) -> tuple[list[Instruction], dict[int, Block]]:
    """Clones of a segment's instructions up to the last one writing a block in `wanted`, each
    writing a fresh block in place of the original's; and original block id -> fresh block.
    A clone reuses the original's `run` on other views, which is sound because `run` is a pure
    function of the views it is given (Note [closures hold no tensors] in runtime/autograd.py).
    An instruction that updates state in place (`_updates_state`: a dropout mask's draw moves
    its generator's count on) is not run again: its stand-in copies what it wrote, so the
    recompute sees the mask of the first run, and the state moves once a step."""
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
        if _updates_state(instr, intermediate):
            clones.append(_copy_of(instr, local))
            continue
        clone = _reading(instr, "recompute", local)
        clone.outputs = [_moved(o, local[o.block.id]) for o in instr.outputs]
        clones.append(clone)
    return clones, local


def _updates_state(instr: Instruction, intermediate: frozenset[int] | set[int]) -> bool:
    """Whether `instr` reads and writes one block that is not an intermediate (state kept
    from step to step: a dropout generator's count, a layer's step count). Run again during
    the backward pass it would read the state as later instructions left it, not as it read
    it, so its results would differ (another dropout mask)."""
    written = {o.block.id for o in instr.outputs}
    return any(o.block.id in written and o.block.id not in intermediate for o in instr.inputs)


def _copy_of(instr: Instruction, local: dict[int, Block]) -> Instruction:
    """The recompute's stand-in for the state update `instr`: the copy kernel moves each of
    its outputs, as the original left them, into the fresh block that takes its place (so the
    originals stay live until the recompute reads them)."""
    device = instr.outputs[0].block.device

    def run(views: list, *outs: Any) -> None:
        for view, out in zip(views, outs):
            device.unary("copy", view, out)

    return Instruction("copy", "never", list(instr.outputs),
                       [_moved(o, local[o.block.id]) for o in instr.outputs], run=run,
                       phase="recompute")


def _reading(instr: Instruction, phase: str, renamed: dict[int, Block]) -> Instruction:
    """A copy of `instr` in `phase` whose inputs in `renamed` read the new blocks instead."""
    inputs = [_moved(o, renamed[o.block.id]) if o.block.id in renamed else o
              for o in instr.inputs]
    return Instruction(instr.op, instr.policy, inputs, instr.outputs, run=instr.run,
                       scalars=instr.scalars, host=instr.host, phase=phase)


def _moved(operand: Operand, block: Block) -> Operand:
    return Operand(block, operand.offset, operand.shape, operand.strides, operand.dtype)
