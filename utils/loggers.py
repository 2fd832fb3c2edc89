"""Rank 0's record of a run: results.csv, results.png, TensorBoard (scalars, image grids, the confusion matrix,
hparams), the trackers of log.to (utils/trackers.py) and the console summary line."""

import csv
import shlex
import sys
import textwrap
import time
from contextlib import contextmanager

import torch
from omegaconf import OmegaConf
from tqdm import tqdm

from utils.config import results_keys
from utils.distributed import when_failing
from utils.general import LOGGER, RANK, WORLD_SIZE, colorstr, short_path
from utils.once import atomic_write
from utils.plots import confusion_figure, figure_array, labelled_grid, results_figure, save_figure
from utils.torch_utils import de_parallel
from utils.trackers import first_line, flat_params, open_trackers

# results.csv's columns, also the TensorBoard tags of the epoch scalars but for those TENSORBOARD_TAGS renames.
COLUMNS = ["epoch", "train/loss", "val/loss", "val/top1", "val/balanced_top1", "val/top5", "val/ema_loss",
           "val/ema_top1", "val/ema_balanced_top1", "val/ema_top5", "lr/pg0", "time/epoch",
           "time/img_s"]  # val/ema_*: with EMA only; balanced_top1: the mean recall of the classes in val
# Multi-label runs' columns: mAP, and F1, precision, recall (macro) and exact match at train.threshold.
MULTILABEL_COLUMNS = ["epoch", "train/loss", "val/loss", "val/map", "val/f1", "val/precision", "val/recall",
                      "val/exact_match", "val/ema_loss", "val/ema_map", "val/ema_f1", "lr/pg0", "time/epoch",
                      "time/img_s"]
PR_CURVES = 20  # multi-label: TensorBoard PR curves of the first this many classes (each holds every val score)
# TensorBoard lists tag groups (the part before '/') alphabetically and opens the first two; its HParams tab takes
# its metrics from the scalar tags, sorted, and shows the first five. So lr/ and time/ go under x/, which sorts last
# (yolov5's name for it), and the EMA's metrics under val_ema/, after val/: the scalars open on train/ and val/, and
# HParams on train/loss, train/loss_step, val/balanced_top1, val/loss and val/top1, with or without EMA.
TENSORBOARD_TAGS = {"val/ema_loss": "val_ema/loss", "val/ema_top1": "val_ema/top1", "val/ema_map": "val_ema/map",
                    "val/ema_f1": "val_ema/f1",
                    "val/ema_balanced_top1": "val_ema/balanced_top1", "val/ema_top5": "val_ema/top5",
                    "lr/pg0": "x/lr", "time/epoch": "x/epoch_time", "time/img_s": "x/img_s"}
PLOT_SHARE = 0.02  # matplotlib plots may take this share of the run's time (each costs about 0.3-1 s on a CPU)
WRONG_SHOWN = 32  # misclassified val images shown per epoch
PROGRESS_SECONDS = 30  # output to a file (nohup, SLURM): a plain progress line this often within an epoch


class RunLogger:
    """Appends one row per epoch to results.csv and the same scalars to TensorBoard event files in run_dir, with
    image grids, the confusion matrix and results.png (those two with log.plots); and to the trackers of log.to
    (MLflow, W&B): the recipe as parameters, the same scalars at the same steps, and at the end the plots,
    recipe.yaml and (log.weights) best.pt.

    TensorBoard's x-axis is the optimizer step for every tag (for epoch metrics, the step at the epoch's end). A
    resumed run (done = (epochs, steps) done) continues the record where its checkpoint was saved: later rows,
    written before the run stopped, are dropped from results.csv, TensorBoard hides later events (purge_step), and
    each tracker continues the run of tracked (tracker -> run id, from the checkpoint).
    """

    def __init__(self, run_dir, cfg, classes, done=None, tracked=None):
        self.run_dir, self.classes, self.csv_path = run_dir, list(classes), run_dir / "results.csv"
        self.columns = results_columns(cfg)
        self.plots = PlotBudget(PLOT_SHARE) if cfg.log.plots else None
        self.unplotted = None  # (global step, confusion matrix) of the last epoch logged, until plotted
        self.confusion = None  # the last epoch's confusion matrix, for the trackers' copy of its plot
        self.upload_weights, self.closed = cfg.log.weights, False
        self.tb = None
        if "tensorboard" in cfg.log.to:
            from torch.utils.tensorboard import SummaryWriter  # here: only rank 0 pays for importing TensorBoard

            self.tb = SummaryWriter(str(run_dir), purge_step=None if done is None else done[1] + 1)
        if self.tb and done is None:
            self.tb.add_text("recipe", textwrap.indent(OmegaConf.to_yaml(cfg), "    "))  # indented: shown as code
            self.write_hparams(cfg)
        if done is not None:
            keep_rows(self.csv_path, done[0], self.columns)
        self.trackers = open_trackers(cfg.log.to, run_dir, flat_params(OmegaConf.to_container(cfg)), tracked,
                                      cfg.log.required)
        when_failing(lambda: self.close("failed"))  # the trackers' runs end failed, with what they hold
        if list(cfg.log.to) != ["tensorboard"]:  # where else than by default the run is recorded
            places = ["results.csv", *(["TensorBoard"] if self.tb else []), *(t.where() for t in self.trackers)]
            LOGGER.info(f"{colorstr('log:')} {', '.join(places)}")

    def tracked(self):
        """The trackers' run ids (tracker -> id), which checkpoints keep so that a resumed run continues them."""
        return {t.key: t.id for t in self.trackers} if self.trackers else None

    def track(self, call):
        """call(tracker) on each tracker; one that fails is dropped with one line, and the run trains on."""
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as e:
                self.trackers.remove(tracker)
                LOGGER.warning(f"log.to: {tracker.label} failed ({first_line(e)}); the run goes on without it")

    def write_hparams(self, cfg):
        """The recipe keys that change what this run learns (results_keys) for TensorBoard's HParams tab, where its
        latest scalars are the metrics.

        Only the session's start is written, not torch's experiment summary: without one TensorBoard builds the
        table from every run's keys and lists first those whose values differ between runs (it shows five keys and
        five metrics, keys always left of metrics). With one, it would take an arbitrary run's keys, alphabetically,
        and a key that acts in other runs only (data.augmix_severity, with AugMix off in that run) would have no
        column."""
        from torch.utils.tensorboard.summary import hparams

        values = {key: OmegaConf.select(cfg, key) for key in results_keys(cfg)}
        values = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()}
        _, session_start, _ = hparams(values, {})
        self.tb.file_writer.add_summary(session_start)

    def log_batch(self, images, targets):
        """A grid of (augmented uint8) training images captioned with their class names (multi-label: all of them,
        comma-separated), in TensorBoard."""
        if self.tb is None:
            return
        labels = [",".join(self.classes[c] for c in t.nonzero().flatten().tolist()) if t.dim() else self.classes[int(t)]
                  for t in targets.cpu()]
        self.tb.add_image("train/batch", labelled_grid(images.cpu(), labels), 0)

    def log_step(self, global_step, loss):
        """The mean training loss of the last few steps, at the global step count."""
        if self.tb:
            self.tb.add_scalar("train/loss_step", loss, global_step)
        self.track(lambda t: t.log({"train/loss_step": loss}, global_step))

    def log_epoch(self, metrics, global_step):
        """Record an epoch that ended at global_step: metrics has every name in its columns (None for a metric not
        computed) and evaluate()'s 'confusion' and 'wrong', or evaluate_multilabel()'s 'per_class', 'probs' and
        'targets'. The matplotlib plots (log.plots) are drawn only within PLOT_SHARE of the run's time."""
        new = not self.csv_path.exists()
        with open(self.csv_path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(self.columns)
            writer.writerow([format_value(metrics[c]) for c in self.columns])
        scalars = {name: metrics[name] for name in self.columns if metrics[name] is not None}
        self.track(lambda t: t.log(scalars, global_step))  # results.csv's columns, epoch too, as they are named
        if self.tb:
            self.log_tensorboard(metrics, scalars, global_step)
        self.confusion = metrics.get("confusion")
        if self.plots:
            self.unplotted = (global_step, metrics.get("confusion"))  # None with very many classes, or multi-label
            if self.plots.due():
                self.draw_plots()
        self.flush()

    def log_tensorboard(self, metrics, scalars, global_step):
        """An epoch's scalars (but the epoch's number, which the step says), per-class figures and the
        misclassified images in TensorBoard."""
        for name, value in scalars.items():
            if name != "epoch":
                self.tb.add_scalar(TENSORBOARD_TAGS.get(name, name), value, global_step)
        if "per_class" in metrics:
            self.log_multilabel(metrics, global_step)
        if metrics.get("wrong"):
            images, true, predicted = zip(*metrics["wrong"][:WRONG_SHOWN])
            labels = [f"{self.classes[t]} as {self.classes[p]}" for t, p in zip(true, predicted)]
            self.tb.add_image("val/misclassified", labelled_grid(torch.stack(images), labels), global_step)

    def log_multilabel(self, metrics, global_step):
        """Multi-label: each class's AP as a scalar and in a table (with its F1 and its threshold maximising F1),
        and the PR curves of the first PR_CURVES classes."""
        rows = ["| class | AP | F1 | positives | best threshold |", "| --- | --- | --- | --- | --- |"]
        for name, (n, ap, _, _, f1, best) in zip(self.classes, metrics["per_class"]):
            if ap is not None:
                self.tb.add_scalar(f"val_ap/{name}", ap, global_step)
            rows.append(f"| {name} | {format_share(ap)} | {format_share(f1)} | {n} | {best:.3f} |")
        self.tb.add_text("val/per_class", "\n".join(rows), global_step)
        for c, name in enumerate(self.classes[:PR_CURVES]):
            self.tb.add_pr_curve(f"val_pr/{name}", metrics["targets"][:, c], metrics["probs"][:, c], global_step)

    def draw_plots(self):
        """results.png and the confusion matrix of the last epoch logged in TensorBoard."""
        with self.plots.timed():
            save_figure(results_figure(self.csv_path), self.run_dir / "results.png")
            step, confusion = self.unplotted
            if confusion is not None and self.tb:
                self.tb.add_image("val/confusion_matrix", figure_array(confusion_figure(confusion, self.classes)),
                                  step, dataformats="HWC")
        self.unplotted = None

    def flush(self):
        """Write the TensorBoard events logged so far (before a checkpoint, which a resumed run continues from)."""
        if self.tb:
            self.tb.flush()

    def close(self, status="finished"):
        """End the record: draw the plots of the last epoch if they are not yet drawn, close the TensorBoard writer,
        upload the plots, recipe.yaml and (log.weights) best.pt to the trackers and mark their runs finished,
        stopped or failed, once. Returns the commands that show the record (tensorboard --logdir ...)."""
        if self.closed:
            return []
        self.closed = True
        if self.unplotted is not None and self.csv_path.exists():
            self.draw_plots()
        if self.tb:
            self.tb.close()
        if self.trackers:
            files = self.artifacts(status)
            self.track(lambda t: t.upload(files))
            self.track(lambda t: t.end(status))
        return [*([f"tensorboard --logdir {shlex.quote(str(self.run_dir.parent))}"] if self.tb else []),
                *filter(None, (t.browse() for t in self.trackers))]

    def artifacts(self, status):
        """The files the trackers keep: with log.plots, results.png and the last epoch's confusion matrix
        (confusion_matrix.png, drawn for them); recipe.yaml and, with log.weights, best.pt of a finished run."""
        files = [*([self.run_dir / "results.png"] if self.plots else []), self.run_dir / "recipe.yaml"]
        if self.confusion is not None and self.plots:
            save_figure(confusion_figure(self.confusion, self.classes), self.run_dir / "confusion_matrix.png")
            files.append(self.run_dir / "confusion_matrix.png")
        best = self.run_dir / "weights" / "best.pt"
        if self.upload_weights and status == "finished":
            files.append(best)
        return [f for f in files if f.exists()]


def progress(loader, label, initial, total):
    """An epoch's progress on rank 0: tqdm's bar on a terminal; with output to a file, where a bar would be one line
    rewritten in place, a plain line every PROGRESS_SECONDS (ProgressLines); nothing on the other ranks. label:
    'epoch/epochs'; initial, total: the steps done and in all."""
    if RANK == 0 and not sys.stderr.isatty():  # tqdm's own test for a terminal, on the stream it writes
        return ProgressLines(loader, label, initial, total)
    return tqdm(loader, desc=label, initial=initial, total=total, disable=True if RANK else None, leave=False)


class ProgressLines:
    """tqdm's part that the loop uses (iterate, set_postfix_str, disable), printing a line every PROGRESS_SECONDS:
    'epoch 1/10: step 40/125, loss 0.5321  312 img/s, 4m 30s left in the epoch'. `disable` is true but for the step
    before a line is due, so that the loop's loss and speed (a .item(), a sync on a GPU) are read once a line."""

    def __init__(self, iterable, label, initial, total):
        self.iterable, self.label, self.n, self.total, self.postfix = iterable, label, initial, total, ""
        self.disable = True

    def __iter__(self):
        start = shown = before = time.monotonic()
        first = self.n
        for item in self.iterable:
            yield item
            self.n += 1
            now = time.monotonic()
            if now - shown >= PROGRESS_SECONDS and self.n < self.total:
                left = (self.total - self.n) * (now - start) / (self.n - first)
                parts = [f"step {self.n}/{self.total}", self.postfix, f"{format_seconds(left)} left in the epoch"]
                LOGGER.info(f"epoch {self.label}: {', '.join(filter(None, parts))}")
                shown = now
            self.disable = now - shown + (now - before) < PROGRESS_SECONDS  # the next step ends before a line
            before = now

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def close(self):
        pass


def format_seconds(seconds):
    """'1h 02m', '4m 30s' or '12s'."""
    minutes, seconds = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m" if hours else f"{minutes}m {seconds:02d}s" if minutes else f"{seconds}s"


class PlotBudget:
    """Says when a plot is due so that plotting takes at most `share` of the time: after a plot that took t
    seconds, the next is due t / share seconds later (the first after one second's worth)."""

    def __init__(self, share):
        self.share, self.cost, self.last = share, 1.0, time.monotonic()

    def due(self):
        """Whether a plot now keeps plotting within its share of the time."""
        return time.monotonic() - self.last >= self.cost / self.share

    @contextmanager
    def timed(self):
        """Time a plot, which sets when the next is due."""
        start = time.monotonic()
        yield
        self.last = time.monotonic()
        self.cost = self.last - start


def results_columns(cfg):
    """results.csv's columns for a recipe: single- or multi-label's, the EMA's only with EMA (train.ema_decay)."""
    columns = MULTILABEL_COLUMNS if cfg.data.multilabel else COLUMNS
    return columns if cfg.train.ema_decay else [c for c in columns if not c.startswith("val/ema_")]


def keep_rows(csv_path, epochs, columns=COLUMNS):
    """Rewrite results.csv (atomically, with these columns) with only the rows of epochs 1..epochs, each read by its
    header's names (an older results.csv may hold blank val/ema_* columns, which are dropped)."""
    if not csv_path.exists():
        return
    with open(csv_path, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row]
    whole = [row for row in rows if None not in row and None not in row.values() and set(columns) <= set(row)
             and row["epoch"].isdigit() and int(row["epoch"]) <= epochs]  # a row cut short by a kill mid-write: not
    with atomic_write(csv_path) as tmp, open(tmp, "w", newline="") as f:
        csv.writer(f).writerows([columns, *([row[c] for c in columns] for row in whole)])


def format_value(value):
    """CSV cell: blank for None, integers as they are, floats to 6 significant digits."""
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def format_share(value):
    """A share to three decimals, '-' for None."""
    return "-" if value is None else f"{value:.3f}"


def startup_line(cfg, device, feed, datasets, state, dtype, steps, resumed=None):
    """The line that says how the run trains: processes, device, threads and workers (feed: (threads, workers, why)),
    the data (datasets: (train, val)), the model and its precision, the batch, and where a resumed run goes on, from
    which checkpoint (resumed: its path)."""
    (threads, workers, why), (train_set, val_set) = feed, datasets
    params = sum(p.numel() for p in de_parallel(state.model).parameters())
    where = f"; resuming at epoch {state.epoch + 1}, step {state.step} from {short_path(resumed)}" if resumed else ""
    return (f"{colorstr('train:')} {WORLD_SIZE} process(es) on {device.type}, {threads} thread(s) and {workers} "
            f"worker(s) each ({why}); {len(train_set)} train / {len(val_set)} val images, {len(train_set.classes)} "
            f"classes; {cfg.model.name} ({params:,} parameters) in {str(dtype or torch.float32).removeprefix('torch.')}"
            f"{', channels_last' if cfg.train.channels_last else ''}"
            f"{', multi-label' if cfg.data.multilabel else ''}; batch {cfg.train.batch_size} "
            f"({cfg.train.batch_size // WORLD_SIZE} per process), {steps} steps per epoch"
            f"{where}")


def epoch_summary(metrics, epochs):
    """One console line per epoch."""
    if "val/map" in metrics:
        ema = "" if metrics["val/ema_map"] is None else f"  ema mAP {metrics['val/ema_map']:.2%}"
        return (f"epoch {metrics['epoch']}/{epochs}  train/loss {metrics['train/loss']:.4f}  "
                f"val/loss {metrics['val/loss']:.4f}  mAP {metrics['val/map']:.2%}  F1 {metrics['val/f1']:.2%}  "
                f"exact {metrics['val/exact_match']:.2%}{ema}  lr {metrics['lr/pg0']:.3g}  "
                f"{metrics['time/epoch']:.1f}s  {metrics['time/img_s']:.0f} img/s")
    top5 = "" if metrics["val/top5"] is None else f" top5 {metrics['val/top5']:.2%}"
    if metrics["val/ema_top1"] is not None:
        top5 += f"  ema top1 {metrics['val/ema_top1']:.2%}"
    return (f"epoch {metrics['epoch']}/{epochs}  train/loss {metrics['train/loss']:.4f}  "
            f"val/loss {metrics['val/loss']:.4f}  top1 {metrics['val/top1']:.2%} "
            f"balanced {metrics['val/balanced_top1']:.2%}{top5}  lr {metrics['lr/pg0']:.3g}  "
            f"{metrics['time/epoch']:.1f}s  {metrics['time/img_s']:.0f} img/s")
