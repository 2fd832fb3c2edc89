"""Optimizer and learning-rate schedule from the recipe's optim and sched sections."""

import bisect
import math
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(model, cfg, head=None, backbone_lr=1.0):
    """SGD (momentum, optional Nesterov) or AdamW; weight decay applies to weights, not to biases or norm layers.
    Fine-tuning (head: the new head's parameter names): the rest, the pretrained part, learns at optim.lr x
    backbone_lr, in groups marked 'backbone' (build_scheduler can freeze them)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    # The head first: group 0, logged as lr/pg0 (TensorBoard: x/lr), follows optim.lr's schedule with or without
    # fine-tuning.
    parts = [(False, named)] if head is None else [(False, [(n, p) for n, p in named if n in head]),
                                                   (True, [(n, p) for n, p in named if n not in head])]
    groups = []
    for backbone, params in parts:
        lr = cfg.lr * backbone_lr if backbone else cfg.lr
        groups += [{"params": [p for _, p in params if p.ndim > 1], "weight_decay": cfg.weight_decay, "lr": lr},
                   {"params": [p for _, p in params if p.ndim <= 1], "weight_decay": 0.0, "lr": lr}]  # biases, norms
        if head is not None:
            groups[-2]["backbone"] = groups[-1]["backbone"] = backbone
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999))


def stepped_parameters(optimizer):
    """The parameters the next step changes: those of groups at a non-zero lr, so not a frozen part's."""
    return [p for group in optimizer.param_groups if group["lr"] > 0 for p in group["params"]]


def build_scheduler(optimizer, cfg, epochs, steps_per_epoch, frozen_epochs=0):
    """Linear warmup from lr * warmup_factor to lr, then the shape sched.name names; stepped per iteration. The
    groups marked 'backbone' (build_optimizer) stay at lr 0 for the first frozen_epochs epochs: with a zero lr SGD
    and AdamW leave a weight exactly as it is, weight decay included, while DDP still sees every parameter used.

    The factor is a closed form of the step (LambdaLR), so the scheduler's state is one step count: a run resumed
    with more train.epochs follows the longer schedule from where it stopped, and one resumed inside or after the
    frozen epochs is where it was.
    """
    total = epochs * steps_per_epoch
    warmup = min(round(cfg.warmup_epochs * steps_per_epoch), total - 1)
    after = {"cosine": partial(cosine, total=total - warmup, end=cfg.min_lr_factor),
             "step": partial(step_decay, every=max(1, round(cfg.step_epochs * steps_per_epoch)), gamma=cfg.gamma),
             "multistep": partial(multistep, milestones=[round(m * steps_per_epoch) for m in cfg.milestones],
                                  gamma=cfg.gamma),
             "constant": constant}[cfg.name]
    factor = partial(warmup_then, after, warmup=warmup, start=cfg.warmup_factor)
    frozen = partial(frozen_then, factor, until=frozen_epochs * steps_per_epoch)
    return LambdaLR(optimizer, [frozen if frozen_epochs and group.get("backbone") else factor
                                for group in optimizer.param_groups])


def frozen_then(factor, step, until):
    """0 before step `until`, then factor(step): the schedule of a part frozen for the first steps."""
    return 0.0 if step < until else factor(step)


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
