"""How a dataset root is laid out, and the layouts besides train/ and val/ class folders: a CSV per split listing
path,label, and one folder of class folders split by data.val_split, whose split the run saves (split.json) so that a
resumed run and val.py use exactly the same one, whatever files were added since.

Their datasets are ListedImages, which look like torchvision's ImageFolder (root, samples, targets, classes), so the
RAM cache, data.skip_corrupt, the samplers and val.py take them alike."""

import csv
import hashlib
import json
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from torchvision.datasets import VisionDataset

from utils.distributed import on_rank0
from utils.general import DatasetError

FOLDERS, CSV_FILES, CLASS_FOLDERS = "folders", "csv", "class folders"  # the layouts find_layout tells apart
VAL_NAMES = ("val", "valid", "test")  # a root's val split, the first present (Roboflow and Kaggle export 'valid')
SPLIT_NAMES = ("train", *VAL_NAMES)  # folders or CSVs (NAME.csv) that make a root a split one
SPLIT_FILE = "split.json"  # in the run directory: data.val_split's file lists
LISTS = ("train", "val")  # the file lists split.json holds


@dataclass
class HoldOut:
    """data.val_split for a root of class folders: the share of each class held out for val, the seed that picks
    them, and the run directory whose saved split to reuse (a resumed run's), None to split afresh."""

    share: float = 0.0
    seed: int = 0
    saved_in: Path | None = None


class ListedImages(VisionDataset):
    """Images given as (path, class index) samples, read like an ImageFolder's: the same attributes and the same
    loader. name ('train', 'val', 'valid', ...) names the file data.skip_corrupt keeps its results in."""

    def __init__(self, root, samples, classes, transform, loader, name):
        super().__init__(str(root), transform=transform)
        self.classes, self.class_to_idx = list(classes), {c: i for i, c in enumerate(classes)}
        self.samples = self.imgs = samples
        self.targets = [target for _, target in samples]
        self.loader, self.name = loader, name

    @property
    def verify_cache(self):
        """Where data.skip_corrupt keeps what it found: in the root, one file per split (as for train/ and val/)."""
        return Path(self.root) / f".verified-{self.name}.json"

    def __getitem__(self, index):
        path, target = self.samples[index]
        image = self.loader(path)
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
        others = not (csvs or folders) and any(entry.is_dir() for entry in os.scandir(root))
    except OSError as e:
        raise DatasetError(f"{root}: cannot be listed ({e.strerror or e})") from None
    if not (csvs or folders or others):
        raise DatasetError(f"{root}: no train/ folder, train.csv or class folders; a dataset root holds "
                           f"train/<class>/* and val/<class>/* (or valid/, test/), or train.csv and val.csv "
                           f"(path,label), or only class folders <class>/* with data.val_split=0.2 (the share held "
                           f"out for val)")
    if val_split and not others:
        raise DatasetError(f"data.val_split={val_split}: {root} has its own split ({', '.join(csvs or folders)}); "
                           f"set data.val_split=0, or name a folder of class folders only")
    if val_split == 0 and others:
        raise DatasetError(f"{root}: no train/ folder or train.csv; if its folders are the classes, set data.val_split "
                           f"(e.g. data.val_split=0.2) to hold out that share of each class for val")
    return CSV_FILES if csvs else FOLDERS if folders else CLASS_FOLDERS


def first_present(root, names, what):
    """root/NAME for the first of names that exists, else a DatasetError saying what was looked for."""
    for name in names:
        if (root / name).exists():
            return root / name
    raise DatasetError(f"{root}: no {either(names)} {what}")


def either(names):
    """'a', 'a or b', 'a, b or c'."""
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else names[0]


def csv_datasets(root, train_transform, val_transform, loader):
    """The train and val sets a CSV root lists: train.csv and the first of val.csv, valid.csv and test.csv."""
    train_csv = root / "train.csv"
    val_csv = first_present(root, [f"{name}.csv" for name in VAL_NAMES], "beside train.csv")
    train_set = csv_dataset(train_csv, train_transform, loader)
    return train_set, csv_dataset(val_csv, val_transform, loader, train_set.classes,
                                  f"has no training images in {train_csv}")


def csv_dataset(csv_file, transform, loader, classes=None, unknown_means=""):
    """A ListedImages of a path,label CSV (paths relative to its folder). Its classes are its sorted labels (as
    ImageFolder sorts folders), or the given ones, where a label not among them is an error ending in unknown_means.
    A bad row or a missing file is a DatasetError naming the CSV and the line."""
    rows = csv_rows(csv_file)
    classes = sorted({label for _, _, label in rows}) if classes is None else list(classes)
    index, folder = {name: i for i, name in enumerate(classes)}, csv_file.parent
    for line, _, label in rows:
        if label not in index:
            raise DatasetError(f"{csv_file}, line {line}: label {label!r} {unknown_means}")
    samples = [(os.path.join(folder, path), index[label]) for _, path, label in rows]
    missing = [(line, path) for (line, path, _), (full, _) in zip(rows, samples) if not os.path.isfile(full)]
    if missing:
        (line, path), more = missing[0], f" ({len(missing)} of its {len(rows)} files are missing)"
        raise DatasetError(f"{csv_file}, line {line}: {path}: no such file{more if len(missing) > 1 else ''}; paths "
                           f"are relative to the CSV's folder, {folder}")
    return ListedImages(folder, samples, classes, transform, loader, csv_file.stem)


def csv_rows(csv_file):
    """[(line, path, label)] of a CSV whose header names a path and a label column (others are ignored)."""
    reader = None
    try:
        with open(csv_file, newline="", encoding="utf-8-sig") as f:  # -sig: a spreadsheet's byte-order mark
            reader = csv.DictReader(f)
            header = reader.fieldnames or []
            if not {"path", "label"} <= set(header):
                raise DatasetError(f"{csv_file}, line 1: the header must name the columns path,label (path relative "
                                   f"to the CSV's folder), got {','.join(header) or 'nothing'}")
            rows = [(reader.line_num, row["path"], row["label"]) for row in reader]
    except UnicodeDecodeError as e:
        raise DatasetError(f"{csv_file}: not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8") from None
    except csv.Error as e:
        raise DatasetError(f"{csv_file}, line {reader.line_num if reader else 1}: not CSV ({e})") from None
    except OSError as e:
        raise DatasetError(f"{csv_file}: cannot be read ({e.strerror or e})") from None
    for line, path, label in rows:
        if not path or not label:  # empty, or missing from a short row (None)
            raise DatasetError(f"{csv_file}, line {line}: no {'path' if not path else 'label'}; each row is path,label")
    if not rows:
        raise DatasetError(f"{csv_file}: no rows under its header; list one image per line as path,label")
    return rows


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
    index, samples = {name: i for i, name in enumerate(classes)}, []
    for name in record[which]:
        label = name.split("/", 1)[0]
        if label not in index:
            raise DatasetError(f"{source}: {name}: class {label!r} is not among the {len(classes)} classes "
                               f"{classes[:5]}...")
        samples.append((os.path.join(root, name), index[label]))
    missing = [name for name, (path, _) in zip(record[which], samples) if not os.path.isfile(path)]
    if missing:
        raise DatasetError(f"{source}: {len(missing)} of its {len(samples)} {which} files are not in {root} (e.g. "
                           f"{missing[0]}); restore them, or start a new run, which splits the folder afresh")
    return ListedImages(root, samples, classes, transform, loader, which)


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
        tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
        # Unicode as written (class names stay readable); surrogateescape keeps file names that are not UTF-8.
        tmp.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n", encoding="utf-8",
                       errors="surrogateescape")
        os.replace(tmp, path)
    on_rank0(write)
