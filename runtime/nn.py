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
from typing import Any, NamedTuple

import numpy as np

from allocators import Allocator
from runtime import amp, dtypes, ops, tape
from runtime._tensor import (
    Tensor,
    _brief,
    as_dtype,
    as_flag,
    checked_nbytes,
    empty,
    host_array,
    tensor,
)
from runtime.autograd import no_grad

__all__ = ["SGD", "Adam", "Dense", "Module", "Optimizer", "ReLU", "Sequential", "Sigmoid", "Tanh",
           "clip_grad_norm_", "manual_seed", "mse", "softmax_cross_entropy", "train_step"]

_rng = np.random.default_rng()
_FLOAT32 = np.dtype("float32")
_FLOAT64 = np.dtype("float64")


def manual_seed(seed: int) -> None:
    """Seed the generator that initialises new layers (each layer may also take `rng=`)."""
    global _rng
    _rng = np.random.default_rng(seed)


# ---------------------------------------------------------------------- modules
class Module:
    """Base of every layer: tensors that require grad become parameters, modules submodules,
    in the order they are assigned; `register_buffer` adds state that is not a parameter
    (BatchNorm's running statistics). `train()` / `eval()` set `training` here and in every
    submodule; `state_dict()` / `load_state_dict()` save and restore parameters and buffers
    under PyTorch's dotted names, bit for bit."""

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        #: tensors (or None) that are state but not parameters, by name, in registration order
        object.__setattr__(self, "_buffers", {})
        #: whether the module computes as in training (dropout on, batch statistics)
        object.__setattr__(self, "training", True)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__() "
                               f"before assigning {name!r}")
        if name in self.__dict__.get("_buffers", ()):
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(f"{type(self).__name__}: buffer {name!r} takes a Tensor or "
                                f"None, got {_brief(value)}")
            self._buffers[name] = value
            object.__setattr__(self, name, value)
            return
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

    # ------------------------------------------------------------------ modes and state
    def train(self, mode: bool = True) -> Module:
        """Set `training` to `mode` in this module and every submodule; returns self."""
        mode = as_flag(mode, f"{type(self).__name__}.train: mode")
        for module in self._walk():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> Module:
        """`train(False)`: dropout off, batch norm on its running statistics; returns self."""
        return self.train(False)

    def _walk(self) -> Iterator[Module]:
        """This module and every submodule, each once (shared ones too)."""
        seen: set[int] = set()
        stack: list[Module] = [self]
        while stack:
            module = stack.pop()
            if id(module) not in seen:
                seen.add(id(module))
                yield module
                stack.extend(reversed(list(module._modules.values())))

    def register_buffer(self, name: str, value: Tensor | None) -> None:
        """Keep `value` (a Tensor, or None for a buffer not in use) as state of this module
        under `name`: in `state_dict()` (unless None) and `buffers()`, not a parameter."""
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"{type(self).__name__}.register_buffer: name must be a non-empty "
                             f"string without '.', got {_brief(name)}")
        if name in self._parameters or name in self._modules:
            raise KeyError(f"{type(self).__name__}.register_buffer: {name!r} is already a "
                           f"parameter or a submodule")
        if value is not None and not isinstance(value, Tensor):
            raise TypeError(f"{type(self).__name__}.register_buffer: {name!r} takes a Tensor "
                            f"or None, got {_brief(value)}")
        self._buffers[name] = value
        object.__setattr__(self, name, value)

    def named_buffers(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        """(qualified name, buffer) pairs of this module and its submodules (None skipped)."""
        for name, t in self._buffers.items():
            if t is not None:
                yield prefix + name, t
        for name, module in self._modules.items():
            yield from module.named_buffers(f"{prefix}{name}.")

    def buffers(self) -> list[Tensor]:
        """Every buffer of this module and its submodules."""
        return [t for _, t in self.named_buffers()]

    def state_dict(self, prefix: str = "") -> dict[str, Tensor]:
        """Parameters and buffers by PyTorch's dotted names, in PyTorch's order: a module's
        parameters, then its buffers, then each submodule's. The values are detached handles
        on the module's own memory (copy them, e.g. `.numpy()`, to keep a snapshot)."""
        state: dict[str, Tensor] = {}
        for name, t in self._parameters.items():
            state[prefix + name] = t.detach()
        for name, t in self._buffers.items():
            if t is not None:
                state[prefix + name] = t.detach()
        for name, module in self._modules.items():
            state.update(module.state_dict(f"{prefix}{name}."))
        return state

    def load_state_dict(self, state: Any, strict: bool = True) -> LoadResult:
        """Write `state` (a mapping of name to Tensor or array-like, as `state_dict()` names
        them) into this module's parameters and buffers, bit for bit (any dtype: the bits
        are copied, never converted). Everything is checked before anything is written: a
        missing or unexpected name (with `strict`, PyTorch's default), a shape or a dtype that
        differs is a RuntimeError naming every such entry. A write moves the tensor's version,
        so `amp` working copies of a parameter are cast again at their next use (Note
        [writes the working copy cannot see] in runtime/amp.py). Returns the missing and
        unexpected names (empty with `strict`)."""
        from collections.abc import Mapping

        if not isinstance(state, Mapping):
            raise TypeError(f"{type(self).__name__}.load_state_dict takes a mapping of names to "
                            f"tensors, got {_brief(state)}")
        strict = as_flag(strict, "load_state_dict: strict")
        own = self.state_dict()
        missing = [name for name in own if name not in state]
        unexpected = [name for name in state if name not in own]
        problems = []
        if strict and missing:
            problems.append(f"missing key(s): {', '.join(missing)}")
        if strict and unexpected:
            problems.append(f"unexpected key(s): {', '.join(map(str, unexpected))}")
        sources: list[tuple[Tensor, Any]] = []
        for name, target in own.items():
            if name not in state:
                continue
            value = state[name]
            if not isinstance(value, Tensor):
                value = np.asarray(value)
            if value.dtype != target.dtype:
                problems.append(f"{name}: dtype {value.dtype} where the module holds "
                                f"{target.dtype}")
            elif tuple(value.shape) != target.shape:
                problems.append(f"{name}: shape {tuple(value.shape)} where the module holds "
                                f"{target.shape}")
            else:
                sources.append((target, value))
        if problems:
            raise RuntimeError(f"{type(self).__name__}.load_state_dict: nothing was loaded: "
                               + "; ".join(problems))
        # NOTE: every source on its target's device first (the only allocations), then the
        # copies, which allocate nothing: a failure leaves the module as it was
        with no_grad():
            staged = [(target, value if isinstance(value, Tensor)
                       and value.device is target.device else
                       tensor(value.numpy() if isinstance(value, Tensor) else value,
                              device=target.device, allocator=target.block.allocator))
                      for target, value in sources]
            for target, value in staged:
                ops.copy(value, out=target)
        return LoadResult(missing, unexpected)

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


class LoadResult(NamedTuple):
    """What `Module.load_state_dict` did not load: names the module holds that the state
    lacks, and names of the state the module does not hold (PyTorch's `_IncompatibleKeys`)."""

    missing_keys: list[str]
    unexpected_keys: list[str]


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
        #: working copies of the parameters for autocast, by ("weight" or "bias", dtype)
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


# ---------------------------------------- convolution layers
def _positive(layer: str, what: str, n: Any) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n <= 0:
        raise ValueError(f"{layer}: {what} must be a positive int, got {_brief(n)}")
    return int(n)


class Conv2d(Module):
    """A 2-D convolution over NCHW images: y = conv2d(x, weight, stride, padding) + bias
    (`ops.conv2d`).

    `weight` is (out_channels, in_channels, kh, kw) and, like `bias` (out_channels,), starts
    uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)], fan_in = in_channels * kh * kw (PyTorch's
    nn.Conv2d initialisation). Inside `amp.autocast(half)` it computes in `half`
    (`ops.conv2d` casts its float32 operands at each call).

    Args:
        in_channels, out_channels: positive sizes.
        kernel_size, stride, padding: an int or an (h, w) pair.
        bias: whether to add a learned bias.
        dtype, device, allocator: where the parameters live.
        rng: a numpy Generator or seed for the initial values (default: `manual_seed`'s).

    Example:
        >>> import numpy as np, runtime
        >>> from runtime import nn
        >>> conv = nn.Conv2d(3, 8, 3, padding=1, rng=0)
        >>> conv(runtime.tensor(np.ones((2, 3, 5, 5), np.float32))).shape
        (2, 8, 5, 5)
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Any, stride: Any = 1,
                 padding: Any = 0, bias: bool = True, *, dtype: Any = "float32",
                 device: Any = None, allocator: Allocator | None = None,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.in_channels = _positive("Conv2d", "in_channels", in_channels)
        self.out_channels = _positive("Conv2d", "out_channels", out_channels)
        self.kernel_size = ops._pair("Conv2d", "kernel_size", kernel_size, 1)
        self.stride = ops._pair("Conv2d", "stride", stride, 1)
        self.padding = ops._pair("Conv2d", "padding", padding, 0)
        bias = as_flag(bias, "Conv2d: bias")
        dtype = as_dtype(dtype, "Conv2d")
        if not dtypes.is_float(dtype):
            raise TypeError(f"Conv2d: parameters are a float dtype (float16, bfloat16, "
                            f"float32, float64), got dtype {dtype}")
        shape = (self.out_channels, self.in_channels, *self.kernel_size)
        checked_nbytes(shape, dtype, "Conv2d: weight")
        generator = _rng if rng is None else _generator(rng)
        bound = 1 / math.sqrt(self.in_channels * self.kernel_size[0] * self.kernel_size[1])
        self.weight = _uniform(generator, shape, bound, dtype, device, allocator)
        self.bias = (_uniform(generator, (self.out_channels,), bound, dtype, device, allocator)
                     if bias else None)

    def forward(self, x: Tensor) -> Tensor:
        return ops.conv2d(x, self.weight, self.bias, self.stride, self.padding)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"stride={self.stride}, padding={self.padding}, bias={self.bias is not None}")


class _Pool2d(Module):
    """A pooling layer over 2-D windows: kernel_size, stride (default: kernel_size) and
    padding as PyTorch's, checked once here; `forward` runs the subclass's `pool` op."""

    #: the op, `ops.max_pool2d` or `ops.avg_pool2d`
    pool: Any = None

    def __init__(self, kernel_size: Any, stride: Any = None, padding: Any = 0) -> None:
        super().__init__()
        name = type(self).__name__
        self.kernel_size = ops._pair(name, "kernel_size", kernel_size, 1)
        self.stride = (self.kernel_size if stride is None
                       else ops._pair(name, "stride", stride, 1))
        self.padding = ops._pair(name, "padding", padding, 0)

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(x, self.kernel_size, self.stride, self.padding)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class MaxPool2d(_Pool2d):
    """The maximum of each window (`ops.max_pool2d`); stride defaults to kernel_size."""

    pool = staticmethod(ops.max_pool2d)


class AvgPool2d(_Pool2d):
    """The mean of each window, zero padding counted (`ops.avg_pool2d`); stride defaults to
    kernel_size."""

    pool = staticmethod(ops.avg_pool2d)


class Flatten(Module):
    """Axes start_dim..end_dim (inclusive, negative from the end) merged into one, as
    PyTorch's nn.Flatten: (N, C, H, W) -> (N, C*H*W) by default. A view where x's strides
    allow, else a copy."""

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        for what, value in (("start_dim", start_dim), ("end_dim", end_dim)):
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Flatten: {what} must be an int, got {_brief(value)}")
        self.start_dim = int(start_dim)
        self.end_dim = int(end_dim)

    def forward(self, x: Tensor) -> Tensor:
        ndim = max(x.ndim, 1)
        start, end = self.start_dim, self.end_dim
        if not (-ndim <= start < ndim and -ndim <= end < ndim):
            raise ValueError(f"Flatten: start_dim {start} and end_dim {end} must be axes of an "
                             f"input of {x.ndim} dimensions (shape {x.shape})")
        start, end = start % ndim, end % ndim
        if start > end:
            raise ValueError(f"Flatten: start_dim {self.start_dim} comes after end_dim "
                             f"{self.end_dim} for an input of shape {x.shape}")
        if x.ndim == 0:
            return x.reshape(1)
        merged = math.prod(x.shape[start:end + 1])
        return x.reshape(*x.shape[:start], merged, *x.shape[end + 1:])

    def extra_repr(self) -> str:
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


__all__ += ["AvgPool2d", "Conv2d", "Flatten", "MaxPool2d"]


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


# ---------------------------------------- normalisation and activation layers
class GELU(Module):
    """The Gaussian error linear unit elementwise (`ops.gelu`; PyTorch's nn.GELU):
    approximate="none" computes x * Phi(x) exactly (with erf), "tanh" PyTorch's tanh
    approximation; any other value is a ValueError.

    Example:
        >>> import numpy as np, runtime
        >>> from runtime import nn
        >>> nn.GELU("tanh")(runtime.tensor(np.float64([1.0]))).numpy()
        array([0.84119199])
    """

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GELU: approximate must be 'none' or 'tanh' (PyTorch's), got "
                             f"{approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return ops.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class LayerNorm(Module):
    """Layer normalisation over the last dimensions, `normalized_shape` (an int or a tuple):
    (x - mean) / sqrt(var + eps) * weight + bias, the variance biased (`ops.layer_norm`);
    PyTorch's nn.LayerNorm. `weight` starts at ones and `bias` at zeros, each of
    normalized_shape; with `elementwise_affine=False` there are neither, and with `bias=False`
    no bias. Inside `amp.autocast` it computes in float32 and returns float32, as
    torch.autocast runs layer_norm.

    Example:
        >>> import numpy as np, runtime
        >>> from runtime import nn
        >>> norm = nn.LayerNorm(4)
        >>> norm(runtime.tensor(np.float32([[0, 1, 2, 3]]))).numpy().round(3)
        array([[-1.342, -0.447,  0.447,  1.342]], dtype=float32)
    """

    def __init__(self, normalized_shape: Any, eps: float = 1e-5,
                 elementwise_affine: bool = True, bias: bool = True, *, dtype: Any = "float32",
                 device: Any = None, allocator: Allocator | None = None) -> None:
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        if not isinstance(normalized_shape, (tuple, list)) or not normalized_shape or any(
                isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n <= 0
                for n in normalized_shape):
            raise ValueError(f"LayerNorm: normalized_shape must be a positive int or a "
                             f"non-empty tuple of them, got {_brief(normalized_shape)}")
        if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, numbers.Real) or not (
                0 <= float(eps) < math.inf):
            raise ValueError(f"LayerNorm: eps must be a finite number >= 0, got {_brief(eps)}")
        self.normalized_shape = tuple(int(n) for n in normalized_shape)
        self.eps = float(eps)
        self.elementwise_affine = as_flag(elementwise_affine, "LayerNorm: elementwise_affine")
        dtype = as_dtype(dtype, "LayerNorm")
        if not dtypes.is_float(dtype):
            raise TypeError(f"LayerNorm: parameters are a float dtype (float16, bfloat16, "
                            f"float32, float64), got dtype {dtype}")
        checked_nbytes(self.normalized_shape, dtype, "LayerNorm: weight")
        self.weight = self.bias = None
        if self.elementwise_affine:
            self.weight = tensor(np.ones(self.normalized_shape, dtype), device=device,
                                 allocator=allocator, requires_grad=True)
            if as_flag(bias, "LayerNorm: bias"):
                self.bias = tensor(np.zeros(self.normalized_shape, dtype), device=device,
                                   allocator=allocator, requires_grad=True)

    def forward(self, x: Tensor) -> Tensor:
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}")


__all__ += ["GELU", "LayerNorm"]



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
        # NOTE: the forward pass's state writes (batch norm's running statistics) wait for the
        # commit point: Note [state writes wait for the commit point] in runtime/ops.py
        with ops.state_writes() as writes:
            if half is None:
                value = loss(model(x), target)
            else:
                with amp.autocast(half):
                    value = loss(model(x), target)
            (value if scaler is None else scaler.scale(value)).backward()
            writes.commit()
        if scaler is None:
            optimizer.step()
        else:
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


# ---------------------------------------- batch norm, embedding, dropout layers
def _positive_int(what: str, n: Any) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, numbers.Integral) or n <= 0:
        raise ValueError(f"{what} must be a positive int, got {_brief(n)}")
    return int(n)


def _float_dtype(dtype: Any, what: str) -> np.dtype:
    dtype = as_dtype(dtype, what)
    if not dtypes.is_float(dtype):
        raise TypeError(f"{what}: parameters are a float dtype (float16, bfloat16, float32, "
                        f"float64), got dtype {dtype}")
    return dtype


class _BatchNorm(Module):
    """Batch normalisation over axis 1 (`ops.batch_norm`), PyTorch's `_BatchNorm`: weight
    (ones) and bias (zeros) when `affine`; buffers running_mean (zeros), running_var (ones)
    and num_batches_tracked (an int64 0-d count) when `track_running_stats`. In training the
    batch's statistics normalise and the running ones are updated in place (momentum 0.1:
    running = 0.9 * running + 0.1 * batch, the variance unbiased) and the count moves on; in
    evaluation (`eval()`) the running statistics normalise. Without running statistics the
    batch's are used in both modes. `momentum=None` is PyTorch's cumulative average: the
    factor is 1 / num_batches_tracked (counting this batch), computed on the device, so a
    captured graph replays it."""

    #: the numbers of dimensions the input may have
    dims: tuple[int, ...] = ()

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1,
                 affine: bool = True, track_running_stats: bool = True, *,
                 dtype: Any = "float32", device: Any = None,
                 allocator: Allocator | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        self.num_features = _positive_int(f"{name}: num_features", num_features)
        self.eps = ops._number(name, "eps", eps, 0.0)
        self.momentum = (None if momentum is None else
                         ops._number(name, "momentum", momentum, 0.0, 1.0))
        self.affine = as_flag(affine, f"{name}: affine")
        self.track_running_stats = as_flag(track_running_stats,
                                           f"{name}: track_running_stats")
        dtype = _float_dtype(dtype, name)
        shape = (self.num_features,)
        where = {"device": device, "allocator": allocator}
        self.weight = (tensor(np.ones(shape, dtype), requires_grad=True, **where)
                       if self.affine else None)
        self.bias = (tensor(np.zeros(shape, dtype), requires_grad=True, **where)
                     if self.affine else None)
        tracked = self.track_running_stats
        self.register_buffer("running_mean", tensor(np.zeros(shape, dtype), **where)
                             if tracked else None)
        self.register_buffer("running_var", tensor(np.ones(shape, dtype), **where)
                             if tracked else None)
        self.register_buffer("num_batches_tracked", tensor(np.zeros((), np.int64), **where)
                             if tracked else None)

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"{type(self).__name__}: expected a Tensor, got {_brief(x)}")
        if x.ndim not in self.dims:
            raise ValueError(f"{type(self).__name__}: expected "
                             f"{' or '.join(f'{d}D' for d in self.dims)} input (got {x.ndim}D "
                             f"input of shape {x.shape})")
        batch_stats = self.training or not self.track_running_stats
        momentum = self.momentum
        if momentum is None and self.training and self.track_running_stats:
            momentum = self._average_factor(x)
        y = ops.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                           batch_stats, 0.0 if momentum is None else momentum, self.eps)
        if self.training and self.track_running_stats:  # NOTE: after the checks of batch_norm
            ops._count_up(self.num_batches_tracked)
        return y

    def _average_factor(self, x: Tensor) -> Tensor:
        """1 / (num_batches_tracked + 1), a 0-d tensor of x's compute dtype: the factor of
        PyTorch's cumulative average once this batch is counted (the count moves on only after
        the batch is normalised, so a refused call counts nothing)."""
        wide = ops._wide_dtype(x.dtype)
        with no_grad():
            count = ops.cast(ops._current_state(self.num_batches_tracked), wide, exact=False)
            return ops.div(1.0, ops.add(count, 1.0, out=count), out=count)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
                f"affine={self.affine}, track_running_stats={self.track_running_stats}")


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of (N, C) or (N, C, L) inputs (PyTorch's BatchNorm1d)."""

    dims = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of (N, C, H, W) inputs per channel (PyTorch's BatchNorm2d).

    Example:
        >>> import numpy as np, runtime
        >>> from runtime import nn
        >>> bn = nn.BatchNorm2d(3)
        >>> y = bn(runtime.tensor(np.arange(24.0, dtype=np.float32).reshape(2, 3, 2, 2)))
        >>> bn.num_batches_tracked.item(), bn.eval().training
        (1, False)
    """

    dims = (4,)


class Embedding(Module):
    """A lookup table: rows of `weight` (num_embeddings, embedding_dim), initialised N(0, 1)
    as PyTorch's, picked by integer indices (`ops.embedding`; the output has shape
    indices.shape + (embedding_dim,)).

    Args:
        num_embeddings, embedding_dim: positive sizes.
        padding_idx: a row (negative: counted from the end, stored as its positive index)
            that starts at zeros and gets no gradient, or None.
        max_norm, norm_type: with max_norm, each row looked up whose norm_type-norm is above
            max_norm is scaled down to it in place first (`ops.embedding`).
        dtype, device, allocator: where the weight lives.
        rng: a numpy Generator or seed for the initial values (default: `manual_seed`'s).

    Example:
        >>> from runtime import nn
        >>> nn.Embedding(10, 3, padding_idx=-1, max_norm=1.0)
        Embedding(10, 3, padding_idx=9, max_norm=1.0)
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: int | None = None, max_norm: float | None = None,
                 norm_type: float = 2.0, *, dtype: Any = "float32", device: Any = None,
                 allocator: Allocator | None = None,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.num_embeddings = _positive_int("Embedding: num_embeddings", num_embeddings)
        self.embedding_dim = _positive_int("Embedding: embedding_dim", embedding_dim)
        self.padding_idx = ops._padding_index("Embedding", padding_idx, self.num_embeddings)
        if max_norm is not None:
            max_norm = ops._number("Embedding", "max_norm", max_norm, -math.inf)
        self.max_norm = max_norm
        self.norm_type = ops._number("Embedding", "norm_type", norm_type, -math.inf)
        dtype = _float_dtype(dtype, "Embedding")
        shape = (self.num_embeddings, self.embedding_dim)
        checked_nbytes(shape, dtype, "Embedding: weight")
        generator = _rng if rng is None else _generator(rng)
        values = generator.standard_normal(shape).astype(dtype)
        if self.padding_idx is not None:  # NOTE: PyTorch's reset_parameters zeroes it
            values[self.padding_idx] = 0
        self.weight = tensor(values, device=device, allocator=allocator, requires_grad=True)

    def forward(self, indices: Any) -> Tensor:
        return ops.embedding(indices, self.weight, self.padding_idx, self.max_norm,
                             self.norm_type)

    def extra_repr(self) -> str:
        text = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            text += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            text += f", max_norm={self.max_norm}"
        if self.norm_type != 2:
            text += f", norm_type={self.norm_type}"
        return text


class Dropout(Module):
    """Inverted dropout (`ops.dropout`): in training each element is zeroed with probability
    p and the rest scaled by 1 / (1 - p); the identity in evaluation (`eval()`).

    Each layer draws from its own `ops.Generator`, seeded from `rng` (a numpy Generator or
    seed; default: `manual_seed`'s generator, as layers' initial values), so a model built
    after `nn.manual_seed(s)` draws the same masks every time, eagerly or as a captured graph.
    `inplace=True` writes the result into the input (`out=x`), which autograd refuses where
    gradients are recorded (runtime.no_grad() inference, say, takes it).
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *,
                 rng: np.random.Generator | int | None = None) -> None:
        super().__init__()
        self.p = ops._number("Dropout", "p (the probability of zeroing an element)", p, 0.0,
                             1.0)
        self.inplace = as_flag(inplace, "Dropout: inplace")
        seed = int((_rng if rng is None else _generator(rng)).integers(2**63))
        #: where this layer's masks come from
        self.generator = ops.Generator(seed)

    def forward(self, x: Tensor) -> Tensor:
        return ops.dropout(x, self.p, self.training, self.generator,
                           out=x if self.inplace else None)

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}"


__all__ += ["BatchNorm1d", "BatchNorm2d", "Dropout", "Embedding", "LoadResult"]



class Optimizer:
    """Base of the optimizers: holds the parameters and per-parameter state; `step()` runs
    `_update(param, grad, state)` under no_grad for each parameter that has a gradient.

    Note [optimizers compute as PyTorch's do]: each update is PyTorch's CPU for-loop
    (`torch.optim`'s default there), op for op: the state has the parameter's dtype, and each
    of PyTorch's ops (a fused one such as lerp, addcmul or addcdiv included) is computed in the
    parameter's compute dtype, float32 for a float16 or bfloat16 parameter (PyTorch's opmath,
    `ops._number_dtype`), and rounded once into the parameter's dtype: `_Pointwise`'s ops cast
    two-byte operands into float32 scratch and round the result back; add's alpha is rounded
    to the parameter's dtype first, as PyTorch's kernel does. Numbers that change from step to
    step (Adam's bias corrections, SGD's first-step coefficient) are 0-d tensors of the compute
    dtype on the device, so that a `runtime.graph` replays later steps correctly. Two-byte
    parameters then get PyTorch's bits (but where PyTorch's scalar loop, after its vectors,
    rounds add's product first); float32 ones may differ in the last place where PyTorch's
    kernels fuse a multiply and an add.
    """

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
        #: by parameter id, the eager `_pointwise` over its scratch
        self._pointwise_of: dict[int, _Pointwise] = {}
        #: during a step gated by amp.GradScaler: -0.0 (take it) or NaN (skip it), by dtype
        self._gates: dict[Any, Tensor] | None = None
        #: steps taken, and by parameter id the steps that updated it (host counts: replays of
        #: a captured step move neither, and they update the same parameters every time)
        self._taken = 0
        self._counts = {id(p): 0 for p in self.params}

    def zero_grad(self) -> None:
        """Forget the parameters' gradients (set them to None)."""
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[Tensor]:
        """The tensors of state a step writes besides the parameters: each parameter's
        (`state`), and any the parameters share (Adam's bias corrections)."""
        return [value for p in self.params for value in self.state[id(p)].values()
                if isinstance(value, Tensor)]

    def step(self) -> None:
        """Update every parameter that has a gradient, in place.

        Everything a step could refuse is checked before the first write, and all the memory
        it needs (state, scratch) is allocated then too, so a refused step or an
        OutOfMemoryError leaves the parameters and the optimizer state as they were
        (Note [the commit point]).

        Raises UseAfterFreeError / UninitializedMemoryError for a gradient without readable
        memory, and ValueError where `counts_steps` and a parameter missed a step.
        """
        self._step(None)

    @property
    def counts_steps(self) -> bool:
        """True where an update depends on the number of steps taken (Adam's bias corrections;
        SGD's first momentum step with dampening). The optimizer keeps one count, on the
        device, for all its parameters, where PyTorch counts each parameter's own steps: so a
        parameter must have had a gradient at every step, or at none (a frozen one); a step
        that would give one PyTorch's result for another count is refused."""
        return False

    def _check_step(self, todo: list[Tensor]) -> None:
        """Refuse, before anything is written, a step that could fail part-way or give a
        parameter another result than PyTorch's: a gradient (or parameter) without readable
        memory, and under `counts_steps` a parameter that missed steps. (`.grad` itself takes
        only a tensor of the parameter's shape, dtype and device: `Tensor.grad`.)"""
        name = type(self).__name__
        counts = self._counts if self.counts_steps else None
        for p in todo:
            for t in (p, p.grad):
                block = t.block
                if t._gen != block.generation or not block._written:
                    where = (f"{name}.step(): {'parameter' if t is p else 'the gradient of'} "
                             f"{p.name or p.shape}")
                    t._check(where)
                    block.memory_for_read(where)
            if counts is not None and counts[id(p)] != self._taken:
                raise ValueError(
                    f"{name}.step(): parameter {p.name or p.shape} was updated at "
                    f"{self._counts[id(p)]} of this optimizer's {self._taken} steps; {name} "
                    f"keeps one step count for all its parameters (on the device, so that a "
                    f"captured step replays it), where PyTorch would count this parameter's "
                    f"own steps: give every parameter a gradient at every step (or never), or "
                    f"give this one an optimizer of its own; nothing was changed")

    def _step(self, gates: dict[Any, Tensor] | None,
              remade: dict[int, Callable[[], Tensor]] | None = None) -> None:
        """`step()`, each write to a parameter or to state a select by `gates` where given
        (`amp.GradScaler.step`: Note [a skipped step is a select on the device] in
        runtime/amp.py). While capturing, `remade` may give, by parameter id, a function
        that makes the parameter's gradient again (the same values) just before its update
        (Note [half gradients through the check] in runtime/amp.py)."""
        with no_grad(), tape.phase("update"):
            todo = [p for p in self.params if p.grad is not None]
            self._check_step(todo)
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
            self._counted(todo)

    def _counted(self, todo: list[Tensor]) -> None:
        """Count a step that updated the parameters `todo` (where `counts_steps`)."""
        if self.counts_steps:
            self._taken += 1
            for p in todo:
                self._counts[id(p)] += 1

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
        self._pointwise(p)

    def _begin(self) -> None:
        """Writes that come before the updates (e.g. Adam's bias corrections)."""

    def _end(self) -> None:
        """Writes that come after the updates."""

    def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not implement _update()")

    def _zeros_like(self, p: Tensor) -> Tensor:
        return tensor(np.zeros(p.shape, p.dtype), device=p.device, allocator=p.block.allocator)

    def _scratch(self, like: Tensor, index: int = 0, dtype: np.dtype | None = None
                 ) -> Tensor | None:
        """Scratch tensor number `index` shaped like `like` (of its dtype, or `dtype`), shared
        by every parameter of that shape (updates run one after another), made once, lazily.
        None while a graph captures: there, plain op results are temporaries the graph's
        memory plan places."""
        if tape.active() is not None:
            return None
        dtype = like.dtype if dtype is None else dtype
        key = (like.shape, dtype, id(like.block.allocator), index)
        buffer = self._scratch_pool.get(key)
        if buffer is None:
            buffer = self._scratch_pool[key] = _allocated(
                empty(like.shape, dtype, device=like.device, allocator=like.block.allocator))
        return buffer

    def _pointwise(self, p: Tensor) -> _Pointwise:
        """PyTorch's ops for updating `p` (Note [optimizers compute as PyTorch's do]), over
        its scratch (made at the first call; kept by parameter outside captures)."""
        eager = tape.active() is None
        made = self._pointwise_of.get(id(p)) if eager else None
        if made is None:
            wide = _compute_dtype(p.dtype)
            made = _Pointwise(p.dtype, self._scratch(p, 0, wide),
                              None if wide == p.dtype else self._scratch(p, 1, wide))
            if eager:
                self._pointwise_of[id(p)] = made
        return made

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._options()}, {len(self.params)} parameters)"

    def _options(self) -> str:
        return f"lr={self.lr}"


class _Pointwise:
    """PyTorch's pointwise ops as one parameter's update uses them (Note [optimizers compute
    as PyTorch's do]): each takes and returns tensors of the parameter's dtype; `out` is
    where the result goes (None: a temporary) and may be an operand. A two-byte parameter's
    operands are cast into float32 scratch (`work`, `spare`), the op computed there, and the
    result rounded once into `out`; a float32 or float64 one computes in place, its
    intermediate results in `work`. While a graph captures, both are None: every result is a
    new temporary, written once, which a graph can fuse through or write over."""

    __slots__ = ("dtype", "own", "work", "spare")

    def __init__(self, dtype: np.dtype, work: Tensor | None, spare: Tensor | None) -> None:
        self.dtype = dtype
        #: whether the parameter computes in its own dtype (no casts)
        self.own = dtype not in dtypes.HALVES
        self.work = work
        self.spare = spare

    def _wide(self, x: Tensor, spare: bool = False) -> Tensor:
        """x in the compute dtype: x itself, or cast exactly into work (or spare)."""
        if self.own:
            return x
        return ops.cast(x, _FLOAT32, out=self.spare if spare else self.work)

    def _last(self, out: Tensor | None) -> Tensor | None:
        """Where the last op writes: `out` itself, or the work, which `_rounded` rounds."""
        return out if self.own else self.work

    def _rounded(self, value: Tensor, out: Tensor | None) -> Tensor:
        return value if self.own else ops.cast(value, self.dtype, out=out)

    def add_scaled(self, a: Tensor, b: Tensor, alpha: Any, out: Tensor | None) -> Tensor:
        """a + alpha * b (PyTorch's add with alpha, which rounds a number alpha to the dtype
        first); alpha a number or a 0-d compute-dtype tensor (so rounded already)."""
        if not self.own and not isinstance(alpha, Tensor):
            alpha = float(self.dtype.type(alpha))
        scaled = self._wide(b)
        if isinstance(alpha, Tensor) or alpha != 1.0:  # NOTE: b * 1 is b: no op to fuse through
            scaled = ops.mul(scaled, alpha, out=self.work)
        return self._rounded(ops.add(self._wide(a, True), scaled, out=self._last(out)), out)

    def lerp(self, start: Tensor, end: Tensor, weight: float, out: Tensor | None) -> Tensor:
        """start + weight * (end - start), as PyTorch's lerp: from end for weight >= 0.5."""
        wide = _compute_dtype(self.dtype)
        weight = float(wide.type(weight))  # NOTE: exact, and a Python float for the fast path
        low = self._wide(start, True)
        diff = ops.sub(self._wide(end), low, out=self.work)
        if abs(weight) < 0.5:
            result = ops.add(low, ops.mul(diff, weight, out=self.work), out=self._last(out))
        else:
            diff = ops.mul(diff, float(wide.type(1) - wide.type(weight)), out=self.work)
            result = ops.sub(self._wide(end, True), diff, out=self._last(out))
        return self._rounded(result, out)

    def addcmul(self, a: Tensor, b: Tensor, value: float, out: Tensor | None) -> Tensor:
        """a + value * b * b (PyTorch's addcmul(a, b, b, value=value))."""
        wide_b = self._wide(b, True)
        product = ops.mul(ops.mul(wide_b, value, out=self.work), wide_b, out=self.work)
        return self._rounded(ops.add(self._wide(a, True), product, out=self._last(out)), out)

    def addcdiv(self, a: Tensor, b: Tensor, c: Tensor, value: Tensor,
                out: Tensor | None) -> Tensor:
        """a + value * b / c (PyTorch's addcdiv); value a 0-d compute-dtype tensor."""
        quotient = ops.mul(self._wide(b), value, out=self.work)
        quotient = ops.div(quotient, self._wide(c, True), out=self.work)
        return self._rounded(ops.add(self._wide(a, True), quotient, out=self._last(out)), out)

    def divided(self, a: Tensor, value: Tensor, out: Tensor | None) -> Tensor:
        """a / value; value a 0-d compute-dtype tensor."""
        return self._rounded(ops.div(self._wide(a), value, out=self._last(out)), out)


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a `dtype` parameter's update computes in: float32 for float16 and bfloat16
    (PyTorch's opmath), the dtype itself otherwise (Note [optimizers compute as PyTorch's
    do])."""
    return ops._number_dtype(dtype)


def _shared_by_dtype(shared: list[tuple[Tensor, ...]], p: Tensor) -> tuple[Tensor, ...]:
    """The entry of `shared` (0-d tensors, one entry per compute dtype and device of the
    parameters) that serves `p`."""
    wide = _compute_dtype(p.dtype)
    for entry in shared:
        if entry[0].dtype == wide and entry[0].device is p.device:
            return entry
    raise KeyError(f"no shared state for a {p.dtype} parameter on {p.device.name}")


def _groups(params: list[Tensor], by_dtype: bool = False) -> list[Tensor]:
    """One parameter of each compute dtype (`by_dtype`: of each dtype) and device among
    `params`, in order."""
    seen: dict[tuple[np.dtype, int], Tensor] = {}
    for p in params:
        seen.setdefault((p.dtype if by_dtype else _compute_dtype(p.dtype), id(p.device)), p)
    return list(seen.values())


class SGD(Optimizer):
    """Stochastic gradient descent with momentum, dampening, Nesterov and weight decay, with
    PyTorch's update rule (momentum buffer = gradient at the first step), op for op
    (Note [optimizers compute as PyTorch's do])."""

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
        #: per dtype and device of the parameters, (the dtype, a 0-d of its compute dtype):
        #: 1 at the first step, then 1 - dampening rounded to the dtype, as PyTorch rounds
        #: add's alpha (only with momentum and dampening)
        self._dampened: list[tuple[np.dtype, Tensor]] = []
        #: whether every parameter computes in its own dtype (the one-pass loop of `_step`)
        self._own_dtypes = all(_compute_dtype(p.dtype) == p.dtype for p in self.params)

    @property
    def counts_steps(self) -> bool:
        return bool(self.momentum and self.dampening)

    def _prepare_shared(self) -> None:
        if self._dampened or not self.counts_steps:
            return
        # NOTE: all made before any is kept (Note [the commit point])
        made = [(p.dtype, tensor(np.ones((), _compute_dtype(p.dtype)), device=p.device,
                                 allocator=p.block.allocator))
                for p in _groups(self.params, by_dtype=True)]
        self._dampened = made

    def _prepare(self, p: Tensor, state: dict[str, Any]) -> None:
        super()._prepare(p, state)
        if self.momentum and "momentum" not in state:
            state["momentum"] = self._zeros_like(p)
        if self.weight_decay or self.nesterov:
            self._scratch(p, 1)

    def _step(self, gates: dict[Any, Tensor] | None,
              remade: dict[int, Callable[[], Tensor]] | None = None) -> None:
        """`Optimizer._step`, with the plain case (no momentum, no weight decay, parameters that
        compute in their own dtype, not gated by amp, not capturing) in one loop of one-pass
        updates (`ops._sub_scaled`): p - (grad * lr) rounded twice, the bits of
        `add_scaled(p, grad, -lr)`; every scratch is looked up (made at the first step) after
        the checks and before the first write (Note [the commit point]), for a device that
        runs the two kernels. A gated or captured step, or any other option, goes through
        `_update` (eager and not gated, also one pass: p - lr * buf with momentum); a capture
        records its two ops, which a graph may fold into a product. NOTE: kept beside the
        general loop because that costs 14-16 us more a step here (18 parameters: two scratch
        lookups and five hook calls per parameter, against one lookup)."""
        if (gates is not None or self.momentum or self.weight_decay or not self._own_dtypes
                or tape.active() is not None or not self._plain):
            super()._step(gates, remade)
            return
        with no_grad():
            todo = [p for p in self.params if p.grad is not None]
            self._check_step(todo)
            work = [(p, p.grad, self._scratch(p)) for p in todo]
            lr, sub_scaled = self.lr, ops._sub_scaled
            for p, grad, scratch in work:
                sub_scaled(p, grad, lr, p, scratch)
            self._counted(todo)

    @property
    def _plain(self) -> bool:
        """True where this class updates as SGD does (a subclass that overrides a step method
        takes the general path)."""
        cls = type(self)
        return (cls._update is SGD._update and cls._prepare is SGD._prepare
                and cls._prepare_shared is SGD._prepare_shared
                and cls._begin is Optimizer._begin and cls._end is SGD._end)

    def _gated_scratch(self, p: Tensor) -> None:
        if self.momentum:  # NOTE: the momentum buffer's new value (`_target(buf, 2)`)
            self._scratch(p, 2)
        self._scratch(p, 3)  # NOTE: the parameter's new value (`_target(p, 3)`)
        for _, dampened in self._dampened:
            self._scratch(dampened, 0)

    def _end(self) -> None:
        for dtype, dampened in self._dampened:  # from now on d counts 1 - dampening
            new = ops.mul(dampened, 0.0, out=self._target(dampened, 0))
            new = ops.add(new, float(dtype.type(1 - self.dampening)), out=self._again(new))
            self._commit(new, dampened)

    def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        # NOTE: with out=None (capturing) each op makes a temporary; outside a gated step
        # _target is the state itself and _commit does nothing. PyTorch's _single_tensor_sgd:
        # d = grad + wd * p; buf = buf * momentum + (1 - dampening) * d (buf = d at the first
        # step); d = d + momentum * buf (Nesterov) or buf; p = p - lr * d
        d = grad
        pointwise = self._pointwise(p)
        spare = self._scratch(p, 1) if self.weight_decay or self.nesterov else None
        if self.weight_decay:
            d = pointwise.add_scaled(grad, p, self.weight_decay, out=spare)
        if self.momentum:
            # NOTE: the buffer starts at zero and the first step adds d itself (coefficient 1,
            # later 1 - dampening), so the same ops run at every step: a captured graph
            # replays PyTorch's rule, where the buffer starts as the first d.
            buf = state["momentum"]
            new_buf = ops.mul(buf, self.momentum, out=self._target(buf, 2))
            coefficient = next((c for dtype, c in self._dampened
                                if dtype == p.dtype and c.device is p.device), 1.0)
            new_buf = pointwise.add_scaled(new_buf, d, coefficient, out=self._again(new_buf))
            d = (pointwise.add_scaled(d, new_buf, self.momentum, out=spare) if self.nesterov
                 else new_buf)
        if self._gates is None and pointwise.own and pointwise.work is not None:
            # NOTE: eager, not gated: the two ops of add_scaled(p, d, -lr) in one pass, the
            # same bits (the momentum buffer's new value is in place already)
            ops._sub_scaled(p, d, self.lr, p, pointwise.work)
            return
        # NOTE: p's commit first: in a capture it then follows the ops that make new_p, and
        # they fuse into one chain (new_p never at full size) where the buffer's commit would
        # sit between them
        self._commit(pointwise.add_scaled(p, d, -self.lr, out=self._target(p, 3)), p)
        if self.momentum:
            self._commit(new_buf, buf)

    def _options(self) -> str:
        return (f"lr={self.lr}, momentum={self.momentum}, weight_decay={self.weight_decay}"
                + (", nesterov=True" if self.nesterov else ""))


class Adam(Optimizer):
    """Adam (Kingma and Ba 2015) with PyTorch's defaults and bias correction; weight_decay
    adds weight_decay * param to the gradient (L2, as torch.optim.Adam). Op for op PyTorch's
    CPU for-loop (Note [optimizers compute as PyTorch's do]): the moments have the
    parameter's dtype, and a float16 or bfloat16 parameter computes each op in float32.

    The bias corrections live on the device, in the parameters' compute dtype (float32 for
    two-byte parameters: bfloat16's 1 - beta2**t would round to 0): 1 - beta**t as 0-d tensors
    updated by ops at every step (c = c + (1 - beta) * (1 - c), which keeps c to float32's
    precision where beta**t would cancel), so a captured graph replays later steps correctly,
    like PyTorch's capturable Adam. One step count serves every parameter (`counts_steps`).
    """

    gated_updates = True
    counts_steps = True  # type: ignore[assignment]

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
        #: per compute dtype and device of the parameters, 0-d tensors of that dtype:
        #: 1 - beta1**t and 1 - beta2**t
        self._complements: list[tuple[Tensor, Tensor]] = []
        #: alongside, -lr / (1 - beta1**t) and sqrt(1 - beta2**t), made at each step's start
        self._factors: list[tuple[Tensor, Tensor]] = []

    def _prepare_shared(self) -> None:
        if self._complements:
            return
        complements, factors = [], []
        for like in _groups(self.params):
            dtype, device, allocator = _compute_dtype(like.dtype), like.device, like.block.allocator
            # NOTE: all made before any is kept, so a failed allocation leaves none half made
            # and the next prepare() makes them again (Note [the commit point])
            complements.append(tuple(tensor(np.zeros((), dtype), device=device,
                                            allocator=allocator) for _ in range(2)))
            factors.append(tuple(_allocated(empty((), dtype, device, allocator))
                                 for _ in range(2)))
        self._complements, self._factors = complements, factors
        for c, _ in complements:
            self._scratch(c, 2)  # NOTE: _begin's work

    def _prepare(self, p: Tensor, state: dict[str, Any]) -> None:
        super()._prepare(p, state)
        if "exp_avg" not in state:  # the moments start at zero
            state["exp_avg"], state["exp_avg_sq"] = self._zeros_like(p), self._zeros_like(p)
        self._scratch(p, 1)

    def _gated_scratch(self, p: Tensor) -> None:
        self._scratch(p, 2)
        for complements in self._complements:
            for index, c in enumerate(complements):
                self._scratch(c, index)

    def _begin(self) -> None:
        for complements, (step_size, root) in zip(self._complements, self._factors):
            new = []
            # NOTE: c + (1 - beta) * (1 - c): no cancellation, where 1 - beta**t would lose
            # float32's digits to it. The factors are written after the state (a graph's
            # commit point is its first write to state: before it they could change in a
            # step that fails)
            for index, (c, beta) in enumerate(zip(complements, self.betas)):
                rest = ops.sub(1.0, c, out=self._scratch(c, 2))
                rest = ops.mul(rest, 1 - beta, out=self._scratch(c, 2))
                new.append(ops.add(c, rest, out=self._target(c, index)))
            for made, c in zip(new, complements):
                self._commit(made, c)
            # PyTorch: step_size = lr / (1 - beta1**t), used negated; sqrt(1 - beta2**t). In a
            # skipped step made + gate may be NaN: so are the factors, and the updates, whose
            # commits keep the old values
            ops.div(-self.lr, new[0], out=step_size)
            ops.sqrt(new[1], out=root)

    def _update(self, p: Tensor, grad: Tensor, state: dict[str, Any]) -> None:
        # NOTE: PyTorch's _single_tensor_adam: g = grad + wd * p; m = lerp(m, g, 1 - beta1);
        # v = v * beta2, then + (1 - beta2) * g * g; denominator = sqrt(v) / sqrt(1 -
        # beta2**t) + eps (three ops); p = p + (-step_size) * m / denominator. Outside a gated
        # step _target is the state itself and _commit does nothing; in one, m and v are
        # committed before p reads them (a skipped step discards p's new value whatever it
        # read). Scratch 1 of p's dtype holds g, then the denominator (None while capturing).
        beta1, beta2 = self.betas
        m, v = state["exp_avg"], state["exp_avg_sq"]
        step_size, root = _shared_by_dtype(self._factors, p)
        pointwise, spare = self._pointwise(p), self._scratch(p, 1)
        g = grad
        if self.weight_decay:
            g = pointwise.add_scaled(grad, p, self.weight_decay, out=spare)
        self._commit(pointwise.lerp(m, g, 1 - beta1, out=self._target(m, 2)), m)
        new_v = ops.mul(v, beta2, out=self._target(v, 2))
        new_v = pointwise.addcmul(new_v, g, 1 - beta2, out=self._again(new_v))
        self._commit(new_v, v)
        denominator = ops.sqrt(v, out=spare)
        denominator = pointwise.divided(denominator, root, out=spare)
        denominator = ops.add(denominator, self.eps, out=spare)
        self._commit(pointwise.addcdiv(p, m, denominator, step_size, out=self._target(p, 2)), p)

    def state_tensors(self) -> list[Tensor]:
        return [*super().state_tensors(), *(c for pair in self._complements for c in pair)]

    def _options(self) -> str:
        return (f"lr={self.lr}, betas={self.betas}, eps={self.eps}, "
                f"weight_decay={self.weight_decay}")


# ---------------------------------------------------------------------- more than one process
# NOTE: the machinery is runtime/parallel.py (Note [buckets in backward]); these are its faces
class DistributedDataParallel(Module):
    """`module` trained data-parallel across `group` (`runtime.distributed.init()`): each rank
    runs it on its own part of the batch, and the gradients are averaged across the ranks
    during backward, in buckets of at most `bucket_cap_mb` MiB (PyTorch DDP's default 25),
    each bucket's non-blocking all-reduce started as soon as its last gradient is ready
    (Note [buckets in backward] in runtime/parallel.py). Rank 0's parameters are broadcast to
    every rank first, so the ranks start, and stay, bit for bit the same. An optimizer over
    `ddp.parameters()` (the module's) then takes the same step on every rank.

    `zero_stage` 1 or 2 shards the optimizer state (1) and the gradients too (2) across the
    ranks, ZeRO's stages: use it with `ZeroRedundancyOptimizer(ddp, nn.Adam, ...)`, which
    updates this rank's shard and gathers the parameters.

    Inside `runtime.graph`, each bucket's all-reduce is an instruction of the plan and its
    buffer is placed by the static plan (Note [collectives in a plan] in
    runtime/parallel.py); under ZeRO its reduce-scatter, and the gather of the shards too
    (Note [ZeRO in a plan]).

    Launched as `mpiexec -n N python train.py` (docs/distributed.md). A failed or lost rank
    makes the others raise within the group's timeout, before any write to state (Note [a
    collective never hangs] in runtime/distributed.py).

    Example:
        >>> import runtime
        >>> from runtime import distributed, nn
        >>> group = distributed.init()
        >>> model = nn.Sequential(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 3))
        >>> ddp = nn.DistributedDataParallel(model, group)
        >>> step = runtime.graph(nn.train_step(ddp, nn.SGD(ddp.parameters(), lr=0.1)))
    """

    def __init__(self, module: Module, group: Any, bucket_cap_mb: float = 25.0,
                 zero_stage: int = 0) -> None:
        super().__init__()
        from runtime import distributed, parallel

        if not isinstance(module, Module):
            raise TypeError(f"DistributedDataParallel wraps a Module, got {_brief(module)}")
        if not isinstance(group, distributed.Group):
            raise TypeError(f"DistributedDataParallel: group must be a distributed.Group "
                            f"(distributed.init()), got {_brief(group)}")
        cap = _check_number("DistributedDataParallel: bucket_cap_mb", bucket_cap_mb, 0.0,
                            low_open=True)
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"DistributedDataParallel: zero_stage is 0 (data parallel), 1 "
                             f"(optimizer state sharded) or 2 (gradients too), got "
                             f"{zero_stage!r}")
        self.module = module
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "zero_stage", zero_stage)
        params = module.parameters()
        if not params:
            raise ValueError("DistributedDataParallel: the module has no parameters")
        parallel.broadcast_parameters(params, group)
        object.__setattr__(self, "reducer",
                           parallel.Reducer(params, group, max(1, int(cap * (1 << 20))),
                                            stage=zero_stage))

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def memory_report(self, optimizer: Any = None) -> dict[str, int]:
        """This rank's memory for training, in bytes: `parameter_bytes`; `gradient_bytes`,
        the gradients a step keeps (`.grad` of the parameters, or of the shards under ZeRO);
        `bucket_bytes`, the host buffers of the buckets (kept from step to step; under ZeRO
        one bucket's, or two while one is incomplete, and this rank's parts);
        `optimizer_state_bytes` of `optimizer` (its state tensors: momentum, Adam's moments);
        and `rank`, `size`, `zero_stage`, `buckets`, `largest_bucket_bytes`."""
        reducer = self.reducer
        params = self.module.parameters()
        if self.zero_stage:
            grads = [s.grad for s in reducer.shards]
        else:
            grads = [p.grad for p in params]
        report = {"rank": self.group.rank, "size": self.group.size,
                  "zero_stage": self.zero_stage, "buckets": len(reducer.buckets),
                  "largest_bucket_bytes": max(b.nbytes for b in reducer.buckets),
                  "parameter_bytes": sum(p.nbytes for p in params),
                  "gradient_bytes": sum(g.nbytes for g in grads if g is not None),
                  "bucket_bytes": reducer.buffer_bytes(),
                  "optimizer_state_bytes": 0}
        if optimizer is not None:
            inner = getattr(optimizer, "optimizer", optimizer)
            report["optimizer_state_bytes"] = sum(
                t.nbytes for state in inner.state.values() for t in state.values()
                if isinstance(t, Tensor))
        return report

    def extra_repr(self) -> str:
        return (f"rank={self.group.rank}, size={self.group.size}, "
                f"buckets={len(self.reducer.buckets)}, zero_stage={self.zero_stage}")


class ZeroRedundancyOptimizer:
    """ZeRO's sharded optimizer over a `DistributedDataParallel(..., zero_stage=1 or 2)`:
    `optimizer_class(shards, **options)` keeps the state of this rank's shards only (1/N of
    it), and `step()` updates them, then all-gathers every rank's shards and writes the
    module's parameters, once every bucket has arrived (all of them or none: Note [the
    commit point]). The results equal data parallel's with `optimizer_class` over every
    parameter: the optimizers here are elementwise. `train_step(ddp, opt)` takes it as an
    optimizer.

    Example:
        >>> from runtime import distributed, nn
        >>> model = nn.Sequential(nn.Dense(4, 3))
        >>> ddp = nn.DistributedDataParallel(model, distributed.init(), zero_stage=2)
        >>> opt = nn.ZeroRedundancyOptimizer(ddp, nn.Adam, lr=1e-3)
    """

    def __init__(self, ddp: DistributedDataParallel, optimizer_class: type, **options: Any
                 ) -> None:
        if not isinstance(ddp, DistributedDataParallel) or not ddp.zero_stage:
            raise ValueError(f"ZeroRedundancyOptimizer takes a DistributedDataParallel made "
                             f"with zero_stage=1 or 2, got {_brief(ddp)}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be an Optimizer "
                            f"class (nn.SGD, nn.Adam), got {_brief(optimizer_class)}")
        self.ddp = ddp
        #: the optimizer of this rank's shard parameters
        self.optimizer = optimizer_class(ddp.reducer.make_shards(), **options)

    @property
    def params(self) -> list[Tensor]:
        return self.optimizer.params

    @property
    def state(self) -> dict[int, dict[str, Any]]:
        return self.optimizer.state

    def prepare(self) -> None:
        """`Optimizer.prepare` of the shards' optimizer (Note [the commit point])."""
        self.optimizer.prepare()

    def step(self) -> None:
        """Update this rank's shards, then gather every rank's into the parameters. If the
        gather fails (another rank failed or died), the shards and their optimizer state are
        put back as they were before the step, so the whole step is undone on this rank
        (Note [ZeRO's commit point is the gather])."""
        if all(p.grad is None for p in self.optimizer.params):
            return
        if tape.active() is not None:  # NOTE: Note [ZeRO in a plan] in runtime/parallel.py
            targets = self._written()
            token = self.ddp.reducer.record_save(targets)
            self.optimizer.step()
            self.ddp.reducer.record_gather(targets, token)
            return
        saved = self._saved()
        try:
            self.optimizer.step()
            self.ddp.reducer.gather()
        except BaseException:
            self._restore(saved)
            raise

    # Note [ZeRO's commit point is the gather]: under ZeRO a rank steps its own shard and that
    # shard's optimizer state before the all-gather that brings every rank's shard into the
    # parameters. The parameters are written only once every bucket has arrived (all or
    # none), but the shard and its state have moved by then: if the gather fails, the shard
    # would be one step ahead of the parameters, and a retried step would apply the update
    # twice, while the error says the step stopped before its first write. So a step keeps a
    # host copy of what it may write on this rank (the shards, their optimizer state, the state
    # they share such as Adam's bias corrections, and its step counts: 1/N of the parameters
    # and of the state) and puts it back when the step fails; the copy is dropped when the step
    # returns. Inside a graph too (Note [ZeRO in a plan] in runtime/parallel.py).
    def _written(self) -> list[Tensor]:
        """What a step may write on this rank: the shards and their optimizer's state tensors
        (Adam's shared bias corrections among them)."""
        return [*self.optimizer.params, *self.optimizer.state_tensors()]

    def _saved(self) -> tuple:
        opt = self.optimizer
        return ([(t, t.numpy().copy()) for t in self._written()],
                {key: dict(entry) for key, entry in opt.state.items()}, opt._taken,
                dict(opt._counts))

    def _restore(self, saved: tuple) -> None:
        copies, state, taken, counts = saved
        opt = self.optimizer
        opt.state.update(state)  # NOTE: the entries as they were, tensors and numbers
        with no_grad():
            for t, host in copies:
                t[...] = host
        opt._taken, opt._counts = taken, counts

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self.optimizer!r}, stage {self.ddp.zero_stage}, "
                f"rank {self.ddp.group.rank} of {self.ddp.group.size})")


__all__ += ["DistributedDataParallel", "ZeroRedundancyOptimizer"]
