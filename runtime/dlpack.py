"""DLPack exchange without copies: `Tensor.__dlpack__` / `__dlpack_device__` and `from_dlpack`.

Export. A tensor's native view (a numpy.ndarray on the CPU, a cupy.ndarray on CUDA) already
speaks DLPack, so a tensor exports through it. The view handed over is made over a small holder
object that keeps a new handle on the tensor's block: NumPy's and CuPy's DLPack capsules hold the
array they export, and a consumer's array holds the capsule, so the block keeps its memory (it is
not returned to its allocator, and so not reused) until the consumer lets go of it. Releasing the
tensor only drops the tensor's own reference. `Block.free()`, which frees whatever handles
remain, raises BufferError while an export is alive (the holder counts itself in
`Block.exports`): freeing would let the consumer read and write memory handed to someone else,
and deferring the free would make it silently not free (PyTorch's storage, which a DLPack
consumer holds, cannot be freed from under it either).

What a consumer could misuse or not take is refused before anything is shared (BufferError,
saying what to do instead): a tensor that requires grad (export `t.detach()`, as PyTorch asks);
a view with negative strides (many consumers cannot take them; PyTorch aborts the process) unless
the consumer asks for a copy (`copy=True`); and a read-only block (a deduplicated constant) to a
consumer that asks for no DLPack 1.0 capsule (`max_version` below (1, 0)) and so cannot be told
that it is read-only. A read-only block otherwise goes out as a copy unless the consumer asks
for none (`copy=False`): PyTorch (2.13) asks for a versioned capsule and then ignores its
read-only flag, so a shared view would let it write every holder's constant. With `copy=False`
a consumer that asks for a versioned capsule gets the memory itself with the read-only flag
(NumPy then makes a non-writeable array); `copy=True` always gives a writable copy.

Import. `from_dlpack(x)` (`runtime.from_dlpack`, with the other factories of tensors in
runtime/_tensor.py, over `take` and `foreign_view` here) asks NumPy (or CuPy) to take `x` and
wraps the result in a `ForeignBlock`: a Block that is written from birth, holds the
producer's memory (and so the producer) as its allocation, and when its last handle goes
simply drops that reference. The
foreign memory never reaches an allocator: its Allocation has no owner, so handing it to any
allocator's `free` raises InvalidFreeError. The block's allocator serves only the results of ops
on it (ops allocate outputs from their input's allocator).

Writes through the other library are not seen by blockrt: they do not move `Tensor.version`
(autograd's in-place check), as in PyTorch. Foreign memory may overlap other blocks: two imports
of one array, or the import of a NumPy array over a blockrt tensor's own memory (a round trip
through `np.from_dlpack`). The `out=` aliasing check of `runtime.ops` therefore compares a
ForeignBlock with every other block on device addresses (docs/aliasing.md, Note [blocks that may
share memory]); importing a blockrt Tensor itself gives a handle on the same block.

Example:
    >>> import numpy as np, runtime
    >>> host = np.arange(6.0).reshape(2, 3)
    >>> t = runtime.from_dlpack(host)          # no copy: t is a view of host's memory
    >>> host[0, 0] = 7.0
    >>> float(t[0, 0].item())
    7.0
    >>> back = np.from_dlpack(t)               # no copy the other way either
    >>> back[1, 2] = -1.0
    >>> float(host[1, 2])
    -1.0
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

import backends
from allocators import Allocation, Allocator
from backends.base import Device
from backends.numpy import NumpyDevice
from runtime import tape
from runtime.block import Block
from runtime.dtypes import BFLOAT16

#: DLPack's DLDeviceType codes that blockrt meets.
KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_OPENCL = 1, 2, 3, 4
_DEVICE_TYPES = {1: "CPU", 2: "CUDA", 3: "CUDA host", 4: "OpenCL", 7: "Vulkan", 8: "Metal",
                 9: "VPI", 10: "ROCm", 11: "ROCm host", 12: "ExtDev", 13: "CUDA managed",
                 14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}


class ForeignBlock(Block):
    """A Block over memory that another library owns (made by `from_dlpack`).

    It is written from birth and its allocation is the foreign memory, whose `raw` keeps the
    producer alive. When its last handle goes (or `free()` is called) the block drops that
    reference instead of returning the memory to an allocator; `allocator` serves only the
    results of ops on it. Later writes through new handles allocate as any Block does.
    Its memory may overlap any other block's, so `runtime.ops` tests it against them on device
    addresses (only plain `Block`s are known to be disjoint from each other).

    Attributes:
        foreign: the Allocation over the producer's memory (owner None: no allocator's), or
            None once it was let go.
        address: the device address of the foreign memory's first byte (taken once: reading
            it off the raw memory costs microseconds, and the overlap test of every op on
            this block needs it).
    """

    __slots__ = ("foreign", "address")

    def __init__(self, foreign: Allocation, allocator: Allocator, readonly: bool) -> None:
        super().__init__(foreign.nbytes, allocator)
        self.foreign: Allocation | None = foreign
        self.address: int = foreign.ptr
        self._allocation = foreign
        self._written = True
        self.readonly = readonly

    def _return_memory(self) -> None:
        # NOTE: the foreign allocation is detached first, so Block never hands it to `free`.
        if self._allocation is not None and self._allocation is self.foreign:
            self._allocation = None
        self.foreign = None
        super()._return_memory()


# ---------------------------------------------------------------------- export
def dlpack_device(device: Device) -> tuple[int, int]:
    """(DLPack device type, device index) of `device`; BufferError for a device DLPack lacks."""
    kind, _, index = device.name.partition(":")
    index = index.partition("@")[0]  # "opencl:0@queue:0x...": a device over a given queue
    if isinstance(device, NumpyDevice):
        return KDL_CPU, 0
    if kind == "cuda":
        return KDL_CUDA, int(index or 0)
    if kind == "opencl":
        return KDL_OPENCL, int(index or 0)
    raise BufferError(f"device {device.name} ({type(device).__name__}) has no DLPack device type")


_exports_lock = threading.Lock()
#: by block, how many exports of its memory began or ended (`export_events`)
_export_events: weakref.WeakKeyDictionary[Block, int] = weakref.WeakKeyDictionary()


def _count_export(block: Block, step: int) -> None:
    with _exports_lock:
        block.exports += step
        _export_events[block] = _export_events.get(block, 0) + 1


def export_events(block: Block) -> int:
    """How many DLPack exports of `block`'s memory began or ended so far (0: never exported).
    The other library's writes move no version: a reader that finds the same count and no
    live export (`Block.exports`) knows that none could have happened since it looked
    (Note [writes the working copy cannot see] in runtime/amp.py)."""
    return _export_events.get(block, 0)


def seen(block: Block) -> tuple[int, int] | None:
    """What a reader remembers of `block` to know later that nothing wrote it since: its
    version and its export count, or None where writes could come unseen (a live export, or
    imported memory), so that the reader must look again (Note [writes the working copy
    cannot see] in runtime/amp.py)."""
    if block.exports or isinstance(block, ForeignBlock):
        return None
    return block.version, export_events(block)


class _Export:
    """Holds a handle (a tensor's, or the producer's array) and shows its memory through an
    array interface. For a tensor's memory it counts as a live export of the block
    (`Block.exports`) from its birth to its collection, when the consumer lets go."""

    def __init__(self, interface_name: str, interface: dict, handle: Any,
                 block: Block | None = None) -> None:
        setattr(self, interface_name, interface)
        #: a reference on the block: its memory stays while this export lives
        self.handle = handle
        if block is not None:
            _count_export(block, 1)
            weakref.finalize(self, _count_export, block, -1)


def _share_host(native: np.ndarray, handle: Any) -> np.ndarray:
    interface = dict(native.__array_interface__)
    interface["data"] = (interface["data"][0], bool(handle.block.readonly))
    return np.asarray(_Export("__array_interface__", interface, handle, handle.block))


def _share_cuda(native: Any, handle: Any) -> Any:
    import cupy  # NOTE: the tensor is on a CUDA device, so the CUDA backend imported it

    bfloat16 = native.dtype == BFLOAT16  # NOTE: the interface's typestr has no bfloat16: "<V2"
    interface = dict((native.view(np.uint16) if bfloat16 else native).__cuda_array_interface__)
    interface.pop("stream", None)  # NOTE: the export runs on the device's stream already
    shared = cupy.asarray(_Export("__cuda_array_interface__", interface, handle, handle.block))
    return shared.view(BFLOAT16) if bfloat16 else shared


def _check_exportable(tensor: Any, max_version: Any, copy: Any) -> bool | None:
    """Refuse, before anything is shared, what a consumer could misuse or not take; returns the
    copy flag to export with (a read-only block goes as a copy unless copy=False)."""
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"__dlpack__: copy must be True, False or None, got {copy!r}")
    if max_version is not None and not (
            isinstance(max_version, tuple) and len(max_version) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in max_version)):
        raise TypeError(f"__dlpack__: max_version must be a (major, minor) tuple of ints, got "
                        f"{max_version!r}")
    if tensor.requires_grad:
        raise BufferError(
            "__dlpack__: the tensor requires grad, and another library's writes to it would "
            "bypass autograd (PyTorch refuses too); export tensor.detach() instead")
    if copy:
        return copy
    if any(s < 0 and n > 1 for s, n in zip(tensor.strides, tensor.shape)):
        raise BufferError(
            f"__dlpack__: the view has negative strides {tensor.strides} (elements), which many "
            f"consumers cannot take (PyTorch aborts on them); ask for a copy "
            f"(np.from_dlpack(t, copy=True)) or export runtime.ops.copy(t)")
    if tensor.block.readonly and (max_version is None or max_version < (1, 0)):
        raise BufferError(
            f"__dlpack__: block #{tensor.block.id} is read-only (a constant, shared by every "
            f"holder of equal content), and a consumer that asks for no DLPack 1.0 capsule "
            f"(max_version={max_version!r}) cannot be told so and could write it; ask for a "
            f"copy (np.from_dlpack(t, copy=True), or runtime.tensor(t.numpy()) for a writable "
            f"tensor) or use a consumer that passes max_version=(1, 0)")
    if tensor.block.readonly and copy is None:
        # NOTE: PyTorch 2.13 asks for a versioned capsule and then ignores its read-only flag:
        # a copy is the only answer that no consumer can turn into a write to the constant
        return True
    return copy


def export(tensor: Any, stream: Any = None, max_version: tuple[int, int] | None = None,
           dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
    """`tensor.__dlpack__(...)`: a DLPack capsule over the tensor's memory (see the module).

    Raises:
        BufferError: the tensor's device cannot be exchanged through DLPack (OpenCL), or the
            native library refuses the request (e.g. a stream on the CPU); the tensor requires
            grad; its view has negative strides and no copy was asked for; it is read-only (a
            constant) and the consumer cannot be told (no max_version >= (1, 0)) nor asked for
            a copy.
        TypeError: copy or max_version is malformed.
        UseAfterFreeError / UninitializedMemoryError: the tensor has no readable memory.
        GraphCaptureError: called while a graph is capturing.
    """
    tape.refuse_read("__dlpack__()")
    copy = _check_exportable(tensor, max_version, copy)
    device_type, _ = dlpack_device(tensor.device)
    share = {KDL_CPU: _share_host, KDL_CUDA: _share_cuda}.get(device_type)
    if share is None:
        raise BufferError(f"__dlpack__: tensors on {tensor.device.name} cannot be exported: no "
                          f"array library imports {_DEVICE_TYPES[device_type]} memory through "
                          f"DLPack; copy with tensor.numpy()")
    if device_type == KDL_CPU and stream is not None:
        raise BufferError(f"__dlpack__: stream must be None for a tensor on the CPU, "
                          f"got {stream!r}")
    native = tensor._native_read("__dlpack__()")
    options = {"stream": stream, "max_version": max_version, "dl_device": dl_device,
               "copy": copy}
    options = {key: value for key, value in options.items() if value is not None}
    if device_type == KDL_CUDA:
        with tensor.device.cuda_device, tensor.device.stream:
            shared = _share_cuda(native, tensor.detach())
            try:
                return shared.__dlpack__(**options)
            except (TypeError, ValueError, NotImplementedError) as exc:
                if native.dtype != BFLOAT16:
                    raise
                # NOTE: CuPy exports bfloat16 from version 14 (with ml_dtypes)
                raise BufferError(f"__dlpack__: bfloat16 tensors on CUDA cannot be exported "
                                  f"by this CuPy ({exc}); export ops.cast(t, 'float32')") from exc
    if native.dtype == BFLOAT16:  # Note [bfloat16 through DLPack]
        shared = _share_host(native.view(np.uint16), tensor.detach())
        return _retyped(shared.__dlpack__(**options), (_KDL_UINT, 16), (_KDL_BFLOAT, 16))
    return _share_host(native, tensor.detach()).__dlpack__(**options)


# Note [bfloat16 through DLPack]: DLPack has a code for bfloat16 (kDLBfloat, 4), and PyTorch
# and JAX use it, but NumPy has no bfloat16 and refuses the code both ways. So a host bfloat16
# tensor is handed to NumPy's exporter as uint16 (the same bits) and the capsule's dtype is set
# to kDLBfloat before it leaves; an incoming capsule of kDLBfloat is set to uint16 before
# NumPy takes it, and the array is viewed as ml_dtypes.bfloat16. Only the DLDataType changes,
# in a capsule nobody has consumed yet; the layout of DLManagedTensor(Versioned) is DLPack's
# stable ABI.
_KDL_UINT, _KDL_BFLOAT = 1, 4


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.c_void_p),
                ("strides", ctypes.c_void_p), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype, _capsule_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dtype_field(capsule: Any) -> _DLDataType:
    """The DLDataType inside an unconsumed DLPack capsule (either kind); valid while the
    capsule lives."""
    name = _capsule_name(capsule)
    kind = {b"dltensor": _DLManagedTensor,
            b"dltensor_versioned": _DLManagedTensorVersioned}.get(name)
    if kind is None:
        raise BufferError(f"from_dlpack: the producer gave a capsule named {name!r}, not an "
                          f"unconsumed DLPack tensor")
    return kind.from_address(_capsule_pointer(capsule, name)).dl_tensor.dtype


def _retyped(capsule: Any, old: tuple[int, int], new: tuple[int, int]) -> Any:
    """`capsule` with its dtype (code, bits) `old` set to `new` (others left as they are)."""
    field = _dtype_field(capsule)
    if (field.code, field.bits) == old and field.lanes == 1:
        field.code, field.bits = new
    return capsule


#: DLPack's type codes by name (DLPack 1.1, dlpack.h's DLDataTypeCode)
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex",
               6: "bool", 7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz",
               10: "float8_e4m3fn", 11: "float8_e4m3fnuz", 12: "float8_e5m2",
               13: "float8_e5m2fnuz", 14: "float8_e8m0fnu", 15: "float6_e2m3fn",
               16: "float6_e3m2fn", 17: "float4_e2m1fn"}
#: The (code, bits) of the element types a tensor holds (runtime/dtypes.py DTYPES)
_HELD = {(0, 8), (0, 16), (0, 32), (0, 64), (1, 8), (1, 16), (1, 32), (1, 64), (2, 16),
         (2, 32), (2, 64), (_KDL_BFLOAT, 16), (6, 8)}


def _check_held(field: _DLDataType) -> None:
    """Raise TypeError, before NumPy or CuPy takes the capsule, for an element type no tensor
    holds (float8 and the narrower floats, complex, vectors of lanes), naming it."""
    if (field.code, field.bits) in _HELD and field.lanes == 1:
        return
    name = _CODE_NAMES.get(field.code, f"type code {field.code}")
    if field.code in (0, 1, 2, 5):
        name = f"{name}{field.bits}"
    lanes = f" in vectors of {field.lanes} lanes" if field.lanes != 1 else ""
    raise TypeError(f"from_dlpack: the producer's elements are {name}{lanes} (DLPack type code "
                    f"{field.code}, {field.bits} bits), which no tensor holds; tensors hold "
                    f"bool, int8-64, uint8-64, float16, bfloat16, float32 and float64: convert "
                    f"in the producer first (float8 to float16 or bfloat16, say)")


class _Checked:
    """What NumPy or CuPy imports in place of a producer: its capsule, once its element type
    is one a tensor holds (`_check_held`); for NumPy (`bfloat_as_uint16`) a bfloat16 one
    retyped uint16 (Note [bfloat16 through DLPack])."""

    def __init__(self, producer: Any, bfloat_as_uint16: bool) -> None:
        self.producer = producer
        self.bfloat_as_uint16 = bfloat_as_uint16
        #: whether a bfloat16 capsule was retyped
        self.bfloat = False

    def __dlpack_device__(self) -> Any:
        return self.producer.__dlpack_device__()

    def __dlpack__(self, **options: Any) -> Any:
        capsule = self.producer.__dlpack__(**options)
        field = _dtype_field(capsule)
        _check_held(field)
        if self.bfloat_as_uint16 and (field.code, field.bits) == (_KDL_BFLOAT, 16):
            field.code = _KDL_UINT
            self.bfloat = True
        return capsule


# ---------------------------------------------------------------------- import
def _host_memory(address: int, nbytes: int, readonly: bool, owner: Any) -> np.ndarray:
    """A uint8 array over `nbytes` at `address` that keeps `owner` alive (the NumPy raw)."""
    interface = {"data": (address, readonly), "shape": (nbytes,), "typestr": "|u1",
                 "version": 3}
    return np.asarray(_Export("__array_interface__", interface, owner))


def _import_host(obj: Any, index: int) -> tuple[Device, Any, int, Callable[..., Any]]:
    producer = _Checked(obj, bfloat_as_uint16=True)  # Note [bfloat16 through DLPack]
    native = np.from_dlpack(producer)
    if producer.bfloat:
        native = native.view(BFLOAT16)
    readonly = not native.flags.writeable

    def memory(address: int, nbytes: int) -> np.ndarray:
        return _host_memory(address, nbytes, readonly, native)

    return backends.get_device("cpu"), native, native.__array_interface__["data"][0], memory


def _import_cuda(obj: Any, index: int) -> tuple[Device, Any, int, Callable[..., Any]]:
    device = backends.get_device(f"cuda:{index}")
    import cupy as cp  # NOTE: the CUDA backend imported it to make `device`
    with device.cuda_device, device.stream:  # the producer's work is ordered before ours
        native = cp.from_dlpack(_Checked(obj, bfloat_as_uint16=False))

    def memory(address: int, nbytes: int) -> Any:
        return cp.cuda.UnownedMemory(address, nbytes, native, device_id=index)

    return device, native, int(native.data.ptr), memory


def take(obj: Any) -> tuple[Device, Any, int, Callable[[int, int], Any]]:
    """What `runtime.from_dlpack` takes from `obj`: the device of its memory, the native array
    (NumPy's or CuPy's) over it, the address of its first element, and `memory(address,
    nbytes)`, which makes the raw memory of a ForeignBlock over part of it.

    Raises:
        TypeError: `obj` has no `__dlpack__`, or its elements are of a type no tensor holds
            (named before anything is shared).
        BufferError: its memory is on a device blockrt cannot use through DLPack.
        BackendUnavailableError: its memory is on CUDA and the CUDA backend is unavailable.
    """
    if not hasattr(obj, "__dlpack__") or not hasattr(obj, "__dlpack_device__"):
        raise TypeError(f"from_dlpack needs an object with __dlpack__ and __dlpack_device__, "
                        f"got {type(obj).__name__}")
    device_type, index = (int(n) for n in obj.__dlpack_device__())
    importer = {KDL_CPU: _import_host, KDL_CUDA: _import_cuda}.get(device_type)
    if importer is None:
        where = _DEVICE_TYPES.get(device_type, "unknown")
        raise BufferError(f"from_dlpack: {where} memory (DLPack device type {device_type}, "
                          f"index {index}) is not supported; blockrt imports CPU and CUDA memory")
    return importer(obj, index)


def foreign_view(device: Device, native: Any, dtype: np.dtype, address: int,
                 memory: Callable[[int, int], Any],
                 allocator_for: Callable[[Device], Allocator]) -> tuple[ForeignBlock, tuple, int]:
    """The ForeignBlock over the bytes `native` (of `dtype`, from `take`) touches, whose
    allocator is `allocator_for(device)`, and the view's strides and offset on it, in elements.

    Raises:
        BufferError: strides that are not whole elements.
    """
    item = dtype.itemsize
    if any(s % item for s in native.strides):
        raise BufferError(f"from_dlpack: strides {native.strides} (bytes) are not multiples of "
                          f"the item size {item}")
    strides = tuple(s // item for s in native.strides)
    lo = hi = 0  # the byte span [lo, hi) the array touches, from its first element
    for n, s in zip(native.shape, native.strides):
        if n == 0:
            lo = hi = 0
            break
        if s > 0:
            hi += s * (n - 1)
        else:
            lo += s * (n - 1)
    else:
        hi += item
    raw = memory(address + lo, hi - lo)
    foreign = Allocation(device, raw, 0, hi - lo, hi - lo)
    block = ForeignBlock(foreign, allocator_for(device),
                         readonly=isinstance(native, np.ndarray) and not native.flags.writeable)
    return block, strides, -lo // item
