"""Train an image classifier from a recipe, as one process or many under torchrun.

Usage:
    python train.py --recipe cls.yaml
    torchrun --nproc_per_node=2 train.py --recipe cls.yaml optim.lr=0.05 train.epochs=3
    torchrun --nproc_per_node=2 train.py --resume runs/train/exp     # continue a stopped or crashed run exactly

The run, top to bottom: main() joins the process group and settles the recipe; train() builds the data, model and
optimizer, then each epoch trains (train_one_epoch, train_step), validates, logs and saves. Every rank runs all of it.
The ranks meet (a collective: the stop vote, the logged loss, a save) only in at_shared_step(), after a step every
rank takes, and at the end of each epoch.
"""

import signal
import sys
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from utils.general import LOGGER, RANK, WORLD_SIZE, SharedError, UsageError, after_imports, before_imports, colorstr

if __name__ == "__main__":  # first: a Ctrl-C during the imports below ends the process with one line; no collection
    before_imports(quiet_interrupt=True)

import torch
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from data.batches import device_batches
from data.datasets import balanced_class_weights, input_feed, set_epoch, training_data
from data.layouts import held_out_folder, save_split
from data.shard_sets import check_same_shards
from data.transforms import crop_spec, normalizer, val_size
from models import build_model, check_batch_for_batchnorm, check_input_size, check_model_name, settle, start_from
from models.pretrained import fine_tuning, freeze_batchnorm
from utils.checkpoint import restore, save_state
from utils.config import Recipe, best_metric
from utils.distributed import (cleanup_distributed, exit_on_error, keep_ranks_in_step, setup_distributed,
                               stop_if_another_rank_failed)
from utils.loggers import WRONG_SHOWN, RunLogger, epoch_summary, progress, startup_line
from utils.losses import build_criterion
from utils.metrics import EpochLoss, evaluate, evaluate_ema
from utils.multilabel import evaluate_multilabel, evaluate_multilabel_ema
from utils.optim import build_optimizer, build_scheduler, stepped_parameters
from utils.precision import autocast, autocast_dtype, grad_scaler
from utils.run import end_stopped, make_run_dir, next_steps, parse_args, prepare_run, resumed_run_dir
from utils.seeds import init_seeds
from utils.stopping import StopVote, check_vote, out_of_patience, record_best, wants_save, weights_sum
from utils.watchdog import Placed, further, now_at, placed, set_limit
from utils.torch_utils import (compiled, de_parallel, join_uneven_inputs, memory_format, model_ema, no_sync,
                               one_image_batchnorm, select_device, set_device, set_threads, smart_DDP, sync_batchnorm,
                               update_ema)


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
    best_score: float = -1.0  # the best val score of best_metric so far
    best_epoch: int = 0
    best_metric: str = "top1"  # train.best_metric as it applies (config.best_metric): top1, balanced_top1 or map
    ema: torch.optim.swa_utils.AveragedModel | None = None  # EMA of the weights (train.ema_decay), None when off
    frozen_epochs: int = 0  # fine-tuning (model.freeze_epochs): the pretrained part is frozen in epochs before this
    thresholds: list | None = None  # multi-label: per class, the threshold maximising F1 at the last validation
    ema_thresholds: list | None = None  # ... and the EMA's, saved with its weights in best.pt


@dataclass
class Loop:
    """What the epochs read besides the state: the recipe, the data, how a batch becomes a loss, and the outputs."""

    cfg: Recipe  # a plain dataclass, not an OmegaConf node: the loop reads keys every step, ~60 us each from OmegaConf
    loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    normalize: Callable  # a uint8 batch on the device -> normalised floats
    mix: Callable | None  # MixUp or CutMix of a batch; None when off
    criterion: nn.Module
    dtype: torch.dtype | None  # autocast dtype; None for fp32
    vote: StopVote  # entered; its device is the training device
    logger: RunLogger | None  # rank 0's; None on the others
    run_dir: Path
    recipe: dict  # the resolved recipe, saved in every checkpoint
    classes: list
    train_images: int
    data_identity: dict | None = None  # a shard set's shards and their SHA-256, which a resume must find unchanged
    multilabel: bool = False  # data.multilabel: sigmoid outputs, BCE, mAP


@record  # under torchrun, an unexpected error's traceback becomes the reported root cause of the failure
def main(argv=None):
    """Join the process group, settle the recipe and checkpoint, train and return the best val score; bad input
    exits with code 2 and one line, a stop signal with 128 + its number after saving."""
    try:
        args = parse_args(argv)
        # Stop signals are caught from here on: one that arrives before the run directory is made ends the process at
        # once, nothing saved (torchrun passes it to every rank); after, the ranks stop together after a step and
        # save.
        with StopVote() as vote:
            setup_distributed()
            try:
                cfg, run_dir, resume = prepare_run(args, check_model_name, settle)
                vote.device = select_device(cfg.device)
                set_device(vote.device)
                best = train(cfg, vote, autocast_dtype(cfg.train.precision, vote.device), run_dir, resume, args.check)
            except UsageError as e:  # said while this rank is still in the group, where the others find it
                exit_on_error("train.py", e)
            except Exception:
                stop_if_another_rank_failed("train.py")  # a collective broken by a rank that failed and left
                raise
            finally:
                cleanup_distributed()
    except UsageError as e:  # met before the group was joined
        exit_on_error("train.py", e)
    if best is None:  # the ranks stopped together on a signal, after saving last.pt
        sys.exit(128 + (vote.signal or signal.SIGTERM))
    return best


def train(cfg, vote, dtype, run_dir=None, resume=None, check=False):
    """The whole run: data, model, optimizer, then per epoch train, validate, log and save. Returns the best val
    score of train.best_metric (top-1 by default), or None when the ranks stopped on a signal. vote (a StopVote,
    entered) holds the training device; check: stop once the data and model are built (--check)."""
    device = vote.device
    set_limit(cfg.train.hang_seconds)  # a rank that hangs is named after this long (utils/watchdog.py)
    check_batch_for_batchnorm(cfg)  # before the data is read: a mistake of the recipe alone
    threads, workers, workers_why = set_threads(cfg.data.workers, input_feed(cfg.data, device), device.type)
    init_seeds(cfg.seed + RANK, cfg.train.deterministic)  # own dropout stream per rank; DDP copies rank 0's init
    # A resumed run reuses its saved data.val_split split (files added since change nothing); else it is made anew.
    train_set, val_set, train_loader, val_loader, mix = training_data(cfg, device, workers, run_dir if resume else None)
    classes = train_set.classes
    steps = train_loader.sampler.steps()[0]
    state = build_state(cfg, len(classes), device, dtype, steps, pretrained=not resume)
    if resume:
        check_same_shards(*resume, train_set)
        restore(state, *resume, classes, cfg.train.epochs, len(train_set))
    if WORLD_SIZE > 1:  # after restore: DDP starts every rank from rank 0's weights
        state.model = smart_DDP(state.model, device, **cfg.ddp)
    state.model = compiled(state.model, cfg.train.compile)
    LOGGER.info(startup_line(cfg, device, (threads, workers, workers_why), (train_set, val_set), state, dtype, steps,
                             resumed=resume and resume[0]))
    if check:
        LOGGER.info(f"{colorstr('train:')} --check: the recipe, data and model are ready to train; no run written")
        return state.best_score
    # Only now: a run that fails on its data or model leaves no directory behind.
    continuing = run_dir is not None  # resumed, or restarted by torchrun into this job's run
    vote.started = True  # from here a Ctrl-C stops the run where it can save (StopVote)
    run_dir = resumed_run_dir(run_dir, cfg) if continuing else make_run_dir(cfg)
    save_split(run_dir, cfg, train_set, val_set)  # data.val_split's split, for a resume and val.py to reuse
    logger = RunLogger(run_dir, cfg, classes, (state.epoch, state.epoch * steps + state.step) if continuing else None,
                       resume and resume[1].get("trackers")) if RANK == 0 else None
    weights = balanced_class_weights(train_set) if cfg.train.class_weights == "balanced" else None
    criterion = build_criterion(cfg.train, len(classes), cfg.data.multilabel, weights).to(device)
    loop = Loop(OmegaConf.to_object(cfg), train_loader, val_loader, normalizer(cfg.data, device), mix, criterion, dtype,
                vote, logger, run_dir, OmegaConf.to_container(cfg), list(classes), len(train_set),
                getattr(train_set, "identity", None), cfg.data.multilabel)
    start, started_at = time.time(), (state.epoch, state.step)
    for epoch in range(state.epoch, cfg.train.epochs):
        epoch_start = time.time()
        images_seen, stopped = train_one_epoch(loop, state, epoch, show_batch=not (epoch or state.step or resume))
        if stopped:
            return end_stopped(logger, run_dir, epoch, state.step, steps)
        train_time = time.time() - epoch_start
        metrics = validate(loop, state)
        metrics.update({"epoch": epoch + 1, "train/loss": state.epoch_loss[0] / state.epoch_loss[1],
                        "lr/pg0": state.optimizer.param_groups[0]["lr"], "time/epoch": time.time() - epoch_start,
                        "time/img_s": images_seen / train_time})
        stopped = end_epoch(loop, state, epoch, metrics)  # a signal during validation
        if out_of_patience(cfg.train.patience, state, cfg.train.epochs) or stopped and epoch + 1 == cfg.train.epochs:
            break  # the run has ended: a stop signal then is no stop
        if stopped:
            return end_stopped(logger, run_dir, epoch + 1, 0, steps)
    if logger:
        LOGGER.info(next_steps(run_dir, state, time.time() - start, held_out_folder(train_set, val_set), started_at,
                               logger.close()))
    return state.best_score


def build_state(cfg, num_classes, device, dtype, steps, pretrained=True):
    """The model (with model.weights where pretrained, on the device), its optimizer (fine-tuning: the pretrained
    part apart from the new head), schedule, GradScaler and EMA."""
    model = build_model(cfg.model, num_classes, cfg.data.img_size)
    if cfg.model.weights and pretrained:  # not when resuming: the checkpoint holds every weight, and no download
        start_from(model, cfg.model, num_classes)
    head, backbone_lr, frozen_epochs = fine_tuning(cfg.model, num_classes, model)
    model = model.to(device, memory_format=memory_format(cfg.train.channels_last))
    check_input_size(model, cfg.model.name, cfg.data.img_size, device)
    if val_size(cfg.data) != cfg.data.img_size:
        check_input_size(model, cfg.model.name, val_size(cfg.data), device, key="data.val_img_size")
    model = sync_batchnorm(model, cfg.model.sync_bn, device)
    optimizer = build_optimizer(model, cfg.optim, head, backbone_lr)
    scheduler = build_scheduler(optimizer, cfg.sched, cfg.train.epochs, steps, frozen_epochs)
    state = TrainState(model, optimizer, scheduler, grad_scaler(device, dtype), best_metric=best_metric(cfg),
                       frozen_epochs=frozen_epochs)
    if cfg.train.ema_decay:
        if cfg.train.ema_steps > cfg.train.epochs * steps:
            raise SharedError(f"train.ema_steps={cfg.train.ema_steps} is more than the run's "
                              f"{cfg.train.epochs * steps} steps ({cfg.train.epochs} epochs of {steps}): the EMA would "
                              f"never be updated; lower it")
        state.ema = model_ema(model, cfg.train.ema_decay, cfg.train.ema_steps, cfg.train.batch_size, cfg.train.epochs)
    return state


def train_one_epoch(loop, state, epoch, show_batch=False):
    """Train this rank's share of the epoch from step state.step to its end, or until the ranks agree to stop
    (state.step then says where, and last.pt holds it); returns (images all ranks trained on, whether stopped).
    With show_batch, rank 0 logs the first batch's images."""
    cfg, sampler, device = loop.cfg, loop.loader.sampler, loop.vote.device
    set_epoch(loop.loader, epoch, state.step)
    state.model.train()
    if epoch < state.frozen_epochs:  # the pretrained part's weights are held by a zero lr (build_scheduler)
        freeze_batchnorm(state.model)
    most, fewest = sampler.steps()  # ranks' shares differ by a sample, so a rank may take one step fewer
    running, tail_loss, stopped = EpochLoss(state.epoch_loss, device), None, False
    bar = progress(loop.loader, f"{epoch + 1}/{cfg.train.epochs}", state.step, most)
    layout, crop = memory_format(cfg.train.channels_last), crop_spec(cfg.data)
    # The caches' batches are cropped on the device, the next one while this step runs
    with join_uneven_inputs(state.model, fewest < most), closing(device_batches(bar, device, crop)) as batches:
        steps = placed(batches, (epoch, 0), f"epoch {epoch + 1}, step {{}}/{most}", "in the step", state.step, most)
        for step, (images, targets) in enumerate(steps, state.step):
            if show_batch and loop.logger:
                loop.logger.log_batch(images[:32], targets[:32])
                show_batch = False
            images = loop.normalize(images).contiguous(memory_format=layout)
            if loop.mix is not None:
                images, targets = loop.mix(images, targets, epoch, step)
            loss = train_step(state, images, targets, loop.criterion, loop.dtype, cfg, sampler.step_samples(step),
                              sampler.micro_batches(step, cfg.train.accumulate))
            running.add(loss, len(targets))
            state.step = step + 1
            global_step = epoch * most + state.step
            if state.ema is not None and global_step % cfg.train.ema_steps == 0:  # the run's steps: short epochs too
                update_ema(state.ema, state.model, warmup=global_step < cfg.sched.warmup_epochs * most)
            if step >= fewest:  # a step some ranks do not take: every rank votes on it after the loop
                tail_loss = loss
            elif at_shared_step(loop, state, epoch, loop.vote.cast(loss, step), running):
                stopped = True
                break  # here, in join(): leaving it first would sync the model from a rank that is not done
            running.show(bar)
    if not stopped:
        now_at((epoch, 1), f"the end of epoch {epoch + 1}")  # past every step: a rank a step short waits here
        state.step = most  # also on a rank that took one step fewer
        stopped = at_shared_step(loop, state, epoch, loop.vote.settle(tail_loss, most - 1), running, epoch_end=True)
    if not stopped:
        keep_ranks_in_step(state, loop.loader, epoch)  # a rank that took a step fewer catches up
    return state.epoch_loss[1] - running.before[1], stopped


def train_step(state, images, targets, criterion, dtype, cfg, step_samples, accumulate=1):
    """One optimizer step on this rank's part of a global batch of step_samples, in `accumulate` micro-batches
    whose gradients are all-reduced once, after the last; returns the summed loss."""
    state.optimizer.zero_grad(set_to_none=True)
    total = 0
    for i, (x, y) in enumerate(zip(images.tensor_split(accumulate), targets.tensor_split(accumulate))):
        with no_sync(state.model, skip=i < accumulate - 1), one_image_batchnorm(state.model, len(x)):
            with autocast(x.device, dtype):
                loss_sum = criterion(state.model(x), y)
            # DDP averages gradients over the processes (one that has run out adds zeros): scaled so, the step's
            # gradient is the mean over its samples at any number of processes and micro-batches, also in a last,
            # partial step.
            state.scaler.scale(loss_sum * (WORLD_SIZE / step_samples)).backward()
        total += loss_sum.detach()
    if cfg.optim.clip_grad_norm:
        state.scaler.unscale_(state.optimizer)  # clip the true gradient, not fp16's scaled one
        nn.utils.clip_grad_norm_(stepped_parameters(state.optimizer), cfg.optim.clip_grad_norm)  # not a frozen part's
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.scheduler.step()
    return total


def at_shared_step(loop, state, epoch, verdict, running, epoch_end=False):
    """Where the ranks meet: after a step every rank took, or at the epoch's end. The only place in an epoch for
    what needs every rank (collectives): count the stop vote (verdict), log the loss every train.log_every_steps
    steps, and save last.pt every train.save_every_steps steps or to stop. Returns whether the ranks stop."""
    cfg, most = loop.cfg.train, loop.loader.sampler.steps()[0]
    stop = check_vote(verdict, epoch, most)
    global_step = epoch * most + state.step
    log = cfg.log_every_steps and state.step % cfg.log_every_steps == 0
    save_now = stop or wants_save(cfg.save_every_steps, global_step, state.step, most)
    if log or save_now or epoch_end:  # the epoch's running totals, which checkpoints hold
        state.epoch_loss = running.total()
    if log:  # before a save, so it holds the logged loss
        # The mean since the last log, as a difference of running totals: a resumed run logs the same values.
        (total, n), (logged, logged_n) = state.epoch_loss, state.logged_loss
        if loop.logger and n > logged_n:
            loop.logger.log_step(global_step, (total - logged) / (n - logged_n))
        state.logged_loss = state.epoch_loss
    if save_now:
        stop = save(loop, state, epoch, "last.pt") or stop
    return stop


def validate(loop, state):
    """The val metrics of the weights and their EMA (with train.tta, of each image and its flip); multi-label's with
    each one's per-class thresholds. state.epoch: the epoch validated."""
    epoch = state.epoch
    val_loader = Placed(loop.val_loader, (epoch, 2), f"epoch {epoch + 1}, val batch {{}}/{len(loop.val_loader)}",
                        "validating")
    args = (val_loader, loop.normalize, len(loop.classes), loop.vote.device, loop.dtype)
    tta = loop.cfg.train.tta
    if loop.multilabel:
        threshold = loop.cfg.train.threshold
        metrics = evaluate_multilabel(de_parallel(state.model), *args, threshold=threshold, tta=tta)
        return {**metrics, **evaluate_multilabel_ema(state.ema, *args, threshold=threshold, tta=tta)}
    metrics = evaluate(de_parallel(state.model), *args, keep_wrong=WRONG_SHOWN if loop.logger else 0, tta=tta)
    return {**metrics, **evaluate_ema(state.ema, *args, tta=tta)}


def end_epoch(loop, state, epoch, metrics):
    """Commit the epoch: the best score of train.best_metric so far (of the weights or their EMA, whichever is
    better), the logs, and last.pt (and best.pt when it improved). Returns whether a stop signal arrived during
    validation (save's vote)."""
    now_at((epoch, 3), f"the end of epoch {epoch + 1}")
    state.epoch, state.step, state.epoch_loss, state.logged_loss = epoch + 1, 0, (0.0, 0), (0.0, 0)
    state.thresholds, state.ema_thresholds = metrics.get("thresholds"), metrics.get("ema_thresholds")
    improved, ema_better = record_best(state, metrics, epoch)
    if loop.logger:
        loop.logger.log_epoch(metrics, (epoch + 1) * loop.loader.sampler.steps()[0])
        LOGGER.info(epoch_summary(metrics, loop.cfg.train.epochs))
    return save(loop, state, epoch, *(["best.pt"] if improved else []), "last.pt", best_from_ema=ema_better)


def save(loop, state, epoch, *names, best_from_ema=False):
    """Save the run where it is as weights/NAME for each name (all ranks call this, rank 0 writes), after the
    TensorBoard events logged so far, so that a resumed run's events continue from the checkpoint's. The ranks
    first vote on the weights (never save NaN: a step with a finite loss may still overflow them), which also
    counts a stop signal; returns whether one arrived."""
    further(f"saving weights/{' and '.join(names)}")
    stop = check_vote(loop.vote.settle(weights_sum(state.model)), epoch, loop.loader.sampler.steps()[0])
    if loop.logger:
        loop.logger.flush()
    save_state(state, loop.recipe, loop.classes, loop.train_images, [loop.run_dir / "weights" / n for n in names],
               best_from_ema, loop.data_identity, loop.logger and loop.logger.tracked())
    return stop


if __name__ == "__main__":
    after_imports()
    main()
