"""Optimizer and learning-rate schedule from the recipe's optim and sched sections."""

import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model, cfg):
    """SGD (momentum, optional Nesterov) or AdamW; weight decay applies to weights, not to biases or norm layers."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]  # biases and norm scales
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999))


def build_scheduler(optimizer, cfg, epochs, steps_per_epoch):
    """Linear warmup from lr * warmup_factor to lr, then cosine decay to lr * min_lr_factor; stepped per iteration.

    The factor is a closed form of the step (LambdaLR), so the scheduler's state is one step count: a run resumed
    with more train.epochs follows the longer schedule from where it stopped.
    """
    total = epochs * steps_per_epoch
    warmup = min(round(cfg.warmup_epochs * steps_per_epoch), total - 1)
    return LambdaLR(optimizer, partial(warmup_cosine, warmup=warmup, total=total, start=cfg.warmup_factor,
                                       end=cfg.min_lr_factor))


def warmup_cosine(step, warmup, total, start, end):
    """Factor of the peak lr at `step`: linear from start to 1 over warmup steps, then cosine from 1 to end."""
    if step < warmup:
        return start + (1 - start) * step / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return end + (1 - end) * (1 + math.cos(math.pi * progress)) / 2
