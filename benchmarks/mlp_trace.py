"""The allocation trace of an MLP training loop, as eager execution makes it.

One step of an MLP with `depth` dense layers of `width` units, ReLU, a fused softmax-cross-entropy
loss and SGD, on a float32 batch of `batch` rows, allocates and frees exactly 30 tensors when depth
is 4: the input batch, per layer the matmul result, the biased pre-activation and the activation
(the matmul result dies at once), the loss and its gradient, then per layer backwards the
pre-activation gradient, the weight and bias gradients and (except the first layer) the input
gradient. Every tensor is freed at its last use, as reference counting frees it.

Events are ("alloc", id, nbytes) and ("free", id, 0).
"""

from __future__ import annotations

import itertools

Event = tuple[str, int, int]


def mlp_training_events(batch: int = 256, width: int = 1024, depth: int = 4, steps: int = 1,
                        itemsize: int = 4) -> list[Event]:
    """The events of `steps` training steps (see the module docstring)."""
    events: list[Event] = []
    ids = itertools.count()
    act, weight, bias = batch * width * itemsize, width * width * itemsize, width * itemsize

    def alloc(nbytes: int) -> int:
        tensor = next(ids)
        events.append(("alloc", tensor, nbytes))
        return tensor

    def free(*tensors: int) -> None:
        events.extend(("free", tensor, 0) for tensor in tensors)

    for _ in range(steps):
        # Forward: x @ W -> z; z + b -> h (z dies); relu(h) -> a. Keep h and the layer input.
        x = alloc(act)
        inputs, pre = [], []
        for _ in range(depth):
            z = alloc(act)
            h = alloc(act)
            free(z)
            a = alloc(act)
            inputs.append(x)
            pre.append(h)
            x = a
        # Loss and its gradient (fused softmax cross-entropy); the last activation dies.
        loss = alloc(itemsize)
        grad = alloc(act)
        free(x)
        # Backward, last layer first: dh, then dW, db and (but for the first layer) dx.
        for layer in reversed(range(depth)):
            dh = alloc(act)
            free(grad, pre[layer])
            dw = alloc(weight)
            db = alloc(bias)
            grad = alloc(act) if layer else -1
            free(dh, inputs[layer])
            free(dw, db)  # after the SGD update of this layer's parameters
        free(loss)
    return events


def peak_live_bytes(events: list[Event]) -> int:
    """The most bytes live at once over the trace (the requested-bytes peak)."""
    live: dict[int, int] = {}
    current = peak = 0
    for kind, tensor, nbytes in events:
        if kind == "alloc":
            live[tensor] = nbytes
            current += nbytes
            peak = max(peak, current)
        else:
            current -= live.pop(tensor)
    return peak
