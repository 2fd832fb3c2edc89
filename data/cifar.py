"""CIFAR-10 and CIFAR-100 from their python-version files under datasets/, read with torchvision's dataset classes;
nothing is downloaded. write_cifar_standin() writes a small stand-in in the same format for tests."""

import math
import pickle
import struct
from pathlib import Path

import numpy as np
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.vision import VisionDataset

from data.datasets import DatasetError
from utils.general import ROOT

DATASETS_DIR = ROOT / "datasets"  # datasets/cifar10/cifar-10-batches-py/, datasets/cifar100/cifar-100-python/

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
# CIFAR-100's 20 superclasses (coarse labels) and their 5 classes (fine labels); both orders are alphabetical.
CIFAR100_SUPERCLASSES = {
    "aquatic_mammals": ["beaver", "dolphin", "otter", "seal", "whale"],
    "fish": ["aquarium_fish", "flatfish", "ray", "shark", "trout"],
    "flowers": ["orchid", "poppy", "rose", "sunflower", "tulip"],
    "food_containers": ["bottle", "bowl", "can", "cup", "plate"],
    "fruit_and_vegetables": ["apple", "mushroom", "orange", "pear", "sweet_pepper"],
    "household_electrical_devices": ["clock", "keyboard", "lamp", "telephone", "television"],
    "household_furniture": ["bed", "chair", "couch", "table", "wardrobe"],
    "insects": ["bee", "beetle", "butterfly", "caterpillar", "cockroach"],
    "large_carnivores": ["bear", "leopard", "lion", "tiger", "wolf"],
    "large_man-made_outdoor_things": ["bridge", "castle", "house", "road", "skyscraper"],
    "large_natural_outdoor_scenes": ["cloud", "forest", "mountain", "plain", "sea"],
    "large_omnivores_and_herbivores": ["camel", "cattle", "chimpanzee", "elephant", "kangaroo"],
    "medium_mammals": ["fox", "porcupine", "possum", "raccoon", "skunk"],
    "non-insect_invertebrates": ["crab", "lobster", "snail", "spider", "worm"],
    "people": ["baby", "boy", "girl", "man", "woman"],
    "reptiles": ["crocodile", "dinosaur", "lizard", "snake", "turtle"],
    "small_mammals": ["hamster", "mouse", "rabbit", "shrew", "squirrel"],
    "trees": ["maple_tree", "oak_tree", "palm_tree", "pine_tree", "willow_tree"],
    "vehicles_1": ["bicycle", "bus", "motorcycle", "pickup_truck", "train"],
    "vehicles_2": ["lawn_mower", "rocket", "streetcar", "tank", "tractor"],
}
CIFAR100_CLASSES = sorted(name for names in CIFAR100_SUPERCLASSES.values() for name in names)


class Cifar10(CIFAR10):
    """torchvision's CIFAR10 that checks its files by presence, not md5 (which reads all 170 MB at every start and
    rejects a stand-in), and reports a missing or damaged file as a DatasetError naming it and where to get it."""

    label_key = "labels"  # of the batch files; the class names are under self.meta["key"] of the meta file

    def __init__(self, root, train=True, transform=None, target_transform=None):
        VisionDataset.__init__(self, Path(root), transform=transform, target_transform=target_transform)
        self.train = train
        self._check_integrity()
        # torchvision's loading, file by file, so that an error can name the file
        batches = [self._read_batch(name) for name, _ in (self.train_list if train else self.test_list)]
        data = np.vstack([rows for rows, _ in batches])
        side = math.isqrt(data.shape[1] // 3)  # 32; a stand-in may be smaller
        self.data = data.reshape(-1, 3, side, side).transpose((0, 2, 3, 1))  # rows are CHW: to HWC images
        self.targets = [int(t) for _, labels in batches for t in labels]
        self._load_meta()

    @property
    def folder(self):
        """The folder holding the files: root/base_folder."""
        return Path(self.root) / self.base_folder

    def _check_integrity(self):
        """True when every file exists; else a DatasetError naming the missing ones (nothing is downloaded)."""
        names = [name for name, _ in self.train_list + self.test_list] + [self.meta["filename"]]
        missing = [name for name in names if not (self.folder / name).is_file()]
        if missing:
            raise DatasetError(f"{self.folder}: missing {', '.join(missing)}; download {self.url} on a machine with "
                               f"internet and extract it into {self.root} so that {self.folder / missing[0]} exists "
                               f"(nothing is downloaded here)")
        return True

    def _read(self, name, keys):
        """The dict a file holds (a Python 2 pickle, as torchvision reads it), or a DatasetError naming the file."""
        path = self.folder / name
        try:
            with open(path, "rb") as f:
                content = pickle.load(f, encoding="latin1")  # Python 2 str to str; numpy accepts its latin1 buffers
        except Exception as e:  # a damaged pickle can fail with almost any exception, none naming the file
            raise self._damaged(path, ": ".join([type(e).__name__, *str(e).strip().splitlines()[:1]])) from None
        absent = [key for key in keys if not isinstance(content, dict) or key not in content]
        if absent:
            raise self._damaged(path, f"no {', '.join(map(repr, absent))} in it")
        return content

    def _read_batch(self, name):
        """A batch file's images (N rows of 3*H*W uint8, CHW order) and labels (N ints)."""
        content = self._read(name, ("data", self.label_key))
        data, labels = content["data"], content[self.label_key]
        rows = data.shape[1] if isinstance(data, np.ndarray) and data.ndim == 2 and data.dtype == np.uint8 else 0
        side = math.isqrt(rows // 3)
        if not side or rows != 3 * side**2 or not isinstance(labels, list) or len(labels) != len(data):
            raise self._damaged(self.folder / name, f"'data' must be N x 3*H*W uint8 with N '{self.label_key}'")
        return data, labels

    def _load_meta(self):
        """The class names from the meta file, without torchvision's md5 check."""
        self.classes = list(self._read(self.meta["filename"], (self.meta["key"],))[self.meta["key"]])
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def _damaged(self, path, reason):
        """The DatasetError for a file that exists but cannot be used."""
        return DatasetError(f"{path}: not a readable CIFAR file ({reason}); replace it: download {self.url} on a "
                            f"machine with internet and extract it into {self.root}")


class Cifar100(Cifar10, CIFAR100):
    """torchvision's CIFAR100 (its files and fine labels) read as Cifar10 reads CIFAR-10."""

    label_key = "fine_labels"


# What each name is: its dataset class, the folder of its files (under datasets/<name>/), the archive holding that
# folder, and its class names in label order.
CIFAR = {name: {"dataset": dataset, "base_folder": dataset.base_folder, "url": dataset.url, "classes": classes}
         for name, dataset, classes in (("cifar10", Cifar10, CIFAR10_CLASSES),
                                        ("cifar100", Cifar100, CIFAR100_CLASSES))}


def cifar_dataset(name, train, transform, root=None):
    """CIFAR `name`'s training (train=True) or test set from root (default datasets/<name>); like an ImageFolder it
    has .classes, .targets and .root, and yields (transformed RGB PIL image, class index)."""
    if name not in CIFAR:
        raise DatasetError(f"'{name}' is not a CIFAR dataset (choose one of {', '.join(CIFAR)})")
    return CIFAR[name]["dataset"](DATASETS_DIR / name if root is None else root, train=train, transform=transform)


class Py2Pickler(pickle._Pickler):  # the Python pickler: the C one offers no hook for bytes
    """A pickler that writes bytes as Python 2 str, as the CIFAR files were written: read back with
    encoding='latin1' they are str (torchvision's keys 'data', 'labels'), with encoding='bytes' b'data', ..."""

    def save_py2_str(self, obj):
        """Write obj with the STRING opcodes of protocol 2 instead of Python 3's bytes."""
        n = len(obj)
        self.write((pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)) + obj)
        self.memoize(obj)

    dispatch = {**pickle._Pickler.dispatch, bytes: save_py2_str}


def write_py2_pickle(path, obj):
    """Write obj as a protocol-2 pickle with Python 2 strings (see Py2Pickler)."""
    with open(path, "wb") as f:
        Py2Pickler(f, protocol=2).dump(obj)


def class_colours(n):
    """n distinct RGB colours (n <= 125) from a 5x5x5 grid, at least 63 levels apart in some channel."""
    levels = np.linspace(0, 255, 5)
    grid = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), -1).reshape(-1, 3)
    return grid[np.linspace(0, len(grid) - 1, n).round().astype(int)]


def standin_batch(name, classes, labels, data, batch_label):
    """One batch file's dict, keys and strings as bytes (Python 2 str), as in the real files."""
    names = [f"{classes[i]}_s_{j:06d}.png".encode() for j, i in enumerate(labels)]
    batch = {b"batch_label": batch_label.encode(), b"data": data, b"filenames": names}
    if name == "cifar10":
        return {**batch, b"labels": [int(i) for i in labels]}
    coarse = {fine: i for i, names in enumerate(CIFAR100_SUPERCLASSES.values()) for fine in names}
    return {**batch, b"fine_labels": [int(i) for i in labels], b"coarse_labels": [coarse[classes[i]] for i in labels]}


def standin_meta(name, size):
    """The meta file's dict: batches.meta for CIFAR-10, meta for CIFAR-100."""
    if name == "cifar10":
        return {b"num_cases_per_batch": 10000, b"label_names": [c.encode() for c in CIFAR10_CLASSES],
                b"num_vis": 3 * size * size}
    return {b"fine_label_names": [c.encode() for c in CIFAR100_CLASSES],
            b"coarse_label_names": [c.encode() for c in CIFAR100_SUPERCLASSES]}


def write_cifar_standin(root, name, images_per_class_train, images_per_class_test, size=32, seed=0):
    """Write a small stand-in for CIFAR `name` into root/<base_folder>/, in the real files' format (read by
    cifar_dataset and by torchvision's own classes alike); returns root. Each class is one colour plus noise, so a
    model can learn it; everything follows from seed. size=32 is the real format; smaller sizes keep it but for
    the row length (3*size*size), which cifar_dataset reads and torchvision does not."""
    if name not in CIFAR:
        raise ValueError(f"write_cifar_standin: '{name}' is not a CIFAR dataset (choose one of {', '.join(CIFAR)})")
    dataset, classes = CIFAR[name]["dataset"], CIFAR[name]["classes"]
    folder = Path(root) / dataset.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    rng, colours = np.random.default_rng(seed), class_colours(len(classes))
    for split, per_class, files in (("training", images_per_class_train, dataset.train_list),
                                    ("testing", images_per_class_test, dataset.test_list)):
        labels = rng.permutation(np.repeat(np.arange(len(classes)), per_class))  # the real files are shuffled too
        pixels = colours[labels][:, :, None, None] + rng.normal(0, 24, (len(labels), 3, size, size))
        data = pixels.clip(0, 255).round().astype(np.uint8).reshape(len(labels), -1)  # rows of CHW, row-major
        for i, ((file_name, _), part) in enumerate(zip(files, np.array_split(np.arange(len(labels)), len(files)))):
            batch = standin_batch(name, classes, labels[part], data[part], f"{split} batch {i + 1} of {len(files)}")
            write_py2_pickle(folder / file_name, batch)
    write_py2_pickle(folder / dataset.meta["filename"], standin_meta(name, size))
    return Path(root)
