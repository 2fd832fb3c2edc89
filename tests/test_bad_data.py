"""Bad training data: missing class folders, empty classes and unreadable images stop a run with one line naming
the path and what to do; data.skip_corrupt checks every image once, caches the results and skips the bad ones."""

import errno
import json
import os
import re
import socket

import pytest
from PIL import Image

import data.verify
import train
import val
from conftest import run_torchrun
from data.sources import build_datasets, write_digits
from data.sampler import DistributedShuffleSampler
from utils.config import load_recipe
from utils.general import DatasetError, ImageError, cpu_count

TRAIN_ARGS = ("train.epochs=1", "train.batch_size=4", "model.width=4", "data.img_size=8")


def truncate(path):
    """Cut an image file to half its bytes (PIL: 'image file is truncated')."""
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2])
    return path


def random_bytes(path, size=300):
    """A file of random bytes under an image's name (PIL: cannot identify image file)."""
    path.write_bytes(os.urandom(size))
    return path


def train_cmd(root, tmp_path, *overrides):
    """train.py on a tiny ImageFolder: one epoch of a 4-channel convnet on 8x8 images."""
    return ("train.py", "--recipe", "cls.yaml", f"data.name={root}", *TRAIN_ARGS, f"project={tmp_path / 'runs'}",
            *overrides)


@pytest.fixture
def decoded(monkeypatch):
    """The paths the skip_corrupt check decodes, in a list that the test may clear between calls."""
    paths, decode = [], data.verify.decode
    monkeypatch.setattr(data.verify, "decode", lambda path: paths.append(str(path)) or decode(path))
    return paths


def warned(log):
    """The messages LOGGER warned with."""
    return [r.getMessage() for r in log.records if r.levelname == "WARNING"]


def test_split_without_class_folders_says_what_it_must_hold(image_folder):
    root = image_folder({"train": {"ant": 2}})
    (root / "val").mkdir()
    (root / "val" / "loose.png").write_bytes((root / "train" / "ant" / "000.png").read_bytes())
    with pytest.raises(DatasetError) as e:
        build_datasets(root, None, None)
    assert str(e.value) == (f"{root / 'val'}: no class folders; an ImageFolder split holds one folder per class "
                            f"with that class's images in it ({root / 'val'}/<class>/*.jpg|png|...)")


def test_empty_class_folders_are_each_named(image_folder):
    root = image_folder({"train": {"ant": 2}, "val": {"ant": 1}})
    (root / "train" / "bee").mkdir()
    (root / "train" / "cow").mkdir()
    (root / "train" / "cow" / "notes.txt").write_text("not an image")
    with pytest.raises(DatasetError) as e:
        build_datasets(root, None, None)
    assert str(e.value).startswith(f"{root / 'train' / 'bee'}, {root / 'train' / 'cow'}: no image files (.jpg, ")
    assert str(e.value).endswith("; add images to each class folder or remove the empty one(s)")


def test_unreadable_image_is_named_with_its_reason_and_the_way_past_it(image_folder, monkeypatch):
    root = image_folder({"train": {"ant": 2, "bee": 1}, "val": {"ant": 1}})
    truncated = truncate(root / "train" / "ant" / "001.png")
    garbage = random_bytes(root / "train" / "bee" / "garbage.jpg")
    empty = root / "train" / "bee" / "empty.png"
    empty.touch()
    huge = root / "train" / "bee" / "huge.png"
    Image.new("L", (100, 50)).save(huge)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # PIL refuses more than twice as many: huge.png's 5,000
    train_set, _ = build_datasets(root, None, None)
    samples = [path for path, _ in train_set.samples]
    assert train_set[samples.index(str(root / "train" / "ant" / "000.png"))][0].mode == "RGB"
    for path, reason in ((truncated, "image file is truncated"), (garbage, "not an image format PIL can identify"),
                         (empty, "an empty file, 0 bytes"),
                         (huge, "5,000 pixels, over PIL's limit of 4,000 for one image, a guard against "
                                "decompression bombs")):
        with pytest.raises(ImageError) as e:
            train_set[samples.index(str(path))]
        assert str(e.value) == (f"{path}: unreadable image ({reason}); remove the file, or skip unreadable images "
                                f"with data.skip_corrupt=true (every image checked once first)")


@pytest.mark.parametrize("workers, cache", [(0, "none"), (1, "none"), (0, "ram"), (0, "jpeg")])
def test_train_py_stops_on_an_unreadable_image_with_one_line(image_folder, tmp_path, workers, cache, capsys, log):
    if workers and cpu_count() < 2:
        pytest.skip("data.workers is lowered to 0 on one core")
    root = image_folder({"train": {"ant": 4, "bee": 4}, "val": {"ant": 2, "bee": 2}}, size=8)
    bad = truncate(root / "train" / "bee" / "002.png")
    with pytest.raises(SystemExit) as exit_info:
        train.main(train_cmd(root, tmp_path, f"data.workers={workers}", f"data.cache={cache}")[1:])
    stderr = capsys.readouterr().err
    assert exit_info.value.code == 2, stderr
    if cache != "none":  # decoded into a cache before the run starts: no run directory, and no cache file
        assert not (tmp_path / "runs").exists()
        assert not [path for path in root.iterdir() if "jpegcache" in path.name]
    else:
        assert f"{workers} worker(s)" in log.text  # one worker really loaded the images
        assert list((tmp_path / "runs").iterdir()) == []  # its run directory, with nothing saved, is removed
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert errors == [f"train.py: error: {bad}: unreadable image (image file is truncated); remove the file, or skip "
                      f"unreadable images with data.skip_corrupt=true (every image checked once first)"]
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_torchrun_stops_on_an_unreadable_image_and_names_it(image_folder, tmp_path):
    root = image_folder({"train": {"ant": 4, "bee": 4}, "val": {"ant": 2, "bee": 2}}, size=8)
    bad = random_bytes(root / "train" / "ant" / "bad.jpg")
    result = run_torchrun(*train_cmd(root, tmp_path), nproc=2, timeout=120)  # a hang fails with TimeoutExpired
    assert result.returncode != 0
    assert re.search(rf"train\.py: error: {re.escape(str(bad))}: unreadable image \(not an image format PIL can "
                     rf"identify\); remove the file", result.stderr), result.stderr


@pytest.mark.slow
def test_a_new_run_that_fails_on_rank_1_before_saving_leaves_no_directory_and_keeps_earlier_runs(image_folder,
                                                                                                   tmp_path):
    root = image_folder({"train": {"ant": 4, "bee": 4}, "val": {"ant": 2, "bee": 2}}, size=8)
    earlier = tmp_path / "runs" / "exp"  # an earlier run that failed after saving: kept
    (earlier / "weights").mkdir(parents=True)
    (earlier / "weights" / "last.pt").write_bytes(b"checkpoint")
    # The image rank 1 loads first (its share of the first global batch of 4), unreadable: rank 1 alone fails.
    sampler = DistributedShuffleSampler(8, 1, 2, seed=load_recipe("cls.yaml").seed, batch_size=4)
    first = next(iter(sampler))
    bad = truncate(root / "train" / ("ant", "bee")[first // 4] / f"{first % 4:03d}.png")
    result = run_torchrun(*train_cmd(root, tmp_path, "data.workers=0", "data.cache=none"), nproc=2, timeout=120)
    said = f"train.py: error: rank 1 on {socket.gethostname()}: {bad}: unreadable image"
    assert [line for line in result.stderr.splitlines() if line.startswith(said)], result.stderr[-3000:]
    assert "train: 2 process(es)" in result.stdout  # the run had started: its directory, exp2, was made
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["exp"]
    assert (earlier / "weights" / "last.pt").read_bytes() == b"checkpoint"


def test_skip_corrupt_drops_unreadable_images_warns_once_and_caches(image_folder, log, decoded):
    root = image_folder({"train": {"ant": 3, "bee": 2}, "val": {"ant": 1, "bee": 2}})
    truncated = truncate(root / "train" / "ant" / "001.png")
    garbage = random_bytes(root / "train" / "bee" / "garbage.jpg")
    val_garbage = random_bytes(root / "val" / "bee" / "garbage.jpg")
    train_set, val_set = build_datasets(root, None, None, skip_corrupt=True)
    assert len(decoded) == 10  # every file once
    assert [os.path.relpath(p, root) for p, _ in train_set.samples] == [
        "train/ant/000.png", "train/ant/002.png", "train/bee/000.png", "train/bee/001.png"]
    assert train_set.targets == [0, 0, 1, 1] and val_set.targets == [0, 1, 1]  # class indices unchanged
    assert train_set.imgs == train_set.samples and len(val_set) == 3
    assert warned(log) == ["data: skipping 3 unreadable image(s) (data.skip_corrupt=true):\n"
                           f"  {truncated}: image file is truncated\n"
                           f"  {garbage}: not an image format PIL can identify\n"
                           f"  {val_garbage}: not an image format PIL can identify"]
    cache = json.loads((root / ".verified-train.json").read_text())["files"]
    stat = os.stat(truncated)
    assert cache["ant/001.png"] == [stat.st_size, stat.st_mtime_ns, "image file is truncated"]
    assert cache["ant/000.png"][2] is None and len(cache) == 6
    assert len(json.loads((root / ".verified-val.json").read_text())["files"]) == 4

    decoded.clear()
    log.clear()
    train_again, val_again = build_datasets(root, None, None, skip_corrupt=True)
    assert decoded == []  # every result came from the cache
    assert train_again.samples == train_set.samples and val_again.samples == val_set.samples
    assert len(warned(log)) == 1

    decoded.clear()
    log.clear()
    touched = root / "train" / "ant" / "000.png"
    truncated.write_bytes(touched.read_bytes())  # rewritten valid: a new size
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))  # same size, new mtime
    new = random_bytes(root / "train" / "bee" / "new.png")
    train_set, _ = build_datasets(root, None, None, skip_corrupt=True)
    assert sorted(decoded) == sorted(map(str, [touched, truncated, new]))  # only the changed and new files
    assert str(truncated) in [p for p, _ in train_set.samples] and len(train_set) == 5
    assert warned(log) == ["data: skipping 3 unreadable image(s) (data.skip_corrupt=true):\n"
                           f"  {garbage}: not an image format PIL can identify\n"
                           f"  {new}: not an image format PIL can identify\n"
                           f"  {val_garbage}: not an image format PIL can identify"]


def test_skip_corrupt_lists_the_first_20_and_a_count(image_folder, log):
    root = image_folder({"train": {"ant": 1}, "val": {"ant": 1}})
    bad = [random_bytes(root / "train" / "ant" / f"bad{i:02d}.jpg", 20) for i in range(23)]
    build_datasets(root, None, None, skip_corrupt=True)
    (warning,) = warned(log)
    lines = warning.splitlines()
    assert lines[0] == "data: skipping 23 unreadable image(s) (data.skip_corrupt=true):"
    assert lines[1:21] == [f"  {path}: not an image format PIL can identify" for path in bad[:20]]
    assert lines[21:] == ["  ... and 3 more"]


def test_skip_corrupt_on_a_read_only_data_folder_skips_the_cache(image_folder, log, monkeypatch):
    def read_only(src, dst):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(data.verify.os, "replace", read_only)  # chmod does not stop root, who may run the tests
    root = image_folder({"train": {"ant": 2}, "val": {"ant": 1}})
    bad = truncate(root / "train" / "ant" / "001.png")
    train_set, _ = build_datasets(root, None, None, skip_corrupt=True)
    assert len(train_set) == 1 and str(bad) in warned(log)[0]
    assert sorted(p.name for p in root.iterdir()) == ["train", "val"]  # no cache, no temporary file left
    assert (f"data: {root / '.verified-train.json'}: not written (Read-only file system); the images will be "
            f"decoded again next run") in log.messages


def test_skip_corrupt_split_with_no_readable_image_is_named(image_folder):
    root = image_folder({"train": {"ant": 2}, "val": {"ant": 2}})
    for path in (root / "val" / "ant").iterdir():
        truncate(path)
    with pytest.raises(DatasetError) as e:
        build_datasets(root, None, None, skip_corrupt=True)
    assert str(e.value) == (f"{root / 'val'}: none of its 2 images is readable (e.g. {root / 'val/ant/000.png'}: "
                            f"image file is truncated); replace them with readable images")


def test_skip_corrupt_leaves_the_digits_whole(tmp_path, log):
    write_digits(tmp_path / "digits")
    train_set, val_set = build_datasets(tmp_path / "digits", None, None, skip_corrupt=True)
    assert (len(train_set), len(val_set)) == (1437, 360) and warned(log) == []
    assert (tmp_path / "digits" / ".verified-train.json").is_file()


@pytest.mark.slow
def test_train_py_skip_corrupt_trains_past_an_unreadable_image(image_folder, tmp_path, log):
    root = image_folder({"train": {"ant": 4, "bee": 4}, "val": {"ant": 2, "bee": 2}}, size=8)
    bad = random_bytes(root / "val" / "bee" / "bad.jpg")
    truncated = truncate(root / "train" / "ant" / "003.png")
    train.main(train_cmd(root, tmp_path, "data.skip_corrupt=true")[1:])
    assert (f"skipping 2 unreadable image(s) (data.skip_corrupt=true):\n  {truncated}: image file is truncated\n"
            f"  {bad}: not an image format PIL can identify") in log.text
    assert "7 train / 4 val images" in log.text
    assert (tmp_path / "runs" / "exp" / "weights" / "last.pt").is_file()
    # val.py follows the checkpoint's recipe: it skips the same image and counts the 4 readable ones, as training did.
    metrics = val.main(["--weights", str(tmp_path / "runs" / "exp" / "weights" / "best.pt"),
                        "--project", str(tmp_path / "val")])
    assert metrics["val/samples"] == 4
