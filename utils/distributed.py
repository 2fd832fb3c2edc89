"""The process group torchrun describes: joining and leaving it, and the collectives every rank calls together."""

import os
import sys
import uuid
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from utils.general import (LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, RESTART_COUNT, SHARE_ONE_GPU, WORLD_SIZE, SharedError,
                           UsageError, error_line)
from utils.torch_utils import TORCH_MINIMUM, check_version, de_parallel

# How long a rank waits at a collective for the others. No rank works alone for long (validation and data checks are
# shared, rank 0 only saves), so a rank that waits this long waits for one that is stuck.
DIST_TIMEOUT = timedelta(minutes=10)


def exit_on_error(script, error):
    """Report a UsageError as one line and exit with code 2: a SharedError (the same on every rank) once, by rank
    0, another by the rank that met it, named. Recorded for torchrun, whose summary then names the cause."""
    if RANK == 0 or not isinstance(error, SharedError):
        prefix = "" if isinstance(error, SharedError) or WORLD_SIZE == 1 else f"[rank {RANK}] "
        print(f"{prefix}{script}: error: {error_line(error)}", file=sys.stderr)
        get_error_handler().record_exception(error)
    sys.exit(2)


def distributed_backend(cuda_available, share_one_gpu=SHARE_ONE_GPU):
    """gloo for CPU tensors, and nccl for GPU tensors where there is CUDA (one group holds both); gloo for both
    where the processes share one GPU (tests only: SHARE_ONE_GPU_FOR_TESTS=1)."""
    return "cpu:gloo,cuda:nccl" if cuda_available and not share_one_gpu else "gloo"


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
        _job["token"] = broadcast_object(uuid.uuid4().hex)


_job = {"token": None}  # this launch's (and restart attempt's) own name in the store, drawn by rank 0 at set-up


def job_store():
    """The process group's key-value store (torch's TCPStore, reachable from every rank on every machine), under a
    prefix that names this launch attempt alone: keys of a failed attempt that torchrun restarted are never read.
    None for one process."""
    if not dist.is_initialized() or _job["token"] is None:
        return None
    return dist.PrefixStore(f"cls/{_job['token']}/", dist.distributed_c10d._get_default_store())


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


def cleanup_distributed():
    """Leave the process group, if any."""
    if dist.is_initialized():
        dist.destroy_process_group()


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


def broadcast_module(module, src=0):
    """Copy rank src's parameters and buffers of module to every rank."""
    if dist.is_initialized():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=src)


def keep_ranks_in_step(state, loader, epoch):
    """After an epoch in which a rank took one step fewer: bring its schedule, optimizer and GradScaler state to
    those of rank 0 (join() synced the weights), and give every rank rank 0's BatchNorm statistics."""
    most, fewest = loader.sampler.steps()
    for _ in range((epoch + 1) * most - state.scheduler.last_epoch):
        state.scheduler.step()
    if fewest < most:
        broadcast_optimizer_state(state.optimizer)
        broadcast_scaler_state(state.scaler)
    broadcast_buffers(de_parallel(state.model))  # every rank validates rank 0's BatchNorm statistics, as saved
    if state.ema is not None:  # a rank that skipped the epoch's last step also skipped an EMA update there
        broadcast_module(state.ema)
