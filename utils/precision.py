"""Mixed precision: the autocast dtype a recipe and device allow, the GradScaler that fp16 alone needs, and what
'auto' precision and memory format settle to on this hardware."""

import os

import torch
from omegaconf import OmegaConf

from utils.distributed import gather_object
from utils.general import LOGGER, UsageError, colorstr
from utils.torch_utils import select_device

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


def native_precision(device):
    """The fastest precision this device trains in at fp32's accuracy. GPUs compute bf16 (before Ampere fp16) on
    tensor cores; a CPU runs bf16 faster than fp32 only with AMX or AVX512-BF16 instructions that oneDNN may use
    (not when ONEDNN_MAX_CPU_ISA caps it below them), without which it converts to fp32 and back
    (benchmarks/compute.py)."""
    if device.type == "cuda":  # tensor cores compute bf16 from Ampere (8.0); older GPUs only emulate it
        return "bf16" if torch.cuda.get_device_capability(device) >= (8, 0) else "fp16"
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    if capped not in ("ALL", "DEFAULT") and not any(isa in capped for isa in ("BF16", "AMX", "FP16", "AVX10",
                                                                              "VNNI_2")):
        return "fp32"
    # torch's own checks (private: a build without them counts as a CPU without the instructions)
    native = (getattr(torch.cpu, check, lambda: False)() for check in ("_is_amx_tile_supported",
                                                                        "_is_avx512_bf16_supported"))
    return "bf16" if any(native) else "fp32"


def settle_auto(cfg, convolutional):
    """cfg with train.precision and train.channels_last 'auto' made what this job's hardware runs fastest, before
    the run saves its recipe (so a resume, val.py and predict.py use what ran). The precision: native_precision when
    every process's device has the same one, else fp32 (the ranks of a job compute alike). channels_last: for a
    convolutional model (convolutional(cfg): more than one Conv2d), which benchmarks/compute.py and gpu.py measured
    as fast or faster in every case; a vision transformer has one convolution and gains nothing."""
    settled, why = {}, []
    if cfg.train.precision == "bf16" and (device := select_device(cfg.device)).type == "cpu" and \
            native_precision(device) != "bf16":
        LOGGER.info(f"{colorstr('train:')} precision bf16 on a cpu without AMX or AVX512-BF16 instructions (or "
                    f"ONEDNN_MAX_CPU_ISA below them): oneDNN emulates it, slower than fp32 (train.precision=auto "
                    f"picks fp32 here)")
    if cfg.train.precision == "auto":
        device = select_device(cfg.device)
        natives = sorted(set(gather_object(native_precision(device))))
        settled["precision"] = natives[0] if len(natives) == 1 else "fp32"
        why.append(f"precision {settled['precision']} " + (f"(the fastest this {device.type} trains in)"
                                                           if len(natives) == 1 else
                                                           f"(the processes' devices differ: {', '.join(natives)})"))
    if cfg.train.channels_last == "auto":
        settled["channels_last"] = convolutional(cfg)
        why.append(f"channels_last {str(settled['channels_last']).lower()} "
                   f"({'' if settled['channels_last'] else 'not '}a convolutional model)")
    if not settled:
        return cfg
    LOGGER.info(f"{colorstr('train:')} auto: {', '.join(why)}")
    return OmegaConf.merge(cfg, {"train": settled})


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
