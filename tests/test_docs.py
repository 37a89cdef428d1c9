"""The docs cannot go stale: every Python block of README.md and docs/*.md runs, and every
`blockrt` command line the README shows runs and does what the comment beside it says.

Python blocks. The blocks of one page run in order, as one script, in a fresh interpreter (a
page's later blocks use the names its earlier ones made), in a scratch directory. A block
whose first line is a requirement comment,

    # requires: opencl            (or cuda, or several: "# requires: opencl, matplotlib")

runs only where each name is there: a backend kind in `backends.available()`, or a package of
REQUIRABLE_PACKAGES that imports; otherwise it is left out with that reason, and so are the
later blocks of the page that need it too (they carry the same comment). There is no marker
that leaves a block out for good. docs/testing.md describes the rules.

Errors point into the page: the script keeps every line of code at its line number in the
page (the rest is blank), so a traceback names `docs/graph.md`, line N.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import backends

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Packages a block may name in `# requires:` besides the backend kinds.
REQUIRABLE_PACKAGES = ("matplotlib", "pyopencl", "cupy", "torch", "sklearn")
REQUIRES = re.compile(r"#\s*requires:\s*(.+)$")
FENCE = re.compile(r"^(\s*)```\s*(\S*)")


@dataclass(frozen=True)
class CodeBlock:
    """A fenced Python block: its first code line's number in the page (1-based), its lines,
    and what it requires (names from its `# requires:` first line)."""

    line: int
    code: list[str]
    requires: tuple[str, ...]


def python_blocks(text: str, where: str) -> list[CodeBlock]:
    """The ```python blocks of a Markdown page, in order; ValueError for a fence it cannot
    read (indented, or never closed) or a `# requires:` naming something unknown."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, language = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if FENCE.match(lines[j])), None)
        if end is None:
            raise ValueError(f"{where}:{i + 1}: a ``` fence that is never closed")
        if language in ("python", "py"):
            if indent:
                raise ValueError(f"{where}:{i + 1}: an indented ```python block; the runner "
                                 "reads blocks at the start of a line only")
            code = lines[i + 1:end]
            requires: tuple[str, ...] = ()
            first = REQUIRES.match(code[0].strip()) if code else None
            if first:
                requires = tuple(name.strip() for name in first.group(1).split(","))
                unknown = [n for n in requires
                           if n not in backends.BACKENDS and n not in REQUIRABLE_PACKAGES]
                if unknown:
                    raise ValueError(f"{where}:{i + 2}: '# requires:' names {unknown}; known: "
                                     f"the backends {sorted(backends.BACKENDS)} and the "
                                     f"packages {list(REQUIRABLE_PACKAGES)}")
            blocks.append(CodeBlock(i + 2, code, requires))
        i = end + 1
    return blocks


def missing(requires: tuple[str, ...]) -> list[str]:
    """Why a block cannot run here: one reason per requirement that is not met."""
    reasons = []
    for name in requires:
        if name in backends.BACKENDS:
            if name not in backends.available():
                reasons.append(f"the {name} backend (available here: "
                               f"{', '.join(backends.available())})")
        elif importlib.util.find_spec(name) is None:
            reasons.append(f"the {name} package (not installed)")
    return reasons


def page_script(text: str, where: str) -> tuple[str, list[str]]:
    """The page as one script (code at its own line numbers, everything else blank) and the
    reasons for each block left out."""
    lines = [""] * len(text.splitlines())
    skipped = []
    for block in python_blocks(text, where):
        reasons = missing(block.requires)
        if reasons:
            skipped.append(f"{where}:{block.line}: needs {'; '.join(reasons)}")
            continue
        lines[block.line - 1:block.line - 1 + len(block.code)] = block.code
    return "\n".join(lines) + "\n", skipped


def run_page(script: str, where: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run `script` as the file `where` (relative to the checkout) in a new interpreter."""
    (cwd / "page.py").write_text(script)
    runner = ("import sys, pathlib; source = pathlib.Path('page.py').read_text(); "
              "exec(compile(source, sys.argv[1], 'exec'), {'__name__': '__main__'})")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep), "MPLBACKEND": "Agg"}
    return subprocess.run([sys.executable, "-W", "error", "-c", runner, where], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600, check=False)


# --- the runner itself --------------------------------------------------------------------------


def test_the_runner_reads_blocks_requirements_and_line_numbers():
    page = "\n".join(["# title", "```python", "x = 1", "```", "text", "```sh", "ls", "```",
                      "```python", "# requires: cuda, matplotlib", "y = x + 1", "```",
                      "```", "print('not python')", "```"])
    blocks = python_blocks(page, "page.md")
    assert [(b.line, b.code, b.requires) for b in blocks] == [
        (3, ["x = 1"], ()), (10, ["# requires: cuda, matplotlib", "y = x + 1"],
                             ("cuda", "matplotlib"))]


@pytest.mark.parametrize(("page", "error"), [
    ("```python\n# requires: cdua\nx = 1\n```\n", "'# requires:' names ['cdua']"),
    ("text\n  ```python\nx = 1\n  ```\n", "page.md:2: an indented"),
    ("```python\nx = 1\n", "page.md:1: a ``` fence that is never closed"),
])
def test_the_runner_refuses_what_it_cannot_read(page, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        python_blocks(page, "page.md")


def test_a_block_that_needs_what_is_missing_is_left_out_with_the_reason():
    page = "```python\nx = 1\n```\n```python\n# requires: cuda\nraise SystemExit(3)\n```\n"
    script, skipped = page_script(page, "page.md")
    if "cuda" in backends.available():
        assert skipped == [] and "raise SystemExit(3)" in script
    else:
        assert skipped == ["page.md:5: needs the cuda backend (available here: "
                           f"{', '.join(backends.available())})"]
        assert script.splitlines()[1] == "x = 1" and "SystemExit" not in script


def test_a_failing_block_fails_the_page_naming_its_line(tmp_path):
    page = "intro\n```python\nx = 1\n```\nmore\n```python\ny = x / 0\n```\n"
    script, _ = page_script(page, "page.md")
    result = run_page(script, "page.md", tmp_path)
    assert result.returncode == 1
    assert 'File "page.md", line 7' in result.stderr and "ZeroDivisionError" in result.stderr


# --- every page -----------------------------------------------------------------------------


#: The pages with Python blocks (docs/aliasing.md, architecture.md and testing.md have none).
CODE_PAGES = [page for page in PAGES if python_blocks(page.read_text(), page.name)]


def test_the_pages_have_python_blocks_to_run():
    assert {p.name for p in CODE_PAGES} >= {"README.md", "allocators.md", "autograd.md",
                                            "embedding.md", "embedding-details.md", "graph.md"}


@pytest.mark.parametrize("page", CODE_PAGES, ids=[p.name for p in CODE_PAGES])
def test_every_python_block_of_the_page_runs_in_order(page, tmp_path):
    where = str(page.relative_to(ROOT))
    script, skipped = page_script(page.read_text(), where)
    if not script.strip():
        pytest.skip(f"every Python block of {where} needs what is missing: {'; '.join(skipped)}")
    result = run_page(script, where, tmp_path)
    assert result.returncode == 0, (f"{where} fails:\n{result.stderr[-4000:]}\n"
                                    f"(left out: {skipped or 'nothing'})")


# --- the README's command lines ------------------------------------------------------------------


def readme_commands() -> list[tuple[str, str]]:
    """(command, the comment beside it) for each `blockrt ...` line of the README's sh blocks."""
    commands, inside = [], False
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```sh"
            continue
        if inside and line.startswith("blockrt "):
            command, _, comment = line.partition("#")
            commands.append((command.strip(), comment.strip()))
    return commands


def blockrt(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m blockrt ARGV` (the README: "`python -m blockrt ...` is the same") in `cwd`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, "-m", "blockrt", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def report_of(out: str) -> dict[str, str]:
    """A printed memory report as {key: value}."""
    return {line.split()[0]: line.split(None, 1)[1] for line in out.splitlines()
            if len(line.split()) >= 2 and line.split()[0] in (
                "plan", "checkpoint", "planned_bytes", "lower_bound_bytes", "naive_bytes",
                "peak_bytes", "recomputed", "products", "updates_folded")}


def check_info(out: str, cwd: Path) -> None:
    for text in ("blockrt ", "Python ", f"NumPy {np.__version__}", "C paths (",
                 f"backends: {', '.join(backends.available())}", "  cpu: alignment ",
                 "default device: "):
        assert text in out, (text, out)


def check_allocators(out: str, cwd: Path) -> None:
    rows = [line for line in out.splitlines() if line[:2] in ("* ", "  ")]
    names = {line[2:].split()[0] for line in rows}
    assert {"direct", "caching"} <= names, out
    assert sum(line.startswith("* ") for line in rows) == 1, out
    assert "default (*): " in out


def check_plan_sqrt(out: str, cwd: Path) -> None:
    report = report_of(out)
    assert report["checkpoint"] == "sqrt" and report["plan"] == "static", out
    assert int(report["recomputed"]) > 0, out  # NOTE: sqrt checkpointing did recompute
    assert "config D: batch 64, width 256, depth 64" in out


def check_plan_plot(out: str, cwd: Path) -> None:
    assert "planned_bytes" in report_of(out), out
    assert "memory timeline of none, recycle, static written to timeline.png" in out
    assert (cwd / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_plan_budget(out: str, cwd: Path) -> None:
    report = report_of(out)
    assert report["plan"] == "static" and int(report["recomputed"]) > 0, out
    assert "budget 600000 B (585.94 KiB, memory_budget): planned " in out, out
    assert "units kept at once" in out and "extra work: " in out, out
    assert out.splitlines()[-1].startswith("|"), out  # NOTE: the timeline


def check_plan_no_fold(out: str, cwd: Path) -> None:
    assert "updates not folded (eager's bits)" in out.splitlines()[0], out
    report = report_of(out)
    assert report["plan"] == "static" and report["updates_folded"] == "0", out
    assert int(report["products"]) > 0, out  # NOTE: the other products still fold


def check_demo(out: str, cwd: Path) -> None:
    result = next(line for line in out.splitlines() if "test accuracy" in line)
    assert float(result.split("test accuracy")[1].split()[0]) >= 0.97, result
    assert {"planned_bytes", "peak_bytes"} <= set(report_of(out)), out
    assert "blockrt memory summary" in out
    assert (cwd / "memory_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def check_bench_list(out: str, cwd: Path) -> None:
    listed = [line.split() for line in out.splitlines()]
    assert listed and all((ROOT / path).is_file() and path == f"benchmarks/bench_{name}.py"
                          for name, path in listed), out
    assert len(listed) == len(list((ROOT / "benchmarks").glob("bench_*.py")))


#: What each README command line must show, after the comment beside it.
CHECKS = {
    "blockrt info": check_info,
    "blockrt allocators": check_allocators,
    "blockrt plan --config D --checkpoint sqrt": check_plan_sqrt,
    "blockrt plan --config S --plot timeline.png": check_plan_plot,
    "blockrt plan --config D --budget 600000": check_plan_budget,
    "blockrt plan --config S --no-fold-updates": check_plan_no_fold,
    "blockrt demo --epochs 5 --no-progress": check_demo,
    "blockrt bench --list": check_bench_list,
}


def test_every_readme_command_line_has_a_check():
    commands = [command for command, _ in readme_commands()]
    assert commands, "the README shows no blockrt command line"
    assert sorted(commands) == sorted(CHECKS), "a README command line without a check here " \
        "(or a check of a line the README no longer shows)"


@pytest.mark.parametrize(("command", "comment"), readme_commands(),
                         ids=[command for command, _ in readme_commands()])
def test_the_readme_command_runs_and_does_what_its_comment_says(command, comment, tmp_path):
    if command.startswith("blockrt demo"):
        for module in ("sklearn", "tqdm", "matplotlib"):
            pytest.importorskip(module, reason=f"the demo needs {module} (the demo extra)")
    if "--plot" in command:
        pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    result = blockrt(command.split()[1:], tmp_path)
    assert result.returncode == 0, f"{command}  # {comment}\n{result.stderr[-3000:]}"
    CHECKS[command](result.stdout, tmp_path)
