"""Every recipe in recipes/ validates and trains: two steps and a validation on a tiny stand-in of its dataset (its
classes, ImageNet's cut to 100; small images and model inputs), in this process, so that no recipe can rot: the
steps move every weight, the checkpoint holds the recipe as run, and val.py measures it as training did."""

import csv
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torchvision
from omegaconf import OmegaConf

import data.cifar
import train
import utils.general
import val
from cifar_standin import write_cifar_standin
from conftest import make_image_folder
from models import check_model_name, settle
from models.pretrained import cache_path, torchvision_weights, weights_kind
from utils.config import RECIPES_DIR, load_recipe

# Per recipe: the stand-in's images per class (train, val) and the overrides that keep it small. The batch makes
# two steps of the stand-in's training images; the image size shrinks the model's inputs, not its architecture.
STAND_INS = {
    "cls.yaml": (None, ["train.batch_size=720"]),
    "multilabel.yaml": (None, ["train.batch_size=1500"]),
    "cifar10-resnet18.yaml": ((4, 2), ["train.batch_size=20", "data.img_size=16"]),
    "cifar100-resnet18.yaml": ((1, 1), ["train.batch_size=50", "data.img_size=16"]),
    "folder.yaml": ((6, 2), ["train.batch_size=12", "data.img_size=32"]),
    "multilabel-photos.yaml": ((6, 2), ["train.batch_size=12", "data.img_size=32"]),
    # fp32: on a CPU with AVX512-BF16 (torch 2.14.1), bf16's weight gradient of layer4's strided 3x3 convolution on
    # the 1x1 maps of 16 px images is wrong from batches of about 128 (docs/techniques.md, bf16)
    "imagenet-resnet50.yaml": ((1, 0), ["train.batch_size=50", "data.img_size=16", "data.val_img_size=16",
                                        "train.precision=fp32"]),
    "imagenet-vit_b_16.yaml": ((1, 0), ["train.batch_size=50", "data.img_size=16", "train.precision=fp32"]),
}


def test_every_recipe_has_a_stand_in():
    assert sorted(STAND_INS) == sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))


@pytest.fixture(scope="module")
def imagenet_standin(tmp_path_factory):
    """100 classes (ImageNet's folder names) of one 8x8 image each for training, 10 of them with a val image: the
    ImageNet models' two steps at a batch of 50, a tenth of the compute of ImageNet's 1,000 classes at 500."""
    classes = [f"n{i:08d}" for i in range(100)]
    return make_image_folder(tmp_path_factory.mktemp("imagenet"), {"train": dict.fromkeys(classes, 1),
                                                                   "val": dict.fromkeys(classes[:10], 1)}, size=8)


@pytest.fixture
def runs():
    """A project folder in memory where there is one: the ImageNet models' checkpoints are hundreds of MB."""
    folder = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def standin_overrides(name, tmp_path, monkeypatch, request, runs):
    """Write the recipe's stand-in under tmp_path; return the overrides that point the recipe at it."""
    cfg = load_recipe(name)
    counts, overrides = STAND_INS[name]
    if cfg.data.name in ("cifar10", "cifar100"):
        monkeypatch.setattr(utils.general, "DATASETS_DIR", tmp_path)
        write_cifar_standin(tmp_path / cfg.data.name, cfg.data.name, *counts, size=8)
    elif cfg.data.name.endswith("imagenet"):
        overrides = [f"data.name={request.getfixturevalue('imagenet_standin')}", *overrides]
    elif counts:
        root = make_image_folder(tmp_path / "photos", {split: {c: n for c in "abc"}
                                                        for split, n in zip(("train", "val"), counts)}, size=40)
        if cfg.data.multilabel:  # the same images listed in CSVs, every other one with a second label
            for split in ("train", "val"):
                files = sorted((root / split).rglob("*.png"))
                rows = [f"{f.relative_to(root)},{f.parent.name}" + (f" {'bca'['abc'.index(f.parent.name)]}" * (i % 2))
                        for i, f in enumerate(files)]
                (root / f"{split}.csv").write_text("\n".join(["path,labels", *rows]))
        overrides = [f"data.name={root}", *overrides]
    if cfg.train.ema_decay:
        overrides = [*overrides, "train.ema_steps=1"]  # two steps: update the EMA at each
    if weights_kind(cfg.model.name, cfg.model.weights) == "torchvision":  # offline: a stand-in in the cache
        monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
        path = cache_path(torchvision_weights(cfg.model.name, cfg.model.weights))
        path.parent.mkdir(parents=True)
        torch.save(torchvision.models.get_model(cfg.model.name).state_dict(), path)
    if cfg.model.freeze_epochs:
        overrides = [*overrides, "model.freeze_epochs=0"]  # two steps in the frozen epochs would move the head alone
    return [*overrides, "train.epochs=1", "data.workers=0", "log.plots=false", f"project={runs}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STAND_INS))
def test_recipe_trains_two_steps_and_validates_on_a_stand_in(name, tmp_path, monkeypatch, request, runs, log):
    assert load_recipe(name, model_check=check_model_name)  # validates as written
    overrides = standin_overrides(name, tmp_path, monkeypatch, request, runs)
    initial, check_input_size = {}, train.check_input_size

    def keep_initial_weights(model, *args, **kw):  # called before the first step
        initial.update({k: p.detach().clone() for k, p in model.named_parameters()} if not initial else {})
        return check_input_size(model, *args, **kw)
    monkeypatch.setattr(train, "check_input_size", keep_initial_weights)
    train.main(["--recipe", name, *overrides])
    assert "2 steps per epoch" in log.text
    run = runs / "exp"
    with open(run / "results.csv") as f:
        rows = list(csv.DictReader(f))
    checkpoint = torch.load(run / "weights" / "last.pt", weights_only=True)
    # as run: overrides too, and what the recipe leaves to its pretrained weights and the hardware
    assert checkpoint["recipe"] == OmegaConf.to_container(settle(load_recipe(name, overrides)))
    assert len(rows) == 1 and checkpoint["epoch"] == 1
    unmoved = [k for k, weight in initial.items() if torch.equal(weight, checkpoint["model"][k])]
    assert len(initial) > 10 and not unmoved, f"the two steps left {unmoved} as initialised"
    assert (checkpoint["ema"] is not None) == (load_recipe(name).train.ema_decay > 0)
    if name.startswith("imagenet"):
        return  # val.py reading back hundreds of MB of weights would double these cases' time; the rest cover it
    # val.py, on the dataset the checkpoint names (CIFAR's test set found by name), measures what training did
    metrics = val.main(["--weights", str(run / "weights" / "last.pt"), "--project", str(runs / "val"),
                        *(["--threshold", "0.5"] if checkpoint["recipe"]["data"]["multilabel"] else [])])
    score = "val/map" if checkpoint["recipe"]["data"]["multilabel"] else "val/top1"  # threshold-free, or at 0.5
    assert metrics[score] == pytest.approx(float(rows[0][score]), abs=1e-6)
    if "val/f1" in rows[0]:  # at train.threshold, 0.5, as training counted
        assert metrics["val/f1"] == pytest.approx(float(rows[0]["val/f1"]), rel=1e-5)
    assert metrics["val/loss"] == pytest.approx(float(rows[0]["val/loss"]), rel=1e-5)
    if checkpoint["recipe"]["data"]["name"].startswith("cifar"):
        assert metrics["val/samples"] == len(data.cifar.CIFAR[checkpoint["recipe"]["data"]["name"]]["classes"]) * \
            STAND_INS[name][0][1]


def test_missing_cifar_files_are_named_with_where_to_get_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(utils.general, "DATASETS_DIR", tmp_path / "datasets")
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--recipe", "cifar10-resnet18.yaml", f"project={tmp_path / 'runs'}"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "cifar-10-batches-py: missing data_batch_1" in error
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in error and error.count("\n") == 1
    assert not (tmp_path / "runs").exists()
