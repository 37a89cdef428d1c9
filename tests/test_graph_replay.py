"""What a replay may rely on between calls (issue 27, part 2): the captures of a thread that
ended never pass to a new thread (Python reuses `threading.get_ident()`, and the new thread's
calls would overwrite the results the old one handed out), and a replay that would read or
write a block the user freed (`Block.free()`) raises `UseAfterFreeError` before anything runs,
as eager execution raises, where it used to compute on memory handed back to the allocator."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_graph_training import build, data, training_programs

import runtime
from runtime import UseAfterFreeError, nn, ops
from runtime.graph import PLANS


# ---------------------------------------------------------------------- threads
def doubled(value: float) -> np.ndarray:
    return np.full((2, 3), 2.0 * value)


def test_threads_that_end_never_hand_their_results_to_a_new_thread():
    """20 short threads one after another (Python gives most of them the ident of one that
    ended), each keeping the result of its one call: every result stays its own."""
    graph = runtime.graph(lambda a: ops.mul(a, 2.0))
    kept: dict[int, runtime.Tensor] = {}

    def call(i: int) -> None:
        kept[i] = graph(np.full((2, 3), float(i)))

    idents = set()
    for i in range(20):
        thread = threading.Thread(target=call, args=(i,))
        thread.start()
        idents.add(thread.ident)
        thread.join()
    assert len(idents) < 20  # NOTE: the reuse the bug needed happened
    for i, result in kept.items():
        np.testing.assert_array_equal(result.numpy(), doubled(i), err_msg=f"thread {i}")


@pytest.mark.parametrize("plan", PLANS)
def test_concurrent_threads_in_waves_keep_their_last_results(plan: str):
    """Waves of 4 threads call the graph at once, several times each, and keep their last
    result (a thread's next call overwrites the one before, as documented); later waves reuse
    the idents of earlier ones. Every thread's last result is its own input doubled."""
    graph = runtime.graph(lambda a: ops.add(ops.mul(a, 2.0), ops.mul(a, 0.0)), plan=plan)
    kept: dict[int, tuple[float, runtime.Tensor]] = {}

    def calls(serial: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for k in range(3):
            value = float(100 * serial + k)
            kept[serial] = (value, graph(np.full((2, 3), value)))

    for wave in range(5):
        barrier = threading.Barrier(4)
        threads = [threading.Thread(target=calls, args=(4 * wave + i, barrier)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(kept) == 20
    for serial, (value, result) in kept.items():
        np.testing.assert_array_equal(result.numpy(), doubled(value), err_msg=f"thread {serial}")


def test_the_captures_of_threads_that_ended_are_dropped():
    """A thread that ends cannot call again: its captures go (and their memory) when a new
    one is made, so a pool of short threads neither fills `max_captures` nor warns; results
    the ended threads handed out stay theirs."""
    graph = runtime.graph(lambda a: ops.mul(a, 2.0), max_captures=4)
    kept = {}

    def call(i: int) -> None:
        kept[i] = graph(np.full((2, 3), float(i)))

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # NOTE: the max_captures warning would fail the test
        for i in range(12):
            thread = threading.Thread(target=call, args=(i,))
            thread.start()
            thread.join()
    assert len(graph._captures) <= 2  # the last thread's, and at most one more not yet pruned
    for i, result in kept.items():
        np.testing.assert_array_equal(result.numpy(), doubled(i))


# ---------------------------------------------------------------------- freed blocks
def adam_step(plan: str) -> tuple[nn.Module, nn.Adam, runtime.Graph]:
    nn.manual_seed(0)
    model = nn.Sequential(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
    opt = nn.Adam(model.parameters(), lr=0.1)
    return model, opt, runtime.graph(nn.train_step(model, opt), plan=plan)


BATCH = (np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4), np.array([0, 2]))


def state_tensors(opt: nn.Optimizer) -> list[runtime.Tensor]:
    """The optimizer's state tensors (momenta, moments), parameter by parameter."""
    return [value for state in opt.state.values() for value in state.values()
            if isinstance(value, runtime.Tensor)]


def snapshot(model: nn.Module, opt: nn.Optimizer) -> list[np.ndarray]:
    """Every parameter and every optimizer state tensor that still holds memory."""
    held = [*model.parameters(), *state_tensors(opt)]
    return [t.numpy().copy() for t in held if t.block.allocated]


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("what", ["weight", "bias", "moment", "output"])
def test_a_replay_that_touches_a_freed_block_raises_and_writes_nothing(plan: str, what: str):
    model, opt, step = adam_step(plan)
    loss = step(*BATCH)
    victim = {"weight": model.parameters()[0], "bias": model.parameters()[3],
              "moment": state_tensors(opt)[0], "output": loss}[what]
    if what != "output":  # eager raises too, naming the block
        eager = nn.train_step(model, opt)
        victim.block.free()
        with pytest.raises(UseAfterFreeError, match=f"block #{victim.block.id}"):
            eager(runtime.tensor(BATCH[0]), runtime.tensor(BATCH[1]))
        model, opt, step = adam_step(plan)
        step(*BATCH)
        victim = {"weight": model.parameters()[0], "bias": model.parameters()[3],
                  "moment": state_tensors(opt)[0]}[what]
    block = victim.block
    block.free()
    before = snapshot(model, opt)
    for _ in range(2):  # and again: a freed block stays freed
        with pytest.raises(UseAfterFreeError) as caught:
            step(*BATCH)
        message = str(caught.value)
        assert f"block #{block.id}" in message and "nothing has run" in message
        assert "recapture()" in message
        for now, then in zip(snapshot(model, opt), before):
            np.testing.assert_array_equal(now, then)
    if what == "output":  # the graph's own memory: a new capture makes it again
        step.recapture()
        assert np.isfinite(step(*BATCH).item())


def test_a_freed_tensor_argument_raises_as_eager():
    graph = runtime.graph(lambda a: ops.mul(a, 2.0))
    x = runtime.tensor(np.ones(3))
    graph(x)
    x.block.free()
    with pytest.raises(UseAfterFreeError, match=f"block #{x.block.id}"):
        ops.mul(x, 2.0)
    with pytest.raises(UseAfterFreeError, match=f"block #{x.block.id}"):
        graph(x)


def test_a_freed_constant_raises_on_replay():
    c = runtime.tensor(np.arange(3.0))
    graph = runtime.graph(lambda a: ops.add(a, c), plan="static")
    np.testing.assert_array_equal(graph(np.ones(3)).numpy(), [1.0, 2.0, 3.0])
    c.block.free()
    with pytest.raises(UseAfterFreeError, match=f"block #{c.block.id}.*reads"):
        graph(np.ones(3))


@settings(max_examples=40, deadline=None)
@given(program=training_programs(), plan=st.sampled_from(PLANS), fuse=st.booleans(),
       victim=st.sampled_from(["argument", "output", "parameter", "state"]),
       pick=st.integers(0, 2**16))
def test_random_programs_with_a_block_freed_between_replays(program, plan, fuse, victim, pick):
    """Random training programs under every plan: between two replays a tensor argument, an
    output, a parameter or optimizer state is freed. Where eager raises (argument, parameter,
    state), the replay raises the same UseAfterFreeError; for an output (graph memory) it
    raises too. The replay writes nothing that lasts (eager may: it raises where it meets the
    block); the other parameters and the state stay as they were."""
    batches = data(program)
    model, opt, step = build(program)
    graph = runtime.graph(step, plan=plan, fuse=fuse)
    x, t = batches[0]
    loss = graph(x, t)
    graph(x, t)
    state = [s for s in state_tensors(opt) if s.block.allocated]
    if victim == "state" and not state:
        victim = "parameter"  # NOTE: plain SGD keeps no state
    args = (runtime.tensor(x), runtime.tensor(t))
    if victim == "argument":
        target = args[pick % 2]
    elif victim == "output":
        target = loss
    elif victim == "parameter":
        target = model.parameters()[pick % len(model.parameters())]
    else:
        target = state[pick % len(state)]
    target.block.free()
    if victim != "output":  # NOTE: eager may write state before it reaches the freed block
        with pytest.raises(UseAfterFreeError, match=f"block #{target.block.id}"):
            step(*args)
    before = snapshot(model, opt)
    with pytest.raises(UseAfterFreeError, match=f"block #{target.block.id}"):
        graph(*args)
    for now, then in zip(snapshot(model, opt), before):
        np.testing.assert_array_equal(now, then)
