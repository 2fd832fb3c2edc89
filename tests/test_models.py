"""Models by name: the small convnet and torchvision's classifiers."""

import pytest
import torch
from omegaconf import OmegaConf

from models import build_model, check_input_size, model_names
from utils.config import ModelConfig
from utils.general import UsageError


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


@pytest.mark.parametrize("name", ["googlenet", "inception_v3"])
def test_models_with_auxiliary_heads_return_plain_logits_in_training(name):
    model = build(name=name).train()
    assert model(torch.randn(2, 3, 80, 80)).shape == (2, 7)


def test_input_size_check_names_the_keys_and_leaves_the_model_as_it_was():
    vit = build(name="vit_b_32")
    with pytest.raises(UsageError, match=r"model.name='vit_b_32' cannot take 32x32 images \(data.img_size=32\)"):
        check_input_size(vit, "vit_b_32", 32, torch.device("cpu"))
    with pytest.raises(UsageError, match="cannot take 8x8 images"):
        check_input_size(build(name="inception_v3"), "inception_v3", 8, torch.device("cpu"))
    convnet = build(name="convnet", width=4)
    before = {k: v.clone() for k, v in convnet.state_dict().items()}
    check_input_size(convnet, "convnet", 8, torch.device("cpu"))
    assert convnet.training and all(torch.equal(before[k], v) for k, v in convnet.state_dict().items())


@pytest.mark.parametrize("norm, kind", [("group", torch.nn.GroupNorm), ("none", None)])
def test_convnet_norm_choices_have_no_batch_statistics(norm, kind):
    model = build(name="convnet", width=4, norm=norm)
    kinds = {type(m) for m in model.modules()}
    assert torch.nn.BatchNorm2d not in kinds and (kind is None or kind in kinds)
    assert model(torch.randn(1, 3, 8, 8)).shape == (1, 7)  # a batch of one trains without batch statistics
