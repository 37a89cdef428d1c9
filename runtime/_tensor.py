"""`Tensor`: shape, dtype, strides and offset over a Block; views share the Block.

Strides and offsets count elements (as in PyTorch), not bytes. Every tensor and view holds one
reference to its block; `release()` (or garbage collection) drops it, and any use of a released
tensor, or of a tensor whose block was freed, raises `UseAfterFreeError`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any

import numpy as np

import backends
from allocators import Allocator, format_bytes
from backends import accelerated
from backends.base import ieee
from runtime import aliasing, autograd, config, dlpack, dtypes, tape
from runtime.autograd import Node
from runtime.block import Block
from runtime.errors import AutogradError, UseAfterFreeError, device_names
from runtime.upcalls import OPS  # NOTE: Note [calls up to ops] in runtime/upcalls.py

#: The dtypes a tensor may hold (runtime/dtypes.py). Arithmetic ops accept dtypes.COMPUTE.
DTYPES = dtypes.DTYPES

#: The most bytes one tensor may span: what a 64-bit signed size (NumPy's intp) can count.
MAX_NBYTES = 2**63 - 1
_RELEASED = -1
_UNSET = object()
#: The C extension of the eager fast path, or None (Note [the eager fast path] in
#: runtime/fastpath.py): `_release`, below the class, is its function where it is in use.
_dispatch = accelerated.load("runtime._dispatch")


#: The same dtypes, for a quick membership test.
_SUPPORTED = frozenset(DTYPES)
_INT64 = np.dtype("int64")
_FLOAT64 = np.dtype("float64")


def _prefix(op: str | None) -> str:
    return f"{op}: " if op else ""


def as_dtype(dtype: Any, op: str | None = None) -> np.dtype:
    """Normalise a dtype spec, refusing ones a tensor cannot hold with a TypeError that names
    `op` (when given) and the spec."""
    if isinstance(dtype, np.dtype) and dtype in _SUPPORTED:
        return dtype  # the common case
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise TypeError(f"{_prefix(op)}not a dtype: {_brief(dtype)}") from exc
    if dt not in _SUPPORTED:
        hint = ""
        if dt.byteorder not in "=|" and dt.newbyteorder("=") in _SUPPORTED:
            hint = f" (non-native byte order; tensors are native: use {dt.newbyteorder('=')})"
        raise TypeError(f"{_prefix(op)}dtype {dt} is not supported{hint}; use one of "
                        f"{', '.join(map(str, DTYPES))}")
    return dt


def as_int(value: Any, what: str) -> int:
    """`value` as an int: a Python or NumPy integer, never a bool, a float or a string.

    Raises TypeError naming `what` (e.g. "view(): offset") and the value.
    """
    if value.__class__ is int:
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {_brief(value)} "
                        f"({type(value).__name__})")
    return int(value)


def as_flag(value: Any, what: str) -> bool:
    """`value` as a bool: True, False or a NumPy bool; a TypeError naming `what` for anything
    else (a string such as "no" is truthy, so it is refused rather than guessed)."""
    if value is True or value is False:
        return value
    if isinstance(value, np.bool_):
        return bool(value)
    raise TypeError(f"{what} must be True or False, got {_brief(value)} "
                    f"({type(value).__name__})")


def as_axes(op: str, axis: Any, ndim: int) -> tuple[int, ...] | None:
    """`axis` (None, an int or a tuple/list of ints) as sorted axes in [0, ndim) without
    repeats, or None for all; TypeError/ValueError naming `op` and the axis otherwise."""
    if axis is None:
        return None
    items = axis if isinstance(axis, (tuple, list)) else (axis,)
    axes = []
    for a in items:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, numbers.Integral):
            raise TypeError(f"{op}: axis must be an int or a tuple of ints, got {_brief(axis)}")
        if not -ndim <= a < ndim:
            whole = f" (of {_brief(axis)})" if items is axis else ""
            raise ValueError(f"{op}: axis {a!r}{whole} is out of range for a {ndim}-dimensional "
                             f"tensor")
        axes.append(int(a) % ndim)
    if len(set(axes)) != len(axes):
        raise ValueError(f"{op}: axis {axis!r} repeats an axis")
    return tuple(sorted(axes))


def _dims(shape: Any, op: str | None) -> tuple[int, ...]:
    """`shape` (an int or a sequence of ints) as a tuple of ints of any sign."""
    if isinstance(shape, numbers.Integral) and not isinstance(shape, (bool, np.bool_)):
        return (int(shape),)
    if isinstance(shape, (str, bytes, Mapping, Set)) or not isinstance(shape, Iterable):
        raise TypeError(f"{_prefix(op)}a shape is an int or a sequence of ints, "
                        f"got {_brief(shape)}")
    dims = tuple(shape)
    for n in dims:
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral):
            raise TypeError(f"{_prefix(op)}shape {_brief(shape)} has a non-integer dimension "
                            f"{_brief(n)}")
    return tuple(int(n) for n in dims)


def as_shape(shape: Any, op: str | None = None) -> tuple[int, ...]:
    """Normalise an int or a sequence of ints into a shape, refusing non-ints (TypeError) and
    negative dimensions or ones no array can count, above MAX_NBYTES (ValueError); messages
    name `op` when given."""
    if type(shape) is tuple and all(type(n) is int and 0 <= n <= MAX_NBYTES for n in shape):
        return shape  # the common case, checked cheaply
    dims = _dims(shape, op)
    for n in dims:
        if n < 0:
            raise ValueError(f"{_prefix(op)}shape {_brief(dims)} has a negative dimension {n}")
        if n > MAX_NBYTES:
            raise ValueError(f"{_prefix(op)}shape {_brief(dims)} has dimension {n}, more than "
                             f"the {MAX_NBYTES} elements an axis can count")
    return dims


def _as_strides(strides: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    """The element strides of `Tensor(...)`: one int per dimension, each small enough that its
    byte stride is a 64-bit number."""
    if type(strides) is tuple and len(strides) == len(shape) and all(
            type(s) is int and -MAX_NBYTES <= s * dtype.itemsize <= MAX_NBYTES for s in strides):
        return strides
    if isinstance(strides, (str, bytes, Mapping, Set)) or not isinstance(strides, Iterable):
        raise TypeError(f"Tensor: strides must be a sequence of ints, got {_brief(strides)}")
    steps = tuple(as_int(s, f"Tensor: strides {_brief(strides)}: a stride") for s in strides)
    if len(steps) != len(shape):
        raise ValueError(f"Tensor: strides {_brief(strides)} have {len(steps)} entries for the "
                         f"{len(shape)} dimensions of shape {shape}")
    for s in steps:
        if abs(s) * dtype.itemsize > MAX_NBYTES:
            raise ValueError(f"Tensor: stride {s} of {dtype} is more than the {MAX_NBYTES} "
                             f"bytes a stride can step")
    return steps


def checked_nbytes(shape: tuple[int, ...], dtype: np.dtype, op: str | None = None) -> int:
    """The bytes a C-contiguous tensor of `shape` and `dtype` holds, refusing sizes no device
    can address (more than MAX_NBYTES) with a ValueError naming `op`, the shape, dtype and
    bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_NBYTES:
        raise ValueError(f"{_prefix(op)}shape {shape} of {dtype} needs {nbytes} bytes "
                         f"({format_bytes(nbytes)}), more than the {MAX_NBYTES} bytes a tensor "
                         f"can span")
    return nbytes


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """C-order strides, in elements, for `shape`."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _reshape_strides(shape, strides, new_shape) -> tuple[int, ...] | None:
    """Strides that view (shape, strides) as new_shape in C order, or None if a copy is needed."""
    if 0 in shape:
        return contiguous_strides(new_shape)
    old = [(n, s) for n, s in zip(shape, strides) if n != 1]
    out = [1] * len(new_shape)
    oi = ni = 0
    while oi < len(old) and ni < len(new_shape):
        # Grow a group of old and new dimensions until both hold the same number of elements.
        nsize, osize = new_shape[ni], old[oi][0]
        nj, oj = ni + 1, oi + 1
        while nsize != osize:
            if nsize < osize:
                nsize *= new_shape[nj]
                nj += 1
            else:
                osize *= old[oj][0]
                oj += 1
        # The old dimensions of the group must be laid out as one C-order run.
        for k in range(oi, oj - 1):
            if old[k][1] != old[k + 1][0] * old[k + 1][1]:
                return None
        step = old[oj - 1][1]
        for k in range(nj - 1, ni - 1, -1):
            out[k] = step
            step *= new_shape[k]
        oi, ni = oj, nj
    return tuple(out)


class Tensor:
    """An n-dimensional view over a Block.

    Make tensors with `runtime.tensor`, `runtime.empty`, `runtime.zeros` or `runtime.view`;
    index and reshape them to get views that share the block.

    `Tensor(block, shape, dtype, strides=None, offset=0)` itself checks every argument (a
    Block; a shape of ints; a dtype of DTYPES; one int stride per dimension; an int offset;
    the view inside the block) and raises TypeError/ValueError naming the bad one.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.arange(6.0).reshape(2, 3))
        >>> x[:, ::2].numpy()
        array([[0., 2.],
               [3., 5.]])
        >>> x.T.shape
        (3, 2)
    """

    __slots__ = ("block", "shape", "dtype", "strides", "offset", "_gen", "_layout", "_span",
                 "_self_overlap", "_native", "_requires_grad", "_node", "_grad", "name",
                 "__weakref__")

    def __init__(self, block: Block, shape: Sequence[int], dtype: Any,
                 strides: Sequence[int] | None = None, offset: int = 0) -> None:
        if not isinstance(block, Block):
            raise TypeError(f"Tensor: block must be a runtime Block, got {_brief(block)} "
                            f"({type(block).__name__})")
        shape = as_shape(shape, "Tensor")
        dtype = as_dtype(dtype, "Tensor")  # NOTE: an object dtype over raw bytes would crash
        strides = (contiguous_strides(shape) if strides is None
                   else _as_strides(strides, shape, dtype))
        self._setup(block, shape, dtype, strides, as_int(offset, "Tensor: offset"))

    @classmethod
    def _trusted(cls, block: Block, shape: tuple[int, ...], dtype: np.dtype,
                 strides: tuple[int, ...], offset: int) -> Tensor:
        """A handle from parts that are already valid (a view's: the source's dtype, shape and
        strides made of ints); only the bounds are checked. Views skip `__init__`'s checks."""
        self = cls.__new__(cls)
        self._setup(block, shape, dtype, strides, offset)
        return self

    def _setup(self, block: Block, shape: tuple[int, ...], dtype: np.dtype,
               strides: tuple[int, ...], offset: int) -> None:
        self._requires_grad = False
        #: the autograd record of the op that made it (None for a leaf)
        self._node: Node | None = None
        #: `.grad`'s value (the property checks what is assigned)
        self._grad: Tensor | None = None
        #: for messages (nn names its parameters)
        self.name: str | None = None
        self.block = block
        self.shape = shape
        self.dtype = dtype
        self.strides = strides
        self.offset = offset
        #: (byte offset, shape, byte strides, itemsize), cached
        self._layout: tuple | None = None
        #: aliasing.byte_span(self.layout()), cached (_UNSET until asked for)
        self._span: Any = _UNSET
        #: has_internal_overlap(), cached (None until asked for)
        self._self_overlap: bool | None = None
        #: (allocation, the native view built on it), cached while the allocation lasts
        self._native: tuple | None = None
        self._check_bounds()
        self._gen = block.acquire()

    @classmethod
    def _fresh(cls, shape: tuple[int, ...], dtype: np.dtype, allocator: Allocator) -> Tensor:
        """A contiguous tensor over a new lazy block; arguments already validated (op outputs)."""
        self = cls.__new__(cls)
        self.block = block = Block(math.prod(shape) * dtype.itemsize, allocator)
        self.shape = shape
        self.dtype = dtype
        self.strides = contiguous_strides(shape)
        self.offset = 0
        self._layout = None
        self._span = _UNSET
        self._self_overlap = False  # a fresh contiguous tensor never overlaps itself
        self._native = None
        self._requires_grad = False
        self._node = None
        self._grad = None
        self.name = None
        self._gen = block.acquire()
        return self

    def _check_bounds(self) -> None:
        span = self.byte_span()  # cached, so the ops' overlap checks reuse it
        if span is None or (span[0] >= 0 and span[1] <= self.block.nbytes):
            return
        itemsize = self.dtype.itemsize
        raise ValueError(
            f"Tensor: a view of shape {self.shape}, strides {self.strides} at offset {self.offset} "
            f"reaches elements [{span[0] // itemsize}, {span[1] // itemsize - 1}] but block "
            f"#{self.block.id} holds {self.block.nbytes // itemsize} elements of {self.dtype}")

    # ------------------------------------------------------------------ properties
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def device(self) -> backends.Device:
        return self.block.device

    @property
    def version(self) -> int:
        """Moves on at every write to the block, through this tensor or any view."""
        return self.block.version

    @property
    def released(self) -> bool:
        return self._gen == _RELEASED

    # ------------------------------------------------------------------ autograd
    @property
    def requires_grad(self) -> bool:
        """True when gradients flow to (a leaf) or through (an op result) this tensor."""
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        flag = as_flag(flag, "requires_grad")
        if self._node is not None and not flag:
            raise AutogradError(f"requires_grad can only be turned off on a leaf; this tensor "
                                f"is the result of {self._node.op}: use detach()")
        if flag and not dtypes.is_float(self.dtype):
            raise AutogradError(f"only float tensors can require gradients, not {self.dtype}")
        self._requires_grad = flag

    def requires_grad_(self, flag: bool = True) -> Tensor:
        """Set requires_grad in place and return self."""
        self.requires_grad = flag
        return self

    @property
    def grad(self) -> Tensor | None:
        """The gradient `backward()` accumulated into this leaf (None until then, and after
        `zero_grad()`); an optimizer reads it."""
        return self._grad

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        # NOTE: PyTorch's rule (THPVariable_set_grad): a gradient has its tensor's shape, dtype
        # and device, so that no optimizer broadcasts, converts or moves one silently
        if value is not None:
            self._check_grad(value)
        self._grad = value

    def _check_grad(self, value: Any) -> None:
        """TypeError / ValueError unless `value` can be this tensor's `.grad`: a Tensor of its
        shape, dtype and device (PyTorch refuses the same)."""
        if not isinstance(value, Tensor):
            raise TypeError(f"grad: assigned grad must be a Tensor or None, got "
                            f"{type(value).__name__} {_brief(value)}")
        if value.shape != self.shape:
            raise ValueError(f"grad: attempting to assign a gradient of shape {value.shape} to a "
                             f"tensor of shape {self.shape}; the gradient and the tensor must "
                             f"have the same shape")
        if value.dtype != self.dtype:
            raise TypeError(f"grad: attempting to assign a gradient of dtype {value.dtype} to a "
                            f"tensor of dtype {self.dtype}; cast it first "
                            f"(runtime.ops.cast(grad, {str(self.dtype)!r}))")
        if value.block.device is not self.block.device:
            theirs, ours = device_names(value.device, self.device)
            raise ValueError(f"grad: attempting to assign a gradient on {theirs} to a tensor on "
                             f"{ours}; copy it over first")

    @property
    def is_leaf(self) -> bool:
        """True unless this tensor is the recorded result of an op."""
        return self._node is None

    @property
    def grad_fn(self) -> Node | None:
        """The autograd record of the op that made this tensor (None for leaves)."""
        return self._node

    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) into the `.grad` of every leaf that requires a gradient;
        see `runtime.autograd`. Without `gradient`, this tensor must have one element; with it,
        `gradient` has its shape and dtype (and is copied: the pass accumulates in place).

        Raises:
            AutogradError: this tensor needs no gradient; no `gradient` for more than one
                element, or one of another shape or dtype; a saved tensor modified in place; a
                second backward through a freed graph.
            TypeError: `gradient` is not a Tensor, or `retain_graph` not a bool.
        """
        if retain_graph is not False:
            retain_graph = as_flag(retain_graph, "backward(): retain_graph")
        if gradient is not None and not isinstance(gradient, Tensor):
            raise TypeError(f"backward(): gradient must be a Tensor or None, got "
                            f"{type(gradient).__name__} {_brief(gradient)}")
        if not self._requires_grad:
            raise AutogradError(f"backward() on a tensor that does not require grad "
                                f"({autograd.describe(self)}); set requires_grad=True on a "
                                f"leaf it uses")
        if gradient is None:
            if self.size != 1:
                raise AutogradError(f"backward() without a gradient needs a scalar (one "
                                    f"element) output, this one has shape {self.shape}; pass "
                                    f"gradient=")
            gradient = _ones_like(self)
        elif gradient.shape != self.shape or gradient.dtype != self.dtype:
            raise AutogradError(f"backward(): gradient has shape {gradient.shape} and dtype "
                                f"{gradient.dtype}; the output has shape {self.shape} and "
                                f"dtype {self.dtype}")
        else:
            with autograd.no_grad():
                gradient = OPS.copy(gradient)
        autograd.backward(self, gradient, retain_graph)

    def detach(self) -> Tensor:
        """A new handle on the same memory, outside the graph (requires no gradient)."""
        self._check("detach()")
        # NOTE: the same layout, already checked: its caches come along, no bounds check
        # (autograd detaches every tensor it saves)
        handle = Tensor.__new__(Tensor)
        handle.block = self.block
        handle.shape = self.shape
        handle.dtype = self.dtype
        handle.strides = self.strides
        handle.offset = self.offset
        handle._layout = self._layout
        handle._span = self._span
        handle._self_overlap = self._self_overlap
        handle._native = self._native
        handle._requires_grad = False
        handle._node = None
        handle._grad = None
        handle.name = None
        handle._gen = self.block.acquire()
        return handle

    def _record_view(self, view: Tensor, op: str, backward_fn: Any) -> Tensor:
        # NOTE: backward_fn holds no tensor, not even self: Note [closures hold no tensors] in
        # runtime/autograd.py
        if self._requires_grad and autograd.is_grad_enabled():
            autograd.record(op, view, (self,), ("x",), backward_fn)
        return view

    def is_contiguous(self) -> bool:
        """True when the elements lie in C order with no gaps."""
        return self.size == 0 or all(
            s == c for n, s, c in zip(self.shape, self.strides, contiguous_strides(self.shape))
            if n != 1)

    def layout(self, shape: Sequence[int] | None = None) -> tuple:
        """(byte offset, shape, byte strides, itemsize), broadcast to `shape` if given."""
        layout = self._layout
        if layout is None:
            item = self.dtype.itemsize
            layout = self._layout = (self.offset * item, self.shape,
                                     tuple(s * item for s in self.strides), item)
        if shape is None or shape == self.shape:
            return layout
        shape = tuple(shape)
        lead = len(shape) - self.ndim
        strides = [0] * lead
        for n, s, target in zip(self.shape, layout[2], shape[lead:]):
            strides.append(s if n == target else 0)
        return layout[0], shape, tuple(strides), layout[3]

    def byte_span(self) -> tuple[int, int] | None:
        """[first, last + 1) bytes of the block this tensor touches; None when it is empty."""
        span = self._span
        if span is _UNSET:
            span = self._span = aliasing.byte_span(self.layout())
        return span

    def has_internal_overlap(self) -> bool:
        """True when two indices of this tensor may share a byte (then it cannot be written)."""
        flag = self._self_overlap
        if flag is None:
            flag = self._self_overlap = aliasing.has_internal_overlap(self.layout())
        return flag

    # ------------------------------------------------------------------ handle lifetime
    def _check(self, what: str = "tensor") -> None:
        if self._gen == _RELEASED:
            raise UseAfterFreeError(f"{what}: the tensor was released and can no longer be used "
                                    f"(shape {self.shape}, block #{self.block.id})")
        self.block.check(self._gen, what)

    def release(self) -> None:
        """Drop this handle's reference now; the memory goes back when no handle is left.

        Any later use of this tensor raises UseAfterFreeError. Releasing twice is harmless.
        """
        gen, self._gen = self._gen, _RELEASED
        self._native = None  # NOTE: a cached native view would keep the freed memory alive
        if gen != _RELEASED:
            self.block.release(gen)

    def __del__(self) -> None:
        try:
            _release(self)
        except Exception:
            pass

    # ------------------------------------------------------------------ native views (for ops)
    def _native_read(self, what: str, shape: Sequence[int] | None = None) -> Any:
        self._check(what)
        allocation = self.block.memory_for_read(what)
        if shape is None or shape == self.shape:
            return self._native_on(allocation)
        offset, shape, strides, _ = self.layout(shape)
        return self.device._array_view(allocation.raw, allocation.offset + offset, shape,
                                       self.dtype, strides)

    def _native_write(self, what: str) -> Any:
        self._check(what)
        return self._native_on(self.block.memory_for_write(what))

    def _native_on(self, allocation: Any) -> Any:
        """The native view of this tensor over `allocation`, cached while the allocation lasts."""
        cached = self._native
        if cached is not None and cached[0] is allocation:
            return cached[1]
        offset, shape, strides, _ = self.layout()
        native = self.device._array_view(allocation.raw, allocation.offset + offset, shape,
                                         self.dtype, strides)
        self._native = (allocation, native)
        return native

    # ------------------------------------------------------------------ views
    def _view(self, shape, strides, offset) -> Tensor:
        self._check("view source")
        return Tensor._trusted(self.block, shape, self.dtype, strides, offset)

    def __getitem__(self, key: Any) -> Tensor:
        """Basic indexing: ints, slices (any step, negative too), Ellipsis and None. A view."""
        if not isinstance(key, tuple):
            key = (key,)
        ellipses = sum(1 for k in key if k is Ellipsis)  # NOTE: `in` would compare arrays
        if ellipses > 1:
            raise IndexError("an index can only have a single ellipsis ('...')")
        consumed = sum(1 for k in key if k is not None and k is not Ellipsis)
        if consumed > self.ndim:
            raise IndexError(f"too many indices: tensor is {self.ndim}-dimensional, "
                             f"but {consumed} were indexed")
        if not ellipses:
            key = key + (Ellipsis,)
        shape: list[int] = []
        strides: list[int] = []
        offset = self.offset
        dim = 0
        for k in key:
            if k is None:
                shape.append(1)
                strides.append(0)
            elif k is Ellipsis:
                for _ in range(self.ndim - consumed):
                    shape.append(self.shape[dim])
                    strides.append(self.strides[dim])
                    dim += 1
            elif isinstance(k, slice):
                try:
                    start, stop, step = k.indices(self.shape[dim])
                except (TypeError, ValueError) as exc:  # float bounds, step 0
                    raise type(exc)(f"index: bad slice {_brief(k)} for axis {dim}: {exc}"
                                    ) from None
                shape.append(len(range(start, stop, step)))
                strides.append(self.strides[dim] * step)
                offset += start * self.strides[dim]
                dim += 1
            elif isinstance(k, numbers.Integral) and not isinstance(k, bool):
                k = int(k)  # NOTE: a NumPy integer would make the offset one
                n = self.shape[dim]
                if not -n <= k < n:
                    raise IndexError(f"index {k} is out of bounds for axis {dim} with size {n}")
                offset += (k % n) * self.strides[dim]
                dim += 1
            else:
                raise TypeError(f"unsupported index {k!r}: tensors take ints, slices, None and "
                                f"'...'; copy out with .numpy() for advanced indexing")
        if 0 in shape:
            offset = self.offset  # NOTE: an empty view may not point past its block
        view = self._view(tuple(shape), tuple(strides), offset)
        return self._record_view(view, "getitem", _scatter_backward(self, view))

    def __setitem__(self, key: Any, value: Any) -> None:
        """Write `value` (a tensor, array or number, broadcast) into the view `self[key]`."""
        if autograd.needs_grad(self, value):
            raise AutogradError(
                f"item assignment is not recorded by autograd, and this one involves a tensor "
                f"that requires grad (target shape {self.shape}); assign under "
                f"runtime.no_grad(), or build the result with ops")
        target = self[key]
        try:
            if not isinstance(value, Tensor):
                host = host_array(value, self.dtype, "value to assign to a tensor")
                value = tensor(host, device=self.device, allocator=self.block.allocator)
            OPS.copy(value, out=target)
        finally:
            target.release()

    @property
    def T(self) -> Tensor:
        """The transpose: axes reversed. A view."""
        view = self._view(self.shape[::-1], self.strides[::-1], self.offset)
        return self._record_view(view, "transpose", lambda g: (g.T,))

    def transpose(self, *axes: int) -> Tensor:
        """Permute the axes (reversed when none are given). A view."""
        if not axes:
            return self.T
        if len(axes) == 1 and not isinstance(axes[0], numbers.Integral):
            if not isinstance(axes[0], (tuple, list)):
                raise TypeError(f"transpose: axes are ints, or one tuple or list of ints; got "
                                f"{_brief(axes[0])}")
            axes = tuple(axes[0])
        ndim = self.ndim
        given = tuple(as_int(a, f"transpose: axes {_brief(axes)}: an axis") for a in axes)
        if sorted(a % ndim if -ndim <= a < ndim else a for a in given) != list(range(ndim)):
            raise ValueError(f"transpose: axes {_brief(axes)} are not a permutation of the "
                             f"{ndim} axes")
        axes = tuple(a % ndim for a in given)
        view = self._view(tuple(self.shape[a] for a in axes),
                          tuple(self.strides[a] for a in axes), self.offset)
        inverse = tuple(sorted(range(len(axes)), key=axes.__getitem__))
        return self._record_view(view, "transpose", lambda g: (g.transpose(inverse),))

    def reshape(self, *shape: Any) -> Tensor:
        """The same elements in C order under a new shape (one -1 is inferred).

        A view when the strides allow it, as in NumPy; otherwise a contiguous copy.
        """
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = shape[0]
        new_shape = _infer_shape(shape, self.size, self.shape)
        strides = _reshape_strides(self.shape, self.strides, new_shape)
        if strides is not None:
            view = self._view(new_shape, strides, self.offset)
        else:
            with autograd.no_grad():
                flat = OPS.copy(self)
            view = flat._view(new_shape, contiguous_strides(new_shape), flat.offset)
            flat.release()
        old_shape = self.shape
        return self._record_view(view, "reshape", lambda g: (g.reshape(old_shape),))

    # ------------------------------------------------------------------ host access
    def numpy(self) -> np.ndarray:
        """A new host numpy array with this tensor's data (a copy)."""
        tape.refuse_read("numpy()")
        return self.device.to_host(self._native_read("numpy()"))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        array = self.numpy()
        return array if dtype is None else array.astype(dtype, copy=False)

    # ------------------------------------------------------------------ queues
    def record_queue(self, queue: Any) -> None:
        """Note that this tensor's memory is used on `queue` as well as on its device's own
        queue (PyTorch's `Tensor.record_stream`), e.g. by a framework's kernel on its native
        view: when the memory goes back to its allocator, it is handed out again only after an
        event on `queue` says that what was queued there by then has run, so the memory's next
        user cannot meet a late write (`Allocator.record_queue`).

        Raises:
            UseAfterFreeError: the tensor's memory was freed.
            ValueError: the block has no memory yet (write it first) or is imported memory,
                which blockrt never reuses.
            TypeError, ValueError: see `Allocator.record_queue` (the CPU has no queues; a queue
                of another context).
        """
        self._check("record_queue")
        allocation = self.block._allocation
        if allocation is None:
            raise ValueError(f"record_queue: block #{self.block.id} has no memory yet (blocks "
                             f"allocate on first write); write the tensor first")
        if allocation.owner is None:
            raise ValueError(f"record_queue: block #{self.block.id} is memory imported from "
                             f"another library, which blockrt never reuses; its owner orders "
                             f"its reuse")
        allocation.owner.record_queue(allocation, queue)

    # ------------------------------------------------------------------ DLPack
    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """A DLPack capsule over this tensor's memory, without a copy (`np.from_dlpack(t)`).

        The consumer's array keeps the block's memory alive after this handle is released; see
        `runtime.dlpack`. Raises BufferError for devices DLPack cannot exchange (OpenCL).
        """
        return dlpack.export(self, stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """(DLPack device type, index): (1, 0) on the CPU, (2, i) on cuda:i, (4, i) on opencl:i."""
        return dlpack.dlpack_device(self.device)

    def item(self) -> float | int | bool:
        """The single element of a size-1 tensor as a Python number."""
        if self.size != 1:
            raise ValueError(f"item() needs a tensor of one element, this one has {self.size} "
                             f"(shape {self.shape})")
        return self.numpy().reshape(()).item()

    def tolist(self) -> Any:
        return self.numpy().tolist()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        head = f"shape={self.shape}, dtype={self.dtype}, device={self.device.name}"
        if self._gen == _RELEASED or self._gen != self.block.generation:
            return f"Tensor(<freed>, {head})"
        if not self.block.written:
            return f"Tensor(<unwritten>, {head})"
        if self.size > 64:
            return f"Tensor({head}, block=#{self.block.id})"
        body = np.array2string(self.numpy(), separator=", ", prefix="Tensor(")
        return f"Tensor({body}, {head})"

    # ------------------------------------------------------------------ operators
    def __add__(self, other: Any) -> Tensor:
        return OPS.add(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return OPS.add(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return OPS.sub(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return OPS.sub(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return OPS.mul(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return OPS.mul(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return OPS.div(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return OPS.div(other, self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return OPS.matmul(self, other)

    def __neg__(self) -> Tensor:
        return OPS.neg(self)


def _infer_shape(shape: Any, size: int, old_shape: tuple) -> tuple[int, ...]:
    """reshape's target: `shape` with its one -1 inferred from `size`."""
    dims = list(_dims(shape, "reshape"))
    for n in dims:
        if n < -1:
            raise ValueError(f"reshape: shape {tuple(dims)} has a negative dimension {n}")
    unknown = [i for i, n in enumerate(dims) if n == -1]
    if len(unknown) > 1:
        raise ValueError(f"reshape: can only infer one dimension of {tuple(dims)}")
    if unknown:
        known = math.prod(n for i, n in enumerate(dims) if i != unknown[0])
        if known == 0 or size % known:
            raise ValueError(f"reshape: cannot reshape {size} elements {old_shape} into "
                             f"{tuple(dims)}")
        dims[unknown[0]] = size // known
    new_shape = as_shape(tuple(dims), "reshape")
    if math.prod(new_shape) != size:
        raise ValueError(f"reshape: cannot reshape {size} elements {old_shape} into "
                         f"{new_shape} ({math.prod(new_shape)} elements)")
    return new_shape


#: What `Tensor.__del__` calls: `Tensor.release`, or its C version where the eager fast path is
#: in use (which hands back to `Tensor.release` what it does not take, and everything while the
#: fast path is off).
_release = Tensor.release if _dispatch is None else _dispatch.release


# ---------------------------------------------------------------------- factories
def _allocator_for(device: Any, allocator: Allocator | None) -> Allocator:
    if allocator is None:
        return config.get_default_allocator(device)
    if not isinstance(allocator, Allocator):
        raise TypeError(f"allocator must be an allocators.Allocator, "
                        f"got {type(allocator).__name__} {_brief(allocator)}")
    check_device_of(allocator, device)
    return allocator


def check_device_of(allocator: Allocator, device: Any) -> None:
    """ValueError naming both unless `device` (a spec or a Device; None: any) is the device of
    `allocator`."""
    dev = backends.get_device(device) if device is not None else allocator.device
    if dev is not allocator.device:
        where, wanted = device_names(allocator.device, dev)
        raise ValueError(f"allocator {allocator!r} is on {where}, but device {wanted} was "
                         f"asked for")


#: What data of a dtype tensors do not hold becomes when no dtype is asked for, by kind.
_DEFAULT_OF_KIND = {"b": np.dtype(bool), "i": _INT64, "u": _INT64, "f": _FLOAT64}
#: Every integer of at most this magnitude is exact in float64.
_EXACT_IN_FLOAT64 = 2**53


def host_array(data: Any, dtype: Any = None, what: str = "tensor") -> np.ndarray:
    """`data` (array-like or Tensor) as a C-contiguous host array of a dtype tensors hold:
    what `runtime.tensor(data, dtype)` holds, exactly. Never changes a value silently.

    Without `dtype`, data of a dtype in DTYPES keeps it (a non-native byte order is swapped);
    other data converts only where every value survives exactly: other integers (Python's,
    NumPy's long long) become int64, other floats float64 (a longdouble must hold float64
    values).

    With `dtype`, a float dtype rounds to nearest (its meaning) but never turns a finite value
    into an infinity; an integer or bool dtype takes only whole values in its range (no
    wrapping, no truncation, no NaN), as `torch.tensor` refuses overflow.

    Raises:
        TypeError: data no tensor can hold (complex, strings, objects), or a bad dtype.
        ValueError: ragged data, or a value the conversion would change; the message names
            `what`, the dtype, the value and the way out.
    """
    if (data.__class__ is np.ndarray and (dtype is None or dtype is data.dtype)
            and data.dtype in _SUPPORTED and data.flags.c_contiguous):
        return data  # the common case (a graph's replay path): nothing to convert
    if isinstance(data, Tensor):
        data = data.numpy()
    target = None if dtype is None else as_dtype(dtype, what)
    host = _infer(data, target, what)
    exact = target is None
    if exact:
        target = _implicit_dtype(host.dtype, what)
    if host.dtype != target:
        host = _convert(host, target, what, exact)
    return np.require(host, requirements="C")  # NOTE: ascontiguousarray would make 0-d 1-d


def _infer(data: Any, target: np.dtype | None, what: str) -> np.ndarray:
    """`data` as an array of the dtype NumPy infers, refused unless it holds real numbers, and
    checked where NumPy's inference itself rounded a Python integer."""
    of = "" if target is None else f" of {target}"
    try:
        host = np.asarray(data)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged lists, odd array-likes
        error = TypeError if isinstance(exc, TypeError) else ValueError
        raise error(f"cannot make a {what}{of} from {type(data).__name__} {_brief(data)}: "
                    f"{exc}") from exc
    kind = dtypes.kind(host.dtype)
    if kind == "O" and not isinstance(data, np.ndarray):  # Python ints beyond 64 bits
        return _from_objects(host, target, what)
    if kind not in "biuf":
        raise TypeError(f"cannot make a {what}{of} from data of dtype {host.dtype} "
                        f"({type(data).__name__} {_brief(data)}): tensors hold real numbers "
                        f"({', '.join(map(str, DTYPES))})")
    if kind == "f" and not isinstance(data, (np.ndarray, np.generic)) and (
            target is None or dtypes.kind(target) != "f"):
        # NOTE: NumPy makes float64 of [-1, 2**64 - 1] or [0.5, 2**60 + 1], rounding the int
        _check_inferred_ints(data, host, target, what)
    return host


def _from_objects(host: np.ndarray, target: np.dtype | None, what: str) -> np.ndarray:
    """The object array NumPy made of Python data (integers too large for any NumPy integer)
    converted exactly to `target`, or refused naming the first number that does not fit."""
    of = "" if target is None else f" of {target}"
    values = host.ravel().tolist()
    for v in values:
        if not isinstance(v, (int, float, np.integer, np.floating)):  # bool is an int
            raise TypeError(f"cannot make a {what}{of} from data of dtype object: "
                            f"{_brief(v)} ({type(v).__name__}) is not an int or a float")
    to_float = target is not None and dtypes.is_float(target)
    if to_float or any(isinstance(v, (float, np.floating)) for v in values):
        floats = []
        for v in values:
            try:
                floats.append(float(v))
            except OverflowError:
                raise ValueError(f"cannot make a {what}{of}: the integer {_brief(v)} is beyond "
                                 f"the largest float64, {np.finfo(_FLOAT64).max}; scale it "
                                 f"down first") from None
        result = np.array(floats, _FLOAT64).reshape(host.shape)
        if not to_float:  # as NumPy would have made float64 of it, had the ints fit
            _check_inferred_ints(values, result, target, what)
        return result
    dtype = target or _INT64
    low, high = (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min),
                                                  int(np.iinfo(dtype).max))
    bad = next((v for v in values if not low <= v <= high), None)
    if bad is None:
        raise TypeError(f"cannot make a {what}{of} from data of dtype object: NumPy finds no "
                        f"one dtype for {_brief(values)}")
    raise ValueError(f"cannot make a {what} of {dtype}: the integer {_brief(bad)} is outside "
                     f"the range of {dtype}, [{low}, {high}]; pass dtype='float64' to round "
                     f"it to a float")


def _check_inferred_ints(data: Any, host: np.ndarray, target: np.dtype | None,
                         what: str) -> None:
    """ValueError when a Python or NumPy integer in `data` is not exactly its float in `host`
    (NumPy inferred a float dtype and rounded it)."""
    if not (abs(host) >= _EXACT_IN_FLOAT64).any():
        return  # NOTE: a rounded integer lies beyond 2**53; most float data has none (fast)
    try:
        objects = np.asarray(data, dtype=object)
    except (TypeError, ValueError):
        return
    if objects.shape != host.shape:
        return
    floats = host.ravel()
    for i, v in enumerate(objects.ravel().tolist()):
        if v.__class__ is float or not isinstance(v, (int, np.integer)) or isinstance(v, bool):
            continue
        if not -_EXACT_IN_FLOAT64 <= v <= _EXACT_IN_FLOAT64 and int(floats[i]) != v:
            of = "" if target is None else f" of {target}"
            raise ValueError(
                f"cannot make a {what}{of}: the integer {_brief(v)} sits among floats (or "
                f"integers of both signs beyond int64), so NumPy made {host.dtype} of it and "
                f"rounded it to {floats[i].item()!r}; pass dtype='float64' to accept the "
                f"rounding, or give the integers alone an integer dtype")


def _implicit_dtype(src: np.dtype, what: str) -> np.dtype:
    """The dtype a tensor holds for data of dtype `src` when no dtype is asked for."""
    if src in _SUPPORTED:
        return src
    native = src.newbyteorder("=")
    if native in _SUPPORTED:
        return native
    return _DEFAULT_OF_KIND[src.kind]


def _convert(host: np.ndarray, target: np.dtype, what: str, exact: bool) -> np.ndarray:
    """`host` as `target` under host_array's rules, or a ValueError naming the first value
    the conversion would change (`exact`: no rounding either, for conversions nobody asked
    for)."""
    src = host.dtype
    if np.can_cast(src, target, "safe"):
        return host.astype(target)  # every value of src is exact in target
    src_kind, target_kind = dtypes.kind(src), dtypes.kind(target)
    if src_kind in "iu" and target_kind in "iu":
        if host.size:
            low, high = int(host.min()), int(host.max())
            info = np.iinfo(target)
            if low < info.min or high > info.max:
                _refuse(what, src, target, low if low < info.min else high, exact)
        return host.astype(target)
    out = ieee(host.astype, target)  # NOTE: checked below; NumPy's cast warnings say less
    if target_kind != "f":
        lost = out != host  # NaN, infinities, fractions and out-of-range values differ
    elif not exact:
        lost = np.isfinite(host) & ~np.isfinite(out)  # e.g. 70000 as float16, 2**128 bfloat16
    else:
        lost = (out != host) & ~(np.isnan(out) & np.isnan(host))
    if lost.any():
        _refuse(what, src, target, host.ravel()[int(np.argmax(lost.ravel()))], exact)
    return out


def _refuse(what: str, src: np.dtype, target: np.dtype, value: Any, exact: bool) -> None:
    """Raise the ValueError of a conversion that would change `value`: what, why, the way out."""
    if isinstance(value, np.generic) and value.dtype.itemsize <= 8:
        value = value.item()  # NOTE: compared below with Python ints, without NumPy's casts
    text = str(value) if isinstance(value, np.generic) else repr(value)  # a longdouble: str
    target_kind = dtypes.kind(target)
    if target_kind in "iub":
        if value != value or value in (math.inf, -math.inf):
            reason, fix = f"{text} has no {target} value", "replace it first (np.nan_to_num)"
        elif target_kind == "b":
            reason, fix = f"{text} is neither 0 nor 1", "compare it first (data != 0)"
        elif not np.iinfo(target).min <= value <= np.iinfo(target).max:
            low, high = np.iinfo(target).min, np.iinfo(target).max
            reason = f"{text} is outside the range of {target}, [{low}, {high}]"
            fix = ("pass dtype='float64' to round it to a float" if exact else
                   "pick a dtype that holds it, or clip it first (np.clip)")
        else:
            reason = f"{text} is not a whole number"
            fix = "round it first (np.round, np.trunc) if that is what you mean"
    elif exact:
        reason, fix = f"{text} has no exact {target} value", f"pass dtype='{target}' to round it"
    else:
        reason = f"{text} is beyond the largest {target}, {dtypes.finfo(target).max}"
        fix = "use float64" if target.itemsize < 8 else "scale it down first"
    raise ValueError(f"cannot make a {what} of {target} from {src} data: {reason} (tensors "
                     f"never change a value silently); {fix}")


def _brief(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters for a message."""
    try:
        text = repr(value)
    except Exception:  # NOTE: a message must not fail (NumPy cannot print some datetimes)
        text = f"<a {type(value).__name__} that has no repr>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def empty(shape: Any, dtype: Any = "float32", device: Any = None,
          allocator: Allocator | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of `shape` whose block holds no memory until first written (lazy).

    Raises:
        TypeError: the shape is not an int or a sequence of ints, or the dtype is not one of
            DTYPES.
        ValueError: a dimension is negative, or the tensor would span more than MAX_NBYTES.
    """
    return _empty("empty", shape, dtype, device, allocator, requires_grad)


def _empty(op: str, shape: Any, dtype: Any, device: Any, allocator: Allocator | None,
           requires_grad: Any) -> Tensor:
    """empty(), with messages that name `op` (the factory the caller called)."""
    shape = as_shape(shape, op)
    dt = as_dtype(dtype, op)
    requires_grad = as_flag(requires_grad, f"{op}: requires_grad")
    nbytes = checked_nbytes(shape, dt, op)
    alloc = _allocator_for(device, allocator)
    out = Tensor(Block(nbytes, alloc), shape, dt)
    if requires_grad:
        out.requires_grad = True
    return out


def tensor(data: Any, dtype: Any = None, device: Any = None,
           allocator: Allocator | None = None, requires_grad: bool = False) -> Tensor:
    """A new tensor holding a copy of `data` (array-like, or a Tensor) on `device`.

    With `requires_grad=True` it is a leaf of autograd: `backward()` fills its `.grad`.

    Example:
        >>> import numpy as np, runtime
        >>> runtime.tensor(np.ones((2, 2), np.float32)).shape
        (2, 2)
    """
    host = host_array(data, dtype, "tensor")
    out = _empty("tensor", host.shape, host.dtype, device, allocator, requires_grad)
    return _write(out, host, "runtime.tensor")


def from_dlpack(obj: Any, allocator: Allocator | None = None) -> Tensor:
    """A Tensor over the memory of `obj` (anything with `__dlpack__`), without a copy.

    The tensor keeps `obj`'s memory alive as long as any handle on it lives; writes on either
    side are seen on the other. `allocator` (default: the device's default allocator) serves the
    results of ops on the tensor. A blockrt Tensor gives a new handle on its own block. See
    `runtime.dlpack`.

    Raises:
        TypeError: `obj` has no `__dlpack__`, or its elements are of a type no tensor holds
            (float8, float6 and float4, complex, vectors), named before anything is shared.
            float16 and bfloat16 (DLPack's kDLBfloat, which NumPy cannot take itself) are
            held: Note [bfloat16 through DLPack] in runtime/dlpack.py.
        BufferError: its memory is on a device blockrt cannot use through DLPack.
        BackendUnavailableError: its memory is on CUDA and the CUDA backend is unavailable.

    Example:
        >>> import numpy as np, runtime
        >>> runtime.from_dlpack(np.ones((2, 3), np.float32)[:, ::2]).strides
        (3, 2)
    """
    if isinstance(obj, Tensor):
        return obj.detach()
    device, native, address, memory = dlpack.take(obj)
    dtype = as_dtype(native.dtype)
    block, strides, offset = dlpack.foreign_view(
        device, native, dtype, address, memory, lambda dev: _allocator_for(dev, allocator))
    return Tensor(block, native.shape, dtype, strides, offset)


def _ones_like(t: Tensor) -> Tensor:
    """A new tensor of ones of t's shape and dtype on t's allocator: the gradient that
    `backward()` starts from (`tensor(np.ones(...))`, without checking what is known good)."""
    out = Tensor._fresh(t.shape, t.dtype, t.block.allocator)
    return _write(out, np.ones(t.shape, t.dtype), "backward()")


def _fill(out: Tensor, value: float) -> None:
    """Write `value` into every element of `out` on its device: a 0-d tensor of it broadcast by
    `copy`, so a graph records a one-item load and a fill, never a host array of out's size
    (which it would copy at every replay, and hold)."""
    fill = tensor(np.full((), value, out.dtype), device=out.device,
                  allocator=out.block.allocator)
    OPS.copy(fill, out=out)
    fill.release()


def _write(out: Tensor, host: np.ndarray, what: str) -> Tensor:
    """Copy `host` (of out's shape and dtype) into the new tensor `out`; return `out`."""
    recorder = tape.active()
    if recorder is not None:  # inside a graph capture: a recorded load, run at replay
        recorder.load(out, host)
        return out
    allocation = out.block.memory_for_write(what)
    out.device.copyin(allocation.raw, allocation.offset, host)
    out.block.mark_written()
    return out


def zeros(shape: Any, dtype: Any = "float32", device: Any = None,
          allocator: Allocator | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of `shape` filled with zeros."""
    return _filled("zeros", 0, shape, dtype, device, allocator, requires_grad)


def ones(shape: Any, dtype: Any = "float32", device: Any = None,
         allocator: Allocator | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of `shape` filled with ones."""
    return _filled("ones", 1, shape, dtype, device, allocator, requires_grad)


def _filled(op: str, value: int, shape: Any, dtype: Any, device: Any,
            allocator: Allocator | None, requires_grad: Any) -> Tensor:
    """zeros() and ones(): every argument checked (naming `op`) before NumPy fills a host
    array, whose errors would name neither."""
    out = _empty(op, shape, dtype, device, allocator, requires_grad)
    return _write(out, np.full(out.shape, value, out.dtype), f"runtime.{op}")


def view(source: Tensor, shape: Any, offset: int = 0) -> Tensor:
    """A C-order view of `shape` over the memory of `source`, starting `offset` elements in.

    This is Neanderthal's view-ge: one buffer, many matrices over it. `source` must be
    contiguous, and the view must fit inside it.

    Example:
        >>> import runtime
        >>> buf = runtime.zeros(8, "float64")
        >>> runtime.view(buf, (4, 2)).shape, runtime.view(buf, (1, 2), offset=6).shape
        ((4, 2), (1, 2))
    """
    if not isinstance(source, Tensor):
        raise TypeError(f"view() needs a Tensor source, got {type(source).__name__} "
                        f"{_brief(source)}")
    shape = as_shape(shape, "view()")
    offset = as_int(offset, "view(): offset counts elements and")
    if not source.is_contiguous():
        raise ValueError(f"view() needs a contiguous source; this one has shape {source.shape} "
                         f"and strides {source.strides}")
    need = math.prod(shape)
    if offset < 0 or offset + need > source.size:
        raise ValueError(f"view(): a view of {need} elements {shape} at offset {offset} does "
                         f"not fit in a source of {source.size} elements")
    result = source._view(shape, contiguous_strides(shape), source.offset + offset)
    return source._record_view(result, "view", _scatter_backward(source, result))


def _scatter_backward(base: Tensor, view: Tensor) -> Any:
    """The backward of a view that picks some elements of `base`: the gradient of the view,
    written into zeros shaped like `base` at the view's elements (a view never repeats an
    element, so writing is summing)."""
    if not base._requires_grad or not autograd.is_grad_enabled():
        return None
    # NOTE: plain values only, never `base` or `view`: Note [closures hold no tensors] in
    # runtime/autograd.py
    shape, strides, offset = view.shape, view.strides, view.offset
    base_shape, base_strides, base_offset = base.shape, base.strides, base.offset
    nbytes = base.block.nbytes

    def backward(g: Tensor) -> tuple[Tensor]:
        # a zeroed copy of the whole block, seen through base's and the view's layouts (a
        # fill on the device: `zeros` would load a host array of the block's size)
        whole = Tensor._fresh((nbytes // g.dtype.itemsize,), g.dtype, g.block.allocator)
        _fill(whole, 0)
        OPS.copy(g, out=Tensor(whole.block, shape, g.dtype, strides, offset))
        return (Tensor(whole.block, base_shape, g.dtype, base_strides, base_offset),)

    return backward

