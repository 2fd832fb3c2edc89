"""Models by name: the small convnet and torchvision's classifiers."""

import torch
from omegaconf import OmegaConf

from models import build_model, model_names
from utils.config import ModelConfig


def build(**kw):
    return build_model(OmegaConf.structured(ModelConfig(**kw)), 7)


def test_convnet_fits_small_and_odd_image_sizes():
    model = build(name="convnet", width=8, depth=3)
    for size in (8, 9, 15, 32):
        assert model(torch.randn(2, 3, size, size)).shape == (2, 7)


def test_convnet_width_and_depth_set_its_size():
    small, large = build(name="convnet", width=8, depth=2), build(name="convnet", width=16, depth=3)
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(small) < count(large)
    assert large.head[-1].in_features == 64  # 16 * 2**(3 - 1)


def test_torchvision_models_by_name_without_download():
    assert {"convnet", "resnet18", "mobilenet_v3_small"} <= set(model_names())
    assert build(name="resnet18")(torch.randn(2, 3, 32, 32)).shape == (2, 7)
