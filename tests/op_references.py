"""What each elementwise op of backends/optable.py computes, written independently of its
formula: the reference its generated tests hold every backend and dtype to (tests/
test_optable.py, and the kernel tests of test_backends, test_opencl and test_ops). An op added
to the table needs one entry here, and nothing else, to be tested (Note [one declaration per
op] in backends/optable.py); test_every_op_has_a_reference fails until it has one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _relu(x: np.ndarray) -> np.ndarray:
    """+0 where x < 0, else x itself (Note [relu's zero] in backends/base.py)."""
    return np.where(x < 0, np.zeros_like(x), x)


def _sign(x: np.ndarray) -> np.ndarray:
    """PyTorch's sign of a real tensor's gradient (sgn): 0 at 0 and at NaN."""
    return np.where(x > 0, 1.0, np.where(x < 0, -1.0, 0.0))


def _gelu_tanh_slope(x: np.ndarray) -> np.ndarray:
    """d/dx of 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x**3), by the product and
    chain rules (written from the formula, not from PyTorch's kernel)."""
    c = math.sqrt(2 / math.pi)
    t = np.tanh(c * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t ** 2) * c * (1 + 3 * 0.044715 * x ** 2)


@dataclass(frozen=True)
class Reference:
    """An op's reference.

    Attributes:
        numpy: the op in float64 NumPy on arrays (bool ones for a condition).
        torch: the op in PyTorch on tensors (public ops), or None.
        domain: where its values are drawn for value and gradient tests: "any", "positive"
            (log, sqrt), or "apart" (kinks and ties kept a step away: relu, abs, maximum).
    """

    numpy: Callable[..., Any]
    torch: Callable[..., Any] | None = None
    domain: str = "any"


REFERENCES: dict[str, Reference] = {
    "copy": Reference(np.copy, lambda t, x: x.clone()),
    "add": Reference(np.add, lambda t, a, b: t.add(a, b)),
    "sub": Reference(np.subtract, lambda t, a, b: t.sub(a, b)),
    "mul": Reference(np.multiply, lambda t, a, b: t.mul(a, b)),
    "div": Reference(np.divide, lambda t, a, b: t.div(a, b), "positive"),
    "neg": Reference(np.negative, lambda t, x: t.neg(x)),
    "exp": Reference(np.exp, lambda t, x: t.exp(x)),
    "log": Reference(np.log, lambda t, x: t.log(x), "positive"),
    "tanh": Reference(np.tanh, lambda t, x: t.tanh(x)),
    "sigmoid": Reference(lambda x: 1 / (1 + np.exp(-x)), lambda t, x: t.sigmoid(x)),
    "relu": Reference(_relu, lambda t, x: t.relu(x), "apart"),
    "sqrt": Reference(np.sqrt, lambda t, x: t.sqrt(x), "positive"),
    "abs": Reference(np.abs, lambda t, x: t.abs(x), "apart"),
    "erf": Reference(_erf, lambda t, x: t.erf(x)),
    "gelu": Reference(lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
                      lambda t, x: t.nn.functional.gelu(x)),
    "gelu_tanh": Reference(
        lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
        lambda t, x: t.nn.functional.gelu(x, approximate="tanh")),
    "maximum": Reference(np.maximum, lambda t, a, b: t.maximum(a, b), "apart"),
    "where_finite": Reference(lambda a, b: np.where(np.isfinite(a), a, b),
                              lambda t, a, b: t.where(t.isfinite(a), a, b)),
    "where": Reference(np.where, lambda t, c, a, b: t.where(c, a, b)),
    "tanh_backward": Reference(lambda g, y: g * (1 - y * y)),
    "sigmoid_backward": Reference(lambda g, y: g * y * (1 - y)),
    "relu_backward": Reference(lambda g, y: np.where(y > 0, g, 0 * g)),
    "abs_backward": Reference(lambda g, x: g * _sign(x)),
    "erf_backward": Reference(lambda g, x: g * 2 / math.sqrt(math.pi) * np.exp(-x * x)),
    "gelu_backward": Reference(
        lambda g, x: g * (0.5 * (1 + _erf(x / math.sqrt(2)))
                          + x * np.exp(-x * x / 2) / math.sqrt(2 * math.pi))),
    "gelu_tanh_backward": Reference(lambda g, x: g * _gelu_tanh_slope(x)),
    "amax_backward": Reference(lambda g, x, y: g * (x == y)),
    "maximum_backward": Reference(
        lambda g, a, b: np.where(a < b, 0.0, np.where(a == b, g / 2, g))),
}
