"""The captured program's records: a scheduled step (`_Step`) and a whole capture (`_Capture`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from allocators import Allocation, Allocator
from runtime import planner
from runtime.block import Block
from runtime.tape import Instruction
from runtime.tensor import Tensor


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


@dataclass
class _Capture:
    """Everything one capture produced: the schedule, the plan and the graph-held tensors."""

    steps: list[_Step]
    placeholders: list[Tensor | None]
    outputs: list[Tensor]
    output_kind: str
    held: list[Tensor]                       # handles keeping graph-written blocks alive
    state: set[int]                          # blocks of state the steps write (see _state_of)
    buffer_of: dict[int, int]                # intermediate block id -> buffer (class) id
    lifetimes: list[planner.Lifetime]        # per buffer, in schedule positions
    naive_bytes: int
    static_plan: planner.Plan
    device: Any
    allocator: Allocator
    stats: dict[str, int]
    outside: list[Block]                     # blocks outside the plan that the steps touch
    outside_ids: set[int]
    init: list[_Step]                        # loads that initialise kept state: run once
    commit: int = 0                          # the first step that writes state
    tail_plan: planner.Plan | None = None    # recycle: buffers first used from `commit` on
    starts: dict = field(default_factory=dict)   # step -> buffers allocated there (none/recycle)
    ends: dict = field(default_factory=dict)     # step -> buffers freed after it (recycle)
    tail: list = field(default_factory=list)     # buffers first used from `commit` on
    arena: Allocation | None = None
    views: list[Callable[[], None]] | None = None   # static: the steps with bound views
    view_key: tuple = ()
    peak_bytes: int = 0
    scratch: dict = field(default_factory=dict)   # fused chains' block-sized scratch, shared
