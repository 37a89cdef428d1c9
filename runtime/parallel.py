"""Data parallelism's machinery: gradients reduced across a group in buckets during backward,
and ZeRO's shards (runtime/nn.py's `DistributedDataParallel` and `ZeroRedundancyOptimizer`
are its public face).

Note [buckets in backward]: the parameters are split into buckets of at most `bucket_cap`
bytes, in reverse order of `parameters()` (the order backward meets them; PyTorch's Reducer
does the same), one dtype and device per bucket. A `Reducer` is the gradient-ready hook
(Note [gradient-ready hooks] in runtime/autograd.py) of every parameter: as each gradient is
whole it is copied into its bucket's host buffer, and when the bucket's last one is in, the
bucket's non-blocking collective starts, while backward goes on computing the other
gradients; between gradients the hook tests the collectives in flight, which is when MPI moves
them on. Buckets start in their index order on every rank (MPI matches collectives by order),
so a bucket that fills early waits for the ones before it. At the pass's end (`finish`) every
collective is waited for and only then are results written: the averaged gradients into the
gradients backward computed (data parallel, `stage=0`), or this rank's part of them into the
gradients of its shard parameters (ZeRO, stages 1 and 2). Nothing is stored before every
collective of the step completed (Note [the commit point] in runtime/nn.py).

ZeRO (Rajbhandari et al. 2020): each bucket is padded to a multiple of the group's size, and
rank r owns part r of it: a flat "shard parameter" with its own gradient, and so its own
optimizer state (the optimizer sees only the shard parameters). Stage 1 all-reduces the
bucket as data parallel does and keeps its part; stage 2 reduce-scatters, so the full
gradients live only in one bucket buffer, which the next bucket takes once the bucket before
has been reduced (a layer's backward later), and leave the pass as soon as they are copied
in. After the optimizer's step the shards are all-gathered into a host copy of every bucket,
and once every bucket has arrived the parameters are written (`gather`).

Host staging: a device whose memory is the host's (the CPU) is read and written through its
NumPy views; any other (OpenCL, CUDA) through copies to and from the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from runtime import distributed, tape
from runtime._tensor import Tensor, empty, tensor
from runtime.autograd import no_grad, register_ready_hook
from runtime.errors import GraphCaptureError

__all__ = ["Reducer", "bucket_plan"]

#: PyTorch DDP's default bucket size (bucket_cap_mb=25)
DEFAULT_BUCKET_BYTES = 25 << 20


def _staging_dtype(dtype: np.dtype) -> np.dtype:
    """The host dtype a gradient is summed in: its own for float32 / float64; float32 for the
    two-byte floats, which MPI has no standard type for (rounded back once, as the ops do)."""
    return dtype if dtype in (np.float32, np.float64) else np.dtype(np.float32)


def bucket_plan(params: list[Tensor], cap: int) -> list[list[int]]:
    """The buckets, as lists of indices into `params`: reverse order, a new bucket where the
    dtype or the device changes or the next gradient would take it past `cap` bytes (a
    gradient larger than `cap` gets a bucket of its own). Note [buckets in backward]."""
    buckets: list[list[int]] = []
    size, key = 0, None
    for index in reversed(range(len(params))):
        p = params[index]
        nbytes = p.size * _staging_dtype(p.dtype).itemsize
        here = (p.dtype, id(p.device))
        if not buckets or here != key or size + nbytes > cap:
            buckets.append([])
            size, key = 0, here
        buckets[-1].append(index)
        size += nbytes
    return buckets


def _read(t: Tensor, out: np.ndarray) -> None:
    """Copy `t` into the flat host array `out` (of t's size): through its NumPy view where the
    device's memory is the host's, else through a copy to the host."""
    if t.device.capabilities.host_memory:
        np.copyto(out.reshape(t.shape), t._native_read("all-reduce"), casting="unsafe")
    else:
        out[...] = t.numpy().reshape(-1)


def _write(t: Tensor, flat: np.ndarray, divisor: int) -> None:
    """Write `flat / divisor` (a host array of t's size) into `t`, rounded to t's dtype."""
    shaped = flat.reshape(t.shape)
    if t.device.capabilities.host_memory and t.dtype == flat.dtype:
        target = t._native_write("all-reduce")
        np.divide(shaped, divisor, out=target)
        t.block.mark_written()
        return
    value = (shaped / flat.dtype.type(divisor)).astype(t.dtype)
    with no_grad():
        t[...] = value


class _Bucket:
    """One bucket: its parameters, where each sits in the flat buffer, and this step's state."""

    def __init__(self, index: int, params: list[Tensor], size: int) -> None:
        self.index = index
        self.params = params
        #: element offsets of each parameter in the flat buffer
        self.offsets: list[int] = []
        numel = 0
        for p in params:
            self.offsets.append(numel)
            numel += p.size
        self.numel = numel
        #: the padded length (a multiple of the group's size) and this rank's part of it
        self.padded = -(-numel // size) * size
        self.part = self.padded // size
        self.dtype = params[0].dtype
        self.staging = _staging_dtype(self.dtype)
        self.nbytes = self.padded * self.staging.itemsize
        self.slot = {id(p): i for i, p in enumerate(params)}
        # per step
        self.waiting: set[int] = set()
        self.grads: dict[int, Tensor] = {}
        self.buffer: np.ndarray | None = None
        self.work: distributed.Work | None = None
        #: inside a graph, on a device whose memory is not the host's: the host copy its
        #: all-reduce runs on (made at capture, kept with the capture's replays)
        self.host: np.ndarray | None = None


class Reducer:
    """The gradient-ready hook of a model's parameters (Note [buckets in backward]).

    `stage` 0 averages every gradient in place (data parallel); 1 and 2 keep this rank's
    part of the averaged gradients as the gradients of the shard parameters (ZeRO).
    """

    def __init__(self, params: list[Tensor], group: distributed.Group, bucket_cap: int,
                 stage: int = 0) -> None:
        self.params = params
        self.group = group
        self.stage = stage
        self.buckets = [_Bucket(i, [params[j] for j in indices], group.size)
                        for i, indices in enumerate(bucket_plan(params, bucket_cap))]
        self._bucket_of = {id(p): bucket for bucket in self.buckets for p in bucket.params}
        #: ZeRO: this rank's shard parameter of each bucket (made by `make_shards`)
        self.shards: list[Tensor] = []
        #: stage 0: one buffer per bucket, kept from step to step; ZeRO: one buffer of the
        #: largest bucket's size (two while a bucket is still incomplete), by the bucket it
        #: holds now
        self._buffers: dict[int, np.ndarray] = {}
        self._spare: list[np.ndarray] = []
        #: ZeRO, during a pass: this rank's part of each bucket's sum (stage 2: received;
        #: stage 1: copied out of its all-reduced buffer before another bucket took it)
        self._recv: dict[int, np.ndarray] = {}
        self._next = 0  # the next bucket to start (they start in index order)
        #: while capturing: each started bucket's flat tensor (Note [collectives in a plan]);
        #: ZeRO: the one flat tensor per staging dtype that the buckets take in turn, the
        #: bucket whose wait is not recorded yet per staging dtype, the recorded stage 2
        #: parts, and the shard gradients the waits write
        self._tokens: dict[int, Tensor] = {}
        self._flats: dict[np.dtype, Tensor] = {}
        self._unwaited: dict[np.dtype, _Bucket] = {}
        self._parts: dict[int, Tensor] = {}
        self._shard_grads: list[tuple[Tensor, Tensor]] = []
        #: in a replay of a captured ZeRO step: the host copy `_replay_save` made
        self._undo: list[np.ndarray] = []
        self._in_pass = False
        #: per step: (bucket, start, seen complete) times, and backward's start and end, for
        #: the overlap figures (`timeline`)
        self.timeline: dict[str, Any] = {}
        self._removers = [register_ready_hook(p, self) for p in params]

    # ------------------------------------------------------------------ the hook
    def ready(self, leaf: Tensor, grad: Tensor) -> bool:
        """A gradient is whole: stage it; start its bucket's collective if it was the last."""
        if not self._in_pass:
            self._begin_pass()
        bucket = self._bucket_of[id(leaf)]
        recorder = tape.active()
        if recorder is not None:  # NOTE: Note [collectives in a plan]
            bucket.grads[id(leaf)] = grad
            bucket.waiting.discard(id(leaf))
            self._record_starts(recorder)
            return self.stage != 0
        self._stage_in(bucket, leaf, grad)
        self._start_ready_buckets()
        self.group.progress()
        return self.stage != 0

    def finish(self) -> list[tuple[Tensor, Tensor]]:
        """Every bucket started and waited for; then the results written (Note [buckets in
        backward]). Returns the gradients to store that backward did not compute itself."""
        try:
            return self._finish()
        finally:
            self._in_pass = False

    def _finish(self) -> list[tuple[Tensor, Tensor]]:
        self.timeline["backward_end"] = time.perf_counter()
        recorder = tape.active()
        if recorder is not None:
            return self._record_finish(recorder)
        extra: list[tuple[Tensor, Tensor]] = []
        if self.stage == 0:
            # NOTE: a parameter without a gradient on this rank gets zeros in the sum, and the
            # averaged gradient is stored for it, so that every rank updates the same ones
            for bucket in self.buckets:
                for p in bucket.params:
                    if id(p) in bucket.waiting:
                        grad = tensor(np.zeros(p.shape, p.dtype), device=p.device,
                                      allocator=p.block.allocator)
                        self._stage_in(bucket, p, grad)
                        extra.append((p, grad))
        else:
            for bucket in self.buckets:
                for p in list(bucket.params):
                    if id(p) in bucket.waiting:
                        self._stage_in(bucket, p, None)
        self._start_ready_buckets()
        self.group.poll_in_background(False)
        self.group.wait_all([b.work for b in self.buckets if b.work is not None])
        self.timeline["reduced"] = time.perf_counter()
        self.timeline["buckets"] = [(b.index, b.nbytes, b.work.started, b.work.completed)
                                    for b in self.buckets if b.work is not None]
        size = self.group.size
        if self.stage == 0:
            for bucket in self.buckets:
                buffer = self._buffers[bucket.index]
                for p, offset in zip(bucket.params, bucket.offsets):
                    _write(bucket.grads[id(p)], buffer[offset:offset + p.size], size)
                bucket.grads.clear()
                bucket.work = None
            return extra
        # ZeRO: this rank's part of each averaged bucket becomes its shard's gradient
        grads = []
        for bucket, shard in zip(self.buckets, self.shards):
            if bucket.index in self._recv:  # NOTE: each part goes as its gradient is made
                part = self._recv.pop(bucket.index)
            else:  # NOTE: stage 1, a bucket whose buffer no other bucket took
                part = self._part(bucket, self._buffers[bucket.index])
            averaged = (part / part.dtype.type(size)).astype(shard.dtype)
            grads.append((shard, tensor(averaged, device=shard.device,
                                        allocator=shard.block.allocator)))
            bucket.work = None
        self._release_buffers()
        return grads

    def _part(self, bucket: _Bucket, buffer: np.ndarray) -> np.ndarray:
        """This rank's part of an all-reduced bucket's buffer (stage 1)."""
        rank = self.group.rank
        return buffer[rank * bucket.part:(rank + 1) * bucket.part]

    # ------------------------------------------------------------------ steps of the pass
    def _begin_pass(self) -> None:
        if self.stage and not self.shards:
            raise RuntimeError(f"DistributedDataParallel(zero_stage={self.stage}) keeps the "
                               f"gradients of this rank's shards only: update them with "
                               f"nn.ZeroRedundancyOptimizer(ddp, optimizer_class, ...), not an "
                               f"optimizer over ddp.parameters()")
        self._in_pass = True
        self._next = 0
        self.timeline = {"backward_start": time.perf_counter()}
        for bucket in self.buckets:
            bucket.waiting = {id(p) for p in bucket.params}
            bucket.grads.clear()
            bucket.work = None

    def _stage_in(self, bucket: _Bucket, p: Tensor, grad: Tensor | None) -> None:
        """Copy p's gradient (None: zeros) into its bucket's buffer."""
        buffer = self._buffer(bucket)
        offset = bucket.offsets[bucket.slot[id(p)]]
        target = buffer[offset:offset + p.size]
        if grad is None:
            target[...] = 0
        else:
            _read(grad, target)
            if self.stage == 0:
                bucket.grads[id(p)] = grad
        bucket.waiting.discard(id(p))

    def _buffer(self, bucket: _Bucket) -> np.ndarray:
        buffer = self._buffers.get(bucket.index)
        if buffer is None:
            if self.stage:
                buffer = self._shared_buffer(bucket)
            else:
                buffer = np.zeros(bucket.padded, bucket.staging)
            self._buffers[bucket.index] = buffer
        return buffer

    def _shared_buffer(self, bucket: _Bucket) -> np.ndarray:
        """ZeRO's one buffer (of the largest bucket's size) for `bucket`: while the bucket
        before is still reducing, wait for it first (stage 1 then copies this rank's part of
        its sum out). That wait is short or none: between a bucket's last gradient and the
        next bucket's first lies a layer's backward, which its collective overlaps."""
        for held in sorted(self._buffers):
            work = self.buckets[held].work
            if work is None:
                # NOTE: that bucket is not complete yet (a parameter it holds is used again
                # later in backward): a second buffer, until the end of the pass
                continue
            work.wait()
            if self.stage == 1:
                self._recv[held] = self._part(self.buckets[held], self._buffers[held]).copy()
            self._spare.append(self._buffers.pop(held).base)
        if not self._spare:
            size = max(b.padded for b in self.buckets)
            self._spare.append(np.zeros(size, bucket.staging))
        buffer = self._spare.pop()[:bucket.padded]
        buffer[bucket.numel:] = 0
        return buffer

    def _release_buffers(self) -> None:
        """ZeRO: every bucket's collective is done; one buffer is kept for the next pass."""
        for index in list(self._buffers):
            self._spare.append(self._buffers.pop(index).base)
        self._spare.sort(key=lambda buffer: buffer.nbytes)
        del self._spare[1:]

    def _start_ready_buckets(self) -> None:
        """Start, in index order, every bucket whose gradients are all in."""
        group = self.group
        while self._next < len(self.buckets) and not self.buckets[self._next].waiting:
            bucket = self.buckets[self._next]
            buffer = self._buffers[bucket.index]
            what = f"bucket {bucket.index} of {len(self.buckets)}"
            if self.stage == 2:
                recv = self._recv[bucket.index] = np.empty(bucket.part, bucket.staging)
                bucket.work = group.reduce_scatter(buffer, recv, f"reduce-scatter of {what}")
            else:
                bucket.work = group.allreduce(buffer, f"all-reduce of {what}")
            self._next += 1
            group.poll_in_background(True)  # NOTE: Note [progress in the background]

    def abandon(self, error: BaseException) -> None:
        """The pass failed part-way (here or in backward): forget its gradients, and tell the
        other ranks, whose collectives would otherwise wait for this one's (Note [a collective
        never hangs] in runtime/distributed.py)."""
        self._in_pass = False
        self.group.poll_in_background(False)
        self._recv.clear()
        self._tokens.clear()
        self._forget_capture()
        for bucket in self.buckets:
            bucket.grads.clear()
        # NOTE: a refused capture ran no collective, and every rank refuses it alike
        if not isinstance(error, (distributed.DistributedError, GraphCaptureError)):
            self.group.fail(error)

    # ------------------------------------------------------------------ inside a capture
    # Note [collectives in a plan]: while `runtime.graph` captures a step, the reducer
    # records instructions instead of running collectives. Per bucket, in index order as its
    # last gradient comes in, "allreduce_start": it reads the bucket's gradients and writes a
    # flat bucket tensor made in the capture (so the static plan places the buffer, and MPI
    # reduces in the arena), copying them in and starting the non-blocking all-reduce; at the
    # pass's end one "allreduce_wait", which reads every bucket tensor and writes every
    # gradient: it waits for each bucket's all-reduce (Note [a collective never hangs] in
    # runtime/distributed.py) and writes the averages over the gradients. The schedule's
    # hazards then order each start after its gradients, the wait after every start, and
    # every read of a gradient (the update, and SGD's product fold) after the wait; the
    # parameters are written only after it (the commit point). A device whose memory is not
    # the host's (OpenCL, CUDA) goes through a host copy of each bucket, as eagerly.
    def _record_starts(self, recorder: Any) -> None:
        while self._next < len(self.buckets) and not self.buckets[self._next].waiting:
            bucket = self.buckets[self._next]
            self._record_start(recorder, bucket)
            self._next += 1

    def _record_start(self, recorder: Any, bucket: _Bucket) -> None:
        grads = [bucket.grads[id(p)] for p in bucket.params]
        first = grads[0]
        if self.stage:
            self._record_zero_start(recorder, bucket, grads)
            return
        flat = empty((bucket.padded,), bucket.staging, device=first.device,
                     allocator=first.block.allocator)
        if not first.device.capabilities.host_memory:  # NOTE: host staging, as eagerly
            bucket.host = np.zeros(bucket.padded, bucket.staging)
        reducer, index = self, bucket.index

        def run(views: list, out: Any) -> None:  # NOTE: Note [closures hold no tensors]
            reducer._replay_start(index, views, out)

        recorder.record("allreduce_start", "never", run, [(g, g.shape) for g in grads],
                        [flat], None)
        self._tokens[bucket.index] = flat

    def _record_finish(self, recorder: Any) -> list[tuple[Tensor, Tensor]]:
        extra = []
        for bucket in self.buckets:
            for p in bucket.params:
                if id(p) in bucket.waiting:  # NOTE: zeros, as eagerly (a recorded load)
                    grad = tensor(np.zeros(p.shape, p.dtype), device=p.device,
                                  allocator=p.block.allocator)
                    bucket.grads[id(p)] = grad
                    bucket.waiting.discard(id(p))
                    extra.append((p, grad))
        self._record_starts(recorder)
        if self.stage:
            for bucket in list(self._unwaited.values()):
                self._record_zero_wait(recorder, bucket)
            grads = self._shard_grads
            self._forget_capture()
            for bucket in self.buckets:
                bucket.grads.clear()
            return grads
        flats = [self._tokens.pop(b.index) for b in self.buckets]
        grads = [b.grads[id(p)] for b in self.buckets for p in b.params]
        reducer = self

        def run(views: list, *outs: Any) -> None:  # NOTE: Note [closures hold no tensors]
            reducer._replay_wait(views, outs)

        recorder.record("allreduce_wait", "never", run, [(f, f.shape) for f in flats], grads,
                        None)
        for bucket in self.buckets:
            bucket.grads.clear()
        return extra

    def _replay_start(self, index: int, views: list, out: np.ndarray) -> None:
        if index == 0:
            self.timeline = {"backward_start": time.perf_counter()}
        bucket = self.buckets[index]
        if bucket.host is not None:  # NOTE: the planned `out` only orders the steps here
            out = bucket.host
        _fill(bucket, views, out)
        bucket.work = self.group.allreduce(out, f"all-reduce of bucket {index} of "
                                                f"{len(self.buckets)} (in a graph)")
        self.group.poll_in_background(True)  # NOTE: Note [progress in the background]

    def _replay_wait(self, views: list, outs: tuple) -> None:
        self.timeline["backward_end"] = time.perf_counter()
        self.group.poll_in_background(False)
        self.group.wait_all([b.work for b in self.buckets])
        self.timeline["reduced"] = time.perf_counter()
        self.timeline["buckets"] = [(b.index, b.nbytes, b.work.started, b.work.completed)
                                    for b in self.buckets]
        size, at = self.group.size, 0
        for bucket, flat in zip(self.buckets, views):
            host, device = bucket.host, bucket.params[0].device
            for offset, p in zip(bucket.offsets, bucket.params):
                if host is None and flat.dtype == p.dtype:
                    np.divide(flat[offset:offset + p.size].reshape(p.shape), size,
                              out=outs[at])
                elif host is None:  # NOTE: `_write`'s rounding of a two-byte gradient
                    part = flat[offset:offset + p.size].reshape(p.shape)
                    np.copyto(outs[at], (part / flat.dtype.type(size)).astype(p.dtype))
                else:  # NOTE: `_write`'s rounding for a device that is not the host
                    part = host[offset:offset + p.size].reshape(p.shape)
                    device.from_host((part / host.dtype.type(size)).astype(p.dtype), outs[at])
                at += 1
            bucket.work = None

    # Note [ZeRO in a plan]: under ZeRO a captured step records, per bucket, "zero_start"
    # (reads the bucket's gradients, writes the bucket's part of one flat tensor that the
    # buckets take in turn, and for stage 2 the received part; copies the gradients in and
    # starts the reduce-scatter, or the all-reduce of stage 1) and "zero_wait" (reads them,
    # waits, writes this rank's averaged part as its shard's gradient). A bucket's wait is
    # recorded before the next bucket's start, so the plan's hazards on the shared flat
    # tensor order them as eagerly: the wait comes before the next bucket overwrites the
    # buffer, and the plan holds one bucket's buffer, not every bucket's. The optimizer's
    # step is recorded as ops on the shards, and the gather as one "zero_gather", which
    # starts every bucket's all-gather, waits, then writes the parameters: the commit point.
    # Before the optimizer's step "zero_save" copies the shards and the state it writes to the
    # host, as eagerly (1/N of the parameters and of the state, outside the plan), and if the
    # gather fails it puts the copies back (Note [ZeRO's commit point is the gather] in
    # runtime/nn.py); a token tensor that the save writes and the gather reads keeps that
    # order in the schedule.
    def _forget_capture(self) -> None:
        self._flats.clear()
        self._unwaited.clear()
        self._parts.clear()
        self._shard_grads = []

    def _record_zero_start(self, recorder: Any, bucket: _Bucket, grads: list[Tensor]) -> None:
        first = grads[0]
        flat = self._flats.get(bucket.staging)
        if flat is None:
            size = max(b.padded for b in self.buckets if b.staging == bucket.staging)
            flat = self._flats[bucket.staging] = empty(
                (size,), bucket.staging, device=first.device, allocator=first.block.allocator)
        waiting = self._unwaited.pop(bucket.staging, None)
        if waiting is not None:  # NOTE: recorded first: this bucket overwrites its buffer
            self._record_zero_wait(recorder, waiting)
        outputs = [flat[:bucket.padded]]
        if self.stage == 2:
            self._parts[bucket.index] = empty((bucket.part,), bucket.staging,
                                              device=first.device,
                                              allocator=first.block.allocator)
            outputs.append(self._parts[bucket.index])
        if not first.device.capabilities.host_memory:  # NOTE: host staging, as eagerly
            bucket.host = np.zeros(bucket.padded, bucket.staging)
        reducer, index = self, bucket.index

        def run(views: list, *outs: Any) -> None:  # NOTE: Note [closures hold no tensors]
            reducer._replay_zero_start(index, views, outs)

        recorder.record("zero_start", "never", run, [(g, g.shape) for g in grads], outputs,
                        None)
        self._tokens[bucket.index] = outputs[0]
        self._unwaited[bucket.staging] = bucket

    def _record_zero_wait(self, recorder: Any, bucket: _Bucket) -> None:
        shard = self.shards[bucket.index]
        grad = empty(shard.shape, shard.dtype, device=shard.device,
                     allocator=shard.block.allocator)
        inputs = [self._tokens.pop(bucket.index)]
        if self.stage == 2:
            inputs.append(self._parts.pop(bucket.index))
        reducer, index = self, bucket.index

        def run(views: list, out: Any) -> None:  # NOTE: Note [closures hold no tensors]
            reducer._replay_zero_wait(index, views, out)

        recorder.record("zero_wait", "never", run, [(t, t.shape) for t in inputs], [grad],
                        None)
        self._shard_grads.append((shard, grad))

    def _replay_zero_start(self, index: int, views: list, outs: tuple) -> None:
        if index == 0:
            self.timeline = {"backward_start": time.perf_counter()}
        bucket = self.buckets[index]
        flat = outs[0] if bucket.host is None else bucket.host
        _fill(bucket, views, flat)
        what = f"bucket {index} of {len(self.buckets)} (in a graph)"
        if self.stage == 2:
            recv = self._recv[index] = (outs[1] if bucket.host is None
                                        else np.empty(bucket.part, bucket.staging))
            bucket.work = self.group.reduce_scatter(flat, recv, f"reduce-scatter of {what}")
        else:
            bucket.work = self.group.allreduce(flat, f"all-reduce of {what}")
        self.group.poll_in_background(True)  # NOTE: Note [progress in the background]

    def _replay_zero_wait(self, index: int, views: list, out: Any) -> None:
        bucket = self.buckets[index]
        if all(b.work is None or b is bucket for b in self.buckets):
            self.group.poll_in_background(False)
        self.group.wait_all([bucket.work])
        bucket.work = None
        if self.stage == 2:
            part = self._recv.pop(index)
        else:
            part = self._part(bucket, views[0] if bucket.host is None else bucket.host)
        bucket.params[0].device.from_host(part / part.dtype.type(self.group.size), out)

    def record_save(self, targets: list[Tensor]) -> Tensor:
        """Inside a capture, before the optimizer's step: record a host copy of `targets`
        (the shards and the state the step writes), which the gather puts back if it fails;
        returns the token the gather reads, so the plan keeps the copy before the step and
        the gather after it (Note [ZeRO in a plan])."""
        recorder = tape.active()
        first = targets[0]
        token = empty((1,), np.dtype(np.float32), device=first.device,
                      allocator=first.block.allocator)
        reducer = self

        def run(views: list, out: Any) -> None:  # NOTE: Note [closures hold no tensors]
            reducer._replay_save(views)

        recorder.record("zero_save", "never", run, [(t, t.shape) for t in targets], [token],
                        None)
        return token

    def _replay_save(self, views: list) -> None:
        device = self.buckets[0].params[0].device
        self._undo = [device.to_host(v) for v in views]

    def record_gather(self, targets: list[Tensor], token: Tensor) -> None:
        """Inside a capture: record the all-gather of the updated shards into the parameters
        (the commit point), which puts `targets` back from `record_save`'s copy if it fails
        (Note [ZeRO in a plan])."""
        recorder = tape.active()
        params = [p for bucket in self.buckets for p in bucket.params]
        shards = [next(k for k, t in enumerate(targets) if t is shard) for shard in self.shards]
        reducer, count = self, len(params)

        def run(views: list, *outs: Any) -> None:  # NOTE: Note [closures hold no tensors]
            reducer._replay_gather(outs[:count], outs[count:], shards)

        recorder.record("zero_gather", "never", run, [(token, token.shape)],
                        [*params, *targets], None)

    def _replay_gather(self, params: tuple, targets: tuple, shards: list[int]) -> None:
        device = self.buckets[0].params[0].device
        try:
            received = self._allgathered([targets[at] if device.capabilities.host_memory
                                          else device.to_host(targets[at]) for at in shards],
                                         " (in a graph)")
        except BaseException:
            for saved, target in zip(self._undo, targets):  # NOTE: as before the step
                device.from_host(saved, target)
            raise
        finally:
            self._undo = []
        at = 0
        for bucket, recv in zip(self.buckets, received):  # NOTE: the commit point
            for p, offset in zip(bucket.params, bucket.offsets):
                device.from_host(recv[offset:offset + p.size], params[at])
                at += 1

    # ------------------------------------------------------------------ ZeRO
    def make_shards(self) -> list[Tensor]:
        """This rank's shard parameter of each bucket: a flat leaf tensor that requires a
        gradient, holding part `rank` of the bucket's parameters (padded with zeros)."""
        if not self.shards:
            rank = self.group.rank
            for bucket in self.buckets:
                flat = self._gathered_params(bucket)
                part = flat[rank * bucket.part:(rank + 1) * bucket.part].astype(bucket.dtype)
                first = bucket.params[0]
                self.shards.append(tensor(part, device=first.device,
                                          allocator=first.block.allocator,
                                          requires_grad=True))
        return self.shards

    def _gathered_params(self, bucket: _Bucket) -> np.ndarray:
        flat = np.zeros(bucket.padded, bucket.staging)
        for p, offset in zip(bucket.params, bucket.offsets):
            _read(p, flat[offset:offset + p.size])
        return flat

    def gather(self) -> None:
        """All-gather the updated shards into a host copy of every bucket, then, once every
        bucket has arrived, write the parameters (all of them or none)."""
        received = self._allgathered([shard.numpy() for shard in self.shards])
        for bucket, recv in zip(self.buckets, received):  # NOTE: the commit point
            for p, offset in zip(bucket.params, bucket.offsets):
                _write(p, recv[offset:offset + p.size], 1)

    def _allgathered(self, shards: list[np.ndarray], where: str = "") -> list[np.ndarray]:
        """Every bucket's all-gather of this rank's shard (a host array each, in bucket
        order), started together and waited for together: each bucket's whole flat buffer,
        every rank's part in it, once all have arrived."""
        works, received, sent = [], [], []
        for bucket, shard in zip(self.buckets, shards):
            send = np.ascontiguousarray(shard.reshape(-1).astype(bucket.staging, copy=False))
            recv = np.empty(bucket.padded, bucket.staging)
            works.append(self.group.allgather(send, recv, f"all-gather of bucket "
                                                          f"{bucket.index}{where}"))
            sent.append(send)  # NOTE: MPI reads it until the wait
            received.append(recv)
        self.group.wait_all(works)
        return received

    # ------------------------------------------------------------------ reports
    def buffer_bytes(self) -> int:
        """Host bytes the reducer holds now: the bucket buffers (ZeRO: its shared one, two
        while a bucket is incomplete)."""
        if self.stage:
            held = sum(b.base.nbytes for b in self._buffers.values())
        else:
            held = sum(b.nbytes for b in self._buffers.values())
        held += sum(b.nbytes for b in self._spare)
        return held + sum(r.nbytes for r in self._recv.values())

    def close(self) -> None:
        """Take back the gradient-ready hooks."""
        for remove in self._removers:
            remove()
        self._removers = []


def _fill(bucket: _Bucket, views: list, flat: np.ndarray) -> None:
    """Inside a graph: copy a bucket's gradients (native views) into its flat buffer (a host
    array: the planned one on the CPU, else the bucket's host copy), a two-byte gradient
    widened to float32 exactly, as `_read` does; zero the padding."""
    device = bucket.params[0].device
    for view, offset, p in zip(views, bucket.offsets, bucket.params):
        target = flat[offset:offset + p.size]
        if bucket.host is not None:
            target[...] = device.to_host(view).reshape(-1)
        else:
            np.copyto(target.reshape(p.shape), view, casting="unsafe")
    flat[bucket.numel:] = 0


def broadcast_parameters(params: Iterable[Tensor], group: distributed.Group) -> None:
    """Give every rank rank 0's parameters (so that data-parallel ranks start identical)."""
    if group.size == 1:
        return
    for p in params:
        host = np.ascontiguousarray(p.numpy())
        group.broadcast(host.reshape(-1).view(np.uint8), 0,
                        f"broadcast of a parameter of shape {p.shape}")
        if group.rank != 0:
            with no_grad():
                p[...] = host
