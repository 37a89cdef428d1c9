"""The graph runtime: capture a step once, then replay it under a memory plan.

`runtime.graph(fn, plan=..., checkpoint=..., fuse=...)` returns a callable `Graph`. Its first call
with a given input signature captures `fn`:

1. **Capture** (delayed execution; `capture.py`). `fn` runs with every op recorded on a tape
   instead of launched (`runtime.tape`): nothing computes and blocks made inside stay lazy. Each
   instruction names the blocks it reads and writes, as layouts; `_sort_blocks` tells the
   intermediates (made inside, held by nothing afterwards) from what the graph keeps.
2. **Rewrite** (`checkpoint.py`). With `checkpoint="sqrt"`, the forward instructions are cut
   into about sqrt(n) segments; forward results that the backward pass needs are recomputed from
   the segment's boundary just before their first backward use (Chen et al. 2016), so they need
   not stay live.
3. **Dependencies and schedule** (`schedule.py`). Read-after-write, write-after-read and
   write-after-write hazards on blocks give a DAG; a list scheduler walks it preferring
   instructions that do not add live bytes, so, e.g., each parameter's update runs as soon as its
   gradient is complete and the gradient dies at once.
4. **Fusion and in-place reuse** (`fuse.py`, with `fuse=True`). A chain of elementwise
   instructions whose intermediates feed only the next one becomes one instruction run in
   cache-sized row blocks, so the intermediates never exist at full size. A matrix product read
   only by such a chain joins it: as one accumulating `Device.gemm` when the chain is
   out = alpha * product + beta * out (an SGD update), else written straight into the chain's
   output. An elementwise instruction writes over an input that dies there when the layouts
   match (NNVM's rule); never for matmul, constants, parameters or tensors the user holds.
5. **Memory plan** (`memory.py`) for the intermediates: "none" allocates each at its first
   write and frees all at the end of the step; "recycle" frees each right after its last use
   (SINGA's reference-count recycling); "static" puts them all at offsets in one arena
   (`runtime.planner`), allocated once, so a replay calls no allocator at all. Every plan makes
   its allocator calls before the first write to state (Note [the commit point] in
   `runtime/nn.py`).
6. **Replay** (`replay.py`): the steps bound to views of the planned memory, run in order.

`capture._build` runs phases 1-5; each takes and returns a record of `program.py` (`Recorded`,
`Fused`, `MemoryPlan`) built by keyword, and the last one is a `_Capture`.

Later calls with the same signature replay the schedule on the new inputs without running the
Python function. Blocks that existed before the capture (parameters, optimizer state) are read
and written in place; blocks made inside that something still holds after `fn` returns (its
outputs, gradients kept in `.grad`, new optimizer state) are kept by the graph and written at
every replay.

What a capture bakes in (and so what invalidates it without being detected): Python control flow
and Python numbers (learning rates, loop counts), the set of tensors `fn` touches (replacing a
parameter tensor or changing the model), and settings read while capturing (aliasing mode,
default allocator). A change of input shape or dtype, or of a non-array argument, captures again;
`recapture()` forgets every capture.

Example:
    >>> import numpy as np, runtime
    >>> from runtime import nn
    >>> nn.manual_seed(0)
    >>> model = nn.Sequential(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
    >>> opt = nn.SGD(model.parameters(), lr=0.1)
    >>> def train_step(x, y):
    ...     loss = nn.softmax_cross_entropy(model(x), y)
    ...     loss.backward()
    ...     opt.step()
    ...     opt.zero_grad()
    ...     return loss
    >>> step = runtime.graph(train_step, plan="static")
    >>> x, y = np.ones((2, 4), np.float32), np.array([0, 2])
    >>> first = step(x, y).item()        # captures, plans, runs
    >>> second = step(x, y).item()       # replays
    >>> second < first
    True
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from allocators import Allocator, OutOfMemoryError, format_bytes
from backends.base import ieee
from runtime import config, planner, tape
from runtime._tensor import Tensor, tensor
from runtime.block import Block
from runtime.dtypes import BFLOAT16
from runtime.errors import GraphCaptureError
from runtime.graph.budget import BudgetError
from runtime.graph.capture import (
    Options,
    _abandon,
    _argument_writes,
    _build,
    _copy_inputs,
    _flatten,
    _host,
    _is_array,
    _lazy_bytes,
    _limiter,
    _results,
    _signature,
)
from runtime.graph.fuse import _products
from runtime.graph.memory import _timeline
from runtime.graph.program import _Capture
from runtime.graph.replay import _check_live, _release, _replay, _run_init
from runtime.tape import Tape

__all__ = ["CHECKPOINTS", "PLANS", "BudgetError", "Graph", "graph"]

PLANS = ("none", "recycle", "static")
CHECKPOINTS = (None, "sqrt", "pointwise")
#: How many captures (input signatures x calling threads) a graph keeps by default.
MAX_CAPTURES = 32

#: Each calling thread's `_Caller`, made at its first call of any graph.
_callers = threading.local()
_serials = itertools.count()


@dataclasses.dataclass(frozen=True)
class _Caller:
    """A calling thread, as a graph files its captures: by a serial no other thread ever gets.
    (`threading.get_ident()` is handed to a new thread once one ends, and with it the ended
    thread's captures: the new thread's calls overwrote the results the old one gave out.)"""

    serial: int
    thread: threading.Thread


def _caller() -> _Caller:
    """The calling thread's `_Caller`."""
    try:
        return _callers.caller
    except AttributeError:
        caller = _callers.caller = _Caller(next(_serials), threading.current_thread())
        return caller


def graph(fn: Callable[..., Any], plan: str = "static", checkpoint: str | None = None,
          fuse: bool = True, device: Any = None, allocator: Allocator | None = None,
          max_captures: int = MAX_CAPTURES, memory_budget: int | None = None,
          lossy: bool | str = False, device_graph: bool = True,
          fold_updates: bool = True) -> Graph:
    """Wrap `fn` (a training or inference step) as a captured, planned, replayable graph.

    Args:
        fn: called with tensors in place of its array arguments; returns a Tensor, a tuple or
            list of Tensors, or None.
        plan: "none", "recycle" or "static" (see the module docstring).
        checkpoint: None; "sqrt" to recompute forward results during backward from about
            sqrt(n) segment boundaries (Chen et al.); "pointwise" to recompute only what a
            chain of fusible elementwise ops makes again from data the backward pass keeps
            anyway (a ReLU of batch norm's affine map), which never raises the peak and costs
            a pass over those results (Note [pointwise recompute] in
            runtime/graph/checkpoint.py).
        fuse: fuse elementwise chains, fold matrix products into the chains that consume them
            and reuse dying inputs in place.
        device, allocator: where array arguments and the plan's memory go (default device and
            its default allocator).
        max_captures: how many captures to keep; past it the least recently used one is
            dropped (its memory freed) with a RuntimeWarning, once per graph.
        memory_budget: bytes the graph's working memory may take at most (plans "static"
            and "recycle"): its intermediates and the fused chains' scratch, each allocation
            counted at the size the allocator hands out for it (`Allocator.allocation_size`:
            a caching allocator's size classes, for one). For every forward result the
            backward pass reads, the graph chooses to keep or recompute it, by cost, so that
            the plan's peak fits (`budget.py`, docs/graph.md). None: under an allocator with a
            limit of its own (a LimitAdaptor), a plan that would not fit in what the limit
            leaves, once the step's input copies, outputs and new state are counted, is fitted
            to it the same way.
        lossy: False (the default): results equal the unconstrained graph's bit for bit.
            True, "bfloat16" or "float16": fitting a budget may also store float32 forward
            results in that half dtype while they wait for the backward pass (True is
            bfloat16: float32's range, 8 bits of precision), where that costs less than
            recomputing; `memory_report()["lossy"]` names each one stored so.
        device_graph: under plan "static", on a device that records device graphs (CUDA),
            replay the step as one recorded graph from its second replay on (one launch, no
            Python per kernel; the same bits: Note [a static plan as one device graph] in
            runtime/graph/replay.py); `memory_report()["device_graph"]` says whether it is
            one, or why not. False: replay launch by launch.
        fold_updates: True (the default): an in-place update of a matrix product's result,
            out = alpha * product + beta * out (plain SGD's w - lr * g, momentum's buf + g), is
            one accumulating `gemm` where the device has one: the gradient never gets a
            buffer, but its rounding may differ from eager's in the last bits
            (`memory_report()["updates_folded"]` counts them; Note [a folded update's
            rounding] in runtime/graph/fuse.py). False: every step equals eager bit for bit,
            at the cost of a product-sized buffer.

    Raises:
        ValueError: an unknown plan or checkpoint, max_captures below 1, a negative budget,
            a budget with plan "none" or checkpoint="sqrt", or a lossy other than a bool,
            "float16" or "bfloat16".
        TypeError: a device_graph or fold_updates other than True or False.
        BudgetError: (at the first call, before anything runs) a budget below the least peak
            any choice reaches; an OutOfMemoryError naming both.

    Example:
        >>> step = runtime.graph(train_step, memory_budget=8 << 20)  # doctest: +SKIP
    """
    return Graph(fn, plan, checkpoint, fuse, device, allocator, max_captures, memory_budget,
                 lossy, device_graph, fold_updates)


class Graph:
    """A step function captured once per input signature and replayed under a memory plan.

    See `runtime.graph` and the module docstring.

    Threads: a graph may be called from several threads. Calls run one at a time (a lock per
    graph), so the results and the state they update are those of the calls made one after
    another in some order; each calling thread has captures of its own, so the tensors a call
    returns are overwritten only by the same thread's next call of the graph (a thread that
    ends passes its captures to no other: they are dropped at the next capture).

    Freed memory: a call whose replay would read or write a block that was freed since the
    capture (`Block.free()` on a parameter, optimizer state, a constant, an argument or an
    output) raises UseAfterFreeError before anything runs, as eager execution raises.
    """

    def __init__(self, fn: Callable[..., Any], plan: str = "static",
                 checkpoint: str | None = None, fuse: bool = True, device: Any = None,
                 allocator: Allocator | None = None, max_captures: int = MAX_CAPTURES,
                 memory_budget: int | None = None, lossy: bool | str = False,
                 device_graph: bool = True, fold_updates: bool = True) -> None:
        if plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
        if not callable(fn):
            raise TypeError(f"graph() needs a callable, got {type(fn).__name__}")
        if isinstance(max_captures, bool) or not isinstance(max_captures, int) \
                or max_captures < 1:
            raise ValueError(f"max_captures must be an int >= 1, got {max_captures!r}")
        if memory_budget is not None:
            if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, np.integer)) \
                    or memory_budget < 0:
                raise ValueError(f"memory_budget must be a number of bytes >= 0 or None, got "
                                 f"{memory_budget!r}")
            if plan == "none":
                raise ValueError("memory_budget needs plan 'static' or 'recycle': plan 'none' "
                                 "reuses no memory, so recomputing saves nothing")
            if checkpoint is not None:
                raise ValueError("memory_budget chooses what to recompute itself: leave "
                                 f"checkpoint None (got {checkpoint!r})")
            memory_budget = int(memory_budget)
        for name, flag in (("device_graph", device_graph), ("fold_updates", fold_updates)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        self.device_graph = bool(device_graph)
        self.fold_updates = bool(fold_updates)
        self.memory_budget = memory_budget
        self.lossy = _lossy_dtype(lossy)
        self.fn = fn
        self.plan = plan
        self.checkpoint = checkpoint
        self.fuse = bool(fuse)
        self.max_captures = max_captures
        self._device = device
        self._allocator = allocator
        #: (calling thread's serial, input signature) -> capture, least recently used first
        self._captures: OrderedDict[tuple, _Capture] = OrderedDict()
        #: serial -> the calling thread, for each thread with captures here
        self._callers: dict[int, _Caller] = {}
        self._last: _Capture | None = None
        self._lock = threading.Lock()
        self._warned = False

    # ------------------------------------------------------------------ calling
    def __call__(self, *args: Any) -> Any:
        if tape.active() is not None:
            raise GraphCaptureError("a graph was called while another graph is capturing; "
                                    "captures do not nest: call the inner function directly")
        caller = _caller()
        key = (caller.serial, _signature(args))
        with self._lock:
            capture = self._captures.get(key)
            if capture is None:
                self._forget_ended_threads()
                capture = self._capture(args)
                self._callers[caller.serial] = caller
                self._keep(key, capture)
            else:
                self._captures.move_to_end(key)
            self._last = capture
            _check_live(capture)
            _copy_inputs(capture, args)
            # NOTE: Note [IEEE results, no floating-point signals] in backends/base.py
            ieee(_replay, capture, self.plan, args)
            return _results(capture)

    def _keep(self, key: tuple, capture: _Capture) -> None:
        """File a new capture, dropping the least recently used past `max_captures`."""
        self._captures[key] = capture
        while len(self._captures) > self.max_captures:
            _, dropped = self._captures.popitem(last=False)
            _release(dropped)
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"{self!r} holds {self.max_captures} captures (one per input signature and "
                    f"calling thread) and dropped the oldest; an argument that changes at "
                    f"every call (a new object, a shape) captures again each time: pass it as "
                    f"an array, or raise max_captures", RuntimeWarning, stacklevel=3)

    def _forget_ended_threads(self) -> None:
        """Drop the captures of threads that have ended (they cannot call again); the results
        those threads were given keep their own memory."""
        ended = {serial for serial, caller in self._callers.items()
                 if not caller.thread.is_alive()}
        if not ended:
            return
        for key in [key for key in self._captures if key[0] in ended]:
            _release(self._captures.pop(key))
        for serial in ended:
            del self._callers[serial]

    def recapture(self) -> None:
        """Forget every capture (and free their memory); the next call captures again."""
        with self._lock:
            for capture in self._captures.values():
                _release(capture)
            self._captures.clear()
            self._callers.clear()
            self._last = None

    release = recapture

    def __del__(self) -> None:
        # NOTE: a graph dropped without release() gives its arenas back to the allocator
        try:
            self.recapture()
        except Exception:
            pass

    # ------------------------------------------------------------------ reports
    def memory_report(self) -> dict[str, Any]:
        """Bytes of the intermediates of the last capture used.

        Keys: planned_bytes (the static arena), lower_bound_bytes (the most bytes live at once
        over the schedule, after fusion and in-place reuse), naive_bytes (the sum of every
        intermediate block the capture recorded, each its own buffer for the whole step: no
        reuse, no fusion, no product folded; a figure no run reaches, not a baseline to measure
        savings against), eager_bytes (the most bytes of intermediates live at once when the
        recorded ops run in their own order, unfused, each block freed after its last use: what
        the step without a graph holds at least, blockrt's eager refcount recycling; compare
        plans with it, or with a plan "none" graph's peak_bytes), peak_bytes (the most bytes
        this graph's plan held at once in its last run, its scratch included, at the sizes the
        allocator handed out), activation_bytes (the most bytes of forward results live at
        once), scratch_bytes (the block-sized scratch arrays fused chains share: one allocation
        of the graph's allocator, held by the capture), plan, and counts: instructions, steps,
        fused, products, updates_folded (of those products, the updates run as one
        accumulating gemm, see `fold_updates`), in_place, recompute_instructions (instructions
        cloned to recompute),
        commit_step (the position of the first step that writes state: every allocation of a
        replay comes before it, Note [the commit point] in runtime/nn.py).

        What stays for the backward pass (with or without a budget): kept (forward results
        the backward pass reads that stay live until then), recomputed (those recomputed
        instead), moved (those moved to host memory and back, see `moves`), recompute_flops
        (the extra work), moved_bytes, step_flops (the step's work without recomputation),
        lossy (each result stored in a half dtype while it waits: its block, the op and
        phase that made it, shape, dtype and bytes; empty unless the graph was made with
        `lossy`). Under a budget also: memory_budget (bytes), budget_source, units, room
        (the most units kept at once; None: all or not the programme's choice), depth
        (nesting of the recomputes), moves (what moved, or why nothing did), schedule (the
        choice in words).

        device_graph: "recorded" where replays launch the step as one device graph, else why
        not (Note [a static plan as one device graph] in runtime/graph/replay.py);
        device_graph_bytes: the memory the recording holds beyond the plan (what its kernels
        allocated while it recorded; 0 when there is none).
        """
        capture = self._require_capture()
        static = capture.memory.static_plan
        choice = capture.choice
        budget: dict[str, Any] = {"memory_budget": None, "lossy": []}
        if choice is not None:
            budget.update(memory_budget=choice.budget, budget_source=choice.source,
                          units=choice.units, room=choice.room, depth=choice.depth,
                          moves=choice.moves, schedule=choice.schedule,
                          lossy=[dataclasses.asdict(s) for s in choice.lossy])
        return {"plan": self.plan, "checkpoint": self.checkpoint, **budget,
                "commit_step": capture.memory.commit,
                "planned_bytes": static.planned_bytes,
                "lower_bound_bytes": static.lower_bound_bytes,
                "naive_bytes": capture.naive_bytes, "eager_bytes": capture.eager_bytes,
                "peak_bytes": capture.peak_bytes,
                "scratch_bytes": capture.memory.scratch_bytes,
                "device_graph": "recorded" if capture.recording else capture.graph_reason,
                "device_graph_bytes": (capture.recording.held_bytes if capture.recording
                                       else 0),
                **capture.stats}

    def timeline(self, live: bool = False) -> list[int]:
        """Bytes held at each scheduled step under this graph's plan (one value per step): its
        allocations at the sizes the allocator hands out, the fused chains' scratch included;
        its highest point is what a memory budget counts. With `live`, the bytes of
        intermediates live at each step instead (what any placement must hold there; its
        highest point is `lower_bound_bytes`)."""
        capture = self._require_capture()
        if live:
            return planner.live_bytes(capture.memory.lifetimes, len(capture.steps),
                                      alignment=capture.memory.static_plan.alignment)
        return self._timeline_of(capture)

    def _timeline_of(self, capture: _Capture) -> list[int]:
        return _timeline(capture.memory, self.plan, len(capture.steps),
                         capture.allocator.allocation_size)

    def _require_capture(self) -> _Capture:
        if self._last is None:
            raise GraphCaptureError("the graph has not run yet: call it once first")
        return self._last

    # ------------------------------------------------------------------ capture
    def _capture(self, args: Sequence[Any]) -> _Capture:
        device, allocator = self._where(args)
        placeholders: list[Tensor | None] = []
        call_args = []
        for arg in args:
            if _is_array(arg):
                holder = tensor(_host(arg), device=device, allocator=allocator)
                placeholders.append(holder)
                call_args.append(holder)
            else:
                placeholders.append(None)
                call_args.append(arg)
        first = Block(0, allocator).id + 1
        recorder = Tape(first)
        try:
            with tape.recording(recorder):
                result = self.fn(*call_args)
            outputs, kind = _flatten(result)
        except BaseException:
            _abandon(recorder)
            raise
        del result, call_args
        capture = _build(recorder, placeholders=placeholders, outputs=outputs,
                         output_kind=kind, allocator=allocator,
                         options=Options(plan=self.plan, checkpoint=self.checkpoint,
                                         fuse=self.fuse, fold_updates=self.fold_updates,
                                         memory_budget=self.memory_budget, lossy=self.lossy),
                         name=getattr(self.fn, "__name__", type(self.fn).__name__))
        self._refuse(capture, _argument_writes(capture))
        self._check_fits(capture)
        capture.record_graph, capture.graph_reason = self._records(capture)
        capture.device.plan_products(_products(capture.steps))  # e.g. the CPU times its BLASes
        return capture

    def _records(self, capture: _Capture) -> tuple[bool, str | None]:
        """Whether replays become one device graph, and if not, why (`memory_report`)."""
        device = capture.device
        if self.plan != "static":
            return False, f"plan {self.plan!r} allocates during the step: only 'static' records"
        if not self.device_graph:
            return False, "device_graph=False: launch by launch"
        if not device.capabilities.records_graphs:
            return False, f"{device.name} records no device graphs"
        moved = [i for step in capture.steps for i in step.instructions if i.phase == "move"]
        if moved:
            # NOTE: an offload reads device memory back to the host and its reload copies what
            # it read, bytes that change every step: neither is a kernel a graph can hold
            return False, (f"memory_budget moves results to host memory and back "
                           f"({sum(i.op == 'offload' for i in moved)} offloads a step): "
                           f"host copies run launch by launch")
        return True, "not recorded yet: the second replay records it"

    def _refuse(self, capture: _Capture, problem: str | None) -> None:
        """Raise GraphCaptureError with `problem` (if any), after initialising the state the
        capture made (so the tensors it belongs to stay usable) and freeing its memory."""
        if problem is None:
            return
        try:
            _run_init(capture)
        finally:
            _release(capture)
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        raise GraphCaptureError(f"{name}: {problem}")

    def _check_fits(self, capture: _Capture) -> None:
        """Refuse, before anything runs, a plan whose memory cannot fit in what the allocator
        has left (e.g. under a LimitAdaptor). State the capture made (optimizer moments) is
        still initialised when it fits, so the tensors it belongs to stay usable."""
        lazy = _lazy_bytes(capture.outside, _limiter(capture.allocator))
        planned = max(self._timeline_of(capture), default=0)
        available = capture.allocator.available_bytes()
        if available is None or planned + lazy <= available:
            return
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        message = (f"the {self.plan} plan of {name} needs {format_bytes(planned + lazy)} "
                   f"({format_bytes(planned)} of intermediates and scratch + "
                   f"{format_bytes(lazy)} of outputs and state made in the step) but "
                   f"{capture.allocator!r} has {format_bytes(available)} available; nothing "
                   f"has run")
        if capture.least_bytes is not None:
            message += (f" (recomputing forward results during backward reaches at least "
                        f"{format_bytes(capture.least_bytes)}: no choice fits)")
        try:
            _run_init(capture)
        except OutOfMemoryError as error:
            message += f" (and the state the capture made could not be initialised: {error})"
        _release(capture)
        raise OutOfMemoryError(message)

    def _where(self, args: Sequence[Any]) -> tuple[Any, Allocator]:
        device = self._device
        if device is None:
            device = next((a.device for a in args if isinstance(a, Tensor)), None)
            device = device or config.get_default_device()
        allocator = self._allocator or config.get_default_allocator(device)
        return allocator.device, allocator

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        return (f"<Graph {name} plan={self.plan} checkpoint={self.checkpoint} fuse={self.fuse} "
                f"captures={len(self._captures)}>")


#: what `lossy` may name, and what True stands for
LOSSY = {"bfloat16": BFLOAT16, "float16": np.dtype(np.float16)}


def _lossy_dtype(lossy: Any) -> np.dtype | None:
    """The half dtype `runtime.graph(..., lossy=...)` allows, or None (lossless)."""
    if lossy is False:
        return None
    if lossy is True:
        return LOSSY["bfloat16"]
    if isinstance(lossy, str) and lossy in LOSSY:
        return LOSSY[lossy]
    raise ValueError(f"lossy must be False, True, 'float16' or 'bfloat16', got {lossy!r}")
