"""data.cache=ram: images decoded once, crops and flips drawn per batch from the per-image path's seeds."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision.datasets import ImageFolder

from data.batches import SeededSamples, batch_to, keep_batch
from data.cache import RamImages
from data.datasets import build_dataloader, set_epoch
from data.sources import build_datasets
from data.transforms import crop_spec, train_transforms, val_transforms
from utils.config import DataConfig, RecipeError, load_recipe
from utils.general import SharedError
from utils.memory import Budget


def data_cfg(**keys):
    return OmegaConf.structured(DataConfig(**keys))


def ramp_folder(root, sizes):
    """An ImageFolder of smooth images (ramps across and down, a coarse checker) of the given (height, width):
    bilinear and antialiased resizing of one box agree on them to a grey level or two, while two different boxes
    give clearly different pixels."""
    for i, (h, w) in enumerate(sizes):
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([255 * x / (w - 1), 255 * y / (h - 1), 255 * ((x // 6 + y // 6) % 2) * 0.5 + 60], -1)
        folder = root / "train" / ("ab"[i % 2])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.round().astype(np.uint8)).save(folder / f"{i:03d}.png")
    return root / "train"


SIZES = [(24, 24), (30, 20), (18, 33), (40, 40), (24, 36), (21, 21), (36, 24), (28, 28)]


def cached_epoch(cfg, folder, ids, epoch, device="cpu"):
    """The cache path's training images for ids in an epoch, gathered in one batch and cropped as train.py does."""
    cache = RamImages(ImageFolder(str(folder)), None, crop_spec(cfg), seed=3)
    cache.set_epoch(epoch)
    images, _ = batch_to(cache.__getitems__(ids), torch.device(device), crop_spec(cfg))
    return images


def per_image_epoch(cfg, folder, ids, epoch):
    samples = SeededSamples(ImageFolder(str(folder), train_transforms(cfg)), seed=3)
    samples.set_epoch(epoch)
    return torch.stack([samples[i][0] for i in ids])


@pytest.mark.parametrize("keys", [dict(img_size=16, scale=[0.25, 1.0], hflip=0.5),
                                  dict(img_size=16, scale=[0.08, 0.3], hflip=0.5),
                                  dict(img_size=24, crop_padding=4, hflip=0.5)])
@pytest.mark.slow
def test_cache_draws_the_per_image_crop_and_flip_of_every_sample(tmp_path, keys):
    cfg = data_cfg(**keys)
    folder = ramp_folder(tmp_path, SIZES)
    ids = list(range(len(SIZES))) + [len(SIZES) + 2, 2 * len(SIZES) + 5]  # repeated copies too
    for epoch in (0, 1):
        cached = cached_epoch(cfg, folder, ids, epoch)
        reference = per_image_epoch(cfg, folder, ids, epoch)
        assert cached.shape == reference.shape == (len(ids), 3, cfg.img_size, cfg.img_size)
        assert cached.dtype == torch.uint8
        diff = (cached.float() - reference.float()).abs().mean((1, 2, 3))
        if cfg.crop_padding:
            assert diff.max() == 0  # a window of the zero-padded image: no interpolation at all
        else:
            assert diff.max() < 3, diff  # the same box, resized by torchvision here and by PIL there
    other_epoch = per_image_epoch(cfg, folder, ids, 1)
    assert (per_image_epoch(cfg, folder, ids, 0).float() - other_epoch.float()).abs().mean() > 5


def test_a_samples_crop_does_not_depend_on_the_batch_it_is_gathered_in(tmp_path):
    cfg = data_cfg(img_size=16, scale=[0.08, 1.0], hflip=0.5)
    cache = RamImages(ImageFolder(str(ramp_folder(tmp_path, SIZES))), None, crop_spec(cfg), seed=3)
    cache.set_epoch(4)
    whole = cache.__getitems__([0, 1, 2, 3, 4, 5, 6, 7])[2]
    assert torch.equal(cache.__getitems__([6, 2])[2], whole[[6, 2]])  # rank 1 of 2 processes, say
    flips = {bool(cache.__getitems__([i + 8 * k])[2][0, 4]) for i in range(8) for k in range(4)}
    assert flips == {True, False}


def test_cached_validation_images_equal_the_per_image_ones(image_folder):
    root = image_folder({"train": {"a": 2, "b": 1, "c": 1}, "val": {"a": 3, "c": 2}}, size=20)
    cfg = data_cfg(img_size=12, crop_pct=0.8)
    _, val_set = build_datasets(root, None, val_transforms(cfg))
    cache = RamImages(build_datasets(root, None, None)[1], val_transforms(cfg))
    images, targets = cache.__getitems__(range(len(cache)))
    assert torch.equal(images, torch.stack([val_set[i][0] for i in range(len(val_set))]))
    assert targets.tolist() == val_set.targets


def test_cached_loader_yields_the_shares_and_crops_of_the_epoch(tmp_path):
    cfg = data_cfg(img_size=16, scale=[0.5, 1.0])
    cache = RamImages(ImageFolder(str(ramp_folder(tmp_path, SIZES))), None, crop_spec(cfg), seed=3)
    loader = build_dataloader(cache, 4, True, 3, 0, torch.device("cpu"))
    assert loader.collate_fn is keep_batch
    set_epoch(loader, 2)
    batches = [batch_to(b, torch.device("cpu"), crop_spec(cfg)) for b in loader]
    assert [len(t) for _, t in batches] == [4, 4]
    loader.sampler.set_epoch(2)
    order = list(loader.sampler)
    reference = per_image_epoch(cfg, tmp_path / "train", order, 2)
    assert (torch.cat([images for images, _ in batches]).float() - reference.float()).abs().mean() < 3


def test_cache_refuses_per_image_augmentation():
    with pytest.raises(RecipeError, match="data.auto_augment must be off with data.cache=ram"):
        load_recipe("cls.yaml", ["data.cache=ram", "data.auto_augment=randaugment"])
    with pytest.raises(RecipeError, match=r"data.cache must be none \(decode per image\), ram or jpeg, got .disk."):
        load_recipe("cls.yaml", ["data.cache=disk"])
    with pytest.raises(RecipeError, match="data.workers must be auto or a number >= 0, got 'some'"):
        load_recipe("cls.yaml", ["data.workers=some"])


def test_decoding_into_the_cache_stops_once_the_images_outgrow_the_memory(tmp_path, monkeypatch):
    import data.cache

    folder = ramp_folder(tmp_path, SIZES)  # 8 images of 1.3 to 4.8 kB each, decoded
    monkeypatch.setattr(data.cache, "memory_budget", lambda: Budget(5000, 6250, "of memory available", 1))
    with pytest.raises(SharedError, match=r"data.cache=ram: the first [2-4] of 8 images take [0-9.]+ KiB, more than "
                                          r"this process's budget of 4.9 KiB \(80% of the 6.1 KiB of memory "
                                          r"available\); set data.cache=none to decode per image"):
        RamImages(ImageFolder(str(folder)), None, crop_spec(data_cfg(img_size=16)))
