"""Datasets and their loaders: the embedded digits set written as an ImageFolder, any user ImageFolder, or CIFAR-10/100
(data/cifar.py)."""

import os
import shutil
import socket
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

import utils.general
from data.cache import RamImages, cached_datasets, keep_batch
from data.cifar import CIFAR, cifar_dataset
from data.sampler import DistributedShuffleSampler, SeededSamples, seed_hash
from data.transforms import train_transforms, val_transforms
from data.verify import UNREADABLE, decode, unreadable_images, unreadable_reason
from utils.distributed import torch_distributed_zero_first
from utils.general import LOCAL_RANK, LOGGER, RANK, WORLD_SIZE, DatasetError, ImageError, colorstr


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
        root = utils.general.DATASETS_DIR / name  # read when called: tests point it elsewhere
        with torch_distributed_zero_first(LOCAL_RANK):  # local rank 0 writes; the others wait, then read
            if not root.exists():
                root.parent.mkdir(parents=True, exist_ok=True)
                EMBEDDED[name](root)
        return root
    root = Path(name)
    if not root.is_dir():
        raise DatasetError(f"data.name '{name}' is neither a dataset here ({', '.join([*EMBEDDED, *CIFAR])}) "
                           f"nor a directory; give the path of an ImageFolder root holding train/<class>/* and "
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


def load_rgb(path):
    """ImageFolder loader: the decoded RGB image, or an ImageError naming the file (PIL's errors name none)."""
    try:
        return decode(path)
    except UNREADABLE as e:
        raise ImageError(f"{path}: unreadable image ({unreadable_reason(e)}); remove the file, or set "
                         f"data.skip_corrupt=true to check every image before training and skip unreadable "
                         f"ones") from None


def image_folder(folder, transform):
    """torchvision ImageFolder read with load_rgb, with errors that name the folder and what it must hold."""
    try:
        dataset = ImageFolder(str(folder), transform=transform, loader=load_rgb, allow_empty=True)
    except FileNotFoundError:  # torchvision's find_classes: no class folders
        raise DatasetError(f"{folder}: no class folders; an ImageFolder split holds one folder per class with that "
                           f"class's images in it ({folder}/<class>/*.jpg|png|...)") from None
    except OSError as e:
        raise DatasetError(f"{folder}: cannot be listed ({e.strerror or e})") from None
    counts = Counter(dataset.targets)
    empty = [str(folder / name) for i, name in enumerate(dataset.classes) if not counts[i]]
    if empty:
        raise DatasetError(f"{', '.join(empty)}: no image files ({', '.join(IMG_EXTENSIONS)}); add images to each "
                           f"class folder or remove the empty one(s)")
    return dataset


def labelled_as(dataset, classes, unknown_means):
    """An ImageFolder relabelled with the indices of classes (those of training, which it may have fewer of); a
    class folder not among them is an error whose message ends with unknown_means."""
    unknown = sorted(set(dataset.classes) - set(classes))
    if unknown:
        raise DatasetError(f"{dataset.root}: classes {unknown} {unknown_means}")
    if dataset.classes != list(classes):
        index = {name: i for i, name in enumerate(classes)}
        set_samples(dataset, [(path, index[dataset.classes[i]]) for path, i in dataset.samples])
        dataset.classes, dataset.class_to_idx = list(classes), index
    return dataset


def eval_dataset(root, split, transform, classes, weights):
    """root's split (train, val or test) labelled with the classes a checkpoint (weights) was trained on."""
    folder = root / split if split != "val" else split_dir(root, "val")
    if not folder.is_dir():
        raise DatasetError(f"{root}: no {split}/ folder (an ImageFolder root holds train/, val/ or test/, each "
                           f"with one folder per class)")
    return labelled_as(image_folder(folder, transform), classes,
                       f"are not among the {len(classes)} classes {weights} was trained on")


def skip_unreadable(dataset):
    """Drop a dataset's unreadable images (each decoded once, see data/verify.py); return them as {path: reason}."""
    folder = Path(dataset.root)
    paths = [path for path, _ in dataset.samples]
    bad = unreadable_images(folder, paths, folder.parent / f".verified-{folder.name}.json")
    if len(bad) == len(paths):
        path, reason = next(iter(bad.items()))
        raise DatasetError(f"{folder}: none of its {len(bad)} images is readable (e.g. {path}: {reason}); replace "
                           f"them with readable images")
    set_samples(dataset, [(path, i) for path, i in dataset.samples if path not in bad])  # class indices unchanged
    return bad


def set_samples(dataset, samples):
    """Give an ImageFolder new (path, class index) samples, its imgs and targets to match."""
    dataset.samples = samples
    dataset.imgs, dataset.targets = samples, [i for _, i in samples]


def skipped_message(skipped, shown=20):
    """One warning listing the skipped images: the first `shown` with their reasons, then how many more."""
    lines = [f"  {path}: {reason}" for path, reason in list(skipped.items())[:shown]]
    if len(skipped) > shown:
        lines.append(f"  ... and {len(skipped) - shown} more")
    header = f"{colorstr('data:')} skipping {len(skipped)} unreadable image(s) (data.skip_corrupt=true):"
    return "\n".join([header, *lines])


def build_datasets(root, train_transform, val_transform, skip_corrupt=False):
    """Train and val ImageFolders, unreadable images dropped if skip_corrupt; val labels follow train's class
    indices (val may lack some classes)."""
    train_set = image_folder(split_dir(root, "train"), train_transform)
    val_set = labelled_as(image_folder(split_dir(root, "val"), val_transform), train_set.classes,
                          f"have no training images in {split_dir(root, 'train')}")
    if skip_corrupt:
        skipped = {**skip_unreadable(train_set), **skip_unreadable(val_set)}
        if skipped and RANK == 0:  # every rank skipped the same files
            LOGGER.warning(skipped_message(skipped))
    return train_set, val_set


def train_val_datasets(name, train_transform, val_transform, skip_corrupt=False):
    """The train and val datasets data.name names: CIFAR-10/100's training and test sets, or an ImageFolder's
    (embedded or the user's) train/ and val/ folders."""
    if name in CIFAR:  # read from their own file format under datasets/ (data/cifar.py)
        return cifar_dataset(name, True, train_transform), cifar_dataset(name, False, val_transform)
    return build_datasets(dataset_root(name), train_transform, val_transform, skip_corrupt)


def training_datasets(cfg, seed):
    """The train and val sets of a recipe's data section: transformed per image as loaded, or with data.cache=ram
    decoded once into memory (RamImages), training's crop and flip then drawn per batch."""
    if cfg.cache != "ram":
        return train_val_datasets(cfg.name, train_transforms(cfg), val_transforms(cfg), cfg.skip_corrupt)
    train_source, val_source = train_val_datasets(cfg.name, None, None, cfg.skip_corrupt)
    return cached_datasets(train_source, val_source, cfg, seed, val_transforms(cfg))


def named_eval_dataset(name, split, transform, classes, weights):
    """data.name's split (train, val or test) labelled with the classes a checkpoint (weights) was trained on;
    CIFAR's val is its test set."""
    if name not in CIFAR:
        return eval_dataset(dataset_root(name), split, transform, classes, weights)
    dataset = cifar_dataset(name, split == "train", transform)
    if dataset.classes != list(classes):
        raise DatasetError(f"{name}: its {len(dataset.classes)} classes are not the {len(classes)} classes {weights} "
                           f"was trained on")
    return dataset


def check_shareable(train_set, world_size=WORLD_SIZE, batch_size=1, drop_last=False, pairs=False):
    """Every process needs at least one training image (a pair of them with MixUp or CutMix, which the sampler
    deals two by two): DDP cannot join a rank that never took a step; with drop_last, the epoch needs one whole
    global batch."""
    needed = 2 * world_size - 1 if pairs else world_size  # pairs: the last process may hold the odd one alone
    if len(train_set) < needed:
        each = "a pair (MixUp and CutMix mix pairs on one process)" if pairs else "one"
        raise DatasetError(f"{train_set.root}: {len(train_set)} training image(s) cannot be shared by {world_size} "
                           f"processes; each needs at least {each} (use fewer processes or more images)")
    if drop_last and len(train_set) < batch_size:
        raise DatasetError(f"{train_set.root}: data.drop_last=true drops every step: {len(train_set)} training "
                           f"image(s) are fewer than one global batch (train.batch_size={batch_size})")


def build_dataloader(dataset, batch_size, train, seed, workers, device, drop_last=False, pairs=False, repeats=1):
    """DataLoader over this rank's share of dataset (see DistributedShuffleSampler); batch_size is global.

    For training the order is shuffled per epoch and each sample's augmentation seeded (see SeededSamples); call
    set_epoch(loader, epoch) before each epoch. With pairs, consecutive samples of the order come in pairs on one
    rank (for MixUp and CutMix); repeats > 1 is repeated augmentation. A RamImages dataset gathers whole batches
    itself (and seeds its training crops the same way).
    """
    sampler = DistributedShuffleSampler(len(dataset), RANK, WORLD_SIZE, shuffle=train, seed=seed,
                                        batch_size=batch_size, drop_last=train and drop_last, group=2 if pairs else 1,
                                        repeats=repeats if train else 1)
    # Worker w seeds torch, random and numpy with base + w, base drawn from this generator, which set_epoch
    # reseeds from (seed, epoch, rank); the transforms of training samples draw from SeededSamples' seeds instead.
    generator = torch.Generator().manual_seed(seed_hash(seed, 0, RANK))
    cached = isinstance(dataset, RamImages)
    return DataLoader(SeededSamples(dataset, seed) if train and not cached else dataset,
                      batch_size=batch_size // WORLD_SIZE, sampler=sampler, num_workers=workers,
                      collate_fn=keep_batch if cached else None, pin_memory=device.type == "cuda",
                      generator=generator, worker_init_fn=leave_process_group)


def leave_process_group(worker_id):
    """Move a DataLoader worker into a process group of its own: Ctrl-C and a scheduler's SIGTERM to the launch's
    group then reach the main process alone, which stops at a step boundary and ends its workers (a worker they
    ended would crash the main process instead). A worker whose main process dies exits by itself."""
    os.setpgrp()


def set_epoch(loader, epoch, start_step=0):
    """Point a training loader's order and augmentation at epoch, skipping its first start_step steps."""
    loader.sampler.set_epoch(epoch, start_step)
    loader.dataset.set_epoch(epoch)
    loader.generator.manual_seed(seed_hash(loader.sampler.seed, epoch, RANK))  # a resumed epoch draws the same
