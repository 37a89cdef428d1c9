"""Train a small residual network on scikit-learn's handwritten digits with blockrt's conv
layers, batch norm and graph runtime.

The data and its split are examples/train_mlp.py's: 1797 grey 8x8 images, 75% for training and
the same 450 for the test, pixels standardised with the training split's statistics, here kept
as 1x8x8 images (NCHW). The network is a ResNet in small: a 3x3 stem of `--width` channels, two
residual blocks at 8x8, one that halves the resolution and doubles the channels (its shortcut a
strided 1x1 convolution), two more at 4x4, each block conv-BN-ReLU-conv-BN plus the shortcut,
then ReLU; global average pooling and a Dense classifier. Adam, learning rate falling linearly
as in the MLP demo, whole mini-batches. The training step is captured by `blockrt.graph` and
replayed from a static memory plan; batch norm updates its running statistics inside the
replayed step, and the test runs in eval mode (running statistics, no batch statistics).

It prints the test accuracy, which must reach 98.5% (the MLP demo reaches about 97.8%), the
graph's memory report and the memory summary.

Run: python examples/train_resnet.py [--epochs N] [--batch B] [--width W] [--seed S]
                                     [--plan P] [--no-progress]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np
from tqdm import tqdm

import blockrt
from blockrt import nn, ops
from blockrt.cli import Parser, int_in, run_piped

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_mlp import load as load_flat  # NOTE: the MLP demo's data and split

TARGET_ACCURACY = 0.985
#: Adam's learning rate in the first epoch; it falls linearly to LR / epochs in the last.
LR = 3e-3


def load() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """examples/train_mlp.py's splits, the images as (n, 1, 8, 8)."""
    x_train, x_test, y_train, y_test = load_flat()
    return x_train.reshape(-1, 1, 8, 8), x_test.reshape(-1, 1, 8, 8), y_train, y_test


class Block(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the shortcut (a strided 1x1 conv and BN where the shape
    changes), then ReLU."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1,
                               bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.project = channels_in != channels_out or stride != 1
        if self.project:
            self.shortcut = nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False)
            self.shortcut_bn = nn.BatchNorm2d(channels_out)

    def forward(self, x):
        h = ops.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        skip = self.shortcut_bn(self.shortcut(x)) if self.project else x
        return ops.relu(ops.add(h, skip))


class ResNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        self.blocks = nn.Sequential(Block(width, width), Block(width, width),
                                    Block(width, 2 * width, stride=2),
                                    Block(2 * width, 2 * width))
        self.head = nn.Dense(2 * width, 10)

    def forward(self, x):
        h = self.blocks(ops.relu(self.stem_bn(self.stem(x))))
        return self.head(ops.mean(h, axis=(2, 3)))  # NOTE: global average pooling


def learning_rate(epoch: int, epochs: int) -> float:
    return LR * (epochs - epoch) / epochs


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy in eval mode (batch norm's running statistics), in batches of 256."""
    model.eval()
    hits = 0
    with blockrt.no_grad():
        for start in range(0, len(x), 256):
            logits = model(blockrt.tensor(x[start:start + 256])).numpy()
            hits += int(np.sum(logits.argmax(axis=1) == y[start:start + 256]))
    model.train()
    return hits / len(x)


def main() -> int:
    parser = Parser(description="Train a small ResNet on scikit-learn's digits with blockrt.")
    parser.add_argument("--epochs", type=int_in(1), default=12, help="default: 12")
    parser.add_argument("--batch", type=int_in(1), default=32, help="default: 32")
    parser.add_argument("--width", type=int_in(1), default=16,
                        help="channels of the first stage (default: 16)")
    parser.add_argument("--seed", type=int_in(0), default=0, help="default: 0")
    parser.add_argument("--plan", default="static", choices=blockrt.PLANS)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args: argparse.Namespace = parser.parse_args()

    x_train, x_test, y_train, y_test = load()
    if args.batch > len(x_train):
        parser.error(f"argument --batch: {args.batch} is out of range; allowed: "
                     f"1..{len(x_train)} (the training images)")
    nn.manual_seed(args.seed)
    model = ResNet(args.width)
    opt = nn.Adam(model.parameters(), lr=LR)
    step = blockrt.graph(nn.train_step(model, opt), plan=args.plan)
    print(f"ResNet, width {args.width}: {sum(p.size for p in model.parameters())} parameters; "
          f"{len(x_train)} training and {len(x_test)} test images; {opt}")

    rng = np.random.default_rng(args.seed)
    batches = len(x_train) // args.batch
    bar = tqdm(total=args.epochs * batches, unit="step", disable=args.no_progress)
    for epoch in range(args.epochs):
        opt.lr = learning_rate(epoch, args.epochs)
        step.recapture()
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
    print(blockrt.format_report(step.memory_report()))
    print()
    print(blockrt.memory_summary())
    if test_accuracy < TARGET_ACCURACY:
        print(f"test accuracy {test_accuracy:.4f} is below {TARGET_ACCURACY}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_piped(main))
