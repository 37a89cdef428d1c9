"""backends/_halfconv.c, the CPU device's float16 / bfloat16 <-> float32 conversions, against
NumPy's and ml_dtypes' casts bit for bit (NaN only as NaN): every two-byte value widened, random
and edge float32 values narrowed, on the F16C / AVX2 path and the portable one. No device is
opened, so `make asan` runs this file under the sanitizers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


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
