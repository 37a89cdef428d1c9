"""The `blockrt` command: each subcommand in-process through `main([...])`, argparse errors,
and the installed console script once as a subprocess. Demo and benchmarks never run for real.

Bad arguments: each is one line naming the option, the value and what is allowed, exit status 2,
in-process (an exception escaping `main` fails the test) and for the issue's own cases as a
subprocess with no traceback. Output into a pipe whose reader has gone ends quietly.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import allocators
import backends
from backends import _blas
from blockrt import cli
from runtime import fastpath

SUBCOMMANDS = ("allocators", "info", "plan", "demo", "bench")
TINY = ["--batch", "4", "--width", "8", "--depth", "2"]


def blockrt(*argv: str, env: dict[str, str] | None = None,
            stdout: int = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """`python -m blockrt ARGV` in the checkout root, as a user runs it."""
    environ = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "blockrt", *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=120, cwd=cli.ROOT,
                          env=environ, check=False)


def assert_one_line_error(err: str, prog: str, *named: str) -> None:
    """One line, `prog: error: ...; see `prog --help``, holding every string of `named`; no
    usage block above it (it pushed the error out of sight)."""
    assert "Traceback" not in err, err
    (line,) = err.splitlines()
    assert line.startswith(f"{prog}: error: "), err
    assert line.endswith(f"; see `{prog} --help`"), err
    for text in named:
        assert text in line, (text, line)


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
    assert ("  allocators._speedups: in use (" in out) == allocators.ACCELERATED
    assert ("  runtime._dispatch: in use (" in out) == fastpath.ACCELERATED
    report = _blas.report()
    if report.chooser is not None:
        assert "CPU gemm: measured per process (BLOCKRT_BLAS=auto) between " + " and ".join(
            f"{lib.name} ({lib.path})" for lib in report.libraries) in out
    else:
        assert (f"CPU gemm: CBLAS of {report.route.name} ({report.route.path})" if report.route
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


def test_plan_no_fold_updates_shows_eagers_bits_cost(capsys):
    """`--no-fold-updates` is runtime.graph's fold_updates=False: no update folded, and the
    weight gradients get buffers of their own where the CPU's gemm accumulates."""
    reports = {}
    for flag in ((), ("--no-fold-updates",)):
        status, out, err = run(capsys, "plan", "--config", "S", "--batch", "8", "--width",
                               "32", "--depth", "3", *flag)
        assert status == 0, err
        assert ("updates not folded" in out.splitlines()[0]) == bool(flag)
        reports[bool(flag)] = dict(line.split(None, 1) for line in out.splitlines()[1:])
    assert reports[True]["updates_folded"] == "0"
    if cli.runtime.get_default_device().capabilities.gemm_accumulates:
        assert reports[False]["updates_folded"] == "4"
        units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
        planned = {k: float(r["planned_bytes"].split()[0]) * units[r["planned_bytes"].split()[1]]
                   for k, r in reports.items()}
        assert planned[True] > planned[False], planned
    assert cli.build_parser().parse_args(["plan"]).fold_updates is True


def test_plan_budget_shows_the_choice_and_the_timeline(capsys):
    argv = ["plan", "--config", "D", "--batch", "4", "--width", "16", "--depth", "12"]
    status, out, err = run(capsys, *argv, "--budget", "3000")
    assert status == 0, err
    assert "memory budget 3000 B" in out.splitlines()[0]
    choice = next(line for line in out.splitlines() if line.startswith("choice: "))
    assert "units kept at once" in choice and "recomputed" in choice, out
    assert "moved (none: the cpu device's memory is the host's)" in choice
    assert re.search(r"extra work: [0-9.]+ MFLOP recomputed \(\+[0-9.]+% of the step", out), out
    timeline = out.splitlines()[-1]
    assert timeline.startswith("|") and timeline.endswith("|") and "@" in timeline, out
    status, out, err = run(capsys, *argv, "--budget", "10")
    assert status == 1
    assert "a memory budget of 10 bytes" in err and "below the least any choice reaches" in err


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


def test_demo_help_lists_the_demos_own_options_in_whole_sentences(capsys):
    status, out, _ = run(capsys, "demo", "--help")
    assert status == 0
    for option in ("--epochs", "--batch", "--seed", "--plan", "--plot", "--precision",
                   "--no-progress"):
        assert option in out
    description = " ".join(out.split("\n\n")[1].split())
    assert description.startswith(cli.DEMO_DESCRIPTION) and description.endswith(".")
    assert cli.DEMO_DESCRIPTION.endswith("then show where the memory went.")


def test_top_level_help_lists_the_subcommands(capsys):
    status, out, _ = run(capsys, "--help")
    assert status == 0 and out.startswith("usage: blockrt")
    for command in SUBCOMMANDS:
        assert command in out


def ids(cases: list[tuple[list[str], list[str]]]) -> list[str]:
    """Test ids of (argv, named) cases: the command line."""
    return [" ".join(argv)[:40] for argv, _ in cases]


DIM = "1..2147483647"
SEEDS = "0..4294967295"
DEPTHS = f"1..{cli.MAX_DEPTH}"


BAD_INPUT = [
    ([], ["COMMAND"]),
    (["frobnicate"], ["'frobnicate'"]),
    (["plan", "--config", "XL"], ["--config", "'XL'", "'S'"]),
    (["plan", "--plan", "greedy"], ["--plan", "'greedy'", "'static'"]),
    (["plan", "--checkpoint", "all"], ["--checkpoint", "'all'", "'sqrt'"]),
    (["plan", "--depth", "0"], ["--depth", " 0 ", DEPTHS]),
    (["plan", "--depth", "100000"], ["--depth", "100000", DEPTHS, "2 ms a layer"]),
    (["plan", "--depth", "2.5"], ["--depth", "'2.5'", "not an integer", DEPTHS]),
    (["plan", "--batch", "0"], ["--batch", " 0 ", DIM]),
    (["plan", "--batch", "-3"], ["--batch", "-3", DIM]),
    (["plan", "--batch", str(2**31)], ["--batch", str(2**31), DIM, "32-bit"]),
    (["plan", "--width", "1e3"], ["--width", "'1e3'", "not an integer", DIM]),
    (["plan", "--width", ""], ["--width", "''", "not an integer"]),
    (["plan", "--width", "9" * 5000], ["--width", "'99999", "...", "not an integer"]),
    (["plan", "--budget", "-1"], ["--budget", "-1", "0 or more"]),
    (["plan", "--budget", "1MiB"], ["--budget", "'1MiB'", "not an integer"]),
    (["plan", "--budget", "9000", "--checkpoint", "sqrt"], ["--budget", "--checkpoint"]),
    (["plan", "--budget", "9000", "--plan", "none"], ["--budget", "--plan none"]),
    (["plan", "--seed", "-1"], ["--seed", "-1", SEEDS]),
    (["plan", "--seed", str(2**32)], ["--seed", str(2**32), SEEDS]),
    (["plan", "--seed", "abc"], ["--seed", "'abc'", SEEDS]),
    (["plan", "--plot", "/no/such/dir/t.png"], ["--plot", "/no/such/dir"]),
    (["plan", "--plot", "timeline.svg"], ["--plot", "'timeline.svg'", ".png"]),
    (["plan", "--plot", "/"], ["--plot", "'/'", "directory"]),
    (["plan", "--plot"], ["--plot", "expected one argument"]),
    (["plan", "--width", "100000000"], ["width 100000000", "needs about", "PiB", "--width"]),
    (["plan", "--config", "L", "--batch", str(2**31 - 1)], ["batch 2147483647", "device"]),
    (["info", "--verbose"], ["--verbose"]),
    (["allocators", "--", "x"], ["x"]),
    (["allocators", "extra"], ["extra"]),
    (["bench", "nosuch"], ["'nosuch'", "graph"]),
    (["bench", "--quick"], ["'--quick'", "none is named"]),
    (["bench", "--list", "--", "--quick"], ["'--quick'", "none is named"]),
    (["demo", "--bogus"], ["--bogus"]),
    (["demo", "--epochs", "0"], ["--epochs", " 0 ", "1 or more"]),
    (["demo", "--plan", "greedy"], ["--plan", "'greedy'", "'static'"]),
]


@pytest.mark.parametrize(("argv", "named"), BAD_INPUT, ids=ids(BAD_INPUT))
def test_bad_input_exits_2_with_one_line_naming_option_value_and_range(capsys, argv, named):
    status, out, err = run(capsys, *argv)
    assert status == 2
    prog = " ".join(["blockrt", *argv[:1]]) if argv and argv[0] in SUBCOMMANDS else "blockrt"
    assert_one_line_error(err, prog, *named)
    assert "config" not in out  # NOTE: nothing ran: the plan's first line says its config


ISSUE_CASES = [
    (["plan", "--seed", "-1"], ["--seed", "-1", SEEDS]),
    (["plan", "--width", "100000000"], ["width 100000000", "needs about"]),
    (["plan", "--depth", "100000"], ["--depth", "100000", DEPTHS]),
]


@pytest.mark.parametrize(("argv", "named"), ISSUE_CASES, ids=ids(ISSUE_CASES))
def test_the_issues_bad_plan_arguments_print_no_traceback(argv, named):
    result = blockrt(*argv)
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "blockrt plan", *named)


def test_plan_refuses_a_step_bigger_than_the_device_and_runs_one_that_fits(capsys, monkeypatch):
    cfg = cli.MLPConfig(4, 8, 2)
    device = types.SimpleNamespace(name="cpu", total_memory=cli.step_bytes(cfg) - 1)
    monkeypatch.setattr(cli, "_default_device", lambda: device)
    status, out, err = run(capsys, "plan", *TINY)
    assert status == 2 and out == ""
    assert_one_line_error(err, "blockrt plan", "batch 4, width 8, depth 2",
                          cli.allocators.format_bytes(cli.step_bytes(cfg)), "device cpu")
    device.total_memory += 1
    assert run(capsys, "plan", *TINY)[0] == 0


@pytest.mark.parametrize("cfg", [(4, 8, 2), (16, 32, 3), (64, 16, 1), (1, 512, 1), (4, 4, 12)])
def test_step_bytes_is_at_least_what_each_plan_holds_and_at_most_twice(cfg):
    cfg = cli.MLPConfig(*cfg)
    old = cli.runtime.get_default_allocator()
    peaks = []
    try:
        for plan in cli.runtime.PLANS:
            for checkpoint in (None, "sqrt"):
                measure = cli.runtime.set_default_allocator("direct")
                step = cli.training_step(cfg, plan, checkpoint)
                step(*cli._batch(cfg, 0))
                peaks.append(measure.stats()["peak_allocated_bytes"])
    finally:
        cli.runtime.set_default_allocator(old)
    assert max(peaks) <= cli.step_bytes(cfg) <= 2 * max(peaks), (peaks, cli.step_bytes(cfg))


def test_bench_list_shows_the_benchmark_scripts(capsys):
    status, out, _ = run(capsys, "bench", "--list")
    assert status == 0
    names = [line.split()[0] for line in out.splitlines()]
    expected = sorted(p.stem[len("bench_"):] for p in (cli.ROOT / "benchmarks").glob("bench_*.py"))
    assert names == expected and "graph" in names


def test_bench_and_demo_run_their_scripts_with_this_python(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(cli.subprocess, "call",
                        lambda command, **options: calls.append((command, options)) or 0)
    monkeypatch.setattr(cli, "DEMO_MODULES", ())
    assert run(capsys, "bench", "graph", "bench_alloc.py", "--", "--configs", "S")[0] == 0
    assert run(capsys, "demo", "--epochs", "1", "--no-progress")[0] == 0
    bench = cli.ROOT / "benchmarks"
    # NOTE: no cwd: the scripts run where the user is, so a relative --plot lands there
    assert calls == [([sys.executable, str(bench / "bench_graph.py"), "--configs", "S"], {}),
                     ([sys.executable, str(bench / "bench_alloc.py"), "--configs", "S"], {}),
                     ([sys.executable, str(cli.ROOT / "examples" / "train_mlp.py"), "--epochs",
                       "1", "--no-progress"], {})]


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


# --- BLOCKRT_* environment variables it cannot use -----------------------------------------------

#: (variable, value, what the one line must hold: the variable, the value, what it accepts)
BAD_ENVIRONMENT = [
    ("BLOCKRT_ALLOCATOR", "foo", ["BLOCKRT_ALLOCATOR", "'foo'", "known: buddy, caching, direct"]),
    ("BLOCKRT_DEVICE", "nosuch", ["BLOCKRT_DEVICE", "'nosuch'", "known backends: cpu"]),
    ("BLOCKRT_DEVICE", "cpu:x", ["BLOCKRT_DEVICE", "'cpu:x'", "non-negative integer"]),
    ("BLOCKRT_DEVICE", "cpu:3", ["BLOCKRT_DEVICE", "'cpu:3'", "indices 0..0"]),
    ("BLOCKRT_BLAS", "atlas", ["BLOCKRT_BLAS", "'atlas'", "auto, mkl, openblas, none"]),
    ("BLOCKRT_BLAS_CACHE", "rel/dir", ["BLOCKRT_BLAS_CACHE", "'rel/dir'", "absolute"]),
]
#: Each subcommand, as it would run (the demo and benchmarks never start: see `no_scripts`).
COMMANDS = [["allocators"], ["info"], ["plan", *TINY], ["demo", "--epochs", "1"],
            ["bench", "graph"], ["bench", "--list"]]


@pytest.fixture
def no_scripts(monkeypatch) -> list:
    """The demo's and benchmarks' scripts are recorded, not run."""
    calls: list = []
    monkeypatch.setattr(cli.subprocess, "call", lambda command, **kw: calls.append(command) or 0)
    monkeypatch.setattr(cli, "DEMO_MODULES", ())
    return calls


def environment(monkeypatch, variable: str, value: str) -> None:
    """This process as if it had started with `variable=value`: the settings read again, the
    default device and the CPU's BLAS not chosen yet."""
    monkeypatch.setenv(variable, value)
    monkeypatch.setattr(cli.config, "SETTINGS", cli.config.Settings.from_environ(os.environ))
    monkeypatch.setitem(cli.config._state, "device", None)
    monkeypatch.setattr(_blas, "_found", [])


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("variable", "value", "named"), BAD_ENVIRONMENT,
                         ids=[f"{v}={x}" for v, x, _ in BAD_ENVIRONMENT])
def test_every_subcommand_refuses_a_bad_environment_variable_in_one_line(
        capsys, monkeypatch, no_scripts, argv, variable, value, named):
    environment(monkeypatch, variable, value)
    status, out, err = run(capsys, *argv)
    assert (status, out, no_scripts) == (1, "", []), err
    (line,) = err.splitlines()
    assert line.startswith(f"blockrt {argv[0]}: error: "), line
    for text in named:
        assert text in line, (text, line)


def test_a_good_environment_runs_every_subcommand(capsys, monkeypatch, no_scripts):
    environment(monkeypatch, "BLOCKRT_ALLOCATOR", "direct")
    for argv in COMMANDS:
        status, _, err = run(capsys, *argv)
        assert status == 0, (argv, err)
    assert len(no_scripts) == 2  # the demo and bench_graph.py


@pytest.mark.parametrize("launcher", ["module", "console script"])
@pytest.mark.parametrize(("variable", "value", "named"), [
    ("BLOCKRT_PURE_PYTHON", "maybe", ["BLOCKRT_PURE_PYTHON", "'maybe'", "1/true/yes/on",
                                      "0/false/no/off"]),
    ("BLOCKRT_ALLOCATOR", "foo", ["BLOCKRT_ALLOCATOR", "'foo'", "known: buddy, caching, direct"]),
], ids=["BLOCKRT_PURE_PYTHON=maybe", "BLOCKRT_ALLOCATOR=foo"])
def test_the_issues_bad_environment_gives_one_line_and_a_failing_status(launcher, variable,
                                                                         value, named):
    """`blockrt info` as a user runs it; BLOCKRT_PURE_PYTHON stops the import of blockrt itself
    (blockrt/_exit.py)."""
    if launcher == "module":
        result = blockrt("info", env={variable: value})
    else:
        script = Path(sys.executable).with_name("blockrt")
        if not script.exists():
            pytest.skip("no blockrt console script: run `pip install -e .` to create it")
        result = subprocess.run([str(script), "info"], capture_output=True, text=True,
                                timeout=60, check=False, env={**os.environ, variable: value})
    assert result.returncode == 1 and result.stdout == "", result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith("blockrt"), line
    for text in named:
        assert text in line, (text, line)


def test_a_bad_pure_python_switch_still_raises_where_blockrt_is_imported():
    code = ("try:\n    import blockrt\nexcept ValueError as exc:\n    print('ValueError', exc)\n"
            "raise SystemExit(3)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=cli.ROOT, check=False,
                            env={**os.environ, "BLOCKRT_PURE_PYTHON": "maybe"})
    assert result.returncode == 3 and result.stderr == "", result.stderr
    assert result.stdout.startswith("ValueError environment variable BLOCKRT_PURE_PYTHON=")


@pytest.mark.parametrize("raised", ["ValueError('a bug')", "SettingError('a setting')"])
def test_only_a_setting_error_is_cut_to_one_line(raised):
    """The facade's one-line report is for the user's settings only: another error raised
    while blockrt is imported (a bug's ValueError) keeps its whole traceback."""
    code = ("from backends.accelerated import SettingError\n"
            "from blockrt._exit import one_line_on_exit\n"
            "with one_line_on_exit('backends.accelerated.SettingError'):\n"
            f"    raise {raised}\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=cli.ROOT, check=False)
    assert result.returncode == 1
    if raised.startswith("Setting"):
        assert result.stderr == "blockrt: error: a setting\n"
    else:
        assert result.stderr.startswith("Traceback") and "ValueError: a bug" in result.stderr


def test_info_measure_says_what_it_ran():
    (line,) = cli._measure("S", least=0.0)
    cfg = cli.CONFIGS["S"]
    assert line.startswith(f"  measured: config S (batch {cfg.batch}, width {cfg.width}, depth "
                           f"{cfg.depth}), static plan, on cpu: ")
    steps = int(re.search(r"on cpu: (\d+) steps after the capture in", line).group(1))
    assert steps >= 3 and "ms a step" in line
    report = _blas.report()
    if report.chooser is None:
        assert line.endswith(f"on {report.summary}: nothing to choose"), line
    else:
        assert line.endswith("until the library was chosen"), line


def test_plan_says_when_it_runs_out_of_memory_or_cannot_write_the_plot(capsys, monkeypatch,
                                                                         tmp_path):
    def oom(*args, **kwargs):
        raise MemoryError("Unable to allocate 24 GiB")

    monkeypatch.setattr(cli, "training_step", oom)
    status, _, err = run(capsys, "plan", *TINY)
    assert status == 1
    assert err == "blockrt plan: error: out of memory running config S with overrides: " \
        "Unable to allocate 24 GiB\n"
    monkeypatch.undo()

    def unwritable(timelines, path, title):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(cli.runtime, "plot_memory_timeline", unwritable)
    status, _, err = run(capsys, "plan", "--plot", str(tmp_path / "t.png"), *TINY)
    assert status == 1
    assert err.startswith("blockrt plan: error: cannot write the plot: [Errno 13] Permission ")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize(("variable", "value"), [("BLOCKRT_DEVICE", "nosuch"),
                                                 ("BLOCKRT_ALLOCATOR", "nosuch"),
                                                 ("BLOCKRT_BLAS", "atlas")])
def test_plan_names_a_bad_environment_variable_in_one_line(variable, value):
    result = blockrt("plan", *TINY, env={variable: value})
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith("blockrt plan: error: ") and variable in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


# --- the demo's own arguments (examples/train_mlp.py) ------------------------------------------


@pytest.fixture(scope="module")
def train_mlp() -> types.ModuleType:
    """examples/train_mlp.py as a module, for its argument checks (it needs the demo extra)."""
    for module in cli.DEMO_MODULES:
        pytest.importorskip(module, reason=f"the demo needs {module} (the demo extra)")
    spec = importlib.util.spec_from_file_location("train_mlp", cli.ROOT / "examples" /
                                                  "train_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEMO_CASES = [
    (["--epochs", "0"], ["--epochs", " 0 ", "1 or more"]),
    (["--epochs", "-1"], ["--epochs", "-1", "1 or more"]),
    (["--epochs", "many"], ["--epochs", "'many'", "not an integer"]),
    (["--batch", "0"], ["--batch", " 0 ", "1 or more"]),
    (["--batch", "100000"], ["--batch", "100000", "1..1347", "training images"]),
    (["--seed", "-1"], ["--seed", "-1", SEEDS]),
    (["--seed", str(2**32)], ["--seed", str(2**32), SEEDS]),
    (["--plan", "greedy"], ["--plan", "'greedy'", "'static'"]),
    (["--precision", "float8"], ["--precision", "'float8'", "'bfloat16'"]),
    (["--plot", "/no/such/dir/t.png"], ["--plot", "/no/such/dir"]),
    (["--plot", "timeline.txt"], ["--plot", "'timeline.txt'", ".png"]),
]


@pytest.mark.parametrize(("argv", "named"), DEMO_CASES[:4] + DEMO_CASES[5:],
                         ids=ids(DEMO_CASES[:4] + DEMO_CASES[5:]))
def test_blockrt_demo_refuses_what_the_demo_refuses_before_it_starts(capsys, no_scripts, argv,
                                                                     named):
    status, out, err = run(capsys, "demo", *argv)
    assert (status, out, no_scripts) == (2, "", [])
    assert_one_line_error(err, "blockrt demo", *named)


@pytest.mark.parametrize(("argv", "named"), DEMO_CASES, ids=ids(DEMO_CASES))
def test_the_demo_refuses_bad_arguments_in_one_line(capsys, monkeypatch, train_mlp, argv, named):
    monkeypatch.setattr(sys, "argv", ["train_mlp.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        train_mlp.main()
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # NOTE: nothing trained: the model is printed first
    assert_one_line_error(err, "train_mlp.py", *named)


def test_blockrt_demo_passes_the_demos_exit_status_2_through_without_a_traceback(train_mlp):
    result = blockrt("demo", "--batch", "100000")
    assert result.returncode == 2
    assert_one_line_error(result.stderr, "train_mlp.py", "--batch", "100000", "training images")


def test_a_script_ended_by_a_signal_exits_128_plus_the_signal(capsys, monkeypatch):
    monkeypatch.setattr(cli.subprocess, "call", lambda command: -9)
    monkeypatch.setattr(cli, "DEMO_MODULES", ())
    assert run(capsys, "demo")[0] == 128 + 9


# --- output into a pipe whose reader has gone ----------------------------------------------------


def into_a_closed_pipe(command: list[str], buffered: bool) -> subprocess.CompletedProcess[str]:
    """Run `command` with stdout into a pipe whose read end is closed: `| head -1` at its most
    eager. NOTE: a reader that closes after a line only breaks the pipe when the command writes
    after that, which depends on timing; a reader gone before the first write breaks it always.
    Buffered, the write fails at the last flush; unbuffered (PYTHONUNBUFFERED), at the first."""
    environ = {**os.environ, "PYTHONUNBUFFERED": "" if buffered else "1"}
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(command, stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=120, cwd=cli.ROOT, env=environ, check=False)
    finally:
        os.close(write)


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
@pytest.mark.parametrize("argv", [["allocators"], ["info"], ["--help"], ["bench", "--list"],
                                  ["plan", *TINY], ["demo"]], ids=" ".join)
def test_output_into_a_closed_pipe_ends_quietly(argv, buffered):
    if argv == ["demo"]:
        for module in cli.DEMO_MODULES:
            pytest.importorskip(module, reason=f"the demo needs {module} (the demo extra)")
    result = into_a_closed_pipe([sys.executable, "-m", "blockrt", *argv], buffered)
    assert result.stderr == ""
    # NOTE: 1 as Python's `signal` docs do on EPIPE; argparse ignores a failed write of --help
    assert result.returncode == (0 if argv == ["--help"] and not buffered else 1)


def test_the_demo_script_into_a_closed_pipe_ends_quietly(train_mlp, tmp_path):
    # NOTE: unbuffered, its first print fails; buffered, it would train first (run_piped is
    # the same function as blockrt's, whose buffered case is above)
    script = cli.ROOT / "examples" / "train_mlp.py"
    result = into_a_closed_pipe([sys.executable, str(script), "--epochs", "1", "--no-progress",
                                 "--plot", str(tmp_path / "t.png")], buffered=False)
    assert result.stderr == ""
    assert result.returncode == 1
