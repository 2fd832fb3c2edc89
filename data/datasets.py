"""Datasets and their loaders: the embedded digits set written as an ImageFolder, or any user ImageFolder."""

import os
import shutil
import socket
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from data.sampler import DistributedShuffleSampler, SeededSamples
from utils.general import ROOT, UsageError
from utils.torch_utils import LOCAL_RANK, RANK, WORLD_SIZE, torch_distributed_zero_first

DATASETS_DIR = ROOT / "datasets"


class DatasetError(UsageError):
    """A dataset that cannot be used, with a message naming the path and what is wrong."""


def write_digits(root):
    """Write scikit-learn's 1,797 real 8x8 handwritten digits as a PNG ImageFolder, fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits  # the images ship inside scikit-learn; nothing is downloaded
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)  # values are 0..16 in the source
    train_idx, val_idx = train_test_split(
        np.arange(len(pixels)), test_size=0.2, stratify=digits.target, random_state=0)
    # Written whole, then renamed into place; the name is unique even between machines sharing a disk.
    tmp = root.with_name(f".{root.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    for split, indices in (("train", train_idx), ("val", val_idx)):
        for i in indices:
            folder = tmp / split / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels[i]).save(folder / f"{i:04d}.png")
    try:
        os.replace(tmp, root)
    except OSError:  # another process (e.g. another node on a shared disk) finished first
        shutil.rmtree(tmp, ignore_errors=True)


EMBEDDED = {"digits": write_digits}  # datasets that ship with our requirements, written on first use


def dataset_root(name):
    """ImageFolder root for data.name: an embedded dataset (written once by local rank 0) or a user directory."""
    if name in EMBEDDED:
        root = DATASETS_DIR / name
        with torch_distributed_zero_first(LOCAL_RANK):  # local rank 0 writes; the others wait, then read
            if not root.exists():
                DATASETS_DIR.mkdir(parents=True, exist_ok=True)
                EMBEDDED[name](root)
        return root
    root = Path(name)
    if not root.is_dir():
        raise DatasetError(f"data.name '{name}' is neither an embedded dataset ({', '.join(EMBEDDED)}) nor a "
                           f"directory; give the path of an ImageFolder root holding train/<class>/* and "
                           f"val/<class>/* (nothing is downloaded)")
    return root


def split_dir(root, split):
    """root/train, or for split 'val' root/val falling back to root/test."""
    names = ("val", "test") if split == "val" else (split,)
    for name in names:
        if (root / name).is_dir():
            return root / name
    raise DatasetError(f"{root}: no {' or '.join(f'{n}/' for n in names)} folder; an ImageFolder root holds "
                       f"train/<class>/* and val/<class>/* (or test/<class>/*)")


def image_folder(folder, transform):
    """torchvision ImageFolder, with errors that name the folder."""
    try:
        return ImageFolder(str(folder), transform=transform)
    except (FileNotFoundError, RuntimeError) as e:
        raise DatasetError(f"{folder}: {e}") from None


def build_datasets(root, train_transform, val_transform):
    """Train and val ImageFolders; val labels follow train's class indices (val may lack some classes)."""
    train_set = image_folder(split_dir(root, "train"), train_transform)
    val_set = image_folder(split_dir(root, "val"), val_transform)
    unknown = sorted(set(val_set.classes) - set(train_set.classes))
    if unknown:
        raise DatasetError(f"{split_dir(root, 'val')}: classes {unknown} have no training images in "
                           f"{split_dir(root, 'train')}")
    if val_set.classes != train_set.classes:
        val_set.samples = [(path, train_set.class_to_idx[val_set.classes[i]]) for path, i in val_set.samples]
        val_set.imgs, val_set.targets = val_set.samples, [i for _, i in val_set.samples]
        val_set.classes, val_set.class_to_idx = train_set.classes, train_set.class_to_idx
    return train_set, val_set


def check_shareable(train_set, world_size=WORLD_SIZE):
    """Every process needs at least one training image: DDP cannot join a rank that never took a step."""
    if len(train_set) < world_size:
        raise DatasetError(f"{train_set.root}: {len(train_set)} training image(s) cannot be shared by {world_size} "
                           f"processes; each needs at least one (use fewer processes or more images)")


def build_dataloader(dataset, batch_size, train, seed, workers, device):
    """DataLoader over this rank's share of dataset (see DistributedShuffleSampler); batch_size is per rank.

    For training the order is shuffled per epoch and each sample's augmentation seeded (see SeededSamples); call
    set_epoch(loader, epoch) before each epoch.
    """
    sampler = DistributedShuffleSampler(len(dataset), RANK, WORLD_SIZE, shuffle=train, seed=seed)
    # Worker w seeds torch, random and numpy with base + w, base drawn per epoch from this (seed, rank) generator;
    # the transforms of training samples draw from SeededSamples' per-sample seeds instead.
    generator = torch.Generator().manual_seed(seed + RANK)
    return DataLoader(SeededSamples(dataset, seed) if train else dataset, batch_size=batch_size, sampler=sampler,
                      num_workers=workers, pin_memory=device.type == "cuda", generator=generator)


def set_epoch(loader, epoch):
    """Point a training loader's order and augmentation at epoch."""
    loader.sampler.set_epoch(epoch)
    loader.dataset.set_epoch(epoch)
