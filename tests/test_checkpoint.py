"""Checkpoints are written atomically and load with weights_only=True."""

import pytest
import torch
from omegaconf import OmegaConf

from models import build_model
from utils.checkpoint import load_checkpoint, save_checkpoint
from utils.config import load_recipe
from utils.optim import build_optimizer, build_scheduler
from utils.torch_utils import grad_scaler


def test_full_training_state_round_trips_with_weights_only(tmp_path):
    cfg = load_recipe("cls.yaml", ["model.width=4"])
    model = build_model(cfg.model, 10)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.sched, 3, 5)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "scaler": grad_scaler(torch.device("cpu"), None).state_dict(), "epoch": 1, "best_top1": 0.5,
             "classes": ["a", "b"], "recipe": OmegaConf.to_container(cfg)}
    save_checkpoint(state, tmp_path / "last.pt")
    loaded = load_checkpoint(tmp_path / "last.pt")
    assert loaded["recipe"] == OmegaConf.to_container(cfg) and loaded["classes"] == ["a", "b"]
    fresh = build_model(cfg.model, 10)
    fresh.load_state_dict(loaded["model"])
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    scheduler.load_state_dict(loaded["scheduler"])
    optimizer.load_state_dict(loaded["optimizer"])


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)
    with pytest.raises(Exception):
        save_checkpoint({"epoch": 2, "bad": lambda: None}, path)  # a lambda cannot be pickled
    assert load_checkpoint(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_weights_only_refuses_pickled_objects(tmp_path):
    torch.save({"model": torch.nn.Linear(2, 2)}, tmp_path / "module.pt")  # a pickled module, not a state_dict
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_checkpoint(tmp_path / "module.pt")
