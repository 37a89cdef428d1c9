"""Stores between the forward and the backward pass: forward results kept for backward that
live elsewhere, or smaller, while they wait. Chosen by `budget._fit`.

- **Moves** (vDNN, SINGA's swap): copied to host memory after their last forward use and back
  before their first backward use, so the device holds them only where they are used. Only on
  devices whose memory is not the host's (`Capabilities.host_memory` False). A move is two
  instructions. "offload" reads the result (a whole-block uint8 view) and copies it into a host
  array; it writes a 0-byte token block. "reload" is a load of that same host array (filled at
  every replay by the offload) into a fresh block, and it reads the token, so the schedule runs
  it after the offload.
- **Lossy stores** (only with `runtime.graph(..., lossy=...)`): a float32 result cast to
  float16 or bfloat16 after its last forward use (`Device.cast`, rounding to nearest even) and
  widened back to float32, into a fresh block, before each later run of readers (a recompute,
  a stretch of the backward pass): half the bytes while it waits, and the backward pass reads
  the rounded values.

Either way the later reads are pointed at the fresh block (a lossy store widens a fresh one for
each later run of readers); the result's lifetime ends at the offload or cast, and the fresh block's
begins at the reload or widening.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from runtime.block import Block
from runtime.graph.checkpoint import _moved, _reading
from runtime.tape import Instruction, Operand

_BYTES = np.dtype(np.uint8)
_FLOAT32 = np.dtype(np.float32)


@dataclass(frozen=True)
class Stored:
    """One result stored lossy: its block, the op that made it (in the forward pass or a
    recompute), its shape, and the dtype it waited in."""

    block: int
    op: str
    phase: str
    shape: tuple[int, ...]
    dtype: str
    #: bytes it took while waiting (half its float32 bytes)
    nbytes: int


#: (block, the forward operand that wrote it) -> (the instruction after its last forward use,
#: a function making for each later reader (or the first only) the instruction before it and
#: the block that reader reads instead), or None to leave it alone
_Pair = Callable[[Block, Operand],
                 "tuple[Instruction, Callable[[], tuple[Instruction, Block]]] | None"]


def _stored(program: list[Instruction], intermediate: set[int], chosen: Iterable[int],
            pair: _Pair, *, each_read: bool = False
            ) -> tuple[list[Instruction], list[tuple[Block, Operand]]]:
    """`program` with each block of `chosen` given the instructions `pair` makes for it: one after
    its last read in the run of instructions of its writer's phase (the forward pass, or one
    recompute), and one before its first read after that run (`each_read`: before its first read
    in each later run of one phase, the readers of each run sharing a block of their own that
    dies there). Blocks read only within the run are left alone. `intermediate` gains the new
    blocks. Returns the program and the (block, operand) of each one rewritten."""
    run_end = [0] * len(program)
    for i in range(len(program) - 1, -1, -1):
        same = i + 1 < len(program) and program[i + 1].phase == program[i].phase
        run_end[i] = run_end[i + 1] if same else i + 1
    written: dict[int, tuple[int, Operand]] = {}
    reads: dict[int, list[int]] = {}
    for i, instr in enumerate(program):
        for operand in instr.inputs:
            found = reads.setdefault(operand.block.id, [])
            if not found or found[-1] != i:
                found.append(i)
        for operand in instr.outputs:
            written.setdefault(operand.block.id, (i, operand))
    after: dict[int, list[Instruction]] = {}
    before: dict[int, list[Instruction]] = {}
    #: position -> block id -> the block the instruction there reads instead
    renamed: dict[int, dict[int, Block]] = {}
    done: list[tuple[Block, Operand]] = []
    for bid in sorted(chosen):
        if bid not in written:
            continue
        at, operand = written[bid]
        near = [i for i in reads.get(bid, ()) if i < run_end[at]]
        far = [i for i in reads.get(bid, ()) if i >= run_end[at]]
        made = pair(operand.block, operand) if far else None
        if made is None:
            continue
        out, back = made
        after.setdefault(max([at, *near]), []).append(out)
        intermediate.update(o.block.id for o in out.outputs)
        fresh, run = None, None
        for position in far:
            if fresh is None or (each_read and run_end[position] != run):
                run = run_end[position]
                load, fresh = back()
                before.setdefault(position, []).append(load)
                intermediate.update(o.block.id for o in load.outputs)
            renamed.setdefault(position, {})[bid] = fresh
        done.append((operand.block, operand))
    rewritten: list[Instruction] = []
    for i, instr in enumerate(program):
        rewritten.extend(before.get(i, ()))
        if i in renamed:
            instr = _reading(instr, instr.phase, renamed[i])
        rewritten.append(instr)
        rewritten.extend(after.get(i, ()))
    for index, instr in enumerate(rewritten):
        instr.index = index
    return rewritten, done


def _move(program: list[Instruction], intermediate: set[int], moved: Iterable[int],
          device: object) -> tuple[list[Instruction], int]:
    """`program` with each block of `moved` moved to host memory and back. Returns the program
    and the bytes one replay copies (both ways)."""

    def pair(block: Block, _: Operand) -> tuple[Instruction, Callable]:
        token = Block(0, block.allocator)
        host = np.empty(block.nbytes, np.uint8)

        def reload() -> tuple[Instruction, Block]:
            back = Block(block.nbytes, block.allocator)
            return Instruction("reload", "never", [_whole(token)], [_whole(back)], host=host,
                               phase="move"), back

        return Instruction("offload", "never", [_whole(block)], [_whole(token)],
                           run=_offload(host, device), phase="move"), reload

    program, done = _stored(program, intermediate, moved, pair)
    return program, sum(2 * block.nbytes for block, _ in done)


def _halve(program: list[Instruction], intermediate: set[int], chosen: Iterable[int],
           dtype: np.dtype, device: object) -> tuple[list[Instruction], list[Stored]]:
    """`program` with each float32 block of `chosen`, written whole by one forward operand,
    stored as `dtype` (float16 or bfloat16) between its last forward and first backward use.
    Returns the program and what was stored so."""
    makers: dict[int, Instruction] = {}
    for instr in program:
        for operand in instr.outputs:
            makers.setdefault(operand.block.id, instr)

    def pair(block: Block, operand: Operand) -> tuple[Instruction, Callable] | None:
        if operand.dtype != _FLOAT32 or not operand.whole:
            return None
        narrow = _contiguous(Block(block.nbytes // 2, block.allocator), operand.shape, dtype)

        def widen() -> tuple[Instruction, Block]:
            wide = Block(block.nbytes, block.allocator)
            return Instruction("cast", "never", [narrow],
                               [_contiguous(wide, operand.shape, _FLOAT32)], run=_cast(device),
                               phase="store"), wide

        return Instruction("cast", "never", [operand], [narrow], run=_cast(device),
                           phase="store"), widen

    # NOTE: each later run of readers (a recompute, a stretch of the backward pass) widens a
    # copy of its own, which dies there: between the runs the result waits at half its bytes
    program, done = _stored(program, intermediate, chosen, pair, each_read=True)
    return program, [Stored(block.id, makers[block.id].op, makers[block.id].phase, operand.shape,
                            np.dtype(dtype).name, block.nbytes // 2) for block, operand in done]


def _whole(block: Block) -> Operand:
    return _moved(Operand(block, 0, (block.nbytes,), (1,), _BYTES), block)


def _contiguous(block: Block, shape: tuple[int, ...], dtype: np.dtype) -> Operand:
    strides, step = [], np.dtype(dtype).itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return Operand(block, 0, tuple(shape), tuple(reversed(strides)), np.dtype(dtype))


def _offload(host: np.ndarray, device: object):
    """The offload's kernel: the block's bytes into `host` (Note [closures hold no tensors] in
    runtime/autograd.py: it holds the host array and the device, no tensor)."""
    to_host = device.to_host  # type: ignore[attr-defined]

    def run(views: list, token: object) -> None:
        host[...] = to_host(views[0])

    return run


def _cast(device: object):
    """A lossy store's kernel, either way (it holds the device, no tensor)."""
    cast = device.cast  # type: ignore[attr-defined]

    def run(views: list, out: object) -> None:
        cast(views[0], out)

    return run
