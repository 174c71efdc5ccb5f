"""A small ResNet for 32x32 images (CIFAR-style: 3 stages of basic blocks, BatchNorm, no max-pool)."""

from typing import Annotated

import torch
import torch.nn.functional as F
from torch import nn

from src.schema.signature import Arg


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    _no_split_modules = ["BasicBlock"]  # FSDP's unit of sharding (see models/gpt.py)

    def __init__(
        self,
        num_classes: Annotated[int, Arg("labels (config/model/resnet.yaml takes it from the data)", ge=2)],
        width: Annotated[int, Arg("channels of the first stage (doubled per stage)", ge=1)] = 16,
        blocks_per_stage: Annotated[int, Arg("basic blocks in each of the 3 stages", ge=1)] = 2,
        in_channels: Annotated[int, Arg("image channels", ge=1)] = 3,
    ):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        stages, channels = [], width
        for stage, out_channels in enumerate((width, 2 * width, 4 * width)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                stages.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> class logits (B, num_classes)."""
        x = self.stages(self.stem(images))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
