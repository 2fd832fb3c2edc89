"""train.py end to end: real runs on digits and tiny folders, their outputs, and failures before any work."""

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

import export
import train
import val
from conftest import ROOT, console_lines, fails, make_image_folder, read_results, run_python, run_torchrun
from data.datasets import build_dataloader
from data.sources import build_datasets, dataset_root
from data.transforms import normalizer, val_transforms
from data.verify import decode
from models import build_model, check_batch_for_batchnorm, model_from_checkpoint, settle
from utils.checkpoint import load_checkpoint
from utils.config import CHANGES_RESULTS_WHEN, ModelConfig, Recipe, checkpoint_recipe, flat_keys, load_recipe
from utils.loggers import COLUMNS, TENSORBOARD_TAGS, RunLogger
from utils.general import SharedError
from utils.metrics import evaluate
from utils.precision import autocast_dtype, native_precision
from utils.torch_utils import batchnorm_layers, one_image_batchnorm


def evaluate_checkpoint(path):
    """Single-process top-1 of a checkpoint on the validation set named by its own recipe, in the precision and
    memory format it was trained in."""
    ckpt, cpu = load_checkpoint(path), torch.device("cpu")
    cfg = checkpoint_recipe(ckpt["recipe"], path)
    model = model_from_checkpoint(ckpt, cfg, path, cpu)
    _, val_set = build_datasets(dataset_root(cfg.data.name), None, val_transforms(cfg.data))
    loader = build_dataloader(val_set, 64, False, 0, 0, cpu)
    return evaluate(model, loader, normalizer(cfg.data, cpu), len(ckpt["classes"]), cpu,
                    autocast_dtype(cfg.train.precision, cpu))


def two_tone_folder(root, train, val, size=8):
    """An ImageFolder any model learns in a few steps: class 'dark' has pixels in [0, 96), 'bright' in [160, 256)."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for name, low in (("dark", 0), ("bright", 160)):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(low, low + 96, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i:03d}.png")
    return root


@pytest.mark.slow
def test_torchrun_two_processes_reach_99_percent_on_digits(digits_run):
    project, result = digits_run
    header, rows = read_results(project / "exp")
    epochs = load_recipe("cls.yaml").train.epochs
    assert header == [c for c in COLUMNS if not c.startswith("val/ema_")]  # no EMA in cls.yaml: no EMA columns
    assert [int(r["epoch"]) for r in rows] == list(range(1, epochs + 1))
    assert float(rows[-1]["val/top1"]) >= 0.988  # at most 4 of 360 wrong: the lowest last epoch of digits_sweep, 98.89%
    assert all(float(r["time/img_s"]) > 0 and float(r["time/epoch"]) > 0 for r in rows)
    best = project / "exp" / "weights" / "best.pt"
    assert "Results saved to" in result.stdout and f"tensorboard --logdir {project}" in result.stdout
    assert f"python val.py --weights {best}" in result.stdout
    assert f"python predict.py --weights {best} --source datasets/digits/val" in result.stdout
    top1 = max(float(r["val/top1"]) for r in rows)
    epoch = next(r["epoch"] for r in rows if float(r["val/top1"]) == top1)
    assert f"Best val top-1 {top1:.2%} at epoch {epoch}: {best}" in result.stdout


@pytest.mark.slow
def test_only_rank_0_writes_one_run_dir(digits_run):
    project, result = digits_run
    assert [p.name for p in project.iterdir()] == ["exp"]
    assert len(list((project / "exp").glob("events.out.tfevents.*"))) == 1
    assert result.stdout.count("Results saved to") == 1


@pytest.mark.slow
def test_run_saves_resolved_recipe_with_auto_settled_for_this_cpu(digits_run):
    project, result = digits_run
    saved = load_recipe(str(project / "exp" / "recipe.yaml"))
    assert saved == settle(load_recipe("cls.yaml", [f"project={project}"]))
    precision = native_precision(torch.device("cpu"))
    assert saved.train.precision == precision and saved.train.channels_last is True  # the convnet
    assert (f"train: auto: precision {precision} (the fastest this cpu trains in), channels_last true (a "
            f"convolutional model)") in result.stdout
    assert f"in {'bfloat16' if precision == 'bf16' else 'float32'}, channels_last; batch 48" in result.stdout
    assert load_checkpoint(project / "exp" / "weights" / "last.pt")["recipe"] == OmegaConf.to_container(saved)


@pytest.mark.slow
def test_checkpoints_load_weights_only_and_hold_the_evaluated_model(digits_run):
    project, _ = digits_run
    _, rows = read_results(project / "exp")
    best_top1 = max(float(r["val/top1"]) for r in rows)
    last = load_checkpoint(project / "exp" / "weights" / "last.pt")
    best = load_checkpoint(project / "exp" / "weights" / "best.pt")
    assert last["epoch"] == len(rows) and last["classes"] == [str(d) for d in range(10)]
    assert {"model", "optimizer", "scheduler", "scaler", "recipe"} <= set(last)
    assert abs(best["best_score"] - best_top1) < 1e-6 and best["best_metric"] == "top1" and "best_top1" not in best
    # Re-evaluating best.pt alone counts exactly what the two ranks counted together during training.
    assert evaluate_checkpoint(project / "exp" / "weights" / "best.pt")["val/top1"] == best["best_score"]
    assert not list((project / "exp" / "weights").glob(".*.tmp-*"))
    # val.py and predict.py evaluate it in the layout it trained in (channels_last: auto's, for the convnet); a
    # checkpoint from before train.channels_last existed trained contiguous
    cfg, cpu = checkpoint_recipe(best["recipe"], "best.pt"), torch.device("cpu")
    first_conv = model_from_checkpoint(best, cfg, "best.pt", cpu).features[0][0].weight
    assert first_conv.is_contiguous(memory_format=torch.channels_last) and not first_conv.is_contiguous()
    del best["recipe"]["train"]["channels_last"]
    older = model_from_checkpoint(best, checkpoint_recipe(best["recipe"], "best.pt"), "best.pt", cpu)
    assert older.features[0][0].weight.is_contiguous()


@pytest.mark.slow
def test_tensorboard_groups_scalars_and_holds_images_and_the_recipe_as_hparams(digits_run):
    project, _ = digits_run
    run_dir = project / "exp"
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0}).Reload()
    _, rows = read_results(run_dir)
    steps = 30  # 1,437 images in global batches of 48
    assert [e.step for e in events.Scalars("val/top1")] == [steps * (i + 1) for i in range(len(rows))]
    assert [round(e.value, 6) for e in events.Scalars("val/top1")] == [float(r["val/top1"]) for r in rows]
    assert set(events.Tags()["scalars"]) == {*(TENSORBOARD_TAGS.get(c, c) for c in COLUMNS[1:] if "/ema_" not in c),
                                             "train/loss_step"}
    assert [e.value for e in events.Scalars("x/lr")] == pytest.approx([float(r["lr/pg0"]) for r in rows], rel=1e-5)
    # The loss every 10 steps of each epoch, at the global step.
    assert [e.step for e in events.Scalars("train/loss_step")] == [e * steps + s for e in range(len(rows))
                                                                  for s in (10, 20, 30)]
    assert set(events.Tags()["images"]) == {"train/batch", "val/misclassified", "val/confusion_matrix"}
    batch = events.Images("train/batch")
    assert len(batch) == 1 and (batch[0].width, batch[0].height) == (8 * 66, 3 * 78)  # rank 0's 24 images in 64 px tiles
    wrong = events.Images("val/misclassified")  # each epoch that misclassified an image of rank 0's share
    assert [e.step for e in wrong] == sorted({e.step for e in wrong}) and wrong[0].step == steps
    assert events.Images("val/confusion_matrix")[-1].step == steps * len(rows)  # drawn at least for the last epoch
    hparams = logged_hparams(events)
    recipe = load_recipe("cls.yaml")
    assert hparams["optim.lr"].number_value == recipe.optim.lr and hparams["model.name"].string_value == "convnet"
    assert hparams["data.scale"].string_value == str(list(recipe.data.scale))
    assert "model.sync_bn" in hparams and "ddp.comm_hook" in hparams  # two processes
    recipe_text = events.Tensors("recipe/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"batch_size: {recipe.train.batch_size}" in recipe_text and f"project: {project}" in recipe_text


@pytest.mark.slow
def test_results_png_is_drawn(digits_run):
    project, _ = digits_run
    with Image.open(project / "exp" / "results.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size == (1300, 360)


def logged_events(run_dir, overrides=()):
    """The TensorBoard events of a RunLogger for cls.yaml with overrides, through one epoch with EMA metrics (no
    training)."""
    logger = RunLogger(run_dir, load_recipe("cls.yaml", list(overrides)), ["a", "b"])
    logger.log_step(5, 1.0)
    logger.log_epoch({**dict.fromkeys(COLUMNS, 0.5), "epoch": 1, "confusion": None, "wrong": []}, 10)
    logger.close()
    return EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()


def logged_hparams(events):
    """The recipe keys and values a run logged for TensorBoard's HParams tab."""
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    return HParamsPluginData.FromString(content).session_start_info.hparams


def test_hparams_hold_augmix_severity_only_with_augmix_on(tmp_path):
    off = logged_hparams(logged_events(tmp_path / "off"))
    on = logged_hparams(logged_events(tmp_path / "on", ["data.auto_augment=augmix", "data.cache=none",
                                                        "data.augmix_severity=5"]))
    assert off["data.auto_augment"].string_value == "" and "data.augmix_severity" not in off
    assert on["data.auto_augment"].string_value == "augmix" and on["data.augmix_severity"].number_value == 5


def test_hparams_hold_what_changes_results_not_where_the_run_goes(tmp_path):
    hparams = logged_hparams(logged_events(tmp_path))
    assert {"model.name", "model.width", "data.scale", "optim.lr", "sched.warmup_factor", "seed"} <= set(hparams)
    # Inert in this run: a pretrained model's, an EMA's, another schedule's, several processes' keys.
    assert not {"model.backbone_lr", "train.ema_steps", "sched.gamma", "ddp.comm_hook"} & set(hparams)
    assert not {"project", "name", "device", "data.workers", "train.log_every_steps"} & set(hparams)
    assert set(CHANGES_RESULTS_WHEN) <= set(flat_keys(OmegaConf.to_container(OmegaConf.structured(Recipe))))


def test_hparams_metrics_are_the_scalars_with_the_val_results_among_the_five_shown(tmp_path):
    events = logged_events(tmp_path)
    # No experiment summary: TensorBoard builds the table from every run's keys, and its metrics from the scalar
    # tags, sorted, showing the first five.
    assert set(events.PluginTagToContent("hparams")) == {"_hparams_/session_start_info"}
    shown = sorted(events.Tags()["scalars"])[:5]
    assert shown == ["train/loss", "train/loss_step", "val/balanced_top1", "val/loss", "val/top1"]


def test_scalar_groups_sort_train_and_val_first_and_results_csv_keeps_its_columns(tmp_path):
    events = logged_events(tmp_path, ["train.ema_decay=0.99"])
    groups = sorted({tag.split("/")[0] for tag in events.Tags()["scalars"]})
    assert groups == ["train", "val", "val_ema", "x"]  # TensorBoard opens the first two groups
    assert {"val_ema/top1", "x/lr", "x/epoch_time", "x/img_s"} <= set(events.Tags()["scalars"])
    assert read_results(tmp_path)[0] == COLUMNS


def test_results_csv_has_ema_columns_only_with_ema_and_a_resume_keeps_its_rows_and_plot(tmp_path):
    cfg = load_recipe("cls.yaml")  # no EMA
    values = {**dict.fromkeys(COLUMNS, 0.5), "confusion": None, "wrong": []}
    logger = RunLogger(tmp_path, cfg, ["a", "b"])
    for epoch in (1, 2):
        logger.log_epoch({**values, "epoch": epoch, "val/ema_loss": None, "val/ema_top1": None}, 10 * epoch)
    logger.close()
    plain = [c for c in COLUMNS if not c.startswith("val/ema_")]
    header, rows = read_results(tmp_path)
    assert header == plain and [r["epoch"] for r in rows] == ["1", "2"] and "" not in rows[1].values()
    logger = RunLogger(tmp_path, cfg, ["a", "b"], done=(1, 10))  # resumed after epoch 1: epoch 2 is done again
    logger.log_epoch({**values, "epoch": 2, "val/top1": 0.25}, 20)
    logger.close()
    header, rows = read_results(tmp_path)
    assert header == plain and [(r["epoch"], r["val/top1"]) for r in rows] == [("1", "0.5"), ("2", "0.25")]
    assert (tmp_path / "results.png").stat().st_size > 10_000
    # A results.csv written before: blank val/ema_* columns, which a resume drops, and a row cut short by a kill.
    older = ",".join(COLUMNS) + "\n" + ",".join("" if "/ema_" in c else "1" if c == "epoch" else "0.5"
                                                  for c in COLUMNS) + "\n2,0.4\n"
    (tmp_path / "results.csv").write_text(older)
    RunLogger(tmp_path, cfg, ["a", "b"], done=(2, 20)).close()
    header, rows = read_results(tmp_path)
    assert header == plain and rows == [{c: "1" if c == "epoch" else "0.5" for c in plain}]


@pytest.mark.slow
def test_single_process_on_user_folder_with_few_classes_from_10_class_weights(image_folder, tmp_path, log):
    root = image_folder({"train": {"ant": 6, "bee": 5, "cat": 5}, "test": {"ant": 2, "bee": 3, "cat": 2}})
    torch.save(build_model(OmegaConf.structured(ModelConfig(name="convnet", width=4)), 10).state_dict(),
               tmp_path / "digits.pt")
    train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=2", "train.batch_size=4",
                "model.width=4", f"project={tmp_path / 'runs'}", "name=tiny", f"model.weights={tmp_path / 'digits.pt'}"])
    assert (f"weights from {tmp_path / 'digits.pt'}; head.3.weight, head.3.bias initialised afresh for 3 classes"
            in log.text)
    header, rows = read_results(tmp_path / "runs" / "tiny")
    assert len(rows) == 2 and all(r["val/top5"] == "" for r in rows)  # top-5 needs 5 classes
    assert "1 process(es)" in log.text and "16 train / 7 val images, 3 classes" in log.text
    assert load_checkpoint(tmp_path / "runs" / "tiny" / "weights" / "last.pt")["classes"] == ["ant", "bee", "cat"]


def test_unknown_key_exits_before_any_work(tmp_path, capsys):
    error = fails(["--recipe", "cls.yaml", "optim.lrr=0.1", f"project={tmp_path / 'runs'}"], capsys)
    assert "unknown key 'optim.lrr' (did you mean optim.lr=0.1?)" in error
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_unknown_key_under_torchrun_fails_on_every_rank_and_says_it_once(tmp_path):
    result = run_torchrun("train.py", "--recipe", "cls.yaml", "optim.lrr=0.1", f"project={tmp_path / 'runs'}")
    assert result.returncode != 0
    assert len(console_lines(result.stderr, "train.py: error: command line: unknown key 'optim.lrr'")) == 1
    assert not (tmp_path / "runs").exists()


def test_missing_dataset_exits_with_a_clear_error(tmp_path, capsys):
    error = fails(["--recipe", "cls.yaml", f"data.name={tmp_path / 'nope'}", f"project={tmp_path / 'runs'}"], capsys)
    assert "is neither a dataset here (digits, multidigits, cifar10, cifar100) nor a directory" in error


def test_a_project_that_cannot_hold_runs_is_refused_before_the_data_is_read(tmp_path, capsys):
    (tmp_path / "afile").touch()
    for project in ("afile", "afile/runs"):  # data.name names nothing: its error would come later
        error = fails(["--recipe", "cls.yaml", f"data.name={tmp_path / 'nope'}", f"project={tmp_path / project}"],
                      capsys)
        assert error.rstrip().endswith(f"project='{tmp_path / project}': {tmp_path / 'afile'} is a file, not a "
                                       f"folder; give another project")


def test_check_builds_the_data_and_model_then_exits_writing_no_run(tmp_path, caplog):
    caplog.set_level("INFO")
    assert train.main(["--recipe", "cls.yaml", "--check", f"project={tmp_path / 'runs'}"]) == -1.0
    assert "--check: the recipe, data and model are ready to train; no run written" in caplog.text
    assert "1437 train / 360 val images" in caplog.text and not (tmp_path / "runs").exists()


def test_check_refuses_as_a_run_would(tmp_path, capsys):
    error = fails(["--recipe", "cls.yaml", "--check", "model.name=squeezenet1_1", f"project={tmp_path}"], capsys)
    assert "model.name='squeezenet1_1' cannot take 8x8 images" in error


@pytest.mark.slow
def test_model_that_cannot_take_the_image_size_fails_before_the_run_dir(tmp_path, capsys):
    error = fails(["--recipe", "cls.yaml", "model.name=squeezenet1_1", f"project={tmp_path / 'runs'}"], capsys)
    assert "model.name='squeezenet1_1' cannot take 8x8 images (data.img_size=8): Given input size" in error
    error = fails(["--recipe", "cls.yaml", "model.name=vit_b_32", f"project={tmp_path / 'runs'}"], capsys)
    assert "model.name='vit_b_32' cannot be built for 8x8 images (data.img_size=8): Input shape indivisible" in error
    assert not (tmp_path / "runs").exists()


def test_a_gpu_device_without_cuda_exits_before_any_work(tmp_path, capsys):
    for device in ("0", "cuda:1"):  # device=0 reaches the recipe as an int
        error = fails(["--recipe", "cls.yaml", f"device={device}", f"project={tmp_path / 'runs'}"], capsys)
        assert error == (f"train.py: error: device='{device}' but CUDA is not available here; use device=cpu or "
                         f"device=auto\n")
    assert not (tmp_path / "runs").exists()


def test_a_batch_of_one_image_per_process_with_batchnorm_is_refused_before_the_data_is_read(tmp_path, capsys):
    # The issue's command: torchrun --nproc_per_node=2 train.py --recipe folder.yaml model.weights='' ... batch 2.
    issue = load_recipe("folder.yaml", ["model.weights=", "data.img_size=32", "train.batch_size=2"])
    with pytest.raises(SharedError) as e:
        check_batch_for_batchnorm(issue, world_size=2)
    assert str(e.value) == ("train.batch_size=2 on 2 processes gives each process 1 image per step: too few for the "
                            "BatchNorm layers of model.name=resnet18, which normalise by the batch's own statistics; "
                            "use train.batch_size=4 or more")
    split = load_recipe("cls.yaml", ["train.batch_size=12", "train.accumulate=4"])  # micro-batches of 2, 2, 1, 1
    with pytest.raises(SharedError, match=r"^train.batch_size=12 on 2 processes with train.accumulate=4 gives each "
                                          r"process 6 images per step in micro-batches as small as 1 image: .*; use "
                                          r"train.batch_size=16 or more, a lower train.accumulate or model.norm=group$"):
        check_batch_for_batchnorm(split, world_size=2)
    check_batch_for_batchnorm(load_recipe("cls.yaml", ["train.batch_size=2", "model.norm=group"]), world_size=2)
    check_batch_for_batchnorm(load_recipe("cls.yaml", ["train.batch_size=16", "train.accumulate=4"]), world_size=2)
    # One process, before the data is read (there is none) or a run directory made.
    error = fails(["--recipe", "cls.yaml", "train.batch_size=1", f"data.name={tmp_path / 'nope'}",
                   f"project={tmp_path / 'runs'}"], capsys)
    assert error == ("train.py: error: train.batch_size=1 on 1 process gives each process 1 image per step: too few "
                     "for the BatchNorm layers of model.name=convnet, which normalise by the batch's own statistics; "
                     "use train.batch_size=2 or more or model.norm=group\n")
    assert not (tmp_path / "runs").exists()


def test_an_epochs_last_micro_batch_of_one_image_is_normalised_by_the_running_statistics(image_folder, tmp_path, log):
    # 7 images in steps of 4 as 2 micro-batches: the last step's 3 images split 2 + 1. At 4x4 pixels the third stage's
    # feature maps are 1x1, where BatchNorm cannot take one image's own statistics.
    root = image_folder({"train": {"a": 4, "b": 3}, "val": {"a": 2, "b": 2}}, size=4)
    train.main(["--recipe", "cls.yaml", f"data.name={root}", "data.img_size=4", "train.epochs=1", "train.batch_size=4",
                "train.accumulate=2", "model.width=4", "data.workers=0", f"project={tmp_path}"])
    assert "2 steps per epoch" in log.text and (tmp_path / "exp" / "weights" / "last.pt").is_file()
    model = build_model(ModelConfig(width=4, depth=3), 2).train()
    before = [layer.running_mean.clone() for layer in batchnorm_layers(model)]
    with one_image_batchnorm(model, 1):
        model(torch.rand(1, 3, 4, 4))
    assert all(layer.training for layer in batchnorm_layers(model))
    assert all(torch.equal(a, layer.running_mean) for a, layer in zip(before, batchnorm_layers(model)))


def test_a_global_batch_larger_than_the_training_images_is_said(image_folder, tmp_path, log):
    root = image_folder({"train": {"a": 3, "b": 3}, "val": {"a": 1, "b": 1}}, size=8)
    train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=1", "train.batch_size=16", "model.width=4",
                "data.workers=0", f"project={tmp_path}"])
    assert ("train.batch_size=16 is more than the epoch's 6 training images: each epoch is one step of them all"
            in log.text)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_one_process_in_the_precision_and_layout_auto_did_not_pick_reaches_the_same_accuracy(tmp_path, monkeypatch,
                                                                                               digits_run, log):
    # The README recipe at one process, in the other precision (bf16 <-> fp32) and contiguous: the same >= 99% as
    # two processes in auto's, and val.py's figure is the one training recorded, in the run's precision.
    models = []
    monkeypatch.setattr(train, "check_input_size", lambda model, *args, **kw: models.append(model))
    other = {"bf16": "fp32", "fp32": "bf16"}[load_recipe(str(digits_run[0] / "exp" / "recipe.yaml")).train.precision]
    best = train.main(["--recipe", "cls.yaml", f"project={tmp_path}", f"train.precision={other}",
                       "train.channels_last=false"])
    assert models[0].features[0][0].weight.is_contiguous() and "train: auto:" not in log.text
    assert f"in {'bfloat16' if other == 'bf16' else 'float32'}; batch 48" in log.text
    assert val.main(["--weights", str(tmp_path / "exp" / "weights" / "best.pt"), "--project", str(tmp_path / "val")]
                    )["val/top1"] == best
    _, rows = read_results(tmp_path / "exp")
    _, two_processes = read_results(digits_run[0] / "exp")
    assert best >= 0.99 and max(float(r["val/top1"]) for r in rows) == pytest.approx(best, abs=1e-6)  # csv: 6 digits
    assert abs(best - max(float(r["val/top1"]) for r in two_processes)) < 0.01
    assert "cached 1437 train and 360 val images in memory" in log.text  # the recipe's data.cache=ram
    assert "0 worker(s) each (auto: data.cache=ram, every core computes)" in log.text
    saved = load_checkpoint(tmp_path / "exp" / "weights" / "last.pt")
    assert list(saved["model"]) == list(load_checkpoint(digits_run[0] / "exp" / "weights" / "last.pt")["model"])
    # One of the two runs trained in bf16: exported, its model computes in fp32, and says so; val.py in fp32 gives the
    # exported model's top-1, a val image or none from bf16's.
    bf16_run = tmp_path / "exp" if other == "bf16" else digits_run[0] / "exp"
    exported = shutil.copy(bf16_run / "weights" / "best.pt", tmp_path / "bf16.pt")
    export.main(["--weights", str(exported), "--format", "torchscript"])
    assert "the model trained and was validated in bf16; exported models compute in fp32" in log.text
    files = [path for path, _ in build_datasets(dataset_root("digits"), None, None)[1].samples]
    data = checkpoint_recipe(load_checkpoint(exported)["recipe"], exported).data
    images = normalizer(data, torch.device("cpu"))(torch.stack([val_transforms(data)(decode(f)) for f in files]))
    scripted = torch.jit.load(str(tmp_path / "bf16.torchscript"))(images)
    labels = torch.tensor([int(Path(f).parent.name) for f in files])
    fp32 = val.main(["--weights", str(exported), "--precision", "fp32", "--project", str(tmp_path / "val")])
    assert (scripted.argmax(1) == labels).sum().item() == round(fp32["val/top1"] * 360)
    assert abs(fp32["val/top1"] - load_checkpoint(exported)["best_score"]) <= 1 / 360 + 1e-9


@pytest.mark.slow
def test_compile_trains_through_inductor_as_the_eager_model_does(tmp_path, monkeypatch):
    # Real torch.compile: TorchInductor compiles the training step of a one-stage convnet to C++ kernels (about 20 s
    # on 2 cores, nearly all of it compiling). It compiles on the first call, so its kernels show the steps ran
    # compiled; its fresh cache folder makes it compile here rather than reuse another run's kernels.
    root = two_tone_folder(tmp_path / "data", train=8, val=2)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    runs = {}
    for compile in ("false", "true"):
        train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=1", "train.batch_size=8",
                    "model.width=4", "model.depth=1", f"train.compile={compile}", f"project={tmp_path / compile}",
                    "train.precision=fp32"])  # the tolerance below is fp32's rounding
        runs[compile] = (load_checkpoint(tmp_path / compile / "exp" / "weights" / "last.pt")["model"],
                         read_results(tmp_path / compile / "exp")[1][0])
    (eager, eager_row), (compiled, compiled_row) = runs["false"], runs["true"]
    assert list((tmp_path / "inductor").rglob("*.so")), "the compiled model never ran"
    assert list(compiled) == list(eager)  # the plain module was saved: no '_orig_mod.' prefixes
    for name in eager:  # two SGD steps: inductor's fused kernels round differently, by far less than a step moves
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-6)
    assert float(compiled_row["train/loss"]) == pytest.approx(float(eager_row["train/loss"]), rel=1e-5)
    assert compiled_row["val/top1"] == eager_row["val/top1"]


def test_bf16_runs_the_forward_in_bf16_and_learns_an_easy_task(tmp_path, monkeypatch):
    # precision=bf16 on a CPU: every training and validation forward runs in bf16 (autocast), and two-tone images
    # are told apart perfectly by the last of 4 epochs (group norm: BatchNorm's running statistics of a width-4
    # network on 8-pixel images lag its weights, which would test BatchNorm rather than bf16).
    root = two_tone_folder(tmp_path / "data", train=16, val=8)
    dtypes, check_input_size = set(), train.check_input_size

    def record_head_dtype(model, *args, **kw):  # after the check's own fp32 forward
        check_input_size(model, *args, **kw)
        model.head[-1].register_forward_hook(lambda layer, inputs, output: dtypes.add((layer.training, output.dtype)))
    monkeypatch.setattr(train, "check_input_size", record_head_dtype)
    best = train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=4", "train.batch_size=8",
                       "model.width=4", "model.norm=group", "train.precision=bf16", f"project={tmp_path / 'r'}"])
    assert dtypes == {(True, torch.bfloat16), (False, torch.bfloat16)}
    _, rows = read_results(tmp_path / "r" / "exp")
    assert best == 1.0 and float(rows[-1]["val/top1"]) == 1.0
    assert float(rows[-1]["train/loss"]) < float(rows[0]["train/loss"])
    assert load_checkpoint(tmp_path / "r" / "exp" / "weights" / "last.pt")["recipe"]["train"]["precision"] == "bf16"


def test_early_stopping_after_patience_epochs_without_a_better_top1(image_folder, tmp_path, log, capsys,
                                                                      monkeypatch):
    # Random images with random labels: val top-1 stops improving within a few epochs.
    root = image_folder({"train": {"a": 8, "b": 8}, "val": {"a": 4, "b": 4}}, size=8)
    train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=12", "train.patience=2",
                "train.batch_size=4", "model.width=4", f"project={tmp_path}"])
    _, rows = read_results(tmp_path / "exp")
    top1 = [float(r["val/top1"]) for r in rows]
    best_epoch = top1.index(max(top1)) + 1
    assert len(rows) == best_epoch + 2 < 12  # stopped two epochs after the best
    assert (f"Stopping early after epoch {len(rows)}: no better val top-1 in 2 epochs since the best, "
            f"{max(top1):.2%} at epoch {best_epoch} (train.patience=2)") in log.text
    # Resumed, it would train an epoch and stop again: refused, as a run that trained all its epochs is
    error = fails(["--resume", tmp_path / "exp"], capsys)
    assert error.rstrip().endswith(f"last.pt: the run ran out of patience after epoch {len(rows)}: no better val "
                                   f"score in 2 epochs since its best, at epoch {best_epoch} (train.patience=2); to "
                                   f"train longer, resume with train.patience=N (N > 2) or train.patience=0")
    assert load_checkpoint(tmp_path / "exp" / "weights" / "best.pt")["epoch"] == best_epoch
    # A stop signal during the validation that runs out of patience: the run has ended, as it would have
    end_epoch = train.end_epoch
    monkeypatch.setattr(train, "end_epoch", lambda loop, state, *args: end_epoch(loop, state, *args) or
                        state.epoch - state.best_epoch >= 2)  # what the vote says when a signal came
    log.clear()
    train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=12", "train.patience=2",
                "train.batch_size=4", "model.width=4", f"project={tmp_path}", "name=signalled"])
    assert f"Stopping early after epoch {len(rows)}" in log.text and "Resume with" not in log.text
    signalled = [float(r["val/top1"]) for r in read_results(tmp_path / "signalled")[1]]
    assert signalled == top1  # the same run, ended where it ran out of patience


def test_a_run_with_log_plots_false_draws_nothing_and_records_every_figure(image_folder, tmp_path, log):
    root = image_folder({"train": {"a": 4, "b": 4}, "val": {"a": 2, "b": 2}}, size=8)
    train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=2", "train.batch_size=4", "model.width=4",
                "log.plots=false", f"project={tmp_path}"])
    run = tmp_path / "exp"
    assert [r["epoch"] for r in read_results(run)[1]] == ["1", "2"]
    assert not (run / "results.png").exists()
    events = EventAccumulator(str(run), size_guidance={"scalars": 0}).Reload()
    assert [e.step for e in events.Scalars("val/top1")] == [2, 4]
    assert set(events.Tags()["images"]) == {"train/batch", "val/misclassified"}  # no val/confusion_matrix
    assert f"Results saved to {run} (results.csv, TensorBoard events, weights/)" in log.text


def test_without_plots_the_trackers_are_given_no_figure_not_even_an_earlier_launchs(tmp_path):
    logger = RunLogger(tmp_path, load_recipe("cls.yaml", ["log.plots=false", "log.to=[]"]), ["a", "b"])
    (tmp_path / "results.png").write_bytes(b"drawn by a launch with log.plots=true")
    (tmp_path / "recipe.yaml").write_text("model: {}\n")
    logger.log_epoch({**dict.fromkeys(COLUMNS, 0.5), "epoch": 1, "confusion": torch.eye(2), "wrong": []}, 10)
    assert logger.artifacts("finished") == [tmp_path / "recipe.yaml"]
    assert not (tmp_path / "confusion_matrix.png").exists()


def test_an_unknown_model_name_fails_with_the_recipe_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--recipe", "cls.yaml", "model.name=resnt18", f"project={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "model.name='resnt18': no such model" in err and "(closest: 'resnet18')" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_val_split_run_and_its_resume_say_what_they_trained_and_what_comes_next(tmp_path):
    """Paths as typed (relative to where train.py runs, the scripts' too) before and after a resume; this launch's
    epochs and time; a predict command on new images, not on the root whose val images lie among the training
    ones."""
    make_image_folder(tmp_path / "data", {"": {"cat": 6, "dog": 6}}, size=16)  # class folders in the root
    short = ["data.workers=0", "train.batch_size=4"]
    first = run_python(ROOT / "train.py", "--recipe", "cls.yaml", "data.name=data", "data.val_split=0.34",
                       "train.epochs=1", "data.img_size=16", *short, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    best = "runs/train/exp/weights/best.pt"
    assert re.search(r"\n1 epoch in [\d.]+s\. Results saved to runs/train/exp ", first.stdout), first.stdout
    new_images = "--source path/to/new_images     # a folder of new images"
    assert f"  python {ROOT / 'predict.py'} --weights {best} {new_images}\n" in first.stdout
    resumed = run_python(ROOT / "train.py", "--resume", "runs/train/exp", "train.epochs=3", *short, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert re.search(r"\n2 epochs in [\d.]+s, resumed at epoch 2, step 0; 3 in all\. Results saved to runs/train/exp ",
                     resumed.stdout), resumed.stdout
    val_command = f"python {ROOT / 'val.py'} --weights {best}"
    assert f"  {val_command}\n" in resumed.stdout
    assert run_python(*val_command.split()[1:], cwd=tmp_path).returncode == 0  # works as typed where it was printed
    assert "train.epochs=3, the run was planned for 1: from here the lr follows the schedule of 3 epochs, so it " \
           "moves at once from" in resumed.stdout
