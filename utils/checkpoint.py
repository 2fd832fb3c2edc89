"""Checkpoints: plain state_dicts written atomically and loaded without unpickling code."""

import os
from pathlib import Path

import torch


def save_checkpoint(state, path):
    """Write state to path via a temporary file and os.replace, so a crash never leaves a half-written file."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path, device="cpu"):
    """Load a checkpoint onto device; weights_only=True refuses anything but tensors and plain containers."""
    return torch.load(path, map_location=device, weights_only=True)
