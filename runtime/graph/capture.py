"""Capture: arguments in, results out, phase 1 (`_sort_blocks`), and `_build`, which runs the
phases on a recorded tape."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from allocators import Allocator
from runtime import autograd, planner
from runtime._tensor import Tensor, host_array
from runtime.block import Block
from runtime.errors import GraphCaptureError
from runtime.graph.budget import BudgetError, _fit, flops
from runtime.graph.checkpoint import _checkpoint, _pointwise
from runtime.graph.fuse import _fuse_steps
from runtime.graph.memory import _plan_memory, _timeline
from runtime.graph.program import Fused, MemoryPlan, Recorded, _Capture, _Step
from runtime.graph.schedule import _scheduled
from runtime.tape import Instruction, Tape


# ---------------------------------------------------------------------- arguments and results
def _chain(allocator: Allocator) -> list[Allocator]:
    """`allocator` and the allocators under it (adaptors' upstreams), top first."""
    chain = [allocator]
    while getattr(chain[-1], "upstream", None) is not None:
        chain.append(chain[-1].upstream)
    return chain


def _limiter(allocator: Allocator) -> Allocator:
    """The allocator in `allocator`'s chain whose own limit its available_bytes() reports: the
    lowest one with a limit of its own (a LimitAdaptor, a caching allocator's limit_bytes),
    else the bottom one (the device's memory). A block's bytes count against that limit only
    when its own allocator's chain passes through it."""
    chain = _chain(allocator)
    own = [a for a in chain if a._limit()[1] != "device memory"]
    return own[-1] if own else chain[-1]


def _is_array(arg: Any) -> bool:
    return isinstance(arg, (np.ndarray, Tensor))


def _host(arg: Any) -> np.ndarray:
    """What the graph holds for an array argument: exactly what runtime.tensor makes of it."""
    return arg.numpy() if isinstance(arg, Tensor) else host_array(arg, None, "graph input")


def _signature(args: Sequence[Any]) -> tuple:
    key = []
    for arg in args:
        if _is_array(arg):
            key.append(("array", tuple(arg.shape), np.dtype(arg.dtype).str))
        else:
            try:
                hash(arg)
            except TypeError:
                raise GraphCaptureError(
                    f"graph arguments must be arrays, tensors or hashable values (they are "
                    f"baked into the capture); got a {type(arg).__name__}") from None
            key.append(("value", type(arg).__name__, _value_key(arg)))
    return tuple(key)


def _value_key(value: Any) -> Any:
    """A key under which equal arguments, and only those, find one capture: floats by their
    bits (a NaN finds the capture of the same NaN; 0.0 and -0.0, equal to ==, do not share
    one, as their products differ in sign), tuples element by element."""
    if isinstance(value, (float, np.floating, complex, np.complexfloating)):
        return np.asarray(value).tobytes()
    if isinstance(value, tuple):
        return tuple((type(v).__name__, _value_key(v)) for v in value)
    return value


def _flatten(result: Any) -> tuple[list[Tensor], str]:
    if result is None:
        return [], "none"
    if isinstance(result, Tensor):
        return [result], "single"
    if isinstance(result, (tuple, list)) and all(isinstance(t, Tensor) for t in result):
        return list(result), type(result).__name__
    raise GraphCaptureError(f"a captured function must return a Tensor, a tuple or list of "
                            f"Tensors, or None; got {type(result).__name__}")


def _copy_inputs(capture: _Capture, args: Sequence[Any]) -> None:
    for holder, arg in zip(capture.placeholders, args):
        if holder is None:
            continue
        if isinstance(arg, Tensor):
            if arg.block.id in capture.memory.state:
                raise GraphCaptureError(
                    f"graph argument {capture.placeholders.index(holder)} shares block "
                    f"#{arg.block.id} with state the step writes (a parameter or optimizer "
                    f"state); a graph copies array arguments in before the step runs, so it "
                    f"would read old values where the function called directly reads new ones: "
                    f"pass a copy (ops.copy(t)) or read the state inside the function")
            if (arg.device is holder.device and arg.block is not holder.block
                    and type(arg.block) is Block):
                # NOTE: the hot path of every replay. Distinct plain blocks never overlap
                # (Note [blocks that may share memory] in docs/aliasing.md), so a plain device
                # copy between the (checked, cached) native views is safe; imported memory may
                # overlap anything, so it goes through ops.copy's overlap test
                source = arg._native_read("graph input")
                holder.device.unary("copy", source, holder._native_write("graph input"))
                holder.block.mark_written()
                continue
            from runtime import ops

            with autograd.no_grad():
                ops.copy(arg, out=holder)
        else:
            if arg.dtype is not holder.dtype or not arg.flags.c_contiguous:
                arg = host_array(arg, None, "graph input")  # NOTE: as runtime.tensor converts
            allocation = holder.block.memory_for_write("graph input")
            holder.device.copyin(allocation.raw, allocation.offset, arg)
            holder.block.mark_written()


def _results(capture: _Capture) -> Any:
    handles = [Tensor(t.block, t.shape, t.dtype, t.strides, t.offset) for t in capture.outputs]
    if capture.output_kind == "none":
        return None
    if capture.output_kind == "single":
        return handles[0]
    return tuple(handles) if capture.output_kind == "tuple" else handles


# ---------------------------------------------------------------------- building a capture
@dataclass(frozen=True, kw_only=True)
class Options:
    """How a graph captures: its memory plan, checkpointing, fusion and memory budget (see
    `runtime.graph`)."""

    plan: str
    checkpoint: str | None
    fuse: bool
    #: whether an update out = alpha * product + beta * out may become one accumulating gemm
    fold_updates: bool
    #: bytes the intermediates may take at most; None: the allocator's limit, if it has one
    memory_budget: int | None = None
    #: the half dtype a budget may store kept forward results in (lossy), or None
    lossy: np.dtype | None = None


def _build(recorder: Tape, *, placeholders: list[Tensor | None], outputs: list[Tensor],
           output_kind: str, allocator: Allocator, options: Options,
           name: str = "step") -> _Capture:
    """Run the phases on a recorded tape (the module docstring of `runtime.graph` says what
    each does)."""
    recorded = _sort_blocks(recorder, outputs)
    eager = _eager_bytes(recorded)
    if options.checkpoint == "sqrt":
        recorded = _checkpoint(recorded)
    elif options.checkpoint == "pointwise":
        recorded = _pointwise(recorded)
    alignment = max(allocator.device.alignment, 64)

    def plan_of(tape: Recorded) -> tuple[tuple[list[Instruction], Fused, MemoryPlan], int]:
        scheduled = _scheduled(tape)
        fused = _fuse_steps(scheduled, tape.intermediate, allocator.device, fuse=options.fuse,
                            in_place=options.fuse and options.plan != "none",
                            fold_updates=options.fold_updates)
        memory = _plan_memory(fused, tape, recorder.made_here, plan=options.plan,
                              alignment=alignment, device=allocator.device,
                              size=allocator.allocation_size)
        peak = max(_timeline(memory, options.plan, len(fused.steps), allocator.allocation_size),
                   default=0)
        return (scheduled, fused, memory), peak

    budget, source = _budget(options, allocator, recorded)
    choice, least = None, None
    if budget is None:
        (scheduled, fused, memory), _ = plan_of(recorded)
    else:
        try:
            fitted = _fit(recorded, budget, source, plan_of,
                          device=allocator.device, name=name, lossy=options.lossy)
        except BudgetError as error:
            if options.memory_budget is not None:
                raise
            # NOTE: under a limit nobody asked to fit, the capture goes on as planned
            # without one and `Graph._check_fits` refuses it with the limit's numbers
            (scheduled, fused, memory), _ = plan_of(recorded)
            least = error.least_bytes
        else:
            recorded, choice = fitted.recorded, fitted.choice
            scheduled, fused, memory = fitted.planned
    outside = recorded.outside
    return _Capture(steps=fused.steps, placeholders=placeholders,
                    outputs=[t.detach() for t in outputs], output_kind=output_kind,
                    held=recorded.held, buffer_of=fused.buffer_of, memory=memory,
                    naive_bytes=sum(recorded.blocks[bid].nbytes
                                    for bid in recorded.intermediate),
                    eager_bytes=eager,
                    device=allocator.device, allocator=allocator,
                    stats=_counts(recorded, scheduled, fused, memory), outside=outside,
                    outside_ids={block.id for block in outside},
                    generations=[block.generation for block in outside],
                    init=[_Step([instr]) for instr in recorded.init], choice=choice,
                    least_bytes=least)


def _budget(options: Options, allocator: Allocator, recorded: Recorded
            ) -> tuple[int | None, str]:
    """The bytes the intermediates may take, and where the number comes from: the graph's
    memory_budget, else (plans that reuse memory) what the allocator's own limit leaves once
    the blocks the step makes and keeps are allocated, else None."""
    if options.memory_budget is not None:
        return options.memory_budget, "memory_budget"
    limiter = _limiter(allocator)
    if options.plan == "none" or limiter._limit()[1] == "device memory":
        return None, ""
    available = allocator.available_bytes()
    if available is None:
        return None, ""
    lazy = _lazy_bytes(recorded.outside, limiter)
    return max(0, available - lazy), f"the limit of {limiter!r}"


def _lazy_bytes(outside: list[Block], limiter: Allocator) -> int:
    """Bytes of the blocks outside the plan that a replay allocates (outputs and state made in
    the step) and that count against `limiter`, each at the size its allocator sets aside."""
    return sum(block.allocator.allocation_size(block.nbytes) for block in outside
               if block._allocation is None and not block.readonly
               and any(a is limiter for a in _chain(block.allocator)))


def _sort_blocks(recorder: Tape, outputs: list[Tensor]) -> Recorded:
    """Phase 1: which blocks are intermediates (made in the capture, held by nothing once `fn`
    returned), which the graph keeps, and which loads initialise kept state."""
    program = recorder.instructions
    blocks: dict[int, Block] = {}
    for instr in program:
        for operand in (*instr.inputs, *instr.outputs):
            blocks[operand.block.id] = operand.block
    held = [t.detach() for t in outputs] + list(recorder.external.values())
    for block in blocks.values():
        if recorder.made_here(block) and block.refcount > 0:
            held.append(Tensor(block, (block.nbytes,), np.uint8))
    kept = {t.block.id for t in held}
    intermediate = frozenset(bid for bid, block in blocks.items()
                             if recorder.made_here(block) and bid not in kept)
    # NOTE: host data loaded into a block made here that outlives the call (optimizer state
    # made at the first step) initialises it: it runs at the first replay only.
    init = [instr for instr in program if instr.kind == "load"
            and recorder.made_here(instr.outputs[0].block)
            and instr.outputs[0].block.id not in intermediate]
    for bid, block in blocks.items():
        if bid not in intermediate and recorder.made_here(block) and block._allocation is None:
            block._written = False  # NOTE: written on the tape only; a replay writes it for real
    return Recorded(program=[instr for instr in program if not any(instr is i for i in init)],
                    init=init, blocks=blocks, intermediate=intermediate, held=held)


def _eager_bytes(recorded: Recorded) -> int:
    """The most bytes of intermediates live at once when `fn` runs without a graph: the
    recorded program in its own order, unfused, each block live from the instruction that
    first touches it to the last (refcount recycling frees none sooner; a Python reference
    may keep one longer): the least that running the step eagerly holds."""
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for position, instr in enumerate(recorded.program):
        for operand in (*instr.inputs, *instr.outputs):
            bid = operand.block.id
            if bid in recorded.intermediate:
                first.setdefault(bid, position)
                last[bid] = position
    return planner.lower_bound([planner.Lifetime(bid, first[bid], last[bid],
                                                 recorded.blocks[bid].nbytes) for bid in first])


def _counts(recorded: Recorded, scheduled: list[Instruction], fused: Fused,
            memory: MemoryPlan) -> dict[str, int]:
    """What `Graph.memory_report` counts: instructions, steps, fusion, reuse, recomputation,
    and the most bytes of forward results live at once."""
    # NOTE: results waiting for the backward pass count wherever they wait on the device:
    # moved back ("move"), stored lossy or widened again ("store")
    forward = {fused.buffer_of.get(operand.block.id) for instr in scheduled
               if instr.phase in ("forward", "recompute", "move", "store")
               for operand in instr.outputs}
    activation = [life for life in memory.lifetimes if life.key in forward]
    steps = fused.steps
    made = {o.block.id: instr.phase for instr in scheduled
            if instr.phase in ("forward", "recompute")
            for o in instr.outputs if o.block.id in recorded.intermediate}
    read = {o.block.id for instr in scheduled if instr.phase in ("backward", "update")
            for o in instr.inputs}
    return {"instructions": len(scheduled), "steps": len(steps),
            "kept": sum(1 for bid in read if made.get(bid) == "forward"),
            "recompute_flops": sum(flops(i) for i in scheduled if i.phase == "recompute"),
            "step_flops": sum(flops(i) for i in scheduled if i.phase != "recompute"),
            "recomputed": sum(1 for bid in read if made.get(bid) == "recompute"),
            "moved": sum(1 for i in scheduled if i.op == "reload" and i.phase == "move"),
            "moved_bytes": sum(2 * i.outputs[0].block.nbytes for i in scheduled
                               if i.op == "reload" and i.phase == "move"),
            "fused": sum(len(s.instructions) for s in steps if len(s.instructions) > 1),
            "products": sum(1 for s in steps if s.product is not None),
            "updates_folded": sum(1 for s in steps if isinstance(s.product, tuple)),
            "in_place": fused.in_place, "recompute_instructions": recorded.recomputed,
            "activation_bytes": planner.lower_bound(activation) if activation else 0}


def _argument_writes(capture: _Capture) -> str | None:
    """Why the capture cannot be used when `fn` writes into one of its array arguments (the
    graph copies arguments into buffers of its own, so the caller would never see the write),
    or None."""
    holders = {holder.block.id: position for position, holder in
               enumerate(capture.placeholders) if holder is not None}
    for step in capture.steps:
        for instr in step.instructions:
            for operand in instr.outputs:
                position = holders.get(operand.block.id)
                if position is not None:
                    return (f"it writes into its argument {position} in place ({instr.op}), "
                            f"but a graph copies array arguments into buffers of its own, so "
                            f"the write would never reach the caller's tensor; compute a new "
                            f"tensor instead (e.g. ops.relu(x) rather than ops.relu(x, out=x))")
    return None


def _abandon(recorder: Tape) -> None:
    """Undo what a capture that failed did to blocks: state it made from host data (optimizer
    moments) gets that data now, so the objects that hold it stay usable, and every other block
    made in it, marked written on the tape only, holds nothing again; a gradient backward gave
    a leaf in it (the leaf had none) is taken back, so the leaf is as it was before the call."""
    for instr in recorder.instructions:
        operand = instr.outputs[0] if instr.outputs else None
        block = operand.block if operand is not None else None
        if (instr.kind == "load" and recorder.made_here(block) and block.refcount > 0
                and block._allocation is None):
            allocation = block.memory_for_write("graph capture")
            block.device.copyin(allocation.raw, allocation.offset + operand.offset, instr.host)
    for instr in recorder.instructions:
        for operand in instr.outputs:
            block = operand.block
            if recorder.made_here(block) and block._allocation is None:
                block._written = False
    for leaf in recorder.grads_given:
        grad = leaf.grad
        if grad is not None and recorder.made_here(grad.block) and not grad.block._written:
            leaf.grad = None
