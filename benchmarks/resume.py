"""What resuming and mid-epoch checkpoints cost, measured side by side in one run.

1. train.save_every_steps: the epoch time of train.py with mid-epoch saves against the same run without, sides
   alternated, as the ratio of median epoch times (results.csv's time/epoch, which includes the end-of-epoch
   save and validation); and, more precisely on a noisy machine, the median time of one save of the run's
   last.pt (written as train.py does: temporary file, fsync, rename) times the saves per epoch, as a share of
   the epoch.
2. Resume start-up: the time from launch to the first training step of a run resumed from a checkpoint against a
   fresh run of the same recipe (both import torch and build the data and model), alternated; the difference is
   what resuming adds (finding, loading and restoring the checkpoint).

    python benchmarks/resume.py [--rounds 3] [--every 5] [key=value ...]
"""

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from utils.checkpoint import save_checkpoint  # noqa: E402


def train(*args):
    """Run train.py; return (seconds from launch to its first training step, its output)."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "train.py", *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    first_step, lines = None, []
    for line in process.stdout:
        lines.append(line)
        if first_step is None and line.startswith("train:"):  # printed just before the first step
            first_step = time.perf_counter() - start
    if process.wait():
        sys.exit("".join(lines[-20:]))
    return first_step, "".join(lines)


def epoch_times(run_dir):
    with open(run_dir / "results.csv") as f:
        return [float(row["time/epoch"]) for row in csv.DictReader(f)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--every", type=int, default=5, help="train.save_every_steps of the saving side")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    recipe = ["--recipe", "cls.yaml", f"train.epochs={args.epochs}", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        epochs = {0: [], args.every: []}
        startup = {"fresh": [], "resumed": []}
        for r in range(args.rounds):
            for every in (epochs if r % 2 else list(epochs)[::-1]):  # alternate which side goes first
                name = f"r{r}s{every}"
                startup["fresh"].append(train(*recipe, f"train.save_every_steps={every}", f"project={project}",
                                              f"name={name}")[0])
                epochs[every] += epoch_times(project / name)[1:]  # epoch 1 warms up
            resumed = project / f"r{r}s0"
            startup["resumed"].append(train("--resume", resumed, f"train.epochs={args.epochs + 1}")[0])
        _, output = train(*recipe, "train.epochs=1", f"project={project}", "name=steps")
        checkpoint = torch.load(project / "steps" / "weights" / "last.pt", weights_only=True)
        save_times = []
        for _ in range(20):
            start = time.perf_counter()
            save_checkpoint(checkpoint, project / "save.pt")
            save_times.append(time.perf_counter() - start)
        size = (project / "save.pt").stat().st_size / 2**20
    steps = int(output.split(" steps per epoch")[0].rsplit(" ", 1)[-1])
    base, saving = statistics.median(epochs[0]), statistics.median(epochs[args.every])
    print(f"recipe {' '.join(recipe)}: {steps} steps per epoch, {args.rounds} rounds, epochs 2-{args.epochs} each")
    print(f"epoch time, no mid-epoch saves       {base:7.2f} s (median)")
    print(f"epoch time, save_every_steps={args.every:<4d}     {saving:7.2f} s (median)")
    print(f"ratio with / without: {saving / base:.3f}  (spread {min(epochs[args.every]) / max(epochs[0]):.3f}-"
          f"{max(epochs[args.every]) / min(epochs[0]):.3f})")
    save, saves = statistics.median(save_times), (steps - 1) // args.every
    print(f"one save of last.pt ({size:.1f} MiB)   {save * 1000:7.1f} ms (median of 20); {saves} mid-epoch saves per "
          f"epoch: {saves * save / base:.1%} of an epoch")
    fresh, resumed = statistics.median(startup["fresh"]), statistics.median(startup["resumed"])
    print(f"launch to first step, fresh run      {fresh:7.2f} s (median)")
    print(f"launch to first step, --resume       {resumed:7.2f} s (median)")
    print(f"resume adds {resumed - fresh:+.2f} s; ratio resumed / fresh: {resumed / fresh:.3f}")


if __name__ == "__main__":
    main()
