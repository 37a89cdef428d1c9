"""Compile every CUDA kernel blockrt generates, with nvcc, on a machine with no GPU.

Run by `.ci/cuda-compile`, in a virtual environment holding CuPy (pinned there: this uses
CuPy's private code generator, `cupy._core._kernel._get_elementwise_kernel_code`, to get the
exact source CuPy would compile for each kernel and argument dtypes). It catches what only a GPU
run caught before: a formula or a two-byte link that does not compile with CuPy's float16 and
bfloat16 types. It runs nothing; `.ci/cuda` on a GPU machine runs the kernels against their
bit-for-bit tests.

Kernels: each half kernel (`_half_kernel`) for every formula, both two-byte dtypes and every
mix of operands (out's dtype, float32, a number); each float kernel of `_kernels()` for float32
and float64; and the fused chains of tests/test_cuda.py, float and two-byte. All go into one
translation unit, each in its own namespace under its own name, and nvcc compiles it once.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import tempfile

import cupy
import ml_dtypes
import numpy as np
from cupy._core import _carray, _scalar
from cupy._core import _kernel as cupy_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from backends import cuda

F16, BF16, F32, F64 = (np.dtype(d) for d in ("float16", ml_dtypes.bfloat16, "float32",
                                             "float64"))
I64 = np.dtype("int64")
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


def chain(program: list, inputs: tuple, out: np.dtype) -> tuple[cupy.ElementwiseKernel, list]:
    """`_chain_kernel` for a fused program as `CudaDevice._fused` shapes it, and its args."""
    shape, numbers = [], 0
    for name, args, dtype in program:
        refs = []
        for kind, ref in args:
            if kind == "number":
                ref, numbers = numbers, numbers + 1
            refs.append((kind, ref))
        shape.append((name, tuple(refs), cuda._LETTERS[np.dtype(dtype)]))
    kernel, params = cuda._chain_kernel(tuple(shape), tuple(cuda._LETTERS[d] for d in inputs),
                                        cuda._LETTERS[out])
    number = ("number", F64 if out == F64 else F32)
    return kernel, [number if p[0] == "n" else inputs[int(p[1:])] for p in params] + [out]


def chains() -> list[tuple[str, cupy.ElementwiseKernel, list]]:
    """The chains of tests/test_cuda.py: a float one per float dtype, a two-byte one (float32
    links among them) per two-byte dtype, and a two-byte chain stored as float32."""
    found = []
    for dtype in (F32, F64):
        program = [("mul", (("input", 0), ("input", 1)), dtype),
                   ("add", (("link", 0), ("number", 0.1)), dtype),
                   ("sigmoid", (("link", 1),), dtype),
                   ("tanh_backward", (("input", 0), ("link", 2)), dtype),
                   ("sub", (("link", 3), ("link", 0)), dtype),
                   ("relu", (("link", 4),), dtype), ("tanh", (("link", 5),), dtype),
                   ("exp", (("link", 6),), dtype),
                   ("mul", (("link", 7), ("number", 3.0)), dtype)]
        found.append((f"chain {dtype}", *chain(program, (dtype, dtype), dtype)))
    for half in (F16, BF16):
        program = [("mul", (("input", 0), ("input", 1)), half),
                   ("add", (("link", 0), ("number", 0.1)), F32),
                   ("sigmoid", (("link", 1),), half),
                   ("tanh_backward", (("input", 0), ("link", 2)), half),
                   ("div", (("link", 3), ("link", 0)), F32), ("relu", (("link", 4),), half),
                   ("where_finite", (("link", 5), ("input", 1)), half),
                   ("exp", (("link", 6),), F32), ("log", (("link", 7),), half),
                   ("sub", (("link", 8), ("number", 3.0)), half),
                   ("sqrt", (("link", 9),), half),
                   ("relu_backward", (("input", 1), ("link", 10)), half),
                   ("neg", (("link", 11),), half)]
        found.append((f"chain {half}", *chain(program, (half, half), half)))
        program = [("mul", (("input", 0), ("input", 1)), half), ("exp", (("link", 0),), F32)]
        found.append((f"chain {half} into float32", *chain(program, (half, F32), F32)))
    return found


def kernels() -> list[tuple[str, cupy.ElementwiseKernel, list]]:
    """Every kernel to compile: (label, kernel, args)."""
    found = []
    for name, formula in cuda._FLOAT_FORMULAS.items():
        arity = 2 if re.search(r"\bb\b", formula) else 1
        for half, mix in itertools.product((F16, BF16),
                                           itertools.product(("out", "float32", "number"),
                                                             repeat=arity)):
            if set(mix) == {"number"}:
                continue
            args = [("number", F32) if m == "number" else half if m == "out" else F32
                    for m in mix]
            kernel = cuda._half_kernel(name, tuple(m == "number" for m in mix))
            found.append((f"half {name} {half} ({', '.join(mix)})", kernel, args + [half]))
    for (name, kernel), dtype in itertools.product(cuda._kernels().items(), (F32, F64)):
        args = ([dtype, I64, dtype, I64, dtype] if name == "cross_entropy_backward"
                else [dtype] * (kernel.nin + 1))
        found.append((f"{name} {dtype}", kernel, args))
    return found + chains()


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
