"""`Tensor`: shape, dtype, strides and offset over a Block; views share the Block.

Strides and offsets count elements (as in PyTorch), not bytes. Every tensor and view holds one
reference to its block; `release()` (or garbage collection) drops it, and any use of a released
tensor, or of a tensor whose block was freed, raises `UseAfterFreeError`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence, Set
from typing import Any

import numpy as np

import backends
from allocators import Allocator, format_bytes
from runtime import aliasing, autograd, config, dlpack, tape
from runtime.autograd import Node
from runtime.block import Block
from runtime.errors import AutogradError, UseAfterFreeError, device_names

#: The dtypes a tensor may hold. Arithmetic ops accept the float ones.
DTYPES = tuple(np.dtype(t) for t in ("float32", "float64", "int32", "int64", "uint8", "bool"))

#: The most bytes one tensor may span: what a 64-bit signed size (NumPy's intp) can count.
MAX_NBYTES = 2**63 - 1
_RELEASED = -1
_UNSET = object()


def as_dtype(dtype: Any) -> np.dtype:
    """Normalise a dtype spec, refusing ones a tensor cannot hold."""
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise TypeError(f"not a dtype: {dtype!r}") from exc
    if dt not in DTYPES:
        raise TypeError(f"dtype {dt} is not supported; use one of {', '.join(map(str, DTYPES))}")
    return dt


def as_shape(shape: Any) -> tuple[int, ...]:
    """Normalise an int or a sequence of ints into a shape, refusing negatives and non-ints."""
    if type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape):
        return shape  # the common case, checked cheaply
    if isinstance(shape, (numbers.Integral,)) and not isinstance(shape, bool):
        shape = (shape,)
    if isinstance(shape, (str, bytes, Mapping, Set)):  # iterable, but not a list of sizes
        raise TypeError(f"a shape is an int or a sequence of ints, got {shape!r}")
    try:
        dims = tuple(shape)
    except TypeError as exc:
        raise TypeError(f"a shape is an int or a sequence of ints, got {shape!r}") from exc
    for n in dims:
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise TypeError(f"shape {shape!r} has a non-integer dimension {n!r}")
        if n < 0:
            raise ValueError(f"shape {dims} has a negative dimension {n}")
    return tuple(int(n) for n in dims)


def checked_nbytes(shape: tuple[int, ...], dtype: np.dtype) -> int:
    """The bytes a C-contiguous tensor of `shape` and `dtype` holds, refusing sizes no device
    can address (more than MAX_NBYTES) with a ValueError naming the shape, dtype and bytes."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_NBYTES:
        raise ValueError(f"shape {shape} of {dtype} needs {nbytes} bytes ({format_bytes(nbytes)}), "
                         f"more than the {MAX_NBYTES} bytes a tensor can span")
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
                 "_self_overlap", "_native", "_requires_grad", "_node", "grad", "name",
                 "__weakref__")

    def __init__(self, block: Block, shape: Sequence[int], dtype: Any,
                 strides: Sequence[int] | None = None, offset: int = 0) -> None:
        self._requires_grad = False
        self._node: Node | None = None    # NOTE: the autograd record of the op that made it
        self.grad: Tensor | None = None
        self.name: str | None = None      # for messages (nn names its parameters)
        self.block = block
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.strides = tuple(strides) if strides is not None else contiguous_strides(self.shape)
        self.offset = offset
        self._layout: tuple | None = None   # NOTE: (byte offset, shape, byte strides, itemsize)
        self._span: Any = _UNSET            # NOTE: cached aliasing.byte_span(self.layout())
        self._self_overlap: bool | None = None
        self._native: tuple | None = None   # NOTE: (allocation, native view) built on it
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
        self.grad = None
        self.name = None
        self._gen = block.acquire()
        return self

    def _check_bounds(self) -> None:
        span = self.byte_span()  # NOTE: cached, so the ops' overlap checks reuse it
        if span is None or (span[0] >= 0 and span[1] <= self.block.nbytes):
            return
        itemsize = self.dtype.itemsize
        raise ValueError(
            f"a view of shape {self.shape}, strides {self.strides} at offset {self.offset} "
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
        if self._node is not None and not flag:
            raise AutogradError(f"requires_grad can only be turned off on a leaf; this tensor "
                                f"is the result of {self._node.op}: use detach()")
        if flag and self.dtype.kind != "f":
            raise AutogradError(f"only float tensors can require gradients, not {self.dtype}")
        self._requires_grad = bool(flag)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        """Set requires_grad in place and return self."""
        self.requires_grad = flag
        return self

    @property
    def is_leaf(self) -> bool:
        """True unless this tensor is the recorded result of an op."""
        return self._node is None

    @property
    def grad_fn(self) -> Node | None:
        """The autograd record of the op that made this tensor (None for leaves)."""
        return self._node

    def backward(self, gradient: Tensor | None = None, retain_graph: bool = False) -> None:
        """Accumulate the gradient of this (scalar) tensor into `.grad` of every leaf that
        requires one; see `runtime.autograd`."""
        autograd.backward(self, gradient, retain_graph)

    def detach(self) -> Tensor:
        """A new handle on the same memory, outside the graph (requires no gradient)."""
        self._check("detach()")
        return Tensor(self.block, self.shape, self.dtype, self.strides, self.offset)

    def _record_view(self, view: Tensor, op: str, backward_fn: Any) -> Tensor:
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
            self.release()
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
        return Tensor(self.block, shape, self.dtype, strides, offset)

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
                start, stop, step = k.indices(self.shape[dim])
                shape.append(len(range(start, stop, step)))
                strides.append(self.strides[dim] * step)
                offset += start * self.strides[dim]
                dim += 1
            elif isinstance(k, numbers.Integral) and not isinstance(k, bool):
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
        from runtime import ops

        if autograd.needs_grad(self, value):
            raise AutogradError(
                f"item assignment is not recorded by autograd, and this one involves a tensor "
                f"that requires grad (target shape {self.shape}); assign under "
                f"runtime.no_grad(), or build the result with ops")
        target = self[key]
        try:
            if not isinstance(value, Tensor):
                host = host_array(value, None, f"value to assign to a tensor of {self.dtype}")
                value = tensor(host.astype(self.dtype, copy=False), device=self.device,
                               allocator=self.block.allocator)
            ops.copy(value, out=target)
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
            axes = tuple(axes[0])
        if sorted(a % self.ndim if -self.ndim <= a < self.ndim else a for a in axes) != \
                list(range(self.ndim)):
            raise ValueError(f"axes {axes} are not a permutation of the {self.ndim} axes")
        axes = tuple(a % self.ndim for a in axes)
        view = self._view(tuple(self.shape[a] for a in axes),
                          tuple(self.strides[a] for a in axes), self.offset)
        inverse = tuple(sorted(range(len(axes)), key=axes.__getitem__))
        return self._record_view(view, "transpose", lambda g: (g.transpose(inverse),))

    def reshape(self, *shape: Any) -> Tensor:
        """The same elements in C order under a new shape (one -1 is inferred).

        A view when the strides allow it, as in NumPy; otherwise a contiguous copy.
        """
        if len(shape) == 1 and not isinstance(shape[0], numbers.Integral):
            shape = tuple(shape[0])
        new_shape = _infer_shape(shape, self.size, self.shape)
        strides = _reshape_strides(self.shape, self.strides, new_shape)
        if strides is not None:
            view = self._view(new_shape, strides, self.offset)
        else:
            from runtime import ops

            with autograd.no_grad():
                flat = ops.copy(self)
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
        return _ops.add(self, other)

    def __radd__(self, other: Any) -> Tensor:
        return _ops.add(other, self)

    def __sub__(self, other: Any) -> Tensor:
        return _ops.sub(self, other)

    def __rsub__(self, other: Any) -> Tensor:
        return _ops.sub(other, self)

    def __mul__(self, other: Any) -> Tensor:
        return _ops.mul(self, other)

    def __rmul__(self, other: Any) -> Tensor:
        return _ops.mul(other, self)

    def __truediv__(self, other: Any) -> Tensor:
        return _ops.div(self, other)

    def __rtruediv__(self, other: Any) -> Tensor:
        return _ops.div(other, self)

    def __matmul__(self, other: Tensor) -> Tensor:
        return _ops.matmul(self, other)

    def __neg__(self) -> Tensor:
        return _ops.neg(self)


def _infer_shape(shape: Sequence[Any], size: int, old_shape: tuple) -> tuple[int, ...]:
    dims = list(shape)
    unknown = [i for i, n in enumerate(dims) if isinstance(n, numbers.Integral) and n == -1]
    if len(unknown) > 1:
        raise ValueError(f"can only infer one dimension of {tuple(shape)}")
    if unknown:
        known = math.prod(n for i, n in enumerate(dims) if i != unknown[0])
        if known == 0 or size % known:
            raise ValueError(f"cannot reshape {size} elements {old_shape} into {tuple(shape)}")
        dims[unknown[0]] = size // known
    new_shape = as_shape(dims)
    if math.prod(new_shape) != size:
        raise ValueError(f"cannot reshape {size} elements {old_shape} into {new_shape} "
                         f"({math.prod(new_shape)} elements)")
    return new_shape


# ---------------------------------------------------------------------- factories
def _allocator_for(device: Any, allocator: Allocator | None) -> Allocator:
    if allocator is None:
        return config.get_default_allocator(device)
    if not isinstance(allocator, Allocator):
        raise TypeError(f"allocator must be an allocators.Allocator, "
                        f"got {type(allocator).__name__}")
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


def host_array(data: Any, dtype: Any = None, what: str = "tensor") -> np.ndarray:
    """`data` (array-like or Tensor) as a C-contiguous host array of a dtype tensors hold.

    Without `dtype`, float data becomes float64 and integer data int64 unless already of a
    supported dtype (as NumPy's defaults). Raises TypeError for data no tensor can hold.
    """
    if isinstance(data, Tensor):
        data = data.numpy()
    dt = None if dtype is None else as_dtype(dtype)
    try:
        host = np.asarray(data, dtype=dt)
    except (TypeError, ValueError) as exc:  # ragged lists, strings that are not numbers
        raise type(exc)(f"cannot make a {what}{'' if dt is None else f' of {dt}'} from "
                        f"{type(data).__name__} {_brief(data)}: {exc}") from exc
    if host.dtype == np.float16 or host.dtype.kind not in "fiub":
        raise TypeError(f"cannot make a {what} from data of dtype {host.dtype}")
    if host.dtype not in DTYPES:
        host = host.astype(np.float64 if host.dtype.kind == "f" else np.int64)
    return np.require(host, requirements="C")  # NOTE: ascontiguousarray would make 0-d 1-d


def _brief(value: Any, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters for a message."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def empty(shape: Any, dtype: Any = "float32", device: Any = None,
          allocator: Allocator | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of `shape` whose block holds no memory until first written (lazy).

    Raises:
        TypeError: the shape is not an int or a sequence of ints, or the dtype is not one of
            DTYPES.
        ValueError: a dimension is negative, or the tensor would span more than MAX_NBYTES.
    """
    shape = as_shape(shape)
    dt = as_dtype(dtype)
    nbytes = checked_nbytes(shape, dt)
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
    out = empty(host.shape, host.dtype, device, allocator, requires_grad)
    recorder = tape.active()
    if recorder is not None:  # inside a graph capture: a recorded load, run at replay
        recorder.load(out, host)
        return out
    allocation = out.block.memory_for_write("runtime.tensor")
    out.device.copyin(allocation.raw, allocation.offset, host)
    out.block.mark_written()
    return out


def zeros(shape: Any, dtype: Any = "float32", device: Any = None,
          allocator: Allocator | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of `shape` filled with zeros."""
    shape, dt = as_shape(shape), as_dtype(dtype)
    checked_nbytes(shape, dt)  # NOTE: before NumPy, whose error names neither
    return tensor(np.zeros(shape, dt), device=device, allocator=allocator,
                  requires_grad=requires_grad)


def ones(shape: Any, dtype: Any = "float32", device: Any = None,
         allocator: Allocator | None = None, requires_grad: bool = False) -> Tensor:
    """A tensor of `shape` filled with ones."""
    shape, dt = as_shape(shape), as_dtype(dtype)
    checked_nbytes(shape, dt)
    return tensor(np.ones(shape, dt), device=device, allocator=allocator,
                  requires_grad=requires_grad)


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
        raise TypeError(f"view() needs a Tensor source, got {type(source).__name__}")
    shape = as_shape(shape)
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
        raise TypeError(f"offset counts elements and must be an int, got {offset!r}")
    if not source.is_contiguous():
        raise ValueError(f"view() needs a contiguous source; this one has shape {source.shape} "
                         f"and strides {source.strides}")
    need = math.prod(shape)
    if offset < 0 or offset + need > source.size:
        raise ValueError(f"a view of {need} elements {shape} at offset {offset} does not fit in "
                         f"a source of {source.size} elements")
    result = source._view(shape, contiguous_strides(shape), source.offset + offset)
    return source._record_view(result, "view", _scatter_backward(source, result))


def _scatter_backward(base: Tensor, view: Tensor) -> Any:
    """The backward of a view that picks some elements of `base`: the gradient of the view,
    written into zeros shaped like `base` at the view's elements (a view never repeats an
    element, so writing is summing)."""
    if not base._requires_grad or not autograd.is_grad_enabled():
        return None
    shape, strides, offset = view.shape, view.strides, view.offset
    base_shape, base_strides, base_offset = base.shape, base.strides, base.offset
    nbytes = base.block.nbytes  # NOTE: plain values only: the closure must not hold `base`

    def backward(g: Tensor) -> tuple[Tensor]:
        # NOTE: a zeroed copy of the whole block, seen through base's and the view's layouts
        whole = zeros(nbytes // g.dtype.itemsize, g.dtype, allocator=g.block.allocator)
        from runtime import ops

        ops.copy(g, out=Tensor(whole.block, shape, g.dtype, strides, offset))
        return (Tensor(whole.block, base_shape, g.dtype, base_strides, base_offset),)

    return backward


from runtime import ops as _ops  # noqa: E402  (ops imports this module; bound for operators)
