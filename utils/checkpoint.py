"""Checkpoints: plain state_dicts written atomically and durably, loaded without unpickling code, found for --resume."""

import os
import pickle
from pathlib import Path

import torch

from utils.general import UsageError

TRAINING_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "step", "classes", "recipe", "rng")


def save_checkpoint(state, path):
    """Write state to path via a temporary file, fsync and os.replace: a crash or a full disk at any moment leaves
    either the previous file or the new one, whole."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
        fsync_dir(path.parent)  # ... and the new name survives a power cut
    except OSError as e:
        raise UsageError(f"cannot save checkpoint {path}: {e.strerror or e}; the previous checkpoint there, if any, "
                         f"is intact") from None
    finally:
        tmp.unlink(missing_ok=True)


def fsync_dir(folder):
    """Make a rename inside folder durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path, device="cpu"):
    """Load a checkpoint onto device; weights_only=True refuses anything but tensors and plain containers, so a
    file whose pickle would run code is refused before any of it runs."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines()]
        reason = next((line for line in lines if "GLOBAL" in line or line.startswith("Unsupported")), lines[0])
        raise UsageError(f"{path}: refused: it holds Python objects, not only tensors and plain values, and loading "
                         f"it could run code (torch.load with weights_only=True: {reason})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise UsageError(f"{path}: not a readable checkpoint ({str(e).strip().splitlines()[0]})") from None


def load_training_checkpoint(path, device="cpu"):
    """A checkpoint that can resume training: everything train.py saves, else a clear error."""
    ckpt = load_checkpoint(path, device)
    missing = [k for k in TRAINING_KEYS if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UsageError(f"{path}: not a training checkpoint of train.py (missing {', '.join(missing)}); resume from "
                         f"a run's weights/last.pt")
    return ckpt


def load_model_checkpoint(path, device="cpu"):
    """What evaluating or exporting a checkpoint needs: its weights, class names and recipe, and where in the run
    it was saved (epoch and step; None if unknown), else a clear error. The optimizer state is left out."""
    ckpt = load_checkpoint(path, device)
    missing = [k for k in ("model", "classes", "recipe") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UsageError(f"{path}: not a checkpoint of train.py (missing {', '.join(missing)}); use a run's "
                         f"weights/best.pt or weights/last.pt")
    return {key: ckpt.get(key) for key in ("model", "classes", "recipe", "epoch", "step")}


def position(ckpt):
    """Where in its run a checkpoint was saved, in words."""
    if ckpt.get("epoch") is None:
        return "position in its run unknown"
    if not ckpt.get("step"):
        return f"after epoch {ckpt['epoch']}"
    return f"epoch {ckpt['epoch'] + 1}, step {ckpt['step']}: saved mid-epoch, so no row of results.csv is for it"


def find_resume_checkpoint(resume, project):
    """The checkpoint --resume names: a file, a run directory (its weights/last.pt), or, for '', the newest
    weights/last.pt under project."""
    if resume == "":
        candidates = sorted(Path(project).glob("*/weights/last.pt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise UsageError(f"--resume: no run to resume under {project}/ (no */weights/last.pt); give a run "
                             f"directory or checkpoint: --resume runs/train/exp")
        return candidates[-1]
    path = Path(resume)
    if path.is_dir():
        for candidate in (path / "weights" / "last.pt", path / "last.pt"):
            if candidate.is_file():
                return candidate
        raise UsageError(f"--resume {resume}: no weights/last.pt in this directory")
    if not path.exists():
        raise UsageError(f"--resume {resume}: no such checkpoint file or run directory")
    return path


def run_dir_of(checkpoint_path):
    """The run directory a checkpoint belongs to: the parent of its weights/ folder."""
    path = Path(checkpoint_path).resolve()
    return path.parent.parent if path.parent.name == "weights" else path.parent
