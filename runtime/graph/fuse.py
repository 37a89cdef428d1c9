"""Fusion: elementwise chains as one step, products folded into their consumers, in-place reuse."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from backends import optable
from runtime import dtypes
from runtime.graph.program import Fused, _Step
from runtime.graph.schedule import _positions
from runtime.tape import Instruction, Operand


def _fuse_steps(scheduled: list[Instruction], intermediate: frozenset[int], device: Any, *,
                fuse: bool, in_place: bool, fold_updates: bool) -> Fused:
    """Phase 4: the schedule as steps (`fuse`: elementwise chains fused, products folded into
    the chains that consume them; `fold_updates`: an update out = alpha * product + beta * out
    may become one accumulating gemm) and a buffer for each planned block (`in_place`: an
    elementwise step may write over an input that dies there)."""
    if fuse:
        steps = _attach_products(_fuse(_sunk(scheduled, intermediate), intermediate),
                                 intermediate, device, fold_updates)
    else:
        steps = [_Step([instr]) for instr in scheduled]
    internal = set().union(*(step.internal for step in steps))
    fresh = {step.instructions[-1].outputs[0].block.id for step in steps
             if step.product == "into"}
    buffer_of, reused = _buffers(steps, intermediate - internal, in_place, fresh)
    return Fused(steps=steps, buffer_of=buffer_of, in_place=reused)


def _fusable(instr: Instruction) -> bool:
    """An elementwise kernel that a fused chain may run (`Op.fusible` in backends/optable.py)."""
    op = optable.BY_NAME.get(instr.op)
    return (instr.kind == "kernel" and op is not None and op.fusible
            and instr.policy == "elementwise" and len(instr.outputs) == 1)


#: The farthest (in instructions) `_sunk` moves a link down to its one reader
_SINK_REACH = 64


def _sunk(scheduled: list[Instruction], intermediate: frozenset[int]) -> list[Instruction]:
    """The schedule with each fusible instruction whose result only one later fusible
    instruction reads moved down to just before that reader, so that the two fuse: the
    scheduler runs an instruction as soon as it frees what it makes (batch norm's x - mean,
    the moment its mean exists), often a few small instructions before the one that reads
    its result (the mul by 1 / sqrt(var + eps), which waits for them).

    Moved only where it reads no result of the fusible instruction just before it (the two
    may fuse where they are), nothing between writes what it reads or touches its result, at most
    _SINK_REACH instructions down, and where at most one input dies at it, one that could
    hold its result in place (`_donates`): so no step holds more bytes than before (between,
    that input lives on where the result did; at the chain, the chain's result takes its
    buffer where the reader's result took the moved one's). Values are unchanged: only
    independent instructions trade places."""
    readers = _positions(scheduled, "inputs")
    writers = _positions(scheduled, "outputs")
    landing: dict[int, list[int]] = {}  # NOTE: reader position -> moved positions, in order
    for i, instr in enumerate(scheduled):
        if not _fusable(instr):
            continue
        link = instr.outputs[0]
        bid = link.block.id
        reads = sorted(set(readers.get(bid, ())))
        if (bid not in intermediate or not link.whole or writers.get(bid) != [i]
                or len(reads) != 1 or not i + 1 < reads[0] <= i + _SINK_REACH):
            continue
        p = reads[0]
        reader = scheduled[p]
        if (not _fusable(reader) or reader.outputs[0].shape != link.shape
                or not all(o.whole for o in reader.inputs if o.block.id == bid)):
            continue
        mine = {o.block.id for o in instr.inputs}
        if any(o.block.id in mine for k in range(i + 1, p) for o in scheduled[k].outputs):
            continue
        if i and _fusable(scheduled[i - 1]) and scheduled[i - 1].outputs[0].block.id in mine:
            continue  # NOTE: it may end a chain where it is; moved, that link would be made
        dying = {o.block.id: o for o in instr.inputs
                 if o.block.id in intermediate and max(readers[o.block.id]) == i
                 and max(writers.get(o.block.id, [-1])) < i}
        if len(dying) > 1 or not all(_donates(o, link) for o in dying.values()):
            continue
        landing.setdefault(p, []).append(i)
    if not landing:
        return scheduled
    moved = {i for group in landing.values() for i in group}
    order: list[Instruction] = []

    def emit(k: int) -> None:
        for m in landing.get(k, ()):
            emit(m)
        order.append(scheduled[k])

    for k in range(len(scheduled)):
        if k not in moved:
            emit(k)
    return order


def _fuse(scheduled: list[Instruction], intermediate: frozenset[int]) -> list[_Step]:
    """Group chains of elementwise instructions, consecutive in the schedule, where each link's
    output is an intermediate written whole, read only by the next link (whole), and dead after
    it. The chain runs in row blocks; its inner results never exist at full size."""
    readers = _positions(scheduled, "inputs")
    writers = _positions(scheduled, "outputs")
    steps: list[_Step] = []
    for position, instr in enumerate(scheduled):
        if steps and position and _fusable(instr) and _fusable(scheduled[position - 1]):
            previous = scheduled[position - 1]
            link = previous.outputs[0]
            bid = link.block.id
            # NOTE: a link may be read twice by the next (x - m squared: mul(d, d))
            if (bid in intermediate and link.whole and set(readers.get(bid, ())) == {position}
                    and writers.get(bid) == [position - 1]
                    and previous.outputs[0].shape == instr.outputs[0].shape
                    and all(o.whole for o in instr.inputs if o.block.id == bid)
                    and steps[-1].instructions[-1] is previous):
                steps[-1].instructions.append(instr)
                steps[-1].internal.add(bid)
                continue
        steps.append(_Step([instr]))
    return steps


_PRODUCTS = ("matmul", "linear")


def _arguments(instr: Instruction) -> Iterator[Operand | float]:
    """An instruction's arguments in call order: its operands, with the numbers of
    `scalars` at their positions among them (as `ops._launch` passes them to the kernel)."""
    scalars = instr.scalars or {}
    operands = iter(instr.inputs)
    for position in range(len(instr.inputs) + len(scalars)):
        yield scalars[position] if position in scalars else next(operands)


def _chain(step: _Step) -> tuple[list[Instruction], Instruction | None] | None:
    """The elementwise chain that `step` runs as one `Device.fused` program, and the product
    written into the chain's output before it ("into"), if any; None for a step that runs no
    fused program (one instruction, or a product folded into one accumulating gemm)."""
    if step.product == "into":
        return step.instructions[1:], step.instructions[0]
    if step.product is None and len(step.instructions) > 1:
        return step.instructions, None
    return None


def _fused_program(chain: Sequence[Instruction], internal: set[int],
                   head: Instruction | None = None
                   ) -> tuple[tuple[tuple[str, tuple, Any], ...], list[Operand]]:
    """`chain` as a `Device.fused` program (kernel, arguments, dtype per link) and the operands
    its ("input", k) arguments name, in order: the chain's external operands; its inner
    results (`internal`) are links. With a product `head` already written into the chain's
    output, the program reads that output (plus linear's bias, added first) where the chain
    read the product."""
    operands: list[Operand] = []
    program: list[tuple[str, tuple, Any]] = []
    source: dict[int, tuple[str, int]] = {}  # internal block id -> its argument
    if head is not None:
        product = head.outputs[0]
        operands.append(chain[-1].outputs[0])
        source[product.block.id] = ("input", 0)
        if len(head.inputs) > 2:  # linear's bias
            operands.append(head.inputs[2])
            program.append(("add", (("input", 0), ("input", 1)), product.dtype))
            source[product.block.id] = ("link", 0)
    for instr in chain:
        args: list[tuple[str, Any]] = []
        for operand in _arguments(instr):
            if not isinstance(operand, Operand):
                args.append(("number", operand))
            elif operand.block.id in internal:
                args.append(source[operand.block.id])
            else:
                args.append(("input", len(operands)))
                operands.append(operand)
        output = instr.outputs[0]
        program.append((instr.op, tuple(args), output.dtype))
        source[output.block.id] = ("link", len(program) - 1)
    return tuple(program), operands


def _scratch_keys(steps: Sequence[_Step], device: Any) -> list[tuple]:
    """The scratch arrays `device` runs the fused steps with (`Device.fused_scratch`), each
    key once: the steps share one scratch dict, so chains share the array of a key."""
    keys: dict[tuple, None] = {}
    for step in steps:
        chain = _chain(step)
        if chain is not None:
            instructions, head = chain
            program, _ = _fused_program(instructions, step.internal, head)
            out = instructions[-1].outputs[0]
            keys.update(dict.fromkeys(device.fused_scratch(program, out.shape, out.dtype)))
    return list(keys)


def _is_product(instr: Instruction) -> bool:
    """A 2-D matrix product: matmul(a, b), or linear(x, weight.T[, bias broadcast])."""
    return (instr.kind == "kernel" and instr.op in _PRODUCTS and len(instr.outputs) == 1
            and instr.outputs[0].whole
            and all(len(o.shape) == 2 for o in (*instr.inputs[:2], instr.outputs[0])))


def _products(steps: Sequence[_Step]) -> list[tuple[Operand, Operand, Operand, bool]]:
    """The 2-D matrix products the steps run, one entry per call, as (a, b, out, accumulates),
    for `Device.plan_products`: products heading a chain, and products on their own."""
    found = []
    for step in steps:
        head = step.instructions[0]
        if step.product is not None:
            accumulates = step.product != "into" and step.product[1] != 0.0
            found.append((head.inputs[0], head.inputs[1], step.instructions[-1].outputs[0],
                          accumulates))
        elif (len(step.instructions) == 1 and head.kind == "kernel" and head.op in _PRODUCTS
              and all(len(o.shape) == 2 for o in (*head.inputs[:2], *head.outputs))):
            found.append((head.inputs[0], head.inputs[1], head.outputs[0], False))
    return found


# Note [a folded update's rounding]: eagerly, SGD's w - lr * g rounds the product g, then
# lr * g, then the difference. Folded, one gemm(a, b, w, alpha=-lr, beta=1) adds the product
# into w as the BLAS kernel goes: a BLAS may add alpha * (partial sum) into its output once per
# block of the inner dimension (the batch, for a weight gradient; OpenBLAS's blocks are a few
# hundred long), and may round alpha * sum + out once (a fused multiply-add). Either way the
# folded step's bits may differ from eager's. Measured on an AMD EPYC with OpenBLAS 0.3.31 (an
# MLP under SGD, 3 steps): widths (16, 64, 4) at batch 8 equal eager bit for bit, (256, 512,
# 10) at batch 64 differ in the parameters, (64, 300, 7) at batch 1000 in the losses too. No
# BLAS promises which rounding it does, so the difference cannot be predicted from the shapes,
# only avoided. The fold saves the gradient's buffer (the M MLP plans 5.25 MB with it, 9.44
# without), so it stays the default; `runtime.graph(..., fold_updates=False)` gives eager's
# bits, the product written to a buffer of its own and the update run as eager runs it, and
# `memory_report()["updates_folded"]` says whether a graph folded any. Every other rewrite of
# the graph, a product written straight into its chain's output ("into") included, rounds as
# eager does.


def _attach_products(steps: list[_Step], intermediate: frozenset[int],
                     device: Any, fold_updates: bool) -> list[_Step]:
    """Move each matrix product whose result (an intermediate) only an elementwise chain reads,
    whole, into that chain's step, so the product never gets a buffer of its own:
    - (alpha, beta): the chain computes out = alpha * product + beta * out, in place on out
      (plain SGD's w - lr * g, momentum's buf + g), the device's gemm accumulates and
      `fold_updates` allows it: one BLAS call, no pass over a gradient at all; it rounds
      differently from the chain (Note [a folded update's rounding]);
    - "into": otherwise, when the chain's output has the product's shape and dtype and shares
      no block with what the step reads: the product is written straight into the output and
      the chain (with linear's bias add at its head) runs over it in place. Bit-identical.
    The product moves later, to the chain's position, only past steps that write nothing it
    reads."""
    readers: dict[int, set[int]] = {}
    writers: dict[int, set[int]] = {}
    for position, step in enumerate(steps):
        for instr in step.instructions:
            for operand in instr.inputs:
                readers.setdefault(operand.block.id, set()).add(position)
            for operand in instr.outputs:
                writers.setdefault(operand.block.id, set()).add(position)
    # NOTE: once: the CPU's capability is a Deferred, asked at each read
    accumulate = fold_updates and bool(device.capabilities.gemm_accumulates)
    moved: set[int] = set()
    for position, step in enumerate(steps):
        if step.product is not None or not all(_fusable(i) for i in step.instructions):
            continue
        out = step.instructions[-1].outputs[0]
        for operand in (o for i in step.instructions for o in i.inputs):
            bid = operand.block.id
            source = writers.get(bid, set())
            if bid not in intermediate or len(source) != 1 or readers[bid] != {position}:
                continue
            (at,) = source
            head = steps[at].instructions[0]
            if at >= position or at in moved or len(steps[at].instructions) != 1 \
                    or not _is_product(head):
                continue
            reads = {o.block.id for o in head.inputs}
            if out.block.id in reads or any(o.block.id in reads for later in
                                            steps[at + 1:position]
                                            for i in later.instructions for o in i.outputs):
                continue
            kind = _folding(step, head, out, accumulate)
            if kind is None:
                continue
            steps[position] = _Step([head, *step.instructions], step.internal | {bid}, kind)
            moved.add(at)
            break
    return [step for position, step in enumerate(steps) if position not in moved]


def _folding(step: _Step, head: Instruction, out: Operand,
             accumulate: bool) -> str | tuple[float, float] | None:
    """How `head`'s product joins `step`'s chain (see `_attach_products`), or None; `out`
    (the chain's output) is already known not to be read by the product; `accumulate`:
    whether an update may become one accumulating gemm (the device's and `fold_updates`)."""
    product = head.outputs[0]
    if any(o.block.id == product.block.id and (o.shape != out.shape or not o.whole)
           for i in step.instructions for o in i.inputs):
        return None
    if product.dtype != out.dtype or product.shape != out.shape:
        return None
    if accumulate and out.dtype in (np.float32, np.float64) \
            and (head.op == "matmul" or len(head.inputs) == 2):
        form = _linear_form(step.instructions, product.block.id, out)
        if form is not None:
            return form
    if any(o.block.id == out.block.id for i in step.instructions for o in i.inputs):
        return None
    if len(head.inputs) > 2 and product.dtype in dtypes.HALVES:
        return None  # NOTE: linear rounds x @ w.T + bias once; split, the product would round too
    return "into"


def _linear_form(chain: Sequence[Instruction], product: int,
                 out: Operand) -> tuple[float, float] | None:
    """(alpha, beta) when `chain` computes out = alpha * product + beta * out exactly in form
    (each link's formula linear in those two: adds, subtractions, negations, products with
    numbers), else None."""
    value: dict[int, tuple[float, float]] = {}  # block id -> (coefficient of product, of out)
    form: tuple[float, float] | None = None
    for instr in chain:
        args: list[Any] = []
        for operand in _arguments(instr):
            if not isinstance(operand, Operand):
                args.append(float(operand))
            elif operand.block.id == product:
                args.append((1.0, 0.0))
            elif operand == out:
                args.append((0.0, 1.0))
            elif operand.block.id in value:
                args.append(value[operand.block.id])
            else:
                return None
        # NOTE: the op's own formula decides (backends/optable.py): add, sub, neg and a
        # product with a number are linear; anything else is not
        op = optable.BY_NAME.get(instr.op)
        form = None if op is None else optable.linear_form(op, args)
        if form is None:
            return None
        value[instr.outputs[0].block.id] = form
    return form if form is not None and form[0] != 0.0 else None


def _donates(operand: Operand, out: Operand) -> bool:
    """Whether `operand`, dying at the step that writes `out`, could hold out in place: both
    cover their blocks whole, with one size, shape and dtype."""
    return (operand.whole and operand.block.nbytes == out.block.nbytes
            and operand.shape == out.shape and operand.dtype == out.dtype)


def _buffers(steps: list[_Step], planned: set[int], in_place: bool,
             fresh: set[int] = frozenset()) -> tuple[dict[int, int], int]:
    """Map each planned block to a buffer: its own, or (in place) the buffer of an elementwise
    step's input (any link's, for a chain) that dies at the step writing it, when both cover
    their blocks whole with one size (`_donates`).
    Blocks in `fresh` always get their own (a product is written into them before the chain
    that reads the dying inputs runs)."""
    flat = [(position, instr) for position, step in enumerate(steps)
            for instr in step.instructions]
    last_use: dict[int, int] = {}
    first_write: dict[int, int] = {}
    for position, instr in flat:
        for operand in instr.inputs:
            last_use[operand.block.id] = position
        for operand in instr.outputs:
            first_write.setdefault(operand.block.id, position)
            last_use[operand.block.id] = position
    buffer_of: dict[int, int] = {}
    reused = 0
    taken: set[int] = set()
    # NOTE: a chain's result may take the buffer of any link's dying input: each runs element
    # by element (row block by row block), every link reading an element before the last
    # writes it
    step_reads = [[o for i in step.instructions for o in i.inputs] for step in steps]
    for position, instr in flat:
        reads = step_reads[position]
        for out in instr.outputs:
            bid = out.block.id
            if bid not in planned or bid in buffer_of:
                continue
            donor = None
            if in_place and instr.policy == "elementwise" and out.whole \
                    and first_write[bid] == position and bid not in fresh:
                for operand in reads:
                    source = operand.block.id
                    if (source in buffer_of and source not in taken
                            and last_use[source] == position and _donates(operand, out)):
                        donor = source
                        break
            if donor is None:
                buffer_of[bid] = bid  # NOTE: a buffer is named by the first block it holds
            else:
                buffer_of[bid] = buffer_of[donor]
                taken.add(donor)
                reused += 1
    return buffer_of, reused
