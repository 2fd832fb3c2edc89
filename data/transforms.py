"""Image transforms (torchvision v2) for training and validation, from the recipe's data section.

Per-sample transforms stop at uint8 tensors; conversion to float and mean/std normalisation happen per batch
on the training device (normalizer()), where they are one vectorised op instead of two Python-dispatched
transforms per image (on small images they cost more than the augmentation), and uint8 batches are a quarter
of the bytes to copy to a GPU.
"""

import torch
from torchvision.transforms import v2


def train_transforms(cfg):
    """Random resized crop and optional horizontal flip, to a uint8 (C, H, W) tensor."""
    # Geometry on the PIL image, then ToImage: as torchvision's reference presets, and faster on small images.
    steps = [v2.RandomResizedCrop(cfg.img_size, scale=tuple(cfg.scale), antialias=True)]
    if cfg.hflip > 0:
        steps.append(v2.RandomHorizontalFlip(cfg.hflip))
    return v2.Compose([*steps, v2.ToImage()])


def val_transforms(cfg):
    """Resize to img_size / crop_pct and centre-crop img_size, to a uint8 (C, H, W) tensor."""
    return v2.Compose([v2.Resize(resize_size(cfg), antialias=True), v2.CenterCrop(cfg.img_size), v2.ToImage()])


def resize_size(cfg):
    """The side the shorter image side is resized to before the centre crop of validation and inference."""
    return round(cfg.img_size / cfg.crop_pct)


def preprocessing(cfg):
    """What a deployed model needs to know to prepare an image as validation does, as plain values."""
    return {"img_size": cfg.img_size, "resize": resize_size(cfg), "crop_pct": cfg.crop_pct, "mean": list(cfg.mean),
            "std": list(cfg.std), "steps": "RGB; resize the shorter side to resize (bilinear, antialiased); "
                                           "centre-crop img_size x img_size; scale to [0, 1]; subtract mean and "
                                           "divide by std per channel"}


def normalizer(cfg, device):
    """Function mapping a uint8 batch (N, C, H, W) on device to float32 (x / 255 - mean) / std per channel."""
    mean = torch.tensor(list(cfg.mean), device=device).view(1, -1, 1, 1) * 255
    std = torch.tensor(list(cfg.std), device=device).view(1, -1, 1, 1) * 255
    return lambda images: (images.float() - mean) / std
