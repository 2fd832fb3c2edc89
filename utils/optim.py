"""Optimizer and learning-rate schedule from the recipe's optim and sched sections."""

import bisect
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
    """Linear warmup from lr * warmup_factor to lr, then the shape sched.name names; stepped per iteration.

    The factor is a closed form of the step (LambdaLR), so the scheduler's state is one step count: a run resumed
    with more train.epochs follows the longer schedule from where it stopped.
    """
    total = epochs * steps_per_epoch
    warmup = min(round(cfg.warmup_epochs * steps_per_epoch), total - 1)
    after = {"cosine": partial(cosine, total=total - warmup, end=cfg.min_lr_factor),
             "step": partial(step_decay, every=max(1, round(cfg.step_epochs * steps_per_epoch)), gamma=cfg.gamma),
             "multistep": partial(multistep, milestones=[round(m * steps_per_epoch) for m in cfg.milestones],
                                  gamma=cfg.gamma),
             "constant": constant}[cfg.name]
    return LambdaLR(optimizer, partial(warmup_then, after, warmup=warmup, start=cfg.warmup_factor))


def warmup_then(after, step, warmup, start):
    """Factor of the peak lr at `step`: linear from start to 1 over warmup steps, then after(steps since warmup)."""
    if step < warmup:
        return start + (1 - start) * step / warmup
    return after(step - warmup)


def cosine(step, total, end):
    """Half a cosine from 1 to end over total steps, then end."""
    progress = min(1.0, step / max(1, total))
    return end + (1 - end) * (1 + math.cos(math.pi * progress)) / 2


def step_decay(step, every, gamma):
    """gamma ** (number of whole `every`-step periods done)."""
    return gamma ** (step // every)


def multistep(step, milestones, gamma):
    """gamma ** (number of milestones reached)."""
    return gamma ** bisect.bisect_right(milestones, step)


def constant(step):
    """1: the peak lr throughout."""
    return 1.0
