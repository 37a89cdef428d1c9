"""Fitting a memory budget (`runtime.graph(..., memory_budget=N)`): for every forward result the
backward pass reads, keep it, recompute it, move it to host memory or (only with `lossy`) store
it in a half dtype while it waits, chosen by cost; then plan what is kept.

The model of cost (docs/graph.md, "Memory budgets"):

- **Pointwise first.** Every family below is searched three times: on the tape as captured,
  on `checkpoint._pointwise`'s rewrite (Note [pointwise recompute]) and on its local rewrite
  (only results whose forward reads end before the next kept result; the full one drops a
  residual block's output, which the block's last add reads, so its units are whole blocks).
  Each rewrite is a candidate itself: its recompute is one elementwise pass per result, where
  a unit's is a layer.
- **Units.** The forward instructions are cut after each one whose result the backward pass
  reads, unless what else made so far is read later in the forward pass takes more bytes
  than the unit's results: a unit is a run of
  forward instructions ending with such a result (for an MLP, one Dense layer and its
  activation). The instructions after the last one join the last unit, and so does a unit
  whose results fit in one 64-byte alignment unit (`_units`).
- **Work** is counted in floating-point operations per instruction (`flops`): 2mnk for a matrix
  product, one per element for the rest. Recomputing a unit costs its forward work again.
- **Memory** is counted in units held at once, then checked in bytes: a choice is rewritten
  into the program, scheduled, fused and planned exactly as the graph will run it, and its peak
  under the graph's plan (the static arena, or recycle's highest point, and the fused chains'
  scratch, each allocation at the size the allocator hands out: `memory._timeline`) is what
  must fit.
- **Choice.** A sweep of L units whose input is kept, with room for s units, either keeps all
  its results (L <= s) or splits off its first k units: of those only the last result is kept
  during the sweep, the rest of the sweep goes on with room for s - 1, and the k units are
  recomputed from their input when the backward pass reaches them, that recompute being a
  sweep with room for s again. The least work T(L, s) over every split is a dynamic programme
  (Griewank's binomial checkpointing, with a recompute that keeps what it makes; Chen et al.'s
  sqrt(n) is one point of it, Checkmate solves the general graph with an integer programme):
      T(L, s) = 0 if L <= s, else min over k of T(L - k, s - 1) + cost(k - 1 units) + T(k, s).
  Room for 2 reaches any depth (at quadratic work); more room costs less work.
  Room counts results plus the gradient the backward pass holds while a recompute runs:
  over every schedule of a chain, not only nested splits, T(L, s) is the least work with s + 1
  buffers counting that gradient (tests/test_budget.py checks it exhaustively for small
  chains). Counting results alone, a recompute need not hold its boundary result (the
  backward pass has read it first): T(k - 1, s) in place of T(k, s), less work for the same
  activations but one buffer more in all, so never the cheaper fit of a byte budget.
- **Parts by bytes and work.** The programme counts every unit alike; a conv net's units
  differ tenfold in bytes and in work (ResNet-50: a 1x1 convolution's output is 4 times its
  3x3 neighbour's at under half the work, a ReLU's costs a pass). One more family cuts the
  units into parts for one level of recompute by a second programme over (where the parts so
  far end, the bytes they keep), whose estimate of the peak while the backward pass walks a
  part is the kept results before it, the part's own results, and what the plan that keeps
  everything holds there besides forward results (`_segments`, `_Search.besides`); the room
  it aims at is moved by what the real plan held, then bisected, up to six plans; a unit whose
  results a later part reads (a residual block's input) counts as kept. A part keeps every result
  of its last unit (`_apply`'s `keep`): before, only the last instruction's, so a batch norm
  unit dropped its 1 KiB 1 / std and recomputed its convolution for it, and every budget on
  ResNet-50 recomputed about one whole forward pass.
- **Search.** The budget is bytes, the DP counts units: the largest room whose real planned peak
  fits is found by a search that steps by the bytes a unit is worth, as a secant between the
  nearest probes, bisecting when that stalls (each probe is one rewrite and plan, tens of
  milliseconds on config D; two to four probes where a bisection takes six or seven). Other
  candidates are planned for real too: checkpoint="sqrt"'s segments (a cut by instructions,
  which sometimes fits the same bytes with less work); on devices whose memory is not the host's
  (`Capabilities.host_memory` False: OpenCL, CUDA), moves to host memory (`move.py`): the fewest
  first units whose waiting results moved out and back make the plan fit, and mixes (the DP's
  largest room with every waiting forward result moved; a quarter, half or three quarters of the
  units moved and the DP on the rest); with `lossy`, the fewest first units whose waiting results
  stored in a half dtype make it fit, else the DP's largest room with every waiting result,
  recomputed ones too, stored so. Where moves compete they are planned first, and a family of
  rooms is skipped when a candidate already costs no more than its floor (`_Search.floor`).
- **Cost.** The cheapest candidate that fits wins (the first tried among equals: lossless
  before lossy), in seconds added to a step: recompute flops times the seconds per flop,
  elements cast by lossy stores times the seconds per element, bytes moved (`moved_bytes`,
  both ways) times the seconds per byte, and a kernel call for every added instruction. The
  rates are measured on the device once a process (`rates`: a 1 MiB copy each way, a
  256-cubed product, a cast, a one-element call) and only where a move or a lossy store
  competes; otherwise (the CPU device without `lossy`) flops alone decide, with no clock
  read, so the choice is deterministic.

A budget below the least peak any room reaches is refused when planned, naming both (a
`BudgetError`, an `OutOfMemoryError`), before anything runs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from allocators import OutOfMemoryError, format_bytes
from runtime import planner
from runtime.graph.checkpoint import _checkpoint, _pointwise, _recompute_sweep, _wanted
from runtime.graph.move import Stored, _halve, _move
from runtime.graph.program import Recorded
from runtime.tape import Instruction

__all__ = ["BudgetError"]

#: At most this many units: `_table` takes about units**2 NumPy calls (65 units: 20 ms).
_MAX_UNITS = 256
#: Bytes below which a result costs one alignment unit of every plan (64 at least).
_ALIGNED = 64
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
    #: what is moved to host memory, or why nothing is
    moves: str
    #: the choice in words
    schedule: str = "everything kept"
    #: the results stored lossy (`runtime.graph(..., lossy=...)`), each with its dtype
    lossy: tuple[Stored, ...] = ()


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


#: the kept bytes `_segments` counts in steps of budget / this
_SEGMENT_BINS = 1024
#: where no parts fit the estimate, the room aimed at grows by this share of the budget
_SEGMENT_REAIM = 0.08
#: the most plans the parts family makes for one budget it aims at
_SEGMENT_PLANS = 6
#: the budgets it aims at, as shares less than the budget, until one plans parts that fit
_SEGMENT_SMALLER = (0.0, 0.01, 0.02, 0.04)


def _segments(sizes: np.ndarray, work: np.ndarray, besides: np.ndarray, reach: list[int],
              room: float) -> tuple[tuple[int, int], ...] | None:
    """Units cut into parts (first, count) for one level of recompute, at the least work whose
    estimated peak fits in `room` bytes; None if none does. Each part keeps its last unit's
    results and recomputes the others from the part before it (a part of one unit recomputes
    nothing). While the backward pass walks part j, what is live is the kept results of the
    parts before it, all of part j's results (recomputed or kept) and what the backward pass
    holds besides forward results there (`besides[i]` for unit i: gradients, a convolution's
    columns), so a part may be long where the backward pass holds little and few results are
    kept before it. A unit whose results a later part's forward instructions read (a residual
    block's input, read by its last add: `reach[i]`, the last unit reading unit i's) stays
    kept however its part is cut (`checkpoint._dropped`), and counts so. `sizes` and `work`
    are each unit's result bytes and recompute cost: they
    differ tenfold between units (ResNet-50: a 1x1 convolution's output is 4 times its 3x3
    neighbour's, at under half the work), which the programme's room, counted in units, does
    not see.

    A dynamic programme over (where the parts so far end, the bytes they keep, in steps of
    room / _SEGMENT_BINS rounded up): the least work of each."""
    n = len(sizes)
    step = room / _SEGMENT_BINS
    if step <= 0:
        return None
    bins = _SEGMENT_BINS + 1
    least = np.full((n + 1, bins), np.inf)
    least[0, 0] = 0.0
    back = np.full((n + 1, bins, 2), -1, dtype=np.int64)
    total_bytes = np.concatenate([[0.0], np.cumsum(sizes)])
    total_work = np.concatenate([[0.0], np.cumsum(work)])
    for end in range(1, n + 1):
        keep = float(sizes[end - 1])
        highest = 0.0
        for start in range(end - 1, -1, -1):
            highest = max(highest, float(besides[start]))
            if start < end - 1 and reach[start] >= end:  # NOTE: a later part reads it: kept
                keep += float(sizes[start])
            grow = int(math.ceil(keep / step))
            live = total_bytes[end] - total_bytes[start] + highest
            before = int((room - live) // step)  # NOTE: the most kept bins before the part
            if before < 0:
                break  # NOTE: longer parts hold more
            top = min(before, bins - 1 - grow)
            if top < 0:
                continue
            candidate = least[start, :top + 1] + (total_work[end - 1] - total_work[start])
            target = least[end, grow:grow + top + 1]
            better = candidate < target
            if better.any():
                target[better] = candidate[better]
                where = np.nonzero(better)[0]
                back[end, where + grow, 0] = start
                back[end, where + grow, 1] = where
    if not np.isfinite(least[n]).any():
        return None
    kept = int(np.argmin(least[n]))
    parts, end = [], n
    while end:
        start, before = back[end, kept]
        parts.append((int(start), end - int(start)))
        end, kept = int(start), int(before)
    parts.reverse()
    return tuple(parts)


def _depth(sweep: _Sweep | None) -> int:
    if sweep is None:
        return 0
    return 1 + max((_depth(nested) for _, _, nested in sweep.parts[:-1]), default=-1)


# ---------------------------------------------------------------------- units and rewriting
def _result_bytes(unit: Sequence[Instruction], wanted: set[int]) -> int:
    """Bytes of the results of `unit` that the backward pass reads."""
    return sum(o.block.nbytes for i in unit for o in i.outputs if o.block.id in wanted)


def _units(program: Sequence[Instruction], wanted: set[int],
           intermediate: frozenset[int]) -> list[list[Instruction]]:
    """The forward instructions cut after each one writing a result the backward pass reads,
    unless what else made so far is read later in the forward pass takes more bytes than the
    unit's results (batch norm's centred x runs past its 1 / std to make x-hat: a cut between
    them would leave a unit of 1 / std alone, and a recompute of x-hat reading the centred x,
    held all along, so dropping x-hat would save nothing; a residual stream, as large as a
    layer's results, crosses every cut of a transformer and stops none); a unit whose results
    fit in one alignment unit joins the one before it.

    The programme counts room in units, each as if it held a layer's result. A unit whose
    results take at most the plans' 64-byte alignment (a loss's mean, a scalar) costs no room
    worth a unit, and counting it as one costs work: config D's 4-byte loss unit made 66 units
    where 65 count, 88 extra unit forwards at room 8 where 86 do. Such a unit joins the unit
    before it (recomputed with it, if at all)."""
    forward = [instr for instr in program if instr.phase == "forward"]
    last_read: dict[int, int] = {}
    for position, instr in enumerate(forward):
        for operand in instr.inputs:
            last_read[operand.block.id] = position
    units: list[list[Instruction]] = [[]]
    # NOTE: intermediates no backward reads that a later forward instruction reads, by id
    crossing: dict[int, int] = {}
    results = 0  # NOTE: bytes of the open unit's results that the backward pass reads
    for position, instr in enumerate(forward):
        units[-1].append(instr)
        for o in instr.inputs:
            if last_read[o.block.id] == position:
                crossing.pop(o.block.id, None)
        for o in instr.outputs:
            if o.block.id in wanted:
                results += o.block.nbytes
            elif o.block.id in intermediate and last_read.get(o.block.id, -1) > position:
                crossing[o.block.id] = o.block.nbytes
        if any(o.block.id in wanted for o in instr.outputs) \
                and sum(crossing.values()) <= results:
            units.append([])
            results = 0
    if not units[-1]:
        units.pop()
    elif len(units) > 1:
        units[-2].extend(units.pop())  # NOTE: the tail (the loss) joins the last unit
    merged: list[list[Instruction]] = []
    for unit in units:
        if merged and _result_bytes(unit, wanted) <= _ALIGNED:  # NOTE: no room worth a unit
            merged[-1].extend(unit)
        else:
            merged.append(unit)
    units = merged
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
        keep: list[set[int]] = []
        for first, count, _ in current.parts:
            members = [i for unit in units[first:first + count] for i in unit if id(i) in image]
            originals.append(members)
            segments.append([where[id(image[id(i)])] for i in members])
            # NOTE: a part keeps every result of its last unit, not only the last
            # instruction's: a unit of batch norm ends with x-hat after its 1 / std, and
            # dropping the 1 / std would recompute the unit's convolution for 1 KiB
            last = units[first + count - 1] if count else []
            keep.append({o.block.id for i in last if id(i) in image
                         for o in image[id(i)].outputs})
        drop = [True] * (len(segments) - 1) + [False]
        program, made = _recompute_sweep(program, intermediate, segments, drop, keep)
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


# ---------------------------------------------------------------------- rates
@dataclass(frozen=True)
class Rates:
    """What a device's work costs, in seconds, measured (`rates`)."""

    #: a byte moved to host memory and back, per byte each way (`moved_bytes` counts both)
    per_byte: float
    #: a floating-point operation of a matrix product
    per_flop: float
    #: an element cast between float32 and a half dtype
    per_element: float
    #: a kernel call on one element: what any added instruction costs besides its work
    per_call: float


#: id(device) -> (device, its rates): measured once a process
_RATES: dict[int, tuple[Any, Rates]] = {}
#: the probes' sizes: bytes copied each way, and the side of the square product and cast;
#: and the tries each takes the best of: at least 7, and up to 25 until 30 ms have passed (on
#: a shared machine a product's threads stall some tries, by up to a hundred times)
_PROBE_BYTES = 1 << 20
_PROBE_SIDE = 256
_PROBE_TRIES = (7, 25)


def rates(device: Any) -> Rates:
    """The seconds `device` takes to move bytes, multiply, cast and call a kernel, measured at
    the first call for it in this process by short probes (a 1 MiB copy out and in, a
    256 x 256 x 256 product, a 256 x 256 cast to float16 and back, a one-element cast; the best
    of 7 to 25 tries each, 20 to 120 ms on a CPU) and cached: the exchange rates of moves and lossy
    stores against recompute, never constants."""
    known = _RATES.get(id(device))
    if known is None or known[0] is not device:
        known = (device, _probe(device))
        _RATES[id(device)] = known
    return known[1]


def _probe(device: Any) -> Rates:
    side, half = _PROBE_SIDE, np.dtype(np.float16)
    sizes = (_PROBE_BYTES, *[side * side * 4] * 3, side * side * 2, 4, 2)
    raws = [device.raw_alloc(n) for n in sizes]
    try:
        square = [device.array_view(raw, 0, (side, side), np.float32, (side * 4, 4))
                  for raw in raws[1:4]]
        narrow = device.array_view(raws[4], 0, (side, side), half, (side * 2, 2))
        one = device.array_view(raws[5], 0, (1,), np.float32, (4,))
        one_half = device.array_view(raws[6], 0, (1,), half, (2,))
        for raw in (*raws[1:3], raws[5]):
            device.copyin(raw, 0, np.full(device.nbytes_of(raw) // 4, 0.5, np.float32))
        host = np.arange(_PROBE_BYTES, dtype=np.uint32).astype(np.uint8)

        def best(run: Callable[[], Any]) -> float:
            run()
            device.synchronize()
            seconds, began = math.inf, time.perf_counter()
            for tried in range(_PROBE_TRIES[1]):
                if tried >= _PROBE_TRIES[0] and time.perf_counter() - began > 0.03:
                    break
                start = time.perf_counter()
                run()
                device.synchronize()
                seconds = min(seconds, time.perf_counter() - start)
            return max(seconds, 1e-9)

        copy = best(lambda: (device.copyin(raws[0], 0, host),
                             device.copyout(raws[0], 0, _PROBE_BYTES)))
        product = best(lambda: device.matmul(square[0], square[1], square[2]))
        cast = best(lambda: (device.cast(square[0], narrow), device.cast(narrow, square[2])))
        call = best(lambda: [device.cast(one, one_half) for _ in range(10)]) / 10
    finally:
        for raw in raws:
            device.raw_free(raw)
    return Rates(per_byte=copy / (2 * _PROBE_BYTES), per_flop=product / (2 * side**3),
                 per_element=max(cast - 2 * call, 1e-12) / (2 * side * side), per_call=call)


# ---------------------------------------------------------------------- the search
@dataclass(frozen=True)
class Fitted:
    """A choice that fits: the rewritten tape, what planning it gave (`plan_of`'s result) and
    the report."""

    recorded: Recorded
    planned: object
    choice: Choice


@dataclass(frozen=True)
class _Candidate:
    """A rewritten tape that fits, its cost in seconds (flops when no rates were measured) and
    how it was made."""

    cost: float
    recorded: Recorded
    planned: object
    room: int | None
    depth: int
    schedule: str
    moves: str
    lossy: tuple[Stored, ...] = ()
    #: the units of the tape the choice was made on
    units: int = 0


# Note [a refusal's least fits]: a BudgetError names the least peak a budget's search reached,
# and a user (and tests/test_graph_layers.py) takes that least as the next budget. But which
# plans a search makes depends on its budget (the rooms the programme probes are aimed at it,
# and so are the segments' parts), and a plan's peak need not rise with its room: a refusal at
# a budget of 1 byte planned room 3 at 8192 bytes, while at a budget of 8192 the probes went
# from room 7 to 2 (8704) past room 3, and refused again. So where nothing fits, the
# programme also plans its _SMALLEST_ROOMS smallest rooms, whatever the budget, and the least
# a refusal names is the least of the plans every failed search makes (keeping everything,
# checkpoint="sqrt", those rooms): a budget of that least finds that plan again, and fits.
#: How many of the programme's smallest rooms a search that finds nothing plans
_SMALLEST_ROOMS = 3


class _Search:
    """The candidates of one `_fit`, each planned for real: rewrites of the tape by the dynamic
    programme (the largest room that fits), checkpoint="sqrt"'s segments, moves of the first
    units' results to host memory with the programme on the rest, and lossy stores."""

    def __init__(self, recorded: Recorded, budget: int, plan_of: Callable[[Recorded], tuple],
                 device: Any, lossy: np.dtype | None, planned: object, peak: int,
                 prefix: str = "") -> None:
        self.recorded, self.budget, self.plan_of, self.device = recorded, budget, plan_of, device
        #: what every candidate's schedule starts with (the rewrite `recorded` already holds)
        self.prefix = prefix
        #: `plan_of(recorded)`'s plan, whose peak is `peak`
        self.planned = planned
        self.lossy = lossy
        self.wanted = _wanted(recorded.program, recorded.intermediate)
        self.units = _units(recorded.program, self.wanted, recorded.intermediate)
        self.split = _table(len(self.units))[1] if len(self.units) > 2 else None
        self.peaks: list[int] = [peak]
        #: peaks of the plans made whatever the budget, where nothing fits (keeping
        #: everything, checkpoint="sqrt", the programme's smallest rooms): BudgetError's least
        #: is theirs, so a budget of that least fits (Note [a refusal's least fits])
        self.fixed_peaks: list[int] = [peak]
        self.found: list[_Candidate] = []
        #: bytes over the budget keeping everything, and the bytes a unit is worth there
        self.over = peak - budget
        self.slope = max(1.0, peak / len(self.units))
        self.can_move = not device.capabilities.host_memory and len(self.units) > 1
        self._rates: Rates | None = None

    @property
    def rates(self) -> Rates:
        """The device's measured rates where a move or a lossy store competes with recompute
        (probed at the first candidate that fits); else flops alone, and no clock is read."""
        if self._rates is None:
            self._rates = (rates(self.device) if self.can_move or self.lossy is not None
                           else Rates(per_byte=0.0, per_flop=1.0, per_element=0.0,
                                      per_call=0.0))
        return self._rates

    # ------------------------------------------------------------------ one candidate
    def _results(self, count: int) -> list[int]:
        return sorted({o.block.id for unit in self.units[:count] for i in unit
                       for o in i.outputs if o.block.id in self.wanted})

    def rewrite(self, room: int | None, *, first: int = 0, moved: int = 0, halved: int = 0
                ) -> tuple[Recorded, int, int, tuple[Stored, ...]]:
        """The tape with the programme's sweep over units `first`.. at `room` (None: keep
        them), the results of the first `moved` units moved and of the first `halved` stored
        lossy; its sweep's depth, the bytes moved and what is stored lossy."""
        recorded, depth, copied, stored = self.recorded, 0, 0, ()
        if room is not None:
            sweep = _sweep(first, len(self.units) - first, room, self.split)
            recorded, depth = _apply(recorded, self.units, sweep), _depth(sweep)
        if moved or halved:
            intermediate = set(recorded.intermediate)
            program = list(recorded.program)
            if moved:
                program, copied = _move(program, intermediate, self._results(moved),
                                        self.device)
            if halved:
                # NOTE: with recomputes, what they keep for the backward pass waits too
                again = [o.block.id for i in program if i.phase == "recompute"
                         for o in i.outputs] if room is not None else []
                program, made = _halve(program, intermediate, self._results(halved) + again,
                                       self.lossy, self.device)
                stored = tuple(made)
            recorded = dataclasses.replace(recorded, program=program, intermediate=frozenset(
                intermediate), blocks={**recorded.blocks, **{
                    o.block.id: o.block for i in program for o in (*i.inputs, *i.outputs)}})
        return recorded, depth, copied, stored

    def offer(self, recorded: Recorded, *, room: int | None, depth: int, schedule: str,
              moves: str, copied: int = 0, stored: tuple[Stored, ...] = ()) -> bool:
        """Plan `recorded`; file it as a candidate when it fits. Returns whether it fits."""
        planned, peak = self.plan_of(recorded)
        self.peaks.append(peak)
        if peak > self.budget:
            return False
        self.file(recorded, planned, room=room, depth=depth, schedule=schedule, moves=moves,
                  copied=copied, stored=stored)
        return True

    def file(self, recorded: Recorded, planned: object, *, room: int | None, depth: int,
             schedule: str, moves: str, copied: int = 0, stored: tuple[Stored, ...] = ()
             ) -> None:
        """File a rewrite that fits as a candidate."""
        if self.prefix:
            schedule = f"{self.prefix}, {schedule}"
        self.found.append(_Candidate(self.cost(recorded, copied), recorded, planned, room, depth,
                                     schedule, moves, stored, units=len(self.units)))

    def cost(self, recorded: Recorded, copied: int) -> float:
        """Seconds the rewrite adds to a step: each added instruction's call, recompute flops,
        elements cast and bytes moved, at the device's rates."""
        rates, seconds = self.rates, copied * self.rates.per_byte
        for instr in recorded.program:
            if instr.phase == "recompute":
                seconds += self.recompute_cost(instr)
            elif instr.phase == "store":
                seconds += rates.per_call + flops(instr) * rates.per_element
            elif instr.phase == "move":
                seconds += rates.per_call
        return seconds

    def recompute_cost(self, instr: Instruction) -> float:
        """Seconds one recomputed instruction adds: its call and its flops."""
        return self.rates.per_call + flops(instr) * self.rates.per_flop

    def boundary(self, low: int, high: int, fits: Callable[[int], bool], *, guess: float,
                 slope: float, rising: bool) -> bool:
        """Probe values in low..high for the edge of what fits: with `rising` the peak grows
        with the value (room) and the largest that fits is wanted, else it falls (units moved
        or stored lossy), the most is tried first (nothing less fits if it does not) and the
        fewest that fits is wanted. Steps from `guess` by the bytes a value is worth (`slope`)
        until a probe on each side is known, then as a secant between them, bisecting after two
        secant steps in a row that did not halve the interval: two to five plans where a
        bisection takes six or seven. Unbracketed, the steps at least double (galloping): a
        family whose peak barely moves with the value (every result moved, where keeping more
        recomputes less and holds little more) needs a handful of plans, not one per value.
        Assumes, as a bisection does, that the peak is monotone. Returns whether any fit."""
        toward = 1 if rising else -1  # NOTE: the direction of more bytes
        good, bad = (low - 1, high + 1) if rising else (high + 1, low - 1)
        nothing = good
        good_peak = bad_peak = None
        value, span, stalled, jump = round(guess), abs(bad - good), 0, 1
        if not rising and low <= high:
            if not fits(high):
                return False
            good, good_peak = high, self.peaks[-1]
        while abs(bad - good) > 1:
            lower, upper = sorted((good, bad))
            if not lower < value < upper:
                value = (lower + upper) // 2
            if fits(value):
                good, good_peak = value, self.peaks[-1]
            else:
                bad, bad_peak = value, self.peaks[-1]
            bracketed = good_peak is not None and bad_peak is not None
            stalled = stalled + 1 if bracketed and abs(bad - good) * 2 > span else 0
            span = abs(bad - good)
            if stalled >= 2:
                value, stalled = (good + bad) // 2, 0
            elif bracketed and bad_peak > good_peak:
                value = good + int((self.budget - good_peak) / (bad_peak - good_peak)
                                   * (bad - good))
            elif good_peak is not None:  # NOTE: past the estimate by up to one: a bracket
                value = good + toward * max(jump, math.ceil((self.budget - good_peak) / slope))
                jump *= 2  # NOTE: galloping, where the peak falls short of its estimate
            else:
                value = bad - toward * max(jump, math.ceil((bad_peak - self.budget) / slope))
                jump *= 2
        return good != nothing

    def floor(self, first: int) -> float:
        """A cost that no room that fits for the units from `first` on (their results kept on
        the device) goes below. Room r holds r units' results at once, so no room whose r
        smallest results exceed the budget fits; and of the units' results the backward pass
        reads, the first forward keeps at most r, so at least all but r units are recomputed
        once: the cheapest of them, at the device's rates."""
        units = self.units[first:]
        sizes = sorted(_result_bytes(unit, self.wanted) for unit in units)
        room = int(np.searchsorted(np.cumsum(sizes), self.budget, side="right"))
        costs = sorted(sum(map(self.recompute_cost, unit)) for unit in units)
        return float(sum(costs[:max(0, len(units) - room)]))

    # ------------------------------------------------------------------ the families
    def recompute(self, why: str, first: int = 0, moved: int = 0, halved: int = 0) -> None:
        """The largest room that fits for the units from `first` on (with the results of the
        first `moved` or `halved` units that wait for the backward pass moved or stored
        lossy); skipped where moves compete and a candidate already costs no more than the
        family's floor (`floor`: not with every waiting result moved or stored lossy, where
        the room holds less than its units' results)."""
        n = len(self.units) - first
        if self.split is None or n < 3:
            return
        if (self.can_move and self.found and not halved and moved < len(self.units) - 1
                and self.best().cost <= self.floor(first)):
            return

        probed: dict[int, tuple[bool, int]] = {}

        def fits(room: int) -> bool:
            if room in probed:  # NOTE: planned already; its peak is the last one seen again
                self.peaks.append(probed[room][1])
                return probed[room][0]
            recorded, depth, copied, stored = self.rewrite(room, first=first, moved=moved,
                                                           halved=halved)
            what = f"at most {room} of {n} units kept at once, recomputes nested {depth} deep"
            if copied:
                what = f"the waiting results of the first {moved} units moved, " + what
            if stored:
                what = f"{len(stored)} results stored lossy, " + what
            fitted = self.offer(recorded, room=room, depth=depth, schedule=what, moves=why,
                                copied=copied, stored=stored)
            probed[room] = (fitted, self.peaks[-1])
            return fitted

        slope = self.slope / 2 if halved else self.slope
        if not self.boundary(2, n - 1, fits, guess=self.budget / slope - 1, slope=slope,
                             rising=True):
            for room in range(2, min(n - 1, _SMALLEST_ROOMS + 1) + 1):
                fits(room)
                self.fixed_peaks.append(probed[room][1])

    def segments(self, why: str) -> None:
        """One level of recompute whose parts are chosen by each unit's bytes, work and what
        the backward pass holds besides forward results while it walks the unit, measured
        on the plan that keeps everything (`_segments`). The estimate misses what the plan
        cannot place tightly and what a recompute holds while it runs, so the room aimed at is
        moved by what the real plan held above or below the budget (or, where no parts fit
        the estimate, grown by a share of the budget) until a room that fits and one that
        does not are known, then bisected: at most six plans. Where none of them fit, the same
        for budgets 1, 2 and 4% smaller (their plans fit this budget too)."""
        units, n = self.units, len(self.units)
        if n < 3:
            return
        sizes = np.array([_result_bytes(unit, self.wanted) for unit in units], dtype=float)
        work = np.array([sum(map(self.recompute_cost, unit)) for unit in units], dtype=float)
        besides, fixed = self.besides()
        unit_of = {id(i): k for k, unit in enumerate(units) for i in unit}
        home = {o.block.id: k for k, unit in enumerate(units) for i in unit for o in i.outputs
                if o.block.id in self.wanted}
        reach = list(range(n))
        for unit in units:
            for i in unit:
                for o in i.inputs:
                    if o.block.id in home:
                        reach[home[o.block.id]] = max(reach[home[o.block.id]], unit_of[id(i)])
        tried: set[tuple] = set()

        def aim(target: float) -> bool:
            """Bracket and bisect the room for a budget of `target` bytes (at most
            _SEGMENT_PLANS plans, each filed if it fits the real budget); whether one fit."""
            room, fitted = target - fixed, False
            fits_at, over_at = -math.inf, math.inf  # NOTE: rooms known to fit, and not to
            for _ in range(_SEGMENT_PLANS):
                parts = _segments(sizes, work, besides, reach, room)
                if parts is None:  # NOTE: the estimate is above the real peak as often as
                    fits_at = max(fits_at, room)  # below: a room to go above, as one that fits
                    room = (room + over_at) / 2 if over_at < math.inf else \
                        room + _SEGMENT_REAIM * target
                    continue
                if parts in tried:
                    break
                tried.add(parts)
                dropped = sum(1 for _, count in parts if count > 1)
                sweep = _Sweep(tuple((first, count, None) for first, count in parts)
                               + ((n, 0, None),))
                fits = self.offer(_apply(self.recorded, units, sweep), room=None, depth=1,
                                  moves=why, schedule=f"{dropped} parts of {n} units "
                                                      f"recomputed once, chosen by bytes and work")
                fitted = fitted or fits
                if fits:
                    fits_at = max(fits_at, room)
                else:
                    over_at = min(over_at, room)
                if fits_at > -math.inf and over_at < math.inf:
                    room = (fits_at + over_at) / 2
                else:
                    room += target - self.peaks[-1]
            return fitted

        # NOTE: the real peak does not follow the room aimed at smoothly (ResNet-50 at a budget
        # of 105 MiB: aiming at 110.9 MiB planned 116.8 and nothing fit, while the aims of a
        # budget of 104 MiB reached 118.1 MiB, which planned 102.3): where no parts fit, the
        # aims of slightly smaller budgets are tried too, whose plans fit this one as well,
        # so a larger budget does not fall back to a costlier family where a smaller fits
        for share in _SEGMENT_SMALLER:
            if aim(self.budget * (1 - share)):
                return

    def besides(self) -> tuple[np.ndarray, float]:
        """Per unit, the most bytes the plan that keeps everything holds, other than forward
        results the backward pass reads, while the backward pass walks that unit (from the
        first backward read of its results to that of the unit before it); and what its peak
        holds above the bytes live at once (the chains' scratch, the placement's gaps)."""
        (_, fused, memory), peak = self.planned, self.peaks[0]
        steps = fused.steps
        buffers = {fused.buffer_of.get(bid, bid) for bid in self.wanted}
        everything = planner.live_bytes(memory.lifetimes, len(steps))
        results = planner.live_bytes([life for life in memory.lifetimes
                                      if life.key in buffers], len(steps))
        other = np.array(everything, dtype=float) - np.array(results, dtype=float)
        first_read: dict[int, int] = {}
        for position, step in enumerate(steps):
            for instr in step.instructions:
                if instr.phase != "forward":
                    for operand in instr.inputs:
                        first_read.setdefault(operand.block.id, position)
        starts = [min((first_read[o.block.id] for i in unit for o in i.outputs
                       if o.block.id in self.wanted and o.block.id in first_read),
                      default=len(steps)) for unit in self.units]
        besides = np.zeros(len(self.units))
        for k, start in enumerate(starts):
            until = starts[k - 1] if k else len(steps)
            span = other[start:max(until, start + 1)]
            besides[k] = float(span.max()) if len(span) else 0.0
        return besides, float(max(0, peak - max(everything, default=0)))

    def sqrt(self, why: str) -> None:
        """checkpoint="sqrt"'s segments, as one more candidate (a cut by instructions, not
        units, which sometimes fits the same bytes with less work)."""
        recorded = _checkpoint(self.recorded)
        if recorded.recomputed:
            self.offer(recorded, room=None, depth=1, moves=why,
                       schedule='checkpoint="sqrt" segments')
            self.fixed_peaks.append(self.peaks[-1])

    def moves(self) -> None:
        """The fewest first units moved that fit with nothing recomputed."""
        n = len(self.units)

        def only(count: int) -> bool:
            recorded, _, copied, _ = self.rewrite(None, moved=count)
            return self.offer(recorded, room=None, depth=0, copied=copied,
                              schedule=f"the first {count} of {n} units' results moved",
                              moves=self._moved(count, copied))

        self.boundary(1, n - 1, only, guess=self.over / self.slope + 1, slope=self.slope,
                      rising=False)

    def mixes(self) -> None:
        """Mixes of moves and recompute: the programme's largest room that fits with every
        forward result it keeps for the backward pass moved out while it waits, or with a
        quarter, half or three quarters of the units, from the first, moved and the programme
        on the rest."""
        n = len(self.units)
        self.recompute(self._moved(n - 1, None), moved=n - 1)
        for count in sorted({n // 4, n // 2, 3 * n // 4}):
            if 1 <= count <= n - 3:  # NOTE: the first units moved, the programme on the rest
                self.recompute(self._moved(count, None), first=count, moved=count)

    def _moved(self, count: int, copied: int | None) -> str:
        per = f"{copied} bytes a step; " if copied is not None else ""
        return (f"the waiting results of the first {count} units moved to host memory and "
                f"back ({per}chosen by cost: {self.rates.per_byte:.3g} s per byte moved against "
                f"{self.rates.per_flop:.3g} s per flop recomputed, measured on "
                f"{self.device.name})")

    def halves(self, why: str) -> None:
        """Lossy stores: the fewest first units stored lossy that fit with nothing recomputed;
        when none does, every unit's kept results stored lossy and the programme's largest
        room."""
        n = len(self.units)

        def only(count: int) -> bool:
            recorded, _, _, stored = self.rewrite(None, halved=count)
            return self.offer(recorded, room=None, depth=0, stored=stored, moves=why,
                              schedule=f"the results of the first {count} of {n} units "
                                       f"stored lossy")

        if not self.boundary(1, n - 1, only, guess=2 * self.over / self.slope + 1,
                             slope=self.slope / 2, rising=False):
            self.recompute(why, halved=n - 1)

    def best(self) -> _Candidate | None:
        """The cheapest candidate (the first filed among equals: lossless before lossy)."""
        return min(self.found, key=lambda c: c.cost, default=None)


def _fit(recorded: Recorded, budget: int, source: str,
         plan_of: Callable[[Recorded], tuple[object, int]], *, device: Any,
         name: str, lossy: Any = None) -> Fitted:
    """The cheapest rewrite whose planned peak fits `budget` bytes, among: the least recompute
    work of the dynamic programme, checkpoint="sqrt"'s segments, (on a device whose memory is
    not the host's) moves to host memory alone or mixed with recompute, and (with `lossy`, a
    half dtype) lossy stores alone or with recompute. Cost: the seconds a candidate adds to a
    step at the device's measured `rates` (`_Search.cost`) where a move or a lossy store
    competes; recompute flops alone otherwise.

    `plan_of(recorded)` schedules, fuses and plans a tape and returns (what it made, its peak in
    bytes). Raises BudgetError when nothing fits, naming the least peak reached."""
    planned, peak = plan_of(recorded)
    why = (f"none: the {device.name} device's memory is the host's"
           if device.capabilities.host_memory else "none: recompute costs less")
    searches = [_Search(recorded, budget, plan_of, device, lossy, planned, peak)]
    if peak <= budget:
        return Fitted(recorded, planned, Choice(
            budget=budget, source=source, units=len(searches[0].units), room=None, depth=0,
            moves=why, schedule="everything kept"))
    # NOTE: the pointwise recompute first (Note [pointwise recompute] in
    # runtime/graph/checkpoint.py), alone and as the start of every family: it costs a pass
    # where a segment costs a forward
    for local in (False, True):
        cheap = _pointwise(recorded, local=local)
        if not cheap.recomputed or (local and cheap.recomputed == searches[-1].recorded
                                    .recomputed):
            continue
        cheap_planned, cheap_peak = plan_of(cheap)
        search = _Search(cheap, budget, plan_of, device, lossy, cheap_planned, cheap_peak,
                         prefix=f"{cheap.recomputed} pointwise instructions recomputed")
        searches.append(search)
        if cheap_peak <= budget:
            search.file(cheap, cheap_planned, room=None, depth=0, moves=why,
                        schedule="everything else kept")
    for search in searches:
        units = search.units
        if search.can_move:  # NOTE: first: shallow plans, and a cost that may rule out recompute
            search.moves()
        search.recompute(why)
        search.segments(why)
        search.sqrt(why)
        if search.can_move:
            search.mixes()
        if lossy is not None and len(units) > 1:
            search.halves(why)
    found = min((c for search in searches for c in search.found), key=lambda c: c.cost,
                default=None)
    if found is None:
        least = min(p for search in searches for p in search.fixed_peaks)
        also = " or moving them to host memory" if searches[0].can_move else ""
        also += " or storing them lossy" if lossy is not None else ""
        raise BudgetError(
            f"{name}: a memory budget of {budget} bytes ({format_bytes(budget)}, {source}) is "
            f"below the least any choice reaches: {least} bytes ({format_bytes(least)}) of "
            f"intermediates, recomputing every forward result the backward pass reads down "
            f"to two units kept at once{also} ({len(searches[0].units)} units; {peak} bytes "
            f"keeping everything); nothing has run",
            budget_bytes=budget, least_bytes=least)
    return Fitted(found.recorded, found.planned, Choice(
        budget=budget, source=source, units=found.units, room=found.room, depth=found.depth,
        moves=found.moves, schedule=found.schedule, lossy=found.lossy))
