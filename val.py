"""Validate a checkpoint: top-1, balanced top-1 (mean per-class recall), top-5, loss, per-class precision, recall
and top-5 accuracy, and the confusion matrix, as one process or many under torchrun (every image is counted exactly
once). A multi-label checkpoint: mAP and per-class AP, and F1, precision, recall and exact match at its recipe's
train.threshold, as training logged them, or at --threshold (a probability, or 'saved': the per-class thresholds
train.py chose on val). --save-probs writes every image's probability of every class.

The checkpoint carries its class names and its recipe's preprocessing, so no recipe is needed.

Usage:
    python val.py --weights runs/train/exp/weights/best.pt
    torchrun --nproc_per_node=2 val.py --weights runs/train/exp/weights/best.pt --split train
    python val.py --weights runs/train/exp/weights/best.pt --tta      # each image and its horizontal flip
    python val.py --weights runs/train/exp/weights/best.pt --threshold 0.3     # multi-label: one for all classes
    python val.py --weights runs/train/exp/weights/best.pt --threshold saved   # multi-label: the saved per-class
    python val.py --weights runs/train/exp/weights/best.pt --save-probs        # probabilities.csv
"""

import argparse
import csv
import json
from pathlib import Path

from utils.general import (LOGGER, RANK, WORLD_SIZE, UsageError, after_imports, before_imports, colorstr,
                           format_table, in_flags, increment_path, quiet_ctrl_c, save_probabilities, short_path)

if __name__ == "__main__":  # no collection during the imports below (utils/general.before_imports)
    before_imports()

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from data.datasets import build_dataloader
from data.sources import named_eval_dataset, skip_unreadable, skipped_message
from data.multilabel import check_task
from data.transforms import normalizer, val_transforms
from models import model_from_checkpoint
from utils.checkpoint import load_model_checkpoint, position
from utils.config import checkpoint_recipe
from utils.distributed import (cleanup_distributed, exit_on_error, on_rank0, setup_distributed,
                               stop_if_another_rank_failed)
from utils.metrics import evaluate, per_class
from utils.multilabel import SAVED, chosen_thresholds, evaluate_multilabel, threshold_option
from utils.plots import confusion_figure, save_figure
from utils.precision import inference_precision
from utils.torch_utils import select_device, set_device, set_threads
from utils.tta import TTA_NAME, flip_warning

MAX_CLASSES_SHOWN = 50  # more classes are saved to per_class.csv but not printed
FLAGS = {"data.name": "--data", "data.skip_corrupt": "--skip-corrupt",  # recipe keys the data code's lines name
         "data.csv_allow_outside": "--csv-allow-outside"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Validate a checkpoint of train.py on a split of its dataset.")
    parser.add_argument("--weights", required=True, help="checkpoint of train.py (e.g. runs/train/exp/weights/best.pt)")
    parser.add_argument("--data", help="dataset: an embedded name or an ImageFolder root (default: the checkpoint's)")
    parser.add_argument("--split", default="val", choices=["val", "test", "train"],
                        help="split folder (val falls back to test, as in training)")
    parser.add_argument("--batch-size", type=int, help="global batch over all processes (default: the recipe's)")
    parser.add_argument("--workers", type=int, help="DataLoader workers per process (default: the recipe's)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="autocast (default: the recipe's)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda (GPU LOCAL_RANK), or GPU N as N or cuda:N")
    parser.add_argument("--skip-corrupt", action="store_true",
                        help="check every image once first and leave the unreadable out, each named (default: as the "
                             "run did, data.skip_corrupt)")
    parser.add_argument("--csv-allow-outside", action="store_true",
                        help="a CSV root: read images listed outside the CSV's folder (default: as the run did, "
                             "data.csv_allow_outside)")
    parser.add_argument("--tta", action="store_true",
                        help="test-time augmentation: the mean softmax of each image and its horizontal flip")
    parser.add_argument("--threshold", type=threshold_option,
                        help="multi-label: count a label from this probability, for every class, or 'saved': from "
                             "the per-class thresholds train.py chose on val and saved in the checkpoint (on the "
                             "val split, chosen on these same images, so optimistic) (default: the recipe's "
                             "train.threshold, as training logged its figures)")
    parser.add_argument("--save-probs", action="store_true",
                        help="also save every image's probability of every class (softmax; multi-label: sigmoid) "
                             "in probabilities.csv: file, labels (the true ones), then a column per class")
    parser.add_argument("--project", default="runs/val", help="results go to project/name")
    parser.add_argument("--name", default="exp", help="run name, incremented (exp, exp2, ...) when taken")
    return parser.parse_args(argv)


@record  # under torchrun, an unexpected error's traceback becomes the reported root cause of the failure
def main(argv=None):
    """Validate; bad input exits with code 2 and one line."""
    args = parse_args(argv)
    try:
        setup_distributed()
        try:
            return validate(args)
        except UsageError as e:  # said while this rank is still in the group, where the others find it
            exit_on_error("val.py", e, FLAGS)
        except Exception:
            stop_if_another_rank_failed("val.py")  # a collective broken by a rank that failed and left
            raise
        finally:
            cleanup_distributed()
    except UsageError as e:  # met before the group was joined
        exit_on_error("val.py", e, FLAGS)


def validate(args):
    """Evaluate the checkpoint on the split; rank 0 prints and saves the results. Returns the metrics."""
    ckpt = on_rank0(load_model_checkpoint, args.weights)  # read once, shared: other machines need no copy
    args.weights = ckpt["path"]  # a run directory's weights/best.pt
    cfg, classes = checkpoint_recipe(ckpt["recipe"], args.weights), ckpt["classes"]
    threshold, threshold_from = chosen_thresholds(args.threshold, ckpt, cfg, args.weights, "recipe")  # multi-label
    if args.threshold == SAVED and isinstance(threshold, list) and args.split == "val" and args.data is None:
        threshold_from += ": chosen on these same images, so the figures at them are optimistic"
    device = select_device(args.device, key="--device")
    set_device(device)
    precision, dtype = inference_precision(args.precision, cfg.train.precision, device)
    _, workers, _ = set_threads(cfg.data.workers if args.workers is None else args.workers, device_type=device.type)
    allow_outside = cfg.data.csv_allow_outside or args.csv_allow_outside
    dataset = named_eval_dataset(args.data or cfg.data.name, args.split, val_transforms(cfg.data), classes,
                                 args.weights, allow_outside, cfg.data.cache_dir, cfg.data.shard_hosts,
                                 split_root=cfg.data.name if cfg.data.val_split > 0 else None)
    check_task(dataset, cfg.data.multilabel, args.data or cfg.data.name, weights=args.weights)
    if (cfg.data.skip_corrupt or args.skip_corrupt) and hasattr(dataset, "samples"):  # a run's top-1 left them out
        skipped = skip_unreadable(dataset)
        if skipped and RANK == 0:
            LOGGER.warning(in_flags(skipped_message(skipped), FLAGS) if args.skip_corrupt else skipped_message(skipped))
    batch_size = cfg.train.batch_size if args.batch_size is None else args.batch_size
    if batch_size < 1:
        raise UsageError(f"--batch-size {batch_size}: must be >= 1")
    batch_size = max(batch_size // WORLD_SIZE, 1) * WORLD_SIZE  # split evenly between the processes
    loader = build_dataloader(dataset, batch_size, False, cfg.seed, workers, device)
    model = model_from_checkpoint(ckpt, cfg, args.weights, device)
    LOGGER.info(f"{colorstr('val:')} {args.weights} ({position(ckpt)}) on {short_path(dataset.root)}: "
                f"{len(dataset)} images, {len(classes)} classes; {WORLD_SIZE} process(es) on {device.type}, "
                f"batch {batch_size}, {precision}{f'; TTA: {TTA_NAME}' if args.tta else ''}")
    if args.tta and (warning := flip_warning(cfg.data.hflip, args.weights)) and RANK == 0:  # prints on every rank
        LOGGER.warning(warning)
    run = {"weights": str(args.weights), "epoch": ckpt["epoch"], "step": ckpt["step"], "data": str(dataset.root),
           "processes": WORLD_SIZE, "batch_size": batch_size, "precision": precision, "tta": args.tta}
    if cfg.data.multilabel:
        run["thresholds"] = threshold_from
        LOGGER.info(f"{colorstr('val:')} multi-label: F1, precision, recall and exact match at thresholds "
                    f"{threshold_from}")
        metrics = evaluate_multilabel(model, loader, normalizer(cfg.data, device), len(classes), device, dtype,
                                      threshold, args.tta)
        report_fn, save_fn = report_multilabel, save_multilabel_results
    else:
        metrics = evaluate(model, loader, normalizer(cfg.data, device), len(classes), device, dtype, tta=args.tta,
                           keep_probs=args.save_probs)
        report_fn, save_fn = report, save_results
    if RANK == 0:
        save_dir = increment_path(Path(args.project) / args.name, mkdir=True)
        LOGGER.info(report_fn(metrics, classes))
        files = save_fn(save_dir, metrics, classes, run)
        if args.save_probs:
            files.append(save_probs(save_dir, dataset, loader.sampler, metrics, classes))
        LOGGER.info(f"Results saved to {colorstr('bold', str(save_dir))}: {', '.join(files)}")
    return metrics


def report(metrics, classes):
    """The console report: overall metrics, then one row per class (top-5 with 5 classes or more)."""
    top5 = "" if metrics["val/top5"] is None else f"  top-5 {metrics['val/top5']:.2%}"
    overall = (f"top-1 {metrics['val/top1']:.2%}  balanced top-1 {metrics['val/balanced_top1']:.2%}{top5}  "
               f"loss {metrics['val/loss']:.4f}  ({metrics['val/samples']} images)")
    if len(classes) > MAX_CLASSES_SHOWN:
        return f"{overall}\n(per-class results of the {len(classes)} classes in per_class.csv)"
    columns = 5 if metrics["val/top5"] is not None else 4
    rows = [(name, n, fmt(precision), fmt(recall), fmt(top5_acc))[:columns]
            for name, (n, precision, recall, top5_acc) in zip(classes, per_class(metrics["class_counts"]))]
    return f"{overall}\n" + format_table(["class", "images", "precision", "recall", "top-5"][:columns], rows)


def report_multilabel(metrics, classes):
    """The console report of a multi-label model: overall metrics, then one row per class."""
    overall = (f"mAP {metrics['val/map']:.2%}  F1 {metrics['val/f1']:.2%}  precision {metrics['val/precision']:.2%}  "
               f"recall {metrics['val/recall']:.2%}  exact match {metrics['val/exact_match']:.2%}  loss "
               f"{metrics['val/loss']:.4f}  ({metrics['val/samples']} images)")
    if len(classes) > MAX_CLASSES_SHOWN:
        return f"{overall}\n(per-class results of the {len(classes)} classes in per_class.csv)"
    rows = [(name, n, fmt(ap), fmt(precision), fmt(recall), fmt(f1), f"{best:.3f}")
            for name, (n, ap, precision, recall, f1, best) in zip(classes, metrics["per_class"])]
    header = ["class", "support", "AP", "precision", "recall", "F1", "best threshold"]
    return f"{overall}\n" + format_table(header, rows)


def save_multilabel_results(save_dir, metrics, classes, run):
    """A multi-label model's metrics.json (save_summary) and per_class.csv (support, AP, precision, recall and F1
    at the thresholds used, and each class's threshold maximising F1 on this split); returns the names of the
    files."""
    save_summary(save_dir, metrics, ("map", "f1", "precision", "recall", "exact_match", "loss"), run)
    with open(save_dir / "per_class.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["class", "support", "ap", "precision", "recall", "f1", "best_threshold"])
        for name, row in zip(classes, metrics["per_class"]):
            writer.writerow([name, *("" if v is None else f"{v:.6g}" for v in row)])
    return ["metrics.json", "per_class.csv"]


def save_summary(save_dir, metrics, names, run):
    """metrics.json: each metric of names under its own name, 'images', and under 'run' how it was measured
    (weights, data, processes, precision, ...): apart, so that no detail of the run can take a metric's name."""
    summary = {**{name: metrics[f"val/{name}"] for name in names}, "images": metrics["val/samples"], "run": run}
    (save_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")


def save_probs(save_dir, dataset, sampler, metrics, classes):
    """probabilities.csv (utils.general.save_probabilities) of every image of the dataset, in its order (files as it
    lists them, else their indices), with its true label(s); returns its name."""
    ids = sampler.gathered_ids()  # the gathered rows are every rank's share in turn
    probs, targets = torch.empty_like(metrics["probs"]), torch.empty_like(metrics["targets"])
    probs[ids], targets[ids] = metrics["probs"], metrics["targets"]
    labels = [classes[c] for c in targets.tolist()] if targets.dim() == 1 else \
        ["|".join(classes[c] for c in row.nonzero().flatten().tolist()) for row in targets]
    files = [path for path, _ in dataset.samples] if hasattr(dataset, "samples") else range(len(probs))
    save_probabilities(save_dir / "probabilities.csv", files, classes, probs, labels)
    return "probabilities.csv"


def fmt(value):
    """A share to three decimals, '-' for None."""
    return "-" if value is None else f"{value:.3f}"


def save_results(save_dir, metrics, classes, run):
    """metrics.json (save_summary), per_class.csv, and the confusion matrix (when kept) as CSV (counts) and PNG (rows
    normalised); returns the names of the files written."""
    save_summary(save_dir, metrics, ("top1", "balanced_top1", "top5", "loss"), run)
    with open(save_dir / "per_class.csv", "w", newline="", encoding="utf-8") as f:  # class names in any script
        writer = csv.writer(f)
        writer.writerow(["class", "images", "precision", "recall", "top5"])
        for name, row in zip(classes, per_class(metrics["class_counts"])):
            writer.writerow([name, *("" if v is None else f"{v:.6g}" for v in row)])
    if metrics["confusion"] is None:  # too many classes to keep one
        return ["metrics.json", "per_class.csv"]
    with open(save_dir / "confusion_matrix.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["true \\ predicted", *classes])
        writer.writerows([name, *row] for name, row in zip(classes, metrics["confusion"].tolist()))
    save_figure(confusion_figure(metrics["confusion"], classes), save_dir / "confusion_matrix.png")
    return ["metrics.json", "per_class.csv", "confusion_matrix.csv", "confusion_matrix.png"]


if __name__ == "__main__":
    after_imports()
    with quiet_ctrl_c("val.py"):
        main()
