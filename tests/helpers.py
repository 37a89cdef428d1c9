"""Small helpers shared by several test modules."""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


def relu_reference(x: np.ndarray) -> np.ndarray:
    """relu as PyTorch's CPU computes it: +0 where x < 0, else x itself (-0.0 and NaN as they
    are): Note [relu's zero] in backends/base.py. Not np.maximum(x, 0), whose zero's sign
    depends on NumPy's loop."""
    from op_references import REFERENCES

    return REFERENCES["relu"].numpy(np.asarray(x))


def _references(arity: int) -> dict[str, Callable[..., np.ndarray]]:
    from op_references import REFERENCES

    from backends import optable

    return {name: REFERENCES[name].numpy for name in optable.kernels(arity)}


#: What each unary, binary and ternary kernel / op computes, in NumPy (tests/op_references.py,
#: for the kernels of backends/optable.py)
UNARY_REFERENCE = _references(1)
BINARY_REFERENCE = _references(2)
TERNARY_REFERENCE = _references(3)


def to_device(device: Any, host: np.ndarray) -> Any:
    """A C-order native view on `device` holding a copy of the host array `host`."""
    host = np.ascontiguousarray(host)
    raw = device.raw_alloc(host.nbytes)
    device.copyin(raw, 0, host)
    return device.array_view(raw, 0, host.shape, host.dtype, host.strides)


def run_threads(target: Callable[[int], None], workers: int) -> None:
    """Run target(index) in `workers` threads that start together; re-raise the first error.

    (A plain threading.Thread swallows its exception, so a test would only see its effects.)
    """
    start = threading.Barrier(workers)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        start.wait()
        try:
            target(index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def fresh_defaults(allocators: bool = True, pools: bool = True) -> Iterator[None]:
    """No device has a default allocator (and/or constant pool) inside the block; the ones there
    were come back after it, and those made inside are dropped (see runtime.config)."""
    import importlib

    from runtime import config

    constant = importlib.import_module("runtime.constant")  # NOTE: runtime.constant is a function

    names = [name for name, wanted in ((config._ALLOCATOR, allocators), (constant._POOL, pools))
             if wanted]
    saved = {dev: {name: dev.__dict__.pop(name) for name in names if name in dev.__dict__}
             for dev in list(config._with_defaults)}
    try:
        yield
    finally:
        for dev in list(config._with_defaults):
            for name in names:
                dev.__dict__.pop(name, None)
        for dev, attributes in saved.items():
            dev.__dict__.update(attributes)
            config._with_defaults.add(dev)


def assert_rounded_product(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """`got` (a two-byte float a @ b) is the exact product, summed in float32 in some order and
    rounded once: within one step of `got`'s dtype plus twice float32's error bound for a sum
    of k products (k roundings of at most 2**-24 of the running magnitudes; twice, since
    tensor cores are reported to truncate as they add, and 2.02 covers the k**2 term). What a
    GPU's half GEMM (float32 accumulation, its own order) must give."""
    wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
    exact = wide_a @ wide_b
    sums = 2.02 * a.shape[-1] * 2.0**-24 * (np.abs(wide_a) @ np.abs(wide_b))
    bound = np.abs(np.spacing(got)).astype(np.float64) + sums
    error = np.abs(got.astype(np.float64) - exact)
    assert np.all(error <= bound), f"largest error {error.max()} against bound {bound.max()}"


def float_chain(dtype: Any) -> list[tuple[str, tuple, Any]]:
    """A fused program over inputs 0 and 1, every link of one float dtype: products then sums,
    the activations and a derivative, the math library's functions, numbers (the CUDA chain
    tests, and the chains `.ci/cuda_compile.py` compiles)."""
    return [("mul", (("input", 0), ("input", 1)), dtype),
            ("add", (("link", 0), ("number", 0.1)), dtype),
            ("sigmoid", (("link", 1),), dtype),
            ("tanh_backward", (("input", 0), ("link", 2)), dtype),
            ("sub", (("link", 3), ("link", 0)), dtype),
            ("relu", (("link", 4),), dtype), ("tanh", (("link", 5),), dtype),
            ("exp", (("link", 6),), dtype),
            ("mul", (("link", 7), ("number", 3.0)), dtype)]


def half_chain(half: Any) -> list[tuple[str, tuple, Any]]:
    """A fused program over two `half` inputs, ending in `half`: every formula, float32 links
    among the two-byte ones, numbers (as `float_chain`)."""
    f32 = np.dtype("float32")
    return [("mul", (("input", 0), ("input", 1)), half),
            ("add", (("link", 0), ("number", 0.1)), f32),
            ("sigmoid", (("link", 1),), half),
            ("tanh_backward", (("input", 0), ("link", 2)), half),
            ("div", (("link", 3), ("link", 0)), f32), ("relu", (("link", 4),), half),
            ("where_finite", (("link", 5), ("input", 1)), half),
            ("exp", (("link", 6),), f32), ("log", (("link", 7),), half),
            ("sub", (("link", 8), ("number", 3.0)), half), ("sqrt", (("link", 9),), half),
            ("relu_backward", (("input", 1), ("link", 10)), half),
            ("neg", (("link", 11),), half)]


def same_bits(a: Any, b: Any) -> bool:
    """`a` and `b` (Tensors or arrays) have one dtype and shape and equal bits: NaN payloads
    and the sign of zero included."""
    a, b = (np.asarray(x.numpy() if hasattr(x, "numpy") else x) for x in (a, b))
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = f"u{a.dtype.itemsize}"
    return bool(np.array_equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits)))


def pytest_in_pure_python(*args: str, timeout: float | None = None
                          ) -> subprocess.CompletedProcess:
    """pytest run on `args` (files, options) in a fresh process at the checkout's root with
    BLOCKRT_PURE_PYTHON=1: the build without the C extension, as CI checks it."""
    from backends.accelerated import PURE_PYTHON_ENV

    root = pathlib.Path(__file__).resolve().parent.parent
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *args], cwd=root, env={**os.environ, PURE_PYTHON_ENV: "1"},
                          capture_output=True, text=True, timeout=timeout, check=False)


def product_layouts(rng: np.random.Generator, dtype: Any) -> list[tuple]:
    """(a, a's view, b, b's view): host arrays and the view a matrix product meets of each,
    applied alike to the host array and to its device copy: C order, a transposed view
    (backward's x.T), rows of a wider array, one row, one column, an outer product, batches,
    a 2-D operand broadcast over a batch, transposed batches, no rows."""
    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(dtype)

    def same(v: Any) -> Any:
        return v

    def t(v: Any) -> Any:
        return v.T

    def swapped(v: Any) -> Any:
        return v.swapaxes(1, 2)

    return [(r(5, 4), same, r(4, 3), same), (r(4, 5), t, r(4, 3), same),
            (r(5, 4), same, r(3, 4), t), (r(4, 5), t, r(3, 4), t),
            (r(7, 12), lambda v: v[:, 2:6], r(4, 9), lambda v: v[:, :6]),
            (r(1, 4), same, r(4, 3), same), (r(5, 4), same, r(4, 1), same),
            (r(5, 1), same, r(1, 3), same),
            (r(3, 2, 4), same, r(3, 4, 5), same), (r(3, 2, 4), same, r(4, 5), same),
            (r(3, 4, 2), swapped, r(3, 4, 5), same), (r(3, 2, 4), same, r(3, 5, 4), swapped),
            (r(0, 4), same, r(4, 3), same)]
