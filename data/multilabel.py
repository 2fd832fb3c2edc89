"""Multi-label data: an image carries any number of the classes (none included), listed in a CSV's labels column, and
the embedded multidigits set; targets are multi-hot uint8 vectors, one byte per class.

A CSV row's labels are separated by '|' when the root's train.csv uses '|' anywhere (class names may then hold
spaces: 'golden retriever|ball'; its val.csv is read the same way), else by spaces ('3 7'); an empty cell is an
image with none of the classes."""

import csv

import numpy as np
import torch
from PIL import Image

from utils.general import DatasetError
from utils.once import atomic_write

SIDE = 8  # pixels of a scikit-learn digit; multidigits' images are GRID x GRID of them
GRID = 2
DIGITS_PER_IMAGE = (2, 3)  # each multidigits image holds this many different digits, in distinct cells
IMAGES = {"train": 3000, "val": 1000}


def split_labels(cell, bar):
    """A labels cell's class names, each once, in the order given: split on '|' (bar) or on spaces; names keep
    their inner spaces when split on '|'."""
    names = [name.strip() for name in cell.split("|")] if bar else cell.split()
    return tuple(dict.fromkeys(name for name in names if name))


def multi_hot(targets, num_classes):
    """(N, num_classes) uint8 of N samples' class-index tuples: 1 where a sample has the class."""
    hot = np.zeros((len(targets), num_classes), np.uint8)
    rows = np.repeat(np.arange(len(targets)), [len(t) for t in targets])
    hot[rows, np.fromiter((c for t in targets for c in t), np.int64, len(rows))] = 1
    return torch.from_numpy(hot)


def positive_weights(dataset):
    """train.class_weights=balanced for multi-label data: each class's BCE positive weight, its negatives over its
    positives in the training set (as torch's BCEWithLogitsLoss documents pos_weight); 1 for a class without
    positives or without negatives."""
    hot = multi_hot(dataset.targets, len(dataset.classes)).double()
    positives = hot.sum(0)
    negatives = len(dataset) - positives
    return torch.where((positives > 0) & (negatives > 0), negatives / positives.clamp(min=1), 1.0).float()


def check_task(train_set, multilabel, name, val_set=None, weights=None):
    """Refuse data whose kind (one label per image, or several) is not the recipe's data.multilabel, or that of the
    checkpoint (weights) it evaluates, and multi-label val images without a single label (no class would have an
    AP)."""
    is_multilabel = getattr(train_set, "multilabel", False)
    if weights is not None and multilabel != is_multilabel:
        kinds = ("one label per image (a label column)", "several labels per image (a labels column)")
        raise DatasetError(f"data.name={name} lists {kinds[is_multilabel]}, but {weights} was trained on "
                           f"{kinds[multilabel]}; evaluate it on data of that kind")
    if multilabel and not is_multilabel:
        raise DatasetError(f"data.multilabel=true, but data.name={name} has one label per image; multi-label data is "
                           f"a CSV list with a labels column (path,labels: the labels separated by spaces, or by | "
                           f"when class names hold spaces), such as the embedded data.name=multidigits")
    if is_multilabel and not multilabel:
        raise DatasetError(f"data.name={name} lists several labels per image (a labels column), but "
                           f"data.multilabel=false: set data.multilabel=true (recipes/multilabel.yaml), or list one "
                           f"label per image in a label column")
    if is_multilabel and val_set is not None and not any(val_set.targets):
        raise DatasetError(f"{val_set.root}: none of the {len(val_set)} val images has a label, so no class has an "
                           f"average precision (mAP) or recall; give val images with labels")


def write_multidigits(root, report=lambda n: None, classes=tuple(range(10)), images=IMAGES,
                      digits_per_image=DIGITS_PER_IMAGE):
    """Write the embedded multi-label set: 16x16 images of a 2x2 grid of scikit-learn's 8x8 digits, 2 or 3 different
    digits in distinct cells (the rest black), labelled with the digits present; train.csv and val.csv (path,labels,
    space-separated) over images/. Train images are made from the digits of the single-label set's train split,
    val images from its val split (the same fixed, stratified 80/20 split), so no digit image is in both. report(1)
    after each image. benchmarks/finetune.py writes other such sets: of some digits (classes), images per split,
    digits per image."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    pools = dict(zip(("train", "val"), train_test_split(np.arange(len(pixels)), test_size=0.2,
                                                        stratify=digits.target, random_state=0)))
    rng = np.random.default_rng(0)
    with atomic_write(root, first_wins=True) as tmp:  # another machine on a shared disk may finish first
        for split, pool in pools.items():
            by_digit = [pool[digits.target[pool] == d] for d in classes]
            write_split(tmp, split, [pick_digits(rng, by_digit, digits_per_image) for _ in range(images[split])],
                        pixels, classes, report)


def pick_digits(rng, by_digit, digits_per_image):
    """One image's (class position, cell, digit image index) triples: that many different classes in distinct cells."""
    chosen = rng.choice(len(by_digit), size=rng.choice(digits_per_image), replace=False)
    cells = rng.choice(GRID * GRID, size=len(chosen), replace=False)
    return [(int(c), int(cell), rng.choice(by_digit[c])) for c, cell in zip(chosen, cells)]


def write_split(tmp, split, images, pixels, classes, report):
    """Write one split into tmp: each image of images (pick_digits' triples) as a PNG, and its CSV of labels."""
    (tmp / "images" / split).mkdir(parents=True)
    with open(tmp / f"{split}.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "labels"])
        for i, picked in enumerate(images):
            image = np.zeros((GRID * SIDE, GRID * SIDE), np.uint8)
            for _, cell, index in picked:
                y, x = divmod(cell, GRID)
                image[y * SIDE : (y + 1) * SIDE, x * SIDE : (x + 1) * SIDE] = pixels[index]
            name = f"images/{split}/{i:05d}.png"
            Image.fromarray(image).save(tmp / name)
            writer.writerow([name, " ".join(str(classes[c]) for c in sorted(c for c, _, _ in picked))])
            report(1)
