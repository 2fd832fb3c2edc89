"""Checkpoints: plain state_dicts written atomically and durably, loaded without unpickling code, found for --resume;
a training run's state saved into one and restored from it."""

import math
import pickle
import re
import zipfile
from pathlib import Path

import torch

from utils.distributed import gather_object, on_rank0
from utils.general import LOGGER, RANK, WORLD_SIZE, SharedError, UsageError
from utils.once import atomic_write
from utils.seeds import rng_states, set_rng_states
from utils.torch_utils import de_parallel
from utils.watchdog import PulsingFile

TRAINING_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "step", "classes", "recipe", "rng")


def save_checkpoint(state, path):
    """Write state to path whole and durably (utils/once.atomic_write): a crash or a full disk at any moment leaves
    either the previous file or the new one, whole."""
    path = Path(path)
    try:
        with atomic_write(path) as tmp, open(tmp, "wb") as f:
            torch.save(state, PulsingFile(f))  # a slow disk's long save is not a hang (utils/watchdog.py)
    except (OSError, RuntimeError) as e:
        error = os_error_behind(e)  # torch's zip writer raises a RuntimeError of its own over a full disk's OSError
        if error is None:
            raise
        raise UsageError(f"cannot save checkpoint {path}: {error.strerror or error}; the previous checkpoint there, "
                         f"if any, is intact") from None


def os_error_behind(error):
    """error if it is an OSError, else the first OSError it was raised over (its cause or context), else None."""
    while error is not None and not isinstance(error, OSError):
        error = error.__cause__ or error.__context__
    return error


def load_checkpoint(path, device="cpu"):
    """Load a checkpoint onto device; weights_only=True refuses anything but tensors and plain containers, so a
    file whose pickle would run code is refused before any of it runs."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint {path} does not exist")
    kind = not_a_checkpoint(path)
    if kind:
        raise UsageError(f"{path} is not a checkpoint ({kind})")
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as e:
        named = re.search(r"GLOBAL ([\w.]+)", str(e))  # torch's advice to allow it would give the file a way in
        reason = f"it names {named[1]}" if named else str(e).strip().splitlines()[0]
        raise UsageError(f"{path}: refused: it holds Python objects, not only tensors and plain values, and loading "
                         f"it could run code (torch.load with weights_only=True: {reason}); a model saved whole, "
                         f"torch.save(model), is one: save its weights, torch.save(model.state_dict(), PATH)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise UsageError(f"{path}: not a readable checkpoint ({str(e).strip().splitlines()[0]})") from None


IMAGE_STARTS = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")  # PNG ... TIFF


def not_a_checkpoint(path):
    """What a file is, in a few words, when torch.save did not write it (it writes a zip archive holding data.pkl,
    or before torch 1.6 a pickle), else None: read from its first bytes, before torch.load would call text or an
    image a pickle that could run code."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head.startswith(b"PK\x03\x04"):
        try:
            names = zipfile.ZipFile(path).namelist()
        except (zipfile.BadZipFile, OSError):  # a checkpoint cut short, most likely: torch.load names what it finds
            return None
        if any(name.endswith("/constants.pkl") for name in names):
            return "it is a TorchScript model, as export.py writes; give the .pt file it was exported from"
        torch_saved = any(name.endswith("data.pkl") for name in names)
        return None if torch_saved else "it is a zip archive torch.save did not write"
    if head.startswith(b"\x80"):  # a pickle (protocol 2 or later): torch.load with weights_only decides
        return None
    if not head:
        return "it is empty"
    if path.suffix.lower() == ".onnx":
        return "it is an ONNX model, as export.py writes; give the .pt file it was exported from"
    if head.startswith(IMAGE_STARTS):
        return "it is an image"
    return "it is text" if b"\x00" not in head else "its first bytes are not those of a file torch.save writes"


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
    it was saved (epoch and step; None if unknown) and a multi-label model's per-class thresholds (None for a
    single-label one), else a clear error. The optimizer state is left out. path may be a run directory: its
    weights/best.pt, else last.pt, is loaded, as 'path' says."""
    path = model_checkpoint_path(path)
    ckpt = load_checkpoint(path, device)
    missing = [k for k in ("model", "classes", "recipe") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise UsageError(f"{path}: not a checkpoint of train.py (missing {', '.join(missing)}); use a run's "
                         f"weights/best.pt or weights/last.pt")
    return {"path": str(path), **{key: ckpt.get(key) for key in ("model", "classes", "recipe", "epoch", "step",
                                                                  "thresholds")}}


def model_checkpoint_path(path):
    """The checkpoint a model is read from: path, or for a run directory its weights/best.pt, else its last.pt
    (said)."""
    path = Path(path)
    if not path.is_dir():
        return path
    found = checkpoint_in(path, ("best.pt", "last.pt"))
    if found is None:
        raise UsageError(f"{path}: a directory without weights/best.pt or weights/last.pt; give a checkpoint file "
                         f"or a run directory")
    LOGGER.info(f"{path} is a run directory: using {found}")
    return found


def checkpoint_in(run_dir, names):
    """The first of run_dir/weights/NAME and run_dir/NAME, for each of names in turn, that is a file; else None."""
    return next((path for name in names for path in (run_dir / "weights" / name, run_dir / name) if path.is_file()),
                None)


def state_dict_mismatch(error):
    """The first problem load_state_dict's RuntimeError lists (a missing or unexpected key, or a size mismatch), as
    one line: its message is a header line, then one line per problem."""
    lines = str(error).strip().splitlines()
    return (lines[1:] or lines)[0].strip()


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
        last = checkpoint_in(path, ("last.pt",))
        if last is None:
            raise UsageError(f"--resume {resume}: no weights/last.pt in this directory")
        return last
    if not path.exists():
        raise UsageError(f"--resume {resume}: no such checkpoint file or run directory")
    return path


def warn_of_a_rescheduled_lr(path, ckpt, epochs, lr):
    """A run resumed with another train.epochs follows the schedule of the new length from where it is: rank 0 says
    so when that moves the lr (a shorter cosine lowers it at once, a longer one raises it). lr: the highest of the
    groups' (a fine-tuned head's), as the schedule now sets it."""
    planned = ckpt["recipe"]["train"]["epochs"]
    saved_lr = max(group["lr"] for group in ckpt["optimizer"]["param_groups"])
    if RANK != 0 or planned == epochs or math.isclose(lr, saved_lr, rel_tol=1e-6, abs_tol=1e-12):
        return
    change = f" ({lr / saved_lr - 1:+.0%})" if saved_lr else ""
    LOGGER.warning(f"{path}: train.epochs={epochs}, the run was planned for {planned}: from here the lr follows the "
                   f"schedule of {epochs} epochs, so it moves at once from {saved_lr:.4g} to {lr:.4g}{change}")


def run_dir_of(checkpoint_path):
    """The run directory a checkpoint belongs to: the parent of its weights/ folder."""
    path = Path(checkpoint_path).resolve()
    return path.parent.parent if path.parent.name == "weights" else path.parent


def save_state(state, recipe, classes, train_images, paths, best_from_ema=False, data_identity=None, tracked=None):
    """Save a checkpoint of the run where it is, with its recipe (a plain dict) and every rank's random state, to
    each of paths (all ranks call this together, rank 0 writes). With best_from_ema, best.pt's 'model' holds the
    EMA weights, which scored better ('model_source' says which). data_identity: a shard set's shards and their
    SHA-256 (data/shard_sets.py), which a resumed run must find unchanged. 'best_score': the best val score so far
    of 'best_metric' (train.best_metric as it applies: top1, balanced_top1 or map). Multi-label: 'thresholds' holds
    the saved weights' per-class thresholds, chosen at the last validation. 'trackers': rank 0's tracked run ids
    (tracked: tracker -> id), which a resumed run continues."""
    rng = gather_object(rng_states())

    def write():
        checkpoint = {
            "model": de_parallel(state.model).state_dict(), "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(), "scaler": state.scaler.state_dict(), "epoch": state.epoch,
            "step": state.step, "epoch_loss": list(state.epoch_loss),
            "logged_loss": list(state.logged_loss), "best_score": state.best_score, "best_metric": state.best_metric,
            "best_epoch": state.best_epoch, "classes": list(classes), "recipe": recipe,
            "rng": rng, "train_images": train_images, "ema": None if state.ema is None else state.ema.state_dict(),
            "model_source": "training", "data_identity": data_identity, "thresholds": state.thresholds,
            "trackers": tracked}
        for path in paths:
            ema_best = best_from_ema and path.name == "best.pt"
            save_checkpoint({**checkpoint, "model": state.ema.module.state_dict(), "model_source": "ema",
                             "thresholds": state.ema_thresholds} if ema_best else checkpoint, path)
    on_rank0(write)


def restore(state, path, ckpt, classes, epochs, train_images=None):
    """Load a checkpoint into state: weights, optimizer, schedule, scaler, position and this rank's random state.
    epochs: the resumed run's train.epochs, to warn when another length moves the lr; train_images: how many the
    data holds now, to warn when the checkpoint was trained on another number."""
    if ckpt["classes"] != list(classes):
        raise SharedError(f"{path}: trained on {len(ckpt['classes'])} classes {ckpt['classes'][:5]}..., but the "
                          f"data has {len(classes)} classes {list(classes)[:5]}...; resume with the same data")
    try:
        state.model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise SharedError(f"{path}: its weights do not fit the model of its recipe: "
                          f"{state_dict_mismatch(e)}") from None
    state.optimizer.load_state_dict(ckpt["optimizer"])
    state.scheduler.load_state_dict(ckpt["scheduler"])
    for group, base_lr, factor in zip(state.optimizer.param_groups, state.scheduler.base_lrs,
                                      state.scheduler.lr_lambdas):  # a changed train.epochs changes the schedule
        group["lr"] = base_lr * factor(state.scheduler.last_epoch)
    warn_of_a_rescheduled_lr(path, ckpt, epochs, max(group["lr"] for group in state.optimizer.param_groups))
    state.scaler.load_state_dict(ckpt["scaler"])
    if state.ema is not None:
        state.ema.load_state_dict(ckpt["ema"])
    state.epoch, state.step, state.epoch_loss = ckpt["epoch"], ckpt["step"], tuple(ckpt["epoch_loss"])
    state.logged_loss = tuple(ckpt.get("logged_loss", state.epoch_loss))
    # best_top1: what older checkpoints call best_score (whichever metric train.best_metric chose), so they resume
    state.best_score, state.best_epoch = ckpt.get("best_score", ckpt.get("best_top1")), ckpt["best_epoch"]
    state.thresholds = ckpt.get("thresholds")
    if RANK < len(ckpt["rng"]):
        set_rng_states(ckpt["rng"][RANK])
    if RANK == 0 and train_images is not None and ckpt.get("train_images", train_images) != train_images:
        LOGGER.warning(f"{path} was trained on {ckpt['train_images']} training images, the data now holds "
                       f"{train_images}: the order and the resumed epoch's remaining steps differ")
    if RANK == 0 and len(ckpt["rng"]) != WORLD_SIZE:
        LOGGER.warning(f"{path} was saved by {len(ckpt['rng'])} process(es), resumed by {WORLD_SIZE}: the data "
                       f"and steps are the same, but per-process random streams (dropout) start afresh")
