"""Checkpoints: written atomically and durably, loaded with weights_only=True, and checked before a resume."""

import errno
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from omegaconf import OmegaConf

import train
import utils.checkpoint
import utils.run
import utils.watchdog
from conftest import ROOT, clean_env, make_image_folder, run_torchrun
from models import build_model
from test_resume import RECIPE, assert_same_run, free_port
from utils.checkpoint import load_checkpoint, restore, save_checkpoint, save_state
from utils.config import load_recipe
from utils.general import SharedError, UsageError
from utils.optim import build_optimizer, build_scheduler
from utils.precision import grad_scaler
from utils.run import make_run_dir, read_restarted_run
from utils.stopping import StopVote
from utils.torch_utils import model_ema


def train_state(cfg, classes=2):
    model = build_model(cfg.model, classes)
    optimizer = build_optimizer(model, cfg.optim)
    return train.TrainState(model, optimizer, build_scheduler(optimizer, cfg.sched, cfg.train.epochs, 5),
                            grad_scaler(torch.device("cpu"), None))


def saved_state(state, cfg, path, classes=("a", "b"), at=(1, 3)):
    state.model(torch.randn(2, 3, 8, 8)).sum().backward()
    state.optimizer.step()
    state.scheduler.step()
    state.epoch, state.step = at  # epochs done, and steps into the next
    save_state(state, OmegaConf.to_container(cfg), list(classes), 17, [path])
    return load_checkpoint(path)


def test_full_training_state_round_trips_with_weights_only(tmp_path):
    cfg = load_recipe("cls.yaml", ["model.width=4"])
    state = train_state(cfg)
    ckpt = saved_state(state, cfg, tmp_path / "last.pt")
    assert ckpt["recipe"] == OmegaConf.to_container(cfg) and ckpt["classes"] == ["a", "b"]
    assert (ckpt["epoch"], ckpt["step"], len(ckpt["rng"]), ckpt["train_images"]) == (1, 3, 1, 17) and "ema" in ckpt
    fresh = train_state(cfg)
    restore(fresh, "last.pt", ckpt, ["a", "b"], cfg.train.epochs)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(), state.model.state_dict().values()))
    assert fresh.scheduler.last_epoch == 1 and (fresh.epoch, fresh.step) == (1, 3)
    assert fresh.optimizer.param_groups[0]["lr"] == state.optimizer.param_groups[0]["lr"]


def test_a_resume_that_changes_the_schedule_says_how_the_lr_moves(tmp_path, log):
    cfg = load_recipe("cls.yaml", ["model.width=4", "train.epochs=4", "sched.warmup_epochs=0"])
    ckpt = saved_state(train_state(cfg), cfg, tmp_path / "last.pt")
    restore(train_state(cfg), "last.pt", ckpt, ["a", "b"], 4)
    assert not log.records  # the same length: the schedule goes on as it was
    shorter = load_recipe("cls.yaml", ["model.width=4", "train.epochs=2", "sched.warmup_epochs=0"])
    state = train_state(shorter)
    restore(state, "last.pt", ckpt, ["a", "b"], 2)
    lr, saved = state.optimizer.param_groups[0]["lr"], ckpt["optimizer"]["param_groups"][0]["lr"]
    assert lr < saved and [r.getMessage() for r in log.records] == [
        f"last.pt: train.epochs=2, the run was planned for 4: from here the lr follows the schedule of 2 epochs, so "
        f"it moves at once from {saved:.4g} to {lr:.4g} ({lr / saved - 1:+.0%})"]


def test_resume_refuses_other_classes_and_other_weights(tmp_path):
    cfg = load_recipe("cls.yaml", ["model.width=4", "train.epochs=2"])
    ckpt = saved_state(train_state(cfg), cfg, tmp_path / "last.pt")
    with pytest.raises(SharedError, match=r"trained on 2 classes \['a', 'b'\]..., but the data has 3 classes"):
        restore(train_state(cfg, 3), "last.pt", ckpt, ["a", "b", "c"], 2)
    wider = load_recipe("cls.yaml", ["model.width=8"])
    with pytest.raises(SharedError, match="last.pt: its weights do not fit the model of its recipe: size mismatch"):
        restore(train_state(wider), "last.pt", ckpt, ["a", "b"], 2)


def resume(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", *map(str, argv)])
    return e.value.code, capsys.readouterr().err


def test_resume_errors_are_one_line_before_any_work(tmp_path, capsys):
    code, err = resume(capsys, tmp_path / "nope")
    assert code == 2 and err == f"train.py: error: --resume {tmp_path / 'nope'}: no such checkpoint file or run directory\n"
    code, err = resume(capsys, "", f"project={tmp_path / 'empty'}")  # bare --resume: the newest run under project
    assert code == 2 and f"--resume: no run to resume under {tmp_path / 'empty'}/ (no */weights/last.pt)" in err
    (tmp_path / "run" / "weights").mkdir(parents=True)
    cfg = load_recipe("cls.yaml", ["model.width=4"])
    saved_state(train_state(cfg), cfg, tmp_path / "run" / "weights" / "last.pt")
    code, err = resume(capsys, tmp_path / "run", "optim.lr=0.5")
    lr = cfg.optim.lr
    assert code == 2 and f"optim.lr=0.5 cannot change on resume: the run so far was trained with optim.lr={lr}" in err
    with pytest.raises(SystemExit):
        train.main(["--resume", str(tmp_path / "run"), "--recipe", "cls.yaml"])
    assert "--resume takes the recipe from the checkpoint: leave out --recipe" in capsys.readouterr().err
    finished = load_recipe("cls.yaml", ["model.width=4", "train.epochs=1", f"data.name={tmp_path / 'gone'}"])
    last = tmp_path / "finished" / "weights" / "last.pt"
    last.parent.mkdir(parents=True)
    saved_state(train_state(finished), finished, last, at=(1, 0))  # saved after the run's one epoch
    code, err = resume(capsys, last.parent.parent)  # refused before its data, which is gone, would be read
    assert code == 2 and err == (f"train.py: error: {last}: the run has already trained all 1 epoch; to train longer, "
                                 f"resume with train.epochs=N (N > 1)\n")
    saved_state(train_state(finished), finished, last, at=(7, 14))  # stopped in epoch 8 of a longer schedule
    code, err = resume(capsys, last.parent.parent, "train.epochs=3")
    assert code == 2 and err == (f"train.py: error: {last}: the run is already past train.epochs=3 (saved at epoch 8, "
                                 f"step 14); to train longer, resume with train.epochs=N (N > 7)\n")
    torch.save({"epoch": 1}, tmp_path / "other.pt")
    code, err = resume(capsys, tmp_path / "other.pt")
    assert code == 2 and "other.pt: not a training checkpoint of train.py (missing model, optimizer" in err


class RunsCode:
    """A pickle that would run code on load: it creates the file it names."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_resume_refuses_a_checkpoint_whose_pickle_would_run_code(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    torch.save({"model": RunsCode(marker), "epoch": 1}, tmp_path / "evil.pt")
    code, err = resume(capsys, tmp_path / "evil.pt")
    assert code == 2 and not marker.exists()
    assert "evil.pt: refused: it holds Python objects, not only tensors and plain values, and loading it could run " \
           "code (torch.load with weights_only=True: it names posix.system); a model saved whole, torch.save(model), " \
           "is one: save its weights, torch.save(model.state_dict(), PATH)\n" in err


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)

    def full_disk(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(utils.once.os, "fsync", full_disk)
    with pytest.raises(UsageError, match="cannot save checkpoint .*last.pt: No space left on device; the previous"):
        save_checkpoint({"epoch": 2}, path)
    monkeypatch.undo()
    write = utils.watchdog.PulsingFile.write

    def fill_up(self, data):  # the disk fills mid-save: torch's zip writer raises a RuntimeError over the OSError
        if self.f.tell() + len(data) > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(self, data)
    monkeypatch.setattr(utils.watchdog.PulsingFile, "write", fill_up)
    with pytest.raises(UsageError, match="cannot save checkpoint .*last.pt: No space left on device; the previous"):
        save_checkpoint({"epoch": 2, "model": {"weight": torch.ones(10_000)}}, path)
    monkeypatch.undo()
    assert load_checkpoint(path) == {"epoch": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


def test_stop_vote_counts_a_signal_and_a_non_finite_loss_one_step_later():
    before = signal.getsignal(signal.SIGTERM)
    with StopVote(torch.device("cpu")) as vote:
        vote.started = True  # training: a signal asks for a stop (before, it ends the process at once)
        assert vote.cast(torch.tensor(1.0), 0) == (False, None)
        assert vote.cast(torch.tensor(float("inf")), 1) == (False, None)
        assert vote.cast(torch.tensor(2.0), 2) == (False, 1)  # step 1's loss, counted at step 2
        os.kill(os.getpid(), signal.SIGTERM)  # caught: it only asks for a stop
        assert vote.cast(torch.tensor(3.0), 3) == (False, None)
        assert vote.settle() == (True, None)
    assert signal.getsignal(signal.SIGTERM) is before


def test_bare_resume_followed_by_overrides_takes_them_as_overrides():
    args = train.parse_args(["--resume", "train.epochs=30", "project=runs/x"])
    assert args.resume == "" and args.overrides == ["train.epochs=30", "project=runs/x"]
    assert train.parse_args(["--resume", "runs/train/exp", "train.epochs=30"]).resume == "runs/train/exp"


@pytest.mark.slow
def test_a_sigterm_during_a_start_up_fetch_ends_the_process_within_seconds(tmp_path):
    # A server that takes the connection and never answers: the top file's fetch waits up to its timeout (60 s) a
    # try, over 6 tries. A scheduler's SIGTERM there must end the process at once, as a Ctrl-C does: there is no step
    # to finish and nothing to save.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"http://127.0.0.1:{server.getsockname()[1]}/set"
        process = subprocess.Popen([sys.executable, "train.py", "--recipe", "cls.yaml", f"data.name={url}",
                                    "data.cache=none", f"project={tmp_path / 'runs'}"], cwd=ROOT, env=clean_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            server.settimeout(120)
            connection, _ = server.accept()  # train.py is fetching
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=30)
            connection.close()
        finally:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert stderr.strip().splitlines() == ["SIGTERM: stopped while starting, before any training; nothing was saved"]
    assert not (tmp_path / "runs").exists()


def test_resume_refuses_a_checkpoint_that_is_not_the_runs_latest_state(tmp_path, capsys):
    weights = tmp_path / "run" / "weights"
    weights.mkdir(parents=True)
    cfg = load_recipe("cls.yaml", ["model.width=4", "train.ema_decay=0.9", "train.ema_steps=1"])
    state = train_state(cfg)
    state.ema = model_ema(state.model, 0.9, 1, 64, 10)
    saved_state(state, cfg, weights / "best.pt")  # epoch 1, step 3
    state.step = 4
    save_state(state, OmegaConf.to_container(cfg), ["a", "b"], 17, [weights / "last.pt"])
    code, err = resume(capsys, weights / "best.pt")
    assert code == 2 and err == (f"train.py: error: --resume {weights / 'best.pt'}: not the run's latest state (saved "
                                 f"at epoch 2, step 3, {weights / 'last.pt'} at epoch 2, step 4); resuming from it "
                                 f"would rewind the run. Resume from {weights / 'last.pt'}, or start a new run from "
                                 f"its weights with model.weights={weights / 'best.pt'}\n")
    save_state(state, OmegaConf.to_container(cfg), ["a", "b"], 17, [weights / "best.pt"], best_from_ema=True)  # the same position
    code, err = resume(capsys, weights / "best.pt")
    assert code == 2 and "best.pt: it holds the EMA of the weights (a best.pt), not the training state; resume " \
                         f"from {weights / 'last.pt'}" in err
    assert load_checkpoint(weights / "last.pt")["step"] == 4  # nothing was overwritten


def test_a_restart_never_takes_a_run_whose_id_is_the_bare_static_one(tmp_path, monkeypatch):
    # Under --master-addr/--master-port without --rdzv-id, every torchrun job's run id is 'none'; runs made before
    # job_id() told static jobs apart hold just that.
    monkeypatch.setattr(utils.run, "RUN_ID", "none")
    other = tmp_path / "exp"
    (other / "weights").mkdir(parents=True)
    (other / ".torchrun_id").write_text("none")
    assert read_restarted_run(tmp_path, "exp") == (None, None, None)
    ours = make_run_dir(load_recipe("cls.yaml", [f"project={tmp_path}"]))
    assert ours.name == "exp2" and (ours / ".torchrun_id").read_text() == f"none:{os.uname().nodename}:{os.getppid()}"


@pytest.mark.slow
def test_a_static_rendezvous_restart_continues_its_own_run_not_another_static_jobs(tmp_path):
    # Two torchrun jobs under static rendezvous (--master-addr/--master-port, no --rdzv-id: both have the run id
    # 'none') train the same recipe in one project. The first finishes in exp; torchrun restarts the second's workers
    # after rank 1 dies in epoch 2, while exp looks the newest run there (as when the other job is still writing).
    data = make_image_folder(tmp_path / "data", {"train": {"a": 9, "b": 8}, "val": {"a": 3, "b": 4}})
    project = tmp_path / "runs"
    args = ["train.py", *RECIPE, f"data.name={data}", f"project={project}"]
    assert static_torchrun(*args).returncode == 0
    other = project / "exp"
    finished = {name: (other / name).read_bytes() for name in ("results.csv", "weights/last.pt")}
    later = time.time() + 3600
    os.utime(other, (later, later))
    # Rank 1's 8th vote is at step 2 of epoch 2, just after that epoch's mid-epoch save at step 1 (see test_resume).
    result = static_torchrun("--max-restarts=1", "tests/faults.py", "kill-rank-at-step:8:1", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    ours = project / "exp2"
    assert f"torchrun restart 1: continuing {ours} from {ours / 'weights' / 'last.pt'}" in result.stdout
    assert "resuming at epoch 2, step 1" in result.stdout
    assert sorted(p.name for p in project.iterdir()) == ["exp", "exp2"]
    assert {name: (other / name).read_bytes() for name in finished} == finished
    assert_same_run(ours, other)  # the same recipe uninterrupted: continued exactly where it was killed


def static_torchrun(*args):
    """torchrun with two processes under static rendezvous on this machine, as a job without --rdzv-id."""
    return run_torchrun(*args, launcher=("--master-addr=127.0.0.1", f"--master-port={free_port()}", "--nnodes=1"))


def test_the_rescheduled_lr_is_said_by_rank_0_alone(monkeypatch, log):
    ckpt = {"recipe": {"train": {"epochs": 4}}, "optimizer": {"param_groups": [{"lr": 0.1}]}}
    monkeypatch.setattr(utils.checkpoint, "RANK", 1)
    utils.checkpoint.warn_of_a_rescheduled_lr("last.pt", ckpt, 2, 0.05)
    assert log.text == ""
    monkeypatch.setattr(utils.checkpoint, "RANK", 0)
    utils.checkpoint.warn_of_a_rescheduled_lr("last.pt", ckpt, 2, 0.05)
    assert "the run was planned for 4" in log.text


def test_checkpoints_name_the_best_score_and_its_metric_and_an_older_best_top1_still_resumes(tmp_path):
    cfg = load_recipe("cls.yaml", ["model.width=4", "train.best_metric=balanced_top1"])
    state = train_state(cfg)
    state.best_score, state.best_epoch, state.best_metric = 0.75, 1, "balanced_top1"
    ckpt = saved_state(state, cfg, tmp_path / "last.pt")
    assert (ckpt["best_score"], ckpt["best_metric"], ckpt["best_epoch"]) == (0.75, "balanced_top1", 1)
    assert "best_top1" not in ckpt
    ckpt["best_top1"] = ckpt.pop("best_score")  # as checkpoints were saved before best_score
    del ckpt["best_metric"]
    resumed = train_state(cfg)
    restore(resumed, tmp_path / "last.pt", ckpt, ["a", "b"], cfg.train.epochs)
    assert (resumed.best_score, resumed.best_epoch, resumed.epoch, resumed.step) == (0.75, 1, 1, 3)


def test_a_stop_says_the_step_it_saved_or_that_it_saved_after_a_validated_epoch(tmp_path):
    resume = f"Resume with:\n  python train.py --resume {tmp_path}"
    assert utils.run.stopped_message(tmp_path, 5, 9, 9) == (  # the epoch's last step, before its validation
        f"\nStopped at epoch 6, step 9/9; saved {tmp_path / 'weights' / 'last.pt'}. {resume}")
    assert utils.run.stopped_message(tmp_path, 6, 0, 9) == (  # a signal during epoch 6's validation: train.py
        f"\nStopped after epoch 6 and its validation; saved {tmp_path / 'weights' / 'last.pt'}. {resume}")
