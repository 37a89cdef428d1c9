"""Moves: forward results copied to host memory after their last forward use and back before
their first backward use, so the device holds them only where they are used (vDNN, SINGA's
swap). Chosen by `budget._fit` on devices whose memory is not the host's (`Device.host_memory`).

A move is two instructions. "offload" reads the result (a whole-block uint8 view) and copies it
into a host array; it writes a 0-byte token block. "reload" is a load of that same host array
(filled at every replay by the offload) into a fresh block, and it reads the token, so the
schedule runs it after the offload; the backward reads are pointed at the fresh block. The
result's lifetime ends at the offload, and the fresh block's begins at the reload.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from runtime.block import Block
from runtime.graph.checkpoint import _moved, _outside_reads, _reading
from runtime.tape import Instruction, Operand

_BYTES = np.dtype(np.uint8)


def _move(program: list[Instruction], intermediate: set[int], moved: Iterable[int],
          device: object) -> tuple[list[Instruction], int]:
    """`program` with each block of `moved` (forward results the backward pass reads) moved to
    host memory and back; `intermediate` gains the new blocks. Returns the program and the bytes
    one replay copies (both ways)."""
    forward = {i for i, instr in enumerate(program) if instr.phase == "forward"}
    backward_reads = _outside_reads(program, forward)
    last_forward_use: dict[int, int] = {}
    blocks: dict[int, Block] = {}
    for i in sorted(forward):
        for operand in (*program[i].inputs, *program[i].outputs):
            last_forward_use[operand.block.id] = i
            blocks[operand.block.id] = operand.block
    after: dict[int, list[Instruction]] = {}
    before: dict[int, list[Instruction]] = {}
    renamed: dict[int, Block] = {}
    copied = 0
    for bid in sorted(moved):
        block = blocks[bid]
        token, back = Block(0, block.allocator), Block(block.nbytes, block.allocator)
        host = np.empty(block.nbytes, np.uint8)
        after.setdefault(last_forward_use[bid], []).append(Instruction(
            "offload", "never", [_whole(block)], [_whole(token)], run=_offload(host, device),
            phase="move"))
        before.setdefault(backward_reads[bid], []).append(Instruction(
            "reload", "never", [_whole(token)], [_whole(back)], host=host, phase="move"))
        renamed[bid] = back
        intermediate.update((token.id, back.id))
        copied += 2 * block.nbytes
    rewritten: list[Instruction] = []
    for i, instr in enumerate(program):
        rewritten.extend(before.get(i, ()))
        if i not in forward and any(o.block.id in renamed for o in instr.inputs):
            instr = _reading(instr, instr.phase, renamed)
        rewritten.append(instr)
        rewritten.extend(after.get(i, ()))
    for index, instr in enumerate(rewritten):
        instr.index = index
    return rewritten, copied


def _whole(block: Block) -> Operand:
    return _moved(Operand(block, 0, (block.nbytes,), (1,), _BYTES), block)


def _offload(host: np.ndarray, device: object):
    """The offload's kernel: the block's bytes into `host` (Note [closures hold no tensors] in
    runtime/autograd.py: it holds the host array and the device, no tensor)."""
    to_host = device.to_host  # type: ignore[attr-defined]

    def run(views: list, token: object) -> None:
        host[...] = to_host(views[0])

    return run
