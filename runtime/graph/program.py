"""The records the phases pass on: what a tape holds (`Recorded`), the fused steps (`Fused`),
the memory plan (`MemoryPlan`), a scheduled step (`_Step`) and a whole capture (`_Capture`).

Each phase takes and returns these by name (`capture._build` reads as the list of phases); every
record is built by keyword."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from allocators import Allocation, Allocator
from runtime import planner
from runtime._tensor import Tensor
from runtime.block import Block
from runtime.tape import Instruction


# ---------------------------------------------------------------------- what the phases pass on
@dataclass(frozen=True, kw_only=True)
class Recorded:
    """The tape sorted (phase 1, `capture._sort_blocks`), then rewritten by checkpointing
    (phase 2, `checkpoint._checkpoint`)."""

    #: the instructions to schedule, in program order (the loads in `init` taken out)
    program: list[Instruction]
    #: loads of host data into state made in the capture (optimizer moments): run once
    init: list[Instruction]
    #: every block an instruction touches, by id
    blocks: dict[int, Block]
    #: ids of the blocks made in the capture that nothing holds once `fn` returned: the
    #: blocks the memory plan places
    intermediate: frozenset[int]
    #: handles that keep alive the blocks made in the capture that something still holds
    held: list[Tensor]
    #: forward instructions cloned to recompute results during backward
    recomputed: int = 0

    @property
    def outside(self) -> list[Block]:
        """Blocks the steps touch that the plan does not place (parameters, state, outputs)."""
        return [block for bid, block in self.blocks.items() if bid not in self.intermediate]


@dataclass(frozen=True, kw_only=True)
class Fused:
    """The schedule as steps (phase 4, `fuse._fuse_steps`), and where each planned block lives."""

    steps: list[_Step]
    #: planned block id -> buffer id (a buffer is named by the first block it holds; blocks
    #: that reuse a dying input in place share its buffer)
    buffer_of: dict[int, int]
    #: blocks that took a dying input's buffer
    in_place: int


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """Where and when the buffers live (phase 5, `memory._plan_memory`)."""

    #: per buffer, in step positions
    lifetimes: list[planner.Lifetime]
    #: every buffer at an offset in one arena ("static", and the lower bound every plan reports)
    static_plan: planner.Plan
    #: the position of the first step that writes state (Note [the commit point] in
    #: runtime/nn.py)
    commit: int
    #: blocks of state the steps write
    state: set[int]
    #: step position -> buffers allocated just before it ("none" and "recycle")
    starts: dict[int, list[planner.Lifetime]]
    #: step position -> buffers freed just after it ("recycle")
    ends: dict[int, list[int]]
    #: buffers first used at or after `tail_at`: allocated just before it
    tail: list[planner.Lifetime]
    #: "recycle": `tail` placed in one arena
    tail_plan: planner.Plan | None
    #: where `tail` is taken: `commit`, or 0 where "recycle" would hold more with the tail
    #: apart than the static arena (`memory._recycle_or_one_arena`)
    tail_at: int
    #: the fused chains' scratch arrays (`Device.fused_scratch` keys) -> byte offset in one
    #: allocation of `scratch_bytes`, taken at the first replay and held by the capture
    scratch: dict[tuple, int]
    scratch_bytes: int


# ---------------------------------------------------------------------- the captured program
@dataclass
class _Step:
    """One scheduled instruction, or a fused chain of them, ready to replay."""

    instructions: list[Instruction]
    #: blocks of intermediates internal to a fused chain (never materialised at full size)
    internal: set[int] = field(default_factory=set)
    #: a matrix product heading the chain (`instructions[0]`, see `_attach_products`): "into"
    #: (the product goes into the chain's output, the chain runs over it in place) or
    #: (alpha, beta) (the whole chain is out = alpha * product + beta * out: one `Device.gemm`)
    product: str | tuple[float, float] | None = None


@dataclass(kw_only=True)
class _Capture:
    """Everything one capture produced: the schedule, the plan and the graph-held tensors, and
    what its replays keep between calls."""

    steps: list[_Step]
    placeholders: list[Tensor | None]
    outputs: list[Tensor]
    #: how `fn` returned its outputs: "none", "single", "tuple" or "list"
    output_kind: str
    #: handles keeping graph-written blocks alive
    held: list[Tensor]
    #: planned block id -> buffer id
    buffer_of: dict[int, int]
    memory: MemoryPlan
    #: every intermediate block its own buffer for the whole step (no reuse, no fusion)
    naive_bytes: int
    #: the step run eagerly: program order, unfused, each block freed after its last use
    eager_bytes: int
    device: Any
    allocator: Allocator
    #: the counts `Graph.memory_report` adds
    stats: dict[str, int]
    #: blocks outside the plan that the steps touch, and their ids
    outside: list[Block]
    outside_ids: set[int]
    #: each outside block's generation when captured: one that moved on was freed since
    #: (`replay._check_live`)
    generations: list[int]
    #: loads that initialise state made in the capture: run at the first replay, then emptied
    init: list[_Step]
    #: "static": the arena, and the steps bound to views into it
    arena: Allocation | None = None
    views: list[Callable[[], None]] | None = None
    #: the outside blocks' allocations `views` were bound to
    view_key: tuple = ()
    #: buffer -> (raw, offset) that `views` were bound to
    bound_memory: dict = field(default_factory=dict)
    #: "static" on a device that records graphs, unless the graph said device_graph=False:
    #: replays launch one recording (Note [a static plan as one device graph] in
    #: runtime/graph/replay.py)
    record_graph: bool = False
    #: the recording of `views` (a `Device.record` result), False where it failed, None
    #: before it was tried
    recording: Any = None
    #: why the steps are not one device graph (None when they are)
    graph_reason: str | None = None
    #: outside blocks the steps write, marked written after each launch of `recording`
    graph_marks: list = field(default_factory=list)
    #: for each of the recording's host checks, the argument whose copy it reads (an index
    #: into `placeholders`) or None, and what the last check that passed saw of that
    #: argument (`replay._run_checks`)
    check_sources: list = field(default_factory=list)
    check_seen: list = field(default_factory=list)
    #: raw device memory holding the bytes of the steps' loads, where `record_graph` (a load
    #: copies from there, which a graph can record)
    staged: list = field(default_factory=list)
    #: the most bytes the plan held at once in the last replay (the scratch included)
    peak_bytes: int = 0
    #: fused chains' block-sized scratch arrays, shared by the steps: views of
    #: `scratch_memory` by `Device.fused_scratch` key
    scratch: dict = field(default_factory=dict)
    scratch_memory: Allocation | None = None
    #: what a memory budget chose (`budget.Choice`), or None without a budget
    choice: Any = None
    #: under an allocator's limit that no choice fits: the least peak of intermediates reached
    least_bytes: int | None = None
