"""The memory plan: buffer lifetimes over the steps, the static arena, the commit point, and what
"none" and "recycle" replays allocate and free at each step.

A replay makes every allocator call before the first step that writes state
(Note [the commit point] in runtime/nn.py): `_commit_point` finds that step; "static" takes its
whole arena before the first step, "none" and "recycle" take the buffers first used from the
commit on in one go just before it (`replay._take_tail`), and the blocks the graph keeps and the
fused chains' scratch (once a capture, `replay._take_scratch`) get memory before anything runs.
A new kind of replay, or a phase that moves a write to state earlier, must keep this.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from runtime import planner
from runtime.block import Block
from runtime.graph.fuse import _scratch_keys
from runtime.graph.program import Fused, MemoryPlan, Recorded, _Step


def _plan_memory(fused: Fused, recorded: Recorded, made_here: Callable[[Block], bool], *,
                 plan: str, alignment: int, device: Any,
                 size: Callable[[int], int]) -> MemoryPlan:
    """Phase 5: lifetimes of `fused`'s buffers, their static placement, the commit point, the
    allocations of a "none" or "recycle" replay (compared at the allocator's `size` of each
    request with the static placement: `_recycle_or_one_arena`), and the fused chains'
    scratch on `device` (one allocation of the graph's allocator, held by the capture like a
    static arena)."""
    scratch: dict[tuple, int] = {}
    scratch_bytes = 0
    for key in _scratch_keys(fused.steps, device):
        shape, dtype, _ = key
        scratch[key] = scratch_bytes
        scratch_bytes += -(-math.prod(shape) * dtype.itemsize // alignment) * alignment
    lifetimes = _lifetimes(fused, recorded.blocks)
    commit, state = _commit_point(fused.steps, {block.id for block in recorded.outside},
                                  made_here)
    starts: dict[int, list[planner.Lifetime]] = {}
    ends: dict[int, list[int]] = {}
    tail = []
    for life in lifetimes:
        if life.first >= commit:
            tail.append(life)
            continue
        starts.setdefault(life.first, []).append(life)
        if plan == "recycle":
            ends.setdefault(life.last, []).append(life.key)
    tail_plan = planner.plan(tail, alignment=alignment) if plan == "recycle" and tail else None
    memory = MemoryPlan(lifetimes=lifetimes,
                        static_plan=planner.plan(lifetimes, alignment=alignment),
                        commit=commit, state=state, starts=starts, ends=ends, tail=tail,
                        tail_plan=tail_plan, tail_at=commit, scratch=scratch,
                        scratch_bytes=scratch_bytes)
    return _recycle_or_one_arena(memory, len(fused.steps), size) if plan == "recycle" else memory


def _recycle_or_one_arena(memory: MemoryPlan, n: int, size: Callable[[int], int]
                          ) -> MemoryPlan:
    """"recycle"'s plan, or the static placement where that holds fewer bytes at once: every
    buffer in one arena taken before the first step (also where the allocator's rounding of
    many small requests outweighs what recycling saves). Recycle frees the buffers first used
    before the commit point as they die and takes the tail's arena at the commit, planned
    apart from those still live then, so the two can sit on top of each other: a training
    step's commit point is its first update, and SGD's updates, folded into the products,
    begin with the backward pass, while the forward pass's activations are all live."""
    most = max(_timeline(memory, "recycle", n, size), default=0)
    if most <= max(_timeline(memory, "static", n, size), default=0):
        return memory
    return dataclasses.replace(memory, starts={}, ends={}, tail=memory.lifetimes,
                               tail_plan=memory.static_plan, tail_at=0)


def _timeline(memory: MemoryPlan, plan: str, n: int, size: Callable[[int], int]) -> list[int]:
    """Bytes held at each of the `n` steps under `plan`, each allocation counted at `size` of
    its request (the graph's `Allocator.allocation_size`: what the allocator really sets aside)
    ("static": the arena throughout; "none": nothing goes back before the end of the step;
    "recycle": live bytes, and the tail arena from the commit point on), the scratch of the
    fused chains held throughout."""
    commit = memory.tail_at
    held = size(memory.scratch_bytes) if memory.scratch else 0
    if plan == "static":
        arena = size(memory.static_plan.planned_bytes) if memory.static_plan.offsets else 0
        return [arena + held] * n
    if plan == "none":
        grown = [0] * n
        for life in memory.lifetimes:
            grown[min(life.first, commit)] += size(life.nbytes)
        return [held + b for b in np.cumsum(grown).tolist()] if n else []
    early = [planner.Lifetime(life.key, life.first, life.last, size(life.nbytes))
             for lives in memory.starts.values() for life in lives]
    live = planner.live_bytes(early, n) if early else [0] * n
    if memory.tail_plan is not None:
        tail = size(memory.tail_plan.planned_bytes)
        live[commit:] = [b + tail for b in live[commit:]]
    return [held + b for b in live]


def _lifetimes(fused: Fused, blocks: dict[int, Block]) -> list[planner.Lifetime]:
    """Each buffer from the first step that touches it to the last, at the size of the largest
    block it holds."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for position, step in enumerate(fused.steps):
        for instr in step.instructions:
            for operand in (*instr.inputs, *instr.outputs):
                buffer = fused.buffer_of.get(operand.block.id)
                if buffer is not None:
                    first.setdefault(buffer, position)
                    last[buffer] = position
    sizes: dict[int, int] = {}
    for bid, buffer in fused.buffer_of.items():
        sizes[buffer] = max(sizes.get(buffer, 0), blocks[bid].nbytes)
    return [planner.Lifetime(b, first[b], last[b], sizes[b]) for b in first]


def _commit_point(steps: Sequence[_Step], outside: set[int],
                  made_here: Callable[[Block], bool]) -> tuple[int, set[int]]:
    """The position of the first step that writes state, and the blocks of state written.

    State is a block that existed before the capture (parameters, earlier optimizer state) or
    one made here that a step reads before or where it first writes it (state carried from step
    to step). Outputs that are only written are not state (Note [the commit point])."""
    read: set[int] = set()
    written: set[int] = set()
    state: set[int] = set()
    commit = len(steps)
    for position, step in enumerate(steps):
        for instr in step.instructions:
            read.update(o.block.id for o in instr.inputs)
            for operand in instr.outputs:
                block = operand.block
                if block.id in outside and block.id not in written and (
                        block.id in read or not made_here(block)):
                    state.add(block.id)
                    commit = min(commit, position)
                written.add(block.id)
    return commit, state
