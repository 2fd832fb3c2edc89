"""What a checkpoint costs: save and load time as a share of an epoch, for small and large models.

For each model, one process measures, alternating, (a) the time of a training step (forward, backward, SGD) on a
batch like the digits recipe's, upscaled to --img-size, and (b) the time to save and to load the state train.py
checkpoints (weights, optimizer momentum, schedule, scaler, position), written as train.py writes it: temporary
file, fsync, rename. An epoch is the recipe's steps per epoch times the median step; at the default interval a
checkpoint is saved once per epoch (last.pt, and best.pt when val top-1 improves).

    python benchmarks/checkpoint.py [--rounds 5] [--img-size 32] [--models convnet resnet18 resnet50]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import build_model, check_model_name  # noqa: E402
from utils.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402

STEPS_PER_EPOCH = 23  # digits: 1,437 training images in global batches of 64


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(name, img_size, rounds, folder):
    """(median step, save and load seconds, checkpoint MB) for model `name`."""
    cfg = load_recipe("cls.yaml", [f"model.name={name}", f"data.img_size={img_size}"], model_check=check_model_name)
    model = build_model(cfg.model, 10, img_size)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.sched, cfg.train.epochs, STEPS_PER_EPOCH)
    images = torch.randn(cfg.train.batch_size, 3, img_size, img_size)
    targets = torch.randint(0, 10, (cfg.train.batch_size,))
    criterion = torch.nn.CrossEntropyLoss()

    def step():
        optimizer.zero_grad(set_to_none=True)
        criterion(model(images), targets).backward()
        optimizer.step()
        scheduler.step()

    path = folder / f"{name}.pt"

    def save():
        save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                         "scheduler": scheduler.state_dict(), "scaler": {}, "epoch": 1, "step": 0,
                         "recipe": OmegaConf.to_container(cfg)}, path)

    step()  # warm-up: first-call allocations, momentum buffers created
    save()
    steps, saves, loads = [], [], []
    for _ in range(rounds):
        steps.append(timed(step))
        saves.append(timed(save))
        loads.append(timed(lambda: load_checkpoint(path)))
    return statistics.median(steps), statistics.median(saves), statistics.median(loads), path.stat().st_size / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--img-size", type=int, default=32)
    parser.add_argument("--models", nargs="+", default=["convnet", "resnet18", "resnet50"])
    args = parser.parse_args()
    print(f"batch 64 at {args.img_size}px, {torch.get_num_threads()} thread(s), {STEPS_PER_EPOCH} steps per epoch, "
          f"medians of {args.rounds}")
    print(f"{'model':10s} {'checkpoint':>10s} {'step':>8s} {'epoch':>8s} {'save':>8s} {'load':>8s} "
          f"{'save/epoch':>10s} {'load/epoch':>10s}")
    with tempfile.TemporaryDirectory(dir=ROOT) as folder:  # on the disk runs/ is on, not a memory-backed /tmp
        for name in args.models:
            step, save, load, mb = measure(name, args.img_size, args.rounds, Path(folder))
            epoch = step * STEPS_PER_EPOCH
            print(f"{name:10s} {mb:8.1f}MB {step:7.3f}s {epoch:7.2f}s {save:7.3f}s {load:7.3f}s "
                  f"{save / epoch:10.2%} {load / epoch:10.2%}")


if __name__ == "__main__":
    main()
