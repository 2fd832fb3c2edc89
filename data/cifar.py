"""CIFAR-10 and CIFAR-100 from their python-version files under datasets/, read with torchvision's dataset classes;
nothing is downloaded (tests/cifar_standin.py writes a small stand-in in the same format)."""

import math
import pickle
from pathlib import Path

import numpy as np
from torchvision.datasets import CIFAR10, CIFAR100
from torchvision.datasets.vision import VisionDataset

import utils.general
from utils.general import DatasetError

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
# The only callables a CIFAR file may name: numpy's array reconstruction (as numpy 1 and 2 spell it; _frombuffer for
# protocol 5), dtype, and _codecs.encode, with which Python 3 writes bytes at protocol 2.
CIFAR_GLOBALS = {(module, name) for core in ("numpy.core", "numpy._core")
                 for module, name in ((f"{core}.multiarray", "_reconstruct"), (f"{core}.numeric", "_frombuffer"))}
CIFAR_GLOBALS |= {("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle that names a callable CIFAR's files never hold."""


class CifarUnpickler(pickle.Unpickler):
    """An Unpickler that builds only what CIFAR's files hold (dicts, lists, strings, numbers and numpy arrays): a
    pickle may name any callable to run as it loads, so one placed in datasets/ could run code; any callable but
    CIFAR_GLOBALS is refused before it is imported."""

    def find_class(self, module, name):
        if (module, name) not in CIFAR_GLOBALS:
            raise RefusedGlobal(f"it asks for {module}.{name}, which CIFAR's files never hold; refused, nothing run")
        return super().find_class(module, name)


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
        """The dict a file holds (a Python 2 pickle, as torchvision reads it, by CifarUnpickler), or a DatasetError
        naming the file."""
        path = self.folder / name
        try:
            with open(path, "rb") as f:
                content = CifarUnpickler(f, encoding="latin1").load()  # Python 2 str to str; numpy takes latin1 buffers
        except RefusedGlobal as e:
            raise self._damaged(path, str(e)) from None
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
    root = utils.general.DATASETS_DIR / name if root is None else root  # read when called: tests point it elsewhere
    return CIFAR[name]["dataset"](root, train=train, transform=transform)
