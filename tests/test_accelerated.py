"""The C paths register (backends/accelerated.py, STYLE.md rule 21): one leaf module holds the
switch and the table of extensions; each Python twin asks it for its extension where the twin
is defined and binds what it gets there; no module replaces another module's names; and
`blockrt info` says, for each C path, whether it is in use and why.

What the differential tests compare (test_speedups.py, test_fastpath.py, test_backward_engine.py,
test_halfconv.py) is each C path against its twin; this file holds the wiring between them.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

import allocators
from backends import accelerated
from helpers import pytest_in_pure_python
from runtime import _tensor, autograd, fastpath, ops

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("allocators", "backends", "runtime", "blockrt")


def python(code: str, **env: str) -> str:
    """The standard output of `code` run in a fresh interpreter at the checkout's root, with
    BLOCKRT_PURE_PYTHON unset unless `env` sets it."""
    environment = {key: value for key, value in os.environ.items()
                   if key != accelerated.PURE_PYTHON_ENV}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, cwd=ROOT, check=False, env={**environment, **env})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_every_c_source_is_one_path_of_the_table():
    """A C extension added to the build is a row of the table, and each row names a source."""
    sources = sorted(str(path.relative_to(ROOT)) for package in PACKAGES
                     for path in (ROOT / package).glob("*.c"))
    paths = accelerated.paths()
    assert sorted(path.source for path in paths) == sources
    for path in paths:
        package, _, name = path.module.partition(".")
        assert path.source == f"{package}/{name}.c"


def test_the_twins_bound_what_the_leaf_handed_out():
    """Each twin's module holds the C function of the extension the leaf loaded (or its own
    Python function where the path is off), bound where the twin is defined."""
    dispatch = accelerated.load("runtime._dispatch")
    if dispatch is None:
        assert autograd.record is autograd.python_record
        assert autograd._engine is None
        assert _tensor._release is _tensor.Tensor.release
        assert ops._fast is None
        return
    assert autograd.record is dispatch.record
    assert autograd._engine is dispatch.backward
    assert autograd._release is dispatch.release
    assert _tensor._release is dispatch.release
    assert (ops._fast is dispatch.elementwise) == fastpath.ACCELERATED
    speedups = accelerated.load("allocators._speedups")
    assert allocators.ACCELERATED == (speedups is not None)
    caching = allocators.create("caching", "cpu")
    assert (type(caching).allocate is allocators.Allocator.allocate) == (speedups is None)


def _unpacked(target: ast.expr) -> list[ast.expr]:
    """The names an assignment target binds: `a, (b.c, *d) = ...` binds a, b.c and d."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [leaf for part in target.elts for leaf in _unpacked(part)]
    if isinstance(target, ast.Starred):
        return _unpacked(target.value)
    return [target]


def _assigned_modules(path: pathlib.Path) -> list[str]:
    """`module.name = ...`, `del module.name` and `setattr(module, ...)` in `path`, where
    `module` is a name that an import of one of blockrt's packages bound in the file (a
    module, or a class or function of one). Thread-local state such as `autograd._mode` is
    written through its own attributes, which this leaves alone."""
    tree = ast.parse(path.read_text(), str(path))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                            if alias.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            imported.update(alias.asname or alias.name for alias in node.names)
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("setattr", "delattr") and node.args):
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in [leaf for each in targets for leaf in _unpacked(each)]:
            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                    and target.value.id in imported):
                found.append(f"line {target.lineno}: {ast.unparse(target)}")
    return found


FILES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_module_replaces_another_modules_names(path):
    """What runs is bound where it is defined: no module assigns to a name of a module (or of
    a class) it imported. `fastpath.load` once set `autograd.record`, `autograd._engine` and
    the tensor module's `_release`, and `python_only` swapped `ops._fast` and friends."""
    found = _assigned_modules(path)
    assert not found, f"{path.relative_to(ROOT)} assigns to imported modules' names: {found}"


def test_python_only_leaves_the_c_functions_bound_and_runs_python():
    """Inside `fastpath.python_only()` every C function hands its call back to its twin:
    nothing is rebound, and an elementwise op, its record and the backward pass run in Python
    (the C elementwise returns None, the C engine hands the pass back)."""
    if not fastpath.ACCELERATED:
        pytest.skip("the eager fast path is off here")
    import numpy as np

    import runtime

    bound = (ops._fast, autograd.record, autograd._engine, _tensor._release)
    x = runtime.tensor(np.ones(3, np.float32), requires_grad=True)
    with fastpath.python_only():
        assert (ops._fast, autograd.record, autograd._engine, _tensor._release) == bound
        assert ops._fast("neg", None, (x,)) is None
        assert autograd._engine(None, None, False) is None
        y = ops.mul(x, x)
        ops.sum(y).backward()
    assert ops._fast("neg", None, (x,)) is not None  # on again
    assert x.grad.numpy().tolist() == [2.0, 2.0, 2.0]


def test_the_switch_turns_every_path_off_and_says_why():
    code = ("import json, blockrt, backends\nbackends.available()\n"
            "from backends import accelerated\nfrom runtime import autograd, fastpath\n"
            "print(json.dumps([[p.module, p.in_use, p.why] for p in accelerated.paths()]))\n"
            "print(autograd.record is autograd.python_record, fastpath.ACCELERATED)")
    table, wiring = python(code, BLOCKRT_PURE_PYTHON="yes").splitlines()
    assert json.loads(table) == [[path.module, False, "off: BLOCKRT_PURE_PYTHON=yes"]
                                 for path in accelerated.paths()]
    assert wiring == "True False"


def test_an_extension_that_is_not_built_leaves_its_twin_alone():
    """`runtime._dispatch` missing (as where no C compiler was present at install; here an
    import that fails): ops, autograd and release run in Python, and the table says why."""
    code = ("import sys\nsys.modules['runtime._dispatch'] = None  # its import now fails\n"
            "import numpy as np, runtime\nfrom backends import accelerated\n"
            "from runtime import autograd, fastpath, ops\n"
            "x = runtime.tensor(np.ones(2, np.float32), requires_grad=True)\n"
            "runtime.ops.sum(runtime.ops.mul(x, x)).backward()\n"
            "(path,) = [p for p in accelerated.paths() if p.module == 'runtime._dispatch']\n"
            "print(path.in_use, path.why.split(' (')[0])\n"
            "print(fastpath.ACCELERATED, ops._fast, autograd.record is autograd.python_record,"
            " x.grad.numpy().tolist())")
    table, wiring = python(code).splitlines()
    assert table == "False not built"
    assert wiring == "False None True [2.0, 2.0]"


def test_refuse_turns_a_path_off_for_later_askers():
    module = "backends._halfconv"
    before = accelerated.load(module)
    saved = {path.module: path for path in accelerated.paths()}[module]
    try:
        accelerated.refuse(module, "a test")
        assert accelerated.load(module) is None
        (path,) = [path for path in accelerated.paths() if path.module == module]
        assert (path.in_use, path.why) == (False, "off: a test")
    finally:
        accelerated._loaded[module] = before
        accelerated._PATHS[module].in_use = saved.in_use
        accelerated._PATHS[module].why = saved.why


def test_an_unknown_path_is_refused_by_name():
    with pytest.raises(KeyError, match="'runtime._nothing' is not a C path.*allocators._speedups"):
        accelerated.load("runtime._nothing")


@pytest.mark.parametrize("value, in_use", [("", True), ("0", True), ("1", False)])
def test_blockrt_info_lists_each_c_path_in_use_or_not_and_why(value, in_use):
    environment = {key: item for key, item in os.environ.items()
                   if key != accelerated.PURE_PYTHON_ENV}
    if value:
        environment[accelerated.PURE_PYTHON_ENV] = value
    result = subprocess.run([sys.executable, "-m", "blockrt", "info"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, check=False, env=environment)
    assert result.returncode == 0, result.stderr
    for path in accelerated.paths():
        why = "in use" if in_use else f"off: {accelerated.PURE_PYTHON_ENV}={value}"
        assert f"  {path.module}: {why} ({path.runs}; {path.source})" in result.stdout


# ---------------------------------------------------------------------- CI: the pure-Python build
#: Suites whose figures or planted bugs depend on the C paths (compiled chains, the CPU's
#: sub_scaled), rerun without them: each must pass, or skip saying why, in both builds
PURE_PYTHON_SUITES = ["tests/test_graph.py", "tests/test_graph_docs.py", "tests/test_batchnorm.py",
                      "tests/test_attention.py", "tests/test_graph_layers.py"]


@pytest.mark.slow
@pytest.mark.skipif(not allocators.ACCELERATED,
                    reason="this run is pure Python already (the suites run as they are)")
def test_the_graph_and_layer_suites_pass_in_pure_python_mode():
    done = pytest_in_pure_python(
        *PURE_PYTHON_SUITES, "tests/test_device_kit.py", "-k",
        "not torch and (not test_device_kit or ChainRoundsOnce)", timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "skipped" in done.stdout, done.stdout[-500:]
