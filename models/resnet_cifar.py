"""ResNet-18 for 32x32 images (CIFAR): torchvision's ResNet-18 with a stem that keeps the full resolution."""

from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet


def resnet18_cifar(num_classes):
    """ResNet-18 as CIFAR recipes train it: 11.2M parameters (11,173,962 for 10 classes).

    He et al. 2016's ImageNet ResNet-18 (BasicBlock, [2, 2, 2, 2], 64 to 512 channels) with the stem that
    kuangliu/pytorch-cifar and weiaicunzai/pytorch-cifar100 use for CIFAR: a 3x3 stride-1 conv and no max-pool. On
    32x32 inputs the ImageNet stem (7x7 stride-2 conv, then 3x3 stride-2 max-pool) would leave 8x8 before the first
    block and 1x1 at the last stage; this one keeps 32x32, and 4x4 at the last stage. (He et al.'s own CIFAR
    networks, ResNet-20 to 110, are narrower: 16 to 64 channels, 0.27M to 1.7M parameters.) Module names are
    torchvision's, so state_dict keys match torchvision's resnet18 (conv1 and fc differ in shape).
    """
    model = ResNet(BasicBlock, [2, 2, 2, 2], num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as ResNet initialises convs
    model.maxpool = nn.Identity()
    return model
