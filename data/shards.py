"""Write a data set as WebDataset shards that data.name then reads (data/shard_sets.py), from any layout the
project reads: split folders, class folders with --val-split, or train.csv and val.csv.

Usage:
    python -m data.shards path/to/your/data path/to/shards
    python -m data.shards path/to/class_folders path/to/shards --val-split 0.2 --shard-size 500MB

OUT gets train/ and val/, each a run of tar shards (train-000000.tar, ...) with its wids index (index.json), and
dataset.json naming both and the classes: give train.py data.name=OUT (or OUT/dataset.json, or its URL once
served). A sample is `{key}.jpg` (or the image's own format in val) and `{key}.cls`, its class index.

Training images are written in a seeded random order (--seed), so that every shard holds every class in its
share, and stored as JPEGs: a JPEG file as it is (its bytes untouched), another image (or a JPEG turned by its
EXIF orientation, or not RGB or grey) decoded upright and encoded at quality 90; --max-side re-encodes any image
whose shorter side is larger. Validation images are stored as they are (with --max-side, larger ones re-encoded
too): they are decoded by PIL as image files are. Each shard's SHA-256, and each image's CRC-32 and size (as
decoded upright: training crops are drawn from it without reading the image), go into the index. Everything is
written under a temporary name beside OUT and renamed to OUT once complete: a half-written set is never taken for
a whole one.
"""

import argparse
import collections
import hashlib
import io
import json
import re
import sys
import tarfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from utils.general import DatasetError, UsageError, after_imports, before_imports, cpu_count, short_path

if __name__ == "__main__":  # first: no garbage collection while torch imports (data.jpeg_cache's)
    before_imports()

import numpy as np
from PIL import Image
from tqdm import tqdm

from data.jpeg_cache import jpeg_bytes
from data.layouts import HoldOut
from data.shard_sets import INDEX_KIND, KIND, TOP
from data.sources import train_val_datasets
from data.verify import UNREADABLE, decode, unreadable_reason
from utils.distributed import exit_on_error
from utils.once import atomic_write

# The formats validation images are stored in as they are, by the extension the reader knows them by (IMAGE_EXTENSIONS)
EXTENSIONS = {"JPEG": ".jpg", "MPO": ".jpg", "PNG": ".png", "WEBP": ".webp", "BMP": ".bmp", "PPM": ".ppm",
              "TIFF": ".tif"}
# The recipe keys the data code's messages name (written for train.py), as this command sets them.
FLAGS = {"data.name": "src", "data.val_split": "--val-split", "data.csv_allow_outside": "--csv-allow-outside"}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text):
    """'1GB', '500MB', '64MiB' or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1GB, 500MB, 64MiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m data.shards", description="Write a data set as shards.")
    parser.add_argument("src", help="a data root in any layout train.py reads (split folders, class folders with "
                                    "--val-split, train.csv and val.csv)")
    parser.add_argument("out", help="the shard set to write (must not exist yet)")
    parser.add_argument("--shard-size", type=parse_size, default=parse_size("1GB"),
                        help="bytes of images a shard holds at most (default 1GB, as WebDataset advises)")
    parser.add_argument("--max-side", type=int, default=0,
                        help="re-encode images whose shorter side is larger to this many pixels (0: keep sizes)")
    parser.add_argument("--val-split", type=float, default=0.0,
                        help="a root of class folders: the share of each class held out for val")
    parser.add_argument("--seed", type=int, default=0, help="seed of the training images' order in the shards "
                                                             "(and of --val-split)")
    parser.add_argument("--csv-allow-outside", action="store_true",
                        help="train.csv and val.csv: also read paths that leave the CSV's folder")
    args = parser.parse_args(argv)
    if args.max_side < 0:
        parser.error(f"--max-side {args.max_side}: must be >= 0 (0 keeps sizes)")
    return args


def stored(path, train, max_side):
    """(bytes, extension, (height, width)) a sample stores for the image file at path (see the module's
    docstring)."""
    data = Path(path).read_bytes()
    with Image.open(io.BytesIO(data)) as image:
        upright = image.getexif().get(0x0112, 1) == 1  # EXIF orientation: 1 is as stored
        kind, mode, (width, height) = image.format, image.mode, image.size
        if kind in ("JPEG", "MPO"):  # verify() passes a JPEG cut short: it is decoded at 1/8 scale, which still
            image.draft(mode, (1, 1))  # reads every byte, so a damaged file is found here, not in training
            image.load()  # (any other image is decoded in full below)
    fits = not max_side or min(width, height) <= max_side
    if kind in ("JPEG", "MPO") and upright and mode in ("RGB", "L") and fits:  # MPO: a camera's JPEG, + previews
        return data, ".jpg", (height, width)
    image = decode(io.BytesIO(data))
    if not train and fits and kind in EXTENSIONS:  # decoded upright and made RGB when read, as an image file is
        return data, EXTENSIONS[kind], (image.height, image.width)
    if not train and fits:  # a format the reader does not take by its extension (GIF, ...): stored losslessly
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        return buffer.getvalue(), ".png", (image.height, image.width)
    if not fits:
        image = resized(image, max_side)
    return jpeg_bytes(image)[0], ".jpg", (image.height, image.width)


def resized(image, side):
    """image with its shorter side at side pixels (antialiased)."""
    scale = side / min(image.size)
    return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))), Image.BICUBIC)


def shuffled(samples, seed):
    """The training samples in a seeded random order: a folder lists them class by class, and a window of a few
    shards (data.shard_window) must hold every class in its share, not a few classes."""
    return [samples[i] for i in np.random.default_rng(seed).permutation(len(samples))]


def write_split(samples, folder, name, train, shard_size, max_side):
    """Write samples [(path, label)] as folder/{name}-NNNNNN.tar shards and folder/index.json; returns the count."""
    folder.mkdir(parents=True)
    shards, shard, count = [], None, 0

    def load(sample):
        path, label = sample
        try:
            return stored(path, train, max_side), label
        except (*UNREADABLE, OSError) as e:
            raise DatasetError(f"{path}: unreadable image ({unreadable_reason(e) if isinstance(e, UNREADABLE) else e})"
                               f"; remove it (or replace it) and write the set again") from None

    with ThreadPoolExecutor(cpu_count()) as pool:  # PIL decodes and encodes without the GIL
        for ((data, ext, size), label) in tqdm(in_order(pool, load, samples, 4 * cpu_count()), total=len(samples),
                                               desc=f"{name} shards", unit="img", file=sys.stderr):
            if shard is None or (shard["bytes"] + len(data) > shard_size and shard["nsamples"]):
                shard = new_shard(folder, name, len(shards), shard)
                shards.append(shard)
            add_member(shard["tar"], f"{count:09d}{ext}", data)
            add_member(shard["tar"], f"{count:09d}.cls", str(label).encode())
            shard["bytes"] += len(data)
            shard["nsamples"] += 1
            shard["labels"].append(int(label))
            shard["crcs"].append(zlib.crc32(data))
            shard["sizes"].append(list(size))
            count += 1
    close_shard(shard)
    index = {"__kind__": INDEX_KIND, "wids_version": 1, "name": name,
             "shardlist": [{key: s[key] for key in ("url", "nsamples", "filesize", "sha256", "labels", "crcs", "sizes")}
                           for s in shards]}
    (folder / "index.json").write_text(json.dumps(index, separators=(",", ":")))
    return count, len(shards)


def in_order(pool, work, items, ahead):
    """work(item) for each item on pool's threads, yielded in order, with a few tasks ahead: an item that fails
    stops the rest at once (pool.map would first submit them all, and finish them before its error is seen)."""
    pending = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(work, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for future in pending:
            future.cancel()


def new_shard(folder, name, number, previous):
    """Close the previous shard (its size and SHA-256 noted) and open the next."""
    close_shard(previous)
    path = folder / f"{name}-{number:06d}.tar"
    return {"path": path, "url": path.name, "tar": tarfile.open(path, "w", format=tarfile.USTAR_FORMAT), "bytes": 0,
            "nsamples": 0, "labels": [], "crcs": [], "sizes": []}


def close_shard(shard):
    if shard is None or shard["tar"] is None:
        return
    shard["tar"].close()
    shard["tar"] = None
    digest = hashlib.sha256()
    with open(shard["path"], "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    shard["filesize"], shard["sha256"] = shard["path"].stat().st_size, digest.hexdigest()


def add_member(tar, name, data):
    """A file in the tar with fixed owner and time, so the same images always make the same shard."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o444
    tar.addfile(info, io.BytesIO(data))


def write_shard_set(args):
    """The whole set, under a temporary name, renamed to args.out once complete; returns (train, val) counts."""
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists; give a new folder for the shard set (nothing is overwritten)")
    hold_out = HoldOut(args.val_split, args.seed) if args.val_split else None
    train_set, val_set = train_val_datasets(args.src, None, None, hold_out=hold_out,
                                            allow_outside=args.csv_allow_outside)
    if not hasattr(train_set, "samples"):
        raise UsageError(f"{args.src}: its images are not files (CIFAR's are one pickle); shards are written from "
                         f"image files")
    if getattr(train_set, "multilabel", False):
        raise UsageError(f"{args.src}: lists several labels per image (a labels column); a shard set holds one label "
                         f"per image: train on the root as it is (train.py --recipe multilabel.yaml with its path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(out) as tmp:  # renamed over out when complete: out is missing or empty, checked above
        counts = {split: write_split(samples, tmp / split, split, split == "train", args.shard_size, args.max_side)
                  for split, samples in (("train", shuffled(train_set.samples, args.seed)),
                                         ("val", val_set.samples))}
        top = {"__kind__": KIND, "classes": list(train_set.classes),
               "splits": {split: f"{split}/index.json" for split in counts},
               "images": {split: n for split, (n, _) in counts.items()}}
        (tmp / TOP).write_text(json.dumps(top, indent=1))
    return counts


def main(argv=None):
    """Write the shard set; bad input exits with code 2 and one line, in this command's flags."""
    args = parse_args(argv)
    try:
        counts = write_shard_set(args)
    except UsageError as e:
        exit_on_error("python -m data.shards", e, FLAGS)
    (train, train_shards), (val, val_shards) = counts["train"], counts["val"]
    print(f"{short_path(args.out)}: {train} train images in {train_shards} shard(s), {val} val images in "
          f"{val_shards} shard(s); train on it with data.name={short_path(args.out)}")


if __name__ == "__main__":
    after_imports()
    main()
