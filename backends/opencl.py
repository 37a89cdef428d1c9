"""The OpenCL device (pyopencl): buffers, blocking copies and kernels of our own.

Every OpenCL device of every platform is one `OpenCLDevice`, "opencl:N" in enumeration order, with
one context and one in-order command queue. `backends.from_queue(queue)` makes another over a
framework's own in-order queue and its context ("opencl:N@queue:0x..."), so that the framework's
buffers and blockrt's are of one context and its commands and blockrt's run in one order.

Raw memory is a `cl.Buffer` (wrapped with its size and a stable address); native views are
`pyopencl.array.Array`s at a byte offset into it. Ordinary memory is a `READ_WRITE` buffer;
read-only memory (constants) a `READ_ONLY` one, which kernels get only as inputs
(`__global const`) and the host fills and reads with `enqueue_copy`. OpenCL leaves a kernel's
write to a `READ_ONLY` buffer undefined and PoCL does not stop it, so the runtime refuses such
writes (`ReadOnlyError`) before any kernel is enqueued.

Kernels are OpenCL C generated per (op, dtype, ndim): one work item per output element finds its
multi-index from the shape and each operand's strides and offset, in elements, so any strided,
broadcast (0-stride) or offset view works; dimensions that every operand walks contiguously are
merged first, so most launches are 1-D. Each program is built once and kept (`kernel_cache_stats`).

float16 and bfloat16 follow the rule of HALVES in backends/base.py inside the kernels, with no
widened copies: a kernel loads a two-byte operand from its bits into float (exactly: what
`vload_half` gives; bfloat16 by a 16-bit shift), computes in float and stores it rounded to
nearest even (what `vstore_half_rte` gives), and a fused chain rounds each two-byte link in
registers as the link's own kernel would; so the results are bit for bit those of the widened
path (`Device._in_float32`). This is integer arithmetic of core OpenCL 1.x (`_HALF_IO`) and
needs no cl_khr_fp16. Where a device has cl_khr_fp16, kernels still compute in float, not in
half arithmetic: a chain in half rounds every intermediate, and a sum would accumulate in half,
so results would depend on the device and break "compute in float32, round once" (no such
device was at hand to test an opt-in). Only a product on the plain kernel widens a float16
operand once, and linear and cross_entropy compute their half outputs in float32 scratch.

Recycling without events (pyopencl issue 447): memory freed while a queued kernel still reads it
must not be overwritten before that kernel runs. Here it cannot be: every kernel and every copy of
a device goes to its one in-order queue, so a command enqueued after a free (a write into the
recycled memory) starts only after every command enqueued before the free has finished; and host
copies are blocking, so the host never sees or supplies bytes early. The allocator may therefore
hand freed memory out again at once, with no event to wait for. Memory used on a second queue
as well (a framework's, through `Allocator.record_queue` or a hook bound to that queue) is joined
back with a marker and a barrier when it is freed (Note [queue-ordered reuse] in
backends/base.py). Non-blocking host copies would break this reasoning.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from backends import optable
from backends.base import COMPUTE_DTYPES, HALVES, BackendUnavailableError, Capabilities, Device

try:
    import pyopencl as cl
    import pyopencl.array as cla
except ImportError as exc:  # backends._load turns this into BackendUnavailableError
    raise ImportError(f"the opencl backend needs pyopencl ({exc})") from exc

#: Work items per work group for elementwise, reduction and cross-entropy kernels.
GROUP = 128
#: Side of the square GEMM tile kept in local memory.
TILE = 16

_FLOAT_TYPES = {np.dtype("float32"): "float", np.dtype("float64"): "double"}
#: ml_dtypes' bfloat16, stored as the upper half of a float's bits (`_storage`)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: "copy" moves bits of any dtype: the unsigned type of each item size
_BITS_TYPES = {1: "uchar", 2: "ushort", 4: "uint", 8: "ulong"}
_INT_TYPES = {np.dtype(f"{k}{n}"): f"{'u' if k == 'uint' else ''}{c}" for k in ("int", "uint")
              for n, c in ((8, "char"), (16, "short"), (32, "int"), (64, "long"))}
_FP64 = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n"
#: What cross_entropy's flag holds before its check kernel runs: no bad label found (yet).
#: Read-only: non-blocking copies read it after the call that enqueued them has returned.
_NO_BAD_ROW = np.array([np.iinfo(np.int32).max], np.int32)
_NO_BAD_ROW.flags.writeable = False

class _OpenCLC(optable.CStyle):
    """The table's formulas in OpenCL C (Note [one declaration per op] in backends/optable.py):
    C's spelling but for tanh, `tanh_` of `_header` (PoCL's tanh does not saturate)."""

    code_for_op = {**optable.CStyle.code_for_op, "tanh": lambda a: f"tanh_({a})"}


@functools.cache
def _formula(name: str, ctype: str) -> str:
    """The op `name` computed in `ctype` on operands x0, x1, ..."""
    return _OpenCLC(ctype).op(name, [f"x{i}" for i in range(optable.BY_NAME[name].arity)])


class _Raw:
    """A cl.Buffer with its size and a synthetic, aligned, never reused address."""

    __slots__ = ("buffer", "nbytes", "address")

    def __init__(self, buffer: Any, nbytes: int, address: int) -> None:
        self.buffer = buffer
        #: the bytes asked for: a 0-byte raw holds a 1-byte buffer (OpenCL has no empty ones)
        self.nbytes = nbytes
        self.address = address


def _all_devices() -> list:
    try:
        return [d for platform in cl.get_platforms() for d in platform.get_devices()]
    except cl.Error:  # no ICD or no platform
        return []


def _elements(view: Any) -> tuple[int, tuple[int, ...]]:
    """(offset, strides) of a native view in elements of its dtype."""
    size = view.dtype.itemsize
    if view.offset % size or any(s % size for s in view.strides):
        raise ValueError(f"view at byte offset {view.offset} with strides {view.strides} is not "
                         f"aligned to its {view.dtype} elements")
    return view.offset // size, tuple(s // size for s in view.strides)


def _collapse(shape: tuple, strides: list[tuple]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that every operand walks contiguously."""
    dims: list[int] = []
    steps: list[list[int]] = [[] for _ in strides]
    for i, n in enumerate(shape):
        if n == 1:
            continue
        if dims and all(s[-1] == t[i] * n for s, t in zip(steps, strides)):
            dims[-1] *= n
            for s, t in zip(steps, strides):
                s[-1] = t[i]
            continue
        dims.append(n)
        for s, t in zip(steps, strides):
            s.append(t[i])
    return dims, steps


def _walk(var: str, dims: str, pointers: list[str], ndim: int) -> str:
    """OpenCL C that splits the flat index `var` over `ndim` dims (sizes `{dims}{d}`) and moves
    each pointer p by its stride `{p}_s{d}`."""
    lines = [f"    long r_{var} = {var};"]
    for d in range(ndim - 1, -1, -1):
        if d:
            lines.append(f"    long c{d}_{var} = r_{var} % {dims}{d}; r_{var} /= {dims}{d};")
        index = f"c{d}_{var}" if d else f"r_{var}"
        lines += [f"    {p} += {index} * {p}_s{d};" for p in pointers]
    return "\n".join(lines)


def _scalar_types(source: str) -> list:
    """The argument dtypes of the kernel `k` in `source` (None for a buffer)."""
    types = {"long": np.int64, "int": np.int32, "float": np.float32, "double": np.float64}
    typedefs = {name: ctype for ctype, name in re.findall(r"typedef (\w+) (\w+);", source)}
    params = re.search(r"void k\(([^)]*)\)", source).group(1)
    found = []
    for param in params.split(","):
        words = param.split()
        if "__global" in words:
            found.append(None)
        else:
            found.append(types[typedefs.get(words[0], words[0])])
    return found


def _longs(names: list[str]) -> str:
    return "".join(f", long {n}" for n in names)


class OpenCLDevice(Device):
    """One OpenCL device: `cl.Buffer` memory, an in-order queue and generated kernels.

    Args:
        index: position in the list of the devices of all platforms (`device_count()`).
        queue: a framework's own in-order `cl.CommandQueue` on device `index`, already checked
            by `locate_queue`; the device then uses it and its context instead of making its
            own (`backends.from_queue(queue)` is the way in). Default: a new context and queue.

    Attributes:
        cl_device, context, queue: the `cl.Device`, and the `cl.Context` and in-order
            `cl.CommandQueue` every buffer, copy and kernel of this device uses.

    Example:
        >>> import backends
        >>> dev = backends.get_device("opencl")   # doctest: +SKIP
        >>> dev.name                              # doctest: +SKIP
        'opencl:0'
    """

    capabilities = Capabilities(
        read_only_memory=True,  # NOTE: READ_ONLY buffers
        # NOTE: Note [two-byte floats compute in float32] in backends/base.py, with no widened
        # copies: these kernels load float16 / bfloat16 straight into float and round once as
        # they store (`Device._in_float32`'s bits); linear and cross_entropy's two-byte
        # outputs go through float32 scratch, their inputs are read as they are.
        half_kernels=True,
        compiles_fused=True,
        gemm_accumulates=True,  # NOTE: the product kernel scales and accumulates as it stores
        queues=True)

    def __init__(self, index: int = 0, queue: Any = None) -> None:
        if queue is None:
            found = _all_devices()
            if not 0 <= index < len(found):
                raise BackendUnavailableError(f"opencl:{index} does not exist "
                                              f"({len(found)} devices)")
            self.name = f"opencl:{index}"
            # NOTE: in order (the default), which recycling relies on: see the module docstring
            queue = cl.CommandQueue(cl.Context([found[index]]))
        else:
            self.name = f"opencl:{index}@queue:{queue.int_ptr:#x}"
        self.queue = queue
        self.context = queue.context
        #: in a context of several devices, the queue's one
        self.cl_device = queue.device
        # NOTE: MEM_BASE_ADDR_ALIGN is in bits. A value above 512 bytes makes the caching
        # allocator refuse this device unless it is given size classes of a larger granule.
        self.alignment = max(self.cl_device.mem_base_addr_align // 8, 1)
        self.fp64 = "cl_khr_fp64" in self.cl_device.extensions
        if not self.fp64:
            # NOTE: float64 is last
            self.capabilities = dataclasses.replace(type(self).capabilities,
                                                    compute_dtypes=COMPUTE_DTYPES[:-1])
        #: whether the device has half arithmetic (cl_khr_fp16); reported, never used: the
        #: two-byte floats compute in float on every device (module docstring)
        self.fp16 = "cl_khr_fp16" in self.cl_device.extensions
        # NOTE: OpenCL lets float division and sqrt be 2.5 and 3 ULPs off unless asked; asked,
        # they are IEEE's, as on the CPU and CUDA (tests/test_bits.py). A device that cannot
        # (no CORRECTLY_ROUNDED_DIVIDE_SQRT) gives its own bits for them.
        exact = self.cl_device.single_fp_config & cl.device_fp_config.CORRECTLY_ROUNDED_DIVIDE_SQRT
        self._build_options = ["-cl-fp32-correctly-rounded-divide-sqrt"] if exact else []
        # NOTE: local-memory GEMM tiles suit GPUs; on CPU devices (PoCL) the barriers make them
        # ~5x slower than one plain dot product per work item, so those get the plain kernel.
        self.tiled_gemm = not self.cl_device.type & cl.device_type.CPU
        self._next_address = self.alignment
        self._kernels: dict[tuple, Any] = {}
        self._hits = self._misses = 0
        self._lock = threading.RLock()
        #: one int for cross_entropy's bad-label report
        self._flag: Any = None

    @classmethod
    def device_count(cls) -> int:
        return len(_all_devices())

    @classmethod
    def locate_queue(cls, queue: Any) -> tuple[int, int]:
        """(device index, a number naming the queue) of a framework's `cl.CommandQueue`, once
        it is checked to be one this backend can run on (`backends.from_queue` calls this).

        Raises:
            TypeError: `queue` is not a `pyopencl.CommandQueue`.
            ValueError: the queue executes out of order (the kernels and the memory reuse of a
                device rely on its one queue running commands in order), or its device is not
                one of the OpenCL devices of `device_count()` (a sub-device, say).
        """
        if not isinstance(queue, cl.CommandQueue):
            raise TypeError(f"expected a pyopencl.CommandQueue, got {type(queue).__module__}."
                            f"{type(queue).__qualname__}")
        if queue.properties & cl.command_queue_properties.OUT_OF_ORDER_EXEC_MODE_ENABLE:
            raise ValueError(
                f"the queue {queue!r} executes out of order (OUT_OF_ORDER_EXEC_MODE_ENABLE), "
                f"but blockrt's OpenCL kernels and memory reuse rely on one in-order queue: a "
                f"command must start only after those queued before it have finished. Pass an "
                f"in-order queue of the same context instead: "
                f"pyopencl.CommandQueue(queue.context, queue.device)")
        found = _all_devices()
        if queue.device not in found:
            raise ValueError(f"the queue's device {queue.device!r} is not one of the "
                             f"{len(found)} OpenCL device(s) blockrt can see "
                             f"(opencl:0..{len(found) - 1}; sub-devices are not among them)")
        return found.index(queue.device), queue.int_ptr

    @property
    def total_memory(self) -> int | None:
        return int(self.cl_device.global_mem_size)

    # NOTE: the queue hooks: Note [queue-ordered reuse] in backends/base.py
    def _synchronize(self) -> None:
        self.queue.finish()

    def _home_queue(self) -> Any:
        return self.queue

    def _queue_key(self, queue: Any) -> int:
        if not isinstance(queue, cl.CommandQueue):
            raise TypeError(f"{self.name}: expected a pyopencl.CommandQueue, got "
                            f"{type(queue).__name__}")
        if queue.context != self.context:
            raise ValueError(f"{self.name}: the queue {queue!r} belongs to another OpenCL context "
                             f"({queue.context!r}, not {self.context!r}); its buffers and "
                             f"events cannot be used here")
        return queue.int_ptr

    def _record_event(self, queue: Any) -> Any:
        return cl.enqueue_marker(queue)

    def _event_done(self, event: Any) -> bool:
        # NOTE: a negative status is an error: the commands ended, and touch nothing any more
        return event.command_execution_status <= cl.command_execution_status.COMPLETE

    def _wait_event(self, event: Any) -> None:
        event.wait()

    def _join(self, waiter: Any, signaller: Any) -> None:
        cl.enqueue_barrier(waiter, wait_for=[cl.enqueue_marker(signaller)])

    def kernel_cache_stats(self) -> dict[str, int]:
        """{"kernels": programs built, "hits": launches that found theirs, "misses": builds}."""
        return {"kernels": len(self._kernels), "hits": self._hits, "misses": self._misses}

    # ----------------------------------------------------------------- memory
    def _raw_alloc(self, nbytes: int) -> _Raw:
        return self._buffer(nbytes, cl.mem_flags.READ_WRITE)

    def _raw_alloc_read_only(self, nbytes: int) -> _Raw:
        return self._buffer(nbytes, cl.mem_flags.READ_ONLY)

    def _is_read_only(self, raw: _Raw) -> bool:
        return bool(raw.buffer.flags & cl.mem_flags.READ_ONLY)

    def _buffer(self, nbytes: int, flags: int) -> _Raw:
        """A new buffer of `nbytes` with the given `cl.mem_flags`, at a fresh address."""
        if nbytes > self.cl_device.max_mem_alloc_size:
            raise MemoryError(f"cannot allocate {nbytes} bytes on {self.name}: its largest "
                              f"buffer is {self.cl_device.max_mem_alloc_size} bytes")
        try:
            buffer = cl.Buffer(self.context, flags, max(nbytes, 1))
        except cl.Error as exc:
            raise MemoryError(f"cannot allocate {nbytes} bytes on {self.name}: {exc}") from exc
        with self._lock:
            address = self._next_address
            self._next_address += -(-max(nbytes, 1) // self.alignment) * self.alignment
        return _Raw(buffer, nbytes, address)

    def _raw_free(self, raw: _Raw) -> None:
        # NOTE: OpenCL keeps the memory until the commands already queued on it have run.
        raw.buffer.release()

    def _copyin(self, raw: _Raw, offset: int, host_bytes: np.ndarray) -> None:
        if host_bytes.size:
            cl.enqueue_copy(self.queue, raw.buffer, host_bytes, dst_offset=offset,
                            is_blocking=True)

    def _copyout(self, raw: _Raw, offset: int, nbytes: int) -> np.ndarray:
        host = np.empty(nbytes, np.uint8)
        if nbytes:
            cl.enqueue_copy(self.queue, host, raw.buffer, src_offset=offset, is_blocking=True)
        return host

    def _array_view(self, raw: _Raw, offset, shape, dtype, strides) -> Any:
        return cla.Array(self.queue, shape, dtype, strides=strides, data=raw.buffer,
                         offset=offset)

    def _address(self, raw: _Raw) -> int:
        return raw.address

    def _nbytes_of(self, raw: _Raw) -> int:
        return raw.nbytes

    def _to_host(self, view: Any) -> np.ndarray:
        if view.size == 0:
            return np.empty(view.shape, view.dtype)
        # read the byte span the view covers, then pick its elements on the host
        low = sum(s * (n - 1) for s, n in zip(view.strides, view.shape) if s < 0)
        high = sum(s * (n - 1) for s, n in zip(view.strides, view.shape) if s > 0)
        span = np.empty(high - low + view.dtype.itemsize, np.uint8)
        cl.enqueue_copy(self.queue, span, view.base_data, src_offset=view.offset + low,
                        is_blocking=True)
        picked = np.ndarray(view.shape, view.dtype, buffer=span, offset=-low,
                            strides=view.strides)
        return picked.copy()

    # ----------------------------------------------------------------- kernels
    def _type(self, dtype: np.dtype) -> str:
        ctype = _FLOAT_TYPES.get(dtype)
        if ctype is None:
            raise TypeError(f"{self.name} kernels support float32 and float64, got {dtype}")
        if ctype == "double" and not self.fp64:
            raise TypeError(f"{self.name} ({self.cl_device.name}) has no float64 support "
                            f"(cl_khr_fp64); use float32")
        return ctype

    def _compute(self, dtype: np.dtype) -> str:
        """The C type kernels compute `dtype` in: float for the two-byte floats (HALVES), whose
        loads widen exactly and whose stores round once, else `dtype`'s own (`_type`)."""
        return "float" if dtype in HALVES else self._type(dtype)

    def _kernel(self, key: tuple, source: Any) -> Any:
        """The kernel built from `source()` (OpenCL C defining `k`), cached under `key`, which
        determines the source."""
        kernel = self._kernels.get(key)
        if kernel is not None:
            self._hits += 1
            return kernel
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                text = source()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", cl.CompilerWarning)
                    kernel = cl.Program(self.context, text).build(self._build_options).k
                # NOTE: typed scalar arguments take plain ints and set ~20x faster than NumPy's
                kernel.set_scalar_arg_dtypes(_scalar_types(text))
                self._kernels[key] = kernel
                self._misses += 1
            return kernel

    def _run(self, kernel: Any, size: tuple, local: tuple | None, *args: Any) -> None:
        with self._lock:  # NOTE: a kernel's arguments are shared state until it is enqueued
            kernel(self.queue, size, local, *args)

    def _elementwise(self, op: str, expr: str, operands: list, out: Any, ctype: str,
                     bits: bool = False) -> None:
        """out = expr(x0, x1, ...) computed in `ctype`, where each operand is a view (of any
        float dtype: `_storage` loads and stores it) or a NumPy scalar; `bits`: `ctype` is the
        unsigned type of out's item size, and every view is moved as such."""
        self._elementwise_launch(op, expr, operands, out, ctype, bits)()

    def _elementwise_launch(self, op: str, expr: str, operands: list, out: Any, ctype: str,
                            bits: bool = False) -> Callable[[], None]:
        """`_elementwise` set up: its kernel found or built and its arguments made, as a
        function that enqueues it (a fused chain's replays run it again)."""
        if out.size == 0:
            return _nothing
        views = [x for x in operands if isinstance(x, cla.Array)]
        if bits:
            io = [(ctype, "{p}[{i}]", "{p}[{i}] = v")] * (len(views) + 1)
        else:
            io = [_storage(v.dtype) for v in [out, *views]]
        offsets, strides = zip(*(_elements(v) for v in [out, *views]))
        dims, steps = _collapse(out.shape, list(strides))
        if not dims:
            dims, steps = [1], [[0] for _ in steps]
        ndim = len(dims)
        # NOTE: a view that every work item reads at the same element ("b": all strides 0) is
        # loaded without walking; PoCL does not vectorise stride-0 walks (7x slower measured)
        walked = [True] + [any(step) for step in steps[1:]]
        kinds, v = "", 1
        for x in operands:
            if isinstance(x, cla.Array):
                kinds += "v" if walked[v] else "b"
                v += 1
            else:
                kinds += "s"
        key = ("elementwise", op, ctype, ndim, kinds, tuple(io))
        kernel = self._kernel(key, lambda: _elementwise_source(expr, ctype, kinds, ndim, io))
        args: list[Any] = [out.base_data, offsets[0]]
        v = 1
        for x in operands:
            if isinstance(x, cla.Array):
                args += [x.base_data, offsets[v]]
                v += 1
            else:  # NOTE: a number meets a two-byte float as float32 (ops._scalar)
                args.append(x)
        n = math.prod(dims)
        args += [n, *dims, *(s for step, walk in zip(steps, walked) if walk for s in step)]
        return functools.partial(self._run, kernel, (-(-n // GROUP) * GROUP,), (GROUP,), *args)

    def _unary(self, name, x, out) -> None:
        if name == "copy":  # moves bits: any dtype of 1, 2, 4 or 8 bytes
            ctype = _BITS_TYPES.get(out.dtype.itemsize)
            if ctype is None:
                raise TypeError(f"{self.name} cannot copy {out.dtype} "
                                f"({out.dtype.itemsize}-byte elements)")
            self._elementwise(name, _formula(name, ctype), [x], out, ctype, bits=True)
        else:
            self._table_op(name, [x], out)

    def _binary(self, name, a, b, out) -> None:
        self._table_op(name, [a, b], out)

    def _ternary(self, name, a, b, c, out) -> None:
        self._table_op(name, [a, b, c], out)

    def _table_op(self, name: str, operands: list, out: Any) -> None:
        ctype = self._compute(out.dtype)
        self._elementwise(name, _formula(name, ctype), operands, out, ctype)

    def _cast(self, x, out) -> None:
        if out.size == 0:
            return
        if np.dtype("float64") in (x.dtype, out.dtype):
            self._type(np.dtype("float64"))  # TypeError where the device has no cl_khr_fp64
        offsets, strides = zip(*(_elements(v) for v in (out, x)))
        dims, steps = _collapse(out.shape, list(strides))
        if not dims:
            dims, steps = [1], [[0], [0]]
        double = np.dtype("float64") in (x.dtype, out.dtype)
        src, dst = _storage(x.dtype), _storage(out.dtype, double)
        kernel = self._kernel(("cast", x.dtype.str, out.dtype.str, len(dims)),
                              lambda: _cast_source(src, dst, len(dims)))
        n = math.prod(dims)
        self._run(kernel, (-(-n // GROUP) * GROUP,), (GROUP,), out.base_data, offsets[0],
                  x.base_data, offsets[1], n, *dims, *(s for step in steps for s in step))

    def _compile_fused(self, program, inputs, out) -> Callable[[], None] | None:
        """A fused elementwise chain as one generated kernel: each link's expression is inlined
        into the next, so nothing but the inputs and `out` touches memory. The program is
        cached by its expression (kernel_cache_stats counts the hits, once per preparation).
        Two-byte floats compute in float, each two-byte link rounded to its dtype in registers,
        as its own kernel would round it; a chain that mixes float64 with another dtype runs
        the blocked default (None)."""
        ctype = self._fused_type(program, inputs, out)
        if ctype is None:
            return None
        number = np.float64 if ctype == "double" else np.float32
        operands: list[Any] = []
        links: list[str] = []

        def name_of(kind: str, ref: Any) -> str:
            if kind == "link":
                return f"({links[ref]})"
            operands.append(inputs[ref] if kind == "input" else number(ref))
            return f"x{len(operands) - 1}"

        render = _OpenCLC(ctype)
        for i, (name, args, dtype) in enumerate(program):
            link = render.op(name, [name_of(kind, ref) for kind, ref in args])
            last = i == len(program) - 1 and np.dtype(dtype) == out.dtype  # out's store rounds
            if np.dtype(dtype) in _ROUND and not last:
                link = f"{_ROUND[np.dtype(dtype)]}({link})"
            links.append(link)
        return self._elementwise_launch(f"fused {links[-1]}", links[-1], operands, out, ctype)

    def _fused_type(self, program, inputs, out) -> str | None:
        """The C type a fused chain computes in, or None for the blocked default: one dtype
        throughout, or two-byte floats mixed with float32 (all computed in float)."""
        dtypes = {np.dtype(dtype) for _, _, dtype in program} | {x.dtype for x in inputs}
        if dtypes == {out.dtype}:
            return self._compute(out.dtype)
        if dtypes | {out.dtype} <= {*HALVES, np.dtype("float32")}:
            return "float"
        return None

    def _reduce(self, name, x, axis, keepdims, out) -> None:
        ctype = self._compute(x.dtype)
        if out.size == 0:
            return
        axes = range(x.ndim) if axis is None else axis
        kept = [i for i in range(x.ndim) if i not in axes]
        offset_x, strides_x = _elements(x)
        offset_o, strides_o = _elements(out)
        out_strides = [strides_o[i] for i in kept] if keepdims else list(strides_o)
        kdims, ksteps = _collapse(tuple(x.shape[i] for i in kept),
                                  [tuple(strides_x[i] for i in kept), tuple(out_strides)])
        rdims, rsteps = _collapse(tuple(x.shape[i] for i in axes),
                                  [tuple(strides_x[i] for i in axes)])
        n_out, n_red = math.prod(kdims), math.prod(rdims)
        acc = "double" if self.fp64 else ctype
        io_x, io_out = _storage(x.dtype), _storage(out.dtype)
        key = ("reduce", name, ctype, len(kdims), len(rdims), io_x, io_out)
        kernel = self._kernel(key, lambda: _reduce_source(name, ctype, acc, len(kdims),
                                                          len(rdims), io_x, io_out))
        numbers = [n_out, n_red, *kdims, *ksteps[0], *ksteps[1], *rdims, *rsteps[0]]
        self._run(kernel, (-(-n_out // GROUP) * GROUP,), (GROUP,), out.base_data, offset_o,
                  x.base_data, offset_x, *numbers)

    def _moments(self, x, mean, m2) -> None:
        self._channel_stats("moments", (x,), (mean, m2))

    def _channel_dots(self, g, y, sums, dots) -> None:
        self._channel_stats("channel_dots", (g, y), (sums, dots))

    def _channel_stats(self, name: str, inputs: tuple, outputs: tuple) -> None:
        """`moments` and `channel_dots` (float32 / float64 views; the base widens halves): one
        work item per channel, which sums its samples in order, in double where the device
        has it (`_stats_source`)."""
        n, c, s = inputs[0].shape
        if c == 0:
            return
        ctype = self._type(outputs[0].dtype)
        acc = "double" if self.fp64 else ctype
        kernel = self._kernel(("stats", name, ctype, acc),
                              lambda: _stats_source(name, ctype, acc))
        args: list = []
        for position, view in enumerate((*outputs, *inputs)):
            offset, strides = _elements(view)
            args += [view.base_data, offset, *(strides[1:2] if position < 2 else strides)]
        self._run(kernel, (-(-c // GROUP) * GROUP,), (GROUP,), *args, n, c, s)

    def _reduce_max(self, x, axis, keepdims, out) -> None:
        self._reduce("max", x, axis, keepdims, out)  # NOTE: the reductions' kernel, a max step

    def _matmul(self, a, b, out) -> None:
        self._product(a, b, out, 1.0, 0.0)

    def _gemm(self, a, b, out, alpha, beta) -> None:
        self._product(a, b, out, alpha, beta)

    def _product(self, a, b, out, alpha: float, beta: float) -> None:
        """out = alpha * a @ b + beta * out (out not read when beta is 0), NumPy's matmul rules
        for 1-D and batched operands. The plain kernel reads each element of a and b n and m
        times: a float16 operand is widened once first (its load is a dozen integer operations,
        bfloat16's a shift); the tiled one loads each into local memory once per tile."""
        if not self.tiled_gemm and 0 not in out.shape:
            a, b = (self._widened(v) if v.dtype == np.float16 else v for v in (a, b))
        ctype = self._compute(out.dtype)
        (oa, sa), (ob, sb), (oc, sc) = _elements(a), _elements(b), _elements(out)
        a_shape, b_shape, c_shape = a.shape, b.shape, out.shape
        if a.ndim == 1:  # NumPy's rules: a row, b a column, the extra output dim dropped
            a_shape, sa = (1,) + a_shape, (0,) + sa
            c_shape, sc = c_shape[:-1] + (1,) + c_shape[-1:], sc[:-1] + (0,) + sc[-1:]
        if b.ndim == 1:
            b_shape, sb = b_shape + (1,), sb + (0,)
            c_shape, sc = c_shape + (1,), sc + (0,)
        (m, k), n = a_shape[-2:], b_shape[-1]
        if m == 0 or n == 0 or 0 in c_shape:
            return
        scalar = np.float64 if ctype == "double" else np.float32
        batch = c_shape[:-2]
        batch_strides = [sc[:-2]]
        for shape, strides in ((a_shape, sa), (b_shape, sb)):
            pad = len(batch) - (len(shape) - 2)
            batch_strides.append(tuple(0 if i < pad or shape[i - pad] == 1 else strides[i - pad]
                                       for i in range(len(batch))))
        bdims, bsteps = _collapse(batch, batch_strides)
        nbatch = math.prod(bdims)
        io = tuple(_storage(v.dtype) for v in (out, a, b))
        key = ("matmul", ctype, len(bdims), self.tiled_gemm, io)
        kernel = self._kernel(key, lambda: _matmul_source(ctype, len(bdims), self.tiled_gemm,
                                                          io))
        numbers = [m, n, k, sa[-2], sa[-1], sb[-2], sb[-1], sc[-2], sc[-1], *bdims,
                   *(s for step in bsteps for s in step)]
        size = (-(-n // TILE) * TILE, -(-m // TILE) * TILE, nbatch)
        self._run(kernel, size, (TILE, TILE, 1), out.base_data, oc, a.base_data, oa,
                  b.base_data, ob, *numbers, scalar(alpha), scalar(beta))

    def _labels_type(self, labels: Any) -> str:
        ltype = _INT_TYPES.get(labels.dtype)
        if ltype is None:
            raise TypeError(f"cross_entropy: labels must be integers, got {labels.dtype}")
        return ltype

    def _cross_entropy(self, logits, labels, losses, probs) -> None:
        ctype, ltype = self._type(losses.dtype), self._labels_type(labels)
        io = _storage(logits.dtype)  # NOTE: half logits load as they are (`_in_float32`)
        rows, classes = logits.shape
        if rows == 0:
            return
        # NOTE: Note [checked before written] in backends/base.py: a check kernel flags the first
        # bad label and the loss kernel, queued after it, writes nothing once one is flagged.
        # Still one host wait (the flag read back); the reset is not waited for.
        check = self._kernel(("cross_entropy_labels", ltype), lambda: _labels_source(ltype))
        kernel = self._kernel(("cross_entropy", ctype, ltype, io),
                              lambda: _xent_source(ctype, ltype, io))
        offset, (stride,) = _elements(labels)
        size = (-(-rows // GROUP) * GROUP,)
        first_bad = np.empty(1, np.int32)
        with self._lock:
            if self._flag is None:
                self._flag = cl.Buffer(self.context, cl.mem_flags.READ_WRITE, 4)
            cl.enqueue_copy(self.queue, self._flag, _NO_BAD_ROW, is_blocking=False)
            self._run(check, size, (GROUP,), self._flag, rows, classes, labels.base_data,
                      offset, stride)
            self._run(kernel, size, (GROUP,), self._flag,
                      *_xent_args(rows, classes, (losses, probs, logits, labels)))
            cl.enqueue_copy(self.queue, first_bad, self._flag, is_blocking=True)
        if first_bad[0] != _NO_BAD_ROW[0]:
            self._raise_bad_label(labels, int(first_bad[0]), classes)

    def _raise_bad_label(self, labels: Any, start: int, classes: int) -> None:
        """ValueError naming the first label outside [0, classes) at or after row `start`
        (the check kernel's row; rows past INT_MAX - 1 report INT_MAX - 1), as the CPU's."""
        host = self._to_host(labels[start:])
        bad = host[(host < 0) | (host >= classes)][0]
        raise ValueError(f"cross_entropy: label {bad} is outside [0, {classes}) for "
                         f"{classes} classes")

    def _cross_entropy_backward(self, probs, labels, grad, out) -> None:
        ctype, ltype = self._type(out.dtype), self._labels_type(labels)
        io = (_storage(probs.dtype), _storage(grad.dtype))
        rows, classes = out.shape
        if rows * classes == 0:
            return
        kernel = self._kernel(("cross_entropy_backward", ctype, ltype, io),
                              lambda: _xent_backward_source(ctype, ltype, *io))
        args = _xent_args(rows, classes, (out, probs, labels, grad))
        total = rows * classes
        self._run(kernel, (-(-total // GROUP) * GROUP,), (GROUP,), *args)

    def _gather(self, table, indices, out) -> None:
        # NOTE: moves bits, as the copy kernel: any dtype, as the unsigned type of its size
        ctype = _BITS_TYPES[out.dtype.itemsize]
        ltype = self._index_type(indices)
        n, cols = out.shape
        if n * cols == 0:
            return
        kernel = self._kernel(("gather", ctype, ltype), lambda: _gather_source(ctype, ltype))
        args = _xent_args(n, cols, (out, table, indices))
        self._run(kernel, (-(-(n * cols) // GROUP) * GROUP,), (GROUP,), *args)

    def _scatter_add(self, src, indices, out) -> None:
        # NOTE: one work item per column adds the rows in index order: the CPU's np.add.at,
        # one IEEE addition at a time, so the same bits (two-byte src loads as it is; a
        # two-byte out comes as float32 scratch: `Device.scatter_add`)
        ctype, ltype = self._type(out.dtype), self._index_type(indices)
        io = (_storage(out.dtype), _storage(src.dtype))
        n, cols = src.shape
        if n * cols == 0:
            return
        kernel = self._kernel(("scatter_add", ctype, ltype, io),
                              lambda: _scatter_add_source(ctype, ltype, *io))
        args = _xent_args(n, cols, (out, src, indices))
        self._run(kernel, (-(-cols // GROUP) * GROUP,), (GROUP,), *args)

    def _index_type(self, indices: Any) -> str:
        ltype = _INT_TYPES.get(indices.dtype)
        if ltype is None:
            raise TypeError(f"indices must be integers, got {indices.dtype}")
        return ltype


def _xent_args(rows: int, classes: int, views: Sequence[Any]) -> list[Any]:
    """The cross-entropy kernels' arguments: the sizes, then buffer, offset and strides (in
    elements) of each view, in the kernel's parameter order."""
    args: list[Any] = [rows, classes]
    for view in views:
        offset, strides = _elements(view)
        args += [view.base_data, offset, *strides]
    return args


# ---------------------------------------------------------------------- kernel sources
def _header(ctype: str) -> str:
    # NOTE: PoCL's float tanh(-500) is -0.99999994, not -1; past 20 tanh rounds to +-1 in both
    # precisions, so saturate there (NaN still goes through tanh).
    # NOTE: no contraction of a * b + c into one FMA: each op rounds as it would alone, so a
    # fused chain gives bitwise the results of its kernels run one by one.
    return ("#pragma OPENCL FP_CONTRACT OFF\n" + (_FP64 if "double" in ctype else "")
            + f"typedef {ctype} T;\n") + (
        "inline T tanh_(T x) { return fabs(x) > (T)20 ? copysign((T)1, x) : tanh(x); }\n"
        if ctype in ("float", "double") else "") + _HALF_IO


# NOTE: float16 by bit arithmetic, not vload_half / vstore_half_rte: the same bits, and PoCL
# runs those as scalar routines (8.3 and 7.5 ms per 4M elements here, these 1.3 and 1.4 ms).
# Loads are exact; stores round to nearest even, overflow to infinity, NaN stays NaN.
#: OpenCL C: a float16 (`load_f16`, `store_f16`) or bfloat16 (`store_bf16`) from or into its
#: bits, and a float rounded to either and widened back in registers (`round_f16`,
#: `round_bf16`): a fused chain's two-byte links round as their own kernels' stores would.
_HALF_IO = """inline float load_f16(ushort h) {
    uint m = h & 0x3ffu, e = h & 0x7c00u;
    /* a subnormal, m * 2**-24, with m made a float by subtracting 2**23 from 2**23 + m: an
       integer conversion here stops PoCL vectorising a kernel that calls exp (4x slower) */
    float tiny = (as_float(0x4b000000u | m) - 0x1p23f) * 0x1p-24f;
    uint bits = e == 0x7c00u ? 0x7f800000u | (m << 13)
              : e == 0u ? as_uint(tiny) : ((h & 0x7fffu) << 13) + 0x38000000u;
    return as_float(bits | ((uint)(h & 0x8000u) << 16)); }
inline ushort store_f16(float f) {
    uint u = as_uint(f), a = u & 0x7fffffffu;
    uint normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    /* below 2**-14, a multiple of 2**-24: adding 2**23 rounds a * 2**24 to an integer (ties
       to even) in the low bits; rint does the same, as a scalar call on PoCL */
    uint tiny = as_uint(as_float(a) * 0x1p24f + 0x1p23f) - 0x4b000000u;
    uint h = a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu)
           : a >= 0x477ff000u ? 0x7c00u : a >= 0x38800000u ? normal : tiny;
    return (ushort)(((u >> 16) & 0x8000u) | h); }
inline ushort store_bf16(float f) {
    uint u = as_uint(f);
    return isnan(f) ? (ushort)((u >> 16) | 0x40u)
                    : (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); }
inline float round_f16(float v) { return load_f16(store_f16(v)); }
inline float round_bf16(float v) { return as_float((uint)store_bf16(v) << 16); }
"""
_ROUND = {np.dtype("float16"): "round_f16", BFLOAT16: "round_bf16"}


def _nothing() -> None:
    """The launch of a kernel over no elements."""


@functools.cache  # NOTE: asked once per operand of every launch
def _storage(dtype: np.dtype, double: bool = False) -> tuple[str, str, str]:
    """(pointer type, load of element {i} of {p} as a value, store of value v there) of a dtype,
    {p} and {i} to be filled in: float16 and bfloat16 as their bits (`_HALF_IO`, core OpenCL,
    no cl_khr_fp16; bfloat16 a float's upper 16 bits), rounded to nearest even (NaN stays NaN),
    as NumPy and ml_dtypes do; `double`: v is a double, which float16 rounds from directly
    (bfloat16 goes through float32, as ml_dtypes does)."""
    if dtype == np.float16:
        if double:
            return "half", "vload_half({i}, {p})", "vstore_half_rte(v, {i}, {p})"
        return "ushort", "load_f16({p}[{i}])", "{p}[{i}] = store_f16(v)"
    if dtype == BFLOAT16:
        return "ushort", "as_float((uint){p}[{i}] << 16)", "{p}[{i}] = store_bf16((float)v)"
    if dtype == np.bool_:
        return "uchar", "{p}[{i}]", "{p}[{i}] = (uchar)(v != 0)"
    ctype = {**_FLOAT_TYPES, **_INT_TYPES}[dtype]
    return ctype, "{p}[{i}]", f"{{p}}[{{i}}] = ({ctype})v"


def _cast_source(src: tuple[str, str, str], dst: tuple[str, str, str], ndim: int) -> str:
    """A kernel that converts each element of `in` (storage `src`) into `out` (`dst`)."""
    wide = "double" if "double" in (src[0], dst[0]) else "float"
    if src[0] not in ("half", "ushort", "float", "double"):  # an integer or bool source
        wide = src[0] if dst[0] not in ("half", "ushort", "float", "double") else wide
    load = src[1].format(p="in", i="in_o")
    store = dst[2].format(p="out", i="out_o")
    strides = [f"{p}_s{d}" for p in ("out_o", "in_o") for d in range(ndim)]
    return f"""{_FP64 if wide == "double" else ""}{_HALF_IO}
__kernel void k(__global {dst[0]}* out, long out_o, __global const {src[0]}* in, long in_o,
                long n{_longs([f"n{d}" for d in range(ndim)])}{_longs(strides)})
{{
    long i = get_global_id(0);
    if (i >= n) return;
{_walk("i", "n", ["out_o", "in_o"], ndim)}
    {wide} v = ({wide})({load});
    {store};
}}
"""


def _elementwise_source(expr: str, ctype: str, kinds: str, ndim: int,
                        io: Sequence[tuple[str, str, str]]) -> str:
    """out = expr(x0, x1, ...) computed in `ctype`; io[0] is out's storage, io[1:] each array
    operand's (`_storage`): a two-byte float loads into float and rounds once as it is stored."""
    params = [f"__global {io[0][0]}* out, long out_o"]
    loads = []
    pointers = ["out_o"]
    arrays = iter(io[1:])
    for i, kind in enumerate(kinds):
        if kind == "s":
            params.append(f"T x{i}")
        else:
            storage, load, _ = next(arrays)
            params.append(f"__global const {storage}* in{i}, long in{i}_o")
            if kind == "v":  # "b": one element for every work item, not walked
                pointers.append(f"in{i}_o")
            loads.append(f"    T x{i} = {load.format(p=f'in{i}', i=f'in{i}_o')};")
    strides = [f"{p}_s{d}" for p in pointers for d in range(ndim)]
    return f"""{_header(ctype)}
__kernel void k({", ".join(params)}, long n{_longs([f"n{d}" for d in range(ndim)])}
                {_longs(strides)})
{{
    long i = get_global_id(0);
    if (i >= n) return;
{_walk("i", "n", pointers, ndim)}
{chr(10).join(loads)}
    T v = {expr};
    {io[0][2].format(p="out", i="out_o")};
}}
"""


#: Each reduction's start and step on `total` (of type A) with the element `v`: max keeps a
#: NaN once it meets one (v > total is false for a NaN on either side), as np.max and torch.amax
_REDUCE_STEPS = {"sum": ("0", "total += v;"), "mean": ("0", "total += v;"),
                 "max": ("-INFINITY", "total = (isnan(total) || total >= v) ? total : v;")}


def _reduce_source(name: str, ctype: str, acc: str, nkept: int, nred: int,
                   io_x: tuple[str, str, str], io_out: tuple[str, str, str]) -> str:
    kept = [f"k{d}" for d in range(nkept)]
    kept_steps = [f"x_o_s{d}" for d in range(nkept)] + [f"out_o_s{d}" for d in range(nkept)]
    red = [f"r{d}" for d in range(nred)]
    red_steps = [f"p_s{d}" for d in range(nred)]
    result = "total / (A)n_red" if name == "mean" else "total"
    start, step = _REDUCE_STEPS[name]
    return f"""{_header(ctype)}{_FP64 if acc == "double" else ""}typedef {acc} A;
__kernel void k(__global {io_out[0]}* out, long out_o, __global const {io_x[0]}* x, long x_o,
                long n_out, long n_red{_longs(kept + kept_steps + red + red_steps)})
{{
    long i = get_global_id(0);
    if (i >= n_out) return;
{_walk("i", "k", ["x_o", "out_o"], nkept)}
    A total = {start};
    for (long j = 0; j < n_red; j++) {{
        long p = x_o;
{_walk("j", "r", ["p"], nred)}
        A v = ({ctype}){io_x[1].format(p="x", i="p")};
        {step}
    }}
    T v = (T)({result});
    {io_out[2].format(p="out", i="out_o")};
}}
"""


def _stats_source(name: str, ctype: str, acc: str) -> str:
    """OpenCL C of `moments` (the mean, then a second pass for the squares around it) or
    `channel_dots` (the sums of g and of g * y in one pass): work item k sums channel k of
    (n, c, s) inputs, samples in order."""
    dots = name == "channel_dots"
    inputs = "".join(f", __global const T* {p}, long {p}_o, long {p}_sn, long {p}_sc, long {p}_ss"
                     for p in (("a", "b") if dots else ("a",)))

    def walk(body: str) -> str:  # NOTE: every element of channel k; p into a (q into b)
        at = "".join(f"        long {q} = {v}_o + i * {v}_sn + k * {v}_sc + j * {v}_ss;\n"
                     for q, v in (("p", "a"), ("q", "b"))[:2 if dots else 1])
        return (f"    for (long i = 0; i < n; i++) for (long j = 0; j < s; j++) {{\n{at}"
                f"        {body}\n    }}\n")

    if dots:
        passes = walk("total += (A)a[p]; second += (A)a[p] * (A)b[q];")
        first = "total"
    else:
        passes = (walk("total += (A)a[p];") + "    A centre = total / ((A)n * (A)s);\n"
                  + walk("A d = (A)a[p] - centre; second += d * d;"))
        first = "centre"
    return f"""{_header(ctype)}{_FP64 if acc == "double" else ""}typedef {acc} A;
__kernel void k(__global T* o1, long o1_o, long o1_s, __global T* o2, long o2_o, long o2_s
                {inputs}, long n, long c, long s)
{{
    long k = get_global_id(0);
    if (k >= c) return;
    A total = 0, second = 0;
{passes}    o1[o1_o + k * o1_s] = (T)({first});
    o2[o2_o + k * o2_s] = (T)second;
}}
"""


def _matmul_source(ctype: str, nbatch: int, tiled: bool,
                   io: Sequence[tuple[str, str, str]]) -> str:
    """c = alpha * a @ b + beta * c in `ctype`; io is the storage of c, a and b (`_storage`)."""
    batch = [f"b{d}" for d in range(nbatch)]
    steps = [f"{p}_s{d}" for p in ("c_o", "a_o", "b_o") for d in range(nbatch)]
    io_c, io_a, io_b = io
    if tiled:  # TS x TS tiles of a and b in local memory, one output element per work item
        at = io_a[1].format(p="a", i="a_o + row * am + ka * ak")
        bt = io_b[1].format(p="b", i="b_o + kb * bk + col * bn")
        body = f"""
    __local T at[TS][TS];
    __local T bt[TS][TS + 1];
    int lr = get_local_id(1), lc = get_local_id(0);
    for (long t = 0; t < K; t += TS) {{
        long ka = t + lc, kb = t + lr;
        at[lr][lc] = row < M && ka < K ? (T){at} : (T)0;
        bt[lr][lc] = kb < K && col < N ? (T){bt} : (T)0;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int q = 0; q < TS; q++) total += at[lr][q] * bt[q][lc];
        barrier(CLK_LOCAL_MEM_FENCE);
    }}"""
    else:
        a = io_a[1].format(p="a", i="a_o + row * am + q * ak")
        b = io_b[1].format(p="b", i="b_o + q * bk + col * bn")
        body = f"""
    if (row >= M || col >= N) return;
    for (long q = 0; q < K; q++)
        total += (T){a} * (T){b};"""
    return f"""{_header(ctype)}#define TS {TILE}
__kernel __attribute__((reqd_work_group_size(TS, TS, 1)))
void k(__global {io_c[0]}* c, long c_o, __global const {io_a[0]}* a, long a_o,
       __global const {io_b[0]}* b, long b_o,
       long M, long N, long K, long am, long ak, long bk, long bn, long cm, long cn
       {_longs(batch + steps)}, T alpha, T beta)
{{
    long row = get_global_id(1), col = get_global_id(0);
    long z = get_global_id(2);
{_walk("z", "b", ["c_o", "a_o", "b_o"], nbatch)}
    T total = 0;{body}
    if (row >= M || col >= N) return;
    long at_c = c_o + row * cm + col * cn;
    T scaled = alpha == (T)1 ? total : alpha * total;
    T v = beta == (T)0 ? scaled : scaled + beta * (T){io_c[1].format(p="c", i="at_c")};
    {io_c[2].format(p="c", i="at_c")};
}}
"""


def _labels_source(ltype: str) -> str:
    """The label check run before the loss kernel: the first row whose label lies outside
    [0, classes) goes into `first_bad` (rows past INT_MAX - 1 count as INT_MAX - 1)."""
    return f"""typedef {ltype} L;
__kernel void k(__global int* first_bad, long rows, long classes,
                __global const L* labels, long l_o, long l_s)
{{
    long i = get_global_id(0);
    if (i >= rows) return;
    long label = (long)labels[l_o + i * l_s];
    if (label < 0 || label >= classes) atomic_min(first_bad, (int)min(i, (long)INT_MAX - 1));
}}
"""


def _xent_source(ctype: str, ltype: str, io_x: tuple[str, str, str]) -> str:
    """The losses and probabilities in `ctype` from logits x of storage `io_x` (`_storage`)."""
    def x(i: str) -> str:
        return io_x[1].format(p="row", i=i)

    return f"""{_header(ctype)}typedef {ltype} L;
__kernel void k(__global const int* first_bad, long rows, long classes,
                __global T* loss, long loss_o, long loss_s,
                __global T* p, long p_o, long p_r, long p_c,
                __global const {io_x[0]}* x, long x_o, long x_r, long x_c,
                __global const L* labels, long l_o, long l_s)
{{
    long i = get_global_id(0);
    if (i >= rows || *first_bad != INT_MAX) return;  // a bad label anywhere: write nothing
    long label = (long)labels[l_o + i * l_s];
    __global const {io_x[0]}* row = x + x_o + i * x_r;
    __global T* prob = p + p_o + i * p_r;
    T top = {x("0")};
    for (long j = 1; j < classes; j++) top = fmax(top, (T){x("j * x_c")});
    T total = 0;
    for (long j = 0; j < classes; j++) {{
        T e = exp((T){x("j * x_c")} - top);
        prob[j * p_c] = e;
        total += e;
    }}
    for (long j = 0; j < classes; j++) prob[j * p_c] /= total;
    loss[loss_o + i * loss_s] = log(total) - ((T){x("label * x_c")} - top);
}}
"""


def _xent_backward_source(ctype: str, ltype: str, io_p: tuple[str, str, str],
                          io_g: tuple[str, str, str]) -> str:
    """The logits' gradient in `ctype` from probabilities and a gradient of storage `io_p` and
    `io_g` (`_storage`)."""
    p = io_p[1].format(p="p", i="p_o + r * p_r + c * p_c")
    g = io_g[1].format(p="g", i="g_o + r * g_s")
    return f"""{_header(ctype)}typedef {ltype} L;
__kernel void k(long rows, long classes, __global T* out, long o_o, long o_r, long o_c,
                __global const {io_p[0]}* p, long p_o, long p_r, long p_c,
                __global const L* labels, long l_o, long l_s,
                __global const {io_g[0]}* g, long g_o, long g_s)
{{
    long i = get_global_id(0);
    if (i >= rows * classes) return;
    long r = i / classes, c = i % classes;
    T hit = (long)labels[l_o + r * l_s] == c ? (T)1 : (T)0;
    out[o_o + r * o_r + c * o_c] = ((T){p} - hit) * (T){g};
}}
"""


def _gather_source(ctype: str, ltype: str) -> str:
    """out[r, c] = table[idx[r], c], moved as `ctype` bits (the indices are checked first)."""
    return f"""typedef {ltype} L;
__kernel void k(long n, long cols, __global {ctype}* out, long o_o, long o_r, long o_c,
                __global const {ctype}* table, long t_o, long t_r, long t_c,
                __global const L* idx, long l_o, long l_s)
{{
    long i = get_global_id(0);
    if (i >= n * cols) return;
    long r = i / cols, c = i % cols;
    long row = (long)idx[l_o + r * l_s];
    out[o_o + r * o_r + c * o_c] = table[t_o + row * t_r + c * t_c];
}}
"""


def _scatter_add_source(ctype: str, ltype: str, io_o: tuple[str, str, str],
                        io_s: tuple[str, str, str]) -> str:
    """out[idx[i], c] += src[i, c] for i in order, one work item per column c."""
    at = "o_o + row * o_r + c * o_c"
    load = io_o[1].format(p="out", i=at)
    add = io_s[1].format(p="src", i="s_o + i * s_r + c * s_c")
    return f"""{_header(ctype)}typedef {ltype} L;
__kernel void k(long n, long cols, __global {io_o[0]}* out, long o_o, long o_r, long o_c,
                __global const {io_s[0]}* src, long s_o, long s_r, long s_c,
                __global const L* idx, long l_o, long l_s)
{{
    long c = get_global_id(0);
    if (c >= cols) return;
    for (long i = 0; i < n; i++) {{
        long row = (long)idx[l_o + i * l_s];
        T v = (T)({load}) + (T)({add});
        {io_o[2].format(p="out", i=at)};
    }}
}}
"""
