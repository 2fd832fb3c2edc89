"""Fine-tuning from pretrained weights by name against training from scratch, offline, on digits.

    python benchmarks/finetune.py [--seeds 0 1 2 3 4] [--per-class 8]
    python benchmarks/finetune.py --multilabel [--seeds 0 1 2 3 4] [--images 50]

No ImageNet weights can be downloaded on machines without internet, so the mechanism is shown with weights trained
here: ResNet-18 is trained on the digits 0-4 in their eight orientations (datasets/digits, 32 px; 40 classes), its
state_dict (with a 1,000-class head, as torchvision's file has) is placed in a temporary TORCH_HOME under the exact
name of torchvision's ResNet18_Weights.IMAGENET1K_V1 file, and recipes/folder.yaml then trains on a few images per
class of the digits 5-9, per seed: with model.weights=IMAGENET1K_V1 (its default, DEFAULT, is that file), and from
scratch, both with the same recipe and with the from-scratch command folder.yaml gives. Every run validates on all
val images of the digits 5-9. Prints a table.

--multilabel does the same for recipes/multilabel-photos.yaml, on collages of the digits 5-9: 16x16 images of 1 to 3
different digits in the cells of a 2x2 grid (as the embedded multidigits, data/multilabel.py), a few (--images) to
train on, 400 from the val digits to validate on; it also runs the fine-tuning with crops of 60-100% of the area,
to show what crops that cut digits out of an image but not out of its labels cost. Compares best val mAP.
"""

import argparse
import csv
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torchvision
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.sources import dataset_root  # noqa: E402
from data.multilabel import write_multidigits  # noqa: E402
from models.pretrained import cache_path, torchvision_weights  # noqa: E402

# The digits are 8x8: upscaled to 32 px, which ResNet-18's 32x downsampling leaves a 1x1 map of; no flips (a
# mirrored digit is another shape); whole images, as recipes/cls.yaml (crops cost digits accuracy); the RAM cache;
# no last step of a single image, whose BatchNorm statistics would be undefined.
DIGITS = ["data.img_size=32", "data.val_img_size=32", "data.crop_pct=1.0", "data.hflip=0", "data.scale=[1.0,1.0]",
          "data.auto_augment=''", "data.cache=ram", "train.channels_last=false", "data.drop_last=true"]
# ImageNet's weights carry to other photos because they learnt a thousand varied classes. Five classes are too few:
# trained on the digits 0-4 alone, the features of the digits 5-9 fell onto those five, and a linear probe of them
# (4 images per class) reached 68% of val, below a random ResNet-18's 78%. The digits 0-4 in their eight
# orientations, 40 classes, must keep the strokes' shapes apart: 86%. Crops (scale 0.35-1) widen them further.
ORIENTATIONS = {"": None, "-mirrored": Image.Transpose.FLIP_LEFT_RIGHT, "-flipped": Image.Transpose.FLIP_TOP_BOTTOM,
                "-rot90": Image.Transpose.ROTATE_90, "-rot180": Image.Transpose.ROTATE_180,
                "-rot270": Image.Transpose.ROTATE_270, "-transposed": Image.Transpose.TRANSPOSE,
                "-transversed": Image.Transpose.TRANSVERSE}
PRETRAIN = ["model.weights=''", "train.epochs=10", "train.batch_size=48", "train.patience=0", "optim.lr=0.002",
            "data.scale=[0.35,1.0]"]
FINETUNE = ["train.batch_size=4"]  # a few dozen images: 10 steps an epoch; the recipe's epochs and schedule
# Collages: each 8x8 digit at 32 px, as in pretraining; whole collages (the recipe's), but no flips or TrivialAugment
# (a turned digit can be another: 6 and 9).
COLLAGES = ["data.img_size=64", "data.val_img_size=64", "data.hflip=0", "data.auto_augment=''", "data.cache=ram",
            "train.channels_last=false", "data.drop_last=true"]
VAL_COLLAGES = 400
SCRATCH = {"from scratch, the same recipe": ["model.weights=''"],
           "from scratch, folder.yaml's from-scratch command": [
               "model.weights=''", "optim.lr=0.002", "train.epochs=40", "train.patience=10", "sched.warmup_epochs=2"]}


def subset(source, target, classes, per_class=None):
    """An ImageFolder at target of source's train/ and val/ images of classes (the first per_class of each in
    train/ where given), as symbolic links."""
    for split in ("train", "val"):
        for name in classes:
            files = sorted((source / split / name).glob("*.png"))
            files = files[:per_class] if split == "train" and per_class else files
            (target / split / name).mkdir(parents=True)
            for file in files:
                (target / split / name / file.name).symlink_to(file.resolve())
    return target


def orientations(source, target, classes):
    """An ImageFolder at target of source's train/ and val/ images of classes, each in its eight orientations as
    eight classes ("3", "3-mirrored", "3-rot90", ...)."""
    for split in ("train", "val"):
        for name in classes:
            for suffix, transpose in ORIENTATIONS.items():
                (target / split / f"{name}{suffix}").mkdir(parents=True)
                for file in sorted((source / split / name).glob("*.png")):
                    image = Image.open(file)
                    image = image.transpose(transpose) if transpose else image
                    image.save(target / split / f"{name}{suffix}" / file.name)
    return target


def run(args, project, name, env, recipe="folder.yaml", metric="val/top1"):
    """Run train.py (one process) with the recipe and args; return (best, last) val metric in % and the log."""
    command = [sys.executable, "train.py", "--recipe", recipe, *args, f"project={project}", f"name={name}"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"{shlex.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    with open(project / name / "results.csv") as f:
        scores = [float(row[metric]) * 100 for row in csv.DictReader(f)]
    return max(scores), scores[-1], result.stdout


def place_as_torchvision_weights(checkpoint, path):
    """Save a checkpoint's ResNet-18 as torchvision's resnet18 file would hold it: a plain state_dict with a
    1,000-class head (random, as the classes differ), at path."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["model"]
    model = torchvision.models.resnet18(num_classes=1000)
    state = {**state, "fc.weight": model.fc.weight.detach(), "fc.bias": model.fc.bias.detach()}
    model.load_state_dict(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--per-class", type=int, default=8, help="training images per class of the digits 5-9")
    parser.add_argument("--multilabel", action="store_true", help="multilabel-photos.yaml on collages of digits 5-9")
    parser.add_argument("--images", type=int, default=50, help="--multilabel: training collages")
    parser.add_argument("--finetune", nargs="*", default=[], help="more recipe overrides for the fine-tuned runs")
    parser.add_argument("--pretrained", type=Path, help="the pretraining's best.pt: reused if there, else kept there")
    args = parser.parse_args()
    start, digits = time.time(), dataset_root("digits")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        env = {**os.environ, "TORCH_HOME": str(tmp / "torch")}
        pretrain_data = orientations(digits, tmp / "digits0-4", "01234")
        task = multilabel_task(tmp, args.images) if args.multilabel else single_label_task(tmp, digits, args.per_class)
        pretrained, best = pretrain(pretrain_data, tmp, env, args.pretrained)
        weights = torchvision_weights("resnet18", "IMAGENET1K_V1")
        os.environ["TORCH_HOME"] = env["TORCH_HOME"]  # cache_path() reads it, as torch.hub does
        place_as_torchvision_weights(pretrained, cache_path(weights))
        print(f"pretrained on the digits 0-4 in 8 orientations: val top-1 {best:.2f}%; placed as {weights} at "
              f"{cache_path(weights).relative_to(tmp)} under a temporary TORCH_HOME\n", flush=True)
        variants = {**{name: ["model.weights=IMAGENET1K_V1", *extra, *args.finetune]
                       for name, extra in task["tuned"].items()}, **SCRATCH}
        rows = []
        for seed in args.seeds:
            common = [f"data.name={task['data']}", *task["overrides"], f"seed={seed}"]
            results = {name: run([*common, *extra], tmp / "runs", f"run{i}-{seed}", env, task["recipe"],
                                 task["metric"]) for i, (name, extra) in enumerate(variants.items())}
            rows.append((seed, [result[:2] for result in results.values()]))
            print(f"seed {seed}: " + ", ".join(f"{name} {result[0]:.2f}%" for name, result in results.items()),
                  flush=True)
        tuned_log = next(iter(results.values()))[2]
        print_summary(task, list(variants), rows, tuned_log, time.time() - start)


def pretrain(data, tmp, env, keep=None):
    """(the pretraining's best.pt, its val top-1 in %): ResNet-18 trained on data, or the checkpoint at keep from an
    earlier run (trained the same way); a new one is copied to keep where given."""
    if keep and keep.is_file():
        return keep, torch.load(keep, map_location="cpu", weights_only=True)["best_score"] * 100
    best, _, _ = run([f"data.name={data}", *DIGITS, *PRETRAIN], tmp / "runs", "pretrain", env)
    checkpoint = tmp / "runs" / "pretrain" / "weights" / "best.pt"
    if keep:
        keep.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(checkpoint, keep)
    return checkpoint, best


def single_label_task(tmp, digits, per_class):
    """folder.yaml on per_class training images of each of the digits 5-9 (all their val images)."""
    few = subset(digits, tmp / f"digits5-9-{per_class}", "56789", per_class)
    val_images = sum(1 for _ in (few / "val").rglob("*.png"))
    return {"recipe": "folder.yaml", "metric": "val/top1", "data": few, "overrides": [*DIGITS, *FINETUNE],
            "tuned": {"fine-tuned from IMAGENET1K_V1": []},
            "what": f"{5 * per_class} training images ({per_class} per class of the digits 5-9), {val_images} val "
                    f"images; best val top-1 of each run (last epoch's)"}


def multilabel_task(tmp, images):
    """multilabel-photos.yaml on images collages of 1 to 3 of the digits 5-9 (VAL_COLLAGES to validate on), as it
    is (whole images) and with crops."""
    root = tmp / f"collages5-9-{images}"
    write_multidigits(root, classes=(5, 6, 7, 8, 9), images={"train": images, "val": VAL_COLLAGES},
                      digits_per_image=(1, 2, 3))
    return {"recipe": "multilabel-photos.yaml", "metric": "val/map", "data": root,
            "overrides": [*COLLAGES, f"train.batch_size={images // 10}"],  # 10 steps an epoch, as FINETUNE
            "tuned": {"fine-tuned from IMAGENET1K_V1": [], "fine-tuned, crops of 60-100%": ["data.scale=[0.6,1.0]"]},
            "what": f"{images} training collages of 1 to 3 of the digits 5-9, {VAL_COLLAGES} val collages; best val "
                    f"mAP of each run (last epoch's)"}


def print_summary(task, columns, rows, tuned_log, seconds):
    """The table over seeds, the fine-tuned run's log lines about its weights, and the overrides."""
    print(f"\n{task['recipe']}: {task['what']}:\n")
    print(f"| seed | {' | '.join(columns)} |\n|{' --- |' * (1 + len(columns))}")
    for seed, runs in rows:
        print(f"| {seed} | " + " | ".join(f"{best:.2f}% ({last:.2f}%)" for best, last in runs) + " |")
    means = [sum(runs[i][0] for _, runs in rows) / len(rows) for i in range(len(columns))]
    print("| mean | " + " | ".join(f"{m:.2f}%" for m in means) + " |\n")
    print("fine-tuned run's log:\n" + "\n".join(line for line in tuned_log.splitlines()
                                                if line.startswith(("model.weights", "model:", "fine-tuning:"))))
    print(f"\nrecipe overrides: data {shlex.join(task['overrides'])}; pretraining {shlex.join(DIGITS + PRETRAIN)}; "
          f"{seconds:.0f}s in all")


if __name__ == "__main__":
    main()
