"""Capture: arguments in, results out, and `_build`, which runs the phases on a recorded tape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from allocators import Allocator
from runtime import autograd, planner
from runtime.block import Block
from runtime.errors import GraphCaptureError
from runtime.graph.checkpoint import _recompute_sqrt
from runtime.graph.fuse import _attach_products, _buffers, _fuse
from runtime.graph.program import _Capture, _Step
from runtime.graph.schedule import _schedule
from runtime.tape import Tape
from runtime.tensor import Tensor, host_array


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
            if arg.block.id in capture.state:
                raise GraphCaptureError(
                    f"graph argument {capture.placeholders.index(holder)} shares block "
                    f"#{arg.block.id} with state the step writes (a parameter or optimizer "
                    f"state); a graph copies array arguments in before the step runs, so it "
                    f"would read old values where the function called directly reads new ones: "
                    f"pass a copy (ops.copy(t)) or read the state inside the function")
            if (arg.device is holder.device and arg.block is not holder.block
                    and type(arg.block) is Block):
                # NOTE: the hot path of every replay: distinct plain blocks never overlap, so a
                # plain device copy between the (checked, cached) native views is safe; imported
                # memory may overlap anything, so it goes through ops.copy's overlap test
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
def _build(recorder: Tape, placeholders: list[Tensor | None], outputs: list[Tensor], kind: str,
           device: Any, allocator: Allocator, plan: str, checkpoint: str | None,
           fuse: bool) -> _Capture:
    program = recorder.instructions
    # Phase 1: which blocks are intermediates (made here, held by nothing once fn returned).
    blocks: dict[int, Block] = {}
    for instr in program:
        for operand in (*instr.inputs, *instr.outputs):
            blocks[operand.block.id] = operand.block
    held = [t.detach() for t in outputs] + list(recorder.external.values())
    for block in blocks.values():
        if recorder.made_here(block) and block.refcount > 0:
            held.append(Tensor(block, (block.nbytes,), np.uint8))
    kept = {t.block.id for t in held}
    intermediate = {bid for bid, block in blocks.items()
                    if recorder.made_here(block) and bid not in kept}
    # NOTE: host data loaded into a block made here that outlives the call (optimizer state made
    # at the first step) initialises it: it runs at the first replay only.
    init = [instr for instr in program if instr.kind == "load"
            and recorder.made_here(instr.outputs[0].block)
            and instr.outputs[0].block.id not in intermediate]
    program = [instr for instr in program if not any(instr is i for i in init)]
    recomputed = 0
    if checkpoint == "sqrt":
        program, recomputed = _recompute_sqrt(program, intermediate)
        for instr in program:
            for operand in instr.outputs:
                if operand.block.id not in blocks:
                    blocks[operand.block.id] = operand.block
                    intermediate.add(operand.block.id)
    # Phase 2: dependencies and a memory-aware schedule.
    order = _schedule(program, intermediate)
    scheduled = [program[i] for i in order]
    # Phase 3: fusion into steps, then in-place reuse, both on the schedule.
    if fuse:
        steps = _attach_products(_fuse(scheduled, intermediate), intermediate, device)
    else:
        steps = [_Step([i]) for i in scheduled]
    internal = set().union(*(step.internal for step in steps))
    fresh = {step.instructions[-1].outputs[0].block.id for step in steps
             if step.product == "into"}
    buffer_of, in_place = _buffers(steps, intermediate - internal, fuse and plan != "none",
                                   fresh)
    # Phase 4: lifetimes per buffer, in step positions, and the static plan.
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for position, step in enumerate(steps):
        for instr in step.instructions:
            for operand in (*instr.inputs, *instr.outputs):
                buffer = buffer_of.get(operand.block.id)
                if buffer is not None:
                    first.setdefault(buffer, position)
                    last[buffer] = position
    sizes: dict[int, int] = {}
    for bid, buffer in buffer_of.items():
        sizes[buffer] = max(sizes.get(buffer, 0), blocks[bid].nbytes)
    lifetimes = [planner.Lifetime(b, first[b], last[b], sizes[b]) for b in first]
    alignment = max(allocator.device.alignment, 64)
    static_plan = planner.plan(lifetimes, alignment=alignment)
    forward = {buffer_of.get(operand.block.id) for instr in scheduled
               if instr.phase in ("forward", "recompute") for operand in instr.outputs}
    activation = [life for life in lifetimes if life.key in forward]
    stats = {"instructions": len(scheduled), "steps": len(steps),
             "fused": sum(len(s.instructions) for s in steps if len(s.instructions) > 1),
             "products": sum(1 for s in steps if s.product is not None),
             "in_place": in_place, "recomputed": recomputed,
             "activation_bytes": planner.lower_bound(activation) if activation else 0}
    naive = sum(blocks[bid].nbytes for bid in intermediate)
    outside = [block for bid, block in blocks.items() if bid not in intermediate]
    for block in outside:
        if recorder.made_here(block) and block._allocation is None:
            block._written = False  # NOTE: written on the tape only; a replay writes it for real
    commit, state = _commit_point(steps, {block.id for block in outside}, recorder)
    # NOTE: what "none" and "recycle" replays allocate and free at each step, worked out once
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
    return _Capture(steps, placeholders, [t.detach() for t in outputs], kind, held, state,
                    buffer_of, lifetimes, naive, static_plan, device, allocator, stats,
                    outside, {block.id for block in outside}, [_Step([i]) for i in init],
                    commit, tail_plan, starts, ends, tail)


def _commit_point(steps: Sequence[_Step], outside: set[int],
                  recorder: Tape) -> tuple[int, set[int]]:
    """The position of the first step that writes state, and the blocks of state written.

    State is a block that existed before the capture (parameters, earlier optimizer state) or
    one made here that a step reads before or where it first writes it (state carried from step
    to step). Outputs that are only written are not state. A replay makes every allocator call
    before the commit position, so a failed allocation leaves the state as it was."""
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
                        block.id in read or not recorder.made_here(block)):
                    state.add(block.id)
                    commit = min(commit, position)
                written.add(block.id)
    return commit, state


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
    made in it, marked written on the tape only, holds nothing again."""
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
