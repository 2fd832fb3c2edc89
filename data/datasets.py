"""Datasets and their loaders: the embedded digits set written as an ImageFolder, a user's dataset root in any layout
(class folders, CSVs or a held-out split: data/layouts.py), or CIFAR-10/100 (data/cifar.py)."""

import os
import shlex
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

import utils.general
from data.batches import SeededBatches, SeededSamples, keep_batch
from data.cache import cached_datasets
from data.cifar import CIFAR, cifar_dataset
from data.jpeg_cache import decodes_on_device, jpeg_datasets
from data.layouts import (CLASS_FOLDERS, CSV_FILES, SPLIT_FILE, VAL_NAMES, HoldOut, Listing, csv_dataset, csv_datasets,
                          either, find_layout, first_present, listed_alike, listed_split, read_split, set_samples,
                          split_files, training_bar)
from data.mix import batch_mixer
from data.multilabel import check_task, positive_weights, write_multidigits
from data.shard_sets import describe, eval_shards, shard_datasets
from data.sampler import BalancedSampler, DistributedShuffleSampler, seed_hash
from data.transforms import crop_spec, train_transforms, val_size, val_transforms
from data.verify import UNREADABLE, decode, unreadable_images, unreadable_reason
from utils.checkpoint import run_dir_of
from utils.config import names_shards
from utils.distributed import on_rank0, topology
from utils.general import LOGGER, RANK, WORLD_SIZE, DatasetError, ImageError, colorstr, short_path
from utils.memory import release_freed_memory
from utils.once import atomic_write, once_per_machine

LARGE_IMAGES = 2  # training images whose median shorter side is this many times the size the model sees are said
SMALL_IMAGES = 3  # ... and those this many times smaller than data.img_size (scaled up: 9x the compute, no detail)


def write_digits(root, report=lambda n: None):
    """Write scikit-learn's 1,797 real 8x8 handwritten digits as a PNG ImageFolder, fixed stratified 80/20 split;
    report(1) after each image."""
    from sklearn.datasets import load_digits  # the images ship inside scikit-learn; nothing is downloaded
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)  # values are 0..16 in the source
    train_idx, val_idx = train_test_split(
        np.arange(len(pixels)), test_size=0.2, stratify=digits.target, random_state=0)
    with atomic_write(root, first_wins=True) as tmp:  # another machine on a shared disk may finish first
        for split, indices in (("train", train_idx), ("val", val_idx)):
            for i in indices:
                folder = tmp / split / str(digits.target[i])
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels[i]).save(folder / f"{i:04d}.png")
                report(1)


# Datasets that ship with our requirements, written on first use.
EMBEDDED = {"digits": write_digits, "multidigits": write_multidigits}


def dataset_root(name):
    """ImageFolder root for data.name: an embedded dataset (written once by local rank 0) or a user directory."""
    if name in EMBEDDED:
        root = utils.general.DATASETS_DIR / name  # read when called: tests point it elsewhere

        def write(report):
            if not root.exists():
                root.parent.mkdir(parents=True, exist_ok=True)
                EMBEDDED[name](root, report)
        once_per_machine("embedded", f"writing {root}", write)  # local rank 0 writes; the others wait, then read
        return root
    root = Path(name)
    if not root.is_dir():
        raise DatasetError(f"data.name '{name}' is neither a dataset here ({', '.join([*EMBEDDED, *CIFAR])}) "
                           f"nor a directory; give the path of a dataset root holding train/<class>/* and "
                           f"val/<class>/*, train.csv and val.csv, or class folders (nothing is downloaded)")
    return root


def split_dir(root, split):
    """root/train, or for split 'val' the first of root/val, root/valid and root/test."""
    names = VAL_NAMES if split == "val" else (split,)
    for name in names:
        if (root / name).is_dir():
            return root / name
    hold_out = f"; or hold out part of train/: data.name={root / 'train'} data.val_split=0.2" if split == "val" else ""
    raise DatasetError(f"{root}: no {either([f'{n}/' for n in names])} folder; an ImageFolder root holds "
                       f"train/<class>/* and val/<class>/* (or valid/, test/){hold_out}")


def load_rgb(path):
    """ImageFolder loader: the decoded RGB image, or an ImageError naming the file (PIL's errors name none)."""
    try:
        return decode(path)
    except UNREADABLE as e:
        raise ImageError(f"{path}: unreadable image ({unreadable_reason(e)}); remove the file, or set "
                         f"data.skip_corrupt=true to check every image before training and skip unreadable "
                         f"ones") from None


class ListedFolder(ImageFolder):
    """torchvision's ImageFolder, its samples a Listing (data/layouts.py) listed one class folder at a time by
    torchvision's own make_dataset: never a list of every image's (path, class), which at ImageNet's size is some
    200 MB of Python objects that the allocator keeps, in part, once freed."""

    @staticmethod
    def make_dataset(directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        listing = Listing.joined(directory, [
            Listing.of(directory, ImageFolder.make_dataset(directory, {name: class_to_idx[name]}, extensions,
                                                           is_valid_file, True))
            for name in sorted(class_to_idx)])  # make_dataset's order
        if not allow_empty and not len(listing):
            raise FileNotFoundError(f"Found no valid file in {directory}")
        return listing


def image_folder(folder, transform):
    """torchvision ImageFolder read with load_rgb, its samples a Listing (ListedFolder), with errors that name the
    folder and what it must hold."""
    try:
        dataset = ListedFolder(str(folder), transform=transform, loader=load_rgb, allow_empty=True)
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
    set_samples(dataset, dataset.samples)  # its targets and imgs read from the Listing too
    return dataset


def labelled_as(dataset, classes, unknown_means):
    """An ImageFolder relabelled with the indices of classes (those of training, which it may have fewer of); a
    class folder not among them is an error whose message ends with unknown_means."""
    unknown = sorted(set(dataset.classes) - set(classes))
    if unknown:
        raise DatasetError(f"{dataset.root}: classes {unknown} {unknown_means}")
    if dataset.classes != list(classes):
        index = {name: i for i, name in enumerate(classes)}
        set_samples(dataset, dataset.samples.relabelled([index[name] for name in dataset.classes]))
        dataset.classes, dataset.class_to_idx = list(classes), index
    return dataset


def eval_dataset(root, split, transform, classes, weights, allow_outside=False):
    """root's split (train, val or test) labelled with the classes a checkpoint (weights) was trained on, in any
    layout (data/layouts.py); a root of class folders as split by data.val_split, in the checkpoint's run. Every
    rank lists it, and must list the same (listed_alike)."""
    layout, unknown_means = find_layout(root), f"not among the {len(classes)} classes {weights} was trained on"
    if layout == CSV_FILES:
        names = [f"{name}.csv" for name in (VAL_NAMES if split == "val" else (split,))]
        return listed_alike(root, lambda: (csv_dataset(first_present(root, names, "to evaluate"), transform, load_rgb,
                                                       classes, f"is {unknown_means}", allow_outside,
                                                       training_bar(root)),))[0]
    if layout == CLASS_FOLDERS:
        record, path = saved_split(root, split, weights)  # read by rank 0, outside listed_alike: a collective
        return listed_alike(root, lambda: (listed_split(root, record, split, transform, load_rgb, classes, path),))[0]
    return listed_alike(root, lambda: (split_folder(root, split, transform, classes, f"are {unknown_means}"),))[0]


def split_folder(root, split, transform, classes, unknown_means):
    """root's split (train, val or test) folder as an ImageFolder labelled with classes (labelled_as)."""
    folder = root / split if split != "val" else split_dir(root, "val")
    if not folder.is_dir():
        raise DatasetError(f"{root}: no {split}/ folder (an ImageFolder root holds train/, val/ or test/, each "
                           f"with one folder per class)")
    return labelled_as(image_folder(folder, transform), classes, unknown_means)


def saved_split(root, split, weights):
    """val.py on a root of class folders: (the split record the checkpoint's run saved, its path)."""
    if split == "test":
        raise DatasetError(f"{root}: no test split; data.val_split splits a folder of class folders into train and "
                           f"val only")
    path = run_dir_of(weights) / SPLIT_FILE
    return read_split(path, f"val.py reads {root}, a folder of class folders, as the run that trained {weights} "
                            f"split it: keep the checkpoint in its run's weights/ folder, or give --data a root "
                            f"with a val/ folder (its test/ folder: --data ROOT --split test)"), path


def skip_unreadable(dataset):
    """Drop a dataset's unreadable images (each decoded once, see data/verify.py); return them as {path: reason}."""
    folder = Path(dataset.root)
    paths = [path for path, _ in dataset.samples]
    # An ImageFolder's split keeps them beside its folder; listed images (CSV, data.val_split) name their own file.
    cache_file = getattr(dataset, "verify_cache", folder.parent / f".verified-{folder.name}.json")
    bad = unreadable_images(folder, paths, cache_file)
    if len(bad) == len(paths):
        path, reason = next(iter(bad.items()))
        raise DatasetError(f"{folder}: none of its {len(bad)} images is readable (e.g. {path}: {reason}); replace "
                           f"them with readable images")
    set_samples(dataset, dataset.samples.taken([path not in bad for path in paths]))  # class indices unchanged
    return bad


def skipped_message(skipped, shown=20):
    """One warning listing the skipped images: the first `shown` with their reasons, then how many more."""
    lines = [f"  {path}: {reason}" for path, reason in list(skipped.items())[:shown]]
    if len(skipped) > shown:
        lines.append(f"  ... and {len(skipped) - shown} more")
    header = f"{colorstr('data:')} skipping {len(skipped)} unreadable image(s) (data.skip_corrupt=true):"
    return "\n".join([header, *lines])


def build_datasets(root, train_transform, val_transform, skip_corrupt=False, hold_out=None, allow_outside=False):
    """Train and val datasets of a root in any layout (data/layouts.py): train/ and the first of val/, valid/ and
    test/ as ImageFolders, train.csv and val.csv (allow_outside: data.csv_allow_outside), or class folders split by
    data.val_split (hold_out, a HoldOut); rank 0 logs which. Every rank lists them, and must list the same
    (listed_alike). Unreadable images dropped if skip_corrupt; val labels follow train's class indices (val may
    lack some classes)."""
    hold_out = hold_out or HoldOut()
    layout = find_layout(root, hold_out.share)
    if layout == CSV_FILES:
        train_set, val_set = listed_alike(root, csv_datasets, root, train_transform, val_transform, load_rgb,
                                          allow_outside)
        used = f"training on train.csv, validating on {val_set.name}.csv"
    elif layout == CLASS_FOLDERS:
        record, source, used = held_out_split(root, hold_out)  # rank 0's, outside listed_alike: a collective
        train_set, val_set = listed_alike(root, split_datasets, root, record, source, train_transform, val_transform)
    else:
        train_set, val_set = listed_alike(root, folder_datasets, root, train_transform, val_transform)
        used = f"training on train/, validating on {Path(val_set.root).name}/"
    LOGGER.info(f"{colorstr('data:')} {short_path(root)}: {used}")  # LOGGER prints on rank 0 alone
    if skip_corrupt:
        skipped = {**skip_unreadable(train_set), **skip_unreadable(val_set)}
        if skipped and RANK == 0:  # every rank skipped the same files
            LOGGER.warning(skipped_message(skipped))
    return train_set, val_set


def folder_datasets(root, train_transform, val_transform):
    """The train and val ImageFolders of a root of split folders: train/ and the first of val/, valid/ and test/."""
    train_dir = split_dir(root, "train")
    train_set = image_folder(train_dir, train_transform)
    return train_set, labelled_as(image_folder(split_dir(root, "val"), val_transform), train_set.classes,
                                  f"have no training images in {train_dir}")


def split_datasets(root, record, source, train_transform, val_transform):
    """The train and val sets of a data.val_split record (held_out_split) of a root of class folders."""
    return tuple(listed_split(root, record, which, transform, load_rgb, record["classes"], source)
                 for which, transform in (("train", train_transform), ("val", val_transform)))


def held_out_split(root, hold_out):
    """data.val_split's (split record, its source, how it was made) for a root of class folders: split afresh by
    rank 0, whose lists every rank takes (one split, even while files are being added), or as the resumed run
    saved it."""
    if hold_out.saved_in is None:
        record = on_rank0(lambda: split_files(image_folder(root, None), hold_out.share, hold_out.seed))
        source, used = root, (f"data.val_split={hold_out.share} of each class's images held out for val (seed "
                              f"{hold_out.seed}); the run saves this split as {SPLIT_FILE}")
    else:
        source = hold_out.saved_in / SPLIT_FILE
        record = read_split(source, "without it the resumed run cannot go on with the same split; start a new run")
        used = f"the run's split, from {source}"
    return record, source, used


def train_val_datasets(name, train_transform, val_transform, skip_corrupt=False, hold_out=None, allow_outside=False):
    """The train and val datasets data.name names: CIFAR-10/100's training and test sets, or those of a dataset
    root (embedded or the user's) in any layout (build_datasets)."""
    if name in CIFAR:  # read from their own file format under datasets/ (data/cifar.py)
        if hold_out and hold_out.share:
            raise DatasetError(f"data.val_split={hold_out.share}: {name} validates on its own test set; set "
                               f"data.val_split=0")
        return cifar_dataset(name, True, train_transform), cifar_dataset(name, False, val_transform)
    return build_datasets(dataset_root(name), train_transform, val_transform, skip_corrupt, hold_out, allow_outside)


def training_datasets(cfg, seed, saved_in=None, device=torch.device("cpu")):
    """The train and val sets of a recipe's data section: transformed per image as loaded, or with data.cache=ram
    decoded once into memory (RamImages), or with data.cache=jpeg read from one file per split (JpegImages),
    training's crop and flip then drawn per batch on device. saved_in: a resumed run's directory, whose saved
    data.val_split split is reused (see data/layouts.py)."""
    if names_shards(cfg.name):  # read by batches, cropped from the per-sample seeds as the JPEG cache's are
        train_set, val_set = shard_datasets(cfg, seed, crop_spec(cfg), decodes_on_device(cfg, device),
                                            val_transforms(cfg), topology().local_rank == 0)
        LOGGER.info(f"{colorstr('data:')} {cfg.name}: {describe(train_set, val_set)}")
        return train_set, val_set
    hold_out = HoldOut(cfg.val_split, seed, saved_in)
    if cfg.cache == "none":
        train_set, val_set = train_val_datasets(cfg.name, train_transforms(cfg), val_transforms(cfg), cfg.skip_corrupt,
                                                hold_out, cfg.csv_allow_outside)
        check_task(train_set, cfg.multilabel, cfg.name, val_set)
        return train_set, val_set
    train_source, val_source = train_val_datasets(cfg.name, None, None, cfg.skip_corrupt, hold_out,
                                                  cfg.csv_allow_outside)
    check_task(train_source, cfg.multilabel, cfg.name, val_source)  # before decoding every image
    if cfg.cache == "jpeg":
        return jpeg_datasets(train_source, val_source, cfg, seed, val_transforms(cfg), device, topology())
    return cached_datasets(train_source, val_source, cfg, seed, val_transforms(cfg))


def training_data(cfg, device, workers, saved_in=None):
    """A recipe's (train_set, val_set, train_loader, val_loader, mix): the datasets (training_datasets), MixUp and
    CutMix (None unless on), and loaders over this rank's shares with `workers` workers each (see build_dataloader).
    saved_in: a resumed run's directory, whose data.val_split split is reused. Rank 0 says when the training images
    are much larger or smaller than the model sees them (image_size_note) and when one step is the whole epoch."""
    train_set, val_set = training_datasets(cfg.data, cfg.seed, saved_in, device)
    release_freed_memory()  # what listing them freed, which every DataLoader worker would otherwise inherit
    if RANK == 0 and (note := image_size_note(train_set, cfg.data)):  # a fact, sometimes meant (photos at 224 px)
        LOGGER.info(note)
    mix = batch_mixer(cfg.data, len(train_set.classes), cfg.seed)
    check_shareable(train_set, WORLD_SIZE, cfg.train.batch_size, cfg.data.drop_last, pairs=mix is not None)
    train_loader = build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, device,
                                    cfg.data.drop_last, pairs=mix is not None, repeats=cfg.data.repeats,
                                    balanced=cfg.data.sampler == "balanced")
    if train_loader.sampler.step_samples(0) < cfg.train.batch_size and RANK == 0:
        LOGGER.warning(f"train.batch_size={cfg.train.batch_size} is more than the epoch's "
                       f"{train_loader.sampler.size} training images: each epoch is one step of them all")
    val_loader = build_dataloader(val_set, cfg.train.batch_size, False, cfg.seed, workers, device)
    return train_set, val_set, train_loader, val_loader, mix


def image_size_note(dataset, cfg, sample=64):
    """The line for training images whose median shorter side is LARGE_IMAGES times the larger of data.img_size
    and data.val_img_size or more (56 px images at the recipe's 16 px), or SMALL_IMAGES times smaller than
    data.img_size or more (28 px digits at 160 px), else None: they are scaled to it, which may be meant (photos at
    224 px) but is easily missed, and small images scaled up cost the square of the factor in compute for no new
    detail. The sizes come from the cache's decode (or a shard index) where there is one, else from the headers of
    up to `sample` of the image files (no decoding); None where neither is at hand (CIFAR's arrays)."""
    sides = shorter_sides(dataset, sample)
    seen = max(cfg.img_size, val_size(cfg))
    if sides is None or not len(sides):
        return None
    median = int(np.median(sides))
    if median >= LARGE_IMAGES * seen:
        return (f"{colorstr('data:')} the training images are much larger than the model sees them: median shorter "
                f"side {median} px, scaled down to data.img_size={cfg.img_size} (val: {val_size(cfg)} px); set "
                f"data.img_size if that is not meant")
    if median * SMALL_IMAGES <= cfg.img_size:
        return (f"{colorstr('data:')} the training images are much smaller than the model sees them: median shorter "
                f"side {median} px, scaled up to data.img_size={cfg.img_size}, {(cfg.img_size / median) ** 2:.0f}x "
                f"the pixels to compute on and no more detail; at their own size they train as well in a fraction "
                f"of the time, e.g. recipes/cls.yaml's small convnet: --recipe cls.yaml "
                f"data.name={shlex.quote(cfg.name)} data.img_size={median}")
    return None


def shorter_sides(dataset, sample=64):
    """The shorter sides of a training set's images, before cropping: every one where a cache or shard index holds
    their sizes, else those of up to `sample` image files spread over the set, read from their headers; None where
    neither is at hand."""
    sizes = getattr(dataset, "sizes", None)
    if sizes is None and hasattr(dataset, "split"):  # a shard set's index
        sizes = getattr(dataset.split, "sizes", None)
    padded = getattr(getattr(dataset, "spec", None), "padding", 0)  # RamImages stored padded crops' images resized
    if sizes is not None and not padded:
        return sizes.min(1).values.numpy()
    samples = getattr(dataset, "samples", None)
    if not samples:
        return None
    sides = []
    for path, _ in samples[:: max(1, len(samples) // sample)][:sample]:
        try:
            with Image.open(path) as image:  # the header alone: nothing is decoded
                sides.append(min(image.size))
        except UNREADABLE:  # said where the image is read
            continue
    return np.array(sides)


def input_feed(cfg, device):
    """What the DataLoader workers of data.cache do, for set_threads: decode "files" (or the JPEG cache's JPEGs),
    gather batches from "memory" (the RAM cache), or read "bytes" (the JPEG cache's, decoded on device)."""
    if cfg.cache == "ram":
        return "memory"
    jpegs = cfg.cache == "jpeg" or names_shards(cfg.name)
    return "bytes" if jpegs and decodes_on_device(cfg, device) else "files"


def named_eval_dataset(name, split, transform, classes, weights, allow_outside=False, cache_dir="", shard_hosts=()):
    """data.name's split (train, val or test) labelled with the classes a checkpoint (weights) was trained on;
    CIFAR's val is its test set. allow_outside: data.csv_allow_outside; cache_dir, shard_hosts: data.cache_dir (a
    shard set's node cache), data.shard_hosts."""
    if names_shards(name):
        return eval_shards(name, split, transform, classes, weights, cache_dir, list(shard_hosts),
                           topology().local_rank == 0)
    if name not in CIFAR:
        return eval_dataset(dataset_root(name), split, transform, classes, weights, allow_outside)
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


def build_dataloader(dataset, batch_size, train, seed, workers, device, drop_last=False, pairs=False, repeats=1,
                     balanced=False):
    """DataLoader over this rank's share of dataset (see DistributedShuffleSampler); batch_size is global.

    For training the order is shuffled per epoch and each sample's augmentation seeded: a training set is read a
    batch at a time as a SeededBatches (data/batches.py), a dataset of image files or arrays through SeededSamples;
    call set_epoch(loader, epoch) before each epoch. With pairs, consecutive samples of the order come in pairs on
    one rank (for MixUp and CutMix); repeats > 1 is repeated augmentation; balanced draws each class equally often
    (BalancedSampler, from dataset.targets).
    """
    options = dict(rank=RANK, world_size=WORLD_SIZE, shuffle=train, seed=seed, batch_size=batch_size,
                   drop_last=train and drop_last, group=2 if pairs else 1, repeats=repeats if train else 1,
                   windows=getattr(dataset, "windows", None) if train else None)
    sampler = (BalancedSampler(dataset.targets, **options) if train and balanced
               else DistributedShuffleSampler(len(dataset), **options))
    # Worker w seeds torch, random and numpy with base + w, base drawn from this generator, which set_epoch
    # reseeds from (seed, epoch, rank); the augmentation of training samples draws from their own seeds instead.
    generator = torch.Generator().manual_seed(seed_hash(seed, 0, RANK))
    if train and not isinstance(dataset, SeededBatches):
        dataset = SeededSamples(dataset, seed)
    batched = hasattr(dataset, "__getitems__")  # every training set, and the caches' validation sets
    return DataLoader(dataset, batch_size=batch_size // WORLD_SIZE, sampler=sampler, num_workers=workers,
                      collate_fn=keep_batch if batched else None, pin_memory=device.type == "cuda",
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


def balanced_class_weights(dataset):
    """train.class_weights=balanced, scikit-learn's: class c weighs n / (k * count_c), for n images in k classes
    that have any, so the weights of the n images average 1 and a weighted loss keeps the unweighted one's scale.
    A class without images weighs 0. Multi-label data: each class's positive weight (positive_weights)."""
    if getattr(dataset, "multilabel", False):
        return positive_weights(dataset)
    targets = torch.from_numpy(np.asarray(dataset.targets, dtype=np.int64))  # a list, or a Listing's (an array)
    counts = torch.bincount(targets, minlength=len(dataset.classes))
    weights = len(dataset) / (counts.count_nonzero() * counts.double())  # inf where count_c is 0: replaced
    return torch.where(counts > 0, weights, 0.0).float()
