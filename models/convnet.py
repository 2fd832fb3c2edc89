"""A small VGG-style network for low-resolution images (8 to 64 pixels), where ImageNet stems downsample too early."""

from torch import nn


def conv_bn_relu(c_in, c_out):
    """3x3 convolution, batch norm, ReLU; the conv has no bias since batch norm supplies one."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class ConvNet(nn.Module):
    """depth stages of two conv-BN-ReLU blocks (width, 2*width, ... channels), 2x max-pool between stages,
    then global average pooling, dropout and a linear classifier."""

    def __init__(self, num_classes, width=32, depth=3, dropout=0.0, in_channels=3):
        super().__init__()
        layers, c_in = [], in_channels
        for stage in range(depth):
            c_out = width * 2**stage
            if stage:
                layers.append(nn.MaxPool2d(2, ceil_mode=True))  # ceil_mode: odd sizes keep their last row
            layers += [conv_bn_relu(c_in, c_out), conv_bn_relu(c_out, c_out)]
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(dropout), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.features(x))
