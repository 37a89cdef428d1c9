"""Queue-ordered reuse (issue 15): what it costs on the same-queue hot path, against a baseline.

The same cases run in two source trees side by side: this checkout, and a baseline commit
checked out into a temporary git worktree (default: the commit before queue-ordered reuse).
Each round starts one worker process per tree, in turn, so both see the same machine load;
the best round of each case is kept. The baseline's C extension is built in its worktree
(`setup.py build_ext --inplace`, with the compiler this checkout was built with).

Same-queue cases (must cost at most 5% more than the baseline):
- `caching` allocate + free of 4 KiB on the OpenCL device (the C hot path), and on the CPU;
- `direct` and `statistics(caching)` allocate + free on the CPU (the Python path of `free`);
- the pyopencl hook on the device's own queue: one 4 KiB buffer, and a pyopencl array;
- `ops.add` of two 64x256 float32 tensors on OpenCL, new output (allocated and freed).
Cross-queue cases (this checkout only, since the baseline cannot do them): a hook bound to a
second queue, and `record_queue` + free.

Run: python benchmarks/bench_queues.py [--baseline REF] [--rounds N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import ROOT, baseline_checkout, cpu_name

#: The last commit before queue-ordered reuse.
BASELINE = "b52df7d"


# ---------------------------------------------------------------------- the worker
def cases(cross: bool) -> dict:
    """name -> a function of no arguments that runs the case once."""
    import numpy as np

    import allocators
    import backends
    import runtime
    from allocators.adaptors import StatisticsAdaptor

    found: dict = {}

    def pair(alloc, nbytes=4096):
        allocate, free = alloc.allocate, alloc.free
        return lambda: free(allocate(nbytes))

    found["caching 4 KiB, cpu (C hot path)"] = pair(allocators.create("caching", "cpu"))
    found["direct 4 KiB, cpu (Python free)"] = pair(allocators.create("direct", "cpu"))
    found["statistics(caching) 4 KiB, cpu"] = pair(
        StatisticsAdaptor(allocators.create("caching", "cpu")))
    if "opencl" not in backends.available():
        return found
    import pyopencl as cl
    import pyopencl.array as cla

    from allocators import interop

    dev = backends.get_device("opencl")
    alloc = allocators.create("caching", dev)
    found["caching 4 KiB, opencl (C hot path)"] = pair(alloc)
    hook = interop.pyopencl_allocator(alloc)
    found["pyopencl hook, 4 KiB buffer, home queue"] = lambda: hook(4096)
    found["pyopencl array of 1024 float32, home queue"] = (
        lambda: cla.empty(dev.queue, (1024,), np.float32, allocator=hook))
    a = runtime.tensor(np.ones((64, 256), np.float32), device=dev, allocator=alloc)
    b = runtime.tensor(np.ones((64, 256), np.float32), device=dev, allocator=alloc)
    found["ops.add 64x256 float32, opencl, new output"] = (
        lambda: runtime.ops.add(a, b).release())
    if cross:
        other = cl.CommandQueue(dev.context)
        bound = interop.pyopencl_allocator(alloc, other)
        found["pyopencl hook, 4 KiB buffer, another queue"] = lambda: bound(4096)

        def recorded() -> None:
            allocation = alloc.allocate(4096)
            alloc.record_queue(allocation, other)
            alloc.free(allocation)

        found["caching 4 KiB, opencl, record_queue + free"] = recorded
    return found


def worker(number: int, cross: bool) -> None:
    found = cases(cross)
    results = {}
    for name, fn in found.items():
        fn()  # NOTE: warm-up (first allocations, kernel builds)
        results[name] = min(timeit.repeat(fn, number=number, repeat=3)) / number * 1e6
    for name in found:
        if "opencl" in name or "queue" in name:
            import backends

            backends.get_device("opencl").synchronize()
            break
    import allocators

    results["tree"] = str(pathlib.Path(allocators.__file__).resolve().parents[1])
    print(json.dumps(results))


# ---------------------------------------------------------------------- the driver
def run_tree(tree: pathlib.Path, number: int, cross: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONSAFEPATH="1")
    args = [sys.executable, str(ROOT / "benchmarks" / "bench_queues.py"), "--worker",
            "--number", str(number)] + (["--cross"] if cross else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"worker in {tree} failed:\n{out.stderr}")
    results = json.loads(out.stdout.splitlines()[-1])
    loaded = results.pop("tree")
    if pathlib.Path(loaded) != tree.resolve():
        raise SystemExit(f"the worker for {tree} imported blockrt from {loaded}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE, help="commit to compare against")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 300 calls")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cross", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or args.number < 1:
        parser.error("--rounds and --number must be at least 1")
    if args.worker:
        worker(args.number, args.cross)
        return
    if args.quick:
        args.rounds, args.number = 3, 300
    with baseline_checkout(args.baseline) as base:
        best: dict[str, dict[str, float]] = {"baseline": {}, "now": {}}
        for _ in range(args.rounds):
            for label, tree, cross in (("baseline", base, False), ("now", ROOT, True)):
                for name, value in run_tree(tree, args.number, cross).items():
                    best[label][name] = min(value, best[label].get(name, float("inf")))
    print(f"# queue-ordered reuse: same-queue cost against {args.baseline}; {cpu_name()}; "
          f"Python {platform.python_version()}; {args.rounds} rounds of {args.number} calls")
    print("| case | baseline (us) | now (us) | ratio |")
    print("|---|---:|---:|---:|")
    for name, now in best["now"].items():
        before = best["baseline"].get(name)
        if before is None:
            print(f"| {name} | - | {now:.2f} | - |")
        else:
            print(f"| {name} | {before:.2f} | {now:.2f} | {now / before:.3f} |")


if __name__ == "__main__":
    main()
