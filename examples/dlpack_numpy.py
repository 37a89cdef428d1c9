"""Share memory between blockrt and NumPy through DLPack: no copies, lifetimes kept.

    python examples/dlpack_numpy.py
"""

from __future__ import annotations

import gc

import numpy as np

import blockrt


def main() -> None:
    alloc = blockrt.allocators.create("caching", "cpu")

    # blockrt -> NumPy: the array is a view of the tensor's block
    t = blockrt.tensor(np.arange(12, dtype=np.float32).reshape(3, 4), allocator=alloc)
    columns = np.from_dlpack(t[:, 1::2])
    columns[0, 0] = 100.0
    print("shared:", t.numpy()[0, 1] == 100.0)

    # The array keeps the block's memory out of the allocator after the tensor goes.
    t.release()
    gc.collect()
    print("still readable after the tensor went:", bool(columns[0, 0] == 100.0),
          f"({alloc.stats()['active_allocations']} allocation live)")
    del columns
    gc.collect()
    print(f"after the array goes: {alloc.stats()['active_allocations']} allocations live")

    # NumPy -> blockrt: a tensor over NumPy's memory, ops write straight into it
    host = np.linspace(-1, 1, 8)
    x = blockrt.from_dlpack(host[::2])
    blockrt.ops.relu(x, out=x)
    print("NumPy sees blockrt's write:", host)


if __name__ == "__main__":
    main()
