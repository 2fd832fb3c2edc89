"""Image decoding that says why a file is unreadable, and the check behind data.skip_corrupt: every image decoded
once before training, shared out over ranks and threads, with the results cached next to the data."""

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from utils.distributed import broadcast_object, gather_object
from utils.general import LOCAL_WORLD_SIZE, LOGGER, RANK, WORLD_SIZE, colorstr, cpu_count
from utils.once import atomic_write

# What PIL raises for a file it cannot decode (truncated, not an image, corrupt data, a decompression bomb).
UNREADABLE = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)
CACHE_VERSION = 1
CHUNK = 64  # files per thread-pool task: a task per file costs more than checking a cached one
SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # 16-bit PNG, TIFF and PGM; "I" as older Pillows read them
BACKGROUND = (255, 255, 255)  # what transparent pixels show: white, as on a web page or a photo viewer


def decode(path):
    """A fully decoded RGB image as a person sees the file: turned upright as its EXIF orientation says (cameras
    store portraits sideways), then made RGB by to_rgb."""
    try:
        image = Image.open(path)
    except UnidentifiedImageError:
        if isinstance(path, (str, os.PathLike)) and os.path.getsize(path) == 0:  # PIL calls it an unknown format
            raise OSError("an empty file, 0 bytes") from None
        raise
    with image:
        ImageOps.exif_transpose(image, in_place=True)  # reads and decodes the pixels (Image.open read the header)
        return to_rgb(image)


def to_rgb(image):
    """An image of any mode as RGB: 16-bit values scaled to 8 bits (convert("RGB") would clip everything above 255
    to white), transparency (an alpha channel, or a palette's or colour key's) composited on BACKGROUND (dropping
    alpha would show whatever colours the invisible pixels hold, often black or junk), and the rest (L, 1, P, CMYK,
    YCbCr, ...) by PIL's convert."""
    if image.mode in SIXTEEN_BIT:
        pixels = np.asarray(image).astype(np.float32) / 257  # 65535 -> 255: 257 = 65535 / 255
        image = Image.fromarray(pixels.round().clip(0, 255).astype(np.uint8))
    if "A" in image.mode or "a" in image.mode or "transparency" in image.info:
        rgba = image.convert("RGBA")  # LA, PA, RGBa, and P, L or RGB with a transparent palette entry or colour
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*BACKGROUND, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def unreadable_reason(error):
    """Why PIL could not read a file, in a few words (its own message for an unknown format repeats the path)."""
    if isinstance(error, UnidentifiedImageError):
        return "not an image format PIL can identify"
    if isinstance(error, Image.DecompressionBombError) and len(sizes := re.findall(r"\d+", str(error))) == 2:
        return (f"{int(sizes[0]):,} pixels, over PIL's limit of {int(sizes[1]):,} for one image, a guard against "
                f"decompression bombs")
    return str(error) or type(error).__name__


def check_file(path, cached=None):
    """[size, mtime_ns, reason] of one file (reason None: readable); decoded only if cached is not its current
    [size, mtime_ns, ...]."""
    try:
        stat = os.stat(path)
    except OSError as e:
        return [None, None, e.strerror or str(e)]
    key = [stat.st_size, stat.st_mtime_ns]
    if cached is not None and cached[:2] == key:
        return cached
    try:
        decode(path)
    except UNREADABLE as e:
        return [*key, unreadable_reason(e)]
    return [*key, None]


def unreadable_images(folder, paths, cache_file):
    """{path: reason} of the unreadable files among paths (in their order), the same on every rank.

    Each rank checks its share paths[RANK::WORLD_SIZE] over a thread pool (PIL releases the GIL while decoding),
    reusing cache_file's results for files whose size and mtime are unchanged; rank 0 reads the cache for all
    (the ranks need not share a disk) and saves the pooled results.
    """
    cache = broadcast_object(read_cache(cache_file) if RANK == 0 else None)
    prefix = os.path.join(folder, "")
    names = [path.removeprefix(prefix) for path in paths]  # relative, so the data folder may be moved
    share = list(zip(paths, names))[RANK::WORLD_SIZE]
    chunks = [share[i : i + CHUNK] for i in range(0, len(share), CHUNK)]
    with ThreadPoolExecutor(max(1, cpu_count() // LOCAL_WORLD_SIZE)) as pool:  # this process's share of the cores
        checked = pool.map(lambda chunk: {name: check_file(path, cache.get(name)) for path, name in chunk}, chunks)
        entries = {name: entry for part in checked for name, entry in part.items()}
    pooled = {name: entry for part in gather_object(entries) for name, entry in part.items()}
    entries = {name: pooled[name] for name in names}  # in the dataset's order, whichever rank checked them
    if RANK == 0:
        decoded = sum(entry != cache.get(name) for name, entry in entries.items())
        LOGGER.info(f"{colorstr('data:')} {folder}: {len(paths)} images checked: {decoded} decoded, "
                    f"{len(paths) - decoded} known from {cache_file.name}")
        if entries != cache:
            write_cache(cache_file, entries)
    return {path: entries[name][2] for path, name in zip(paths, names) if entries[name][2] is not None}


def read_cache(cache_file):
    """A split's cached {name: [size, mtime_ns, reason]}, or {} when there is none or it cannot be read."""
    try:
        content = json.loads(Path(cache_file).read_text())
        files = content["files"] if content.get("version") == CACHE_VERSION else {}
        return {name: entry for name, entry in files.items() if isinstance(entry, list) and len(entry) == 3}
    except (OSError, ValueError, KeyError, AttributeError):
        return {}


def write_cache(cache_file, entries):
    """Save the results whole (utils/once.atomic_write); a read-only data folder only skips it."""
    try:
        with atomic_write(cache_file) as tmp:
            tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": entries}, separators=(",", ":")))
    except OSError as e:
        LOGGER.info(f"{colorstr('data:')} {cache_file}: not written ({e.strerror or e}); the images will be "
                    f"decoded again next run")
