"""Naming a rank that hangs, within train.hang_seconds rather than the collectives' 10-minute timeout.

Each rank's main thread says where it is in the run (now_at: a place that only grows as training goes on, and what
it does there; pulse: it moved within that place, as a checkpoint's bytes are written), which costs it a dict update.
Its watch thread (utils/distributed.watch_failures) publishes that in the job's store beside its sign of life, and
reads every other rank's (Watchdog.hung). A rank hangs when, for the limit, it gave no sign of life (stopped by
SIGSTOP, frozen, its machine gone), or its place stood still while another rank is past it: waiting for it at the
next collective (a rank stuck in I/O, a driver or a deadlock). A step that is merely slow never trips it, nor does a
long validation or save: every rank is then in the same place, or the slow one pulses.

torch's own tools were weighed first: torch.distributed.elastic.timer (the agent SIGKILLs a worker whose `expires`
block overruns) needs every launch to set TORCHELASTIC_ENABLE_FILE_TIMER, and its deadline also runs out on the ranks
that wait for the hung one, at the same moment, so either may be killed first and blamed; gloo's and nccl's
timeouts end a waiter, never the hung rank.
"""

import functools
import json
import os
import time
from contextlib import contextmanager

from utils.general import MAX_RESTARTS, RANK, RESTART_COUNT, WORLD_SIZE

HANG_SECONDS = float(os.getenv("CLS_HANG_SECONDS", 60))  # until train.hang_seconds is read (start-up); tests lower it
CHECK_SECONDS = 1.0  # how often a watch thread reads the other ranks' places and signs of life, at most
# A reading of every rank costs the job's store time that grows with the ranks (0.09 ms at 8, 0.5 ms at 64, 5 ms at
# 512, measured on one core), and every rank reads: past this many ranks each reads less often, so that the store
# serves this many readings a second in all (at 512 ranks, every 16 s: 0.17 s of store time a second).
READINGS_A_SECOND = 32
LEFT = "left"  # a rank's place once it has left the process group: its silence then says nothing
GONE = "its process ended without leaving the job (killed: kill -9, the out-of-memory killer; or crashed)"
# This rank's place in the run, as its main thread last said it: a tuple of ints that only grows, what it does there,
# and a count of its moves (new places and pulses), which the watch thread publishes when it changed.
_here = {"place": None, "doing": "starting", "waiting": 0, "moves": 0, "limit": HANG_SECONDS}


def set_limit(seconds):
    """How long a rank may give no sign of life, or stand still behind the others, before it is named (0: never)."""
    _here["limit"] = float(seconds)


def limit():
    return _here["limit"]


def now_at(place, doing):
    """This rank's main thread is at place (a tuple of ints, later places larger: (epoch, stage, step, ...)) doing
    `doing`, as the line that names a hung rank says it."""
    _here.update(place=tuple(place), doing=doing, moves=_here["moves"] + 1)


def further(doing):
    """A place just after this rank's current one (inside it, before the next), e.g. saving at the end of a step."""
    if _here["place"] is not None:
        now_at((*_here["place"], 1), f"{_here['doing']}: {doing}")


def pulse():
    """This rank moved within its place (a checkpoint's bytes written): it does not hang, however long that takes."""
    _here["moves"] += 1


@contextmanager
def waiting():
    """While inside, this rank waits for the others (a collective): its place counts as past the same place of a rank
    that has not reached it."""
    _here["waiting"], _here["moves"] = _here["waiting"] + 1, _here["moves"] + 1
    try:
        yield
    finally:
        _here["waiting"], _here["moves"] = _here["waiting"] - 1, _here["moves"] + 1


def collective(fn):
    """fn, a call that waits for every rank, as waiting() while it runs."""
    @functools.wraps(fn)
    def waiting_for_every_rank(*args, **kwargs):
        with waiting():
            return fn(*args, **kwargs)
    return waiting_for_every_rank


def placed(items, place, label, using, first=0, total=None):
    """Iterate items (a DataLoader's batches), marking this rank at place + (i, 0) while item i loads and at
    place + (i, 1) while it is used, i counted from first; label.format(i + 1) names item i ('epoch 2, step 7/40'),
    `using` what is done with it ('in the step'); total: the items there are, where known."""
    items, i = iter(items), first
    while True:
        past = total is not None and i >= total  # what follows the last item, not an item
        doing = f"{label.format(total)} (done)" if past else f"{label.format(i + 1)} (loading its batch)"
        now_at((*place, i, 0), doing)
        try:
            item = next(items)
        except StopIteration:
            return
        now_at((*place, i, 1), f"{label.format(i + 1)} ({using})")
        yield item
        i += 1


class Placed:
    """A DataLoader whose every pass marks this rank's place, pass p's batches at place + (p, i, ...) (placed); its
    other attributes are the loader's."""

    def __init__(self, loader, place, label, using):
        self.loader, self.place, self.label, self.using, self.passes = loader, tuple(place), label, using, 0

    def __iter__(self):
        self.passes += 1
        return placed(self.loader, (*self.place, self.passes), self.label, self.using, total=len(self.loader))

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)


class PulsingFile:
    """A file object that pulses as it is written, in parts of at most PART bytes: a slow disk's long write is not a
    hang."""

    PART = 16 << 20

    def __init__(self, f):
        self.f = f

    def write(self, data):
        view = memoryview(data).cast("B")
        for start in range(0, len(view), self.PART):
            self.f.write(view[start:start + self.PART])
            pulse()
        return len(view)

    def __getattr__(self, name):
        return getattr(self.f, name)


def published():
    """This rank's place as its watch thread publishes it, and its count of moves (publish when that changed)."""
    here = _here
    place = None if here["place"] is None else [*here["place"], min(here["waiting"], 1)]
    return json.dumps({"place": place, "doing": here["doing"], "moves": here["moves"]}), here["moves"]


PF_EXITING = 0x4  # a process's flag (/proc/PID/stat's 9th field) from the moment it begins to exit


def proc_start(pid):
    """When process pid started (clock ticks since boot), or None where it has ended or is ending (exiting, which
    may take seconds as a GPU's memory is freed, or a zombie until its parent reaps it): with the pid, it names one
    running process for good."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return None if fields[0] in ("Z", "X") or int(fields[6]) & PF_EXITING else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_namespace():
    """This process's pid namespace (containers on one machine have their own), or '' where /proc does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


@functools.cache
def boot_id():
    """This machine's boot id, or '' where /proc does not say: two machines may share a host name, and every
    machine's root pid namespace reads alike."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def identity(host):
    """What another rank needs to end this one when it is frozen on the same machine: its host, boot, pid namespace,
    pid and start time, and the error file torchrun reads for it."""
    return json.dumps({"host": host, "boot": boot_id(), "pidns": pid_namespace(), "pid": os.getpid(),
                       "start": proc_start(os.getpid()), "error_file": os.getenv("TORCHELASTIC_ERROR_FILE", "")})


def on_this_machine(info, host):
    """Whether a rank's identity (identity()) is that of a process on this machine, named host here (not where
    /proc does not give the boot id)."""
    return bool(boot_id()) and (info["host"], info.get("boot"), info["pidns"]) == (host, boot_id(), pid_namespace())


class Watchdog:
    """What this rank's watch thread knows of the other ranks: when each one's sign of life last changed, and since
    when each one has stood still in its place with another rank past it (behind), by this process's own clock
    (machines' clocks may differ); and which of them run on this machine (host), whose processes it can see."""

    def __init__(self, store, world_size=WORLD_SIZE, rank=RANK, host=None):
        self.store, self.others, self.host = store, [r for r in range(world_size) if r != rank], host
        self.keys = [f"alive/{r}" for r in self.others] + [f"place/{r}" for r in self.others]
        self.seen, self.behind, self.read_at, self.procs, self.local = {}, {}, 0.0, None, set()
        self.every = max(CHECK_SECONDS, world_size / READINGS_A_SECOND)

    def hung(self):
        """(rank, why, place, frozen) of a rank that hangs, read at most every self.every seconds (frozen: it gave no
        sign of life), or whose process on this machine has ended; None while none does."""
        now, seconds = time.monotonic(), limit()
        if not self.others or now - self.read_at < self.every or not self.read():
            return None
        if (ended := self.gone()) or not seconds:  # with the limit off, only a process that has ended
            return ended
        places = {r: self.place(r) for r in self.others}
        mine = published_place()
        for r in self.others:
            place = places[r]
            if place == LEFT:
                continue
            if now - self.seen[f"alive/{r}"][1] > seconds:
                return r, silence(seconds), place, True
            # Timed from when another rank was first seen past it, not from when it came to its place: in a step
            # longer than the limit, the rank that ends it first is past the others by a moment, not by the step.
            raw = self.seen[f"place/{r}"][0]
            if not self.passed(place, [mine, *(places[o] for o in self.others if o != r)]):
                self.behind.pop(r, None)
            elif self.behind.get(r, (None,))[0] != raw:
                self.behind[r] = raw, now
            elif now - self.behind[r][1] > seconds:
                return r, f"made no progress for {seconds:g} s while the other ranks waited for it", place, False
        return None

    def read(self):
        """Read every other rank's sign of life and place (False while one has not published yet: still joining)."""
        now = self.read_at = time.monotonic()
        if not self.store.check(self.keys):
            return False
        for key, value in zip(self.keys, self.store.multi_get(self.keys)):
            if self.seen.get(key, (None,))[0] != value:
                self.seen[key] = value, now
        return True

    def gone(self, silent_for=None):
        """(rank, why, place, True) of a rank, not yet LEFT, whose process on this machine has ended (killed by
        SIGKILL, the out-of-memory killer, or crashed without leaving the job), as of the last read; or, given
        silent_for, of one elsewhere that gave no sign of life for that long. None if there is none. A rank is this
        machine's (self.local) by its host name, boot id and pid namespace, never by its name alone."""
        if self.procs is None and self.store.check([f"proc/{r}" for r in self.others]):
            self.procs = {r: json.loads(info) for r, info in
                          zip(self.others, self.store.multi_get([f"proc/{r}" for r in self.others]))}
            self.local = {r for r, info in self.procs.items() if on_this_machine(info, self.host)}
        now = time.monotonic()
        for r in self.others:
            place = self.place(r)
            if place == LEFT:
                continue
            if r in self.local:
                info = self.procs[r]
                if proc_start(info["pid"]) != info["start"]:
                    return r, GONE, place, True
            elif silent_for is not None and now - self.seen[f"alive/{r}"][1] > silent_for:
                return r, silence(silent_for), place, True
        return None

    @staticmethod
    def passed(place, others):
        """Whether another rank's place (of others) is past place."""
        if not isinstance(place, dict) or place["place"] is None:
            return False
        return any(isinstance(p, dict) and p["place"] is not None and p["place"] > place["place"] for p in others)

    def place(self, rank):
        """rank's published place ({'place', 'doing', 'moves'}), or LEFT."""
        raw = self.seen[f"place/{rank}"][0].decode()
        return LEFT if raw == LEFT else json.loads(raw)


def published_place():
    return json.loads(published()[0])


def silence(seconds):
    """Why a rank that gave no sign of life for `seconds` is named."""
    return f"gave no sign of life for {seconds:g} s (stopped, frozen, or its machine is gone)"


def hung_line(why, place, frozen):
    """The line that names what a hung rank did last (its rank and machine are added by the caller): where a frozen
    one was last seen (its place is published every 0.5 s), where a live one is stuck."""
    where = f"at {place['doing']}" if isinstance(place, dict) and place["place"] is not None else \
        "starting up"
    limit_set = "" if why == GONE else "train.hang_seconds sets the limit; "
    return (f"{why}, {'last seen' if frozen else 'stuck'} {where}; {after_failure()} ({limit_set}"
            f"docs/troubleshooting.md says what to look at)")


def after_failure():
    """What becomes of the job after a rank's failure: torchrun starts it again while --max-restarts allows."""
    if RESTART_COUNT < MAX_RESTARTS:
        return f"torchrun restarts the job (restart {RESTART_COUNT + 1} of {MAX_RESTARTS})"
    return "the job ends here"
