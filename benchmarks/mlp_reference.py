"""The MLP training step of the training benchmark, and its contenders.

The model: `depth` hidden Dense layers of `width` x `width` (input features = `width`), each
followed by a ReLU, then one Dense classifier layer `width` -> 10 classes (so `depth + 1` Dense
layers in all). Weights are stored as PyTorch stores them, `(out_features, in_features)`, so a
layer computes `x @ W.T + b`. Everything is float32.

One training step on a fixed batch `x` (batch, width) with integer labels (batch,): forward, softmax
cross-entropy loss (mean over the batch), backward, plain SGD update `p -= lr * grad` (no momentum,
no weight decay). Initial weights are PyTorch's default for `nn.Linear`: uniform(-1/sqrt(fan_in),
1/sqrt(fan_in)) for weight and bias, drawn from one seeded `numpy.random.Generator`, so every
contender starts from the same weights and trains on the same batch.

A contender is a factory `make(params, x, labels, lr) -> Trainer`: it copies the given NumPy
weights into its own representation (the caller's arrays are never written) and returns a
`Trainer` whose `step()` runs one training step and returns the loss as a Python float (so the
step has completed when it returns), whose `params()` returns the current weights as NumPy
copies for correctness checks, and whose `settled()`, if any, says whether the warm-up its own
first steps need is over (blockrt's: measuring its CBLAS). Contenders:

- `numpy-naive`: the plain NumPy reference (`reference_step`), a fresh array for every result;
- `numpy-prealloc`: hand-written NumPy with every buffer allocated once (the practical limit);
- `torch`: PyTorch CPU eager, `nn.Linear` layers, `F.cross_entropy`, SGD as `optim.SGD` runs it;
- `torch-compile`: the same step under `torch.compile` (PyTorch's captured mode: TorchDynamo and
  Inductor, which needs a C++ compiler; the first call compiles, about 30 s here);
- `blockrt-eager`: blockrt's autograd and `runtime.nn`, eager.
- `blockrt-none`, `blockrt-recycle`, `blockrt-static`, `blockrt-static-sqrt`: the same step
  captured by `runtime.graph` under each memory plan (the last with checkpoint="sqrt"), on the
  CBLAS that blockrt picks (`backends/_blas.py`: where MKL and NumPy's OpenBLAS are both here,
  the one measured faster on the step's own products in the first steps);
- `blockrt-static-openblas`, `blockrt-static-mkl`, `blockrt-eager-openblas`,
  `blockrt-eager-mkl`: `blockrt-static` and `blockrt-eager` with that library for every product
  (their processes run with BLOCKRT_BLAS set, `CONTENDER_ENV`), to show what the choice is worth;
- `blockrt-static-mixed`: `blockrt-static` with each product shape on the library that was the
  faster for that shape alone (as measured by the choice), the mix that Note [one thread pool
  per process] in backends/_blas_choice.py rules out; shown side by side to keep it honest.
- `tinygrad`: tinygrad on its CPU device, the step under `TinyJit` (needs tinygrad and a clang).

Optional dependencies (torch, tinygrad, blockrt's nn) are imported inside their factory only; a
factory whose dependency is missing raises `ContenderUnavailable` with the reason.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from blockrt.models import CLASSES, MLPConfig
from blockrt.models import CONFIGS as CONFIGS_ALL

LR = 0.01

Params = list[tuple[np.ndarray, np.ndarray]]  # [(weight (out, in), bias (out,)), ...]


#: The configurations bench_train times (blockrt.models defines them, and D, for the graphs).
CONFIGS = {name: CONFIGS_ALL[name] for name in ("S", "M", "L")}
# NOTE: `--quick` and the correctness check use these; the same code paths, sizes of no cost
QUICK_CONFIGS = {
    "S": MLPConfig(batch=16, width=32, depth=8),
    "M": MLPConfig(batch=32, width=64, depth=4),
    "L": MLPConfig(batch=64, width=128, depth=4),
}
CHECK_CONFIG = MLPConfig(batch=8, width=16, depth=3)
# Largest absolute differences from the reference that `check_against_reference` accepts, after
# 3 steps at CHECK_CONFIG: float32 rounding in a different summation order (losses are about 2.3,
# weights about 0.25, and 3 steps move a weight by up to about 5e-3).
LOSS_ATOL = 1e-5
PARAM_ATOL = 1e-6


class ContenderUnavailable(RuntimeError):
    """A contender's optional dependency is missing; the message says which and why."""


class Trainer(NamedTuple):
    """What a contender factory returns.

    `step()` runs one training step and returns the loss (before the update) as a float;
    `params()` returns the current weights as NumPy copies, in the layout of `Params`.
    """

    step: Callable[[], float]
    params: Callable[[], Params]
    #: what a contender built on another may reuse (make_torch's model and tensors), or None
    state: Any = None
    #: whether its own warm-up is over (blockrt's: the CBLAS chosen); None: nothing to wait for
    settled: Callable[[], bool] | None = None


def init_params(config: MLPConfig, seed: int = 0) -> Params:
    """PyTorch-style initial weights: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), float32."""
    rng = np.random.default_rng(seed)

    def uniform(shape: tuple[int, ...], bound: float) -> np.ndarray:
        # NOTE: drawn in float32 and scaled in place, so that no float64 or temporary copy of a
        # 64 MiB weight raises the process's peak memory (ru_maxrss) before training starts
        values = rng.random(shape, dtype=np.float32)
        values *= 2 * bound
        values -= bound
        return values

    shapes = [(config.width, config.width)] * config.depth + [(CLASSES, config.width)]
    params = []
    for out_features, in_features in shapes:
        bound = 1.0 / math.sqrt(in_features)
        weight = uniform((out_features, in_features), bound)
        params.append((weight, uniform((out_features,), bound)))
    return params


def make_batch(config: MLPConfig, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """A standard-normal float32 batch (batch, width) and int64 labels in [0, 10)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((config.batch, config.width), dtype=np.float32)
    labels = rng.integers(0, CLASSES, config.batch, dtype=np.int64)
    return x, labels


def copy_params(params: Params) -> Params:
    """Fresh copies of every weight and bias."""
    return [(weight.copy(), bias.copy()) for weight, bias in params]


# --- the plain NumPy reference -----------------------------------------------------------------


def reference_step(params: Params, x: np.ndarray, labels: np.ndarray, lr: float = LR) -> float:
    """One training step written the obvious way; updates `params` in place, returns the loss."""
    # Forward, keeping every layer's input for the backward pass.
    inputs = []
    a = x
    for i, (weight, bias) in enumerate(params):
        inputs.append(a)
        a = a @ weight.T + bias
        if i < len(params) - 1:
            a = np.maximum(a, 0)
    # Softmax cross-entropy, mean over the batch, and its gradient with respect to the logits.
    shifted = a - a.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    rows = np.arange(len(labels))
    loss = -log_probs[rows, labels].mean()
    grad = np.exp(log_probs)
    grad[rows, labels] -= 1
    grad /= len(labels)
    # Backward, last layer first; every gradient is computed before its layer is updated.
    for i in reversed(range(len(params))):
        weight, bias = params[i]
        grad_weight = grad.T @ inputs[i]
        grad_bias = grad.sum(axis=0)
        if i > 0:
            grad = (grad @ weight) * (inputs[i] > 0)
        weight -= lr * grad_weight
        bias -= lr * grad_bias
    return float(loss)


def make_numpy_naive(params: Params, x: np.ndarray, labels: np.ndarray,
                     lr: float = LR) -> Trainer:
    """The plain NumPy reference as a contender: a fresh array for every intermediate."""
    own = copy_params(params)
    return Trainer(step=lambda: reference_step(own, x, labels, lr),
                   params=lambda: copy_params(own))


# --- hand-written NumPy with preallocated buffers ----------------------------------------------


def make_numpy_prealloc(params: Params, x: np.ndarray, labels: np.ndarray,
                        lr: float = LR) -> Trainer:
    """Hand-written NumPy training step; every buffer is allocated here, once.

    Each step runs only `out=` and in-place ufuncs and matmuls: no array is allocated but a few
    of batch x 10 in the loss (NumPy's fancy indexing). The learning rate is folded into the
    loss gradient: backprop is linear in the upstream gradient and ReLU masks do not depend on
    its scale, so every gradient comes out already multiplied by `lr` and the update is one
    in-place subtraction per parameter.
    """
    own = copy_params(params)
    batch = x.shape[0]
    widths = [weight.shape[0] for weight, _ in own]
    acts = [np.empty((batch, width), np.float32) for width in widths]  # layer outputs
    grads = [np.empty((batch, width), np.float32) for width in widths]  # d loss / d output
    masks = [np.empty((batch, width), bool) for width in widths[:-1]]  # output <= 0 (ReLU off)
    grad_weights = [np.empty_like(weight) for weight, _ in own]
    grad_biases = [np.empty_like(bias) for _, bias in own]
    row_max = np.empty((batch, 1), np.float32)
    row_sum = np.empty((batch, 1), np.float32)
    rows = np.arange(batch)
    last = len(own) - 1

    def step() -> float:
        # Forward: a_i = relu(a_{i-1} @ W_i.T + b_i), in place in acts[i].
        a = x
        for i, (weight, bias) in enumerate(own):
            np.matmul(a, weight.T, out=acts[i])
            np.add(acts[i], bias, out=acts[i])
            if i < last:
                np.maximum(acts[i], 0, out=acts[i])
            a = acts[i]
        # Loss: log-softmax of the logits into grads[last], then lr * (softmax - onehot) / batch.
        logits, grad = acts[last], grads[last]
        np.max(logits, axis=1, keepdims=True, out=row_max)
        np.subtract(logits, row_max, out=grad)
        np.exp(grad, out=logits)  # the logits are not needed any more
        np.sum(logits, axis=1, keepdims=True, out=row_sum)
        np.log(row_sum, out=row_sum)
        np.subtract(grad, row_sum, out=grad)  # log-probabilities
        loss = -float(grad[rows, labels].mean())
        np.exp(grad, out=grad)
        grad[rows, labels] -= 1.0
        np.multiply(grad, lr / batch, out=grad)
        # Backward, last layer first: weight and bias gradients, the input gradient masked by
        # the previous ReLU, then the update (after the input gradient has used the old weight).
        for i in range(last, -1, -1):
            weight, bias = own[i]
            layer_input = acts[i - 1] if i > 0 else x
            np.matmul(grads[i].T, layer_input, out=grad_weights[i])
            np.sum(grads[i], axis=0, out=grad_biases[i])
            if i > 0:
                np.matmul(grads[i], weight, out=grads[i - 1])
                np.less_equal(acts[i - 1], 0, out=masks[i - 1])
                np.copyto(grads[i - 1], 0.0, where=masks[i - 1])
            np.subtract(weight, grad_weights[i], out=weight)
            np.subtract(bias, grad_biases[i], out=bias)
        return loss

    return Trainer(step=step, params=lambda: copy_params(own))


# --- PyTorch CPU eager -------------------------------------------------------------------------


def make_torch(params: Params, x: np.ndarray, labels: np.ndarray, lr: float = LR) -> Trainer:
    """PyTorch CPU eager: `nn.Linear` layers, `F.cross_entropy`, SGD by hand under `no_grad`.

    The step is written as PyTorch users write it: `zero_grad()` (gradients set to None, so they
    are allocated anew each step), forward, loss, `backward()`, update. The update is the loop
    `torch.optim.SGD` runs on CPU tensors (`p.add_(p.grad, alpha=-lr)`; no foreach or fused
    kernels there); creating a `torch.optim` optimizer imports torch._dynamo, 1.3 s here.
    """
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        raise ContenderUnavailable(f"torch is not importable ({e}); "
                                   "pip install torch==2.13.0 for the CPU build") from e
    layers: list[torch.nn.Module] = []
    for i, (weight, bias) in enumerate(params):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0])
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(weight))
            linear.bias.copy_(torch.from_numpy(bias))
        layers.append(linear)
        if i < len(params) - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    parameters = list(model.parameters())
    tx, tlabels = torch.from_numpy(x), torch.from_numpy(labels)

    def step() -> float:
        model.zero_grad()
        loss = F.cross_entropy(model(tx), tlabels)
        loss.backward()
        with torch.no_grad():
            for parameter in parameters:
                parameter.add_(parameter.grad, alpha=-lr)
        return loss.item()

    def current() -> Params:
        linears = [layer for layer in model if isinstance(layer, torch.nn.Linear)]
        return [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy())
                for m in linears]

    return Trainer(step=step, params=current, state=(model, parameters, tx, tlabels))


def make_torch_compile(params: Params, x: np.ndarray, labels: np.ndarray,
                       lr: float = LR) -> Trainer:
    """PyTorch's captured mode: `make_torch`'s step (gradients set to None, forward, loss,
    backward, the SGD update) as one function under `torch.compile` (TorchDynamo captures it,
    AOTAutograd the backward, Inductor compiles both with the C++ compiler); the first call
    compiles. ContenderUnavailable where torch or its compiler is missing."""
    import shutil

    eager = make_torch(params, x, labels, lr)
    import torch
    import torch.nn.functional as F

    if shutil.which("g++") is None and shutil.which("c++") is None:
        raise ContenderUnavailable("torch.compile's Inductor needs a C++ compiler (g++)")
    model, parameters, tx, tlabels = eager.state

    def train_step() -> Any:
        for parameter in parameters:
            parameter.grad = None
        loss = F.cross_entropy(model(tx), tlabels)
        loss.backward()
        with torch.no_grad():
            for parameter in parameters:
                parameter.add_(parameter.grad, alpha=-lr)
        return loss

    compiled = torch.compile(train_step)
    return Trainer(step=lambda: compiled().item(), params=eager.params)


# --- blockrt, eager ----------------------------------------------------------------------------


def _blockrt_model(params: Params, lr: float) -> tuple[Any, Any, list[Any]]:
    """blockrt's `nn.Sequential` of `nn.Dense` and `nn.ReLU` holding `params`, and plain SGD.
    ContenderUnavailable where blockrt is not importable or BLOCKRT_BLAS names a library that
    is not here."""
    try:
        from backends import _blas
        from runtime import nn  # noqa: F401  (importable: blockrt_model needs it)
    except ImportError as e:
        raise ContenderUnavailable(f"blockrt's nn is not importable ({e})") from e
    try:
        _blas.find()
    except RuntimeError as e:  # e.g. BLOCKRT_BLAS=mkl without MKL
        raise ContenderUnavailable(str(e)) from e
    return blockrt_model(params, lr)


def blockrt_model(params: Params, lr: float = LR, device: Any = None) -> tuple[Any, Any, list[Any]]:
    """blockrt's `nn.Sequential` of `nn.Dense` and `nn.ReLU` on `device` holding `params`
    (a copy), plain SGD over it, and its Dense layers."""
    import runtime
    from runtime import nn

    layers = []
    for i, (weight, bias) in enumerate(params):
        dense = nn.Dense(weight.shape[1], weight.shape[0], device=device)
        with runtime.no_grad():
            dense.weight[...] = weight
            dense.bias[...] = bias
        layers.append(dense)
        if i < len(params) - 1:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    return model, nn.SGD(model.parameters(), lr=lr), layers[::2]


def typed_step(config: MLPConfig, dtype: str, graph: bool = False,
               device: Any = None) -> Callable[[], Any]:
    """A call running one plain SGD step (`nn.train_step`) of the config's blockrt MLP with
    every tensor in `dtype` on `device`, eager or captured by `runtime.graph`, returning the
    loss tensor (the same seeds every time; bench_half's and bench_opencl's half steps)."""
    import runtime
    from runtime import nn

    rng = np.random.default_rng(0)
    widths = [config.width] * (config.depth + 1) + [CLASSES]
    layers: list[Any] = []
    for i in range(config.depth + 1):
        layers.append(nn.Dense(widths[i], widths[i + 1], dtype=dtype, rng=i, device=device))
        if i < config.depth:
            layers.append(nn.ReLU())
    model = nn.Sequential(*layers)
    step = nn.train_step(model, nn.SGD(model.parameters(), lr=0.01))
    x = runtime.tensor(rng.normal(0, 1, (config.batch, config.width)), dtype=dtype,
                       device=device)
    y = runtime.tensor(rng.integers(0, CLASSES, config.batch), device=device)
    run = runtime.graph(step, device=device) if graph else step
    return lambda: run(x, y)


def _current(denses: list[Any]) -> Callable[[], Params]:
    return lambda: [(dense.weight.numpy().copy(), dense.bias.numpy().copy()) for dense in denses]


def make_blockrt_eager(params: Params, x: np.ndarray, labels: np.ndarray,
                       lr: float = LR) -> Trainer:
    """blockrt eager: `nn.Sequential` of `nn.Dense` and `nn.ReLU`, `nn.softmax_cross_entropy`,
    `nn.SGD`, on the default ("cpu") device and default allocator."""
    import runtime
    from runtime import nn

    model, opt, denses = _blockrt_model(params, lr)
    tx, tlabels = runtime.tensor(x), runtime.tensor(labels)

    def step() -> float:
        opt.zero_grad()
        loss = nn.softmax_cross_entropy(model(tx), tlabels)
        loss.backward()
        opt.step()
        return float(loss.item())

    return Trainer(step=step, params=_current(denses), settled=_settled)


def blockrt_graph(plan: str, checkpoint: str | None = None) -> Callable[..., Trainer]:
    """A factory for blockrt's step captured by `runtime.graph(plan=..., checkpoint=...)`: the
    step ends with `opt.zero_grad()`, so gradients are intermediates the plan places."""
    def make(params: Params, x: np.ndarray, labels: np.ndarray, lr: float = LR) -> Trainer:
        model, opt, denses = _blockrt_model(params, lr)
        import runtime
        from runtime import nn

        graph = runtime.graph(nn.train_step(model, opt), plan=plan, checkpoint=checkpoint)
        tx, tlabels = runtime.tensor(x), runtime.tensor(labels)

        def step() -> float:
            return float(graph(tx, tlabels).item())

        return Trainer(step=step, params=_current(denses), settled=_settled)

    make.__doc__ = f"blockrt's step under runtime.graph(plan={plan!r}, checkpoint={checkpoint!r})"
    return make


class _PerShape:
    """A route for the CPU device's products (called as `backends._blas.Gemm` is): while
    `chooser` measures, its own; once it has decided, each product shape it timed on the
    library that was the faster for that shape alone, and the rest as the chooser runs them."""

    products = True

    def __init__(self, chooser: Any) -> None:
        from backends._blas_choice import product_of, run

        self._product_of, self._run = product_of, run
        self.chooser = chooser
        self.path = chooser.path
        #: (a's and b's shapes and strides, accumulates) -> its product, while measuring
        self.layouts: dict[tuple, Any] = {}
        #: the same keys -> the library for them, once decided
        self.by_shape: dict[tuple, Any] | None = None

    @property
    def summary(self) -> str:
        if self.by_shape is None:
            return f"per shape, {self.chooser.state}"
        counts: dict[str, int] = {}
        for library in self.by_shape.values():
            counts[library.name] = counts.get(library.name, 0) + 1
        return "per shape: " + ", ".join(f"{name} for {count} layouts"
                                         for name, count in sorted(counts.items()))

    def __call__(self, a: np.ndarray, b: np.ndarray, c: np.ndarray, alpha: float,
                 beta: float) -> bool:
        key = (a.shape, a.strides, b.shape, b.strides, beta != 0.0)
        if self.by_shape is None:
            if self.chooser.decision is None:
                self.layouts[key] = self._product_of(a, b, c, beta != 0.0)
                return self.chooser(a, b, c, alpha, beta)
            self._split()
        library = self.by_shape.get(key)
        if library is None:
            return self.chooser(a, b, c, alpha, beta)
        return self._run(library, a, b, c, alpha, beta)

    def _split(self) -> None:
        libraries = {lib.name: lib for lib in self.chooser.libraries}
        fastest = {}
        for product, _, times, _ in self.chooser.table():
            timed = [(t, name) for name, t in times.items() if t is not None]
            if len(timed) == len(libraries):
                fastest[product] = libraries[min(timed)[1]]
        self.by_shape = {key: fastest[product] for key, product in self.layouts.items()
                         if product in fastest}


def make_blockrt_static_mixed(params: Params, x: np.ndarray, labels: np.ndarray,
                              lr: float = LR) -> Trainer:
    """`blockrt-static` whose products, once the measured choice is made, each run on the
    library that was the faster for their shape alone (ContenderUnavailable where there is
    no choice: one library, or BLOCKRT_BLAS set)."""
    from backends import _blas

    trainer = blockrt_graph("static")(params, x, labels, lr)
    chooser = _blas.report().chooser
    if chooser is None:
        raise ContenderUnavailable("needs two CBLAS libraries and BLOCKRT_BLAS=auto")
    route = _blas._found[0] = _PerShape(chooser)
    return trainer._replace(settled=lambda: route.by_shape is not None or not chooser.measuring)


def blas_summary() -> str:
    """The CBLAS this process's blockrt products run on and how it was chosen."""
    from backends import _blas

    route = _blas.find()
    return route.summary if isinstance(route, _PerShape) else _blas.report().summary


def _settled() -> bool:
    """Whether this process is done measuring which CBLAS runs its products."""
    from backends import _blas

    chooser = _blas.report().chooser
    return chooser is None or not chooser.measuring


# --- tinygrad ----------------------------------------------------------------------------------


def make_tinygrad(params: Params, x: np.ndarray, labels: np.ndarray, lr: float = LR,
                  jit: bool = True) -> Trainer:
    """tinygrad on its CPU device: `Tensor.linear` and `relu` layers holding the weights in
    PyTorch's layout, `sparse_categorical_crossentropy` (mean), `nn.optim.SGD`, the step as
    tinygrad trains: under `Context(TRAINING=1)`, `zero_grad()`, forward, loss, `backward()`,
    then `loss.realize(*opt.schedule_step())` (what `opt.step()` realizes, and the loss, in one
    schedule), wrapped in `TinyJit` (kernels captured on the second call, replayed after;
    `jit=False` runs the same step eagerly, scheduled anew each call).

    tinygrad's CPU device compiles its kernels (and, in 0.14, its worker thread's programs when
    the device opens) with the C compiler named by `CC`, default `clang`; where `CC` is unset
    and there is no `clang` but a versioned `clang-N` (Debian's `clang-14` package installs
    only that name), `CC` is set to the newest. `NUM_CPU_THREADS` (tinygrad's split of a kernel
    over cores) is set to `OMP_NUM_THREADS` where that is set and it is not. Every tensor is
    placed on "CPU" explicitly, so a GPU tinygrad could pick by default is not used.
    """
    import glob
    import os
    import shutil

    if not os.environ.get("CC") and shutil.which("clang") is None:
        versioned = [os.path.basename(path) for directory in os.get_exec_path()
                     for path in glob.glob(os.path.join(directory, "clang-[0-9]*"))
                     if os.path.basename(path)[len("clang-"):].isdigit()]
        if versioned:
            os.environ["CC"] = max(versioned, key=lambda name: int(name[len("clang-"):]))
    compiler = os.environ.get("CC") or "clang"
    if shutil.which(compiler) is None:
        raise ContenderUnavailable(f"tinygrad's CPU device compiles with {compiler!r} (CC), which "
                                   "is not on PATH; install clang (apt-get install clang) or set "
                                   "CC to a clang")
    if "OMP_NUM_THREADS" in os.environ:
        os.environ.setdefault("NUM_CPU_THREADS", os.environ["OMP_NUM_THREADS"])
    try:
        from tinygrad import Device, Tensor, TinyJit
        from tinygrad.helpers import Context
        from tinygrad.nn.optim import SGD
    except ImportError as e:
        raise ContenderUnavailable(f"tinygrad is not importable ({e}); "
                                   "pip install tinygrad (0.14.0 measured)") from e
    device = "CPU"
    try:
        Device[device]  # opening it compiles the worker's programs with CC
    except Exception as e:  # what the compiler or loader raised
        raise ContenderUnavailable(f"tinygrad's CPU device does not open here ({e!r})") from e

    def on_device(array: np.ndarray) -> Any:
        # NOTE: Tensor(ndarray) wraps the array; realize() copies it into a CPU-device buffer,
        # so the caller's arrays are only read
        return Tensor(array, device=device).contiguous().realize()

    weights = [on_device(weight) for weight, _ in params]
    biases = [on_device(bias) for _, bias in params]
    tx, tlabels = on_device(x), on_device(labels.astype(np.int32))
    opt = SGD([t for pair in zip(weights, biases) for t in pair], lr=lr)
    last = len(weights) - 1

    def train_step(xb: Any, yb: Any) -> Any:
        opt.zero_grad()
        a = xb
        for i, (weight, bias) in enumerate(zip(weights, biases)):
            a = a.linear(weight.transpose(), bias)
            if i < last:
                a = a.relu()
        loss = a.sparse_categorical_crossentropy(yb)
        loss.backward()
        return loss.realize(*opt.schedule_step())

    run = TinyJit(train_step) if jit else train_step

    def step() -> float:
        with Context(TRAINING=1):
            loss = run(tx, tlabels)
        # NOTE: backward() gives every live float tensor a gradient, the batch too; dropped so
        # that its lazy graph does not grow step by step (it is never realized)
        tx.grad = None
        return float(loss.item())

    def current() -> Params:
        return [(weight.numpy().copy(), bias.numpy().copy())
                for weight, bias in zip(weights, biases)]

    return Trainer(step=step, params=current)


CONTENDERS: dict[str, Callable[..., Trainer]] = {
    "numpy-naive": make_numpy_naive,
    "numpy-prealloc": make_numpy_prealloc,
    "torch": make_torch,
    "torch-compile": make_torch_compile,
    "blockrt-eager": make_blockrt_eager,
    "blockrt-eager-openblas": make_blockrt_eager,
    "blockrt-eager-mkl": make_blockrt_eager,
    "blockrt-none": blockrt_graph("none"),
    "blockrt-recycle": blockrt_graph("recycle"),
    "blockrt-static": blockrt_graph("static"),
    "blockrt-static-sqrt": blockrt_graph("static", "sqrt"),
    "blockrt-static-openblas": blockrt_graph("static"),
    "blockrt-static-mkl": blockrt_graph("static"),
    "blockrt-static-mixed": make_blockrt_static_mixed,
    "tinygrad": make_tinygrad,
}


#: Environment variables a contender's process needs set before blockrt loads.
CONTENDER_ENV: dict[str, dict[str, str]] = {
    f"blockrt-{mode}-{library}": {"BLOCKRT_BLAS": library}
    for mode in ("static", "eager") for library in ("openblas", "mkl")}


def check_against_reference(make: Callable[..., Trainer], config: MLPConfig = CHECK_CONFIG,
                            steps: int = 3) -> dict[str, float]:
    """Train `steps` steps with `make` and with `reference_step` from the same start.

    Returns the largest absolute difference of the losses ("loss") and of any weight or bias
    after the last step ("params"), and the largest parameter change the training made
    ("moved", to show the comparison is not of two untouched copies).
    """
    start = init_params(config)
    x, labels = make_batch(config)
    trainer = make(start, x, labels, LR)
    reference = copy_params(start)
    loss_diff = 0.0
    for _ in range(steps):
        loss_diff = max(loss_diff, abs(trainer.step() - reference_step(reference, x, labels)))
    ours = trainer.params()
    param_diff = max(float(np.max(np.abs(a - b)))
                     for pair, ref in zip(ours, reference) for a, b in zip(pair, ref))
    moved = max(float(np.max(np.abs(a - b)))
                for pair, ref in zip(start, reference) for a, b in zip(pair, ref))
    return {"loss": loss_diff, "params": param_diff, "moved": moved}
