"""Compile every CUDA kernel blockrt generates, with nvcc, on a machine with no GPU.

Run by `.ci/cuda-compile`, in a virtual environment holding CuPy (pinned there: this uses
CuPy's private code generator, `cupy._core._kernel._get_elementwise_kernel_code`, to get the
exact source CuPy would compile for each kernel and argument dtypes). It catches what only a GPU
run caught before: a formula or a two-byte link that does not compile with CuPy's float16 and
bfloat16 types. It runs nothing; `.ci/cuda` on a GPU machine runs the kernels against their
bit-for-bit tests.

Kernels: each half kernel (`_half_kernel`) for every op of backends/optable.py, both two-byte
dtypes and every mix of float operands (out's dtype, float32, a number; a bool condition);
each float kernel of `_kernels()` for float32 and
float64; the fused chains of tests/test_cuda.py, float and two-byte; and every chain the graph
runtime emits for small training steps (`emitted`: float32, half storage and mixed precision,
SGD and Adam), as `CudaDevice._compile_fused` would compile it. All go into one translation
unit, each in its own namespace under its own name, and nvcc compiles it once.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import cupy
import ml_dtypes
import numpy as np
from cupy._core import _carray, _scalar
from cupy._core import _kernel as cupy_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from backends import cuda, optable
from helpers import float_chain, half_chain

F16, BF16, F32, F64 = (np.dtype(d) for d in ("float16", ml_dtypes.bfloat16, "float32",
                                             "float64"))
I64, BOOL = np.dtype("int64"), np.dtype("bool")
#: CuPy's argument kinds (cupy/_core/_kernel.pxd, _ArgKind)
NDARRAY, INDEXER, SCALAR = 1, 2, 3


def source(kernel: cupy.ElementwiseKernel, args: list) -> str:
    """The body CuPy generates for `kernel` called with `args` (array dtypes, or ("number",
    dtype)) on 2-D strided arrays: its typedefs and its `extern "C"` function."""
    ins, outs = args[:kernel.nin], args[kernel.nin:]
    in_types = tuple(None if isinstance(a, tuple) else a.type for a in ins)
    _, _, type_map = kernel._decide_params_type(in_types, tuple(a.type for a in outs))
    infos = [cupy_kernel._ArgInfo(SCALAR, _scalar.CScalar, np.dtype(a[1]), 0, True, True)
             if isinstance(a, tuple) else
             cupy_kernel._ArgInfo(NDARRAY, cupy.ndarray, a, 2, False, True) for a in args]
    infos.append(cupy_kernel._ArgInfo(INDEXER, _carray.Indexer, None, 2, True, True))
    return cupy_kernel._get_elementwise_kernel_code(tuple(infos), type_map, kernel.params,
                                                    kernel.operation, kernel.name,
                                                    kernel.preamble)


def chain(program: list, inputs: tuple,
          out: np.dtype) -> tuple[cupy.ElementwiseKernel, list] | None:
    """The kernel `CudaDevice._compile_fused` compiles for a program on arrays of these dtypes
    (through its own `_chain_call`), and its args; None where the program runs the blocked
    default."""
    call = cuda._chain_call(program, [np.empty(0, d) for d in inputs], np.empty(0, out))
    if call is None:
        return None
    key, values = call
    kernel, params = cuda._chain_kernel(*key)
    return kernel, [("number", values[p].dtype) if p[0] == "n" else values[p].dtype
                    for p in params] + [out]


def emitted() -> list[tuple[str, list, tuple, np.dtype]]:
    """Every fused program the graph runtime emits for small training steps, run on the CPU
    device: an MLP in float32, float16 and bfloat16 storage and in mixed float16 (with its
    loss scaler) and bfloat16, under SGD with momentum and under Adam, each captured by
    `runtime.graph` (static plan, fused). As (label, program, input dtypes, out dtype)."""
    import runtime
    from backends.base import Device
    from runtime import nn

    seen: dict[str, tuple[str, list, tuple, np.dtype]] = {}
    original = Device.prepare_fused

    def record(self: Any, program: Any, inputs: Any, out: Any, *args: Any, **kw: Any) -> Any:
        if not kw.get("compiled_only"):  # NOTE: a lone step's chain: the CPU's alone
            program = list(program)
            dtypes = tuple(x.dtype for x in inputs)
            seen.setdefault(repr((program, dtypes, out.dtype)),
                            (f"emitted chain {len(seen)}", program, dtypes, out.dtype))
        return original(self, program, inputs, out, *args, **kw)

    Device.prepare_fused = record
    try:
        x = np.random.default_rng(0).normal(0, 1, (8, 16)).astype(np.float32)
        labels = np.arange(8) % 4
        for storage, precision, optimizer in itertools.product(
                ("float32", "float16", "bfloat16"), (None, "float16", "bfloat16"),
                ("sgd", "adam")):
            if precision is not None and storage != "float32":
                continue  # NOTE: mixed precision keeps float32 masters
            model = nn.Sequential(nn.Dense(16, 32, dtype=storage, rng=1), nn.ReLU(),
                                  nn.Dense(32, 4, dtype=storage, rng=2))
            opt = (nn.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
                   if optimizer == "sgd" else nn.Adam(model.parameters(), lr=1e-3))
            step = runtime.graph(nn.train_step(model, opt, precision=precision))
            for _ in range(2):
                step(x.astype(storage) if precision is None else x, labels)
    finally:
        Device.prepare_fused = original
    return list(seen.values())


def chains() -> list[tuple[str, cupy.ElementwiseKernel, list]]:
    """The chains of tests/test_cuda.py (tests/helpers.py): a float one per float dtype, a
    two-byte one (float32 links among them) per two-byte dtype, and a two-byte chain stored as
    float32."""
    found = [(f"chain {dtype}", *chain(float_chain(dtype), (dtype, dtype), dtype))
             for dtype in (F32, F64)]
    for half in (F16, BF16):
        found.append((f"chain {half}", *chain(half_chain(half), (half, half), half)))
        program = [("mul", (("input", 0), ("input", 1)), half), ("exp", (("link", 0),), F32)]
        found.append((f"chain {half} into float32", *chain(program, (half, F32), F32)))
    return found


def kernels() -> list[tuple[str, cupy.ElementwiseKernel, list]]:
    """Every kernel to compile: (label, kernel, args)."""
    found = []
    for op in optable.OPS:
        if op.name == "copy":
            continue  # NOTE: CuPy's copyto, no kernel of ours
        floats = op.operand_kinds.count(optable.FLOAT)
        for half, mix in itertools.product((F16, BF16),
                                           itertools.product(("out", "float32", "number"),
                                                             repeat=floats)):
            if set(mix) == {"number"}:
                continue
            kinds = iter(mix)
            chosen = ["bool" if kind == optable.BOOL else next(kinds)
                      for kind in op.operand_kinds]
            args = [("number", F32) if m == "number" else half if m == "out" else
                    BOOL if m == "bool" else F32 for m in chosen]
            kernel = cuda._half_kernel(op.name, tuple(m == "number" for m in chosen))
            found.append((f"half {op.name} {half} ({', '.join(chosen)})", kernel, args + [half]))
    for (name, kernel), dtype in itertools.product(cuda._kernels().items(), (F32, F64)):
        if name == "cross_entropy_backward":
            args = [dtype, I64, dtype, I64, dtype]
        else:
            args = [BOOL if kind == optable.BOOL else dtype
                    for kind in optable.BY_NAME[name].operand_kinds] + [dtype]
        found.append((f"{name} {dtype}", kernel, args))
    for dtype in (F32, F64):  # NOTE: embedding's backward (`CudaDevice._scatter_add`)
        found.append((f"scatter_add {dtype}", cuda._scatter_add_kernel(),
                      [dtype, I64, ("number", I64), ("number", I64), dtype]))
    found += chains()
    programs = emitted()
    blocked = []
    for label, program, inputs, out in programs:
        made = chain(program, inputs, out)
        if made is None:  # NOTE: runs the blocked default on CUDA
            blocked.append(f"{label}: {[(n, str(d)) for n, _, d in program]} on "
                           f"{[str(d) for d in inputs]} into {out}")
        else:
            found.append((label, *made))
    print(f"{len(programs)} chains emitted by the training steps; {len(blocked)} of them run "
          f"the blocked default on CUDA{':' if blocked else ''}")
    for line in blocked:
        print(f"  {line}")
    return found


def main() -> int:
    include = os.path.join(os.path.dirname(cupy.__file__), "_core", "include")
    parts = ["#include <cassert>", "#include <cupy/carray.cuh>", "#include <cupy/float16.cuh>",
             "#include <cupy/bfloat16.cuh>"]
    labels = []
    for i, (label, kernel, args) in enumerate(kernels()):
        body = re.sub(r'^\s*#include .*$', "", source(kernel, args), flags=re.M)
        body = body.replace(f" {kernel.name}(", f" {kernel.name}_{i}(")
        parts.append(f"// {label}\nnamespace k{i} {{\n{body}\n}}")
        labels.append(label)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "blockrt_kernels.cu")
        with open(path, "w") as f:
            f.write("\n".join(parts))
        # NOTE: blockrt's kernels are compiled with --fmad=false (backends/cuda.py, _NO_FMA)
        result = subprocess.run(["nvcc", "-arch=sm_90", "-c", "--fmad=false", f"-I{include}",
                                 "-o", os.path.join(tmp, "k.o"), path],
                                capture_output=True, text=True)
        if result.returncode:
            sys.stdout.write(result.stderr[-6000:])
            for line in sorted(set(re.findall(r"\.cu\((\d+)\)", result.stderr)), key=int)[:5]:
                with open(path) as f:
                    text = f.read().splitlines()
                start = max(i for i in range(int(line)) if text[i].startswith("// "))
                print(f"in {text[start][3:]}")
            print(f"nvcc failed on blockrt's CUDA kernels ({len(labels)} of them)")
            return 1
    print(f"nvcc compiled all {len(labels)} of blockrt's CUDA elementwise kernels "
          f"(cupy {cupy.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
