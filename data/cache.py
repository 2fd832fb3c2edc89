"""data.cache=ram: a dataset decoded once into one flat uint8 tensor, and batches gathered from it per batch.

Training images are stored no larger than their crops need (store_side: the shorter side bounded from data.img_size
and data.scale, antialiased, never upscaled; CIFAR's padded crop: resized to data.img_size first, which is not
random), each at its own size, and their crop and flip run per batch on the training device (transforms.crop_batch),
drawn from the same per-sample seeds as the per-image path: crop boxes are drawn on each image's original size and
scaled to the stored one, so each sample gets the same crop box and flip either way, and pixels differ only by
interpolation (roi_align on the stored image against PIL's resize of the original), so a run stays exact at any
number of processes and on resume. A batch is padded only to its own largest image. Validation images are stored
after their transforms, which are not random: exactly the per-image path's. DataLoader workers, forked, share the
tensor without copying it.

Each process on a machine holds its own copy, so the memory budget (memory_budget) is the least of the memory
available and the container's room, shared by the processes on the machine.

batch_to moves either cache's batches to the training device; the JPEG cache's (data/jpeg_cache.py) are decoded and
cropped by decode_crop, here beside it.
"""

import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from data.sampler import sample_seed
from data.transforms import crop_batch, crop_params, crop_spec
from utils.general import LOGGER, SharedError, colorstr, cpu_count
from utils.memory import MEMORY_SHARE, memory_budget, size_text

# torchvision 0.29 marks its image decoders deprecated in favour of TorchCodec; decode_jpeg is still there, and
# decodes a whole batch in one call, on the GPU too (the README's troubleshooting table says what to do without it).
warnings.filterwarnings("ignore", "The image decoding and encoding capabilities of TorchVision", DeprecationWarning)
MEASURE = "measure"  # RamImages' default budget: memory_budget() when it is made


class RamImages(Dataset):
    """A dataset's images, decoded (and with `transform`, transformed) once into one flat uint8 tensor, each image
    (C, H, W) at its own size; loaders fetch whole batches (__getitems__), padded to the batch's largest image. With
    a crop spec (training), images are stored as store_transform makes them, and a batch also holds each sample's
    crop box and flip and the stored image's scale, for crop_batch on the device. budget: the Budget this cache and
    `used` bytes cached before it must fit (None: no check)."""

    def __init__(self, source, transform=None, spec=None, seed=0, budget=MEASURE, used=0):
        self.classes, self.root, self.spec, self.seed, self.epoch = source.classes, source.root, spec, seed, 0
        self.samples = getattr(source, "samples", None)  # image files, where the source has them
        self.targets = torch.as_tensor(source.targets, dtype=torch.int64)
        store = store_transform(spec) if spec is not None else None
        sizes, images = decode_all(source, transform, store, memory_budget() if budget == MEASURE else budget, used)
        self.stored = torch.tensor([image.shape[1:] for image in images], dtype=torch.int64).view(-1, 2)
        # crop_params draws on the size the per-image path crops: the original image's, or for padded crops the
        # resized one, which is the stored one.
        self.sizes = torch.tensor(sizes, dtype=torch.int64).view(-1, 2) if spec and not spec.padding else self.stored
        self.channels = images[0].shape[0] if images else 3
        self.edge = spec is not None and not spec.padding  # see gather
        self.pixels, self.offsets = pack(images)
        uniform = len(images) and bool((self.stored == self.stored[0]).all())
        self.images = self.pixels.view(-1, self.channels, *self.stored[0].tolist()) if uniform else None
        self.scales = (self.stored / self.sizes).float()  # (N, 2): stored over drawn size, per axis (y, x)

    @property
    def nbytes(self):
        """Bytes the cached images take."""
        return self.pixels.nbytes

    def set_epoch(self, epoch):
        """Choose the epoch whose crops the next batches draw (workers are not persistent: each epoch sees it)."""
        self.epoch = epoch

    def __getitems__(self, ids):
        """A batch of ids (copy k of image i is id i + k * len(self), as SeededSamples'): (images, targets), and
        for training the (N, 5) crop params drawn from each id's seed for this epoch on the image's original size,
        and the (N, 2) scales that map them to the stored image."""
        ids = np.asarray(ids, dtype=np.uint64)
        index = torch.from_numpy((ids % len(self)).astype(np.int64))
        if self.spec is None:
            return self.gather(index), self.targets[index]
        params = seeded_crops(self.seed, self.epoch, ids, self.sizes[index], self.spec)
        return self.gather(index), self.targets[index], params, self.scales[index]

    def gather(self, index):
        """The images of index as one (N, C, H, W) tensor of the batch's largest height and width, each image in
        its top-left corner; the rest is zeros, or for resized crops its border pixels repeated (interpolating at a
        crop's edge then reads the image's own edge, not black; for padded crops, outside the image is zeros, as
        the per-image path's padding is)."""
        if self.images is not None:  # every image one size: one indexing op
            return self.images[index]
        sizes, pixels, c = self.stored[index], self.pixels.numpy(), self.channels
        height, width = sizes.max(0).values.tolist()
        # numpy: copies of one image are too small to gain from torch's threads, which only contend for the cores.
        batch = np.zeros((len(index), c, height, width), dtype=np.uint8)
        for out, start, (h, w) in zip(batch, self.offsets[index.numpy()].tolist(), sizes.tolist()):
            out[:, :h, :w] = pixels[start : start + c * h * w].reshape(c, h, w)
            if self.edge:
                out[:, :h, w:] = out[:, :h, w - 1 : w]
                out[:, h:] = out[:, h - 1 : h]
        return torch.from_numpy(batch)

    def __getitem__(self, i):
        return tuple(value[0] for value in self.__getitems__([i]))

    def __len__(self):
        return len(self.targets)


def seeded_crops(seed, epoch, ids, sizes, spec):
    """(N, 5) int64 crop params of sample ids in an epoch, drawn from each id's seed on its (N, 2) (height, width)
    sizes: the per-image path's crop box and flip of each sample."""
    return torch.from_numpy(crop_params(sample_seed(seed, epoch, ids), sizes[:, 0], sizes[:, 1], spec))


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
    """(sizes, images): every image of source as a uint8 (C, H, W) tensor, after transform and store, and its
    (height, width) before store; decoded by a thread per core (decoders release the GIL); an unreadable image
    raises the loader's error, which names it. Stops as soon as used + the images decoded so far outgrow budget,
    before the machine runs out."""
    def load(i):
        image = source[i][0]
        image = transform(image) if transform else image
        size = tuple(v2.functional.get_size(image))
        image = store(image) if store else image
        return size, v2.functional.to_image(image).as_subclass(torch.Tensor)
    sizes, images, nbytes = [], [], used
    with ThreadPoolExecutor(cpu_count()) as pool:
        for size, image in pool.map(load, range(len(source))):
            sizes.append(size)
            images.append(image)
            nbytes += image.nbytes
            if budget is not None and nbytes > budget.nbytes:
                pool.shutdown(cancel_futures=True)
                before = f", {size_text(nbytes)} with the {size_text(used)} cached before them" if used else ""
                raise too_big(f"the first {len(images)} of {len(source)} images take {size_text(nbytes - used)}"
                              f"{before}", budget)
    return sizes, images


def pack(images):
    """(pixels, offsets): every image's pixels in one flat uint8 tensor, image i at offsets[i]:offsets[i + 1].
    Each image is let go of (its list entry cleared) once copied, so memory holds little more than one copy."""
    offsets = np.cumsum([0] + [image.numel() for image in images])
    pixels = torch.empty(int(offsets[-1]), dtype=torch.uint8)
    for i, image in enumerate(images):
        pixels[offsets[i] : offsets[i + 1]].view(image.shape).copy_(image)
        images[i] = None
    return pixels, offsets


def too_big(what, budget):
    """The error for a cache that does not fit, with its numbers, where the budget comes from, and the way out."""
    shared = f", shared by the {budget.processes} processes on this machine" if budget.processes > 1 else ""
    return SharedError(f"data.cache=ram: {what}, more than this process's budget of {size_text(budget.nbytes)} "
                       f"({MEMORY_SHARE:.0%} of the {size_text(budget.room)} {budget.source}{shared}); set "
                       f"data.cache=none to decode per image")


def keep_batch(batch):
    """collate_fn for RamImages, whose __getitems__ already returns whole batches."""
    return batch


def decode_crop(blobs, params, scales, spec, device):
    """The JPEG cache's training batch: JPEG bytes (a list of 1-D uint8 CPU tensors) decoded in one call on device
    (nvJPEG on CUDA), then each image cropped and flipped on its own, at its own size (crop_image), into one uint8
    (N, C, size, size) batch. params and scales stay on the CPU, where crop_image reads them."""
    images = decode_jpeg(blobs, mode=ImageReadMode.RGB, device=device)
    return torch.stack([crop_image(image, box, scale, spec) for image, box, scale in zip(images, params, scales)])


def crop_image(image, params, scale, spec):
    """One decoded (C, H, W) image's resized crop and flip from its crop_params row (and scale: stored over drawn
    size, (y, x)). An image stored at its own size is resized by torchvision with antialiasing, as the per-image
    path's PIL resize is, and many times faster on a CPU than crop_batch's roi_align (0.5 against 8 ms for a 500x375
    photo at 176 px); one stored smaller goes through roi_align, which takes its box scaled to fractional pixels,
    and a padded crop (a window, no resampling) through crop_batch's indexing."""
    if spec.padding or scale.tolist() != [1.0, 1.0]:
        return crop_batch(image[None], params[None].to(image.device), spec, scale[None].to(image.device))[0]
    top, left, h, w, flip = params.tolist()
    crop = v2.functional.resized_crop(image, top, left, h, w, [spec.size, spec.size], antialias=True)
    return crop.flip(-1) if flip else crop


def batch_to(batch, device, spec):
    """A loader's batch on device as (uint8 images, targets); the RAM cache's training batches are cropped and
    flipped there (crop_batch), the JPEG cache's JPEG bytes (a list) decoded, cropped and flipped there
    (decode_crop)."""
    images, targets, *crop = batch
    if isinstance(images, list):
        return decode_crop(images, *crop, spec, device), targets.to(device, non_blocking=True)
    images, targets, *crop = (tensor.to(device, non_blocking=True) for tensor in batch)
    return (crop_batch(images, crop[0], spec, *crop[1:]) if crop else images), targets
