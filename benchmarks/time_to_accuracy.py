"""Wall time of the README's training command, from launch to exit, against the launcher's own start-up floor.

The floor is a torchrun of the same number of processes that only imports torch and torchvision and joins the
gloo process group: what any PyTorch training launched this way pays before its first step. Each side runs
--rounds times, alternated, and the medians are compared; every training run must end at the recipe's
accuracy (--min-top1) or the script fails. Also compares 1 process with 2, and the default precision and memory
format (auto: bf16 and channels_last where the CPU computes bf16 natively) with fp32 and contiguous, side by side.

    python benchmarks/time_to_accuracy.py [--rounds 3] [--min-top1 0.99] [key=value ...]
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
FP32 = ["train.precision=fp32", "train.channels_last=false"]  # what auto is not, where it picks bf16
FLOOR = ("import torch, torchvision, torch.distributed as dist; dist.init_process_group('gloo'); "
         "dist.barrier(); dist.destroy_process_group()")


def launch(nproc, *args):
    """Seconds from launching `torchrun --nproc_per_node=nproc ARGS` to its exit; fails loudly on an error."""
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={nproc}", *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"{' '.join(map(str, args))} failed:\n{result.stderr[-3000:]}")
    return seconds


def floor(nproc):
    """The launcher's start-up floor at nproc processes."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(FLOOR)
    return launch(nproc, f.name)


def training(nproc, overrides, min_top1):
    """Wall time of train.py on cls.yaml with overrides; checks the last epoch's val top-1."""
    with tempfile.TemporaryDirectory() as project:
        seconds = launch(nproc, "train.py", "--recipe", "cls.yaml", f"project={project}", *overrides)
        with open(Path(project) / "exp" / "results.csv") as f:
            top1 = float(list(csv.DictReader(f))[-1]["val/top1"])
    if top1 < min_top1:
        sys.exit(f"train.py {' '.join(overrides)} at {nproc} process(es) ended at {top1:.2%} val top-1, below "
                 f"{min_top1:.1%}")
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each side, alternated (medians compared)")
    parser.add_argument("--min-top1", type=float, default=0.99, help="val top-1 every training run must end at")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every training run")
    args = parser.parse_args()
    sides = {"floor, 2 processes": lambda: floor(2),
             "train.py, 2 processes": lambda: training(2, args.overrides, args.min_top1),
             "train.py, 1 process": lambda: training(1, args.overrides, args.min_top1),
             "train.py, 2 processes, fp32": lambda: training(2, [*args.overrides, *FP32], args.min_top1),
             "floor, 1 process": lambda: floor(1)}
    times = {name: [] for name in sides}
    for round_ in range(args.rounds):
        for name in list(sides)[:: 1 if round_ % 2 == 0 else -1]:  # alternate the order
            times[name].append(sides[name]())
            print(f"round {round_ + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"\nmedians of {args.rounds}, launch to exit (all training runs ended at >= {args.min_top1:.1%} val top-1):")
    for name in sides:
        print(f"  {name:30s} {median[name]:6.1f} s  (spread {min(times[name]):.1f}-{max(times[name]):.1f})")
    print(f"time to accuracy / start-up floor, 2 processes: "
          f"{median['train.py, 2 processes'] / median['floor, 2 processes']:.2f}x")
    print(f"time to accuracy / start-up floor, 1 process:   "
          f"{median['train.py, 1 process'] / median['floor, 1 process']:.2f}x")
    print(f"auto / fp32 at 2 processes: {median['train.py, 2 processes'] / median['train.py, 2 processes, fp32']:.2f}")
    print(f"1 process / 2 processes:    {median['train.py, 1 process'] / median['train.py, 2 processes']:.2f}")


if __name__ == "__main__":
    main()
