"""A small VGG-style network for low-resolution images (8 to 64 pixels), where ImageNet stems downsample too early."""

import math

from torch import nn


def norm_layer(norm, channels):
    """BatchNorm (statistics over the batch), GroupNorm (over each sample's channel groups: the same at any number
    of processes) or nothing."""
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    if norm == "group":
        return nn.GroupNorm(math.gcd(8, channels), channels)  # 8 groups where the width allows
    return nn.Identity()


def conv_norm_relu(c_in, c_out, norm):
    """3x3 convolution, normalisation, ReLU; the conv has a bias only when no norm layer supplies one."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=norm == "none"), norm_layer(norm, c_out),
                         nn.ReLU(inplace=True))


class ConvNet(nn.Module):
    """depth stages of two conv-norm-ReLU blocks (width, 2*width, ... channels), 2x max-pool between stages,
    then global average pooling, dropout and a linear classifier."""

    def __init__(self, num_classes, width=32, depth=3, dropout=0.0, in_channels=3, norm="batch"):
        super().__init__()
        layers, c_in = [], in_channels
        for stage in range(depth):
            c_out = width * 2**stage
            if stage:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))  # ceil_mode: odd sizes keep their last row
            layers += [conv_norm_relu(c_in, c_out, norm), conv_norm_relu(c_out, c_out, norm)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.features(x))
