"""How a dataset root is laid out, and the layouts besides train/ and val/ class folders: a CSV per split listing
path,label, and one folder of class folders split by data.val_split, whose split the run saves (split.json) so that a
resumed run and val.py use exactly the same one, whatever files were added since.

Their datasets are ListedImages, which look like torchvision's ImageFolder (root, samples, targets, classes), so the
RAM cache, data.skip_corrupt, the samplers and val.py take them alike. Every layout's samples, an ImageFolder's too, are
a Listing: arrays, not a Python object per image, so that a process and each of its DataLoader workers hold some tens
of bytes an image, not hundreds (objects' reference counts, touched by a worker, copy their pages into it)."""

import csv
import hashlib
import operator
from collections.abc import Sequence
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torchvision.datasets import VisionDataset

from data.multilabel import multi_hot, split_labels
from utils.distributed import gather_object, on_rank0
from utils.general import LOGGER, RANK, DatasetError, colorstr, error_line
from utils.once import atomic_write

FOLDERS, CSV_FILES, CLASS_FOLDERS = "folders", "csv", "class folders"  # the layouts find_layout tells apart
VAL_NAMES = ("val", "valid", "test")  # a root's val split, the first present (Roboflow and Kaggle export 'valid')
SPLIT_NAMES = ("train", *VAL_NAMES)  # folders or CSVs (NAME.csv) that make a root a split one
NO_CSV_VAL = ("list the images to validate on in val.csv (path,label): data.val_split holds out class folders' "
              "images only")
SPLIT_FILE = "split.json"  # in the run directory: data.val_split's file lists
LISTS = ("train", "val")  # the file lists split.json holds


def hidden(path, root):
    """Whether path, under root, is or lies in a hidden file or folder (its name starts with '.': Jupyter's
    .ipynb_checkpoints, macOS's ._ copies, .git): never a class or an image, as in Hugging Face's image folders.
    Text, not pathlib: it is asked of every file of a listing (a million for ImageNet)."""
    path, root = str(path), str(root)
    below = path[len(root):] if root not in ("", ".") and path.startswith(root) else path
    return f"{os.sep}." in f"{os.sep}{below}"


@dataclass
class HoldOut:
    """data.val_split for a root of class folders: the share of each class held out for val, the seed that picks
    them, and the run directory whose saved split to reuse (a resumed run's), None to split afresh."""

    share: float = 0.0
    seed: int = 0
    saved_in: Path | None = None


class Listing(Sequence):
    """A data set's (path, target) samples, held as arrays: every path relative to root as UTF-8 (surrogateescape: any
    file name) in one bytes object with its start offsets, the targets as class indices, or for multi-label samples
    (tuples of class indices) every sample's indices in one array with their offsets; each array of the narrowest
    integer type that holds it (narrow). Reads as the list of tuples it replaces: samples[i] is
    (os.path.join(root, name), target), a list's equality and slices included.

    About 36 bytes an ImageNet image (30 of them its name), in pages a forked DataLoader worker shares with its
    process. A list of tuples of str took some 150 bytes more in the process, and about 190 in each worker, which
    copies the objects' pages as it touches their reference counts (or its garbage collector the tuples'):
    benchmarks/scale.py --only memory."""

    def __init__(self, root, names, offsets, labels, label_offsets=None):
        self.root, self.names, self.offsets, self.labels = str(root), names, offsets, labels
        self.label_offsets, self.multilabel = label_offsets, label_offsets is not None

    @classmethod
    def listed(cls, root, names, targets, multilabel=False):
        """The Listing of samples named (relative to root, or absolute) by names, with targets."""
        encoded = [name.encode("utf-8", "surrogateescape") for name in names]
        offsets = narrow(np.cumsum([0, *map(len, encoded)], dtype=np.int64))
        if not multilabel:
            return cls(root, b"".join(encoded), offsets, narrow(np.asarray(targets, dtype=np.int64).reshape(-1)))
        labels = narrow(np.fromiter((c for t in targets for c in t), np.int64))
        label_offsets = narrow(np.cumsum([0, *map(len, targets)], dtype=np.int64))
        return cls(root, b"".join(encoded), offsets, labels, label_offsets)

    @classmethod
    def of(cls, root, samples, multilabel=False):
        """The Listing of (path, target) samples whose paths lie under root (or are absolute)."""
        prefix = os.path.join(str(root), "")
        return cls.listed(root, [path.removeprefix(prefix) for path, _ in samples], [t for _, t in samples],
                          multilabel)

    @classmethod
    def joined(cls, root, parts):
        """One single-label Listing of parts (single-label Listings under root), in order."""
        starts = np.cumsum([0, *(len(part.names) for part in parts)])
        offsets = [np.zeros(1, np.int64), *(part.offsets[1:].astype(np.int64) + start
                                            for part, start in zip(parts, starts))]
        labels = [np.zeros(0, np.int64), *(part.labels.astype(np.int64) for part in parts)]
        return cls(root, b"".join(part.names for part in parts), narrow(np.concatenate(offsets)),
                   narrow(np.concatenate(labels)))

    def name(self, i):
        """Sample i's path relative to root."""
        return self.names[self.offsets[i] : self.offsets[i + 1]].decode("utf-8", "surrogateescape")

    def target(self, i):
        """Sample i's class index (an int), or its tuple of class indices (multi-label)."""
        if self.multilabel:
            return tuple(self.labels[self.label_offsets[i] : self.label_offsets[i + 1]].tolist())
        return int(self.labels[i])

    @property
    def targets(self):
        """The samples' targets, as a sequence that reads as their list."""
        return Targets(self)

    def taken(self, keep):
        """The Listing of the samples keep selects (indices, or a boolean mask), in order."""
        index = np.flatnonzero(keep) if np.asarray(keep).dtype == bool else np.asarray(keep, np.int64)
        targets = [self.target(i) for i in index] if self.multilabel else self.labels[index]
        return Listing.listed(self.root, [self.name(i) for i in index], targets, self.multilabel)

    def relabelled(self, new_index):
        """The same samples with class c now new_index[c] (single-label)."""
        return Listing(self.root, self.names, self.offsets, narrow(np.asarray(new_index, dtype=np.int64)[self.labels]))

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = operator.index(i)
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        return os.path.join(self.root, self.name(i)), self.target(i)

    def __len__(self):
        return len(self.offsets) - 1

    def __eq__(self, other):
        if isinstance(other, Listing):
            return (self.root, self.names, self.multilabel) == (other.root, other.names, other.multilabel) and all(
                np.array_equal(a, b) for a, b in ((self.offsets, other.offsets), (self.labels, other.labels),
                                                  (self.label_offsets, other.label_offsets)))
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None

    def __repr__(self):
        return f"Listing({list(self)!r})" if len(self) <= 20 else f"<Listing of {len(self)} samples under {self.root}>"


def narrow(values):
    """An int64 array as the narrowest of int16, int32 and int64 that holds its values (class indices rarely need
    more than two bytes, a listing's name offsets four)."""
    for dtype in (np.int16, np.int32):
        if not len(values) or np.iinfo(dtype).min <= values.min() and values.max() <= np.iinfo(dtype).max:
            return values.astype(dtype)
    return values


class Targets(Sequence):
    """A Listing's targets, read as their list: targets[i] is sample i's class index or tuple of class indices;
    np.asarray gives the class indices of single-label samples without a Python object each."""

    def __init__(self, listing):
        self.listing = listing

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.listing[i][1]

    def __len__(self):
        return len(self.listing)

    def __array__(self, dtype=None, copy=None):
        if self.listing.multilabel:
            raise TypeError("multi-label targets are tuples of class indices: see data/multilabel.py's multi_hot")
        return self.listing.labels.astype(np.int64 if dtype is None else dtype)  # held narrow, read as int64

    def __eq__(self, other):
        return isinstance(other, (Sequence, np.ndarray)) and list(self) == list(other)

    __hash__ = None

    def __repr__(self):
        return repr(list(self)) if len(self) <= 20 else f"<{len(self)} targets>"


def set_samples(dataset, samples):
    """Give a dataset (an ImageFolder, ListedImages) samples, a Listing: its imgs and targets to match."""
    dataset.samples = dataset.imgs = samples
    dataset.targets = samples.targets


class ListedImages(VisionDataset):
    """Images given as (path, class index) samples (a Listing), read like an ImageFolder's: the same attributes and
    the same loader. name ('train', 'val', 'valid', ...) names the file data.skip_corrupt keeps its results in.
    Multi-label samples hold a tuple of class indices instead, and load as a multi-hot uint8 vector
    (data/multilabel.py)."""

    def __init__(self, samples, classes, transform, loader, name):
        super().__init__(samples.root, transform=transform)
        self.classes, self.class_to_idx = list(classes), {c: i for i, c in enumerate(classes)}
        set_samples(self, samples)
        self.loader, self.name, self.multilabel = loader, name, samples.multilabel

    @property
    def verify_cache(self):
        """Where data.skip_corrupt keeps what it found: in the root, one file per split (as for train/ and val/)."""
        return Path(self.root) / f".verified-{self.name}.json"

    def __getitem__(self, index):
        path, target = self.samples[index]
        image = self.loader(path)
        if self.multilabel:
            target = multi_hot([target], len(self.classes))[0]
        return (image if self.transform is None else self.transform(image)), target

    def __len__(self):
        return len(self.samples)


def find_layout(root, val_split=None):
    """FOLDERS (train/ and val/, valid/ or test/), CSV_FILES (train.csv and val.csv, ...; they win over folders,
    which may hold the CSVs' images) or CLASS_FOLDERS (one folder of class folders, for data.val_split); a root
    with only a val split (for val.py) counts as its layout. With the recipe's val_split (not None), a root it does
    not fit is an error that says what to do."""
    try:
        csvs = [f"{name}.csv" for name in SPLIT_NAMES if (root / f"{name}.csv").is_file()]
        folders = [f"{name}/" for name in SPLIT_NAMES if (root / name).is_dir()]
        others = not (csvs or folders) and any(entry.is_dir() and not hidden(entry.name, "")
                                               for entry in os.scandir(root))
    except OSError as e:
        raise DatasetError(f"{root}: cannot be listed ({e.strerror or e})") from None
    if not (csvs or folders or others):
        raise DatasetError(f"{root}: no train/ folder, train.csv or class folders; a dataset root holds "
                           f"train/<class>/* and val/<class>/* (or valid/, test/), or train.csv and val.csv "
                           f"(path,label), or only class folders <class>/* with data.val_split=0.2 (the share held "
                           f"out for val)")
    if val_split and not others:
        raise DatasetError(f"data.val_split={val_split}: {root} has its own split ({', '.join(csvs or folders)}); "
                           + (NO_CSV_VAL if csvs == ["train.csv"]
                              else f"to hold out part of train/, name it: data.name={root / 'train'}"
                              if folders == ["train/"] else "set data.val_split=0, or name a folder of class folders "
                              "only"))
    if val_split == 0 and others:
        raise DatasetError(f"{root}: no train/ folder or train.csv; if its folders are the classes, set data.val_split "
                           f"(e.g. data.val_split=0.2) to hold out that share of each class for val")
    return CSV_FILES if csvs else FOLDERS if folders else CLASS_FOLDERS


def listed_alike(root, build, *args):
    """build(*args): a tuple of datasets that each rank lists for itself (from its own disk), returned once every rank
    holds the same classes and (path relative to the dataset's root, class) samples in the same order. A DatasetError
    that some ranks meet and others not (a file missing on one machine), or lists that differ (copies that differ,
    files added during start-up), stop every rank with one line naming the ranks and machines and what each saw."""
    try:
        datasets, error = build(*args), None
    except DatasetError as e:
        datasets, error = None, e
    reports = gather_object((socket.gethostname(), error_line(error) if error else None,
                             None if error else [listing(dataset) for dataset in datasets]))
    hosts = [host for host, _, _ in reports]
    failed = {rank: message for rank, (_, message, _) in enumerate(reports) if message is not None}
    if error is not None and len(failed) == len(reports) and len(set(failed.values())) == 1:
        raise error  # every rank met the same problem: said as it is, once
    if failed:
        message = next(iter(failed.values()))
        alike = [rank for rank, m in failed.items() if m == message]
        fine = [rank for rank in range(len(reports)) if rank not in failed]
        others = f", other errors by {len(failed) - len(alike)} other rank(s)" if len(failed) > len(alike) else ""
        raise DatasetError(f"{message} (met by {places(alike, hosts)}{others}"
                           f"{f', not by {places(fine, hosts)}' if fine else ''}); {SAME_DATA}")
    seen = [listings for _, _, listings in reports]
    if any(listings != seen[0] for listings in seen):
        raise DatasetError(f"{root}: the ranks list different images: {differing(seen, hosts)}; {SAME_DATA}")
    return datasets


SAME_DATA = ("every machine needs the same copy of the dataset (the same files, at the same paths under its root), "
             "unchanged while the run starts: make the copies identical (e.g. rsync -a --delete from one machine) "
             "and start again")


def listing(dataset):
    """(images, classes, digest) of a dataset: the digest hashes its classes and its (path relative to its root,
    class) samples in order (its Listing's arrays); equal on two ranks when they list the same."""
    samples = dataset.samples
    digest = hashlib.sha256(samples.names)
    for array in (samples.offsets, samples.labels, samples.label_offsets):
        digest.update(b"" if array is None else array.tobytes())
    digest.update(json.dumps(dataset.classes).encode())
    return len(dataset.samples), len(dataset.classes), digest.hexdigest()


def differing(seen, hosts):
    """What each group of ranks with the same listings (one per dataset) saw: 'rank 0 on a: 10 train / 4 val images,
    2 classes; rank 1 on b: ...', with the same counts said to hide other files, labels or order."""
    groups = {}
    for rank, listings in enumerate(seen):
        groups.setdefault(tuple(map(tuple, listings)), []).append(rank)
    counts = {tuple(listing[:2] for listing in listings) for listings in groups}
    described = [f"{places(ranks, hosts)}: {' / '.join(str(n) for n, _, _ in listings)} images "
                 f"({'train / val' if len(listings) == 2 else 'in the split'}), {listings[0][1]} classes"
                 for listings, ranks in groups.items()]
    same = " (the same counts: other files, labels or order)" if len(counts) == 1 else ""
    return "; ".join(described) + same


def places(ranks, hosts):
    """'rank 3 on a', 'ranks 0-7 on a, 16-23 on c': ranks (ascending) by the machine (hosts[rank]) they run on."""
    by_host = {}
    for rank in ranks:
        by_host.setdefault(hosts[rank], []).append(rank)
    return f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(f"{spans(on)} on {host}" for host, on in by_host.items())


def spans(numbers):
    """'0-7, 9, 12-13' of ascending integers."""
    runs = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def first_present(root, names, what):
    """root/NAME for the first of names that exists, else a DatasetError saying what was looked for."""
    for name in names:
        if (root / name).exists():
            return root / name
    raise DatasetError(f"{root}: no {either(names)} {what}")


def either(names):
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


def csv_datasets(root, train_transform, val_transform, loader, allow_outside=False):
    """The train and val sets a CSV root lists: train.csv and the first of val.csv, valid.csv and test.csv; rank 0
    warns of images listed in both. allow_outside (data.csv_allow_outside): accept paths outside root."""
    train_csv = root / "train.csv"
    val_csv = first_present(root, [f"{name}.csv" for name in VAL_NAMES], f"beside train.csv; {NO_CSV_VAL}")
    train_set = csv_dataset(train_csv, train_transform, loader, allow_outside=allow_outside)
    val_set = csv_dataset(val_csv, val_transform, loader, train_set.classes, f"has no training images in {train_csv}",
                          allow_outside, train_set.label_bar)  # split as train.csv is: a val.csv may have no '|'
    if val_set.multilabel != train_set.multilabel:
        kinds = {True: "a labels column (several labels per image)", False: "a label column (one label per image)"}
        raise DatasetError(f"{val_csv}: has {kinds[val_set.multilabel]}, {train_csv.name} has "
                           f"{kinds[train_set.multilabel]}; give both the same columns")
    trained = {path for path, _ in train_set.samples}  # normalised, as csv_dataset lists them
    shared = [path for path, _ in val_set.samples if path in trained]
    if shared and RANK == 0:
        LOGGER.warning(f"{colorstr('data:')} {len(shared)} of the {len(val_set)} images of {val_csv.name} are also "
                       f"in {train_csv.name} (e.g. {os.path.relpath(shared[0], root)}): val scores them after "
                       f"training on them; list each image in one of the two")
    return train_set, val_set


def csv_dataset(csv_file, transform, loader, classes=None, unknown_means="", allow_outside=False, bar=None):
    """A ListedImages of a path,label CSV, or a multi-label one of a path,labels CSV (data/multilabel.py; paths
    relative to its folder, which they may not leave unless allow_outside). Its classes are its sorted labels (as
    ImageFolder sorts folders), or the given ones, where a label not among them is an error ending in unknown_means.
    A bad row, a missing file or an image listed with two labels (label sets) is a DatasetError naming the CSV and the
    line; rank 0 warns of an image listed twice with the same. bar: whether multi-label cells split on '|' (the
    training CSV's choice, label_bar); None: as this file says (uses_bar)."""
    rows, multilabel = csv_rows(csv_file)
    bar = uses_bar(rows, multilabel) if bar is None else bar
    if multilabel:
        rows = [(line, path, tuple(sorted(split_labels(labels, bar)))) for line, path, labels in rows]
    names = [os.path.normpath(path) for _, path, _ in rows]  # as compared: ./a.png, a//b.png are a.png, a/b.png
    if not allow_outside:
        check_inside(csv_file, rows, names)
    labels_of = (lambda labels: labels) if multilabel else (lambda label: (label,))
    classes = sorted({name for _, _, labels in rows for name in labels_of(labels)}) if classes is None \
        else list(classes)
    index, folder = {name: i for i, name in enumerate(classes)}, csv_file.parent
    for line, _, labels in rows:
        for label in labels_of(labels):
            if label not in index:
                raise DatasetError(f"{csv_file}, line {line}: label {label!r} {unknown_means}")
    repeats = repeated_rows(csv_file, rows, names)
    target = (lambda labels: tuple(sorted(index[name] for name in labels))) if multilabel else index.__getitem__
    samples = Listing.listed(folder, names, [target(labels) for _, _, labels in rows], multilabel)
    missing = [(line, path) for (line, path, _), name in zip(rows, names)
               if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        (line, path), more = missing[0], f" ({len(missing)} of its {len(rows)} files are missing)"
        raise DatasetError(f"{csv_file}, line {line}: {path}: no such file{more if len(missing) > 1 else ''}; paths "
                           f"are relative to the CSV's folder, {folder}")
    if repeats and RANK == 0:
        first, line, path = repeats[0]
        LOGGER.warning(f"{colorstr('data:')} {csv_file}: {len(repeats)} row(s) list an image again with the same label "
                       f"(e.g. {path}, lines {first} and {line}); each image counts as often as it is listed")
    dataset = ListedImages(samples, classes, transform, loader, csv_file.stem)
    dataset.label_bar = bar
    return dataset


def uses_bar(rows, multilabel):
    """Whether a CSV's labels cells split on '|' (any cell holds one), for csv_rows' rows."""
    return multilabel and any("|" in labels for _, _, labels in rows)


def training_bar(root):
    """Whether root's train.csv splits its labels on '|', which its other CSVs then do too; None without one."""
    train_csv = root / "train.csv"
    return uses_bar(*csv_rows(train_csv)) if train_csv.is_file() else None


def check_inside(csv_file, rows, names):
    """Refuse rows whose path (normalised: names) leaves the CSV's folder, by '..' or from the filesystem's root: a
    list is read from where it lies unless the recipe says otherwise."""
    leaving = (os.sep, os.pardir + os.sep)
    outside = [i for i, name in enumerate(names) if name.startswith(leaving) or name == os.pardir]
    if outside:
        (line, path, _), more = rows[outside[0]], f" ({len(outside)} of its {len(rows)} paths are)"
        raise DatasetError(f"{csv_file}, line {line}: {path} lies outside the CSV's folder, {csv_file.parent}"
                           f"{more if len(outside) > 1 else ''}; list images inside it, or read paths "
                           f"outside it with data.csv_allow_outside=true")


def repeated_rows(csv_file, rows, names):
    """[(first line, line, path)] of the rows that list an image (by its normalised path: names) again with the same
    label; one listed with two labels is a DatasetError naming both lines."""
    first, repeats = {}, []
    if len(set(names)) == len(names):  # the common case, in a fraction of the loop's time
        return repeats
    for (line, path, label), name in zip(rows, names):
        seen_line, seen_path, seen_label = first.setdefault(name, (line, path, label))
        if seen_line == line:
            continue
        if seen_label != label:
            raise DatasetError(f"{csv_file}: line {seen_line} labels {seen_path} {seen_label!r} and line {line} "
                               f"labels {path} {label!r}; an image has one label"
                               f"{' set' if isinstance(label, tuple) else ''}: remove one of the rows")
        repeats.append((seen_line, line, path))
    return repeats


def csv_rows(csv_file):
    """([(line, path, label)], False) of a CSV whose header names a path and a label column (others are ignored),
    the label without surrounding spaces; ([(line, path, labels cell)], True) of one with a labels column instead:
    multi-label (a CSV with both is read by its label column, as before multi-label), an empty cell meaning none."""
    reader = None
    try:
        with open(csv_file, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            if "path" not in header or not {"label", "labels"} & set(header):
                raise DatasetError(f"{csv_file}, line 1: the header must name the columns path,label (one label per "
                                   f"image; path relative to the CSV's folder) or path,labels (several), got "
                                   f"{','.join(header) or 'nothing'}")
            column = "label" if "label" in header else "labels"
            rows = [(reader.line_num, row["path"], row[column]) for row in reader]
    except UnicodeDecodeError as e:
        raise DatasetError(f"{csv_file}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except csv.Error as e:
        raise DatasetError(f"{csv_file}, line {reader.line_num if reader else 1}: not CSV ({e})") from None
    except OSError as e:
        raise DatasetError(f"{csv_file}: cannot be read ({e.strerror or e})") from None
    multilabel = column == "labels"
    if not multilabel:  # a spreadsheet's 'cat ' is the class cat, as a labels cell's names are stripped
        rows = [(line, path, label.strip() if label else label) for line, path, label in rows]
    for line, path, label in rows:
        # empty, or missing from a short row (None); a multi-label image may have no labels, but not a short row
        if not path or (not label if not multilabel else label is None):
            raise DatasetError(f"{csv_file}, line {line}: no {'path' if not path else column}; each row is "
                               f"path,{column}")
    if not rows:
        raise DatasetError(f"{csv_file}: no rows under its header; list one image per line as path,{column}")
    return rows, multilabel


def split_files(folder, share, seed):
    """data.val_split of an ImageFolder of class folders, as the lists split.json holds: each class's files (paths
    relative to the folder, '/'-separated) ordered by a hash of (seed, path), the first round(share x n) held out
    for val, at least one of a class with two or more, never all of them. Stratified, and the same for the same files
    and seed on any machine."""
    root, by_class = Path(folder.root), [[] for _ in folder.classes]
    for path, target in folder.samples:
        by_class[target].append(Path(path).relative_to(root).as_posix())
    train, val = [], []
    for files in by_class:
        files.sort(key=lambda name: hashlib.sha256(f"{seed}/{name}".encode("utf-8", "surrogateescape")).digest())
        held = min(max(math.floor(share * len(files) + 0.5), 1), len(files) - 1) if len(files) > 1 else 0
        val += sorted(files[:held])
        train += sorted(files[held:])
    return {"classes": list(folder.classes), "train": train, "val": val}


def listed_split(root, record, which, transform, loader, classes, source):
    """A ListedImages of a split record's `which` list ('train' or 'val') under root, labelled with classes (a file's
    class is its first folder); a listed file that is gone, or of another class, is an error naming source."""
    index, targets = {name: i for i, name in enumerate(classes)}, []
    for name in record[which]:
        label = name.split("/", 1)[0]
        if label not in index:
            raise DatasetError(f"{source}: {name}: class {label!r} is not among the {len(classes)} classes "
                               f"{classes[:5]}...")
        targets.append(index[label])
    missing = [name for name in record[which] if not os.path.isfile(os.path.join(root, name))]
    if missing:
        raise DatasetError(f"{source}: {len(missing)} of its {len(targets)} {which} files are not in {root} (e.g. "
                           f"{missing[0]}); restore them, or start a new run, which splits the folder afresh")
    return ListedImages(Listing.listed(root, record[which], targets), classes, transform, loader, which)


def read_split(path, remedy):
    """The split record saved at path (rank 0 reads it for all: the ranks need not share a disk); a missing or
    damaged file is a DatasetError ending in remedy."""
    def read():
        try:
            record = json.loads(Path(path).read_text(encoding="utf-8", errors="surrogateescape"))
        except FileNotFoundError:
            raise DatasetError(f"{path}: missing; it holds the run's data.val_split split; {remedy}") from None
        except ValueError as e:
            raise DatasetError(f"{path}: not a split file of train.py ({e}); {remedy}") from None
        if not isinstance(record, dict) or not all(isinstance(record.get(k), list) for k in ("classes", *LISTS)):
            raise DatasetError(f"{path}: not a split file of train.py (no classes, train and val lists); {remedy}")
        return record
    return on_rank0(read)


def held_out_folder(train_set, val_set):
    """The folder that holds the val images alone (a root's val/), or None: data.val_split and CSV lists hold them
    among the training images in one root, and CIFAR's are not files."""
    if getattr(val_set, "samples", None) and Path(val_set.root) != Path(train_set.root):
        return val_set.root
    return None


def save_split(run_dir, cfg, train_set, val_set):
    """With data.val_split, rank 0 saves the run's split as run_dir/split.json (atomically): the classes and the
    files each set holds, relative to data.name, for a resumed run and val.py to read instead of splitting again."""
    if not cfg.data.val_split:
        return
    root = Path(train_set.root)
    record = {"data": cfg.data.name, "val_split": cfg.data.val_split, "seed": cfg.seed,
              "classes": list(train_set.classes),
              **{which: [Path(path).relative_to(root).as_posix() for path, _ in dataset.samples]
                 for which, dataset in zip(LISTS, (train_set, val_set))}}

    def write():
        path = run_dir / SPLIT_FILE
        with atomic_write(path) as tmp:
            # Unicode as written (class names stay readable); surrogateescape keeps file names that are not UTF-8.
            tmp.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n", encoding="utf-8",
                           errors="surrogateescape")
    on_rank0(write)
