"""Writing a file once: the project's one way to write a file whole and durably, clean what dead writers left, and
let the other processes wait on the writer's own progress.

A file (or a folder) is written under a temporary name in its own directory, .NAME.tmp-HOST-PID-TOKEN[SUFFIX],
then fsynced, renamed over its path (os.replace) and its directory fsynced, so a crash at any moment leaves the old
file or the new one, whole, and the rename survives a power cut (atomic_write). The kernel, not the name, says who
owns a temporary: its writer holds an exclusive lock (flock) on a lock file beside it, the temporary's name and
.lock, from before it is made until it is renamed or removed, and the kernel frees the lock when the writer's
process ends, however it ends, in whatever pid namespace. Each write first removes the temporary files of the same
path whose lock is free (clean_leftovers); host and pid in the name are for people.

One process writes while the others wait (once_per_machine, or a caller's own split of the work): the work reports
its progress (bytes received, images encoded) on a counter in a key-value store (utils/distributed.job_store(), or
a HashStore for one process) and records its outcome (done, failed); a waiter polls both without entering a
collective, and gives up only when the counter has not moved for STALL_SECONDS, however long the work takes in all,
or when a writer is gone: its pid ended (on this machine), or its sign of life in the job's store (each rank counts
one every FAILURE_POLL_S from a thread, utils/distributed.watch_failures) stood still for LIVENESS_SECONDS, on any
machine. The waiter's line names the writer that stopped, which the job's store then records as the rank that
failed. A stop signal (SIGTERM, Ctrl-C) while writing or waiting ends the process at once (stop_on_signals), its
temporary file removed. Machines whose disk is shared write a file on it once: the lowest-numbered of those that
see the same directory writes, and the others wait on it (first_machine_sharing).
"""

import contextlib
import fcntl
import itertools
import os
import re
import secrets
import shutil
import signal
import socket
import string
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from utils.distributed import FAILURE_GRACE_S, first_failure, job_store
from utils.general import LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, WORLD_SIZE, UsageError, error_line

HOST = socket.gethostname()
STALL_SECONDS = float(os.getenv("CLS_STALL_SECONDS", 600))  # no progress for this long is a stall (tests lower it)
# A rank whose sign of life stood still this long is gone (killed, stopped, its machine down); tests lower it.
LIVENESS_SECONDS = float(os.getenv("CLS_LIVENESS_SECONDS", 15))
POLL_SECONDS = 0.1
LIVENESS_POLL_SECONDS = 1.0  # how often a waiter reads its writers' signs of life
# A temporary file of another machine's writer (a shared disk) whose lock is free here is removed only when also
# untouched for this long: some shared disks keep each machine's locks to itself, and a live writer writes far more
# often. So is one whose lock cannot be tried (a file system without locks).
OTHER_HOST_LEFTOVER_SECONDS = 24 * 3600
LOCK = ".lock"  # a temporary's lock file is its name and this
HELD = {}  # str(temporary) -> descriptor of its lock file, for the temporaries this process writes
CALLS = itertools.count()  # once_per_machine calls of this process: every rank makes the same ones, in order


class Stalled(UsageError):
    """Work another process does made no progress for STALL_SECONDS, or its writer is gone; says which rank waited,
    where, on what, and who stopped. blamed: (line, rank, host) of the writer that stopped, for the job's record of
    the rank that failed (utils/distributed.exit_on_error), or None where the line blames no rank."""

    def __init__(self, line, blamed=None):
        super().__init__(line)
        self.blamed = blamed


class WorkFailed(RuntimeError):
    """The work waited on failed in another process, which reports its own error (utils/distributed.exit_on_error):
    not a UsageError, so this rank says only that it stopped for that rank's failure."""


class Interrupted(SystemExit):
    """A stop signal met while writing or waiting: the process ends with 128 + its number, finally blocks run."""

    def __init__(self, signum, doing):
        super().__init__(128 + signum)
        self.line = f"{signal.Signals(signum).name}: stopped while {doing}; nothing was saved"

    def __str__(self):
        return self.line


# Writing a file whole, durably, and cleaning what dead writers left.

def temporary(path, suffix=""):
    """A new temporary name to write path under, beside it, its lock taken by this process (hold) until it is
    committed or removed (commit, remove): the name says this host and pid for people, and a token that makes it
    new (pids repeat in other pid namespaces and after a reboot; a lock file removed is never made again, which
    clean_leftovers relies on); it ends in suffix (a PNG's writer picks its format by the name's end). Its folder
    must exist."""
    path = Path(path)
    token = "".join(secrets.choice(string.ascii_lowercase) for _ in range(8))  # letters: never taken for the pid
    tmp = path.with_name(f".{path.name}.tmp-{HOST}-{os.getpid()}-{token}{suffix}")
    HELD[str(tmp)] = hold(lock_of(tmp), doing=f"taking the lock of {tmp}")
    return tmp


def lock_of(tmp):
    """The lock file of the temporary tmp."""
    return tmp.with_name(tmp.name + LOCK)


def release(tmp):
    """Give up this process's lock on its temporary tmp, where it holds one, removing the lock's file."""
    fd = HELD.pop(str(tmp), None)
    if fd is not None:
        unlock(lock_of(tmp), fd)


def writer_of(leftover, path):
    """(host, pid) of the writer that named leftover for path (temporary; older versions wrote no token), or None
    when the name is not one of path's temporaries (its lock file is not)."""
    if leftover.name.endswith(LOCK):
        return None
    found = re.fullmatch(rf"\.{re.escape(path.name)}\.tmp-(.+)-(\d+)(-[a-z]{{8}})?(\..*)?", leftover.name, re.S)
    return (found[1], int(found[2])) if found else None


def alive(pid):
    """Whether a process of this pid runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def clean_leftovers(path):
    """Remove the temporary files (or folders) of path whose writer is gone, with their lock files: their lock is
    free (or its file gone) on this host's; for another host's (a shared disk), or where the lock cannot be tried,
    also untouched for OTHER_HOST_LEFTOVER_SECONDS. On NFS, flock is a POSIX lock (Linux 2.6.12 on) that every
    client sees through NFSv4 or lockd; mounted with local_lock (and on some FUSE and SMB mounts) each machine sees
    its own only, hence the age. Returns the paths removed."""
    path, removed = Path(path), []
    found = path.parent.glob(f".{glob_escape(path.name)}.tmp-*")
    for leftover in sorted({p.with_name(p.name.removesuffix(LOCK)) for p in found}):  # a lock file: its temporary's
        writer = writer_of(leftover, path)
        if writer is None or str(leftover) in HELD:  # this process's own: probing would drop a POSIX lock
            continue
        with probed(lock_of(leftover)) as free:
            if free is False or not (free and writer[0] == HOST or untouched(leftover)):
                continue
            if leftover.exists() or leftover.is_symlink():
                removed.append(leftover)
            remove(leftover)
            lock_of(leftover).unlink(missing_ok=True)  # while locked: its writer's name is never made again
    return removed


def written(path):
    """[(name, size, disk blocks, time changed)] of path's temporary files: it changes as their writers write."""
    found = []
    for tmp in Path(path).parent.glob(f".{glob_escape(Path(path).name)}.tmp-*"):
        with contextlib.suppress(FileNotFoundError):  # renamed or removed as it was listed
            info = tmp.stat()
            found.append((tmp.name, info.st_size, info.st_blocks, info.st_mtime_ns))
    return sorted(found)


def untouched(leftover):
    """Whether leftover and its lock file (those there) were last changed OTHER_HOST_LEFTOVER_SECONDS ago."""
    for file in (leftover, lock_of(leftover)):
        with contextlib.suppress(FileNotFoundError):
            if time.time() - file.lstat().st_mtime <= OTHER_HOST_LEFTOVER_SECONDS:
                return False
    return True


def glob_escape(name):
    """name with glob's special characters matched as themselves."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


def remove(path):
    """Remove a file or folder if it is there; this process's lock on it, a temporary, is given up (release)."""
    path = Path(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    release(path)


def fsync_path(path, flags=os.O_RDONLY):
    """Flush path's bytes (a file) or its entries (a folder) to the disk."""
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp, path):
    """Make tmp path, durably: tmp's bytes flushed (a file's; a folder's files are not, as a folder written here is
    written again when lost), renamed over path, and the rename flushed in path's directory. A folder over a folder
    that is not empty raises the OSError of os.replace."""
    tmp, path = Path(tmp), Path(path)
    if not tmp.is_dir():
        fsync_path(tmp)
    os.replace(tmp, path)
    release(tmp)
    fsync_path(path.parent)


@contextlib.contextmanager
def atomic_write(path, suffix="", first_wins=False):
    """Give the temporary path to write path's content at (a file, or a folder); on leaving, make it path (commit).
    Leftovers of dead writers of path are removed first; on any exception (a stop signal too) the temporary is.
    first_wins: a folder that another process (another machine on a shared disk) made first is kept, and this one
    dropped."""
    path = Path(path)
    clean_leftovers(path)
    tmp = temporary(path, suffix)
    try:
        yield tmp
        try:
            commit(tmp, path)
        except OSError:
            if not (first_wins and path.is_dir()):
                raise
    finally:
        remove(tmp)


# Locks the kernel holds: what says a writer lives, whatever its name, pid namespace or machine.

def hold(lock, moved=lambda: None, doing="waiting for a lock"):
    """The descriptor of the file lock, made where missing and locked by this process (flock, exclusive), its host
    and pid written in it for the others' lines. While another process holds it, this one waits as long as moved()
    (a sign of the holder's work) changes, and stops after STALL_SECONDS without (Stalled, naming doing and the
    holder). Where the file system has no locks, the file is made, unlocked (clean_leftovers then goes by age)."""
    last, since = moved(), time.monotonic()
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if (now := moved()) != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since > STALL_SECONDS:
                raise Stalled(f"rank {RANK} on {HOST}: stopped {doing}: {holder(lock)}, which holds its lock "
                              f"{lock.name}, made no progress for {STALL_SECONDS:g} s") from None
            time.sleep(POLL_SECONDS)
            continue
        except OSError:  # no locks here (ENOLCK, EOPNOTSUPP)
            pass
        try:
            if same_file(fd, lock):  # else its holder or a cleaner removed it as this one opened it: made again
                os.ftruncate(fd, 0)
                os.write(fd, f"{HOST} {os.getpid()}\n".encode())
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def same_file(fd, path):
    """Whether path is the file open as fd."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def unlock(lock, fd):
    """Remove the lock file lock and give up the lock held on it as fd (hold): removed while held, so that the file
    at its name is always its holder's (a waiter that then takes the removed one's lock makes it anew: hold)."""
    Path(lock).unlink(missing_ok=True)
    os.close(fd)


@contextlib.contextmanager
def locked(lock, moved=lambda: None, doing="waiting for a lock"):
    """While inside, hold the lock file lock (hold: waiting on moved(), named as doing), removed on leaving."""
    fd = hold(lock, moved, doing)
    try:
        yield
    finally:
        unlock(lock, fd)


@contextlib.contextmanager
def probed(lock):
    """Whether the lock file lock is free, taken while inside where it is: True (free, or no file: its holder
    removed it), False (another process holds it) or None (it cannot be tried: no locks on this file system, or
    not this user's file)."""
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        yield True
        return
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = same_file(fd, lock) or not lock.exists()  # made again since it was opened: its maker holds it
        except BlockingIOError:
            free = False
        except OSError:
            free = None
        yield free
    finally:
        os.close(fd)


def holder(lock):
    """'pid N on HOST', of the process that last took the lock file lock (hold), or 'another process'."""
    with contextlib.suppress(OSError, ValueError):
        host, pid = Path(lock).read_text().split()
        return f"pid {int(pid)} on {host}"
    return "another process"


# Waiting for work another process does, on its progress rather than a clock.

def local_store():
    """A store for the work of one process (torch's HashStore), with job_store()'s calls."""
    return dist.HashStore()


def made(store, key, amount=1):
    """Count amount of progress on key's work (images written, bytes received)."""
    store.add(f"{key}/progress", amount)


def progress(store, key):
    """The progress counted on key's work so far."""
    return store.add(f"{key}/progress", 0)


def writing(store, key):
    """Record this process as one of key's writers, for a waiter's line and its checks that the writers still run."""
    store.append(f"{key}/writers", f"{RANK} {HOST} {os.getpid()};")


def writers(store, key):
    """[(rank, host, pid)] of key's writers recorded so far, each once, in rank order."""
    if not store.check([f"{key}/writers"]):
        return []
    found = (entry.split() for entry in store.get(f"{key}/writers").decode().split(";") if entry)
    return sorted({(int(rank), host, int(pid)) for rank, host, pid in found})


def named(writer):
    """'rank R on HOST (pid N)'."""
    return f"rank {writer[0]} on {writer[1]} (pid {writer[2]})"


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
        raise WorkFailed(f"rank {RANK} on {HOST}: {doing} stopped: it failed ({line})")
    return True


def wait_for(store, key, doing, until=None, total=None, desc=None):
    """Wait until key's work is finished (or until() is true), showing its progress as a bar on rank 0 when desc
    is given. Stalled, naming this rank, its host, doing and the writers waited on, when the progress counter stood
    still for STALL_SECONDS or a writer is gone (gone_writer); the worker's error (WorkFailed) when it failed; a
    Stalled naming the store when the job's store does not answer."""
    last, since, silence = -1, time.monotonic(), silences(store)
    with tqdm(total=total, desc=desc, unit="img", leave=False, disable=desc is None or RANK != 0) as bar:
        try:
            while not finished(store, key, doing) and not (until and until()):
                now, others = progress(store, key), [w for w in writers(store, key) if w[0] != RANK]
                if now != last:
                    bar.update(now - max(last, 0))
                    last, since = now, time.monotonic()
                elif (gone := gone_writer(others, silence)) and not finished(store, key, doing):
                    writer, why = gone
                    raise Stalled(f"rank {RANK} on {HOST}: stopped {doing}: {named(writer)} {why}",
                                  (f"{why}, while rank {RANK} on {HOST} was {doing}", *writer[:2]))
                elif time.monotonic() - since > STALL_SECONDS:
                    who = " and ".join(map(named, others)) or "the work"
                    raise Stalled(f"rank {RANK} on {HOST}: stopped {doing}: {who} made no progress for "
                                  f"{STALL_SECONDS:g} s (at {now})",
                                  (f"made no progress for {STALL_SECONDS:g} s (at {now}), while rank {RANK} on "
                                   f"{HOST} was {doing}", *others[0][:2]) if others else None)
                time.sleep(POLL_SECONDS)
        except dist.DistError as e:  # the store's process, or its machine, is gone
            raise Stalled(f"rank {RANK} on {HOST}: stopped {doing}: the job's store does not answer "
                          f"({error_line(e)}); torchrun's agent on the first machine, which holds it, has ended, or "
                          "its machine is gone") from None


def silences(store):
    """A function of writers that gives {rank: seconds} since each one's sign of life (utils/distributed.
    sign_of_life) last moved, as this process saw it (its own clock: machines' clocks may differ); read at most
    every LIVENESS_POLL_SECONDS."""
    seen, read = {}, [0.0]

    def silence(writers):
        now = time.monotonic()
        if now - read[0] >= LIVENESS_POLL_SECONDS:
            read[0] = now
            for rank, _, _ in writers:
                count = store.add(f"alive/{rank}", 0)
                if seen.get(rank, (None,))[0] != count:
                    seen[rank] = count, now
        return {rank: now - seen[rank][1] for rank, _, _ in writers if rank in seen}
    return silence


def gone_writer(writers, silence):
    """(writer, why) of the first writer that is gone: on this machine, its pid has ended; on any, its sign of life
    stood still for LIVENESS_SECONDS. None while every writer lives."""
    silent = silence(writers)
    for writer in writers:
        if writer[1] == HOST and not alive(writer[2]):
            return writer, "has ended"
        if silent.get(writer[0], 0) > LIVENESS_SECONDS:
            return writer, (f"has given no sign of life for {LIVENESS_SECONDS:g} s (killed, stopped, or its "
                            "machine is gone)")
    return None


@contextlib.contextmanager
def stop_on_signals(doing):
    """While inside, SIGTERM and SIGINT end this process at once (Interrupted, which unwinds: temporary files are
    removed), rather than after the write as training's StopVote would; said once a machine. Outside the main
    thread, where handlers cannot be set, nothing changes."""
    def stop(signum, frame):
        if LOCAL_RANK == 0:
            print(f"\n{signal.Signals(signum).name}: stopped while {doing}; nothing was saved", file=sys.stderr,
                  flush=True)
        raise Interrupted(signum, doing)
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def once_per_machine(name, doing, work):
    """Run work(report) on local rank 0 of each machine while the machine's other ranks wait on what it reports
    (report(n): n more bytes or items done; the waiters' stall limit runs from the last report); return once every
    machine's work is done. work's error is raised where it is met; the ranks waiting on it stop (WorkFailed). A stop
    signal ends the process at once (stop_on_signals). Without a process group, every process runs work itself."""
    store = job_store()
    alone = store is None
    store, machines = store or local_store(), 1 if alone else max(1, WORLD_SIZE // LOCAL_WORLD_SIZE)
    job = f"{name}/{next(CALLS)}"
    mine = f"{job}/machine{RANK // LOCAL_WORLD_SIZE}"
    with stop_on_signals(doing):
        if LOCAL_RANK == 0 or alone:
            for key in (mine, job):
                writing(store, key)
            try:
                work(lambda amount: [made(store, key, amount) for key in (mine, job)])
            except BaseException as e:  # a stop signal's too: the waiters stop at once
                for key in (mine, job):
                    done(store, key, e)
                raise
            done(store, mine)
            store.add(f"{job}/machines", 1)
        else:
            wait_for(store, mine, f"waiting for local rank 0 {doing}")
        wait_for(store, job, f"waiting for every machine {doing}",
                 until=lambda: store.add(f"{job}/machines", 0) == machines)


def first_machine_sharing(path, store, key, machine, machines, doing):
    """The lowest-numbered of the machines (this one is machine) that sees path's directory as this one does (a
    shared disk), so that one machine writes path for all of them: each machine makes a marker beside path (a
    temporary file of path, of a name of its own, locked by its writer: clean_leftovers removes a dead one's), posts
    the name on key in store, and looks for the others' once all are made (wait_for key, doing). This machine's own
    number where the directory is its alone or cannot be written. The markers are removed once every machine looked."""
    path, marker = Path(path), None
    with contextlib.suppress(OSError):  # unwritable: its writer says so, and here it shares with no one
        path.parent.mkdir(parents=True, exist_ok=True)
        marker = temporary(path, ".machine")
        marker.touch()
    try:
        store.set(f"{key}/marker/{machine}", marker.name if marker else "")
        store.add(f"{key}/marked", 1)
        wait_for(store, key, doing, until=lambda: store.add(f"{key}/marked", 0) == machines)
        first = next(m for m in range(machines) if m == machine or
                     (name := store.get(f"{key}/marker/{m}").decode()) and (path.parent / name).exists())
        store.add(f"{key}/looked", 1)
        wait_for(store, key, doing, until=lambda: store.add(f"{key}/looked", 0) == machines)
        return first
    finally:
        if marker:
            remove(marker)


@contextlib.contextmanager
def repeating(action, every):
    """While inside, call action() every `every` seconds from a thread of its own."""
    stop = threading.Event()

    def loop():
        while not stop.wait(every):
            action()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def watching(folder, report, every=1.0):
    """While inside, report the growth of the bytes of the files under folder (a download by another library into
    its own cache, which reports nothing itself) every `every` seconds."""
    def size():
        return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file()) if Path(folder).is_dir() else 0
    last = [size()]

    def check():
        with contextlib.suppress(OSError):  # a file renamed or removed while listed
            now = size()
            if now != last[0]:
                report(abs(now - last[0]))
                last[0] = now
    with repeating(check, every):
        yield
