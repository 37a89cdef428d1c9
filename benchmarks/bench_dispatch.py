"""Op dispatch overhead: blockrt ops against PyTorch CPU and the NumPy calls they run, side by side.

Each op is timed in many short interleaved rounds (blockrt, blockrt on its Python path, PyTorch,
NumPy, ...) and the best round of each is kept, so all see the same machine load. "blockrt" is
the default (the C eager fast path where it is built, Note [the eager fast path] in
runtime/fastpath.py); "Python path" is the same call inside `fastpath.python_only()` (which adds
about a microsecond of switching). BLAS runs on
one thread everywhere (PyTorch too: `torch.set_num_threads(1)`), so that matmul's thread
scheduling does not drown the dispatch figures, and blockrt's products run on NumPy's own
OpenBLAS (BLOCKRT_BLAS=openblas), so that matmul compares dispatch, not two libraries. PyTorch is
optional (skipped when not importable). Prints the CPU, the libraries and a Markdown table for
BENCHMARKS.md.

Run: python benchmarks/bench_dispatch.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before NumPy loads its BLAS
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("BLOCKRT_BLAS", "openblas")

import numpy as np

import runtime
from runtime import fastpath, ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cpu_name, interleaved_best


def cases(n: int, m: int, torch: Any) -> list[tuple[str, Callable, Callable, Callable | None]]:
    """(name, blockrt call, NumPy call, PyTorch call or None) for each op on n x m float32."""
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
    if torch is not None:
        ta, tb, tw, to = (torch.from_numpy(v.copy()) for v in (na, nb, nw, no))
        tbuf = torch.from_numpy(nbuf.copy())
        tx, ty = tbuf[:n * m].view(n, m), tbuf[n * m:].view(n, m)
    rows = [
        ("add, out=, broadcast bias", lambda: ops.add(a, b, out=o),
         lambda: np.add(na, nb, out=no), lambda: torch.add(ta, tb, out=to)),
        ("relu in place", lambda: ops.relu(o, out=o), lambda: np.maximum(no, 0, out=no),
         lambda: torch.relu_(to)),
        ("tanh, new output", lambda: ops.tanh(a), lambda: np.tanh(na), lambda: torch.tanh(ta)),
        ("matmul, new output", lambda: ops.matmul(a, w), lambda: np.matmul(na, nw),
         lambda: torch.matmul(ta, tw)),
        ("sum over axis 0", lambda: ops.sum(a, axis=0), lambda: np.sum(na, axis=0),
         lambda: torch.sum(ta, dim=0)),
        ("mul, views of one buffer", lambda: ops.mul(x_view, 2.0, out=y_view),
         lambda: np.multiply(nx, 2.0, out=ny), lambda: torch.mul(tx, 2.0, out=ty)),
    ]
    return [(name, ours, theirs, mine if torch is not None else None)
            for name, ours, theirs, mine in rows]


def python_path(call: Callable[[], Any]) -> Callable[[], Any]:
    """`call` on blockrt's Python path alone."""
    def run() -> Any:
        with fastpath.python_only():
            return call()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for smoke runs)")
    args = parser.parse_args()
    rounds = 3 if args.quick else 25
    try:
        import torch

        torch.set_num_threads(1)
        torch_name = f"PyTorch {torch.__version__}"
    except ImportError as e:
        torch, torch_name = None, f"no PyTorch ({e})"
    from backends import _blas

    blas = _blas.find()
    print(f"Op dispatch on {cpu_name()}: Python {platform.python_version()}, NumPy "
          f"{np.__version__}, {torch_name}; one BLAS thread; blockrt's products on "
          f"{blas.name if blas is not None else 'np.matmul'}; C fast path "
          f"{'on' if fastpath.ACCELERATED else 'not built'}; best of {rounds} interleaved rounds")
    print()
    print("| shape | op | blockrt (us) | Python path (us) | PyTorch (us) | NumPy (us) | "
          "blockrt / PyTorch | blockrt / NumPy |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for n, m in ((64, 256), (1024, 1024)):
        number = 400 if n * m < 10**5 else 10
        if args.quick:
            number //= 10
        for name, ours, theirs, torchs in cases(n, m, torch):
            contenders = {"blockrt": ours, "python": python_path(ours), "numpy": theirs}
            if torchs is not None:
                contenders["torch"] = torchs
            best = interleaved_best(contenders, number, rounds)
            mine, slow, numpy = best["blockrt"], best["python"], best["numpy"]
            versus = best.get("torch")
            torch_cells = (f"{versus:.1f} | " if versus else "- | ",
                           f"{mine / versus:.2f}" if versus else "-")
            print(f"| {n}x{m} | {name} | {mine:.1f} | {slow:.1f} | {torch_cells[0]}{numpy:.1f} | "
                  f"{torch_cells[1]} | {mine / numpy:.2f} |")


if __name__ == "__main__":
    main()
