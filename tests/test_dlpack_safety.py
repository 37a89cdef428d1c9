"""DLPack exports that cannot break blockrt's promises (issue 15): constants stay unwritten, a
freed block's memory is never read through a live export, tensors that require grad and views a
consumer cannot take are refused before anything is shared.

Consumers: NumPy always; PyTorch CPU where it is installed (it is not a test dependency); a
legacy consumer, which asks for an unversioned capsule, through a small shim.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import runtime
from runtime._tensor import DTYPES
from runtime.dtypes import BFLOAT16


class Legacy:
    """A consumer from before DLPack 1.0: it asks for a capsule with no max_version."""

    def __init__(self, producer: Any, copy: bool | None = None) -> None:
        self.producer, self.copy = producer, copy

    def __dlpack__(self, **_: Any) -> Any:
        if self.copy is None:
            return self.producer.__dlpack__()
        return self.producer.__dlpack__(copy=self.copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.producer.__dlpack_device__()


# ---------------------------------------------------------------------- constants
def test_a_constant_goes_out_as_a_copy_that_no_write_brings_back():
    c = runtime.constant(np.arange(4.0))
    other = runtime.constant(np.arange(4.0))  # NOTE: the same block: deduplicated
    assert other.block is c.block
    theirs = np.from_dlpack(c)
    theirs[0] = 99.0
    np.testing.assert_array_equal(other.numpy(), np.arange(4.0))
    assert c.block.exports == 0  # the copy holds nothing of the block


def test_a_constant_without_a_copy_is_shared_read_only_with_a_versioned_consumer():
    c = runtime.constant(np.arange(4.0))
    shared = np.from_dlpack(c, copy=False)
    assert not shared.flags.writeable
    assert c.block.exports == 1
    with pytest.raises(ValueError, match="read-only"):
        shared[0] = 1.0
    del shared
    gc.collect()
    assert c.block.exports == 0


def test_a_legacy_consumer_is_refused_a_constant_and_told_how_to_get_a_copy():
    c = runtime.constant(np.arange(4.0))
    with pytest.raises(BufferError, match=r"block #\d+ is read-only .*max_version=None.* ask "
                                          r"for a copy \(np.from_dlpack\(t, copy=True\)"):
        np.from_dlpack(Legacy(c))
    with pytest.raises(BufferError, match="read-only"):
        np.from_dlpack(Legacy(c, copy=False))
    copied = np.from_dlpack(Legacy(c, copy=True))
    np.testing.assert_array_equal(copied, np.arange(4.0))
    shared = np.from_dlpack(c, copy=False)
    assert copied.__array_interface__["data"][0] != shared.__array_interface__["data"][0]


def test_a_plain_tensor_is_still_shared_without_a_copy_both_ways():
    t = runtime.tensor(np.arange(4.0))
    theirs = np.from_dlpack(t)
    theirs[0] = 7.0
    assert t.numpy()[0] == 7.0
    legacy = np.from_dlpack(Legacy(t))  # NOTE: a writable block needs no flag
    assert legacy.__array_interface__["data"][0] == theirs.__array_interface__["data"][0]
    assert t.block.exports == 2


# ---------------------------------------------------------------------- free with live exports
def test_free_with_a_live_export_raises_and_frees_nothing():
    t = runtime.tensor(np.arange(4.0))
    theirs = np.from_dlpack(t)
    with pytest.raises(BufferError, match=r"free\(\): block #\d+ \(32 B\) has 1 live DLPack "
                                          r"export\(s\)"):
        t.block.free()
    assert t.block.allocated
    np.testing.assert_array_equal(t.numpy(), np.arange(4.0))  # the tensor still works
    runtime.tensor(np.full(4, 9.0))  # NOTE: would take the memory, had it been freed
    np.testing.assert_array_equal(theirs, np.arange(4.0))
    del theirs
    gc.collect()
    t.block.free()
    assert not t.block.allocated


def test_exports_are_counted_per_consumer_array_and_copies_count_none():
    t = runtime.tensor(np.arange(6.0))
    first, second = np.from_dlpack(t), np.from_dlpack(t[1:])
    np.from_dlpack(t, copy=True)
    assert t.block.exports == 2
    del first
    gc.collect()
    assert t.block.exports == 1
    del second
    gc.collect()
    assert t.block.exports == 0


# ---------------------------------------------------------------------- refused before sharing
def test_a_tensor_that_requires_grad_is_refused_and_its_detach_goes():
    w = runtime.tensor(np.arange(4.0), requires_grad=True)
    with pytest.raises(BufferError, match=r"requires grad.*export tensor.detach\(\) instead"):
        np.from_dlpack(w)
    assert w.block.exports == 0
    np.testing.assert_array_equal(np.from_dlpack(w.detach()), np.arange(4.0))


def test_negative_strides_are_refused_unless_a_copy_is_asked_for():
    t = runtime.tensor(np.arange(12.0).reshape(3, 4))
    view = t[::-1, ::2]
    with pytest.raises(BufferError, match=r"negative strides \(-4, 2\).*copy=True"):
        np.from_dlpack(view)
    with pytest.raises(BufferError, match="negative strides"):
        np.from_dlpack(view, copy=False)
    np.testing.assert_array_equal(np.from_dlpack(view, copy=True), np.arange(12.0)
                                  .reshape(3, 4)[::-1, ::2])
    single = t[1:2][::-1]  # NOTE: a negative stride over one element walks nowhere: shared
    np.testing.assert_array_equal(np.from_dlpack(single), [[4.0, 5.0, 6.0, 7.0]])


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"copy": "yes"}, TypeError, "copy must be True, False or None, got 'yes'"),
    ({"max_version": 1}, TypeError, r"max_version must be a \(major, minor\) tuple"),
    ({"max_version": (1, True)}, TypeError, r"max_version must be a \(major, minor\) tuple"),
])
def test_malformed_arguments_are_named(options, error, match):
    with pytest.raises(error, match=match):
        runtime.tensor(np.ones(2)).__dlpack__(**options)


# ---------------------------------------------------------------------- the property
@st.composite
def views(draw: Any) -> tuple[np.ndarray, tuple]:
    # NOTE: NumPy, the consumer here, has no bfloat16 (tests/test_dlpack.py takes it through
    # a capsule and PyTorch)
    dtype = draw(st.sampled_from([d for d in DTYPES if d != BFLOAT16]))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3)))
    host = (np.arange(int(np.prod(shape))) % 7).astype(dtype).reshape(shape)
    index = tuple(slice(draw(st.sampled_from([None, 0, 1])), None,
                        draw(st.sampled_from([1, 2, -1, -2]))) for _ in shape)
    return host, index


@settings(max_examples=150, deadline=None)
@given(case=views(), constant=st.booleans(), copy=st.sampled_from([None, True, False]))
def test_an_export_gives_the_exact_values_or_a_clear_error_and_never_writes_a_constant(
        case, constant, copy):
    host, index = case
    base = runtime.constant(host) if constant else runtime.tensor(host)
    view = base[index]
    expected = host[index]
    try:
        theirs = np.from_dlpack(view, copy=copy)
    except BufferError as error:
        assert "__dlpack__:" in str(error) and ("negative strides" in str(error)
                                                or "read-only" in str(error)), error
        assert copy is not True
        return
    np.testing.assert_array_equal(theirs, expected)
    assert theirs.dtype == expected.dtype
    if constant:
        assert not (copy is False and theirs.flags.writeable)
        if theirs.flags.writeable and theirs.size:
            theirs.flat[0] = 1
        np.testing.assert_array_equal(base.numpy(), host)
    elif copy is not True and theirs.size:
        new = not theirs.flat[0] if theirs.dtype == bool else theirs.flat[0] + 1
        theirs.flat[0] = new
        assert view.numpy().flat[0] == new  # shared, not a silent copy


# ---------------------------------------------------------------------- PyTorch
@pytest.fixture(scope="module")
def torch() -> Any:
    return pytest.importorskip("torch", reason="PyTorch is not installed (not a test dependency; "
                                               "pip install torch to run these)")


def test_torch_cannot_write_a_constant(torch):
    c = runtime.constant(np.arange(4.0))
    theirs = torch.from_dlpack(c)
    theirs[0] = 99.0
    np.testing.assert_array_equal(c.numpy(), np.arange(4.0))


def test_torch_shares_a_plain_tensor_and_holds_its_block(torch):
    t = runtime.tensor(np.arange(4.0))
    theirs = torch.from_dlpack(t)
    theirs[0] = 7.0
    assert t.numpy()[0] == 7.0
    with pytest.raises(BufferError, match="live DLPack export"):
        t.block.free()
    del theirs
    gc.collect()
    t.block.free()


def test_torch_gets_clear_errors_not_a_crash(torch):
    with pytest.raises(BufferError, match="negative strides"):
        torch.from_dlpack(runtime.tensor(np.arange(4.0))[::-1])
    with pytest.raises(BufferError, match="requires grad"):
        torch.from_dlpack(runtime.tensor(np.arange(4.0), requires_grad=True))
