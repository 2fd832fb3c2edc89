"""Training throughput of train.py's epoch loop against a bare PyTorch loop, in one process, alternating.

Both sides train the same model on the same data, transforms and batch size; the bare side is the shortest
correct loop (DataLoader, normalise, forward, backward, step). Epochs alternate between the sides so a noisy
machine slows both alike; the ratio of median images/s is what to read, not the absolute numbers.

    python benchmarks/train_loop.py [--rounds 5] [key=value ...]
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

from data.datasets import build_dataloader, build_datasets, dataset_root  # noqa: E402
from data.transforms import normalizer, train_transforms, val_transforms  # noqa: E402
from models import build_model  # noqa: E402
from train import train_one_epoch  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402
from utils.torch_utils import grad_scaler, init_seeds, set_threads  # noqa: E402


def bare_epoch(model, loader, normalize, criterion, optimizer):
    """The reference: the least a correct training epoch does."""
    model.train()
    for images, targets in loader:
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
    threads, workers = set_threads(cfg.data.workers)
    init_seeds(cfg.seed)
    train_set, _ = build_datasets(dataset_root(cfg.data.name), train_transforms(cfg.data), val_transforms(cfg.data))
    normalize = normalizer(cfg.data, device)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    classes = len(train_set.classes)

    bare_model = build_model(cfg.model, classes)
    bare_optimizer = build_optimizer(bare_model, cfg.optim)
    bare_loader = DataLoader(train_set, batch_size=cfg.train.batch_size, shuffle=True, num_workers=workers)

    model = build_model(cfg.model, classes)
    optimizer = build_optimizer(model, cfg.optim)
    loader = build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, device)
    scheduler = build_scheduler(optimizer, cfg.sched, args.rounds + 1, len(loader))
    scaler = grad_scaler(device, None)

    def run_bare(epoch):
        return bare_epoch(bare_model, bare_loader, normalize, criterion, bare_optimizer)

    def run_ours(epoch):
        loader.sampler.set_epoch(epoch)
        return train_one_epoch(model, loader, normalize, criterion, optimizer, scheduler, scaler, device, None,
                               cfg, epoch)[1]

    rates = {"bare": [], "train.py": []}
    for epoch in range(args.rounds + 1):  # round 0 warms both up and is not counted
        sides = [("bare", run_bare), ("train.py", run_ours)]
        for name, run in sides if epoch % 2 else sides[::-1]:  # alternate which side goes first
            start = time.perf_counter()
            images = run(epoch)
            if epoch:
                rates[name].append(images / (time.perf_counter() - start))
    bare, ours = statistics.median(rates["bare"]), statistics.median(rates["train.py"])
    print(f"recipe {args.recipe} {' '.join(args.overrides)}: {cfg.model.name}, batch {cfg.train.batch_size}, "
          f"{threads} thread(s), {workers} worker(s), {args.rounds} epochs per side")
    print(f"bare PyTorch loop   {bare:8.0f} img/s (median)")
    print(f"train.py epoch loop {ours:8.0f} img/s (median)")
    print(f"ratio train.py / bare: {ours / bare:.3f}")


if __name__ == "__main__":
    main()
