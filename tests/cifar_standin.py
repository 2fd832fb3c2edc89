"""A small stand-in for CIFAR-10 or CIFAR-100 in the real files' format (Python 2 pickles), for tests: each class
one colour plus noise, so a model can learn it; read by data/cifar.py and by torchvision's own classes alike."""

import pickle
import struct
from pathlib import Path

import numpy as np

from data.cifar import CIFAR, CIFAR10_CLASSES, CIFAR100_CLASSES, CIFAR100_SUPERCLASSES


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
