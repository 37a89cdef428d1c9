"""Reverse-mode automatic differentiation on runtime tensors (micrograd's shape, PyTorch's rules).

An op whose inputs require gradients records a `Node` on its output: the inputs, a small
backward function, and the tensors that function needs (saved with the version of their block
at save time). `Tensor.backward()` sorts the graph topologically and runs the backward functions
in reverse, accumulating gradients:

- a gradient reaching an input broadcast by the op is summed back to the input's shape;
- leaves (tensors made by the user with `requires_grad=True`) accumulate into `.grad`, in place
  once it exists, as PyTorch does; intermediate gradients live only during the pass;
- a saved tensor whose block was written after it was saved (its version moved on) makes
  `backward()` raise `AutogradError` naming the op, the operand and both versions;
- unless `retain_graph=True`, each node drops what it saved as soon as it has run, so the memory
  of activations returns to the allocator during the backward pass.

No reference cycles: a node holds its inputs and detached handles of what it saved, never its
own output, so every tensor's memory goes back as soon as the last Python reference does.

Note [closures hold no tensors]: the functions an op hands on hold no tensor of their own. A
backward function (`record`) captures plain values only (shapes, flags, numbers, the device);
every tensor it needs comes to it as an argument, saved through `save`, and a view's backward
keeps its base's layout, not its base (`tensor._scatter_backward`). A saved tensor is a detached
handle with its block's version, checked by `Node.unpack` and released by `Node.free` once the
node has run. A captured one would escape all three: a later in-place write would go unnoticed,
its memory would stay allocated until the whole graph is dropped instead of going back during
the backward pass, and a captured output would make a cycle (output -> node -> function ->
output) that only the cyclic garbage collector frees. Naming the backward function's parameters
after the op's tensors (`def fn(g, x, w)` in `ops.linear`) keeps the outer ones out of reach.
The kernel call an op launches (`run` of `ops._launch`, kept as `Instruction.run` on a graph's
tape) likewise takes every array as a native view argument: a graph replays it on views of the
memory its plan chose, and a checkpointed graph runs it again on other buffers, where a captured
tensor would still be read at its own memory.

Example:
    >>> import numpy as np, runtime
    >>> w = runtime.tensor(np.array([1.0, -2.0]), requires_grad=True)
    >>> runtime.ops.sum(runtime.ops.mul(w, w)).backward()
    >>> w.grad.numpy()
    array([ 2., -4.])
"""

from __future__ import annotations

import itertools
import operator
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from backends import accelerated
from runtime import tape
from runtime.errors import AutogradError
from runtime.upcalls import OPS  # NOTE: Note [calls up to ops] in runtime/upcalls.py

#: A runtime Tensor, as the annotations here name it: runtime/_tensor.py sits above this module
#: (docs/architecture.md), so it is not imported, not even for a type checker.
Tensor = Any

__all__ = ["Node", "backward", "enable_grad", "is_grad_enabled", "no_grad", "record",
           "register_ready_hook"]

#: backward(grad, *saved) -> one gradient (or None) per input of the node.
BackwardFn = Callable[..., Sequence[Any]]

#: The C extension of the eager fast path, or None: `record`, `_engine` and `_release` below are
#: its functions where it is in use (Note [the eager fast path] in runtime/fastpath.py).
_dispatch = accelerated.load("runtime._dispatch")
#: What frees a saved tensor: `Tensor.release`, or the C one (which hands back to it).
_release = operator.methodcaller("release") if _dispatch is None else _dispatch.release


class _GradMode(threading.local):
    enabled = True
    #: the two-byte dtype `runtime.amp.autocast` runs products in on this thread, or None;
    #: here, not in amp, so that ops reads it without importing amp (which imports ops), and
    #: the backward pass turns it off (a backward op computes in the dtypes its forward op
    #: chose, as in torch.autocast)
    autocast: Any = None


_mode = _GradMode()


def is_grad_enabled() -> bool:
    """True when ops record the graph for backward (per thread, as in PyTorch)."""
    return _mode.enabled


@contextmanager
def _grad_mode(enabled: bool) -> Iterator[None]:
    previous = _mode.enabled
    _mode.enabled = enabled
    try:
        yield
    finally:
        _mode.enabled = previous


def no_grad() -> Any:
    """A context manager in which ops record nothing (for updates and evaluation).

    Example:
        >>> import runtime
        >>> with runtime.no_grad():
        ...     pass
    """
    return _grad_mode(False)


def enable_grad() -> Any:
    """A context manager that turns recording back on inside `no_grad`."""
    return _grad_mode(True)


class Node:
    """One recorded op: how to turn the gradient of its output into gradients of its inputs.

    Attributes:
        op: the op's name, for messages.
        inputs: per operand, the Node that made it, the leaf Tensor itself, or None (numbers and
            operands that need no gradient). Non-leaf tensors are not held, so an activation
            that no backward function saved goes back to its allocator when the user drops it.
        shapes: the operands' shapes (a gradient is summed back to them after broadcasting).
        labels: the operands' names in messages ("a", "b", "x", ...).
    """

    __slots__ = ("op", "inputs", "shapes", "labels", "backward_fn", "saved", "freed")

    def __init__(self, op: str, inputs: Sequence[Node | Tensor | None],
                 shapes: Sequence[tuple[int, ...] | None], labels: Sequence[str],
                 backward_fn: BackwardFn, saved: Sequence[tuple[str, Any, int]]) -> None:
        self.op = op
        self.inputs = tuple(inputs)
        self.shapes = tuple(shapes)
        self.labels = tuple(labels)
        self.backward_fn = backward_fn
        #: (label, detached handle or plain value, block version when saved; -1: no check)
        self.saved = list(saved)
        self.freed = False

    def unpack(self) -> list[Any]:
        """The saved values, after checking that no saved tensor was written since."""
        if self.freed:
            raise AutogradError(
                f"backward through the graph of {self.op} a second time: its saved tensors were "
                f"already freed; pass retain_graph=True to the first backward() to keep them")
        values = []
        for label, value, version in self.saved:
            if version >= 0 and value.block.version != version:
                raise AutogradError(
                    f"a tensor needed to compute gradients was modified in place: {label} of "
                    f"{self.op} ({describe(value)}) is at version {value.block.version}, but "
                    f"version {version} was saved for backward. Write to a copy instead, or "
                    f"do the write after backward()")
            values.append(value)
        return values

    def free(self) -> None:
        """Drop the saved tensors now (their memory may go back to the allocator)."""
        for _, value, version in self.saved:
            if version >= 0:
                _release(value)
        self.saved = []
        self.freed = True

    def __repr__(self) -> str:
        return f"<Node {self.op}>"


def describe(t: Tensor) -> str:
    """A tensor as messages name it: its name, shape, dtype and block."""
    name = f"{t.name!r}, " if t.name else ""
    return f"{name}shape {t.shape}, {t.dtype}, block #{t.block.id}"


def needs_grad(*operands: Any) -> bool:
    """True when recording is on and some operand is a tensor that requires a gradient."""
    if not _mode.enabled:
        return False
    for x in operands:
        if getattr(x, "_requires_grad", False):
            return True
    return False


def _is_tensor(x: Any) -> bool:
    """True for a Tensor, known by its slot `_requires_grad` (as `needs_grad` knows one): this
    module sits below runtime._tensor (docs/architecture.md)."""
    return hasattr(x, "_requires_grad")


def python_record(op: str, out: Tensor, inputs: Sequence[Any], labels: Sequence[str],
                  backward_fn: BackwardFn, save: Sequence[tuple[str, Any]] = ()) -> Tensor:
    """Attach a Node to `out` (call right after the op wrote it, when `needs_grad` said so).

    `inputs` are the op's operands (numbers allowed: they get no gradient); `save` lists
    (label, value) pairs passed to `backward_fn(grad, *values)`. A saved tensor is kept as a
    detached handle with its block's version, so a later in-place write is caught; pass `out`
    itself to save the op's output.
    """
    entries: list[Node | Tensor | None] = []
    shapes: list[tuple[int, ...] | None] = []
    for x in inputs:
        if _is_tensor(x) and x._requires_grad:
            node = x._node
            entries.append(x if node is None else node)
            shapes.append(x.shape)
        else:
            entries.append(None)
            shapes.append(None)
    saved = []
    for label, value in save:
        if _is_tensor(value):
            handle = value.detach()
            handle.name = value.name
            saved.append((label, handle, value.block.version))
        else:
            saved.append((label, value, -1))
    out._node = Node(op, entries, shapes, labels, backward_fn, saved)
    out._requires_grad = True
    return out


#: What ops call to record a Node: `python_record`, the specification, or where the eager fast
#: path is in use the C `runtime._dispatch.record`, which makes the same Node without running
#: Python and hands anything else (and every call while the fast path is off) to
#: `python_record`.
record = python_record if _dispatch is None else _dispatch.record


# ---------------------------------------------------------------------- the backward pass
def _topological(root: Node) -> list[Node]:
    """Every node `root` depends on, each after the nodes of its inputs (an iterative
    depth-first search, so deep graphs do not hit the recursion limit)."""
    order: list[Node] = []
    seen = {id(root)}
    stack: list[tuple[Node, int]] = [(root, 0)]
    while stack:
        node, index = stack.pop()
        inputs = node.inputs
        while index < len(inputs):
            child = inputs[index]
            index += 1
            if isinstance(child, Node) and id(child) not in seen:
                seen.add(id(child))
                stack.append((node, index))
                stack.append((child, 0))
                break
        else:
            order.append(node)
    return order


def _unbroadcast(grad: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum `grad` over the axes that broadcasting added or stretched, down to `shape`."""
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    summed = OPS.sum(grad, axis=axes, keepdims=True) if axes else grad
    return summed.reshape(shape)


def _accumulate(previous: Tensor, grad: Tensor) -> Tensor:
    """previous + grad, where `previous` is a partial sum the pass owns (nothing else holds
    its memory: `_owned`): written into `previous` itself where it can hold the sum (Note
    [accumulating in place]), else a new tensor."""
    if (previous.shape == grad.shape and previous.dtype == grad.dtype
            and not previous.has_internal_overlap()):
        return OPS.add(previous, grad, out=previous)
    return OPS.add(previous, grad)


# Note [accumulating in place]: a gradient that reaches a tensor from several consumers (a
# residual block's input, the three views q, k and v of one projection) is summed as it
# arrives. The partial sum is the pass's own (`_owned`), so the next part is added into it,
# not into a new tensor: no allocation, and the sum keeps the partial sum's layout. That layout
# matters: the gradient of a view is its base's layout (`tensor._scatter_backward`), and
# attention's q, k and v are a transposed view of one (batch, time, 3, heads, width) block,
# so a new C-order sum of two such gradients walked that memory across its strides (BERT's
# step: 21 ms for 12 such sums, BENCHMARKS.md), and its reshape back made a copy. Only where
# the sum has the partial sum's dtype (no promotion) and the partial sum can be written (no
# two indices share an element: `Tensor.has_internal_overlap`, the rule every out= obeys);
# else a new tensor, as before. The same values either way; the Python engine and the C one
# both call this.


def _owned(grad: Tensor, handed: dict[int, Tensor]) -> Tensor:
    """`grad` if nothing else holds its memory, else a copy (so in-place accumulation into it
    can never change another gradient or a tensor the user holds)."""
    if id(grad) in handed or grad.block._refs > 1:
        return OPS.copy(grad)
    return grad


def backward(root: Tensor, gradient: Tensor, retain_graph: bool) -> None:
    """The backward pass of `Tensor.backward`, which checked its arguments: accumulate
    d(root)/d(leaf), seeded with `gradient` (owned: nothing else holds its memory), into the
    `.grad` of every leaf that requires a gradient, with recording and autocast off.

    Raises:
        AutogradError: a saved tensor modified in place; a second backward through a freed
            graph.
    """
    previous, autocast = _mode.enabled, _mode.autocast
    _mode.enabled = False  # NOTE: no_grad(), without a generator's context manager
    _mode.autocast = None
    try:
        if tape._state.tape is None:
            _start(root, gradient, retain_graph)
        else:
            with tape.phase("backward"):
                _start(root, gradient, retain_graph)
    finally:
        _mode.enabled, _mode.autocast = previous, autocast


def _start(root: Tensor, gradient: Tensor, retain_graph: bool) -> None:
    if root._node is None:
        _store_leaf(root, gradient)
        return
    if _ready_hooks:  # NOTE: Note [gradient-ready hooks]: the Python engine reports leaves
        pairs = _run_hooked(root._node, gradient, retain_graph)
    else:
        pairs = None if _engine is None else _engine(root._node, gradient, retain_graph)
        if pairs is None:  # NOTE: no C engine, or it handed the pass back (the fast path is off)
            pairs = _run(root._node, gradient, retain_graph)
    for leaf, grad in pairs:
        _store_leaf(leaf, grad)


# ---------------------------------------------------------------------- gradient-ready hooks
class _HookRef(weakref.ref):
    """A weak reference to a ready hook, with the serial number of its registration."""

    __slots__ = ("serial",)


#: by leaf id, a weak reference to the hook object registered on it (the hook holds the leaf,
#: so the id stays the leaf's while the hook lives): Note [gradient-ready hooks]
_ready_hooks: dict[int, _HookRef] = {}
#: registration order: leaves whose gradients are whole at the same node are reported
#: latest-registered first (a model's parameters in reverse, as backward meets them)
_serials = itertools.count()


def register_ready_hook(leaf: Tensor, hook: Any) -> Callable[[], None]:
    """Tell `hook` about `leaf`'s gradient in every backward pass, as soon as the pass has
    computed all of it, and return a function that takes the registration back.

    Note [gradient-ready hooks]: `hook.ready(leaf, grad)` is called once per pass for each
    registered leaf that got a gradient, right after the last node that adds to it ran (the
    rest of the pass has not run yet; PyTorch's post-accumulate-grad hook, which its DDP
    Reducer uses to start a bucket's all-reduce). It returns True where it took the gradient
    (the pass then forgets it and stores nothing for that leaf), False where the pass keeps
    it. Once every gradient of the pass is computed and before any is stored in `.grad`,
    `hook.finish()` is called once for each hook that saw a leaf of the pass, and returns
    (leaf, gradient) pairs to store as well (new tensors, or gradients it was handed and
    wrote in place). Either may raise: nothing has been stored then, so every `.grad` is as
    it was (Note [the commit point] in runtime/nn.py). Where the pass fails (in a hook or in
    a backward function), `hook.abandon(error)` is called on every hook of the pass before
    the error goes on. The hook object is held weakly: a
    registration ends with it. While any hook is registered, passes run in the Python engine
    (`_run`, the specification of the C one), which knows when a leaf's gradient is whole.

    Raises:
        AutogradError: `leaf` is not a leaf that requires a gradient, or has a hook already.
    """
    if not _is_tensor(leaf) or not leaf._requires_grad or leaf._node is not None:
        raise AutogradError("register_ready_hook: takes a leaf tensor that requires grad")
    key = id(leaf)
    held = _ready_hooks.get(key)
    if held is not None and held() is not None:
        raise AutogradError(f"register_ready_hook: {describe(leaf)} has a ready hook already "
                            f"(one per leaf: wrap the model in one DistributedDataParallel)")
    ref = _HookRef(hook, lambda _, key=key: _forget(key))
    ref.serial = next(_serials)
    _ready_hooks[key] = ref

    def remove() -> None:
        if _ready_hooks.get(key) is ref:
            del _ready_hooks[key]

    return remove


def _forget(key: int) -> None:
    held = _ready_hooks.get(key)
    if held is not None and held() is None:
        del _ready_hooks[key]


def _run_hooked(root: Node, gradient: Tensor, retain_graph: bool
                ) -> list[tuple[Tensor, Tensor]]:
    """`_run` with the ready hooks of Note [gradient-ready hooks]: each hooked leaf's gradient
    is reported after the last node that adds to it, and the hooks' `finish` after the pass."""
    order = list(reversed(_topological(root)))
    hooks: dict[int, Any] = {}
    last: dict[int, int] = {}  # leaf id -> the position of the last node that adds to it
    serial: dict[int, int] = {}
    for position, node in enumerate(order):
        for entry in node.inputs:
            if entry is not None and not isinstance(entry, Node):
                ref = _ready_hooks.get(id(entry))
                hook = None if ref is None else ref()
                if hook is not None:
                    hooks[id(entry)] = hook
                    last[id(entry)] = position
                    serial[id(entry)] = ref.serial
    if not hooks:
        return _run(root, gradient, retain_graph)
    # NOTE: by position, then latest registered first
    last = dict(sorted(last.items(), key=lambda item: (item[1], -serial[item[0]])))
    reported: set[int] = set()

    def done(position: int, leaves: dict[int, tuple[Tensor, Tensor]],
             handed: dict[int, Tensor]) -> None:
        for key in [key for key, at in last.items() if at <= position]:
            del last[key]
            if key not in leaves:
                continue  # NOTE: no gradient reached this leaf in this pass
            reported.add(key)
            leaf, grad = leaves[key]
            if hooks[key].ready(leaf, grad):
                # NOTE: taken: the pass holds it no longer, so its memory may go back now
                del leaves[key], handed[id(grad)]
            leaf = grad = None

    try:
        pairs = _run(root, gradient, retain_graph, order=order, after_node=done)
        for hook in {id(hook): hook for key, hook in hooks.items() if key in reported}.values():
            pairs.extend(hook.finish())
    except BaseException as error:
        for hook in {id(hook): hook for hook in hooks.values()}.values():
            hook.abandon(error)
        raise
    return pairs


#: The C engine (`runtime._dispatch.backward`, the same steps as `_run`; None while the fast
#: path is off), or None: Note [the backward engine].
_engine: Callable[[Node, Tensor, bool], list[tuple[Tensor, Tensor]] | None] | None = (
    None if _dispatch is None else _dispatch.backward)


def _run(root: Node, gradient: Tensor, retain_graph: bool, order: list[Node] | None = None,
         after_node: Callable[[int, dict, dict], None] | None = None
         ) -> list[tuple[Tensor, Tensor]]:
    """The backward pass from `root` with `gradient`: every node's backward function, in
    reverse topological order. Returns each leaf with its gradient (owned: nothing else holds
    its memory), for `_store_leaf`.

    Note [the backward engine]: this function is the specification; the C engine
    `runtime._dispatch.backward` takes the same steps in the same order (the same calls of
    the backward functions, the same releases, copies and accumulations through `ops.copy`
    and `_accumulate`) and calls back into Python for what is rare (a freed node or a saved tensor
    written since: `Node.unpack` raises; a gradient to sum back to its input's shape:
    `_unbroadcast`). Neither keeps a gradient alive longer than the pass needs it: a partial
    sum takes the next part in place or goes as soon as the next sum replaces it, and what a
    node's backward function returned goes once it is delivered (so the two engines free, and
    peak, at the same points).
    `backward()` runs the C one where the fast path is on
    (Note [the eager fast path] in runtime/fastpath.py); tests/test_fastpath.py runs random
    graphs through both and compares every gradient, error, block version and allocator
    statistic.
    """
    grads: dict[Node, Tensor] = {root: gradient}
    handed: dict[int, Tensor] = {id(gradient): gradient}  # gradients stored, by id
    # NOTE: the leaves' gradients reach `.grad` only once all are computed, and that last part
    # allocates nothing, so an OutOfMemoryError midway leaves every `.grad` as it was:
    # Note [the commit point] in runtime/nn.py
    leaves: dict[int, tuple[Tensor, Tensor]] = {}
    if order is None:
        order = list(reversed(_topological(root)))
    for position, node in enumerate(order):
        g = grads.pop(node, None)
        if g is None:
            if after_node is not None:
                after_node(position, leaves, handed)
            continue  # nothing flowed here
        del handed[id(g)]
        results = node.backward_fn(g, *node.unpack())
        if not retain_graph:
            node.free()
        for r in results:
            if r is g:
                break
        else:
            _release(g)  # NOTE: its memory may serve the gradients computed next
        del g
        for entry, shape, grad in zip(node.inputs, node.shapes, results):
            if entry is None or grad is None:
                continue
            if grad.shape != shape:
                grad = _unbroadcast(grad, shape)
            if not isinstance(entry, Node):
                held = leaves.get(id(entry))
                if held is None:
                    grad = _owned(grad, handed)
                else:
                    del handed[id(held[1])]
                    grad = _accumulate(held[1], grad)
                    held = None  # NOTE: the sum replaces it: Note [the backward engine]
                leaves[id(entry)] = (entry, grad)
                handed[id(grad)] = grad
                continue
            previous = grads.get(entry)
            if previous is None:
                grad = _owned(grad, handed)
            else:
                del handed[id(previous)]
                grad = _accumulate(previous, grad)
                previous = None
            grads[entry] = grad
            handed[id(grad)] = grad
        # NOTE: nothing of this node outlives it: Note [the backward engine]
        results = grad = r = None
        if after_node is not None:  # NOTE: Note [gradient-ready hooks]
            after_node(position, leaves, handed)
    return list(leaves.values())


def _store_leaf(leaf: Tensor, grad: Tensor) -> None:
    """Set or accumulate (in place) an owned gradient into `leaf.grad`."""
    if leaf.grad is None:
        leaf.grad = grad
        recorder = tape._state.tape
        if recorder is not None:
            recorder.grads_given.append(leaf)
        return
    OPS.add(leaf.grad, grad, out=leaf.grad)
