"""Datasets: the embedded digits ImageFolder, user ImageFolders, and their errors."""

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image

import data.datasets
from conftest import ROOT
from data.batches import batch_to
from data.datasets import build_dataloader, check_shareable, set_epoch
from data.sources import build_datasets, dataset_root, split_dir, write_digits
from data.transforms import crop_spec, normalizer, train_transforms, val_transforms
from utils.config import DataConfig
from utils.general import DatasetError


def count_files(folder):
    return {d.name: len(list(d.iterdir())) for d in sorted(Path(folder).iterdir())}


def test_digits_written_as_stratified_80_20_imagefolder(tmp_path):
    write_digits(tmp_path / "digits")
    train, val = count_files(tmp_path / "digits" / "train"), count_files(tmp_path / "digits" / "val")
    assert sorted(train) == sorted(val) == [str(d) for d in range(10)]
    assert sum(train.values()) == 1437 and sum(val.values()) == 360  # all 1,797 images, 80/20
    for digit in train:  # stratified: each class keeps its share within one image
        assert abs(val[digit] - 0.2 * (train[digit] + val[digit])) <= 1
    assert not list(tmp_path.glob(".digits.tmp*"))  # the temporary folder was renamed into place


def test_digits_split_is_fixed(tmp_path):
    write_digits(tmp_path / "a")
    write_digits(tmp_path / "b")
    files = lambda root: sorted(str(p.relative_to(root)) for p in root.rglob("*.png"))
    assert files(tmp_path / "a") == files(tmp_path / "b")


def test_digits_pixels_are_the_real_images(tmp_path):
    from sklearn.datasets import load_digits
    write_digits(tmp_path / "digits")
    ds = build_datasets(tmp_path / "digits", None, None)[0]
    image, label = ds[0]
    index = int(Path(ds.samples[0][0]).stem)
    expected = torch.tensor(load_digits().images[index] * 255 / 16).round().to(torch.uint8)
    assert image.size == (8, 8) and label == load_digits().target[index]
    assert torch.equal(torch.from_numpy(np.array(image.convert("L"))), expected)


def test_user_folder_with_test_split_and_missing_val_class(image_folder):
    root = image_folder({"train": {"ant": 3, "bee": 2, "cat": 2}, "test": {"ant": 1, "cat": 2}})
    train, val = build_datasets(root, None, None)
    assert train.classes == val.classes == ["ant", "bee", "cat"]
    assert sorted(val.targets) == [0, 2, 2]  # 'cat' keeps train's index 2 although val has no 'bee'


def test_val_class_unknown_to_train_is_an_error(image_folder):
    root = image_folder({"train": {"ant": 2}, "val": {"ant": 1, "dog": 1}})
    with pytest.raises(DatasetError, match=r"\['dog'\] have no training images"):
        build_datasets(root, None, None)


def test_missing_dataset_says_nothing_is_downloaded(tmp_path):
    with pytest.raises(DatasetError, match=r"neither a dataset here \(digits, multidigits, cifar10, cifar100\).*nothing is downloaded"):
        dataset_root(str(tmp_path / "imagenet"))


def test_missing_val_folder_is_named(image_folder):
    root = image_folder({"train": {"ant": 2}})
    with pytest.raises(DatasetError, match="no val/, valid/ or test/ folder"):
        split_dir(root, "val")


def test_empty_class_folder_is_named(image_folder, tmp_path):
    root = image_folder({"train": {"ant": 2}, "val": {"ant": 1}})
    (root / "train" / "bee").mkdir()
    with pytest.raises(DatasetError, match="train"):
        build_datasets(root, None, None)


def test_transforms_give_uint8_of_img_size_and_normalizer_matches_formula(image_folder):
    cfg = OmegaConf.structured(DataConfig(img_size=10, scale=[0.5, 1.0], mean=[0.5, 0.4, 0.3], std=[0.2, 0.2, 0.25]))
    root = image_folder({"train": {"a": 1}, "val": {"a": 1}}, size=16)
    train, val = build_datasets(root, train_transforms(cfg), val_transforms(cfg))
    for image, _ in (train[0], val[0]):
        assert image.dtype == torch.uint8 and image.shape == (3, 10, 10)
    batch = val[0][0][None]
    out = normalizer(cfg, torch.device("cpu"))(batch)
    expected = (batch.float() / 255 - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor(
        [0.2, 0.2, 0.25]).view(1, 3, 1, 1)
    assert torch.allclose(out, expected, atol=1e-6)


def test_every_process_needs_a_training_image(image_folder):
    train, _ = build_datasets(image_folder({"train": {"a": 2, "b": 1}, "val": {"a": 1}}), None, None)
    check_shareable(train, world_size=3)
    with pytest.raises(DatasetError, match="3 training image.* cannot be shared by 4 processes"):
        check_shareable(train, world_size=4)
    check_shareable(train, world_size=1, batch_size=3, drop_last=True)
    with pytest.raises(DatasetError, match=r"data.drop_last=true drops every step: 3 training image\(s\) are fewer "
                                           r"than one global batch \(train.batch_size=4\)"):
        check_shareable(train, world_size=1, batch_size=4, drop_last=True)
    # With MixUp or CutMix the sampler deals pairs: 3 images are 2 pairs (one partial), enough for 2 processes.
    check_shareable(train, world_size=2, pairs=True)
    with pytest.raises(DatasetError, match=r"cannot be shared by 3 processes; each needs at least a pair"):
        check_shareable(train, world_size=3, pairs=True)


@pytest.mark.parametrize("cache", ["none", "ram"])  # sizes from the files' headers, or from the RAM cache's decode
def test_training_images_much_larger_than_data_img_size_are_said_in_one_line(image_folder, log, cache):
    from data.datasets import training_data
    from utils.config import load_recipe

    large = image_folder({"train": {"a": 3, "b": 3}, "val": {"a": 1, "b": 1}}, size=40)
    cfg = load_recipe("cls.yaml", [f"data.name={large}", f"data.cache={cache}"])  # data.img_size=8
    training_data(cfg, torch.device("cpu"), 0)
    lines = [line for line in log.text.splitlines() if "much larger" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "the training images are much larger than the model sees them: median shorter side 40 px, scaled down to "
        "data.img_size=8 (val: 8 px); set data.img_size if that is not meant")
    log.clear()
    training_data(load_recipe("cls.yaml", [f"data.name={large}", f"data.cache={cache}", "data.img_size=20"]),
                  torch.device("cpu"), 0)  # 40 px is twice 20 px
    assert "much larger" in log.text
    log.clear()
    training_data(load_recipe("cls.yaml", [f"data.name={large}", f"data.cache={cache}", "data.img_size=21"]),
                  torch.device("cpu"), 0)
    assert "much larger" not in log.text


def test_training_images_much_smaller_than_data_img_size_are_said_with_the_recipe_that_fits_them(image_folder, log):
    """28 px digits at folder.yaml's 160 px: scaled up, 33x the pixels; the line points to cls.yaml at their size."""
    from data.datasets import training_data
    from utils.config import load_recipe

    small = image_folder({"train": {"a": 3, "b": 3}, "val": {"a": 1, "b": 1}}, size=28)
    training_data(load_recipe("cls.yaml", [f"data.name={small}", "data.img_size=160"]), torch.device("cpu"), 0)
    lines = [line for line in log.text.splitlines() if "much smaller" in line]
    assert len(lines) == 1 and lines[0].endswith(
        "the training images are much smaller than the model sees them: median shorter side 28 px, scaled up to "
        "data.img_size=160, 33x the pixels to compute on and no more detail; at their own size they train as well "
        f"in a fraction of the time, e.g. recipes/cls.yaml's small convnet: --recipe cls.yaml data.name={small} "
        "data.img_size=28")
    log.clear()
    training_data(load_recipe("cls.yaml", [f"data.name={small}", "data.img_size=84"]), torch.device("cpu"), 0)
    assert "much smaller" in log.text  # 3x
    log.clear()
    training_data(load_recipe("cls.yaml", [f"data.name={small}", "data.img_size=83"]), torch.device("cpu"), 0)
    assert "much smaller" not in log.text


def documented_storage():
    """The storage class docs/data.md's "A storage of your own" shows, run as written there."""
    section = (ROOT / "docs" / "data.md").read_text().split("## A storage of your own")[1]
    namespace = {}
    exec(re.search(r"```python\n(.*?)```", section, re.S).group(1), namespace)
    return namespace["StoredJpegs"]


def test_the_documented_storage_of_your_own_trains_the_same_crops_at_one_two_and_three_processes(monkeypatch):
    rng, store, sizes = np.random.default_rng(0), {}, []
    for i in range(13):  # larger than 32 px: a CPU crops them one at a time, exactly
        image, buffer = rng.integers(0, 256, (40 + i, 36 + 2 * i, 3), dtype=np.uint8), io.BytesIO()
        Image.fromarray(image).save(buffer, "JPEG")
        store[f"images/{i}.jpg"] = buffer.getvalue()
        sizes.append(image.shape[:2])
    spec = crop_spec(OmegaConf.structured(DataConfig(img_size=16, scale=[0.3, 1.0], hflip=0.5)))
    dataset = documented_storage()(store, list(store), [i % 3 for i in range(13)], sizes, list("abc"), spec, seed=5)

    def epoch(number, world, workers=0):
        """{sample id: its training crop} over every rank's loader, as build_dataloader makes them."""
        crops = {}
        for rank in range(world):
            monkeypatch.setattr(data.datasets, "RANK", rank)
            monkeypatch.setattr(data.datasets, "WORLD_SIZE", world)
            loader = build_dataloader(dataset, 6, True, 5, workers, torch.device("cpu"))
            set_epoch(loader, number)
            images, targets = (torch.cat(parts) for parts in zip(*loader))
            assert torch.equal(targets, torch.tensor(list(loader.sampler)) % 3)
            crops.update(zip(loader.sampler, images))
        return crops

    one = epoch(0, 1)
    assert sorted(one) == list(range(13)) and {c.shape for c in one.values()} == {(3, 16, 16)}
    for world, workers in ((2, 0), (3, 0), (1, 2)):
        assert all(torch.equal(crop, one[i]) for i, crop in epoch(0, world, workers).items()), (world, workers)
    assert sum(torch.equal(crop, one[i]) for i, crop in epoch(1, 1).items()) < 3  # drawn again each epoch
    on_device = documented_storage()(store, list(store), [0] * 13, sizes, list("abc"), spec, seed=5, on_device=True)
    (flat, lengths), *_ = batch = on_device.__getitems__(list(range(13)))  # JPEG bytes, decoded by batch_to
    assert lengths.tolist() == [len(data) for data in store.values()] and flat.numel() == lengths.sum()
    assert torch.equal(batch_to(batch, torch.device("cpu"), spec)[0], torch.stack([one[i] for i in range(13)]))
