"""Op dispatch overhead: blockrt ops against the NumPy calls they run, side by side.

Each pair is timed in many short interleaved rounds (blockrt, NumPy, blockrt, ...) and the best
round of each is kept, so both see the same machine load. BLAS runs on one thread, so that matmul's
thread scheduling does not drown the dispatch figures, and blockrt's products run on NumPy's own
OpenBLAS (BLOCKRT_BLAS=openblas), so that matmul compares dispatch, not two libraries. Prints a
Markdown table for BENCHMARKS.md.

Run: python benchmarks/bench_dispatch.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads its BLAS
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("BLOCKRT_BLAS", "openblas")

import numpy as np

import runtime
from runtime import ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import interleaved_best


def cases(n: int, m: int):
    rng = np.random.default_rng(0)
    na = rng.random((n, m), dtype=np.float32)
    nb = rng.random(m, dtype=np.float32)
    nw = rng.random((m, m), dtype=np.float32)
    no = np.empty((n, m), np.float32)
    a, b, w = runtime.tensor(na), runtime.tensor(nb), runtime.tensor(nw)
    o = runtime.tensor(no)
    buf = runtime.tensor(np.zeros(2 * n * m, np.float32))
    x_view, y_view = runtime.view(buf, (n, m)), runtime.view(buf, (n, m), offset=n * m)
    nbuf = np.zeros(2 * n * m, np.float32)
    nx, ny = nbuf[:n * m].reshape(n, m), nbuf[n * m:].reshape(n, m)
    x_view[...] = na
    nx[...] = na
    return [
        ("add, out=, broadcast bias", lambda: ops.add(a, b, out=o),
         lambda: np.add(na, nb, out=no)),
        ("relu in place", lambda: ops.relu(o, out=o), lambda: np.maximum(no, 0, out=no)),
        ("tanh, new output", lambda: ops.tanh(a), lambda: np.tanh(na)),
        ("matmul, new output", lambda: ops.matmul(a, w), lambda: np.matmul(na, nw)),
        ("sum over axis 0", lambda: ops.sum(a, axis=0), lambda: np.sum(na, axis=0)),
        ("mul, views of one buffer", lambda: ops.mul(x_view, 2.0, out=y_view),
         lambda: np.multiply(nx, 2.0, out=ny)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for smoke runs)")
    args = parser.parse_args()
    rounds = 3 if args.quick else 25
    print("| shape | op | blockrt (us) | NumPy (us) | overhead (us) | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for n, m in ((64, 256), (1024, 1024)):
        number = 400 if n * m < 10**5 else 10
        if args.quick:
            number //= 10
        for name, ours, theirs in cases(n, m):
            best = interleaved_best({"blockrt": ours, "numpy": theirs}, number, rounds)
            t_ours, t_np = best["blockrt"], best["numpy"]
            print(f"| {n}x{m} | {name} | {t_ours:.1f} | {t_np:.1f} | {t_ours - t_np:.1f} | "
                  f"{t_ours / t_np:.2f} |")


if __name__ == "__main__":
    main()
