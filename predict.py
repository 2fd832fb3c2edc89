"""Classify images with a checkpoint: the top-k classes and their probabilities for each image, printed and saved as
CSV and JSON in runs/predict/expN. A multi-label checkpoint gives every class whose probability reaches its threshold
(the per-class ones train.py chose on val, or --threshold). --save-probs also writes every image's probability of
every class. An unreadable image is named and skipped.

Usage:
    python predict.py --weights runs/train/exp/weights/best.pt --source photo.jpg
    python predict.py --weights runs/train/exp/weights/best.pt --source photos/ --topk 3     # a folder, recursively
    python predict.py --weights runs/train/exp/weights/best.pt --source 'photos/**/*.jpg'     # a glob
    python predict.py --weights runs/train/exp/weights/best.pt --source photos/ --tta --save-images  # see them
    python predict.py --weights runs/train/exp/weights/best.pt --source photos/ --threshold 0.3   # multi-label
    python predict.py --weights runs/train/exp/weights/best.pt --source photos/ --save-probs   # probabilities.csv
"""

import argparse
import csv
import glob
import json
import shlex
import sys
from pathlib import Path

from utils.general import (LOGGER, RANK, UsageError, after_imports, before_imports, colorstr, cpu_count,
                           format_table, increment_path, quiet_ctrl_c, save_probabilities)

if __name__ == "__main__":  # no collection during the imports below (utils/general.before_imports)
    before_imports()

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS
from tqdm import tqdm

from data.layouts import hidden
from data.transforms import normalizer, val_transforms
from data.verify import UNREADABLE, decode, unreadable_reason
from models import model_from_checkpoint
from utils.checkpoint import load_model_checkpoint
from utils.config import checkpoint_recipe
from utils.distributed import exit_on_error
from utils.plots import THUMBNAIL_SIDE, annotated_image, contact_sheet
from utils.precision import autocast, inference_precision
from utils.torch_utils import select_device, set_device
from utils.multilabel import chosen_thresholds, threshold_option
from utils.tta import TTA_NAME, flip_warning, tta_logits

MAX_ROWS_SHOWN = 50  # more predictions are saved but not printed
SHEET_SIZE = 100  # images per contact sheet (10 x 10 thumbnails)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Classify images with a checkpoint of train.py.")
    parser.add_argument("--weights", required=True, help="checkpoint of train.py (e.g. runs/train/exp/weights/best.pt)")
    parser.add_argument("--source", required=True, nargs="+",
                        help="images, folders (searched recursively) or glob patterns, one or more")
    parser.add_argument("--topk", type=int, default=5, help="classes reported per image")
    parser.add_argument("--batch-size", type=int, default=32, help="images per forward pass")
    parser.add_argument("--workers", type=int, default=min(4, cpu_count() - 1), help="image-decoding processes")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="autocast (default: the recipe's)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda (GPU LOCAL_RANK), or GPU N as N or cuda:N")
    parser.add_argument("--tta", action="store_true",
                        help="test-time augmentation: the mean softmax of each image and its horizontal flip")
    parser.add_argument("--threshold", type=threshold_option,
                        help="multi-label: report every class from this probability, or 'saved' (default): from "
                             "the per-class thresholds train.py chose on val and saved in the checkpoint, the best "
                             "guess for new images (its recipe's train.threshold where it saved none)")
    parser.add_argument("--save-probs", action="store_true",
                        help="also save every image's probability of every class (softmax; multi-label: sigmoid) "
                             "in probabilities.csv: file, then a column per class, the images in predictions.csv's "
                             "order")
    parser.add_argument("--save-images", action="store_true",
                        help="also save each image with its top-k drawn on it (images/) and contact sheets of all")
    parser.add_argument("--project", default="runs/predict", help="results go to project/name")
    parser.add_argument("--name", default="exp", help="run name, incremented (exp, exp2, ...) when taken")
    return parser.parse_args(argv)


def main(argv=None):
    """Predict; bad input exits with code 2 and one line; no readable image among those found, with code 1 and one
    line, after saving the results (the list of what was skipped and why)."""
    args = parse_args(argv)
    try:
        rows, skipped = predict(args)
    except UsageError as e:
        exit_on_error("predict.py", e)
    if skipped and not rows:  # not a usage error (2): the images were found, and the skipped are saved
        if RANK == 0:
            print(f"predict.py: error: none of the {len(skipped)} image(s) of --source {shlex.join(args.source)} "
                  f"could be read (each is named above); nothing was classified", file=sys.stderr)
        sys.exit(1)
    return rows, skipped


class ImageFiles(Dataset):
    """Images by path, prepared as in validation: (uint8 image or None, index, None or why it is unreadable)."""

    def __init__(self, paths, transform):
        self.paths, self.transform = paths, transform

    def __getitem__(self, index):
        try:
            return self.transform(decode(self.paths[index])), index, None
        except UNREADABLE as e:
            return None, index, unreadable_reason(e)

    def __len__(self):
        return len(self.paths)


def collate(samples):
    """(stacked readable images, their indices, [(index, reason) of the unreadable ones])."""
    readable = [(image, i) for image, i, reason in samples if reason is None]
    images = torch.stack([image for image, _ in readable]) if readable else None
    return images, [i for _, i in readable], [(i, reason) for _, i, reason in samples if reason is not None]


def list_images(sources):
    """The image files the sources name, sorted, each once (list_source)."""
    return sorted({path for source in sources for path in list_source(source)})


def list_source(source):
    """The image files source names: one file, a folder's image files (recursively, hidden ones passed over as in
    training) or a glob's matches (which pass them over too)."""
    path = Path(source)
    if path.is_file():
        return [path]
    if not path.exists() and not glob.has_magic(source):
        raise UsageError(f"--source {source}: no such file or folder")
    if path.is_dir():
        files = (p for p in path.rglob("*")
                 if p.suffix.lower() in IMG_EXTENSIONS and p.is_file() and not hidden(p, path))
    else:
        files = (Path(p) for p in glob.glob(source, recursive=True) if Path(p).is_file())
    paths = list(files)
    if not paths:
        raise UsageError(f"--source {source}: no images found; give an image, a folder of images ("
                         f"{', '.join(IMG_EXTENSIONS)}) or a glob such as 'photos/*.jpg'")
    return paths


def predict(args):
    """Classify every image of args.source; rank 0 of one process prints and saves. Returns (rows, skipped)."""
    if args.topk < 1 or args.batch_size < 1 or args.workers < 0:
        raise UsageError("--topk and --batch-size must be >= 1 and --workers >= 0")
    ckpt = load_model_checkpoint(args.weights)
    args.weights = ckpt["path"]  # a run directory's weights/best.pt
    cfg, classes = checkpoint_recipe(ckpt["recipe"], args.weights), ckpt["classes"]
    threshold, _ = chosen_thresholds(args.threshold, ckpt, cfg, args.weights)  # multi-label only
    device = select_device(args.device, key="--device")
    set_device(device)
    _, dtype = inference_precision(args.precision, cfg.train.precision, device)
    paths = list_images(args.source)
    # No worker processes for a single batch: starting them costs more than decoding it.
    loader = DataLoader(ImageFiles(paths, val_transforms(cfg.data)), batch_size=args.batch_size,
                        num_workers=min(args.workers, len(paths) // args.batch_size), collate_fn=collate,
                        pin_memory=device.type == "cuda")
    model = model_from_checkpoint(ckpt, cfg, args.weights, device)
    normalize, k = normalizer(cfg.data, device), min(args.topk, len(classes))
    if args.tta and RANK == 0:
        LOGGER.info(f"{colorstr('predict:')} TTA: {TTA_NAME}")
        if warning := flip_warning(cfg.data.hflip, args.weights):
            LOGGER.warning(warning)
    thresholds = None if threshold is None else \
        torch.as_tensor(threshold, dtype=torch.float32, device=device).expand(len(classes))
    rows, skipped, all_probs = [], [], []
    with torch.no_grad():
        for images, indices, unreadable in tqdm(loader, desc="predict", disable=None if len(loader) > 1 else True,
                                                leave=False):
            for i, reason in unreadable:
                LOGGER.warning(f"skipped {paths[i]}: unreadable image ({reason})")
                skipped.append({"file": str(paths[i]), "reason": reason})
            if images is None:
                continue
            with autocast(device, dtype):
                images = normalize(images.to(device, non_blocking=True))
                logits = tta_logits(model, images, thresholds is not None) if args.tta else model(images)
            probs = logits.float().sigmoid() if thresholds is not None else logits.float().softmax(dim=1)
            if args.save_probs:
                all_probs.append(probs.cpu())
            if thresholds is not None:
                rows += labelled_rows(probs, thresholds, [paths[i] for i in indices], classes)
                continue
            top = probs.topk(k, dim=1)  # with TTA: the mean of the two softmaxes
            for i, values, labels in zip(indices, top.values.tolist(), top.indices.tolist()):
                rows.append({"file": str(paths[i]), "top": [{"class": classes[c], "prob": p}
                                                            for c, p in zip(labels, values)]})
    if RANK == 0:  # predict.py shares no work: under torchrun every process classifies every image, one saves
        save_dir = increment_path(Path(args.project) / args.name, mkdir=True)
        k = None if thresholds is not None else k  # multi-label: every label from its threshold, not a top k
        LOGGER.info(report(rows, skipped, k))
        if args.save_images:
            name_drawn_copies(save_dir, rows)
        source = args.source[0] if len(args.source) == 1 else args.source  # as typed: a glob, or the shell's paths
        save_results(save_dir, rows, skipped, k, {"weights": str(args.weights), "source": source, "tta": args.tta},
                     args.save_images)
        files = ["predictions.csv", "predictions.json", *(save_images(save_dir, rows) if args.save_images else [])]
        if args.save_probs:
            save_probabilities(save_dir / "probabilities.csv", [r["file"] for r in rows], classes,
                               torch.cat([torch.zeros(0, len(classes)), *all_probs]))
            files.append("probabilities.csv")
        LOGGER.info(f"Results saved to {colorstr('bold', str(save_dir))}: {', '.join(files)}")
    return rows, skipped


def labelled_rows(probs, thresholds, paths, classes):
    """Multi-label rows: per image, under 'labels', every class whose probability reaches its threshold, the
    likeliest first, as {'class', 'prob'} entries (single-label rows hold their top k under 'top')."""
    rows = []
    for path, p, chosen in zip(paths, probs.tolist(), (probs >= thresholds).tolist()):
        labels = sorted((c for c in range(len(classes)) if chosen[c]), key=lambda c: -p[c])
        rows.append({"file": str(path), "labels": [{"class": classes[c], "prob": p[c]} for c in labels]})
    return rows


def entries(row):
    """A row's {'class', 'prob'} entries: a multi-label row's labels, or a single-label row's top k."""
    return row["labels"] if "labels" in row else row["top"]


def report(rows, skipped, k=None):
    """The console table: each image's top-k classes with their probabilities, or with k None (multi-label) its
    labels; the first MAX_ROWS_SHOWN."""
    if k is None:
        table = format_table(["file", "labels"], [[r["file"], ", ".join(f"{t['class']} {t['prob']:.3f}" for t in
                                                                        r["labels"]) or "-"]
                                                  for r in rows[:MAX_ROWS_SHOWN]])
    else:
        table = format_table(["file", *(f"top-{j + 1}" for j in range(k))],
                             [[r["file"], *(f"{t['class']} {t['prob']:.3f}" for t in r["top"])]
                              for r in rows[:MAX_ROWS_SHOWN]])
    more = f"\n... and {len(rows) - MAX_ROWS_SHOWN} more" if len(rows) > MAX_ROWS_SHOWN else ""
    return f"{table}{more}\n{len(rows)} image(s) classified, {len(skipped)} unreadable skipped"


def save_results(save_dir, rows, skipped, k, facts, drawn_column=False):
    """predictions.csv (file, then class and probability for each of the top k, or with k None (multi-label) the
    labels and their probabilities, each '|'-separated as in a training CSV, then with drawn_column the path of the
    image's drawn copy) and predictions.json."""
    multilabel = k is None
    with open(save_dir / "predictions.csv", "w", newline="", encoding="utf-8") as f:  # class names in any script
        writer = csv.writer(f)
        # drawn comes last so that the other columns keep their places with and without --save-images
        writer.writerow(["file", *(["labels", "probs"] if multilabel else
                                   (f"{name}{j + 1}" for j in range(k) for name in ("class", "prob"))),
                         *(["drawn"] if drawn_column else [])])
        for r in rows:
            values = (["|".join(t["class"] for t in r["labels"]),
                       "|".join(f"{t['prob']:.6g}" for t in r["labels"])] if multilabel else
                      (v for t in r["top"] for v in (t["class"], f"{t['prob']:.6g}")))
            writer.writerow([r["file"], *values, *([r["drawn"]] if drawn_column else [])])
    (save_dir / "predictions.json").write_text(json.dumps({**facts, "predictions": rows, "skipped": skipped},
                                                          indent=1) + "\n")


def name_drawn_copies(save_dir, rows):
    """Give each row the path its drawn copy will have, save_dir/images/NAME (a path like its file's, to open from
    the same place): named before drawing so that predictions.csv, written first, can say which copy is whose."""
    taken = set()
    for r in rows:
        r["drawn"] = str(save_dir / "images" / unique_name(Path(r["file"]), taken))


def save_images(save_dir, rows):
    """For people: each classified image with its top-k (multi-label: its labels) drawn on it (small ones enlarged)
    at the path name_drawn_copies gave it, and contact sheets of SHEET_SIZE thumbnails captioned with their top-1
    (multi-label: their labels) (contact_sheet.jpg, contact_sheet_2.jpg, ...). Returns what it wrote."""
    (save_dir / "images").mkdir()
    sheets = []
    for start in range(0, len(rows), SHEET_SIZE):
        thumbnails, captions = [], []
        for r in rows[start : start + SHEET_SIZE]:
            image = decode(r["file"])
            lines = [f"{t['prob']:.2f} {t['class']}" for t in entries(r)] or ["no label"]  # probability first
            annotated_image(image, lines).save(r["drawn"], quality=95)
            image.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))  # a sheet holds thumbnails, not 100 full photos
            thumbnails.append(image)
            captions.append(lines[0] if "top" in r else ",".join(t["class"] for t in r["labels"]) or "-")
        sheets.append(f"contact_sheet{f'_{len(sheets) + 1}' if sheets else ''}.jpg")
        contact_sheet(thumbnails, captions).save(save_dir / sheets[-1], quality=95)
    return [f"images/ ({len(rows)})", *sheets]


def unique_name(path, taken):
    """The name of an image's annotated copy: its own, as PNG for a PNG and JPEG for any other format, with _2, _3,
    ... before the suffix when an earlier image took it (compared case-blind, as some file systems compare)."""
    suffix = ".png" if path.suffix.lower() == ".png" else ".jpg"
    name, n = path.stem + suffix, 1
    while name.lower() in taken:
        n += 1
        name = f"{path.stem}_{n}{suffix}"
    taken.add(name.lower())
    return name


if __name__ == "__main__":
    after_imports()
    with quiet_ctrl_c("predict.py"):
        main()
