"""Every elementwise op of backends/optable.py, tested from its entry and its reference
(tests/op_references.py): an op added to the table is tested here with no new test code
(Note [one declaration per op] in backends/optable.py).

For each public op, on every device here (the CPU, OpenCL on PoCL, the naive test device) and
every float dtype: its values against the reference (two-byte floats computed in float32 and
rounded once), `out=` (the result written there and returned; the identical view of an input
allowed, a partial overlap computed through a temporary or refused, as the op's policy says),
its gradient against finite differences and, where PyTorch is installed, against PyTorch's
(values too). The table itself: its entries are well formed, C runs the ops it says it runs
(a stale build of the extension fails), and the derivative kernels are checked as kernels by
tests/test_bits.py and test_backends.py.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from op_references import REFERENCES
from test_autograd import check_gradients

import backends
import runtime
from backends import _halfconv_gen, optable
from naive_device import NaiveDevice
from runtime import dtypes, ops

PUBLIC = [op.name for op in optable.OPS if op.public]
BINARY = [name for name in PUBLIC if optable.BY_NAME[name].arity == 2]
DIFFERENTIABLE = [name for name in PUBLIC if optable.BY_NAME[name].derivative is not None]
FLOATS = [np.dtype("float32"), np.dtype("float64"), np.dtype("float16"), dtypes.BFLOAT16]
#: A result's distance from the float64 reference, relative, per dtype (the transcendental
#: libraries, a formula's few roundings, a two-byte float's one rounding of float32)
RTOL = {np.dtype("float32"): 2e-6, np.dtype("float64"): 1e-13, np.dtype("float16"): 2e-3,
        dtypes.BFLOAT16: 1.6e-2}
_NAIVE = NaiveDevice()


def _devices() -> list[Any]:
    return [backends.get_device(kind) for kind in backends.available()
            if kind != "cuda"] + [_NAIVE]


def _operands(name: str, shape: tuple[int, ...], seed: int) -> list[np.ndarray]:
    """float64 operands in the op's domain (tests/op_references.py), bool ones for a
    condition."""
    rng = np.random.default_rng(seed)
    domain = REFERENCES[name].domain
    found = []
    for kind in optable.BY_NAME[name].operand_kinds:
        if kind == optable.BOOL:
            found.append(rng.random(shape) < 0.5)
            continue
        values = rng.uniform(-3, 3, shape)
        if domain == "positive":
            values = np.abs(values) + 0.25
        elif domain == "apart":  # NOTE: kinks and ties a step away: 0.25 + a multiple of 0.5
            values = np.round(values * 2) / 2 + 0.25
        found.append(values)
    if REFERENCES[name].domain == "apart" and len(found) == 2:
        found[1] = found[1] + 0.125  # NOTE: maximum's operands never tie
    return found


def _stored(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return x if x.dtype == np.bool_ else x.astype(dtype)


def test_every_op_has_a_reference():
    assert set(REFERENCES) == set(optable.BY_NAME)


@pytest.mark.parametrize("name", PUBLIC)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("device", _devices(), ids=lambda d: d.name)
def test_each_op_computes_its_reference(device, dtype, name):
    """The op on its operands stored in `dtype` against the reference on the same stored
    values in float64, within the dtype's tolerance; numbers as the last operand too."""
    if np.dtype("float64") == dtype and dtype not in device.capabilities.compute_dtypes:
        pytest.skip(f"{device.name} has no float64")
    shape = (3, 7) if device is not _NAIVE else (2, 3)
    host = [_stored(x, dtype) for x in _operands(name, shape, 1)]
    wide = [x if x.dtype == np.bool_ else x.astype(np.float64) for x in host]
    want = REFERENCES[name].numpy(*wide)
    got = getattr(ops, name)(*(runtime.tensor(x, device=device) for x in host))
    assert got.dtype == dtype and got.shape == shape
    np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=RTOL[dtype],
                               atol=RTOL[dtype] * 1e-3)
    if len(host) > 1 and host[-1].dtype != np.bool_:
        number = float(wide[-1][0, 0])
        want = REFERENCES[name].numpy(*wide[:-1], np.float64(_stored(np.array(number), dtype)))
        got = getattr(ops, name)(*(runtime.tensor(x, device=device) for x in host[:-1]),
                                 float(_stored(np.array(number), dtype)))
        np.testing.assert_allclose(got.numpy().astype(np.float64), want, rtol=RTOL[dtype],
                                   atol=RTOL[dtype] * 1e-3)


@pytest.mark.parametrize("name", PUBLIC)
def test_each_op_writes_out_and_keeps_its_aliasing_policy(name):
    """out= is written and returned; the identical view of a float input is allowed (policy
    ELEMENTWISE); a partial overlap is computed through a temporary ("copy") or refused
    ("raise") before anything is written."""
    assert optable.BY_NAME[name].aliasing == ops.ALIASING_POLICY[name] == ops.ELEMENTWISE
    host = [_stored(x, np.dtype("float64")) for x in _operands(name, (4, 4), 2)]
    want = getattr(ops, name)(*(runtime.tensor(x) for x in host)).numpy()
    out = runtime.tensor(np.zeros((4, 4)))
    assert getattr(ops, name)(*(runtime.tensor(x) for x in host), out=out) is out
    np.testing.assert_array_equal(out.numpy(), want)
    first = next(i for i, x in enumerate(host) if x.dtype != np.bool_)
    inputs = [runtime.tensor(x) for x in host]
    assert getattr(ops, name)(*inputs, out=inputs[first]) is inputs[first]
    np.testing.assert_array_equal(inputs[first].numpy(), want)
    # a partial overlap: out is the input shifted by one row
    for mode in ("copy", "raise"):
        runtime.set_aliasing(mode)
        try:
            buffer = runtime.tensor(np.concatenate([host[first], np.zeros((1, 4))]))
            inputs = [runtime.tensor(x) for x in host]
            inputs[first] = buffer[:4]
            target = buffer[1:]
            if mode == "raise":
                before = buffer.numpy().copy()
                with pytest.raises(runtime.AliasingError, match=name):
                    getattr(ops, name)(*inputs, out=target)
                np.testing.assert_array_equal(buffer.numpy(), before)
            else:
                getattr(ops, name)(*inputs, out=target)
                np.testing.assert_array_equal(target.numpy(), want)
        finally:
            runtime.set_aliasing("copy")


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_each_gradient_matches_finite_differences(name):
    host = _operands(name, (3, 4), 3)
    floats = [i for i, x in enumerate(host) if x.dtype != np.bool_]

    def fn(*tensors: runtime.Tensor) -> runtime.Tensor:
        operands: list[Any] = list(host)
        for i, t in zip(floats, tensors):
            operands[i] = t
        operands = [runtime.tensor(x) if isinstance(x, np.ndarray) else x for x in operands]
        return getattr(ops, name)(*operands)

    check_gradients(fn, *(host[i] for i in floats))


@pytest.mark.parametrize("name", PUBLIC)
def test_each_op_and_its_gradient_match_pytorch(name):
    """Values and the gradients of a weighted sum, in float64, against PyTorch's CPU: at the
    drawn operands, and at the edges (ties and kinks: zeros, equal operands; NaN and
    infinities)."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    edges = np.array([0.0, -0.0, 1.0, -1.0, 0.5, np.nan, np.inf, -np.inf])
    if name == "relu":
        # NOTE: relu_backward is g * (y > 0), so 0 where y is NaN; PyTorch's threshold_backward
        # passes g there (and gives 0, not NaN, for a NaN or infinite g where y <= 0): a known
        # difference, kept (tests/test_bits.py holds every backend to the product)
        edges = edges[~np.isnan(edges)]
    drawn = _operands(name, (2, 8), 4)
    for host in (drawn, _edge_operands(name, edges)):
        floats = [i for i, x in enumerate(host) if x.dtype != np.bool_]
        weights = np.random.default_rng(5).uniform(0.5, 1.5, host[0].shape)
        leaves = [runtime.tensor(x, requires_grad=i in floats) for i, x in enumerate(host)]
        loss = ops.sum(ops.mul(getattr(ops, name)(*leaves), runtime.tensor(weights)))
        loss.backward()
        theirs = [torch.tensor(x, requires_grad=i in floats) for i, x in enumerate(host)]
        value = REFERENCES[name].torch(torch, *theirs)
        (value * torch.tensor(weights)).sum().backward()
        mine = getattr(ops, name)(*(runtime.tensor(x) for x in host)).numpy()
        np.testing.assert_allclose(mine, value.detach().numpy(), rtol=1e-13, atol=0,
                                   err_msg=f"{name} values")
        for i in floats:
            np.testing.assert_allclose(leaves[i].grad.numpy(), theirs[i].grad.numpy(),
                                       rtol=1e-13, atol=0, err_msg=f"{name} gradient {i}")


def _edge_operands(name: str, edges: np.ndarray) -> list[np.ndarray]:
    """Every pair of edge values (each operand's rows against the other's columns)."""
    kinds = optable.BY_NAME[name].operand_kinds
    floats = kinds.count(optable.FLOAT)
    grids = np.meshgrid(*[edges] * floats, indexing="ij")
    values = iter(g.reshape(1, -1) for g in grids)
    size = edges.size ** floats
    return [np.arange(size).reshape(1, -1) % 3 == 0 if kind == optable.BOOL else next(values)
            for kind in kinds]


def test_maximum_splits_the_gradient_at_a_tie_and_passes_it_at_nan_as_pytorch():
    a = runtime.tensor(np.array([1.0, 2.0, np.nan, 1.0, 3.0]), requires_grad=True)
    b = runtime.tensor(np.array([1.0, 1.0, 1.0, np.nan, 4.0]), requires_grad=True)
    ops.sum(ops.maximum(a, b)).backward()
    np.testing.assert_array_equal(a.grad.numpy(), [0.5, 1.0, 1.0, 1.0, 0.0])
    np.testing.assert_array_equal(b.grad.numpy(), [0.5, 0.0, 1.0, 1.0, 1.0])


def test_a_gelu_made_of_erf_matches_pytorchs():
    """GELU, x * (1 + erf(x / sqrt(2))) / 2, the op erf is for (nn.GELU, exact)."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    x = np.random.default_rng(6).normal(0, 3, 200)
    t = runtime.tensor(x, requires_grad=True)
    gelu = ops.mul(ops.mul(t, 0.5), ops.add(ops.erf(ops.mul(t, 1 / math.sqrt(2))), 1.0))
    ops.sum(gelu).backward()
    theirs = torch.tensor(x, requires_grad=True)
    value = torch.nn.functional.gelu(theirs)
    value.sum().backward()
    np.testing.assert_allclose(gelu.numpy(), value.detach().numpy(), rtol=1e-14, atol=1e-16)
    np.testing.assert_allclose(t.grad.numpy(), theirs.grad.numpy(), rtol=1e-13, atol=1e-16)


def test_where_takes_a_bool_condition_on_the_same_device():
    x = runtime.tensor(np.float32([1.0, 2.0]))
    with pytest.raises(TypeError, match="where: cond must be a bool Tensor, got float32"):
        ops.where(x, x, x)
    with pytest.raises(TypeError, match="where: cond must be a bool Tensor, got bool"):
        ops.where(True, x, x)
    with pytest.raises(TypeError, match="where: needs at least one Tensor operand"):
        ops.where(runtime.tensor(np.array([True, False])), 1.0, 2.0)


# ---------------------------------------------------------------------- the table itself
def test_the_c_extension_runs_the_tables_ops():
    """The built extension's op codes are the table's (a build older than the table fails
    here: `make venv` rebuilds it), and its header is the one the table makes now."""
    halfconv = pytest.importorskip("backends._halfconv", reason="the C kernels are not built")
    assert halfconv.ops == tuple(op.name for op in _halfconv_gen.c_ops(optable))
    with open(halfconv.__file__.rsplit("/", 1)[0] + "/_optable.h") as f:
        assert f.read() == _halfconv_gen.header(optable)


def test_a_malformed_entry_is_refused_by_name():
    x0, x1 = optable.X0, optable.X1
    bad = [
        (optable.Op("twice", ("x",), optable.add(x0, x1)), "reads operand 1"),
        (optable.Op("odd", ("x",), optable.Expr("cube", (x0,))), "not a primitive"),
        (optable.Op("cond", ("a", "b"), optable.select(x0, x0, x1)), "as a number"),
        (optable.Op("num", ("x",), optable.add(optable.lt(x0, 0.0), 1.0)), "as a condition"),
        (optable.Op("grad", ("x",), x0, (optable.call("cube", optable.G),)), "not an op"),
        (optable.Op("arity", ("x",), x0, (optable.G, optable.G)), "2 derivatives for 1"),
    ]
    for op, message in bad:
        with pytest.raises(ValueError, match=message):
            optable.check([op])
    optable.check(optable.OPS)


def test_linear_forms_are_read_off_the_formulas():
    """The graph folds add, sub, neg and products with numbers into a product (runtime/graph/
    fuse.py): their formulas are linear; relu's, mul's of two terms and copy are not folded."""
    p, q = (1.0, 0.0), (0.0, 1.0)
    form = optable.linear_form
    assert form(optable.BY_NAME["add"], [p, q]) == (1.0, 1.0)
    assert form(optable.BY_NAME["sub"], [p, q]) == (1.0, -1.0)
    assert form(optable.BY_NAME["neg"], [p]) == (-1.0, -0.0)
    assert form(optable.BY_NAME["mul"], [p, 3.0]) == (3.0, 0.0)
    for name, args in (("mul", [p, q]), ("relu", [p]), ("copy", [p]), ("add", [p, 2.0])):
        assert form(optable.BY_NAME[name], args) is None


@pytest.mark.parametrize("name", PUBLIC)
def test_each_op_is_right_into_an_out_interleaved_with_its_input(name):
    """out and an input in one buffer, on disjoint elements whose spans overlap (every other
    row of a (3, 2) view against the middle two elements): no overlap, so the kernel runs on
    them as they are, and must not take out for the input (np.may_share_memory says True of
    them; a select wrote only half of out where_finite thought out was its a)."""
    host = [_stored(x, np.dtype("float64")) for x in _operands(name, (1, 2), 7)]
    first = next(i for i, x in enumerate(host) if x.dtype != np.bool_)
    data = np.arange(6.0) + 10.0
    data[2:4] = host[first][0]
    buffer = runtime.tensor(data)
    out = runtime.view(buffer, (3, 2))[0:3:2]
    inputs: list[Any] = [runtime.tensor(x[0]) for x in host]
    inputs[first] = runtime.view(buffer, (2,), offset=2)
    getattr(ops, name)(*inputs, out=out)
    want = REFERENCES[name].numpy(*[x[0] if x.dtype == np.bool_ else x[0] for x in host])
    np.testing.assert_allclose(out.numpy(), np.broadcast_to(want, (2, 2)), rtol=1e-13)


@pytest.mark.parametrize("name", BINARY)
def test_each_binary_op_is_right_into_its_own_input_of_fewer_dimensions(name):
    """out (1, 3) over the same elements as a (3,): the identical view, broadcast (the NumPy
    device's kernels get inputs unbroadcast)."""
    host = _operands(name, (1, 3), 8)
    buffer = runtime.tensor(host[0][0].copy())
    out = runtime.view(buffer, (1, 3))
    getattr(ops, name)(buffer, float(host[1][0, 0]), out=out)
    want = REFERENCES[name].numpy(host[0][0], host[1][0, 0])
    np.testing.assert_allclose(out.numpy()[0], want, rtol=1e-13)
