"""backends/_halfconv.c, the CPU device's float16 / bfloat16 <-> float32 conversions, against
NumPy's and ml_dtypes' casts bit for bit (NaN only as NaN): every two-byte value widened, random
and edge float32 values narrowed, on the F16C / AVX2 path and the portable one. No device is
opened, so `make asan` runs this file under the sanitizers."""

from __future__ import annotations

import itertools
import math
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backends import _erf_gen


@pytest.fixture(params=[True, False], ids=["f16c-avx2", "portable"])
def conv(request):
    module = pytest.importorskip("backends._halfconv", reason="the C conversions are not built")
    module.set_f16c(request.param)
    yield module
    module.set_f16c(True)


def _equal_or_both_nan(got: np.ndarray, want: np.ndarray) -> bool:
    """The same bits, except that a NaN need only meet a NaN."""
    nan = np.isnan(want.astype(np.float32))
    bits = f"u{got.dtype.itemsize}"
    return bool(np.array_equal(np.isnan(got.astype(np.float32)), nan)
                and np.array_equal(got.view(bits)[~nan], want.view(bits)[~nan]))


def test_every_float16_and_bfloat16_widens_as_numpy_does(conv):
    every = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    for widen, dtype in ((conv.widen, np.float16), (conv.widen_bf16, ml_dtypes.bfloat16)):
        out = np.empty(every.size, np.float32)
        widen(every, out)
        assert _equal_or_both_nan(out, every.view(dtype).astype(np.float32))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_float32_narrows_to_nearest_even_as_numpy_does(seed):
    module = pytest.importorskip("backends._halfconv", reason="the C conversions are not built")
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, 50_000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([0x477FF000, 0x477FEFFF, 0x38800000, 0x387FFFFF, 0x33000000, 0x33000001,
                      0x32FFFFFF, 0x7F800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x00000001],
                     np.uint32)
    values = np.concatenate([bits, edges, edges | 0x80000000]).view(np.float32)
    for flag in (True, False):
        module.set_f16c(flag)
        for narrow, dtype in ((module.narrow, np.float16),
                              (module.narrow_bf16, ml_dtypes.bfloat16)):
            out = np.empty(values.size, np.uint16)
            narrow(values, out)
            with np.errstate(all="ignore"):
                assert _equal_or_both_nan(out.view(dtype), values.astype(dtype))
    module.set_f16c(True)


def test_the_conversions_refuse_buffers_that_do_not_match(conv):
    with pytest.raises(ValueError, match="not the same number"):
        conv.widen(np.zeros(4, np.uint16), np.zeros(3, np.float32))
    with pytest.raises((TypeError, BufferError, ValueError)):
        conv.narrow(np.zeros(4, np.float32), np.zeros(8, np.uint16)[::2])  # not contiguous
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        conv.widen(np.zeros(4, np.uint16), frozen)
    with pytest.raises(TypeError):
        conv.widen(np.zeros(4, np.uint16))


# ---------------------------------------------------------------------- apply
def _module() -> Any:
    return pytest.importorskip("backends._halfconv", reason="the C conversions are not built")


def _codes() -> dict[str, int]:
    """apply's and float_op's code of each op, by name (the extension's `ops`, generated from
    backends/optable.py), or none without the extension."""
    try:
        from backends import _halfconv
    except ImportError:
        return {}
    return {name: code for code, name in enumerate(_halfconv.ops)}


#: apply's codes, and each kernel as the NumPy device computes it in float32: its kernels,
#: made from the same table by another renderer (backends/numpy.py), so that C and NumPy are
#: held to each other (no device is opened)
CODES = _codes()


def _float32(name: str) -> Any:
    from backends.numpy import _KERNELS

    if name == "copy":
        return lambda a: a.copy()

    def kernel(*operands: Any) -> np.ndarray:
        shape = np.broadcast_shapes(*(np.shape(x) for x in operands))
        dtype = np.result_type(*[x.dtype for x in operands if isinstance(x, np.ndarray)])
        out = np.empty(shape, dtype)
        _KERNELS[name](*operands, out=out)
        return out
    return kernel


FLOAT32 = {name: _float32(name) for name in CODES}
HALVES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _bits(rng: np.random.Generator, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """Random two-byte patterns of `dtype` (NaN, inf and subnormals included), with edges."""
    bits = rng.integers(0, 2**16, shape, dtype=np.uint32).astype(np.uint16)
    edges = np.array([0, 0x8000, 0x7C00, 0xFC00, 0x7F80, 0xFF80, 0x0001, 0x3C00], np.uint16)
    flat = bits.reshape(-1)
    flat[:min(flat.size, edges.size)] = edges[:flat.size]
    return bits.view(dtype)


def _layout(rng: np.random.Generator, kind: str, dtype: np.dtype, shape: tuple) -> object:
    """An operand for out of `shape`, laid out as `kind` says."""
    rows, cols = shape
    if kind == "contiguous":
        return _bits(rng, shape, dtype)
    if kind == "transposed":
        return np.ascontiguousarray(_bits(rng, (cols, rows), dtype)).T
    if kind == "every other column":
        return _bits(rng, (rows, 2 * cols), dtype)[:, ::2]
    if kind == "broadcast row":
        return np.broadcast_to(_bits(rng, (cols,), dtype), shape)
    if kind == "row, unbroadcast":
        return _bits(rng, (cols,), dtype)
    if kind == "column":
        return _bits(rng, (rows, 1), dtype)
    if kind == "float32":
        return _bits(rng, shape, dtype).astype(np.float32)
    if kind == "number":
        return np.float32(rng.normal(0, 3))
    return float(rng.normal(0, 3))  # a Python float


LAYOUTS = ["contiguous", "transposed", "every other column", "broadcast row", "row, unbroadcast",
           "column", "float32", "number", "python float"]


@pytest.mark.skipif(not CODES, reason="the C conversions are not built")
@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), name=st.sampled_from(sorted(CODES) or ["copy"]),
       dtype=st.sampled_from(HALVES), layouts=st.tuples(*[st.sampled_from(LAYOUTS)] * 2),
       shape=st.sampled_from([(3, 5), (17, 600), (1, 1), (2, 1030)]),
       out_kind=st.sampled_from(["half", "half, every other row", "float32"]),
       flag=st.booleans())
def test_apply_computes_in_float32_and_rounds_once(seed, name, dtype, layouts, shape, out_kind,
                                                    flag):
    """Each kernel on every layout apply takes equals NumPy's float32 kernel on the widened
    operands, rounded once to out's dtype: bit for bit, NaN only as NaN; both CPU paths."""
    module = _module()
    rng = np.random.default_rng(seed)
    arity = module_arity(name)
    operands = [_layout(rng, kind, dtype, shape) for kind in layouts[:arity]]
    if all(not isinstance(x, np.ndarray) for x in operands):
        operands[0] = _bits(rng, shape, dtype)
    out_dtype = np.dtype(np.float32) if out_kind == "float32" else dtype
    if out_kind == "half, every other row":
        out = np.zeros((2 * shape[0], shape[1]), out_dtype)[::2]
    else:
        out = np.zeros(shape, out_dtype)
    module.set_f16c(flag)
    try:
        assert _applied_as_float32(module, name, dtype, operands, out)
    finally:
        module.set_f16c(True)


def _applied_as_float32(module: Any, name: str, dtype: np.dtype, operands: list,
                        out: np.ndarray) -> bool:
    """Whether apply takes the call and writes what NumPy's float32 kernel gives on the
    widened operands, rounded once to out's dtype (NaN only as NaN)."""
    wide = [x.astype(np.float32) if isinstance(x, np.ndarray) else np.float32(x)
            for x in operands]
    with np.errstate(all="ignore"):
        want = np.broadcast_to(FLOAT32[name](*wide), out.shape).astype(out.dtype)
    return bool(module.apply(CODES[name], dtype == HALVES[1], out, *operands)
                and _equal_or_both_nan(out, want))


def module_arity(name: str) -> int:
    from backends import optable

    return optable.BY_NAME[name].arity


@pytest.mark.parametrize("second", ["contiguous", "broadcast row", "number"])
@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("name", sorted(set(CODES) - {"copy"}))
def test_apply_on_rows_of_contiguous_halves(conv, name, dtype, second):
    """Every kernel on the layouts of the vector path (contiguous rows of halves, numbers),
    with rows of a multiple of eight and with a tail: as NumPy's float32 kernel, rounded once."""
    rng = np.random.default_rng(len(name) * 31 + len(second))
    for shape in ((5, 304), (3, 21)):
        operands = [_bits(rng, shape, dtype), _layout(rng, second, dtype, shape)]
        operands = operands[:module_arity(name)]
        assert _applied_as_float32(conv, name, dtype, operands, np.zeros(shape, dtype))
        if len(operands) == 2:  # the number first: sub(1, y)
            assert _applied_as_float32(conv, name, dtype, operands[::-1], np.zeros(shape, dtype))


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_apply_in_place_reads_each_chunk_before_writing_it(conv, dtype):
    rng = np.random.default_rng(5)
    a = _bits(rng, (3, 1500), dtype)
    b = _bits(rng, (3, 1500), dtype)
    with np.errstate(all="ignore"):
        want = np.add(a.astype(np.float32), b.astype(np.float32)).astype(dtype)
    assert conv.apply(CODES["add"], dtype == HALVES[1], a, a, b)
    assert _equal_or_both_nan(a, want)


def test_apply_declines_what_it_cannot_take_and_writes_nothing(conv):
    """False, out untouched, for layouts and operands apply does not handle; the caller then
    computes another way. A wrong code or argument count is an error."""
    a = np.ones((2, 3), np.float16)
    frozen = np.full((2, 3), 7, np.float16)
    frozen.flags.writeable = False
    cases = [
        (frozen, a, a),                                        # a read-only out
        (np.full((2, 3), 7, np.float16), np.ones((3, 3), np.float16), a),  # shapes differ
        (np.full((2, 3), 7, np.float16), a, np.float64(2.0)),  # a float64 number
        (np.full((2, 3), 7, np.float16), a, 2),                # an int (NumPy's rules differ)
        (np.full((2, 3), 7, np.float16), a, np.ones((2, 3), np.float64)),  # 8-byte items
        (np.full((2, 3), 7, np.float16), a, "2"),
        (np.lib.stride_tricks.as_strided(np.full(3, 7, np.float16), (2, 3), (0, 2),
                                         writeable=True), a, a),  # a broadcast out
    ]
    for out, x, y in cases:
        before = out.copy()
        assert conv.apply(CODES["add"], False, out, x, y) is False
        assert np.array_equal(out.view(np.uint16), before.view(np.uint16))
    with pytest.raises(ValueError, match=f"code {len(conv.ops)} with 2 operand"):
        conv.apply(len(conv.ops), False, a.copy(), a, a)
    add = CODES["add"]
    with pytest.raises(ValueError, match=f"code {add} with 1 operand"):
        conv.apply(add, False, a.copy(), a)
    with pytest.raises(TypeError, match="takes 4 or 5 arguments"):
        conv.apply(add, False, a.copy())


# ---------------------------------------------------------------------- float_op
#: float_op's ops (every op of apply's but copy), each against the NumPy device's kernel
FLOAT_OPS = sorted(set(CODES) - {"copy"})


def _float_bits(rng: Any, shape: tuple, dtype: Any) -> np.ndarray:
    """Random bit patterns of `dtype` (every class of value: NaN with payloads, signalling NaN
    among them, infinities, subnormals, signed zeros), half of them ordinary numbers."""
    dtype = np.dtype(dtype)
    bits = rng.integers(0, 2**(8 * dtype.itemsize), size=shape, dtype=f"u{dtype.itemsize}",
                        endpoint=False)
    values = bits.view(dtype)
    normal = rng.standard_normal(shape).astype(dtype)
    mixed = np.where(rng.random(shape) < 0.5, values, normal)
    edges = np.array([-0.0, 0.0, -np.inf, np.inf, np.nan, -np.nan, -1.0], dtype)
    flat = mixed.reshape(-1)  # NOTE: the signed zeros and NaN, which random bits rarely give
    flat[:min(flat.size, edges.size)] = edges[:flat.size]
    return mixed


@pytest.mark.skipif(not CODES, reason="the C kernels are not built")
@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), name=st.sampled_from(FLOAT_OPS or ["add"]),
       dtype=st.sampled_from([np.float32, np.float64]),
       shape=st.sampled_from([(), (1,), (7,), (3, 300), (2, 3, 17), (64, 256)]),
       where=st.sampled_from(["new", "into a", "into b", "b a row"]), vector=st.booleans())
def test_float_op_gives_numpys_bits(seed, name, dtype, shape, where, vector):
    """Every op float_op runs, on contiguous float32 / float64, gives the NumPy device's
    kernels' bits for every value (NaN payloads, a signalling NaN quieted by a product, signed
    zeros; where two NaNs meet, a NaN), in place too and with b one row of out's last
    dimension."""
    code, reference = CODES[name], FLOAT32[name]
    arity = module_arity(name)
    rng = np.random.default_rng(seed)
    a = _float_bits(rng, shape, dtype)
    row = where == "b a row" and arity == 2 and len(shape) >= 1
    b = _float_bits(rng, shape[-1:] if row else shape, dtype)
    with np.errstate(all="ignore"):
        want = reference(a) if arity == 1 else reference(a, b)
    out = {"into a": a, "into b": b if arity == 2 and not row else a}.get(where,
                                                                           np.empty(shape, dtype))
    args = (a,) if arity == 1 else (a, b)
    conv = _module()
    conv.set_f16c(vector)  # NOTE: AVX2 loops, or the portable ones
    try:
        assert conv.float_op(code, int(dtype == np.float64), out, *args) is True
    finally:
        conv.set_f16c(True)
    # NOTE: NaN payloads exactly for the ops the CPU device runs here (backends/numpy.py
    # _IN_C) but add (where two NaNs meet, one payload or the other, as compiled); for the
    # others a NaN need only meet a NaN (GCC makes x * -1.0 a negation, say, which flips a
    # NaN's sign and leaves a signalling one unquieted)
    from backends.numpy import _IN_C

    _same_bits_nan_as_nan(out, np.asarray(want, dtype), exact=name in _IN_C and name != "add")


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from([np.float32, np.float64]),
       rows=st.integers(1, 300), cols=st.integers(2, 600), keepdims=st.booleans(),
       vector=st.booleans())
def test_float_op_sums_rows_as_numpy_does(seed, dtype, rows, cols, keepdims, vector):
    """The sum over the first axis (a bias's gradient) gives np.add.reduce(x, 0)'s bits: the
    rows added in order (signed zeros included; where NumPy gives a NaN, a NaN)."""
    rng = np.random.default_rng(seed)
    x = _float_bits(rng, (rows, cols), dtype)
    with np.errstate(all="ignore"):
        want = np.add.reduce(x, 0, keepdims=keepdims)
    out = np.empty(want.shape, dtype)
    conv = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    conv.set_f16c(vector)
    try:
        assert conv.sum_rows(int(dtype == np.float64), out, x) is True
    finally:
        conv.set_f16c(True)
    _same_bits_nan_as_nan(out, want, exact=False)


def _same_bits_nan_as_nan(got: np.ndarray, want: np.ndarray, exact: bool) -> None:
    """The same bits, NaN payloads included where `exact`; else a NaN need only meet a NaN (the
    sum of two NaNs carries one payload or the other, as compiled)."""
    bits = f"u{want.dtype.itemsize}"
    if exact:
        assert np.array_equal(got.view(bits), want.view(bits))
        return
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(bits)[~nan], want.view(bits)[~nan])


def test_float_op_declines_what_it_cannot_take_and_writes_nothing(conv):
    a = np.ones((2, 3), np.float32)
    frozen = a.copy()
    frozen.flags.writeable = False
    cases = [
        (frozen, a, a),                                  # a read-only out
        (np.zeros((2, 3), np.float32), a[:, ::2], None),  # strided: NumPy's own kernel
        (np.zeros((2, 3), np.float32), np.ones((3, 2), np.float32), a),  # shapes differ
        (np.zeros((2, 3), np.float32), a, np.ones((2, 1), np.float32)),  # a column, no row
        (np.zeros((2, 3), np.float32), a, np.ones((2, 3))),  # float64 items in a float32 op
        (np.zeros((2, 3), np.float32), a, 2.0),         # a number
    ]
    for out, x, y in cases:
        if x.shape != out.shape and y is None:
            continue
        before = out.copy()
        args = (x,) if y is None else (x, y)
        assert conv.float_op(CODES["relu" if y is None else "add"], 0, out, *args) is False
        assert np.array_equal(out, before)
    rows = np.ones((4, 3), np.float32)
    for out, x in [(np.zeros(1, np.float32), np.ones((4, 1), np.float32)),  # one column
                   (np.zeros(4, np.float32), rows),                         # the wrong length
                   (np.zeros(3, np.float32), np.ones((2, 4, 3), np.float32)),  # 3-D
                   (rows[0], rows)]:                                        # out inside x
        before = out.copy()
        assert conv.sum_rows(0, out, x) is False
        assert np.array_equal(out, before)
    relu, copy = CODES["relu"], CODES["copy"]
    with pytest.raises(ValueError, match=f"code {relu} with 2 operand"):
        conv.float_op(relu, 0, a.copy(), a, a)
    with pytest.raises(ValueError, match=f"code {copy} with 1 operand"):
        conv.float_op(copy, 0, a.copy(), a)
    with pytest.raises(ValueError, match="kind 2 names no dtype"):
        conv.float_op(relu, 2, a.copy(), a)
    with pytest.raises(TypeError, match="takes 4 or 5 arguments"):
        conv.float_op(relu, 0, a.copy())


# ---------------------------------------------------------------------- erf
def _float32_erf_values() -> np.ndarray:
    """Every 256th float32 bit pattern (both signs, every exponent), the float32s within a few
    ULPs of each joint of `erf_block`'s pieces (k / 16) and of 4, where C's erf takes over,
    and the special values."""
    sampled = np.arange(0, 1 << 32, 256, dtype=np.uint64).astype(np.uint32).view(np.float32)
    joints = np.float32(np.arange(1, 65) / 16)
    near = (joints.view(np.uint32)[:, None] + np.arange(-4, 5, dtype=np.int64)[None, :])
    near = near.astype(np.uint32).view(np.float32).ravel()
    special = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-38, 3.9999998,
                          4.0, 4.0000005, 10.0])
    return np.concatenate([sampled, near, -near, special])


@pytest.fixture(params=["avx512", "avx2", "portable"])
def erf_path(request):
    """`_halfconv` with the erf core on one loop (backends/_erf_gen.py's PATHS), skipped where
    this CPU lacks it; every loop is back on afterwards."""
    module = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    f16c, avx512 = _erf_gen.PATHS[request.param]
    try:
        if module.set_avx512(True) is False and avx512:
            pytest.skip("this CPU has no AVX-512 (F, BW, VL and DQ)")
        if module.set_f16c(f16c) is False and f16c:
            pytest.skip("this CPU has no AVX2")
        module.set_avx512(avx512)
        yield module
    finally:
        module.set_f16c(True)
        module.set_avx512(True)


def test_the_float32_erf_is_cs_erf_rounded_once(erf_path):
    """`erf_op` kind 0 (`erf_block`: polynomials, and C's erf near a rounding boundary) gives
    the bits of kind 2 (C's erf in double on every element, rounded once), on 2**24 + 1164
    values, on the AVX-512, AVX2 and portable loops; `python -m backends._erf_gen --check`
    compares all 2**32."""
    module = erf_path
    x = _float32_erf_values()
    fast, plain = np.empty_like(x), np.empty_like(x)
    assert module.erf_op(0, fast, x) and module.erf_op(2, plain, x)
    assert _equal_or_both_nan(fast, plain)
    in_place = x.copy()  # NOTE: out may be the input itself
    assert module.erf_op(0, in_place, in_place) and _equal_or_both_nan(in_place, plain)
    spot = x[::4099]
    assert _equal_or_both_nan(plain[::4099], np.float32([math.erf(v) for v in spot.tolist()]))


def _gelu_values(dtype: type, seed: int, size: int) -> np.ndarray:
    """GELU's arguments of every kind: normal ones, wide ones (where erf's pieces and C's erf
    take over), the special values and the subnormals, in random order."""
    rng = np.random.default_rng(seed)
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-310, 5.6568542, -5.6568542,
               40.0, -40.0, 1e30, -1e30, 13.0, -13.0]
    x = np.concatenate([rng.standard_normal(size), rng.uniform(-12, 12, size // 4),
                        np.array(special)]).astype(dtype)
    rng.shuffle(x)
    return x


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), size=st.integers(0, 3000),
       seed=st.integers(0, 2**32 - 1), in_place=st.sampled_from([None, "x", "g"]))
def test_gelu_in_one_pass_has_the_formulas_bits(dtype, size, seed, in_place):
    """The CPU's gelu and gelu_backward kernels (`_halfconv.gelu_op`, a tile of NumPy's exp
    for the gradient: its loop called in C, or np.exp's call in Python) give the bits of the
    table's formulas run op by op (`_kernel`, their twin), on every erf loop this CPU has, over
    sizes that end mid tile, with out the input itself; a NaN need only meet a NaN."""
    module = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    from backends import numpy as cpu
    from backends import optable

    x = _gelu_values(dtype, seed, size)
    g = np.random.default_rng(seed + 1).standard_normal(x.size).astype(dtype)
    formulas = {name: cpu._kernel(optable.BY_NAME[name]) for name in ("gelu", "gelu_backward")}
    exp_paths = [cpu._LOOP_CODES, {}]  # NOTE: NumPy's exp loop in C, then np.exp's call
    for (f16c, avx512), exp_in_c in itertools.product(_erf_gen.PATHS.values(), exp_paths):
        module.set_f16c(f16c)
        module.set_avx512(avx512)
        try:
            for name, inputs in (("gelu", (x,)), ("gelu_backward", (g, x))):
                want = np.empty_like(x)
                with np.errstate(all="ignore"):
                    formulas[name](*inputs, out=want)
                copies = [a.copy() for a in inputs]
                out = (np.empty_like(x) if in_place is None
                       else copies[0 if in_place == "g" or name == "gelu" else 1])
                with (np.errstate(all="ignore"),  # NOTE: as the device calls its kernels
                      mock.patch.object(cpu, "_LOOP_CODES", exp_in_c)):
                    cpu._KERNELS[name](*copies, out=out)
                assert _equal_or_both_nan(out, want), (name, f16c, avx512, exp_in_c)
        finally:
            module.set_f16c(True)
            module.set_avx512(True)


def test_numpys_exp_loop_is_taken_only_where_it_gives_np_exps_bits():
    """gelu's gradient and the chains call NumPy's exp, log and tanh loops in C only after
    reading each from its ufunc's object and checking its bits; another ufunc's loop read in
    its place is refused and forgotten."""
    module = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    from backends import numpy as cpu

    assert cpu._ufunc_loop(np.divmod, np.dtype(np.float32)) is None  # NOTE: two outputs
    assert cpu._ufunc_loop(np.exp, np.dtype(np.int8)) is None  # NOTE: no int8 -> int8 loop
    assert cpu._ufunc_loop(np.exp, np.dtype(np.float32)) is not None
    sin = {dtype: cpu._ufunc_loop(np.sin, dtype) for dtype in cpu._FLOAT_OP}
    try:
        with mock.patch.object(cpu, "_ufunc_loop", lambda ufunc, dtype: sin[dtype]):
            assert cpu._loops_in_c() == {}
        x = np.linspace(-3, 3, 64, dtype=np.float32)
        assert not module.gelu_op(0, np.empty_like(x), x, x)  # NOTE: forgotten: e is needed
    finally:
        assert cpu._loops_in_c() == cpu._LOOP_CODES  # NOTE: the ufuncs' own loops back


def test_numpys_add_loop_sums_rows_only_where_it_gives_np_sums_bits():
    """The last-axis sums call NumPy's add loop in C only after reading it from np.add's object
    and checking its bits; np.multiply's loop read in its place is refused and forgotten, and
    a row longer than NumPy's buffer is left to NumPy."""
    module = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    from backends import numpy as cpu

    times = {dtype: cpu._ufunc_loop(np.multiply, dtype) for dtype in cpu._FLOAT_OP}
    x = np.linspace(-3, 3, 64, dtype=np.float32).reshape(4, 16)
    try:
        with mock.patch.object(cpu, "_ufunc_loop", lambda ufunc, dtype: times[dtype]):
            assert cpu._sum_loops_in_c() == set()
        assert not module.sum_last(0, np.empty(4, np.float32), x)  # NOTE: forgotten
    finally:
        assert cpu._sum_loops_in_c() == cpu._SUM_IN_C  # NOTE: np.add's own loops back
    add = cpu._ADD_LOOP + len(module.ops)  # NOTE: the add loop's code: never a chain's link
    plan = np.array([0, 1, 1, 2, x.ctypes.data, 4, 16, add, 0, 0, x.ctypes.data, 16, 1],
                    np.int64)
    with pytest.raises(ValueError, match="chain: the plan is malformed"):
        module.chain(plan)
    if 0 in cpu._SUM_IN_C:
        long = np.ones((2, 8193), np.float32)
        assert not module.sum_last(0, np.empty(2, np.float32), long)
        assert module.sum_last(0, np.empty(2, np.float32), long[:, :8192].copy())


def test_gelu_in_one_pass_refuses_what_it_cannot_take():
    """gelu_op takes contiguous float32 and float64 arrays of out's shape and dtype: anything
    else is False with nothing written (the kernels then run the formulas, with their bits), a
    wrong count or kind an error that says so."""
    module = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    from backends import numpy as cpu

    x = np.linspace(-3, 3, 64, dtype=np.float32)
    out = np.full_like(x, 7.0)
    assert not module.gelu_op(0, out, x[::2].copy().repeat(2)[::2])  # NOTE: 32 items
    assert not module.gelu_op(0, out, x.astype(np.float64))
    assert not module.gelu_op(0, out[::2], x[::2])
    assert not module.gelu_op(1, out, x)
    assert (out == 7.0).all()
    with pytest.raises(TypeError, match="takes 3 to 5 arguments, got 6"):
        module.gelu_op(0, out, x, x, x, x)
    with pytest.raises(ValueError, match="kind 3 names no dtype"):
        module.gelu_op(3, out, x)
    for name, inputs in (("gelu", (x[::2],)), ("gelu_backward", (x[::2], x[::2]))):
        got, want = np.empty(32, np.float32), np.empty(32, np.float32)
        cpu._KERNELS[name](*inputs, out=got)
        cpu._KERNELS[name](*(a.copy() for a in inputs), out=want)
        assert _equal_or_both_nan(got, want)


# ---------------------------------------------------------------------- transpose
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 70), cols=st.integers(0, 70),
       dtype=st.sampled_from(["float16", "bfloat16", "float32", "float64", "int16", "uint32",
                              "int64", "complex64"]),
       seed=st.integers(0, 2**32 - 1))
def test_transpose_moves_every_item_in_tiles(rows, cols, dtype, seed):
    """out (rows, cols) = src (cols, rows) transposed, bit for bit, over sizes that end mid
    tile (16) and every item size it takes (NaN payloads kept: it moves bits)."""
    conv = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    dtype = np.dtype(dtype)  # NOTE: bfloat16 by name, as ml_dtypes (imported) registers it
    bits = np.random.default_rng(seed).integers(0, 256, cols * rows * dtype.itemsize,
                                                dtype=np.uint8)
    src = bits.view(dtype).reshape(cols, rows)
    out = np.zeros((rows, cols), dtype)
    assert conv.transpose(out, src) is True
    assert out.tobytes() == np.ascontiguousarray(src.T).tobytes()


def test_transpose_declines_what_it_cannot_take_and_writes_nothing():
    conv = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    frozen = np.zeros((4, 3), np.float32)
    frozen.flags.writeable = False
    memory = np.zeros(24, np.float32)
    cases = [
        (frozen, src),                                   # a read-only out
        (np.zeros((3, 4), np.float32), src),             # not the transposed shape
        (np.zeros((4, 3), np.float64), src),             # items of another size
        (np.zeros((4, 3), np.float32), src[:, ::-1]),    # src not C-contiguous
        (np.zeros((6, 3), np.float32)[::2], src),        # out not C-contiguous
        (np.zeros((4, 3, 1), np.float32), src),          # 3-D
        (np.zeros((4, 3), np.bool_), src.astype(np.bool_)),  # one-byte items
        (np.zeros((4, 3), np.complex128), src.astype(np.complex128)),  # 16-byte items
        (memory[:12].reshape(4, 3), memory[6:18].reshape(3, 4)),  # out overlaps src
    ]
    for out, x in cases:
        before = out.copy()
        assert conv.transpose(out, x) is False
        assert np.array_equal(out, before)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        conv.transpose(src)


# ---------------------------------------------------------------------- max over rows
@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]),
       shape=st.lists(st.integers(1, 40), min_size=1, max_size=3), seed=st.integers(0, 2**32 - 1),
       special=st.sampled_from(["none", "zeros", "nans", "infs", "all"]))
def test_the_cpus_max_over_rows_has_numpys_bits(dtype, shape, seed, special):
    """The CPU's maximum over the last axis of a contiguous float array (`_halfconv.max_rows`,
    with NumPy's own reduction for the rows whose maximum is NaN or zero) gives NumPy's bits,
    NaN payloads and signs of zero included, on the AVX2 lanes and the portable loop, over
    rows shorter and longer than a vector and some rows of nothing but zeros or NaNs."""
    pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    from backends import _halfconv as module
    from backends import numpy as cpu

    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(dtype)
    pool = {"none": [1.0], "zeros": [0.0, -0.0], "infs": [np.inf, -np.inf],
            "nans": [np.nan, -np.nan, np.float64(np.nan) * -1],
            "all": [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf]}[special]
    pick = rng.random(shape) < 0.3
    x[pick] = np.asarray(rng.choice(np.asarray(pool, dtype), size=int(pick.sum())), dtype)
    if special != "none" and x.ndim > 1:
        x[0] = pool[0]  # NOTE: a whole row of one special value
    want = np.maximum.reduce(x, axis=-1, keepdims=True)
    for vector in (True, False):
        module.set_f16c(vector)
        try:
            got = np.full(want.shape, 7, dtype)
            cpu.NumpyDevice()._reduce_max(x, (x.ndim - 1,), True, got)
            assert got.tobytes() == want.tobytes(), (vector, x, got, want)
        finally:
            module.set_f16c(True)


def test_max_over_rows_refuses_what_it_cannot_take():
    module = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    out = np.full(3, 7, np.float32)
    assert module.max_rows(0, out, x[:, ::2]) is False  # NOTE: not contiguous
    assert module.max_rows(0, out[:2], x) is False  # NOTE: not a row each
    assert module.max_rows(1, out, x) is False  # NOTE: kind and dtype disagree
    assert module.max_rows(0, x.reshape(-1)[:3], x) is False  # NOTE: out inside x
    assert (out == 7).all()
    with pytest.raises(TypeError, match="takes 3 arguments, got 2"):
        module.max_rows(0, out)
    # NOTE: it returns how many rows have a maximum of NaN or zero, for NumPy to take again
    assert module.max_rows(0, out, x) == 0 and out.tolist() == [3.0, 7.0, 11.0]
    x[1] = -x[1] - 1
    x[2, 3] = np.nan
    x[0] = np.minimum(x[0], 0)
    assert module.max_rows(0, out, x) == 2 and out[1] == -5.0
