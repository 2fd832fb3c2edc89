"""Run train.py with a fault injected at an exact point, for tests of what survives it.

    python tests/faults.py FAULT[,FAULT...] train.py ARGS...           (or as the script torchrun launches)

FAULT, where K counts rank 0's saves of weights/last.pt and S the training steps this process has voted on since
it started (1-based; see StopVote):
    killpg-after-save:K      rank 0 SIGKILLs its whole process group (torchrun and every rank) right after save K
    killpg-in-save:K         ... during save K: the temporary file is written, not yet renamed into place
    enospc-in-save:K         rank 0's save K fails with 'No space left on device'
    signal-at-step:S:NAME    rank 0 sends signal NAME (SIGTERM, SIGINT) to its process group during step S, as a
                             scheduler's preemption or a Ctrl-C in the terminal does
    signal-torchrun-at-step:S:NAME  rank 0 sends signal NAME to torchrun's process group during step S, as Ctrl-C in
                             the terminal does: torchrun's workers run in sessions of their own, and it passes it on
    kill-rank-at-step:S:R    on torchrun's first attempt only, rank R SIGKILLs itself during step S
    stop-rank-at-step:S:R    rank R SIGSTOPs itself (every thread: frozen) during step S; S and R may list one per
                             torchrun attempt, S0/S1/...: attempt k stops at step Sk, attempts past the list run on
    hang-rank-at-step:S:R    on torchrun's first attempt only, rank R's main thread hangs during step S (its other
                             threads run on: stuck in I/O or a driver)
    nan-loss-at-step:S:R     rank R's training loss is nan in its S-th step
    low-memory-on-rank:R:MB  rank R's machine seems to have MB MiB of memory available, and no cgroup limit
    kill-in-jpeg-cache:R     rank R SIGKILLs itself as it writes its first images into its JPEG cache file
    hang-in-jpeg-cache:R     rank R hangs (alive) as it writes its first images into its JPEG cache file
    as-host:NAME             this torchrun agent's ranks name their machine NAME, as ranks on another machine do
    fail-while-others-wait:R rank R meets a usage error on joining the process group, while every other rank waits
                             there for ever, as in a GPU collective that a rank which left never breaks (gloo's do)
    slow-to-say-on-rank:R:S  rank R takes S seconds more between recording its error and saying it, as under load

Several faults can be given at once, separated by commas.
"""

import errno
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.general import before_imports  # noqa: E402

if __name__ == "__main__":
    before_imports()  # as train.py's own, which run_path calls, and its after_imports

import torch  # noqa: E402

import data.jpeg_cache  # noqa: E402
import utils.checkpoint  # noqa: E402
import utils.distributed  # noqa: E402
import utils.memory  # noqa: E402
import utils.once  # noqa: E402
import utils.stopping  # noqa: E402
from utils.general import RANK, RESTART_COUNT, UsageError  # noqa: E402

counts = {"save": 0, "step": 0}


def on_save(action):
    """Wrap save_checkpoint so that action runs at rank 0's K-th save of last.pt."""
    def wrap(k):
        original = utils.checkpoint.save_checkpoint

        def save(state, path):
            counts["save"] += Path(path).name == "last.pt"
            return action(original, state, path) if counts["save"] == k else original(state, path)
        utils.checkpoint.save_checkpoint = save
    return wrap


def on_step(action, every=False):
    """Wrap StopVote.cast (called once per voted step) so that action() runs during step S (every: at each step,
    given S)."""
    def wrap(s, *args):
        original = utils.stopping.StopVote.cast

        def cast(self, loss, step):
            counts["step"] += 1
            if every:
                action(s, *args)
            elif counts["step"] == int(s):
                action(*args)
            return original(self, loss, step)
        utils.stopping.StopVote.cast = cast
    return wrap


def killpg():
    os.killpg(os.getpgid(0), signal.SIGKILL)


def save_then_killpg(original, state, path):
    original(state, path)
    killpg()


def killpg_before_rename(original, state, path):
    utils.once.os.replace = lambda *a: killpg()  # the temporary file is complete; the rename never happens
    original(state, path)


def fail_with_enospc(original, state, path):
    real_fsync = utils.once.os.fsync

    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    utils.once.os.fsync = fsync
    try:
        original(state, path)
    finally:
        utils.once.os.fsync = real_fsync


def send_signal(name):
    if RANK == 0:
        os.killpg(os.getpgid(0), getattr(signal, name))


def send_signal_to_torchrun(name):
    if RANK == 0:
        os.killpg(os.getpgid(os.getppid()), getattr(signal, name))


def kill_rank(rank):
    if RANK == int(rank) and RESTART_COUNT == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def stop_rank(steps, rank):
    """The fault of stop-rank-at-step: on_step calls it at every step, as S may differ per attempt."""
    steps, ranks = [int(s) for s in steps.split("/")], [int(r) for r in rank.split("/")]
    ranks += ranks[-1:] * (len(steps) - len(ranks))
    if RESTART_COUNT < len(steps) and RANK == ranks[RESTART_COUNT] and counts["step"] == steps[RESTART_COUNT]:
        os.kill(os.getpid(), signal.SIGSTOP)


def hang_rank(rank):
    if RANK == int(rank) and RESTART_COUNT == 0:
        hang()


def nan_loss_at_step(s, rank):
    original = torch.nn.CrossEntropyLoss.forward
    calls = {"n": 0}

    def forward(self, logits, targets):
        calls["n"] += 1
        loss = original(self, logits, targets)
        return loss * float("nan") if calls["n"] == int(s) and RANK == int(rank) else loss
    torch.nn.CrossEntropyLoss.forward = forward


def low_memory_on_rank(rank, mib):
    if RANK == int(rank):
        meminfo = Path(tempfile.mkdtemp()) / "meminfo"
        meminfo.write_text(f"MemTotal: {4 * int(float(mib) * 1024)} kB\nMemAvailable: {int(float(mib) * 1024)} kB\n")
        utils.memory.memory_budget.__defaults__ = (str(meminfo), "/nonexistent", "/nonexistent", None)


def in_jpeg_cache_write(action):
    """Run action() on rank R as it writes its first images into its JPEG cache file (write_chunk)."""
    def wrap(rank):
        original = data.jpeg_cache.write_chunk

        def write_chunk(*args):
            if RANK == int(rank):
                action()
            return original(*args)
        data.jpeg_cache.write_chunk = write_chunk
    return wrap


def hang():
    time.sleep(10**6)  # in the main thread: torchrun's SIGTERM still ends it (utils/once.stop_on_signals)


def as_host(name):
    utils.once.HOST = utils.distributed.HOST = name


def fail_while_others_wait(rank):
    original = utils.distributed.setup_distributed

    def setup_distributed():
        original()
        if RANK == int(rank):
            raise UsageError(f"injected: rank {rank} alone meets this")
        threading.Event().wait()  # no timeout: only the process group's watch_failures can end this rank
    utils.distributed.setup_distributed = setup_distributed


def slow_to_say_on_rank(rank, seconds):
    original = utils.distributed.record_failure

    def record_failure(*args):
        original(*args)
        if RANK == int(rank):
            time.sleep(float(seconds))
    utils.distributed.record_failure = record_failure


FAULTS = {"killpg-after-save": on_save(save_then_killpg), "killpg-in-save": on_save(killpg_before_rename),
          "enospc-in-save": on_save(fail_with_enospc), "signal-at-step": on_step(send_signal),
          "signal-torchrun-at-step": on_step(send_signal_to_torchrun),
          "kill-rank-at-step": on_step(kill_rank), "stop-rank-at-step": on_step(stop_rank, every=True),
          "hang-rank-at-step": on_step(hang_rank), "nan-loss-at-step": nan_loss_at_step,
          "low-memory-on-rank": low_memory_on_rank, "kill-in-jpeg-cache": in_jpeg_cache_write(lambda: os.kill(
              os.getpid(), signal.SIGKILL)), "hang-in-jpeg-cache": in_jpeg_cache_write(hang), "as-host": as_host,
          "fail-while-others-wait": fail_while_others_wait, "slow-to-say-on-rank": slow_to_say_on_rank}

if __name__ == "__main__":
    for fault in sys.argv[1].split(","):
        name, *args = fault.split(":")
        FAULTS[name](*(int(a) if name.endswith("save") else a for a in args))
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
