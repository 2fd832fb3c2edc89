"""Test-time augmentation (the mean softmax of each image and its horizontal flip) in evaluate(), train.py, val.py
and predict.py; predict.py --save-images: each image with its top-k drawn on it, and contact sheets."""

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch.utils.data import DataLoader, TensorDataset

import predict
import train
import val
from conftest import make_image_folder, read_results
from utils.checkpoint import load_checkpoint
from utils.general import DATASETS_DIR
from utils.metrics import evaluate
from utils.plots import annotated_image, label_font
from utils.tta import tta_logits

VAL_DIR = DATASETS_DIR / "digits" / "val"


def flip_sensitive_model(classes=4, side=4):
    """A linear model of the pixels: its scores for an image and for its mirror image differ."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * side * side, classes))


def uint8_batch(n, side=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, generator=generator)


def test_tta_probabilities_are_the_mean_of_the_softmax_of_the_image_and_its_flip():
    model, x = flip_sensitive_model(), uint8_batch(5).float() / 255
    with torch.no_grad():
        expected = (model(x).softmax(1) + model(x.flip(3)).softmax(1)) / 2
        probs = tta_logits(model, x).softmax(1)
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(expected, model(x).softmax(1), atol=1e-3)  # the flip mattered


def test_evaluate_with_tta_scores_the_mean_softmax_its_loss_the_nll_of_it():
    model, images, targets = flip_sensitive_model(), uint8_batch(7), torch.tensor([0, 1, 2, 3, 0, 1, 2])
    loader = DataLoader(TensorDataset(images, targets), batch_size=3)
    normalize = lambda x: x.float() / 255  # noqa: E731
    metrics = evaluate(model, loader, normalize, 4, torch.device("cpu"), tta=True)
    with torch.no_grad():
        x = normalize(images)
        probs = (model(x).softmax(1) + model(x.flip(3)).softmax(1)) / 2
    assert math.isclose(metrics["val/loss"], F.nll_loss(probs.log(), targets).item(), rel_tol=1e-5)
    predicted = probs.argmax(1)
    assert metrics["val/top1"] == (predicted == targets).sum().item() / 7
    assert metrics["confusion"].tolist() == torch.bincount(targets * 4 + predicted, minlength=16).view(4, 4).tolist()
    plain = evaluate(model, loader, normalize, 4, torch.device("cpu"))
    assert plain["val/loss"] != pytest.approx(metrics["val/loss"], rel=1e-3)


def test_a_flip_symmetric_model_scores_the_same_with_and_without_tta():
    torch.manual_seed(0)  # global average pooling makes it blind to mirror images
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 6))
    loader = DataLoader(TensorDataset(uint8_batch(20, side=6), torch.arange(20) % 6), batch_size=8)
    args = (loader, lambda x: x.float() / 255 - 0.5, 6, torch.device("cpu"))
    plain, tta = evaluate(model, *args), evaluate(model, *args, tta=True)
    assert torch.equal(plain["class_counts"], tta["class_counts"]) and torch.equal(plain["confusion"], tta["confusion"])
    assert (plain["val/top1"], plain["val/top5"]) == (tta["val/top1"], tta["val/top5"])
    assert math.isclose(plain["val/loss"], tta["val/loss"], rel_tol=1e-6)


@pytest.fixture(scope="module")
def tta_run(tmp_path_factory):
    """A one-epoch run of a narrow convnet on digits, validated with train.tta: (best.pt, its results.csv row). Its
    EMA is a copy of the weights (an update moves it all the way: alpha = (1 - 0.9) * batch 48 > 1)."""
    project = tmp_path_factory.mktemp("runs")
    train.main(["--recipe", "cls.yaml", "model.width=4", "train.epochs=1", "train.tta=true", "train.ema_decay=0.9",
                "train.ema_steps=1", f"project={project}"])
    _, rows = read_results(project / "exp")
    return project / "exp" / "weights" / "best.pt", rows[0]


@pytest.mark.slow
def test_val_tta_reproduces_what_train_tta_logged_and_warns_that_digits_flip(tta_run, tmp_path, log):
    weights, row = tta_run
    metrics = val.main(["--weights", str(weights), "--tta", "--project", str(tmp_path)])
    assert f"{metrics['val/top1']:.6g}" == row["val/top1"] and f"{metrics['val/loss']:.6g}" == row["val/loss"]
    assert (row["val/ema_top1"], row["val/ema_loss"]) == (row["val/top1"], row["val/loss"])  # the EMA with TTA too
    assert f"{load_checkpoint(weights)['recipe']['train']['precision']}; TTA: image + horizontal flip" in log.text
    assert log.text.count("trained without flips (data.hflip=0): where a flip changes the class") == 1
    assert json.loads((tmp_path / "exp" / "metrics.json").read_text())["run"]["tta"] is True
    plain = val.main(["--weights", str(weights), "--project", str(tmp_path)])
    assert f"{plain['val/loss']:.6g}" != row["val/loss"]  # training did validate with TTA
    assert json.loads((tmp_path / "exp2" / "metrics.json").read_text())["run"]["tta"] is False


def probabilities(rows):
    """{file name: {class: probability}} of predict.py's rows."""
    return {r["file"].split("/")[-1]: {t["class"]: t["prob"] for t in r["top"]} for r in rows}


@pytest.mark.slow
def test_predict_tta_gives_each_image_the_mean_of_its_and_its_mirror_images_probabilities(tta_run, tmp_path):
    weights, _ = tta_run
    source = tmp_path / "source"
    source.mkdir()
    for path in sorted((VAL_DIR / "2").iterdir())[:2]:
        shutil.copy(path, source / path.name)
        Image.open(path).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(source / f"mirror_{path.name}")
    common = ["--weights", str(weights), "--source", str(source), "--topk", "10"]
    plain = probabilities(predict.main([*common, "--project", str(tmp_path / "plain")])[0])
    tta = probabilities(predict.main([*common, "--tta", "--project", str(tmp_path / "tta")])[0])
    for name in (p.name for p in source.glob("0*.png")):
        mean = {c: (plain[name][c] + plain[f"mirror_{name}"][c]) / 2 for c in plain[name]}
        assert tta[name] == pytest.approx(mean, abs=1e-6) and tta[f"mirror_{name}"] == pytest.approx(mean, abs=1e-6)
        assert plain[name] != pytest.approx(mean, abs=1e-3)  # the flip changes this digit's probabilities
    assert json.loads((tmp_path / "tta" / "exp" / "predictions.json").read_text())["tta"] is True


@pytest.mark.slow
def test_predict_save_images_draws_each_images_top_k_and_contact_sheets_of_them(tta_run, tmp_path, monkeypatch):
    weights, _ = tta_run
    digit = sorted((VAL_DIR / "7").iterdir())[0]
    for folder in ("a", "b"):  # two inputs of one name
        (tmp_path / "src" / folder).mkdir(parents=True)
        shutil.copy(digit, tmp_path / "src" / folder / "x.png")
    Image.fromarray(np.full((20, 40, 3), 200, dtype=np.uint8)).save(tmp_path / "src" / "wide.jpg")
    monkeypatch.setattr(predict, "SHEET_SIZE", 2)  # 3 images: a sheet of 2 and a sheet of 1
    rows, _ = predict.main(["--weights", str(weights), "--source", str(tmp_path / "src"), "--topk", "3",
                            "--save-images", "--project", str(tmp_path / "p")])
    out = tmp_path / "p" / "exp"
    assert sorted(p.name for p in (out / "images").iterdir()) == ["wide.jpg", "x.png", "x_2.png"]
    wide = np.array(Image.open(out / "images" / "wide.jpg")).astype(int)
    assert wide.shape == (260, 520, 3)  # 20 px high: x13 to reach 256
    assert wide[:40, :40].mean() < 150 and abs(wide[200:, 200:] - 200).max() <= 3  # a dark box at the top left only
    for name in ("x.png", "x_2.png"):  # 8x8: x32, nearest neighbour; the text box at the top left, nothing elsewhere
        drawn, original = np.array(Image.open(out / "images" / name)), np.array(Image.open(digit).convert("RGB"))
        enlarged = original.repeat(32, axis=0).repeat(32, axis=1)
        assert drawn.shape == (256, 256, 3) and np.array_equal(drawn[128:], enlarged[128:])
        assert (drawn[:40, :60] != enlarged[:40, :60]).any(axis=2).mean() > 0.05  # white text on black
    # Tiles of 128 px, a 12 px caption and 2 px gaps: 2 tiles, then 1.
    assert Image.open(out / "contact_sheet.jpg").size == (2 * 130, 142)
    assert Image.open(out / "contact_sheet_2.jpg").size == (130, 142)
    assert not (out / "contact_sheet_3.jpg").exists() and len(rows) == 3


def shows(drawn, source):
    """Whether a drawn copy shows the source image: below its text box, the source enlarged by a whole factor."""
    drawn, source = np.array(Image.open(drawn)), np.array(Image.open(source).convert("RGB"))
    factor = drawn.shape[0] // source.shape[0]
    enlarged = source.repeat(factor, axis=0).repeat(factor, axis=1)
    return drawn.shape == enlarged.shape and np.array_equal(drawn[128:], enlarged[128:])


@pytest.mark.slow
def test_predict_save_images_names_each_images_drawn_copy_in_predictions_csv(tta_run, tmp_path):
    weights, _ = tta_run
    source = make_image_folder(tmp_path, {"src": {"cat": 2, "dog": 2}}) / "src"  # cat/000.png, dog/000.png, ...
    rows, _ = predict.main(["--weights", str(weights), "--source", str(source), "--save-images",
                            "--project", str(tmp_path / "p")])
    out = tmp_path / "p" / "exp"
    with open(out / "predictions.csv") as f:
        table = list(csv.DictReader(f))
    drawn = [r["drawn"] for r in table]
    assert [r["file"] for r in table] == [str(p) for p in sorted(source.rglob("*.png"))]
    assert sorted(Path(d).name for d in drawn) == ["000.png", "000_2.png", "001.png", "001_2.png"]
    assert all(Path(d).parent == out / "images" and Path(d).is_file() for d in drawn)
    assert all(shows(r["drawn"], r["file"]) for r in table)
    assert not shows(table[0]["drawn"], table[2]["file"])  # cat/000 and dog/000 differ: a swap would be seen
    assert [r["drawn"] for r in json.loads((out / "predictions.json").read_text())["predictions"]] == drawn
    assert [r["drawn"] for r in rows] == drawn
    predict.main(["--weights", str(weights), "--source", str(source), "--project", str(tmp_path / "p")])
    with open(tmp_path / "p" / "exp2" / "predictions.csv") as f:
        assert "drawn" not in next(csv.reader(f))  # nothing drawn, no column


def test_class_names_with_accents_are_drawn_not_replaced_by_boxes():
    font = label_font(24)

    def ink(text):
        image = Image.new("L", (200, 40))
        ImageDraw.Draw(image).text((2, 2), text, font=font, fill=255)
        return np.array(image)
    missing = ink("\U0010fffd")  # a private-use code point: the font's 'missing glyph' box
    assert all(not np.array_equal(ink(c), missing) for c in "èûé")
    drawn = np.array(annotated_image(Image.new("RGB", (300, 300)), ["0.93 crème brûlée"]))
    assert drawn[:40].any() and not drawn[60:].any()


@pytest.mark.slow
def test_predict_under_torchrun_saves_only_on_rank_0(tta_run, tmp_path, monkeypatch):
    weights, _ = tta_run
    monkeypatch.setattr(predict, "RANK", 1)
    rows, _ = predict.main(["--weights", str(weights), "--source", str(VAL_DIR / "1"), "--save-images",
                            "--project", str(tmp_path / "p")])
    assert len(rows) == 36 and not (tmp_path / "p").exists()
