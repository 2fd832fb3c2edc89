"""Test-time augmentation: each image classified as itself and as its horizontal flip, their softmaxes (multi-label:
sigmoids) averaged.
Multi-crop TTA is not offered: the flip is the one view that costs nothing in resolution or framing."""

import math

import torch
import torch.nn.functional as F

TTA_NAME = "image + horizontal flip"  # what val.py and predict.py print


def tta_logits(model, images, multilabel=False):
    """Logits whose softmax is the mean of the softmax of each image of the normalised (N, C, H, W) batch and of its
    horizontal flip: the log of that mean (float32). Cross-entropy on them is the NLL of the averaged probabilities,
    and their softmax the averaged probabilities, so callers treat them as any logits. multilabel: logits whose
    sigmoid is the mean of the two sigmoids."""
    views = torch.cat([images, images.flip(3)])  # one forward pass of both views
    logits = model(views).float().view(2, len(images), -1)
    if multilabel:  # log(mean p) - log(mean (1 - p)), from log-sigmoids: stable where a probability is near 0 or 1
        return F.logsigmoid(logits).logsumexp(dim=0) - F.logsigmoid(-logits).logsumexp(dim=0)
    return logits.log_softmax(dim=2).logsumexp(dim=0) - math.log(2)  # log((p + p_flip) / 2), stable in underflow


def flip_warning(hflip, weights):
    """The warning for TTA on a checkpoint trained without flips (data.hflip=0), else None."""
    if hflip:
        return None
    return (f"--tta on {weights}, trained without flips (data.hflip=0): where a flip changes the class (digits, "
            f"text), TTA lowers accuracy")
