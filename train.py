"""Train an image classifier from a recipe, as one process or many under torchrun.

Usage:
    python train.py --recipe cls.yaml
    torchrun --nproc_per_node=2 train.py --recipe cls.yaml optim.lr=0.05 train.epochs=3
    torchrun --nproc_per_node=2 train.py --resume runs/train/exp     # continue a stopped or crashed run exactly
"""

import argparse
import glob
import os
import shlex
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

from data.cache import batch_to
from data.datasets import build_dataloader, check_shareable, set_epoch, training_datasets
from data.mix import batch_mixer
from data.transforms import crop_spec, normalizer, val_size
from models import build_model, check_input_size, load_weights, read_weights
from utils.checkpoint import find_resume_checkpoint, load_training_checkpoint, run_dir_of, save_checkpoint
from utils.config import Recipe, check_resumable, load_recipe, load_resumed_recipe, parse_overrides, recipe_to_yaml
from utils.general import LOGGER, SharedError, UsageError, colorstr, increment_path, short_path
from utils.loggers import WRONG_SHOWN, RunLogger, epoch_summary
from utils.metrics import evaluate
from utils.optim import build_optimizer, build_scheduler
from utils.stopping import StopVote
from utils.torch_utils import (LOCAL_WORLD_SIZE, RANK, RESTART_COUNT, RUN_ID, WORLD_SIZE, all_reduce_sum, autocast,
                               autocast_dtype, broadcast_buffers, broadcast_module, broadcast_optimizer_state,
                               broadcast_scaler_state, cleanup_distributed, compiled, de_parallel, exit_on_error,
                               gather_object, grad_scaler, init_seeds, join_uneven_inputs, memory_format, model_ema,
                               no_sync, on_rank0, rng_states, select_device, set_device, set_rng_states, set_threads,
                               setup_distributed, smart_DDP, sync_batchnorm)


class Stopped(Exception):
    """The ranks agreed to stop on a signal (preemption, Ctrl-C) after saving a checkpoint."""

    def __init__(self, signum):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


@dataclass
class TrainState:
    """What an optimizer step needs and a checkpoint holds: the training objects and where the run is."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    epoch: int = 0  # epochs done
    step: int = 0  # steps done in the next epoch
    epoch_loss: tuple = (0.0, 0)  # (summed train loss, samples) of those steps, over all ranks
    logged_loss: tuple = (0.0, 0)  # epoch_loss when the loss was last logged (every train.log_every_steps steps)
    best_top1: float = -1.0
    best_epoch: int = 0
    ema: torch.optim.swa_utils.AveragedModel | None = None  # EMA of the weights (train.ema_decay), None when off


def parse_args(argv=None):
    """--recipe NAME or --resume [PATH], and key=value overrides."""
    parser = argparse.ArgumentParser(description="Train an image classifier from a recipe.")
    parser.add_argument("--recipe", help="recipe path, or a name in recipes/ (default: cls.yaml)")
    parser.add_argument("--resume", nargs="?", const="", metavar="PATH",
                        help="continue a run exactly: a checkpoint, a run directory, or (no PATH) the newest run "
                             "under project; the recipe comes from the checkpoint")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. optim.lr=0.05")
    args = parser.parse_args(argv)
    if args.resume and "=" in args.resume and not Path(args.resume).exists():  # `--resume key=value`: no PATH
        args.overrides.insert(0, args.resume)
        args.resume = ""
    return args


@record  # under torchrun, an unexpected error's traceback becomes the reported root cause of the failure
def main(argv=None):
    """Join the process group, settle the recipe and checkpoint, train; bad input exits with code 2 and one line,
    a stop signal with 128 + its number after saving."""
    args = parse_args(argv)
    # Stop signals are caught from here on: one that arrives while the ranks set up stops the run after its first
    # step, where the default action would kill this rank and leave the others failing at a collective.
    try:
        with StopVote() as vote:
            setup_distributed()
            try:
                cfg, run_dir, resume = prepare_run(args)
                vote.device = select_device(cfg.device)
                set_device(vote.device)
                dtype = autocast_dtype(cfg.train.precision, vote.device)
                return train(cfg, vote, dtype, run_dir, resume)
            finally:
                cleanup_distributed()
    except UsageError as e:
        exit_on_error("train.py", e)
    except Stopped as e:
        sys.exit(128 + e.signum)


def prepare_run(args):
    """(recipe, run directory or None for a new one, (checkpoint path, checkpoint) or None) for this launch: a new
    run, an explicit --resume, or this torchrun job's own run after torchrun restarted the workers."""
    if args.resume is not None:
        if args.recipe:
            raise SharedError("--resume takes the recipe from the checkpoint: leave out --recipe (key=value "
                              "overrides may still extend train.epochs, or change data.workers or device)")
        project = parse_overrides(args.overrides).get("project", Recipe.project)
        run_dir, path, ckpt = on_rank0(read_resume, args.resume, project)
        return load_resumed_recipe(ckpt["recipe"], args.overrides, source=path), Path(run_dir), (path, ckpt)
    cfg = load_recipe(args.recipe or "cls.yaml", args.overrides)
    if RESTART_COUNT:  # torchrun restarted the workers after a failure: continue this job's run where it stopped
        run_dir, path, ckpt = on_rank0(read_restarted_run, cfg.project, cfg.name)
        if ckpt is not None:
            check_resumable(load_resumed_recipe(ckpt["recipe"], source=path), cfg, "the recipe on restart")
        LOGGER.info(f"torchrun restart {RESTART_COUNT}: continuing {run_dir or 'a new run'} "
                    f"{'from ' + path if path else 'from the start'}")
        return cfg, run_dir and Path(run_dir), (path, ckpt) if ckpt is not None else None
    return cfg, None, None


def read_resume(resume, project):
    """Rank 0: (run directory, checkpoint path, checkpoint) for --resume."""
    path = find_resume_checkpoint(resume, project)
    ckpt = load_training_checkpoint(path)
    check_latest(path, ckpt)
    return str(run_dir_of(path)), str(path), ckpt


def read_restarted_run(project, name):
    """Rank 0: (run directory, last.pt path, checkpoint) of this torchrun job's run, Nones where there is none."""
    runs = [d for d in Path(project).glob(f"{glob.escape(name)}*") if (d / ".torchrun_id").is_file()]
    for run_dir in sorted(runs, key=lambda d: d.stat().st_mtime, reverse=True):
        if (run_dir / ".torchrun_id").read_text() == job_id():
            last = run_dir / "weights" / "last.pt"
            return (str(run_dir), str(last), load_training_checkpoint(last)) if last.exists() else (str(run_dir),
                                                                                                   None, None)
    return None, None, None


def train(cfg, vote, dtype, run_dir=None, resume=None):
    """The whole run: data, model, optimizer, then per epoch train, validate, log and save; returns best top-1.
    vote (a StopVote, entered) stops every rank together on a signal; its device is the training device."""
    device = vote.device
    threads, workers, workers_why = set_threads(cfg.data.workers, cfg.data.cache == "ram", device.type)
    init_seeds(cfg.seed + RANK, cfg.train.deterministic)  # own dropout stream per rank; DDP copies rank 0's init
    train_set, val_set = training_datasets(cfg.data, cfg.seed)
    classes = train_set.classes
    mix = batch_mixer(cfg.data, len(classes), cfg.seed)  # None unless MixUp or CutMix is on
    check_shareable(train_set, WORLD_SIZE, cfg.train.batch_size, cfg.data.drop_last, pairs=mix is not None)
    train_loader = build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, device,
                                    cfg.data.drop_last, pairs=mix is not None, repeats=cfg.data.repeats)
    val_loader = build_dataloader(val_set, cfg.train.batch_size, False, cfg.seed, workers, device)
    steps = train_loader.sampler.steps()[0]
    normalize = normalizer(cfg.data, device)

    model = build_model(cfg.model, len(classes), cfg.data.img_size)
    if cfg.model.weights:
        start_from(model, cfg.model.weights, len(classes))
    model = model.to(device, memory_format=memory_format(cfg.train.channels_last))
    check_input_size(model, cfg.model.name, cfg.data.img_size, device)
    if val_size(cfg.data) != cfg.data.img_size:
        check_input_size(model, cfg.model.name, val_size(cfg.data), device, key="data.val_img_size")
    model = sync_batchnorm(model, cfg.model.sync_bn, device)
    optimizer = build_optimizer(model, cfg.optim)
    state = TrainState(model, optimizer, build_scheduler(optimizer, cfg.sched, cfg.train.epochs, steps),
                       grad_scaler(device, dtype))
    if cfg.train.ema_decay:
        if cfg.train.ema_steps > cfg.train.epochs * steps:
            raise SharedError(f"train.ema_steps={cfg.train.ema_steps} is more than the run's {cfg.train.epochs * steps} "
                              f"steps ({cfg.train.epochs} epochs of {steps}): the EMA would never be updated; lower it")
        state.ema = model_ema(model, cfg.train.ema_decay, cfg.train.ema_steps, cfg.train.batch_size, cfg.train.epochs)
    if resume:
        restore(state, *resume, classes, cfg.train.epochs)
        if resume[1].get("train_images", len(train_set)) != len(train_set):
            LOGGER.warning(f"{resume[0]} was trained on {resume[1]['train_images']} training images, the data now "
                           f"holds {len(train_set)}: the order and the resumed epoch's remaining steps differ")
    if WORLD_SIZE > 1:
        state.model = smart_DDP(model, device, **cfg.ddp)  # after restore: DDP starts every rank from rank 0's weights
    state.model = compiled(state.model, cfg.train.compile)
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.train.label_smoothing, reduction="sum")

    LOGGER.info(f"{colorstr('train:')} {WORLD_SIZE} process(es) on {device.type}, {threads} thread(s) and "
                f"{workers} worker(s) each ({workers_why}); {len(train_set)} train / {len(val_set)} val images, "
                f"{len(classes)} classes; {cfg.model.name} ({sum(p.numel() for p in model.parameters()):,} "
                f"parameters) in {str(dtype or torch.float32).removeprefix('torch.')}; batch {cfg.train.batch_size} "
                f"({cfg.train.batch_size // WORLD_SIZE} per process), {steps} steps per epoch"
                f"{f'; resuming at epoch {state.epoch + 1}, step {state.step}' if resume else ''}")
    # Only now: a run that fails on its data or model leaves no directory behind.
    continuing = run_dir is not None  # resumed, or restarted by torchrun into this job's run
    run_dir = resumed_run_dir(run_dir, cfg) if continuing else make_run_dir(cfg)
    logger = RunLogger(run_dir, cfg, classes, (state.epoch, state.epoch * steps + state.step) if continuing else None
                       ) if RANK == 0 else None

    def save(*names, best_from_ema=False):  # all ranks call it; the events logged so far are flushed first
        if logger:
            logger.tb.flush()
        save_state(state, cfg, classes, len(train_set), [run_dir / "weights" / n for n in names], best_from_ema)
    start = time.time()
    loop_cfg = OmegaConf.to_object(cfg)  # a plain dataclass: the loop reads keys every step, ~60 us each from OmegaConf
    for epoch in range(state.epoch, cfg.train.epochs):
        epoch_start = time.time()
        set_epoch(train_loader, epoch, state.step)
        images_seen, stopped = train_one_epoch(state, train_loader, normalize, mix, criterion, dtype, loop_cfg, epoch,
                                               vote, save, logger, show_batch=not (epoch or state.step or resume))
        if stopped:
            stop(vote, run_dir, epoch, state.step, steps)
        train_time = time.time() - epoch_start
        keep_ranks_in_step(state, train_loader, epoch)
        metrics = evaluate(de_parallel(state.model), val_loader, normalize, len(classes), device, dtype,
                           keep_wrong=WRONG_SHOWN if logger else 0)
        metrics.update(evaluate_ema(state.ema, val_loader, normalize, len(classes), device, dtype))
        loss_sum, seen = state.epoch_loss
        metrics.update({"epoch": epoch + 1, "train/loss": loss_sum / seen,
                        "lr/pg0": optimizer.param_groups[0]["lr"], "time/epoch": time.time() - epoch_start,
                        "time/img_s": images_seen / train_time})
        state.epoch, state.step, state.epoch_loss, state.logged_loss = epoch + 1, 0, (0.0, 0), (0.0, 0)
        ema_better = state.ema is not None and metrics["val/ema_top1"] > metrics["val/top1"]
        top1 = metrics["val/ema_top1"] if ema_better else metrics["val/top1"]
        improved = top1 > state.best_top1
        if improved:
            state.best_top1, state.best_epoch = top1, epoch + 1
        if logger:
            logger.log_epoch(metrics, (epoch + 1) * steps)
            LOGGER.info(epoch_summary(metrics, cfg.train.epochs))
        stop_asked = check_vote(vote.settle(weights_sum(state.model)), epoch, steps)  # signal in validation?
        save(*(["best.pt"] if improved else []), "last.pt", best_from_ema=ema_better)  # last.pt commits the epoch
        if stop_asked and epoch + 1 < cfg.train.epochs:
            stop(vote, run_dir, epoch + 1, 0, steps)
        if out_of_patience(cfg.train.patience, state, cfg.train.epochs):
            break
    if logger:
        logger.close()
        images = val_set.root if getattr(val_set, "samples", None) else "path/to/images"  # CIFAR's are not files
        LOGGER.info(next_steps(run_dir, state, time.time() - start, images))
    return state.best_top1


def out_of_patience(patience, state, epochs):
    """Early stopping: whether `patience` epochs have passed without a better val top-1 (every rank agrees: the
    metrics are the same everywhere)."""
    if not patience or state.epoch >= epochs or state.epoch - state.best_epoch < patience:
        return False
    LOGGER.info(f"Stopping early after epoch {state.epoch}: no better val top-1 in {patience} epochs (train.patience)"
                f"; the best, {state.best_top1:.2%}, was at epoch {state.best_epoch}")
    return True


def next_steps(run_dir, state, seconds, val_folder):
    """The end of a run: where its results are, its best score, and the commands that use them."""
    best = shlex.quote(str(run_dir / "weights" / "best.pt"))  # pasted into a shell as printed
    return (f"\n{state.epoch} epochs in {seconds:.1f}s. Results saved to {colorstr('bold', str(run_dir))} "
            f"(results.csv, results.png, TensorBoard events, weights/)\nBest val top-1 {state.best_top1:.2%} at epoch "
            f"{state.best_epoch}: {best}\nNext:\n  tensorboard --logdir {shlex.quote(str(run_dir.parent))}\n"
            f"  python val.py --weights {best}\n"
            f"  python predict.py --weights {best} --source {shlex.quote(str(short_path(val_folder)))}\n"
            f"  python export.py --weights {best} --format onnx")


def train_one_epoch(state, loader, normalize, mix, criterion, dtype, cfg, epoch, vote, save, logger=None,
                    show_batch=False):
    """Train this rank's share of the epoch from step state.step to its end, or until the ranks agree to stop
    (state.step then says where, and last.pt holds it); returns (images all ranks trained on, whether stopped).
    Batches are mixed by mix (MixUp, CutMix) unless it is None. Rank 0's logger gets the loss every
    train.log_every_steps steps, and with show_batch the first batch."""
    state.model.train()
    device, sampler = next(de_parallel(state.model).parameters()).device, loader.sampler
    most, fewest = sampler.steps()  # ranks' shares differ by a sample, so a rank may take one step fewer
    loss_sum, seen, tail_loss = torch.zeros((), dtype=torch.float64, device=device), 0, None
    loss_before = state.epoch_loss  # of the steps done before this call (a resumed epoch's first part)
    bar = tqdm(loader, desc=f"{epoch + 1}/{cfg.train.epochs}", initial=state.step, total=most,
               disable=True if RANK else None, leave=False)
    start = last_shown = time.monotonic()
    stop, layout, crop = False, memory_format(cfg.train.channels_last), crop_spec(cfg.data)
    with join_uneven_inputs(state.model, fewest < most):
        for step, batch in enumerate(bar, state.step):
            images, targets = batch_to(batch, device, crop)  # the RAM cache's batches are cropped on the device
            if show_batch and logger:
                logger.log_batch(images[:32], targets[:32])
                show_batch = False
            images = normalize(images).contiguous(memory_format=layout)
            if mix is not None:
                images, targets = mix(images, targets, epoch, step)
            loss = train_step(state, images, targets, criterion, dtype, cfg, sampler.step_samples(step),
                              micro_batches(sampler, step, cfg.train.accumulate))
            loss_sum += loss
            seen += len(targets)
            state.step = step + 1
            global_step = epoch * most + state.step
            if state.ema is not None and global_step % cfg.train.ema_steps == 0:  # the run's steps: short epochs too
                update_ema(state.ema, state.model, warmup=global_step < cfg.sched.warmup_epochs * most)
            if step < fewest:  # every rank takes this step, so all can vote, log and save (collectives) after it
                stop = check_vote(vote.cast(loss, step), epoch, most)
                if cfg.train.log_every_steps and state.step % cfg.train.log_every_steps == 0:  # before a save
                    log_loss(state, logger, global_step, loss_before, loss_sum, seen)
                if stop or wants_save(cfg.train.save_every_steps, global_step, state.step, most):
                    stop = check_vote(vote.settle(weights_sum(state.model)), epoch, most) or stop  # never save NaN
                    state.epoch_loss = add_epoch_loss(loss_before, loss_sum, seen, device)
                    save("last.pt")  # here, in the loop: leaving join() would sync the model from another rank
                if stop:
                    break
            else:  # the step some ranks do not take: voted on with every rank after the loop
                tail_loss = loss if tail_loss is None else tail_loss + loss
            if not bar.disable and time.monotonic() - last_shown > 0.5:  # .item() syncs: at most twice a second
                last_shown = time.monotonic()
                rate = seen * WORLD_SIZE / (last_shown - start)
                bar.set_postfix_str(f"loss {loss_sum.item() / max(seen, 1):.4f}  {rate:.0f} img/s", refresh=False)
    if not stop:
        stop = check_vote(vote.settle(tail_loss, most - 1), epoch, most)
        state.step = most  # also on a rank that took one step fewer
        if fewest < most and cfg.train.log_every_steps and most % cfg.train.log_every_steps == 0:
            log_loss(state, logger, (epoch + 1) * most, loss_before, loss_sum, seen)  # the step not every rank took
        state.epoch_loss = add_epoch_loss(loss_before, loss_sum, seen, device)
        if stop:
            save("last.pt")
    return state.epoch_loss[1] - loss_before[1], stop


def micro_batches(sampler, step, accumulate):
    """How many micro-batches step `step` is split into: train.accumulate, or fewer where a rank holds fewer
    samples in an epoch's last step. The same on every rank that takes the step: with join() on, DDP's every
    forward is a collective."""
    if sampler.step_samples(step) == sampler.batch_size:  # a whole global batch: every rank holds its full share
        return accumulate
    return min(accumulate, *(n for n in (sampler.step_share(step, r) for r in range(sampler.world_size)) if n))


def train_step(state, images, targets, criterion, dtype, cfg, step_samples, accumulate=1):
    """One optimizer step on this rank's part of a global batch of step_samples, in `accumulate` micro-batches
    whose gradients are all-reduced once, after the last; returns the summed loss."""
    state.optimizer.zero_grad(set_to_none=True)
    total = 0
    for i, (x, y) in enumerate(zip(images.tensor_split(accumulate), targets.tensor_split(accumulate))):
        with no_sync(state.model, skip=i < accumulate - 1):
            with autocast(x.device, dtype):
                loss_sum = criterion(state.model(x), y)
            # DDP averages gradients over the processes (one that has run out adds zeros): scaled so, the step's
            # gradient is the mean over its samples at any number of processes and micro-batches, also in a last,
            # partial step.
            state.scaler.scale(loss_sum * (WORLD_SIZE / step_samples)).backward()
        total += loss_sum.detach()
    if cfg.optim.clip_grad_norm:
        state.scaler.unscale_(state.optimizer)  # clip the true gradient, not fp16's scaled one
        nn.utils.clip_grad_norm_(state.model.parameters(), cfg.optim.clip_grad_norm)
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    return total


def log_loss(state, logger, global_step, loss_before, loss_sum, seen):
    """Log the mean loss, over all ranks, of the steps since it was last logged (all ranks call this). It is kept
    as a difference of the epoch's running totals, which checkpoints hold, so a resumed run logs the same values."""
    state.epoch_loss = add_epoch_loss(loss_before, loss_sum, seen, loss_sum.device)
    (total, n), (logged, logged_n) = state.epoch_loss, state.logged_loss
    if logger and n > logged_n:
        logger.log_step(global_step, (total - logged) / (n - logged_n))
    state.logged_loss = state.epoch_loss


def update_ema(ema, model, warmup):
    """Move the EMA towards the weights; during warmup it restarts each time, so it copies them (as torchvision's
    reference recipes do: the early, fast-changing weights are not worth averaging)."""
    ema.update_parameters(de_parallel(model))
    if warmup:
        ema.n_averaged.fill_(0)


def evaluate_ema(ema, loader, normalize, num_classes, device, dtype):
    """The EMA's val/ema_loss, val/ema_top1 and val/ema_top5 (None without EMA)."""
    if ema is None:
        return dict.fromkeys(("val/ema_loss", "val/ema_top1", "val/ema_top5"))
    metrics = evaluate(ema.module, loader, normalize, num_classes, device, dtype)
    return {f"val/ema_{name}": metrics[f"val/{name}"] for name in ("loss", "top1", "top5")}


def weights_sum(model):
    """A number that is not finite if any weight is, voted on before each save: a step whose loss was finite but
    whose gradients overflowed must not be saved either."""
    return torch.stack([p.detach().float().sum() for p in de_parallel(model).parameters()]).sum()


def check_vote(verdict, epoch, steps):
    """The vote's stop flag; a non-finite loss (or weights) on any rank ends the run on every rank, unsaved."""
    stop, bad_step = verdict
    if bad_step == -1:
        raise SharedError(f"the weights became non-finite (nan or inf) in epoch {epoch + 1}; stopped "
                          f"without saving, so weights/last.pt keeps the last good state. Lower optim.lr, set "
                          f"optim.clip_grad_norm, or train in fp32")
    if bad_step is not None:
        raise SharedError(f"the training loss is not finite (nan or inf) at epoch {epoch + 1}, step {bad_step + 1}/"
                          f"{steps}; stopped without saving, so weights/last.pt keeps the last good state. Lower "
                          f"optim.lr, set optim.clip_grad_norm, or train in fp32")
    return stop


def wants_save(every, global_step, step, steps):
    """A mid-epoch save every `every` steps, except at the epoch's end, which saves anyway."""
    return bool(every) and global_step % every == 0 and step < steps


def add_epoch_loss(epoch_loss, loss_sum, seen, device):
    """epoch_loss plus this rank's (loss_sum, seen) summed over every rank."""
    total = all_reduce_sum(torch.stack([loss_sum.double(), torch.tensor(seen, dtype=torch.float64, device=device)]))
    return epoch_loss[0] + total[0].item(), epoch_loss[1] + int(total[1].item())


def keep_ranks_in_step(state, loader, epoch):
    """After an epoch in which a rank took one step fewer: bring its schedule, optimizer and GradScaler state to
    those of rank 0 (join() synced the weights), and give every rank rank 0's BatchNorm statistics."""
    most, fewest = loader.sampler.steps()
    for _ in range((epoch + 1) * most - state.scheduler.last_epoch):
        state.scheduler.step()
    if fewest < most:
        broadcast_optimizer_state(state.optimizer)
        broadcast_scaler_state(state.scaler)
    broadcast_buffers(de_parallel(state.model))  # every rank validates rank 0's BatchNorm statistics, as saved
    if state.ema is not None:  # a rank that skipped the epoch's last step also skipped an EMA update there
        broadcast_module(state.ema)


def stop(vote, run_dir, epoch, step, steps):
    """Every rank agreed to stop and last.pt holds where the run is: say how to resume, and stop."""
    LOGGER.info(f"\nStopped at epoch {epoch + 1 if step else epoch}, step {step or steps}/{steps}; saved "
                f"{run_dir / 'weights' / 'last.pt'}. Resume with:\n  {resume_command(run_dir)}")
    raise Stopped(vote.signal or 15)


def resume_command(run_dir):
    """The command that continues this run from its last checkpoint, launched as this one was."""
    run_dir = shlex.quote(str(run_dir))
    if RUN_ID is None:
        return f"python train.py --resume {run_dir}"
    nodes = WORLD_SIZE // LOCAL_WORLD_SIZE
    extra = f" --nnodes={nodes} (and this launch's --rdzv options, on every node)" if nodes > 1 else ""
    return f"torchrun --nproc_per_node={LOCAL_WORLD_SIZE}{extra} train.py --resume {run_dir}"


def save_state(state, cfg, classes, train_images, paths, best_from_ema=False):
    """Save a checkpoint of the run where it is to each of paths (with every rank's random state; all ranks call
    this together, rank 0 writes). With best_from_ema, best.pt's 'model' holds the EMA weights, which scored
    better ('model_source' says which)."""
    rng = gather_object(rng_states())

    def write():
        checkpoint = {
            "model": de_parallel(state.model).state_dict(), "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(), "epoch": state.epoch,
            "step": state.step, "epoch_loss": list(state.epoch_loss),
            "logged_loss": list(state.logged_loss), "best_top1": state.best_top1,
            "best_epoch": state.best_epoch, "classes": list(classes), "recipe": OmegaConf.to_container(cfg),
            "rng": rng, "train_images": train_images, "ema": None if state.ema is None else state.ema.state_dict(),
            "model_source": "training"}
        for path in paths:
            ema_best = best_from_ema and path.name == "best.pt"
            save_checkpoint({**checkpoint, "model": state.ema.module.state_dict(), "model_source": "ema"}
                            if ema_best else checkpoint, path)
    on_rank0(write)


def restore(state, path, ckpt, classes, epochs):
    """Load a checkpoint into state: weights, optimizer, schedule, scaler, position and this rank's random state."""
    if ckpt["classes"] != list(classes):
        raise SharedError(f"{path}: trained on {len(ckpt['classes'])} classes {ckpt['classes'][:5]}..., but the "
                          f"data has {len(classes)} classes {list(classes)[:5]}...; resume with the same data")
    try:
        state.model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise SharedError(f"{path}: its weights do not fit the model of its recipe: "
                          f"{str(e).strip().splitlines()[1].strip()}") from None
    if (ckpt["epoch"], ckpt["step"]) >= (epochs, 0):
        raise SharedError(f"{path}: the run has already trained all {epochs} epochs; to train longer, resume with "
                          f"train.epochs=N (N > {epochs})")
    state.optimizer.load_state_dict(ckpt["optimizer"])
    state.scheduler.load_state_dict(ckpt["scheduler"])
    for group, base_lr, factor in zip(state.optimizer.param_groups, state.scheduler.base_lrs,
                                      state.scheduler.lr_lambdas):  # a changed train.epochs changes the schedule
        group["lr"] = base_lr * factor(state.scheduler.last_epoch)
    state.scaler.load_state_dict(ckpt["scaler"])
    if state.ema is not None:
        state.ema.load_state_dict(ckpt["ema"])
    state.epoch, state.step, state.epoch_loss = ckpt["epoch"], ckpt["step"], tuple(ckpt["epoch_loss"])
    state.logged_loss = tuple(ckpt.get("logged_loss", state.epoch_loss))
    state.best_top1, state.best_epoch = ckpt["best_top1"], ckpt["best_epoch"]
    if RANK < len(ckpt["rng"]):
        set_rng_states(ckpt["rng"][RANK])
    if len(ckpt["rng"]) != WORLD_SIZE:
        LOGGER.warning(f"{path} was saved by {len(ckpt['rng'])} process(es), resumed by {WORLD_SIZE}: the data "
                       f"and steps are the same, but per-process random streams (dropout) start afresh")


def start_from(model, path, num_classes):
    """model.weights: rank 0 reads the file and shares it; every rank loads it, the classifier head resized."""
    resized = load_weights(model, on_rank0(read_weights, path), num_classes, f"model.weights={path}")
    head = f"; {', '.join(resized)} initialised afresh for {num_classes} classes" if resized else ""
    LOGGER.info(f"{colorstr('model:')} weights from {path}{head}")


def job_id():
    """What tells this torchrun job from any other: its run id, or under static rendezvous (--master-addr and
    --master-port without --rdzv-id), where every job's run id is 'none', the launching agent (host and process),
    which stays the same across its restarts and holds rank 0 on node 0."""
    if RUN_ID != "none":
        return RUN_ID
    return f"none:{socket.gethostname()}:{os.getppid()}"


def check_latest(path, ckpt):
    """--resume continues a run only from its latest state: not from best.pt's EMA weights, and not from an older
    checkpoint, which would rewind the run (drop later results and overwrite last.pt)."""
    last = run_dir_of(path) / "weights" / "last.pt"
    if ckpt.get("model_source", "training") != "training":
        raise UsageError(f"--resume {path}: it holds the EMA of the weights (a best.pt), not the training state; "
                         f"resume from {last}")
    if last.is_file() and not last.samefile(path):
        latest = load_training_checkpoint(last)
        if (latest["epoch"], latest["step"]) != (ckpt["epoch"], ckpt["step"]):
            raise UsageError(f"--resume {path}: not the run's latest state (saved {saved_at(ckpt)}, {last} "
                             f"{saved_at(latest)}); resuming from it would rewind the run. Resume from {last}, or "
                             f"start a new run from its weights with model.weights={path}")


def saved_at(ckpt):
    """Where in its run a checkpoint was saved, in a few words."""
    return f"at epoch {ckpt['epoch'] + 1}, step {ckpt['step']}" if ckpt["step"] else f"after epoch {ckpt['epoch']}"


def make_run_dir(cfg):
    """Rank 0 claims project/name (exp, exp2, ...) and saves the resolved recipe there; every rank gets the path."""
    def claim():
        try:
            run_dir = increment_path(Path(cfg.project) / cfg.name, mkdir=True)
            (run_dir / "weights").mkdir()
            (run_dir / "recipe.yaml").write_text(recipe_to_yaml(cfg))
            if RUN_ID is not None:  # lets a torchrun restart of this job find its run
                (run_dir / ".torchrun_id").write_text(job_id())
        except OSError as e:
            raise UsageError(f"project={cfg.project!r} name={cfg.name!r}: cannot create the run directory: "
                             f"{e}") from None
        return str(run_dir)
    return Path(on_rank0(claim))


def resumed_run_dir(run_dir, cfg):
    """The run directory a resumed run continues in; rank 0 saves the (possibly extended) recipe there."""
    def update():
        (run_dir / "weights").mkdir(exist_ok=True)
        (run_dir / "recipe.yaml").write_text(recipe_to_yaml(cfg))
    on_rank0(update)
    return run_dir


if __name__ == "__main__":
    main()
