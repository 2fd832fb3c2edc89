"""Process set-up for training: ranks, device, threads, seeds, DDP and mixed precision."""

import inspect
import os
import random
import re
import sys
from contextlib import contextmanager, nullcontext
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import get_error_handler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.torch_version import TorchVersion

from utils.config import DEVICES, parse_device
from utils.general import LOGGER, RANK, WORLD_SIZE, SharedError, UsageError, cpu_count, error_line

# Set by torchrun; absent means one process.
LOCAL_RANK = int(os.getenv("LOCAL_RANK", 0))
LOCAL_WORLD_SIZE = int(os.getenv("LOCAL_WORLD_SIZE", 1))  # processes on this machine
RESTART_COUNT = int(os.getenv("TORCHELASTIC_RESTART_COUNT", 0))  # > 0: torchrun restarted the workers after a failure
RUN_ID = os.getenv("TORCHELASTIC_RUN_ID")  # the torchrun job (--rdzv-id; with --standalone, one per launch)
# How long a rank waits at a collective for the others. No rank works alone for long (validation and data checks are
# shared, rank 0 only saves), so a rank that waits this long waits for one that is stuck.
DIST_TIMEOUT = timedelta(minutes=10)

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
COMM_HOOKS = {"none": None, "bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
TORCH_BUCKET_MB = 25  # DDP's default bucket_cap_mb
TORCH_MINIMUM = "2.4"  # requirements.txt's torch>=2.4


def exit_on_error(script, error):
    """Report a UsageError as one line and exit with code 2: a SharedError (the same on every rank) once, by rank
    0, another by the rank that met it, named. Recorded for torchrun, whose summary then names the cause."""
    if RANK == 0 or not isinstance(error, SharedError):
        prefix = "" if isinstance(error, SharedError) or WORLD_SIZE == 1 else f"[rank {RANK}] "
        print(f"{prefix}{script}: error: {error_line(error)}", file=sys.stderr)
        get_error_handler().record_exception(error)
    sys.exit(2)


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


def distributed_backend(cuda_available):
    """gloo for CPU tensors, and nccl for GPU tensors where there is CUDA (one group holds both)."""
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def setup_distributed():
    """Check torch's version, then join the process group that torchrun describes in the environment; nothing to
    join for one process.

    Joined before the recipe is read, so rank 0 alone can read a checkpoint and share it; object collectives
    and barriers use gloo, so the device need not be chosen yet.
    """
    check_version(torch.__version__, TORCH_MINIMUM, "torch ", hard=True)  # first: an older one fails later, unclearly
    if WORLD_SIZE > 1 and not dist.is_initialized():
        dist.init_process_group(backend=distributed_backend(torch.cuda.is_available()), timeout=DIST_TIMEOUT,
                                **restart_store())


def restart_store():
    """After a torchrun restart on one machine, a store for the process group whose keys are this attempt's alone.

    torchrun shares its rendezvous store with the workers by default, and the restarted workers of a failed
    attempt can read its stale addresses and hang or fail to connect (pytorch/pytorch#135712). The restart count
    separates attempts where one agent restarts every worker; across machines it can differ, so multi-node jobs
    set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 instead (see README).
    """
    if not RESTART_COUNT or os.getenv("TORCHELASTIC_USE_AGENT_STORE") != "True" or LOCAL_WORLD_SIZE != WORLD_SIZE:
        return {}
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD_SIZE, is_master=False,
                          timeout=DIST_TIMEOUT)
    return {"store": dist.PrefixStore(f"attempt_{RESTART_COUNT}", store), "rank": RANK, "world_size": WORLD_SIZE}


def set_device(device):
    """Make device this process's GPU (before any nccl collective), if it is one."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def cleanup_distributed():
    """Leave the process group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()


def set_threads(workers="auto", cached=False, device_type="cpu", cores=None, procs_per_machine=LOCAL_WORLD_SIZE):
    """Split this machine's cores between the processes on it, and each process's between DataLoader workers and
    compute threads; return (threads, workers, why) where why says how the workers were chosen.

    Each process gets cores // procs_per_machine cores; its workers take at most all but one, its compute threads
    the rest, so the machine is never oversubscribed. data.workers=auto picks by what feeds the model (see
    auto_workers); a number asked for is lowered, with a warning, to what fits.
    """
    cores = cores or cpu_count()
    per_process = max(1, cores // procs_per_machine)
    if workers == "auto":
        workers, why = auto_workers(per_process, cached, device_type)
    else:
        asked, workers, why = int(workers), min(int(workers), per_process - 1), "data.workers"
        if workers < asked:
            LOGGER.warning(f"data.workers={asked} lowered to {workers}: {cores} cores shared by "
                           f"{procs_per_machine} process(es) leave {per_process} per process, one of them for compute")
    threads = max(1, per_process - workers)
    torch.set_num_threads(threads)
    return threads, workers, why


def auto_workers(cores, cached, device_type):
    """data.workers=auto for a process with `cores` cores: (workers, why). Measured by benchmarks/data.py: batches
    gathered from the RAM cache cost little, so every core computes; a GPU computes by itself, so all cores but
    the feeding one decode; on a CPU, decoding and the model share the cores half and half."""
    if cached:
        return 0, "auto: data.cache=ram, every core computes"
    if device_type == "cuda":
        return cores - 1, "auto: the GPU computes, the other cores decode"
    return cores // 2, "auto: half the cores decode, half compute"


def rng_states():
    """This process's random generator states (python, numpy, torch CPU and CUDA) as plain, weights_only-safe values."""
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_states(states):
    """Restore states saved by rng_states()."""
    random.setstate((states["python"][0], tuple(states["python"][1]), states["python"][2]))
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])


def init_seeds(seed=0, deterministic=False):
    """Seed python, numpy and torch; optionally ask torch for deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    torch.backends.cudnn.benchmark = not deterministic  # benchmark picks the fastest, not the same, kernels
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # required by deterministic cuBLAS
        # warn_only: some CUDA kernels (e.g. adaptive pooling backward) have no deterministic version
        torch.use_deterministic_algorithms(True, warn_only=True)


def smart_DDP(model, device, comm_hook="none", bucket_cap_mb=TORCH_BUCKET_MB, **options):
    """Wrap model in DistributedDataParallel behind version checks; comm_hook names a COMM_HOOKS compression of the
    gradients' all-reduce, options are further DDP arguments (the recipe's ddp section holds both)."""
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
    if COMM_HOOKS[comm_hook] is not None:
        ddp.register_comm_hook(None, COMM_HOOKS[comm_hook])  # state None: the hook all-reduces over the default group
    return ddp


def sync_batchnorm(model, enabled, device):
    """With model.sync_bn on several GPUs, BatchNorm statistics are computed over the global batch (SyncBatchNorm)."""
    if not enabled:
        return model
    if device.type != "cuda":
        raise UsageError("model.sync_bn=true needs CUDA devices (SyncBatchNorm runs on GPUs only); on CPU use "
                         "model.norm=group for statistics that do not depend on the number of processes")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if WORLD_SIZE > 1 else model


def model_ema(model, decay, steps, global_batch, epochs):
    """An exponential moving average of model's weights and buffers (torch.optim.swa_utils.AveragedModel), to be
    updated every `steps` optimizer steps. As in torchvision's reference recipes, the decay is adjusted to the
    global batch, the steps between updates and the epochs: alpha = (1 - decay) * batch * steps / epochs."""
    alpha = min(1.0, (1 - decay) * global_batch * steps / epochs)
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(1 - alpha), use_buffers=True)


def broadcast_module(module, src=0):
    """Copy rank src's parameters and buffers of module to every rank."""
    if dist.is_initialized():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=src)


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
    the default contiguous (NCHW) format."""
    return torch.channels_last if channels_last else torch.contiguous_format


def compiled(model, enabled):
    """train.compile: torch.compile the training model, DDP wrapper included, so that TorchDynamo's DDPOptimizer
    splits the graph at DDP's buckets and all-reduces still overlap the backward pass. The plain module is still
    what is saved, validated and averaged (de_parallel)."""
    return torch.compile(model) if enabled else model


@contextmanager
def torch_distributed_zero_first(local_rank=LOCAL_RANK):
    """Let local rank 0 run the block (e.g. prepare a dataset) while the other local ranks wait for it."""
    distributed = dist.is_initialized()
    if distributed and local_rank != 0:
        dist.barrier()
    yield
    if distributed and local_rank == 0:
        dist.barrier()


def broadcast_object(obj, src=0):
    """Return rank src's obj on every rank (a no-op for one process)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def on_rank0(fn, *args):
    """Run fn(*args) on rank 0 alone and return its result on every rank. A UsageError or OSError it raises is
    raised on every rank as one SharedError, so no rank is left waiting for a rank that has failed."""
    result, error = None, None
    if RANK == 0:
        try:
            result = fn(*args)
        except (UsageError, OSError) as e:
            error = error_line(e)
    result, error = broadcast_object((result, error))
    if error is not None:
        raise SharedError(error)
    return result


def gather_object(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] for one process)."""
    if not dist.is_initialized():
        return [obj]
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects


def all_reduce_sum(tensor):
    """Sum a tensor over all ranks in place and return it (a no-op for one process)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_buffers(model, src=0):
    """Copy rank src's buffers (BatchNorm running statistics) to every rank, so all ranks hold one model."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=src)


def broadcast_scaler_state(scaler, src=0):
    """Copy rank src's GradScaler state (scale, growth tracker) to every rank, so all unscale and skip alike."""
    if dist.is_initialized() and scaler.is_enabled():
        scaler.load_state_dict(broadcast_object(scaler.state_dict(), src))


def broadcast_optimizer_state(optimizer, src=0):
    """Copy rank src's optimizer state (momentum, step counts) to every rank."""
    if not dist.is_initialized():
        return
    device = optimizer.param_groups[0]["params"][0].device  # nccl moves only GPU tensors; gloo any
    for state in optimizer.state.values():
        for name, value in state.items():
            if torch.is_tensor(value):
                moved = value.to(device)
                dist.broadcast(moved, src=src)
                value.copy_(moved)


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
