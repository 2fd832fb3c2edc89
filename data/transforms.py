"""Image transforms (torchvision v2) for training and validation, from the recipe's data section.

Per-sample transforms stop at uint8 tensors; conversion to float and mean/std normalisation happen per batch
on the training device (normalizer()), where they are one vectorised op instead of two Python-dispatched
transforms per image (on small images they cost more than the augmentation), and uint8 batches are a quarter
of the bytes to copy to a GPU.

Training's crop and flip are drawn by crop_params from each sample's seed alone, by one vectorised function that
both the per-image path (SeededCropFlip) and the caches' per-batch path (crop_batch) call: a sample gets the
same crop box and flip from either, and the same pixels to within one grey level.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
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


# On a CPU, images above this many pixels crop faster one by one (torchvision's own uint8 kernels, 0.3-0.4 ms a
# 500x375 photo at 176 px on one core) than as one batched product over the batch's largest size (9-16 ms an image);
# at 8x8 the batch takes 6 us an image against 33 us one by one (benchmarks/gpu.py --crops).
BATCHED_CPU_PIXELS = 32 * 32


def crop_batch(images, params, spec, scales=None):
    """Training's crop and flip of a batch from crop_params' (N, 5) params, on the images' device: a (N, C, H, W)
    uint8 batch padded to its largest image, or a list of (C, H, W) images. Padded windows (data.crop_padding) are
    one indexing op; resized crops are torchvision's antialiased resized_crop and flip of each image, done for the
    whole batch at once by resized_crops on a GPU and on small images, one image at a time above
    BATCHED_CPU_PIXELS on a CPU. scales (N, 2), (y, x): how much smaller each stored image is than the one its box
    was drawn on; its box is scaled to match, in fractional pixels (resize_weights)."""
    flip = params[:, 4].bool()
    if spec.padding:
        return windows(stacked(images), params, spec.padding, spec.size)
    boxes = params[:, :4].double()
    if scales is not None:  # edges map to edges: a resize by s moves pixel edge x to x * s
        boxes = boxes * scales.double().repeat(1, 2).to(boxes.device)
    height, width = max_size(images)
    if images[0].device.type != "cpu" or height * width <= BATCHED_CPU_PIXELS:
        return resized_crops(stacked(images), boxes, flip, spec.size)
    return torch.stack([resized_crop(image, box, f, spec.size) for image, box, f in zip(images, boxes, flip.tolist())])


def windows(images, params, padding, size):
    """CIFAR's crops: each image's size x size window at params' top and left in the image padded by `padding`
    zeros (outside the image is zeros, also where the batch pads a smaller image), flipped where params say."""
    top, left, _, _, flip = params.unbind(1)
    n, device = len(images), images.device
    padded = F.pad(images, [padding] * 4)
    rows = (top + padding)[:, None] + torch.arange(size, device=device)
    cols = (left + padding)[:, None] + torch.arange(size, device=device)
    cropped = padded[torch.arange(n, device=device)[:, None, None], :, rows[:, :, None],
                     cols[:, None, :]].permute(0, 3, 1, 2)  # (N, size, size, C) -> (N, C, size, size)
    return torch.where(flip.bool()[:, None, None, None], cropped.flip(-1), cropped).contiguous()


def max_size(images):
    """(height, width) of the largest image of a batch or list."""
    if isinstance(images, torch.Tensor):
        return tuple(images.shape[-2:])
    return max(image.shape[-2] for image in images), max(image.shape[-1] for image in images)


def stacked(images):
    """A list of (C, H, W) images as one zero-padded (N, C, H, W) batch of the largest's size, each in its top-left
    corner (a batch is returned as it is)."""
    if isinstance(images, torch.Tensor):
        return images
    height, width = max_size(images)
    batch = images[0].new_zeros((len(images), images[0].shape[0], height, width))
    for out, image in zip(batch, images):
        out[:, : image.shape[1], : image.shape[2]] = image
    return batch


def resized_crop(image, box, flip, size):
    """One (C, H, W) uint8 image's resized crop of box (top, left, height, width) to size x size, flipped if flip:
    torchvision's resized_crop where the box is whole pixels, else resized_crops on the pixels the box covers."""
    if bool((box == box.round()).all()):
        top, left, h, w = box.long().tolist()
        crop = TF.resized_crop(image, top, left, h, w, [size, size], antialias=True)
        return crop.flip(-1) if flip else crop
    first = box[:2].floor()
    last = (box[:2] + box[2:]).ceil().long()
    span = image[:, int(first[0]) : int(last[0]), int(first[1]) : int(last[1])]
    shifted = torch.cat([box[:2] - first, box[2:]])
    return resized_crops(span[None], shifted[None], torch.tensor([flip]), size)[0]


def resized_crops(images, boxes, flips, size):
    """A batch's resized crops: each (C, H, W) uint8 image's box (top, left, height, width; (N, 4), in pixels,
    fractional too) resized to size x size with torchvision's antialiased bilinear resize, flipped where flips (N,)
    says, as uint8 (N, C, size, size). Antialiased resizing is separable: each image's box becomes a (size, H)
    and a (size, W) weight matrix (resize_weights; zero outside the box, reversed for a flip), and the batch is
    resized by two batched matrix products in float32, on the images' device. Pixels match resized_crop's to within
    one grey level (its uint8 kernels round between the two passes); what the batch pads is never read."""
    n, channels, height, width = images.shape
    boxes = boxes.to(images.device, torch.float64)
    rows = resize_weights(boxes[:, 0], boxes[:, 2], size, height)  # (N, size, H)
    cols = resize_weights(boxes[:, 1], boxes[:, 3], size, width)  # (N, size, W)
    cols = torch.where(flips.to(images.device).bool()[:, None, None], cols.flip(1), cols)
    # Two plain batched products, channels folded into the other side of each (a broadcast over them would copy
    # the weights per channel): (N, H, C * W) by rows, then (N, size * C, W) by cols.
    pixels = images.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
    tall = torch.bmm(rows, pixels.view(n, height, channels * width))  # (N, size, C * W)
    out = torch.bmm(tall.view(n, size * channels, width), cols.transpose(1, 2))  # (N, size * C, size)
    out = out.view(n, size, channels, size).permute(0, 2, 1, 3)
    return out.round_().clamp_(0, 255).to(torch.uint8, memory_format=torch.contiguous_format)


def resize_weights(start, length, out_size, in_size):
    """(N, out_size, in_size) float32 weights of torch's antialiased bilinear resize (the weights of
    _upsample_bilinear2d_aa, which torchvision's resize uses) of each sample's span [start, start + length) of
    in_size pixels to out_size: output pixel i reads the pixels whose centres lie in the span, each weighted by the
    triangle filter at its distance from the output pixel's centre (widened by the scale when shrinking), the
    weights normalised to sum to one."""
    start, length = start[:, None, None], length[:, None, None]
    scale = length / out_size
    stretch = torch.where(scale >= 1, 1 / scale, torch.ones_like(scale))
    centre = start + scale * (torch.arange(out_size, device=start.device, dtype=torch.float64)[:, None] + 0.5)
    pixel = torch.arange(in_size, device=start.device, dtype=torch.float64) + 0.5
    weight = (1 - ((pixel - centre) * stretch).abs()).clamp_(min=0) * ((pixel > start) & (pixel < start + length))
    return (weight / weight.sum(2, keepdim=True).clamp_(min=1e-12)).float()  # a span with no pixel centre: zeros


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
            "std": list(cfg.std), "steps": f"RGB; resize the shorter side to resize and the longer to int(resize "
                                           f"x longer / shorter), rounded down as torchvision's Resize does "
                                           f"(bilinear, antialiased); centre-crop img_size x img_size; {normalise}"}


def normalizer(cfg, device):
    """Function mapping a uint8 batch (N, C, H, W) on device to float32 (x / 255 - mean) / std per channel."""
    mean = torch.tensor(list(cfg.mean), device=device).view(1, -1, 1, 1) * 255
    std = torch.tensor(list(cfg.std), device=device).view(1, -1, 1, 1) * 255
    return lambda images: (images.float() - mean) / std
