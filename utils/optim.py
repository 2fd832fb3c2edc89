"""Optimizer and learning-rate schedule from the recipe's optim and sched sections."""

import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR


def build_optimizer(model, cfg):
    """SGD (momentum, optional Nesterov) or AdamW; weight decay applies to weights, not to biases or norm layers."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]  # biases and norm scales
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.momentum, 0.999))


def build_scheduler(optimizer, cfg, epochs, steps_per_epoch):
    """Linear warmup from lr * warmup_factor to lr, then cosine decay to lr * min_lr_factor; stepped per iteration."""
    total = epochs * steps_per_epoch
    warmup = min(round(cfg.warmup_epochs * steps_per_epoch), total - 1)
    lr = optimizer.param_groups[0]["lr"]
    cosine = CosineAnnealingLR(optimizer, T_max=total - warmup, eta_min=lr * cfg.min_lr_factor)
    if warmup == 0:
        return cosine
    linear = LinearLR(optimizer, start_factor=cfg.warmup_factor, end_factor=1.0, total_iters=warmup)
    return SequentialLR(optimizer, [linear, cosine], milestones=[warmup])
