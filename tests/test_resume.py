"""Nothing lost: a run killed at any moment and resumed ends bit-identical to an uninterrupted one (at one and two
processes); torchrun restarts, preemption signals, non-finite losses and a full disk end cleanly on every rank."""

import csv
import random
import socket
import subprocess
import sys

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import ROOT, TORCHRUN, clean_env, console_lines, make_image_folder, run_python, run_torchrun
from utils.checkpoint import load_checkpoint

# 17 training images in batches of 8: 3 steps per epoch, the last one partial; at two processes rank 0 holds 9
# images (3 steps) and rank 1 holds 8 (2 steps). Dropout and random crops make every random stream matter. One
# DataLoader worker at one process (two processes on two cores get none): a worker leaves compute one thread, and
# other thread counts round differently.
RECIPE = ["--recipe", "cls.yaml", "train.epochs=3", "train.batch_size=8", "model.width=4", "model.dropout=0.2",
          "data.scale=[0.5,1.0]", "train.save_every_steps=2", "train.log_every_steps=1", "train.ema_decay=0.9",
          "train.ema_steps=2", "data.workers=1", "log.plots=false"]
# The kills and resumes again in bf16 (autocast; oneDNN emulates it where the CPU lacks bf16 instructions)
PRECISIONS = ("fp32", "bf16")


def recipe(precision="fp32"):
    """RECIPE's arguments in precision."""
    return [*RECIPE, f"train.precision={precision}"]
TIME_COLUMNS = {"time/epoch", "time/img_s"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("data") / "d", {"train": {"a": 9, "b": 8},
                                                                      "val": {"a": 3, "b": 4}})


def launch(nproc, *args, max_restarts=0, timeout=600):
    """train.py (or tests/faults.py FAULT train.py) as one process, or under torchrun with nproc processes."""
    if nproc == 1:
        return run_python(*args, timeout=timeout)
    return run_torchrun(f"--max-restarts={max_restarts}", *args, nproc=nproc, timeout=timeout)


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """Uninterrupted runs of RECIPE at one and two processes, in each precision: {(nproc, precision): run
    directory}."""
    project, runs = tmp_path_factory.mktemp("reference"), {}
    for nproc in (1, 2):
        for precision in PRECISIONS:
            result = launch(nproc, "train.py", *recipe(precision), f"data.name={data}", f"project={project}",
                            f"name=n{nproc}-{precision}")
            assert result.returncode == 0, result.stderr[-3000:]
            runs[nproc, precision] = project / f"n{nproc}-{precision}"
    return runs


def weights(run_dir):
    return load_checkpoint(run_dir / "weights" / "last.pt")["model"]


def assert_same_run(run_dir, reference_dir):
    """Bit-identical final weights, the same results.csv apart from timings, and each epoch and logged step once in
    TensorBoard."""
    for key in ("model", "ema"):  # the weights and their EMA
        ours, theirs = (load_checkpoint(d / "weights" / "last.pt")[key] for d in (run_dir, reference_dir))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    rows, reference_rows = results(run_dir), results(reference_dir)
    assert [r["epoch"] for r in rows] == ["1", "2", "3"]
    assert [{k: v for k, v in r.items() if k not in TIME_COLUMNS} for r in rows] == \
        [{k: v for k, v in r.items() if k not in TIME_COLUMNS} for r in reference_rows]
    ours, theirs = (EventAccumulator(str(d), size_guidance={"scalars": 0}).Reload() for d in (run_dir, reference_dir))
    assert [e.step for e in ours.Scalars("val/top1")] == [3, 6, 9]  # each epoch once, at its last step
    # The loss logged every step: the same steps and values, none lost or repeated across kills and resumes.
    assert [(e.step, e.value) for e in ours.Scalars("train/loss_step")] == \
        [(e.step, e.value) for e in theirs.Scalars("train/loss_step")]


def results(run_dir):
    with open(run_dir / "results.csv") as f:
        return list(csv.DictReader(f))


def position(run_dir):
    ckpt = load_checkpoint(run_dir / "weights" / "last.pt")
    return ckpt["epoch"], ckpt["step"]


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_one_process_stopped_and_killed_at_any_moment_resumes_to_bit_identical_weights(data, reference, tmp_path,
                                                                                      precision):
    run_dir = tmp_path / "exp"
    # 1. Ctrl-C (SIGINT to the process group, DataLoader worker included) during step 1: stops after step 2.
    result = launch(1, "tests/faults.py", "signal-at-step:1:SIGINT", "train.py", *recipe(precision),
                    f"data.name={data}", f"project={tmp_path}")
    assert "1 worker(s)" in result.stdout
    assert result.returncode == 130 and "Traceback" not in result.stderr
    assert f"Resume with:\n  python train.py --resume {run_dir}" in result.stdout
    assert position(run_dir) == (0, 2)
    # 2. Resumed, then SIGKILLed while saving last.pt at the end of epoch 1, after its results row was written:
    #    last.pt stays the mid-epoch one, whole.
    result = launch(1, "tests/faults.py", "killpg-in-save:1", "train.py", "--resume", run_dir)
    assert result.returncode != 0 and position(run_dir) == (0, 2)
    assert [r["epoch"] for r in results(run_dir)] == ["1"]
    # 3. Resumed (the orphan epoch-1 row and events are dropped), SIGKILLed right after the end-of-epoch save.
    result = launch(1, "tests/faults.py", "killpg-after-save:1", "train.py", "--resume", run_dir)
    assert result.returncode != 0 and position(run_dir) == (1, 0)
    # 4. Resumed from the end of epoch 1 to the end: a bare --resume takes the newest run under project.
    result = launch(1, "train.py", "--resume", f"project={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming at epoch 2, step 0 from {run_dir / 'weights' / 'last.pt'}" in result.stdout  # the one found
    assert_same_run(run_dir, reference[1, precision])
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]  # resumed in place
    # 5. A finished run extended by one epoch.
    result = launch(1, "train.py", "--resume", run_dir, "train.epochs=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["epoch"] for r in results(run_dir)] == ["1", "2", "3", "4"]
    assert load_checkpoint(run_dir / "weights" / "last.pt")["recipe"]["train"]["epochs"] == 4
    assert "epochs: 4" in (run_dir / "recipe.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_two_processes_preempted_killed_and_out_of_disk_resume_to_bit_identical_weights(data, reference, tmp_path,
                                                                                         precision):
    run_dir = tmp_path / "exp"
    # 1. Rank 0 sends SIGTERM to the process group (torchrun and both ranks, as a scheduler's preemption does)
    #    during step 1 of epoch 1; the ranks agree to stop after step 2, rank 0 saves, every process exits.
    result = launch(2, "tests/faults.py", "signal-at-step:1:SIGTERM", "train.py", *recipe(precision),
                    f"data.name={data}", f"project={tmp_path}")
    assert result.returncode != 0 and position(run_dir) == (0, 2)
    assert result.stdout.count("Stopped at epoch 1, step 2/3") == 1
    assert f"Resume with:\n  torchrun --nproc_per_node=2 train.py --resume {run_dir}" in result.stdout
    assert "exitcode  : 143" in result.stderr and "train.py\", line" not in result.stderr  # no worker raised
    # 2. Resumed (rank 1's share of epoch 1 is done, rank 0 has a step left), SIGKILL of torchrun and both ranks
    #    right after the end-of-epoch save.
    result = launch(2, "tests/faults.py", "killpg-after-save:1", "train.py", "--resume", run_dir)
    assert result.returncode != 0 and position(run_dir) == (1, 0)
    # 3. Resumed; rank 0's disk is full at its second save (the end of epoch 2): every rank ends with one line, and
    #    last.pt stays the mid-epoch checkpoint of epoch 2.
    result = launch(2, "tests/faults.py", "enospc-in-save:2", "train.py", "--resume", run_dir)
    message = (f"train.py: error: cannot save checkpoint {run_dir / 'weights' / 'last.pt'}: No space left on "
               f"device; the previous checkpoint there, if any, is intact")
    assert result.returncode != 0 and len(console_lines(result.stderr, message)) == 1
    assert position(run_dir) == (1, 1) and not list((run_dir / "weights").glob(".last.pt.tmp-*"))
    # 4. Resumed from the middle of epoch 2 to the end.
    result = launch(2, "train.py", "--resume", run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(run_dir, reference[2, precision])


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_and_continues_the_same_run(data, reference, tmp_path):
    # Rank 1's votes: epoch 1 has 5 (steps 1 and 2, the settle before the mid-epoch save, after the loop, after
    # validation); its 8th is at step 2 of epoch 2, just after that epoch's mid-epoch save at step 1.
    result = launch(2, "tests/faults.py", "kill-rank-at-step:8:1", "train.py", *recipe(), f"data.name={data}",
                    f"project={tmp_path}", max_restarts=1)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torchrun restart 1: continuing" in result.stdout and "resuming at epoch 2, step 1" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]
    assert_same_run(tmp_path / "exp", reference[2, "fp32"])


def root_cause(stderr):
    """torchrun's summary of the failure it names as the root cause."""
    return stderr.split("Root Cause (first observed failure):")[-1]


@pytest.mark.slow
@pytest.mark.parametrize("frozen", [1, 0])
def test_a_rank_frozen_mid_training_is_named_in_seconds_and_the_run_resumes_exactly(data, reference, tmp_path,
                                                                                     frozen):
    # A rank SIGSTOPs itself at its 4th vote (epoch 1's end). Without the watchdog, the other waits in gloo for 600 s
    # and is torchrun's root cause; the launch's timeout is far shorter.
    result = launch(2, "tests/faults.py", f"stop-rank-at-step:4:{frozen}", "train.py", *recipe(), f"data.name={data}",
                    f"project={tmp_path}", "train.hang_seconds=5", timeout=180)
    line = (f"train.py: error: rank {frozen} on {socket.gethostname()}: gave no sign of life for 5 s (stopped, frozen, "
            f"or its machine is gone), last seen ")  # where: published every 0.5 s, these steps are quicker
    # Said once on the console, by the rank that ended it (rank 0's place when it is the one frozen)
    assert result.returncode != 0 and len(console_lines(result.stderr, line)) == 1, result.stderr[-3000:]
    cause = root_cause(result.stderr)
    assert f"rank      : {frozen} (local_rank: {frozen})" in cause and f"traceback : {line}" in cause, \
        result.stderr[-3000:]
    # The other rank ended the frozen one: torchrun did not wait out its 30 s for a SIGTERM a stopped process ignores
    assert "forcefully exiting via" not in result.stderr, result.stderr[-3000:]
    if frozen == 0:
        return
    result = launch(2, "train.py", "--resume", tmp_path / "exp")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "exp", reference[2, "fp32"])


@pytest.mark.slow
def test_a_rank_whose_main_thread_hangs_is_named_and_ends_itself(data, tmp_path):
    # Rank 1's main thread sleeps at its 2nd vote (epoch 1, step 2) while its watch thread lives: rank 0 finds it
    # standing still behind it, and rank 1 ends on being named, as torchrun's root cause.
    result = launch(2, "tests/faults.py", "hang-rank-at-step:2:1", "train.py", *recipe(), f"data.name={data}",
                    f"project={tmp_path}", "train.hang_seconds=5", "train.save_every_steps=0", timeout=180)
    line = (f"train.py: error: rank 1 on {socket.gethostname()}: made no progress for 5 s while the other ranks waited "
            f"for it, stuck at epoch 1, step 2/3 (in the step); the job ends here")
    assert result.returncode != 0 and len(console_lines(result.stderr, line)) == 1, result.stderr[-3000:]
    cause = root_cause(result.stderr)
    assert "rank      : 1 (local_rank: 1)" in cause and "exitcode  : 2" in cause and line in cause, cause


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0])
def test_ranks_frozen_at_random_moments_under_torchrun_restarts_end_bit_identical(data, reference, tmp_path, seed):
    # Three attempts, each frozen at a random vote of a random rank (the ranks are named and ended, torchrun starts
    # the group again from last.pt), then a fourth that runs to the end: one run directory, the unbroken run's
    # weights and logs.
    rng = random.Random(seed)
    steps, ranks = zip(*[(rng.randint(2, 6), rng.randint(0, 1)) for _ in range(3)])
    fault = f"stop-rank-at-step:{'/'.join(map(str, steps))}:{'/'.join(map(str, ranks))}"
    result = launch(2, "tests/faults.py", fault, "train.py", *recipe(), f"data.name={data}", f"project={tmp_path}",
                    "train.hang_seconds=5", max_restarts=3, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("gave no sign of life for 5 s") == 3, (fault, result.stderr[-3000:])
    for restart in (1, 2, 3):  # not "the job ends here": torchrun starts it again
        assert result.stderr.count(f"; torchrun restarts the job (restart {restart} of 3) (") == 1
    assert "torchrun restart 3: continuing" in result.stdout, result.stdout[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["exp"]
    assert_same_run(tmp_path / "exp", reference[2, "fp32"])


@pytest.mark.slow
def test_non_finite_loss_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint(data, tmp_path):
    # Rank 1 takes 2 steps per epoch: its 5th loss is in epoch 3, step 1.
    result = launch(2, "tests/faults.py", "nan-loss-at-step:5:1", "train.py", *recipe(), f"data.name={data}",
                    f"project={tmp_path}")
    assert result.returncode != 0
    message = "train.py: error: the training loss is not finite (nan or inf) at epoch 3, step 1/3"
    assert len(console_lines(result.stderr, message)) == 1
    assert position(tmp_path / "exp") == (2, 0)  # the end of epoch 2: no later state was saved
    assert [r["epoch"] for r in results(tmp_path / "exp")] == ["1", "2"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_group_norm_gives_the_same_step_at_1_two_nodes_and_3_processes(tmp_path):
    # 13 images in global batches of 6: the last step holds one image, which rank 0 takes at any N; at 2 and 3
    # processes the other ranks have run out. Its gradient must still be the mean over that step's samples.
    data = make_image_folder(tmp_path / "d13", {"train": {"a": 7, "b": 6}, "val": {"a": 1, "b": 1}})
    recipe = ["train.py", "--recipe", "cls.yaml", f"data.name={data}", "train.epochs=1", "train.batch_size=6",
              "model.width=4", "model.norm=group", "data.scale=[0.5,1.0]", "train.precision=fp32", "log.plots=false"]
    assert run_python(*recipe, f"project={tmp_path}", "name=n1").returncode == 0
    port = free_port()
    nodes = [subprocess.Popen(  # two torchrun "nodes" of one process each, joined by c10d rendezvous
        [sys.executable, "-c", TORCHRUN, "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes", *recipe,
         f"project={tmp_path}", "name=n2"], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "2 process(es) on cpu" in outputs[0]
    result = run_torchrun(*recipe, f"project={tmp_path}", "name=n3", nproc=3)
    assert result.returncode == 0, result.stderr[-3000:]
    one = weights(tmp_path / "n1")
    for name in ("n2", "n3"):
        other = weights(tmp_path / name)
        assert all(torch.allclose(one[k], other[k], rtol=1e-5, atol=1e-6) for k in one), name


@pytest.mark.slow
def test_best_pt_holds_the_better_of_the_weights_and_their_ema(reference):
    sources = []
    for run_dir in reference.values():
        best = load_checkpoint(run_dir / "weights" / "best.pt")
        row = results(run_dir)[best["epoch"] - 1]
        top1, ema_top1 = float(row["val/top1"]), float(row["val/ema_top1"])
        sources.append(best["model_source"])
        assert best["model_source"] == ("ema" if ema_top1 > top1 else "training")
        assert abs(best["best_score"] - max(top1, ema_top1)) < 1e-6
        held = {k: v for k, v in best["ema"].items() if k.startswith("module.")}
        same = all(torch.equal(best["model"][k.removeprefix("module.")], v) for k, v in held.items())
        assert same == (best["model_source"] == "ema")
    assert "ema" in sources  # the recipe makes the EMA win somewhere, so both branches are shown
