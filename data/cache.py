"""data.cache=ram: a dataset decoded once into one flat uint8 tensor, and batches gathered from it per batch.

Training images are stored no larger than their crops need (store_side: the shorter side bounded from data.img_size
and data.scale, antialiased, never upscaled; CIFAR's padded crop: resized to data.img_size first, which is not
random), each at its own size, and their crop and flip run per batch on the training device (transforms.crop_batch),
drawn from the same per-sample seeds as the per-image path: crop boxes are drawn on each image's original size and
scaled to the stored one, so each sample gets the same crop box and flip either way, and pixels differ only by
interpolation (torchvision's antialiased resize of the stored image against PIL's of the original), so a run stays
exact at any number of processes and on resume. A batch is padded only to its own largest image. Validation images are stored
after their transforms, which are not random: exactly the per-image path's. DataLoader workers, forked, share the
tensor without copying it.

Each process on a machine holds its own copy, so the memory budget (memory_budget) is the least of the memory
available and the container's room, shared by the processes on the machine. Images are decoded straight into
memory reserved for that budget, a few chunks at a time, so building a cache takes the memory of its pixels, not a
second copy (decode_all).

A training RamImages is a SeededBatches (data/batches.py): its batches are cropped on the device by batch_to.
"""

import math
import mmap
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from itertools import islice

import numpy as np
import torch
from torchvision.transforms import v2

from data.batches import SeededBatches
from data.multilabel import multi_hot
from data.transforms import crop_spec
from utils.general import LOGGER, SharedError, colorstr, cpu_count
from utils.memory import MEMORY_SHARE, memory_budget, size_text

MEASURE = "measure"  # RamImages' default budget: memory_budget() when it is made


class RamImages(SeededBatches):
    """A dataset's images, decoded (and with `transform`, transformed) once into one flat uint8 tensor, each image
    (C, H, W) at its own size; loaders fetch whole batches (__getitems__), padded to the batch's largest image. With
    a crop spec (training), images are stored as store_transform makes them, and a batch also holds each sample's
    crop box and flip and the stored image's scale, for crop_batch on the device. budget: the Budget this cache and
    `used` bytes cached before it must fit (None: no check)."""

    def __init__(self, source, transform=None, spec=None, seed=0, budget=MEASURE, used=0):
        self.classes, self.root, self.spec, self.seed = source.classes, source.root, spec, seed
        self.samples = getattr(source, "samples", None)  # image files, where the source has them
        # Multi-label: the source's class-index tuples, made multi-hot per batch (a byte per class and image
        # would be 1.3 GB at ImageNet's size with 1,000 classes)
        self.multilabel = getattr(source, "multilabel", False)
        self.targets = (source.targets if self.multilabel  # a Listing's targets (arrays) or a list
                        else torch.from_numpy(np.asarray(source.targets, dtype=np.int64)))
        store = store_transform(spec) if spec is not None else None
        sizes, self.stored, self.pixels, self.offsets = decode_all(
            source, transform, store, memory_budget() if budget == MEASURE else budget, used)
        # crop_params draws on the size the per-image path crops: the original image's, or for padded crops the
        # resized one, which is the stored one.
        self.sizes = sizes if spec and not spec.padding else self.stored
        self.channels = int(self.offsets[1] // self.stored[0].prod()) if len(self.stored) else 3
        uniform = len(self.stored) and bool((self.stored == self.stored[0]).all())
        self.images = self.pixels.view(-1, self.channels, *self.stored[0].tolist()) if uniform else None
        self.scales = (self.stored / self.sizes).float()  # (N, 2): stored over drawn size, per axis (y, x)

    @property
    def nbytes(self):
        """Bytes the cached images take."""
        return self.pixels.nbytes

    def read(self, ids, index):
        """A batch's (images, targets, sizes, scales) (see SeededBatches): its images padded to the batch's largest
        (gather); for training each image's original size, which its crop box is drawn on, and the (N, 2) scales that
        map it to the stored image."""
        index = torch.from_numpy(index)
        targets = (multi_hot([self.targets[i] for i in index.tolist()], len(self.classes)) if self.multilabel
                   else self.targets[index])
        if self.spec is None:
            return self.gather(index), targets, None, None
        return self.gather(index), targets, self.sizes[index], self.scales[index]

    def gather(self, index):
        """The images of index as one (N, C, H, W) tensor of the batch's largest height and width, each image in
        its top-left corner, the rest zeros (which resized crops never read, and which padded crops take as the
        per-image path's zero padding)."""
        if self.images is not None:  # every image one size: one indexing op
            return self.images[index]
        sizes, pixels, c = self.stored[index], self.pixels.numpy(), self.channels
        height, width = sizes.max(0).values.tolist()
        # numpy: copies of one image are too small to gain from torch's threads, which only contend for the cores.
        batch = np.zeros((len(index), c, height, width), dtype=np.uint8)
        for out, start, (h, w) in zip(batch, self.offsets[index.numpy()].tolist(), sizes.tolist()):
            out[:, :h, :w] = pixels[start : start + c * h * w].reshape(c, h, w)
        return torch.from_numpy(batch)

    def __len__(self):
        return len(self.targets)


def store_side(spec):
    """The most pixels the shorter side of a training image is stored with, for RandomResizedCrop's crops."""
    # Detail over memory: a crop covers at least data.scale[0] of the image's area, so at img_size / sqrt(that)
    # even the smallest crop reads img_size^2 stored pixels or more and is upsampled only where the original is too
    # small itself (at 0.08 that is 3.5 x img_size: ImageNet-sized photos stay whole, larger ones shrink). The
    # 1.15 x img_size of fast loaders would halve a 500x375 photo's bytes at 224 but leave a 0.08 crop about a
    # tenth of img_size^2 pixels, upsampled some 3-fold per side, where the per-image path reads the original.
    return math.ceil(spec.size / math.sqrt(spec.scale[0]))


def store_transform(spec):
    """How training images are stored: for padded crops resized to data.img_size (the per-image path's first
    step), else with a shorter side above store_side(spec) resized down to it (antialiased); smaller ones as they
    are."""
    if spec.padding:
        return v2.Resize(spec.size, antialias=True)
    side = store_side(spec)

    def store(image):
        return v2.functional.resize(image, [side], antialias=True) if min(v2.functional.get_size(image)) > side \
            else image
    return store


def cached_datasets(train_source, val_source, cfg, seed, val_transform):
    """data.cache=ram: the training and validation sets (without transforms) as RamImages, which together must fit
    this process's memory budget."""
    spec, budget = crop_spec(cfg), memory_budget()
    train_set = RamImages(train_source, None, spec, seed, budget)
    val_set = RamImages(val_source, val_transform, budget=budget, used=train_set.nbytes)
    resized = int((train_set.stored != train_set.sizes).any(1).sum()) if not spec.padding else 0
    bound = f" ({resized} resized to a shorter side of {store_side(spec)} px)" if resized else ""
    LOGGER.info(f"{colorstr('data:')} cached {len(train_set)} train and {len(val_set)} val images in memory "
                f"({size_text(train_set.nbytes + val_set.nbytes)} in each process: "
                f"{size_text(per_image(train_set))} per train image{bound}, {size_text(per_image(val_set))} per val "
                f"image; data.cache=ram)")
    return train_set, val_set


def per_image(dataset):
    """Mean bytes an image of a RamImages takes."""
    return dataset.nbytes / max(len(dataset), 1)


def decode_all(source, transform, store, budget, used=0):
    """(sizes, stored, pixels, offsets) of every image of source as uint8 (C, H, W) pixels, after transform and
    store: its (N, 2) (height, width) before store and after, and all its pixels in one flat uint8 tensor, image i at
    offsets[i]:offsets[i + 1]. With a budget, images are written straight into memory reserved for all of it, so
    the cache takes its pixels' size and a few chunks of images in flight; without one (not Linux), they are joined
    at the end, which takes twice that for a moment. An unreadable image raises the loader's error, which names it.
    Stops as soon as used + the images decoded so far outgrow budget, before the machine runs out."""
    sizes, stored = np.zeros((len(source), 2), np.int64), np.zeros((len(source), 2), np.int64)
    offsets = np.zeros(len(source) + 1, np.int64)
    room = None if budget is None else max(int(budget.nbytes - used), 0)
    buffer = reserve(room) if room else None
    out = torch.frombuffer(buffer, dtype=torch.uint8) if buffer is not None else None
    parts = []
    with closing(decoded(source, transform, store)) as images:
        for i, (size, image) in enumerate(images):
            sizes[i], stored[i], end = size, image.shape[1:], offsets[i] + image.numel()
            if room is not None and end > room:
                before = f", {size_text(end + used)} with the {size_text(used)} cached before them" if used else ""
                raise too_big(f"the first {i + 1} of {len(source)} images take {size_text(end)}{before}", budget)
            if out is not None:
                out[offsets[i] : end].view(image.shape).copy_(image)
            else:
                parts.append(image.reshape(-1))  # a copy where the decoder left channels last
            offsets[i + 1] = end
    return torch.from_numpy(sizes), torch.from_numpy(stored), filled(buffer, parts, int(offsets[-1])), offsets


def decoded(source, transform, store, chunk=16):
    """Every image of source as ((height, width) before store, uint8 (C, H, W) tensor after it), in order; decoded
    in chunks of images by a thread per core (decoders release the GIL), two chunks a thread in flight at most, so
    decoded images waiting to be stored take a bounded amount of memory whatever the data set's size."""
    def load(i):
        image = source[i][0]
        image = transform(image) if transform else image
        size = tuple(v2.functional.get_size(image))
        image = store(image) if store else image
        return size, v2.functional.to_image(image).as_subclass(torch.Tensor)

    def load_chunk(start):
        return [load(i) for i in range(start, min(start + chunk, len(source)))]
    threads = cpu_count()
    starts = iter(range(0, len(source), chunk))
    pool = ThreadPoolExecutor(threads)
    try:
        pending = deque(pool.submit(load_chunk, start) for start in islice(starts, 2 * threads))
        while pending:
            images = pending.popleft().result()
            pending.extend(pool.submit(load_chunk, start) for start in islice(starts, 1))
            yield from images
    finally:
        pool.shutdown(cancel_futures=True)


def reserve(nbytes):
    """nbytes of anonymous memory, private to this process and its forks (DataLoader workers read it without
    copying), or None where the system will not reserve that much (strict overcommit). A page takes memory only
    once written, so a cache reserves its whole budget and takes the size of what it stores."""
    try:
        return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError:
        return None


def filled(buffer, parts, nbytes):
    """The flat uint8 tensor of the nbytes stored: buffer's start, the never written rest given back (without a
    buffer, parts joined)."""
    if buffer is None:
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    if nbytes:
        buffer.resize(nbytes)  # shrinks in place (mremap): views of the start stay valid
    return torch.frombuffer(buffer, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)


def too_big(what, budget):
    """The error for a cache that does not fit, with its numbers, where the budget comes from, and the way out."""
    shared = f", shared by the {budget.processes} processes on this machine" if budget.processes > 1 else ""
    return SharedError(f"data.cache=ram: {what}, more than this process's budget of {size_text(budget.nbytes)} "
                       f"({MEMORY_SHARE:.0%} of the {size_text(budget.room)} {budget.source}{shared}); set "
                       f"data.cache=none to decode per image")
