"""Waiting for work other processes do, on its progress rather than a clock.

A worker reports progress (made) on a counter in a key-value store (utils/distributed.job_store(), or a HashStore for
one process) and records its outcome (done, failed); a waiter polls both without entering a collective, and gives up
only when the counter has not moved for STALL_SECONDS, however long the work takes in all. once_per_machine runs
work with no progress to count (a download) on local rank 0 with a heartbeat, the others waiting on it.
"""

import itertools
import os
import socket
import threading
import time

import torch.distributed as dist
from tqdm import tqdm

from utils.distributed import FAILURE_GRACE_S, first_failure, job_store
from utils.general import LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, WORLD_SIZE, UsageError, error_line

STALL_SECONDS = float(os.getenv("CLS_STALL_SECONDS", 600))  # no progress for this long is a stall (tests lower it)
POLL_SECONDS = 0.1
HEARTBEAT_SECONDS = 5  # once_per_machine's sign of life, far inside STALL_SECONDS
CALLS = itertools.count()  # once_per_machine calls of this process: every rank makes the same ones, in order


class Stalled(UsageError):
    """Work another process does made no progress for STALL_SECONDS; says which rank waited, where, and on what."""


class WorkFailed(RuntimeError):
    """The work waited on failed in another process, which reports its own error (utils/distributed.exit_on_error):
    not a UsageError, so this rank says only that it stopped for that rank's failure."""


def local_store():
    """A store for the work of one process (torch's HashStore), with job_store()'s calls."""
    return dist.HashStore()


def made(store, key, amount=1):
    """Count amount of progress on key's work (images written, bytes fetched; 1 for a heartbeat)."""
    store.add(f"{key}/progress", amount)


def progress(store, key):
    """The progress counted on key's work so far."""
    return store.add(f"{key}/progress", 0)


def done(store, key, error=None):
    """Record key's work as done, or as failed with error (waiters stop at once); the first outcome recorded stands."""
    store.compare_set(f"{key}/outcome", "", "ok:" if error is None else f"error:{error_line(error)}")


def finished(store, key, doing="waiting"):
    """Whether key's work has an outcome; on a failure, WorkFailed once the failed rank's own report is in the job's
    store (or after FAILURE_GRACE_S), so that this rank's line names that rank rather than repeating its error."""
    if not store.check([f"{key}/outcome"]):
        return False
    status, _, line = store.get(f"{key}/outcome").decode().partition(":")
    if status == "error":
        for _ in range(int(FAILURE_GRACE_S / POLL_SECONDS)):
            if first_failure(job_store()) is not None or job_store() is None:
                break
            time.sleep(POLL_SECONDS)
        raise WorkFailed(f"rank {RANK} on {socket.gethostname()}: {doing} stopped: it failed ({line})")
    return True


def wait_for(store, key, doing, until=None, total=None, desc=None):
    """Wait until key's work is finished (or until() is true), showing its progress as a bar on rank 0 when desc
    is given; a Stalled error naming this rank, its host and doing when the progress counter stood still for
    STALL_SECONDS, or the worker's error when it failed."""
    last, since = -1, time.monotonic()
    with tqdm(total=total, desc=desc, unit="img", leave=False, disable=desc is None or RANK != 0) as bar:
        while not finished(store, key, doing) and not (until and until()):
            now = progress(store, key)
            if now != last:
                bar.update(now - max(last, 0))
                last, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_SECONDS:
                raise Stalled(f"rank {RANK} on {socket.gethostname()}: {doing} made no progress for "
                              f"{STALL_SECONDS:g} s (at {now}); stopped waiting")
            time.sleep(POLL_SECONDS)


def once_per_machine(name, doing, work):
    """Run work() on local rank 0 of each machine while the machine's other ranks wait, with a heartbeat as its
    progress; return once every machine's work is done. work's error is raised where it is met; the ranks waiting on
    it stop (WorkFailed). Without a process group, every process runs work itself."""
    store = job_store()
    alone = store is None
    store, machines = store or local_store(), 1 if alone else max(1, WORLD_SIZE // LOCAL_WORLD_SIZE)
    job = f"{name}/{next(CALLS)}"
    mine = f"{job}/machine{RANK // LOCAL_WORLD_SIZE}"
    if LOCAL_RANK == 0 or alone:
        beating = threading.Event()
        beat = threading.Thread(target=heartbeat, args=(store, (mine, job), beating), daemon=True)
        beat.start()
        try:
            work()
        except Exception as e:
            for key in (mine, job):
                done(store, key, e)
            raise
        finally:
            beating.set()
        done(store, mine)
        store.add(f"{job}/machines", 1)
    else:
        wait_for(store, mine, f"waiting for local rank 0 {doing}")
    wait_for(store, job, f"waiting for every machine {doing}",
             until=lambda: store.add(f"{job}/machines", 0) == machines)


def heartbeat(store, keys, stop):
    """Count progress on keys every HEARTBEAT_SECONDS until stop is set."""
    while not stop.wait(HEARTBEAT_SECONDS):
        for key in keys:
            made(store, key)
