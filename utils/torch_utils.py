"""A process's torch set-up: its device and threads, DDP behind its version checks, and the EMA of the weights."""

import inspect
import re
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.torch_version import TorchVersion

from utils.config import DEVICES, parse_device
from utils.general import LOCAL_RANK, LOCAL_WORLD_SIZE, LOGGER, SHARE_ONE_GPU, WORLD_SIZE, UsageError, cpu_count

TORCH_BUCKET_MB = 25  # DDP's default bucket_cap_mb
TORCH_MINIMUM = "2.4"  # requirements.txt's torch>=2.4


def select_device(device="auto", local_rank=LOCAL_RANK, key="device", local_world_size=LOCAL_WORLD_SIZE):
    """Return the torch.device for this process: 'auto' picks CUDA when present, 'cuda' GPU LOCAL_RANK, and a GPU
    index (0, cuda:1) that GPU, for one process per machine. Errors name key, where the choice came from."""
    device, parsed = str(device), parse_device(device)  # str: OmegaConf and YAML may give device=0 as an int
    if parsed is None:
        raise UsageError(f"{key} must be {DEVICES}, got {device!r}")
    kind, index = parsed
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise UsageError(f"{key}={device!r} but CUDA is not available here; use {key}=cpu or {key}=auto")
    count = torch.cuda.device_count()
    if index is None:
        if SHARE_ONE_GPU:  # tests only (utils/general.py)
            return torch.device("cuda", local_rank % count)
        if local_rank >= count:
            raise UsageError(f"LOCAL_RANK {local_rank} needs GPU {local_rank}, but only {count} GPU(s) are visible; "
                             f"lower --nproc_per_node")
        return torch.device("cuda", local_rank)
    # Every process would take the one GPU: torchrun gives each its own by LOCAL_RANK instead.
    if local_world_size > 1:
        raise UsageError(f"{key}={device!r} names one GPU for the {local_world_size} processes on this machine; use "
                         f"{key}=cuda (each process takes GPU LOCAL_RANK) and choose the GPUs with "
                         f"CUDA_VISIBLE_DEVICES")
    if index >= count:
        raise UsageError(f"{key}={device!r} but only {count} GPU(s) are visible here (0 to {count - 1}); choose one "
                         f"of them, or see CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def check_version(current, minimum, name="version ", pinned=False, hard=False):
    """Whether version current is at least minimum (pinned: is minimum); hard=True raises a UsageError instead of
    returning False. Compared by release numbers: 2.14 > 2.4, and local builds (+cu130), pre-releases and dev
    builds of a release count as it (NVIDIA's containers ship e.g. 2.4.0a0+3bcc3cd)."""
    current_release, minimum_release = (TorchVersion(re.match(r"\d+(\.\d+)*", str(v))[0]) for v in (current, minimum))
    ok = current_release == minimum_release if pinned else current_release >= minimum_release
    if hard and not ok:
        raise UsageError(f"{name}{minimum}{'' if pinned else ' or newer'} is required, but {name}{current} is "
                         f"installed; {'install that version' if pinned else 'upgrade it'} (see requirements.txt)")
    return ok


def set_device(device):
    """Make device this process's GPU (before any nccl collective), if it is one."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def set_threads(workers="auto", feed="files", device_type="cpu", cores=None, procs_per_machine=LOCAL_WORLD_SIZE):
    """Split this machine's cores between the processes on it, and each process's between DataLoader workers and
    compute threads; return (threads, workers, why) where why says how the workers were chosen.

    Each process gets cores // procs_per_machine cores; its workers take at most all but one, its compute threads
    the rest, so the machine is never oversubscribed unless it has fewer cores than processes (why then says so).
    data.workers=auto picks by what feeds the model, feed (see auto_workers); a number asked for is lowered, with a
    warning on each machine, to what fits.
    """
    cores = cores or cpu_count()
    per_process = max(1, cores // procs_per_machine)
    if workers == "auto":
        workers, why = auto_workers(per_process, feed, device_type)
    else:
        asked, workers, why = int(workers), min(int(workers), per_process - 1), "data.workers"
        if workers < asked and LOCAL_RANK == 0:
            LOGGER.warning(f"data.workers={asked} lowered to {workers}: {cores} cores shared by "
                           f"{procs_per_machine} process(es) leave {per_process} per process, one of them for compute")
    if procs_per_machine > cores:
        why += (f"; oversubscribed: {procs_per_machine} processes share this machine's {cores} core"
                f"{'s' * (cores != 1)}, each process a thread or more (use --nproc_per_node={cores} or fewer)")
    threads = max(1, per_process - workers)
    torch.set_num_threads(threads)
    return threads, workers, why


def auto_workers(cores, feed, device_type):
    """data.workers=auto for a process with `cores` cores: (workers, why). feed says what the workers do: decode
    "files" (or JPEGs of the JPEG cache), gather "memory" (the RAM cache's batches) or "bytes" (the JPEG cache's,
    decoded on the device). Measured by benchmarks/data.py: batches gathered from the RAM cache cost little, so
    every core computes; a GPU computes by itself, so all cores but the feeding one decode; on a CPU, decoding and
    the model share the cores half and half. Bytes from the page cache cost little too, but a GPU step is short:
    two workers read ahead."""
    if feed == "memory":
        return 0, "auto: data.cache=ram, every core computes"
    if cores == 1:  # no core to spare: the process decodes between its steps
        return 0, "auto: one core per process, which both decodes and computes"
    if feed == "bytes":
        return min(2, cores - 1), "auto: JPEGs decoded on the device; workers only read their bytes"
    if device_type == "cuda":
        return cores - 1, "auto: the GPU computes, the other cores decode"
    return cores // 2, "auto: half the cores decode, half compute"


def smart_DDP(model, device, comm_hook="none", bucket_cap_mb=TORCH_BUCKET_MB, **options):
    """Wrap model in DistributedDataParallel behind version checks; comm_hook names a compression of the gradients'
    all-reduce (utils/config.py's COMM_HOOKS), options are further DDP arguments (the recipe's ddp section)."""
    if check_version(torch.__version__, "1.12.0", "torch ", pinned=True):
        raise UsageError("torch==1.12.0 DDP training is not supported due to a known issue; upgrade or "
                         "downgrade torch. See https://github.com/ultralytics/yolov5/issues/8395")
    device_ids = [device.index] if device.type == "cuda" else None  # device_ids must be None for CPU modules
    # No static_graph: with it, a rank that joins (join(), for uneven shares) before its first step of a DDP
    # instance, as one resumed on an epoch's last step can, mismatches the others' collectives; and it measured
    # no faster here.
    # broadcast_buffers=False: training steps never read BatchNorm's running statistics, so each rank keeps its
    # own and rank 0's go to every rank before validation (broadcast_buffers below) and into checkpoints. DDP's
    # own per-step broadcast would take them from whichever rank join() picks, which a resume cannot reproduce.
    no_sync = {"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters \
        else {"broadcast_buffers": False}  # renamed in newer torch, which warns about the old name
    # torch's default size is left to torch: given any size, recent torch (2.14 here) caps the first bucket (the
    # last layers' gradients) at it too, not at the 1 MB that lets their all-reduce start early.
    if bucket_cap_mb != TORCH_BUCKET_MB:
        options["bucket_cap_mb"] = bucket_cap_mb
    ddp = DDP(model, device_ids=device_ids, output_device=device_ids and device_ids[0], **no_sync, **options)
    # The hook holds under join() (a rank that has run out runs it on zeros, so its all-reduces still match) and
    # no_sync() (which skips it). fp16 keeps more bits than bf16 but flushes gradients below 6e-8 to zero unless
    # train.precision=fp16's loss scale lifts them.
    if comm_hook != "none":  # state None: the hook all-reduces over the default group
        ddp.register_comm_hook(None, getattr(default_hooks, f"{comm_hook}_compress_hook"))
    return ddp


def sync_batchnorm(model, enabled, device):
    """With model.sync_bn on several GPUs, BatchNorm statistics are computed over the global batch (SyncBatchNorm)."""
    if not enabled:
        return model
    if device.type != "cuda":
        raise UsageError("model.sync_bn=true needs CUDA devices (SyncBatchNorm runs on GPUs only); on CPU use "
                         "model.norm=group for statistics that do not depend on the number of processes")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if WORLD_SIZE > 1 else model


def batchnorm_layers(model):
    """model's BatchNorm layers (any dimension, SyncBatchNorm and timm's BatchNormAct2d included)."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@contextmanager
def one_image_batchnorm(model, images):
    """Context for a training forward of `images` images: one image alone (an epoch's last, partial step can leave
    a process one, or one per micro-batch) is normalised by the BatchNorm layers' running statistics, which it leaves
    as they are. Its own statistics would be those of a single image, and an error where a feature map is 1x1.
    SyncBatchNorm keeps its statistics over every process's micro-batch."""
    layers = [m for m in batchnorm_layers(model) if m.training and not isinstance(m, nn.SyncBatchNorm)
              ] if images == 1 else []
    for layer in layers:
        layer.eval()
    try:
        yield
    finally:
        for layer in layers:
            layer.train()


def model_ema(model, decay, steps, global_batch, epochs):
    """An exponential moving average of model's weights and buffers (torch.optim.swa_utils.AveragedModel), to be
    updated every `steps` optimizer steps. As in torchvision's reference recipes, the decay is adjusted to the
    global batch, the steps between updates and the epochs: alpha = (1 - decay) * batch * steps / epochs."""
    alpha = min(1.0, (1 - decay) * global_batch * steps / epochs)
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(1 - alpha), use_buffers=True)


def update_ema(ema, model, warmup):
    """Move the EMA towards the weights; during warmup it restarts each time, so it copies them (as torchvision's
    reference recipes do: the early, fast-changing weights are not worth averaging)."""
    ema.update_parameters(de_parallel(model))
    if warmup:
        ema.n_averaged.fill_(0)


def ddp_of(model):
    """The DDP wrapper of a (compiled) training model, or None for one process."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wraps DDP, not the reverse (see compiled())
    return model if isinstance(model, DDP) else None


def de_parallel(model):
    """Return the plain module inside torch.compile's and DDP's wrappers (or the model itself): its state_dict has
    no '_orig_mod.' or 'module.' prefixes."""
    ddp = ddp_of(model)
    return ddp.module if ddp is not None else getattr(model, "_orig_mod", model)


def join_uneven_inputs(model, uneven=True):
    """Context that lets DDP ranks run different numbers of steps (no sample is padded or dropped); with even
    shares it is off and costs nothing."""
    ddp = ddp_of(model)
    return ddp.join(enable=uneven) if ddp is not None else nullcontext()


def no_sync(model, skip=True):
    """Context in which backward() only accumulates gradients on each process (DDP.no_sync): for the micro-batches
    of a step before its last, whose backward all-reduces the sum once."""
    ddp = ddp_of(model)
    return ddp.no_sync() if skip and ddp is not None else nullcontext()


def memory_format(channels_last):
    """train.channels_last: torch.channels_last (NHWC, what GPU tensor cores and oneDNN convolutions prefer), else
    the default contiguous (NCHW) format. 'auto' is settled before (utils/precision.settle_auto)."""
    if channels_last not in (True, False):
        raise ValueError(f"train.channels_last={channels_last!r} is not settled to true or false")
    return torch.channels_last if channels_last else torch.contiguous_format


def compiled(model, enabled):
    """train.compile: torch.compile the training model, DDP wrapper included, so that TorchDynamo's DDPOptimizer
    splits the graph at DDP's buckets and all-reduces still overlap the backward pass. The plain module is still
    what is saved, validated and averaged (de_parallel)."""
    return torch.compile(model) if enabled else model


