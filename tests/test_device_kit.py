"""The device kit (backends/testing.py) over every device here, and over devices planted with
the bugs a backend author can make.

Every rule of `backends.testing.RULES` passes on the CPU, on OpenCL (PoCL), on the naive test
device (tests/naive_device.py) and on CUDA where present. Each planted device breaks one rule
(a wrong kernel, a misaligned raw_alloc, a view that ignores its offset, a capability claimed
without its hook, ...) and `check_device` fails it with a message that names that rule.
docs/backends.md runs the kit over the device it writes (tests/test_docs.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

import backends
from backends import Device, testing
from backends.numpy import NumpyDevice
from naive_device import NaiveDevice

KINDS = [kind for kind in ("cpu", "opencl", "cuda") if kind in backends.available()]
DEVICES = {kind: backends.get_device(kind) for kind in KINDS}
DEVICES["naive"] = NaiveDevice()


@pytest.mark.parametrize("rule", testing.RULES)
@pytest.mark.parametrize("name", DEVICES)
def test_every_device_here_keeps_the_rule(name, rule):
    """A broken rule raises AssertionError naming it (the planted devices below show each
    rule failing)."""
    assert testing.check_device(DEVICES[name], examples=25, rules=[rule]) == [rule]


def test_the_kit_runs_the_rules_it_is_asked_for_and_names_an_unknown_one():
    testing.check_device(DEVICES["cpu"], examples=2, rules=["views", "queues"])
    with pytest.raises(ValueError, match="no rule 'view'; the rules are required hooks, "):
        testing.check_device(DEVICES["cpu"], rules=["view"])


# ---------------------------------------------------------------------- planted bugs
class WrongKernel(NumpyDevice):
    """Planted: sub computes b - a."""

    def _binary(self, name: str, a: Any, b: Any, out: Any) -> None:
        if name == "sub":
            a, b = b, a
        super()._binary(name, a, b, out)


class InexactExp(NumpyDevice):
    """Planted: exp a few hundred ULPs off (float32), a NaN payload aside."""

    def _unary(self, name: str, x: Any, out: Any) -> None:
        super()._unary(name, x, out)
        if name == "exp":
            np.multiply(out, 1 + 3e-5, out=out)


class Misaligned(NumpyDevice):
    """Planted: raw memory starts 8 bytes past the alignment."""

    def _raw_alloc(self, nbytes: int) -> np.ndarray:
        return super()._raw_alloc(nbytes + 8)[8:]


class IgnoresOffset(NumpyDevice):
    """Planted: a view starts at the raw memory's first byte, whatever the offset."""

    def _array_view(self, raw, offset, shape, dtype, strides) -> np.ndarray:
        if all(s >= 0 for s in strides):  # NOTE: else NumPy would refuse a view out of bounds
            offset = 0
        return super()._array_view(raw, offset, shape, dtype, strides)


class CopiesInPlace(NumpyDevice):
    """Planted: copyin writes at byte 0, whatever the offset."""

    def _copyin(self, raw: Any, offset: int, host_bytes: np.ndarray) -> None:
        super()._copyin(raw, 0, host_bytes)


class WritesPastTheView(NumpyDevice):
    """Planted: the copy kernel also zeroes the byte after its output's last element."""

    def _unary(self, name: str, x: Any, out: Any) -> None:
        super()._unary(name, x, out)
        if name == "copy" and out.size and out.flags.c_contiguous:
            after = out.__array_interface__["data"][0] + out.nbytes
            base = out.base
            while isinstance(base, np.ndarray) and base.base is not None:
                base = base.base
            start = base.__array_interface__["data"][0]
            if after < start + base.nbytes:
                base.view(np.uint8).reshape(-1)[after - start] ^= 0xFF


class ReadsOutAtBetaZero(NumpyDevice):
    """Planted: gemm with beta 0 adds the old out anyway (0 * NaN is NaN)."""

    def _gemm(self, a: Any, b: Any, out: Any, alpha: float, beta: float) -> None:
        old = out.copy()
        np.matmul(a, b, out=out)
        np.multiply(out, alpha, out=out)
        out += beta * old

    def _matmul(self, a: Any, b: Any, out: Any) -> None:
        self._gemm(a, b, out, 1.0, 0.0)

    def scratch(self, shape: Any, dtype: Any) -> np.ndarray:
        # NOTE: a two-byte product runs in float32 scratch that out is not copied into at beta
        # 0; np.empty's garbage showed the planted read on some draws only, and hypothesis
        # could not replay the one that did. NaN shows it on every draw
        return np.full(tuple(shape), np.nan if np.dtype(dtype).kind == "f" else 0, dtype)

    def _in_float32(self, kernel: Any, inputs: Any, outs: Any, read: bool = False) -> None:
        # NOTE: the base class's, whose float32 targets come from `scratch` above: NumpyDevice's
        # own takes np.empty (so the NaN scratch never reached a product, and the flake stayed)
        Device._in_float32(self, kernel, inputs, outs, read)


class SumsTheWrongAxis(NumpyDevice):
    """Planted: a reduction over axis 0 keeps the sum of the first row."""

    def _reduce(self, name, x, axis, keepdims, out) -> None:
        super()._reduce(name, x, axis, keepdims, out)
        if axis == (0,) and x.shape[0] > 1 and not keepdims:
            out[...] = x[0]


class WritesBeforeItChecks(NumpyDevice):
    """Planted: cross_entropy writes probs before it looks at the labels."""

    def _cross_entropy(self, logits, labels, losses, probs) -> None:
        probs[...] = 0
        super()._cross_entropy(logits, labels, losses, probs)


class ClaimsCompiledChains(NumpyDevice):
    """Planted: claims compiles_fused and writes no `_compile_fused` (the base's, which the
    CPU's own replaces)."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, compiles_fused=True)
    _compile_fused = Device._compile_fused


class ChainsLoneStepsWithoutChains(NumpyDevice):
    """Planted: asks a graph to run its lone steps as compiled chains, and compiles none."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, compiles_fused=False,
                                       chains_lone_steps=True)
    _compile_fused = Device._compile_fused


class MomentsDropsASample(NumpyDevice):
    """Planted: batch norm's statistics over every sample but the last."""

    def _moments(self, x, mean, m2) -> None:
        super()._moments(x[:-1] if x.shape[0] > 1 else x, mean, m2)


class ColumnsLoseTheLastTap(NumpyDevice):
    """Planted: im2col leaves the last window element's row of the columns zero."""

    def _im2col(self, x, kernel, stride, padding, columns) -> None:
        super()._im2col(x, kernel, stride, padding, columns)
        columns[-1] = 0


class HidesReadOnlyMemory(NumpyDevice):
    """Planted: hands out read-only memory and claims none."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, read_only_memory=False)


class ChainRoundsOnce(NumpyDevice):
    """Planted: a compiled chain computes in float64 and rounds once at the end, where each
    link's kernel rounds to its own dtype."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, compiles_fused=True)

    def _compile_fused(self, program, inputs, out):
        def run() -> None:
            results: list[Any] = []
            for name, args, _ in program:
                operands = [np.asarray(inputs[ref], np.float64) if kind == "input"
                            else results[ref] if kind == "link" else ref for kind, ref in args]
                target = np.empty(out.shape, np.float64)
                backends.get_device("cpu").elementwise(name, operands, target)
                results.append(target)
            np.copyto(out, results[-1], casting="unsafe")
        return run

    def _sub_scaled(self, a, b, scale, out, scratch) -> None:
        # NOTE: the CPU's own (without the C extension the base runs it as a compiled chain,
        # which would show this device's bug under the sub_scaled rule first)
        backends.get_device("cpu").sub_scaled(a, b, scale, out, scratch)


class HalfHookWritesAndDeclines(NumpyDevice):
    """Planted: `_half_elementwise` writes out, then says it took nothing."""

    def _half_elementwise(self, name, operands, out) -> bool:
        out[...] = 0
        return False


class ClaimsQueuesItHasNot(NumpyDevice):
    """Planted: a synchronous device whose home queue is None although it claims queues."""

    capabilities = dataclasses.replace(NumpyDevice.capabilities, queues=True)

    def _home_queue(self) -> Any:
        return None

    _queue_key = _record_event = _event_done = _wait_event = _join = _synchronize = (
        lambda self, *args: None)


class PoolSkipsNaN(NumpyDevice):
    """Planted: max pooling that passes NaN by (a scan on `v > best` alone)."""

    def _max_pool2d(self, x, kernel, stride, padding, out, indices) -> None:
        with np.errstate(invalid="ignore"):
            clean = np.where(np.isnan(x), -np.inf, x).astype(x.dtype)
        super()._max_pool2d(clean, kernel, stride, padding, out, indices)


class NoTernary(Device):
    """Planted: a device that writes everything but `_ternary`."""


for _hook in Device.REQUIRED_HOOKS:
    if _hook != "_ternary":
        setattr(NoTernary, _hook, NumpyDevice.__dict__[_hook])


PLANTED = [
    (WrongKernel, "elementwise kernels", r"sub\(float32\): element \d+ is"),
    (InexactExp, "elementwise kernels", r"exp\(float32\): element \d+ is .* ULPs apart"),
    (Misaligned, "raw memory", r"not a multiple of the alignment 64 \(8 past one\)"),
    (IgnoresOffset, "views", "byte offset"),
    (CopiesInPlace, "copies", "copied in at byte"),
    (WritesPastTheView, "copy kernel", "outside the view"),
    (ReadsOutAtBetaZero, "products", "beta=0.0"),
    (SumsTheWrongAxis, "reductions", r"over \(0,\)"),
    (WritesBeforeItChecks, "cross entropy", "a refused label left probs written"),
    (ClaimsCompiledChains, "capabilities", "claims compiles_fused but does not write "
                                           "_compile_fused"),
    (ChainsLoneStepsWithoutChains, "capabilities", "claims chains_lone_steps without "
                                                   "compiles_fused"),
    (MomentsDropsASample, "channel statistics", r"moments\(float32\) of \(2, 3, 5\)"),
    (ColumnsLoseTheLastTap, "convolution columns", r"kernel \(3, 3\).*: im2col"),
    (HidesReadOnlyMemory, "capabilities", "writes _raw_alloc_read_only, _is_read_only but does "
                                          "not claim read_only_memory"),
    (ChainRoundsOnce, "fused chains", "chain"),
    (HalfHookWritesAndDeclines, "half kernels", "returned False but wrote out"),
    (ClaimsQueuesItHasNot, "queues", "claims queues but has no home queue"),
    (NoTernary, "required hooks", "^.*_ternary not written"),
    (PoolSkipsNaN, "max pooling", r"max_pool2d \(\d, \d, \d, \d\) kernel"),
]


@pytest.mark.parametrize(("device_class", "rule", "message"), PLANTED,
                         ids=[cls.__name__ for cls, _, _ in PLANTED])
def test_a_planted_bug_fails_the_kit_naming_its_rule(device_class, rule, message):
    device = device_class()
    device.name = device_class.__name__.lower()
    with pytest.raises(AssertionError) as caught:
        testing.check_device(device, examples=60)
    text = str(caught.value)
    assert text.startswith(f"[{rule}] {device_class.__name__} "), text
    assert re.search(message, text), text


def test_the_rules_before_the_broken_one_pass_on_a_planted_device():
    """Each planted device breaks its rule alone among those run before it (check_device
    stops at the first): the others hold on NumPy's memory and kernels."""
    order = list(testing.RULES)
    for device_class, rule, _ in PLANTED:
        before = order[:order.index(rule)]
        testing.check_device(device_class(), examples=10, rules=before)
