"""Dense layers, activations, losses and optimizers on runtime tensors (micrograd's nn, PyTorch's
names and defaults).

Modules have `parameters()`, `named_parameters()`, `zero_grad()`, `__call__` and a readable
`repr`. Optimizers update parameters in place under `no_grad`; every buffer they need (momentum,
Adam's moments, one or two scratch tensors per parameter shape, shared by the parameters of that
shape) is made at the first step, so a warm step asks the allocator for nothing.

Note [the commit point]: a training step, eager through `train_step` or a `runtime.graph` replay
under any plan, makes every allocation it needs before its first write to state (parameters,
optimizer state, and eagerly the gradients in `.grad`). So an OutOfMemoryError, a limit's refusal
or an injected fault leaves that state bit for bit as it was, and calling the step again retries
it. Eagerly: `train_step` calls `Optimizer.prepare()` first, which makes every parameter's state
and scratch and gives them their memory at once (`_allocated`); `backward()` computes every
leaf's gradient before it stores any in `.grad`, and storing allocates nothing; `step()` then
allocates nothing, since its ops write into tensors made beforehand (`out=`). In a graph, the
capture finds the commit position, the first step that writes state, and a replay makes every
allocator call before it (runtime/graph: `memory._commit_point`, `replay._replay`). Hence an
optimizer makes what it needs in `_prepare` / `_prepare_shared` and writes only in `_begin`,
`_update` and `_end`, and a new plan or replay path allocates before the commit position.
tests/test_faults.py trains under `FaultInjectionAdaptor`, eagerly and under every plan, and
checks that every failed step changed nothing.

Example:
    >>> import numpy as np, runtime
    >>> from runtime import nn
    >>> nn.manual_seed(0)
    >>> model = nn.Sequential(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
    >>> opt = nn.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> x = runtime.tensor(np.ones((2, 4), np.float32))
    >>> loss = nn.softmax_cross_entropy(model(x), np.array([0, 2]))
    >>> loss.backward()
    >>> opt.step()
    >>> model
    Sequential(
      (0): Dense(in_features=4, out_features=8, bias=True)
      (1): ReLU()
      (2): Dense(in_features=8, out_features=3, bias=True)
    )
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from allocators import Allocator
from runtime import amp, dtypes, ops, tape
from runtime.autograd import no_grad
from runtime.tensor import (
    Tensor,
    _brief,
    as_dtype,
    as_flag,
    checked_nbytes,
    empty,
    host_array,
    tensor,
)

__all__ = ["SGD", "Adam", "Dense", "Module", "Optimizer", "ReLU", "Sequential", "Sigmoid", "Tanh",
           "clip_grad_norm_", "manual_seed", "mse", "softmax_cross_entropy", "train_step"]

_rng = np.random.default_rng()
_FLOAT64 = np.dtype("float64")


def manual_seed(seed: int) -> None:
    """Seed the generator that initialises new layers (each layer may also take `rng=`)."""
    global _rng
    _rng = np.random.default_rng(seed)


# ---------------------------------------------------------------------- modules
class Module:
    """Base of every layer: tensors that require grad become parameters, modules submodules,
    in the order they are assigned."""

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                               f"before assigning {name!r}")
        if isinstance(value, Module):
            self._refuse_cycle(name, value)
        self._parameters.pop(name, None)
        self._modules.pop(name, None)
        if isinstance(value, Tensor) and value.requires_grad:
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def _refuse_cycle(self, name: str, value: Module) -> None:
        """ValueError if `value` is this module or contains it: a module tree has no cycles
        (parameters(), repr and every walk of the tree would never end). A module may appear
        twice (shared weights); only containing itself is refused."""
        path: dict[int, str] = {id(value): name}  # module id -> where it sits in value
        stack = [value]
        while stack:
            module = stack.pop()
            if module is self:
                raise ValueError(f"{type(self).__name__}: assigning {type(value).__name__} as "
                                 f".{name} would make a module that contains itself (through "
                                 f"{path[id(module)]}); a module tree cannot have cycles")
            for child_name, child in module.__dict__.get("_modules", {}).items():
                if id(child) not in path:
                    path[id(child)] = f"{path[id(module)]}.{child_name}"
                    stack.append(child)

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement forward()")

    def __call__(self, *args: Any) -> Any:
        return self.forward(*args)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """(qualified name, parameter) pairs, each parameter once; names them for messages."""
        seen: set[int] = set()
        for name, p in self._named(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                p.name = name
                yield name, p

    def _named(self, prefix: str) -> Iterator[tuple[str, Tensor]]:
        for name, p in self._parameters.items():
            yield prefix + name, p
        for name, module in self._modules.items():
            yield from module._named(f"{prefix}{name}.")

    def parameters(self) -> list[Tensor]:
        """Every parameter of this module and its submodules, each once."""
        return [p for _, p in self.named_parameters()]

    def zero_grad(self) -> None:
        """Forget every parameter's gradient (sets `.grad` to None, as PyTorch does by default;
        the memory goes back to the allocator, which hands it out again next backward)."""
        for p in self.parameters():
            p.grad = None

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not self._modules:
            return head + ")"
        lines = [head]
        for name, module in self._modules.items():
            body = repr(module).replace("\n", "\n  ")
            lines.append(f"  ({name}): {body}")
        return "\n".join(lines) + "\n)"


def _generator(rng: Any) -> np.random.Generator:
    """`rng` (a Generator, or a seed NumPy takes) as a Generator; TypeError/ValueError naming
    the bad seed."""
    try:
        return np.random.default_rng(rng)
    except (TypeError, ValueError, OverflowError) as exc:
        error = TypeError if isinstance(exc, TypeError) else ValueError
        raise error(f"rng must be a numpy Generator or a seed (a non-negative int), got "
                        f"{_brief(rng)}: {exc}") from exc


def _uniform(rng: np.random.Generator, shape: tuple[int, ...], bound: float, dtype: Any,
             device: Any, allocator: Allocator | None) -> Tensor:
    data = rng.uniform(-bound, bound, size=shape).astype(dtype)
    return tensor(data, device=device, allocator=allocator, requires_grad=True)


class Dense(Module):
    """A fully connected layer: y = x @ weight.T + bias.

    `weight` is (out_features, in_features) and, like `bias`, starts uniform in
    [-1/sqrt(in_features), 1/sqrt(in_features)] (PyTorch's nn.Linear initialisation).

    Inside `amp.autocast(half)` a layer with float32 (or the other two-byte) parameters
    computes in `half` from working copies of its parameters, cast again only when a parameter
    changed (runtime/amp.py); its input is cast to `half` and its output is `half`. float64
    layers compute in float64, as torch.autocast leaves float64 alone.

    Args:
        in_features, out_features: positive sizes.
        bias: whether to add a learned bias.
        dtype, device, allocator: where the parameters live.
        rng: a numpy Generator or seed for the initial values (default: `manual_seed`'s).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 dtype: Any = "float32", device: Any = None, allocator: Allocator | None = None,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        for what, n in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n <= 0:
                raise ValueError(f"Dense: {what} must be a positive int, got {_brief(n)}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        bias = as_flag(bias, "Dense: bias")
        dtype = as_dtype(dtype, "Dense")
        if not dtypes.is_float(dtype):
            raise TypeError(f"Dense: parameters are a float dtype (float16, bfloat16, float32, "
                            f"float64), got dtype {dtype}")
        checked_nbytes((self.out_features, self.in_features), dtype, "Dense: weight")
        generator = _rng if rng is None else _generator(rng)
        bound = 1 / math.sqrt(in_features)
        self.weight = _uniform(generator, (self.out_features, self.in_features), bound, dtype,
                               device, allocator)
        self.bias = (_uniform(generator, (self.out_features,), bound, dtype, device, allocator)
                     if bias else None)
        #: working copies of the parameters for autocast, by (parameter id, dtype)
        self._copies: dict[Any, Any] = {}

    def forward(self, x: Tensor) -> Tensor:
        half = amp.autocast_dtype()
        if half is None or self.weight.dtype in (half, _FLOAT64):
            # NOTE: nothing to copy: ops.linear casts x itself (Note [autocast in ops])
            return ops.linear(x, self.weight, self.bias)
        return amp.linear(x, self.weight, self.bias, half, self._copies)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


class ReLU(Module):
    """max(x, 0) elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.relu(x)


class Tanh(Module):
    """The hyperbolic tangent elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.tanh(x)


class Sigmoid(Module):
    """1 / (1 + e**-x) elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return ops.sigmoid(x)


class Sequential(Module):
    """Modules applied in order; indexable, iterable, with a length."""

    def __init__(self, *modules: Module) -> None:
        super().__init__()
        for index, module in enumerate(modules):
            if not isinstance(module, Module):
                raise TypeError(f"Sequential takes Modules; argument {index} is a "
                                f"{type(module).__name__}")
            setattr(self, str(index), module)

    def forward(self, x: Any) -> Any:
        for module in self._modules.values():
            x = module(x)
        return x

    def __getitem__(self, index: int) -> Module:
        return list(self._modules.values())[index]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


# ---------------------------------------------------------------------- losses
def _autocast_float32(x: Tensor) -> Tensor:
    """x in float32 where `amp.autocast` is on and x is two-byte (losses run in float32 there,
    as torch.autocast runs them), else x."""
    if amp.autocast_dtype() is not None and x.dtype in dtypes.HALVES:
        return ops.cast(x, "float32")
    return x


def softmax_cross_entropy(logits: Tensor, labels: Any) -> Tensor:
    """The mean over the batch of the softmax cross-entropy of `logits` (batch, classes) against
    integer class indices `labels` (batch,), computed stably; PyTorch's F.cross_entropy.
    Inside `amp.autocast`, two-byte logits are cast to float32 first."""
    return ops.mean(ops.cross_entropy(logits, labels))  # NOTE: it casts under autocast


def mse(prediction: Tensor, target: Any) -> Tensor:
    """The mean squared error, mean((prediction - target)**2); PyTorch's F.mse_loss. Inside
    `amp.autocast`, a two-byte prediction is cast to float32 first."""
    prediction = _autocast_float32(prediction)
    if not isinstance(target, Tensor):
        target = tensor(host_array(target, prediction.dtype, "target"), device=prediction.device,
                        allocator=prediction.block.allocator)
    elif target.dtype != prediction.dtype and amp.autocast_dtype() is not None:
        target = ops.cast(target, prediction.dtype)
    if target.shape != prediction.shape:
        raise ValueError(f"mse: target has shape {target.shape}, prediction {prediction.shape}")
    diff = ops.sub(prediction, target)
    return ops.mean(ops.mul(diff, diff))


def train_step(model: Module, optimizer: Optimizer, loss: Any = softmax_cross_entropy, *,
               precision: Any = "float32", scaler: amp.GradScaler | None = None) -> Any:
    """A training step `step(x, target) -> loss tensor`: forward, loss, backward, update, then
    `optimizer.zero_grad()`. The optimizer's memory is prepared first and backward stores the
    gradients only once all are computed, so an OutOfMemoryError anywhere in the step leaves
    parameters, gradients and optimizer state as they were. Ending with zero_grad lets the
    gradients die inside the step, so a `runtime.graph` capture of it plans their memory (each
    is freed after its update).

    Mixed precision (runtime/amp.py): `precision="float16"` or `"bfloat16"` runs the forward
    pass and the loss under `amp.autocast(precision)` (Dense layers in the half dtype from
    their float32 masters, the loss in float32), and the update through `scaler`: by default a
    new `amp.GradScaler()` for float16 and none for bfloat16 (which needs no scaling). The
    scaler in use is `step.scaler` (None without one), e.g. for `step.scaler.skipped_steps`.

    Example:
        >>> import runtime
        >>> from runtime import nn
        >>> model = nn.Sequential(nn.Dense(4, 2))
        >>> step = runtime.graph(nn.train_step(model, nn.SGD(model.parameters(), lr=0.1)))
        >>> mixed = nn.train_step(model, nn.Adam(model.parameters()), precision="float16")
        >>> mixed.scaler
        GradScaler(init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
    """
    half = None
    if precision is not None and as_dtype(precision, "train_step: precision") != np.float32:
        half = amp._half(precision, "train_step: precision (or float32)")
    if scaler is None and half == np.float16:
        scaler = amp.GradScaler()
    if scaler is not None and not isinstance(scaler, amp.GradScaler):
        raise TypeError(f"train_step: scaler must be an amp.GradScaler, got {_brief(scaler)}")

    def step(x: Tensor, target: Any) -> Tensor:
        optimizer.prepare()  # NOTE: every allocation first: Note [the commit point]
        if scaler is not None:
            scaler.prepare(optimizer)
        if half is None:
            value = loss(model(x), target)
        else:
            with amp.autocast(half):
                value = loss(model(x), target)
        if scaler is None:
            value.backward()
            optimizer.step()
        else:
            scaler.scale(value).backward()
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()
        return value

    step.scaler = scaler  # type: ignore[attr-defined]
    return step


# ---------------------------------------------------------------------- gradient clipping
def clip_grad_norm_(parameters: Iterable[Tensor] | Tensor, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
    """Scale the gradients of `parameters` in place so that their total norm (the norm of all
    of them as one vector) is at most `max_norm`, and return that total norm, before clipping,
    as a 0-d tensor on their device (torch.nn.utils.clip_grad_norm_).

    Every gradient is multiplied by min(max_norm / (total + 1e-6), 1), always, on the device:
    there is no Python decision on a value, so it runs eagerly and in a `runtime.graph` capture
    alike (and needs no read back). With loss scaling, call `GradScaler.unscale_(optimizer)`
    first, so that the norm is the true one.

    The norm is computed in float32 (float64 when a gradient is float64; two-byte gradients
    are cast to float32 first, so the result is float32 where PyTorch's would be two-byte):
    norm_type 2 as the square root of the sum of squares (a dot product per gradient), 1 as
    the sum of magnitudes, any other p > 0 as exp(log(sum(exp(p * log|g|))) / p). A norm above
    float32's largest square root (about 1.8e19) comes out inf, as PyTorch's does.

    Non-finite norms (PyTorch's default, error_if_nonfinite=False): a gradient holding inf or
    NaN gives an inf or NaN norm, which is returned; the gradients are multiplied by 0 (inf)
    or NaN (NaN), so they come out zero or NaN where they were finite (and NaN where inf).
    Under a `GradScaler` such a step is skipped anyway (its check ran at `unscale_`).
    `error_if_nonfinite=True` reads the norm back and raises RuntimeError before any gradient
    is changed; it cannot run in a capture (GraphCaptureError).

    Args:
        parameters: an iterable of tensors (or one tensor); those whose `.grad` is None are
            left out. No gradient at all: returns 0.0 (float32) and changes nothing.
        max_norm: a number >= 0 (inf: compute the norm, change nothing).
        norm_type: a finite number > 0 (the largest magnitude, norm_type inf, needs a max
            reduction that the devices do not have: ValueError).

    Raises TypeError / ValueError naming a bad argument.

    Example:
        >>> import numpy as np, runtime
        >>> from runtime import nn
        >>> w = runtime.tensor(np.zeros(2, np.float32), requires_grad=True)
        >>> w.grad = runtime.tensor(np.array([3.0, 4.0], np.float32))
        >>> nn.clip_grad_norm_([w], max_norm=1.0).item()
        5.0
        >>> [round(v, 6) for v in w.grad.numpy().tolist()]
        [0.6, 0.8]
    """
    what = "clip_grad_norm_"
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    elif isinstance(parameters, (str, bytes)) or not isinstance(parameters, Iterable):
        raise TypeError(f"{what}: parameters must be a Tensor or an iterable of Tensors, got "
                        f"{_brief(parameters)}")
    params = list(parameters)
    for index, p in enumerate(params):
        if not isinstance(p, Tensor):
            raise TypeError(f"{what}: parameter {index} is a {type(p).__name__}, not a Tensor")
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
            raise TypeError(f"{what}: {name} must be a number, got {_brief(value)}")
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"{what}: max_norm must be a number >= 0, got {_brief(max_norm)}")
    if not norm_type > 0:
        raise ValueError(f"{what}: norm_type must be a number > 0, got {_brief(norm_type)}")
    if math.isinf(norm_type):
        raise ValueError(f"{what}: norm_type inf (the largest magnitude) needs a max reduction, "
                         f"which the devices do not have; use a finite norm_type (2.0, 1.0, ...)")
    error_if_nonfinite = as_flag(error_if_nonfinite, f"{what}: error_if_nonfinite")
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        if not params:
            return tensor(np.zeros((), np.float32))
        return tensor(np.zeros((), np.float32), device=params[0].device,
                      allocator=params[0].block.allocator)
    if error_if_nonfinite:
        tape.refuse_read(f"{what}(error_if_nonfinite=True)")
    p, max_norm = float(norm_type), float(max_norm)
    wide = np.dtype(np.float64 if any(g.dtype == np.float64 for g in grads) else np.float32)
    with no_grad(), tape.phase("update"):
        total = None
        for g in grads:
            part = _norm_part(g if g.dtype == wide else ops.cast(g, wide), p)
            total = part if total is None else ops.add(total, part, out=total)
        if p == 2.0:
            total = ops.sqrt(total, out=total)
        elif p != 1.0:
            total = ops.exp(ops.mul(ops.log(total, out=total), 1.0 / p, out=total), out=total)
        if error_if_nonfinite and not math.isfinite(float(total.item())):
            raise RuntimeError(f"{what}: the total norm of order {p} of the gradients of "
                               f"{len(grads)} parameters is {float(total.item())}, so it cannot "
                               f"be clipped; the gradients are unchanged (error_if_nonfinite="
                               f"False multiplies them by the resulting 0 or NaN instead)")
        coefficient = _at_most_one(ops.div(max_norm, ops.add(total, 1e-6)))
        coefficients = {wide: coefficient}
        for g in grads:
            if g.dtype not in coefficients:
                coefficients[g.dtype] = ops.cast(coefficient, g.dtype)
        for g in grads:
            ops.mul(g, coefficients[g.dtype], out=g)
    return total


def _norm_part(x: Tensor, p: float) -> Tensor:
    """sum(|x| ** p) of a float32 or float64 tensor, as a new 0-d tensor."""
    if p == 2.0:
        if x.is_contiguous():  # NOTE: a dot product: no temporary of x's size
            flat = x.reshape(-1)
            return ops.matmul(flat, flat)
        return ops.sum(ops.mul(x, x))
    # NOTE: |x| = relu(x) + relu(-x) exactly (one term is 0), and NaN stays NaN
    magnitude = ops.neg(x)
    magnitude = ops.relu(magnitude, out=magnitude)
    magnitude = ops.add(ops.relu(x), magnitude, out=magnitude)
    if p != 1.0:
        magnitude = ops.log(magnitude, out=magnitude)
        magnitude = ops.exp(ops.mul(magnitude, p, out=magnitude), out=magnitude)
    return ops.sum(magnitude)


def _at_most_one(c: Tensor) -> Tensor:
    """min(c, 1) of a 0-d c >= 0 (or NaN), exactly, from the ops there are: relu(c - 1) is
    > 0 exactly where c > 1, so 1 / relu(c - 1) is finite exactly there (inf at 0, NaN for
    NaN), and (1 / relu(c - 1)) * 0 + 1 is 1 there and NaN elsewhere, which where_finite
    takes where it is finite and c where not. (1 - relu(1 - c) would round c.)"""
    pick = ops.relu(ops.sub(c, 1.0))
    pick = ops.div(1.0, pick, out=pick)
    pick = ops.add(ops.mul(pick, 0.0, out=pick), 1.0, out=pick)
    return ops.where_finite(pick, c, out=pick)


# ---------------------------------------------------------------------- optimizers
def _check_number(what: str, value: Any, low: float, high: float = math.inf,
                  low_open: bool = False) -> float:
    """`value` as a float in [low, high) (or (low, high)), or TypeError/ValueError naming
    `what` (e.g. "SGD: lr") and the value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {_brief(value)}")
    try:
        number = float(value)
    except OverflowError:  # NOTE: a Python int beyond float64 lies in no bounds we take
        number = math.inf
    if not (low < number if low_open else low <= number) or not number < high:
        bounds = f"{'(' if low_open else '['}{low}, {high})"
        raise ValueError(f"{what} must lie in {bounds}, got {_brief(value)}")
    return number


def _allocated(t: Tensor) -> Tensor:
    """`t` with its memory allocated now rather than at its first write (outside a capture,
    where memory is the plan's business), so that a step's allocations all come first
    (Note [the commit point])."""
    if tape.active() is None:
        t.block.memory_for_write("optimizer state")
    return t


class Optimizer:
    """Base of the optimizers: holds the parameters and per-parameter state; `step()` runs
    `_update(param, grad, state)` under no_grad for each parameter that has a gradient."""

    #: True where every write of `_update`, `_begin` and `_end` to a parameter or to state goes
    #: through `_target` and `_commit`, so that amp.GradScaler can skip a step on the device
    gated_updates = False

    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.params: list[Tensor] = []
        name = type(self).__name__
        if isinstance(params, (Tensor, str, bytes)) or not isinstance(params, Iterable):
            raise TypeError(f"{name} takes an iterable of Tensors (model.parameters()), got "
                            f"{type(params).__name__} {_brief(params)}")
        for p in params:
            if not isinstance(p, Tensor):
                raise TypeError(f"{name} takes Tensors, got {type(p).__name__} {_brief(p)}")
            if not p.requires_grad or not p.is_leaf:
                raise ValueError(f"{type(self).__name__}: parameter {p.name or p.shape} must be "
                                 f"a leaf tensor with requires_grad=True")
            if all(p is not q for q in self.params):
                self.params.append(p)
        if not self.params:
            raise ValueError(f"{type(self).__name__} got an empty parameter list")
        self.lr = _check_number(f"{name}: lr", lr, 0.0)
        self.state: dict[int, dict[str, Any]] = {id(p): {} for p in self.params}
        self._scratch_pool: dict[tuple, Tensor] = {}
        #: during a step gated by amp.GradScaler: -0.0 (take it) or NaN (skip it), by dtype
        self._gates: dict[Any, Tensor] | None = None

    def zero_grad(self) -> None:
        """Forget the parameters' gradients (set them to None)."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """Update every parameter that has a gradient, in place.

        All the memory a step needs (state, scratch) is allocated before the first write, so an
        OutOfMemoryError leaves the parameters and the optimizer state as they were
        (Note [the commit point]).
        """
        self._step(None)

    def _step(self, gates: dict[Any, Tensor] | None,
              remade: dict[int, Callable[[], Tensor]] | None = None) -> None:
        """`step()`, each write to a parameter or to state a select by `gates` where given
        (`amp.GradScaler.step`: Note [a skipped step is a select on the device] in
        runtime/amp.py). While capturing, `remade` may give, by parameter id, a function
        that makes the parameter's gradient again (the same values) just before its update
        (Note [half gradients through the check] in runtime/amp.py)."""
        with no_grad(), tape.phase("update"):
            todo = [p for p in self.params if p.grad is not None]
            self._gates = gates
            try:
                self._prepare_shared()
                for p in todo:
                    self._prepare(p, self.state[id(p)])
                if gates is not None:
                    for p in todo:
                        self._gated_scratch(p)
                self._begin()
                # NOTE: while capturing, a gated update reads grad + gate (-0.0: grad bit for
                # bit; NaN: a skipped step, whose values _commit discards anyway), so that it
                # cannot be scheduled before the check: the graph then runs each update as
                # one elementwise chain into the state, where run early its new value would
                # wait at full size beside every gradient (runtime/graph/schedule.py)
                capturing = gates is not None and tape.active() is not None
                remade = remade or {}
                for p in todo:
                    grad = p.grad
                    if capturing:
                        again = remade.get(id(p))
                        grad = ops.add(grad if again is None else again(), gates[grad.dtype])
                    self._update(p, grad, self.state[id(p)])
                self._end()
            finally:
                self._gates = None

    def prepare_gate(self) -> None:
        """Allocate now the state and the further scratch a gated step needs (amp.GradScaler
        calls it, as `nn.train_step` calls `prepare()`; see `gated_updates`)."""
        self.prepare()
        with no_grad(), tape.phase("update"):
            for p in self.params:
                self._gated_scratch(p)

    def _gated_scratch(self, p: Tensor) -> None:
        """Make the scratch that gated updates of `p` (and the shared state) use."""

    def _target(self, state: Tensor, index: int) -> Tensor | None:
        """Where the new value of `state` goes: `state` itself, or in a gated step scratch
        number `index` shaped like it (None while capturing: a temporary), for `_commit`."""
        return state if self._gates is None else self._scratch(state, index)

    def _again(self, new: Tensor) -> Tensor | None:
        """Where the next op on `new` (from `_target`) writes: over `new` itself (the state,
        outside a gated step; its scratch, eagerly), or a temporary in a gated step that a
        graph captures. A block a capture writes once can be fused through or written over
        when it dies (runtime/graph/fuse.py); one written twice is a full-size buffer."""
        return None if self._gates is not None and tape.active() is not None else new

    def _commit(self, new: Tensor, state: Tensor) -> None:
        """Write `new` (from `_target`) over `state`: nothing to do outside a gated step; in
        one, state = where_finite(new + gate, state), new bit for bit or state unchanged."""
        if self._gates is None:
            return
        # NOTE: _again: the update's chain fuses through the gate into state while capturing
        gated = ops.add(new, self._gates[new.dtype], out=self._again(new))
        ops.where_finite(gated, state, out=state)

    def prepare(self) -> None:
        """Allocate now the state and scratch of every parameter (`step()` would make them at
        its first call), so that a later `step()` allocates nothing and cannot fail for memory
        once the gradients are there. `nn.train_step` calls it first thing."""
        with no_grad(), tape.phase("update"):
            self._prepare_shared()
            for p in self.params:
                self._prepare(p, self.state[id(p)])

    def _prepare_shared(self) -> None:
        """Make the state shared by all parameters (e.g. Adam's bias corrections)."""

    def _prepare(self, p: Tensor, state: dict[str, Any]) -> None:
        """Make what updating `p` needs: its state and scratch. The only allocations of a step."""

    def _begin(self) -> None:
        """Writes that come before the updates (e.g. Adam's bias corrections)."""

    def _end(self) -> None:
        """Writes that come after the updates."""

    def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _update()")

    def _zeros_like(self, p: Tensor) -> Tensor:
        return tensor(np.zeros(p.shape, p.dtype), device=p.device, allocator=p.block.allocator)

    def _scratch(self, like: Tensor, index: int = 0) -> Tensor | None:
        """Scratch tensor number `index` shaped like `like`, shared by every parameter of that
        shape (updates run one after another), made once, lazily. None while a graph captures:
        there, plain op results are temporaries the graph's memory plan places."""
        if tape.active() is not None:
            return None
        key = (like.shape, like.dtype, id(like.block.allocator), index)
        buffer = self._scratch_pool.get(key)
        if buffer is None:
            buffer = self._scratch_pool[key] = _allocated(
                empty(like.shape, like.dtype, device=like.device, allocator=like.block.allocator))
        return buffer

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._options()}, {len(self.params)} parameters)"

    def _options(self) -> str:
        return f"lr={self.lr}"


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, with
    PyTorch's update rule (momentum buffer = gradient at the first step)."""

    gated_updates = True

    def __init__(self, params: Iterable[Tensor], lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False) -> None:
        super().__init__(params, lr)
        self.momentum = _check_number("SGD: momentum", momentum, 0.0)
        self.weight_decay = _check_number("SGD: weight_decay", weight_decay, 0.0)
        self.dampening = _check_number("SGD: dampening", dampening, 0.0, 1.0 + 1e-12)
        if nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("SGD: Nesterov momentum needs momentum > 0 and dampening 0")
        self.nesterov = as_flag(nesterov, "SGD: nesterov")
        #: 0-d: 1 at the first step, then 1 - dampening
        self._dampened: Tensor | None = None

    def _coefficient(self, like: Tensor) -> Tensor:
        if self._dampened is None:
            self._dampened = tensor(np.ones((), like.dtype), device=like.device,
                                    allocator=like.block.allocator)
        return self._dampened

    def _prepare(self, p: Tensor, state: dict[str, Any]) -> None:
        self._scratch(p)
        if self.momentum and "momentum" not in state:
            state["momentum"] = self._zeros_like(p)
        if self.momentum and self.dampening:
            self._coefficient(p)

    def _step(self, gates: dict[Any, Tensor] | None,
              remade: dict[int, Callable[[], Tensor]] | None = None) -> None:
        """`Optimizer._step`, with the plain case (no momentum, no weight decay, not gated by
        amp, not capturing) in one loop of one-pass updates (`ops._sub_scaled`): p - (grad *
        lr) rounded twice, the bits of `_update`'s two ops; every scratch is looked up (made at
        the first step) before the first write (Note [the commit point]), for a device that
        runs the two kernels. A gated or captured step, or any other option, goes through
        `_update` (eager and not gated, also one pass: p - lr * buf with momentum); a capture
        records its two ops, which a graph may fold into a product. NOTE: kept beside the
        general loop because that costs 14-16 us more a step here (18 parameters: two scratch
        lookups and five hook calls per parameter, against one lookup)."""
        if (gates is not None or self.momentum or self.weight_decay
                or self._dampened is not None or tape.active() is not None or not self._plain):
            super()._step(gates, remade)
            return
        with no_grad():
            todo = [(p, p.grad, self._scratch(p)) for p in self.params if p.grad is not None]
            lr, sub_scaled = self.lr, ops._sub_scaled
            for p, grad, scratch in todo:
                sub_scaled(p, grad, lr, p, scratch)

    @property
    def _plain(self) -> bool:
        """True where this class updates as SGD does (a subclass that overrides a step method
        takes the general path)."""
        cls = type(self)
        return (cls._update is SGD._update and cls._prepare is SGD._prepare
                and cls._prepare_shared is Optimizer._prepare_shared
                and cls._begin is Optimizer._begin and cls._end is SGD._end)

    def _gated_scratch(self, p: Tensor) -> None:
        if self.momentum:  # NOTE: the momentum buffer's new value (`_target(buf, 1)`)
            self._scratch(p, 1)
        if self.nesterov:
            self._scratch(p, 2)
        if self._dampened is not None:
            self._scratch(self._dampened, 0)

    def _end(self) -> None:
        if self._dampened is not None:  # from now on d counts 1 - dampening
            new = ops.mul(self._dampened, 0.0, out=self._target(self._dampened, 0))
            new = ops.add(new, 1 - self.dampening, out=self._again(new))
            self._commit(new, self._dampened)

    def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        # NOTE: with out=None (capturing) each op makes a temporary; outside a gated step
        # _target is the state itself and _commit does nothing
        scratch = self._scratch(p)
        d = grad
        if self.weight_decay:
            decay = ops.mul(p, self.weight_decay, out=scratch)
            d = ops.add(decay, grad, out=scratch)
        if self.momentum:
            # NOTE: the buffer starts at zero and the first step adds d itself (coefficient 1,
            # later 1 - dampening), so the same ops run at every step: a captured graph
            # replays PyTorch's rule, where the buffer starts as the first d.
            buf = state["momentum"]
            new_buf = ops.mul(buf, self.momentum, out=self._target(buf, 1))
            if self.dampening:
                d = ops.mul(d, self._coefficient(p), out=scratch)
            new_buf = ops.add(new_buf, d, out=self._again(new_buf))
            if self.nesterov:  # p -= lr * (d + momentum * buf), in two subtractions
                new_p = ops.sub(p, ops.mul(d, self.lr, out=scratch), out=self._target(p, 2))
                new_p = ops.sub(new_p, ops.mul(new_buf, self.lr * self.momentum, out=scratch),
                                out=self._again(new_p))
                self._commit(new_p, p)
                self._commit(new_buf, buf)
                return
            d = new_buf
        if self._gates is None and scratch is not None and d is not scratch:
            # NOTE: eager, not gated: the two ops below in one pass, the same bits (the momentum
            # buffer's new value is in place already)
            ops._sub_scaled(p, d, self.lr, p, scratch)
            return
        # NOTE: p's commit first: in a capture it then follows the ops that make new_p, and
        # they fuse into one chain (new_p never at full size) where the buffer's commit would
        # sit between them
        new_p = ops.sub(p, ops.mul(d, self.lr, out=scratch), out=self._target(p, 0))
        self._commit(new_p, p)
        if self.momentum:
            self._commit(d, state["momentum"])

    def _options(self) -> str:
        return (f"lr={self.lr}, momentum={self.momentum}, weight_decay={self.weight_decay}"
                + (", nesterov=True" if self.nesterov else ""))


class Adam(Optimizer):
    """Adam (Kingma and Ba 2015) with PyTorch's defaults and bias correction; weight_decay
    adds weight_decay * param to the gradient (L2, as torch.optim.Adam).

    The bias corrections live on the device (beta**t as 0-d tensors updated by ops at every
    step), so a captured graph replays later steps correctly, like PyTorch's capturable Adam.
    """

    gated_updates = True

    def __init__(self, params: Iterable[Tensor], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"Adam: betas must be a pair of numbers, got {_brief(betas)}")
        self.betas = (_check_number("Adam: betas[0]", betas[0], 0.0, 1.0),
                      _check_number("Adam: betas[1]", betas[1], 0.0, 1.0))
        self.eps = _check_number("Adam: eps", eps, 0.0, low_open=True)
        self.weight_decay = _check_number("Adam: weight_decay", weight_decay, 0.0)
        #: beta1**t and beta2**t, as 0-d tensors
        self._powers: tuple[Tensor, Tensor] | None = None
        #: lr / (1 - beta1**t), a 0-d tensor
        self._step_size: Tensor | None = None
        #: 1 / (1 - beta2**t), a 0-d tensor
        self._inverse_correction: Tensor | None = None

    def _prepare_shared(self) -> None:
        if self._powers is not None:
            return
        like = self.params[0]
        dtype, device, allocator = like.dtype, like.device, like.block.allocator
        # NOTE: all made before any is kept, so a failed allocation leaves none half made and
        # the next prepare() makes them again (Note [the commit point])
        made = [tensor(np.ones((), dtype), device=device, allocator=allocator) for _ in range(2)]
        made += [_allocated(empty((), dtype, device, allocator)) for _ in range(2)]
        self._powers = (made[0], made[1])
        self._step_size, self._inverse_correction = made[2], made[3]

    def _prepare(self, p: Tensor, state: dict[str, Any]) -> None:
        if "exp_avg" not in state:  # the moments start at zero
            state["exp_avg"], state["exp_avg_sq"] = self._zeros_like(p), self._zeros_like(p)
        self._scratch(p, 0)
        self._scratch(p, 1)

    def _gated_scratch(self, p: Tensor) -> None:
        self._scratch(p, 2)
        for power in self._powers:
            self._scratch(power, 0)
            self._scratch(power, 1)

    def _begin(self) -> None:
        beta1, beta2 = self.betas
        power1, power2 = self._powers
        new1 = ops.mul(power1, beta1, out=self._target(power1, 0))
        new2 = ops.mul(power2, beta2, out=self._target(power2, 1))
        ops.sub(1.0, new1, out=self._step_size)
        ops.div(self.lr, self._step_size, out=self._step_size)
        ops.sub(1.0, new2, out=self._inverse_correction)
        ops.div(1.0, self._inverse_correction, out=self._inverse_correction)
        self._commit(new1, power1)
        self._commit(new2, power2)

    def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        beta1, beta2 = self.betas
        m, v = state["exp_avg"], state["exp_avg_sq"]
        s1, s2 = self._scratch(p, 0), self._scratch(p, 1)  # None while capturing
        g = grad
        if self.weight_decay:
            g = ops.add(ops.mul(p, self.weight_decay, out=s1), grad, out=s1)
        # NOTE: outside a gated step _target is the state itself and _commit does nothing; in
        # one, m and v are committed before p reads them (a skipped step discards p's new
        # value whatever it read)
        new_m = ops.mul(m, beta1, out=self._target(m, 2))
        new_m = ops.add(new_m, ops.mul(g, 1 - beta1, out=s2), out=self._again(new_m))
        self._commit(new_m, m)
        new_v = ops.mul(v, beta2, out=self._target(v, 2))
        squared = ops.mul(g, g, out=s2)
        new_v = ops.add(new_v, ops.mul(squared, 1 - beta2, out=s2), out=self._again(new_v))
        self._commit(new_v, v)
        # p -= lr / (1 - beta1**t) * m / (sqrt(v / (1 - beta2**t)) + eps)
        denominator = ops.sqrt(ops.mul(v, self._inverse_correction, out=s2), out=s2)
        denominator = ops.add(denominator, self.eps, out=s2)
        step = ops.mul(m, self._step_size, out=s1)
        new_p = ops.sub(p, ops.div(step, denominator, out=s1), out=self._target(p, 0))
        self._commit(new_p, p)

    def _options(self) -> str:
        return (f"lr={self.lr}, betas={self.betas}, eps={self.eps}, "
                f"weight_decay={self.weight_decay}")
