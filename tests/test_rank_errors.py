"""An error that one rank meets alone, on any machine, reaches the user: one line naming the rank and machine, on
that machine's console and on rank 0's; every other rank stops promptly with a line naming the failed rank. Launched
as two torchrun "nodes" on this machine (static rendezvous: node 1 holds ranks 2 and 3), as a job across two
machines is."""

import json
import re
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from conftest import ROOT, TORCHRUN, clean_env, make_image_folder, run_torchrun
from utils.watchdog import GONE
from test_resume import free_port

HOST = socket.gethostname()
RECIPE = ["--recipe", "cls.yaml", "train.epochs=1", "train.batch_size=4", "model.width=4", "model.norm=group",
          "data.workers=0"]  # group norm: 4 processes of 1 image a step each


def two_nodes(tmp_path, args, node1_args, node1_fault=None, nproc=2, timeout=240):
    """train.py on two torchrun agents of nproc processes each (with 2: ranks 0-1 on node 0, 2-3 on node 1; a pair:
    each node's), node 1 with node1_args added and run through tests/faults.py with node1_fault; [(exit code,
    output)] of each agent."""
    port = free_port()
    nodes = []
    for node in (0, 1):
        script = ["tests/faults.py", node1_fault, "train.py"] if node and node1_fault else ["train.py"]
        nodes.append(subprocess.Popen(
            [sys.executable, "-c", TORCHRUN, "--nnodes=2", f"--node_rank={node}",
             f"--nproc_per_node={nproc[node] if isinstance(nproc, tuple) else nproc}", "--master-addr=127.0.0.1",
             f"--master-port={port}", *script, *args,
             *(node1_args if node else []), f"project={tmp_path / 'runs'}"], cwd=ROOT, env=clean_env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        return [(node.wait(timeout=timeout), node.stdout.read()) for node in nodes]
    finally:
        for node in nodes:  # after a timeout, none is left running
            node.kill()


def error_lines(output):
    """The ranks' last lines on the console (torchrun's summary quotes them again, indented)."""
    return [line for line in output.splitlines()
            if line.startswith("train.py: ") and ("train.py: error:" in line or " stopped: rank " in line)]


def assert_reported(nodes, failed_rank, line):
    """The failed rank's line on both consoles, once each; every other rank's 'stopped' line on its own; exit 2."""
    said = f"train.py: error: rank {failed_rank} on {HOST}: {line}"
    (code0, out0), (code1, out1) = nodes
    assert code0 != 0 and code1 != 0, out0[-3000:] + out1[-3000:]
    stopped = {rank: f"train.py: rank {rank} on {HOST} stopped: rank {failed_rank} on {HOST} failed"
               for rank in range(4) if rank not in (0, failed_rank)}
    assert sorted(error_lines(out0)) == sorted([said, *(stopped[r] for r in (1,) if r in stopped)]), out0[-3000:]
    assert sorted(error_lines(out1)) == sorted([said, *(stopped[r] for r in (2, 3) if r in stopped)]), out1[-3000:]
    assert "]: Traceback" not in out0 + out1  # no rank's traceback of a collective broken by the failed rank


@pytest.mark.slow
def test_an_unwritable_jpeg_cache_dir_on_one_machine_reaches_both_consoles(tmp_path):
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}})
    (tmp_path / "a_regular_file").write_text("")
    bad = tmp_path / "a_regular_file" / "cache"
    nodes = two_nodes(tmp_path, [*RECIPE, f"data.name={data}", "data.cache=jpeg", f"data.cache_dir={tmp_path / 'ok'}"],
                      [f"data.cache_dir={bad}"])
    (_, out0), (_, out1) = nodes
    line = next(line for line in error_lines(out1) if "error" in line).split(f"on {HOST}: ", 1)[-1]
    assert line.startswith(f"data.cache=jpeg: cannot write {bad}"), out1[-3000:]
    assert_reported(nodes, 2, line)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("*.pt"))


@pytest.mark.slow
def test_a_ram_cache_over_one_machines_budget_reaches_both_consoles(tmp_path):
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}}, size=64)
    # Node 1's rank 3 sees a machine with 1 MiB available: its cache of 12 64x64 images (147 KiB) is over its
    # budget (80% of 1 MiB over the machine's 2 processes: 410 KiB) once val's and train's are both held.
    nodes = two_nodes(tmp_path, [*RECIPE, f"data.name={data}", "data.cache=ram", "data.img_size=64"], [],
                      "low-memory-on-rank:3:0.3")
    (_, out0), (_, out1) = nodes
    line = next(line for line in error_lines(out1) if "error" in line).split(f"on {HOST}: ", 1)[-1]
    assert line.startswith("data.cache=ram: ") and "more than this process's budget" in line, out1[-3000:]
    assert_reported(nodes, 3, line)


@pytest.mark.slow
def test_a_machine_whose_cache_writer_is_killed_is_named_by_the_other_machine_within_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("CLS_STALL_SECONDS", "600")  # what ends node 0 is rank 1's silence, not a stall
    monkeypatch.setenv("CLS_LIVENESS_SECONDS", "5")
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}})
    # One process a node; node 1's rank 1 names its machine node-b: its pid cannot be checked from node 0.
    nodes = two_nodes(tmp_path, [*RECIPE, f"data.name={data}", "data.cache=jpeg", f"data.cache_dir={tmp_path / 'a'}"],
                      [f"data.cache_dir={tmp_path / 'b'}"], "as-host:node-b,kill-in-jpeg-cache:1", nproc=1,
                      timeout=120)  # node 0 waited 600 s before
    (code0, out0), (code1, out1) = nodes
    assert code0 != 0 and code1 != 0, out0[-3000:] + out1[-3000:]
    line = (rf"train.py: rank 0 on {HOST}: stopped waiting for every machine's train cache file: rank 1 on node-b "
            r"\(pid \d+\) has given no sign of life for 5 s \(killed, stopped, or its machine is gone\)")
    # Said once on the console and once as torchrun's root cause: both name rank 1
    assert len(re.findall(rf"{line}\n", out0)) == 2 and re.search(rf"traceback : {line}\n", out0), out0[-3000:]
    assert "train.py: error:" not in out0  # rank 0 does not blame itself


@pytest.mark.slow
def test_a_hung_cache_writer_is_named_as_the_one_that_made_no_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("CLS_STALL_SECONDS", "5")
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}})
    # Rank 0 hangs, alive, at its first images (rank 1 might find no images left to claim, were it the one)
    result = run_torchrun("tests/faults.py", "hang-in-jpeg-cache:0", "train.py", *RECIPE, f"data.name={data}",
                          "data.cache=jpeg", f"data.cache_dir={tmp_path / 'cache'}", f"project={tmp_path / 'runs'}",
                          timeout=120)
    assert result.returncode != 0
    cache = r"\S+train\S+\.jpegcache"
    waiter = (rf"train.py: rank 1 on {HOST}: stopped waiting for local rank 0 to write {cache}: rank 0 on {HOST} "
              rf"\(pid \d+\) made no progress for 5 s \(at \d+\)")
    hung = (rf"train.py: error: rank 0 on {HOST}: made no progress for 5 s \(at \d+\), while rank 1 on {HOST} was "
            rf"waiting for local rank 0 to write {cache}")
    # The waiter's line once on the console; the hung rank, which ends itself on being named, says its own there and
    # is torchrun's root cause
    on_console = r"(?<!traceback : )"  # after rank 0's progress bar, on its line
    assert len(re.findall(rf"{on_console}{waiter}\n", result.stderr)) == 1, result.stderr[-3000:]
    assert len(re.findall(rf"{on_console}{hung}\n", result.stderr)) == 1, result.stderr[-3000:]
    root_cause = result.stderr.split("Root Cause")[-1]
    assert re.search(rf"rank      : 0 \(local_rank: 0\)\n  exitcode  : 2 .*\n.*\n  traceback : {hung}\n", root_cause), \
        result.stderr[-3000:]


@pytest.mark.slow
def test_a_rank_that_hangs_on_another_machine_is_named_there_and_ends_with_its_agent(tmp_path):
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}})
    # One process a node; node 1's rank 1 hangs, alive, at its 2nd vote (epoch 1, step 2): rank 0 names it, and it
    # ends on that (its agent with it) rather than waiting in its sleep until killed.
    nodes = two_nodes(tmp_path, [*RECIPE, f"data.name={data}", "train.epochs=2", "train.hang_seconds=5"], [],
                      "hang-rank-at-step:2:1", nproc=1, timeout=120)
    (code0, out0), (code1, out1) = nodes
    assert code0 != 0 and code1 != 0, out0[-3000:] + out1[-3000:]
    said = (f"train.py: error: rank 1 on {HOST}: made no progress for 5 s while the other ranks waited for it, stuck "
            f"at epoch 1, step 2/3 (in the step); the job ends here")
    assert [line.split("; the job")[0] for line in error_lines(out0)] == [said.split("; the job")[0]], out0[-3000:]
    assert [line.split("; the job")[0] for line in error_lines(out1)] == [said.split("; the job")[0]], out1[-3000:]
    assert f"traceback : {said}" in out1.split("Root Cause")[-1], out1[-3000:]
    assert "]: Traceback" not in out0 + out1  # no rank's traceback of a collective broken by the rank that ended
    # Before its line, where it stood: its main thread's stack, down to the fault's sleep
    stack = out1.split(f"rank 1 on {HOST}, named as hung, stands here:\n")[1].split("train.py: error:")[0]
    assert "in hang\n    time.sleep(10**6)" in stack, out1[-3000:]


@pytest.mark.slow
def test_a_rank_killed_mid_step_on_another_machine_is_named_on_both_consoles_without_a_traceback(tmp_path):
    # Node 1 ("node-b") is another machine: its rank 3 SIGKILLs itself at its 2nd vote (epoch 1, step 2). Rank 2 sees
    # its process end and says so on node-b's console; rank 0, whose collective broke, says it on node 0's; no
    # rank's traceback of the collective that broke, no offer to save.
    data = make_image_folder(tmp_path / "data", {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}})
    nodes = two_nodes(tmp_path, [*RECIPE, f"data.name={data}"], [], "as-host:node-b,kill-rank-at-step:2:3")
    (code0, out0), (code1, out1) = nodes
    assert code0 != 0 and code1 != 0, out0[-3000:] + out1[-3000:]
    said = f"train.py: error: rank 3 on node-b: {GONE}, last seen "  # where: published every 0.5 s
    lines0, lines1 = error_lines(out0), error_lines(out1)
    assert sorted(line.split(", last seen ")[0] for line in lines0) == [
        said.split(", last seen ")[0], f"train.py: rank 1 on {HOST} stopped: rank 3 on node-b failed"], out0[-3000:]
    assert len(lines1) == 1 and lines1[0].startswith(said), out1[-3000:]
    assert "]: Traceback" not in out0 + out1 and "to save a checkpoint" not in out0 + out1, out0[-3000:] + out1[-3000:]


def test_a_ranks_unexpected_error_is_recorded_for_the_others_to_say_before_it_raises(monkeypatch):
    # The other ranks then say its last line and stop (as for a usage error, above), instead of the traceback of the
    # collective it broke; the rank itself raises on, and its traceback is torchrun's root cause.
    import utils.distributed as distributed
    store = dist.HashStore()
    monkeypatch.setitem(distributed._job, "store", store)
    monkeypatch.setitem(distributed._job, "failed_here", False)
    monkeypatch.setattr(distributed, "FAILURE_POLL_S", 0.01)
    try:
        raise RuntimeError("an unexpected error")
    except RuntimeError:
        distributed.stop_if_another_rank_failed("train.py")  # returns: the caller raises
    assert store.check(["error/0"]) and json.loads(store.get("error/0"))["line"] == "RuntimeError: an unexpected error"
    assert distributed.first_failure(store) == 0 and distributed._job["failed_here"]


@pytest.mark.slow
def test_machines_started_with_other_overrides_or_process_counts_are_refused_before_any_work(tmp_path):
    # Either trained on, rank 0's machine ending normally with weights the ranks' diverging schedules had spoilt, or
    # waited for a machine its count never included, for the watchdog to blame a healthy rank.
    args = ["--recipe", "cls.yaml", "train.epochs=2"]
    differ = (f"the ranks were started with different recipes: rank 1 on {HOST} has train.epochs=3, rank 0 on {HOST} "
              f"train.epochs=2 (and 1 other key(s)); start every machine with the same command")
    for nproc, node1_args, line in (
            (1, ["optim.lr=0.05", "train.epochs=3", "data.workers=0"], differ),  # data.workers: each machine's own
            ((2, 1), [], f"every machine must run the same number of processes (torchrun's --nproc_per_node): {HOST} "
                         f"runs 2 (ranks 0-1), {HOST} runs 1 (rank 2); start each machine's torchrun with the same "
                         f"--nproc_per_node")):
        node1_first = 1 if nproc == 1 else 2
        nodes = two_nodes(tmp_path, args, node1_args, nproc=nproc, timeout=120)
        for (code, output), said in zip(nodes, ("", f"rank {node1_first} on {HOST}: ")):  # once on each console
            assert code != 0 and error_lines(output) == [f"train.py: error: {said}{line}"], output[-3000:]
            assert "]: Traceback" not in output and "epoch 1/2" not in output  # no rank's traceback
        assert not (tmp_path / "runs").exists()
