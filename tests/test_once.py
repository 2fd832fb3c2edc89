"""Writing a file once (utils/once.py): whole and durable, nothing left by a failed or dead writer while a live
writer's file is kept, and waiters that stop, naming the writer, when its own progress stops."""

import contextlib
import datetime
import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

import utils.once
from conftest import closed_port
from utils.once import (HOST, Stalled, atomic_write, clean_leftovers, done, local_store, made, once_per_machine,
                        repeating, temporary, wait_for, writing)


def test_an_atomic_write_makes_the_file_whole_and_flushes_the_file_and_its_directory(tmp_path, monkeypatch):
    synced, fsync = [], os.fsync

    def record(fd):
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        fsync(fd)
    monkeypatch.setattr(utils.once.os, "fsync", record)
    with atomic_write(tmp_path / "a.txt") as tmp:
        assert tmp == tmp_path / f".a.txt.tmp-{HOST}-{os.getpid()}"  # names its writer
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


def test_leftovers_of_dead_writers_are_removed_and_live_writers_files_kept(tmp_path):
    path = tmp_path / "cache.bin"
    dead = tmp_path / f".cache.bin.tmp-{HOST}-{dead_pid()}"
    live = tmp_path / f".cache.bin.tmp-{HOST}-{os.getppid()}"  # pytest's parent runs
    mine = temporary(path)  # this process's: alive
    elsewhere = tmp_path / ".cache.bin.tmp-other-host-1"  # another machine's on a shared disk: its pid unknown here
    old_elsewhere = tmp_path / ".cache.bin.tmp-other-host-2.png"
    other_file = tmp_path / f".cache.bin2.tmp-{HOST}-{dead_pid()}"  # another path's
    for leftover in (dead, live, mine, elsewhere, old_elsewhere, other_file):
        leftover.write_bytes(b"x")
    dead_folder = tmp_path / f".cache.bin.tmp-{HOST}-{dead_pid()}.png"  # a folder, a suffix after the pid
    dead_folder.mkdir()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(old_elsewhere, (two_days_ago, two_days_ago))
    removed = clean_leftovers(path)
    assert sorted(removed) == sorted([dead, dead_folder, old_elsewhere])
    assert {p.name for p in tmp_path.iterdir()} == {live.name, mine.name, elsewhere.name, other_file.name}


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
    assert stalled.value.blamed == ("made no progress for 0.5 s (at 3000)", 1, "node-b")


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
    assert stalled.value.blamed == (line, 1, "node-b")


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
