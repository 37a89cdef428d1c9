"""The graph runtime: capture a step once, then replay it under a memory plan.

`runtime.graph(fn, plan=..., checkpoint=..., fuse=...)` returns a callable `Graph`. Its first call
with a given input signature captures `fn`:

1. **Capture** (delayed execution). `fn` runs with every op recorded on a tape instead of
   launched (`runtime.tape`): nothing computes and blocks made inside stay lazy. Each instruction
   names the blocks it reads and writes, as layouts.
2. **Rewrite.** With `checkpoint="sqrt"`, the forward instructions are cut into about sqrt(n)
   segments; forward results that the backward pass needs are recomputed from the segment's
   boundary just before their first backward use (Chen et al. 2016), so they need not stay live.
3. **Dependencies and schedule.** Read-after-write, write-after-read and write-after-write
   hazards on blocks give a DAG; a list scheduler walks it preferring instructions that do not
   add live bytes, so, e.g., each parameter's update runs as soon as its gradient is complete
   and the gradient dies at once.
4. **Fusion and in-place reuse** (`fuse=True`). A chain of elementwise instructions whose
   intermediates feed only the next one becomes one instruction run in cache-sized row blocks,
   so the intermediates never exist at full size. A matrix product read only by such a chain
   joins it: as one accumulating `Device.gemm` when the chain is out = alpha * product +
   beta * out (an SGD update), else written straight into the chain's output. An elementwise
   instruction writes over an input that dies there when the layouts match (NNVM's rule); never
   for matmul, constants, parameters or tensors the user holds.
5. **Memory plan** for the blocks made inside the capture that nothing outside holds
   (intermediates): "none" allocates each at its first write and frees all at the end of the
   step; "recycle" frees each right after its last use (SINGA's reference-count recycling);
   "static" puts them all at offsets in one arena (`runtime.planner`), allocated once, so a
   replay calls no allocator at all.

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

import math
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from allocators import Allocation, Allocator, OutOfMemoryError, format_bytes
from backends.base import ieee
from runtime import autograd, config, planner, tape
from runtime.block import Block
from runtime.errors import GraphCaptureError
from runtime.tape import Instruction, Operand, Tape
from runtime.tensor import Tensor, host_array, tensor

__all__ = ["CHECKPOINTS", "PLANS", "Graph", "graph"]

PLANS = ("none", "recycle", "static")
CHECKPOINTS = (None, "sqrt")
#: How many captures (input signatures x calling threads) a graph keeps by default.
MAX_CAPTURES = 32


def graph(fn: Callable[..., Any], plan: str = "static", checkpoint: str | None = None,
          fuse: bool = True, device: Any = None, allocator: Allocator | None = None,
          max_captures: int = MAX_CAPTURES) -> Graph:
    """Wrap `fn` (a training or inference step) as a captured, planned, replayable graph.

    Args:
        fn: called with tensors in place of its array arguments; returns a Tensor, a tuple or
            list of Tensors, or None.
        plan: "none", "recycle" or "static" (see the module docstring).
        checkpoint: None, or "sqrt" to recompute forward results during backward.
        fuse: fuse elementwise chains, fold matrix products into the chains that consume them
            and reuse dying inputs in place.
        device, allocator: where array arguments and the plan's memory go (default device and
            its default allocator).
        max_captures: how many captures to keep; past it the least recently used one is
            dropped (its memory freed) with a RuntimeWarning, once per graph.

    Raises:
        ValueError: an unknown plan or checkpoint, or max_captures below 1.
    """
    return Graph(fn, plan, checkpoint, fuse, device, allocator, max_captures)


# ---------------------------------------------------------------------- the captured program
@dataclass
class _Step:
    """One scheduled instruction, or a fused chain of them, ready to replay."""

    instructions: list[Instruction]
    #: blocks of intermediates internal to a fused chain (never materialised at full size)
    internal: set[int] = field(default_factory=set)
    #: a matrix product heading the chain (`instructions[0]`, see `_attach_products`): "into"
    #: (the product goes into the chain's output, the chain runs over it in place) or
    #: (alpha, beta) (the whole chain is out = alpha * product + beta * out: one `Device.gemm`)
    product: str | tuple[float, float] | None = None


@dataclass
class _Capture:
    """Everything one capture produced: the schedule, the plan and the graph-held tensors."""

    steps: list[_Step]
    placeholders: list[Tensor | None]
    outputs: list[Tensor]
    output_kind: str
    held: list[Tensor]                       # handles keeping graph-written blocks alive
    state: set[int]                          # blocks of state the steps write (see _state_of)
    buffer_of: dict[int, int]                # intermediate block id -> buffer (class) id
    lifetimes: list[planner.Lifetime]        # per buffer, in schedule positions
    naive_bytes: int
    static_plan: planner.Plan
    device: Any
    allocator: Allocator
    stats: dict[str, int]
    outside: list[Block]                     # blocks outside the plan that the steps touch
    outside_ids: set[int]
    init: list[_Step]                        # loads that initialise kept state: run once
    commit: int = 0                          # the first step that writes state
    tail_plan: planner.Plan | None = None    # recycle: buffers first used from `commit` on
    starts: dict = field(default_factory=dict)   # step -> buffers allocated there (none/recycle)
    ends: dict = field(default_factory=dict)     # step -> buffers freed after it (recycle)
    tail: list = field(default_factory=list)     # buffers first used from `commit` on
    arena: Allocation | None = None
    views: list[Callable[[], None]] | None = None   # static: the steps with bound views
    view_key: tuple = ()
    peak_bytes: int = 0
    scratch: dict = field(default_factory=dict)   # fused chains' block-sized scratch, shared


class Graph:
    """A step function captured once per input signature and replayed under a memory plan.

    See `runtime.graph` and the module docstring.

    Threads: a graph may be called from several threads. Calls run one at a time (a lock per
    graph), so the results and the state they update are those of the calls made one after
    another in some order; each calling thread has captures of its own, so the tensors a call
    returns are overwritten only by the same thread's next call of the graph.
    """

    def __init__(self, fn: Callable[..., Any], plan: str = "static",
                 checkpoint: str | None = None, fuse: bool = True, device: Any = None,
                 allocator: Allocator | None = None, max_captures: int = MAX_CAPTURES) -> None:
        if plan not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {plan!r}")
        if checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {checkpoint!r}")
        if not callable(fn):
            raise TypeError(f"graph() needs a callable, got {type(fn).__name__}")
        if isinstance(max_captures, bool) or not isinstance(max_captures, int) \
                or max_captures < 1:
            raise ValueError(f"max_captures must be an int >= 1, got {max_captures!r}")
        self.fn = fn
        self.plan = plan
        self.checkpoint = checkpoint
        self.fuse = bool(fuse)
        self.max_captures = max_captures
        self._device = device
        self._allocator = allocator
        #: (calling thread, input signature) -> capture, least recently used first
        self._captures: OrderedDict[tuple, _Capture] = OrderedDict()
        self._last: _Capture | None = None
        self._lock = threading.Lock()
        self._warned = False

    # ------------------------------------------------------------------ calling
    def __call__(self, *args: Any) -> Any:
        if tape.active() is not None:
            raise GraphCaptureError("a graph was called while another graph is capturing; "
                                    "captures do not nest: call the inner function directly")
        key = (threading.get_ident(), _signature(args))
        with self._lock:
            capture = self._captures.get(key)
            if capture is None:
                capture = self._capture(args)
                self._keep(key, capture)
            else:
                self._captures.move_to_end(key)
            self._last = capture
            _copy_inputs(capture, args)
            ieee(_replay, capture, self.plan)  # NOTE: Note [IEEE results, no ...] in backends
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

    def recapture(self) -> None:
        """Forget every capture (and free their memory); the next call captures again."""
        with self._lock:
            for capture in self._captures.values():
                _release(capture)
            self._captures.clear()
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
        over the schedule, after fusion and in-place reuse), naive_bytes (every intermediate
        block at full size, no reuse), peak_bytes (the most bytes this graph's plan held at
        once in its last run), activation_bytes (the most bytes of forward results live at
        once), scratch_bytes (the block-sized scratch arrays fused chains share, made by the
        device outside any allocator), plan, and counts: instructions, steps, fused, products,
        in_place, recomputed.
        """
        capture = self._require_capture()
        static = capture.static_plan
        return {"plan": self.plan, "checkpoint": self.checkpoint,
                "planned_bytes": static.planned_bytes,
                "lower_bound_bytes": static.lower_bound_bytes,
                "naive_bytes": capture.naive_bytes, "peak_bytes": capture.peak_bytes,
                "scratch_bytes": sum(int(a.nbytes) for a in capture.scratch.values()),
                **capture.stats}

    def timeline(self) -> list[int]:
        """Bytes live at each scheduled step under this graph's plan (one value per step)."""
        return self._timeline_of(self._require_capture())

    def _timeline_of(self, capture: _Capture) -> list[int]:
        n, commit = len(capture.steps), capture.commit
        if self.plan == "static":
            return [capture.static_plan.planned_bytes] * n
        if self.plan == "none":  # nothing goes back before the end of the step
            grown = [0] * n
            for life in capture.lifetimes:
                grown[min(life.first, commit)] += life.nbytes
            return list(np.cumsum(grown).tolist()) if n else []
        early = [life for lives in capture.starts.values() for life in lives]
        live = planner.live_bytes(early, n) if early else [0] * n
        if capture.tail_plan is not None:  # the tail arena, held from the commit step on
            live[commit:] = [b + capture.tail_plan.planned_bytes for b in live[commit:]]
        return live

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
        capture = _build(recorder, placeholders, outputs, kind, device, allocator, self.plan,
                         self.checkpoint, self.fuse)
        self._refuse(capture, _argument_writes(capture))
        self._check_fits(capture)
        return capture

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
        limiter = _limiter(capture.allocator)
        lazy = sum(block.nbytes for block in capture.outside
                   if block._allocation is None and not block.readonly
                   and any(a is limiter for a in _chain(block.allocator)))
        planned = max(self._timeline_of(capture), default=0)
        available = capture.allocator.available_bytes()
        if available is None or planned + lazy <= available:
            return
        name = getattr(self.fn, "__name__", type(self.fn).__name__)
        message = (f"the {self.plan} plan of {name} needs {format_bytes(planned + lazy)} "
                   f"({format_bytes(planned)} of intermediates + {format_bytes(lazy)} of "
                   f"outputs and state made in the step) but {capture.allocator!r} has "
                   f"{format_bytes(available)} available; nothing has run")
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


# ---------------------------------------------------------------------- arguments and results
def _chain(allocator: Allocator) -> list[Allocator]:
    """`allocator` and the allocators under it (adaptors' upstreams), top first."""
    chain = [allocator]
    while getattr(chain[-1], "upstream", None) is not None:
        chain.append(chain[-1].upstream)
    return chain


def _limiter(allocator: Allocator) -> Allocator:
    """The allocator in `allocator`'s chain whose own limit its available_bytes() reports: the
    lowest one with a limit of its own (a LimitAdaptor, a caching allocator's limit_bytes),
    else the bottom one (the device's memory). A block's bytes count against that limit only
    when its own allocator's chain passes through it."""
    chain = _chain(allocator)
    own = [a for a in chain if a._limit()[1] != "device memory"]
    return own[-1] if own else chain[-1]


def _is_array(arg: Any) -> bool:
    return isinstance(arg, (np.ndarray, Tensor))


def _host(arg: Any) -> np.ndarray:
    """What the graph holds for an array argument: exactly what runtime.tensor makes of it."""
    return arg.numpy() if isinstance(arg, Tensor) else host_array(arg, None, "graph input")


def _signature(args: Sequence[Any]) -> tuple:
    key = []
    for arg in args:
        if _is_array(arg):
            key.append(("array", tuple(arg.shape), np.dtype(arg.dtype).str))
        else:
            try:
                hash(arg)
            except TypeError:
                raise GraphCaptureError(
                    f"graph arguments must be arrays, tensors or hashable values (they are "
                    f"baked into the capture); got a {type(arg).__name__}") from None
            key.append(("value", type(arg).__name__, _value_key(arg)))
    return tuple(key)


def _value_key(value: Any) -> Any:
    """A key under which equal arguments, and only those, find one capture: floats by their
    bits (a NaN finds the capture of the same NaN; 0.0 and -0.0, equal to ==, do not share
    one, as their products differ in sign), tuples element by element."""
    if isinstance(value, (float, np.floating, complex, np.complexfloating)):
        return np.asarray(value).tobytes()
    if isinstance(value, tuple):
        return tuple((type(v).__name__, _value_key(v)) for v in value)
    return value


def _flatten(result: Any) -> tuple[list[Tensor], str]:
    if result is None:
        return [], "none"
    if isinstance(result, Tensor):
        return [result], "single"
    if isinstance(result, (tuple, list)) and all(isinstance(t, Tensor) for t in result):
        return list(result), type(result).__name__
    raise GraphCaptureError(f"a captured function must return a Tensor, a tuple or list of "
                            f"Tensors, or None; got {type(result).__name__}")


def _copy_inputs(capture: _Capture, args: Sequence[Any]) -> None:
    for holder, arg in zip(capture.placeholders, args):
        if holder is None:
            continue
        if isinstance(arg, Tensor):
            if arg.block.id in capture.state:
                raise GraphCaptureError(
                    f"graph argument {capture.placeholders.index(holder)} shares block "
                    f"#{arg.block.id} with state the step writes (a parameter or optimizer "
                    f"state); a graph copies array arguments in before the step runs, so it "
                    f"would read old values where the function called directly reads new ones: "
                    f"pass a copy (ops.copy(t)) or read the state inside the function")
            if (arg.device is holder.device and arg.block is not holder.block
                    and type(arg.block) is Block):
                # NOTE: the hot path of every replay: distinct plain blocks never overlap, so a
                # plain device copy between the (checked, cached) native views is safe; imported
                # memory may overlap anything, so it goes through ops.copy's overlap test
                source = arg._native_read("graph input")
                holder.device.unary("copy", source, holder._native_write("graph input"))
                holder.block.mark_written()
                continue
            from runtime import ops

            with autograd.no_grad():
                ops.copy(arg, out=holder)
        else:
            if arg.dtype is not holder.dtype or not arg.flags.c_contiguous:
                arg = host_array(arg, None, "graph input")  # NOTE: as runtime.tensor converts
            allocation = holder.block.memory_for_write("graph input")
            holder.device.copyin(allocation.raw, allocation.offset, arg)
            holder.block.mark_written()


def _results(capture: _Capture) -> Any:
    handles = [Tensor(t.block, t.shape, t.dtype, t.strides, t.offset) for t in capture.outputs]
    if capture.output_kind == "none":
        return None
    if capture.output_kind == "single":
        return handles[0]
    return tuple(handles) if capture.output_kind == "tuple" else handles


# ---------------------------------------------------------------------- building a capture
def _build(recorder: Tape, placeholders: list[Tensor | None], outputs: list[Tensor], kind: str,
           device: Any, allocator: Allocator, plan: str, checkpoint: str | None,
           fuse: bool) -> _Capture:
    program = recorder.instructions
    # Phase 1: which blocks are intermediates (made here, held by nothing once fn returned).
    blocks: dict[int, Block] = {}
    for instr in program:
        for operand in (*instr.inputs, *instr.outputs):
            blocks[operand.block.id] = operand.block
    held = [t.detach() for t in outputs] + list(recorder.external.values())
    for block in blocks.values():
        if recorder.made_here(block) and block.refcount > 0:
            held.append(Tensor(block, (block.nbytes,), np.uint8))
    kept = {t.block.id for t in held}
    intermediate = {bid for bid, block in blocks.items()
                    if recorder.made_here(block) and bid not in kept}
    # NOTE: host data loaded into a block made here that outlives the call (optimizer state made
    # at the first step) initialises it: it runs at the first replay only.
    init = [instr for instr in program if instr.kind == "load"
            and recorder.made_here(instr.outputs[0].block)
            and instr.outputs[0].block.id not in intermediate]
    program = [instr for instr in program if not any(instr is i for i in init)]
    recomputed = 0
    if checkpoint == "sqrt":
        program, recomputed = _recompute_sqrt(program, intermediate)
        for instr in program:
            for operand in instr.outputs:
                if operand.block.id not in blocks:
                    blocks[operand.block.id] = operand.block
                    intermediate.add(operand.block.id)
    # Phase 2: dependencies and a memory-aware schedule.
    order = _schedule(program, intermediate)
    scheduled = [program[i] for i in order]
    # Phase 3: fusion into steps, then in-place reuse, both on the schedule.
    if fuse:
        steps = _attach_products(_fuse(scheduled, intermediate), intermediate, device)
    else:
        steps = [_Step([i]) for i in scheduled]
    internal = set().union(*(step.internal for step in steps))
    fresh = {step.instructions[-1].outputs[0].block.id for step in steps
             if step.product == "into"}
    buffer_of, in_place = _buffers(steps, intermediate - internal, fuse and plan != "none",
                                   fresh)
    # Phase 4: lifetimes per buffer, in step positions, and the static plan.
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for position, step in enumerate(steps):
        for instr in step.instructions:
            for operand in (*instr.inputs, *instr.outputs):
                buffer = buffer_of.get(operand.block.id)
                if buffer is not None:
                    first.setdefault(buffer, position)
                    last[buffer] = position
    sizes: dict[int, int] = {}
    for bid, buffer in buffer_of.items():
        sizes[buffer] = max(sizes.get(buffer, 0), blocks[bid].nbytes)
    lifetimes = [planner.Lifetime(b, first[b], last[b], sizes[b]) for b in first]
    alignment = max(allocator.device.alignment, 64)
    static_plan = planner.plan(lifetimes, alignment=alignment)
    forward = {buffer_of.get(operand.block.id) for instr in scheduled
               if instr.phase in ("forward", "recompute") for operand in instr.outputs}
    activation = [life for life in lifetimes if life.key in forward]
    stats = {"instructions": len(scheduled), "steps": len(steps),
             "fused": sum(len(s.instructions) for s in steps if len(s.instructions) > 1),
             "products": sum(1 for s in steps if s.product is not None),
             "in_place": in_place, "recomputed": recomputed,
             "activation_bytes": planner.lower_bound(activation) if activation else 0}
    naive = sum(blocks[bid].nbytes for bid in intermediate)
    outside = [block for bid, block in blocks.items() if bid not in intermediate]
    for block in outside:
        if recorder.made_here(block) and block._allocation is None:
            block._written = False  # NOTE: written on the tape only; a replay writes it for real
    commit, state = _commit_point(steps, {block.id for block in outside}, recorder)
    # NOTE: what "none" and "recycle" replays allocate and free at each step, worked out once
    starts: dict[int, list[planner.Lifetime]] = {}
    ends: dict[int, list[int]] = {}
    tail = []
    for life in lifetimes:
        if life.first >= commit:
            tail.append(life)
            continue
        starts.setdefault(life.first, []).append(life)
        if plan == "recycle":
            ends.setdefault(life.last, []).append(life.key)
    tail_plan = planner.plan(tail, alignment=alignment) if plan == "recycle" and tail else None
    return _Capture(steps, placeholders, [t.detach() for t in outputs], kind, held, state,
                    buffer_of, lifetimes, naive, static_plan, device, allocator, stats,
                    outside, {block.id for block in outside}, [_Step([i]) for i in init],
                    commit, tail_plan, starts, ends, tail)


def _commit_point(steps: Sequence[_Step], outside: set[int],
                  recorder: Tape) -> tuple[int, set[int]]:
    """The position of the first step that writes state, and the blocks of state written.

    State is a block that existed before the capture (parameters, earlier optimizer state) or
    one made here that a step reads before or where it first writes it (state carried from step
    to step). Outputs that are only written are not state. A replay makes every allocator call
    before the commit position, so a failed allocation leaves the state as it was."""
    read: set[int] = set()
    written: set[int] = set()
    state: set[int] = set()
    commit = len(steps)
    for position, step in enumerate(steps):
        for instr in step.instructions:
            read.update(o.block.id for o in instr.inputs)
            for operand in instr.outputs:
                block = operand.block
                if block.id in outside and block.id not in written and (
                        block.id in read or not recorder.made_here(block)):
                    state.add(block.id)
                    commit = min(commit, position)
                written.add(block.id)
    return commit, state


def _argument_writes(capture: _Capture) -> str | None:
    """Why the capture cannot be used when `fn` writes into one of its array arguments (the
    graph copies arguments into buffers of its own, so the caller would never see the write),
    or None."""
    holders = {holder.block.id: position for position, holder in
               enumerate(capture.placeholders) if holder is not None}
    for step in capture.steps:
        for instr in step.instructions:
            for operand in instr.outputs:
                position = holders.get(operand.block.id)
                if position is not None:
                    return (f"it writes into its argument {position} in place ({instr.op}), "
                            f"but a graph copies array arguments into buffers of its own, so "
                            f"the write would never reach the caller's tensor; compute a new "
                            f"tensor instead (e.g. ops.relu(x) rather than ops.relu(x, out=x))")
    return None


def _abandon(recorder: Tape) -> None:
    """Undo what a capture that failed did to blocks: state it made from host data (optimizer
    moments) gets that data now, so the objects that hold it stay usable, and every other block
    made in it, marked written on the tape only, holds nothing again."""
    for instr in recorder.instructions:
        operand = instr.outputs[0] if instr.outputs else None
        block = operand.block if operand is not None else None
        if (instr.kind == "load" and recorder.made_here(block) and block.refcount > 0
                and block._allocation is None):
            allocation = block.memory_for_write("graph capture")
            block.device.copyin(allocation.raw, allocation.offset + operand.offset, instr.host)
    for instr in recorder.instructions:
        for operand in instr.outputs:
            block = operand.block
            if recorder.made_here(block) and block._allocation is None:
                block._written = False


#: Ops whose kernels check their data and may raise (cross_entropy's labels).
_RAISES_ON_DATA = frozenset({"cross_entropy"})


def _dependencies(program: Sequence[Instruction],
                  intermediate: set[int] = frozenset()) -> list[set[int]]:
    """Predecessors of each instruction: read-after-write, write-after-read, write-after-write
    on blocks (whole blocks: conservative for disjoint views of one block); and a write to a
    block that outlives the step (state, outputs) waits for every earlier instruction that may
    raise on its data, so a replay that raises there has written nothing that lasts, as the
    function called directly would not have (an SGD momentum update needs no gradient and
    would otherwise run first)."""
    last_write: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    preds: list[set[int]] = []
    raisers: list[int] = []
    for j, instr in enumerate(program):
        before: set[int] = set()
        if raisers and any(o.block.id not in intermediate for o in instr.outputs):
            before.update(raisers)
        if instr.op in _RAISES_ON_DATA:
            raisers.append(j)
        for operand in instr.inputs:
            writer = last_write.get(operand.block.id)
            if writer is not None:
                before.add(writer)
        for operand in instr.outputs:
            bid = operand.block.id
            writer = last_write.get(bid)
            if writer is not None:
                before.add(writer)
            before.update(readers.get(bid, ()))
        before.discard(j)
        preds.append(before)
        for operand in instr.inputs:
            readers.setdefault(operand.block.id, []).append(j)
        for operand in instr.outputs:
            last_write[operand.block.id] = j
            readers[operand.block.id] = []
    return preds


def _schedule(program: Sequence[Instruction], intermediate: set[int]) -> list[int]:
    """A topological order of `program` that prefers, among ready instructions, one that adds
    no live bytes (it frees at least what it allocates), else the earliest in program order."""
    preds = _dependencies(program, intermediate)
    waiting = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in program]
    for j, before in enumerate(preds):
        for i in before:
            succs[i].append(j)
    uses: dict[int, int] = {}
    sizes: dict[int, int] = {}
    for instr in program:
        for operand in {o.block.id: o for o in (*instr.inputs, *instr.outputs)}.values():
            bid = operand.block.id
            if bid in intermediate:
                uses[bid] = uses.get(bid, 0) + 1
                sizes[bid] = operand.block.nbytes
    born: set[int] = set()
    ready = [j for j, n in enumerate(waiting) if n == 0]
    order: list[int] = []

    def growth(j: int) -> int:
        touched = {o.block.id for o in (*program[j].inputs, *program[j].outputs)}
        delta = 0
        for bid in touched & intermediate:
            if bid not in born:
                delta += sizes[bid]
            if uses[bid] == 1:
                delta -= sizes[bid]
        return delta

    while ready:
        pick = min(ready, key=lambda j: (growth(j) > 0, j))
        ready.remove(pick)
        order.append(pick)
        for bid in {o.block.id for o in (*program[pick].inputs, *program[pick].outputs)}:
            if bid in intermediate:
                born.add(bid)
                uses[bid] -= 1
        for j in succs[pick]:
            waiting[j] -= 1
            if waiting[j] == 0:
                ready.append(j)
    if len(order) != len(program):
        raise AssertionError("the dependency graph has a cycle")  # program order is a witness
    return order


def _positions(instrs: Sequence[Instruction], side: str) -> dict[int, list[int]]:
    """Block id -> positions of the instructions that read it ("inputs") or write it
    ("outputs")."""
    found: dict[int, list[int]] = {}
    for position, instr in enumerate(instrs):
        for operand in getattr(instr, side):
            found.setdefault(operand.block.id, []).append(position)
    return found


def _fusable(instr: Instruction) -> bool:
    return instr.kind == "kernel" and instr.policy == "elementwise" and len(instr.outputs) == 1


def _fuse(scheduled: list[Instruction], intermediate: set[int]) -> list[_Step]:
    """Group chains of elementwise instructions, consecutive in the schedule, where each link's
    output is an intermediate written whole, read only by the next link (whole), and dead after
    it. The chain runs in row blocks; its inner results never exist at full size."""
    readers = _positions(scheduled, "inputs")
    writers = _positions(scheduled, "outputs")
    steps: list[_Step] = []
    for position, instr in enumerate(scheduled):
        if steps and position and _fusable(instr) and _fusable(scheduled[position - 1]):
            previous = scheduled[position - 1]
            link = previous.outputs[0]
            bid = link.block.id
            if (bid in intermediate and link.whole and readers.get(bid) == [position]
                    and writers.get(bid) == [position - 1]
                    and previous.outputs[0].shape == instr.outputs[0].shape
                    and all(o.whole for o in instr.inputs if o.block.id == bid)
                    and steps[-1].instructions[-1] is previous):
                steps[-1].instructions.append(instr)
                steps[-1].internal.add(bid)
                continue
        steps.append(_Step([instr]))
    return steps


_PRODUCTS = ("matmul", "linear")


def _arguments(instr: Instruction) -> Iterator[Operand | float]:
    """An instruction's arguments in call order: its operands, with the numbers of
    `scalars` at their positions among them (as `ops._launch` passes them to the kernel)."""
    scalars = instr.scalars or {}
    operands = iter(instr.inputs)
    for position in range(len(instr.inputs) + len(scalars)):
        yield scalars[position] if position in scalars else next(operands)


def _is_product(instr: Instruction) -> bool:
    """A 2-D matrix product: matmul(a, b), or linear(x, weight.T[, bias broadcast])."""
    return (instr.kind == "kernel" and instr.op in _PRODUCTS and len(instr.outputs) == 1
            and instr.outputs[0].whole
            and all(len(o.shape) == 2 for o in (*instr.inputs[:2], instr.outputs[0])))


def _attach_products(steps: list[_Step], intermediate: set[int], device: Any) -> list[_Step]:
    """Move each matrix product whose result (an intermediate) only an elementwise chain reads,
    whole, into that chain's step, so the product never gets a buffer of its own:
    - (alpha, beta): the chain computes out = alpha * product + beta * out, in place on out
      (plain SGD's w - lr * g, momentum's buf + g), and the device's gemm accumulates: one
      BLAS call, no pass over a gradient at all; it rounds once where the chain rounded twice
      or three times;
    - "into": otherwise, when the chain's output has the product's shape and dtype and shares
      no block with what the step reads: the product is written straight into the output and
      the chain (with linear's bias add at its head) runs over it in place. Bit-identical.
    The product moves later, to the chain's position, only past steps that write nothing it
    reads."""
    readers: dict[int, set[int]] = {}
    writers: dict[int, set[int]] = {}
    for position, step in enumerate(steps):
        for instr in step.instructions:
            for operand in instr.inputs:
                readers.setdefault(operand.block.id, set()).add(position)
            for operand in instr.outputs:
                writers.setdefault(operand.block.id, set()).add(position)
    moved: set[int] = set()
    for position, step in enumerate(steps):
        if step.product is not None or not all(_fusable(i) for i in step.instructions):
            continue
        out = step.instructions[-1].outputs[0]
        for operand in (o for i in step.instructions for o in i.inputs):
            bid = operand.block.id
            source = writers.get(bid, set())
            if bid not in intermediate or len(source) != 1 or readers[bid] != {position}:
                continue
            (at,) = source
            head = steps[at].instructions[0]
            if at >= position or at in moved or len(steps[at].instructions) != 1 \
                    or not _is_product(head):
                continue
            reads = {o.block.id for o in head.inputs}
            if out.block.id in reads or any(o.block.id in reads for later in
                                            steps[at + 1:position]
                                            for i in later.instructions for o in i.outputs):
                continue
            kind = _folding(step, head, out, device)
            if kind is None:
                continue
            steps[position] = _Step([head, *step.instructions], step.internal | {bid}, kind)
            moved.add(at)
            break
    return [step for position, step in enumerate(steps) if position not in moved]


def _folding(step: _Step, head: Instruction, out: Operand,
             device: Any) -> str | tuple[float, float] | None:
    """How `head`'s product joins `step`'s chain (see `_attach_products`), or None; `out`
    (the chain's output) is already known not to be read by the product."""
    product = head.outputs[0]
    if any(o.block.id == product.block.id and (o.shape != out.shape or not o.whole)
           for i in step.instructions for o in i.inputs):
        return None
    if product.dtype != out.dtype or product.shape != out.shape:
        return None
    if head.op == "matmul" or len(head.inputs) == 2:
        form = _linear_form(step.instructions, product.block.id, out)
        if form is not None and device.gemm_accumulates \
                and out.dtype in (np.float32, np.float64):
            return form
    if any(o.block.id == out.block.id for i in step.instructions for o in i.inputs):
        return None
    return "into"


def _linear_form(chain: Sequence[Instruction], product: int,
                 out: Operand) -> tuple[float, float] | None:
    """(alpha, beta) when `chain` computes out = alpha * product + beta * out exactly in form
    (adds, subtractions, negations and multiplications by numbers of those two), else None."""
    value: dict[int, tuple[float, float]] = {}  # block id -> (coefficient of product, of out)
    form: tuple[float, float] | None = None
    for instr in chain:
        args: list[Any] = []
        for operand in _arguments(instr):
            if not isinstance(operand, Operand):
                args.append(float(operand))
            elif operand.block.id == product:
                args.append((1.0, 0.0))
            elif operand == out:
                args.append((0.0, 1.0))
            elif operand.block.id in value:
                args.append(value[operand.block.id])
            else:
                return None
        terms = [a for a in args if isinstance(a, tuple)]
        numbers = [a for a in args if not isinstance(a, tuple)]
        if instr.op in ("add", "sub") and len(terms) == 2:
            sign = 1.0 if instr.op == "add" else -1.0
            form = (terms[0][0] + sign * terms[1][0], terms[0][1] + sign * terms[1][1])
        elif instr.op == "mul" and len(terms) == 1 and len(numbers) == 1:
            form = (terms[0][0] * numbers[0], terms[0][1] * numbers[0])
        elif instr.op == "neg" and len(terms) == 1:
            form = (-terms[0][0], -terms[0][1])
        else:
            return None
        value[instr.outputs[0].block.id] = form
    return form if form is not None and form[0] != 0.0 else None


def _buffers(steps: list[_Step], planned: set[int], in_place: bool,
             fresh: set[int] = frozenset()) -> tuple[dict[int, int], int]:
    """Map each planned block to a buffer: its own, or (in place) the buffer of an elementwise
    input that dies at the step writing it, when both cover their blocks whole with one size.
    Blocks in `fresh` always get their own (a product is written into them before the chain
    that reads the dying inputs runs)."""
    flat = [(position, instr) for position, step in enumerate(steps)
            for instr in step.instructions]
    last_use: dict[int, int] = {}
    first_write: dict[int, int] = {}
    for position, instr in flat:
        for operand in instr.inputs:
            last_use[operand.block.id] = position
        for operand in instr.outputs:
            first_write.setdefault(operand.block.id, position)
            last_use[operand.block.id] = position
    buffer_of: dict[int, int] = {}
    reused = 0
    taken: set[int] = set()
    for position, instr in flat:
        for out in instr.outputs:
            bid = out.block.id
            if bid not in planned or bid in buffer_of:
                continue
            donor = None
            if in_place and instr.policy == "elementwise" and out.whole \
                    and first_write[bid] == position and bid not in fresh:
                for operand in instr.inputs:
                    source = operand.block.id
                    if (source in buffer_of and source not in taken and operand.whole
                            and last_use[source] == position
                            and operand.block.nbytes == out.block.nbytes
                            and operand.shape == out.shape and operand.dtype == out.dtype):
                        donor = source
                        break
            if donor is None:
                buffer_of[bid] = bid  # NOTE: a buffer is named by the first block it holds
            else:
                buffer_of[bid] = buffer_of[donor]
                taken.add(donor)
                reused += 1
    return buffer_of, reused


def _recompute_sqrt(program: list[Instruction], intermediate: set[int]
                    ) -> tuple[list[Instruction], int]:
    """Chen et al.'s sqrt(n) checkpointing on the instruction list.

    The forward instructions are cut into segments of about sqrt(n). The last result of each
    segment, and anything a later segment reads, is kept; the other forward results that the
    backward phase reads are recomputed: the segment's instructions are cloned, writing fresh
    blocks, just before the first backward instruction that needs them, and the backward reads
    are pointed at the clones.
    """
    forward = [i for i, instr in enumerate(program) if instr.phase == "forward"]
    n = len(forward)
    if n < 4:
        return program, 0
    size = max(2, math.ceil(math.sqrt(n)))
    segments = [forward[k:k + size] for k in range(0, n, size)]
    segment_of: dict[int, int] = {}
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].outputs:
                segment_of.setdefault(operand.block.id, s)
    later_reads: set[int] = set()  # forward results read by a later forward segment
    for s, members in enumerate(segments):
        for i in members:
            for operand in program[i].inputs:
                home = segment_of.get(operand.block.id)
                if home is not None and home < s:
                    later_reads.add(operand.block.id)
    backward_reads: dict[int, int] = {}  # block -> first backward instruction reading it
    for i, instr in enumerate(program):
        if instr.phase != "forward":
            for operand in instr.inputs:
                backward_reads.setdefault(operand.block.id, i)
    insert_before: dict[int, list[Instruction]] = {}
    renamed: dict[int, Block] = {}
    count = 0
    for s, members in enumerate(segments):
        boundary = {o.block.id for o in program[members[-1]].outputs}
        wanted = {bid for bid, home in segment_of.items()
                  if home == s and bid in intermediate and bid in backward_reads
                  and bid not in boundary and bid not in later_reads}
        if not wanted or s == len(segments) - 1:
            continue  # NOTE: the last segment's results are used at once: nothing to drop
        clones: list[Instruction] = []
        local: dict[int, Block] = {}
        last_wanted = max(i for i in members if any(o.block.id in wanted
                                                      for o in program[i].outputs))
        for i in members:
            if i > last_wanted:
                break
            instr = program[i]
            outputs = []
            for operand in instr.outputs:
                shadow = local.get(operand.block.id)
                if shadow is None:
                    shadow = local[operand.block.id] = Block(operand.block.nbytes,
                                                             operand.block.allocator)
                outputs.append(_moved(operand, shadow))
            inputs = [_moved(o, local[o.block.id]) if o.block.id in local else o
                      for o in instr.inputs]
            clones.append(Instruction(instr.op, instr.policy, inputs, outputs, run=instr.run,
                                      scalars=instr.scalars, host=instr.host,
                                      phase="recompute"))
        count += len(clones)
        at = min(backward_reads[bid] for bid in wanted)
        insert_before.setdefault(at, []).extend(clones)
        for bid in wanted:
            renamed[bid] = local[bid]
    rewritten: list[Instruction] = []
    for i, instr in enumerate(program):
        rewritten.extend(insert_before.get(i, ()))
        if instr.phase != "forward":
            instr = Instruction(instr.op, instr.policy,
                                [_moved(o, renamed[o.block.id]) if o.block.id in renamed else o
                                 for o in instr.inputs], instr.outputs, run=instr.run,
                                scalars=instr.scalars, host=instr.host, phase=instr.phase)
        rewritten.append(instr)
    for index, instr in enumerate(rewritten):
        instr.index = index
    return rewritten, count


def _moved(operand: Operand, block: Block) -> Operand:
    return Operand(block, operand.offset, operand.shape, operand.strides, operand.dtype)


# ---------------------------------------------------------------------- replay
Memory = dict[int, tuple[Any, int]]  # buffer -> (raw memory, byte offset)


def _replay(capture: _Capture, plan: str) -> None:
    """Run the schedule once. Every allocator call comes before the first write to state
    (`capture.commit`), so an OutOfMemoryError leaves parameters and optimizer state as they
    were: blocks the graph keeps get memory first, "static" then takes its arena, and "none" and
    "recycle" take, just before the commit step, all the memory the rest of the step uses
    ("recycle" as one arena planned over those buffers' lifetimes)."""
    for block in capture.outside:
        if block._allocation is None and not block.readonly:
            block.memory_for_write("graph replay")
    if plan == "static":
        _replay_static(capture)
        return
    _run_init(capture)
    allocator, starts, ends = capture.allocator, capture.starts, capture.ends
    memory: Memory = {}
    allocations: dict[int, Allocation] = {}
    live = peak = 0
    try:
        for position, step in enumerate(capture.steps):
            if position == capture.commit:
                live += _take_tail(capture, allocations, memory)
            for life in starts.get(position, ()):
                allocation = allocations[life.key] = allocator.allocate(life.nbytes)
                memory[life.key] = (allocation.raw, allocation.offset)
                live += allocation.size
            peak = max(peak, live)
            _bind(step, capture, memory)()
            for key in ends.get(position, ()):
                allocation = allocations.pop(key)
                del memory[key]
                live -= allocation.size
                allocator.free(allocation)
    finally:
        for allocation in allocations.values():
            allocator.free(allocation)
    capture.peak_bytes = peak


_TAIL = -1  # NOTE: the key of recycle's tail arena among a replay's allocations


def _take_tail(capture: _Capture, allocations: dict[int, Allocation], memory: Memory) -> int:
    """Allocate the buffers first used at or after the commit step; return the bytes taken."""
    taken = 0
    if capture.tail_plan is not None:  # recycle: one arena, its buffers placed by the planner
        arena = allocations[_TAIL] = capture.allocator.allocate(capture.tail_plan.planned_bytes)
        for key, offset in capture.tail_plan.offsets.items():
            memory[key] = (arena.raw, arena.offset + offset)
        return arena.size
    for life in capture.tail:  # none: one allocation each, as at their first writes
        allocation = allocations[life.key] = capture.allocator.allocate(life.nbytes)
        memory[life.key] = (allocation.raw, allocation.offset)
        taken += allocation.size
    return taken


def _run_init(capture: _Capture) -> None:
    """Load the host data that initialises state made in the capture: at the first replay."""
    for step in capture.init:
        _bind(step, capture, {})()
    capture.init = []


def _replay_static(capture: _Capture) -> None:
    """Run the prebuilt steps; they are rebuilt only when an outside block's memory moved."""
    if capture.arena is None and capture.static_plan.offsets:
        # NOTE: also for a plan of 0 bytes (zero-size intermediates): their views need memory
        capture.arena = capture.allocator.allocate(capture.static_plan.planned_bytes)
        capture.views = None
    _run_init(capture)
    key = tuple(id(block._allocation) for block in capture.outside)
    if capture.views is None or key != capture.view_key:
        arena = capture.arena
        memory: Memory = {}
        if arena is not None:
            for buffer, offset in capture.static_plan.offsets.items():
                memory[buffer] = (arena.raw, arena.offset + offset)
        capture.views = [_bind(step, capture, memory) for step in capture.steps]
        capture.view_key = tuple(id(block._allocation) for block in capture.outside)
        capture.peak_bytes = arena.size if arena is not None else 0
    for thunk in capture.views:
        thunk()


def _memory_of(operand: Operand, capture: _Capture, memory: Memory) -> tuple[Any, int]:
    buffer = capture.buffer_of.get(operand.block.id)
    if buffer is not None:
        return memory[buffer]
    block = operand.block
    allocation = block._allocation  # NOTE: the capture checked every read; lazy ones get memory
    if allocation is None:
        allocation = block.memory_for_write("graph replay")
    return allocation.raw, allocation.offset


def _view(operand: Operand, capture: _Capture, memory: Memory) -> Any:
    raw, base = _memory_of(operand, capture, memory)
    return capture.device._array_view(raw, base + operand.offset, operand.shape, operand.dtype,
                                      operand.strides)


def _outside_writes(instructions: Sequence[Instruction], capture: _Capture) -> list[Block]:
    """Blocks outside the plan that these instructions write: their versions move on."""
    return [o.block for instr in instructions for o in instr.outputs
            if o.block.id not in capture.buffer_of and o.block.id in capture.outside_ids]


def _bind(step: _Step, capture: _Capture, memory: Memory) -> Callable[[], None]:
    """A function that runs `step` on views bound now."""
    marks = _outside_writes(step.instructions, capture)
    if step.product is not None:
        run = _bind_product(step, capture, memory)
    elif len(step.instructions) > 1:
        run = _bind_fused(step, capture, memory)
    else:
        run = _bind_one(step.instructions[0], capture, memory)
    if not marks:
        return run

    def run_and_mark() -> None:
        run()
        for block in marks:
            block.mark_written()

    return run_and_mark


def _bind_one(instr: Instruction, capture: _Capture, memory: Memory) -> Callable[[], None]:
    if instr.kind == "load":
        raw, base = _memory_of(instr.outputs[0], capture, memory)
        offset, host, copyin = base + instr.outputs[0].offset, instr.host, capture.device.copyin
        return lambda: copyin(raw, offset, host)
    views = [_view(a, capture, memory) if isinstance(a, Operand) else a
             for a in _arguments(instr)]
    targets = [_view(o, capture, memory) for o in instr.outputs]
    run = instr.run
    return lambda: run(views, *targets)


def _bind_product(step: _Step, capture: _Capture, memory: Memory) -> Callable[[], None]:
    """A product heading a chain (`_attach_products`): one accumulating gemm, or the product
    written into the chain's output and the chain run over it in place."""
    head, chain = step.instructions[0], step.instructions[1:]
    device = capture.device
    a, b = (_view(operand, capture, memory) for operand in head.inputs[:2])
    out = _view(chain[-1].outputs[0], capture, memory)
    if step.product != "into":
        alpha, beta = step.product
        return lambda: device.gemm(a, b, out, alpha, beta)
    rest = _bind_fused(_Step(chain, step.internal), capture, memory, head)

    def run() -> None:
        device.matmul(a, b, out)  # NOTE: as the op itself computes it: bit-identical
        rest()

    return run


def _bind_fused(step: _Step, capture: _Capture, memory: Memory,
                head: Instruction | None = None) -> Callable[[], None]:
    """A chain of elementwise instructions as one `Device.fused` program: the chain's external
    operands are its inputs, its inner results are links that never exist at full size. With
    a product `head` already written into the chain's output, the program reads that output
    (plus linear's bias, added first) where the chain read the product."""
    out = _view(step.instructions[-1].outputs[0], capture, memory)
    inputs: list[Any] = []
    program: list[tuple[str, tuple, Any]] = []
    source: dict[int, tuple[str, int]] = {}  # internal block id -> its argument
    if head is not None:
        product = head.outputs[0]
        inputs.append(out)
        source[product.block.id] = ("input", 0)
        if len(head.inputs) > 2:  # linear's bias
            inputs.append(_view(head.inputs[2], capture, memory))
            program.append(("add", (("input", 0), ("input", 1)), product.dtype))
            source[product.block.id] = ("link", 0)
    for instr in step.instructions:
        args = []
        for operand in _arguments(instr):
            if not isinstance(operand, Operand):
                args.append(("number", operand))
            elif operand.block.id in step.internal:
                args.append(source[operand.block.id])
            else:
                args.append(("input", len(inputs)))
                inputs.append(_view(operand, capture, memory))
        output = instr.outputs[0]
        program.append((instr.op, tuple(args), output.dtype))
        source[output.block.id] = ("link", len(program) - 1)
    return capture.device.prepare_fused(tuple(program), inputs, out, capture.scratch)


def _release(capture: _Capture) -> None:
    if capture.arena is not None:
        capture.allocator.free(capture.arena)
        capture.arena = None
    capture.views = None
    capture.scratch.clear()
    for t in capture.held:
        t.release()
    capture.held.clear()
