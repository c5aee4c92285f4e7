"""The served model and its requests: a small ResNet-style CNN in plain torch, with weights
drawn from a seed (no download, no torchvision), and synthetic image batches drawn from the
same seed and a request id. Every process that knows the seed builds the same model and can
rebuild any request, so the router can check an answer by running the model itself."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional

BATCH = 8  # images per request
IMAGE = (3, 32, 32)  # channels, height, width
CLASSES = 10
STAGES = (16, 32, 64)  # channels of each residual stage; each stage after the first halves the size
# Replicas and the router may compute on different devices or thread counts: sums come out in
# another order, so answers are compared with a tolerance far below any real mistake.
TOLERANCE = 1e-3


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the input (through a 1x1 convolution
    where the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.norm1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.norm2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(channels_out))

    def forward(self, x: Tensor) -> Tensor:
        y = functional.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return functional.relu(y + self.shortcut(x))


class TinyResNet(nn.Module):
    """A stem, one residual block per stage, global average pooling and a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(IMAGE[0], STAGES[0], 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(STAGES[0]), nn.ReLU())
        blocks = []
        channels = STAGES[0]
        for index, width in enumerate(STAGES):
            blocks.append(ResidualBlock(channels, width, stride=1 if index == 0 else 2))
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Linear(channels, CLASSES)

    def forward(self, images: Tensor) -> Tensor:
        features = self.blocks(self.stem(images))
        return self.classifier(features.mean(dim=(2, 3)))


def _seeded(seed: int, stream: int) -> torch.Generator:
    """A generator of its own per (seed, stream), so weights and each request draw independent
    numbers whatever else uses torch's global generator."""
    return torch.Generator().manual_seed(seed * 1_000_003 + stream)


def build_model(seed: int, device: torch.device | None = None) -> TinyResNet:
    """The model with every weight and batch-norm statistic drawn from `seed` (He-scaled
    convolutions, so activations keep their size through the blocks), in eval mode."""
    model = TinyResNet()
    generator = _seeded(seed, -1)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                fan_in = module.weight[0].numel()
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * math.sqrt(2.0 / fan_in))
                if module.bias is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.1)
            elif isinstance(module, nn.BatchNorm2d):
                size = module.num_features
                module.weight.copy_(1.0 + 0.1 * torch.randn(size, generator=generator))
                module.bias.copy_(0.1 * torch.randn(size, generator=generator))
                module.running_mean.copy_(0.1 * torch.randn(size, generator=generator))
                module.running_var.copy_(1.0 + 0.1 * torch.rand(size, generator=generator))
    return model.eval().to(device or torch.device("cpu"))


def request_batch(seed: int, request: int) -> Tensor:
    """The images of request `request`: BATCH standard-normal images (as after the usual
    per-channel normalization), the same in every process."""
    return torch.randn((BATCH, *IMAGE), generator=_seeded(seed, request))


def infer(model: TinyResNet, images: Tensor) -> Tensor:
    """The logits of each image, shape (BATCH, CLASSES)."""
    with torch.inference_mode():
        return model(images)


def difference(answer: Tensor, expected: Tensor) -> float:
    """The largest absolute difference between two answers (inf when their shapes differ)."""
    if answer.shape != expected.shape:
        return math.inf
    return float((answer.float().cpu() - expected.float().cpu()).abs().max())
