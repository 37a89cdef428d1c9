"""Train a character-level GPT on the source of Python's own standard library with blockrt,
optionally beside the same model in PyTorch, and print a sample.

The text ships with Python: the top-level modules of the standard library (`*.py` beside
`os.py`, in name order), the first `--chars` characters of them, so nothing is downloaded; the
vocabulary is the set of characters in that text. The model is a GPT in small: token and
position embeddings, `--layers` transformer blocks (LayerNorm, causal multi-head
self-attention, residual; LayerNorm, a GELU MLP four times as wide, residual), a final
LayerNorm and a Dense head over the vocabulary; width 128, 4 heads, context 64 by default.
Adam at a fixed learning rate; batches of random windows drawn by a seeded generator. The
training step is captured by `blockrt.graph` and replayed from a static memory plan.

`--compare-torch` builds the same model in PyTorch with blockrt's initial weights (through
`state_dict`), trains it on the same batches with `torch.optim.Adam`, and prints both losses at
every logged step with their relative difference; the run fails if any differs by more than
1%. At the end it prints a sample: `--sample` characters drawn from the model after a prompt.

Run: python examples/train_gpt.py [--steps N] [--batch B] [--context T] [--width W] [--heads H]
                                  [--layers L] [--chars C] [--seed S] [--log-every K]
                                  [--compare-torch] [--sample N] [--no-progress]
"""

from __future__ import annotations

import math
import os
import pathlib
import sys
from typing import Any

import numpy as np
from tqdm import tqdm

import blockrt
from blockrt import nn, ops
from blockrt.cli import Parser, int_in, run_piped

#: Adam's learning rate (fixed).
LR = 1e-3
#: The largest relative difference between blockrt's and PyTorch's loss at a logged step.
TOLERANCE = 0.01


def load_text(chars: int) -> str:
    """The first `chars` characters of the standard library's top-level modules, in name order."""
    library = pathlib.Path(os.__file__).resolve().parent
    text, total = [], 0
    for path in sorted(library.glob("*.py")):
        body = path.read_text(encoding="utf-8", errors="replace")
        text.append(body)
        total += len(body)
        if total >= chars:
            break
    return "".join(text)[:chars]


class SelfAttention(nn.Module):
    """Causal multi-head self-attention: one Dense for queries, keys and values, heads by
    reshape and transpose, scaled dot-product attention, a Dense projection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Dense(width, 3 * width)
        self.proj = nn.Dense(width, width)

    def forward(self, x):
        batch, time, width = x.shape
        qkv = self.qkv(x).reshape(batch, time, 3, self.heads, width // self.heads)
        qkv = qkv.transpose(2, 0, 3, 1, 4)                     # (3, batch, heads, time, dim)
        y = ops.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        return self.proj(y.transpose(0, 2, 1, 3).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Dense(width, 4 * width)
        self.gelu = nn.GELU()
        self.out = nn.Dense(4 * width, width)

    def forward(self, x):
        x = ops.add(x, self.attn(self.ln1(x)))
        return ops.add(x, self.out(self.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, vocabulary: int, context: int, width: int, heads: int,
                 layers: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocabulary, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Dense(width, vocabulary)

    def forward(self, tokens):
        time = tokens.shape[-1]
        x = ops.add(self.tok(tokens), self.pos.weight[:time])   # positions 0..time-1
        return self.head(self.ln_f(self.blocks(x)))


def loss_of(logits, targets):
    """Mean cross-entropy over every position."""
    return nn.softmax_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def batches(data: np.ndarray, batch: int, context: int, seed: int):
    """Endless (inputs, targets) of `batch` random windows of `context` characters."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - context - 1, batch)
        windows = np.stack([data[s:s + context + 1] for s in starts])
        yield windows[:, :-1], windows[:, 1:]


def torch_twin(model: GPT, args: Any, vocabulary: int) -> Any:
    """The same model in PyTorch, with `model`'s weights (its state_dict, name for name)."""
    import torch
    from torch import nn as tnn
    from torch.nn import functional

    class TorchAttention(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = tnn.Linear(args.width, 3 * args.width)
            self.proj = tnn.Linear(args.width, args.width)

        def forward(self, x):
            batch, time, width = x.shape
            qkv = self.qkv(x).reshape(batch, time, 3, args.heads, width // args.heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4)
            y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(batch, time, width))

    class TorchBlock(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.attn = tnn.LayerNorm(args.width), TorchAttention()
            self.ln2, self.gelu = tnn.LayerNorm(args.width), tnn.GELU()
            self.fc = tnn.Linear(args.width, 4 * args.width)
            self.out = tnn.Linear(4 * args.width, args.width)

        def forward(self, x):
            x = x + self.attn(self.ln1(x))
            return x + self.out(self.gelu(self.fc(self.ln2(x))))

    class TorchGPT(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = tnn.Embedding(vocabulary, args.width)
            self.pos = tnn.Embedding(args.context, args.width)
            self.blocks = tnn.Sequential(*(TorchBlock() for _ in range(args.layers)))
            self.ln_f, self.head = tnn.LayerNorm(args.width), tnn.Linear(args.width, vocabulary)

        def forward(self, tokens):
            x = self.tok(tokens) + self.pos.weight[:tokens.shape[-1]]
            return self.head(self.ln_f(self.blocks(x)))

    twin = TorchGPT()
    twin.load_state_dict({name: torch.from_numpy(t.numpy().copy())
                          for name, t in model.state_dict().items()})
    return twin


def sample(model: GPT, prompt: np.ndarray, count: int, context: int, seed: int) -> np.ndarray:
    """`count` tokens drawn one at a time from the model's distribution after `prompt`."""
    rng = np.random.default_rng(seed)
    tokens = list(prompt)
    model.eval()
    with blockrt.no_grad():
        for _ in range(count):
            window = np.array(tokens[-context:], np.int64)[None, :]
            logits = model(blockrt.tensor(window)).numpy()[0, -1].astype(np.float64)
            p = np.exp(logits - logits.max())
            tokens.append(int(rng.choice(len(p), p=p / p.sum())))
    model.train()
    return np.array(tokens[len(prompt):])


def main() -> int:
    parser = Parser(description="Train a character-level GPT on Python's standard library "
                                "source with blockrt.")
    parser.add_argument("--steps", type=int_in(1), default=200, help="default: 200")
    parser.add_argument("--batch", type=int_in(1), default=32, help="default: 32")
    parser.add_argument("--context", type=int_in(2), default=64, help="default: 64")
    parser.add_argument("--width", type=int_in(1), default=128, help="default: 128")
    parser.add_argument("--heads", type=int_in(1), default=4, help="default: 4")
    parser.add_argument("--layers", type=int_in(1), default=2, help="default: 2")
    parser.add_argument("--chars", type=int_in(1000), default=1_000_000,
                        help="characters of text (default: 1000000)")
    parser.add_argument("--seed", type=int_in(0), default=0, help="default: 0")
    parser.add_argument("--log-every", type=int_in(1), default=20, help="default: 20")
    parser.add_argument("--compare-torch", action="store_true",
                        help="train the same model in PyTorch beside it and compare losses")
    parser.add_argument("--sample", type=int_in(0), default=200,
                        help="characters to sample at the end (default: 200)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()
    if args.width % args.heads:
        parser.error(f"argument --heads: {args.heads} does not divide the width {args.width}")

    text = load_text(args.chars)
    vocabulary = sorted(set(text))
    index = {c: i for i, c in enumerate(vocabulary)}
    data = np.array([index[c] for c in text], np.int64)
    if len(data) <= args.context + 1:
        parser.error(f"argument --chars: {len(data)} characters of text do not fill one window "
                     f"of --context {args.context}")
    nn.manual_seed(args.seed)
    model = GPT(len(vocabulary), args.context, args.width, args.heads, args.layers)
    opt = nn.Adam(model.parameters(), lr=LR)
    step = blockrt.graph(nn.train_step(model, opt, loss=loss_of), plan="static")
    print(f"GPT: {args.layers} layers, width {args.width}, {args.heads} heads, context "
          f"{args.context}; {sum(p.size for p in model.parameters())} parameters; "
          f"{len(data)} characters, {len(vocabulary)} distinct")

    twin = torch_opt = None
    if args.compare_torch:
        import torch
        torch.set_num_threads(os.cpu_count() or 1)
        twin = torch_twin(model, args, len(vocabulary))
        torch_opt = torch.optim.Adam(twin.parameters(), lr=LR)

    worst = 0.0
    stream = batches(data, args.batch, args.context, args.seed)
    bar = tqdm(total=args.steps, unit="step", disable=args.no_progress)
    for number in range(1, args.steps + 1):
        x, y = next(stream)
        loss = step(x, y).item()
        line = f"step {number}: loss {loss:.4f}"
        if twin is not None:
            import torch
            logits = twin(torch.from_numpy(x))
            theirs = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.from_numpy(y).reshape(-1))
            torch_opt.zero_grad()
            theirs.backward()
            torch_opt.step()
            difference = abs(loss - theirs.item()) / theirs.item()
            line += f", PyTorch {theirs.item():.4f} (relative difference {difference:.2e})"
        bar.update()
        if number % args.log_every == 0 or number == 1:
            if twin is not None:
                worst = max(worst, difference)
            tqdm.write(line)
    bar.close()
    if not math.isfinite(loss):
        print(f"the loss is {loss}", file=sys.stderr)
        return 1

    prompt = data[:args.context]
    drawn = sample(model, prompt, args.sample, args.context, args.seed)
    print(f"sample ({len(drawn)} characters after a prompt of {len(prompt)}):")
    print("".join(vocabulary[i] for i in prompt) + "".join(vocabulary[i] for i in drawn))
    print()
    print(blockrt.format_report(step.memory_report()))
    if twin is not None:
        print(f"largest relative difference from PyTorch at a logged step: {worst:.2e} "
              f"(tolerance {TOLERANCE})")
        if worst > TOLERANCE:
            print(f"the losses differ by {worst:.2e} > {TOLERANCE}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_piped(main))
