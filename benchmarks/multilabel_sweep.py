"""The multi-label recipe over seeds and process counts: each run's best val mAP (best.pt's), and whether val.py,
run on that best.pt as one process, reproduces it.

Every (seed, N) launches `torchrun --nproc_per_node=N train.py --recipe multilabel.yaml seed=S`, then `python val.py
--weights .../best.pt`, and prints a table of the best mAP (%), the spread of each row and of all runs, and the
runs whose mAP val.py did not reproduce to results.csv's six digits (exit code 1 if any, or if the spread of all
runs is --max-spread points or more).

    python benchmarks/multilabel_sweep.py [--seeds 0-4] [--nprocs 1 2 3] [key=value ...]
"""

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.digits_sweep import seed_range  # noqa: E402


def best_map(nproc, seed, overrides):
    """(best.pt's val mAP as results.csv holds it, val.py's mAP of best.pt) of one launch."""
    with tempfile.TemporaryDirectory() as project:
        run = Path(project) / "exp"
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={nproc}", "train.py", "--recipe", "multilabel.yaml",
                                 f"seed={seed}", f"project={project}", *overrides], cwd=ROOT, capture_output=True,
                                text=True)
        if result.returncode:
            sys.exit(f"seed {seed}, {nproc} process(es): failed\n{result.stderr[-3000:]}")
        with open(run / "results.csv") as f:
            rows = list(csv.DictReader(f))
        best = max(rows, key=lambda r: float(r["val/map"]))  # the first best: the epoch best.pt holds
        result = subprocess.run([sys.executable, "val.py", "--weights", str(run / "weights" / "best.pt"), "--project",
                                 project, "--name", "val"], cwd=ROOT, capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"val.py of seed {seed}, {nproc} process(es): failed\n{result.stderr[-3000:]}")
        measured = json.loads((Path(project) / "val" / "metrics.json").read_text())["map"]
        return float(best["val/map"]), f"{measured:.6g}" == best["val/map"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_range, default=seed_range("0-4"), help="e.g. 0-4 or 0,3,5")
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-spread", type=float, default=1.0, help="points of mAP all runs must lie within")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = parser.parse_args()
    print(f"best val mAP (%) of multilabel.yaml {' '.join(args.overrides)}; seeds {args.seeds}", flush=True)
    print(f"{'N':>2s}  " + " ".join(f"{s:>6d}" for s in args.seeds) + "  spread", flush=True)
    scores, unreproduced = [], []
    for nproc in args.nprocs:
        row = []
        for seed in args.seeds:
            score, reproduced = best_map(nproc, seed, args.overrides)
            row.append(score)
            if not reproduced:
                unreproduced.append(f"seed {seed} at N={nproc}")
        scores += row
        print(f"{nproc:2d}  " + " ".join(f"{100 * s:6.2f}" for s in row) + f"  {100 * (max(row) - min(row)):6.2f}",
              flush=True)
    spread = 100 * (max(scores) - min(scores))
    print(f"all {len(scores)} runs: {100 * min(scores):.2f}% to {100 * max(scores):.2f}%, a spread of {spread:.2f} "
          f"points ({'within' if spread < args.max_spread else 'NOT within'} {args.max_spread:g}); val.py "
          f"reproduced {len(scores) - len(unreproduced)} of {len(scores)}"
          f"{': not ' + ', '.join(unreproduced) if unreproduced else ''}")
    sys.exit(0 if spread < args.max_spread and not unreproduced else 1)


if __name__ == "__main__":
    main()
