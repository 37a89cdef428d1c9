"""Immutable constants: deduplication by verified content hash, read-only blocks, lifetime,
and where their memory lives (read-only device memory by default).

Most tests use a pool over an allocator of their own, "direct" or a ReadOnlyAllocator (both give
every allocation its own raw memory), so its stats show exactly what the constants did; the
pool's invariants are checked after every step that changes it.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import allocators
import backends
import helpers
import runtime
from backends import Device
from backends.numpy import NumpyDevice
from runtime import ConstantPool, ReadOnlyError, UseAfterFreeError, ops

constant_module = importlib.import_module("runtime.constant")  # runtime.constant is the function
ReadOnlyAllocator = constant_module.ReadOnlyAllocator

#: The allocators a test pool may sit on: ordinary memory, and read-only memory.
ALLOCATORS = {"direct": lambda: allocators.create("direct", "cpu"),
              "read-only": lambda: ReadOnlyAllocator("cpu")}


@pytest.fixture(params=sorted(ALLOCATORS))
def alloc(request):
    return ALLOCATORS[request.param]()


@pytest.fixture
def direct():
    """Ordinary memory, for the writable tensors a test needs besides its constants."""
    return allocators.create("direct", "cpu")


@pytest.fixture
def pool(alloc):
    return ConstantPool(alloc)


def exact(pool, **expected):
    """Assert the pool's stats hold exactly `expected` (for the keys given) and its invariants."""
    stats = pool.stats()
    assert {key: stats[key] for key in expected} == expected
    pool.check_invariants()


# ---------------------------------------------------------------------- deduplication
def test_equal_content_gives_the_same_block(pool):
    a = pool.constant(np.arange(6.0))
    b = pool.constant(np.arange(6.0))
    assert a.block is b.block
    assert a.block.refcount == 2
    exact(pool, constants=1, bytes=48, lookups=2, hits=1, misses=1, hit_rate=0.5, collisions=0)


def test_equal_bytes_share_across_shapes_and_dtypes(pool):
    data = np.arange(6.0)
    a = pool.constant(data)
    b = pool.constant(data.reshape(2, 3))
    c = pool.constant(data.view(np.int64))
    d = pool.constant(data.view(np.uint8).reshape(4, 12))
    assert a.block is b.block is c.block is d.block
    assert (b.shape, b.dtype) == ((2, 3), np.float64)
    assert (c.shape, c.dtype) == ((6,), np.int64)
    assert (d.shape, d.dtype) == ((4, 12), np.uint8)
    np.testing.assert_array_equal(c.numpy(), data.view(np.int64))
    np.testing.assert_array_equal(d.numpy(), data.view(np.uint8).reshape(4, 12))
    exact(pool, constants=1, lookups=4, hits=3, misses=1)


def test_different_content_gives_different_blocks(pool, alloc):
    a = pool.constant(np.arange(6.0))
    b = pool.constant(np.arange(6.0) + 1)
    c = pool.constant(np.arange(5.0))  # a prefix of a's bytes: another size, another key
    assert len({a.block.id, b.block.id, c.block.id}) == 3
    exact(pool, constants=3, bytes=48 + 48 + 40, lookups=3, hits=0, misses=3, hit_rate=0.0)
    assert alloc.stats()["allocated_bytes"] == 48 + 48 + 40


def test_hit_statistics_are_exact(pool):
    handles = [pool.constant(np.full(3, k % 3, np.int32)) for k in range(10)]
    exact(pool, constants=3, bytes=36, lookups=10, hits=7, misses=3, hit_rate=0.7, collisions=0)
    assert [h.block.refcount for h in handles[:3]] == [4, 3, 3]


def test_dtype_argument_and_tensor_data(pool):
    a = pool.constant([1, 2, 3], dtype="float32")
    assert a.dtype == np.float32
    b = pool.constant(runtime.tensor(np.array([1, 2, 3], np.float32)))
    assert b.block is a.block
    with pytest.raises(TypeError, match="complex64"):
        pool.constant(np.ones(2, np.complex64))
    half = pool.constant(np.ones(2, np.float16))  # every storage dtype, deduplicated too
    assert half.dtype == np.float16 and pool.constant(np.ones(2, np.float16)).block is half.block
    assert pool.constant(np.ones(2, np.float32)).block is not half.block
    with pytest.raises(TypeError, match="not supported"):
        pool.constant([1.0], dtype="complex64")
    exact(pool, lookups=5, hits=2)


def test_forced_digest_collision_is_verified_and_counted(pool, monkeypatch):
    monkeypatch.setattr(constant_module, "content_digest", lambda data: b"same")
    first, second = np.arange(4.0), np.arange(4.0) * 10
    a = pool.constant(first)
    b = pool.constant(second)
    assert a.block is not b.block
    np.testing.assert_array_equal(a.numpy(), first)
    np.testing.assert_array_equal(b.numpy(), second)
    exact(pool, constants=2, lookups=2, hits=0, misses=2, collisions=1)
    # Both now sit under one key; each still deduplicates against its own bytes.
    assert pool.constant(second).block is b.block
    exact(pool, constants=2, lookups=3, hits=1, misses=2, collisions=2)  # `a` was compared first
    assert pool.constant(first).block is a.block
    exact(pool, constants=2, lookups=4, hits=2, misses=2, collisions=2)


def test_colliding_entries_are_forgotten_one_by_one(pool, alloc, monkeypatch):
    monkeypatch.setattr(constant_module, "content_digest", lambda data: b"same")
    a = pool.constant(np.zeros(2))
    b = pool.constant(np.ones(2))
    a.release()
    exact(pool, constants=1, bytes=16)
    assert pool.blocks() == [b.block]
    b.release()
    exact(pool, constants=0, bytes=0)
    assert alloc.stats()["allocated_bytes"] == 0


@pytest.mark.skipif(runtime.get_default_device().name != "cpu",
                    reason="about the cpu pool serving constants made without a device, which "
                           "needs cpu to be the default device (BLOCKRT_DEVICE names another)")
def test_default_pool_per_device():
    from runtime.constant import default_constant_pools, get_default_constant_pool

    with helpers.fresh_defaults(allocators=False):
        a = runtime.constant(np.arange(3.0), device="cpu")
        b = runtime.constant(np.arange(3.0))
        default = get_default_constant_pool("cpu")
        assert a.block is b.block
        assert default.blocks() == [a.block]
        assert isinstance(default.allocator, ReadOnlyAllocator)  # read-only memory of its own
        assert not a.block.memory_for_read().raw.flags.writeable
        assert default_constant_pools() == {a.device: default}


def test_constant_argument_errors(pool):
    with pytest.raises(TypeError, match="ConstantPool"):
        runtime.constant(np.ones(2), pool=pool.allocator)
    with pytest.raises(TypeError, match="ConstantPool takes"):
        ConstantPool("direct")
    assert runtime.constant(np.ones(2), device="cpu", pool=pool).block in pool.blocks()


# ---------------------------------------------------------------------- where constants live
def test_a_pool_without_an_allocator_keeps_constants_in_read_only_memory(direct):
    pool = ConstantPool(device="cpu")
    assert isinstance(pool.allocator, ReadOnlyAllocator)
    assert pool.device is backends.get_device("cpu")
    c = pool.constant(np.arange(6.0).reshape(2, 3))
    raw = c.block.memory_for_read().raw
    assert not raw.flags.writeable and pool.device.is_read_only(raw)
    assert not c._native_read("test").flags.writeable  # what kernels get cannot be written
    ordinary = runtime.tensor(np.arange(6.0), allocator=direct)
    assert ordinary.block.memory_for_read().raw.flags.writeable
    assert pool.constant(np.arange(6.0)).block is c.block
    # NOTE: an ordinary tensor first: a result takes its first operand's allocator
    np.testing.assert_array_equal(ops.add(ordinary.reshape(2, 3), c).numpy(),
                                  2 * np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(ops.matmul(ordinary.reshape(2, 3), c.T).numpy(),
                                  np.arange(6.0).reshape(2, 3) @ np.arange(6.0).reshape(2, 3).T)
    exact(pool, constants=1, bytes=48, lookups=2, hits=1)
    assert pool.allocator.stats()["allocated_bytes"] == 48


@pytest.mark.parametrize("wrap", [lambda a: a, allocators.StatisticsAdaptor,
                                  lambda a: allocators.LimitAdaptor(a, 1 << 20)],
                         ids=["read-only", "statistics", "limit"])
def test_results_computed_from_constants_are_ordinary_writable_tensors(wrap):
    allocator = wrap(runtime.ReadOnlyAllocator("cpu"))
    assert allocator.read_only_memory  # NOTE: an adaptor says what its upstream hands out
    pool = ConstantPool(allocator)
    c = pool.constant(np.arange(4.0))
    assert c.device.is_read_only(c.block.memory_for_read().raw)
    for result in (ops.add(c, 1.0), ops.copy(c), ops.neg(c)):
        assert not result.device.is_read_only(result.block.memory_for_read().raw)
        result[0] = 9.0
        assert result.numpy()[0] == 9.0


def test_a_pool_on_the_default_device_by_default():
    assert ConstantPool().device is runtime.get_default_device()


def test_a_pool_given_both_needs_them_to_agree(direct):
    assert ConstantPool(direct, device="cpu").allocator is direct
    with pytest.raises(ValueError, match="is on cpu .*, but device cpu .* was asked for"):
        ConstantPool(direct, device=NumpyDevice())  # another Device object: another device


def test_the_invariants_catch_a_constant_outside_read_only_memory():
    pool = ConstantPool(device="cpu")
    c = pool.constant(np.arange(4.0))
    pool.check_invariants()
    c.block.memory_for_read().raw.flags.writeable = True
    with pytest.raises(AssertionError, match=f"block #{c.block.id} is not in read-only memory"):
        pool.check_invariants()


def test_read_only_memory_is_read_only_to_kernels_whatever_the_block(direct):
    alloc = ReadOnlyAllocator("cpu")
    t = runtime.tensor(np.zeros(3), allocator=alloc)  # not a constant: only its memory is
    assert not t.block.readonly
    with pytest.raises(ValueError, match="read-only"):  # NumPy's own refusal, not ours
        ops.relu(runtime.tensor(np.ones(3), allocator=direct), out=t)
    np.testing.assert_array_equal(t.numpy(), np.zeros(3))


class NoReadOnlyDevice(NumpyDevice):
    """Host memory without the read-only kind, as on CUDA: the Device base class's fallback."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, read_only_memory=False)
    _raw_alloc_read_only = Device._raw_alloc_read_only
    _is_read_only = Device._is_read_only


def test_without_read_only_memory_constants_are_guarded_by_read_only_error_alone():
    dev = NoReadOnlyDevice()
    pool = ConstantPool(device=dev)
    c = pool.constant(np.arange(4.0))
    raw = c.block.memory_for_read().raw
    assert raw.flags.writeable and not dev.is_read_only(raw)  # ordinary memory
    other = runtime.tensor(np.full(4, 7.0), allocator=allocators.create("direct", dev))
    with pytest.raises(ReadOnlyError, match="constants are immutable"):
        ops.copy(other, out=c)
    np.testing.assert_array_equal(c.numpy(), np.arange(4.0))
    exact(pool, constants=1, bytes=32)


# ---------------------------------------------------------------------- read-only
#: Every way to write into a constant `c` (1-D float64, 4 elements); `other` is a writable 4-vector.
WRITES = {
    "op out=": lambda c, other: ops.add(other, other, out=c),
    "in-place op": lambda c, other: ops.relu(c, out=c),
    "overlapping op": lambda c, other: ops.neg(c[:3], out=c[1:]),
    "copy into": lambda c, other: ops.copy(other, out=c),
    "setitem": lambda c, other: c.__setitem__(0, 5.0),
    "setitem all": lambda c, other: c.__setitem__(Ellipsis, other),
    "setitem on a view": lambda c, other: c[1:].__setitem__(0, 5.0),
    "op out= a view": lambda c, other: ops.mul(other[:2], 2.0, out=c.reshape(2, 2)[1]),
    "matmul out=": lambda c, other: ops.matmul(other.reshape(4, 1), other.reshape(1, 4)[:, :1],
                                               out=c.reshape(4, 1)),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_every_write_raises_and_leaves_data_unchanged(pool, direct, how):
    data = np.array([-1.0, 2.0, -3.0, 4.0])
    other = runtime.tensor(np.full(4, 7.0), allocator=direct)
    c = pool.constant(data)
    version = c.block.version
    with pytest.raises(ReadOnlyError, match=rf"block #{c.block.id} .*constants are immutable"):
        WRITES[how](c, other)
    np.testing.assert_array_equal(c.numpy(), data)
    assert c.block.version == version
    assert c.block.readonly
    exact(pool, constants=1)


@pytest.mark.parametrize("aliasing", ["copy", "raise"])
def test_aliased_in_place_write_raises_in_both_aliasing_modes(pool, aliasing):
    runtime.set_aliasing(aliasing)
    c = pool.constant(np.arange(4.0))
    with pytest.raises(ReadOnlyError):
        ops.relu(c, out=c)
    np.testing.assert_array_equal(c.numpy(), np.arange(4.0))


def test_reading_works(pool):
    c = pool.constant(np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(c.numpy(), np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(c.T.numpy(), np.arange(6.0).reshape(2, 3).T)
    total = ops.add(c, c)
    np.testing.assert_array_equal(total.numpy(), 2 * np.arange(6.0).reshape(2, 3))
    assert not total.block.readonly  # an op's output is an ordinary, writable tensor
    total[0, 0] = 9.0
    copied = ops.copy(c)
    copied[0, 0] = -1.0
    assert copied.numpy()[0, 0] == -1.0 and c.numpy()[0, 0] == 0.0
    assert float(ops.sum(c).item()) == 15.0
    assert ops.matmul(c, c.T).numpy()[1, 1] == 9 + 16 + 25


def test_ordinary_tensors_stay_writable(direct):
    t = runtime.tensor(np.zeros(3), allocator=direct)
    assert not t.block.readonly
    t[0] = 1.0
    assert t.numpy()[0] == 1.0


# ---------------------------------------------------------------------- lifetime
def test_block_is_freed_when_the_last_user_goes(pool, alloc):
    baseline = alloc.stats()["allocated_bytes"]
    a = pool.constant(np.arange(8.0))
    view = a[2:]
    b = pool.constant(np.arange(8.0))
    block = a.block
    assert alloc.stats()["allocated_bytes"] == baseline + 64
    a.release()
    b.release()
    assert block.allocated and pool.blocks() == [block]  # the view still uses it
    exact(pool, constants=1, bytes=64)
    del view
    gc.collect()
    assert not block.allocated
    assert alloc.stats()["allocated_bytes"] == baseline
    exact(pool, constants=0, bytes=0, lookups=2, hits=1)
    again = pool.constant(np.arange(8.0))
    assert again.block is not block
    np.testing.assert_array_equal(again.numpy(), np.arange(8.0))
    exact(pool, constants=1, bytes=64, lookups=3, hits=1, misses=2)


def test_block_free_drops_the_constant(pool, alloc):
    a = pool.constant(np.arange(4.0))
    block = a.block
    block.free()
    exact(pool, constants=0, bytes=0)
    assert alloc.stats()["allocated_bytes"] == 0
    with pytest.raises(UseAfterFreeError):
        a.numpy()
    fresh = pool.constant(np.arange(4.0))
    assert fresh.block is not block
    assert alloc.stats()["allocated_bytes"] == 32
    a.release()  # a stale handle's release touches neither the new block nor the pool
    exact(pool, constants=1, bytes=32, misses=2)
    np.testing.assert_array_equal(fresh.numpy(), np.arange(4.0))


def test_garbage_collected_handles_free_the_block(pool, alloc):
    for _ in range(3):
        pool.constant(np.ones(16))  # each result is dropped at once
    exact(pool, constants=0, lookups=3, hits=0, misses=3)
    assert alloc.stats()["num_frees"] == 3
    assert alloc.stats()["allocated_bytes"] == 0


def test_on_return_hook_runs_once_after_the_memory_went_back(direct):
    alloc = direct
    t = runtime.tensor(np.ones(2), allocator=alloc)
    block = t.block
    assert block.on_return is None  # ordinary blocks carry no hook
    seen = []
    block.on_return = lambda b: seen.append((b, b.allocated, alloc.stats()["allocated_bytes"]))
    again = runtime.Tensor(block, (2,), "float64")
    t.release()
    assert seen == []
    again.release()
    assert seen == [(block, False, 0)]
    assert block.on_return is None
    runtime.Tensor(block, (2,), "float64").release()  # a later return calls nothing
    assert len(seen) == 1


# ---------------------------------------------------------------------- properties
def _small(dtype):
    kind = np.dtype(dtype).kind
    if kind == "f":
        return st.sampled_from([0.0, -0.0, 1.0, np.nan, np.inf])
    if kind == "b":
        return st.booleans()
    return st.integers(0, 2)


@st.composite
def array_pairs(draw):
    """Two arrays whose bytes are often equal (same data, maybe another dtype or shape)."""
    dtype = draw(st.sampled_from(["float32", "float64", "int32", "int64", "uint8", "bool"]))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    a = draw(hnp.arrays(dtype, shape, elements=_small(dtype)))
    how = draw(st.sampled_from(["same", "as bytes", "other"]))
    if how == "same":
        b = a.copy()
    elif how == "as bytes":
        b = a.reshape(-1).view(np.uint8).copy()
    else:
        other = draw(st.sampled_from(["float32", "int64", "uint8", "bool"]))
        other_shape = draw(hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=3))
        b = draw(hnp.arrays(other, other_shape, elements=_small(other)))
    return a, b


@settings(max_examples=150)
@given(array_pairs(), st.sampled_from(sorted(ALLOCATORS)))
def test_constants_roundtrip_and_dedup_iff_bytes_equal(pair, kind):
    a, b = pair
    alloc = ALLOCATORS[kind]()
    pool = ConstantPool(alloc)
    ca, cb = pool.constant(a), pool.constant(b)
    for array, c in ((a, ca), (b, cb)):
        assert (c.shape, c.dtype) == (array.shape, array.dtype)
        assert c.numpy().tobytes() == array.tobytes()  # bit-exact: NaN and -0.0 included
    assert (ca.block is cb.block) == (a.tobytes() == b.tobytes())
    pool.check_invariants()
    ca.release()
    cb.release()
    assert len(pool) == 0
    assert alloc.stats()["allocated_bytes"] == 0
