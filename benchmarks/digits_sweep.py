"""The README command's accuracy over seeds, process counts and CPU instruction sets: each run's last-epoch val top-1.

Every (seed, N, ISA) launches `torchrun --nproc_per_node=N train.py --recipe cls.yaml seed=S` with oneDNN limited to
the ISA (ONEDNN_MAX_CPU_ISA; 'default' leaves it alone), and prints a table of the last epoch's top-1, the lowest
of each row, how many runs missed 0, 1, 2, ... val images at the last and at the best epoch, the range of the
last epoch's val loss (a margin that moves less than top-1 from seed to seed), and whether every run reached
--min-top1 (exit code 1 if not).

    python benchmarks/digits_sweep.py [--seeds 0-9] [--nprocs 1 2 3] [--isas default AVX2] [key=value ...]
"""

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def launch(nproc, seed, isa, overrides):
    """results.csv's rows (dicts of floats) of one launch of the README command."""
    env = dict(os.environ)
    if isa != "default":
        env["ONEDNN_MAX_CPU_ISA"] = isa
    with tempfile.TemporaryDirectory() as project:
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={nproc}", "train.py", "--recipe", "cls.yaml", f"seed={seed}",
                                 f"project={project}", *overrides], cwd=ROOT, env=env, capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"seed {seed}, {nproc} process(es), {isa}: failed\n{result.stderr[-3000:]}")
        with open(Path(project) / "exp" / "results.csv") as f:
            return [{key: float(value) for key, value in row.items() if value} for row in csv.DictReader(f)]


def misses(top1, val_images=360):
    """How many of the digits' val images a top-1 missed."""
    return round(val_images * (1 - top1))


def tally(counts):
    """'0 (12), 1 (30), 2 (15); mean 1.05' for how many runs missed each number of images."""
    runs = ", ".join(f"{n} ({counts.count(n)})" for n in sorted(set(counts)))
    return f"{runs}; mean {sum(counts) / len(counts):.2f}"


def older_isa(cpuinfo="/proc/cpuinfo"):
    """An instruction set older than this CPU's best, for oneDNN to emulate an older CPU: AVX2 on an AVX-512
    machine, else SSE4.1."""
    try:
        flags = set(open(cpuinfo).read().split())
    except OSError:
        return "SSE41"
    return "AVX2" if "avx512f" in flags else "SSE41"


def seed_range(text):
    """'0-9' or '0,3,5' as a list of ints."""
    if "-" in text:
        first, last = map(int, text.split("-"))
        return list(range(first, last + 1))
    return [int(s) for s in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=seed_range, default=seed_range("0-9"), help="e.g. 0-9 or 0,3,5")
    parser.add_argument("--nprocs", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--isas", nargs="+", default=["default", older_isa()],
                        help="ONEDNN_MAX_CPU_ISA values (default: the machine's own and the one before it)")
    parser.add_argument("--min-top1", type=float, default=0.988, help="the bar every run's last epoch must reach")
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = parser.parse_args()
    if overrides := [isa for isa in args.isas if "=" in isa]:  # `--isas AVX2 train.epochs=8` takes both as ISAs
        parser.error(f"--isas {' '.join(overrides)}: recipe overrides go before --isas or after --")
    print(f"last-epoch val top-1 (%) of cls.yaml {' '.join(args.overrides)}; seeds {args.seeds}", flush=True)
    print(f"{'ISA':10s} {'N':>2s}  " + " ".join(f"{s:>6d}" for s in args.seeds) + "  lowest", flush=True)
    runs = []  # each run's results.csv rows
    for isa in args.isas:
        for nproc in args.nprocs:
            row = [launch(nproc, seed, isa, args.overrides) for seed in args.seeds]
            runs += row
            last = [run[-1]["val/top1"] for run in row]
            print(f"{isa:10s} {nproc:2d}  " + " ".join(f"{100 * t:6.2f}" for t in last) + f"  {100 * min(last):6.2f}",
                  flush=True)
    lowest = min(run[-1]["val/top1"] for run in runs)
    losses = [run[-1]["val/loss"] for run in runs]
    print(f"val images missed, of 360 (runs): last epoch {tally([misses(run[-1]['val/top1']) for run in runs])}")
    print(f"{'best epoch':>44s} {tally([misses(max(epoch['val/top1'] for epoch in run)) for run in runs])}")
    print(f"last-epoch val loss {min(losses):.4f} to {max(losses):.4f}")
    print(f"lowest of all {len(runs)} runs: {lowest:.2%} "
          f"({'every run' if lowest >= args.min_top1 else 'NOT every run'} >= {args.min_top1:.1%})")
    sys.exit(0 if lowest >= args.min_top1 else 1)


if __name__ == "__main__":
    main()
