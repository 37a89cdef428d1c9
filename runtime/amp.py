"""Mixed-precision training: float16 or bfloat16 activations and gradients, float32 master
weights and optimizer state, and dynamic loss scaling for float16 (torch.amp's model).

Three parts, used together (`nn.train_step(model, opt, precision="float16")` wires them up):

- `autocast(dtype)`: inside it, an `nn.Dense` whose parameters are float32 computes in `dtype`:
  its input is cast to `dtype` (once, at the first layer), the product uses a `dtype` working
  copy of the weight and bias, and the output is `dtype`, so activations, and the gradients of
  activations, are two-byte. The losses (`nn.softmax_cross_entropy`, `nn.mse`) compute in
  float32 inside it, as autocast runs them in PyTorch. Without layers, `ops.matmul` and
  `ops.linear` compute in `dtype` and `ops.cross_entropy` in float32 (Note [autocast in ops]
  in runtime/ops.py); other ops follow their inputs' dtype.
- Working copies: each Dense keeps one `dtype` copy of each parameter, cast from the float32
  master when the master has changed since (its block's version moved on) and once in each graph
  capture, so a training step casts each weight once, and the copy is neither an activation nor
  saved anew by every layer call. The backward pass reads the copy and hands the master a
  float32 gradient (the two-byte gradient, cast), so the optimizer updates the masters and keeps
  its state in float32.
- `GradScaler`: float16 holds magnitudes from about 6e-8 to 65504; small gradients flush to zero
  unless the loss is multiplied by a scale first. `scale(loss)` multiplies; `step(opt)` divides
  the gradients by the scale, checks them, and updates the parameters only if every one is
  finite; `update()` halves the scale after a step with inf or NaN and doubles it after 2000
  finite steps in a row (`torch.amp.GradScaler`'s defaults); `unscale_(opt)` does the
  division and the check before `step`, for `nn.clip_grad_norm_`. A skipped step is counted
  (`skipped_steps`) and logged (logger "runtime.amp", level WARNING). As in torch.amp, the
  scaler refuses float16 gradients (keep float32 masters under autocast), a second `step()`
  of an optimizer before `update()`, and an `update()` with no check since the last one.
  bfloat16 has float32's range and needs no scaling: `GradScaler(enabled=False)`, or no scaler.

Note [a skipped step is a select on the device]: the check and the skip involve no Python
decision on a device value, so a `runtime.graph` capture replays them: the check looks at each
element, as PyTorch's does (the sum of `g * 0` over a gradient is exactly zero where all its
elements are finite, NaN where one is not; a sum of the gradients themselves could overflow
and read a finite step as skipped), the total `sum - sum` is +0 or NaN, and its negation,
-0.0 or NaN, is the gate. An optimizer that supports gating (`nn.SGD`, `nn.Adam`) computes
each new value of a parameter or a state tensor into scratch and writes
`where_finite(new + gate, old)` over the old one: the new value bit for bit (x + -0.0 is x)
when the step is taken, the old one when it is skipped. The loss scale and the growth
counter are updated by arithmetic on the 0/1 flag
`where_finite(sum - sum + 1, 0)`. The eager path reads the flag back to log a skip at once; a
graph's replays skip silently on the device, and `check()` logs the skips since the last check.
In a capture the gated update also reads `grad + gate` (the gradient bit for bit, or NaN), so
it is ordered after the check, and writes each new value once into a temporary
(`Optimizer._again`), so that each parameter's update fuses into one elementwise chain ending in
the select: no full-size new value waits beside the gradients, which the check keeps alive until
it has read them all.

Note [half gradients through the check]: the check needs every gradient before the first
update, so all of them are live at once; a capture holds them as the half gradients they were
cast from, half the bytes of the float32 ones. While a graph captures, `scale()` makes 1 / scale
before the backward pass and opens a collection: `linear`'s backward pass (`_remember`) notes,
for each master's float32 gradient, the half gradient it is the cast of and both blocks'
versions. `step()` then takes every gradient still exactly that (both blocks at those
versions: not a sum, as the gradient of a weight used twice is, not accumulated into by a second
backward pass, not unscaled by `unscale_` and clipped) as a cast of its half source: it
unscales `.grad` in place and checks it as always, but the optimizer gets
`cast(half) * (1 / scale)`, made again just before that parameter's update
(`Optimizer._step`'s `remade`): the float32 gradient's value exactly (the same ops on the same
values), so the step equals the eager one bit for bit. Nothing reads `.grad` after the check
(unless the function keeps or returns it), and 1 / scale is there from the start, so the
schedule unscales and checks each float32 gradient right after its cast (the check's
`g * 0` lives only until its sum) and it dies there, while its half source lives on to the
update. The cost: one cast
and one multiplication more per parameter, so only gradients of at least 64 KiB
(`_REMAKE_BYTES`) are made again (a bias's are held as they are). Eagerly nothing changes:
`.grad` is the float32 gradient, and PyTorch's eager step holds every one as well.

Example:
    >>> import numpy as np, runtime
    >>> from runtime import amp, nn
    >>> nn.manual_seed(0)
    >>> model = nn.Sequential(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
    >>> opt = nn.Adam(model.parameters(), lr=1e-3)
    >>> scaler = amp.GradScaler()
    >>> x = runtime.tensor(np.ones((2, 4), np.float32))
    >>> with amp.autocast("float16"):
    ...     logits = model(x)
    ...     loss = nn.softmax_cross_entropy(logits, np.array([0, 2]))
    >>> logits.dtype, loss.dtype, model[0].weight.dtype
    (dtype('float16'), dtype('float32'), dtype('float32'))
    >>> scaler.scale(loss).backward()
    >>> model[0].weight.grad.dtype
    dtype('float32')
    >>> scaler.step(opt)
    >>> scaler.update()
    >>> scaler.get_scale(), scaler.skipped_steps
    (65536.0, 0)
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from runtime import autograd, dlpack, dtypes, ops, tape
from runtime._tensor import Tensor, _brief, as_dtype, as_flag, empty, tensor, view
from runtime.autograd import no_grad
from runtime.errors import GraphCaptureError

__all__ = ["GradScaler", "autocast", "autocast_dtype", "linear"]

_log = logging.getLogger(__name__)
_FLOAT32 = np.dtype("float32")
#: The smallest float32 gradient a capture makes again from its half source rather than hold
#: through the check (Note [half gradients through the check]): below it, the bytes saved
#: are not worth two more kernel calls (a bias's gradient)
_REMAKE_BYTES = 1 << 16


# ---------------------------------------------------------------------- autocast
class _Collecting(threading.local):
    # NOTE: the autocast dtype itself is autograd._mode.autocast, where ops reads it
    #: while a graph captures a scaled backward pass (GradScaler.scale opens it): the capture
    #: (a weak reference to its tape), and by block id of a master's float32 gradient, the
    #: half gradient it was cast from and the versions of both blocks right after the cast
    #: (Note [half gradients through the check])
    sources: tuple[Any, dict[int, tuple[Tensor, int, int]]] | None = None


_collecting = _Collecting()


def _capturing(capture: Any) -> bool:
    """Whether `capture` (a weak reference to a tape) is the capture recording now."""
    return capture() is tape.active() is not None


def _half(dtype: Any, what: str) -> np.dtype:
    """`dtype` as float16 or bfloat16, or TypeError naming it."""
    dtype = as_dtype(dtype, what)
    if dtype not in dtypes.HALVES:
        raise TypeError(f"{what}: mixed precision computes in float16 or bfloat16, got {dtype}")
    return dtype


@contextmanager
def autocast(dtype: Any = "float16", enabled: bool = True) -> Iterator[None]:
    """Run `nn.Dense` layers, `ops.matmul` and `ops.linear` in `dtype` (float16 or bfloat16)
    and the losses in float32 inside the block, per thread, as `torch.autocast` does for
    products and losses (Note [autocast in ops] in runtime/ops.py). Nesting replaces the dtype
    for the inner block; `enabled=False` turns it off inside; a backward pass runs without it.

    Raises TypeError for a dtype other than float16 and bfloat16.
    """
    dtype = _half(dtype, "autocast")
    enabled = as_flag(enabled, "autocast: enabled")
    previous = autograd._mode.autocast
    autograd._mode.autocast = dtype if enabled else None
    try:
        yield
    finally:
        autograd._mode.autocast = previous


def autocast_dtype() -> np.dtype | None:
    """The dtype `autocast` computes layers and products in on this thread, or None outside
    it (and inside a backward pass)."""
    return autograd._mode.autocast


# ---------------------------------------------------------------------- working copies
class _Copy:
    """A `dtype` working copy of a master parameter, and what it was cast from."""

    __slots__ = ("copy", "source", "seen", "capture")

    def __init__(self, copy: Tensor, source: tuple) -> None:
        self.copy = copy
        #: the memory the master views (block id, offset, strides): a block's id is never
        #: reused, where a new master's id() may be
        self.source = source
        #: what `dlpack.seen` said of the master's block at the last eager cast; None: cast at
        #: the next use
        self.seen: tuple[int, int] | None = None
        #: the capture (a weak reference to its tape) that recorded the last cast, if any
        self.capture: Any = None


# Note [writes the working copy cannot see]: a working copy is cast again when its master's
# block version has moved on since the last cast, which every write through the runtime does
# (ops with out=, item assignment, views, optimizer steps, graph replays). Two kinds of write
# move no version: another library's through a DLPack export of the master's memory, and the
# owner's of memory the master imported (`runtime.from_dlpack`). The runtime cannot watch
# either, so it never trusts the copy of a master that could have been written so: while an
# export of its block lives, or for an imported block, the copy is cast at every use; and
# since an export that begins and ends between two uses leaves no live export behind, the
# copy also remembers how many exports of the block had begun or ended
# (`dlpack.export_events`, both read by `dlpack.seen`) and is cast again when that count
# moved. No check of the content (a full read of the master) is needed, and no stale copy is
# ever read. A device graph's host checks skip bytes they passed by the same rule
# (`_run_checks` in runtime/graph/replay.py).


def working_copy(master: Tensor, dtype: np.dtype, copies: dict[Any, _Copy],
                 role: str) -> Tensor:
    """`master` in `dtype`, from `copies` (the owner's cache, one copy per `role` and dtype,
    e.g. "weight"), cast again when the master may have been written since the last cast
    (Note [writes the working copy cannot see]) or, inside a graph capture, once per capture
    (so every replay casts the master its update wrote). A new master in the role (another
    memory) replaces the old copy, which lives on only while a backward pass holds it."""
    key = (role, dtype)
    source = (master.block.id, master.offset, master.strides)
    entry = copies.get(key)
    if (entry is None or entry.source != source or entry.copy.shape != master.shape
            or entry.copy.device is not master.device):
        made = empty(master.shape, dtype, device=master.device, allocator=master.block.allocator)
        entry = copies[key] = _Copy(made, source)
    recorder = tape.active()
    if recorder is None:
        stale = entry.seen is None or entry.seen != dlpack.seen(master.block)
    else:
        stale = entry.capture is None or not _capturing(entry.capture)
    if stale:
        with no_grad():
            ops.cast(master, dtype, out=entry.copy)
        if recorder is None:
            entry.seen, entry.capture = dlpack.seen(master.block), None
        else:  # NOTE: recorded, not run: the next eager use casts again
            entry.seen, entry.capture = None, weakref.ref(recorder)
    return entry.copy


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, dtype: Any,
           copies: dict[Any, _Copy]) -> Tensor:
    """x @ weight.T + bias computed in `dtype` from working copies of float32 (or any float)
    master parameters: x is cast to `dtype` first (a differentiable cast) and the result is
    `dtype`. The backward pass computes in `dtype` and gives the masters gradients of their own
    dtype (cast once, as in torch.autocast); it reads the weight's working copy, so only x is
    saved per call, and an x that had to be cast is saved as given and cast again in the
    backward pass (a cheap pass, where keeping its cast would hold a copy of the input batch
    from the forward pass to the backward one)."""
    dtype = _half(dtype, "amp.linear")
    given = x
    recast = x.dtype != dtype
    if recast:
        x = ops.cast(x, dtype)
    w = working_copy(weight, dtype, copies, "weight")
    b = working_copy(bias, dtype, copies, "bias") if bias is not None else None
    with no_grad():
        out = ops.linear(x, w, b)
    operands = [x, weight] if bias is None else [x, weight, bias]
    if autograd.needs_grad(*operands):
        nx, nw = x.requires_grad, weight.requires_grad
        nb = bias is not None and bias.requires_grad
        master, features, in_features = weight.dtype, weight.shape[0], weight.shape[1]
        bias_dtype = bias.dtype if bias is not None else master

        # NOTE: shapes and dtypes only: Note [closures hold no tensors] in runtime/autograd.py
        def fn(g: Tensor, x: Tensor | None, w: Tensor | None) -> tuple:
            g2 = g if g.ndim == 2 else g.reshape(-1, features)
            gx = ops.matmul(g, w) if nx else None
            gw = gb = None
            if nw:
                x = ops.cast(x, dtype) if recast else x
                x2 = x if x.ndim == 2 else x.reshape(-1, in_features)
                gw = _remember(ops._matmul_at(g2, x2), master)
            if nb:
                gb = _remember(ops.sum(g2, axis=0), bias_dtype)
            return gx, gw, gb

        autograd.record("linear", out, operands, ("x", "weight", "bias"), fn,
                        [("x", given if nw else None), ("weight", w if nx else None)])
    return out


def _remember(half: Tensor, master: np.dtype) -> Tensor:
    """`half` cast to `master` (a master's gradient); while a capture of a scaled backward
    pass collects them, remember `half` as its source (Note [half gradients through the
    check])."""
    made = ops.cast(half, master)
    opened = _collecting.sources
    if opened is not None and _capturing(opened[0]):
        opened[1][made.block.id] = (half, half.block.version, made.block.version)
    return made


# ---------------------------------------------------------------------- loss scaling
def _unscaled(half: Tensor, dtype: np.dtype, inverse: Tensor) -> Tensor:
    """cast(half, dtype) * inverse, while capturing: a master's unscaled gradient made again
    from its half source (Note [half gradients through the check]). In place: the update's
    first op, which reads it last, may then write over it (runtime/graph/fuse.py)."""
    made = ops.cast(half, dtype)
    return ops.mul(made, inverse, out=made)


class _Stage:
    """What a GradScaler did to one optimizer's gradients since its last update()."""

    __slots__ = ("optimizer", "unscaled", "stepped", "found")

    def __init__(self, optimizer: Any) -> None:
        #: a weak reference to the optimizer (its id alone could be reused)
        self.optimizer = weakref.ref(optimizer)
        self.unscaled = False
        self.stepped = False
        #: from unscale_ until step(): +0.0 if its gradients were all finite, NaN if not
        self.found: Tensor | None = None


def _positive(where: str, what: str, value: Any, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {what} must be a number, got {_brief(value)}")
    number = float(value)
    if not low < number < high:
        raise ValueError(f"{where}: {what} must lie in ({low}, {high}), got {_brief(value)}")
    return number


def _count(where: str, what: str, value: Any, low: int, high: int) -> int:
    """`value` as an int in [low, high] (counts are exact float32 integers up to 2**24)."""
    if (isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral)
            or not low <= value <= high):
        raise ValueError(f"{where}: {what} must be an int in [{low}, {high}], got "
                         f"{_brief(value)}")
    return int(value)


def _settings(where: str, scale: tuple[str, Any], growth_factor: Any, backoff_factor: Any,
              growth_interval: Any) -> tuple[float, float, float, int]:
    """The scaler's settings checked (the constructor's rule, and load_state_dict's), the
    scale given as (its name there, value): TypeError / ValueError naming `where`, the setting
    and the value."""
    return (_positive(where, scale[0], scale[1], 0.0),
            _positive(where, "growth_factor", growth_factor, 1.0),
            _positive(where, "backoff_factor", backoff_factor, 0.0, 1.0),
            _count(where, "growth_interval", growth_interval, 1, _EXACT))


#: float32 counts (steps, the growth tracker) are exact up to here
_EXACT = 2 ** 24


def _probe_key(t: Tensor) -> tuple:
    return (t.shape, t.dtype, id(t.block.allocator))


class GradScaler:
    """Dynamic loss scaling for float16 training (`torch.amp.GradScaler`'s rule and defaults).

    Use: `scaler.scale(loss).backward()`, then `scaler.step(optimizer)` (unscale, check, update
    or skip), then `scaler.update()` (adjust the scale); to clip or read the gradients at their
    true size, `scaler.unscale_(optimizer)` before `step` (unscale and check there, once). A
    step whose gradients hold inf or NaN leaves the parameters and the optimizer state bit for
    bit as they were, counts in `skipped_steps` and is logged; the scale is multiplied by
    `backoff_factor` at the next `update()`. After `growth_interval` finite steps in a row the
    scale is multiplied by `growth_factor`. Everything runs on the device, so a
    `runtime.graph` capture of the step replays the check and the skip (Note [a skipped step
    is a select on the device]); its replays log nothing, and `check()` logs the steps skipped
    since it last looked.

    Args:
        init_scale: the first scale (2**16); growth_factor (> 1, 2.0), backoff_factor
            (in (0, 1), 0.5), growth_interval (a positive int, 2000).
        enabled: False makes every method a pass-through (`scale` returns the loss, `step`
            calls `optimizer.step()`): bfloat16 needs no scaling.

    The scale, the growth counter and the step counts are float32 0-d tensors on the
    parameters' device (counts exact up to 2**24 steps), made at the first use.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 enabled: bool = True) -> None:
        self.enabled = as_flag(enabled, "GradScaler: enabled")
        (self.init_scale, self.growth_factor, self.backoff_factor,
         self.growth_interval) = _settings("GradScaler", ("init_scale", init_scale),
                                           growth_factor, backoff_factor, growth_interval)
        #: scale, growth tracker, steps, skipped steps, finite since the last update: 0-d
        self._state: dict[str, Tensor] = {}
        #: 0-d scratch for one step, by name (eager only: a capture uses temporaries)
        self._scratch: dict[tuple[str, np.dtype], Tensor] = {}
        #: by (shape, dtype, allocator id), where the check looks at a gradient's elements: a
        #: view over one buffer per dtype and allocator as large as the largest (eager only)
        self._probes: dict[tuple, Tensor] = {}
        #: checks kept for the next update() (steps, and an unscale_ without its step) since
        #: the last one, on the host (the same in every replay)
        self._pending = 0
        #: skipped steps already logged
        self._reported = 0
        #: the state `load_state_dict` gave before the device state was made
        self._initial: dict[str, float] = {}
        #: id(optimizer) -> what unscale_ and step did to its gradients since the last update()
        self._stages: dict[int, _Stage] = {}
        #: while capturing, from scale() to update(): the capture (a weak reference to its
        #: tape) and 1 / scale (Note [half gradients through the check])
        self._early: tuple[Any, Tensor] | None = None

    # ------------------------------------------------------------------ state
    def _make_state(self, like: Tensor) -> None:
        if self._state:
            return
        device, allocator = like.device, like.block.allocator
        values = {"scale": self.init_scale, "tracker": 0.0, "steps": 0.0, "skipped": 0.0,
                  "finite": 1.0, **self._initial}
        # NOTE: all made before any is kept: Note [the commit point] in runtime/nn.py
        made = {name: tensor(np.array(value, _FLOAT32), device=device, allocator=allocator)
                for name, value in values.items()}
        self._state = made

    def _buffer(self, name: str, dtype: np.dtype = _FLOAT32) -> Tensor | None:
        """A 0-d scratch tensor made once (None while a graph captures: temporaries there)."""
        if tape.active() is not None:
            return None
        key = (name, dtype)
        buffer = self._scratch.get(key)
        if buffer is None:
            scale = self._state["scale"]
            buffer = empty((), dtype, device=scale.device, allocator=scale.block.allocator)
            buffer.block.memory_for_write("loss scaler state")
            self._scratch[key] = buffer
        return buffer

    def prepare(self, optimizer: Any) -> None:
        """Make now the scaler's state and scratch, and the optimizer's scratch for gated
        updates, so that `step` allocates nothing once the gradients are there
        (Note [the commit point] in runtime/nn.py). `nn.train_step` calls it first thing."""
        if not self.enabled:
            return
        self._make_state(optimizer.params[0])
        with no_grad():
            for name in ("inverse", "sum", "total", "zero_or_nan", "finite", "one", "grow",
                         "factor", "term"):
                self._buffer(name)
            for dtype in {p.dtype for p in optimizer.params}:
                self._buffer("inverse", dtype)
                self._buffer("sum", dtype)
                self._buffer("gate", dtype)
            self._prepare_probes(optimizer.params)
            if getattr(optimizer, "gated_updates", False):
                optimizer.prepare_gate()

    def _prepare_probes(self, params: list[Tensor]) -> None:
        """Make the views `_probe` hands out for gradients like `params`' (eager only)."""
        if tape.active() is not None:
            return
        missing = [p for p in params if _probe_key(p) not in self._probes]
        largest: dict[tuple, Tensor] = {}  # NOTE: by (dtype, allocator id)
        for p in missing:
            key = (p.dtype, id(p.block.allocator))
            if key not in largest or p.size > largest[key].size:
                largest[key] = p
        # NOTE: all made before any is kept (Note [the commit point] in runtime/nn.py); the
        # views of each buffer keep it alive
        buffers = {key: empty((p.size,), p.dtype, device=p.device, allocator=p.block.allocator)
                   for key, p in largest.items()}
        for buffer in buffers.values():
            buffer.block.memory_for_write("loss scaler state")
        self._probes.update({_probe_key(p): view(buffers[(p.dtype, id(p.block.allocator))],
                                                 p.shape) for p in missing})

    def _probe(self, g: Tensor) -> Tensor | None:
        """Where the check looks at the elements of `g` (None while capturing: a temporary)."""
        return None if tape.active() is not None else self._probes.get(_probe_key(g))

    # ------------------------------------------------------------------ the step
    def scale(self, loss: Tensor) -> Tensor:
        """`loss` times the current scale (a float32 tensor; a two-byte loss is cast to float32
        first, since the scale alone would overflow float16). Disabled: `loss` itself."""
        if not isinstance(loss, Tensor):
            raise TypeError(f"GradScaler.scale: expected a Tensor, got {_brief(loss)}")
        if not self.enabled:
            return loss
        self._make_state(loss)
        scale = self._state["scale"]
        recorder = tape.active()
        if recorder is not None and (self._early is None or not _capturing(self._early[0])):
            # NOTE: Note [half gradients through the check]: the inverse before the backward
            # pass, and the half gradients collected during it
            with no_grad(), tape.phase("update"):
                self._early = (weakref.ref(recorder), ops.div(1.0, scale))
            _collecting.sources = (weakref.ref(recorder), {})
        if loss.dtype != scale.dtype:
            loss = ops.cast(loss, scale.dtype)
        return ops.mul(loss, scale)

    def _stage(self, optimizer: Any) -> _Stage:
        """What this scaler did to `optimizer`'s gradients since the last update()."""
        stage = self._stages.get(id(optimizer))
        if stage is None or stage.optimizer() is not optimizer:
            stage = self._stages[id(optimizer)] = _Stage(optimizer)
        return stage

    def unscale_(self, optimizer: Any) -> None:
        """Divide the gradients of `optimizer`'s parameters by the scale, in place, and keep on
        the device whether all of them are finite, so that they can be clipped
        (`nn.clip_grad_norm_`) or read at their true size before `step(optimizer)`, which then
        skips or takes the step by that check and does not divide again (torch.amp's
        `unscale_`). At most once per optimizer between two `update()` calls; a graph capture
        records it like the rest of the step. Disabled: does nothing.

        Raises RuntimeError naming the optimizer when called again for it before `update()`,
        or after `step(optimizer)` (which has unscaled its gradients already); ValueError for a
        float16 gradient (torch.amp's "Attempting to unscale FP16 gradients."), and what the
        optimizer's own check refuses, before any gradient is divided.

        Example:
            >>> import numpy as np, runtime
            >>> from runtime import amp, nn
            >>> w = runtime.tensor(np.ones(3, np.float32), requires_grad=True)
            >>> opt, scaler = nn.SGD([w], lr=0.1), amp.GradScaler(init_scale=4.0)
            >>> scaler.scale(runtime.ops.sum(runtime.ops.mul(w, w))).backward()
            >>> w.grad.numpy().tolist()
            [8.0, 8.0, 8.0]
            >>> scaler.unscale_(opt)
            >>> w.grad.numpy().tolist()
            [2.0, 2.0, 2.0]
            >>> round(nn.clip_grad_norm_([w], max_norm=1.0).item(), 4)   # 2 * sqrt(3)
            3.4641
            >>> scaler.step(opt)                                        # no second division
            >>> scaler.update()
        """
        if not self.enabled:
            return
        stage = self._stage(optimizer)
        name = type(optimizer).__name__
        if stage.stepped:
            raise RuntimeError(f"GradScaler.unscale_: step() already ran for this optimizer "
                               f"({name}) since the last update(), and its gradients are "
                               f"unscaled; call unscale_ before step()")
        if stage.unscaled:
            raise RuntimeError(f"GradScaler.unscale_: already called for this optimizer ({name}) "
                               f"since the last update(); the gradients are unscaled once per "
                               f"step: call unscale_ once, then step(), then update()")
        grads = self._gradients(optimizer, "GradScaler.unscale_")
        if grads:
            self.prepare(optimizer)
            with no_grad(), tape.phase("update"):
                # NOTE: one buffer per optimizer unscaled before the next update(): another
                # optimizer's unscale_ must not overwrite this one's check before its step()
                found = self._buffer(f"found{sum(s.unscaled for s in self._stages.values())}")
                stage.found, _ = self._unscale(grads, found)
        stage.unscaled = True

    def step(self, optimizer: Any) -> None:
        """Divide the gradients of `optimizer`'s parameters by the scale (in place; not again
        after `unscale_(optimizer)`), then update the parameters if all are finite and leave
        them and the optimizer's state as they were if not (Note [a skipped step is a select
        on the device]). Disabled: optimizer.step().

        Raises GraphCaptureError inside a capture for an optimizer that cannot skip on the
        device (`gated_updates` False: not nn.SGD or nn.Adam); eagerly, such an optimizer's
        step is skipped in Python after reading the check back. Raises RuntimeError, as
        torch.amp does, for a second step() of the optimizer before update(), or when none of
        its parameters has a gradient; ValueError for a float16 gradient (see `unscale_`).
        """
        if not self.enabled:
            optimizer.step()
            return
        stage = self._stage(optimizer)
        name = type(optimizer).__name__
        if stage.stepped:
            raise RuntimeError(f"GradScaler.step: step() has already been called for this "
                               f"optimizer ({name}) since the last update(): each step is "
                               f"unscaled, checked and taken once; call update() before the "
                               f"next step() (torch.amp.GradScaler refuses the same)")
        grads = self._gradients(optimizer, "GradScaler.step")
        if not grads:
            raise RuntimeError(f"GradScaler.step: No inf checks were recorded for this "
                               f"optimizer ({name}): none of its parameters has a gradient "
                               f"(torch.amp.GradScaler refuses the same); run the scaled "
                               f"backward pass first")
        capturing = tape.active() is not None
        gated = getattr(optimizer, "gated_updates", False)
        if capturing and not gated:
            raise GraphCaptureError(
                f"GradScaler.step: {type(optimizer).__name__} cannot skip a step on the device "
                f"(its gated_updates is False: only nn.SGD and nn.Adam write through "
                f"_target / _commit), so a captured step could not skip an overflow; run it "
                f"eagerly, where the scaler reads the check back and skips in Python")
        self.prepare(optimizer)
        with no_grad(), tape.phase("update"):
            found = stage.found if stage.unscaled else None
            sources: dict[int, Tensor] = {}
            inverses: dict[np.dtype, Tensor] = {}
            if found is None:
                sources = self._sources(grads)
                found, inverses = self._unscale(grads, self._buffer("zero_or_nan"))
            # NOTE: the scaler keeps no tensor of the step past it (a capture's temporaries die)
            stage.found, stage.stepped = None, True
            finite, gates = self._flags(found, grads)
            if gated and sources:
                optimizer._step(gates, {id(p): functools.partial(
                    _unscaled, sources[id(p.grad)], p.grad.dtype, inverses[p.grad.dtype])
                    for p in optimizer.params if p.grad is not None and id(p.grad) in sources})
            elif gated:
                optimizer._step(gates)
            elif finite.item() == 1.0:
                optimizer.step()
            state = self._state
            ops.add(state["steps"], 1.0, out=state["steps"])
            missed = ops.sub(1.0, finite, out=self._buffer("term"))
            ops.add(state["skipped"], missed, out=state["skipped"])
            self._fold(finite)

    def _fold(self, finite: Tensor) -> None:
        """Keep a check's 0/1 flag for the next update(): finite since the last one."""
        state = self._state
        if self._pending:
            ops.mul(state["finite"], finite, out=state["finite"])
        else:
            ops.copy(finite, out=state["finite"])
        self._pending += 1

    def _gradients(self, optimizer: Any, where: str) -> list[Tensor]:
        """The gradients of `optimizer`'s parameters, once everything that would refuse the
        step is checked (unscaling writes them, so a refusal after would leave them changed):
        a float16 gradient, and what the optimizer's own check refuses (nn.Optimizer's
        `_check_step`: a gradient without memory, a missed step)."""
        todo = [p for p in optimizer.params if p.grad is not None]
        for p in todo:
            if p.grad.dtype == np.float16:
                raise ValueError(
                    f"{where}: parameter {p.name or p.shape} has a float16 gradient, which loss "
                    f"scaling cannot unscale and check safely (PyTorch refuses it too: "
                    f"\"Attempting to unscale FP16 gradients.\"); keep float32 parameters and "
                    f"compute in float16 under amp.autocast (nn.train_step(..., "
                    f"precision='float16')), or train bfloat16 ones without a scaler; nothing "
                    f"was changed")
        check = getattr(optimizer, "_check_step", None)
        if check is not None:
            check(todo)
        return [p.grad for p in todo]

    def _inverse(self) -> Tensor:
        """1 / scale: made by scale() while capturing, else now."""
        early = self._early
        if early is not None and _capturing(early[0]):
            return early[1]
        return ops.div(1.0, self._state["scale"], out=self._buffer("inverse"))

    def _sources(self, grads: list[Tensor]) -> dict[int, Tensor]:
        """While capturing: by id, the gradients of `grads` that are a cast of a half gradient
        and unchanged since, and that half gradient (Note [half gradients through the
        check]); empty otherwise. Forgets those (update() forgets the rest)."""
        opened = _collecting.sources
        if opened is None or not _capturing(opened[0]):
            return {}
        found = {}
        for g in grads:
            entry = opened[1].pop(g.block.id, None)
            if (entry is not None and g.nbytes >= _REMAKE_BYTES
                    and (entry[0].block.version, g.block.version) == entry[1:]):
                found[id(g)] = entry[0]
        return found

    def _unscale(self, grads: list[Tensor], out: Tensor | None) -> tuple[Tensor, dict]:
        """Unscale `grads` in place; return (in `out`) +0.0 when all are finite, NaN if not,
        and 1 / scale by dtype. The check looks at each element, as PyTorch's does: g * 0 is
        +-0 where g is finite and NaN where not, and a sum of zeros is exactly zero (a sum of
        the gradients themselves could overflow to inf, and read a finite step as skipped)."""
        inverse = self._inverse()
        inverses = {_FLOAT32: inverse}
        total = None
        for g in grads:
            dtype = g.dtype
            if dtype not in inverses:
                inverses[dtype] = ops.cast(inverse, dtype, out=self._buffer("inverse", dtype))
            ops.mul(g, inverses[dtype], out=g)
            zeros = ops.mul(g, 0.0, out=self._probe(g))
            s = ops.sum(zeros, out=self._buffer("sum", dtype))
            if dtype != _FLOAT32:
                s = ops.cast(s, _FLOAT32, out=self._buffer("sum"))
            total = (ops.copy(s, out=self._buffer("total")) if total is None
                     else ops.add(total, s, out=total))
        return ops.sub(total, total, out=out), inverses

    def _flags(self, zero_or_nan: Tensor,
               grads: list[Tensor]) -> tuple[Tensor, dict[np.dtype, Tensor]]:
        """From `_unscale`'s +0.0 or NaN: the 0/1 flag "all finite" and the gates, -0.0 or NaN,
        one per dtype of `grads`."""
        finite = ops.add(zero_or_nan, 1.0, out=self._buffer("finite"))
        finite = ops.where_finite(finite, 0.0, out=finite)
        gate = ops.neg(zero_or_nan, out=self._buffer("gate"))
        gates = {_FLOAT32: gate}
        for g in grads:
            if g.dtype not in gates:
                gates[g.dtype] = ops.cast(gate, g.dtype, out=self._buffer("gate", g.dtype))
        return finite, gates

    def update(self) -> None:
        """Adjust the scale after the steps since the last update: times backoff_factor if any
        skipped (and the growth counter restarts), else count one more finite step and, at
        growth_interval of them in a row, times growth_factor. All by arithmetic on the
        device's 0/1 flag, the same ops at every call. An `unscale_(optimizer)` without its
        step counts by its check, as in torch.amp.

        Raises RuntimeError, as torch.amp does, when no step() or unscale_() ran since the
        last update()."""
        if not self.enabled:
            return
        unscaled = [stage.found for stage in self._stages.values() if stage.found is not None]
        if not self._pending and not unscaled:
            raise RuntimeError("GradScaler.update: No inf checks were recorded prior to "
                               "update(): no step() or unscale_() ran since the last update() "
                               "(torch.amp.GradScaler refuses the same); applying the last "
                               "check again would back the scale off twice for one overflow")
        state = self._state
        f, tracker, scale = state["finite"], state["tracker"], state["scale"]
        interval = float(self.growth_interval)
        with no_grad(), tape.phase("update"):
            for found in unscaled:  # NOTE: unscale_ alone: torch.amp updates by its check
                self._fold(self._flags(found, [])[0])
            ops.add(tracker, 1.0, out=tracker)
            ops.mul(tracker, f, out=tracker)  # finite steps in a row, 0 after a skip
            # NOTE: tracker is an integer in [0, interval]: relu(t - i + 1) - relu(t - i) is 1
            # exactly when t == i
            grow = ops.relu(ops.sub(tracker, interval - 1.0, out=self._buffer("grow")),
                            out=self._buffer("grow"))
            over = ops.relu(ops.sub(tracker, interval, out=self._buffer("term")),
                            out=self._buffer("term"))
            grow = ops.sub(grow, over, out=grow)
            # factor = 1 + (1 - f) * (backoff - 1) + grow * (growth - 1): exactly 1 when the
            # step was finite and the scale does not grow
            factor = ops.sub(1.0, f, out=self._buffer("factor"))
            factor = ops.mul(factor, self.backoff_factor - 1.0, out=factor)
            factor = ops.add(factor, 1.0, out=factor)
            term = ops.mul(grow, self.growth_factor - 1.0, out=self._buffer("term"))
            factor = ops.add(factor, term, out=factor)
            ops.mul(scale, factor, out=scale)
            keep = ops.sub(1.0, grow, out=self._buffer("one"))
            ops.mul(tracker, keep, out=tracker)
        self._pending = 0
        self._stages.clear()
        self._early = None
        _collecting.sources = None
        if tape.active() is None:
            self.check()

    # ------------------------------------------------------------------ what happened
    def _read(self, name: str, default: float) -> float:
        if not self.enabled or not self._state:
            return self._initial.get(name, default) if self.enabled else default
        return float(self._state[name].item())

    def get_scale(self) -> float:
        """The current scale (init_scale before the first step, 1.0 when disabled); reads the
        device."""
        return self._read("scale", self.init_scale) if self.enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        """How many optimizer steps were skipped for inf or NaN gradients; reads the device."""
        return int(self._read("skipped", 0.0))

    @property
    def steps(self) -> int:
        """How many optimizer steps `step()` ran or skipped; reads the device."""
        return int(self._read("steps", 0.0))

    def check(self) -> int:
        """Log (WARNING, logger "runtime.amp") the steps skipped since the last check and
        return the number skipped in all. An eager `update()` checks every time; a graph's
        replays skip on the device without Python, so call it between them (each epoch, say)."""
        skipped = self.skipped_steps
        if skipped > self._reported:
            new = skipped - self._reported
            _log.warning("GradScaler: %d optimizer step%s skipped for inf or NaN gradients; "
                         "loss scale now %g (%d of %d steps skipped so far)", new,
                         "" if new == 1 else "s", self.get_scale(), skipped, self.steps)
            self._reported = skipped
        return skipped

    def state_dict(self) -> dict[str, Any]:
        """The scaler's settings and state as plain numbers (torch.amp.GradScaler's keys, plus
        the step counts), for a checkpoint; reads the device. Empty when disabled."""
        if not self.enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(self._read("tracker", 0.0)), "steps": self.steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned: the settings now, the device state (scale,
        growth counter, counts) at once if it exists, else when it is made.

        Raises ValueError for a state of a disabled scaler or with a key missing, and
        TypeError / ValueError for a value the constructor would refuse (the same checks), a
        growth tracker outside [0, growth_interval) or counts that are no int in [0, 2**24]
        (skipped steps at most the steps); a refused state changes nothing."""
        if not self.enabled:
            return
        where = "GradScaler.load_state_dict"
        if not isinstance(state, Mapping):
            raise TypeError(f"{where}: expected the mapping state_dict() returns, got "
                            f"{_brief(state)}")
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                   "_growth_tracker"} - set(state)
        if missing:
            raise ValueError(f"{where}: the state has no {', '.join(sorted(missing))} (a "
                             f"disabled scaler's state is empty)")
        settings = _settings(where, ("scale", state["scale"]), state["growth_factor"],
                             state["backoff_factor"], state["growth_interval"])
        tracker = _count(where, "_growth_tracker", state["_growth_tracker"], 0, settings[3] - 1)
        steps = _count(where, "steps", state.get("steps", 0), 0, _EXACT)
        skipped = _count(where, "skipped_steps", state.get("skipped_steps", 0), 0, steps)
        (self.init_scale, self.growth_factor, self.backoff_factor,
         self.growth_interval) = settings
        values = {"scale": self.init_scale, "tracker": float(tracker), "steps": float(steps),
                  "skipped": float(skipped)}
        self._reported = skipped
        if self._state:
            with no_grad():
                for name, value in values.items():
                    ops.mul(self._state[name], 0.0, out=self._state[name])
                    ops.add(self._state[name], value, out=self._state[name])
        else:
            self._initial = values

    def __repr__(self) -> str:
        if not self.enabled:
            return "GradScaler(enabled=False)"
        return (f"GradScaler(init_scale={self.init_scale}, growth_factor={self.growth_factor}, "
                f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval})")
