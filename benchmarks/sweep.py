"""A sweep on the digits against cls.yaml: tune.py searches spaces/cls.yaml (lr, weight decay, label smoothing,
epochs) for --trials trials, then the best trial's recipe (best.yaml) and cls.yaml each train seeds 0 to --seeds - 1;
prints each one's best val top-1 per seed and their means, and what a trial costs beside its training: its time in
the sweep less its epochs' (results.csv's time/epoch), against the same for a plain train.py launch of its recipe.

The sweep picks its trial on seed 0's val images, which the seeds' runs are scored on too: the digits have no third
split, so the comparison favours the sweep by what choosing on those images is worth.

    python benchmarks/sweep.py [--trials 20] [--seeds 5] [--keep DIR]
"""

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    """Run a script of the repository with python; returns its wall time in seconds."""
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--keep", help="a folder to keep the sweep and the runs in (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(args.keep or tmp)
        wall = run("tune.py", "--recipe", "cls.yaml", "--space", "spaces/cls.yaml", "--trials", args.trials,
                   "--project", project / "tune")
        sweep = project / "tune" / "cls-cls"
        with open(sweep / "trials.csv", newline="") as f:
            trials = list(csv.DictReader(f))
        # Like for like: trials that ran to their end, against plain launches of the best trial's recipe
        finished = [t for t in trials if t["state"] == "COMPLETE"]
        outside = [float(t["seconds"]) - epochs_seconds(sweep / f"trial-{t['trial']}") for t in finished]
        plain = [run("train.py", "--recipe", sweep / "best.yaml", f"project={project}", f"name=plain{k}") -
                 epochs_seconds(project / f"plain{k}") for k in range(3)]
        print(f"sweep: {len(trials)} trials ({sum(t['state'] == 'PRUNED' for t in trials)} pruned) in {wall:.0f} s; "
              f"time beside the epochs: a finished trial's median {statistics.median(outside):.1f} s (range "
              f"{min(outside):.1f}-{max(outside):.1f}, {len(finished)} trials), a plain train.py launch's median "
              f"{statistics.median(plain):.1f} s (range {min(plain):.1f}-{max(plain):.1f}, 3 launches)")
        print((sweep / "best.yaml").read_text().strip())
        scores = {"best.yaml": [], "cls.yaml": []}
        for seed in range(args.seeds):
            for name, recipe in (("best.yaml", sweep / "best.yaml"), ("cls.yaml", "cls.yaml")):
                run("train.py", "--recipe", recipe, f"seed={seed}", f"project={project}", f"name={name}-{seed}")
                scores[name].append(best_top1(project / f"{name}-{seed}"))
        print("| seed | best.yaml | cls.yaml |\n| --- | --- | --- |")
        for seed in range(args.seeds):
            print(f"| {seed} | {scores['best.yaml'][seed]:.2%} | {scores['cls.yaml'][seed]:.2%} |")
        print(f"| mean | {statistics.mean(scores['best.yaml']):.2%} | {statistics.mean(scores['cls.yaml']):.2%} |")


if __name__ == "__main__":
    main()
