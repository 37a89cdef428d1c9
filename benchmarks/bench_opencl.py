"""The OpenCL backend on PoCL (a CPU OpenCL device): fusion, the training step, allocation.

Tables, each measured side by side in interleaved rounds (best kept):
1. A fused elementwise chain against the same ops unfused: sigmoid(x * a + b) on 16M float32
   (`--elements` to change; a and b numbers, as a captured graph passes them), as one
   `Device.fused` program (one generated kernel, no intermediate buffers) against three kernels
   writing two full-size temporaries.
2. The MLP training step of benchmarks/mlp_reference.py on the OpenCL device: blockrt eager
   against the same step captured by `runtime.graph(plan="static")` (small configuration: PoCL's
   GEMM runs at about 1 GFLOP/s here).
3. A cached allocate + free pair: blockrt's caching allocator on the OpenCL device against
   `pyopencl.tools.MemoryPool(ImmediateAllocator(queue))` on the same device.
4. float16 and bfloat16 against float32 (`--half-elements`, default 4M): the chain
   sigmoid(x * a + b) op by op and as one fused program, and the S MLP training step (eager and
   under a static graph), each half dtype two ways: the native half kernels (loads widen, the
   store rounds once) and the widened path they replaced (`widened_halves`: every half operand
   copied into float32 scratch, the float32 kernel, the result narrowed by a cast kernel).
The header names the CPU (PoCL runs the kernels on it), the software (pyopencl, the OpenCL
platform) and the load; products run in blockrt's own OpenCL kernel, on no CBLAS.

Run: python benchmarks/bench_opencl.py [--quick] [--elements N] [--tables fusion,half,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_reference import MLPConfig, blockrt_model, init_params, make_batch, typed_step
from timing import cpu_name, interleaved_best, interleaved_min, versions

import allocators
import backends
import runtime
from backends.base import HALVES
from blockrt.models import CONFIGS
from runtime import nn, ops


def device_or_exit() -> backends.Device:
    if "opencl" not in backends.available():
        print("no OpenCL device here (pip install 'blockrt[opencl]' brings PoCL)")
        sys.exit(0)
    return backends.get_device("opencl")


def timed(fn, device: backends.Device) -> float:
    start = time.perf_counter()
    fn()
    device.synchronize()
    return (time.perf_counter() - start) * 1e3


def fusion_table(device: backends.Device, elements: int, rounds: int) -> None:
    rng = np.random.default_rng(0)
    alloc = allocators.create("caching", device)
    x = runtime.tensor(rng.normal(size=elements).astype(np.float32), allocator=alloc)
    a, b = np.float32(1.5), np.float32(-0.25)  # numbers, as a captured graph passes them
    out = runtime.empty(elements, "float32", allocator=alloc)

    def unfused() -> None:
        ops.sigmoid(ops.add(ops.mul(x, a), b), out=out)

    views = [x._native_read("bench")]
    target = out._native_write("bench")
    dtype = np.dtype(np.float32)
    program = (("mul", (("input", 0), ("number", a)), dtype),
               ("add", (("link", 0), ("number", b)), dtype),
               ("sigmoid", (("link", 1),), dtype))

    def fused() -> None:
        device.fused(program, views, target)

    unfused()
    expected = out.numpy()
    fused()
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6, atol=1e-7)
    best = interleaved_min({"unfused": lambda: timed(unfused, device),
                            "fused": lambda: timed(fused, device)}, rounds)
    nbytes = elements * 4
    print(f"Fused elementwise chain sigmoid(x * a + b), {elements:,} float32 on "
          f"{device.name} ({device.cl_device.name}), best of {rounds} rounds:\n")
    print("| | ms | bytes moved (ideal) | full-size temporaries |")
    print("|---|---:|---:|---:|")
    print(f"| unfused (3 kernels) | {best['unfused']:.2f} | {6 * nbytes / 2**20:.0f} MiB | 2 |")
    print(f"| fused (1 kernel) | {best['fused']:.2f} | {2 * nbytes / 2**20:.0f} MiB | 0 |")
    print(f"| **unfused / fused** | **{best['unfused'] / best['fused']:.2f}x** | | |")
    print(f"\nkernel cache: {device.kernel_cache_stats()}")


def training_table(device: backends.Device, config: MLPConfig, rounds: int) -> None:
    x, labels = make_batch(config)
    model, opt, _ = blockrt_model(init_params(config), device=device)
    tx, ty = runtime.tensor(x, device=device), runtime.tensor(labels, device=device)

    def eager() -> None:
        opt.zero_grad()
        loss = nn.softmax_cross_entropy(model(tx), ty)
        loss.backward()
        opt.step()
        loss.item()

    g_model, g_opt, _ = blockrt_model(init_params(config), device=device)
    graph = runtime.graph(nn.train_step(g_model, g_opt), plan="static", device=device)

    def static() -> None:
        graph(tx, ty).item()

    best = interleaved_best({"eager": eager, "static": static}, number=1, rounds=rounds)
    report = graph.memory_report()
    print(f"\nMLP training step on {device.name}, batch {config.batch}, width {config.width}, "
          f"depth {config.depth}, best of {rounds} rounds:\n")
    print("| | ms per step |")
    print("|---|---:|")
    print(f"| eager | {best['eager'] / 1e3:.1f} |")
    print(f"| graph static | {best['static'] / 1e3:.1f} |")
    print(f"| **static / eager** | **{best['static'] / best['eager']:.2f}** |")
    print(f"\nstatic plan: {report['planned_bytes'] / 2**10:.0f} KiB planned, "
          f"{report['naive_bytes'] / 2**10:.0f} KiB naive, {report['fused']} fused instructions")


def allocation_table(device: backends.Device, rounds: int, number: int) -> None:
    import pyopencl.tools as cl_tools

    rows = []
    for nbytes in (256, 64 << 10, 4 << 20):
        alloc = allocators.create("caching", device)
        pool = cl_tools.MemoryPool(cl_tools.ImmediateAllocator(device.queue))

        def blockrt_pair(alloc=alloc, nbytes=nbytes) -> None:
            alloc.free(alloc.allocate(nbytes))

        def pyopencl_pair(pool=pool, nbytes=nbytes) -> None:
            pool.allocate(nbytes).release()

        rows.append((nbytes, interleaved_best({"caching": blockrt_pair,
                                               "pyopencl pool": pyopencl_pair}, number, rounds)))
    print(f"\nCached allocate + free on {device.name}, best of {rounds} rounds of {number}:\n")
    print("| size | caching (us) | pyopencl pool (us) | caching / pyopencl |")
    print("|---|---:|---:|---:|")
    for nbytes, best in rows:
        print(f"| {allocators.format_bytes(nbytes)} | {best['caching']:.2f} | "
              f"{best['pyopencl pool']:.2f} | {best['caching'] / best['pyopencl pool']:.2f} |")


def widened_halves() -> backends.Device:
    """A new OpenCL device that computes float16 and bfloat16 as before the native half
    kernels: `half_kernels` off and no `half_elementwise` (each half operand widened into
    float32 scratch, the float32 kernel, the result narrowed), fused half chains in the blocked
    default (those kernels again, block by block)."""
    from backends.opencl import OpenCLDevice

    class Widened(OpenCLDevice):
        capabilities = dataclasses.replace(OpenCLDevice.capabilities, half_kernels=False)

        def _compile_fused(self, program, inputs, out):
            return None if out.dtype in HALVES else super()._compile_fused(program, inputs, out)

    return Widened(0)


def half_chain(device: backends.Device, dtype: str, elements: int):
    """(op by op, fused) runs of sigmoid(x * a + b) on `elements` of `dtype`, and the out."""
    alloc = allocators.create("caching", device)
    host = np.random.default_rng(0).normal(size=elements).astype(np.float32)
    x = runtime.tensor(host, dtype=dtype, device=device, allocator=alloc)
    out = runtime.tensor(np.zeros(elements, np.float32), dtype=dtype, device=device,
                         allocator=alloc)
    a, b = np.float32(1.5), np.float32(-0.25)
    half = np.dtype(out.dtype)
    program = (("mul", (("input", 0), ("number", a)), half),
               ("add", (("link", 0), ("number", b)), half),
               ("sigmoid", (("link", 1),), half))
    views, target = [x._native_read("bench")], out._native_write("bench")

    def unfused() -> None:
        ops.sigmoid(ops.add(ops.mul(x, a), b), out=out)

    def fused() -> None:
        device.fused(program, views, target)

    return unfused, fused, out


def half_step(device: backends.Device, dtype: str, graph: bool):
    """One SGD step of the S MLP (blockrt.models) with every tensor in `dtype` on `device`."""
    step = typed_step(CONFIGS["S"], dtype, graph, device)
    return lambda: step().item()


def half_table(device: backends.Device, elements: int, rounds: int, step: bool) -> None:
    widened = widened_halves()
    kinds = {"float32": [("float32", device)]}
    for dtype in ("float16", "bfloat16"):
        kinds[dtype] = [(f"{dtype} widened", widened), (f"{dtype} native", device)]
    chains = {}
    for dtype, pairs in kinds.items():
        for label, dev in pairs:
            chains[label] = half_chain(dev, dtype, elements)
    for dtype in ("float16", "bfloat16"):  # the same bits both ways, op by op and fused
        results = []
        for label in (f"{dtype} widened", f"{dtype} native"):
            for run in chains[label][:2]:
                run()
                results.append(chains[label][2].numpy().view(np.uint16))
        if not all(np.array_equal(results[0], r) for r in results[1:]):
            raise SystemExit(f"{dtype}: the widened and native paths disagree")
    measures = {}
    for label, (unfused, fused, _) in chains.items():
        dev = widened if "widened" in label else device
        measures[f"{label} op by op"] = lambda unfused=unfused, dev=dev: timed(unfused, dev)
        measures[f"{label} fused"] = lambda fused=fused, dev=dev: timed(fused, dev)
    if step:
        for graph in (False, True):
            mode = "graph" if graph else "eager"
            for dtype, pairs in kinds.items():
                for label, dev in pairs:
                    run = half_step(dev, dtype, graph)
                    run()
                    measures[f"{label} S step {mode}"] = lambda run=run, dev=dev: timed(run, dev)
    best = interleaved_min(measures, rounds)
    print(f"\nfloat16 and bfloat16 against float32 on {device.name} (cl_khr_fp16: "
          f"{'yes' if device.fp16 else 'no'}), best of {rounds} rounds: the chain "
          f"sigmoid(x * a + b) on {elements:,} elements, the S MLP training step "
          f"(batch {CONFIGS['S'].batch}, width {CONFIGS['S'].width}, depth "
          f"{CONFIGS['S'].depth}); ratios to float32 in the same row\n")
    labels = ["float32"] + [f"{d} {w}" for d in ("float16", "bfloat16")
                            for w in ("widened", "native")]
    print("| what | " + " | ".join(f"{label} (ms)" for label in labels)
          + " | " + " | ".join(f"{label} / float32" for label in labels[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(labels) - 1))
    rows = ["op by op", "fused"] + (["S step eager", "S step graph"] if step else [])
    for row in rows:
        ms = [best[f"{label} {row}"] for label in labels]
        print(f"| {row} | " + " | ".join(f"{m:.2f}" for m in ms) + " | "
              + " | ".join(f"{m / ms[0]:.2f}" for m in ms[1:]) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--elements", type=int, default=16 << 20)
    parser.add_argument("--half-elements", type=int, default=4 << 20)
    parser.add_argument("--tables", default="fusion,training,allocation,half",
                        help="which tables, comma-separated")
    args = parser.parse_args()
    tables = args.tables.split(",")
    device = device_or_exit()
    print(f"OpenCL on {cpu_name()}; {versions(device)}; products in blockrt's OpenCL kernel; "
          f"1-minute load average {os.getloadavg()[0]:.2f} at the start\n")
    elements = 1 << 16 if args.quick else args.elements
    if "fusion" in tables:
        fusion_table(device, elements, 3 if args.quick else 9)
    config = MLPConfig(16, 32, 2) if args.quick else MLPConfig(64, 256, 4)
    if "training" in tables:
        training_table(device, config, 2 if args.quick else 5)
    if "allocation" in tables:
        allocation_table(device, 3 if args.quick else 9, 500 if args.quick else 5000)
    if "half" in tables:
        half_table(device, 1 << 16 if args.quick else args.half_elements,
                   2 if args.quick else 5, step=not args.quick)


if __name__ == "__main__":
    main()
