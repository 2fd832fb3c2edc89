"""Train an image classifier from a recipe, as one process or many under torchrun.

Usage:
    python train.py --recipe cls.yaml
    torchrun --nproc_per_node=2 train.py --recipe cls.yaml optim.lr=0.05 train.epochs=3
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn
from tqdm import tqdm

from data.datasets import build_dataloader, build_datasets, check_shareable, dataset_root, set_epoch
from data.sampler import epoch_steps
from data.transforms import normalizer, train_transforms, val_transforms
from models import build_model, check_input_size
from utils.checkpoint import save_checkpoint
from utils.config import RecipeError, load_recipe, recipe_to_yaml
from utils.general import LOGGER, UsageError, colorstr, increment_path
from utils.loggers import RunLogger, epoch_summary
from utils.metrics import evaluate
from utils.optim import build_optimizer, build_scheduler
from utils.torch_utils import (RANK, WORLD_SIZE, all_reduce_sum, autocast, autocast_dtype, broadcast_buffers,
                               broadcast_object, broadcast_optimizer_state, cleanup_distributed, de_parallel,
                               grad_scaler, init_seeds, join_uneven_inputs, select_device, set_threads,
                               setup_distributed, smart_DDP)


def parse_args(argv=None):
    """--recipe NAME and key=value overrides."""
    parser = argparse.ArgumentParser(description="Train an image classifier from a recipe.")
    parser.add_argument("--recipe", default="cls.yaml", help="recipe path, or a name in recipes/ (default: cls.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. optim.lr=0.05")
    return parser.parse_args(argv)


def main(argv=None):
    """Load and check the recipe before any work, then train; bad input exits with code 2 and a one-line reason."""
    args = parse_args(argv)
    try:
        cfg = load_recipe(args.recipe, args.overrides)
        device = select_device(cfg.device)
        dtype = autocast_dtype(cfg.train.precision, device)
        setup_distributed(device)
        try:
            return train(cfg, device, dtype)
        finally:
            cleanup_distributed()
    except UsageError as e:
        everywhere = isinstance(e, RecipeError)  # a recipe error is the same on every rank: say it once
        if RANK == 0 or not everywhere:
            print(f"{'' if everywhere or WORLD_SIZE == 1 else f'[rank {RANK}] '}train.py: error: {e}", file=sys.stderr)
        sys.exit(2)


def train(cfg, device, dtype):
    """The whole run: data, model, optimizer, then per epoch train, validate, log and save; returns best top-1."""
    rank_batch = cfg.train.batch_size // WORLD_SIZE  # the recipe check made sure it divides
    threads, workers = set_threads(cfg.data.workers)
    init_seeds(cfg.seed + RANK, cfg.train.deterministic)  # own dropout stream per rank; DDP copies rank 0's init
    train_set, val_set = build_datasets(dataset_root(cfg.data.name), train_transforms(cfg.data),
                                        val_transforms(cfg.data))
    check_shareable(train_set)
    classes = train_set.classes
    train_loader = build_dataloader(train_set, rank_batch, True, cfg.seed, workers, device)
    val_loader = build_dataloader(val_set, rank_batch, False, cfg.seed, workers, device)
    steps = epoch_steps(len(train_set), rank_batch, WORLD_SIZE)[0]
    normalize = normalizer(cfg.data, device)

    model = build_model(cfg.model, len(classes)).to(device)
    check_input_size(model, cfg.model.name, cfg.data.img_size, device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.sched, cfg.train.epochs, steps)
    scaler = grad_scaler(device, dtype)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing)
    if WORLD_SIZE > 1:
        model = smart_DDP(model, device)

    LOGGER.info(f"{colorstr('train:')} {WORLD_SIZE} process(es) on {device.type}, {threads} thread(s) and "
                f"{workers} worker(s) each; {len(train_set)} train / {len(val_set)} val images, {len(classes)} "
                f"classes; {cfg.model.name} ({sum(p.numel() for p in model.parameters()):,} parameters); "
                f"batch {cfg.train.batch_size} ({rank_batch} per process), {steps} steps per epoch")
    run_dir = make_run_dir(cfg)  # only now: a run that fails on its data or model leaves no directory behind
    logger = RunLogger(run_dir, recipe_to_yaml(cfg)) if RANK == 0 else None
    best_top1, best_epoch, start = -1.0, 0, time.time()
    for epoch in range(cfg.train.epochs):
        epoch_start = time.time()
        set_epoch(train_loader, epoch)
        show = (lambda images: logger.log_images("train/batch", images[:64] / 255)) if logger and epoch == 0 else None
        train_loss, images_seen = train_one_epoch(model, train_loader, normalize, criterion, optimizer, scheduler,
                                                  scaler, device, dtype, cfg, epoch, show)
        train_time = time.time() - epoch_start
        broadcast_buffers(de_parallel(model))  # every rank validates rank 0's BatchNorm statistics, as saved
        metrics = evaluate(de_parallel(model), val_loader, normalize, len(classes), device, dtype)
        metrics.update({"epoch": epoch + 1, "train/loss": train_loss, "lr": optimizer.param_groups[0]["lr"],
                        "epoch_time": time.time() - epoch_start, "train/img_s": images_seen / train_time})
        improved = metrics["val/top1"] > best_top1
        if improved:
            best_top1, best_epoch = metrics["val/top1"], epoch + 1
        if RANK == 0:
            logger.log_epoch(metrics)
            LOGGER.info(epoch_summary(metrics, cfg.train.epochs))
            state = checkpoint_state(model, optimizer, scheduler, scaler, epoch + 1, best_top1, classes, cfg)
            save_checkpoint(state, run_dir / "weights" / "last.pt")
            if improved:
                save_checkpoint(state, run_dir / "weights" / "best.pt")
    if RANK == 0:
        logger.close()
        LOGGER.info(f"\n{cfg.train.epochs} epochs in {time.time() - start:.1f}s. Results saved to "
                    f"{colorstr('bold', str(run_dir))}\nBest val top-1 {best_top1:.2%} at epoch {best_epoch}: "
                    f"{run_dir / 'weights' / 'best.pt'}\nView the run: tensorboard --logdir {run_dir.parent}")
    return best_top1


def train_one_epoch(model, loader, normalize, criterion, optimizer, scheduler, scaler, device, dtype, cfg, epoch,
                    show_batch=None):
    """One pass over this rank's share of the data; returns (mean train loss, images seen) over all ranks."""
    model.train()
    loss_sum, seen = torch.zeros((), device=device), 0
    bar = tqdm(loader, desc=f"{epoch + 1}/{cfg.train.epochs}", disable=True if RANK else None, leave=False)
    start = last_shown = time.monotonic()
    with join_uneven_inputs(model):  # shares differ by a sample, so ranks may take one step fewer
        for images, targets in bar:
            images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            if show_batch:
                show_batch(images)
                show_batch = None
            images = normalize(images)
            with autocast(device, dtype):
                loss = criterion(model(images), targets)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if cfg.optim.clip_grad_norm:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            loss_sum += loss.detach() * len(targets)
            seen += len(targets)
            if not bar.disable and time.monotonic() - last_shown > 0.5:  # .item() syncs: at most twice a second
                last_shown = time.monotonic()
                rate = seen * WORLD_SIZE / (last_shown - start)
                bar.set_postfix_str(f"loss {loss_sum.item() / seen:.4f}  {rate:.0f} img/s", refresh=False)
    most, fewest = epoch_steps(len(loader.dataset), loader.batch_size, WORLD_SIZE)
    for _ in range(most - len(loader)):  # a rank whose share ran out a step early keeps the schedule in step
        scheduler.step()
    if fewest < most:  # ... but missed that step's optimizer update; join() synced the weights, this the state
        broadcast_optimizer_state(optimizer)
    loss_sum, seen = all_reduce_sum(torch.stack([loss_sum.double(), torch.tensor(seen, device=device).double()]))
    return (loss_sum / seen).item(), int(seen)


def make_run_dir(cfg):
    """Rank 0 claims project/name (exp, exp2, ...) and saves the resolved recipe there; every rank gets the path."""
    run_dir = None
    if RANK == 0:
        try:
            run_dir = increment_path(Path(cfg.project) / cfg.name, mkdir=True)
            (run_dir / "weights").mkdir()
            (run_dir / "recipe.yaml").write_text(recipe_to_yaml(cfg))
        except OSError as e:
            raise UsageError(f"project={cfg.project!r} name={cfg.name!r}: cannot create the run directory: "
                             f"{e}") from None
    return Path(broadcast_object(str(run_dir)))


def checkpoint_state(model, optimizer, scheduler, scaler, epoch, best_top1, classes, cfg):
    """Everything a checkpoint holds, as plain state_dicts and values (loadable with weights_only=True)."""
    return {"model": de_parallel(model).state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
            "best_top1": best_top1, "classes": list(classes), "recipe": OmegaConf.to_container(cfg)}


if __name__ == "__main__":
    main()
