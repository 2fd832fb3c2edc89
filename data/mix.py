"""MixUp and CutMix of each training batch, drawn from (seed, epoch, step) alone.

Each image is mixed with its pair partner: samples 2m and 2m+1 of the epoch's order, which the sampler keeps on one
process (DistributedShuffleSampler's group=2). One lambda (and for CutMix one box) per global step, as torchvision's
v2.MixUp and v2.CutMix draw one per batch, but from a generator seeded by the step rather than the global stream:
every process draws the same, so a step mixes the same pairs the same way at any number of processes.
"""

import math

import numpy as np
import torch
from torch.nn import functional as F

from data.sampler import seed_hash

MIX_STREAM = 0x4D1C  # keeps the mixing draws apart from the sampler's, which hash (seed, epoch) too


def batch_mixer(cfg, num_classes, seed):
    """A function (images, targets, epoch, step) -> (mixed images, soft targets) for the recipe's data section,
    or None when MixUp and CutMix are both off. Images are float (normalised) batches of one process's share;
    targets class indices, or multi-hot rows (multi-label)."""
    if not (cfg.mixup_alpha > 0 or cfg.cutmix_alpha > 0):
        return None

    def mix(images, targets, epoch, step):
        rng = np.random.default_rng(seed_hash(seed, epoch, step, MIX_STREAM))
        cutmix = cfg.cutmix_alpha > 0 and (cfg.mixup_alpha == 0 or rng.random() < cfg.mix_switch_prob)
        lam = float(rng.beta(*[cfg.cutmix_alpha if cutmix else cfg.mixup_alpha] * 2))
        partner = pair_partners(len(images), images.device)
        if cutmix:
            images, lam = cut_and_paste(images, partner, lam, rng)
        else:
            images = images.lerp(images[partner], 1 - lam)  # lam * image + (1 - lam) * partner
        # Multi-label targets are multi-hot already: mixed, a label's target is its share of the mixed pixels.
        soft = (targets if targets.dim() == 2 else F.one_hot(targets, num_classes)).to(images.dtype)
        return images, soft.lerp(soft[partner], 1 - lam)
    return mix


def pair_partners(n, device):
    """Index of each sample's partner: 0<->1, 2<->3, ...; a last, unpaired sample (an odd batch at an epoch's end)
    is its own partner and stays unmixed."""
    partner = torch.arange(n, device=device) ^ 1
    partner[partner >= n] = n - 1
    return partner


def cut_and_paste(images, partner, lam, rng):
    """CutMix: paste the partner's pixels in a box of area (1 - lam) centred anywhere (clipped at the borders, as
    torchvision's v2.CutMix); returns the images and lam adjusted to the box's true area."""
    height, width = images.shape[-2:]
    cy, cx = int(rng.integers(height)), int(rng.integers(width))
    half_h, half_w = int(height * math.sqrt(1 - lam)) // 2, int(width * math.sqrt(1 - lam)) // 2
    y1, y2 = max(cy - half_h, 0), min(cy + half_h, height)
    x1, x2 = max(cx - half_w, 0), min(cx + half_w, width)
    mixed = images.clone()
    mixed[..., y1:y2, x1:x2] = images[partner][..., y1:y2, x1:x2]
    return mixed, 1 - (y2 - y1) * (x2 - x1) / (height * width)
