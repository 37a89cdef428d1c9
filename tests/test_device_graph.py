"""A static plan replayed as one device graph (Note [a static plan as one device graph] in
runtime/graph/replay.py), on the CPU: the replay's side of it (when it records, what stays
outside the recording, when it refuses, what the report says) with a host device whose
`record` keeps the bound steps and whose `launch` runs them again. The CUDA device's own
recording (stream capture) is tested in tests/test_cuda.py where a GPU is at hand.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_budget import batch, deep_step, forced_rates

import allocators
import runtime
from backends.base import HostCheck, RecordError
from backends.numpy import NumpyDevice
from runtime import nn
from runtime.block import Block


class _Launch:
    """A recording: its launch runs the kernels of the bound steps, and none of their Python
    (a device graph replays kernels only: the version marks are the replay's to make)."""

    held_bytes = 0

    def __init__(self, run, checks):
        self.run, self.checks, self.launches = run, checks, 0

    def launch(self):
        self.launches += 1
        mark, Block.mark_written = Block.mark_written, lambda block: None
        try:
            self.run()
        finally:
            Block.mark_written = mark


class RecordingDevice(NumpyDevice):
    """Host memory and kernels; `record` keeps the function (nothing runs), and each launch
    runs it again, as a device graph launches what it recorded. `refuse` makes `record` raise
    RecordError with that reason; `checks` (a function of nothing) gives the host checks
    (`HostCheck`) that a recording moved out of the graph."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, records_graphs=True)

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.name = "recording"
        self.recordings: list[_Launch] = []
        self.refuse: str | None = None
        self.checks = list

    def _record(self, run):
        if self.refuse is not None:
            raise RecordError(self.refuse)
        self.recordings.append(_Launch(run, self.checks()))
        return self.recordings[-1]


def _train(device, device_graph, optimizer="sgd", steps=5):
    nn.manual_seed(0)
    model = nn.Sequential(nn.Dense(6, 16, device=device), nn.ReLU(),
                          nn.Dense(16, 3, device=device))
    opt = (nn.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else nn.Adam(model.parameters(), lr=1e-2))
    step = runtime.graph(nn.train_step(model, opt), device=device, device_graph=device_graph,
                         allocator=allocators.create("direct", device))
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6)).astype(np.float32), rng.integers(0, 3, 8)
    losses = []
    for _ in range(steps):
        before = [p.version for p in model.parameters()]
        losses.append(step(x, y).item())
        # NOTE: what each step wrote moved its version on, launched or not
        assert all(p.version > v for p, v in zip(model.parameters(), before))
    return losses, [p.numpy() for p in model.parameters()], step, model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_second_replay_records_and_later_ones_launch_with_the_same_bits(optimizer):
    device = RecordingDevice()
    graphed, params, step, model = _train(device, True, optimizer)
    assert len(device.recordings) == 1 and device.recordings[0].launches == 4
    assert step.memory_report()["device_graph"] == "recorded"
    assert step.memory_report()["device_graph_bytes"] == 0
    launched, launched_params, other, _ = _train(RecordingDevice(), False, optimizer)
    assert other.memory_report()["device_graph"] == "device_graph=False: launch by launch"
    assert graphed == launched and graphed[-1] < graphed[0]
    for p, q in zip(params, launched_params):
        np.testing.assert_array_equal(p.view(np.uint8), q.view(np.uint8))


def test_a_load_inside_the_step_copies_bytes_staged_on_the_device_once():
    device = RecordingDevice()
    _, _, step, _ = _train(device, True, steps=3)
    capture = step._last
    loads = [i for s in capture.steps for i in s.instructions if i.kind == "load"]
    assert loads and len(capture.staged) == len(loads)
    for instr, raw in zip(loads, capture.staged):
        host = np.ascontiguousarray(instr.host)
        np.testing.assert_array_equal(device.copyout(raw, 0, host.nbytes),
                                      host.reshape(-1).view(np.uint8))
    step.recapture()
    assert capture.staged == [] and capture.recording is None


def test_a_step_the_device_cannot_record_runs_launch_by_launch_and_says_why():
    device = RecordingDevice()
    device.refuse = "recording: the step reads memory back to the host"
    refused, params, step, _ = _train(device, True)
    assert step.memory_report()["device_graph"] == device.refuse
    launched, launched_params, _, _ = _train(RecordingDevice(), False)
    assert refused == launched
    for p, q in zip(params, launched_params):
        np.testing.assert_array_equal(p, q)


def host_check(t, check) -> HostCheck:
    """A HostCheck of tensor `t`'s memory, as a device makes one: its layout at its device
    address (written out here, not the replay's own helper), its native view, and `check`."""
    allocation = t.block._allocation
    offset, shape, strides, itemsize = t.layout()
    return HostCheck((t.device.address(allocation.raw) + allocation.offset + offset, shape,
                      strides, itemsize), t._native_read("test"), check)


def labels_check(holder: dict, log: list):
    """`RecordingDevice.checks` as the CUDA device's cross_entropy moves its check out of a
    recording: one HostCheck of the graph's copy of the labels (argument 1), which logs the
    array it is given and refuses a label outside [0, 3)."""

    def check(array):
        log.append(array)
        bad = array[(array < 0) | (array >= 3)]
        if bad.size:
            raise ValueError(f"the host check: label {int(bad[0])} is outside [0, 3)")

    return lambda: [host_check(holder["step"]._last.placeholders[1], check)]


def one_layer_step(device: RecordingDevice) -> tuple[dict, nn.Module]:
    nn.manual_seed(0)
    model = nn.Sequential(nn.Dense(6, 3, device=device))
    step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1)),
                         device=device, allocator=allocators.create("direct", device))
    return {"step": step}, model


def test_a_host_check_of_memory_the_step_writes_is_refused_with_both_ranges():
    """A check moved before the launch must read what the step does not write (its inputs'
    copies); one that reads an intermediate would see the last step's values."""
    device = RecordingDevice()
    holder, _ = one_layer_step(device)
    step = holder["step"]

    def written_by_the_step():
        raw, offset = next(iter(step._last.bound_memory.values()))
        return [HostCheck((device.address(raw) + offset, (4,), (1,), 1), None, print)]

    device.checks = written_by_the_step
    x, y = np.ones((4, 6), np.float32), np.array([0, 1, 2, 0])
    for _ in range(3):
        step(x, y)
    reason = step.memory_report()["device_graph"]
    assert "which the step itself writes" in reason and "4 bytes at 0x" in reason

    device.checks = labels_check(holder, [])
    step.recapture()
    for _ in range(3):
        step(x, y)
    assert step.memory_report()["device_graph"] == "recorded"


def test_host_labels_are_checked_on_the_host_and_bad_ones_refused_before_any_write():
    """Labels passed as a host array: the check before each launch reads that array, not the
    device (no wait for the device's queue); a bad label raises before anything is written."""
    device = RecordingDevice()
    log: list = []
    holder, model = one_layer_step(device)
    device.checks = labels_check(holder, log)
    x = np.ones((4, 6), np.float32)
    batches = [np.array([0, 1, 2, k % 3]) for k in range(5)]
    for y in batches:
        holder["step"](x, y)
    assert device.recordings[0].launches == 4 and len(log) == 4
    for checked, y in zip(log, batches[1:]):
        assert np.shares_memory(checked, y)
    before = [(p.version, p.numpy()) for p in model.parameters()]
    with pytest.raises(ValueError, match="the host check: label 7 is outside"):
        holder["step"](x, np.array([0, 7, 1, 2]))
    for p, (version, values) in zip(model.parameters(), before):
        assert p.version == version
        np.testing.assert_array_equal(p.numpy(), values)


def test_device_labels_are_checked_again_only_after_a_write_could_have_changed_them():
    """Labels in a tensor: checked at the first launch, skipped while nothing can have written
    them (the rule of runtime/amp.py's working copies, `dlpack.seen`), checked again after a
    write through the runtime, at every launch while a DLPack export lives, and once after it
    ended; a bad label written in is refused."""
    device = RecordingDevice()
    log: list = []
    holder, model = one_layer_step(device)
    device.checks = labels_check(holder, log)
    step, x = holder["step"], np.ones((4, 6), np.float32)
    labels = runtime.tensor(np.array([0, 1, 2, 0]), device=device)
    for _ in range(4):
        step(x, labels)
    assert device.recordings[0].launches == 3 and len(log) == 1
    labels[1] = 2
    step(x, labels)
    step(x, labels)
    assert len(log) == 2 and log[-1][1] == 2
    exported = np.from_dlpack(labels)
    step(x, labels)
    step(x, labels)
    assert len(log) == 4
    del exported
    step(x, labels)
    step(x, labels)
    assert len(log) == 5
    labels[2] = 3
    with pytest.raises(ValueError, match="the host check: label 3 is outside"):
        step(x, labels)


def test_only_the_static_plan_records():
    device = RecordingDevice()
    model = nn.Sequential(nn.Dense(2, 2, device=device))
    step = runtime.graph(lambda x: model(x), plan="recycle", device=device)
    for _ in range(3):
        step(np.ones((1, 2), np.float32))
    assert step.memory_report()["device_graph"].startswith("plan 'recycle'")
    assert device.recordings == []


class SeparateRecordingDevice(RecordingDevice):
    """A recording device whose memory counts as not the host's (as CUDA's), so that a budget
    may move results to host memory and back."""

    capabilities = dataclasses.replace(RecordingDevice.capabilities, host_memory=False)


def test_a_plan_that_moves_results_to_host_memory_is_not_recorded_and_keeps_its_bits():
    """An offload reads device memory to the host each step, and its reload copies those
    bytes back: a recording would replay the first step's bytes (a staged load) and return
    wrong results silently (found on an H200, tests/test_graph.py under a budget). The plan
    runs launch by launch, says why, and equals the unconstrained graph bit for bit."""
    device = SeparateRecordingDevice()
    x, y = batch(rows=8, width=16)
    model, step = deep_step(6, 16, device=device)
    reference = runtime.graph(step, device=device)
    expected = [reference(x, y).item() for _ in range(4)]
    want = [p.numpy() for p in model.parameters()]
    assert device.recordings and reference.memory_report()["device_graph"] == "recorded"
    need = reference.memory_report()["planned_bytes"]
    model, step = deep_step(6, 16, device=device)
    with forced_rates(device, per_byte=1e-12, per_flop=1e-9, per_element=0.0, per_call=0.0):
        graph = runtime.graph(step, device=device, memory_budget=need * 7 // 10)
        got = [graph(x, y).item() for _ in range(4)]
    report = graph.memory_report()
    assert report["moved"] > 0 and len(device.recordings) == 1
    assert report["device_graph"].startswith("memory_budget moves results to host memory")
    assert got == expected
    for p, q in zip(model.parameters(), want):
        np.testing.assert_array_equal(p.numpy(), q)


def test_a_host_check_of_memory_outside_the_arguments_reads_the_device_at_every_launch():
    """A check whose memory is no argument's copy (state from outside the step) cannot know
    that nothing wrote it: it reads its view before every launch."""
    device = RecordingDevice()
    holder, _ = one_layer_step(device)
    outside = runtime.tensor(np.array([0, 1, 2]), device=device)
    log = []

    device.checks = lambda: [host_check(outside, log.append)]
    for _ in range(5):
        holder["step"](np.ones((4, 6), np.float32), np.array([0, 1, 2, 0]))
    assert device.recordings[0].launches == 4 and len(log) == 4
    assert all(np.shares_memory(view, outside._native_read("test")) for view in log)


@settings(max_examples=30, deadline=None)
@given(depth=st.integers(2, 10), width=st.sampled_from([8, 16]), rows=st.integers(1, 8),
       seed=st.integers(0, 2**16), fraction=st.sampled_from([0.7, 0.4, 0.0]),
       moves_cheap=st.booleans())
def test_budgeted_steps_launch_with_the_bits_of_launch_by_launch(depth, width, rows, seed,
                                                                 fraction, moves_cheap):
    """Deep training steps under a budget that recomputes or moves results to host memory (a
    device whose memory is not the host's, rates set to choose either), on a recording device:
    recorded replays give the launch-by-launch replay's losses and parameters bit for bit, with
    the same allocator peak (a recording once allocated every fused chain's inner result, found
    by tests/test_budget.py on an H200), and a plan with moves is never recorded."""
    device = SeparateRecordingDevice()
    rng = np.random.default_rng(seed)
    batches = [(rng.standard_normal((rows, width), dtype=np.float32),
                rng.integers(0, 10, rows)) for _ in range(4)]
    results = {}
    with forced_rates(device, per_byte=1e-12 if moves_cheap else 1e-3, per_flop=1e-9,
                      per_element=0.0, per_call=0.0):
        need = runtime.graph(deep_step(depth, width, seed, device)[1], device=device,
                             device_graph=False)
        need(*batches[0])
        budget = int(need.memory_report()["planned_bytes"] * fraction)
        try:
            runtime.graph(deep_step(depth, width, seed, device)[1], device=device,
                          memory_budget=budget)(*batches[0])
        except runtime.BudgetError as refused:
            budget = refused.least_bytes
        for device_graph in (True, False):
            model, step = deep_step(depth, width, seed, device)
            stats = allocators.StatisticsAdaptor(allocators.create("direct", device))
            graph = runtime.graph(step, device=device, device_graph=device_graph,
                                  memory_budget=budget, allocator=stats)
            losses = [graph(x, y).item() for x, y in batches]
            results[device_graph] = (losses, [p.numpy() for p in model.parameters()],
                                     graph.memory_report(), stats.stats()["peak_allocated_bytes"])
    (recorded, params, report, peak), (launched, launched_params, _, launched_peak) = (
        results[True], results[False])
    assert peak == launched_peak  # NOTE: a recording allocates nothing from the graph's
    np.testing.assert_array_equal(np.array(recorded), np.array(launched))
    for p, q in zip(params, launched_params):
        np.testing.assert_array_equal(p.view(np.uint8), q.view(np.uint8))
    event(f"moved {bool(report['moved'])}, recomputed {bool(report['recomputed'])}")
    if report["moved"]:
        assert report["device_graph"].startswith("memory_budget moves results to host memory")
    else:
        assert report["device_graph"] == "recorded"
