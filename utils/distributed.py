"""The process group torchrun describes: joining and leaving it, the collectives every rank calls together, and
how an error met by one rank reaches the user and ends the others."""

import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from utils.general import (LOCAL_RANK, LOCAL_WORLD_SIZE, MACHINE, RANK, RESTART_COUNT, SHARE_ONE_GPU, WORLD_SIZE,
                           SharedError, UsageError, error_line, in_flags)
from utils.torch_utils import TORCH_MINIMUM, check_version, de_parallel
from utils.watchdog import (GONE, LEFT, Watchdog, collective, hung_line, identity, limit, on_this_machine, proc_start,
                            published)

# How long a rank waits at a collective for the others. No rank works alone for long (validation and data checks are
# shared, rank 0 only saves), so a rank that waits this long waits for one that is stuck.
DIST_TIMEOUT = timedelta(minutes=10)
HOST = socket.gethostname()
# A rank that sees another rank's failure in the store gives its own error (the same one, when every rank meets it)
# this long to surface first; an error met by every rank together surfaces on all of them well within it.
FAILURE_GRACE_S = 3.0
FAILURE_POLL_S = 0.5  # how often each rank looks for another rank's failure in the store, and shows it lives
# The longest one call to the job's store waits: where the process that holds it (torchrun's agent on the first
# machine) is gone, or its machine, a call fails after this rather than after DIST_TIMEOUT.
STORE_TIMEOUT = timedelta(seconds=30)
# This launch attempt's name and store, the event that stops watch_failures, and the lock held by the one thread
# (the main one, or watch_failures) that says how this process ends; set when the process group is joined.
_job = {"token": None, "store": None, "stop": threading.Event(), "said": threading.Lock(), "failed_here": False,
        "ending": False, "ended": None, "dog": None}
_when_failing = []  # what this process does before it ends on a failure (when_failing)


def when_failing(action):
    """Have action() run before this process ends on a failure, its own or another rank's (once, whichever thread
    ends it)."""
    _when_failing.append(action)


def run_failure_actions():
    """Run (and forget) the actions when_failing registered; one that fails is skipped: the process is ending on
    the error it already has."""
    while _when_failing:
        try:
            _when_failing.pop()()
        except Exception:
            pass


def exit_on_error(script, error, flags=None):
    """End this rank on a UsageError with code 2 and one line: rank 0 says its own; another rank says its own, naming
    itself and its machine, unless rank 0 says the same (an error every rank meets is said once a machine: by rank 0,
    and on each other machine by its first rank, whose console shows no other). Under torchrun the
    error is first recorded in the job's store, where every other rank finds it (watch_failures). flags: for a script
    whose options are not train.py's recipe keys, {recipe key: its option} (val.py: {'data.name': '--data'}), so that
    a line from the shared data code names what the user typed (utils.general.in_flags)."""
    line, store, seconds = error_line(error), _job["store"], int(time.time())
    line = in_flags(line, flags) if flags else line
    run_failure_actions()
    if getattr(error, "blamed", None):  # this rank stopped because another died or stalled (utils/once.Stalled)
        blamed_line, blamed_rank, blamed_host = error.blamed
        if store is not None:
            record_failure(store, blamed_line, seconds, blamed_rank, blamed_host)
        say(f"{script}: {line}", seconds + 1)  # after the blamed rank's second: torchrun names it where it can
        if store is not None:  # a blamed rank that lives ends on its record (end_as_named): let it end first
            time.sleep(FAILURE_GRACE_S + 1)
        sys.exit(2)
    if store is not None:
        record_failure(store, line, seconds)
    own = f"{script}: error: {line}" if RANK == 0 else f"{script}: error: rank {RANK} on {HOST}: {line}"
    if RANK != 0 and (MACHINE == 0 or LOCAL_RANK != 0) and said_by_rank0(store, error, line):  # once a machine
        record_for_torchrun(own, seconds)  # not said twice, but torchrun's summary of this rank still shows its line
    else:
        say(own, seconds)
    if store is not None:  # said; leaving the group can take seconds, in which a rank that this failure stopped
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # may end, and torchrun's SIGTERM would make this code 2 a -15
    sys.exit(2)


def said_by_rank0(store, error, line):
    """Whether rank 0 says this rank's error line too: an error every rank meets (before the group is joined, one
    shared by its kind; after, one rank 0 recorded within FAILURE_GRACE_S)."""
    if store is None:
        return isinstance(error, SharedError)
    return failure_line(store, 0, FAILURE_GRACE_S) == line


def stop_if_another_rank_failed(script):
    """After an unexpected error (a collective broken by a rank that left): if another rank recorded its failure, or
    left without a word (departed), end this rank with code 2 and the line that names it, rather than a traceback of
    the broken collective. An error of this rank's own (not a collective or the store that broke) is recorded, for
    the other ranks to say, before the caller raises it."""
    run_failure_actions()
    store, error = _job["store"], sys.exc_info()[1]
    broken = isinstance(error, dist.DistError) or "gloo" in str(error)  # gloo's are RuntimeErrors
    try:
        first = first_failure(store, quiet=False)
    except dist.DistError as e:  # the job's store is gone, with torchrun's agent that held it: so is the job
        if agent_store():
            end_without_store(script, e)
        first = None
    if first is None and store is not None and broken:
        first = departed(store)
    if first == RANK and not _job["failed_here"]:  # another rank named this one as hung
        end_as_named(script, store)
    if first is not None and first != RANK:
        say_stopped(script, first)
        sys.exit(2)
    if first is None and store is not None and error is not None and not broken:
        record_failure(store, f"{type(error).__name__}: {error_line(error)}", int(time.time()))


def departed(store):
    """The rank whose process left without a word (killed by SIGKILL or the out-of-memory killer, its machine gone)
    and so broke this rank's collective, recorded as blame records a hung one; or the failure another rank records
    meanwhile; None if the other ranks live on. One on this machine shows within a moment (its process is exiting);
    with ranks elsewhere (and the watchdog on: train.hang_seconds), their signs of life are watched until one stood
    still for 2 x FAILURE_GRACE_S, read no more often than the watch thread reads them (Watchdog.every)."""
    dog, start, read_at = Watchdog(store, host=HOST), time.monotonic(), None
    silent_for = 2 * FAILURE_GRACE_S if limit() else None
    with suppress(dist.DistError):  # a store that does not answer tells nothing more
        while True:
            if (first := first_failure(store)) is not None:
                return first
            if read_at is None or time.monotonic() - read_at >= max(FAILURE_POLL_S, dog.every):
                read_at = time.monotonic()
                if dog.read() and (ended := dog.gone(silent_for)):
                    return blame(store, *ended)
            elsewhere = dog.procs is None or len(dog.local) < len(dog.others)
            if time.monotonic() - start > ((silent_for or 0) if elsewhere else 0) + 2 * FAILURE_POLL_S:
                return None
            time.sleep(FAILURE_POLL_S / 5)


def record_failure(store, line, seconds, rank=RANK, host=HOST):
    """Put a rank's error line and the time it met it (seconds since the epoch) in the job's store, and that rank as
    the first that failed unless one was: this rank's, or those of another, one that died or stalled and cannot say
    its own."""
    _job["failed_here"] |= rank == RANK  # this rank's own failure, not one another rank blamed on it
    try:
        store.set(f"error/{rank}", json.dumps({"host": host, "line": line, "time": seconds}))
        store.compare_set("first", "", str(rank))
    except Exception:  # the store's host is gone: the job is ending, and this rank still says its line
        pass


def first_failure(store, quiet=True):
    """The rank that recorded the job's first failure, or None; quiet: None too when the store does not answer."""
    try:
        return int(store.get("first")) if store is not None and store.check(["first"]) else None
    except Exception:
        if not quiet:
            raise
        return None


def failure_line(store, rank, wait_s=0.0):
    """The error line rank recorded, waiting up to wait_s for it (by the clock: a loaded machine's polls are slow);
    None if it records none."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if store.check([f"error/{rank}"]):
                return json.loads(store.get(f"error/{rank}"))["line"]
        except Exception:
            return None
        if time.monotonic() >= deadline:
            return None
        threading.Event().wait(0.05)


def say_stopped(script, first):
    """This rank's line on ending for another rank's failure: rank 0 repeats that rank's error, naming it and its
    machine (the line the user reads), any other rank names it; then a wait that lets the failed rank exit first."""
    try:
        failed = json.loads(_job["store"].get(f"error/{first}"))
    except Exception:
        failed = {"host": "its machine", "line": "its error did not reach this rank"}
    seconds = failed.get("time", int(time.time())) + 1  # after the failed rank's: torchrun names it as root cause
    gone = failed["line"].startswith(GONE)  # its process ended without a word
    # One that is gone says nothing: the first other rank on its machine says its line there (torchrun numbers a
    # machine's ranks in a row), as the rank that ended one frozen does.
    witness = gone and failed["host"] == HOST and LOCAL_RANK == (1 if first % LOCAL_WORLD_SIZE == 0 else 0)
    if RANK == 0 or first == _job["ended"] or witness:
        line = f"{script}: error: rank {first} on {failed['host']}: {failed['line']}"
    else:
        line = f"{script}: rank {RANK} on {HOST} stopped: rank {first} on {failed['host']} failed"
    say(line, seconds)
    # The failed rank may still wait up to FAILURE_GRACE_S for rank 0's line (said_by_rank0) before it exits. It
    # should exit first: torchrun then ends this rank, and its summary shows the failed rank's exit code, where a
    # stopped rank that exited first would have torchrun kill the failed one.
    if first != _job["ended"] and not gone:
        time.sleep(FAILURE_GRACE_S + 1)


def say(text, seconds=None):
    """Print this process's last line, once (the main thread and watch_failures may both come to it), and record it
    for torchrun, whose summary then shows it, as met at seconds (since the epoch; now when None)."""
    if _job["store"] is None or _job["said"].acquire(blocking=False):
        print(text, file=sys.stderr, flush=True)
        record_for_torchrun(text, seconds)


def record_for_torchrun(line, seconds=None, path=None):
    """Write line as this worker's error where torchrun reads it (TORCHELASTIC_ERROR_FILE, in the format of torch's
    ErrorHandler), with no traceback: torchrun's summary shows the line alone. torchrun names as root cause the
    error with the earliest time, in whole seconds: a failed rank records the second it met its error (seconds,
    not when it gets to say it: a loaded machine can take longer than the others' FAILURE_GRACE_S), and a rank
    stopped by its failure the next one, so that the rank that failed is named, however the two are scheduled."""
    path = path or os.getenv("TORCHELASTIC_ERROR_FILE")  # another rank's: one frozen on this machine (blame)
    if not path:  # one process: no torchrun to tell
        return
    seconds = int(time.time()) if seconds is None else seconds
    error = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(seconds)}}
    with open(path, "w") as f:
        json.dump({"message": error}, f)


def watch_failures(script, store, stop):
    """Until stop is set (the process group is left): show that this process lives and where it is (sign_of_life);
    name a rank that hangs (utils/watchdog.py: every rank watches the others); once another rank records a failure,
    give this rank's own error FAILURE_GRACE_S to surface, then say the failed rank and end this process, wherever
    its main thread waits (a collective with a rank that left can wait until DIST_TIMEOUT). A rank that another named
    as hung ends with that line; every rank ends when the job's store is gone (its agent on the first machine
    ended)."""
    dog, published_moves = Watchdog(store, host=HOST), [None]
    _job["dog"] = dog
    while not stop.wait(FAILURE_POLL_S):
        try:
            sign_of_life(store, published_moves)
            first = first_failure(store, quiet=False)
            if first is None and (hung := dog.hung()):
                first = blame(store, *hung)
        except dist.DistError as e:
            if stop.is_set() or not agent_store():
                return
            end_without_store(script, e)
        if first is None:
            continue
        _job["ending"] = True  # a stop signal now (torchrun's, for the failure) is no request to save
        if first == RANK:
            if _job["failed_here"]:
                return  # this rank says its own error
            end_as_named(script, store)
        # A rank that this one ended (frozen) says nothing more: no grace to wait for its line
        if (first != _job["ended"] and stop.wait(FAILURE_GRACE_S)) or _job["said"].locked():
            return
        run_failure_actions()
        say_stopped(script, first)
        os._exit(2)


def ending():
    """Whether this process is ending on a failure that its watch thread saw (its own or another rank's), or will see:
    a rank on this machine whose process has ended (torchrun's stop signal for it comes first). Reads no store."""
    dog = _job["dog"]
    return _job["ending"] or (dog is not None and dog.procs is not None and dog.gone() is not None)


def sign_of_life(store, published_moves=None):
    """Count one on this rank's sign of life in the job's store: a rank whose count stands still is gone or stopped
    (killed, SIGSTOPped, its machine down), whatever its work does (utils/once.wait_for reads it); and publish this
    rank's place in the run when it moved since published_moves[0] (utils/watchdog.py)."""
    store.add(f"alive/{RANK}", 1)
    if published_moves is not None:
        place, moves = published()
        if moves != published_moves[0]:
            store.set(f"place/{RANK}", place)
            published_moves[0] = moves


def blame(store, rank, why, place, frozen):
    """Record rank as hung (the job's first failure, so every rank stops naming it) and return it; one frozen on this
    machine is ended here, its line first written where torchrun reads it, so that torchrun names it, not a
    waiter."""
    seconds, info = int(time.time()), json.loads(store.get(f"proc/{rank}"))
    record_failure(store, hung_line(why, place, frozen), seconds, rank, info["host"])
    if frozen and on_this_machine(info, HOST) and proc_start(info["pid"]) == info["start"] is not None:
        line = f"{os.path.basename(sys.argv[0])}: error: rank {rank} on {HOST}: {hung_line(why, place, frozen)}"
        record_for_torchrun(line, seconds, info["error_file"])
        os.kill(info["pid"], signal.SIGKILL)
        _job["ended"] = rank  # it says nothing more: this rank says its line, and need not wait for it to end
    return rank


def end_as_named(script, store):
    """End this rank, which another rank named as hung (its main thread is stuck, its watch thread not): with the
    line recorded for it, said on this machine's console and recorded for torchrun, whose summary then names this
    rank as the root cause."""
    run_failure_actions()
    try:
        failed = json.loads(store.get(f"error/{RANK}"))
        line, seconds = failed["line"], failed["time"]
    except Exception:
        line, seconds = "named as hung by another rank", int(time.time())
    print_main_stack(f"rank {RANK} on {HOST}, named as hung, stands here")
    text = f"{script}: error: rank {RANK} on {HOST}: {line}"
    if RANK >= LOCAL_WORLD_SIZE or RANK == 0:  # on rank 0's machine, rank 0 says it (say_stopped)
        say(text, seconds)
    elif _job["said"].acquire(blocking=False):
        record_for_torchrun(text, seconds)
    os._exit(2)


def print_main_stack(title):
    """Print where the main thread stands (its stack, most recent call last), under title: what a hung rank is
    stuck in, said before it ends, when nobody can attach a debugger to it any more."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is not None:
        print(f"{title}:\n{''.join(traceback.format_stack(frame)).rstrip()}", file=sys.stderr, flush=True)


def end_without_store(script, error):
    """End this rank when the job's store does not answer: torchrun's agent that holds it (on the first machine) has
    ended, so the job is over, and no collective of this rank will end by itself."""
    if _job["said"].locked():
        return
    run_failure_actions()
    say(f"{script}: rank {RANK} on {HOST} stopped: the job's store does not answer ({error_line(error)}); torchrun's "
        "agent on the first machine, which holds it, has ended")
    os._exit(2)


def agent_store():
    """Whether the job's store lives in torchrun's agent (it outlives every worker of a job that ends well), not in
    rank 0's process (a launch without torchrun), where it is gone once rank 0 is."""
    return os.getenv("TORCHELASTIC_USE_AGENT_STORE") == "True"


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
        _job["token"] = broadcast_object(uuid.uuid4().hex)  # this attempt's own name in the store, drawn by rank 0
        _job["store"] = connect_job_store(_job["token"])
        _job["store"].set(f"proc/{RANK}", identity(HOST))  # for a rank that ends this one if it freezes (blame)
        sign_of_life(_job["store"], [None])  # before any other rank can wait on this one
        _job.update(stop=threading.Event(), said=threading.Lock(), failed_here=False, ending=False, ended=None)
        threading.Thread(target=watch_failures, args=(os.path.basename(sys.argv[0]), _job["store"], _job["stop"]),
                         name="watch_failures", daemon=True).start()
        check_same_layout()


def check_same_layout():
    """Refuse machines that run different numbers of processes (torchrun allows it): a machine's ranks are counted
    from LOCAL_WORLD_SIZE (Topology), which holds only where every machine runs as many, and work shared once per
    machine would wait for a machine that is never counted."""
    places = gather_object((HOST, LOCAL_RANK, LOCAL_WORLD_SIZE))
    machines = [(rank, host, n) for rank, (host, local_rank, n) in enumerate(places) if local_rank == 0]
    if len({n for *_, n in machines}) > 1:
        runs = ", ".join(f"{host} runs {n} ({f'ranks {rank}-{rank + n - 1}' if n > 1 else f'rank {rank}'})"
                         for rank, host, n in machines)
        raise SharedError(f"every machine must run the same number of processes (torchrun's --nproc_per_node): "
                          f"{runs}; start each machine's torchrun with the same --nproc_per_node")


def job_store():
    """The process group's key-value store (torch's TCPStore, reachable from every rank on every machine), under a
    prefix that names this launch attempt alone: keys of a failed attempt that torchrun restarted are never read.
    None for one process."""
    return _job["store"] if dist.is_initialized() else None


class Topology(NamedTuple):
    """Where a process stands in the job: its rank and local rank, the processes on its machine and in all, and the
    job's store (None for one process), for code that splits work between processes (data/jpeg_cache.py)."""

    rank: int
    local_rank: int
    local_world_size: int
    world_size: int
    store: object

    @property
    def machine(self):
        """This process's machine's number (its torchrun agent's node rank)."""
        return self.rank // self.local_world_size

    @property
    def machines(self):
        """The machines of the job."""
        return max(1, self.world_size // self.local_world_size)


def topology():
    """This process's Topology, as torchrun describes it."""
    return Topology(RANK, LOCAL_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE, job_store())


def connect_job_store(token):
    """A connection of this process's own to the store the process group joined at (MASTER_ADDR:MASTER_PORT, as
    torchrun sets them), whose calls wait at most STORE_TIMEOUT, under token's prefix (job_store)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=STORE_TIMEOUT, wait_for_workers=False)
    return dist.PrefixStore(f"cls/{token}/", store)


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
    """Leave the process group, if any (the job's store stays, for exit_on_error to record an error in)."""
    _job["stop"].set()
    if _job["store"] is not None:  # its silence from now on says nothing (utils/watchdog.py)
        with suppress(Exception):
            _job["store"].set(f"place/{RANK}", LEFT)
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


@collective
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
    result, error = broadcast_object((result, error))  # the others wait: rank 0 is named if it stands still
    if error is not None:
        raise SharedError(error)
    return result


@collective
def gather_object(obj):
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] for one process)."""
    if not dist.is_initialized():
        return [obj]
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects


@collective
def all_gather_rows(tensor):
    """Every rank's rows of tensor (ranks may hold different numbers, none too), concatenated in rank order, on every
    rank; the tensor itself for one process."""
    if not dist.is_initialized():
        return tensor
    counts = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=tensor.device)
    counts[dist.get_rank()] = len(tensor)
    counts = all_reduce_sum(counts).tolist()
    padded = tensor.new_zeros((max(counts), *tensor.shape[1:]))  # all_gather takes tensors of one shape
    padded[: len(tensor)] = tensor
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def shared_work(fn, count):
    """[fn(0), ..., fn(count - 1)] on every rank, each rank computing every WORLD_SIZE-th (rank r: r, r + W, ...)
    and gathering the others' (fn's results are pickled)."""
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    parts = gather_object([fn(i) for i in range(rank, count, world)])
    return [parts[i % world][i // world] for i in range(count)]


@collective
def all_reduce_sum(tensor):
    """Sum a tensor over all ranks in place and return it (a no-op for one process)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@collective
def broadcast_buffers(model, src=0):
    """Copy rank src's buffers (BatchNorm running statistics) to every rank, so all ranks hold one model."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=src)


@collective
def broadcast_scaler_state(scaler, src=0):
    """Copy rank src's GradScaler state (scale, growth tracker) to every rank, so all unscale and skip alike."""
    if dist.is_initialized() and scaler.is_enabled():
        scaler.load_state_dict(broadcast_object(scaler.state_dict(), src))


@collective
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


@collective
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
