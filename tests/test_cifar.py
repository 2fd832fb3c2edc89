"""CIFAR-10 and CIFAR-100 from their files (here small stand-ins in the same format), and the CIFAR ResNet-18."""

import pickle
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from torchvision.transforms import ToTensor

import utils.general
from cifar_standin import write_cifar_standin
from data.cifar import CIFAR, CIFAR100_SUPERCLASSES, cifar_dataset
from models.resnet_cifar import resnet18_cifar
from utils.general import DatasetError

URLS = {"cifar10": "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        "cifar100": "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"}
FILES = {"cifar10": ["batches.meta", "data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5",
                     "test_batch"],
         "cifar100": ["meta", "test", "train"]}


def read_pickle(path, encoding="latin1"):
    with open(path, "rb") as f:
        return pickle.load(f, encoding=encoding)


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    """Stand-ins of both datasets, 3 training and 2 test images per class: {name: root}."""
    return {name: write_cifar_standin(tmp_path_factory.mktemp(name), name, 3, 2) for name in CIFAR}


def test_names_describe_the_real_archives():
    assert {name: spec["url"] for name, spec in CIFAR.items()} == URLS
    assert CIFAR["cifar10"]["base_folder"] == "cifar-10-batches-py"
    assert CIFAR["cifar100"]["base_folder"] == "cifar-100-python"
    assert CIFAR["cifar10"]["classes"] == ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                                           "ship", "truck"]
    fine = CIFAR["cifar100"]["classes"]
    assert fine == sorted(fine)  # the real order is alphabetical
    assert len(fine) == len(set(fine)) == 100 and fine[:3] == ["apple", "aquarium_fish", "baby"] and fine[-1] == "worm"
    coarse = list(CIFAR100_SUPERCLASSES)
    assert len(coarse) == 20 and coarse == sorted(coarse) and coarse[-1] == "vehicles_2"


@pytest.mark.parametrize("name, n_classes", [("cifar10", 10), ("cifar100", 100)])
def test_standin_reads_back_with_the_real_names_counts_and_pixels(standins, name, n_classes):
    root = standins[name]
    train, test = cifar_dataset(name, True, None, root), cifar_dataset(name, False, ToTensor(), root)
    assert train.classes == test.classes == CIFAR[name]["classes"] and len(train.classes) == n_classes
    assert (len(train), len(test)) == (3 * n_classes, 2 * n_classes)
    assert Counter(train.targets) == {i: 3 for i in range(n_classes)} and all(type(t) is int for t in train.targets)
    assert Path(train.root) == root and train.folder == root / CIFAR[name]["base_folder"]
    first = read_pickle(train.folder / ("data_batch_1" if name == "cifar10" else "train"))
    image, target = train[0]
    assert image.mode == "RGB" and image.size == (32, 32)
    assert np.array_equal(np.asarray(image), first["data"][0].reshape(3, 32, 32).transpose(1, 2, 0))  # CHW rows
    assert target == first["labels" if name == "cifar10" else "fine_labels"][0]
    tensor, _ = test[0]  # the transform is applied
    assert isinstance(tensor, torch.Tensor) and tensor.shape == (3, 32, 32)


@pytest.mark.parametrize("name", CIFAR)
def test_standin_has_the_real_files_and_keys(standins, name):
    folder = standins[name] / CIFAR[name]["base_folder"]
    assert sorted(p.name for p in folder.iterdir()) == FILES[name]
    assert "data" in read_pickle(folder / FILES[name][-1])  # Python 2 str: str with latin1 (torchvision's) ...
    batch = read_pickle(folder / FILES[name][-1], encoding="bytes")  # ... and bytes with encoding="bytes"
    labels = [b"labels"] if name == "cifar10" else [b"fine_labels", b"coarse_labels"]
    assert sorted(batch) == sorted([b"batch_label", b"data", b"filenames", *labels])
    assert batch[b"data"].dtype == np.uint8 and batch[b"data"].shape[1] == 3072
    meta = read_pickle(folder / FILES[name][0], encoding="bytes")
    if name == "cifar10":
        assert meta == {b"num_cases_per_batch": 10000, b"label_names": [c.encode() for c in CIFAR[name]["classes"]],
                        b"num_vis": 3072}
    else:
        assert sorted(meta) == [b"coarse_label_names", b"fine_label_names"]
        assert meta[b"coarse_label_names"] == [c.encode() for c in CIFAR100_SUPERCLASSES]
        fine, coarse = meta[b"fine_label_names"], meta[b"coarse_label_names"]
        assert all(fine[f].decode() in CIFAR100_SUPERCLASSES[coarse[c].decode()]
                   for f, c in zip(batch[b"fine_labels"], batch[b"coarse_labels"]))


@pytest.mark.parametrize("name, tv_class", [("cifar10", torchvision.datasets.CIFAR10),
                                            ("cifar100", torchvision.datasets.CIFAR100)])
def test_standin_is_read_by_torchvisions_own_classes(standins, monkeypatch, name, tv_class):
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *args: True)  # the md5 check aside
    theirs, ours = tv_class(standins[name], train=True), cifar_dataset(name, True, None, standins[name])
    assert theirs.classes == ours.classes and theirs.targets == ours.targets
    assert np.array_equal(theirs.data, ours.data)


def test_standin_follows_its_seed_and_can_be_learnt(tmp_path):
    a, b, c = (write_cifar_standin(tmp_path / d, "cifar10", 4, 3, seed=s) for d, s in (("a", 0), ("b", 0), ("c", 1)))
    files = lambda root: [p.read_bytes() for p in sorted((root / "cifar-10-batches-py").iterdir())]
    assert files(a) == files(b) != files(c)
    train, test = cifar_dataset("cifar10", True, None, a), cifar_dataset("cifar10", False, None, a)
    assert train.targets != sorted(train.targets)  # shuffled, as the real files are
    targets = np.array(train.targets)
    means = np.stack([train.data[targets == i].mean(0) for i in range(10)]).reshape(10, -1)
    distances = ((test.data.reshape(len(test), 1, -1) - means) ** 2).sum(-1)
    assert (distances.argmin(1) == np.array(test.targets)).all()  # the nearest class mean is always right


def test_standin_of_smaller_images(tmp_path):
    image, _ = cifar_dataset("cifar100", True, None, write_cifar_standin(tmp_path, "cifar100", 1, 1, size=8))[0]
    assert image.size == (8, 8)


def test_default_root_is_datasets_name(tmp_path, monkeypatch):
    monkeypatch.setattr(utils.general, "DATASETS_DIR", tmp_path)
    write_cifar_standin(tmp_path / "cifar10", "cifar10", 1, 1)
    assert Path(cifar_dataset("cifar10", False, None).root) == tmp_path / "cifar10"


@pytest.mark.parametrize("name", CIFAR)
def test_missing_files_name_themselves_the_folder_and_the_archive(tmp_path, name):
    root = write_cifar_standin(tmp_path / name, name, 1, 1)
    folder = root / CIFAR[name]["base_folder"]
    gone = FILES[name][2]
    (folder / gone).unlink()
    with pytest.raises(DatasetError) as e:
        cifar_dataset(name, False, None, root)  # the test split needs all files too, as torchvision does
    message = str(e.value)
    assert f"{folder}: missing {gone};" in message and URLS[name] in message and str(folder / gone) in message
    assert "\n" not in message
    everything = {"cifar10": "data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5, test_batch, "
                             "batches.meta", "cifar100": "train, test, meta"}[name]
    with pytest.raises(DatasetError, match=f"missing {everything};"):
        cifar_dataset(name, True, None, tmp_path / "empty")


@pytest.mark.parametrize("name", CIFAR)
def test_damaged_files_are_named(tmp_path, name):
    root = write_cifar_standin(tmp_path, name, 2, 1)
    folder = root / CIFAR[name]["base_folder"]
    train_file = folder / ("data_batch_2" if name == "cifar10" else "train")
    content = train_file.read_bytes()
    train_file.write_bytes(content[:len(content) // 2])  # truncated, as by an interrupted copy
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(train_file))}: not a readable CIFAR file "
                                           rf"\(UnpicklingError: pickle data was truncated\); replace it: download "
                                           rf"{re.escape(URLS[name])}"):
        cifar_dataset(name, True, None, root)
    cifar_dataset(name, False, None, root)  # the test split does not read it
    train_file.write_bytes(pickle.dumps([1, 2, 3], protocol=2))  # a pickle, but not of a batch
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(train_file))}: not a readable CIFAR file \(no 'data', "):
        cifar_dataset(name, True, None, root)
    label_key = "labels" if name == "cifar10" else "fine_labels"
    train_file.write_bytes(pickle.dumps({"data": np.zeros((2, 3000), np.uint8), label_key: [0, 1]}, protocol=2))
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(train_file))}: not a readable CIFAR file \('data' must "
                                           rf"be N x 3\*H\*W uint8 with N '{label_key}'\)"):
        cifar_dataset(name, True, None, root)  # 3000 is not 3 * side**2
    train_file.write_bytes(pickle.dumps({"data": np.zeros((2, 3072), np.uint8), label_key: [0]}, protocol=2))
    with pytest.raises(DatasetError, match="'data' must be N x 3"):
        cifar_dataset(name, True, None, root)  # one label for two images
    meta_file = folder / FILES[name][0]
    meta_file.write_bytes(b"not a pickle")
    with pytest.raises(DatasetError, match=rf"^{re.escape(str(meta_file))}: not a readable CIFAR file "
                                           rf"\(UnpicklingError: "):
        cifar_dataset(name, False, None, root)


def test_unknown_name():
    with pytest.raises(DatasetError, match="'cifar1000' is not a CIFAR dataset"):
        cifar_dataset("cifar1000", True, None)


@pytest.mark.parametrize("num_classes, parameters", [(10, 11_173_962), (100, 11_220_132)])
def test_resnet18_cifar_size_and_output(num_classes, parameters):
    model = resnet18_cifar(num_classes)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, num_classes)


def test_resnet18_cifar_has_torchvisions_keys():
    ours, theirs = resnet18_cifar(10).state_dict(), torchvision.models.resnet18(weights=None).state_dict()
    assert list(ours) == list(theirs)
    assert ours["conv1.weight"].shape == (64, 3, 3, 3)


def test_resnet18_cifar_stem_is_initialised_as_torchvision_initialises_convs():
    std = resnet18_cifar(10).conv1.weight.std().item()
    assert abs(std - (2 / (64 * 3 * 3)) ** 0.5) < 0.005  # kaiming_normal_, fan_out; nn.Conv2d's default gives 0.11


def test_resnet18_cifar_stem_keeps_32x32():
    model, shapes = resnet18_cifar(10).eval(), {}
    for name in ("layer1", "layer4"):
        getattr(model, name).register_forward_hook(lambda m, x, y, name=name: shapes.update({name: y.shape[-2:]}))
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
    assert shapes == {"layer1": (32, 32), "layer4": (4, 4)}


class RunsCode:
    """What a hostile pickle holds: an object whose unpickling calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", CIFAR)
def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path, name):
    root = write_cifar_standin(tmp_path, name, 2, 1)
    folder = root / CIFAR[name]["base_folder"]
    test_file, marker = folder / ("test_batch" if name == "cifar10" else "test"), tmp_path / "ran"
    content = read_pickle(test_file)
    test_file.write_bytes(pickle.dumps({**content, "note": RunsCode(marker)}, protocol=2))
    with pytest.raises(DatasetError) as e:
        cifar_dataset(name, False, None, root)
    assert str(e.value).startswith(f"{test_file}: not a readable CIFAR file (it asks for posix.system, which CIFAR's "
                                   f"files never hold; refused, nothing run); replace it: download {URLS[name]}")
    assert not marker.exists()
    test_file.write_bytes(pickle.dumps(content, protocol=2))  # the same content, arrays and all, reads back
    assert len(cifar_dataset(name, False, None, root)) == len(content["data"])
