"""Train an MLP on scikit-learn's handwritten digits with blockrt's autograd and graph runtime,
then show where the memory went.

The data set ships inside scikit-learn (1797 grey 8x8 images of the digits 0-9), so nothing is
downloaded. Pixels are standardised with the training split's mean and spread. The model is
Dense(64, 256) -> ReLU -> Dense(256, 256) -> ReLU -> Dense(256, 10), trained with Adam (lr 1e-3)
on whole mini-batches of 64 of a stratified 75/25 split, on the default device and its default
(caching) allocator. The training step (forward, loss, backward, update) is captured once by
`runtime.graph` and replayed from a static memory plan: one arena for every intermediate.

It prints the test accuracy, which must reach 97% (seeds 0-3 reach 97.3-98.4%), the graph's
memory report, the memory summary of every allocator the run used, and writes a plot of the bytes
live per scheduled step under each plan ("none", "recycle", "static") to --plot.

Run: python examples/train_mlp.py [--epochs N] [--seed S] [--plan P] [--plot PNG] [--no-progress]
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import runtime
from blockrt.cli import MAX_SEED, int_in, png_path, run_piped
from runtime import nn
from runtime.graph import PLANS

TARGET_ACCURACY = 0.97


def load(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train and test splits, standardised float32 pixels and int64 labels."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target.astype(np.int64), test_size=0.25, random_state=seed,
        stratify=digits.target)
    mean, spread = x_train.mean(axis=0), x_train.std(axis=0) + 1e-2  # NOTE: some pixels are 0
    x_train = ((x_train - mean) / spread).astype(np.float32)
    x_test = ((x_test - mean) / spread).astype(np.float32)
    return x_train, x_test, y_train, y_test


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Dense(64, 256), nn.ReLU(), nn.Dense(256, 256), nn.ReLU(),
                         nn.Dense(256, 10))


def timelines(x: np.ndarray, y: np.ndarray) -> dict[str, list[int]]:
    """Bytes live per step of the same training step under each plan (throwaway models)."""
    lines = {}
    for plan in PLANS:
        model = make_model()
        step = runtime.graph(nn.train_step(model, nn.Adam(model.parameters(), lr=1e-3)), plan=plan)
        step(x, y)
        lines[plan] = step.timeline()
    return lines


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with runtime.no_grad():
        logits = model(runtime.tensor(x)).numpy()
    return float(np.mean(logits.argmax(axis=1) == y))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int_in(1), default=30)
    parser.add_argument("--batch", type=int_in(1), default=64,
                        help="at most the number of training images")
    parser.add_argument("--seed", type=int_in(0, MAX_SEED), default=0)
    parser.add_argument("--plan", default="static", choices=PLANS)
    parser.add_argument("--plot", type=png_path, default="memory_timeline.png",
                        help="where to write the plot")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args()

    x_train, x_test, y_train, y_test = load(args.seed)
    if args.batch > len(x_train):  # NOTE: whole batches only; none would leave nothing to train
        parser.error(f"argument --batch: {args.batch} is out of range; allowed: "
                     f"1..{len(x_train)} (the training images)")
    nn.manual_seed(args.seed)
    model = make_model()
    opt = nn.Adam(model.parameters(), lr=1e-3)
    step = runtime.graph(nn.train_step(model, opt), plan=args.plan)
    print(model)
    print(f"{len(x_train)} training and {len(x_test)} test images; {opt}")

    rng = np.random.default_rng(args.seed)
    batches = len(x_train) // args.batch  # NOTE: whole batches only: one shape, one capture
    bar = tqdm(total=args.epochs * batches, unit="step", disable=args.no_progress)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        total = 0.0
        for start in range(0, batches * args.batch, args.batch):
            pick = order[start:start + args.batch]
            total += step(x_train[pick], y_train[pick]).item()
            bar.update()
        bar.set_postfix(epoch=epoch + 1, loss=f"{total / batches:.4f}")
    bar.close()

    test_accuracy = accuracy(model, x_test, y_test)
    print(f"train accuracy {accuracy(model, x_train, y_train):.4f}, "
          f"test accuracy {test_accuracy:.4f} (target {TARGET_ACCURACY})")
    print()
    print(f"graph memory report (plan {args.plan}, batch {args.batch}):")
    print(runtime.format_report(step.memory_report()))
    print()
    print(runtime.memory_summary())
    plot = runtime.plot_memory_timeline(timelines(x_train[:args.batch], y_train[:args.batch]),
                                        args.plot, "train_mlp: MiB held by intermediates")
    print(f"memory timeline written to {plot}")
    if test_accuracy < TARGET_ACCURACY:
        print(f"test accuracy {test_accuracy:.4f} is below {TARGET_ACCURACY}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_piped(main))
