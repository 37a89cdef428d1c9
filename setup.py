"""Builds the optional C accelerator of the caching allocator; all metadata is in setup.cfg.

`allocators._speedups` is optional: where it cannot be compiled, blockrt installs without it
and runs the same code in pure Python (see allocators/_core.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("allocators._speedups", ["allocators/_speedups.c"], optional=True)])
