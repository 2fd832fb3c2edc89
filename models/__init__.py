"""Networks: build_model() turns the recipe's model section into an nn.Module."""

from functools import cache

import torchvision

from models.convnet import ConvNet


@cache
def model_names():
    """Every name model.name accepts: 'convnet' and torchvision's classification models."""
    return ["convnet", *torchvision.models.list_models(module=torchvision.models)]


def build_model(cfg, num_classes):
    """A randomly initialised classifier for num_classes classes from the recipe's model section."""
    if cfg.name == "convnet":
        return ConvNet(num_classes, width=cfg.width, depth=cfg.depth, dropout=cfg.dropout)
    # weights=None: nothing is downloaded; these machines may have no internet
    return torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes)
