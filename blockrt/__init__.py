"""blockrt: a pluggable memory allocator and runtime for array computing, in one namespace.

`import blockrt` is the way to use it. The namespace holds the runtime's whole public API
(`runtime.__all__`: tensors and views, ops, autograd, `nn`, graphs, constants, DLPack, reports,
errors), the device and allocator entry points that users call (`get_device`, `from_queue`,
`OutOfMemoryError`, ...), and the three layers themselves as `blockrt.runtime`,
`blockrt.backends` and `blockrt.allocators`. Every name is the object the layer packages
define (`blockrt.tensor is runtime.tensor`), so code that imports `runtime`, `allocators` or
`backends` directly mixes with code that imports blockrt. Each module the namespace holds
imports under its blockrt name as that same module, submodules included
(`import blockrt.allocators.interop` is `allocators.interop`; blockrt/_alias.py).

The package also holds the command line (`blockrt.cli`: the `blockrt` console script and
`python -m blockrt`) and the example MLP configurations the command line shares with the
benchmarks (`blockrt.models`); neither is imported here. Importing blockrt imports NumPy and
the three layers, and no optional package (pyopencl, CuPy, matplotlib are imported when a
backend or a plot first needs them).

Example:
    >>> import numpy as np, blockrt
    >>> x = blockrt.tensor(np.ones((4, 2), np.float32))
    >>> float(blockrt.ops.sum(blockrt.ops.add(x, x)).item())
    16.0
    >>> blockrt.get_device("cpu") is x.device
    True
"""

from __future__ import annotations

from blockrt._exit import one_line_on_exit

# NOTE: named, not imported: the import of its module reads BLOCKRT_PURE_PYTHON and may raise it
with one_line_on_exit("backends.accelerated.SettingError"):
    import allocators
import backends
import runtime
from allocators import InvalidFreeError, OutOfMemoryError
from backends import BackendUnavailableError, from_queue, get_device
from blockrt import _alias
from runtime import (
    PLANS,
    AliasingError,
    AutogradError,
    Block,
    BudgetError,
    ConstantPool,
    Graph,
    GraphCaptureError,
    ReadOnlyAllocator,
    ReadOnlyError,
    Tensor,
    UninitializedMemoryError,
    UseAfterFreeError,
    amp,
    constant,
    empty,
    enable_grad,
    format_report,
    from_dlpack,
    get_aliasing,
    get_default_allocator,
    get_default_device,
    get_num_threads,
    graph,
    is_grad_enabled,
    memory_summary,
    nn,
    no_grad,
    ones,
    ops,
    overlaps,
    plot_memory_timeline,
    set_aliasing,
    set_default_allocator,
    set_default_device,
    set_num_threads,
    tensor,
    view,
    zeros,
)

__all__ = [
    # the layers
    "allocators", "backends", "runtime",
    # devices and allocators
    "BackendUnavailableError", "InvalidFreeError", "OutOfMemoryError", "from_queue",
    "get_device",
    # the runtime (runtime.__all__)
    "PLANS", "AliasingError", "AutogradError", "Block", "BudgetError", "ConstantPool", "Graph",
    "GraphCaptureError", "ReadOnlyAllocator", "ReadOnlyError", "Tensor",
    "UninitializedMemoryError", "UseAfterFreeError", "amp", "constant", "empty", "enable_grad",
    "format_report", "from_dlpack", "get_aliasing", "get_default_allocator",
    "get_default_device", "get_num_threads", "graph", "is_grad_enabled", "memory_summary", "nn",
    "no_grad", "ones", "ops", "overlaps", "plot_memory_timeline", "set_aliasing",
    "set_default_allocator", "set_default_device", "set_num_threads", "tensor", "view", "zeros",
]

_alias.register()
