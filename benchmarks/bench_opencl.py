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
The header names the CPU (PoCL runs the kernels on it), the software (pyopencl, the OpenCL
platform) and the load; products run in blockrt's own OpenCL kernel, on no CBLAS.

Run: python benchmarks/bench_opencl.py [--quick] [--elements N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlp_reference import LR, MLPConfig, init_params, make_batch
from timing import cpu_name, interleaved_best, interleaved_min, versions

import allocators
import backends
import runtime
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

    def model_and_opt():
        layers: list[nn.Module] = []
        for weight, bias in init_params(config):
            dense = nn.Dense(weight.shape[1], weight.shape[0], device=device)
            with runtime.no_grad():
                dense.weight[...] = weight
                dense.bias[...] = bias
            layers += [dense, nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        return model, nn.SGD(model.parameters(), lr=LR)

    model, opt = model_and_opt()
    tx, ty = runtime.tensor(x, device=device), runtime.tensor(labels, device=device)

    def eager() -> None:
        opt.zero_grad()
        loss = nn.softmax_cross_entropy(model(tx), ty)
        loss.backward()
        opt.step()
        loss.item()

    g_model, g_opt = model_and_opt()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few rounds")
    parser.add_argument("--elements", type=int, default=16 << 20)
    args = parser.parse_args()
    device = device_or_exit()
    print(f"OpenCL on {cpu_name()}; {versions(device)}; products in blockrt's OpenCL kernel; "
          f"1-minute load average {os.getloadavg()[0]:.2f} at the start\n")
    elements = 1 << 16 if args.quick else args.elements
    fusion_table(device, elements, 3 if args.quick else 9)
    config = MLPConfig(16, 32, 2) if args.quick else MLPConfig(64, 256, 4)
    training_table(device, config, 2 if args.quick else 5)
    allocation_table(device, 3 if args.quick else 9, 500 if args.quick else 5000)


if __name__ == "__main__":
    main()
