"""Optimizer groups and the schedules (warmup, then cosine, step, multistep or constant), stepped per iteration."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from models import build_model
from utils.config import ModelConfig, OptimConfig, SchedConfig
from utils.optim import build_optimizer, build_scheduler


def lrs(optimizer, scheduler, steps):
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out + [optimizer.param_groups[0]["lr"]]


def make(optim=None, sched=None, epochs=4, steps_per_epoch=10):
    model = build_model(OmegaConf.structured(ModelConfig(name="convnet", width=4, depth=2)), 3)
    optimizer = build_optimizer(model, OmegaConf.structured(OptimConfig(**(optim or {}))))
    scheduler = build_scheduler(optimizer, OmegaConf.structured(SchedConfig(**(sched or {}))), epochs, steps_per_epoch)
    return model, optimizer, scheduler


def test_warmup_then_cosine_per_iteration():
    _, optimizer, scheduler = make({"lr": 0.1}, {"warmup_epochs": 1, "warmup_factor": 0.1, "min_lr_factor": 0.01})
    values = lrs(optimizer, scheduler, 40)
    assert values[0] == pytest.approx(0.01)  # lr * warmup_factor
    assert values[5] == pytest.approx(0.01 + 0.09 * 5 / 10)  # linear
    assert values[10] == pytest.approx(0.1)  # peak at the end of warmup
    assert values[25] == pytest.approx(0.001 + 0.099 * (1 + math.cos(math.pi * 15 / 30)) / 2)  # cosine
    assert values[40] == pytest.approx(0.001)  # lr * min_lr_factor at the end
    assert all(a >= b for a, b in zip(values[10:], values[11:]))


def test_step_multistep_and_constant_after_warmup():
    # 10 steps per epoch, 2 warmup epochs from 0.01 to 0.1; the decays count epochs after warmup.
    warmup = {"warmup_epochs": 2, "warmup_factor": 0.1}
    _, optimizer, scheduler = make({"lr": 0.1}, {"name": "step", "step_epochs": 1.5, "gamma": 0.5, **warmup}, 8)
    values = lrs(optimizer, scheduler, 80)
    assert values[0] == pytest.approx(0.01) and values[10] == pytest.approx(0.055)
    assert values[20:35] == pytest.approx([0.1] * 15)
    assert values[35:50] == pytest.approx([0.05] * 15) and values[50] == pytest.approx(0.025)
    _, optimizer, scheduler = make({"lr": 0.1}, {"name": "multistep", "milestones": [1, 3.5], "gamma": 0.1, **warmup},
                                   8)
    values = lrs(optimizer, scheduler, 80)
    assert values[20:30] == pytest.approx([0.1] * 10) and values[30:55] == pytest.approx([0.01] * 25)
    assert values[55:] == pytest.approx([0.001] * 26)
    _, optimizer, scheduler = make({"lr": 0.1}, {"name": "constant", **warmup}, 8)
    values = lrs(optimizer, scheduler, 80)
    assert values[10] == pytest.approx(0.055) and values[20:] == pytest.approx([0.1] * 61)


def test_no_warmup_starts_at_peak():
    _, optimizer, scheduler = make({"lr": 0.1}, {"warmup_epochs": 0})
    assert lrs(optimizer, scheduler, 1)[0] == pytest.approx(0.1)


def test_weight_decay_skips_biases_and_norm_layers():
    model, optimizer, _ = make({"weight_decay": 1e-4})
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_adamw_and_sgd_options():
    _, sgd, _ = make({"name": "sgd", "momentum": 0.8, "nesterov": True})
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.8 and sgd.defaults["nesterov"]
    _, adamw, _ = make({"name": "adamw", "lr": 0.002, "momentum": 0.85})
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["betas"] == (0.85, 0.999)
