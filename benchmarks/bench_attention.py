"""One transformer block's forward and backward: blockrt eager and static graph against PyTorch
CPU eager, 2 threads, side by side (issue 30).

The block is GPT's (a BERT layer has the same work without the mask): LayerNorm, a qkv Dense,
heads by reshape and transpose, scaled dot-product attention, a projection and a residual;
LayerNorm, an MLP of width 4x with GELU and a residual; float32. One call = forward, backward
from a fixed output gradient into every parameter's gradient, and the gradients dropped
(`zero_grad`, set to None in both). Both libraries start from the same weights.

Configurations: `bert` = batch 4, sequence 128, width 768, 12 heads, no mask (a BERT-base
layer); `char` = batch 32, context 64, width 128, 4 heads, causal (the char-GPT of the
examples); `--quick` shrinks both for a smoke run.

Timing (benchmarks/timing.py): OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS are 2
before NumPy loads, and `torch.set_num_threads(2)`. Each contender is warmed up (a graph captures
then), and then the rounds interleave: in each round every contender in turn (order rotated)
times `number` calls. The table gives each contender's best round (ms per call) and, for each
pair, the median over rounds of the ratio of their times in that round: the machine is shared
and switches speed for seconds at a time, so the ratio within a round is the figure to read.

Run: python benchmarks/bench_attention.py [--quick] [--configs bert,char] [--rounds N]
     [--check]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, NamedTuple

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import cpu_name, versions

import runtime
from runtime import nn, ops

THREADS = 2


class Config(NamedTuple):
    batch: int
    seq: int
    width: int
    heads: int
    causal: bool


CONFIGS = {"bert": Config(4, 128, 768, 12, False), "char": Config(32, 64, 128, 4, True)}
QUICK = {"bert": Config(2, 32, 192, 3, False), "char": Config(8, 32, 64, 4, True)}


class Block(nn.Module):
    """The block in blockrt (the layers of tests/test_attention.py's, float32)."""

    def __init__(self, config: Config, rng: np.random.Generator) -> None:
        super().__init__()
        width = config.width
        self.config = config
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Dense(width, 3 * width, rng=rng)
        self.proj = nn.Dense(width, width, rng=rng)
        self.fc = nn.Dense(width, 4 * width, rng=rng)
        self.gelu = nn.GELU()
        self.out = nn.Dense(4 * width, width, rng=rng)

    def forward(self, x: Any) -> Any:
        batch, seq, width = x.shape
        heads = self.config.heads
        qkv = self.qkv(self.ln1(x)).reshape(batch, seq, 3, heads, width // heads)
        qkv = qkv.transpose(2, 0, 3, 1, 4)
        y = ops.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2],
                                             is_causal=self.config.causal)
        y = y.transpose(0, 2, 1, 3).reshape(batch, seq, width)
        x = ops.add(x, self.proj(y))
        return ops.add(x, self.out(self.gelu(self.fc(self.ln2(x)))))


def torch_block(block: Block, torch: Any) -> Any:
    """The same block in PyTorch, with block's weights."""
    F = torch.nn.functional
    config = block.config
    params = {name: torch.from_numpy(p.numpy()).requires_grad_()
              for name, p in block.named_parameters()}

    class TorchBlock(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v)
                                             for k, v in params.items()})

        def dense(self, h: Any, name: str) -> Any:
            return F.linear(h, self.p[f"{name}_weight"], self.p[f"{name}_bias"])

        def norm(self, h: Any, name: str) -> Any:
            return F.layer_norm(h, (config.width,), self.p[f"{name}_weight"],
                                self.p[f"{name}_bias"])

        def forward(self, x: Any) -> Any:
            batch, seq, width = x.shape
            qkv = self.dense(self.norm(x, "ln1"), "qkv").reshape(
                batch, seq, 3, config.heads, width // config.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=config.causal)
            x = x + self.dense(y.permute(0, 2, 1, 3).reshape(batch, seq, width), "proj")
            return x + self.dense(F.gelu(self.dense(self.norm(x, "ln2"), "fc")), "out")

    return TorchBlock()


def contenders(config: Config, check: bool) -> dict[str, Any]:
    """name -> a call running one forward and backward."""
    import torch

    torch.set_num_threads(THREADS)
    rng = np.random.default_rng(0)
    block = Block(config, rng)
    shape = (config.batch, config.seq, config.width)
    x_host = rng.normal(size=shape).astype(np.float32)
    g_host = rng.normal(size=shape).astype(np.float32)
    x, g = runtime.tensor(x_host), runtime.tensor(g_host)

    def blockrt_step(x: Any, g: Any) -> Any:
        y = block(x)
        y.backward(g)
        block.zero_grad()
        return y

    static = runtime.graph(blockrt_step, plan="static")
    theirs = torch_block(block, torch)
    tx, tg = torch.from_numpy(x_host), torch.from_numpy(g_host)

    def torch_step() -> Any:
        y = theirs(tx)
        y.backward(tg)
        theirs.zero_grad(set_to_none=True)
        return y

    if check:
        want = torch_step().detach().numpy()
        for name, got in (("eager", blockrt_step(x, g)), ("static", static(x, g)),
                          ("static replay", static(x, g))):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-3, atol=1e-4,
                                       err_msg=f"blockrt {name} against torch")
    return {"blockrt-eager": lambda: blockrt_step(x, g), "blockrt-static": lambda: static(x, g),
            "torch": torch_step}


def measure(calls: dict[str, Any], rounds: int, seconds: float) -> dict[str, list[float]]:
    """Seconds per call of each contender in each round (interleaved, order rotated)."""
    for fn in calls.values():
        for _ in range(2):
            fn()
    number = {}
    for name, fn in calls.items():  # NOTE: enough calls for about `seconds` each round
        start = time.perf_counter()
        fn()
        number[name] = max(1, int(seconds / max(time.perf_counter() - start, 1e-6)))
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            for _ in range(number[name]):
                calls[name]()
            times[name].append((time.perf_counter() - start) / number[name])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--configs", default="bert,char")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--check", action="store_true", help="compare outputs with torch first")
    args = parser.parse_args()
    table = QUICK if args.quick else CONFIGS
    import torch

    print(f"# {cpu_name()}; {versions()}, PyTorch {torch.__version__}; {THREADS} threads; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| config | blockrt eager (ms) | blockrt static (ms) | torch eager (ms) | "
          "eager / torch | static / torch |")
    print("|---|---:|---:|---:|---:|---:|")
    for key in args.configs.split(","):
        config = table[key]
        times = measure(contenders(config, args.check), args.rounds, args.seconds)
        best = {name: min(t) * 1e3 for name, t in times.items()}
        ratio = {name: statistics.median(a / b for a, b in zip(times[name], times["torch"]))
                 for name in ("blockrt-eager", "blockrt-static")}
        label = (f"{key}: batch {config.batch}, seq {config.seq}, width {config.width}, "
                 f"{config.heads} heads{', causal' if config.causal else ''}")
        print(f"| {label} | {best['blockrt-eager']:.2f} | {best['blockrt-static']:.2f} | "
              f"{best['torch']:.2f} | {ratio['blockrt-eager']:.2f} | "
              f"{ratio['blockrt-static']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
