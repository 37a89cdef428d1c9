"""Aliasing across Blocks: memory imported with `runtime.from_dlpack` takes part in the out= test.

Two imports of one NumPy array are two Blocks over the same bytes, and so is the import of a
NumPy array over a blockrt tensor's own memory (a round trip through `np.from_dlpack`). The
overlap test must compare them on device addresses, as `np.shares_memory` does, with the same
copy-or-raise policy as views of one Block (docs/aliasing.md, Note [blocks that may share
memory]). Only the CPU device imports host memory, and its matmul (BLAS, beta = 0) corrupts an
overlapping output, so a missed overlap shows up as wrong values, not only as a missing error.

The property reuses test_aliasing's cases (an op on strided views of one buffer, with its NumPy
oracle) and reaches each view through a different route: a plain view of a blockrt tensor, a
view of an import of the whole buffer, or an import of the NumPy view itself. NumPy's own
ufuncs and its matmul fallback buffer overlapping operands, so most wrong answers would be
hidden on the CPU device; the property therefore also watches the kernels: none may be handed an
output that shares memory with an input, other than the identical view of an elementwise op.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_aliasing import (
    ALL_CASES,
    Case,
    ViewSpec,
    aliasing_mode,
    assert_matches_oracle,
    call,
    forbidden_overlap,
)

import allocators
import backends
import runtime
from runtime import aliasing, ops
from runtime.dlpack import ForeignBlock


def square(n: int = 4, dtype: Any = np.float64) -> np.ndarray:
    return (np.arange(n * n).reshape(n, n) % 5 + 1).astype(dtype)


# ---------------------------------------------------------------------- the two reported bugs
def test_matmul_into_a_second_import_of_its_input_gives_numpys_answer():
    base = square()
    expected = base @ base
    a, out = runtime.from_dlpack(base), runtime.from_dlpack(base)
    assert a.block is not out.block  # two Blocks over the same bytes
    ops.matmul(a, a, out=out)
    np.testing.assert_array_equal(base, expected)


def test_matmul_into_a_second_import_of_its_input_raises_and_writes_nothing():
    base = square()
    before = base.copy()
    a, b, out = (runtime.from_dlpack(base) for _ in range(3))
    with aliasing_mode("raise"), pytest.raises(runtime.AliasingError) as caught:
        ops.matmul(a, b, out=out)
    message = str(caught.value)
    assert message.startswith(f"matmul: the output out (block #{out.block.id},")
    for label, t in (("a", a), ("b", b)):
        assert (f"input {label} (block #{t.block.id}, whose memory starts +0 bytes from block "
                f"#{out.block.id}'s" in message)
    np.testing.assert_array_equal(base, before)


@pytest.mark.parametrize("into", ["owner", "import"])
def test_round_trip_through_numpy_is_the_same_memory(into):
    # runtime.from_dlpack(np.from_dlpack(t)) is a second Block over t's memory; either can be out.
    t = runtime.tensor(square())
    back = runtime.from_dlpack(np.from_dlpack(t))
    assert isinstance(back.block, ForeignBlock) and back.block is not t.block
    x, out = (back, t) if into == "owner" else (t, back)
    expected = square() @ square()
    with aliasing_mode("raise"), pytest.raises(runtime.AliasingError, match="^matmul: "):
        ops.matmul(x, x, out=out)
    np.testing.assert_array_equal(t.numpy(), square())
    ops.matmul(x, x, out=out)
    np.testing.assert_array_equal(t.numpy(), expected)


def test_a_view_of_an_import_against_a_shifted_import():
    base = np.linspace(0.5, 2.0, 24)
    expected = base.copy()
    expected[4:20] = base[0:16] * 2
    whole = runtime.from_dlpack(base)
    out = runtime.from_dlpack(base[4:20].reshape(4, 4))  # starts 32 bytes into whole's memory
    x = runtime.view(whole, (4, 4))
    with aliasing_mode("raise"), pytest.raises(runtime.AliasingError,
                                               match=r"whose memory starts -32 bytes from"):
        ops.add(x, x, out=out)
    ops.add(x, x, out=out)
    np.testing.assert_array_equal(base, expected)


# ---------------------------------------------------------------------- what must not raise
def test_interleaved_imports_are_disjoint():
    base = np.arange(16.0)
    evens, odds = runtime.from_dlpack(base[::2]), runtime.from_dlpack(base[1::2])
    with aliasing_mode("raise"):
        ops.add(evens, 0.5, out=odds)
        ops.matmul(runtime.from_dlpack(base[::2].reshape(2, 4)[:, :2]),
                   runtime.from_dlpack(base[::2].reshape(2, 4)[:, 2:]),
                   out=runtime.from_dlpack(base[1::2].reshape(2, 4)[:, :2]))
    expected = np.arange(16.0)
    expected[1::2] = expected[::2] + 0.5
    e, o = expected[::2].reshape(2, 4), expected[1::2].reshape(2, 4)
    o[:, :2] = e[:, :2] @ e[:, 2:]
    np.testing.assert_array_equal(base, expected)


def test_the_identical_view_through_two_imports_runs_in_place():
    base = np.linspace(0.5, 2.0, 12).reshape(3, 4)
    expected = np.exp(base[:, ::2])
    with aliasing_mode("raise"):
        ops.exp(runtime.from_dlpack(base[:, ::2]), out=runtime.from_dlpack(base)[:, ::2])
    np.testing.assert_allclose(base[:, ::2], expected, rtol=1e-12)


def test_a_lazy_output_shares_nothing_with_an_import():
    base = square()
    out = runtime.empty(base.shape, base.dtype)  # no memory until the op writes it
    assert not out.block.allocated
    with aliasing_mode("raise"):
        ops.matmul(runtime.from_dlpack(base), runtime.from_dlpack(base), out=out)
    np.testing.assert_array_equal(out.numpy(), square() @ square())


# ---------------------------------------------------------------------- odd places
def test_misaligned_imports_overlap_by_bytes():
    raw = np.zeros(8 * 6 + 4, np.uint8)
    x = np.ndarray((6,), np.float64, buffer=raw, offset=0)
    y = np.ndarray((6,), np.float64, buffer=raw, offset=4)  # each item straddles two of x's
    x[...] = np.arange(1.0, 7.0)
    assert np.shares_memory(x[::2], y[1::2], max_work=None)
    with aliasing_mode("raise"), pytest.raises(runtime.AliasingError, match="^add: "):
        ops.add(runtime.from_dlpack(x[::2]), 1.0, out=runtime.from_dlpack(y[1::2]))
    assert not np.shares_memory(x[:2], y[2:4], max_work=None)
    with aliasing_mode("raise"):
        ops.add(runtime.from_dlpack(x[:2]), 1.0, out=runtime.from_dlpack(y[2:4]))
    np.testing.assert_array_equal(y[2:4], [2.0, 3.0])


def test_an_imported_out_over_a_constant_is_caught():
    # A constant is read-only, but memory another library shows as writable is out of blockrt's
    # hands; the overlap is still found on addresses and nothing is written.
    pool = runtime.ConstantPool()
    c = runtime.constant(square(), pool=pool)
    shown = np.from_dlpack(c, copy=False)  # NOTE: the constant itself (else a copy)
    assert not shown.flags.writeable
    interface = dict(shown.__array_interface__, data=(shown.ctypes.data, False))
    holder = type("Holder", (), {"__array_interface__": interface, "keep": c})()
    writable = np.asarray(holder)
    with aliasing_mode("raise"), pytest.raises(runtime.AliasingError, match="^matmul: "):
        ops.matmul(c, c, out=runtime.from_dlpack(writable))
    np.testing.assert_array_equal(c.numpy(), square())


@pytest.mark.skipif("cuda" not in backends.available(),
                    reason="no CUDA device (cupy not installed or no GPU)")
def test_cuda_imports_compare_on_device_pointers():
    import cupy as cp

    alloc = allocators.create("caching", "cuda")
    base = cp.asarray(square())
    a, out = (runtime.from_dlpack(base, allocator=alloc) for _ in range(2))
    with aliasing_mode("raise"), pytest.raises(runtime.AliasingError, match="^matmul: "):
        ops.matmul(a, a, out=out)
    ops.matmul(a, a, out=out)
    np.testing.assert_array_equal(out.numpy(), square() @ square())
    t = runtime.tensor(square(), allocator=alloc)
    back = runtime.from_dlpack(cp.from_dlpack(t), allocator=alloc)  # t's own device memory
    with aliasing_mode("raise"), pytest.raises(runtime.AliasingError, match="^matmul: "):
        ops.matmul(back, back, out=t)
    flat = cp.asarray(np.arange(16.0))
    evens, odds = (runtime.from_dlpack(flat[start::2], allocator=alloc) for start in (0, 1))
    with aliasing_mode("raise"):  # interleaved: disjoint
        ops.add(evens, 0.5, out=odds)
    np.testing.assert_array_equal(odds.numpy(), np.arange(0.5, 16.0, 2.0))


# ---------------------------------------------------------------------- the hot path
def test_distinct_plain_blocks_compute_no_address(monkeypatch):
    calls = []
    real = ops._address

    def counted(block: Any) -> int | None:
        calls.append(block)
        return real(block)

    monkeypatch.setattr(ops, "_address", counted)
    a, b = runtime.tensor(square()), runtime.tensor(square())
    out = runtime.empty(a.shape, a.dtype)
    ops.add(a, b, out=out)
    ops.matmul(a, b, out=out)
    ops.add(a, a, out=a)
    assert calls == []
    back = runtime.from_dlpack(np.from_dlpack(a))
    ops.add(back, b, out=out)  # the address path for `back` only, out's address taken once
    assert calls == [out.block, back.block]


# ---------------------------------------------------------------------- the property
ROUTES = ("plain view", "view of an import", "import of the view")


@dataclasses.dataclass
class Routed:
    """A Case whose buffer is a NumPy array (maybe over a blockrt tensor), each view routed."""

    case: Case
    owned: bool          # the buffer is a blockrt tensor's memory, seen through np.from_dlpack
    routes: tuple        # per ViewSpec of operands + (out,): (route, which import of the whole)


@st.composite
def routed_cases(draw: Any) -> Routed:
    case = draw(ALL_CASES)
    owned = draw(st.booleans())
    routes = ROUTES if owned else ROUTES[1:]
    specs = [spec for spec in (*case.operands, case.out) if isinstance(spec, ViewSpec)]
    chosen = tuple((draw(st.sampled_from(routes)), draw(st.integers(0, 1))) for _ in specs)
    return Routed(case, owned, chosen)


def build(routed: Routed) -> tuple[np.ndarray, list, runtime.Tensor, list]:
    """(the buffer as NumPy sees it, the operands, out, handles to keep alive)."""
    case = routed.case
    if routed.owned:
        owner = runtime.tensor(case.data.copy())
        host = np.from_dlpack(owner)
        keep = [owner]
    else:
        host = case.data.copy()
        keep = []
    imports = [runtime.from_dlpack(host) for _ in range(2)]
    routes = iter(routed.routes)
    views = []
    for spec in (*case.operands, case.out):
        if not isinstance(spec, ViewSpec):
            views.append(spec)
            continue
        route, which = next(routes)
        if route == "plain view":
            views.append(spec.tensor(keep[0]))
        elif route == "view of an import":
            views.append(spec.tensor(imports[which]))
        else:
            views.append(runtime.from_dlpack(spec.numpy(host)))
        event(route)
    return host, views[:-1], views[-1], keep + imports


def _identical(x: np.ndarray, out: np.ndarray) -> bool:
    if x.ctypes.data != out.ctypes.data or x.shape != out.shape:
        return False
    return all(n == 1 or a == b for n, a, b in zip(out.shape, x.strides, out.strides))


@contextlib.contextmanager
def kernels_watched() -> Iterator[list[str]]:
    """Record each CPU kernel call whose output shares memory with an input, beyond the identical
    view an elementwise kernel may take in place (the contract in docs/aliasing.md)."""
    device = backends.get_device("cpu")
    seen: list[str] = []

    def watch(kernel: str, in_place_ok: bool) -> None:
        run = getattr(device, kernel)

        def watched(*args: Any, **kwargs: Any) -> None:
            *inputs, out = [x for x in args if isinstance(x, np.ndarray)]
            for x in inputs:
                if in_place_ok and _identical(x, out):
                    continue
                if np.shares_memory(x, out, max_work=None):
                    name = f" {args[0]}" if isinstance(args[0], str) else ""
                    start = min(out.ctypes.data, x.ctypes.data)
                    seen.append(f"{kernel}{name}: out at byte {out.ctypes.data - start} "
                                f"{out.shape} {out.strides} overlaps an input at byte "
                                f"{x.ctypes.data - start} {x.shape} {x.strides}")
            run(*args, **kwargs)

        setattr(device, kernel, watched)

    try:
        for kernel, in_place_ok in (("unary", True), ("binary", True), ("matmul", False),
                                    ("reduce", False)):
            watch(kernel, in_place_ok)
        yield seen
    finally:
        for kernel in ("unary", "binary", "matmul", "reduce"):
            vars(device).pop(kernel, None)


def test_the_kernel_watch_sees_an_overlap():
    x = np.arange(8.0)
    device = backends.get_device("cpu")
    with kernels_watched() as seen:
        device.binary("add", x[:3], x[3:6], x[:3])  # in place on the identical view: allowed
        device.matmul(x[:4].reshape(2, 2), x[:4].reshape(2, 2), x[4:].reshape(2, 2))
        assert seen == []
        device.binary("add", x[:3], x[3:6], x[1:4])  # overlaps both inputs
    assert seen == ["binary add: out at byte 8 (3,) (8,) overlaps an input at byte 0 (3,) (8,)",
                    "binary add: out at byte 0 (3,) (8,) overlaps an input at byte 16 (3,) (8,)"]


@settings(max_examples=150)
@given(routed=routed_cases())
def test_imported_views_are_copy_equivalent(routed):
    host, operands, out, _ = build(routed)
    exhausted = aliasing.budget_exhausted
    with kernels_watched() as seen:
        assert call(routed.case, operands, out) is out
    assert seen == [], "a kernel was handed overlapping operands"
    assert_matches_oracle(routed.case, host.copy())
    assert aliasing.budget_exhausted == exhausted, "the overlap test gave up on its budget"


@settings(max_examples=150)
@given(routed=routed_cases())
def test_imported_views_raise_exactly_on_forbidden_overlap(routed):
    case = routed.case
    host, operands, out, _ = build(routed)
    with aliasing_mode("raise"):
        if forbidden_overlap(case):
            event("raises")
            with pytest.raises(runtime.AliasingError,
                               match=rf"^{case.op}: the output out .* overlaps input"):
                call(case, operands, out)
            np.testing.assert_array_equal(host, case.data)
            return
        event("computes")
        call(case, operands, out)
    assert_matches_oracle(case, host.copy())
