"""Blocks: lazy allocation, reference counting, generation checks and versions.

Every test uses its own "direct" allocator so that its stats show exactly what the blocks did.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import allocators
import runtime
from runtime import ops


@pytest.fixture
def alloc():
    return allocators.create("direct", "cpu")


def filled(alloc, shape, dtype="float64"):
    """A written tensor of `shape` holding 0, 1, 2, ... on `alloc`."""
    size = int(np.prod(shape))
    return runtime.tensor(np.arange(size, dtype=dtype).reshape(shape), allocator=alloc)


def views_of(t):
    """Several views of a 2-D tensor, each holding its own reference to t's block."""
    return [t[1:], t[:, ::2], t.T, t[::-1, 1], t.reshape(-1), runtime.view(t, (2, 2), offset=3)]


# ---------------------------------------------------------------------- lazy allocation
def test_empty_makes_no_allocator_call(alloc):
    t = runtime.empty((4, 3), "float32", allocator=alloc)
    views = [t[1:], t.T, t.reshape(12), runtime.view(t, (2, 2))]
    assert not t.block.allocated
    assert alloc.stats()["num_allocs"] == 0
    assert alloc.stats()["allocated_bytes"] == 0
    assert all(v.block is t.block for v in views)
    assert t.block.refcount == 5


def test_first_write_through_op_out_allocates_exactly_once(alloc):
    other = allocators.create("direct", "cpu")
    x = runtime.tensor(np.ones((4, 3)), allocator=other)
    t = runtime.empty((4, 3), "float64", allocator=alloc)
    view = t[::2]
    assert alloc.stats()["num_allocs"] == 0
    ops.add(x, x, out=t)
    assert t.block.allocated
    assert alloc.stats()["num_allocs"] == 1
    assert alloc.stats()["allocated_bytes"] == 4 * 3 * 8
    ops.mul(x, 3.0, out=t)
    ops.neg(x[::2], out=view)
    assert alloc.stats()["num_allocs"] == 1
    np.testing.assert_array_equal(t.numpy(), [[-1.0] * 3, [3.0] * 3, [-1.0] * 3, [3.0] * 3])


def test_first_write_through_setitem_allocates_exactly_once(alloc):
    other = allocators.create("direct", "cpu")
    value = runtime.tensor(np.full(3, 7.0, np.float32), allocator=other)
    t = runtime.empty((2, 3), "float32", allocator=alloc)
    t[1] = value
    assert t.block.allocated
    assert alloc.stats()["num_allocs"] == 1
    assert alloc.stats()["allocated_bytes"] == 2 * 3 * 4
    np.testing.assert_array_equal(t[1].numpy(), [7.0, 7.0, 7.0])


def test_setitem_with_a_number_leaves_only_the_block_allocated(alloc):
    t = runtime.empty((2, 3), "float32", allocator=alloc)
    t[...] = 2.5
    assert t.block.allocated
    assert alloc.stats()["active_allocations"] == 1
    assert alloc.stats()["allocated_bytes"] == t.block.nbytes
    np.testing.assert_array_equal(t.numpy(), np.full((2, 3), 2.5, np.float32))


def test_factories_that_fill_allocate_at_once(alloc):
    made = [make((3, 2), "float32", allocator=alloc) for make in (runtime.zeros, runtime.ones)]
    assert all(t.block.allocated and t.block.written for t in made)
    assert alloc.stats()["num_allocs"] == 2
    assert alloc.stats()["allocated_bytes"] == 2 * 3 * 2 * 4


@pytest.mark.parametrize("read", [
    lambda t: t.numpy(),
    lambda t: t[1:].numpy(),
    lambda t: t[0, 0].item(),
    lambda t: repr(runtime.tensor(t)),
])
def test_reading_an_unwritten_block_raises_naming_the_block(alloc, read):
    t = runtime.empty((2, 2), "float32", allocator=alloc)
    with pytest.raises(runtime.UninitializedMemoryError) as info:
        read(t)
    message = str(info.value)
    assert f"block #{t.block.id}" in message
    assert "written" in message
    assert alloc.stats()["num_allocs"] == 0


def test_unwritten_block_as_op_input_raises_and_allocates_nothing(alloc):
    t = runtime.empty((2, 2), "float32", allocator=alloc)
    with pytest.raises(runtime.UninitializedMemoryError, match=f"block #{t.block.id}"):
        ops.exp(t)
    gc.collect()
    assert alloc.stats()["allocated_bytes"] == 0


# ---------------------------------------------------------------------- reference counting
@given(order=st.permutations(range(7)))
@settings(max_examples=30)
def test_memory_returns_only_after_the_last_release(order):
    alloc = allocators.create("direct", "cpu")
    t = filled(alloc, (4, 3))
    handles = [t, *views_of(t)]
    block = t.block
    nbytes = block.nbytes
    assert block.refcount == 7
    for count, i in enumerate(order, start=1):
        assert alloc.stats()["allocated_bytes"] == nbytes
        assert alloc.stats()["num_frees"] == 0
        handles[i].release()
        assert handles[i].released
        assert block.refcount == 7 - count
    assert not block.allocated
    assert alloc.stats()["allocated_bytes"] == 0
    assert alloc.stats()["num_frees"] == 1
    alloc.check_invariants()


@given(order=st.permutations(range(7)))
@settings(max_examples=30)
def test_memory_returns_only_after_the_last_handle_is_collected(order):
    alloc = allocators.create("direct", "cpu")
    t = filled(alloc, (4, 3))
    handles = [t, *views_of(t)]
    block = t.block
    del t
    for count, i in enumerate(order, start=1):
        assert alloc.stats()["allocated_bytes"] == block.nbytes
        assert alloc.stats()["num_frees"] == 0
        handles[i] = None  # CPython frees at once; the collector only matters for cycles
        assert block.refcount == 7 - count
    assert not block.allocated
    assert alloc.stats()["allocated_bytes"] == 0
    assert alloc.stats()["num_frees"] == 1


def test_a_handle_in_a_reference_cycle_is_released_by_the_collector(alloc):
    t = filled(alloc, (2, 2))
    cycle = [t[0]]
    cycle.append(cycle)
    del t, cycle
    gc.collect()
    assert alloc.stats()["allocated_bytes"] == 0
    assert alloc.stats()["num_frees"] == 1


def test_releasing_twice_is_harmless(alloc):
    t = filled(alloc, (2, 3))
    v = t[1]
    v.release()
    v.release()
    assert t.block.refcount == 1
    np.testing.assert_array_equal(t.numpy(), np.arange(6.0).reshape(2, 3))
    t.release()
    t.release()
    del t, v
    gc.collect()
    assert alloc.stats()["num_frees"] == 1
    assert alloc.stats()["allocated_bytes"] == 0
    alloc.check_invariants()


def test_releasing_an_unwritten_block_frees_nothing(alloc):
    t = runtime.empty((2, 3), allocator=alloc)
    v = t.T
    t.release()
    v.release()
    assert alloc.stats()["num_allocs"] == 0
    assert alloc.stats()["num_frees"] == 0


USES = {
    "numpy": lambda t, other: t.numpy(),
    "item": lambda t, other: t[0, 0].item(),
    "copy": lambda t, other: ops.copy(t),
    "op input": lambda t, other: ops.add(other, t),
    "op out": lambda t, other: ops.add(other, other, out=t),
    "slicing": lambda t, other: t[1:],
    "transpose": lambda t, other: t.T,
    "reshape": lambda t, other: t.reshape(6),
    "view": lambda t, other: runtime.view(t, (3,)),
    "setitem": lambda t, other: t.__setitem__(0, 1.0),
    "operator": lambda t, other: t + other,
}


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
def test_use_after_release_raises(alloc, use):
    t = filled(alloc, (2, 3))
    other = filled(alloc, (2, 3))
    keep = t[:]  # the block stays allocated: only the handle is gone
    t.release()
    with pytest.raises(runtime.UseAfterFreeError, match="released"):
        use(t, other)
    assert keep.block.allocated
    np.testing.assert_array_equal(keep.numpy(), np.arange(6.0).reshape(2, 3))


def test_repr_of_released_tensor_says_freed(alloc):
    t = filled(alloc, (2, 3))
    t.release()
    assert "<freed>" in repr(t)


# ---------------------------------------------------------------------- block.free()
def test_free_with_views_alive_makes_every_view_stale(alloc):
    t = filled(alloc, (4, 3))
    views = views_of(t)
    block = t.block
    fresh = allocators.create("direct", "cpu")
    block.free()
    assert not block.allocated
    assert block.refcount == 0
    assert alloc.stats()["allocated_bytes"] == 0
    assert alloc.stats()["num_frees"] == 1
    for handle in [t, *views]:
        with pytest.raises(runtime.UseAfterFreeError, match=f"block #{block.id}"):
            handle.numpy()
        with pytest.raises(runtime.UseAfterFreeError):
            handle[0]
        with pytest.raises(runtime.UseAfterFreeError):
            ops.neg(handle)
        with pytest.raises(runtime.UseAfterFreeError):
            ops.neg(runtime.tensor(np.zeros(handle.shape), allocator=fresh), out=handle)
        assert "<freed>" in repr(handle)


def test_stale_handles_released_or_collected_after_free_do_not_double_free(alloc):
    t = filled(alloc, (4, 3))
    views = views_of(t)
    t.block.free()
    views[0].release()
    views[0].release()
    del views
    t.release()
    gc.collect()
    stats = alloc.stats()
    assert stats["num_frees"] == 1
    assert stats["num_allocs"] == 1
    assert stats["allocated_bytes"] == 0
    alloc.check_invariants()


def test_free_twice_frees_once(alloc):
    t = filled(alloc, (3,))
    t.block.free()
    t.block.free()
    assert alloc.stats()["num_frees"] == 1
    assert alloc.stats()["allocated_bytes"] == 0


def test_a_freed_block_can_be_acquired_again_lazily(alloc):
    t = filled(alloc, (4, 3))
    stale = t[1:]
    block = t.block
    old_generation = block.generation
    block.free()
    again = runtime.Tensor(block, (12,), "float64")
    assert block.generation > old_generation
    assert block.refcount == 1
    assert not block.allocated
    assert alloc.stats()["num_allocs"] == 1
    with pytest.raises(runtime.UninitializedMemoryError):
        again.numpy()
    again[...] = 5.0
    assert block.allocated
    assert alloc.stats()["active_allocations"] == 1
    assert alloc.stats()["allocated_bytes"] == block.nbytes
    # The stale handles must neither work nor drop the new handle's reference.
    with pytest.raises(runtime.UseAfterFreeError):
        stale.numpy()
    stale.release()
    t.release()
    del stale, t
    gc.collect()
    assert block.refcount == 1
    np.testing.assert_array_equal(again.numpy(), np.full(12, 5.0))
    again.release()
    assert alloc.stats()["active_allocations"] == 0
    assert alloc.stats()["allocated_bytes"] == 0
    alloc.check_invariants()


# ---------------------------------------------------------------------- versions
def test_version_moves_on_at_every_write_through_any_view(alloc):
    t = filled(alloc, (4, 3))
    views = views_of(t)
    other = runtime.tensor(np.ones(3), allocator=alloc)
    seen = [t.version]
    writes = [
        lambda: t.__setitem__((0, 0), 9.0),
        lambda: views[0].__setitem__(..., 1.5),
        lambda: ops.add(other, other, out=views[0][0]),
        lambda: ops.relu(views[1], out=views[1]),
        lambda: views[2].__setitem__(1, 0.0),
        lambda: ops.copy(other[:2], out=views[5][0]),
    ]
    for write in writes:
        write()
        seen.append(t.version)
        assert all(v.version == t.version for v in views)
    assert seen == sorted(set(seen)), seen  # strictly increasing


def test_reads_do_not_move_the_version(alloc):
    t = filled(alloc, (4, 3))
    before = t.version
    t.numpy()
    t[1:].numpy()
    ops.add(t, t)
    ops.sum(t.T)
    assert t.version == before


# ---------------------------------------------------------------------- stateful model
class BlockModel:
    """What a block should be: its contents (NaN where unknown), live handles, written or not."""

    def __init__(self, tensor):
        self.block = tensor.block
        self.data = np.full(tensor.shape, np.nan)
        self.refs = 0
        self.written = False


class HandleModel:
    """A tensor handle, the NumPy view of its block's model that it mirrors, and its liveness."""

    def __init__(self, tensor, model, block):
        self.tensor = tensor
        self.model = model
        self.block = block
        self.live = True


VIEW_KEYS = {"rows": np.s_[1:], "step": np.s_[..., ::2], "reverse": np.s_[::-1],
             "col": np.s_[..., -1:], "none": np.s_[None], "T": None}


class BlockMachine(RuleBasedStateMachine):
    """Random handle lifetimes over a few blocks, checked against a plain model: the allocator
    holds exactly the written blocks that have a live handle, and stale handles raise."""

    def __init__(self):
        super().__init__()
        self.alloc = allocators.create("direct", "cpu")
        self.source = allocators.create("direct", "cpu")
        self.blocks: list[BlockModel] = []
        self.handles: list[HandleModel] = []

    def _pick(self, data):
        # NOTE: draw an index, not the handle, so hypothesis keeps no reference to the tensor.
        return self.handles[data.draw(st.integers(0, len(self.handles) - 1), label="handle")]

    def _add(self, tensor, model, b):
        self.handles.append(HandleModel(tensor, model, b))
        b.refs += 1

    def _dropped(self, h):
        if not h.live:
            return
        h.live = False
        h.block.refs -= 1
        if h.block.refs == 0:
            self._memory_returned(h.block)

    def _memory_returned(self, b):
        b.refs = 0
        b.written = False
        b.data[...] = np.nan
        for h in self.handles:
            if h.block is b:
                h.live = False

    # ---------------------------------------------------------------- rules
    @precondition(lambda self: len(self.blocks) < 4)
    @rule(rows=st.integers(1, 4), cols=st.integers(1, 4))
    def create(self, rows, cols):
        t = runtime.empty((rows, cols), "float64", allocator=self.alloc)
        b = BlockModel(t)
        self.blocks.append(b)
        self._add(t, b.data, b)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), kind=st.sampled_from(sorted(VIEW_KEYS)))
    def make_view(self, data, kind):
        h = self._pick(data)
        key = VIEW_KEYS[kind]
        if not h.live:
            with pytest.raises(runtime.UseAfterFreeError):
                h.tensor[key] if key is not None else h.tensor.T
            return
        view = h.tensor[key] if key is not None else h.tensor.T
        model = h.model[key] if key is not None else h.model.T
        assert view.block is h.tensor.block
        self._add(view, model, h.block)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), twice=st.booleans())
    def release(self, data, twice):
        h = self._pick(data)
        h.tensor.release()
        if twice:
            h.tensor.release()
        self._dropped(h)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def delete(self, data):
        h = self._pick(data)
        self.handles = [other for other in self.handles if other is not h]
        h.tensor = None  # the last reference: CPython finalises the tensor here
        self._dropped(h)

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), value=st.floats(-100, 100), through_op=st.booleans())
    def write(self, data, value, through_op):
        h = self._pick(data)
        t = h.tensor
        if not h.live:
            with pytest.raises(runtime.UseAfterFreeError):
                t[...] = value
            return
        if through_op:
            ops.copy(runtime.tensor(np.float64(value), allocator=self.source), out=t)
        else:
            t[...] = np.full(t.shape, value)
        h.model[...] = value
        h.block.written = True

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def read(self, data):
        h = self._pick(data)
        if not h.live:
            with pytest.raises(runtime.UseAfterFreeError):
                h.tensor.numpy()
        elif not h.block.written:
            with pytest.raises(runtime.UninitializedMemoryError):
                h.tensor.numpy()
        else:
            got = h.tensor.numpy()
            known = ~np.isnan(h.model)
            np.testing.assert_array_equal(got[known], h.model[known])

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def free_block(self, data):
        b = self.blocks[data.draw(st.integers(0, len(self.blocks) - 1), label="block")]
        b.block.free()
        self._memory_returned(b)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def acquire_again(self, data):
        b = self.blocks[data.draw(st.integers(0, len(self.blocks) - 1), label="block")]
        rows, cols = b.data.shape
        t = runtime.Tensor(b.block, (cols, rows), "float64", strides=(1, cols))
        self._add(t, b.data.T, b)

    @precondition(lambda self: self.blocks)
    @rule(data=st.data())
    def unbalanced_release(self, data):
        """A release with no reference left to drop raises and changes nothing; with references
        left it is a normal release and is not tried (it would strand a handle)."""
        b = self.blocks[data.draw(st.integers(0, len(self.blocks) - 1), label="block")]
        if b.refs:
            return
        before = (b.block.generation, b.block.allocated, dict(self.alloc.stats()))
        with pytest.raises(allocators.InvalidFreeError, match=r"without a matching acquire"):
            b.block.release(b.block.generation)
        assert b.block.refcount == 0
        assert (b.block.generation, b.block.allocated, dict(self.alloc.stats())) == before

    # ---------------------------------------------------------------- invariants
    @invariant()
    def accounting_matches_the_model(self):
        held = [b for b in self.blocks if b.refs > 0 and b.written]
        stats = self.alloc.stats()
        assert stats["allocated_bytes"] == sum(b.block.nbytes for b in held)
        assert stats["active_allocations"] == len(held)
        for b in self.blocks:
            assert b.block.refcount == b.refs
            assert b.block.allocated == any(b is other for other in held)
        self.alloc.check_invariants()

    def teardown(self):
        self.handles.clear()
        gc.collect()
        assert self.alloc.stats()["allocated_bytes"] == 0


TestBlockMachine = BlockMachine.TestCase
# NOTE: 25 programs of up to 30 steps; more in soak mode (docs/testing.md)
TestBlockMachine.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)


def test_a_released_tensor_does_not_keep_its_memory_alive():
    import weakref

    alloc = allocators.create("direct", "cpu")
    t = runtime.tensor(np.arange(6.0), allocator=alloc)
    t.numpy()  # builds and caches the native view over the raw memory
    raw = weakref.ref(t.block._allocation.raw.base)  # the NumPy buffer behind the raw memory
    t.release()
    gc.collect()
    assert alloc.stats()["allocated_bytes"] == 0
    assert raw() is None, "the released tensor still pins the memory its allocator freed"
    with pytest.raises(runtime.UseAfterFreeError):
        t.numpy()
