"""Any common folder layout trains, and val.py reproduces the run's top-1 on it: train/ with val/, valid/ or test/
(the first present, logged); train.csv and val.csv (path,label); one folder of class folders split by
data.val_split, the split saved with the run and reused by a resume and by val.py whatever files are added later.
Class names stay as spelled; images of any mode decode as a person sees them."""

import copy
import csv
import os
import socket
import json
import shutil
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

import predict
import train
import val
from conftest import console_lines, read_results, run_torchrun
from data.cache import RamImages
from data.sources import build_datasets, image_folder, train_val_datasets
from data.layouts import HoldOut, Listing, split_files
from data.verify import decode
from utils.checkpoint import load_checkpoint
from utils.general import DatasetError, colorstr

CLASSES = {"crème brûlée": 0, "hot dog": 160}  # a name with accents, one with a space; their pixels' lowest value
TRAIN_ARGS = ["--recipe", "cls.yaml", "train.epochs=2", "train.batch_size=4", "model.width=4", "log.plots=false"]


def write_images(folder, name, n, start=0, seed=0):
    """n 8x8 PNGs of class name (dark or bright pixels, which a tiny convnet learns) in folder; their paths."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    low = CLASSES[name]
    paths = [folder / f"{i:03d}.png" for i in range(start, start + n)]
    for path in paths:
        Image.fromarray(rng.integers(low, low + 96, (8, 8, 3), dtype=np.uint8)).save(path)
    return paths


def class_folders(root, n):
    """root/<class>/*.png, n images of each class, no split."""
    for name in CLASSES:
        write_images(root / name, name, n)
    return root


def split_folders(root, val_name, n_train=6, n_val=3):
    """root/train/<class>/* and root/VAL_NAME/<class>/*."""
    for split, n in (("train", n_train), (val_name, n_val)):
        for name in CLASSES:
            write_images(root / split / name, name, n, seed=n + len(split))
    return root


def write_csv(path, rows, header=("path", "label")):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header, *rows])
    return path


def csv_root(root, val_name="val"):
    """root/images/*.png in no class folders, listed by root/train.csv and root/VAL_NAME.csv."""
    for split, n in (("train", 6), (val_name, 3)):
        rows = []
        for k, name in enumerate(CLASSES):
            paths = write_images(root / "images" / f"{split}{k}", name, n, seed=k)
            rows += [(path.relative_to(root).as_posix(), name) for path in paths]
        write_csv(root / f"{split}.csv", rows)
    return root


def train_and_validate(root, project, *overrides):
    """Train TRAIN_ARGS on root, then val.py on its best.pt: (run dir, val.py's metrics, top-1 recorded for best.pt's
    epoch)."""
    train.main([*TRAIN_ARGS, f"data.name={root}", f"project={project}", *overrides])
    run_dir = project / "exp"
    best = run_dir / "weights" / "best.pt"
    epoch = load_checkpoint(best)["epoch"]
    recorded = float(next(r for r in read_results(run_dir)[1] if int(r["epoch"]) == epoch)["val/top1"])
    metrics = val.main(["--weights", str(best), "--project", str(project / "val")])
    return run_dir, metrics, recorded


def split_of(run_dir):
    return json.loads((run_dir / "split.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("val_name", ["val", "valid", "test"])
def test_the_val_folder_is_the_first_of_val_valid_test_and_the_log_says_which(tmp_path, val_name, log):
    root = split_folders(tmp_path / "data", val_name)
    for later in ("valid", "test")[("val", "valid", "test").index(val_name):]:  # present, but after val_name
        write_images(root / later / "hot dog", "hot dog", 1)
    _, val_set = build_datasets(root, None, None)
    assert val_set.root == str(root / val_name) and len(val_set) == 6
    assert f"data: {root}: training on train/, validating on {val_name}/" in log.text


@pytest.mark.parametrize("layout", ["valid", "csv", "val_split"])
def test_every_layout_trains_and_val_reproduces_the_recorded_top1(tmp_path, layout, log):
    root, extra = tmp_path / "data", []
    if layout == "valid":
        split_folders(root, "valid")
    elif layout == "csv":
        csv_root(root, "valid")
        extra = ["data.cache=none"]  # the per-image path: the other layouts use the recipe's RAM cache
    else:
        class_folders(root, 9)
        extra = ["data.val_split=0.34"]
    run_dir, metrics, recorded = train_and_validate(root, tmp_path / "runs", *extra)
    used = {"valid": "training on train/, validating on valid/",
            "csv": "training on train.csv, validating on valid.csv",
            "val_split": "data.val_split=0.34 of each class's images held out for val (seed 0); the run saves this "
                         "split as split.json"}[layout]
    assert f"data: {root}: {used}" in log.text
    assert metrics["val/samples"] == 6 and float(f"{metrics['val/top1']:.6g}") == recorded
    assert load_checkpoint(run_dir / "weights" / "best.pt")["classes"] == list(CLASSES)
    assert (run_dir / "split.json").exists() == (layout == "val_split")
    with open(tmp_path / "runs" / "val" / "exp" / "per_class.csv", encoding="utf-8") as f:
        assert [(r["class"], r["images"]) for r in csv.DictReader(f)] == [("crème brûlée", "3"), ("hot dog", "3")]


def test_class_names_survive_into_the_val_table_and_predict_output(tmp_path, log):
    root = class_folders(tmp_path / "data", 4)
    run_dir, _, _ = train_and_validate(root, tmp_path / "runs", "data.val_split=0.25")
    assert "crème brûlée       1" in log.text and "hot dog            1" in log.text  # val.py's per-class table
    rows, _ = predict.main(["--weights", str(run_dir / "weights" / "best.pt"), "--source", str(root),
                            "--project", str(tmp_path / "p")])
    assert len(rows) == 8 and all({t["class"] for t in r["top"]} == set(CLASSES) for r in rows)  # top-2 of 2
    with open(tmp_path / "p" / "exp" / "predictions.csv", encoding="utf-8") as f:
        assert all({r["class1"], r["class2"]} == set(CLASSES) for r in csv.DictReader(f))
    predictions = json.loads((tmp_path / "p" / "exp" / "predictions.json").read_text(encoding="utf-8"))
    assert [[t["class"] for t in p["top"]] for p in predictions["predictions"]] == [
        [t["class"] for t in r["top"]] for r in rows]


@pytest.mark.slow
def test_val_split_is_stratified_seeded_and_written_with_the_run(tmp_path):
    root = class_folders(tmp_path / "data", 10)
    write_images(root / "hot dog" / "more", "hot dog", 5)  # nested folders belong to their class: 15 hot dogs
    train.main([*TRAIN_ARGS, "train.epochs=1", f"data.name={root}", "data.val_split=0.2", f"project={tmp_path}"])
    saved = split_of(tmp_path / "exp")
    assert saved["classes"] == list(CLASSES) and saved["val_split"] == 0.2 and saved["seed"] == 0
    held = {name: [f for f in saved["val"] if f.startswith(name + "/")] for name in CLASSES}
    assert {name: len(files) for name, files in held.items()} == {"crème brûlée": 2, "hot dog": 3}  # 20% each
    assert sorted(saved["train"] + saved["val"]) == sorted(p.relative_to(root).as_posix()
                                                           for p in root.rglob("*.png"))
    train.main([*TRAIN_ARGS, "train.epochs=1", f"data.name={root}", "data.val_split=0.2", f"project={tmp_path}"])
    assert split_of(tmp_path / "exp2")["val"] == saved["val"]  # the same files and seed: the same split
    train.main([*TRAIN_ARGS, "train.epochs=1", f"data.name={root}", "data.val_split=0.2", "seed=1",
                f"project={tmp_path}"])
    assert split_of(tmp_path / "exp3")["val"] != saved["val"]


def test_val_split_holds_out_at_least_one_image_of_a_class_and_never_all(tmp_path):
    counts = {"one": 1, "two": 2, "three": 3, "ten": 10}
    folder = SimpleNamespace(root=str(tmp_path), classes=list(counts), samples=[
        (str(tmp_path / name / f"{i}.png"), k) for k, (name, n) in enumerate(counts.items()) for i in range(n)])
    for share, held in ((0.2, {"two": 1, "three": 1, "ten": 2}), (0.9, {"two": 1, "three": 2, "ten": 9})):
        split = split_files(folder, share, seed=0)
        assert Counter(name.split("/")[0] for name in split["val"]) == held
        assert len(split["train"]) + len(split["val"]) == 16 and not set(split["train"]) & set(split["val"])


@pytest.mark.slow
def test_resume_and_val_keep_the_saved_split_after_files_are_added(tmp_path, log, capfd):
    root = class_folders(tmp_path / "data", 8)
    train.main([*TRAIN_ARGS, "train.epochs=1", f"data.name={root}", "data.val_split=0.25", f"project={tmp_path}"])
    run_dir = tmp_path / "exp"
    saved = (run_dir / "split.json").read_text(encoding="utf-8")
    for name in CLASSES:  # added after the run started: with a split made afresh, some would be held out for val
        write_images(root / name, name, 8, start=100, seed=5)
    log.clear()
    train.main(["--resume", str(run_dir), "train.epochs=2"])
    assert f"the run's split, from {run_dir / 'split.json'}" in log.text and "training images" not in log.text
    assert (run_dir / "split.json").read_text(encoding="utf-8") == saved
    assert load_checkpoint(run_dir / "weights" / "last.pt")["train_images"] == 12  # 6 per class, as before
    metrics = val.main(["--weights", str(run_dir / "weights" / "last.pt"), "--project", str(tmp_path / "v")])
    recorded = float(read_results(run_dir)[1][-1]["val/top1"])
    assert metrics["val/samples"] == 4 and float(f"{metrics['val/top1']:.6g}") == recorded
    train_metrics = val.main(["--weights", str(run_dir / "weights" / "last.pt"), "--split", "train",
                              "--project", str(tmp_path / "v")])
    assert train_metrics["val/samples"] == 12
    gone = json.loads(saved)["val"][0]
    (root / gone).unlink()
    with pytest.raises(SystemExit) as exit_:
        val.main(["--weights", str(run_dir / "weights" / "last.pt"), "--project", str(tmp_path / "v")])
    assert exit_.value.code == 2
    assert capfd.readouterr().err == (
        f"val.py: error: {run_dir / 'split.json'}: 1 of its 4 val files are not in {root} (e.g. {gone}); restore "
        f"them, or start a new run, which splits the folder afresh\n")


def test_val_without_the_saved_split_says_what_is_missing(tmp_path, capfd):
    root = class_folders(tmp_path / "data", 4)
    train.main([*TRAIN_ARGS, "train.epochs=1", f"data.name={root}", "data.val_split=0.25", f"project={tmp_path}"])
    weights = tmp_path / "copy" / "best.pt"  # a checkpoint away from its run
    weights.parent.mkdir()
    shutil.copy(tmp_path / "exp" / "weights" / "best.pt", weights)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        val.main(["--weights", str(weights), "--project", str(tmp_path / "v")])
    assert exit_.value.code == 2 and not (tmp_path / "v").exists()
    assert capfd.readouterr().err == (
        f"val.py: error: {weights.parent / 'split.json'}: missing; it holds the run's data.val_split split; val.py "
        f"reads {root}, a folder of class folders, as the run that trained {weights} split it: keep the checkpoint in "
        f"its run's weights/ folder, or give --data a root with a val/ folder (its test/ folder: --data ROOT --split "
        f"test)\n")


@pytest.mark.slow
def test_val_evaluates_a_folder_of_class_folders_the_run_did_not_split_whole(tmp_path, capfd, log):
    root, other = class_folders(tmp_path / "data", 4), tmp_path / "other"
    for name in CLASSES:  # none of the run's files: another folder (3 images of each class)
        write_images(other / name, name, 3, start=100)
    train.main([*TRAIN_ARGS, "train.epochs=1", f"data.name={root}", "data.val_split=0.25", f"project={tmp_path}"])
    split_run = tmp_path / "exp" / "weights" / "best.pt"
    assert val.main(["--weights", str(split_run), "--data", str(other), "--project", str(tmp_path / "v")])[
        "val/samples"] == 6
    assert f"{other} holds none of the files of the run's split ({tmp_path / 'exp' / 'split.json'})" in log.text
    train.main([*TRAIN_ARGS, "train.epochs=1", f"data.name={split_folders(tmp_path / 'split', 'val')}",
                f"project={tmp_path}"])  # trained on train/ and val/ folders: it split no folder
    assert val.main(["--weights", str(tmp_path / "exp2" / "weights" / "best.pt"), "--data", str(root), "--project",
                     str(tmp_path / "v")])["val/samples"] == 8
    capfd.readouterr()
    with pytest.raises(SystemExit):
        val.main(["--weights", str(tmp_path / "exp2" / "weights" / "best.pt"), "--data", str(root), "--split", "test"])
    assert capfd.readouterr().err == (f"val.py: error: {root}: a folder of class folders, which val.py evaluates "
                                      f"whole; --split test names a part of a root of train/, val/ and test/ "
                                      f"folders: leave --split out\n")


@pytest.mark.slow
def test_val_split_under_torchrun_rank_0_splits_and_writes_and_every_rank_uses_its_split(tmp_path):
    root = class_folders(tmp_path / "data", 9)
    # tests/split_ranks.py: rank 1 cannot list hot dog/005.png; each rank writes the files of its train and val sets.
    result = run_torchrun("tests/split_ranks.py", tmp_path, "train.py", *TRAIN_ARGS, f"data.name={root}",
                          "data.val_split=0.34", f"project={tmp_path / 'runs'}")
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs" / "exp"
    saved = split_of(run_dir)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text(encoding="utf-8")) for r in (0, 1))
    assert rank0 == rank1 == {"train": saved["train"], "val": saved["val"]} and len(saved["val"]) == 6
    assert "hot dog/005.png" in saved["train"] + saved["val"]  # rank 0's listing, which rank 1 could not make
    assert sorted(p.name for p in run_dir.iterdir() if "split" in p.name) == ["split.json"]  # no temporary file left
    assert result.stdout.count("data.val_split=0.34 of each class") == 1
    _, rows = read_results(run_dir)
    metrics = val.main(["--weights", str(run_dir / "weights" / "last.pt"), "--project", str(tmp_path / "v")])
    assert float(f"{metrics['val/top1']:.6g}") == float(rows[-1]["val/top1"])


def test_val_split_where_the_root_has_its_own_split_or_none_given_says_what_to_do(tmp_path):
    folders = split_folders(tmp_path / "folders", "val")
    with pytest.raises(DatasetError) as e:
        build_datasets(folders, None, None, hold_out=HoldOut(0.2))
    assert str(e.value) == (f"data.val_split=0.2: {folders} has its own split (train/, val/); set data.val_split=0, "
                            f"or name a folder of class folders only")
    csvs = csv_root(tmp_path / "csvs", "test")
    with pytest.raises(DatasetError, match=r"has its own split \(train.csv, test.csv\)"):
        build_datasets(csvs, None, None, hold_out=HoldOut(0.2))
    shutil.rmtree(folders / "val")  # train/ alone: the way is to name it
    with pytest.raises(DatasetError) as e:
        build_datasets(folders, None, None, hold_out=HoldOut(0.2))
    assert str(e.value) == (f"data.val_split=0.2: {folders} has its own split (train/); to hold out part of train/, "
                            f"name it: data.name={folders / 'train'}")
    assert len(build_datasets(folders / "train", None, None, hold_out=HoldOut(0.2))[1]) == len(CLASSES)  # 1 of 6
    (csvs / "test.csv").unlink()  # train.csv alone: a CSV lists its val images
    with pytest.raises(DatasetError) as e:
        build_datasets(csvs, None, None, hold_out=HoldOut(0.2))
    assert str(e.value) == (f"data.val_split=0.2: {csvs} has its own split (train.csv); list the images to validate "
                            f"on in val.csv (path,label): data.val_split holds out class folders' images only")
    plain = class_folders(tmp_path / "plain", 2)
    with pytest.raises(DatasetError) as e:
        build_datasets(plain, None, None)
    assert str(e.value) == (f"{plain}: no train/ folder or train.csv; if its folders are the classes, set "
                            f"data.val_split (e.g. data.val_split=0.2) to hold out that share of each class for val")
    with pytest.raises(DatasetError, match=r"^data.val_split=0.2: cifar10 validates on its own test set"):
        train_val_datasets("cifar10", None, None, hold_out=HoldOut(0.2))


def test_a_root_with_train_but_no_val_folder_suggests_val_split(tmp_path, capsys):
    root = tmp_path / "data"
    write_images(root / "train" / "hot dog", "hot dog", 2)
    with pytest.raises(SystemExit) as exit_:
        train.main([*TRAIN_ARGS, f"data.name={root}", f"project={tmp_path / 'runs'}"])
    assert exit_.value.code == 2 and not (tmp_path / "runs").exists()
    assert capsys.readouterr().err == (
        f"train.py: error: {root}: no val/, valid/ or test/ folder; an ImageFolder root holds train/<class>/* and "
        f"val/<class>/* (or valid/, test/); or hold out part of train/: data.name={root / 'train'} "
        f"data.val_split=0.2\n")


def test_csv_errors_name_the_file_and_the_line(tmp_path):
    root = csv_root(tmp_path / "data")
    train_csv, val_csv = root / "train.csv", root / "val.csv"
    rows = list(csv.reader(open(train_csv, encoding="utf-8")))[1:]

    def error(path, new_rows, header=("path", "label")):
        write_csv(path, new_rows, header)
        with pytest.raises(DatasetError) as e:
            build_datasets(root, None, None)
        return str(e.value)

    assert error(train_csv, rows, ("file", "class")) == (
        f"{train_csv}, line 1: the header must name the columns path,label (one label per image; path relative to the "
        f"CSV's folder) or path,labels (several), got file,class")
    assert error(train_csv, [*rows[:3], ("images/gone.png", "hot dog"), *rows[3:]]) == (
        f"{train_csv}, line 5: images/gone.png: no such file; paths are relative to the CSV's folder, {root}")
    assert error(train_csv, [*rows[:2], ("x.png", "hot dog"), ("y.png", "hot dog")]).startswith(
        f"{train_csv}, line 4: x.png: no such file (2 of its 4 files are missing); ")
    assert error(train_csv, [*rows[:2], (rows[2][0],)]) == f"{train_csv}, line 4: no label; each row is path,label"
    assert error(train_csv, []) == f"{train_csv}: no rows under its header; list one image per line as path,label"
    write_csv(train_csv, rows)
    val_rows = list(csv.reader(open(val_csv, encoding="utf-8")))[1:]
    assert error(val_csv, [*val_rows, (val_rows[0][0], "hotdog")]) == (
        f"{val_csv}, line {len(val_rows) + 2}: label 'hotdog' has no training images in {train_csv}")
    val_csv.unlink()
    assert error(root / "other.csv", []) == (f"{root}: no val.csv, valid.csv or test.csv beside train.csv; list the "
                                             f"images to validate on in val.csv (path,label): data.val_split holds "
                                             f"out class folders' images only")


def test_a_bad_csv_stops_train_with_one_line_and_no_run_dir(tmp_path, capsys):
    root = csv_root(tmp_path / "data")
    with open(root / "val.csv", "a", encoding="utf-8") as f:
        f.write("images/missing.png,hot dog\n")
    with pytest.raises(SystemExit) as exit_:
        train.main([*TRAIN_ARGS, f"data.name={root}", f"project={tmp_path / 'runs'}"])
    assert exit_.value.code == 2 and not (tmp_path / "runs").exists()
    assert capsys.readouterr().err == (f"train.py: error: {root / 'val.csv'}, line 8: images/missing.png: no such "
                                       f"file; paths are relative to the CSV's folder, {root}\n")


def test_csv_labels_keep_their_spelling_but_not_surrounding_spaces_and_sort_as_folders_do(tmp_path):
    root = tmp_path / "data"
    paths = write_images(root / "img", "hot dog", 4)
    write_csv(root / "train.csv", [(p.name if i else f"img/{p.name}", name) for i, (p, name) in
                                   enumerate(zip(paths, ["hot dog", "Hot dog", "crème brûlée", "hot dog "]))])
    for i in range(1, 4):  # paths are relative to the CSV: ../img/ from a folder beside img/
        shutil.copy(paths[i], root / paths[i].name)
    write_csv(root / "test.csv", [(f"img/{paths[0].name}", "crème brûlée")])
    train_set, val_set = build_datasets(root, None, None)
    # 'hot dog ' (a spreadsheet's trailing space) is hot dog, as in a multi-label cell; case and accents are kept.
    assert train_set.classes == ["Hot dog", "crème brûlée", "hot dog"] == sorted(train_set.classes)
    assert train_set.targets == [2, 0, 1, 2] and val_set.targets == [1] and val_set.root == str(root)
    assert train_set[0][0].size == (8, 8) and train_set[0][0].mode == "RGB"


def palette_image(palette):
    image = Image.new("P", (6, 4), 1)
    image.putpalette(palette)
    return image


def gray16(path, value):
    Image.fromarray(np.full((4, 6), value, dtype=np.uint16)).save(path)  # mode I;16
    return path


MODES = {  # how an image is written -> the RGB a person sees at its top-left pixel
    "L": (lambda p: Image.new("L", (6, 4), 77).save(p), (77, 77, 77)),
    "1": (lambda p: Image.new("1", (6, 4), 1).save(p), (255, 255, 255)),
    "RGBA transparent": (lambda p: Image.new("RGBA", (6, 4), (10, 20, 30, 0)).save(p), (255, 255, 255)),
    "RGBA half": (lambda p: Image.new("RGBA", (6, 4), (0, 0, 200, 128)).save(p), (127, 127, 227)),
    "LA": (lambda p: Image.new("LA", (6, 4), (0, 0)).save(p), (255, 255, 255)),
    "P": (lambda p: palette_image([0, 0, 0, 200, 0, 0]).save(p), (200, 0, 0)),
    "P transparent": (lambda p: Image.new("P", (6, 4), 0).save(p, transparency=0), (255, 255, 255)),
    "CMYK": (lambda p: Image.new("CMYK", (6, 4), (0, 255, 255, 0)).save(p.with_suffix(".jpg"), quality=100),
             (254, 0, 0)),
    "I;16 mid": (lambda p: gray16(p, 32768), (128, 128, 128)),
    "I;16 max": (lambda p: gray16(p, 65535), (255, 255, 255)),
    "I;16 tiff": (lambda p: gray16(p.with_suffix(".tif"), 1028), (4, 4, 4)),
    "I;16 dark": (lambda p: gray16(p, 200), (1, 1, 1)),  # convert('RGB') would show 200 of 255
}


@pytest.mark.parametrize("mode", MODES)
def test_images_of_any_mode_decode_to_the_rgb_a_person_sees(tmp_path, mode):
    write, expected = MODES[mode]
    write(tmp_path / "image.png")
    path = next(tmp_path.iterdir())
    image = decode(path)
    assert image.mode == "RGB" and image.size == (6, 4)
    assert image.getpixel((0, 0)) == pytest.approx(expected, abs=2 if path.suffix == ".jpg" else 0)


def test_exif_orientation_turns_the_image_upright_in_training_val_and_predict(tmp_path):
    pixels = np.zeros((2, 4, 3), dtype=np.uint8)  # stored 4 wide, 2 high; the top-left pixel red
    pixels[0, 0] = (255, 0, 0)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation 6: the camera was turned; shown rotated 90 degrees clockwise
    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    Image.fromarray(pixels).save(folder / "photo.png", exif=exif)
    gray16(folder / "gray.png", 32768)
    image = decode(folder / "photo.png")
    assert image.size == (2, 4) and image.getpixel((1, 0)) == (255, 0, 0)  # upright: red at the top right
    shutil.copytree(tmp_path / "train", tmp_path / "val")
    train_set, _ = build_datasets(tmp_path, None, None)
    cached = RamImages(train_set, budget=None)  # data.cache=ram decodes through the dataset's loader
    for i, (path, _) in enumerate(train_set.samples):
        expected = torch.from_numpy(np.array(decode(path))).permute(2, 0, 1)
        assert torch.equal(cached[i][0], expected)
        assert torch.equal(predict.ImageFiles([path], lambda im: torch.from_numpy(np.array(im)).permute(2, 0, 1)
                                              )[0][0], expected)


def test_csv_paths_outside_its_folder_are_refused_unless_the_recipe_allows_them(tmp_path):
    root = csv_root(tmp_path / "data")
    outside = write_images(tmp_path / "elsewhere", "hot dog", 1)[0]
    train_csv = root / "train.csv"
    rows = list(csv.reader(open(train_csv, encoding="utf-8")))[1:]
    for path in ("../elsewhere/000.png", str(outside), "images/../../elsewhere/000.png"):
        write_csv(train_csv, [*rows, (path, "hot dog")])
        with pytest.raises(DatasetError) as e:
            build_datasets(root, None, None)
        assert str(e.value) == (f"{train_csv}, line {len(rows) + 2}: {path} lies outside the CSV's folder, {root}; "
                                f"list images inside it, or read paths outside it with data.csv_allow_outside=true")
        train_set, _ = build_datasets(root, None, None, allow_outside=True)
        assert train_set.samples[-1] == (str(outside), 1) or os.path.samefile(train_set.samples[-1][0], outside)
    write_csv(train_csv, [*rows, ("images/./train0//000.png", "crème brûlée")])  # inside, spelled oddly: a repeat
    assert len(build_datasets(root, None, None)[0]) == len(rows) + 1


def test_csv_an_image_listed_with_two_labels_is_refused_and_repeats_and_overlap_are_counted(tmp_path, log):
    root = csv_root(tmp_path / "data")
    train_csv, val_csv = root / "train.csv", root / "val.csv"
    rows = list(csv.reader(open(train_csv, encoding="utf-8")))[1:]
    write_csv(train_csv, [*rows, ("./" + rows[1][0], "hot dog")])
    with pytest.raises(DatasetError) as e:
        build_datasets(root, None, None)
    assert str(e.value) == (f"{train_csv}: line 3 labels {rows[1][0]} 'crème brûlée' and line {len(rows) + 2} "
                            f"labels ./{rows[1][0]} 'hot dog'; an image has one label: remove one of the rows")
    write_csv(train_csv, [*rows, rows[1], rows[2]])
    val_rows = list(csv.reader(open(val_csv, encoding="utf-8")))[1:]
    write_csv(val_csv, [*val_rows, rows[0], rows[7]])
    train_set, val_set = build_datasets(root, None, None)
    assert (len(train_set), len(val_set)) == (len(rows) + 2, len(val_rows) + 2)
    assert (f"{train_csv}: 2 row(s) list an image again with the same label (e.g. {rows[1][0]}, lines 3 and "
            f"{len(rows) + 2}); each image counts as often as it is listed") in log.text
    assert (f"2 of the {len(val_rows) + 2} images of val.csv are also in train.csv (e.g. {rows[0][0]}): val scores "
            f"them after training on them; list each image in one of the two") in log.text


@pytest.mark.slow
def test_ranks_that_list_different_images_stop_with_one_line_naming_them(tmp_path):
    root = split_folders(tmp_path / "data", "val")
    # tests/split_ranks.py: rank 1 cannot list hot dog/005.png (a copy that lags, a file added during start-up).
    result = run_torchrun("tests/split_ranks.py", tmp_path, "train.py", *TRAIN_ARGS, f"data.name={root}",
                          f"project={tmp_path / 'runs'}")
    host = socket.gethostname()
    assert result.returncode != 0 and not (tmp_path / "runs").exists()
    assert (f"train.py: error: {root}: the ranks list different images: rank 0 on {host}: 12 / 6 images (train / "
            f"val), 2 classes; rank 1 on {host}: 11 / 6 images (train / val), 2 classes; every machine needs the same "
            f"copy of the dataset") in result.stderr
    assert len(console_lines(result.stderr, "train.py: error:")) == 1


def expected_samples(root, layout):
    """Write root in layout; the (path, target) training samples a list of tuples held before Listing: torchvision's
    ImageFolder's own list, or made from the CSV rows or the split's file names."""
    classes = sorted(CLASSES)
    if layout == "folders":
        return ImageFolder(str(split_folders(root, "val") / "train")).samples
    if layout == "val_split":
        record = split_files(ImageFolder(str(class_folders(root, 4))), 0.25, 0)
        return [(os.path.join(root, name), classes.index(name.split("/")[0])) for name in record["train"]]
    paths = write_images(root / "images", "hot dog", 4) + write_images(root / "images", "crème brûlée", 2, start=4)
    if layout == "csv":
        labels = ["hot dog"] * 4 + ["crème brûlée"] * 2
        write_csv(root / "train.csv", [(f"./images/{p.name}", label) for p, label in zip(paths, labels)])
        write_csv(root / "val.csv", [(f"images/{paths[0].name}", "hot dog")])
        return [(str(p), classes.index(label)) for p, label in zip(paths, labels)]
    cells = ["hot dog|crème brûlée", "", "hot dog", "crème brûlée", "crème brûlée|hot dog", "hot dog"]
    write_csv(root / "train.csv", [(f"images/{p.name}", cell) for p, cell in zip(paths, cells)], ("path", "labels"))
    write_csv(root / "val.csv", [(f"images/{paths[0].name}", "hot dog")], ("path", "labels"))
    return [(str(p), tuple(sorted(classes.index(c) for c in cell.split("|") if c))) for p, cell in zip(paths, cells)]


@pytest.mark.parametrize("layout", ["folders", "csv", "multilabel csv", "val_split"])
def test_every_layout_holds_its_samples_as_arrays_that_read_as_the_list_of_tuples_did(tmp_path, layout):
    root = tmp_path / "data"
    expected = expected_samples(root, layout)
    train_set, _ = build_datasets(root, np.asarray, np.asarray, hold_out=HoldOut(0.25 if layout == "val_split" else 0))
    assert isinstance(train_set.samples, Listing) and train_set.imgs is train_set.samples
    assert train_set.samples == expected and list(train_set.samples) == expected
    assert [train_set.samples[i] for i in range(-len(expected), 0)] == expected  # negative indices, as a list's
    assert train_set.samples[1:3] == expected[1:3]
    assert train_set.targets == [target for _, target in expected] and len(train_set) == len(expected)
    if layout != "multilabel csv":
        assert np.asarray(train_set.targets).tolist() == [target for _, target in expected]

    # A DataLoader's forked workers read the same batches as from the list of tuples.
    as_list = copy.copy(train_set)
    as_list.samples = as_list.imgs = expected
    as_list.targets = [target for _, target in expected]
    read = [list(DataLoader(dataset, batch_size=4, num_workers=2)) for dataset in (train_set, as_list)]
    assert len(read[0]) == len(read[1]) == -(-len(expected) // 4)
    for (images, targets), (list_images, list_targets) in zip(*read):
        assert torch.equal(images, list_images) and torch.equal(targets, list_targets)


def test_hidden_files_and_folders_are_never_classes_or_images_and_other_files_left_out_are_counted(tmp_path,
                                                                                                   monkeypatch):
    # Jupyter's .ipynb_checkpoints, macOS's ._ copies and a .git folder, in a split, in a class and at the root of
    # class folders; a GIF and a text file are left out for their extension, and said once.
    import data.sources
    said = []
    monkeypatch.setattr(data.sources.LOGGER, "info", said.append)
    root = split_folders(tmp_path / "data", "val")
    first = root / "train" / "crème brûlée"
    for folder in (root / "train" / ".ipynb_checkpoints", first / ".ipynb_checkpoints", root / "val" / ".git"):
        folder.mkdir()
        shutil.copy(next(first.iterdir()), folder / "0-checkpoint.png")
    (first / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    Image.new("RGB", (8, 8)).save(first / "anim.gif")
    (first / "notes.txt").write_text("not an image")
    train_set, val_set = build_datasets(root, None, None)
    assert train_set.classes == val_set.classes == list(CLASSES) and (len(train_set), len(val_set)) == (12, 6)
    assert said[0] == (f"{colorstr('data:')} {root / 'train'}: left out 2 file(s) that are not images by their "
                       f"extension (1 .gif, 1 .txt); images are .jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, .tiff, "
                       f".webp")
    assert predict.list_images([str(first)]) == sorted(first.glob("[!.]*.png"))
    (tmp_path / "only_hidden" / ".git" / "objects").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no train/ folder, train.csv or class folders"):
        build_datasets(tmp_path / "only_hidden", None, None, hold_out=HoldOut(0.2))


def test_a_class_folder_listing_is_torchvisions_own_held_in_narrow_arrays_and_read_as_int64(tmp_path):
    # Listed a class folder at a time (never every image's tuple at once): the same samples, in the same order, as
    # ImageFolder's, nested folders and files of other kinds included.
    folder = split_folders(tmp_path / "data", "val") / "train"
    first, second = sorted(folder.iterdir())
    (first / "nested" / "deeper").mkdir(parents=True)
    shutil.copy(next(second.iterdir()), first / "nested" / "deeper" / "0.png")
    shutil.copy(next(second.iterdir()), first / "nested" / "1.png")
    (first / "notes.txt").write_text("not an image")
    dataset = image_folder(folder, None)
    assert list(dataset.samples) == ImageFolder(str(folder)).samples and len(dataset) == 14
    assert dataset.targets == ImageFolder(str(folder)).targets
    assert (dataset.samples.offsets.dtype, dataset.samples.labels.dtype) == (np.int16, np.int16)
    assert np.asarray(dataset.targets).dtype == np.int64  # as a list of class indices reads
