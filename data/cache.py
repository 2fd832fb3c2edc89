"""data.cache=ram: a dataset decoded once into one uint8 tensor, and batches gathered from it by indexing.

Training images are stored as decoded (CIFAR's padded crop: resized to data.img_size first, which is not random),
and their crop and flip run per batch on the training device (transforms.crop_batch), drawn from the same
per-sample seeds as the per-image path: each sample gets the same crop box and flip either way, and pixels differ
only by interpolation (roi_align against PIL's resize), so a run stays exact at any number of processes and on
resume. Validation images are stored after their transforms, which are not random: exactly the per-image path's.
DataLoader workers, forked, share the tensor without copying it.
"""

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from torchvision.transforms import v2

from data.sampler import sample_seed
from data.transforms import crop_batch, crop_params, crop_spec
from utils.general import LOGGER, SharedError, colorstr, cpu_count

MEMORY_SHARE = 0.8  # of the memory available at start-up that the cache may take


class RamImages(Dataset):
    """A dataset's images, decoded (and with `transform`, transformed) once into one uint8 (N, C, H, W) tensor,
    smaller images padded to the largest; loaders fetch whole batches (__getitems__). With a crop spec (training),
    a batch also holds each sample's crop box and flip, for crop_batch on the device."""

    def __init__(self, source, transform=None, spec=None, seed=0):
        self.classes, self.root, self.spec, self.seed, self.epoch = source.classes, source.root, spec, seed, 0
        self.samples = getattr(source, "samples", None)  # image files, where the source has them
        self.targets = torch.as_tensor(source.targets, dtype=torch.int64)
        images = decode_all(source, transform)
        self.sizes = torch.tensor([image.shape[1:] for image in images])
        self.images = stack_padded(images, self.sizes, edge=spec is not None and not spec.padding)

    def set_epoch(self, epoch):
        """Choose the epoch whose crops the next batches draw (workers are not persistent: each epoch sees it)."""
        self.epoch = epoch

    def __getitems__(self, ids):
        """A batch of ids (copy k of image i is id i + k * len(self), as SeededSamples'): (images, targets), and
        for training the (N, 5) crop params drawn from each id's seed for this epoch."""
        ids = np.asarray(ids, dtype=np.uint64)
        index = torch.from_numpy((ids % len(self)).astype(np.int64))
        if self.spec is None:
            return self.images[index], self.targets[index]
        sizes = self.sizes[index]
        params = crop_params(sample_seed(self.seed, self.epoch, ids), sizes[:, 0], sizes[:, 1], self.spec)
        return self.images[index], self.targets[index], torch.from_numpy(params)

    def __getitem__(self, i):
        return tuple(value[0] for value in self.__getitems__([i]))

    def __len__(self):
        return len(self.targets)


def cached_datasets(train_source, val_source, cfg, seed, val_transform):
    """data.cache=ram: the training and validation sets (without transforms) as RamImages."""
    spec = crop_spec(cfg)
    store = v2.Resize(cfg.img_size, antialias=True) if spec.padding else None  # padded crops take resized images
    train_set = RamImages(train_source, store, spec, seed)
    val_set = RamImages(val_source, val_transform)
    megabytes = (train_set.images.nbytes + val_set.images.nbytes) / 2**20
    LOGGER.info(f"{colorstr('data:')} cached {len(train_set)} train and {len(val_set)} val images in memory "
                f"({megabytes:.1f} MB; data.cache=ram)")
    return train_set, val_set


def decode_all(source, transform):
    """Every image of source as a uint8 (C, H, W) tensor, decoded by a thread per core (decoders release the
    GIL); an unreadable image raises the loader's error, which names it. Stops as soon as the images decoded so
    far outgrow the memory available, before the machine runs out."""
    def load(i):
        image = source[i][0]
        return v2.functional.to_image(transform(image) if transform else image).as_subclass(torch.Tensor)
    images, nbytes, budget = [], 0, memory_budget()
    with ThreadPoolExecutor(cpu_count()) as pool:
        for image in pool.map(load, range(len(source))):
            images.append(image)
            nbytes += image.nbytes
            if budget is not None and nbytes > budget:
                pool.shutdown(cancel_futures=True)
                raise too_big(f"the first {len(images)} of {len(source)} images take {nbytes / 2**30:.1f} GiB",
                              budget)
    return images


def stack_padded(images, sizes, edge=False):
    """One (N, C, H, W) tensor of the largest height and width, each image in its top-left corner; the rest is
    zeros, or with edge its border pixels repeated (so that interpolating at a crop's edge reads the image's own
    edge, not black)."""
    height, width = sizes.max(0).values.tolist()
    check_memory(len(images) * images[0].shape[0] * height * width)
    stacked = torch.zeros(len(images), images[0].shape[0], height, width, dtype=torch.uint8)
    for i, image in enumerate(images):
        h, w = image.shape[1:]
        if edge and (h, w) != (height, width):
            image = F.pad(image[None].float(), (0, width - w, 0, height - h), mode="replicate")[0]
        stacked[i, :, : image.shape[1], : image.shape[2]] = image
    return stacked


def memory_budget():
    """Bytes the cache may take: MEMORY_SHARE of the memory available now (None where that cannot be read)."""
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else None
    return MEMORY_SHARE * pages * os.sysconf("SC_PAGE_SIZE") if pages else None


def check_memory(nbytes):
    """Refuse a cache of nbytes that would not fit in the memory available now."""
    budget = memory_budget()
    if budget is not None and nbytes > budget:
        raise too_big(f"the decoded images need {nbytes / 2**30:.1f} GiB", budget)


def too_big(what, budget):
    """The error for a cache that does not fit, naming the key and the way out."""
    available = budget / MEMORY_SHARE / 2**30
    return SharedError(f"data.cache=ram: {what}, more than {MEMORY_SHARE:.0%} of the {available:.1f} GiB of memory "
                       f"available; set data.cache=none to decode per image")


def keep_batch(batch):
    """collate_fn for RamImages, whose __getitems__ already returns whole batches."""
    return batch


def batch_to(batch, device, spec):
    """A loader's batch on device as (uint8 images, targets); the RAM cache's training batches are cropped and
    flipped there (crop_batch)."""
    images, targets, *params = (tensor.to(device, non_blocking=True) for tensor in batch)
    return (crop_batch(images, params[0], spec) if params else images), targets
