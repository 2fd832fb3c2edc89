"""Naming a rank that hangs (utils/watchdog.py): which rank the watch threads name, from the places and signs of life
the ranks publish, and what never trips it. The launches under torchrun are in test_resume.py and
test_rank_errors.py."""

import json
import subprocess
import time

import pytest
import torch.distributed as dist

import utils.watchdog as watchdog
from utils.watchdog import (GONE, LEFT, Placed, PulsingFile, Watchdog, boot_id, further, now_at, pid_namespace,
                            placed, proc_start, published, waiting)


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    """A limit of 0.3 s, read at every call, and a fresh place for this process."""
    monkeypatch.setattr(watchdog, "CHECK_SECONDS", 0.0)
    monkeypatch.setattr(watchdog, "_here", {"place": None, "doing": "starting", "waiting": 0, "moves": 0,
                                            "limit": 0.3})


def publish(store, rank, place=None, doing="", waiting=0, moves=0, alive=True):
    """Rank's place and a sign of life in the store, as its watch thread publishes them."""
    value = LEFT if place == LEFT else json.dumps(
        {"place": None if place is None else [*place, waiting], "doing": doing, "moves": moves})
    store.set(f"place/{rank}", value)
    if alive:
        store.add(f"alive/{rank}", 1)


def watch(store, seconds, publishing=()):
    """What rank 0's watchdog names over `seconds`, ranks in publishing showing signs of life all along."""
    dog, end = Watchdog(store, world_size=3, rank=0), time.monotonic() + seconds
    while time.monotonic() < end:
        for rank in publishing:
            store.add(f"alive/{rank}", 1)
        if found := dog.hung():
            return found
        time.sleep(0.05)
    return None


def test_a_rank_that_stands_still_behind_the_others_is_named_with_what_it_did():
    store = dist.HashStore()
    now_at((0, 0, 5, 1), "epoch 1, step 6/9 (in the step)")  # rank 0: waits in step 6 for rank 2
    publish(store, 1, (0, 0, 5, 1), "epoch 1, step 6/9 (in the step)")
    publish(store, 2, (0, 0, 5, 0), "epoch 1, step 6/9 (loading its batch)")  # stuck loading, alive
    rank, why, place, frozen = watch(store, 3, publishing=(1, 2))
    assert (rank, frozen) == (2, False) and place["doing"] == "epoch 1, step 6/9 (loading its batch)"
    assert why == "made no progress for 0.3 s while the other ranks waited for it"


@pytest.mark.slow
def test_a_step_longer_than_the_limit_names_no_one_when_a_rank_ends_it_a_moment_before_another():
    store, step = dist.HashStore(), "epoch 1, step 6/9 (in the step)"
    now_at((0, 0, 5, 1), step)
    for rank in (1, 2):
        publish(store, rank, (0, 0, 5, 1), step)
    dog = Watchdog(store, world_size=3, rank=0)
    end = time.monotonic() + 1.0  # a step of three times the limit, every rank in it
    while time.monotonic() < end:
        for rank in (1, 2):
            store.add(f"alive/{rank}", 1)
        assert dog.hung() is None
        time.sleep(0.05)
    now_at((0, 0, 6, 0), "epoch 1, step 7/9 (loading its batch)")  # rank 0 ends it first, rank 1 then rank 2 follow
    publish(store, 1, (0, 0, 6, 0), "epoch 1, step 7/9 (loading its batch)")
    for _ in range(2):  # rank 2 is behind by a moment (half the limit), not by the step
        for rank in (1, 2):
            store.add(f"alive/{rank}", 1)
        assert dog.hung() is None
        time.sleep(0.15)
    publish(store, 2, (0, 0, 6, 0), "epoch 1, step 7/9 (loading its batch)")
    assert watch(store, 1.0, publishing=(1, 2)) is None
    publish(store, 1, (0, 0, 6, 1), "epoch 1, step 7/9 (in the step)")  # then rank 2 stops loading: named
    rank, _, place, frozen = watch(store, 3, publishing=(1, 2))
    assert (rank, frozen, place["doing"]) == (2, False, "epoch 1, step 7/9 (loading its batch)")


def test_a_rank_that_gives_no_sign_of_life_is_named_as_frozen_wherever_it_is():
    store = dist.HashStore()
    now_at((0, 0, 5, 1), "epoch 1, step 6/9 (in the step)")
    publish(store, 1, (0, 0, 5, 1), "epoch 1, step 6/9 (in the step)")
    publish(store, 2, (0, 0, 5, 1), "epoch 1, step 6/9 (in the step)")  # the same place as the others: SIGSTOPped
    rank, why, _, frozen = watch(store, 3, publishing=(1,))
    assert (rank, frozen) == (2, True)
    assert why == "gave no sign of life for 0.3 s (stopped, frozen, or its machine is gone)"


def test_a_rank_whose_process_on_this_machine_ended_is_named_at_once_not_one_elsewhere_nor_one_that_left():
    # Its collectives break the moment it dies (SIGKILL, the out-of-memory killer): no limit to wait out. Not yet
    # reaped by torchrun, it is a zombie: gone too.
    store, step = dist.HashStore(), "epoch 1, step 6/9 (in the step)"
    now_at((0, 0, 5, 1), step)
    processes = {rank: subprocess.Popen(["sleep", "60"]) for rank in (1, 2)}
    for rank, process in processes.items():
        publish(store, rank, (0, 0, 5, 1), step)
        store.set(f"proc/{rank}", json.dumps({"host": "here", "boot": boot_id(), "pidns": pid_namespace(),
                                               "pid": process.pid, "start": proc_start(process.pid), "error_file": ""}))
    here, elsewhere = (Watchdog(store, world_size=3, rank=0, host=host) for host in ("here", "there"))
    try:
        assert here.read() and here.gone() is None
        processes[2].kill()
        for _ in range(500):  # the kill lands at once, but not within the call; exiting takes a moment more
            if open(f"/proc/{processes[2].pid}/stat").read().rpartition(")")[2].split()[0] == "Z":
                break
            time.sleep(0.01)
        assert open(f"/proc/{processes[2].pid}/stat").read().rpartition(")")[2].split()[0] == "Z"
        assert here.gone() == (2, GONE, {"place": [0, 0, 5, 1, 0], "doing": step, "moves": 0}, True)
        time.sleep(here.every)
        assert here.hung()[:2] == (2, GONE)  # the watch thread's reading names it too, long before the limit
        processes[2].wait()  # reaped
        assert here.gone()[0] == 2 and elsewhere.read() and elsewhere.gone() is None
        publish(store, 2, LEFT)  # one that left the job before it ended is not named
        assert here.read() and here.gone() is None
    finally:
        for process in processes.values():
            process.kill()
            process.wait()


def test_after_a_broken_collective_a_rank_elsewhere_is_named_by_a_shorter_silence():
    store, step = dist.HashStore(), "epoch 1, step 6/9 (in the step)"
    now_at((0, 0, 5, 1), step)
    for rank in (1, 2):
        publish(store, rank, (0, 0, 5, 1), step)
    dog = Watchdog(store, world_size=3, rank=0, host="here")
    assert dog.read() and dog.gone(silent_for=0.2) is None
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # rank 1 lives, rank 2 is silent
        store.add("alive/1", 1)
        dog.read()
        time.sleep(0.05)
    rank, why, _, frozen = dog.gone(silent_for=0.2)
    assert (rank, why, frozen) == (2, "gave no sign of life for 0.2 s (stopped, frozen, or its machine is gone)", True)
    assert dog.gone() is None  # without silent_for, only this machine's processes are judged


@pytest.mark.slow
def test_ranks_in_the_same_place_are_never_named_however_long_a_step_takes():
    store = dist.HashStore()
    now_at((0, 0, 5, 1), "epoch 1, step 6/9 (in the step)")  # a slow step: everyone in it, alive
    for rank in (1, 2):
        publish(store, rank, (0, 0, 5, 1), "epoch 1, step 6/9 (in the step)")
    assert watch(store, 1.0, publishing=(1, 2)) is None


@pytest.mark.slow
def test_a_rank_that_works_alone_while_the_others_wait_is_named_only_when_it_stops_pulsing():
    store = dist.HashStore()
    now_at((0, 3, 1), "the end of epoch 1: saving weights/last.pt")
    with waiting():  # rank 0 waits for rank 1, which saves alone (on_rank0)
        publish(store, 1, (0, 3, 1), "the end of epoch 1: saving weights/last.pt", moves=1)
        publish(store, 2, (0, 3, 1), "the end of epoch 1: saving weights/last.pt", waiting=1)
        dog, end = Watchdog(store, world_size=3, rank=0), time.monotonic() + 1.0
        moves = 1
        while time.monotonic() < end:  # pulsing: a slow disk
            moves += 1
            publish(store, 1, (0, 3, 1), "the end of epoch 1: saving weights/last.pt", moves=moves)
            store.add("alive/2", 1)
            assert dog.hung() is None
            time.sleep(0.05)
        rank, why, _, frozen = watch(store, 3, publishing=(1, 2))  # then no more pulses: a dead mount
    assert (rank, frozen) == (1, False)


@pytest.mark.slow
def test_a_rank_that_left_is_not_named_for_its_silence_nor_one_before_training_for_its_place():
    store = dist.HashStore()
    now_at((2, 3, 1), "the end of epoch 3: saving weights/last.pt")
    publish(store, 1, LEFT)  # done: its watch thread stopped
    publish(store, 2)  # still starting (no place yet), alive
    assert watch(store, 1.0, publishing=(2,)) is None


@pytest.mark.slow
def test_no_limit_names_no_rank():
    store = dist.HashStore()
    watchdog.set_limit(0)
    publish(store, 1, (0, 0, 5, 0))
    publish(store, 2, (0, 0, 5, 1))
    assert watch(store, 1.0) is None


def test_the_places_grow_through_steps_validation_and_saves_and_waiting_counts_past_working():
    seen = []
    for _ in placed(range(2), (0, 0), "epoch 1, step {}/3", "in the step", first=1):
        seen.append(json.loads(published()[0]))
    loader = Placed([10, 11], (0, 2), "epoch 1, val batch {}/2", "validating")
    for _ in range(2):  # the weights, then their EMA
        for _ in loader:
            seen.append(json.loads(published()[0]))
    now_at((0, 3), "the end of epoch 1")
    further("saving weights/last.pt")
    seen.append(json.loads(published()[0]))
    with waiting():
        seen.append(json.loads(published()[0]))
    places = [s["place"] for s in seen]
    assert places == sorted(places) and len(set(map(tuple, places))) == len(places)
    assert [s["doing"] for s in seen[:2]] == ["epoch 1, step 2/3 (in the step)", "epoch 1, step 3/3 (in the step)"]
    assert seen[2]["doing"] == "epoch 1, val batch 1/2 (validating)" and len(loader) == 2
    assert seen[-1]["doing"] == "the end of epoch 1: saving weights/last.pt"


def test_a_checkpoint_written_in_one_call_pulses_every_part(tmp_path, monkeypatch):
    monkeypatch.setattr(PulsingFile, "PART", 1000)
    with open(tmp_path / "f", "wb") as f:
        before = watchdog._here["moves"]
        assert PulsingFile(f).write(bytes(4500)) == 4500
    assert watchdog._here["moves"] - before == 5 and (tmp_path / "f").stat().st_size == 4500
