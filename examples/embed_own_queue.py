"""Put blockrt over a framework's own OpenCL context and queue.

A framework that already has a pyopencl context and an in-order queue hands the queue to
`backends.from_queue`: blockrt's allocator, tensors, graphs and training then run on that queue,
in that context, so the framework's arrays and blockrt's tensors compute on each other's memory
with no copy and no second context. Here the framework makes the training data with its own
kernels in blockrt memory, blockrt trains a small network on the same queue, and the framework
reads blockrt's output through a native view. Needs blockrt's OpenCL backend (pyopencl and a
platform, such as PoCL); without it the example says so and exits with status 1.

    python examples/embed_own_queue.py
"""

from __future__ import annotations

import gc
import sys

import numpy as np

import blockrt
from allocators.interop import pyopencl_allocator
from blockrt import nn


def native(t: blockrt.Tensor, write: bool = False):
    """The framework's view of tensor `t`: a pyopencl Array over its memory, on the device's
    queue, valid while `t` lives (the view does not keep the memory). With `write=True` the
    memory is allocated if need be and the write is recorded."""
    block = t.block
    memory = block.memory_for_write("framework") if write else block.memory_for_read()
    view = t.device.array_view(memory.raw, memory.offset + t.offset * t.itemsize, t.shape,
                               t.dtype, tuple(s * t.itemsize for s in t.strides))
    if write:
        block.mark_written()  # NOTE: the write is queued; later reads queue behind it
    return view


def main() -> None:
    if "opencl" not in blockrt.backends.available():
        sys.exit("embed_own_queue.py needs blockrt's OpenCL backend: pyopencl and an OpenCL "
                 "platform such as PoCL (install blockrt[opencl])")
    import pyopencl as cl
    import pyopencl.array as cla
    import pyopencl.clrandom as clrandom

    # 1. The framework's own context and in-order queue (an out-of-order one is refused).
    context = cl.Context([blockrt.get_device("opencl").cl_device])
    queue = cl.CommandQueue(context)

    # 2. blockrt over them: one device per queue, and an allocator that serves both sides.
    device = blockrt.from_queue(queue)
    alloc = blockrt.allocators.StatisticsAdaptor(blockrt.allocators.create("caching", device))
    hook = pyopencl_allocator(alloc)  # bound to the device's queue: the framework's
    print(f"blockrt device {device.name}: the framework's queue {device.queue is queue}, "
          f"its context {device.context == context}")

    # 3. The framework makes the data with its own kernels, in blockrt memory: points in
    # [-1, 1)^2, labelled by the quadrant pair they lie in (not linearly separable).
    n = 512
    generator = clrandom.PhiloxGenerator(context, seed=0)
    u, v = (cla.empty(queue, n, np.float32, allocator=hook) for _ in range(2))
    generator.fill_uniform(u, a=-1.0, b=1.0)
    generator.fill_uniform(v, a=-1.0, b=1.0)
    truth = (u * v) > 0  # int8, allocated through the hook
    x = blockrt.empty((2, n), "float32", device=device, allocator=alloc)
    features = native(x, write=True)  # pyopencl kernels write the blockrt tensors
    features[0], features[1] = 2 * u, 2 * v
    y = blockrt.empty((n,), "uint8", device=device, allocator=alloc)
    native(y, write=True)[...] = truth.view(np.uint8)  # the class labels, 0 or 1

    # 4. blockrt trains on the same queue: a captured, planned training step.
    model = nn.Sequential(nn.Dense(2, 16, device=device, allocator=alloc, rng=1), nn.Tanh(),
                          nn.Dense(16, 2, device=device, allocator=alloc, rng=2))
    optimizer = nn.SGD(model.parameters(), lr=0.5, momentum=0.9)
    step = blockrt.graph(nn.train_step(model, optimizer), device=device, allocator=alloc)
    losses = [step(x.T, y).item() for _ in range(300)]
    print(f"training loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")

    # 5. The framework reads blockrt's output through a native view, on its own queue.
    with blockrt.no_grad():
        logits = model(x.T)
        difference = blockrt.ops.sub(logits[:, 1], logits[:, 0])
    margin = native(difference)  # NOTE: valid while `difference` lives: the tensor owns it
    agree = (margin > 0) == truth  # pyopencl kernels on blockrt memory
    print(f"training accuracy {agree.get().mean():.3f}, computed by the framework on "
          f"{'its own' if margin.queue is queue else 'another'} queue")

    del u, v, truth, features, x, y, logits, difference, margin, agree, model, optimizer, step
    gc.collect()
    stats = alloc.stats()
    print(f"one allocator served both: {stats['num_allocs']} allocations, peak "
          f"{blockrt.allocators.format_bytes(stats['peak_allocated_bytes'])}, "
          f"{stats['active_allocations']} still live")


if __name__ == "__main__":
    main()
