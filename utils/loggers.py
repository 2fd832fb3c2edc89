"""Rank 0's record of a run: results.csv, TensorBoard scalars and images, and the console summary line."""

import csv
import os
import textwrap

from torch.utils.tensorboard import SummaryWriter
from torchvision.utils import make_grid

COLUMNS = ["epoch", "train/loss", "val/loss", "val/top1", "val/top5", "lr", "epoch_time", "train/img_s"]


class RunLogger:
    """Appends one row per epoch to results.csv and the same scalars to TensorBoard event files in run_dir.

    A resumed run (epochs_done given) continues the record of epochs 1..epochs_done: later rows, written before
    the run stopped, are dropped from results.csv, and TensorBoard hides the events of later epochs (purge_step).
    """

    def __init__(self, run_dir, recipe_yaml, epochs_done=None):
        self.csv_path = run_dir / "results.csv"
        if epochs_done is None:
            self.tb = SummaryWriter(str(run_dir))
            self.tb.add_text("recipe", textwrap.indent(recipe_yaml, "    "))  # indented: markdown shows it as code
        else:
            keep_rows(self.csv_path, epochs_done)
            self.tb = SummaryWriter(str(run_dir), purge_step=epochs_done + 1)

    def log_epoch(self, metrics):
        """Record an epoch's metrics (a dict with every name in COLUMNS; None for a metric not computed)."""
        new = not self.csv_path.exists()
        with open(self.csv_path, "a", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(COLUMNS)
            writer.writerow([format_value(metrics[c]) for c in COLUMNS])
        for name in COLUMNS[1:]:
            if metrics[name] is not None:
                self.tb.add_scalar(name, metrics[name], metrics["epoch"])
        self.tb.flush()

    def log_images(self, tag, images, nrow=8):
        """Add a grid of images (N, C, H, W floats in [0, 1]) to TensorBoard."""
        self.tb.add_image(tag, make_grid(images, nrow=nrow, padding=1, normalize=False), 0)

    def close(self):
        """Flush and close the TensorBoard writer."""
        self.tb.close()


def keep_rows(csv_path, epochs):
    """Rewrite results.csv (atomically) with only the rows of epochs 1..epochs."""
    if not csv_path.exists():
        return
    with open(csv_path, newline="") as f:
        rows = [row for row in csv.reader(f) if row]
    tmp = csv_path.with_name(f"{csv_path.name}.tmp")
    with open(tmp, "w", newline="") as f:  # a row cut short by a kill mid-write is dropped too
        csv.writer(f).writerows([COLUMNS, *(row for row in rows[1:] if len(row) == len(COLUMNS)
                                            and row[0].isdigit() and int(row[0]) <= epochs)])
    os.replace(tmp, csv_path)


def format_value(value):
    """CSV cell: blank for None, integers as they are, floats to 6 significant digits."""
    if value is None:
        return ""
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def epoch_summary(metrics, epochs):
    """One console line per epoch."""
    top5 = "" if metrics["val/top5"] is None else f" top5 {metrics['val/top5']:.2%}"
    return (f"epoch {metrics['epoch']}/{epochs}  train/loss {metrics['train/loss']:.4f}  "
            f"val/loss {metrics['val/loss']:.4f}  top1 {metrics['val/top1']:.2%}{top5}  lr {metrics['lr']:.3g}  "
            f"{metrics['epoch_time']:.1f}s  {metrics['train/img_s']:.0f} img/s")
