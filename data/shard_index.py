"""Index shards that another tool wrote, so that data.name reads them in place (data/shard_sets.py).

Usage:
    python -m data.shard_index path/to/webdataset

The folder holds train/*.tar and val/*.tar in WebDataset's layout: a sample is the members that share a key (the
path up to the first dot of the file name), one image (`.jpg`, `.png`, ...) and `.cls`, its class as an index
(`3`) or a name (`cat`). Each shard is read once, and beside the shards are written what the reader needs and a
plain wids index lacks: per split an index.json (`wids-shard-index-v1`, each shard's size and SHA-256, each
sample's label, CRC-32 and size) and, last, dataset.json naming the classes (the names sorted, or 0..max for
indexes) and both splits. The shards themselves are not changed. Training images must be upright RGB or grey
JPEGs, as the JPEG decoder reads them; a set with others is refused, naming the first, and can be rewritten from
its images with `python -m data.shards`.
"""

import argparse
import hashlib
import io
import json
import sys
import tarfile
import zlib
from pathlib import Path

from utils.general import DatasetError, UsageError, after_imports, before_imports, short_path

if __name__ == "__main__":  # first: no garbage collection while torch imports (data.shard_sets')
    before_imports()

from PIL import Image
from tqdm import tqdm

from data.shard_sets import IMAGE_EXTENSIONS, INDEX_KIND, KIND, TOP
from data.verify import UNREADABLE, decode, unreadable_reason
from utils.distributed import exit_on_error
from utils.once import atomic_write


def tar_samples(path):
    """[(key, {'.ext': bytes})] of a WebDataset tar, in order: consecutive members sharing a key."""
    samples = []
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, _, name = member.name.rpartition("/")
            stem, _, ext = name.partition(".")
            key = f"{folder}/{stem}" if folder else stem
            if not samples or samples[-1][0] != key:
                samples.append((key, {}))
            samples[-1][1]["." + ext.lower()] = tar.extractfile(member).read()
    return samples


def image_entry(path, key, members, train):
    """(label text, CRC-32, (height, width)) of one sample; a missing part or a training image the JPEG decoder
    cannot take is an error naming the shard and the key."""
    image = next((data for ext, data in members.items() if ext in IMAGE_EXTENSIONS), None)
    if image is None or ".cls" not in members:
        raise DatasetError(f"{path}: sample {key} has no {'image' if image is None else '.cls'} member")
    try:
        with Image.open(io.BytesIO(image)) as opened:
            upright = opened.getexif().get(0x0112, 1) == 1
            kind, mode, (width, height) = opened.format, opened.mode, opened.size
        if not train:
            height, width = decode(io.BytesIO(image)).size[::-1]  # val: decoded upright, as an image file is
    except UNREADABLE as e:
        raise DatasetError(f"{path}: sample {key}: unreadable image ({unreadable_reason(e)})") from None
    if train and not (kind in ("JPEG", "MPO") and upright and mode in ("RGB", "L")):
        raise DatasetError(f"{path}: sample {key} is a {kind} image ({mode}{'' if upright else ', EXIF-turned'}): "
                           f"training images of a shard set are upright RGB or grey JPEGs; write the set from its "
                           f"images with `python -m data.shards`")
    return members[".cls"].decode().strip(), zlib.crc32(image), [height, width]


def scan_shard(path, train):
    """A shard's index entry, its labels still as text."""
    try:
        samples = tar_samples(path)
    except (tarfile.TarError, OSError) as e:
        raise DatasetError(f"{path}: not a readable tar file ({e})") from None
    entries = [image_entry(path, key, members, train) for key, members in samples]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return {"url": path.name, "nsamples": len(entries), "filesize": path.stat().st_size, "sha256": digest.hexdigest(),
            "labels": [e[0] for e in entries], "crcs": [e[1] for e in entries], "sizes": [e[2] for e in entries]}


def class_list(shards):
    """The classes the .cls values name: 0..max where all are indexes, else the training names sorted."""
    values = {label for split in shards.values() for shard in split for label in shard["labels"]}
    if all(value.isdigit() for value in values):
        return [str(i) for i in range(max(map(int, values)) + 1)]
    if any(value.isdigit() for value in values):
        raise DatasetError("the .cls members mix class indexes and class names; use one or the other")
    classes = sorted({label for shard in shards["train"] for label in shard["labels"]})
    unseen = sorted(values - set(classes))
    if unseen:
        raise DatasetError(f"val names classes with no training images: {', '.join(unseen[:5])}")
    return classes


def scanned(paths, train, desc):
    """scan_shard of each path, with a progress bar that is closed before an error is said."""
    with tqdm(paths, desc=desc, unit="shard", file=sys.stderr) as bar:
        return [scan_shard(path, train) for path in bar]


def index_shards(src):
    """Write src's split indexes and dataset.json (last, so a half-indexed set is never read); returns the counts."""
    src = Path(src)
    if (src / TOP).exists():
        raise UsageError(f"{src / TOP} already exists: the set is indexed (remove it to index it again)")
    tars = {split: sorted((src / split).glob("*.tar")) for split in ("train", "val")}
    for split, paths in tars.items():
        if not paths:
            raise UsageError(f"{src}: no {split}/*.tar; give a folder whose train/ and val/ hold WebDataset shards")
    shards = {split: scanned(paths, split == "train", f"{split} shards") for split, paths in tars.items()}
    classes = class_list(shards)
    number = {name: i for i, name in enumerate(classes)}
    for split, entries in shards.items():
        for shard in entries:
            shard["labels"] = [number[label] for label in shard["labels"]]
        index = {"__kind__": INDEX_KIND, "wids_version": 1, "name": split, "shardlist": entries}
        write_atomically(src / split / "index.json", json.dumps(index, separators=(",", ":")))
    counts = {split: sum(s["nsamples"] for s in entries) for split, entries in shards.items()}
    write_atomically(src / TOP, json.dumps({"__kind__": KIND, "classes": classes,
                                            "splits": {split: f"{split}/index.json" for split in shards},
                                            "images": counts}, indent=1))
    return counts, {split: len(entries) for split, entries in shards.items()}


def write_atomically(path, text):
    """Write text to path whole (utils/once.atomic_write)."""
    with atomic_write(path) as tmp:
        tmp.write_text(text)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m data.shard_index", description=__doc__.split("\n")[0])
    parser.add_argument("src", help="a folder whose train/ and val/ hold WebDataset shards (*.tar)")
    args = parser.parse_args(argv)
    try:
        counts, shards = index_shards(args.src)
    except UsageError as e:
        exit_on_error("python -m data.shard_index", e)
    print(f"{short_path(args.src)}: {counts['train']} train images in {shards['train']} shard(s), {counts['val']} "
          f"val images in {shards['val']} shard(s) indexed; train on it with data.name={short_path(args.src)}")


if __name__ == "__main__":
    after_imports()
    main()
