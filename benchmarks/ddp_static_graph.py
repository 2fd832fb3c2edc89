"""DDP with and without static_graph, timed side by side under torchrun: the training steps of the recipe's model
on random images, rounds alternating between the two, and the ratio of median step times.

    torchrun --nproc_per_node=2 benchmarks/ddp_static_graph.py [--rounds 6] [--steps 30] [key=value ...]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build_model  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.optim import build_optimizer  # noqa: E402
from utils.torch_utils import (RANK, WORLD_SIZE, cleanup_distributed, set_threads, setup_distributed,  # noqa: E402
                               smart_DDP)


def step_times(model, optimizer, images, targets, steps):
    """Seconds per training step (median of `steps`, after 3 warm-up steps)."""
    criterion, times = nn.CrossEntropyLoss(), []
    for i in range(steps + 3):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        criterion(model(images), targets).backward()
        optimizer.step()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="cls.yaml")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    setup_distributed()
    cfg = load_recipe(args.recipe, args.overrides)
    set_threads(0)
    size, batch = cfg.data.img_size, cfg.train.batch_size // WORLD_SIZE
    images, targets = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    sides = {}
    for static in (False, True):
        torch.manual_seed(0)
        model = smart_DDP(build_model(cfg.model, 10), torch.device("cpu"), static_graph=static)
        sides[static] = (model, build_optimizer(model, cfg.optim))
    times = {False: [], True: []}
    for r in range(args.rounds):
        for static in ((False, True) if r % 2 else (True, False)):
            times[static].append(step_times(*sides[static], images, targets, args.steps))
    if RANK == 0:
        plain, static = statistics.median(times[False]), statistics.median(times[True])
        print(f"recipe {args.recipe} {' '.join(args.overrides)}: {cfg.model.name}, {size}px, {batch} per process, "
              f"{WORLD_SIZE} processes, {args.rounds} rounds of {args.steps} steps")
        print(f"DDP                   {plain * 1000:7.2f} ms/step (median)")
        print(f"DDP static_graph      {static * 1000:7.2f} ms/step (median)")
        print(f"ratio static / plain: {static / plain:.3f} (rounds: "
              f"{', '.join(f'{s / p:.2f}' for s, p in zip(times[True], times[False]))})")
    cleanup_distributed()


if __name__ == "__main__":
    main()
