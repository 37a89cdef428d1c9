"""The `blockrt` command: what is installed, what a training step's memory plan looks like,
and the demo and benchmarks of a repository checkout.

Subcommands:
    blockrt allocators      the registered allocators, where each comes from, the default
    blockrt info            Python/NumPy versions, backends and their devices, the default device,
                            the CPU's BLAS and why (--measure S|M|L|D: time a step first)
    blockrt plan            capture an MLP training step and print its memory report
                            (--config S|M|L|D, --plan, --checkpoint sqrt|pointwise, --budget BYTES,
                            --no-fold-updates, --plot PATH)
    blockrt demo [ARGS]     run examples/train_mlp.py (a checkout, and the `demo` extra)
    blockrt bench [NAME]    list (--list) or run benchmarks/bench_NAME.py (a checkout)

Example:
    $ blockrt plan --config D --checkpoint sqrt
    $ blockrt bench graph -- --quick
    $ python -m blockrt info

Exit status: 0 on success, 2 for bad command-line input (one line naming the option, the value
and what is allowed, and where the options are listed; no usage block), 1 for other errors (one
line: a BLOCKRT_* environment variable it cannot use, checked before any subcommand runs, names
the variable, its value and what it accepts) and when the reader of stdout has gone
(`blockrt allocators | head -1` ends quietly); `demo` and `bench` return their scripts' status,
128 + N when signal N ended one.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import NoReturn

import numpy as np

import allocators
import backends
import runtime
from backends import _blas, _blas_choice, accelerated, threads
from blockrt.models import CLASSES, CONFIGS, MLPConfig
from runtime import config, nn

__all__ = ["CONFIGS", "MLPConfig", "Parser", "add_demo_options", "build_parser", "each_plan",
           "int_in", "main", "png_path", "run_piped", "step_bytes", "training_step"]


#: A BLAS takes each dimension of a product as a 32-bit integer (an LP64 build).
MAX_DIM = 2**31 - 1
#: Capture and planning take about 2 ms a hidden layer: 2 s at this depth; at 100000 they ran
#: for minutes and grew past 24 GiB, whatever the width.
MAX_DEPTH = 1024
#: Seeds are what scikit-learn's `random_state` takes (examples/train_mlp.py shares the bound).
MAX_SEED = 2**32 - 1

#: What examples/train_mlp.py imports beyond blockrt (the `demo` extra).
DEMO_MODULES = ("sklearn", "tqdm", "matplotlib")

#: The repository checkout this package was imported from, if it is one (an editable install).
ROOT = Path(__file__).resolve().parent.parent


class CommandError(Exception):
    """A subcommand cannot run (missing checkout or optional dependency, a BLOCKRT_* variable it
    cannot use); exit status 1."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, with each error on one line: `prog: error: MESSAGE`, then where the
    options are listed, and no usage block above it (the message names the option, the value
    and what is allowed; the usage, printed first, pushed that line out of sight). Exit status 2.
    Subcommands' parsers are of this class too (argparse makes them of the parent's class).

    Example:
        >>> Parser(prog="blockrt plan").error("argument --depth: 0 is out of range")
        ... # doctest: +SKIP
        blockrt plan: error: argument --depth: 0 is out of range; see `blockrt plan --help`
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


# --- helpers -----------------------------------------------------------------------------------


def training_step(cfg: MLPConfig, plan: str, checkpoint: str | None,
                  seed: int = 0, memory_budget: int | None = None,
                  lossy: bool | str = False, fold_updates: bool = True) -> runtime.Graph:
    """The MLP training step of benchmarks/bench_graph.py captured by `runtime.graph`.

    `cfg.depth` hidden Dense(width, width) layers with ReLU, a Dense(width, 10) classifier,
    softmax cross-entropy, SGD lr 0.01, `zero_grad()` at the end of the step (so gradients are
    intermediates). Weights come from `seed`; the caller runs the step. `memory_budget`:
    bytes the intermediates may take, `lossy` and `fold_updates` (`runtime.graph`'s options).
    """
    rng = np.random.default_rng(seed)
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        layers += [nn.Dense(cfg.width, cfg.width, rng=rng), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Dense(cfg.width, CLASSES, rng=rng))
    opt = nn.SGD(model.parameters(), lr=0.01)
    return runtime.graph(nn.train_step(model, opt), plan=plan, checkpoint=checkpoint,
                         memory_budget=memory_budget, lossy=lossy, fold_updates=fold_updates)


#: Characters of a text timeline, from empty to full.
_LEVELS = " .:-=+*#%@"


def text_timeline(values: Sequence[int], width: int = 72) -> str:
    """`values` as one line of `width` characters at most: each the highest value of its share
    of the steps, from ' ' (0) to '@' (the highest of all).

    Example:
        >>> text_timeline([0, 5, 10, 5], width=4)
        ' =@='
    """
    if not values:
        return ""
    top = max(values) or 1
    shares = min(width, len(values))
    line = []
    for k in range(shares):
        part = values[k * len(values) // shares:(k + 1) * len(values) // shares]
        line.append(_LEVELS[round(max(part) / top * (len(_LEVELS) - 1))])
    return "".join(line)


def budget_lines(step: runtime.Graph) -> list[str]:
    """What a memory budget chose, for `blockrt plan --budget`: the choice, its extra work, and
    the live bytes of intermediates at each step as a text timeline."""
    report = step.memory_report()
    live = step.timeline(live=True)
    fmt = allocators.format_bytes
    extra = report["recompute_flops"] / max(1, report["step_flops"])
    stored = report["lossy"]
    lossy = ([f"stored lossy: {len(stored)} results "
              f"({', '.join(sorted({s['dtype'] for s in stored}))}, "
              f"{fmt(sum(s['nbytes'] for s in stored))} while they wait)"] if stored else [])
    return [
        f"budget {report['memory_budget']} B ({fmt(report['memory_budget'])}, "
        f"{report['budget_source']}): planned {fmt(report['planned_bytes'])}",
        f"choice: {report['schedule']}; forward results the backward pass reads: "
        f"{report['kept']} kept, "
        f"{report['recomputed']} recomputed, {report['moved']} moved ({report['moves']})",
        f"extra work: {report['recompute_flops'] / 1e6:.1f} MFLOP recomputed "
        f"(+{extra:.1%} of the step's {report['step_flops'] / 1e6:.1f} MFLOP), "
        f"{report['moved_bytes']} B moved",
        *lossy,
        f"timeline (live intermediates, {len(live)} steps, peak {fmt(max(live, default=0))}):",
        f"|{text_timeline(live)}|",
    ]


def each_plan(make_step: Callable[[str], runtime.Graph], *args: object,
              plans: Sequence[str] = runtime.PLANS) -> Iterator[tuple[str, runtime.Graph]]:
    """For each plan: `make_step(plan)`, called once with `args`, as (plan, graph).

    Each graph is released when the loop moves on, so only one plan's memory is held at a time;
    read what you need (`timeline()`, `memory_report()`) inside the loop. The command line's
    `plan --plot` and examples/train_mlp.py draw their timelines this way.

    Example:
        >>> lines = {plan: step.timeline() for plan, step in each_plan(make_step, x, y)}
        ... # doctest: +SKIP
    """
    for plan in plans:
        step = make_step(plan)
        step(*args)
        try:
            yield plan, step
        finally:
            step.release()


def _batch(cfg: MLPConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((cfg.batch, cfg.width), dtype=np.float32)
    return x, rng.integers(0, CLASSES, size=cfg.batch)


def _checkout_dir(name: str, what: str) -> Path:
    """ROOT/name, or CommandError saying that `what` needs a repository checkout."""
    path = ROOT / name
    if not path.is_dir():
        raise CommandError(f"{what} needs a blockrt repository checkout (no {name}/ next to the "
                           f"installed package at {ROOT}); clone the repository and run it there, "
                           f"or install it with `pip install -e .`")
    return path


def _run_script(script: Path, args: Sequence[str]) -> int:
    """Run `script` with this Python in the current directory, so that paths among `args`
    mean what they say where the user typed them; its exit status (128 + N, as a shell says
    it, when signal N ended it)."""
    command = [sys.executable, str(script), *args]
    print("$ " + " ".join(command), flush=True)
    status = subprocess.call(command)
    return 128 - status if status < 0 else status


def int_in(low: int, high: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse `type=`: an integer in low..high (no upper bound when `high` is None).

    Anything else raises argparse.ArgumentTypeError naming the value, the range and `why`, so
    argparse prints one line (`prog: error: argument --depth: ...`) and exits 2.

    Example:
        >>> parser.add_argument("--depth", type=int_in(1, 1024, "capture takes ~2 ms a layer"))
        ... # doctest: +SKIP
    """
    allowed = f"{low}..{high}" if high is not None else f"{low} or more"
    reason = f" ({why})" if why else ""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:  # NOTE: also an integer of more than 4300 digits (sys.int_info)
            shown = repr(text) if len(text) <= 40 else repr(text[:40]) + "..."
            raise argparse.ArgumentTypeError(
                f"{shown} is not an integer; allowed: {allowed}{reason}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: {allowed}{reason}")
        return value

    return parse


def png_path(text: str) -> str:
    """An argparse `type=`: a path ending in .png whose directory exists and is not itself a
    directory (so a long run does not fail at the end, when it writes the plot)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot write a plot to {text!r}: it is a directory")
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"cannot write a plot to {text!r}: the plot is a PNG; "
                                         "name a file ending in .png")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write a plot to {text!r}: "
                                         f"no directory {folder!r}")
    return text


#: What examples/train_mlp.py does, for its --help and `blockrt demo --help`.
DEMO_DESCRIPTION = ("Train an MLP on scikit-learn's handwritten digits with blockrt's autograd "
                    "and graph runtime, then show where the memory went.")


def add_demo_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the options of examples/train_mlp.py on `parser`, and return it.

    The script and `blockrt demo` both call this, so `blockrt demo --help` lists the demo's own
    options and `blockrt demo` checks them before the script starts. The bound that needs the
    data (--batch at most the training images) is the script's own.
    """
    parser.add_argument("--epochs", type=int_in(1), default=10, help="default: 10")
    parser.add_argument("--batch", type=int_in(1), default=16,
                        help="default: 16; at most the number of training images")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                        help="initial weights and batch order (default: 0)")
    parser.add_argument("--plan", default="static", choices=runtime.PLANS,
                        help="the graph's memory plan (default: static)")
    parser.add_argument("--plot", type=png_path, default="memory_timeline.png",
                        help="where to write the plot (default: memory_timeline.png)")
    parser.add_argument("--precision", default="float32",
                        choices=("float32", "float16", "bfloat16"),
                        help="float32 (default), or mixed precision in float16 (with loss "
                             "scaling) or bfloat16")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--ranks", type=int_in(1, 64), default=1,
                        help="train data-parallel on this many processes under MPI's mpiexec, "
                             "each on its part of every batch (default: 1; needs the `mpi` "
                             "extra; docs/distributed.md)")
    return parser


def run_piped(main: Callable[[], int]) -> int:
    """`main()`'s exit status, with stdout flushed; 1, quietly, if the reader of stdout has gone.

    `blockrt allocators | head -1` closes the pipe after one line, and the next write raises
    BrokenPipeError. As the note on SIGPIPE in Python's `signal` documentation says, stdout
    is then pointed at devnull, so that the interpreter's own flush at exit cannot fail again,
    and the status is 1.
    """
    try:
        try:
            return main()
        finally:  # NOTE: also when main() exits through argparse (SystemExit, e.g. --help)
            sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def step_bytes(cfg: MLPConfig) -> int:
    """About the most bytes one `training_step(cfg)` holds at once, under any plan.

    float32 parameters, four batch x width arrays a layer (forward results kept for backward,
    their gradients, results recomputed under checkpointing), four batch x 10 arrays of the
    loss, and the int64 labels; weight gradients add little (the update accumulates into the
    weights). From width 4 up it is at least the peak of each plan and at most twice the
    largest (tests/test_cli.py measures it); narrower steps are dominated by per-array costs.
    """
    params = cfg.depth * (cfg.width * cfg.width + cfg.width) + cfg.width * CLASSES + CLASSES
    arrays = 4 * cfg.batch * cfg.width * (cfg.depth + 1) + 4 * cfg.batch * CLASSES
    return 4 * (params + arrays) + 8 * cfg.batch


def _default_device() -> backends.Device:
    """The default device, with every BLOCKRT_* setting the command reads checked now, or
    CommandError naming the environment variable that is wrong, its value and what it accepts:
    the default device and allocator (`runtime.config.check_settings`) and the CPU's BLAS
    (BLOCKRT_BLAS, BLOCKRT_BLAS_CACHE). BLOCKRT_PURE_PYTHON is read as blockrt is imported
    (blockrt/__init__.py says it in one line)."""
    try:
        device = config.check_settings()
        _blas.find()
    except (ValueError, RuntimeError) as exc:  # NOTE: BackendUnavailableError is a RuntimeError
        raise CommandError(str(exc)) from exc
    return device


# --- subcommands -------------------------------------------------------------------------------


def cmd_allocators(args: argparse.Namespace) -> int:
    """Print every registered allocator, where it comes from, and the default."""
    entry_points = {ep.name: ep for ep in metadata.entry_points(group=allocators.ENTRY_POINT_GROUP)}
    default = config.SETTINGS.allocator
    rows = []
    for name in allocators.names():
        sources = []
        if name in allocators.BUILTINS:
            sources.append(f"built-in ({allocators.BUILTINS[name]})")
        ep = entry_points.get(name)
        if ep is not None:
            dist = getattr(ep, "dist", None)
            owner = f", from {dist.name}" if dist is not None else ""
            sources.append(f"entry point {ep.value}{owner}")
        if not sources:
            sources.append("allocators.register() in this process")
        marker = "*" if name == default else " "
        rows.append((f"{marker} {name}", "; ".join(sources)))
    width = max(len(label) for label, _ in rows)
    for label, source in rows:
        print(f"{label:<{width}}  {source}")
    print()
    hint = "" if config.ALLOCATOR_ENV in config.SETTINGS.allocator_source else \
        f"; set {config.ALLOCATOR_ENV} to change it"
    print(f"default (*): {default} ({config.SETTINGS.allocator_source}{hint})")
    return 0


def _devices(kind: str) -> list[backends.Device]:
    devices = []
    while True:
        try:
            devices.append(backends.get_device(f"{kind}:{len(devices)}"))
        except (ValueError, backends.BackendUnavailableError):
            return devices


def cmd_info(args: argparse.Namespace) -> int:
    """Print versions, backends and their devices, the C paths and the default device."""
    print(f"blockrt {_version()}")
    print(f"Python {platform.python_version()} ({sys.executable})")
    print(f"NumPy {np.__version__}")
    kinds = backends.available()  # NOTE: imports each backend, whose C paths are then asked for
    print("\n".join(_c_path_lines(accelerated.paths())))
    measured = _measure(args.measure) if args.measure is not None else []
    print("\n".join(_blas_lines(_blas.report()) + measured))
    print(threads.describe())
    print(f"backends: {', '.join(kinds)}")
    for kind in kinds:
        for dev in _devices(kind):
            total = dev.total_memory
            memory = allocators.format_bytes(total) if total is not None else "unknown"
            print(f"  {dev.name}: alignment {dev.alignment} B, memory {memory}")
    print(f"default device: {runtime.get_default_device().name}")
    return 0


def _c_path_lines(paths: Sequence[accelerated.Path]) -> list[str]:
    """Each C path of `backends.accelerated`: in use or not, why, and what it runs in C (its
    Python twin runs the rest, and all of it where the path is off)."""
    lines = [f"C paths ({accelerated.PURE_PYTHON_ENV}=1 turns every one off; its Python twin "
             f"then runs alone):"]
    for path in paths:
        lines.append(f"  {path.module}: {path.why} ({path.runs}; {path.source})")
    return lines


def _measure(name: str, limit: float = 600.0, least: float = 1.0) -> list[str]:
    """Run config `name`'s training step under a static graph on the CPU device, and say what
    was run: where two libraries are measured against each other, until the CPU's BLAS is
    chosen (at most `limit` seconds), so that `_blas_lines` has timings to show; otherwise (a
    library named in BLOCKRT_BLAS, or only one here: nothing to choose) for `least` seconds and
    at least 3 steps, timing the library in use."""
    cfg = CONFIGS[name]
    chooser = _blas.report().chooser
    cpu = backends.get_device("cpu")
    old = runtime.get_default_device()
    runtime.set_default_device(cpu)  # NOTE: the products measured are the CPU device's
    try:
        step = training_step(cfg, "static", None)
        x, y = _batch(cfg, 0)
        step(x, y)  # NOTE: the capture and its plan, left out of the time
        steps, start = 0, time.perf_counter()

        def done(seconds: float) -> bool:
            if chooser is not None:
                return chooser.decision is not None or seconds >= limit
            return steps >= 3 and seconds >= least

        while not done(time.perf_counter() - start):
            step(x, y)
            steps += 1
        seconds = time.perf_counter() - start
        step.release()
    finally:
        runtime.set_default_device(old)
    if chooser is None:
        why = f"on {_blas.report().summary}: nothing to choose"
    elif chooser.decision is None:
        why = f"no library chosen after {limit:g} s"
    else:
        why = "until the library was chosen"
    each = f", {seconds / steps * 1e3:.3g} ms a step" if steps else ""
    return [f"  measured: config {name} (batch {cfg.batch}, width {cfg.width}, depth "
            f"{cfg.depth}), static plan, on cpu: {steps} steps after the capture in "
            f"{seconds:.2f} s{each}, {why}"]


def _blas_lines(report: _blas.Report) -> list[str]:
    """What `blockrt info` says of the CPU's products: the library, how it was chosen, and, for
    a measured choice, the time of each product shape on each library."""
    route, chooser = report.route, report.chooser
    if chooser is None:
        how = (f"{_blas.ENV}={report.setting}" if report.setting != "auto" else
               "the only CBLAS here" if route is not None else "no CBLAS found")
        what = f"CBLAS of {route.name} ({route.path})" if route is not None else \
            "matmul + a fused pass"
        return [f"CPU gemm: {what}, {how}"]
    libraries = chooser.libraries
    lines = ["CPU gemm: measured per process (BLOCKRT_BLAS=auto) between "
             + " and ".join(f"{lib.name} ({lib.path})" for lib in libraries)]
    if chooser.decision is not None:
        again = (f" (to be measured once more {_blas_choice.CONFIRM_SECONDS:g} s after the "
                 f"first choice; that choice stays)" if chooser.measuring else "")
        lines.append(f"  chosen: {chooser.decision.library.name}{again}; "
                     f"{chooser.decision.reason}")
    else:
        lines.append(f"  chosen: nothing yet, {chooser.state}: a process times the products "
                     f"of more than {_blas_choice.SMALL} multiply-adds it runs, then keeps one "
                     f"library (`blockrt info --measure S` runs the S training step until then)")
    cache = chooser.cache
    lines.append(f"  disk cache: {cache.path}" if cache is not None else
                 f"  disk cache: off ({_blas.CACHE_ENV}=1 keeps the times per machine)")
    rows = [(str(p), str(calls), times, "disk cache" if cached else "measured")
            for p, calls, times, cached in chooser.table()]
    if not rows and cache is not None:
        rows = [(str(p), "-", times, "disk cache") for p, times in sorted(
            cache.load().items(), key=lambda item: str(item[0]))]
    if rows:
        header = ("product (m x k @ k x n, transposed, +=: accumulates)", "calls",
                  *(f"{lib.name} (ms)" for lib in libraries), "from")
        cells = [(name, calls, *(f"{times[lib.name] * 1e3:.4g}" if times.get(lib.name)
                                  else "-" for lib in libraries), source)
                 for name, calls, times, source in rows]
        widths = [max(len(row[i]) for row in (header, *cells)) for i in range(len(header))]
        for row in (header, *cells):
            lines.append("    " + "  ".join(cell.ljust(width) for cell, width
                                           in zip(row, widths)).rstrip())
    return lines


def _version() -> str:
    try:
        return metadata.version("blockrt")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def cmd_plan(args: argparse.Namespace) -> int:
    """Capture the MLP training step, run it once, print its memory report; maybe plot."""
    base = CONFIGS[args.config]
    cfg = MLPConfig(args.batch or base.batch, args.width or base.width, args.depth or base.depth)
    label = args.config if cfg == base else f"{args.config} with overrides"
    device = _default_device()
    need, have = step_bytes(cfg), device.total_memory
    if have is not None and need > have:
        args.parser.error(f"config {label} (batch {cfg.batch}, width {cfg.width}, depth "
                          f"{cfg.depth}) needs about {allocators.format_bytes(need)} for one "
                          f"step (its parameters and activations, float32), more "
                          f"than the {allocators.format_bytes(have)} of device {device.name}; "
                          "lower --batch, --width or --depth")
    checkpoint, budget = args.checkpoint, args.budget
    if budget is not None and (checkpoint is not None or args.plan == "none"):
        args.parser.error("argument --budget: the budget chooses what to recompute itself and "
                          "needs --plan static or recycle (not --checkpoint, not --plan none)")
    if args.lossy and budget is None:
        args.parser.error("argument --lossy: lossy stores are a way to fit a budget: give "
                          "--budget BYTES too")
    print(f"config {label}: batch {cfg.batch}, width {cfg.width}, depth {cfg.depth}; "
          f"plan {args.plan}, checkpoint {checkpoint or 'none'}"
          + (f", memory budget {budget} B" if budget is not None else "")
          + ("" if args.fold_updates else ", updates not folded (eager's bits)"))
    plans = runtime.PLANS if args.plot else (args.plan,)
    if budget is not None:
        plans = tuple(p for p in plans if p != "none")
    timelines = {}
    try:
        x, y = _batch(cfg, args.seed)
        for plan, step in each_plan(lambda p: training_step(cfg, p, checkpoint, args.seed,
                                                            budget, args.lossy or False,
                                                            args.fold_updates),
                                    x, y, plans=plans):
            timelines[plan] = step.timeline()
            if plan == args.plan:
                print(runtime.format_report(step.memory_report()))
                if budget is not None:
                    print("\n".join(budget_lines(step)))
    except runtime.BudgetError as exc:
        raise CommandError(str(exc)) from exc
    except MemoryError as exc:  # NOTE: step_bytes() fits, but other processes hold memory too
        raise CommandError(f"out of memory running config {label}: {exc}") from exc
    if args.plot:
        try:
            path = runtime.plot_memory_timeline(
                timelines, args.plot, f"blockrt plan: config {label}, one training step")
        except ImportError as exc:
            raise CommandError(f"--plot needs matplotlib: pip install 'blockrt[plot]' ({exc})") \
                from exc
        except OSError as exc:
            raise CommandError(f"cannot write the plot: {exc}") from exc
        print(f"memory timeline of {', '.join(plans)} written to {path}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Run examples/train_mlp.py with this Python, passing the extra arguments through."""
    script = _checkout_dir("examples", "blockrt demo") / "train_mlp.py"
    missing = [m for m in DEMO_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise CommandError(f"blockrt demo needs {', '.join(missing)}: pip install 'blockrt[demo]'")
    return _run_script(script, args.extra)


def _bench_scripts() -> dict[str, Path]:
    folder = _checkout_dir("benchmarks", "blockrt bench")
    return {path.stem.removeprefix("bench_"): path for path in sorted(folder.glob("bench_*.py"))}


def cmd_bench(args: argparse.Namespace) -> int:
    """List the benchmark scripts, or run the named ones one after another."""
    scripts = _bench_scripts()
    if args.list or not args.names:
        for name, path in scripts.items():
            print(f"{name:<10}  {path.relative_to(ROOT)}")
        return 0
    status = 0
    for name in args.names:
        status = _run_script(scripts[name], args.extra) or status
    return status


# --- parser ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The `blockrt` argument parser with its subcommands."""
    parser = Parser(
        prog="blockrt", description="blockrt: allocators, a runtime with autograd and a graph "
        "runtime. Run `blockrt COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"blockrt {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("allocators", help="list the registered allocators and the default",
                       description="List allocators.names(), where each comes from (built-in, "
                       f"entry point group {allocators.ENTRY_POINT_GROUP}), and the default "
                       f"({config.ALLOCATOR_ENV}).")
    p.set_defaults(run=cmd_allocators)

    p = sub.add_parser("info", help="versions, backends, devices, the default device",
                       description="Print the Python and NumPy versions, the available backends "
                       "and their devices, whether the C allocator hot path is in use, the BLAS "
                       "the CPU device's products run on (and, where it is measured, the time "
                       "of each product shape on each library), and the default device.")
    p.add_argument("--measure", choices=list(CONFIGS), default=None, metavar="CONFIG",
                   help="first run this MLP configuration's training step (one of "
                   f"{', '.join(CONFIGS)}) on the CPU, and say what ran: until the CPU's BLAS "
                   "is chosen where two libraries are measured (to show their timings), "
                   "else for a second (the time of a step)")
    p.set_defaults(run=cmd_info)

    p = sub.add_parser("plan", help="memory report of an MLP training step",
                       description="Capture the MLP training step of benchmarks/bench_graph.py "
                       "with runtime.graph, run it once on random data, and print its memory "
                       "report. Configurations (batch, width, depth): "
                       + "; ".join(f"{k} {c.batch},{c.width},{c.depth}"
                                   for k, c in CONFIGS.items()) + ".")
    p.add_argument("--config", choices=list(CONFIGS), default="S", help="default: S")
    p.add_argument("--plan", choices=runtime.PLANS, default="static", help="default: static")
    p.add_argument("--checkpoint", choices=["sqrt", "pointwise"], default=None,
                   help="recompute forward results (sqrt: Chen et al. 2016's segments; "
                        "pointwise: only what elementwise chains make again from kept data); "
                        "default: none")
    p.add_argument("--budget", metavar="BYTES", type=int_in(0), default=None,
                   help="fit the intermediates in BYTES: keep or recompute each forward result "
                   "the backward pass reads, chosen by cost (docs/graph.md); shows the choice "
                   "and the timeline")
    p.add_argument("--lossy", choices=["bfloat16", "float16"], default=None,
                   help="with --budget: the budget may also store waiting forward results in "
                   "this half dtype (lossy; default: never)")
    p.add_argument("--no-fold-updates", dest="fold_updates", action="store_false",
                   help="do not fold SGD's updates into the weight gradients' products: every "
                   "step then equals eager's bits, at a product-sized buffer more "
                   "(runtime.graph's fold_updates; default: folded)")
    p.add_argument("--plot", metavar="PATH", type=png_path,
                   help="also write a PNG of the memory timeline of all three plans "
                   "(needs matplotlib: the `plot` extra)")
    dim = int_in(1, MAX_DIM, "a BLAS dimension is a 32-bit integer")
    p.add_argument("--batch", type=dim, help="override the configuration's batch; one step "
                   "must fit in the device's memory")
    p.add_argument("--width", type=dim, help="override the configuration's width; one step "
                   "must fit in the device's memory")
    p.add_argument("--depth", type=int_in(1, MAX_DEPTH, "capture and planning take about 2 ms "
                                          "a layer"),
                   help=f"override the configuration's depth (at most {MAX_DEPTH})")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0,
                   help="weights and data (default: 0)")
    p.set_defaults(run=cmd_plan)

    p = sub.add_parser("demo", help="train the MLP of examples/train_mlp.py (checkout only)",
                       description=f"{DEMO_DESCRIPTION} Runs examples/train_mlp.py with "
                       "this Python, in the current directory, where it writes "
                       "memory_timeline.png (it needs a repository checkout and the `demo` "
                       "extra). The options below are checked, then passed to the script, e.g. "
                       "`blockrt demo --epochs 5 --no-progress`, or "
                       "`blockrt demo --precision float16` for mixed precision; arguments after "
                       "`--` are passed as they are.")
    add_demo_options(p)
    p.set_defaults(run=cmd_demo)

    p = sub.add_parser("bench", help="list or run the benchmarks (checkout only)",
                       description="Run benchmarks/bench_NAME.py for each NAME, one after another, "
                       "with this Python, in the current directory; without NAME or with --list, "
                       "list them. Other arguments, or those after `--`, go to each script, e.g. "
                       "`blockrt bench graph alloc -- --quick`.")
    p.add_argument("names", nargs="*", metavar="NAME", help="e.g. graph (bench_graph.py)")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.set_defaults(run=cmd_bench)
    for name, subparser in sub.choices.items():
        subparser.set_defaults(parser=subparser, passthrough=name == "bench")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `blockrt` command with `argv` (default: sys.argv[1:]); returns the exit status.

    Bad command-line input exits through argparse (SystemExit 2, one line naming the option,
    the value and what is allowed: `Parser`). Output piped into a reader that stops early
    (`| head -1`) ends quietly with status 1 (`run_piped`).
    """
    return run_piped(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not args.passthrough:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra and args.command not in ("demo", "bench"):
        args.parser.error(f"no arguments are taken after '--': {' '.join(extra)}")
    # NOTE: the demo's options are checked here and passed on as typed (the command is the
    # first word that is not an option: the top-level options take no value)
    own = argv[argv.index(args.command) + 1:] if args.command == "demo" else unknown
    args.extra = own + extra
    try:
        if args.command == "bench":
            known = _bench_scripts()
            for name in args.names:
                if name.removeprefix("bench_").removesuffix(".py") not in known:
                    args.parser.error(f"unknown benchmark {name!r}; known: {', '.join(known)}")
            args.names = [n.removeprefix("bench_").removesuffix(".py") for n in args.names]
            if args.extra and (args.list or not args.names):
                args.parser.error(f"arguments {' '.join(args.extra)!r} go to the benchmarks "
                                  "named, and none is named (without a NAME, or with --list, "
                                  "bench lists the benchmarks)")
        _default_device()
        return args.run(args)
    except CommandError as exc:
        print(f"blockrt {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
