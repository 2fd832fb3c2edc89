"""Mixed precision: the autocast dtype a recipe and device allow, and the GradScaler that fp16 alone needs."""

import torch

from utils.general import LOGGER, UsageError

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision, device, key="train.precision"):
    """Autocast dtype for a precision ('fp32' -> None; 'auto' -> native_precision), refusing combinations the
    device can't run (the error names key, where the precision came from)."""
    dtype = AUTOCAST_DTYPES[native_precision(device) if precision == "auto" else precision]
    if dtype is torch.float16 and device.type != "cuda":
        raise UsageError(f"{key}={precision} needs a CUDA device; use bf16 on CPU")
    if dtype is torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(f"{key}={precision} is not supported by this GPU; use fp16")
    return dtype


def native_precision(device, cpuinfo="/proc/cpuinfo"):
    """precision=auto: the fastest precision this device trains in at fp32's accuracy. GPUs compute bf16 (else
    fp16) on tensor cores; a CPU runs bf16 faster than fp32 only with AMX or AVX512-BF16 instructions, without
    which oneDNN converts to fp32 and back (benchmarks/compute.py measures both)."""
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    try:
        flags = set(open(cpuinfo).read().split())
    except OSError:  # not Linux: no way to ask, so the precision every CPU runs at full speed
        return "fp32"
    return "bf16" if flags & {"amx_bf16", "avx512_bf16"} else "fp32"


def inference_precision(requested, trained, device):
    """(precision, autocast dtype) to evaluate in: the one asked for (--precision), else the one the checkpoint
    was trained in, or fp32 (with a warning) where this device cannot run that one (fp16 on a CPU)."""
    if requested:
        return requested, autocast_dtype(requested, device, "--precision")
    try:
        return trained, autocast_dtype(trained, device)
    except UsageError:
        LOGGER.warning(f"the checkpoint was trained in {trained}, which {device.type} cannot run: evaluating in fp32 "
                       f"(choose with --precision)")
        return "fp32", None


def autocast(device, dtype):
    """Autocast context for dtype; disabled (fp32) when dtype is None."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def grad_scaler(device, dtype):
    """GradScaler that is active only for fp16, the one dtype whose gradients underflow."""
    return torch.amp.GradScaler(device.type, enabled=dtype is torch.float16)
