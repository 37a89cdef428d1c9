"""Replay: run a capture's steps under its plan (none, recycle, static)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from allocators import Allocation, format_bytes
from backends.base import RecordError
from runtime import aliasing, dlpack
from runtime._tensor import Tensor, contiguous_strides, host_array
from runtime.block import Block
from runtime.errors import UseAfterFreeError
from runtime.graph.fuse import _arguments, _fusable, _fused_program
from runtime.graph.program import _Capture, _Step
from runtime.tape import Instruction, Operand

Memory = dict[int, tuple[Any, int]]  # buffer -> (raw memory, byte offset)
_BYTE = np.dtype(np.uint8)


_generation = operator.attrgetter("generation")


def _check_live(capture: _Capture) -> None:
    """Raise UseAfterFreeError, before anything runs, if a block outside the plan that the
    steps read or write (a parameter, optimizer state, a constant, an argument's or an
    output's block) was freed since the capture (`Block.free()` moves its generation on), as
    eager execution raises on a freed tensor; else the replay would compute on memory handed
    back to the allocator. The hot path of every call: one generation read per block."""
    if list(map(_generation, capture.outside)) == capture.generations:
        return
    block = next(b for b, g in zip(capture.outside, capture.generations) if b.generation != g)
    instr = next(i for step in (*capture.init, *capture.steps) for i in step.instructions
                 if any(o.block is block for o in (*i.inputs, *i.outputs)))
    does = "reads" if any(o.block is block for o in instr.inputs) else "writes"
    outputs = [k for k, t in enumerate(capture.outputs) if t.block is block]
    arguments = [k for k, t in enumerate(capture.placeholders) if t is not None
                 and t.block is block]
    if outputs:
        what = (f"output {outputs[0]} of the step (memory the graph owns and writes at every "
                f"call: copy a result to keep it, rather than free it)")
    elif arguments:
        what = f"the graph's copy of argument {arguments[0]}"
    else:
        what = "a tensor from outside the step (a parameter, optimizer state or a constant)"
    raise UseAfterFreeError(
        f"graph replay uses block #{block.id} ({format_bytes(block.nbytes)}), {what}, after "
        f"its memory was freed (captured at generation "
        f"{capture.generations[capture.outside.index(block)]}, now {block.generation}): the "
        f"step {does} it ({instr.op}, {instr.phase}); nothing has run. The capture holds "
        f"the freed block: call recapture() to capture the step again")


def _replay(capture: _Capture, plan: str, args: Sequence[Any] = ()) -> None:
    """Run the schedule once. Every allocator call comes before the first write to state
    (Note [the commit point] in runtime/nn.py): blocks the graph keeps and the fused chains'
    scratch get memory first, "static" then takes its arena, and "none" and "recycle" take, just
    before the commit step, all the memory the rest of the step uses ("recycle" as one arena
    planned over those buffers' lifetimes)."""
    for block in capture.outside:
        if block._allocation is None and not block.readonly:
            block.memory_for_write("graph replay")
    held = _take_scratch(capture)
    if plan == "static":
        _replay_static(capture, held, args)
        return
    _run_init(capture)
    allocator, starts, ends = capture.allocator, capture.memory.starts, capture.memory.ends
    commit = capture.memory.tail_at  # NOTE: the commit point, or 0: MemoryPlan.tail_at
    memory: Memory = {}
    allocations: dict[int, Allocation] = {}
    live = peak = 0
    try:
        for position, step in enumerate(capture.steps):
            if position == commit:
                live += _take_tail(capture, allocations, memory)
            for life in starts.get(position, ()):
                allocation = allocations[life.key] = allocator.allocate(life.nbytes)
                memory[life.key] = (allocation.raw, allocation.offset)
                live += allocation.size
            peak = max(peak, live)
            _bind(step, capture, memory)()
            for key in ends.get(position, ()):
                allocation = allocations.pop(key)
                del memory[key]
                live -= allocation.size
                allocator.free(allocation)
    finally:
        for allocation in allocations.values():
            allocator.free(allocation)
    capture.peak_bytes = held + peak


#: the key of recycle's tail arena among a replay's allocations
_TAIL = -1


def _take_tail(capture: _Capture, allocations: dict[int, Allocation], memory: Memory) -> int:
    """Allocate the buffers first used at or after the commit step; return the bytes taken."""
    taken = 0
    tail_plan = capture.memory.tail_plan
    if tail_plan is not None:  # recycle: one arena, its buffers placed by the planner
        arena = allocations[_TAIL] = capture.allocator.allocate(tail_plan.planned_bytes)
        for key, offset in tail_plan.offsets.items():
            memory[key] = (arena.raw, arena.offset + offset)
        return arena.size
    for life in capture.memory.tail:  # none: one allocation each, as at their first writes
        allocation = allocations[life.key] = capture.allocator.allocate(life.nbytes)
        memory[life.key] = (allocation.raw, allocation.offset)
        taken += allocation.size
    return taken


def _run_init(capture: _Capture) -> None:
    """Load the host data that initialises state made in the capture: at the first replay."""
    for step in capture.init:
        _bind(step, capture, {})()
    capture.init = []


def _take_scratch(capture: _Capture) -> int:
    """Allocate the fused chains' scratch (once a capture, from its allocator, so it counts
    like every other byte the graph holds) and file a view of it under each key the device's
    blocked chains look for (`Device.fused_scratch`); return the bytes held."""
    scratch = capture.memory.scratch
    if capture.scratch_memory is None and scratch:
        allocation = capture.allocator.allocate(capture.memory.scratch_bytes)
        capture.scratch_memory = allocation
        for key, offset in scratch.items():
            shape, dtype, _ = key
            capture.scratch[key] = capture.device._array_view(
                allocation.raw, allocation.offset + offset, shape, dtype,
                tuple(s * dtype.itemsize for s in contiguous_strides(shape)))
    return capture.scratch_memory.size if capture.scratch_memory is not None else 0


def _replay_static(capture: _Capture, held: int, args: Sequence[Any]) -> None:
    """Run the prebuilt steps; they are rebuilt only when an outside block's memory moved.
    From the second replay on the same views, as one device graph where the device records
    them (Note [a static plan as one device graph])."""
    static_plan = capture.memory.static_plan
    if capture.arena is None and static_plan.offsets:
        # NOTE: also for a plan of 0 bytes (zero-size intermediates): their views need memory
        capture.arena = capture.allocator.allocate(static_plan.planned_bytes)
        capture.views = None
    _run_init(capture)
    key = tuple(id(block._allocation) for block in capture.outside)
    if capture.views is None or key != capture.view_key:
        arena = capture.arena
        memory: Memory = {}
        if arena is not None:
            for buffer, offset in static_plan.offsets.items():
                memory[buffer] = (arena.raw, arena.offset + offset)
        capture.views = [_bind(step, capture, memory, capture.record_graph)
                         for step in capture.steps]
        capture.view_key = tuple(id(block._allocation) for block in capture.outside)
        capture.peak_bytes = held + (arena.size if arena is not None else 0)
        capture.bound_memory = memory
        capture.graph_marks = list({id(b): b for b in _outside_writes(
            [i for step in capture.steps for i in step.instructions], capture)}.values())
        capture.recording = None  # NOTE: one recorded on the old views is stale
    elif capture.record_graph:
        if capture.recording is None:
            capture.recording = _record(capture)
        if capture.recording:
            _run_checks(capture, args)
            capture.recording.launch()
            for block in capture.graph_marks:
                block.mark_written()
            return
    for thunk in capture.views:
        thunk()


# Note [a static plan as one device graph]: a static plan's replay runs the same kernels on
# the same addresses at every call, which is what a device graph (a CUDA graph) holds; so on a
# device that records them (`Capabilities.records_graphs`), the second replay on the same
# views records the bound steps once (`Device.record`: nothing runs while it records) and
# launches the recording, and every later replay is that one launch: no Python per kernel.
# The first replay runs launch by launch, so that kernels are compiled, lazy memory taken and
# the scratch allocated before anything is recorded. The input copies stay outside the graph
# (`_copy_inputs`, before it: their sources are the caller's arrays, at new addresses each
# call), and so do the host-side version marks of outside blocks the steps write
# (`graph_marks`, after it). A load of host data inside the step (a constant the step makes)
# copies bytes staged on the device once, at binding, which a graph can record; a reload
# (memory_budget's move to host memory and back) copies what its offload read this very step,
# so a plan with moves is never recorded (`Graph._records`). Where the
# device cannot record the step (a kernel that reads back
# to the host, a library that refuses to be recorded) `_record` keeps the reason, which
# `memory_report()["device_graph"]` shows, and the replays run launch by launch as before,
# with the same bits: a recording launches the very calls the steps make. A host check that
# an op moved out of the graph (cross_entropy's labels: `Device.record`) runs before the launch,
# so it must read memory the step itself does not write: the arguments' copies, state from
# outside; one that reads what the step writes is refused, with the reason.


def _record(capture: _Capture) -> Any:
    """The capture's steps recorded as one device graph, or False with `graph_reason` set."""
    views = capture.views or []  # NOTE: bound by `_replay_static` before it records

    def run() -> None:
        for thunk in views:
            thunk()

    try:
        recording = capture.device.record(run)
        written = _written_layouts(capture)
        for check in recording.checks:
            hit = next((w for w in written if aliasing.overlaps(check.layout, w)), None)
            if hit is not None:
                raise RecordError(
                    f"a host check before the launch would read {_span_text(check.layout)}, "
                    f"which the step itself writes ({_span_text(hit)}): labels made inside "
                    f"the step are checked only when it runs launch by launch")
    except RecordError as exc:
        capture.graph_reason = str(exc)
        return False
    capture.graph_reason = None
    copies = {_layout_of(holder): at for at, holder in enumerate(capture.placeholders)
              if holder is not None}
    capture.check_sources = [copies.get(check.layout) for check in recording.checks]
    capture.check_seen = [None] * len(recording.checks)
    return recording


def _at_address(device: Any, raw: Any, base: int, layout: aliasing.Layout) -> aliasing.Layout:
    """`layout` (its offset from `base` bytes into `raw`) at its device address."""
    offset, shape, strides, itemsize = layout
    return device.address(raw) + base + offset, shape, strides, itemsize


def _layout_of(t: Tensor) -> aliasing.Layout:
    """A tensor's memory as a layout at its device address."""
    allocation = t.block.memory_for_write("graph replay")
    return _at_address(t.device, allocation.raw, allocation.offset, t.layout())


def _run_checks(capture: _Capture, args: Sequence[Any]) -> None:
    """The recording's host checks, before its launch. One that reads the copy of an
    argument checks a host array argument itself (no read of device memory, so no wait for
    the device), and skips a tensor argument it passed before when nothing can have written
    it since (`dlpack.seen`: Note [writes the working copy cannot see] in runtime/amp.py);
    the others read the device."""
    for at, check in enumerate(capture.recording.checks):
        source = capture.check_sources[at]
        if source is None:
            check.check(check.view)
            continue
        arg, holder = args[source], capture.placeholders[source]
        if not isinstance(arg, Tensor):
            check.check(host_array(arg, None, "graph input").reshape(holder.shape))
            continue
        block = arg.block
        seen = dlpack.seen(block)
        key = None if seen is None else (block.id, block.generation, arg.offset, arg.strides,
                                         *seen)
        if key is None or key != capture.check_seen[at]:  # NOTE: a version never comes back
            check.check(check.view)
            capture.check_seen[at] = key


def _written_layouts(capture: _Capture) -> list[aliasing.Layout]:
    """Every layout the steps' instructions write, at device addresses: a fused chain's inner
    results are never in memory, and asking for theirs would allocate them."""
    device, memory = capture.device, capture.bound_memory
    layouts = []
    for step in capture.steps:
        for instr in step.instructions:
            for operand in instr.outputs:
                if operand.block.id in step.internal:
                    continue
                raw, base = _memory_of(operand, capture, memory)
                layouts.append(_at_address(device, raw, base, (
                    operand.offset, operand.shape, operand.strides, operand.dtype.itemsize)))
    return layouts


def _span_text(layout: aliasing.Layout) -> str:
    start, stop = aliasing.byte_span(layout) or (layout[0], layout[0])
    return f"{stop - start} bytes at {start:#x}"


def _memory_of(operand: Operand, capture: _Capture, memory: Memory) -> tuple[Any, int]:
    buffer = capture.buffer_of.get(operand.block.id)
    if buffer is not None:
        return memory[buffer]
    block = operand.block
    allocation = block._allocation  # NOTE: the capture checked every read; lazy ones get memory
    if allocation is None:
        allocation = block.memory_for_write("graph replay")
    return allocation.raw, allocation.offset


def _view(operand: Operand, capture: _Capture, memory: Memory) -> Any:
    raw, base = _memory_of(operand, capture, memory)
    return capture.device._array_view(raw, base + operand.offset, operand.shape, operand.dtype,
                                      operand.strides)


def _outside_writes(instructions: Sequence[Instruction], capture: _Capture) -> list[Block]:
    """Blocks outside the plan that these instructions write: their versions move on."""
    return [o.block for instr in instructions for o in instr.outputs
            if o.block.id not in capture.buffer_of and o.block.id in capture.outside_ids]


def _bind(step: _Step, capture: _Capture, memory: Memory,
          staging: bool = False) -> Callable[[], None]:
    """A function that runs `step` on views bound now. The functions hold native views and the
    instructions' `run` calls, never a Tensor (Note [closures hold no tensors] in
    runtime/autograd.py), so a bound step keeps no block alive that the plan does not."""
    marks = _outside_writes(step.instructions, capture)
    if step.product is not None:
        run = _bind_product(step, capture, memory)
    elif len(step.instructions) > 1:
        run = _bind_fused(step, capture, memory)
    else:
        lone = capture.device.capabilities.chains_lone_steps and _fusable(step.instructions[0])
        run = (_bind_compiled(step, capture, memory) if lone else None
               ) or _bind_one(step.instructions[0], capture, memory, staging)
    if not marks:
        return run

    def run_and_mark() -> None:
        run()
        for block in marks:
            block.mark_written()

    return run_and_mark


def _bind_one(instr: Instruction, capture: _Capture, memory: Memory,
              staging: bool = False) -> Callable[[], None]:
    """One instruction on views bound now; a load copies its host bytes, or with `staging`
    (steps a device graph will record) bytes staged on the device once, here."""
    if instr.kind == "load":
        raw, base = _memory_of(instr.outputs[0], capture, memory)
        offset, host, device = base + instr.outputs[0].offset, instr.host, capture.device
        if not staging:
            return lambda: device.copyin(raw, offset, host)
        # NOTE: a host copy cannot be recorded: the bytes wait on the device, staged once, and
        # each step copies them there (Note [a static plan as one device graph])
        size = np.ascontiguousarray(host).nbytes
        staged = device.raw_alloc(max(size, 1))
        device.copyin(staged, 0, host)
        capture.staged.append(staged)
        source = device._array_view(staged, 0, (size,), _BYTE, (1,))
        target = device._array_view(raw, offset, (size,), _BYTE, (1,))
        return lambda: device.unary("copy", source, target)
    views = [_view(a, capture, memory) if isinstance(a, Operand) else a
             for a in _arguments(instr)]
    targets = [_view(o, capture, memory) for o in instr.outputs]
    run = instr.run
    return lambda: run(views, *targets)


def _bind_product(step: _Step, capture: _Capture, memory: Memory) -> Callable[[], None]:
    """A product heading a chain (`_attach_products`): one accumulating gemm, or the product
    written into the chain's output and the chain run over it in place."""
    head, chain = step.instructions[0], step.instructions[1:]
    device = capture.device
    a, b = (_view(operand, capture, memory) for operand in head.inputs[:2])
    out = _view(chain[-1].outputs[0], capture, memory)
    if step.product != "into":
        alpha, beta = step.product
        return device.prepare_gemm(a, b, out, alpha, beta)
    rest = _bind_fused(_Step(chain, step.internal), capture, memory, head)
    product = device.prepare_matmul(a, b, out)  # NOTE: as the op computes it: bit-identical

    def run() -> None:
        product()
        rest()

    return run


def _bind_fused(step: _Step, capture: _Capture, memory: Memory,
                head: Instruction | None = None) -> Callable[[], None]:
    """A chain of elementwise instructions as one `Device.fused` program (`_fused_program`),
    on views bound now, with the capture's scratch arrays."""
    program, operands = _fused_program(step.instructions, step.internal, head)
    out = _view(step.instructions[-1].outputs[0], capture, memory)
    inputs = [_view(operand, capture, memory) for operand in operands]
    return capture.device.prepare_fused(program, inputs, out, capture.scratch)


def _bind_compiled(step: _Step, capture: _Capture, memory: Memory) -> Callable[[], None] | None:
    """A lone elementwise step as a one-link chain, where the device asks for that
    (`chains_lone_steps`) and compiles the chain (on the CPU a `_halfconv.chain`, whose work
    splits over the pool: Note [one pool for kernels and products] in backends/threads.py),
    with its views bound once; else None. A chain's link gives the bits of the op run alone
    (Note [one formula on every backend] in backends/base.py)."""
    program, operands = _fused_program(step.instructions, step.internal)
    out = _view(step.instructions[-1].outputs[0], capture, memory)
    inputs = [_view(operand, capture, memory) for operand in operands]
    return capture.device.prepare_fused(program, inputs, out, compiled_only=True)


def _release(capture: _Capture) -> None:
    capture.recording = None
    for raw in capture.staged:
        capture.device.raw_free(raw)
    capture.staged.clear()
    if capture.arena is not None:
        capture.allocator.free(capture.arena)
        capture.arena = None
    capture.views = None
    capture.scratch.clear()
    if capture.scratch_memory is not None:
        capture.allocator.free(capture.scratch_memory)
        capture.scratch_memory = None
    for t in capture.held:
        t.release()
    capture.held.clear()
