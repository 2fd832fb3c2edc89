"""Writing a file once (utils/once.py): whole and durable, nothing left by a failed or dead writer while a live
writer's file is kept, and waiters that stop, naming the writer, when its own progress stops."""

import contextlib
import datetime
import os
import re
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

import utils.once
from conftest import ROOT, closed_port
from utils.once import (HOST, Stalled, atomic_write, clean_leftovers, done, local_store, lock_of, made,
                        once_per_machine, repeating, temporary, wait_for, writing)


def test_an_atomic_write_makes_the_file_whole_and_flushes_the_file_and_its_directory(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync

    def record(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        fsync(fd)
    monkeypatch.setattr(utils.once.os, "fsync", record)
    with atomic_write(tmp_path / "a.txt") as tmp:
        assert re.fullmatch(rf"\.a\.txt\.tmp-{re.escape(HOST)}-{os.getpid()}-[a-z]{{8}}", tmp.name)  # for people
        assert lock_of(tmp).read_text() == f"{HOST} {os.getpid()}\n"  # the lock its writer holds as it writes
        tmp.write_text("new")
    assert synced == [False, True]  # the file's bytes, then the rename in its directory
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"] and (tmp_path / "a.txt").read_text() == "new"


def test_an_atomic_write_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(ZeroDivisionError), atomic_write(tmp_path / "a.txt") as tmp:
        tmp.write_text("half")
        1 / 0
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"] and (tmp_path / "a.txt").read_text() == "old"
    with pytest.raises(ZeroDivisionError), atomic_write(tmp_path / "folder") as tmp:  # a folder, as a file
        (tmp / "inside").mkdir(parents=True)
        1 / 0
    assert [p.name for p in tmp_path.iterdir()] == ["a.txt"]


def dead_pid():
    """The pid of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


LOCK_HOLDER = """import fcntl, os, sys, time
for lock in sys.argv[1:]:
    fcntl.flock(os.open(lock, os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def locks_held(*locks):
    """While inside, another process holds the lock files locks, as live writers hold their temporaries'."""
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, *locks], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        yield
    finally:
        holder.kill()
        holder.wait()


def test_leftovers_whose_lock_is_free_are_removed_and_those_whose_lock_is_held_kept(tmp_path):
    path = tmp_path / "cache.bin"
    mine = temporary(path)  # this process's: its lock held here
    dead = tmp_path / f".cache.bin.tmp-{HOST}-{dead_pid()}-abcdefgh"  # killed: its lock file left, free
    unlocked = tmp_path / f".cache.bin.tmp-{HOST}-{dead_pid()}"  # an older version's, without a lock file
    # Another pid namespace's (a container with this host name): its pid runs nowhere here, yet its lock is held.
    other_namespace = tmp_path / f".cache.bin.tmp-{HOST}-{dead_pid()}-qwertyui"
    elsewhere = tmp_path / ".cache.bin.tmp-other-host-1-abcdefgh"  # a shared disk's: its lock may be local there
    old_elsewhere = tmp_path / ".cache.bin.tmp-other-host-2-abcdefgh.png"
    old_elsewhere_held = tmp_path / ".cache.bin.tmp-other-host-3-abcdefgh"
    other_file = tmp_path / f".cache.bin2.tmp-{HOST}-{dead_pid()}-abcdefgh"  # another path's
    dead_folder = tmp_path / f".cache.bin.tmp-{HOST}-{dead_pid()}-abcdefgh.png"  # a folder, a suffix after the pid
    orphan_lock = lock_of(tmp_path / f".cache.bin.tmp-{HOST}-{dead_pid()}-zzzzzzzz")  # killed after its temporary went
    for leftover in (mine, dead, unlocked, other_namespace, elsewhere, old_elsewhere, old_elsewhere_held, other_file):
        leftover.write_bytes(b"x")
    dead_folder.mkdir()
    for leftover in (dead, elsewhere, old_elsewhere, other_file, dead_folder):
        lock_of(leftover).write_text("a writer that is gone\n")
    orphan_lock.write_text("a writer that is gone\n")
    two_days_ago = time.time() - 2 * 24 * 3600
    for old in (old_elsewhere, lock_of(old_elsewhere), old_elsewhere_held):
        os.utime(old, (two_days_ago, two_days_ago))
    with locks_held(lock_of(other_namespace), lock_of(old_elsewhere_held)):
        os.utime(lock_of(old_elsewhere_held), (two_days_ago, two_days_ago))
        removed = clean_leftovers(path)
    assert sorted(removed) == sorted([dead, unlocked, old_elsewhere, dead_folder])
    kept = (mine, other_namespace, elsewhere, old_elsewhere_held, other_file)
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in kept} | {lock_of(p).name for p in kept}


# Run inside `unshare --pid --fork`, as pid 1 of a new pid namespace whose /proc is still the machine's: it forks
# until a child's pid is one no process out here has, then that child writes path, holding its temporary open until
# it reads a line.
WRITER_IN_ANOTHER_PID_NAMESPACE = """import os, sys
from pathlib import Path
while child := os.fork():
    if (code := os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])) != 75:
        sys.exit(code)
if os.path.exists(f"/proc/{os.getpid()}"):  # a pid that runs out here too: the next child
    os._exit(75)
from utils.once import atomic_write
with atomic_write(Path(sys.argv[1])) as tmp, open(tmp, "w") as out:
    out.write("inner")
    out.flush()
    print(tmp.name, flush=True)
    sys.stdin.readline()
    out.write(", whole")
"""


@pytest.mark.slow
def test_a_writer_in_another_pid_namespace_keeps_its_temporary_file(tmp_path):
    """The issue's containers on one machine: one host name, pids of their own. The writer's pid (in its name) runs
    nowhere out here, yet the writer lives: a write out here of the same path keeps its file, and both end whole."""
    path = tmp_path / "weights.pth"
    writer = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", WRITER_IN_ANOTHER_PID_NAMESPACE,
                               path], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        name = writer.stdout.readline().strip()
        if not name:
            pytest.skip("unshare --pid is refused here (test_leftovers_whose_lock_is_free... simulates it)")
        inside = tmp_path / name
        assert not utils.once.alive(int(name.split("-")[-2]))  # its pid runs nowhere here
        with atomic_write(path) as tmp:  # cleans path's leftovers first
            tmp.write_text("outer")
        assert inside.exists() and path.read_text() == "outer"
        writer.communicate("go on\n", timeout=60)
    finally:
        writer.kill()
    assert writer.returncode == 0 and path.read_text() == "inner, whole"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.pth"]  # no temporary, no lock file


def another_writer(store, key, rank=1, host="node-b", pid=4242):
    """Record rank on host as a writer of key, as that process's writing() does."""
    store.append(f"{key}/writers", f"{rank} {host} {pid};")


@contextlib.contextmanager
def signs_of_life(store, rank=1):
    """While inside, rank's sign of life moves, as its watch_failures thread moves it."""
    with repeating(lambda: store.add(f"alive/{rank}", 1), 0.05):
        yield


def test_a_waiter_stops_naming_the_writer_whose_progress_stopped_not_itself(monkeypatch):
    monkeypatch.setattr(utils.once, "STALL_SECONDS", 0.5)
    monkeypatch.setattr(utils.once, "LIVENESS_POLL_SECONDS", 0.05)
    store = local_store()
    writing(store, "job")  # the waiter writes too (a machine's own share): not named
    another_writer(store, "job")
    for _ in range(3):
        made(store, "job", 1000)  # then nothing more: a download whose server went silent
    with signs_of_life(store), pytest.raises(Stalled) as stalled:  # alive: a stall, not a death
        wait_for(store, "job", "waiting for local rank 0 downloading weights")
    assert str(stalled.value) == (f"rank 0 on {HOST}: stopped waiting for local rank 0 downloading weights: rank 1 "
                                  "on node-b (pid 4242) made no progress for 0.5 s (at 3000)")
    assert stalled.value.blamed == (f"made no progress for 0.5 s (at 3000), while rank 0 on {HOST} was waiting for "
                                    "local rank 0 downloading weights", 1, "node-b")


@pytest.mark.slow
def test_a_waiter_stops_naming_a_writer_on_another_machine_that_gives_no_sign_of_life(monkeypatch):
    monkeypatch.setattr(utils.once, "STALL_SECONDS", 5)  # ten times the liveness limit: a stall would be a failure
    monkeypatch.setattr(utils.once, "LIVENESS_SECONDS", 0.5)
    monkeypatch.setattr(utils.once, "LIVENESS_POLL_SECONDS", 0.05)
    store = local_store()
    another_writer(store, "job")  # its pid cannot be checked from here: node-b is another machine
    with signs_of_life(store):
        made(store, "job", 7)
        time.sleep(1)  # twice the limit, alive
    with pytest.raises(Stalled) as stalled:  # then killed
        wait_for(store, "job", "waiting for every machine's train cache file")
    line = "has given no sign of life for 0.5 s (killed, stopped, or its machine is gone)"
    assert str(stalled.value) == (f"rank 0 on {HOST}: stopped waiting for every machine's train cache file: rank 1 "
                                  f"on node-b (pid 4242) {line}")
    assert stalled.value.blamed == (f"{line}, while rank 0 on {HOST} was waiting for every machine's train cache "
                                    "file", 1, "node-b")


@pytest.mark.slow
def test_a_waiter_stops_with_one_line_when_the_jobs_store_is_gone(monkeypatch):
    monkeypatch.setattr(utils.once, "STALL_SECONDS", 600)
    port = closed_port()
    holder = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', "
                               f"{port}, is_master=True, wait_for_workers=False); print(flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()  # the store is up
    store = dist.PrefixStore("job/", dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                                   timeout=datetime.timedelta(seconds=5)))
    another_writer(store, "job")
    holder.kill()  # as torchrun's agent on the first machine, which holds the store, is killed
    holder.wait()
    with pytest.raises(Stalled, match=rf"^rank 0 on {HOST}: stopped waiting for every machine's train cache file: "
                                      r"the job's store does not answer \(.+\); torchrun's agent on the first "
                                      r"machine, which holds it, has ended, or its machine is gone$"):
        wait_for(store, "job", "waiting for every machine's train cache file")


@pytest.mark.slow
def test_a_waiter_outlasts_the_stall_limit_while_the_writer_reports_progress(monkeypatch):
    monkeypatch.setattr(utils.once, "STALL_SECONDS", 0.5)
    store, reports = local_store(), 15

    def work():
        for _ in range(reports):  # 1.5 s in all, three times the stall limit
            made(store, "job", 1)
            time.sleep(0.1)
        done(store, "job")
    writer = threading.Thread(target=work)
    writer.start()
    wait_for(store, "job", "waiting")
    writer.join()
    assert utils.once.progress(store, "job") == reports


def test_a_waiter_stops_at_once_when_its_writer_on_this_machine_is_gone(monkeypatch):
    monkeypatch.setattr(utils.once, "STALL_SECONDS", 600)  # not a stall: the writer's pid runs no more
    store, pid = local_store(), dead_pid()
    another_writer(store, "job", host=HOST, pid=pid)
    with pytest.raises(Stalled, match=rf"^rank 0 on {HOST}: stopped waiting for local rank 0 writing x: rank 1 on "
                                      rf"{HOST} \(pid {pid}\) has ended$"):
        wait_for(store, "job", "waiting for local rank 0 writing x")


def test_once_per_machine_gives_the_work_a_report_of_its_own_progress():
    reported = []
    once_per_machine("test", "writing", lambda report: reported.extend([report(5), report(7)]))
    assert len(reported) == 2  # one process: it runs the work itself, no heartbeat
