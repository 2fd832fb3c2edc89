"""The README command's accuracy over seeds, process counts and CPU instruction sets: each run's last-epoch val top-1.

Every (seed, N, ISA) launches `torchrun --nproc_per_node=N train.py --recipe cls.yaml seed=S` with oneDNN limited to
the ISA (ONEDNN_MAX_CPU_ISA; 'default' leaves it alone), and prints a table of the last epoch's top-1, the lowest
of each row, and whether every run reached --min-top1 (exit code 1 if not).

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


def last_top1(nproc, seed, isa, overrides):
    """The last epoch's val top-1 of one launch of the README command."""
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
            return float(list(csv.DictReader(f))[-1]["val/top1"])


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
    parser.add_argument("--min-top1", type=float, default=0.992)
    parser.add_argument("overrides", nargs="*", help="recipe overrides for every run")
    args = parser.parse_args()
    print(f"last-epoch val top-1 (%) of cls.yaml {' '.join(args.overrides)}; seeds {args.seeds}", flush=True)
    print(f"{'ISA':10s} {'N':>2s}  " + " ".join(f"{s:>6d}" for s in args.seeds) + "  lowest", flush=True)
    lowest = 1.0
    for isa in args.isas:
        for nproc in args.nprocs:
            row = [last_top1(nproc, seed, isa, args.overrides) for seed in args.seeds]
            lowest = min(lowest, *row)
            print(f"{isa:10s} {nproc:2d}  " + " ".join(f"{100 * t:6.2f}" for t in row) + f"  {100 * min(row):6.2f}",
                  flush=True)
    print(f"lowest of all {len(args.isas) * len(args.nprocs) * len(args.seeds)} runs: {lowest:.2%} "
          f"({'every run' if lowest >= args.min_top1 else 'NOT every run'} >= {args.min_top1:.1%})")
    sys.exit(0 if lowest >= args.min_top1 else 1)


if __name__ == "__main__":
    main()
