"""Sharing memory between layers, and the aliasing bug it invites (Neanderthal, seed 000).

Two dense layers write their outputs into views of ONE shared buffer, as in Dragan Djuric's
"Deep Learning from Scratch to GPU - 5 - Sharing Memory". The views are column-major, as
Neanderthal's matrices are: a1 (4x2) and a2 (1x2) both start at the first element of the buffer,
so layer 2's GEMM writes its output over its own input.

1. An unchecked GEMM (zero the output, then accumulate, as BLAS does with beta = 0) corrupts
   the result: 0.41 0.44 instead of 0.44 0.44, for two identical inputs.
2. blockrt's default ("copy" mode) sees the overlap and computes through a temporary: 0.44 0.44.
3. In "raise" mode blockrt refuses, naming the op and both operands.
4. The fix from the article, alternating two buffers, needs no copy at all.

Run: python examples/sharing_memory.py   (or `make demo`)
"""

from __future__ import annotations

import numpy as np

import blockrt
from blockrt import ops

X = np.array([[0.3, 0.3], [0.9, 0.9]])                      # two identical inputs, as columns
W1 = np.array([0.3, 0.1, 0.9, 0.0, 0.6, 2.0, 3.7, 1.0]).reshape(2, 4).T   # column-major 4x2
B1 = np.array([[0.7], [0.2], [1.1], [2.0]])
W2 = np.array([[0.75, 0.15, 0.22, 0.33]])
B2 = np.array([[0.3]])


def colmajor_view(buffer: blockrt.Tensor, rows: int, cols: int, offset: int = 0) -> blockrt.Tensor:
    """Neanderthal's (view-ge buffer rows cols): a column-major matrix over a flat buffer."""
    return blockrt.view(buffer, (cols, rows), offset).T


def layer(w, b, activation, x, out):
    """out = activation(w @ x - b), every step written into `out` (no temporaries)."""
    ops.matmul(w, x, out=out)
    ops.sub(out, b, out=out)
    activation(out, out=out)
    return out


def unchecked_gemm(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """What a BLAS GEMM with beta = 0 does: zero the output, then accumulate a rank-1 update per k.

    It assumes `out` shares no memory with `a` or `b`; nothing checks that.
    """
    out[...] = 0.0
    for k in range(a.shape[1]):
        out += a[:, k:k + 1] * b[k:k + 1, :]


def forward(temp_1: blockrt.Tensor, temp_2: blockrt.Tensor, params) -> np.ndarray:
    x, w1, b1, w2, b2 = params
    a1 = layer(w1, b1, ops.tanh, x, colmajor_view(temp_1, 4, 2))
    a2 = layer(w2, b2, ops.sigmoid, a1, colmajor_view(temp_2, 1, 2))
    return a2.numpy()


def main() -> None:
    alloc = blockrt.allocators.create("direct", "cpu")
    params = [blockrt.tensor(p, allocator=alloc) for p in (X, W1, B1, W2, B2)]
    temp = blockrt.empty(8, "float64", allocator=alloc)     # lazy: no memory until first write
    print(f"shared buffer: {temp.shape[0]} doubles, allocated yet? {temp.block.allocated}")

    a1 = colmajor_view(temp, 4, 2)
    a2 = colmajor_view(temp, 1, 2)
    print(f"a1 {a1.shape} strides {a1.strides} and a2 {a2.shape} strides {a2.strides} share "
          f"block #{a1.block.id}; do they overlap? {blockrt.overlaps(a1.layout(), a2.layout())}")

    # 1. The bug: the same two layers on plain NumPy views of one buffer, with the same strides,
    #    and an unchecked GEMM for layer 2.
    buf = np.zeros(8)
    np_a1 = np.lib.stride_tricks.as_strided(buf, (4, 2), (8, 32))
    np_a2 = np.lib.stride_tricks.as_strided(buf, (1, 2), (8, 8))
    np_a1[...] = np.tanh(W1 @ X - B1)
    unchecked_gemm(W2, np_a1, np_a2)
    corrupted = 1.0 / (1.0 + np.exp(-(np_a2 - B2)))
    print(f"1. unchecked GEMM, output over its input:  {np.round(corrupted, 2)}  (wrong)")

    # 2. blockrt's default: the overlap is detected and computed through a temporary.
    blockrt.set_aliasing("copy")
    result = forward(temp, temp, params)
    print(f"2. blockrt, aliasing='copy' (default):      {np.round(result, 2)}")

    # 3. Or refuse loudly.
    blockrt.set_aliasing("raise")
    try:
        forward(temp, temp, params)
    except blockrt.AliasingError as exc:
        print(f"3. blockrt, aliasing='raise':               AliasingError:\n   {exc}")
    finally:
        blockrt.set_aliasing("copy")

    # 4. The article's fix: two buffers, alternated between layers; no copy is needed.
    temp_odd = blockrt.empty(8, "float64", allocator=alloc)
    temp_even = blockrt.empty(2, "float64", allocator=alloc)
    blockrt.set_aliasing("raise")                           # proves nothing overlaps
    result = forward(temp_odd, temp_even, params)
    blockrt.set_aliasing("copy")
    print(f"4. two alternating buffers, no overlap:     {np.round(result, 2)}")

    # Blocks go back to the allocator when their last view goes.
    del a1, a2, temp, temp_odd, temp_even
    stats = alloc.stats()
    print(f"after the buffers go: {stats['allocated_bytes']} B in use, "
          f"{stats['num_allocs']} allocations, {stats['num_frees']} frees")
    for p in params:
        p.release()
    print(f"after the parameters go: {alloc.stats()['allocated_bytes']} B in use")


if __name__ == "__main__":
    main()
