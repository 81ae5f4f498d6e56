"""ResNet-50 written out by hand (no torchvision).

Same architecture, parameter names and initialisation as ``torchvision.models.resnet50``
(ResNet v1.5: the stride of a down-sampling Bottleneck sits on its 3x3 convolution), so a
torchvision state dict loads into it unchanged. With 1000 classes it has 25,557,032 parameters.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet", "resnet50", "build", "CONFIGS", "RESNET50_NUM_PARAMS"]

RESNET50_NUM_PARAMS = 25_557_032

# --model name -> (Bottlenecks per stage, base width). ``resnet-tiny`` is ResNet-50's code at CI
# size: every kind of block (a projection shortcut opening each stage, stride 2 on the 3x3 conv of
# stages 2-4, an identity shortcut in stage 1) with 20 convolutions instead of 53. XLA's compile
# time grows with the number of convolutions, not with their width or the image size.
CONFIGS: dict[str, tuple[tuple[int, int, int, int], int]] = {
    "resnet50": ((3, 4, 6, 3), 64),
    "resnet-tiny": ((2, 1, 1, 1), 16),
}


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand (x4), plus the shortcut."""

    expansion = 4

    def __init__(
        self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None
    ):
        super().__init__()
        width = planes
        self.conv1 = conv1x1(inplanes, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = conv1x1(width, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(
        self,
        layers: tuple[int, int, int, int] = (3, 4, 6, 3),
        num_classes: int = 1000,
        zero_init_residual: bool = False,
        width: int = 64,
    ):
        super().__init__()
        # ``width`` scales every stage (64 is ResNet-50; the host-cost benchmark uses a narrow one)
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(2 * width, layers[1], stride=2)
        self.layer3 = self._make_layer(4 * width, layers[2], stride=2)
        self.layer4 = self._make_layer(8 * width, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(8 * width * Bottleneck.expansion, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, Bottleneck):
                    nn.init.zeros_(m.bn3.weight)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * Bottleneck.expansion, stride),
                nn.BatchNorm2d(planes * Bottleneck.expansion),
            )
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def resnet50(num_classes: int = 1000, zero_init_residual: bool = False) -> ResNet:
    return ResNet((3, 4, 6, 3), num_classes=num_classes, zero_init_residual=zero_init_residual)


def build(name: str, num_classes: int = 1000) -> ResNet:
    """The ``--model`` configuration ``name`` (a key of CONFIGS)."""
    layers, width = CONFIGS[name]
    return ResNet(layers, num_classes=num_classes, width=width)
