"""The `blockrt` command: each subcommand in-process through `main([...])`, argparse errors,
and the installed console script once as a subprocess. Demo and benchmarks never run for real."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import allocators
import backends
from backends import _blas
from runtime import cli

SUBCOMMANDS = ("allocators", "info", "plan", "demo", "bench")
TINY = ["--batch", "4", "--width", "8", "--depth", "2"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr); SystemExit becomes its code."""
    try:
        status = cli.main(list(argv))
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


def test_allocators_lists_every_name_with_its_source_and_marks_the_default(capsys):
    status, out, _ = run(capsys, "allocators")
    assert status == 0
    rows = {line[2:].split()[0]: line for line in out.splitlines()[:len(allocators.names())]}
    assert sorted(rows) == allocators.names()
    assert "built-in" in rows["direct"] and "built-in" in rows["caching"]
    default = cli.config.SETTINGS.allocator
    assert rows[default].startswith("* ")
    assert f"default (*): {default}" in out


def test_allocators_names_an_allocator_registered_in_process(capsys, monkeypatch):
    monkeypatch.setattr(allocators, "_registered", {})  # NOTE: the registration goes with it
    allocators.register("cli-test-fake", allocators.DirectAllocator)
    status, out, _ = run(capsys, "allocators")
    assert status == 0
    row = next(line for line in out.splitlines() if "cli-test-fake" in line)
    assert "allocators.register()" in row


def test_info_shows_versions_backends_devices_and_the_default_device(capsys):
    status, out, _ = run(capsys, "info")
    assert status == 0
    assert f"NumPy {np.__version__}" in out
    assert f"backends: {', '.join(backends.available())}" in out
    cpu = backends.get_device("cpu")
    assert f"  cpu: alignment {cpu.alignment} B, memory " in out
    assert allocators.format_bytes(cpu.total_memory) in out
    assert ("C allocator hot path: yes" in out) == allocators.ACCELERATED
    blas = _blas.find()
    assert (f"CPU gemm: CBLAS of {blas.name} ({blas.path})" if blas
            else "CPU gemm: matmul + a fused pass") in out
    assert f"default device: {cli.runtime.get_default_device().name}" in out


def test_plan_prints_the_memory_report_of_the_chosen_plan(capsys):
    status, out, _ = run(capsys, "plan", "--config", "D", "--plan", "recycle",
                         "--checkpoint", "sqrt", *TINY)
    assert status == 0
    assert "config D with overrides: batch 4, width 8, depth 2" in out
    report = dict(line.split(None, 1) for line in out.splitlines()[1:])
    assert report["plan"] == "recycle" and report["checkpoint"] == "sqrt"
    for key in ("planned_bytes", "lower_bound_bytes", "naive_bytes", "peak_bytes"):
        assert key in report


def test_plan_defaults_to_config_s_and_the_static_plan():
    args = cli.build_parser().parse_args(["plan"])
    assert (args.config, args.plan, args.checkpoint) == ("S", "static", None)
    assert cli.CONFIGS["S"] == (64, 256, 8) and cli.CONFIGS["D"] == (64, 256, 64)


def test_plan_plot_writes_a_png_of_all_three_plans(capsys, tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the plot extra)")
    path = tmp_path / "timeline.png"
    status, out, _ = run(capsys, "plan", "--plot", str(path), *TINY)
    assert status == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"memory timeline of none, recycle, static written to {path}" in out


def test_plan_plot_without_matplotlib_names_the_plot_extra(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # NOTE: makes `import matplotlib` fail
    status, _, err = run(capsys, "plan", "--plot", str(tmp_path / "t.png"), *TINY)
    assert status == 1
    assert "blockrt[plot]" in err and "matplotlib" in err


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(capsys, command):
    status, out, _ = run(capsys, command, "--help")
    assert status == 0
    assert out.startswith(f"usage: blockrt {command}")


def test_top_level_help_lists_the_subcommands(capsys):
    status, out, _ = run(capsys, "--help")
    assert status == 0 and out.startswith("usage: blockrt")
    for command in SUBCOMMANDS:
        assert command in out


@pytest.mark.parametrize(("argv", "named"), [
    ([], "COMMAND"),
    (["frobnicate"], "'frobnicate'"),
    (["plan", "--config", "XL"], "'XL'"),
    (["plan", "--plan", "greedy"], "'greedy'"),
    (["plan", "--checkpoint", "all"], "'all'"),
    (["plan", "--depth", "0"], "'0'"),
    (["plan", "--plot", "/no/such/dir/t.png"], "/no/such/dir"),
    (["info", "--verbose"], "--verbose"),
    (["allocators", "--", "x"], "x"),
    (["bench", "nosuch"], "'nosuch'"),
])
def test_bad_input_exits_2_naming_the_value(capsys, argv, named):
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert named in err.splitlines()[-1]


def test_bench_list_shows_the_benchmark_scripts(capsys):
    status, out, _ = run(capsys, "bench", "--list")
    assert status == 0
    names = [line.split()[0] for line in out.splitlines()]
    expected = sorted(p.stem[len("bench_"):] for p in (cli.ROOT / "benchmarks").glob("bench_*.py"))
    assert names == expected and "graph" in names


def test_bench_and_demo_run_their_scripts_with_this_python(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call", lambda command, cwd: calls.append(command) or 0)
    monkeypatch.setattr(cli, "DEMO_MODULES", ())
    assert run(capsys, "bench", "graph", "bench_alloc.py", "--", "--configs", "S")[0] == 0
    assert run(capsys, "demo", "--epochs", "1", "--no-progress")[0] == 0
    bench = cli.ROOT / "benchmarks"
    assert calls == [[sys.executable, str(bench / "bench_graph.py"), "--configs", "S"],
                     [sys.executable, str(bench / "bench_alloc.py"), "--configs", "S"],
                     [sys.executable, str(cli.ROOT / "examples" / "train_mlp.py"), "--epochs", "1",
                      "--no-progress"]]


def test_demo_without_its_dependencies_names_the_demo_extra(capsys, monkeypatch):
    monkeypatch.setattr(cli, "DEMO_MODULES", ("no_such_module_for_blockrt",))
    status, _, err = run(capsys, "demo")
    assert status == 1
    assert "no_such_module_for_blockrt" in err and "blockrt[demo]" in err


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_demo_and_bench_outside_a_checkout_say_so(capsys, monkeypatch, tmp_path, command):
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    status, _, err = run(capsys, command)
    assert status == 1
    assert "checkout" in err and str(tmp_path) in err


def test_the_installed_console_script_runs():
    script = Path(sys.executable).with_name("blockrt")
    found = str(script) if script.exists() else shutil.which("blockrt")
    if found is None:
        pytest.skip("no blockrt console script: run `pip install -e .` to create it")
    result = subprocess.run([found, "info"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert f"NumPy {np.__version__}" in result.stdout
    bad = subprocess.run([found, "plan", "--config", "Q"], capture_output=True, text=True,
                         timeout=60, check=False)
    assert bad.returncode == 2 and "'Q'" in bad.stderr


def test_info_names_a_blockrt_blas_it_cannot_honour(capsys, monkeypatch):
    monkeypatch.setattr(_blas, "_found", [])
    monkeypatch.setenv(_blas.ENV, "atlas")
    status, out, _ = run(capsys, "info")
    assert status == 0
    assert "CPU gemm: error: BLOCKRT_BLAS='atlas' is not one of auto, mkl, openblas, none" in out
