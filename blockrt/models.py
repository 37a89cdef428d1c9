"""The example MLP configurations, one definition for the command line (`blockrt plan`) and the
benchmarks (benchmarks/bench_graph.py, benchmarks/bench_train.py through mlp_reference.py)."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CLASSES", "CONFIGS", "MLPConfig"]

#: Output classes of every example MLP (its last layer's width).
CLASSES = 10


class MLPConfig(NamedTuple):
    """A benchmark MLP: batch rows, layer width, number of hidden layers."""

    batch: int
    width: int
    depth: int

    def step_flop(self) -> float:
        """Floating-point operations of the matmuls of one training step (forward and backward).

        Forward 2*b*i*o per layer; backward the same for the weight gradient and again for the
        input gradient, except at the first layer (no gradient for the data).
        """
        b, w = self.batch, self.width
        layers = [(w, w)] * self.depth + [(w, CLASSES)]
        forward = sum(2 * b * i * o for i, o in layers)
        return 3 * forward - 2 * b * w * w


#: S(mall), M(edium), L(arge) and D(eep).
CONFIGS: dict[str, MLPConfig] = {
    "S": MLPConfig(batch=64, width=256, depth=8),
    "M": MLPConfig(batch=256, width=1024, depth=4),
    "L": MLPConfig(batch=1024, width=4096, depth=4),
    "D": MLPConfig(batch=64, width=256, depth=64),
}
