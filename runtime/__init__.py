"""The blockrt runtime: Blocks, Tensors and views, aliasing-safe ops.

Example:
    >>> import numpy as np, runtime
    >>> x = runtime.tensor(np.ones((4, 2), np.float32))
    >>> y = runtime.ops.add(x, x)
    >>> float(runtime.ops.sum(y).item())
    16.0
"""

from __future__ import annotations

from runtime import ops
from runtime.aliasing import overlaps
from runtime.block import Block
from runtime.config import get_aliasing, get_default_allocator, set_aliasing, set_default_allocator
from runtime.constant import ConstantPool, constant
from runtime.errors import AliasingError, ReadOnlyError, UninitializedMemoryError, UseAfterFreeError
from runtime.summary import memory_summary
from runtime.tensor import Tensor, empty, ones, tensor, view, zeros

__all__ = ["AliasingError", "Block", "ConstantPool", "ReadOnlyError", "Tensor",
           "UninitializedMemoryError", "UseAfterFreeError", "constant", "empty", "get_aliasing",
           "get_default_allocator", "memory_summary", "ones", "ops", "overlaps", "set_aliasing",
           "set_default_allocator", "tensor", "view", "zeros"]
