"""Builds the optional C accelerators; all metadata is in setup.cfg.

`allocators._speedups` (the caching allocator's hot path) and `runtime._dispatch` (the eager fast
path of elementwise ops) are optional: where they cannot be compiled, blockrt installs without
them and runs the same code in pure Python (allocators/_core.py, runtime/fastpath.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("allocators._speedups", ["allocators/_speedups.c"], optional=True),
    Extension("runtime._dispatch", ["runtime/_dispatch.c"], optional=True),
])
