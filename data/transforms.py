"""Image transforms (torchvision v2) for training and validation, from the recipe's data section.

Per-sample transforms stop at uint8 tensors; conversion to float and mean/std normalisation happen per batch
on the training device (normalizer()), where they are one vectorised op instead of two Python-dispatched
transforms per image (on small images they cost more than the augmentation), and uint8 batches are a quarter
of the bytes to copy to a GPU.
"""

import torch
from torchvision.transforms import InterpolationMode, v2


def train_transforms(cfg):
    """Crop, optional flip and automatic augmentation on the PIL image, then a uint8 (C, H, W) tensor, randomly
    erased if asked (the order of torchvision's reference presets; geometry before ToImage is also faster on small
    images)."""
    steps = [crop(cfg)]
    if cfg.hflip > 0:
        steps.append(v2.RandomHorizontalFlip(cfg.hflip))
    if cfg.auto_augment:
        steps.append(auto_augment(cfg))
    steps.append(v2.ToImage())
    if cfg.random_erase > 0:  # filled with the mean, which normalisation turns into 0, as erasing after it does
        steps.append(v2.RandomErasing(cfg.random_erase, value=[round(m * 255) for m in cfg.mean]))
    return v2.Compose(steps)


def crop(cfg):
    """RandomResizedCrop over data.scale, or with data.crop_padding, CIFAR's random crop of the padded image."""
    if cfg.crop_padding:
        return v2.Compose([v2.Resize(cfg.img_size, antialias=True), v2.RandomCrop(cfg.img_size, cfg.crop_padding)])
    return v2.RandomResizedCrop(cfg.img_size, scale=tuple(cfg.scale), antialias=True)


def auto_augment(cfg):
    """The data.auto_augment policy, at torchvision's reference settings (bilinear interpolation)."""
    bilinear = InterpolationMode.BILINEAR
    return {"autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=bilinear),
            "autoaugment_cifar10": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10, interpolation=bilinear),
            "randaugment": lambda: v2.RandAugment(magnitude=cfg.ra_magnitude, interpolation=bilinear),
            "trivialaugment": lambda: v2.TrivialAugmentWide(interpolation=bilinear),
            "augmix": lambda: v2.AugMix(severity=cfg.augmix_severity, interpolation=bilinear)}[cfg.auto_augment]()


def val_transforms(cfg):
    """Resize to val_size / crop_pct and centre-crop val_size, to a uint8 (C, H, W) tensor."""
    return v2.Compose([v2.Resize(resize_size(cfg), antialias=True), v2.CenterCrop(val_size(cfg)), v2.ToImage()])


def val_size(cfg):
    """The side of validation's and inference's images: data.val_img_size, else data.img_size."""
    return cfg.val_img_size or cfg.img_size


def resize_size(cfg):
    """The side the shorter image side is resized to before the centre crop of validation and inference."""
    return round(val_size(cfg) / cfg.crop_pct)


def preprocessing(cfg):
    """What a deployed model needs to know to prepare an image as validation does, as plain values."""
    return {"img_size": val_size(cfg), "resize": resize_size(cfg), "crop_pct": cfg.crop_pct, "mean": list(cfg.mean),
            "std": list(cfg.std), "steps": "RGB; resize the shorter side to resize (bilinear, antialiased); "
                                           "centre-crop img_size x img_size; scale to [0, 1]; subtract mean and "
                                           "divide by std per channel"}


def normalizer(cfg, device):
    """Function mapping a uint8 batch (N, C, H, W) on device to float32 (x / 255 - mean) / std per channel."""
    mean = torch.tensor(list(cfg.mean), device=device).view(1, -1, 1, 1) * 255
    std = torch.tensor(list(cfg.std), device=device).view(1, -1, 1, 1) * 255
    return lambda images: (images.float() - mean) / std
