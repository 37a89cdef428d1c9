"""Named notes (docs/architecture.md, "Comments and named notes"): an invariant that spans files
is written once, in its home file, and referred to by name wherever it applies.

Checked here over every source and document of the repository: each note referred to is defined
exactly once; a reference that names a file names the note's home; each note is referred to
from outside its home (a note nobody refers to needs no name); and the table of
docs/architecture.md lists every note with its home. The checker is also run on small made-up
trees, so that each of these failures is seen to be reported.
"""

from __future__ import annotations

import os
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: The files searched for notes, by suffix.
SUFFIXES = (".py", ".md", ".c", ".h", ".cfg", ".toml")
#: Directories never searched: builds, environments, caches.
SKIPPED = {".git", ".venv", "build", "dist", "__pycache__", ".hypothesis", ".pytest_cache",
           ".ruff_cache", "node_modules"}
#: Names that stand for any note in the convention's own description (docs/architecture.md).
PLACEHOLDERS = {"name", "..."}

_WORD = "Note"
#: A definition in code or a docstring: a line that opens with the name and a colon, after an
#: optional comment marker.
_DEFINITION = re.compile(rf"^\s*(?:#\s*|/\*\s*)?{_WORD} \[([^\]\n]+)\]:")
#: A definition in Markdown: a heading that is the name alone.
_HEADING = re.compile(rf"^#{{1,6}} {_WORD} \[([^\]\n]+)\]\s*$")
#: Comment markers and quote marks that open a continued line, dropped before joining lines.
_MARKER = re.compile(r"^\s*(?:#:|#|//|/\*|\*/|\*)?\s*")
_REFERENCE = re.compile(rf"{_WORD} \[([^\]]+)\]")
#: A reference that names a file: `... in path/file.py` (backquotes allowed).
_WITH_HOME = re.compile(rf"{_WORD} \[([^\]]+)\]\)?,?\s+in\s+`?([\w./-]+\.(?:py|md|c|h))\b")


def repository_texts() -> dict[str, str]:
    """Every searched file of the repository: relative path -> text."""
    texts = {}
    for folder, folders, files in os.walk(ROOT):
        folders[:] = sorted(name for name in folders
                            if name not in SKIPPED and not name.endswith(".egg-info")
                            and not name.startswith(".venv"))  # NOTE: .venv-cuda-compile too
        for name in sorted(files):
            path = pathlib.Path(folder, name)
            if path.suffix in SUFFIXES:
                texts[path.relative_to(ROOT).as_posix()] = path.read_text(errors="replace")
    return texts


def definitions(texts: dict[str, str]) -> dict[str, list[tuple[str, int]]]:
    """Note name -> every (file, line) that defines it."""
    found: dict[str, list[tuple[str, int]]] = {}
    for file, text in texts.items():
        pattern = _HEADING if file.endswith(".md") else _DEFINITION
        for number, line in enumerate(text.splitlines(), 1):
            match = pattern.match(line)
            if match:
                found.setdefault(match.group(1), []).append((file, number))
    return found


def _joined(text: str) -> str:
    """`text` as one line: comment markers dropped, so that a name wrapped across lines of a
    comment or a docstring reads whole."""
    return " ".join(_MARKER.sub("", line) for line in text.splitlines())


def references(texts: dict[str, str]) -> list[tuple[str, str, str | None]]:
    """(file, name as written, file named after it or None) for every mention that is not a
    definition (a definition counts as one mention of its own name, which is dropped)."""
    found = []
    defined = definitions(texts)
    for file, text in texts.items():
        flat = _joined(text)
        homes = {match.start(): match.group(2) for match in _WITH_HOME.finditer(flat)}
        own = [name for name, places in defined.items() for place in places if place[0] == file]
        for match in _REFERENCE.finditer(flat):
            name = " ".join(match.group(1).split())
            if name in own:
                own.remove(name)  # the definition itself
                continue
            found.append((file, name, homes.get(match.start())))
    return found


def _table(texts: dict[str, str]) -> dict[str, str]:
    """Note name -> home, as the table of docs/architecture.md lists them."""
    rows = re.findall(rf"^\| `{_WORD} \[([^\]]+)\]` \| `([^`]+)` \|", texts.get(
        "docs/architecture.md", ""), flags=re.MULTILINE)
    return dict(rows)


def problems(texts: dict[str, str]) -> list[str]:
    """Every way `texts` breaks the named-note rules, as messages."""
    found = []
    defined = definitions(texts)
    for name, places in sorted(defined.items()):
        if len(places) > 1:
            where = ", ".join(f"{file}:{line}" for file, line in places)
            found.append(f"note [{name}] is defined {len(places)} times: {where}")
    referred: dict[str, set[str]] = {}
    for file, name, home in references(texts):
        if name in PLACEHOLDERS:
            continue
        if name not in defined:
            found.append(f"{file}: refers to note [{name}], which is defined nowhere")
            continue
        note = name
        referred.setdefault(note, set()).add(file)
        home_file = defined[note][0][0]
        if home is not None and home != home_file:
            found.append(f"{file}: refers to note [{note}] in {home}, but it lives in "
                         f"{home_file}")
    for note, places in sorted(defined.items()):
        if not referred.get(note, set()) - {places[0][0]}:
            found.append(f"note [{note}] ({places[0][0]}) is referred to from no other file")
    if "docs/architecture.md" in texts:
        listed = _table(texts)
        homes = {note: places[0][0] for note, places in defined.items()}
        for note in sorted(set(listed) | set(homes)):
            if listed.get(note) != homes.get(note):
                found.append(f"docs/architecture.md lists note [{note}] in {listed.get(note)}, "
                             f"but it is defined in {homes.get(note)}")
    return found


def test_the_repository_keeps_its_named_notes():
    texts = repository_texts()
    assert len(definitions(texts)) >= 8, sorted(definitions(texts))
    assert problems(texts) == []


# ---------------------------------------------------------------------- the checker itself
def _note(name: str) -> str:
    return f"{_WORD} [{name}]"


def _tree() -> dict[str, str]:
    """A small repository that keeps the rules: two notes, each referred to from elsewhere."""
    return {
        "pkg/a.py": f'"""Module.\n\n{_note("one")}: the first invariant.\n"""\n',
        "pkg/b.py": f"# {_note('two')}: the second invariant,\n# over two lines.\nx = 1\n",
        "pkg/c.py": (f"y = 2  # NOTE: {_note('one')} in pkg/a.py\n"
                     f"# NOTE: the second, wrapped: {_WORD}\n# [two] in pkg/b.py\n"),
        "docs/architecture.md": (f"| `{_note('one')}` | `pkg/a.py` | first |\n"
                                 f"| `{_note('two')}` | `pkg/b.py` | second |\n"
                                 f"Any `{_note('name')}` is written once.\n"),
    }


def test_the_checker_accepts_a_tree_that_keeps_the_rules():
    assert problems(_tree()) == []


def test_a_reference_to_a_note_nobody_defined_is_reported():
    tree = _tree()
    tree["pkg/d.py"] = f"# NOTE: {_note('three')} in pkg/a.py\n"
    assert problems(tree) == ["pkg/d.py: refers to note [three], which is defined nowhere"]


def test_a_note_defined_twice_is_reported():
    tree = _tree()
    tree["docs/other.md"] = f"### {_note('one')}\n\nAgain.\n"
    assert problems(tree) == ["note [one] is defined 2 times: pkg/a.py:3, docs/other.md:1"]


def test_a_reference_to_the_wrong_home_is_reported():
    tree = _tree()
    tree["pkg/c.py"] = tree["pkg/c.py"].replace("pkg/b.py", "pkg/a.py")
    assert problems(tree) == [
        "pkg/c.py: refers to note [two] in pkg/a.py, but it lives in pkg/b.py"]


def test_a_note_nobody_refers_to_and_a_stale_table_are_reported():
    tree = _tree()
    tree["pkg/e.py"] = f"# {_note('four')}: an invariant of one file.\n"
    assert problems(tree) == [
        "note [four] (pkg/e.py) is referred to from no other file",
        "docs/architecture.md lists note [four] in None, but it is defined in pkg/e.py"]
