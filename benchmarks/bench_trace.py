"""Replay of an MLP training loop's allocation trace (batch 256, width 1024, depth 4).

The trace (benchmarks/mlp_trace.py: 30 allocs and 30 frees per step) is recorded through
blockrt's `TraceAdaptor`, written as JSON lines, loaded back and replayed with
`allocators.adaptors.replay` against each blockrt allocator; numpy.empty and pyopencl's
MemoryPool on PoCL replay the same events with an equivalent loop. Figures, from one run:

- hit rate after the first step: allocations served from the cache / allocations, steps 2..N;
- peak reserved / peak requested bytes;
- time per event (alloc or free), best of several replays.

Run: python benchmarks/bench_trace.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mlp_trace import mlp_training_events, peak_live_bytes

import allocators
from allocators.adaptors import TraceAdaptor, load_trace, replay

ALLOCATORS = ("caching", "direct")


def record_trace(events, path: pathlib.Path) -> None:
    """Run `events` through a TraceAdaptor and write its log as JSON lines."""
    tracer = TraceAdaptor(allocators.create("direct", "cpu"))
    live = {}
    for kind, tensor, nbytes in events:
        if kind == "alloc":
            live[tensor] = tracer.allocate(nbytes)
        else:
            tracer.free(live.pop(tensor))
    with open(path, "w") as f:
        tracer.to_jsonl(f)


def blockrt_figures(name: str, trace, steps: int, repeats: int) -> dict:
    per_event = float("inf")
    for _ in range(repeats):
        result = replay(trace, allocators.create(name, "cpu"))
        per_event = min(per_event, result["us_per_event"])
    # Figures after the first step: replay one step, reset the counters' view, replay the rest.
    alloc = allocators.create(name, "cpu")
    one_step = len(trace) // steps
    replay(trace[:one_step], alloc)
    first = alloc.stats()
    replay(trace[one_step:], alloc)
    last = alloc.stats()
    allocs = last["num_allocs"] - first["num_allocs"]
    hits = last["cache_hits"] - first["cache_hits"]
    return {"hit_rate": hits / allocs, "peak_reserved": last["peak_reserved_bytes"],
            "us_per_event": per_event}


def loop_figures(alloc_fn, free_fn, events, steps: int, repeats: int, reserved_fn=None) -> dict:
    """Replay with plain callables (numpy.empty, pyopencl): time, and reserved bytes if known."""
    per_event = float("inf")
    for _ in range(repeats):
        live = {}
        start = time.perf_counter()
        for kind, tensor, nbytes in events:
            if kind == "alloc":
                live[tensor] = alloc_fn(nbytes)
            else:
                free_fn(live.pop(tensor))
        per_event = min(per_event, (time.perf_counter() - start) / len(events) * 1e6)
    figures = {"us_per_event": per_event, "hit_rate": None, "peak_reserved": None}
    if reserved_fn is not None:
        live, peak, misses, allocs = {}, 0, 0, 0
        one_step = len(events) // steps
        for index, (kind, tensor, nbytes) in enumerate(events):
            before = reserved_fn()
            if kind == "alloc":
                live[tensor] = alloc_fn(nbytes)
                if index >= one_step:
                    allocs += 1
                    misses += reserved_fn() > before
            else:
                free_fn(live.pop(tensor))
            peak = max(peak, reserved_fn())
        figures.update(hit_rate=1 - misses / allocs, peak_reserved=peak)
    return figures


def pyopencl_pool():
    try:
        import pyopencl as cl
        import pyopencl.tools as cl_tools
    except ImportError:
        return None
    queue = cl.CommandQueue(cl.create_some_context(interactive=False))
    return cl_tools.MemoryPool(cl_tools.ImmediateAllocator(queue))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (for smoke runs)")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (5 if args.quick else 50)
    repeats = 2 if args.quick else 5
    events = mlp_training_events(batch=256, width=1024, depth=4, steps=steps)
    requested = peak_live_bytes(events)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "mlp.jsonl"
        record_trace(events, path)
        trace = load_trace(path)
    rows = {name: blockrt_figures(name, trace, steps, repeats) for name in ALLOCATORS}
    rows["numpy.empty"] = loop_figures(lambda n: np.empty(n, np.uint8), lambda a: None, events,
                                       steps, repeats)
    pool = pyopencl_pool()
    if pool is not None:
        rows["pyopencl pool"] = loop_figures(pool.allocate, lambda b: b.release(), events, steps,
                                             repeats, reserved_fn=lambda: pool.managed_bytes)
    print(f"{steps} steps, {len(events)} events, peak requested "
          f"{allocators.format_bytes(requested)}\n")
    print("| allocator | hit rate after step 1 | peak reserved / peak requested | us per event |")
    print("|---|---:|---:|---:|")
    for name, f in rows.items():
        hit = "n/a" if f["hit_rate"] is None else f"{100 * f['hit_rate']:.2f}%"
        ratio = "n/a" if f["peak_reserved"] is None else f"{f['peak_reserved'] / requested:.2f}"
        print(f"| {name} | {hit} | {ratio} | {f['us_per_event']:.2f} |")


if __name__ == "__main__":
    main()
