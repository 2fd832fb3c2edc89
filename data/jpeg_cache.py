"""data.cache=jpeg: each split written once into one file, read by every process on the machine.

Training images are stored as JPEG bytes (quality 90) at the shorter side the RAM cache keeps (cache.store_side:
what the recipe's crops can use), validation images as the raw uint8 pixels of their transforms (which are not
random: exactly the per-image path's, so val.py agrees with the run). A batch is its images' bytes gathered from
the page cache, which every process and DataLoader worker on the machine shares: no copy per process and no
memory budget. JPEGs are decoded by batches.decode_jpegs (TorchCodec), a whole batch in one call: on the GPU (nvJPEG)
when training on CUDA, else in the DataLoader workers; then each image is cropped and flipped where it was decoded
(batches.decode_crop), from the same per-sample seeds as the RAM cache's crops, so every promise of the RAM cache
holds: the same crop boxes at any number of processes, and exact mid-epoch resume.

A file is named by what it holds (split, stored size, and a fingerprint of the images: their paths, labels, sizes
and modification times), so runs and recipes with the same bound reuse it and a changed dataset gets a new one. It
is written by one machine's processes (one machine for a shared disk) while the others wait, by a thread per core,
under a temporary name renamed once complete, and checked on every open (its size, image count and a CRC of its
index): a truncated or stale file is rebuilt, never read.

Every process of the writing machine writes the file: they claim chunks of images from a counter in the job's store,
encode them by a thread pool each (PIL decodes, resizes and encodes without the GIL) and write each chunk's bytes
with os.pwrite at a region claimed from another counter, in one temporary file; local rank 0 gathers the index rows,
writes index, header and footer, flushes and renames it (utils/once.commit: durably). Processes wait on the writers'
progress (utils/once.py), never on a clock or in a collective, and none goes on before every machine's file is
complete. Machines that share the file's directory (a shared disk: each sees the others' markers there, utils/once.
first_machine_sharing) leave it to the lowest-numbered of them and wait on its progress; a machine whose directory
is its own writes its own. A file is written under a temporary name of its writer's (utils/once.temporary: local
rank 0's, which holds its lock); a start first removes the temporary files whose lock is free (clean_leftovers), and a
stop signal while writing or waiting ends the process at once, its temporary removed.

The file checked is the one read: opened once when checked (DataLoader workers inherit the descriptor), so a file
later renamed over its path changes nothing. Images are read by positioned reads (os.preadv), not a memory mapping:
a mapping counts every page read, and the pages around it, in the process's resident memory, which over an epoch
grows to the file's size in every process and worker; read, a process holds only the batch it decodes. The index
alone is mapped (its rows, 44 bytes an image, are the page cache's one copy for the whole machine, not a copy in
each process). Each image's bytes are checked against their CRC-32 as they are read: a damaged image stops the run
naming the file, the image and its source, and the file is removed (when it is still the one opened) so the next
start rewrites it.

File layout: the images' bytes back to back, then the index (INDEX_DTYPE, one row per image, with the CRC-32 of
its bytes), then a JSON header, then FOOTER: magic, index offset, header length, CRC-32 of index and header.
"""

import io
import itertools
import json
import mmap
import os
import struct
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from hashlib import sha256
from pathlib import Path

import numpy as np
import torch
from torchvision.transforms import v2
from tqdm import tqdm

from data.batches import SeededBatches
from data.cache import store_side, store_transform
from data.transforms import crop_spec
from utils.general import LOGGER, DatasetError, ImageError, colorstr, cpu_count, short_path
from utils.memory import size_text
from utils.once import (clean_leftovers, commit, done, finished, first_machine_sharing, local_store, made, progress,
                        remove, stop_on_signals, temporary, wait_for, writing)

QUALITY = 90  # JPEG quality of stored training images (FFCV's and DALI's usual)
FULL_CHROMA_BELOW = 64  # images with a shorter side below this keep full-resolution colour (4:4:4), larger ones 4:2:0
VERSION = 2  # of the file layout; part of the fingerprint, so a new layout never reads an old file
MAGIC = b"CLSJPEG2"
FOOTER = struct.Struct("<8sQQI")  # magic, index offset, header length, CRC-32 of index + header
INDEX_DTYPE = np.dtype([("offset", "<u8"), ("nbytes", "<u8"), ("height", "<i4"), ("width", "<i4"),
                        ("drawn_height", "<i4"), ("drawn_width", "<i4"), ("target", "<i8"), ("crc", "<u4")])
CHUNK = 1024  # most images in a chunk claimed by one process: bounds the encoded images it holds before writing
STAT_CHUNK = 4096  # files stat'ed between progress reports while listing the images
CALLS = itertools.count()  # cache() calls of this process: every rank makes the same ones, in the same order


class StaleCache(Exception):
    """A cache file that cannot be used as it is (missing, truncated, or of other images); says why."""


def decodes_on_device(cfg, device):
    """Whether data.cache=jpeg decodes training batches on the training device (data.jpeg_decode): auto does on
    CUDA (nvJPEG), and on a CPU leaves it to the DataLoader workers."""
    return cfg.jpeg_decode == "device" or (cfg.jpeg_decode == "auto" and device.type == "cuda")


class JpegImages(SeededBatches):
    """A split's images in a cache file (see the module's docstring), read a batch at a time (a SeededBatches, as
    RamImages): training's JPEG bytes, decoded, cropped and flipped in the worker or, on_device, on the training
    device (batch_to); validation's stored pixels."""

    def __init__(self, source, path, header, index, opened, spec=None, seed=0, on_device=False):
        self.classes, self.root, self.spec, self.seed = source.classes, source.root, spec, seed
        self.samples = getattr(source, "samples", None)
        self.path, self.raw, self.channels, self.on_device = path, header["raw"], header["channels"], on_device
        self.index, self.count = index, len(index)  # the file's own rows, mapped (open_cache): no copy per process
        self.file, self.identity = opened
        self.file_bytes = self.identity[2]

    @property
    def nbytes(self):
        """Bytes of the cache file."""
        return self.file_bytes

    def __getstate__(self):
        return {**self.__dict__, "file": None, "index": None}  # for DataLoader workers of the spawn start method

    def __setstate__(self, state):
        """Reopen the file by path, refusing one that is not the file checked (another renamed over it since)."""
        self.__dict__.update(state)
        try:
            self.file, identity = open_file(self.path)
        except OSError as e:
            raise ImageError(f"data.cache=jpeg: {self.path} cannot be read ({e.strerror or e}) since it was checked; "
                             f"restart to check it again") from None
        if identity != self.identity:
            raise ImageError(f"data.cache=jpeg: {self.path} was replaced since it was checked (device, inode or size "
                             f"differ); restart to check it again")
        try:
            self.index = read_index(self.file, identity, self.count)[1]
        except StaleCache as e:  # the same file, changed in place (a disk error): not what was checked
            raise ImageError(f"data.cache=jpeg: {self.path} changed since it was checked ({e}); restart to check it "
                             f"again") from None

    @property
    def targets(self):
        """Every image's class index, as an int64 tensor."""
        return torch.from_numpy(self.index["target"].astype(np.int64))

    def blob(self, i, row=None):
        """Image i's stored bytes (row: its index row, read here if not given) as a 1-D uint8 tensor, checked
        against their CRC-32 (see damaged)."""
        row = self.index[i] if row is None else row
        data = read_at(self.file, int(row["offset"]), int(row["nbytes"]))
        if data is None or zlib.crc32(data) != row["crc"]:  # None: the file is shorter than its index says
            raise self.damaged(i)
        return torch.from_numpy(data)

    def damaged(self, i):
        """The ImageError for image i's bytes not matching their CRC-32, after removing the file when its path
        still names the file read (another process may have rewritten it already). data.skip_corrupt does not
        apply: it drops unreadable source images before the file is written, and the file is rewritten instead."""
        try:
            info = os.stat(self.path)
            if (info.st_dev, info.st_ino) == self.identity[:2]:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        source = self.samples[i][0] if self.samples is not None else f"{type(self).__name__} image {i}"
        return ImageError(f"data.cache=jpeg: {self.path}: image {i} (from {source}) does not match its CRC-32: the "
                          f"file is damaged; removed it, so the next start rewrites it")

    def read(self, ids, index):
        """A batch's (images, targets, sizes, scales) (see SeededBatches): training's JPEG bytes, with the original
        sizes their crops are drawn on and the scales to the stored images; validation's stored pixels."""
        rows = self.index[index]  # a copy of the batch's rows
        blobs = [self.blob(i, row) for i, row in zip(index.tolist(), rows)]
        targets, stored = torch.from_numpy(rows["target"].astype(np.int64)), sides(rows, "height", "width")
        if self.raw:
            images = torch.stack([b.view(self.channels, *size) for b, size in zip(blobs, stored.tolist())])
            return images, targets, None, None
        sizes = sides(rows, "drawn_height", "drawn_width")
        return blobs, targets, sizes, (stored / sizes).float()

    def __len__(self):
        return self.count


def sides(rows, height, width):
    """(N, 2) int64 tensor of index rows' (height, width) fields."""
    return torch.from_numpy(np.stack([rows[height], rows[width]], 1).astype(np.int64))


def jpeg_datasets(train_source, val_source, cfg, seed, val_transform, device, topology):
    """data.cache=jpeg: the training and validation sets as JpegImages over their cache files, each written first
    where missing or unusable by the processes of one machine while the others wait (topology: this process's place
    in the job, utils/distributed.Topology)."""
    spec, on_device = crop_spec(cfg), decodes_on_device(cfg, device)
    train_form = {"raw": False, "side": spec.size if spec.padding else store_side(spec), "padded": spec.padding > 0,
                  "quality": QUALITY}
    val_form = {"raw": True, "transform": repr(val_transform)}
    train_set = JpegImages(train_source, *cache(train_source, "train", train_form, store_transform(spec), cfg,
                                                topology), spec, seed, on_device)
    val_set = JpegImages(val_source, *cache(val_source, "val", val_form, val_transform, cfg, topology))
    where = "on the training device" if on_device else "in the DataLoader workers"
    LOGGER.info(f"{colorstr('data:')} JPEG cache {short_path(train_set.path)} ({len(train_set)} images, "
                f"{size_text(train_set.nbytes)}, decoded {where}) and {short_path(val_set.path)} ({len(val_set)} "
                f"val images, {size_text(val_set.nbytes)}); data.cache=jpeg")
    return train_set, val_set


def cache(source, role, form, transform, cfg, topology):
    """(path, header, index, mapped) of source's cache file for role (train or val) in form, written first where
    missing or unusable by every process of the one machine that writes it (the lowest-numbered of those that share
    its directory); returns once every machine's file is complete."""
    store, machine, machines = topology.store or local_store(), topology.machine, topology.machines
    job = f"jpeg/{next(CALLS)}/{role}"  # every machine's progress, and the first failure
    work = f"{job}/machine{machine}"
    with stop_on_signals(f"writing the {role} JPEG cache"):
        if topology.local_rank == 0:
            path, tmp, writer = plan(source, role, form, cfg.cache_dir, store, job, work, topology)
        else:
            wait_for(store, f"{work}/plan", f"waiting for local rank 0 to list the {role} images")
            path, tmp, writer = json.loads(store.get(f"{work}/path"))
            path, tmp = Path(path), tmp and Path(tmp)
        if tmp is not None:
            write_shared(source, path, tmp, form, transform, store, job, work, topology)
        elif writer != machine:  # a disk shared with that machine, which writes the file
            wait_for(store, f"{job}/machine{writer}", f"waiting for machine {writer} to write {path}")
        if topology.local_rank == 0:
            done(store, work)  # this machine's file is complete, for the machines that share it
            store.add(f"{job}/machines", 1)
        wait_for(store, job, f"waiting for every machine's {role} cache file",
                 until=lambda: store.add(f"{job}/machines", 0) == machines)
    try:
        return (path, *open_cache(path, len(source)))
    except StaleCache as e:
        raise DatasetError(f"data.cache=jpeg: {path} is unusable after it was written ({e})") from None


def plan(source, role, form, cache_dir, store, job, work, topology):
    """(path, temporary file or None, the machine that writes path) of source's cache file, as local rank 0 finds it
    (listing the images for their fingerprint, with progress) and tells the machine's other processes. Of the
    machines that share path's directory, the lowest-numbered writes it (utils/once.first_machine_sharing); there,
    the temporary file is created empty, for every process to write into, where the file is missing or unusable,
    after the temporary files of writers that are gone are removed."""
    try:
        for key in (f"{work}/plan", work, job):
            writing(store, key)
        path, tmp = cache_path(source, role, form, cache_dir, lambda n: (made(store, f"{work}/plan", n),
                                                                         made(store, job, n))), None
        machine, machines = topology.machine, topology.machines
        writer = machine if machines == 1 else first_machine_sharing(
            path, store, job, machine, machines, f"waiting for every machine to list the {role} images")
        if writer == machine:
            tmp = begin_writing(path, len(source))
        store.set(f"{work}/path", json.dumps([str(path), str(tmp) if tmp else None, writer]))
        done(store, f"{work}/plan")
        return path, tmp, writer
    except BaseException as e:  # a stop signal's too: the waiters stop at once (machines sharing its file too)
        for key in (f"{work}/plan", work, job):
            done(store, key, e)
        raise


def begin_writing(path, count):
    """None where path is a complete cache file of count images; else its temporary file, created empty for every
    local process to write into, after the temporary files of writers that are gone are removed."""
    try:
        open_cache(path, count)
        return None
    except StaleCache as e:
        if path.exists():
            LOGGER.warning(f"data.cache=jpeg: rewriting {short_path(path)}: {e}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for leftover in clean_leftovers(path):
            LOGGER.info(f"{colorstr('data:')} removed {short_path(leftover)}, left by a writer that is gone")
        tmp = temporary(path)  # locked by this process until it is renamed or removed
        open(tmp, "wb").close()
    except OSError as e:
        raise write_error(path, e) from None
    return tmp


def cache_path(source, role, form, cache_dir="", tick=lambda n: None):
    """Where source's cache file for role in form lives: in cache_dir, or beside the images' folder."""
    folder = Path(source.root)
    side = "raw" if form["raw"] else f"{form['side']}px"
    name = f".{folder.name}-{role}-{side}-{fingerprint(source, form, tick)[:16]}.jpegcache"
    return (Path(cache_dir) if cache_dir else folder.parent) / name


def fingerprint(source, form, tick=lambda n: None):
    """SHA-256 of what identifies source's images in form: each file's path, label, size and modification time (a
    file replaced in place changes them); for datasets without files (CIFAR), their class and length. The JSON of
    [VERSION, form, classes, [[path, label, size, mtime], ...]] is hashed as it is made, a chunk of files at a time,
    never held whole (at ImageNet's size, some 400 MB of Python objects). tick(n) counts files done."""
    samples = getattr(source, "samples", None)
    if samples is None:
        return sha256(json.dumps([VERSION, form, source.classes, [type(source).__name__, str(source.root),
                                                                   len(source)]]).encode()).hexdigest()
    digest = sha256(json.dumps([VERSION, form, source.classes])[:-1].encode() + b", [")

    def stat(start):  # the JSON of 256 files' rows, without its brackets
        return json.dumps([[str(path), int(label), info.st_size, info.st_mtime_ns]
                           for path, label in samples[start : start + 256] for info in (os.stat(path),)])[1:-1]
    # Threads, as stat waits on the disk (a network file system's most), not the cores; a task per 256 files, as
    # a task per file costs ten times a local stat.
    with ThreadPoolExecutor(min(16, 4 * cpu_count())) as pool:
        for start in range(0, len(samples), STAT_CHUNK):
            for k, text in enumerate(pool.map(stat, range(start, min(start + STAT_CHUNK, len(samples)), 256))):
                digest.update((", " if start or k else "").encode() + text.encode())
            tick(min(STAT_CHUNK, len(samples) - start))
    digest.update(b"]]")
    return digest.hexdigest()


def open_file(path):
    """(path's file opened for reading, its (device, inode, size)): the file as opened now, whatever is renamed over
    its path later."""
    file = open(path, "rb", buffering=0)
    info = os.fstat(file.fileno())
    return file, (info.st_dev, info.st_ino, info.st_size)


def read_at(file, offset, nbytes):
    """nbytes of file from offset, as a new uint8 array; None where the file ends before them."""
    out = np.empty(nbytes, np.uint8)
    view, done = memoryview(out), 0
    while done < nbytes:  # a read may return less than asked
        got = os.preadv(file.fileno(), [view[done:]], offset + done)
        if got == 0:
            return None
        done += got
    return out


def open_cache(path, count):
    """(header, index, (file, identity)) of a complete cache file of count images, opened (open_file); StaleCache
    says why it is not one."""
    try:
        file, identity = open_file(path)
    except FileNotFoundError:
        raise StaleCache("not written yet") from None
    except OSError as e:
        raise StaleCache(f"cannot be read ({e.strerror or e})") from None
    return read_index(file, identity, count)


def read_index(file, identity, count):
    """(header, index, (file, identity)) of an opened cache file of count images: its footer, index and header
    checked, its index rows read from the file's pages (mapped); StaleCache says why it is not a complete cache file."""
    size = identity[2]
    if size < FOOTER.size:
        raise StaleCache(f"{size} bytes, shorter than its footer: truncated")
    magic, index_at, header_length, crc = FOOTER.unpack(read_at(file, size - FOOTER.size, FOOTER.size))
    if magic != MAGIC:
        raise StaleCache("no footer at its end: truncated, or not a cache file")
    if index_at + header_length + FOOTER.size > size:  # Python integers: no wrap
        raise StaleCache("its footer points past its end")
    tail = mapped(file, index_at, size - FOOTER.size - index_at)
    if zlib.crc32(tail) != crc:
        raise StaleCache("its index does not match its checksum")
    rows = len(tail) - header_length
    header = json.loads(bytes(tail[rows:]))
    if rows != count * INDEX_DTYPE.itemsize or header["count"] != count:
        raise StaleCache(f"{rows // INDEX_DTYPE.itemsize} images, not the dataset's {count}")
    index = np.frombuffer(tail, INDEX_DTYPE, count)
    check_rows(index, index_at, header)
    return header, index, (file, identity)


def mapped(file, offset, nbytes):
    """A read-only memoryview of nbytes of file from offset, over the file's pages. The index is read so: the page
    cache's one copy, which every process and DataLoader worker on the machine shares, instead of 44 bytes an image
    in each (benchmarks/scale.py --only startup), and no transient copy of it to check its CRC-32. The file is never
    written in place (writers rename a new one over it), so its pages keep the bytes checked."""
    if nbytes == 0:
        return memoryview(b"")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a mapping starts at a multiple of it
    pages = mmap.mmap(file.fileno(), offset - start + nbytes, access=mmap.ACCESS_READ, offset=start)
    return memoryview(pages)[offset - start :]


def check_rows(index, index_at, header):
    """StaleCache naming the first row of index whose bytes are not within the images' index_at bytes (bounds
    checked so that no uint64 sum can wrap), or, in a raw file, not its channels x height x width."""
    offsets, nbytes, index_at = index["offset"], index["nbytes"], np.uint64(index_at)
    outside = (offsets > index_at) | (nbytes > index_at - np.minimum(offsets, index_at))
    if outside.any():
        i = int(outside.argmax())
        raise StaleCache(f"its index points past its images: image {i} at byte {offsets[i]}, {nbytes[i]} bytes, of "
                         f"{index_at}")
    if header["raw"]:
        c, heights, widths = header["channels"], index["height"].astype(np.int64), index["width"].astype(np.int64)
        wrong = (heights <= 0) | (widths <= 0) | (nbytes != (c * heights * widths).astype(np.uint64))
        if wrong.any():
            i = int(wrong.argmax())
            raise StaleCache(f"image {i} holds {nbytes[i]} bytes, not its {c}x{heights[i]}x{widths[i]} pixels' "
                             f"{c * heights[i] * widths[i]}")


def chunk_size(count, processes):
    """Images per claimed chunk: at most CHUNK, and small enough that each of the machine's processes gets some."""
    return max(1, min(CHUNK, count // (4 * processes)))


def write_shared(source, path, tmp, form, transform, store, job, work, topology):
    """Write source's images into tmp with the machine's other processes (see the module's docstring); local rank 0
    then completes it as path (finish_file). Any failure is recorded for every waiter and leaves no tmp."""
    try:
        for key in (work, job):  # every process on the machine writes: a waiter watches each one
            writing(store, key)
        rows = encode_chunks(source, path, tmp, form, transform, store, job, work, topology)
        post(store, f"{work}/rows/{topology.local_rank}", rows.tobytes())
        store.add(f"{work}/posted", 1)
        if topology.local_rank == 0:
            wait_for(store, work, f"waiting for the local ranks writing {path}", total=len(source),
                     until=lambda: store.add(f"{work}/posted", 0) == topology.local_world_size)
            finish_file(source, path, tmp, form, store, work, topology.local_world_size)
            done(store, work)
        else:
            wait_for(store, work, f"waiting for local rank 0 to write {path}")
    except BaseException as e:  # a stop signal's too: the waiters stop at once
        for key in (work, job):
            done(store, key, e)
        raise
    finally:
        if topology.local_rank == 0 and tmp.exists():  # after an error; renamed otherwise
            remove(tmp)  # its lock too


ROW = np.dtype([("image", "<i8"), ("channels", "<i4"), ("row", INDEX_DTYPE)])  # a row, its image and channels
STORE_VALUE = 4 << 20  # bytes of one value in the job's store, whose TCPStore refuses one over 8 MiB


def post(store, key, data):
    """Set key to data (bytes) in the store, in values of STORE_VALUE bytes at most: a process's index rows take
    56 bytes an image, 9 MB for each of 8 processes writing ImageNet's."""
    parts = [data[i : i + STORE_VALUE] for i in range(0, len(data), STORE_VALUE)]
    for k, part in enumerate(parts):
        store.set(f"{key}/{k}", part)
    store.set(key, str(len(parts)))


def posted(store, key):
    """The bytes post(store, key, ...) set."""
    return b"".join(store.get(f"{key}/{k}") for k in range(int(store.get(key))))



def encode_chunks(source, path, tmp, form, transform, store, job, work, topology):
    """ROW array of the images this process encoded into tmp: chunks claimed until none is left, each read and
    encoded by a thread pool (the next chunk's images read while this one's are written)."""
    encode, count = raw_pixels if form["raw"] else jpeg_bytes, len(source)
    size = chunk_size(count, topology.local_world_size)

    def store_one(i):
        image, target = source[i]
        drawn = v2.functional.get_size(image)  # crops are drawn on the original size (RamImages.sizes)
        data, stored, channels = encode(transform(image))
        return i, data, stored if form["raw"] or form["padded"] else drawn, stored, channels, target

    def claim(pool):
        start = (store.add(f"{work}/chunks", 1) - 1) * size
        return [pool.submit(store_one, i) for i in range(start, min(start + size, count))]
    rows, pending = [], deque()
    bar = tqdm(total=count, desc=f"writing {short_path(path)}", unit="img", leave=False,
               disable=topology.rank != 0)
    try:
        fd = os.open(tmp, os.O_WRONLY)
    except OSError as e:
        raise write_error(path, e) from None
    with ThreadPoolExecutor(max(1, cpu_count() // topology.local_world_size)) as pool, bar:
        try:
            pending.extend(chunk for chunk in (claim(pool), claim(pool)) if chunk)
            while pending:
                encoded = [future.result() for future in pending.popleft()]
                if chunk := claim(pool):
                    pending.append(chunk)
                rows.append(write_chunk(fd, encoded, store, work))
                for key in (work, job):
                    made(store, key, len(encoded))
                bar.update(progress(store, work) - bar.n)
                finished(store, work, f"writing {path}")  # raises another process's failure
        except OSError as e:
            raise write_error(path, e) from None
        finally:  # on a failure or a stop signal, the images not begun are dropped (the chunk being written's too)
            pool.shutdown(cancel_futures=True)
            os.close(fd)
    return np.concatenate(rows) if rows else np.zeros(0, ROW)


def write_chunk(fd, encoded, store, work):
    """ROW array of a chunk of encoded images, their bytes written at a region of the file claimed for them."""
    data = b"".join(item[1] for item in encoded)
    at = store.add(f"{work}/bytes", len(data)) - len(data)
    written = 0
    while written < len(data):  # pwrite may write less than asked
        written += os.pwrite(fd, data[written:], at + written)
    rows, offset = np.zeros(len(encoded), ROW), at
    for k, (i, blob, drawn, stored, channels, target) in enumerate(encoded):
        rows[k] = (i, channels, (offset, len(blob), *stored, *drawn, target, zlib.crc32(blob)))
        offset += len(blob)
    return rows


def finish_file(source, path, tmp, form, store, work, processes):
    """Local rank 0: gather the index rows of the machine's processes, write index, header and footer after the images,
    and make tmp path (utils/once.commit: flushed, renamed, the rename flushed)."""
    parts = [np.frombuffer(posted(store, f"{work}/rows/{r}"), ROW) for r in range(processes)]
    rows = np.concatenate(parts)
    index = np.zeros(len(source), INDEX_DTYPE)
    index[rows["image"]] = rows["row"]
    if len(np.unique(rows["image"])) != len(source):
        raise DatasetError(f"data.cache=jpeg: {path}: {len(np.unique(rows['image']))} of {len(source)} images written")
    writers = [len(part) for part in parts]  # images each local process encoded
    header = json.dumps({**form, "count": len(source), "channels": int(rows["channels"][0]) if len(rows) else 3,
                         "writers": writers}).encode()
    tail, at = index.tobytes() + header, store.add(f"{work}/bytes", 0)
    try:
        with open(tmp, "r+b") as f:
            f.seek(at)
            f.write(tail + FOOTER.pack(MAGIC, at, len(header), zlib.crc32(tail)))
        commit(tmp, path)
    except OSError as e:
        raise write_error(path, e) from None
    LOGGER.info(f"{colorstr('data:')} wrote {short_path(path)}: {len(source)} images, {size_text(at)}, encoded by "
                f"{len(writers)} processes ({', '.join(map(str, writers))} images)")


def write_error(path, e):
    """The DatasetError for path's file that cannot be written (OSError e), naming a file in the way of its folder."""
    in_the_way = next((folder for folder in Path(path).parents if folder.exists() and not folder.is_dir()), None)
    reason = f"{in_the_way} is a file, not a folder" if in_the_way else e.strerror or e
    return DatasetError(f"data.cache=jpeg: cannot write {path} ({reason}); set data.cache_dir to a writable "
                        f"directory with room for it")


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
