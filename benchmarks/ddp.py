"""DDP's weak-scaling efficiency under each ddp option: what two processes train per second against what two that
never communicate train, at the same batch per process, one thread each, under one torchrun launch.

    torchrun --nproc_per_node=2 benchmarks/ddp.py [--rounds 5] [--steps N] [key=value ...]

Efficiency = (2 processes x 1 thread, DDP) / (2 x 1 process x 1 thread). The denominator is measured as two
processes that each train their own model at the same time as the DDP ones do (no DDP, no all-reduce), so both
sides share the cores and their memory bandwidth alike: it is what perfect scaling reaches on this machine, and
1 - efficiency is what DDP costs (gradient copies into buckets, the all-reduce where it is not hidden behind the
backward pass, waiting for the slower rank). Every side runs train.py's own train_step on random images, a fresh
model per side; the sides take turns step by step, in alternating order (round 0 warms up and is not counted);
each ratio is taken within a round, then its median and spread (min-max) over rounds are printed.

The all-reduce's share: dist.all_reduce of one flat buffer the size of all the gradients, timed on its own between
the sides, divided by the median DDP step. It is what communication would cost if none of it overlapped the
backward pass, an upper bound: DDP all-reduces bucket by bucket while backward still runs (on a CPU, gloo's
thread competes with the compute thread for the process's core, so little of it can overlap). Also timed in
bf16, the traffic of comm_hook=bf16.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build_model  # noqa: E402
from train import TrainState, train_step  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.distributed import cleanup_distributed, gather_object, setup_distributed  # noqa: E402
from utils.general import RANK, WORLD_SIZE  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402
from utils.precision import grad_scaler  # noqa: E402
from utils.torch_utils import smart_DDP  # noqa: E402

# name: (overrides, training steps per side and round): a second or two per side and round on one core
MODELS = {"convnet, 8 px (cls.yaml)": ([], 16), "resnet18, 32 px": (["model.name=resnet18", "data.img_size=32"], 3)}
ALONE = "2 x 1 process, no DDP"
# name: (recipe overrides, further DDP arguments)
OPTIONS = {"DDP defaults": ([], {}),
           "bucket_cap_mb=1": (["ddp.bucket_cap_mb=1"], {}),
           "bucket_cap_mb=25 (defaults)": (["ddp.bucket_cap_mb=25"], {}),  # a second build: its ratio is the noise
           "bucket_cap_mb=100": (["ddp.bucket_cap_mb=100"], {}),
           "gradient_as_bucket_view": (["ddp.gradient_as_bucket_view=true"], {}),
           "static_graph": ([], {"static_graph": True}),  # benchmark only: smart_DDP says why train.py leaves it off
           "comm_hook=bf16": (["ddp.comm_hook=bf16"], {}),
           "comm_hook=fp16": (["ddp.comm_hook=fp16"], {})}


def side(cfg, ddp_args=None):
    """A function that times one of train.py's train_steps on a fresh model (wrapped in DDP with the recipe's
    ddp options unless ddp_args is None) and returns this rank's seconds."""
    torch.manual_seed(0)
    model = build_model(cfg.model, 10, cfg.data.img_size)
    optimizer = build_optimizer(model, cfg.optim)
    if ddp_args is not None:
        model = smart_DDP(model, torch.device("cpu"), **cfg.ddp, **ddp_args)
    state = TrainState(model, optimizer, build_scheduler(optimizer, cfg.sched, 1, 10**6),
                       grad_scaler(torch.device("cpu"), None))
    batch = cfg.train.batch_size // WORLD_SIZE
    g = torch.Generator().manual_seed(RANK)
    size = cfg.data.img_size
    images, targets = torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)
    criterion = nn.CrossEntropyLoss(reduction="sum")

    def step():
        dist.barrier()  # both ranks start together
        start = time.perf_counter()
        train_step(state, images, targets, criterion, None, cfg, batch * WORLD_SIZE, cfg.train.accumulate)
        return time.perf_counter() - start
    return step


def all_reduce_seconds(numel, dtype, repeats):
    """Seconds per all-reduce of a flat buffer of numel elements of dtype, on its own."""
    buffer = torch.ones(numel, dtype=dtype)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer)
    return (time.perf_counter() - start) / repeats


def measure(recipe, steps, rounds):
    """Per round, every side's seconds for `steps` steps on this rank, and the all-reduce timings; recipe(*overrides)
    gives each side's recipe. The sides take turns step by step, in an order reversed at every step, so that a
    burst of load on the shared cores slows every side alike."""
    sides = {ALONE: side(recipe()), **{name: side(recipe(*o), a) for name, (o, a) in OPTIONS.items()}}
    cfg = recipe()
    numel = sum(p.numel() for p in build_model(cfg.model, 10, cfg.data.img_size).parameters())
    seconds = {name: [] for name in [*sides, "all-reduce fp32", "all-reduce bf16"]}
    for r in range(rounds + 1):
        total = dict.fromkeys(sides, 0.0)
        for i in range(steps):
            for name in (list(sides) if i % 2 else list(sides)[::-1]):
                total[name] += sides[name]()
        if r:
            for name in sides:
                seconds[name].append(total[name])
            seconds["all-reduce fp32"].append(all_reduce_seconds(numel, torch.float32, steps))
            seconds["all-reduce bf16"].append(all_reduce_seconds(numel, torch.bfloat16, steps))
    return seconds, numel


def spread(values, fmt="{:.2f}"):
    """'median (min-max)' of values."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(name, cfg, steps, rounds, numel, ranks):
    """Print each side's median step, efficiency and throughput against the defaults, per-round ratios' spread."""
    batch = cfg.train.batch_size // WORLD_SIZE
    alone = [sum(batch * steps / s[ALONE][r] for s in ranks) for r in range(rounds)]  # images/s, both processes
    rate = {n: [WORLD_SIZE * batch * steps / max(s[n][r] for s in ranks) for r in range(rounds)] for n in OPTIONS}
    print(f"\n{name}: {numel / 1e6:.2f}M parameters ({numel * 4 / 2**20:.1f} MB of gradients), {batch} images per "
          f"process, {steps} steps per side and round")
    print(f"  {'':28s}{'ms/step':>8s}  {'efficiency':18s}  {'throughput / defaults':18s}")
    alone_step = statistics.median(statistics.mean(s[ALONE][r] for s in ranks) for r in range(rounds)) / steps
    print(f"  {ALONE:28s}{alone_step * 1000:8.1f}  1 (the reference)")
    for n in OPTIONS:
        step = statistics.median(max(s[n][r] for s in ranks) for r in range(rounds)) / steps
        efficiency = spread([rate[n][r] / alone[r] for r in range(rounds)])
        print(f"  {n:28s}{step * 1000:8.1f}  {efficiency:18s}  "
              f"{spread([rate[n][r] / rate['DDP defaults'][r] for r in range(rounds)])}")
    ddp_step = statistics.median(max(s["DDP defaults"][r] for s in ranks) for r in range(rounds)) / steps
    for dtype in ("fp32", "bf16"):
        times = [max(s[f"all-reduce {dtype}"][r] for s in ranks) for r in range(rounds)]
        print(f"  all-reduce of the gradients alone, {dtype}: {spread([t * 1000 for t in times], '{:.1f}')} ms, "
              f"{spread([t / ddp_step for t in times], '{:.0%}')} of the DDP defaults' step")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="cls.yaml")
    parser.add_argument("--rounds", type=int, default=5, help="counted rounds, after one warm-up round")
    parser.add_argument("--steps", type=int, help="training steps per side and round (default: per model)")
    parser.add_argument("overrides", nargs="*", help="recipe key=value for every side and model")
    args = parser.parse_args()
    if WORLD_SIZE < 2:
        parser.error("run it under torchrun: torchrun --nproc_per_node=2 benchmarks/ddp.py")
    setup_distributed()
    torch.set_num_threads(1)  # the definition's 1 thread per process, whatever the cores
    if RANK == 0:
        print(f"{WORLD_SIZE} processes x 1 thread, recipe {' '.join([args.recipe, *args.overrides])}; {args.rounds} "
              f"rounds (+1 warm-up) of sides taking turns step by step; ratios are median (min-max) over rounds")
    for name, (overrides, steps) in MODELS.items():
        def recipe(*more, base=(*overrides, *args.overrides)):
            """The recipe of this model, with the side's overrides (validated as train.py validates them)."""
            return load_recipe(args.recipe, [*base, *more])
        steps = args.steps or steps
        seconds, numel = measure(recipe, steps, args.rounds)
        ranks = gather_object(seconds)
        if RANK == 0:
            report(name, recipe(), steps, args.rounds, numel, ranks)
    cleanup_distributed()


if __name__ == "__main__":
    main()
