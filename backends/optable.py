"""The elementwise ops, each declared once: the one table every backend renders its kernels from.

Note [one declaration per op]: an elementwise op is one `Op` entry in `OPS` below: its name and
parameters, the kinds of its operands (its dtype rule), its formula in a small expression form
(`Expr` over the PRIMITIVES), its derivative (an `Expr` over the table's own ops for each
operand), its aliasing policy and whether a graph may fuse it. Everything else is made from the
entry: the NumPy device's kernels (backends/numpy.py), the C kernels of the CPU's half and
float loops (backends/_halfconv_gen.py writes their header when the extension is built, codes
and all), the OpenCL and CUDA kernel sources (`CStyle` here, each backend overriding what its
language spells differently, as tinygrad's renderers override `code_for_op`), the public
functions of `runtime.ops`, their autograd records and aliasing policy, and the linear forms
the graph's fusion folds into a product (`linear_form`). Adding an op is one entry here plus
its reference in tests/op_references.py, from which its tests over every backend and dtype are
generated (tests/test_optable.py).

A formula is evaluated as written, one IEEE operation per primitive, in the order the tree
gives: so every backend computes the same roundings (Note [one formula on every backend] in
backends/base.py) and the exact ops (`Op.exact`: no transcendental primitive) give the CPU's
bits everywhere (tests/test_bits.py).

This module imports nothing but the standard library: `setup.py` loads it by path to write the
C header before NumPy is importable.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

# ---------------------------------------------------------------------- the expression form
#: Each primitive of the formulas and its arity. Arithmetic ones round once as IEEE says
#: (exp, log, tanh and erf to within their library's error); "lt", "gt", "eq", "isnan",
#: "isfinite" and "either" (a logical or) give a condition, which only "select" reads:
#: select(c, a, b) is a where c holds, else b.
PRIMITIVES: dict[str, int] = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "sqrt": 1, "abs": 1,
    "exp": 1, "log": 1, "tanh": 1, "erf": 1,
    "lt": 2, "gt": 2, "eq": 2, "isnan": 1, "isfinite": 1, "either": 2, "select": 3,
}
#: The primitives whose results are conditions, not numbers.
CONDITIONS = frozenset({"lt", "gt", "eq", "isnan", "isfinite", "either"})
#: The primitives whose bits are each library's own (a backend's exp need not give NumPy's).
TRANSCENDENTAL = frozenset({"exp", "log", "tanh", "erf"})


@dataclass(frozen=True)
class Expr:
    """A node of a formula: `op` applied to `args`, each an Expr or a number. In an op's
    formula `op` is a primitive; in a derivative it names an op of the table. The leaves are
    Arg(i), an operand of the op, and, in derivatives, G (the gradient of the op's output) and
    Y (the op's output)."""

    op: str
    args: tuple = ()

    def __repr__(self) -> str:
        if self.op == "arg":
            return f"x{self.args[0]}"
        if self.op in ("grad", "output"):
            return {"grad": "g", "output": "y"}[self.op]
        return f"{self.op}({', '.join(map(repr, self.args))})"


def Arg(index: int) -> Expr:
    """Operand `index` of the op."""
    return Expr("arg", (index,))


#: The gradient of the op's output, and the op's output (in derivatives)
G, Y = Expr("grad"), Expr("output")
X0, X1, X2 = Arg(0), Arg(1), Arg(2)


def _node(op: str) -> Callable[..., Expr]:
    def make(*args: Expr | float) -> Expr:
        return Expr(op, tuple(float(a) if isinstance(a, int) else a for a in args))
    make.__name__ = op
    return make


add, sub, mul, div, sqrt, abs_, exp, log, tanh, erf = map(
    _node, ("add", "sub", "mul", "div", "sqrt", "abs", "exp", "log", "tanh", "erf"))
lt, gt, eq, isnan, isfinite, either, select = map(
    _node, ("lt", "gt", "eq", "isnan", "isfinite", "either", "select"))


def call(op: str, *args: Expr | float) -> Expr:
    """A derivative's use of the table's op `op` (run as the runtime op of that name)."""
    return _node(op)(*args)


def nodes(expr: Expr | float) -> Iterator[Expr]:
    """Every node of `expr`, children before their parent (numbers left out)."""
    if isinstance(expr, Expr):
        for a in expr.args:
            yield from nodes(a)
        yield expr


# ---------------------------------------------------------------------- the table's entries
ELEMENTWISE = "elementwise"
#: The kinds of operand: a float of the op's dtype (or a number), or a bool tensor.
FLOAT, BOOL = "float", "bool"


@dataclass(frozen=True)
class Op:
    """One elementwise op (Note [one declaration per op]).

    Attributes:
        name: the kernel's name and, where `public`, runtime.ops.<name>.
        params: the public function's parameter names, one per operand.
        formula: out = formula(x0, x1, ...), an Expr over PRIMITIVES.
        derivative: per operand, the gradient it gets as an Expr over the table's ops (G the
            output's gradient, Y the output, Arg(i) the operands), or None: no gradient.
            None for the whole: the op has no derivative (autograd's own kernels).
        kinds: each operand's kind, FLOAT (the op's dtype, or a number) or BOOL (a bool
            tensor); the result has the float operands' dtype.
        any_dtype: the op moves bits of any dtype (copy), not only float ones.
        public: a function of runtime.ops; else a kernel that autograd's derivatives call.
        fusible: a graph may run it inside a fused chain (Device.fused).
        aliasing: the op's aliasing policy (runtime/ops.py: ELEMENTWISE, out may be the
            identical view of an input).
        doc: the public function's docstring.
    """

    name: str
    params: tuple[str, ...]
    formula: Expr
    derivative: tuple[Expr | None, ...] | None = None
    kinds: tuple[str, ...] | None = None
    any_dtype: bool = False
    public: bool = True
    fusible: bool = True
    aliasing: str = ELEMENTWISE
    doc: str = ""

    @property
    def arity(self) -> int:
        return len(self.params)

    @property
    def operand_kinds(self) -> tuple[str, ...]:
        return self.kinds or (FLOAT,) * self.arity

    @property
    def exact(self) -> bool:
        """Whether every step is one correctly rounded IEEE operation (or a select), so every
        backend gives the same bits; else its transcendental primitives are each library's."""
        return not any(n.op in TRANSCENDENTAL for n in nodes(self.formula))


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_SQRT_HALF = math.sqrt(0.5)
_ONE_OVER_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
#: GELU's tanh form, PyTorch's constants: kBeta = M_SQRT2 * M_2_SQRTPI * 0.5 (sqrt(2 / pi),
#: the C literals' doubles multiplied as C does) and kKappa; 3 * kKappa folded in double
_GELU_BETA = 1.41421356237309504880 * 1.12837916709551257390 * 0.5
_GELU_KAPPA = 0.044715


def _gelu_inner(x: Expr) -> Expr:
    """kBeta * (x + kKappa * x**3), x**3 as x * x * x: the tanh's argument of GELU's tanh
    form, in PyTorch's order."""
    return mul(_GELU_BETA, add(x, mul(_GELU_KAPPA, mul(mul(x, x), x))))


_GELU_INNER, _GELU_INNER_1 = _gelu_inner(X0), _gelu_inner(X1)

#: Every elementwise op, in the order of their kernel codes in C.
OPS: tuple[Op, ...] = (
    Op("copy", ("x",), X0, (G,), any_dtype=True,
       doc="""A copy of x (any dtype); with `out`, x is broadcast into out's shape.

    Example:
        >>> import numpy as np, runtime
        >>> runtime.ops.copy(runtime.tensor(np.arange(3.0))).numpy()
        array([0., 1., 2.])
    """),
    Op("add", ("a", "b"), add(X0, X1), (G, G),
       doc="a + b elementwise, with broadcasting; either may be a number. `out` may be a or b."),
    Op("sub", ("a", "b"), sub(X0, X1), (G, call("neg", G)),
       doc="a - b elementwise, with broadcasting."),
    Op("mul", ("a", "b"), mul(X0, X1), (call("mul", G, X1), call("mul", G, X0)),
       doc="a * b elementwise, with broadcasting."),
    # NOTE: d(a/b)/db = -(a/b)/b, from the output
    Op("div", ("a", "b"), div(X0, X1),
       (call("div", G, X1), call("neg", call("div", call("mul", G, Y), X1))),
       doc="a / b elementwise, with broadcasting."),
    # NOTE: a product by -1, as the CPU has always computed it (NumPy's SIMD negative was wrong
    # in place on some strides): the same bits as a negation but for a NaN, which keeps its sign
    Op("neg", ("x",), mul(X0, -1.0), (call("neg", G),),
       doc="-x elementwise (x times -1: a NaN keeps its sign)."),
    Op("exp", ("x",), exp(X0), (call("mul", G, Y),), doc="e**x elementwise."),
    Op("log", ("x",), log(X0), (call("div", G, X0),), doc="Natural logarithm elementwise."),
    Op("tanh", ("x",), tanh(X0), (call("tanh_backward", G, Y),),
       doc="Hyperbolic tangent elementwise."),
    # NOTE: never 1 / (1 + exp(-x)), which overflows: Note [one formula on every backend]
    Op("sigmoid", ("x",), add(mul(tanh(mul(X0, 0.5)), 0.5), 0.5),
       (call("sigmoid_backward", G, Y),),
       doc="1 / (1 + e**-x) elementwise, as 0.5 * tanh(0.5 * x) + 0.5 (no overflow for large "
           "|x|)."),
    # NOTE: Note [relu's zero] in backends/base.py: a select, never a maximum
    Op("relu", ("x",), select(lt(X0, 0.0), 0.0, X0), (call("relu_backward", G, Y),),
       doc="max(x, 0) elementwise: +0 where x < 0, else x (-0.0 and NaN as they are, as "
           "PyTorch's relu)."),
    Op("sqrt", ("x",), sqrt(X0), (call("div", call("mul", G, 0.5), Y),),
       doc="The square root elementwise (NaN below zero; sqrt(-0.0) is -0.0)."),
    Op("abs", ("x",), abs_(X0), (call("abs_backward", G, X0),),
       doc="""|x| elementwise (the sign bit cleared: abs(-0.0) is +0.0, a NaN loses its sign).

    The gradient is g * sign(x), 0 at x = 0 and at NaN, as PyTorch's.

    Example:
        >>> import numpy as np, runtime
        >>> runtime.ops.abs(runtime.tensor(np.float32([-2.0, 0.5]))).numpy()
        array([2. , 0.5], dtype=float32)
    """),
    Op("erf", ("x",), erf(X0), (call("erf_backward", G, X0),),
       doc="""The error function elementwise, 2 / sqrt(pi) times the integral of
    exp(-t**2) from 0 to x (GELU's).

    Each backend's library computes it: the CPU's is math.erf's (C's erf in float64, rounded
    once to the dtype: backends/_erf.py); OpenCL's and CUDA's are their own erf, within the
    bounds of tests/test_bits.py. The gradient is g * 2 / sqrt(pi) * exp(-x**2).

    Example:
        >>> import numpy as np, runtime
        >>> runtime.ops.erf(runtime.tensor(np.float64([0.0, 0.5]))).numpy()
        array([0.        , 0.52049988])
    """),
    # NOTE: PyTorch's exact GELU, in its order: x * 0.5 * (1 + erf(x * sqrt(1/2)))
    Op("gelu", ("x",), mul(mul(X0, 0.5), add(1.0, erf(mul(X0, _SQRT_HALF)))),
       (call("gelu_backward", G, X0),),
       doc="""The Gaussian error linear unit elementwise, exactly: x * Phi(x), Phi the standard
    normal's distribution function, computed as x * 0.5 * (1 + erf(x / sqrt(2))) (PyTorch's
    `gelu` with approximate="none", in its order).

    The gradient is g * (Phi(x) + x * exp(-x**2 / 2) / sqrt(2 pi)), as PyTorch's.

    Example:
        >>> import numpy as np, runtime
        >>> runtime.ops.gelu(runtime.tensor(np.float64([-1.0, 0.0, 1.0]))).numpy()
        array([-0.15865525,  0.        ,  0.84134475])
    """),
    # NOTE: PyTorch's tanh form, in its order: 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x**3)))
    Op("gelu_tanh", ("x",), mul(mul(0.5, X0), add(1.0, tanh(_GELU_INNER))),
       (call("gelu_tanh_backward", G, X0),),
       doc="""GELU's tanh approximation elementwise, 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x +
    0.044715 * x**3))): PyTorch's `gelu` with approximate="tanh", in its order (x**3 as
    x * x * x, PyTorch's vectorised loop). `ops.gelu(x, approximate="tanh")` runs it.

    The gradient is PyTorch's: g * (0.5 * (1 + t) + 0.5 * x * (1 - t**2) * sqrt(2 / pi) *
    (1 + 3 * 0.044715 * x**2)), t the tanh above.

    Example:
        >>> import numpy as np, runtime
        >>> runtime.ops.gelu_tanh(runtime.tensor(np.float64([-1.0, 0.0, 1.0]))).numpy()
        array([-0.15880801,  0.        ,  0.84119199])
    """),
    Op("maximum", ("a", "b"), select(either(isnan(X0), gt(X0, X1)), X0, X1),
       (call("maximum_backward", G, X0, X1), call("maximum_backward", G, X1, X0)),
       doc="""The larger of a and b elementwise, with broadcasting; a NaN in either
    gives NaN (torch.maximum, np.maximum). `out` may be a or b.

    At a tie of zeros the result is b's zero (PyTorch's vectorised loop gives the second
    operand's; its scalar tail the first's). The gradient goes to the larger operand; at a tie
    each gets half of it, and where either is NaN both get all of it, as PyTorch's.

    Example:
        >>> import numpy as np, runtime
        >>> a = runtime.tensor(np.float32([1.0, 5.0, np.nan]))
        >>> runtime.ops.maximum(a, 2.0).numpy()
        array([ 2.,  5., nan], dtype=float32)
    """),
    Op("where_finite", ("a", "b"), select(isfinite(X0), X0, X1),
       # NOTE: 1 where a is finite, else 0, from a (a number too: the derivative folds it)
       (call("mul", G, call("where_finite", call("add", call("mul", X0, 0.0), 1.0), 0.0)),
        call("mul", G, call("sub", 1.0, call("where_finite",
                                             call("add", call("mul", X0, 0.0), 1.0), 0.0)))),
       doc="""a where a is finite, else b, elementwise, with broadcasting (NumPy's
    `np.where(np.isfinite(a), a, b)`); either may be a number. `out` may be a or b.

    With b = 0 it replaces infinities and NaN by zeros (`np.nan_to_num` without the large
    finite stand-ins). A mixed-precision step uses it to skip an update on the device: the new
    value plus -0.0 (take the step) or NaN (skip it) is the first operand, the old value the
    second (runtime/amp.py). The gradient goes to a where a is finite and to b elsewhere.

    Example:
        >>> import numpy as np, runtime
        >>> x = runtime.tensor(np.float32([1.0, np.inf, np.nan, -2.0]))
        >>> runtime.ops.where_finite(x, 0.0).numpy()
        array([ 1.,  0.,  0., -2.], dtype=float32)
    """),
    Op("where", ("cond", "a", "b"), select(X0, X1, X2),
       (None, call("where", X0, G, 0.0), call("where", X0, 0.0, G)),
       kinds=(BOOL, FLOAT, FLOAT),
       # NOTE: the chain kernels take float operands only
       fusible=False, doc="""a where cond holds, else b, elementwise, with broadcasting
    (torch.where): cond a bool Tensor on the same device; a and b Tensors of one float dtype,
    or numbers (one at least a Tensor). `out` may be a or b.

    The gradient of a is g where cond holds, +0 elsewhere; b's the other way round.

    Example:
        >>> import numpy as np, runtime
        >>> cond = runtime.tensor(np.array([True, False]))
        >>> runtime.ops.where(cond, runtime.tensor(np.float32([1.0, 2.0])), 0.0).numpy()
        array([1., 0.], dtype=float32)
    """),
    # autograd's kernels, (gradient, the op's output or input) -> gradient; not public ops
    Op("tanh_backward", ("g", "y"), mul(X0, sub(1.0, mul(X1, X1))), public=False),
    Op("sigmoid_backward", ("g", "y"), mul(X0, mul(sub(1.0, X1), X1)), public=False),
    # NOTE: g * (y > 0), a product, so a NaN or infinite gradient stays NaN where y <= 0
    Op("relu_backward", ("g", "y"), mul(X0, select(gt(X1, 0.0), 1.0, 0.0)), public=False),
    Op("abs_backward", ("g", "x"),
       mul(X0, select(gt(X1, 0.0), 1.0, select(lt(X1, 0.0), -1.0, 0.0))), public=False),
    Op("erf_backward", ("g", "x"), mul(X0, mul(exp(mul(mul(X1, X1), -1.0)), _TWO_OVER_SQRT_PI)),
       public=False),
    # NOTE: PyTorch's: g * (cdf + x * pdf), cdf = 0.5 * (1 + erf(x * sqrt(1/2))), pdf =
    # exp(-0.5 * x * x) / sqrt(2 pi)
    Op("gelu_backward", ("g", "x"),
       mul(X0, add(mul(add(1.0, erf(mul(X1, _SQRT_HALF))), 0.5),
                   mul(X1, mul(exp(mul(mul(X1, -0.5), X1)), _ONE_OVER_SQRT_2PI)))),
       public=False),
    # NOTE: PyTorch's: g * (left' + right'), left = 0.5 * x, right = 1 + t, left' = 0.5 *
    # right, right' = left * (1 - t * t) * kBeta * (1 + 3 * kKappa * x * x)
    Op("gelu_tanh_backward", ("g", "x"),
       mul(X0, add(mul(0.5, add(1.0, tanh(_GELU_INNER_1))),
                   mul(mul(mul(0.5, X1), sub(1.0, mul(tanh(_GELU_INNER_1), tanh(_GELU_INNER_1)))),
                       mul(_GELU_BETA, add(1.0, mul(3.0 * _GELU_KAPPA, mul(X1, X1))))))),
       public=False),
    # NOTE: g where x equals the maximum y, +0 elsewhere (a product, so an infinite g gives
    # NaN there, as PyTorch's mask product): amax's gradient (runtime/ops.py)
    Op("amax_backward", ("g", "x", "y"), mul(X0, select(eq(X1, X2), 1.0, 0.0)), public=False),
    # NOTE: torch.maximum's: g where a > b, g / 2 at a tie, +0 where a < b (NaN: all of g)
    Op("maximum_backward", ("g", "a", "b"), select(lt(X1, X2), 0.0, select(eq(X1, X2),
                                                                        mul(X0, 0.5), X0)),
       public=False),
)

#: The ops by name.
BY_NAME: dict[str, Op] = {op.name: op for op in OPS}


def check(ops: Sequence[Op]) -> None:
    """Raise ValueError naming the entry that breaks the form: a formula over primitives of
    their arity reading only its operands, a condition only where select (or either) reads
    one, a derivative per operand over the table's ops."""
    for op in ops:
        for n in nodes(op.formula):
            if n.op == "arg":
                if not 0 <= n.args[0] < op.arity:
                    raise ValueError(f"optable: {op.name} reads operand {n.args[0]}")
                continue
            if PRIMITIVES.get(n.op) != len(n.args):
                raise ValueError(f"optable: {op.name}'s formula has {n!r}, not a primitive of "
                                 f"its arity")
            for i, a in enumerate(n.args):
                condition = isinstance(a, Expr) and (
                    a.op in CONDITIONS or a.op == "arg" and op.operand_kinds[a.args[0]] == BOOL)
                wanted = n.op == "either" or n.op == "select" and i == 0
                if condition != wanted:
                    raise ValueError(f"optable: {op.name}: {n!r} reads {a!r} as "
                                     f"{'a condition' if condition else 'a number'}")
        if op.derivative is not None:
            if len(op.derivative) != op.arity:
                raise ValueError(f"optable: {op.name} has {len(op.derivative)} derivatives for "
                                 f"{op.arity} operands")
            for n in (n for d in op.derivative for n in nodes(d)):
                if n.op not in ("arg", "grad", "output") and (
                        n.op not in BY_NAME or BY_NAME[n.op].arity != len(n.args)):
                    raise ValueError(f"optable: {op.name}'s derivative calls {n!r}, not an op "
                                     f"of the table")


check(OPS)


def kernels(arity: int) -> tuple[str, ...]:
    """The names of the ops of `arity` operands, in table order."""
    return tuple(op.name for op in OPS if op.arity == arity)


# ---------------------------------------------------------------------- evaluation
def evaluate(expr: Expr | float, operands: Sequence, primitives: dict[str, Callable],
             grad=None, output=None):
    """expr on `operands` with each primitive (or op) `primitives[name]`; a select calls
    primitives["select"](condition, a, b) with both branches evaluated."""
    if not isinstance(expr, Expr):
        return expr
    if expr.op == "arg":
        return operands[expr.args[0]]
    if expr.op == "grad":
        return grad
    if expr.op == "output":
        return output
    return primitives[expr.op](*(evaluate(a, operands, primitives, grad, output)
                                 for a in expr.args))


def linear_form(op: Op, operands: Sequence) -> tuple | None:
    """The op as a linear form, where it is one: `operands` are numbers or coefficient tuples
    (each term's coefficient in a linear combination of fixed vectors); returns the result's
    coefficients, or None where the formula is not linear in them (a product of two terms, a
    select, a function). The graph's fusion folds such chains into a product (runtime/graph/
    fuse.py)."""
    def combine(name: str, a, b=None):
        if name in ("add", "sub") and isinstance(a, tuple) and isinstance(b, tuple):
            sign = 1.0 if name == "add" else -1.0
            return tuple(x + sign * y for x, y in zip(a, b))
        if name == "mul" and isinstance(a, tuple) != isinstance(b, tuple):
            terms, number = (a, b) if isinstance(a, tuple) else (b, a)
            return tuple(x * number for x in terms)
        raise _NotLinear

    if op.formula.op == "arg":
        return None  # NOTE: a copy computes nothing to fold
    primitives = {name: functools.partial(combine, name) for name in PRIMITIVES}
    try:
        result = evaluate(op.formula, operands, primitives)
    except _NotLinear:
        return None
    return result if isinstance(result, tuple) else None


class _NotLinear(Exception):
    """A formula that is not linear in its operands (`linear_form`)."""


# ---------------------------------------------------------------------- C-style rendering
def float_literal(value: float, ctype: str) -> str:
    """`value` as a C literal of `ctype` ("float" or "double"; anything else, a type name, gets
    the double cast to it), exactly: the float value NumPy meets it as (a Python float rounded
    to float32 once), in hexadecimal where a decimal would not be exact."""
    if ctype == "float":
        value = struct.unpack("f", struct.pack("f", value))[0]
    text = repr(value) if float(repr(value)) == value and len(repr(value)) <= 8 else value.hex()
    if math.isinf(value):
        text = "INFINITY" if value > 0 else "-INFINITY"
    if ctype == "float":
        literal = text if "INFINITY" in text else text + "f"
    elif ctype == "double":
        literal = text
    else:
        literal = f"({ctype}){text}"
    return f"({literal})" if value < 0 or literal.startswith("(") else literal


class CStyle:
    """Renders a formula as one C expression (OpenCL C, CUDA and C share it); a language
    overrides the entries of `code_for_op` it spells differently, as tinygrad's renderers do.

    Every operation is parenthesised, so the expression computes the tree's order exactly; the
    kernels are compiled without contraction (no FMA), so each arithmetic primitive rounds
    once."""

    code_for_op: dict[str, Callable[..., str]] = {
        "add": lambda a, b: f"({a} + {b})", "sub": lambda a, b: f"({a} - {b})",
        "mul": lambda a, b: f"({a} * {b})", "div": lambda a, b: f"({a} / {b})",
        "sqrt": lambda a: f"sqrt({a})", "abs": lambda a: f"fabs({a})",
        "exp": lambda a: f"exp({a})", "log": lambda a: f"log({a})",
        "tanh": lambda a: f"tanh({a})", "erf": lambda a: f"erf({a})",
        "lt": lambda a, b: f"({a} < {b})", "gt": lambda a, b: f"({a} > {b})",
        "eq": lambda a, b: f"({a} == {b})", "isnan": lambda a: f"isnan({a})",
        "isfinite": lambda a: f"isfinite({a})", "either": lambda a, b: f"({a} || {b})",
        "select": lambda c, a, b: f"({c} ? {a} : {b})",
    }

    def __init__(self, ctype: str) -> None:
        #: the type the formula computes in ("float", "double", or a type placeholder)
        self.ctype = ctype

    def render(self, expr: Expr | float, operands: Sequence[str]) -> str:
        """expr as C, operand i being the C expression operands[i]."""
        if not isinstance(expr, Expr):
            return float_literal(expr, self.ctype)
        if expr.op == "arg":
            return operands[expr.args[0]]
        args = [self.render(a, operands) for a in expr.args]
        if expr.op == "select" and isinstance(expr.args[0], Expr) and expr.args[0].op == "arg":
            # NOTE: a bool operand, which a kernel may load as a number (OpenCL refuses a
            # floating-point condition)
            args[0] = f"({args[0]} != 0)"
        return self.code_for_op[expr.op](*args)

    def op(self, name: str, operands: Sequence[str]) -> str:
        """The formula of the op `name` on `operands`, as C."""
        return self.render(BY_NAME[name].formula, operands)

    def supports(self, name: str) -> bool:
        """Whether every primitive of the op's formula has a spelling here."""
        return all(n.op == "arg" or n.op in self.code_for_op
                   for n in nodes(BY_NAME[name].formula))
