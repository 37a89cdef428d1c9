"""Builds the optional C accelerators; all metadata is in setup.cfg.

`allocators._speedups` (the caching allocator's hot path), `runtime._dispatch` (the eager fast
path of elementwise ops) and `backends._halfconv` (float16 and bfloat16 <-> float32 conversion)
are optional: where they cannot be compiled, blockrt installs without them and runs the same code
in Python (allocators/_core.py, runtime/fastpath.py, np.copyto in backends/numpy.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("allocators._speedups", ["allocators/_speedups.c"], optional=True),
    Extension("runtime._dispatch", ["runtime/_dispatch.c"], optional=True),
    Extension("backends._halfconv", ["backends/_halfconv.c"], optional=True),
])
