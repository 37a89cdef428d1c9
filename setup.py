"""Builds the optional C accelerators; all metadata is in setup.cfg.

`allocators._speedups` (the caching allocator's hot path), `runtime._dispatch` (the eager fast
path of elementwise ops) and `backends._halfconv` (float16 and bfloat16 <-> float32 conversion)
are optional: where they cannot be compiled, blockrt installs without them and runs the same code
in Python (allocators/_core.py, runtime/fastpath.py, np.copyto in backends/numpy.py).
`backends._torchalloc` holds the two C functions PyTorch's pluggable CUDA allocator loads
(`backends.cuda.use_with_torch`, which needs it).

`backends/_optable.h`, the op table `_halfconv` compiles, is written here from
backends/optable.py (Note [one declaration per op]) before anything is compiled; the two
modules are loaded by path, since they import nothing but the standard library and NumPy may
not be importable yet.
"""

import importlib.util
import pathlib
import sys

from setuptools import Extension, setup

HERE = pathlib.Path(__file__).parent


def _load(name: str, path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # NOTE: dataclasses look their module up while it is made
    spec.loader.exec_module(module)
    return module


def write_optable_header() -> None:
    """backends/_optable.h from the table, rewritten only where its text changes."""
    optable = _load("_blockrt_optable", HERE / "backends" / "optable.py")
    generator = _load("_blockrt_halfconv_gen", HERE / "backends" / "_halfconv_gen.py")
    target = HERE / "backends" / "_optable.h"
    text = generator.header(optable)
    if not target.exists() or target.read_text() != text:
        target.write_text(text)


write_optable_header()
setup(ext_modules=[
    Extension("allocators._speedups", ["allocators/_speedups.c"], optional=True),
    Extension("runtime._dispatch", ["runtime/_dispatch.c"], optional=True),
    Extension("backends._halfconv", ["backends/_halfconv.c"], optional=True,
              depends=["backends/_optable.h", "backends/_erf_table.h", "backends/_pool.h"]),
    Extension("backends._torchalloc", ["backends/_torchalloc.c"], optional=True),
])
