"""Models by name: ours (convnet, resnet18_cifar), torchvision's classifiers and timm's when it is installed."""

import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch
from omegaconf import OmegaConf

from models import build_model, check_input_size, check_model_name, load_weights, model_names, read_weights
from utils.config import ModelConfig, RecipeError, load_recipe
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


def test_weights_load_from_our_checkpoints_and_torchvision_files_with_the_head_resized(tmp_path):
    source = build_model(OmegaConf.structured(ModelConfig(name="convnet", width=4, depth=2)), 10)
    torch.save({"model": source.state_dict(), "classes": list("abcdefghij")}, tmp_path / "ours.pt")
    model = build_model(OmegaConf.structured(ModelConfig(name="convnet", width=4, depth=2)), 3)
    head = model.state_dict()["head.3.weight"].clone()
    resized = load_weights(model, read_weights(tmp_path / "ours.pt"), 3, "ours")
    assert resized == ["head.3.weight", "head.3.bias"]
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in model.state_dict().items()
               if not k.startswith("head"))
    assert torch.equal(model.state_dict()["head.3.weight"], head)  # as initialised, for 3 classes
    # torchvision's file format: a plain state_dict of a 1000-class model
    torchvision_file = tmp_path / "mobilenet.pth"
    torch.save(build_model(OmegaConf.structured(ModelConfig(name="mobilenet_v3_small")), 1000).state_dict(),
               torchvision_file)
    mobilenet = build_model(OmegaConf.structured(ModelConfig(name="mobilenet_v3_small")), 5)
    assert load_weights(mobilenet, read_weights(torchvision_file), 5, "tv") == ["classifier.3.weight",
                                                                                 "classifier.3.bias"]
    assert torch.equal(mobilenet.features[0][0].weight, torch.load(torchvision_file)["features.0.0.weight"])
    # the same class count: everything loads
    assert load_weights(source, read_weights(tmp_path / "ours.pt"), 10, "ours") == []


def test_weights_that_do_not_fit_or_do_not_exist_are_named(tmp_path):
    torch.save(build_model(OmegaConf.structured(ModelConfig(name="convnet", width=4, depth=2)), 3).state_dict(),
               tmp_path / "convnet.pt")
    wider = build_model(OmegaConf.structured(ModelConfig(name="convnet", width=8, depth=2)), 3)
    with pytest.raises(UsageError, match=r"w: 'features.0.0.weight' has shape \(4, 3, 3, 3\), the model \(8, 3, 3"):
        load_weights(wider, read_weights(tmp_path / "convnet.pt"), 3, "w")
    resnet = build_model(OmegaConf.structured(ModelConfig(name="resnet18")), 3)
    with pytest.raises(UsageError, match="r: 'features.0.0.weight' is not a weight of this model"):
        load_weights(resnet, read_weights(tmp_path / "convnet.pt"), 3, "r")
    with pytest.raises(UsageError, match=r"model.weights='.*nope.pth': no such file; give a local state_dict file, "
                                          r"or weights by name: DEFAULT or a torchvision weights name"):
        read_weights(str(tmp_path / "nope.pth"))


def test_vit_and_maxvit_are_built_at_the_recipe_image_size():
    model = build_model(OmegaConf.structured(ModelConfig(name="vit_b_32")), 7, img_size=64)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)
    with pytest.raises(UsageError, match=r"data.val_img_size=96"):  # built for 64: another size is named
        check_input_size(model, "vit_b_32", 96, torch.device("cpu"), key="data.val_img_size")


def test_resnet18_cifar_by_name():
    model = build(name="resnet18_cifar")
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7) and isinstance(model.maxpool, torch.nn.Identity)


@pytest.fixture
def fake_timm(monkeypatch):
    """A stand-in for the optional timm package with its API (is_model, create_model) and two models, recording how
    they were asked for: what is checked is our side, not timm's models."""
    timm = types.ModuleType("timm")
    timm.__spec__ = importlib.machinery.ModuleSpec("timm", None)
    timm.calls = []
    timm.is_model = lambda name: name in ("tiny", "vit_tiny")

    def create_model(name, pretrained, num_classes, **kw):
        timm.calls.append((name, pretrained, num_classes, kw))
        return torch.nn.Identity()
    timm.create_model = create_model
    monkeypatch.setitem(sys.modules, "timm", timm)
    return timm


def test_timm_models_are_checked_by_name_and_built_without_download(fake_timm):
    assert load_recipe("cls.yaml", ["model.name=timm/tiny"], model_check=check_model_name).model.name == "timm/tiny"
    with pytest.raises(RecipeError, match=r"model.name='timm/tinny': timm has no model of that name"):
        load_recipe("cls.yaml", ["model.name=timm/tinny"], model_check=check_model_name)
    build(name="timm/tiny")
    build_model(OmegaConf.structured(ModelConfig(name="timm/vit_tiny")), 7, img_size=64)
    # Never pretrained: nothing is downloaded. A ViT is built for the recipe's image size, as torchvision's are.
    assert fake_timm.calls == [("tiny", False, 7, {}), ("vit_tiny", False, 7, {"img_size": 64})]


def test_timm_model_without_timm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RecipeError, match=r"model.name='timm/resnet50': needs timm, which is not installed here "
                                          r"\(pip install timm\)"):
        load_recipe("cls.yaml", ["model.name=timm/resnet50"], model_check=check_model_name)
