"""`import blockrt` is the one import a user needs: it holds the runtime's public API and the
device and allocator entry points, as the same objects the layer packages define, and it stays
cheap (no optional package is imported with it).
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import re
import subprocess
import sys
import types

import pytest

import allocators
import backends
import blockrt
import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: Packages that only a backend, a plot, the demo or the tests may import.
OPTIONAL = ("pyopencl", "cupy", "matplotlib", "sklearn", "tqdm", "hypothesis", "pytest", "torch")
#: Where users read about blockrt.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
         *sorted((ROOT / "examples").glob("*.py"))]


def test_the_namespace_holds_every_name_of_the_runtime_as_the_same_object():
    missing = [name for name in runtime.__all__ if name not in blockrt.__all__]
    assert not missing, f"runtime.__all__ names missing from blockrt.__all__: {missing}"
    for name in runtime.__all__:
        assert getattr(blockrt, name) is getattr(runtime, name), name


def test_the_layers_and_their_entry_points_are_there():
    assert blockrt.allocators is allocators and blockrt.backends is backends
    assert blockrt.get_device is backends.get_device
    assert blockrt.from_queue is backends.from_queue
    assert blockrt.OutOfMemoryError is allocators.OutOfMemoryError
    assert blockrt.InvalidFreeError is allocators.InvalidFreeError
    assert blockrt.BackendUnavailableError is backends.BackendUnavailableError
    assert blockrt.graph is runtime.graph and callable(blockrt.graph)  # NOTE: not the package
    assert blockrt.ops is runtime.ops and blockrt.nn is runtime.nn


def test_every_name_in_all_exists_and_nothing_is_listed_twice():
    assert len(blockrt.__all__) == len(set(blockrt.__all__))
    assert [name for name in blockrt.__all__ if not hasattr(blockrt, name)] == []


@functools.cache
def _resolves(dotted: str) -> bool:
    """Whether `blockrt.a.b...` names something: attributes, or a submodule that imports
    (blockrt.cli, blockrt.allocators.interop), whatever was imported before."""
    obj: object = blockrt
    parts = dotted.split(".")
    for i, part in enumerate(parts[1:], start=2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        elif isinstance(obj, types.ModuleType):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                return False
        else:
            return False
    return True


def test_every_blockrt_name_the_docs_and_examples_use_exists():
    used = {}
    for page in PAGES:
        # NOTE: a name is a run of identifiers after "blockrt."; "blockrt[demo]" is no name
        for match in re.finditer(r"(?<![\w/.-])blockrt(?:\.[A-Za-z_]\w*)+", page.read_text()):
            used.setdefault(match.group(), page.relative_to(ROOT))
    assert len(used) >= 10, sorted(used)  # NOTE: the docs do use the namespace
    broken = {name: str(page) for name, page in used.items() if not _resolves(name)}
    assert not broken, f"names the docs use that blockrt does not have: {broken}"


def test_a_name_blockrt_lacks_is_reported_as_broken():
    assert _resolves("blockrt.nn.Dense") and _resolves("blockrt.cli.main")
    assert not _resolves("blockrt.no_such_name") and not _resolves("blockrt.nn.NoSuchLayer")
    assert _resolves("blockrt.allocators.interop.pyopencl_allocator")
    assert not _resolves("blockrt.allocators.no_such_module")


def test_importing_blockrt_imports_no_optional_package():
    code = ("import sys, blockrt; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({OPTIONAL!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout


def test_importing_blockrt_imports_numpy_ml_dtypes_and_its_own_packages_only():
    """docs/features.md: `import blockrt` brings NumPy, ml_dtypes and blockrt's own packages,
    and nothing else from outside Python's standard library."""
    code = ("import sys; before = set(sys.modules); import blockrt; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} "
            "- set(sys.stdlib_module_names)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    # NOTE: "_"-prefixed names are C parts of the standard library (and setuptools' path
    # hook) not listed by name; cython_runtime is the module object any Cython-built extension
    # (NumPy's) registers, not a package
    outside = {m for m in eval(result.stdout) if not m.startswith("_")} - {"cython_runtime"}
    assert outside == {"allocators", "backends", "blockrt", "ml_dtypes", "numpy", "runtime"}


@pytest.mark.parametrize("package", ["runtime", "allocators", "backends"])
def test_the_layer_packages_stay_importable_on_their_own(package):
    result = subprocess.run([sys.executable, "-c", f"import {package}; import sys; "
                             "print('blockrt' in sys.modules)"],
                            capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"  # NOTE: the layers do not reach up to blockrt


# ---------------------------------------------------------------------- blockrt.<module> imports
def _facade_modules() -> dict[str, types.ModuleType]:
    """Every public attribute of blockrt that is a module (its own, blockrt.cli, left out).
    NOTE: pytest rewrites the asserts of the plugin's distribution, blockrt included, and adds
    modules under names such as `@py_builtins`."""
    return {name: obj for name, obj in vars(blockrt).items()
            if isinstance(obj, types.ModuleType) and name.isidentifier()
            and not name.startswith("_") and not obj.__name__.startswith("blockrt.")}


def test_every_module_the_namespace_holds_imports_as_that_module():
    modules = _facade_modules()
    assert {"allocators", "backends", "runtime", "amp", "nn", "ops"} <= set(modules), modules
    for name, module in modules.items():
        assert importlib.import_module(f"blockrt.{name}") is module, name
    from blockrt.allocators import LimitAdaptor  # the line

    assert LimitAdaptor is allocators.LimitAdaptor
    import blockrt.backends

    assert blockrt.backends is backends


def test_blockrt_graph_stays_the_function_and_imports_as_the_package():
    graph_package = importlib.import_module("runtime.graph")
    assert importlib.import_module("blockrt.graph") is graph_package
    assert importlib.import_module("blockrt.runtime.graph") is graph_package
    assert blockrt.graph is runtime.graph and callable(blockrt.graph)


def test_a_name_no_layer_has_is_not_found_under_its_blockrt_name():
    with pytest.raises(ModuleNotFoundError, match="blockrt.allocators.no_such_module"):
        importlib.import_module("blockrt.allocators.no_such_module")
    with pytest.raises(ModuleNotFoundError, match="blockrt.no_such_module"):
        importlib.import_module("blockrt.no_such_module")


#: In a fresh interpreter: every module of the three layers, imported first under its blockrt
#: name (most are not loaded yet), must be the module of its own name, and leave its parent's
#: attribute as it was.
EVERY_SUBMODULE = """
import importlib, pkgutil, sys, types
import blockrt
names = []
for package in ("allocators", "backends", "runtime"):
    root = importlib.import_module(package)
    names += [package] + [info.name for info in pkgutil.walk_packages(root.__path__, package + ".")]
late = [name for name in names if name not in sys.modules]
wrong = []
for name in names:
    parent, _, child = name.rpartition(".")
    before = getattr(sys.modules[parent], child, None) if parent in sys.modules else None
    alias = importlib.import_module("blockrt." + name)
    if alias is not importlib.import_module(name) or alias.__spec__.name != name:
        wrong.append(name)
    if isinstance(before, types.FunctionType) and getattr(sys.modules[parent], child) is not before:
        wrong.append(name + " (its parent's attribute changed)")
copies = [n for n in sys.modules if n.startswith("blockrt.") and sys.modules[n].__name__ == n]
print(len(names), len(late), wrong, [n for n in copies if n.split(".")[1] in ("allocators",
      "backends", "runtime")])
"""


def test_every_submodule_of_the_layers_imports_under_blockrt_as_itself():
    result = subprocess.run([sys.executable, "-c", EVERY_SUBMODULE], capture_output=True,
                            text=True, cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    count, late, wrong, copies = result.stdout.strip().split(" ", 3)
    assert int(count) > 30 and int(late) > 0, result.stdout  # NOTE: the finder's path ran
    assert (wrong, copies) == ("[]", "[]"), result.stdout
