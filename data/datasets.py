"""A recipe's training and validation data: the samples data.name has (data/sources.py) joined with how they are
stored and read (the image files themselves, data.cache=ram: data/cache.py, data.cache=jpeg: data/jpeg_cache.py, a
shard set: data/shard_sets.py) and with the transforms, and the loaders over each rank's share (every training set a
SeededBatches: data/batches.py)."""

import os
import shlex

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from data.batches import SeededBatches, SeededSamples, keep_batch
from data.cache import cached_datasets
from data.jpeg_cache import decodes_on_device, jpeg_datasets
from data.layouts import HoldOut
from data.mix import batch_mixer
from data.multilabel import check_task, positive_weights
from data.shard_sets import describe, shard_datasets
from data.sampler import BalancedSampler, DistributedShuffleSampler, seed_hash
from data.sources import train_val_datasets
from data.transforms import crop_spec, train_transforms, val_size, val_transforms
from data.verify import UNREADABLE
from utils.config import names_shards
from utils.distributed import topology
from utils.general import LOGGER, RANK, WORLD_SIZE, DatasetError, colorstr
from utils.memory import release_freed_memory

LARGE_IMAGES = 2  # training images whose median shorter side is this many times the size the model sees are said
SMALL_IMAGES = 3  # ... and those this many times smaller than data.img_size (scaled up: 9x the compute, no detail)


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
    batched = isinstance(dataset, SeededBatches)  # every training set, and the caches' validation sets
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
