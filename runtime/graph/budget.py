"""Fitting a memory budget (`runtime.graph(..., memory_budget=N)`): for every forward result the
backward pass reads, keep it or recompute it, chosen by cost; then plan what is kept.

The model of cost (docs/graph.md, "Memory budgets"):

- **Units.** The forward instructions are cut after each one whose result the backward pass
  reads: a unit is a run of forward instructions ending with such a result (for an MLP, one
  Dense layer and its activation). The instructions after the last one join the last unit.
- **Work** is counted in floating-point operations per instruction (`flops`): 2mnk for a matrix
  product, one per element for the rest. Recomputing a unit costs its forward work again.
- **Memory** is counted in units held at once, then checked in bytes: a choice is rewritten
  into the program, scheduled, fused and planned exactly as the graph will run it, and its peak
  under the graph's plan (the static arena, or recycle's highest point) is what must fit.
- **Choice.** A sweep of L units whose input is kept, with room for s units, either keeps all
  its results (L <= s) or splits off its first k units: of those only the last result is kept
  during the sweep, the rest of the sweep goes on with room for s - 1, and the k units are
  recomputed from their input when the backward pass reaches them, that recompute being a
  sweep with room for s again. The least work T(L, s) over every split is a dynamic programme
  (Griewank's binomial checkpointing, with a recompute that keeps what it makes; Chen et al.'s
  sqrt(n) is one point of it, Checkmate solves the general graph with an integer programme):
      T(L, s) = 0 if L <= s, else min over k of T(L - k, s - 1) + cost(k - 1 units) + T(k, s).
  Room for 2 reaches any depth (at quadratic work); more room costs less work.
- **Search.** The budget is bytes, the DP counts units: the largest room whose real planned
  peak fits is found by bisection (each probe is one rewrite and plan, tens of milliseconds on
  config D), so the choice is the least recompute work among the plans that fit. Deterministic:
  no clocks, no random numbers.
- **Moves** to host memory and back (`move.py`) are chosen only on devices whose memory is not
  the host's (`Device.host_memory` False: OpenCL, CUDA), and there before any recompute: the
  fewest units, from the first (whose results wait longest for the backward pass), whose
  results moved out after their last forward use and back before their first backward use make
  the plan fit, found by bisection; they cost bytes copied (`moved_bytes`), no device work.
  When moving all but the last unit's results does not fit, the graph recomputes instead (no
  mix of the two yet). On the CPU device a move would free nothing: the report says so.

A budget below the least peak any room reaches is refused when planned, naming both (a
`BudgetError`, an `OutOfMemoryError`), before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from allocators import OutOfMemoryError, format_bytes
from runtime.graph.checkpoint import _recompute_sweep
from runtime.graph.move import _move
from runtime.graph.program import Recorded
from runtime.tape import Instruction

__all__ = ["BudgetError"]

#: At most this many units: `_table` takes about units**2 NumPy calls (65 units: 20 ms).
_MAX_UNITS = 256
#: Ops whose work is a matrix product: 2 * rows * columns * inner.
_PRODUCTS = frozenset({"matmul", "linear"})


class BudgetError(OutOfMemoryError):
    """A memory budget below the least peak of intermediates that any choice of keeping and
    recomputing reaches; raised when the graph is planned, before anything runs.

    Attributes: `budget_bytes` (asked) and `least_bytes` (the least reached)."""

    def __init__(self, message: str, *, budget_bytes: int, least_bytes: int) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.least_bytes = least_bytes


def flops(instr: Instruction) -> int:
    """Floating-point operations of one instruction: 2mnk for a matrix product (m x k times
    k x n), else one per element of its largest operand; a load is free."""
    if instr.kind == "load":
        return 0
    if instr.op in _PRODUCTS and instr.outputs and instr.inputs:
        inner = instr.inputs[0].shape[-1] if instr.inputs[0].shape else 1
        return 2 * math.prod(instr.outputs[0].shape) * inner
    sizes = [math.prod(o.shape) for o in (*instr.inputs, *instr.outputs)]
    return max(sizes, default=0)


# ---------------------------------------------------------------------- the choice
@dataclass(frozen=True)
class _Sweep:
    """Units computed forward once, cut into parts: (first unit, count, how the recompute of
    the part runs: a sweep of its own, or None when it keeps all it makes). Every part but the
    last is dropped and recomputed; the last keeps its results."""

    parts: tuple[tuple[int, int, _Sweep | None], ...]


@dataclass(frozen=True, kw_only=True)
class Choice:
    """What the budget chose, for `Graph.memory_report`."""

    #: the budget in bytes, and where it came from ("memory_budget" or the allocator's limit)
    budget: int
    source: str
    #: units, and the most units kept at once (None: everything kept)
    units: int
    room: int | None
    #: nesting of the recomputes (0: none)
    depth: int
    #: why nothing is moved to host memory
    moves: str


@functools.lru_cache(maxsize=16)
def _table(units: int) -> tuple[np.ndarray, np.ndarray]:
    """T[s, L] (least recompute work, in units, for a sweep of L units with room for s; inf
    where none fits) and the split k that reaches it, for L, s in 0..units."""
    n = units
    cost = np.full((n + 1, n + 1), np.inf)
    split = np.zeros((n + 1, n + 1), dtype=np.int64)
    for s in range(1, n + 1):
        cost[s, : s + 1] = 0.0
        if s == 1:
            continue
        for length in range(s + 1, n + 1):
            k = np.arange(1, length)
            total = cost[s - 1, length - k] + (k - 1) + cost[s, k]
            best = int(np.argmin(total))
            cost[s, length] = total[best]
            split[s, length] = best + 1
    cost[0, 0] = 0.0
    return cost, split


def _sweep(first: int, length: int, room: int, split: np.ndarray) -> _Sweep:
    """The parts `_table` chose for units first .. first + length - 1 with room for `room`."""
    parts: list[tuple[int, int, _Sweep | None]] = []
    while length > room:
        k = int(split[room, length])
        parts.append((first, k, _sweep(first, k, room, split) if k > room else None))
        first, length, room = first + k, length - k, room - 1
    parts.append((first, length, None))
    return _Sweep(tuple(parts))


def _depth(sweep: _Sweep | None) -> int:
    if sweep is None:
        return 0
    return 1 + max((_depth(nested) for _, _, nested in sweep.parts[:-1]), default=-1)


# ---------------------------------------------------------------------- units and rewriting
def _wanted(program: Sequence[Instruction], intermediate: frozenset[int]) -> set[int]:
    """Intermediates written by the forward pass that an instruction after it reads."""
    made = {o.block.id for instr in program if instr.phase == "forward" for o in instr.outputs}
    return {o.block.id for instr in program if instr.phase != "forward"
            for o in instr.inputs if o.block.id in made and o.block.id in intermediate}


def _units(program: Sequence[Instruction], wanted: set[int]) -> list[list[Instruction]]:
    """The forward instructions cut after each one writing a result the backward pass reads."""
    units: list[list[Instruction]] = [[]]
    for instr in program:
        if instr.phase != "forward":
            continue
        units[-1].append(instr)
        if any(o.block.id in wanted for o in instr.outputs):
            units.append([])
    if not units[-1]:
        units.pop()
    elif len(units) > 1:
        units[-2].extend(units.pop())  # NOTE: the tail (the loss) joins the last unit
    if len(units) > _MAX_UNITS:  # NOTE: neighbours merged, so the table stays small
        per = -(-len(units) // _MAX_UNITS)
        units = [[i for unit in units[k:k + per] for i in unit]
                 for k in range(0, len(units), per)]
    return units


def _apply(recorded: Recorded, units: list[list[Instruction]], sweep: _Sweep) -> Recorded:
    """`recorded` with `sweep` rewritten into its program: each dropped part's results are
    recomputed, nested sweeps recomputing parts of those recomputes in turn."""
    program = list(recorded.program)
    intermediate = set(recorded.intermediate)
    clones = 0
    # NOTE: (sweep, image): image maps an original forward instruction to the instruction that
    # computes it in this sweep (itself, or a clone of a clone)
    work: list[tuple[_Sweep, dict[int, Instruction]]] = [
        (sweep, {id(i): i for unit in units for i in unit})]
    while work:
        current, image = work.pop()
        where = {id(instr): position for position, instr in enumerate(program)}
        segments: list[list[int]] = []
        originals: list[list[Instruction]] = []
        for first, count, _ in current.parts:
            members = [i for unit in units[first:first + count] for i in unit if id(i) in image]
            originals.append(members)
            segments.append([where[id(image[id(i)])] for i in members])
        drop = [True] * (len(segments) - 1) + [False]
        program, made = _recompute_sweep(program, intermediate, segments, drop)
        for (_, _, nested), members, part_clones in zip(current.parts, originals, made):
            clones += len(part_clones)
            intermediate.update(o.block.id for c in part_clones for o in c.outputs)
            if nested is not None and part_clones:
                work.append((nested, {id(o): c for o, c in zip(members, part_clones)}))
    blocks = dict(recorded.blocks)
    blocks.update((o.block.id, o.block) for instr in program for o in instr.outputs
                  if o.block.id not in blocks)
    return dataclasses.replace(recorded, program=program, blocks=blocks,
                               intermediate=frozenset(intermediate), recomputed=clones)


# ---------------------------------------------------------------------- moves
def _fit_moves(recorded: Recorded, units: list[list[Instruction]], wanted: set[int],
               budget: int, plan_of: Callable[[Recorded], tuple[object, int]], device: Any
               ) -> tuple[tuple[Recorded, object, int, int] | None, int]:
    """The fewest units, from the first on (their results wait longest for the backward pass),
    whose results moved to host memory and back make the plan fit (None when moving all but
    the last unit's does not), and the least peak seen."""

    def moved(count: int) -> tuple[Recorded, list[int], int]:
        blocks = sorted({o.block.id for unit in units[:count] for i in unit
                         for o in i.outputs if o.block.id in wanted})
        intermediate = set(recorded.intermediate)
        program, copied = _move(list(recorded.program), intermediate, blocks, device)
        tape = dataclasses.replace(recorded, program=program, intermediate=frozenset(
            intermediate), blocks={**recorded.blocks, **{
                o.block.id: o.block for i in program for o in (*i.inputs, *i.outputs)}})
        return tape, blocks, copied

    best, least = None, None
    low, high = 1, len(units) - 1
    while low <= high:  # NOTE: the fewest units that fit
        middle = (low + high) // 2
        tape, blocks, copied = moved(middle)
        made, peak = plan_of(tape)
        least = peak if least is None else min(least, peak)
        if peak <= budget:
            best = (tape, made, len(blocks), copied)
            high = middle - 1
        else:
            low = middle + 1
    return best, least if least is not None else budget + 1


# ---------------------------------------------------------------------- the search
@dataclass(frozen=True)
class Fitted:
    """A choice that fits: the rewritten tape, what planning it gave (`plan_of`'s result) and
    the report."""

    recorded: Recorded
    planned: object
    choice: Choice


def _fit(recorded: Recorded, budget: int, source: str,
         plan_of: Callable[[Recorded], tuple[object, int]], *, device: Any,
         name: str) -> Fitted:
    """The least recompute work whose planned peak fits `budget` bytes; on a device whose
    memory is not the host's, first the fewest moves to host memory that fit.

    `plan_of(recorded)` schedules, fuses and plans a tape and returns (what it made, its peak in
    bytes). Raises BudgetError when nothing fits, naming the least peak reached."""
    program, intermediate = recorded.program, recorded.intermediate
    wanted = _wanted(program, intermediate)
    units = _units(program, wanted)
    moves = (f"none: the {device.name} device's memory is the host's" if device.host_memory
             else "none: everything fits without")

    def choice(room: int | None, depth: int, why: str = moves) -> Choice:
        return Choice(budget=budget, source=source, units=len(units), room=room, depth=depth,
                      moves=why)

    planned, peak = plan_of(recorded)
    if peak <= budget:
        return Fitted(recorded, planned, choice(None, 0))
    peaks = {len(units): peak}
    if not device.host_memory and len(units) > 1:
        # NOTE: room -1 stands for the moves in `peaks`
        found, peaks[-1] = _fit_moves(recorded, units, wanted, budget, plan_of, device)
        if found is not None:
            candidate, made, count, copied = found
            why = (f"{count} forward results of the first units moved to host memory and back "
                   f"({copied} bytes a step): on {device.name} that frees device memory at "
                   f"no recompute")
            return Fitted(candidate, made, choice(None, 0, why))
        moves = (f"none: moving every forward result but the last unit's to host memory does "
                 f"not fit on {device.name}; recomputed instead")
    fits: dict[int, tuple[Recorded, object]] = {}
    if len(units) > 2:
        _, split = _table(len(units))

        def probe(room: int) -> bool:
            sweep = _sweep(0, len(units), room, split)
            candidate = _apply(recorded, units, sweep)
            made, peaks[room] = plan_of(candidate)
            if peaks[room] <= budget:
                fits[room] = (candidate, made)
            return room in fits

        low, high = 2, len(units) - 1
        while low <= high:  # NOTE: the largest room that fits: the least work
            middle = (low + high) // 2
            if probe(middle):
                low = middle + 1
            else:
                high = middle - 1
    if not fits:
        least = min(peaks.values())
        raise BudgetError(
            f"{name}: a memory budget of {budget} bytes ({format_bytes(budget)}, {source}) is "
            f"below the least any choice reaches: {least} bytes ({format_bytes(least)}) of "
            f"intermediates, recomputing every forward result the backward pass reads down "
            f"to two units kept at once{' or moving them to host memory' if -1 in peaks else ''}"
            f" ({len(units)} units; {peak} bytes keeping everything); nothing has run",
            budget_bytes=budget, least_bytes=least)
    room = max(fits)
    candidate, made = fits[room]
    sweep = _sweep(0, len(units), room, _table(len(units))[1])
    return Fitted(candidate, made, choice(room, _depth(sweep)))
