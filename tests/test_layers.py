"""The layering holds as docs/architecture.md writes it: every import of every module of the
four packages (read with `ast`: at the top of a file, inside a function, under
`if TYPE_CHECKING:` alike) points down.

- Across packages: each package imports only itself and the packages below it (the table of
  packages), and of those only their public API, a dotted path with no part that starts with
  `_`, except the reaches the table of exceptions names.
- Inside runtime/: each module imports only modules of a lower layer (the table of runtime's
  import order), and every module has a layer.
- No import makes a circle, in any package.
- No module is reached through `sys.modules` (the facade's aliases and `from_queue`'s look at
  a framework excepted, as written), a module imported by name from a table belongs to the
  table's package, and a C extension imports nothing of blockrt's.

The tables are read from docs/architecture.md itself, so the written order is the one held.
"""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterator
from typing import NamedTuple

import pytest

import allocators
import backends
from backends import accelerated

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
#: blockrt's packages, lowest first.
PACKAGES = ("backends", "allocators", "runtime", "blockrt")
#: The files (as ROOT-relative paths) that may use `sys.modules`, and for what.
SYS_MODULES = {
    "blockrt/_alias.py": "registers each module of the namespace under its blockrt. name",
    "backends/__init__.py": "asks whether pyopencl or CuPy is imported, to tell their queues apart",
}


def _rows(marker: str) -> list[list[str]]:
    """The body rows, as cells, of the first table of docs/architecture.md that starts at or
    after the line holding `marker` (a heading, or the table's own header)."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if marker in line)
    table = []
    for line in lines[start:]:
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif table:
            break
    return table[2:]  # NOTE: after the header and the |---| row


def _names(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


#: package -> the packages of blockrt's it may import (itself too).
ALLOWED = {_names(package)[0]: {_names(package)[0], *_names(others)}
           for package, others in _rows("| package | imports of blockrt's packages |")}
#: (module, module it reaches) below a public API, as written.
EXCEPTIONS = {(_names(module)[0], reached) for module, reaches, _ in
              _rows("| module | reaches below a public API | why |") for reached in
              _names(reaches)}
#: runtime module (a file's stem, or `graph` for the package) -> its layer.
LAYERS = {name: int(layer) for layer, names, _ in _rows("### Import order inside `runtime/`")
          for name in _names(names)}


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))
#: dotted name -> file, for every module of the packages (C extensions by their source)
MODULES = {_module_name(path): path for path in FILES}
EXTENSIONS = {_module_name(path): path for package in PACKAGES
              for path in (ROOT / package).glob("*.c")}


class Import(NamedTuple):
    line: int
    #: the module it loads: one of blockrt's, or another library's
    module: str
    #: the name taken from it (`from module import name`), or None
    name: str | None


def imports(path: pathlib.Path) -> Iterator[Import]:
    """Every import in `path`, wherever it is; `from a import b` of a submodule b is an import
    of the module a.b."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: a relative import; blockrt's "
                                     f"imports are absolute")
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                if dotted in MODULES or dotted in EXTENSIONS:
                    yield Import(node.lineno, dotted, None)
                else:
                    yield Import(node.lineno, node.module, alias.name)


def ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def public(found: Import) -> bool:
    parts = found.module.split(".")[1:] + ([found.name] if found.name else [])
    return not any(part.startswith("_") for part in parts)


def runtime_key(module: str) -> str:
    """A runtime module's name in the layer table: its file's stem, `graph` for the package's
    files, `__init__` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


IDS = {"ids": lambda path: str(path.relative_to(ROOT))}


def test_the_tables_are_read_from_the_document():
    assert list(ALLOWED) == list(PACKAGES)
    assert ALLOWED["backends"] == {"backends"}
    assert LAYERS["errors"] == 0 and LAYERS["__init__"] == max(LAYERS.values())
    assert ("blockrt.cli", "backends._blas") in EXCEPTIONS


@pytest.mark.parametrize("path", FILES, **IDS)
def test_each_package_imports_only_the_public_api_of_those_below_it(path):
    importer = _module_name(path)
    package = importer.split(".")[0]
    wrong = []
    for found in imports(path):
        if not ours(found.module):
            continue
        target = found.module.split(".")[0]
        if target not in ALLOWED[package]:
            wrong.append(f"line {found.line}: {found.module} ({package} imports only "
                         f"{', '.join(sorted(ALLOWED[package]))})")
        elif (target != package and not public(found)
              and (importer, found.module) not in EXCEPTIONS):
            what = f"{found.module}.{found.name}" if found.name else found.module
            wrong.append(f"line {found.line}: {what} (not {target}'s public API)")
    assert not wrong, f"{path.relative_to(ROOT)} imports against the order: {wrong}"


def in_runtime(module: str) -> bool:
    return module.split(".")[0] == "runtime"


def test_every_runtime_module_has_a_layer():
    assert sorted({runtime_key(name) for name in MODULES if in_runtime(name)}) == sorted(LAYERS)


@pytest.mark.parametrize("path", [path for path in FILES if in_runtime(_module_name(path))],
                         **IDS)
def test_a_runtime_module_imports_only_lower_layers(path):
    mine = runtime_key(_module_name(path))
    upward = []
    for found in imports(path):
        if not in_runtime(found.module) or found.module in EXTENSIONS:
            continue  # NOTE: an extension imports nothing of ours (checked below)
        theirs = runtime_key(found.module)
        if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
            upward.append(f"line {found.line}: {found.module} (layer {LAYERS[theirs]})")
    assert not upward, (f"{path.relative_to(ROOT)} (layer {LAYERS[mine]}) imports a module of "
                        f"its layer or above: {upward}")


def _graph() -> dict[str, set[str]]:
    """module -> blockrt's modules it imports."""
    return {name: {found.module for found in imports(path)
                   if found.module in MODULES and found.module != name}
            for name, path in MODULES.items()}


def test_no_import_makes_a_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                circle = visit(target)
                if circle:
                    return circle
        path.pop()
        state[name] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            circle = visit(name)
            assert circle is None, f"an import circle: {' -> '.join(circle)}"


@pytest.mark.parametrize("path", FILES, **IDS)
def test_no_module_is_reached_through_sys_modules(path):
    tree = ast.parse(path.read_text(), str(path))
    uses = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and node.attr == "modules" and isinstance(node.value, ast.Name)
            and node.value.id == "sys"]
    where = str(path.relative_to(ROOT))
    assert not uses or where in SYS_MODULES, f"{where} uses sys.modules on lines {uses}"


def test_the_uses_of_sys_modules_are_the_written_ones():
    text = DOC.read_text()
    assert "`blockrt/_alias.py`" in text and "`backends.from_queue`" in text
    looked_up = {module.split(".")[0] for module, _ in backends.QUEUE_TYPES.values()}
    assert looked_up.isdisjoint(PACKAGES), "from_queue looks up frameworks only"


def test_a_table_of_modules_names_its_own_package():
    for kind, spec in backends.BACKENDS.items():
        assert spec.startswith("backends."), (kind, spec)
    for name, spec in allocators.BUILTINS.items():
        assert spec.startswith("allocators."), (name, spec)
    assert {path.module for path in accelerated.paths()} == set(EXTENSIONS)


@pytest.mark.parametrize("source", sorted(EXTENSIONS.values()), **IDS)
def test_a_c_extension_imports_nothing_of_blockrts(source):
    text = source.read_text()
    calls = re.findall(r"PyImport_\w+\(\s*\"([^\"]+)\"", text)
    assert not [name for name in calls if ours(name)], (source, calls)
    assert not re.search(r"PyImport_(Import|ImportModule\w*)\((?!\s*\")", text), (
        f"{source.name} imports a module named at run time")


def test_the_calls_up_to_ops_are_the_ops_themselves():
    """Note [calls up to ops]: each field of `upcalls.OPS` is the op of runtime.ops of its
    name, set once; an `Ops` that runtime.ops has not filled says so when called."""
    from runtime import ops, upcalls

    fields = upcalls.Ops.__slots__
    assert all(getattr(upcalls.OPS, name) is getattr(ops, name) for name in fields)
    with pytest.raises(ValueError, match="add, sub, mul, div, matmul, neg, copy, sum set before"):
        upcalls.OPS.provide(**{name: getattr(ops, name) for name in fields})
    empty = upcalls.Ops()
    with pytest.raises(RuntimeError, match=r"runtime.ops.add was called before runtime.ops was"):
        empty.add(1, 2)
    with pytest.raises(ValueError, match="takes exactly add, sub, .*; got add$"):
        empty.provide(add=ops.add)
