"""Every recipe in recipes/ validates and trains: two steps and a validation on a tiny stand-in of its dataset (the
same classes, small images and model inputs), in this process, so that no recipe can rot."""

import csv
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

import data.cifar
import train
import val
from conftest import make_image_folder
from data.cifar import write_cifar_standin
from utils.config import RECIPES_DIR, load_recipe

# Per recipe: the stand-in's images per class (train, val) and the overrides that keep it small. The batch makes
# two steps of the stand-in's training images; the image size shrinks the model's inputs, not its architecture.
STAND_INS = {
    "cls.yaml": (None, ["train.batch_size=720"]),
    "cifar10-resnet18.yaml": ((4, 2), ["train.batch_size=20", "data.img_size=16"]),
    "cifar100-resnet18.yaml": ((1, 1), ["train.batch_size=50", "data.img_size=16"]),
    "folder.yaml": ((6, 2), ["train.batch_size=12", "data.img_size=32"]),
    "imagenet-resnet50.yaml": ((1, 0), ["train.batch_size=500", "data.img_size=16", "data.val_img_size=16"]),
    "imagenet-vit_b_16.yaml": ((1, 0), ["train.batch_size=500", "data.img_size=16", "train.precision=fp32"]),
}


def test_every_recipe_has_a_stand_in():
    assert sorted(STAND_INS) == sorted(p.name for p in RECIPES_DIR.glob("*.yaml"))


@pytest.fixture(scope="module")
def imagenet_standin(tmp_path_factory):
    """1,000 classes of one 8x8 image each for training, 10 of them with a val image."""
    classes = [f"n{i:08d}" for i in range(1000)]
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
        monkeypatch.setattr(data.cifar, "DATASETS_DIR", tmp_path)
        write_cifar_standin(tmp_path / cfg.data.name, cfg.data.name, *counts, size=8)
    elif cfg.data.name.endswith("imagenet"):
        overrides = [f"data.name={request.getfixturevalue('imagenet_standin')}", *overrides]
    elif counts:
        root = make_image_folder(tmp_path / "photos", {split: {c: n for c in "abc"}
                                                        for split, n in zip(("train", "val"), counts)}, size=40)
        overrides = [f"data.name={root}", *overrides]
    return [*overrides, "train.epochs=1", "data.workers=0", f"project={runs}"]


@pytest.mark.parametrize("name", sorted(STAND_INS))
def test_recipe_trains_two_steps_and_validates_on_a_stand_in(name, tmp_path, monkeypatch, request, runs, log):
    assert load_recipe(name)  # validates as written
    train.main(["--recipe", name, *standin_overrides(name, tmp_path, monkeypatch, request, runs)])
    assert "2 steps per epoch" in log.text
    run = runs / "exp"
    with open(run / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 1 and float(rows[0]["train/loss"]) > 0 and 0 <= float(rows[0]["val/top1"]) <= 1
    checkpoint = torch.load(run / "weights" / "last.pt", weights_only=True)
    assert checkpoint["recipe"]["model"]["name"] == load_recipe(name).model.name
    assert (checkpoint["ema"] is not None) == (load_recipe(name).train.ema_decay > 0)
    if checkpoint["recipe"]["data"]["name"].startswith("cifar"):  # val.py finds the CIFAR test set by name too
        metrics = val.main(["--weights", str(run / "weights" / "last.pt"), "--project", str(runs / "val")])
        assert metrics["val/top1"] == pytest.approx(float(rows[0]["val/top1"]), abs=1e-6)
        assert metrics["val/samples"] == len(data.cifar.CIFAR[checkpoint["recipe"]["data"]["name"]]["classes"]) * \
            STAND_INS[name][0][1]


def test_missing_cifar_files_are_named_with_where_to_get_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(data.cifar, "DATASETS_DIR", tmp_path / "datasets")
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--recipe", "cifar10-resnet18.yaml", f"project={tmp_path / 'runs'}"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "cifar-10-batches-py: missing data_batch_1" in error
    assert "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz" in error and error.count("\n") == 1
    assert not (tmp_path / "runs").exists()
