"""The blockrt runtime: Blocks, Tensors and views, aliasing-safe ops.

Example:
    >>> import numpy as np, runtime
    >>> x = runtime.tensor(np.ones((4, 2), np.float32))
    >>> y = runtime.ops.add(x, x)
    >>> float(runtime.ops.sum(y).item())
    16.0
"""

from __future__ import annotations

from backends.threads import get_num_threads, set_num_threads
from runtime import amp, nn, ops
from runtime._tensor import Tensor, empty, from_dlpack, ones, tensor, view, zeros
from runtime.aliasing import overlaps
from runtime.autograd import enable_grad, is_grad_enabled, no_grad
from runtime.block import Block
from runtime.config import (
                            get_aliasing,
                            get_default_allocator,
                            get_default_device,
                            set_aliasing,
                            set_default_allocator,
                            set_default_device,
)
from runtime.constant import ConstantPool, ReadOnlyAllocator, constant
from runtime.errors import (
                            AliasingError,
                            AutogradError,
                            GraphCaptureError,
                            ReadOnlyError,
                            UninitializedMemoryError,
                            UseAfterFreeError,
)
from runtime.graph import PLANS, BudgetError, Graph, graph
from runtime.summary import format_report, memory_summary, plot_memory_timeline

__all__ = ["PLANS", "AliasingError", "amp", "AutogradError", "Block", "BudgetError", "ConstantPool",
           "Graph",
           "GraphCaptureError",
           "ReadOnlyAllocator", "ReadOnlyError", "Tensor", "UninitializedMemoryError",
           "UseAfterFreeError", "constant", "empty", "enable_grad", "format_report", "from_dlpack",
           "get_aliasing", "get_default_allocator", "get_default_device", "get_num_threads",
           "graph",
           "is_grad_enabled", "memory_summary", "no_grad", "nn", "ones", "ops", "overlaps",
           "plot_memory_timeline", "set_aliasing", "set_default_allocator", "set_default_device",
           "set_num_threads",
           "tensor", "view", "zeros"]
