"""data.cache=jpeg: each split written once into one file, memory-mapped by every process on the machine.

Training images are stored as JPEG bytes (quality 90) at the shorter side the RAM cache keeps (cache.store_side:
what the recipe's crops can use), validation images as the raw uint8 pixels of their transforms (which are not
random: exactly the per-image path's, so val.py agrees with the run). A batch is its images' bytes gathered from
the page cache, which every process and DataLoader worker on the machine shares: no copy per process and no
memory budget. JPEGs are decoded by torchvision.io.decode_jpeg, a whole batch in one call: on the GPU (nvJPEG)
when training on CUDA, else in the DataLoader workers; then each image is cropped and flipped where it was decoded
(cache.decode_crop), from the same per-sample seeds as the RAM cache's crops, so every promise of the RAM cache
holds: the same crop boxes at any number of processes, and exact mid-epoch resume.

A file is named by what it holds (split, stored size, and a fingerprint of the images: their paths, labels, sizes
and modification times), so runs and recipes with the same bound reuse it and a changed dataset gets a new one. It
is written by one process per machine while the others wait, by a thread per core, under a temporary name renamed
once complete, and checked on every open (its size, image count and a CRC of its index): a truncated or stale file
is rebuilt, never read.

File layout: the images' bytes back to back, then the index (INDEX_DTYPE, one row per image), then a JSON header,
then FOOTER: magic, index offset, header length, CRC-32 of index and header.
"""

import io
import json
import os
import socket
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms import v2
from tqdm import tqdm

from data.cache import decode_crop, seeded_crops, store_side, store_transform
from data.transforms import crop_spec
from utils.distributed import torch_distributed_zero_first
from utils.general import LOCAL_RANK, LOGGER, DatasetError, colorstr, cpu_count, short_path
from utils.memory import size_text

QUALITY = 90  # JPEG quality of stored training images (FFCV's and DALI's usual)
FULL_CHROMA_BELOW = 64  # images with a shorter side below this keep full-resolution colour (4:4:4), larger ones 4:2:0
VERSION = 1  # of the file layout; part of the fingerprint, so a new layout never reads an old file
MAGIC = b"CLSJPEG1"
FOOTER = struct.Struct("<8sQQI")  # magic, index offset, header length, CRC-32 of index + header
INDEX_DTYPE = np.dtype([("offset", "<u8"), ("nbytes", "<u8"), ("height", "<i4"), ("width", "<i4"),
                        ("drawn_height", "<i4"), ("drawn_width", "<i4"), ("target", "<i8")])
CHUNK = 1024  # images handed to the thread pool at a time: bounds the encoded images held before writing


class StaleCache(Exception):
    """A cache file that cannot be used as it is (missing, truncated, or of other images); says why."""


def decodes_on_device(cfg, device):
    """Whether data.cache=jpeg decodes training batches on the training device (data.jpeg_decode): auto does on
    CUDA (nvJPEG), and on a CPU leaves it to the DataLoader workers."""
    return cfg.jpeg_decode == "device" or (cfg.jpeg_decode == "auto" and device.type == "cuda")


class JpegImages(torch.utils.data.Dataset):
    """A split's images in a cache file (see the module's docstring); like RamImages, loaders fetch whole batches
    (__getitems__). Training sets (spec given) return each batch decoded, cropped and flipped (decode_crop), or when
    on_device its JPEG bytes as a list of 1-D uint8 tensors with each sample's crop params for the epoch and the
    stored image's scale, for batch_to to decode and crop on the device; validation sets return the stored pixels."""

    def __init__(self, source, path, header, index, spec=None, seed=0, on_device=False):
        self.classes, self.root, self.spec, self.seed, self.epoch = source.classes, source.root, spec, seed, 0
        self.samples = getattr(source, "samples", None)
        self.path, self.raw, self.channels, self.on_device = path, header["raw"], header["channels"], on_device
        self.offsets, self.nbytes_each = index["offset"].astype(np.int64), index["nbytes"].astype(np.int64)
        self.targets = torch.from_numpy(index["target"].astype(np.int64))
        self.stored = torch.from_numpy(np.stack([index["height"], index["width"]], 1).astype(np.int64))
        self.sizes = torch.from_numpy(np.stack([index["drawn_height"], index["drawn_width"]], 1).astype(np.int64))
        self.scales = (self.stored / self.sizes).float()
        self.file_bytes, self.data = path.stat().st_size, None

    @property
    def nbytes(self):
        """Bytes of the cache file."""
        return self.file_bytes

    def set_epoch(self, epoch):
        """Choose the epoch whose crops the next batches draw."""
        self.epoch = epoch

    def blob(self, i):
        """Image i's stored bytes as a 1-D uint8 tensor (a copy: the mapping is read-only)."""
        if self.data is None:  # mapped on first use, in the process (or DataLoader worker) that reads
            self.data = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self.offsets[i]
        return torch.from_numpy(np.array(self.data[start : start + self.nbytes_each[i]]))

    def __getitems__(self, ids):
        ids = np.asarray(ids, dtype=np.uint64)
        index = torch.from_numpy((ids % len(self)).astype(np.int64))
        blobs = [self.blob(i) for i in index.tolist()]
        if self.raw:
            sizes = self.stored[index].tolist()
            return torch.stack([b.view(self.channels, *size) for b, size in zip(blobs, sizes)]), self.targets[index]
        params = seeded_crops(self.seed, self.epoch, ids, self.sizes[index], self.spec)
        if self.on_device:
            return blobs, self.targets[index], params, self.scales[index]
        return decode_crop(blobs, params, self.scales[index], self.spec, torch.device("cpu")), self.targets[index]

    def __getitem__(self, i):
        return tuple(value[0] for value in self.__getitems__([i]))

    def __len__(self):
        return len(self.targets)


def jpeg_datasets(train_source, val_source, cfg, seed, val_transform, device):
    """data.cache=jpeg: the training and validation sets as JpegImages over their cache files, each written first
    where missing or unusable (one process per machine writes, the others wait)."""
    spec, on_device = crop_spec(cfg), decodes_on_device(cfg, device)
    train_form = {"raw": False, "side": spec.size if spec.padding else store_side(spec), "padded": spec.padding > 0,
                  "quality": QUALITY}
    val_form = {"raw": True, "transform": repr(val_transform)}
    train_set = JpegImages(train_source, *cache(train_source, "train", train_form, store_transform(spec), cfg),
                           spec, seed, on_device)
    val_set = JpegImages(val_source, *cache(val_source, "val", val_form, val_transform, cfg))
    where = "on the training device" if on_device else "in the DataLoader workers"
    LOGGER.info(f"{colorstr('data:')} JPEG cache {short_path(train_set.path)} ({len(train_set)} images, "
                f"{size_text(train_set.nbytes)}, decoded {where}) and {short_path(val_set.path)} ({len(val_set)} "
                f"val images, {size_text(val_set.nbytes)}); data.cache=jpeg")
    return train_set, val_set


def cache(source, role, form, transform, cfg):
    """(path, header, index) of source's cache file for role (train or val) in form, written first where missing
    or unusable; local rank 0 checks and writes while the other processes on the machine wait, then they check."""
    path = cache_path(source, role, form, cfg.cache_dir)
    with torch_distributed_zero_first():
        try:
            return (path, *open_cache(path, len(source)))
        except StaleCache as e:
            if LOCAL_RANK != 0:
                raise DatasetError(f"data.cache=jpeg: {path} is unusable after local rank 0 wrote it ({e})") from None
            if path.exists():
                LOGGER.warning(f"data.cache=jpeg: rewriting {short_path(path)}: {e}")
        write_cache(source, path, form, transform)
        return (path, *open_cache(path, len(source)))


def cache_path(source, role, form, cache_dir=""):
    """Where source's cache file for role in form lives: in cache_dir, or beside the images' folder."""
    folder = Path(source.root)
    fingerprint = sha256(json.dumps([VERSION, form, source.classes, image_list(source)]).encode()).hexdigest()
    side = "raw" if form["raw"] else f"{form['side']}px"
    name = f".{folder.name}-{role}-{side}-{fingerprint[:16]}.jpegcache"
    return (Path(cache_dir) if cache_dir else folder.parent) / name


def image_list(source):
    """What identifies source's images: each file's path, label, size and modification time (a file replaced in
    place changes them); for datasets without files (CIFAR), their class and length."""
    samples = getattr(source, "samples", None)
    if samples is None:
        return [type(source).__name__, str(source.root), len(source)]

    def stat(sample):
        info = os.stat(sample[0])
        return [str(sample[0]), int(sample[1]), info.st_size, info.st_mtime_ns]
    with ThreadPoolExecutor(min(16, 4 * cpu_count())) as pool:  # stat waits on the disk, not the cores
        return list(pool.map(stat, samples, chunksize=256))


def open_cache(path, count):
    """(header, index) of a complete cache file of count images; StaleCache says why it is not one."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            if size < FOOTER.size:
                raise StaleCache(f"{size} bytes, shorter than its footer: truncated")
            f.seek(size - FOOTER.size)
            magic, index_at, header_length, crc = FOOTER.unpack(f.read(FOOTER.size))
            if magic != MAGIC:
                raise StaleCache("no footer at its end: truncated, or not a cache file")
            if index_at + header_length + FOOTER.size > size:
                raise StaleCache("its footer points past its end")
            f.seek(index_at)
            tail = f.read(size - FOOTER.size - index_at)
    except FileNotFoundError:
        raise StaleCache("not written yet") from None
    except OSError as e:
        raise StaleCache(f"cannot be read ({e.strerror or e})") from None
    if zlib.crc32(tail) != crc:
        raise StaleCache("its index does not match its checksum")
    header = json.loads(tail[len(tail) - header_length :])
    index = np.frombuffer(tail[: len(tail) - header_length], dtype=INDEX_DTYPE)
    if header["count"] != count or len(index) != count:
        raise StaleCache(f"{len(index)} images, not the dataset's {count}")
    if len(index) and int((index["offset"] + index["nbytes"]).max()) > index_at:
        raise StaleCache("its index points past its images")
    return header, index


def write_cache(source, path, form, transform):
    """Write source's images into a cache file at path: encoded by a thread per core (PIL decodes, resizes and
    encodes without the GIL), in order, under a temporary name renamed once complete and flushed to disk. An
    unreadable image raises the loader's error, which names it (data.skip_corrupt leaves none in source)."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    index, offset, channels = np.zeros(len(source), dtype=INDEX_DTYPE), 0, 3
    encode = raw_pixels if form["raw"] else jpeg_bytes

    def store(i):
        image, target = source[i]
        drawn = v2.functional.get_size(image)  # crops are drawn on the original size (RamImages.sizes)
        data, size, channels = encode(transform(image))
        return data, size if form["raw"] or form["padded"] else drawn, size, channels, target
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        bar = tqdm(total=len(source), desc=f"writing {short_path(path)}", unit="img", leave=False)
        with open(tmp, "wb") as f, ThreadPoolExecutor(cpu_count()) as pool, bar:
            for start in range(0, len(source), CHUNK):
                for i, (data, drawn, size, channels, target) in enumerate(
                        pool.map(store, range(start, min(start + CHUNK, len(source)))), start):
                    index[i] = (offset, len(data), *size, *drawn, target)
                    f.write(data)
                    offset += len(data)
                bar.update(min(CHUNK, len(source) - start))
            header = json.dumps({**form, "count": len(source), "channels": channels}).encode()
            tail = index.tobytes() + header
            f.write(tail + FOOTER.pack(MAGIC, offset, len(header), zlib.crc32(tail)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise DatasetError(f"data.cache=jpeg: cannot write {path} ({e.strerror or e}); set data.cache_dir to a "
                           f"writable directory with room for it") from None
    finally:
        if tmp.exists():  # after an error; renamed otherwise
            tmp.unlink()
    LOGGER.info(f"{colorstr('data:')} wrote {short_path(path)}: {len(source)} images, {size_text(offset)}")


def jpeg_bytes(image):
    """(bytes, (height, width), channels) of a PIL image encoded as an RGB JPEG. Photos take JPEG's usual half-
    resolution colour; small images (CIFAR, icons) keep it whole, as their colour edges are a pixel or two wide."""
    buffer = io.BytesIO()
    subsampling = 0 if min(image.size) < FULL_CHROMA_BELOW else 2  # PIL's 0: 4:4:4, 2: 4:2:0
    image.convert("RGB").save(buffer, "JPEG", quality=QUALITY, subsampling=subsampling)
    return buffer.getvalue(), (image.height, image.width), 3


def raw_pixels(image):
    """(bytes, (height, width), channels) of a uint8 (C, H, W) tensor's pixels."""
    image = image.as_subclass(torch.Tensor).contiguous()
    return image.numpy().tobytes(), tuple(image.shape[1:]), image.shape[0]
