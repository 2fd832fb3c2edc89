"""Which samples a data.name has: the embedded digits (written once, as an ImageFolder), a dataset root in any
layout (split folders, class folders with data.val_split, train.csv and val.csv: data/layouts.py), CIFAR-10/100
(data/cifar.py) or, to evaluate, a shard set's split (data/shard_sets.py). Each is a dataset of (image, label) with
its classes, read per image (through its transform, where given); data/datasets.py joins it with how the samples
are stored and read for training. Every rank lists the same samples, or stops with one line (listed_alike)."""

import os
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

import utils.general
from data.cifar import CIFAR, cifar_dataset
from data.layouts import (CLASS_FOLDERS, CSV_FILES, SPLIT_FILE, VAL_NAMES, HoldOut, Listing, csv_dataset, csv_datasets,
                          either, find_layout, first_present, hidden, listed_alike, listed_split, read_split,
                          set_samples, split_files, training_bar)
from data.multilabel import write_multidigits
from data.shard_sets import eval_shards
from data.verify import UNREADABLE, decode, unreadable_images, unreadable_reason
from utils.checkpoint import run_dir_of
from utils.config import names_shards
from utils.distributed import on_rank0, topology
from utils.general import LOGGER, RANK, DatasetError, ImageError, colorstr, short_path
from utils.once import atomic_write, once_per_machine


def write_digits(root, report=lambda n: None):
    """Write scikit-learn's 1,797 real 8x8 handwritten digits as a PNG ImageFolder, fixed stratified 80/20 split;
    report(1) after each image."""
    from sklearn.datasets import load_digits  # the images ship inside scikit-learn; nothing is downloaded
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)  # values are 0..16 in the source
    train_idx, val_idx = train_test_split(
        np.arange(len(pixels)), test_size=0.2, stratify=digits.target, random_state=0)
    with atomic_write(root, first_wins=True) as tmp:  # another machine on a shared disk may finish first
        for split, indices in (("train", train_idx), ("val", val_idx)):
            for i in indices:
                folder = tmp / split / str(digits.target[i])
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels[i]).save(folder / f"{i:04d}.png")
                report(1)


# Datasets that ship with our requirements, written on first use.
EMBEDDED = {"digits": write_digits, "multidigits": write_multidigits}


def dataset_root(name):
    """ImageFolder root for data.name: an embedded dataset (written once by local rank 0) or a user directory."""
    if name in EMBEDDED:
        root = utils.general.DATASETS_DIR / name  # read when called: tests point it elsewhere

        def write(report):
            if not root.exists():
                root.parent.mkdir(parents=True, exist_ok=True)
                EMBEDDED[name](root, report)
        once_per_machine("embedded", f"writing {root}", write)  # local rank 0 writes; the others wait, then read
        return root
    root = Path(name)
    if not root.is_dir():
        raise DatasetError(f"data.name '{name}' is neither a dataset here ({', '.join([*EMBEDDED, *CIFAR])}) "
                           f"nor a directory; give the path of a dataset root holding train/<class>/* and "
                           f"val/<class>/*, train.csv and val.csv, or class folders (nothing is downloaded)")
    return root


def split_dir(root, split):
    """root/train, or for split 'val' the first of root/val, root/valid and root/test."""
    names = VAL_NAMES if split == "val" else (split,)
    for name in names:
        if (root / name).is_dir():
            return root / name
    hold_out = f"; or hold out part of train/: data.name={root / 'train'} data.val_split=0.2" if split == "val" else ""
    raise DatasetError(f"{root}: no {either([f'{n}/' for n in names])} folder; an ImageFolder root holds "
                       f"train/<class>/* and val/<class>/* (or valid/, test/){hold_out}")


def load_rgb(path):
    """ImageFolder loader: the decoded RGB image, or an ImageError naming the file (PIL's errors name none)."""
    try:
        return decode(path)
    except UNREADABLE as e:
        raise ImageError(f"{path}: unreadable image ({unreadable_reason(e)}); remove the file, or skip unreadable "
                         f"images with data.skip_corrupt=true (every image checked once first)") from None


class ListedFolder(ImageFolder):
    """torchvision's ImageFolder, its samples a Listing (data/layouts.py) listed one class folder at a time by
    torchvision's own make_dataset: never a list of every image's (path, class), which at ImageNet's size is some
    200 MB of Python objects that the allocator keeps, in part, once freed. Hidden files and folders are passed over
    (data/layouts.hidden), and left_out counts the other files that are not images by their extension."""

    def find_classes(self, directory):
        classes = [name for name in super().find_classes(directory)[0] if not hidden(name, "")]
        if not classes:
            raise FileNotFoundError(f"no class folders in {directory}")
        return classes, {name: i for i, name in enumerate(classes)}

    def make_dataset(self, directory, class_to_idx, extensions=None, is_valid_file=None, allow_empty=False):
        self.left_out = Counter()  # extension: files

        def is_image(path):
            if hidden(path, directory):
                return False
            if not path.lower().endswith(IMG_EXTENSIONS):
                self.left_out[Path(path).suffix.lower() or "no extension"] += 1
                return False
            return True
        listing = Listing.joined(directory, [
            Listing.of(directory, ImageFolder.make_dataset(directory, {name: index}, None, is_image, True))
            for name, index in sorted(class_to_idx.items())])  # make_dataset's order
        if not allow_empty and not len(listing):
            raise FileNotFoundError(f"Found no valid file in {directory}")
        return listing


def image_folder(folder, transform):
    """torchvision ImageFolder read with load_rgb, its samples a Listing (ListedFolder), with errors that name the
    folder and what it must hold; rank 0 says how many files it left out for their extension."""
    try:
        dataset = ListedFolder(str(folder), transform=transform, loader=load_rgb, allow_empty=True)
    except FileNotFoundError:  # torchvision's find_classes: no class folders
        raise DatasetError(f"{folder}: no class folders; an ImageFolder split holds one folder per class with that "
                           f"class's images in it ({folder}/<class>/*.jpg|png|...)") from None
    except OSError as e:
        raise DatasetError(f"{folder}: cannot be listed ({e.strerror or e})") from None
    counts = Counter(dataset.targets)
    empty = [str(folder / name) for i, name in enumerate(dataset.classes) if not counts[i]]
    if empty:
        raise DatasetError(f"{', '.join(empty)}: no image files ({', '.join(IMG_EXTENSIONS)}); add images to each "
                           f"class folder or remove the empty one(s)")
    if dataset.left_out:
        kinds = ", ".join(f"{n} {ext}" for ext, n in dataset.left_out.most_common())
        LOGGER.info(f"{colorstr('data:')} {short_path(folder)}: left out {dataset.left_out.total()} file(s) that are "
                    f"not images by their extension ({kinds}); images are {', '.join(IMG_EXTENSIONS)}")
    set_samples(dataset, dataset.samples)  # its targets and imgs read from the Listing too
    return dataset


def labelled_as(dataset, classes, unknown_means):
    """An ImageFolder relabelled with the indices of classes (those of training, which it may have fewer of); a
    class folder not among them is an error whose message ends with unknown_means."""
    unknown = sorted(set(dataset.classes) - set(classes))
    if unknown:
        raise DatasetError(f"{dataset.root}: classes {unknown} {unknown_means}")
    if dataset.classes != list(classes):
        index = {name: i for i, name in enumerate(classes)}
        set_samples(dataset, dataset.samples.relabelled([index[name] for name in dataset.classes]))
        dataset.classes, dataset.class_to_idx = list(classes), index
    return dataset


def eval_dataset(root, split, transform, classes, weights, allow_outside=False, split_root=None):
    """root's split (train, val or test) labelled with the classes a checkpoint (weights) was trained on, in any
    layout (data/layouts.py); a root of class folders as split by data.val_split in the checkpoint's run where it
    split one (split_root: its data.name) and this is that folder (there, or moved with its files), else whole. Every
    rank lists it, and must list the same (listed_alike)."""
    layout, unknown_means = find_layout(root), f"not among the {len(classes)} classes {weights} was trained on"
    if layout == CSV_FILES:
        names = [f"{name}.csv" for name in (VAL_NAMES if split == "val" else (split,))]
        return listed_alike(root, lambda: (csv_dataset(first_present(root, names, "to evaluate"), transform, load_rgb,
                                                       classes, f"is {unknown_means}", allow_outside,
                                                       training_bar(root)),))[0]
    if layout == CLASS_FOLDERS and split_root is not None:
        record, path = saved_split(root, split, weights)  # read by rank 0, outside listed_alike: a collective
        if os.path.realpath(root) != os.path.realpath(split_root) and not any(  # another folder, not the run's moved
                os.path.isfile(os.path.join(root, name)) for name in record["val"][:100]):
            return listed_alike(root, lambda: (whole_folder(root, split, transform, classes, unknown_means, path),))[0]
        return listed_alike(root, lambda: (listed_split(root, record, split, transform, load_rgb, classes, path),))[0]
    if layout == CLASS_FOLDERS:
        return listed_alike(root, lambda: (whole_folder(root, split, transform, classes, unknown_means),))[0]
    return listed_alike(root, lambda: (split_folder(root, split, transform, classes, f"are {unknown_means}"),))[0]


def whole_folder(root, split, transform, classes, unknown_means, split_file=None):
    """A folder of class folders that is not the one the checkpoint's run split (data.val_split; split_file: its
    split, of whose first 100 val files this other path holds none), evaluated whole, as the one split it is."""
    if split != "val":
        raise DatasetError(f"{root}: a folder of class folders, which val.py evaluates whole; --split {split} names "
                           f"a part of a root of train/, val/ and test/ folders: leave --split out")
    if split_file and RANK == 0:
        LOGGER.warning(f"{root} holds none of the files of the run's split ({split_file}): not the folder it split; "
                    f"evaluating all its images")
    return labelled_as(image_folder(root, transform), classes, f"are {unknown_means}")


def split_folder(root, split, transform, classes, unknown_means):
    """root's split (train, val or test) folder as an ImageFolder labelled with classes (labelled_as)."""
    folder = root / split if split != "val" else split_dir(root, "val")
    if not folder.is_dir():
        raise DatasetError(f"{root}: no {split}/ folder (an ImageFolder root holds train/, val/ or test/, each "
                           f"with one folder per class)")
    return labelled_as(image_folder(folder, transform), classes, unknown_means)


def saved_split(root, split, weights):
    """val.py on a root of class folders: (the split record the checkpoint's run saved, its path)."""
    if split == "test":
        raise DatasetError(f"{root}: no test split; data.val_split splits a folder of class folders into train and "
                           f"val only")
    path = run_dir_of(weights) / SPLIT_FILE
    return read_split(path, f"val.py reads {root}, a folder of class folders, as the run that trained {weights} "
                            f"split it: keep the checkpoint in its run's weights/ folder, or give --data a root "
                            f"with a val/ folder (its test/ folder: --data ROOT --split test)"), path


def skip_unreadable(dataset):
    """Drop a dataset's unreadable images (each decoded once, see data/verify.py); return them as {path: reason}."""
    folder = Path(dataset.root)
    paths = [path for path, _ in dataset.samples]
    # An ImageFolder's split keeps them beside its folder; listed images (CSV, data.val_split) name their own file.
    cache_file = getattr(dataset, "verify_cache", folder.parent / f".verified-{folder.name}.json")
    bad = unreadable_images(folder, paths, cache_file)
    if len(bad) == len(paths):
        path, reason = next(iter(bad.items()))
        raise DatasetError(f"{folder}: none of its {len(bad)} images is readable (e.g. {path}: {reason}); replace "
                           f"them with readable images")
    set_samples(dataset, dataset.samples.taken([path not in bad for path in paths]))  # class indices unchanged
    return bad


def skipped_message(skipped, shown=20):
    """One warning listing the skipped images: the first `shown` with their reasons, then how many more."""
    lines = [f"  {path}: {reason}" for path, reason in list(skipped.items())[:shown]]
    if len(skipped) > shown:
        lines.append(f"  ... and {len(skipped) - shown} more")
    header = f"{colorstr('data:')} skipping {len(skipped)} unreadable image(s) (data.skip_corrupt=true):"
    return "\n".join([header, *lines])


def build_datasets(root, train_transform, val_transform, skip_corrupt=False, hold_out=None, allow_outside=False):
    """Train and val datasets of a root in any layout (data/layouts.py): train/ and the first of val/, valid/ and
    test/ as ImageFolders, train.csv and val.csv (allow_outside: data.csv_allow_outside), or class folders split by
    data.val_split (hold_out, a HoldOut); rank 0 logs which. Every rank lists them, and must list the same
    (listed_alike). Unreadable images dropped if skip_corrupt; val labels follow train's class indices (val may
    lack some classes)."""
    hold_out = hold_out or HoldOut()
    layout = find_layout(root, hold_out.share)
    if layout == CSV_FILES:
        train_set, val_set = listed_alike(root, csv_datasets, root, train_transform, val_transform, load_rgb,
                                          allow_outside)
        used = f"training on train.csv, validating on {val_set.name}.csv"
    elif layout == CLASS_FOLDERS:
        record, source, used = held_out_split(root, hold_out)  # rank 0's, outside listed_alike: a collective
        train_set, val_set = listed_alike(root, split_datasets, root, record, source, train_transform, val_transform)
    else:
        train_set, val_set = listed_alike(root, folder_datasets, root, train_transform, val_transform)
        used = f"training on train/, validating on {Path(val_set.root).name}/"
    LOGGER.info(f"{colorstr('data:')} {short_path(root)}: {used}")  # LOGGER prints on rank 0 alone
    if skip_corrupt:
        skipped = {**skip_unreadable(train_set), **skip_unreadable(val_set)}
        if skipped and RANK == 0:  # every rank skipped the same files
            LOGGER.warning(skipped_message(skipped))
    return train_set, val_set


def folder_datasets(root, train_transform, val_transform):
    """The train and val ImageFolders of a root of split folders: train/ and the first of val/, valid/ and test/."""
    train_dir = split_dir(root, "train")
    train_set = image_folder(train_dir, train_transform)
    return train_set, labelled_as(image_folder(split_dir(root, "val"), val_transform), train_set.classes,
                                  f"have no training images in {train_dir}")


def split_datasets(root, record, source, train_transform, val_transform):
    """The train and val sets of a data.val_split record (held_out_split) of a root of class folders."""
    return tuple(listed_split(root, record, which, transform, load_rgb, record["classes"], source)
                 for which, transform in (("train", train_transform), ("val", val_transform)))


def held_out_split(root, hold_out):
    """data.val_split's (split record, its source, how it was made) for a root of class folders: split afresh by
    rank 0, whose lists every rank takes (one split, even while files are being added), or as the resumed run
    saved it."""
    if hold_out.saved_in is None:
        record = on_rank0(lambda: split_files(image_folder(root, None), hold_out.share, hold_out.seed))
        source, used = root, (f"data.val_split={hold_out.share} of each class's images held out for val (seed "
                              f"{hold_out.seed}); the run saves this split as {SPLIT_FILE}")
    else:
        source = hold_out.saved_in / SPLIT_FILE
        record = read_split(source, "without it the resumed run cannot go on with the same split; start a new run")
        used = f"the run's split, from {source}"
    return record, source, used


def train_val_datasets(name, train_transform, val_transform, skip_corrupt=False, hold_out=None, allow_outside=False):
    """The train and val datasets data.name names: CIFAR-10/100's training and test sets, or those of a dataset
    root (embedded or the user's) in any layout (build_datasets)."""
    if name in CIFAR:  # read from their own file format under datasets/ (data/cifar.py)
        if hold_out and hold_out.share:
            raise DatasetError(f"data.val_split={hold_out.share}: {name} validates on its own test set; set "
                               f"data.val_split=0")
        return cifar_dataset(name, True, train_transform), cifar_dataset(name, False, val_transform)
    return build_datasets(dataset_root(name), train_transform, val_transform, skip_corrupt, hold_out, allow_outside)


def named_eval_dataset(name, split, transform, classes, weights, allow_outside=False, cache_dir="", shard_hosts=(),
                       split_root=None):
    """data.name's split (train, val or test) labelled with the classes a checkpoint (weights) was trained on;
    CIFAR's val is its test set. allow_outside: data.csv_allow_outside; cache_dir, shard_hosts: data.cache_dir (a
    shard set's node cache), data.shard_hosts; split_root: the folder of class folders the run split (its
    data.name, where data.val_split), eval_dataset."""
    if names_shards(name):
        return eval_shards(name, split, transform, classes, weights, cache_dir, list(shard_hosts),
                           topology().local_rank == 0)
    if name not in CIFAR:
        return eval_dataset(dataset_root(name), split, transform, classes, weights, allow_outside, split_root)
    dataset = cifar_dataset(name, split == "train", transform)
    if dataset.classes != list(classes):
        raise DatasetError(f"{name}: its {len(dataset.classes)} classes are not the {len(classes)} classes {weights} "
                           f"was trained on")
    return dataset
