"""Multi-label classification: labels read from CSVs, BCE with positive weights and smoothing, mixed label vectors,
mAP and F1 against hand-checked values, the same run at N=1, 2 and 3, exact resume, single- against multi-label
mismatches, and val.py, predict.py and export.py on a multi-label checkpoint."""

import csv
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from sklearn.metrics import (accuracy_score, average_precision_score, f1_score, precision_recall_curve,
                             precision_score, recall_score)
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import export
import predict
import val
from conftest import (check_metrics_json, fails, forward_logits, launch_n_invariance, make_image_folder, read_results,
                      rounding_tolerances, run_python, run_torchrun, run_weights, step_losses)
from data.layouts import csv_dataset
from data.mix import batch_mixer
from data.multilabel import positive_weights
from data.verify import decode
from models import model_from_checkpoint
from utils.checkpoint import load_checkpoint
from utils.config import RecipeError, checkpoint_recipe, load_recipe
from utils.general import DatasetError, SharedError
from utils.multilabel import MultiLabelLoss, class_curve, multilabel_metrics

CLASSES = ["blue", "green", "red sky"]  # a name with a space: the CSVs separate labels with '|'
# 37 training images in batches of 12 (the last step of one image), 9 val images: uneven shares at N=2 and 3.
TINY = ["train.batch_size=12", "model.width=4", "model.depth=2", "model.norm=group", "model.dropout=0",
        "data.img_size=8", "data.scale=[0.3,1.0]", "data.hflip=0.5", "data.workers=0", "train.log_every_steps=1"]


def write_multilabel(root, n_train=37, n_val=9, seed=0):
    """A multi-label CSV root: each image's labels are the colour channels it lights (none for some images), on a
    smooth pattern (so crops and flips change it), in two sizes; train.csv and val.csv list them with '|'."""
    rng = np.random.default_rng(seed)
    channel = {"red sky": 0, "green": 1, "blue": 2}
    for split, n in (("train", n_train), ("val", n_val)):
        (root / split).mkdir(parents=True)
        with open(root / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["path", "labels"])
            for i in range(n):
                labels = [name for name in CLASSES if rng.random() < 0.5]
                h, w = (12, 12) if i % 3 else (10, 15)
                y, x = np.mgrid[:h, :w]
                # each image its own phase: two images alike would tie in score, and float rounding, which differs
                # with a batch's size, would break the tie one way or the other (mAP ranks the scores)
                pixels = np.stack([40 + 30 * np.sin(x / 2 + y + c + i / 5) for c in range(3)], -1)
                for name in labels:
                    pixels[..., channel[name]] += 150
                Image.fromarray(pixels.astype(np.uint8)).save(root / split / f"{i:02d}.png")
                writer.writerow([f"{split}/{i:02d}.png", "|".join(labels)])
    return root


# --- data ---------------------------------------------------------------------------------------------------------

def write_csv(path, rows, header="path,labels"):
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def test_csv_labels_split_on_bar_or_spaces_and_load_as_multi_hot(tmp_path):
    for i in range(4):
        Image.new("RGB", (4, 4)).save(tmp_path / f"{i}.png")
    barred = csv_dataset(write_csv(tmp_path / "a.csv", ["0.png,red sky|green", "1.png,", "2.png,green| green |blue",
                                                        "3.png,blue"]), None, decode)
    assert barred.multilabel and barred.classes == ["blue", "green", "red sky"]
    assert barred.targets == [(1, 2), (), (0, 1), (0,)]  # an empty cell: none; a label twice counts once
    assert [barred[i][1].tolist() for i in range(4)] == [[0, 1, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0]]
    assert barred[0][1].dtype == torch.uint8
    spaced = csv_dataset(write_csv(tmp_path / "b.csv", ["0.png,3 7", "1.png,7"]), None, decode)
    assert spaced.classes == ["3", "7"] and spaced.targets == [(0, 1), (1,)]
    single = csv_dataset(write_csv(tmp_path / "c.csv", ["0.png,red sky"], "path,label"), None, decode)
    assert not single.multilabel and single.classes == ["red sky"] and single[0][1] == 0


def test_every_csv_of_a_root_splits_labels_as_its_train_csv_does(tmp_path):
    from data.sources import eval_dataset
    from data.layouts import csv_datasets

    for i in range(3):
        Image.new("RGB", (4, 4)).save(tmp_path / f"{i}.png")
    write_csv(tmp_path / "train.csv", ["0.png,sea lion|sea", "1.png,lion"])
    write_csv(tmp_path / "val.csv", ["2.png,sea lion"])  # no '|' here: still one label, not 'sea' and 'lion'
    train_set, val_set = csv_datasets(tmp_path, None, None, decode)
    assert train_set.classes == ["lion", "sea", "sea lion"] and val_set.targets == [(2,)]
    assert eval_dataset(tmp_path, "val", None, train_set.classes, "w.pt").targets == [(2,)]  # val.py's reading
    write_csv(tmp_path / "train.csv", ["0.png,sea lion", "1.png,lion"])  # no '|' in train.csv: spaces separate
    train_set, val_set = csv_datasets(tmp_path, None, None, decode)
    assert train_set.classes == ["lion", "sea"] and val_set.targets == [(0, 1)]


def test_a_csv_with_both_label_columns_is_read_as_before_by_its_label_column(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "0.png")
    dataset = csv_dataset(write_csv(tmp_path / "a.csv", ["0.png,cat,cat|dog"], "path,label,labels"), None, decode)
    assert not dataset.multilabel and dataset.classes == ["cat"]


def test_csv_mistakes_are_named_with_the_file_and_line(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "0.png")
    with pytest.raises(DatasetError, match=r"b.csv, line 1: the header must name the columns path,label .* or "
                                           r"path,labels \(several\), got path,tags"):
        csv_dataset(write_csv(tmp_path / "b.csv", ["0.png,a"], "path,tags"), None, decode)
    with pytest.raises(DatasetError, match=r"c.csv, line 2: label 'dog' is not ours"):
        csv_dataset(write_csv(tmp_path / "c.csv", ["0.png,cat|dog"]), None, decode, ["cat"], "is not ours")
    with pytest.raises(DatasetError, match=r"d.csv: line 2 labels 0.png \('a',\) and line 3 labels 0.png \('b',\)"):
        csv_dataset(write_csv(tmp_path / "d.csv", ["0.png,a", "0.png,b"]), None, decode)
    root = write_multilabel(tmp_path / "data", 4, 2)
    (root / "val.csv").write_text("path,label\nval/00.png,blue\n")
    from data.layouts import csv_datasets
    with pytest.raises(DatasetError, match=r"val.csv: has a label column \(one label per image\), train.csv has a "
                                           r"labels column \(several labels per image\); give both the same columns"):
        csv_datasets(root, None, None, decode)


def test_the_ram_cache_holds_the_same_labels_and_positive_weights(tmp_path):
    from data.cache import RamImages
    from data.layouts import csv_datasets

    root = write_multilabel(tmp_path / "data")
    train_set, _ = csv_datasets(root, None, None, decode)
    cached = RamImages(train_set, budget=None)
    with open(root / "train.csv") as f:  # counted from the CSV itself
        listed = [row["labels"].split("|") for row in csv.DictReader(f)]
    hot = torch.tensor([[name in labels for name in CLASSES] for labels in listed], dtype=torch.uint8)
    assert torch.equal(cached.__getitems__(range(37))[1], hot)
    positives = hot.sum(0).tolist()
    assert 0 < min(positives) and max(positives) < 37
    assert positive_weights(cached).tolist() == pytest.approx([(37 - p) / p for p in positives])


def test_positive_weights_are_negatives_over_positives():
    class Listed:
        classes, targets = ["a", "b", "c"], [(0,), (0, 1), (0,), ()]

        def __len__(self):
            return 4
    # a: 3 positives, 1 negative; b: 1 and 3; c: no positives, weight 1
    assert positive_weights(Listed()).tolist() == pytest.approx([1 / 3, 3.0, 1.0])


# --- loss, mixing, metrics ----------------------------------------------------------------------------------------

def test_loss_is_bce_averaged_over_classes_with_smoothing_and_positive_weights():
    logits, targets = torch.randn(6, 4), torch.randint(0, 2, (6, 4), dtype=torch.uint8)
    plain = MultiLabelLoss(4)(logits, targets) / 6  # train_step divides the sum by the step's samples
    assert plain.item() == pytest.approx(F.binary_cross_entropy_with_logits(logits, targets.float()).item(), rel=1e-6)
    smoothed = MultiLabelLoss(4, smoothing=0.2)(logits, targets) / 6
    soft = targets.float() * 0.8 + 0.05  # 1 -> 0.85, 0 -> 0.05 (timm's: 1 - s + s/C and s/C)
    assert smoothed.item() == pytest.approx(F.binary_cross_entropy_with_logits(logits, soft).item(), rel=1e-6)
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0])
    weighted = MultiLabelLoss(4, weight)(logits, targets) / 6
    expected = F.binary_cross_entropy_with_logits(logits, targets.float(), pos_weight=weight)
    assert weighted.item() == pytest.approx(expected.item(), rel=1e-6)


def test_mixup_and_cutmix_mix_label_vectors_in_the_share_of_each_image():
    targets = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.uint8)
    images = torch.rand(4, 3, 8, 8)
    for alphas in ({"mixup_alpha": 0.5, "cutmix_alpha": 0.0}, {"mixup_alpha": 0.0, "cutmix_alpha": 1.0}):
        cfg = OmegaConf.create({**alphas, "mix_switch_prob": 0.5})
        mixed, soft = batch_mixer(cfg, 3, seed=0)(images, targets, 0, 1)
        # Each image's share of its own pixels, and its label vector mixed in that share: MixUp's lambda in every
        # pixel, CutMix's share of the pixels left outside the pasted box.
        for a, b in ((0, 1), (2, 3)):
            if alphas["mixup_alpha"]:
                share = ((mixed[a] - images[b]) / (images[a] - images[b])).mean().item()
            else:
                share = (mixed[a] == images[a]).all(0).double().mean().item()
            assert soft[a].tolist() == pytest.approx((share * targets[a] + (1 - share) * targets[b]).tolist(),
                                                     abs=1e-5)
            assert soft[b].tolist() == pytest.approx(((1 - share) * targets[a] + share * targets[b]).tolist(),
                                                     abs=1e-5)
        assert 0 < share < 1


def test_tta_averages_each_classs_sigmoid_over_the_image_and_its_flip():
    from utils.tta import tta_logits

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 5))
    images = torch.randn(6, 3, 4, 4) * 20  # large logits: probabilities near 0 and 1, where a naive logit overflows
    with torch.no_grad():
        mean = (model(images).sigmoid().double() + model(images.flip(3)).sigmoid().double()) / 2
        logits = tta_logits(model, images, multilabel=True)
    assert logits.isfinite().all() and torch.allclose(logits.sigmoid().double(), mean, atol=1e-6)


def test_ap_is_scikit_learns_average_precision_score_with_ties_and_rare_classes():
    from sklearn.metrics import average_precision_score
    rng = np.random.default_rng(0)
    for positives in (0.5, 0.05, 0.002):
        labels = rng.random(3000) < positives
        probs = np.round(np.clip(labels * 0.3 + rng.random(3000) * 0.7, 0, 1), 2).astype(np.float32)  # many ties
        assert class_curve(labels, probs)[0] == pytest.approx(average_precision_score(labels, probs), abs=1e-12)


def test_metrics_of_images_without_labels_or_of_broken_weights_are_one_line():
    with pytest.raises(SharedError, match="none of the 2 images has a label, so no class has an average precision"):
        multilabel_metrics(np.full((2, 3), 0.5, np.float32), np.zeros((2, 3)))
    with pytest.raises(SharedError, match="val probabilities are not finite"):
        multilabel_metrics(np.full((2, 3), np.nan, np.float32), np.ones((2, 3)))


def test_val_counts_labels_from_the_recipes_threshold_and_predict_from_the_saved_ones_unless_told():
    from utils.general import UsageError
    from utils.multilabel import chosen_thresholds

    multi, single = (OmegaConf.create({"data": {"multilabel": m}, "train": {"threshold": 0.4}}) for m in (True, False))
    saved = {"thresholds": [0.2, 0.7]}
    for default in ("saved", "recipe"):
        assert chosen_thresholds(0.3, saved, multi, "w.pt", default) == (0.3, "--threshold 0.3 for every class")
        assert chosen_thresholds("saved", saved, multi, "w.pt", default) == (
            [0.2, 0.7], "per class, as saved by train.py (each maximised its class's F1 on val)")
        assert chosen_thresholds(None, {}, single, "w.pt", default) == (None, None)
    assert chosen_thresholds(None, saved, multi, "w.pt")[0] == [0.2, 0.7]  # predict.py's default
    assert chosen_thresholds(None, saved, multi, "w.pt", "recipe") == (0.4, "train.threshold=0.4 for every class")
    assert chosen_thresholds("saved", {"thresholds": None}, multi, "w.pt") == (
        0.4, "train.threshold=0.4 for every class (the checkpoint saved none per class)")
    with pytest.raises(UsageError, match=r"--threshold 0.5: w.pt is a single-label checkpoint \(one class per image\)"):
        chosen_thresholds(0.5, {}, single, "w.pt")
    with pytest.raises(UsageError, match=r"--threshold saved: w.pt is a single-label checkpoint"):
        chosen_thresholds("saved", {}, single, "w.pt")
    with pytest.raises(UsageError, match=r"--threshold 1.0: must be a probability in \(0, 1\)"):
        chosen_thresholds(1.0, saved, multi, "w.pt")


def test_map_f1_exact_match_and_thresholds_match_a_hand_checked_case():
    probs = np.array([[0.9, 0.2, 0.1], [0.8, 0.6, 0.1], [0.7, 0.4, 0.6], [0.1, 0.9, 0.1]], np.float32)
    targets = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0]])
    m = multilabel_metrics(probs, targets, 0.5)
    # Class 0 ranks +,-,+,-: AP = 1/2 x 1 + 1/2 x 2/3. Class 1 ranks -,+: AP = 1/2. Class 2 has no positive: no AP.
    assert [row[1] for row in m["per_class"]] == pytest.approx([5 / 6, 1 / 2, None])
    assert m["val/map"] == pytest.approx((5 / 6 + 1 / 2) / 2)
    # At 0.5: class 0 predicted for images 0-2 (2 right), class 1 for images 1 and 3 (1 right), class 2 for image 2.
    precision_recall_f1 = [value for row in m["per_class"][:2] for value in row[2:5]]  # approx takes flat lists
    assert precision_recall_f1 == pytest.approx([2 / 3, 1.0, 0.8, 0.5, 1.0, 2 / 3])
    assert m["per_class"][2][:5] == (0, None, 0.0, None, None)
    assert m["val/f1"] == pytest.approx((0.8 + 2 / 3) / 2) and m["val/precision"] == pytest.approx((2 / 3 + 0.5) / 2)
    assert m["val/exact_match"] == 0.25  # image 0 alone has all its labels right
    # Best F1 per class: 0.8 from 0.7 for class 0, 2/3 from 0.6 for class 1, each threshold halfway to the next lower
    # score (0.1 and 0.4), not on a score; class 2 keeps the given threshold.
    assert m["thresholds"] == pytest.approx([0.4, 0.5, 0.5])
    per_class = multilabel_metrics(probs, targets, m["thresholds"])
    assert per_class["val/f1"] == pytest.approx((0.8 + 2 / 3) / 2) and per_class["val/exact_match"] == 0.25


def test_thresholds_lie_between_scores_so_a_change_of_1e_6_flips_no_label():
    rng = np.random.default_rng(0)
    probs = (rng.permutation(999)[:800].reshape(200, 4) / 1000 + 1e-3).astype(np.float32)  # untied, 1e-3 apart
    targets = rng.random((200, 4)) < probs  # the likelier the more often labelled
    chosen = multilabel_metrics(probs, targets)["thresholds"]
    for seed in range(3):
        moved = probs + np.random.default_rng(seed).uniform(-1e-6, 1e-6, probs.shape).astype(np.float32)
        assert ((moved >= np.float32(chosen)) == (probs >= np.float32(chosen))).all()  # no label cell flips
        again = multilabel_metrics(moved, targets, chosen)
        assert again["val/f1"] == multilabel_metrics(probs, targets, chosen)["val/f1"]
        assert multilabel_metrics(moved, targets)["thresholds"] == pytest.approx(chosen, abs=1e-5)
    for c, threshold in enumerate(chosen):  # halfway between the lowest score labelled and the highest one not
        assert threshold == pytest.approx((probs[probs[:, c] >= threshold, c].min() +
                                           probs[probs[:, c] < threshold, c].max()) / 2)


# --- single- against multi-label ----------------------------------------------------------------------------------

def test_a_recipe_and_data_of_different_kinds_fail_before_any_work(tmp_path, capsys):
    runs = f"project={tmp_path / 'runs'}"
    root = write_multilabel(tmp_path / "data")
    error = fails(["--recipe", "cls.yaml", "data.multilabel=true", runs], capsys)
    assert ("data.multilabel=true, but data.name=digits has one label per image; multi-label data is a CSV list "
            "with a labels column") in error
    error = fails(["--recipe", "cls.yaml", f"data.name={root}", runs], capsys)
    assert (f"data.name={root} lists several labels per image (a labels column), but data.multilabel=false: set "
            f"data.multilabel=true (recipes/multilabel.yaml)") in error
    for cache in ("ram", "none"):  # checked before the RAM cache decodes anything
        error = fails(["--recipe", "multilabel.yaml", "data.multilabel=false", f"data.cache={cache}", runs], capsys)
        assert "data.name=multidigits lists several labels per image" in error
    folder = make_image_folder(tmp_path / "folders", {"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}})
    error = fails(["--recipe", "multilabel.yaml", f"data.name={folder}", runs], capsys)
    assert f"data.multilabel=true, but data.name={folder} has one label per image" in error
    for split in ("val", "train"):  # val images without any label: no AP, said before any work
        (root / f"{split}.csv").write_text("path,labels\n" + "".join(f"{split}/{i:02d}.png,\n" for i in range(3)))
    error = fails(["--recipe", "cls.yaml", f"data.name={root}", "data.multilabel=true", runs], capsys)
    assert f"{root}: none of the 3 val images has a label, so no class has an average precision (mAP)" in error
    error = fails(["--recipe", "cls.yaml", "train.best_metric=map", runs], capsys)
    assert "train.best_metric must be auto, top1 or balanced_top1 (map is for data.multilabel=true)" in error
    assert not (tmp_path / "runs").exists()


def test_recipe_checks_name_the_multilabel_key(tmp_path):
    for option, expected in (("data.cache=jpeg", "data.cache must be none or ram with data.multilabel=true"),
                             ("train.best_metric=top1", "train.best_metric must be auto or map with "
                                                        "data.multilabel=true, got 'top1'"),
                             ("data.sampler=balanced", "data.sampler must be shuffle with data.multilabel=true"),
                             ("train.threshold=1", "train.threshold must be a probability in (0, 1), got 1.0")):
        with pytest.raises(RecipeError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            load_recipe("multilabel.yaml", [option])


# --- the same run at N = 1, 2, 3 ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def n_runs(tmp_path_factory):
    """{launch: project}: tests/n_invariance.py's multi-label runs (RAM cache and per image; MixUp, positive
    weights, smoothing) at N=1 on two threads, on one and in three micro-batches, N=2 and N=3."""
    base = tmp_path_factory.mktemp("ml")
    data = write_multilabel(base / "data")
    return launch_n_invariance(base, data, "multilabel")


@pytest.mark.slow
@pytest.mark.parametrize("path", ("ram", "none"))
def test_two_and_three_processes_train_and_score_what_one_does_up_to_float_rounding(n_runs, path):
    reference, losses = run_weights(n_runs["1"] / path), step_losses(n_runs["1"] / path)
    tolerance, loss_tolerance = rounding_tolerances(n_runs, path)
    moved = (reference - run_weights(n_runs["1"] / ("none" if path == "ram" else "ram"))).abs().max().item()
    assert moved > 100 * tolerance  # the two paths' pixels differ: a split batch would show as much
    _, (row,) = read_results(n_runs["1"] / path)
    assert sorted(losses) == [1, 2, 3, 4]
    for n in ("2", "3"):
        gap = (run_weights(n_runs[n] / path) - reference).abs().max().item()
        assert gap <= tolerance, f"N={n}: weights {gap:.2e} from N=1's, rounding {tolerance:.2e}"
        _, (other,) = read_results(n_runs[n] / path)
        for key in ("val/map", "val/f1", "val/exact_match"):  # every val image once, whichever rank scored it
            assert float(other[key]) == pytest.approx(float(row[key]), abs=1e-6), (n, key)
        assert float(other["val/loss"]) == pytest.approx(float(row["val/loss"]), rel=1e-5)
        assert step_losses(n_runs[n] / path) == {s: pytest.approx(v, abs=loss_tolerance) for s, v in losses.items()}
        thresholds = load_checkpoint(n_runs[n] / path / "weights" / "last.pt")["thresholds"]
        assert thresholds == pytest.approx(load_checkpoint(n_runs["1"] / path / "weights" / "last.pt")["thresholds"],
                                           abs=1e-5)


# --- exact resume, val.py, predict.py, export.py ------------------------------------------------------------------

RESUMED = ["--recipe", "cls.yaml", *TINY, "data.multilabel=true", "train.epochs=2", "data.cutmix_alpha=1.0",
           "train.class_weights=balanced", "train.save_every_steps=2", "train.ema_decay=0.9", "train.ema_steps=1"]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """(data root, an uninterrupted two-epoch multi-label run, the same run stopped by Ctrl-C in epoch 1 and
    resumed)."""
    base = tmp_path_factory.mktemp("resume")
    data = write_multilabel(base / "data")
    result = run_python("train.py", *RESUMED, f"data.name={data}", f"project={base}", "name=straight")
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_python("tests/faults.py", "signal-at-step:1:SIGINT", "train.py", *RESUMED, f"data.name={data}",
                        f"project={base}", "name=stopped")
    assert result.returncode == 130 and load_checkpoint(base / "stopped" / "weights" / "last.pt")["step"] == 2
    result = run_python("train.py", "--resume", base / "stopped")
    assert result.returncode == 0 and "resuming at epoch 1, step 2" in result.stdout, result.stderr[-3000:]
    return data, base / "straight", base / "stopped"


@pytest.mark.slow
def test_a_stopped_multilabel_run_resumes_to_bit_identical_weights_metrics_and_thresholds(resumed):
    _, straight, stopped = resumed
    for name in ("last.pt", "best.pt"):
        ours, theirs = (load_checkpoint(run / "weights" / name) for run in (stopped, straight))
        for key in ("model", "ema"):
            assert all(torch.equal(ours[key][k], theirs[key][k]) for k in theirs[key])
        assert ours["thresholds"] == theirs["thresholds"] and len(ours["thresholds"]) == 3
        assert ours["best_score"] == theirs["best_score"] and ours["best_metric"] == "map"
    time = {"time/epoch", "time/img_s"}
    rows = [[{k: v for k, v in r.items() if k not in time} for r in read_results(run)[1]]
            for run in (stopped, straight)]
    assert rows[0] == rows[1] and len(rows[0]) == 2 and rows[0][0]["val/ema_map"] != ""


@pytest.mark.slow
def test_tensorboard_holds_results_csv_each_classs_ap_and_pr_curves_and_results_png_is_drawn(resumed):
    data, run, _ = resumed
    events = EventAccumulator(str(run), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    tags = events.Tags()
    _, rows = read_results(run)
    renamed = {"val/ema_loss": "val_ema/loss", "val/ema_map": "val_ema/map", "val/ema_f1": "val_ema/f1",
               "lr/pg0": "x/lr", "time/epoch": "x/epoch_time", "time/img_s": "x/img_s"}
    for column in list(rows[0])[1:]:  # every column but the epoch, at each epoch's end
        logged = events.Scalars(renamed.get(column, column))
        assert [e.step for e in logged] == [4, 8], column
        assert [e.value for e in logged] == pytest.approx([float(r[column]) for r in rows], rel=1e-5), column
    # The last epoch's AP of each class: scikit-learn's, from last.pt's probabilities of the val images.
    with open(data / "val.csv") as f:
        listed = list(csv.DictReader(f))
    probs = forward_logits(run / "weights" / "last.pt", [data / r["path"] for r in listed]).sigmoid().numpy()
    targets = np.array([[name in r["labels"].split("|") for name in CLASSES] for r in listed])
    ap = [events.Scalars(f"val_ap/{name}")[-1].value for name in CLASSES]
    assert ap == pytest.approx([average_precision_score(targets[:, c], probs[:, c]) for c in range(3)], abs=1e-5)
    assert np.mean(ap) == pytest.approx(float(rows[-1]["val/map"]), abs=1e-5)
    assert {f"val_pr/{name}" for name in CLASSES} <= set(tags["tensors"])
    curve = events.Tensors("val_pr/red sky")[-1].tensor_proto  # (6, thresholds): TP, FP, TN, FN, precision, recall
    assert curve.tensor_shape.dim[0].size == 6
    table = events.Tensors("val/per_class/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| class | AP | F1 | positives | best threshold |") and "| red sky |" in table
    assert (run / "results.png").stat().st_size > 10_000


def read_probabilities(path):
    """probabilities.csv: (header, rows as lists)."""
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    return header, rows


def check_against_sklearn(folder, probs, targets, thresholds):
    """folder's metrics.json and per_class.csv (val.py's) hold scikit-learn's figures for probs at thresholds."""
    predicted = probs >= np.array(thresholds)
    saved = json.loads((folder / "metrics.json").read_text())
    expected = {"map": average_precision_score(targets, probs, average="macro"),
                "exact_match": accuracy_score(targets, predicted)}
    for name, score in (("f1", f1_score), ("precision", precision_score), ("recall", recall_score)):
        expected[name] = score(targets, predicted, average="macro", zero_division=0)
    assert {k: saved[k] for k in expected} == pytest.approx(expected, abs=1e-6), folder.name
    with open(folder / "per_class.csv") as f:
        per_class = list(csv.DictReader(f))
    assert [r["class"] for r in per_class] == CLASSES
    assert [int(r["support"]) for r in per_class] == targets.sum(0).tolist()
    for key, score in (("ap", average_precision_score), ("f1", f1_score), ("precision", precision_score),
                       ("recall", recall_score)):
        kwargs = {} if key == "ap" else {"zero_division": np.nan}  # a precision of no predictions: blank
        inputs = probs if key == "ap" else predicted
        expected = [score(targets[:, c], inputs[:, c], **kwargs) for c in range(len(CLASSES))]
        if key == "f1":  # F1 is 0 where precision is undefined and recall 0
            expected = np.nan_to_num(expected).tolist()
        written = [float(r[key]) if r[key] else np.nan for r in per_class]
        assert written == pytest.approx(expected, abs=1e-5, nan_ok=True), (folder.name, key)


@pytest.mark.slow
def test_val_py_reproduces_training_at_train_threshold_and_counts_each_image_once_at_two_processes(resumed, tmp_path,
                                                                                                    log, capsys):
    data, run, _ = resumed
    weights = run / "weights" / "last.pt"
    ckpt = load_checkpoint(weights)
    _, rows = read_results(run)
    default = val.main(["--weights", str(weights), "--project", str(tmp_path), "--name", "a", "--save-probs"])
    for key in ("val/map", "val/f1", "val/precision", "val/recall", "val/exact_match"):  # at train.threshold=0.5
        assert f"{default[key]:.6g}" == rows[-1][key], key
    details = {"weights": str(weights), "epoch": 2, "step": 0, "data": str(data), "processes": 1, "batch_size": 12,
               "precision": ckpt["recipe"]["train"]["precision"], "tta": False}  # auto's, as training validated
    check_metrics_json(tmp_path / "a", log.text, {**details, "thresholds": "train.threshold=0.5 for every class"})
    assert "multi-label: F1, precision, recall and exact match at thresholds train.threshold=0.5 for every class" in \
        log.text
    header, table = read_probabilities(tmp_path / "a" / "probabilities.csv")
    with open(data / "val.csv") as f:
        listed = list(csv.DictReader(f))
    assert header == ["file", "labels", *CLASSES] and len(table) == 9
    assert [(r[0], r[1]) for r in table] == [(str(data / r["path"]), r["labels"]) for r in listed]  # val.csv's order
    expected = forward_logits(weights, [r[0] for r in table]).sigmoid()
    assert torch.allclose(torch.tensor([[float(p) for p in r[2:]] for r in table]), expected, atol=1e-6)
    log.clear()
    val.main(["--weights", str(weights), "--threshold", "saved", "--project", str(tmp_path), "--name", "b"])
    saved_from = ("per class, as saved by train.py (each maximised its class's F1 on val): chosen on these same "
                  "images, so the figures at them are optimistic")
    assert f"at thresholds {saved_from}" in log.text
    check_metrics_json(tmp_path / "b", log.text, {**details, "thresholds": saved_from})
    # The figures val.py saved, recomputed by scikit-learn from the probabilities it saved: at 0.5, and at the
    # saved thresholds, each of which gives its class the highest F1 of any threshold.
    probs = np.array([r[2:] for r in table], float)
    targets = np.array([[name in r[1].split("|") for name in CLASSES] for r in table])
    check_against_sklearn(tmp_path / "a", probs, targets, [0.5] * 3)
    check_against_sklearn(tmp_path / "b", probs, targets, ckpt["thresholds"])
    for c, threshold in enumerate(ckpt["thresholds"]):
        precision, recall, _ = precision_recall_curve(targets[:, c], probs[:, c])
        highest = np.max(2 * precision * recall / np.maximum(precision + recall, 1e-12))
        assert f1_score(targets[:, c], probs[:, c] >= threshold) == pytest.approx(highest), CLASSES[c]
        for nudge in (-1e-6, 1e-6):  # a threshold between scores: no label flips for a change in the 6th decimal
            assert np.array_equal(probs[:, c] + nudge >= threshold, probs[:, c] >= threshold), CLASSES[c]
    best = run / "weights" / "best.pt"
    measured = val.main(["--weights", str(best), "--project", str(tmp_path), "--name", "best"])
    assert [r[5] for r in measured["per_class"]] == pytest.approx(load_checkpoint(best)["thresholds"])
    result = run_torchrun("val.py", "--weights", weights, "--project", tmp_path, "--name", "two", "--save-probs",
                          nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    two = check_metrics_json(tmp_path / "two", result.stdout, {**details, "processes": 2,
                                                               "thresholds": "train.threshold=0.5 for every class"})
    for key in ("map", "f1", "exact_match"):
        assert two[key] == pytest.approx(default[f"val/{key}"], abs=1e-6)
    _, shared = read_probabilities(tmp_path / "two" / "probabilities.csv")  # each rank's rows back in the files' order
    assert [r[:2] for r in shared] == [r[:2] for r in table]
    assert np.allclose(np.array([r[2:] for r in shared], float), np.array([r[2:] for r in table], float), atol=1e-6)
    single = make_image_folder(tmp_path / "single", {"val": {"blue": 1}})
    assert fails(["--weights", weights, "--data", single], capsys, val).strip().endswith(
        f"--data {single} lists one label per image (a label column), but {weights} was trained on several labels per "
        f"image (a labels column); evaluate it on data of that kind")


@pytest.mark.slow
def test_predict_lists_every_label_from_its_threshold_and_export_outputs_probabilities(resumed, tmp_path):
    data, run, _ = resumed
    weights = run / "weights" / "best.pt"
    ckpt = load_checkpoint(weights)
    rows, _ = predict.main(["--weights", str(weights), "--source", str(data / "val"), "--project", str(tmp_path),
                            "--save-images", "--workers", "0", "--save-probs", "--batch-size", "4"])
    cfg = checkpoint_recipe(ckpt["recipe"], weights)
    model = model_from_checkpoint(ckpt, cfg, weights)
    with open(tmp_path / "exp" / "predictions.csv") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == ["file", "labels", "probs", "drawn"] and len(table) == 9
    for row, saved in zip(rows, table):
        probs = forward_logits(weights, [row["file"]]).sigmoid()[0].tolist()  # in the run's precision and layout
        expected = sorted((c for c in range(3) if probs[c] >= ckpt["thresholds"][c]), key=lambda c: -probs[c])
        assert [t["class"] for t in row["labels"]] == [CLASSES[c] for c in expected]
        assert saved["labels"] == "|".join(CLASSES[c] for c in expected)
        assert [float(p) for p in saved["probs"].split("|") if p] == pytest.approx([probs[c] for c in expected],
                                                                                     rel=1e-4)
    header, table = read_probabilities(tmp_path / "exp" / "probabilities.csv")  # every class's, in the rows' order
    assert header == ["file", *CLASSES] and [r[0] for r in table] == [r["file"] for r in rows]
    expected = forward_logits(weights, [r["file"] for r in rows]).sigmoid()
    assert torch.allclose(torch.tensor([[float(p) for p in r[1:]] for r in table]), expected, atol=1e-6)
    low, _ = predict.main(["--weights", str(weights), "--source", str(data / "val"), "--project", str(tmp_path),
                           "--threshold", "0.000001", "--workers", "0"])
    assert all(len(r["labels"]) == 3 for r in low)
    results = export.main(["--weights", str(weights), "--format", "torchscript", "onnx"])  # each checked in export
    import onnx
    proto = onnx.load(str(results["onnx"][0]))
    assert [o.name for o in proto.graph.output] == ["probs"]
    assert json.loads({p.key: p.value for p in proto.metadata_props}["thresholds"]) == ckpt["thresholds"]
    path, _ = results["torchscript"]
    files = {"metadata.json": ""}
    exported = torch.jit.load(str(path), _extra_files=files)
    metadata = json.loads(files["metadata.json"])
    assert metadata["thresholds"] == ckpt["thresholds"] and "probabilities" in metadata["output"]
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        assert torch.allclose(exported(x), model(x).sigmoid(), atol=1e-6)


def test_best_pt_holds_the_thresholds_of_the_weights_it_holds(tmp_path):
    from types import SimpleNamespace

    from utils.checkpoint import save_state

    model = torch.nn.Linear(2, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = SimpleNamespace(model=model, optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", enabled=False),
                            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), epoch=1, step=0,
                            epoch_loss=(0.0, 0), logged_loss=(0.0, 0), best_score=0.5, best_epoch=1, best_metric="map",
                            ema=torch.optim.swa_utils.AveragedModel(model), thresholds=[0.1, 0.2, 0.3],
                            ema_thresholds=[0.4, 0.5, 0.6])
    paths = [tmp_path / "best.pt", tmp_path / "last.pt"]
    save_state(state, {}, CLASSES, 10, paths, best_from_ema=True)
    best, last = (load_checkpoint(path) for path in paths)
    assert (best["model_source"], best["thresholds"]) == ("ema", [0.4, 0.5, 0.6])
    assert (last["model_source"], last["thresholds"]) == ("training", [0.1, 0.2, 0.3])


# --- the embedded set ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_torchrun_trains_multidigits_to_a_high_map_that_val_py_reproduces(tmp_path):
    result = run_torchrun("train.py", "--recipe", "multilabel.yaml", "train.epochs=3", f"project={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = read_results(tmp_path / "exp")
    assert float(rows[-1]["val/map"]) > 0.98  # about 0.997 after 3 epochs, and 0.999 after the recipe's 8
    val.main(["--weights", str(tmp_path / "exp" / "weights" / "best.pt"), "--project", str(tmp_path / "v")])
    saved = json.loads((tmp_path / "v" / "exp" / "metrics.json").read_text())
    assert f"{saved['map']:.6g}" == rows[-1]["val/map"] and saved["images"] == 1000
