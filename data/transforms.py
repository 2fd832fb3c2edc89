"""Image transforms (torchvision v2) for training and validation, from the recipe's data section.

Per-sample transforms stop at uint8 tensors; conversion to float and mean/std normalisation happen per batch
on the training device (normalizer()), where they are one vectorised op instead of two Python-dispatched
transforms per image (on small images they cost more than the augmentation), and uint8 batches are a quarter
of the bytes to copy to a GPU.

Training's crop and flip are drawn by crop_params from each sample's seed alone, by one vectorised function that
both the per-image path (SeededCropFlip) and the RAM cache's per-batch path (crop_batch) call: a sample gets the
same crop box and flip from either.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.ops import roi_align
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as TF

from data.sampler import uniforms

RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's range of box aspect ratios (torchvision's default)
TRIES = 10  # RandomResizedCrop's tries at a box inside the image before it falls back to a centre crop


def train_transforms(cfg):
    """Crop, optional flip and automatic augmentation on the PIL image, then a uint8 (C, H, W) tensor, randomly
    erased if asked (the order of torchvision's reference presets; geometry before ToImage is also faster on small
    images). For samples of SeededSamples, which seeds each one."""
    steps = [SeededCropFlip(crop_spec(cfg))]
    if cfg.auto_augment:
        steps.append(auto_augment(cfg))
    steps.append(v2.ToImage())
    if cfg.random_erase > 0:  # filled with the mean, which normalisation turns into 0, as erasing after it does
        steps.append(v2.RandomErasing(cfg.random_erase, value=[round(m * 255) for m in cfg.mean]))
    return v2.Compose(steps)


@dataclass(frozen=True)
class CropSpec:
    """Training's crop and flip, as plain values (read per sample, where a recipe node's lookups would cost more)."""

    size: int  # data.img_size
    scale: tuple  # data.scale: RandomResizedCrop's range of box areas, as shares of the image
    hflip: float  # data.hflip
    padding: int  # data.crop_padding: > 0 crops a window of the image resized to size and padded by this much


def crop_spec(cfg):
    """The CropSpec of a recipe's data section."""
    return CropSpec(cfg.img_size, tuple(cfg.scale), cfg.hflip, cfg.crop_padding)


def crop_params(keys, heights, widths, spec):
    """(len(keys), 5) int64 array of each sample's crop box and flip: top, left, height, width, flip (0 or 1),
    drawn from the sample's key alone (see uniforms).

    Without padding, RandomResizedCrop's algorithm over spec.scale on an image of heights x widths: up to ten
    tries at a box of that area share and an aspect ratio in RATIO that fits, else a centre crop. With padding,
    CIFAR's random window of size x size of the image (already resized to size) padded by `padding` zeros; top
    and left then count from the unpadded image's corner, so they may be negative.
    """
    u = uniforms(keys, 2 * TRIES + 3)
    height, width = np.asarray(heights, dtype=np.float64), np.asarray(widths, dtype=np.float64)
    if spec.padding:
        box = np.full(len(u), float(spec.size))
        top = np.floor(u[:, 0] * (height + 2 * spec.padding - spec.size + 1)) - spec.padding
        left = np.floor(u[:, 1] * (width + 2 * spec.padding - spec.size + 1)) - spec.padding
        h, w = box, box
    else:
        top, left, h, w = resized_crop_boxes(u, height, width, spec.scale)
    flip = u[:, -1] < spec.hflip
    return np.stack([top, left, h, w, flip]).T.astype(np.int64)


def resized_crop_boxes(u, height, width, scale):
    """RandomResizedCrop's boxes (top, left, height, width) for a batch, from 2 * TRIES + 2 uniforms per sample."""
    area = (height * width)[:, None] * (scale[0] + u[:, :TRIES] * (scale[1] - scale[0]))
    log_ratio = math.log(RATIO[0]), math.log(RATIO[1])
    ratio = np.exp(log_ratio[0] + u[:, TRIES : 2 * TRIES] * (log_ratio[1] - log_ratio[0]))
    w, h = np.round(np.sqrt(area * ratio)), np.round(np.sqrt(area / ratio))
    fits = (w > 0) & (w <= width[:, None]) & (h > 0) & (h <= height[:, None])
    rows, first = np.arange(len(u)), fits.argmax(1)
    w, h, found = w[rows, first], h[rows, first], fits.any(1)
    # None fits: the whole image, cut to the nearest allowed aspect ratio, centred.
    aspect = width / height
    h = np.where(found, h, np.where(aspect < RATIO[0], np.round(width / RATIO[0]), height))
    w = np.where(found, w, np.where(aspect > RATIO[1], np.round(height * RATIO[1]), width))
    top = np.where(found, np.floor(u[:, -3] * (height - h + 1)), (height - h) // 2)
    left = np.where(found, np.floor(u[:, -2] * (width - w + 1)), (width - w) // 2)
    return top, left, h, w


class SeededCropFlip:
    """Training's crop and flip of one PIL image, drawn by crop_params from the sample's seed: SeededSamples seeds
    torch's generator with it, and torch.initial_seed() reads it back."""

    def __init__(self, spec):
        self.spec = spec

    def __call__(self, image):
        if self.spec.padding:
            image = TF.resize(image, [self.spec.size], antialias=True)  # the shorter side; a no-op at that size
        height, width = TF.get_size(image)
        top, left, h, w, flip = crop_params([torch.initial_seed()], [height], [width], self.spec)[0].tolist()
        if self.spec.padding:
            image = TF.crop(image, top, left, h, w)  # outside the image is zeros: the padding
        else:
            image = TF.resized_crop(image, top, left, h, w, [self.spec.size] * 2, antialias=True)
        return TF.horizontal_flip(image) if flip else image


def crop_batch(images, params, spec, scales=None):
    """The RAM cache's training crop and flip of a uint8 batch (N, C, H, W) on its device, from crop_params'
    (N, 5) params: one indexing op for padded windows, one roi_align (bilinear, averaging when it shrinks) for
    resized crops, instead of a Python call per image. scales (N, 2), (y, x): how much smaller each stored image
    is than the one its resized crop was drawn on; its box is scaled to match, in fractional pixels."""
    top, left, h, w, flip = params.unbind(1)
    n, size = len(images), spec.size
    if spec.padding:
        padded = F.pad(images, [spec.padding] * 4)
        rows = (top + spec.padding)[:, None] + torch.arange(size, device=images.device)
        cols = (left + spec.padding)[:, None] + torch.arange(size, device=images.device)
        cropped = padded[torch.arange(n, device=images.device)[:, None, None], :, rows[:, :, None],
                         cols[:, None, :]].permute(0, 3, 1, 2)  # (N, size, size, C) -> (N, C, size, size)
    else:
        boxes = torch.stack([left, top, left + w, top + h], 1).float()
        if scales is not None:  # edges map to edges: a resize by s moves pixel edge x to x * s
            boxes = boxes * scales.float().flip(1).repeat(1, 2)
        boxes = torch.cat([torch.arange(n, device=images.device, dtype=boxes.dtype)[:, None], boxes], 1)
        cropped = roi_align(images.float(), boxes, size, aligned=True).round_().clamp_(0, 255).to(torch.uint8)
    return torch.where(flip.bool()[:, None, None, None], cropped.flip(-1), cropped).contiguous()


def auto_augment(cfg):
    """The data.auto_augment policy, at torchvision's reference settings (bilinear interpolation)."""
    bilinear = InterpolationMode.BILINEAR
    return {"autoaugment": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET, interpolation=bilinear),
            "autoaugment_cifar10": lambda: v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10, interpolation=bilinear),
            "randaugment": lambda: v2.RandAugment(magnitude=cfg.ra_magnitude, interpolation=bilinear),
            "trivialaugment": lambda: v2.TrivialAugmentWide(interpolation=bilinear),
            "augmix": lambda: v2.AugMix(severity=cfg.augmix_severity, interpolation=bilinear)}[cfg.auto_augment]()


def val_transforms(cfg):
    """Validation's and inference's uint8 (C, H, W) tensor of val_size x val_size: the shorter side resized to
    val_size / crop_pct and the centre cropped (data.val_resize=crop), or the whole image resized (squash)."""
    if cfg.val_resize == "squash":
        return v2.Compose([v2.Resize([val_size(cfg)] * 2, antialias=True), v2.ToImage()])
    return v2.Compose([v2.Resize(resize_size(cfg), antialias=True), v2.CenterCrop(val_size(cfg)), v2.ToImage()])


def val_size(cfg):
    """The side of validation's and inference's images: data.val_img_size, else data.img_size."""
    return cfg.val_img_size or cfg.img_size


def resize_size(cfg):
    """The side the shorter image side is resized to before the centre crop of validation and inference."""
    return round(val_size(cfg) / cfg.crop_pct)


def preprocessing(cfg):
    """What a deployed model needs to know to prepare an image as validation does, as plain values."""
    normalise = "scale to [0, 1]; subtract mean and divide by std per channel"
    if cfg.val_resize == "squash":
        return {"img_size": val_size(cfg), "resize": "squash", "mean": list(cfg.mean), "std": list(cfg.std),
                "steps": f"RGB; resize the whole image to img_size x img_size (bilinear, antialiased; its aspect "
                         f"ratio is not kept); {normalise}"}
    return {"img_size": val_size(cfg), "resize": resize_size(cfg), "crop_pct": cfg.crop_pct, "mean": list(cfg.mean),
            "std": list(cfg.std), "steps": f"RGB; resize the shorter side to resize (bilinear, antialiased); "
                                           f"centre-crop img_size x img_size; {normalise}"}


def normalizer(cfg, device):
    """Function mapping a uint8 batch (N, C, H, W) on device to float32 (x / 255 - mean) / std per channel."""
    mean = torch.tensor(list(cfg.mean), device=device).view(1, -1, 1, 1) * 255
    std = torch.tensor(list(cfg.std), device=device).view(1, -1, 1, 1) * 255
    return lambda images: (images.float() - mean) / std
