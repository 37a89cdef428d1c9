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

import allocators
import runtime
from backends.base import RecordError
from backends.numpy import NumpyDevice
from runtime import nn
from runtime.block import Block


class _Launch:
    """A recording: its launch runs the kernels of the bound steps, and none of their Python
    (a device graph replays kernels only: the version marks are the replay's to make)."""

    held_bytes = 0

    def __init__(self, run, checked):
        self.run, self.checked, self.launches = run, checked, 0

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
    RecordError with that reason; `checked` (a function of nothing) gives the layouts a host
    check moved out of the recording would read."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, records_graphs=True)

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.name = "recording"
        self.recordings: list[_Launch] = []
        self.refuse: str | None = None
        self.checked = list

    def _record(self, run):
        if self.refuse is not None:
            raise RecordError(self.refuse)
        self.recordings.append(_Launch(run, self.checked()))
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


def test_a_host_check_of_memory_the_step_writes_is_refused_with_both_ranges():
    """A check moved before the launch must read what the step does not write (its inputs'
    copies); one that reads an intermediate would see the last step's values."""
    device = RecordingDevice()
    holder = {}

    def written_by_the_step():
        capture = holder["step"]._last
        raw, offset = next(iter(capture.bound_memory.values()))
        return [(device.address(raw) + offset, (4,), (1,), 1)]

    nn.manual_seed(0)
    model = nn.Sequential(nn.Dense(6, 3, device=device))
    step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1)),
                         device=device, allocator=allocators.create("direct", device))
    holder["step"] = step
    device.checked = written_by_the_step
    x, y = np.ones((4, 6), np.float32), np.array([0, 1, 2, 0])
    for _ in range(3):
        step(x, y)
    reason = step.memory_report()["device_graph"]
    assert "which the step itself writes" in reason and "4 bytes at 0x" in reason

    def the_labels_copy():
        labels = holder["step"]._last.placeholders[1]
        allocation = labels.block._allocation
        return [(device.address(allocation.raw) + allocation.offset, (labels.nbytes,), (1,),
                 1)]

    device.checked = the_labels_copy
    step.recapture()
    for _ in range(3):
        step(x, y)
    assert step.memory_report()["device_graph"] == "recorded"


def test_only_the_static_plan_records():
    device = RecordingDevice()
    model = nn.Sequential(nn.Dense(2, 2, device=device))
    step = runtime.graph(lambda x: model(x), plan="recycle", device=device)
    for _ in range(3):
        step(np.ones((1, 2), np.float32))
    assert step.memory_report()["device_graph"].startswith("plan 'recycle'")
    assert device.recordings == []
