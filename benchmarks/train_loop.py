"""Training throughput of train.py's epoch loop against a bare PyTorch loop, in one process, alternating.

Both sides train the same model on the same data, transforms, batch size and precision; the bare side is the
shortest correct loop (DataLoader, normalise, forward under autocast, backward, step). Epochs alternate between
the sides so a noisy machine slows both alike; the ratio of median images/s is what to read, not the absolute
numbers. With train.precision=bf16 (or fp16), train.py's loop is also timed in fp32, for the speed-up.

    python benchmarks/train_loop.py [--rounds 5] [key=value ...]
    python benchmarks/train_loop.py train.precision=bf16 data.img_size=32 model.width=64   # bf16 on a CPU
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.datasets import build_dataloader, build_datasets, dataset_root, set_epoch  # noqa: E402
from data.transforms import normalizer, train_transforms, val_transforms  # noqa: E402
from models import build_model  # noqa: E402
from train import TrainState, train_one_epoch  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402
from utils.stopping import StopVote  # noqa: E402
from utils.torch_utils import autocast_dtype, grad_scaler, init_seeds, set_threads  # noqa: E402


def bare_epoch(model, loader, normalize, criterion, optimizer, dtype):
    """The reference: the least a correct training epoch does."""
    model.train()
    for images, targets in loader:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = criterion(model(normalize(images)), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return len(loader.dataset)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="cls.yaml")
    parser.add_argument("--rounds", type=int, default=5, help="epochs per side, alternating")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_recipe(args.recipe, args.overrides)
    device = torch.device("cpu")
    dtype = autocast_dtype(cfg.train.precision, device)
    threads, workers = set_threads(cfg.data.workers)
    init_seeds(cfg.seed)
    train_set, _ = build_datasets(dataset_root(cfg.data.name), train_transforms(cfg.data), val_transforms(cfg.data))
    normalize = normalizer(cfg.data, device)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    classes = len(train_set.classes)

    bare_model = build_model(cfg.model, classes)
    bare_optimizer = build_optimizer(bare_model, cfg.optim)
    bare_loader = DataLoader(train_set, batch_size=cfg.train.batch_size, shuffle=True, num_workers=workers)

    def ours(dtype):
        """train.py's epoch loop on its own model, loader and schedule, at autocast dtype."""
        model = build_model(cfg.model, classes)
        optimizer = build_optimizer(model, cfg.optim)
        loader = build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, device)
        state = TrainState(model, optimizer, build_scheduler(optimizer, cfg.sched, args.rounds + 1, len(loader)),
                           grad_scaler(device, dtype))
        summed = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing, reduction="sum")  # as train.py

        def run(epoch):
            set_epoch(loader, epoch)
            state.step = 0
            with StopVote(device) as vote:
                return train_one_epoch(state, loader, normalize, None, summed, dtype, cfg, epoch, vote, None)[0]
        return run

    sides = {"bare PyTorch loop": lambda epoch: bare_epoch(bare_model, bare_loader, normalize, criterion,
                                                           bare_optimizer, dtype),
             "train.py epoch loop": ours(dtype)}
    if dtype is not None:  # what the recipe's precision buys over fp32
        sides["train.py in fp32"] = ours(None)
    rates = {name: [] for name in sides}
    for epoch in range(args.rounds + 1):  # round 0 warms every side up and is not counted
        order = list(sides) if epoch % 2 else list(sides)[::-1]  # alternate which side goes first
        for name in order:
            start = time.perf_counter()
            images = sides[name](epoch)
            if epoch:
                rates[name].append(images / (time.perf_counter() - start))
    median = {name: statistics.median(values) for name, values in rates.items()}
    print(f"recipe {args.recipe} {' '.join(args.overrides)}: {cfg.model.name}, {cfg.data.img_size}px, batch "
          f"{cfg.train.batch_size}, {cfg.train.precision}, {threads} thread(s), {workers} worker(s), "
          f"{args.rounds} epochs per side")
    for name, rate in median.items():
        print(f"{name:20s}{rate:8.0f} img/s (median)")
    print(f"ratio train.py / bare: {median['train.py epoch loop'] / median['bare PyTorch loop']:.3f}")
    if dtype is not None:
        print(f"ratio train.py {cfg.train.precision} / fp32: "
              f"{median['train.py epoch loop'] / median['train.py in fp32']:.3f}")


if __name__ == "__main__":
    main()
