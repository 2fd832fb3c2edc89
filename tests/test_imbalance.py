"""Imbalanced classes: the balanced sampler (each class equally often, the same global order at any N and after a
resume), class-weighted loss, balanced top-1 (exact across ranks) and best.pt chosen by train.best_metric."""

import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchvision.datasets import ImageFolder

import train
import val
from conftest import Lookup, make_image_folder, read_results, run_python, run_torchrun
from data.batches import batch_to
from data.cache import RamImages
from data.datasets import balanced_class_weights, build_dataloader, set_epoch
from data.sampler import BalancedSampler
from data.transforms import crop_spec, train_transforms
from utils.checkpoint import load_checkpoint
from utils.config import DataConfig
from utils.metrics import evaluate

NINETY_TEN = [0] * 90 + [1] * 10  # targets: class 0 has 90 samples, class 1 has 10


def shares(targets, world, epoch=0, seed=0, start_step=0, **kw):
    """Each rank's share of a balanced epoch, as lists of ids."""
    samplers = [BalancedSampler(targets, rank=rank, world_size=world, seed=seed, **kw) for rank in range(world)]
    for sampler in samplers:
        sampler.set_epoch(epoch, start_step)
    return [list(sampler) for sampler in samplers]


def global_steps(targets, world, batch_size, epoch=0, **kw):
    """The ids of each optimizer step, united over ranks (per-rank batch batch_size / world)."""
    b = batch_size // world
    parts = shares(targets, world, epoch, batch_size=batch_size, **kw)
    steps = max(-(-len(p) // b) for p in parts)
    return [sorted(i for p in parts for i in p[s * b:(s + 1) * b]) for s in range(steps)]


def test_balanced_sampler_draws_each_class_about_equally_often_in_epochs_of_the_dataset_size():
    (epoch,) = shares(NINETY_TEN, 1)
    assert len(epoch) == 100
    assert Counter(i % 100 >= 90 for i in epoch) == {False: 55, True: 45}  # seed 0, epoch 0: 55 of class 0
    minority = sum(i % 100 >= 90 for e in range(50) for i in shares(NINETY_TEN, 1, epoch=e)[0])
    assert 0.47 < minority / 5000 < 0.53  # shuffled, class 1 would be 10% of the draws
    assert shares(NINETY_TEN, 1, epoch=1) != shares(NINETY_TEN, 1, epoch=0)
    assert shares(NINETY_TEN, 1, seed=1) != shares(NINETY_TEN, 1, seed=0)
    assert shares(NINETY_TEN, 1, epoch=3) == shares(NINETY_TEN, 1, epoch=3)


def test_a_sample_drawn_k_times_comes_as_k_copies_with_their_own_ids():
    (epoch,) = shares(NINETY_TEN, 1)
    assert len(set(epoch)) == 100  # no id twice, so no two draws augmented alike
    for sample in range(100):
        copies = [i for i in epoch if i % 100 == sample]
        assert copies == [sample + 100 * k for k in range(len(copies))]  # numbered in the order they come
    assert max(Counter(i % 100 for i in epoch).values()) > 3  # class 1's 10 samples, ~45 draws


@pytest.mark.parametrize("options", [{}, dict(group=2), dict(drop_last=True), dict(repeats=3)])
def test_balanced_sampler_deals_the_same_global_steps_at_any_world_size(options):
    targets = [0] * 31 + [1] * 4 + [2] * 2  # 37 samples in global batches of 12: a last, partial step
    reference = global_steps(targets, 1, 12, epoch=2, **options)
    assert sum(map(len, reference)) == (36 if options.get("drop_last") else 37)
    for world in (2, 3):
        assert global_steps(targets, world, 12, epoch=2, **options) == reference, world


def test_a_resumed_epoch_continues_the_same_balanced_order():
    for rank in range(2):
        full = shares(NINETY_TEN, 2, epoch=4, batch_size=8)[rank]
        resumed = shares(NINETY_TEN, 2, epoch=4, batch_size=8, start_step=5)[rank]
        assert resumed == full[5 * 4:]


def test_copies_of_a_sample_are_augmented_afresh_on_both_data_paths(image_folder):
    root = image_folder({"train": {"a": 7, "b": 1}}, size=16)
    cfg = DataConfig(img_size=8, scale=[0.1, 1.0], hflip=0.5)
    folder = ImageFolder(str(root / "train"), train_transforms(cfg))
    paths = {"none": folder, "ram": RamImages(ImageFolder(str(root / "train")), None, crop_spec(cfg), seed=0)}
    for name, dataset in paths.items():
        loader = build_dataloader(dataset, 8, True, 0, 0, torch.device("cpu"), balanced=True)
        set_epoch(loader, 0)
        ids = list(loader.sampler)
        images = torch.cat([batch_to(batch, torch.device("cpu"), crop_spec(cfg))[0] if name == "ram" else batch[0]
                            for batch in loader])
        copies = [k for k, i in enumerate(ids) if i % 8 == 7]  # class b's one image: about half the draws
        assert len(copies) >= 2, ids
        assert not torch.equal(images[copies[0]], images[copies[1]]), name


def test_balanced_class_weights_are_n_over_classes_times_count():
    dataset = TensorDataset(torch.zeros(100))
    dataset.targets, dataset.classes = [0] * 90 + [2] * 10, ["a", "b", "c"]
    assert balanced_class_weights(dataset).tolist() == [torch.tensor(100 / (2 * 90)).item(), 0.0, 5.0]


def test_balanced_top1_is_the_mean_recall_of_the_classes_in_val():
    # Class a: 9 images, all right; class b: 1 image, predicted a; class c: no images (not counted).
    targets = torch.tensor([0] * 9 + [1])
    images = torch.zeros(10, 3, 1, 1, dtype=torch.uint8)  # every image gets logits row 0: class a
    loader = DataLoader(TensorDataset(images, targets), batch_size=4)
    metrics = evaluate(Lookup(torch.tensor([[3.0, 2.0, 1.0]])), loader, lambda x: x.float(), 3, torch.device("cpu"))
    assert metrics["val/top1"] == 0.9 and metrics["val/balanced_top1"] == 0.5


# fp32: the runs at 1 and 2 processes are compared to fp32's rounding
RECIPE = ["--recipe", "cls.yaml", "train.epochs=2", "train.batch_size=6", "model.width=4", "model.depth=2",
          "model.norm=group", "model.dropout=0", "data.scale=[0.3,1.0]", "data.hflip=0.5", "data.workers=0",
          "train.precision=fp32", "log.plots=false"]
BALANCED = ["data.sampler=balanced", "train.class_weights=balanced", "train.best_metric=balanced_top1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run directory}: the balanced recipe at one process (in this one, recording the loss's class weights)
    and at two under torchrun; the plain recipe at one. 25 training images, 19 and 6: 5 steps of 6, the last of
    one image, which only rank 0 takes at two processes."""
    base = tmp_path_factory.mktemp("imbalance")
    data = make_image_folder(base / "data", {"train": {"a": 19, "b": 6}, "val": {"a": 6, "b": 2}}, size=8)
    common = [*RECIPE, f"data.name={data}", f"project={base}"]
    result = run_torchrun("train.py", *common, *BALANCED, "name=n2", nproc=2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    weights, train_one_epoch = [], train.train_one_epoch

    def recording(loop, *args, **kw):
        weights.append(loop.criterion.weight)
        return train_one_epoch(loop, *args, **kw)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train, "train_one_epoch", recording)
        train.main([*common, *BALANCED, "name=n1"])
        train.main([*common, "name=plain"])
    return {"n1": base / "n1", "n2": base / "n2", "plain": base / "plain", "weights": weights}


def model(run_dir):
    return load_checkpoint(run_dir / "weights" / "last.pt")["model"]


@pytest.mark.slow
def test_the_loss_weighs_each_class_by_n_over_classes_times_count(runs):
    expected = torch.tensor([25 / (2 * 19), 25 / (2 * 6)])
    assert all(torch.equal(w, expected) for w in runs["weights"][:2]) and runs["weights"][2] is None


@pytest.mark.slow
def test_balanced_training_at_two_processes_is_what_one_trains_up_to_float_rounding(runs):
    one, two, plain = model(runs["n1"]), model(runs["n2"]), model(runs["plain"])
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6)
    assert max((one[k] - plain[k]).abs().max().item() for k in one) > 1e-3  # the balanced options change the run


@pytest.mark.slow
def test_balanced_top1_is_in_results_csv_exact_across_ranks_and_picks_best_pt(runs, tmp_path):
    header, rows = read_results(runs["n2"])
    assert "val/balanced_top1" in header and "val/ema_balanced_top1" not in header  # no EMA in this recipe
    best = load_checkpoint(runs["n2"] / "weights" / "best.pt")
    scores = [float(r["val/balanced_top1"]) for r in rows]
    assert best["epoch"] == scores.index(max(scores)) + 1
    assert f"{best['best_score']:.6g}" == rows[best["epoch"] - 1]["val/balanced_top1"]
    assert best["best_metric"] == "balanced_top1"
    # One process re-counting best.pt's val set finds the score the two ranks counted together, to the last bit.
    metrics = val.main(["--weights", str(runs["n2"] / "weights" / "best.pt"), "--project", str(tmp_path)])
    assert metrics["val/balanced_top1"] == best["best_score"] and metrics["val/balanced_top1"] != metrics["val/top1"]
    summary = json.loads((tmp_path / "exp" / "metrics.json").read_text())
    assert summary["balanced_top1"] == best["best_score"]


# Per epoch: (top1, balanced_top1, ema_top1, ema_balanced_top1), given to end_epoch in place of the measured ones.
SCRIPT = [(0.90, 0.50, 0.80, 0.40), (0.80, 0.60, 0.70, 0.75), (0.95, 0.55, 0.90, 0.50), (0.85, 0.70, 0.60, 0.65),
          (0.50, 0.50, 0.50, 0.50), (0.50, 0.50, 0.50, 0.50)]


@pytest.mark.parametrize("metric, words, score, best_epoch, source, stopped_after", [
    ("balanced_top1", "val balanced top-1", 0.75, 2, "ema", 4), ("top1", "val top-1", 0.95, 3, "training", 5)])
def test_best_pt_and_patience_follow_train_best_metric(image_folder, tmp_path, monkeypatch, log, metric, words,
                                                       score, best_epoch, source, stopped_after):
    validate = train.validate

    def scripted(loop, state):  # state.epoch: the epoch being validated
        names = ("val/top1", "val/balanced_top1", "val/ema_top1", "val/ema_balanced_top1")
        return {**validate(loop, state), **dict(zip(names, SCRIPT[state.epoch]))}
    monkeypatch.setattr(train, "validate", scripted)
    root = image_folder({"train": {"a": 6, "b": 2}, "val": {"a": 2, "b": 1}}, size=8)
    best = train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=6", "train.batch_size=4",
                       "model.width=4", "train.ema_decay=0.9", "train.ema_steps=1", "train.patience=2",
                       f"train.best_metric={metric}", f"project={tmp_path}"])
    _, rows = read_results(tmp_path / "exp")
    assert len(rows) == stopped_after and best == score
    assert [float(r["val/ema_balanced_top1"]) for r in rows] == [row[3] for row in SCRIPT[:stopped_after]]
    ckpt = load_checkpoint(tmp_path / "exp" / "weights" / "best.pt")
    assert (ckpt["epoch"], ckpt["model_source"], ckpt["best_score"]) == (best_epoch, source, score)
    assert (f"Stopping early after epoch {stopped_after}: no better {words} in 2 epochs since the best, "
            f"{score:.2%} at epoch {best_epoch} (train.patience=2)") in log.text
    assert f"Best {words} {score:.2%} at epoch {best_epoch}: " in log.text
    assert "top1 90.00% balanced 50.00%" in log.text  # epoch 1's line


@pytest.mark.slow
def test_a_balanced_run_stopped_mid_epoch_and_resumed_ends_bit_identical(image_folder, tmp_path):
    root = image_folder({"train": {"a": 9, "b": 3}, "val": {"a": 2, "b": 1}}, size=8)
    recipe = [*RECIPE, *BALANCED, f"data.name={root}", "train.batch_size=4", "model.dropout=0.2", f"project={tmp_path}"]
    train.main([*recipe, "name=whole"])
    # Ctrl-C during step 1 of 3: the run stops after step 2 and saves where it is.
    result = run_python("tests/faults.py", "signal-at-step:1:SIGINT", "train.py", *recipe, "name=resumed")
    assert result.returncode == 130 and "Stopped at epoch 1, step 2/3" in result.stdout, result.stderr[-3000:]
    train.main(["--resume", str(tmp_path / "resumed")])
    whole, resumed = (model(tmp_path / name) for name in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    columns = ("train/loss", "val/balanced_top1")
    assert [[r[c] for c in columns] for r in read_results(tmp_path / "whole")[1]] == \
        [[r[c] for c in columns] for r in read_results(tmp_path / "resumed")[1]]
