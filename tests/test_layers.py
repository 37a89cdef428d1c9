"""The import order inside `runtime/`, as docs/architecture.md writes it, holds: no module imports
(at the top or inside a function) a module of a later layer, and every module has a layer.

Within the tensor core (layer 3) the modules import one another, the same pragmatic coupling as
micrograd's and PyTorch's tensors: cycles there are broken by imports inside functions.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: runtime module -> layer; a module may import only modules of its layer or lower ones.
LAYERS = {
    "errors": 0, "aliasing": 0, "planner": 0, "dtypes": 0,
    "block": 1,
    "config": 2,
    "tape": 3, "autograd": 3, "tensor": 3, "dlpack": 3, "fastpath": 3, "ops": 3,
    "constant": 4,
    "amp": 5, "nn": 5, "graph": 5,
    "summary": 6,
    "__init__": 7,
}
#: C extensions of runtime/ (built from .c files): they import no runtime module, so any layer
#: may import them.
EXTENSIONS = {"_dispatch": 0}


def runtime_imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, runtime module) for every import of a runtime module in `path`, wherever it is."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "runtime":
                    found.append((node.lineno, "__init__"))
                elif alias.name.startswith("runtime."):
                    found.append((node.lineno, alias.name.split(".")[1]))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "runtime":
                found += [(node.lineno, alias.name) for alias in node.names
                          if alias.name in LAYERS or alias.name in EXTENSIONS]
                if any(alias.name not in LAYERS and alias.name not in EXTENSIONS
                       for alias in node.names):
                    found.append((node.lineno, "__init__"))
            elif node.module.startswith("runtime."):
                found.append((node.lineno, node.module.split(".")[1]))
    return found


def module_of(path: pathlib.Path) -> str:
    """The runtime module a file belongs to: its stem, or its package's name (runtime/graph/)."""
    relative = path.relative_to(ROOT / "runtime")
    return relative.parts[0] if len(relative.parts) > 1 else path.stem


FILES = sorted((ROOT / "runtime").rglob("*.py"))


def test_every_runtime_module_has_a_layer():
    assert sorted({module_of(path) for path in FILES}) == sorted(LAYERS)


@pytest.mark.parametrize("path", FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_module_imports_a_later_layer(path):
    mine = LAYERS[module_of(path)]
    layers = {**LAYERS, **EXTENSIONS}
    upward = [f"line {line}: {name} (layer {layers[name]})"
              for line, name in runtime_imports(path) if layers[name] > mine]
    assert not upward, f"{path.relative_to(ROOT)} (layer {mine}) imports upward: {upward}"


def test_the_layers_are_the_documented_ones():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for name in LAYERS:
        assert f"`{name}`" in text, f"docs/architecture.md does not place runtime/{name}.py"
