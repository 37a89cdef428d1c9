"""The networks of the seeds' tables, in blockrt and in PyTorch, with the same weights.

- ResNet-50 (He et al.; the layout torchvision calls v1.5: the stride of a downsampling block on
  its 3x3 convolution): a 7x7/2 stem, 3x3/2 max pooling, bottleneck stages of 3, 4, 6 and 3
  blocks (widths 64, 128, 256, 512, four times that out), global average pooling and a Dense
  classifier over 1000 classes; batch norm after every convolution, no conv bias.
- A BERT-base-shaped encoder: `layers` post-LayerNorm transformer layers of width 768, 12 heads
  and a GELU MLP of 3072 (attention, residual, LayerNorm; MLP, residual, LayerNorm), over input
  activations of (batch, sequence, 768) (no embedding table), and a two-class head on the first
  position, as BERT's sequence classification.

`blockrt_resnet50()` / `torch_resnet50()` and `blockrt_encoder()` / `torch_encoder()` build the
same modules under the same names, so `copy_weights(blockrt_model, torch_model)` makes the
PyTorch one start from blockrt's weights (their state_dicts, key for key). A training step is
forward, softmax cross-entropy (mean), backward and plain SGD (lr 0.01, momentum 0.9).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from runtime import nn, ops

#: ResNet-50's stages: (blocks, width, stride of the first block)
STAGES = ((3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2))
#: BERT-base's width, heads and MLP width
WIDTH, HEADS, MLP = 768, 12, 3072


# ---------------------------------------------------------------------- blockrt
class Bottleneck(nn.Module):
    def __init__(self, channels_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = 4 * width
        self.conv1 = nn.Conv2d(channels_in, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.project = stride != 1 or channels_in != out
        if self.project:
            self.downsample = nn.Sequential(nn.Conv2d(channels_in, out, 1, stride=stride,
                                                      bias=False), nn.BatchNorm2d(out))

    def forward(self, x: Any) -> Any:
        h = ops.relu(self.bn1(self.conv1(x)))
        h = ops.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return ops.relu(ops.add(h, self.downsample(x) if self.project else x))


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        channels, stages = 64, []
        for blocks, width, stride in STAGES:
            layer = []
            for i in range(blocks):
                layer.append(Bottleneck(channels, width, stride if i == 0 else 1))
                channels = 4 * width
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Dense(channels, classes)

    def forward(self, x: Any) -> Any:
        h = self.maxpool(ops.relu(self.bn1(self.conv1(x))))
        h = self.layer4(self.layer3(self.layer2(self.layer1(h))))
        return self.fc(ops.mean(h, axis=(2, 3)))


class EncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Dense(WIDTH, 3 * WIDTH)
        self.proj = nn.Dense(WIDTH, WIDTH)
        self.ln1 = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Dense(WIDTH, MLP)
        self.gelu = nn.GELU()
        self.fc2 = nn.Dense(MLP, WIDTH)
        self.ln2 = nn.LayerNorm(WIDTH)

    def forward(self, x: Any) -> Any:
        batch, time, width = x.shape
        qkv = self.qkv(x).reshape(batch, time, 3, HEADS, width // HEADS).transpose(2, 0, 3, 1, 4)
        y = ops.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        h = self.ln1(ops.add(x, self.proj(y.transpose(0, 2, 1, 3).reshape(batch, time, width))))
        return self.ln2(ops.add(h, self.fc2(self.gelu(self.fc1(h)))))


class Encoder(nn.Module):
    def __init__(self, layers: int = 12) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(EncoderLayer() for _ in range(layers)))
        self.head = nn.Dense(WIDTH, 2)

    def forward(self, x: Any) -> Any:
        return self.head(self.layers(x)[:, 0])


def blockrt_resnet50() -> ResNet50:
    return ResNet50()


def blockrt_encoder(layers: int = 12) -> Encoder:
    return Encoder(layers)


# ---------------------------------------------------------------------- PyTorch
def torch_resnet50() -> Any:
    """ResNet-50 in PyTorch, its modules named as `ResNet50`'s."""
    import torch
    from torch import nn as tnn

    class TorchBottleneck(tnn.Module):
        def __init__(self, channels_in: int, width: int, stride: int) -> None:
            super().__init__()
            out = 4 * width
            self.conv1 = tnn.Conv2d(channels_in, width, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(width)
            self.conv2 = tnn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
            self.bn2 = tnn.BatchNorm2d(width)
            self.conv3 = tnn.Conv2d(width, out, 1, bias=False)
            self.bn3 = tnn.BatchNorm2d(out)
            self.downsample = (tnn.Sequential(tnn.Conv2d(channels_in, out, 1, stride=stride,
                                                         bias=False), tnn.BatchNorm2d(out))
                               if stride != 1 or channels_in != out else None)

        def forward(self, x: Any) -> Any:
            h = torch.relu(self.bn1(self.conv1(x)))
            h = torch.relu(self.bn2(self.conv2(h)))
            h = self.bn3(self.conv3(h))
            return torch.relu(h + (x if self.downsample is None else self.downsample(x)))

    class TorchResNet50(tnn.Module):
        def __init__(self, classes: int = 1000) -> None:
            super().__init__()
            self.conv1 = tnn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
            self.bn1 = tnn.BatchNorm2d(64)
            self.maxpool = tnn.MaxPool2d(3, stride=2, padding=1)
            channels = 64
            for number, (blocks, width, stride) in enumerate(STAGES, 1):
                layer = []
                for i in range(blocks):
                    layer.append(TorchBottleneck(channels, width, stride if i == 0 else 1))
                    channels = 4 * width
                setattr(self, f"layer{number}", tnn.Sequential(*layer))
            self.fc = tnn.Linear(channels, classes)

        def forward(self, x: Any) -> Any:
            h = self.maxpool(torch.relu(self.bn1(self.conv1(x))))
            h = self.layer4(self.layer3(self.layer2(self.layer1(h))))
            return self.fc(h.mean(dim=(2, 3)))

    return TorchResNet50()


def torch_encoder(layers: int = 12) -> Any:
    """The encoder in PyTorch, its modules named as `Encoder`'s."""
    from torch import nn as tnn
    from torch.nn import functional

    class TorchEncoderLayer(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.proj = tnn.Linear(WIDTH, 3 * WIDTH), tnn.Linear(WIDTH, WIDTH)
            self.ln1, self.ln2 = tnn.LayerNorm(WIDTH), tnn.LayerNorm(WIDTH)
            self.fc1, self.gelu, self.fc2 = tnn.Linear(WIDTH, MLP), tnn.GELU(), tnn.Linear(MLP,
                                                                                         WIDTH)

        def forward(self, x: Any) -> Any:
            batch, time, width = x.shape
            q, k, v = self.qkv(x).reshape(batch, time, 3, HEADS, width // HEADS).permute(
                2, 0, 3, 1, 4)
            y = functional.scaled_dot_product_attention(q, k, v)
            h = self.ln1(x + self.proj(y.transpose(1, 2).reshape(batch, time, width)))
            return self.ln2(h + self.fc2(self.gelu(self.fc1(h))))

    class TorchEncoder(tnn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = tnn.Sequential(*(TorchEncoderLayer() for _ in range(layers)))
            self.head = tnn.Linear(WIDTH, 2)

        def forward(self, x: Any) -> Any:
            return self.head(self.layers(x)[:, 0])

    return TorchEncoder()


def copy_weights(model: nn.Module, twin: Any) -> None:
    """Load blockrt `model`'s state (parameters and buffers) into the PyTorch `twin`."""
    import torch
    twin.load_state_dict({name: torch.from_numpy(np.array(t.numpy()))
                          for name, t in model.state_dict().items()})
