"""tune.py: a sweep end to end, refused spaces, a sweep killed and run again, failed trials, two workers on one
study. Trials are real train.py runs of the digits, one short epoch each."""

import csv
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

import tune
from conftest import ROOT, clean_env, run_python

SPACE = "optim.lr: {low: 0.02, high: 0.2, log: true}\ntrain.label_smoothing: {choices: [0.0, 0.1]}\n"
FIXED = ["train.epochs=1", "model.width=8"]


@pytest.fixture
def space(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(SPACE)
    return path


def sweep_command(space, project, trials, *more):
    return ["tune.py", "--recipe", "cls.yaml", "--space", str(space), "--trials", str(trials), "--project",
            str(project), *FIXED, *more]


def read_trials(sweep):
    with open(sweep / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_sweep_runs_its_trials_and_writes_the_best_as_a_recipe_that_trains(space, tmp_path):
    result = run_python(*sweep_command(space, tmp_path, 3))
    assert result.returncode == 0, result.stderr[-3000:]
    sweep = tmp_path / "cls-space"
    trials = read_trials(sweep)
    assert [t["state"] for t in trials] == ["COMPLETE"] * 3
    for t in trials:  # each trial is a run of its own, with the trial's keys, and the value its best val top-1
        recipe = yaml.safe_load((sweep / f"trial-{t['trial']}" / "recipe.yaml").read_text())
        assert recipe["optim"]["lr"] == pytest.approx(float(t["optim.lr"])) and recipe["train"]["epochs"] == 1
        assert 0.02 <= float(t["optim.lr"]) <= 0.2 and t["train.label_smoothing"] in ("0.0", "0.1")
        with open(sweep / f"trial-{t['trial']}" / "results.csv", newline="") as f:
            assert float(t["value"]) == pytest.approx(max(float(r["val/top1"]) for r in csv.DictReader(f)))
        assert list((sweep / f"trial-{t['trial']}").glob("events.out.tfevents.*"))
    best = max(trials, key=lambda t: float(t["value"]))
    recipe = yaml.safe_load((sweep / "best.yaml").read_text())
    assert recipe == {"base": "cls.yaml", "train": {"epochs": 1, "label_smoothing": float(best["train.label_smoothing"])},
                      "model": {"width": 8}, "optim": {"lr": pytest.approx(float(best["optim.lr"]))}}
    assert (sweep / "history.png").stat().st_size > 0 and f"trial {best['trial']:>3s}" in result.stdout
    trained = run_python("train.py", "--recipe", str(sweep / "best.yaml"), f"project={tmp_path}", "name=best")
    assert trained.returncode == 0, trained.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "best" / "recipe.yaml").read_text())
    assert saved["optim"]["lr"] == pytest.approx(float(best["optim.lr"])) and saved["model"]["width"] == 8
    again = run_python("tune.py", "--report", str(sweep))  # the report alone, from the folder
    assert again.returncode == 0 and "3 trials (3 complete)" in again.stdout


@pytest.mark.parametrize("space_text, expected", [
    ("optim.learning_rate: {low: 0.01, high: 0.1}", "optim.learning_rate: not a recipe key"),
    ("optim.name: {low: 1, high: 2}", "optim.name: a range needs a key that takes a number"),
    ("model.depth: {low: 1.5, high: 3}", "model.depth: takes a whole number, so its range must be whole numbers"),
    ("optim.lr: {low: -0.1, high: 0.1}", "optim.lr: -0.1 is refused:"),
    ("optim.name: {choices: [sgd, lamb]}", "optim.name: 'lamb' is refused:"),
    ("optim.lr: {low: 0.1, high: 0.01}", "optim.lr: needs low < high"),
    ("optim.lr: [0.1, 0.2]", "optim.lr: give {low: L, high: H}"),
    ("model.width: {low: 4, high: 8}", "model.width: searched, and also set on the command line"),
])
def test_a_space_that_cannot_be_searched_is_refused_before_any_trial(space_text, expected, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(space_text)
    with pytest.raises(SystemExit) as stop:
        tune.main(sweep_command(path, tmp_path / "runs", 3)[1:])
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"tune.py: error: --space {path}: ")
    assert expected in err, err
    assert not (tmp_path / "runs").exists()


def test_the_shipped_space_reads_as_four_searched_keys_of_cls_yaml():
    space = tune.read_space(ROOT / "spaces" / "cls.yaml", "cls.yaml", [])
    assert list(space) == ["optim.lr", "optim.weight_decay", "train.label_smoothing", "train.epochs"]
    assert space["optim.lr"].log and space["train.epochs"].low == 4 and space["train.epochs"].step == 1


def test_a_sweep_killed_mid_trial_goes_on_with_the_same_command(space, tmp_path):
    command = sweep_command(space, tmp_path, 2, "train.save_every_steps=5")
    command[command.index("train.epochs=1")] = "train.epochs=6"  # left alone, a trial runs on for seconds
    sweep = tmp_path / "cls-space"
    sweeper = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list((sweep / "trial-0" / "weights").glob("*.pt")):  # mid-trial: its run has saved
        assert sweeper.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    sweeper.send_signal(signal.SIGKILL)
    sweeper.wait()
    while running(f"project={sweep}"):  # its trial was told to stop (SIGTERM) when it died, and stops
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert "SIGTERM: stopping after the current step" in (sweep / "logs" / "trial-0.txt").read_text()
    result = run_python(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trial 0 was cut off" in result.stdout
    trials = read_trials(sweep)
    assert [t["state"] for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert trials[1]["retry_of"] == "0" and trials[1]["optim.lr"] == trials[0]["optim.lr"]  # trial 0 ran again
    assert trials[2]["optim.lr"] != trials[0]["optim.lr"]  # a new trial draws new keys (its own seed)
    assert "2 trials" not in result.stdout and "3 trials (2 complete, 1 fail)" in result.stdout


def running(word):
    """Whether a process of this machine has word in its command line."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if word.encode() in cmdline.read_bytes():
                return True
        except OSError:
            pass
    return False


def test_failed_trials_are_recorded_with_their_line_and_the_sweep_goes_on(space, tmp_path):
    result = run_python(*sweep_command(space, tmp_path, 2, "data.name=no_such_folder"))
    assert result.returncode == 2
    trials = read_trials(tmp_path / "cls-space")
    assert [t["state"] for t in trials] == ["FAIL", "FAIL"]  # the second ran after the first failed
    assert all("data.name 'no_such_folder' is neither a dataset here" in t["error"] for t in trials)
    assert result.stderr.strip().endswith("no trial has finished yet (their output: "
                                          f"{tmp_path / 'cls-space' / 'logs'})")


def test_a_pruned_trial_is_a_run_stopped_early_with_its_checkpoint(tmp_path):
    """watch reports each epoch's score and, when the pruner says so, stops train.py, which saves and stops."""
    class Trial:  # the pruner's side, as Optuna's trial offers it: prune once two epochs are reported
        reports = []

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return len(self.reports) >= 2

    command = [sys.executable, "train.py", "--recipe", "cls.yaml", "train.epochs=20", f"project={tmp_path}", "name=t"]
    process = subprocess.Popen(command, cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert tune.watch(process, Trial(), tmp_path / "t" / "results.csv", "top1")
    assert process.returncode == 128 + signal.SIGTERM, process.stderr.read()[-2000:]
    assert [step for step, _ in Trial.reports] == [0, 1] and Trial.reports[1][1] > 0.5
    assert (tmp_path / "t" / "weights" / "last.pt").exists()
    assert len(tune.epoch_scores(tmp_path / "t" / "results.csv", "top1")) < 20


def test_nproc_runs_each_trial_under_torchrun(tmp_path):
    space = tmp_path / "lr.yaml"
    space.write_text("optim.lr: {low: 0.02, high: 0.2, log: true}\n")
    result = run_python(*sweep_command(space, tmp_path, 1, "--nproc", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [t["state"] for t in read_trials(tmp_path / "cls-lr")] == ["COMPLETE"]
    assert "train: 2 process(es) on cpu" in (tmp_path / "cls-lr" / "logs" / "trial-0.txt").read_text()


def test_a_trial_that_fails_under_torchrun_is_recorded_with_the_ranks_error_line(tmp_path):
    space = tmp_path / "batch.yaml"
    space.write_text("train.batch_size: {choices: [47]}\n")  # one process takes it; two cannot share it
    result = run_python(*sweep_command(space, tmp_path, 1, "--nproc", "2"))
    assert result.returncode == 2
    line = (f"train.py: error: {ROOT / 'recipes' / 'cls.yaml'} (with command-line overrides): train.batch_size must "
            "be a multiple of the 2 processes")
    assert read_trials(tmp_path / "cls-batch")[0]["error"].startswith(line), result.stdout[-3000:]
    assert f"failed (exit 1): {line}" in result.stdout, result.stdout[-3000:]  # not torchrun's summary border


def test_a_crash_without_an_error_line_is_recorded_by_its_exception_not_torchruns_border(tmp_path):
    log = tmp_path / "trial-0.txt"
    log.write_text("epoch 1/3 ...\n[rank1]: Traceback (most recent call last):\n[rank1]: RuntimeError: boom\n"
                   "Traceback (most recent call last):\n  File \"run.py\", line 1, in <module>\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 60 +
                   "\ntrain.py FAILED\n" + "-" * 60 + "\nRoot Cause (first observed failure):\n[0]:\n"
                   "  traceback : Traceback (most recent call last):\n    RuntimeError: boom\n" + "=" * 60 + "\n")
    assert tune.failure_line(log) == "RuntimeError: boom"
    log.write_text("")
    assert tune.failure_line(log) == "no output"


def test_scores_stop_at_a_row_the_run_is_still_writing(tmp_path):
    results = tmp_path / "results.csv"
    results.write_text("epoch,val/loss,val/top1,val/ema_top1\n1,0.5,0.8,0.85\n2,0.4,0.9,\n3,0.3,0.9")  # row 3: cut
    assert tune.epoch_scores(results, "top1") == [0.85, 0.9]
    results.write_text("epoch,val/loss,val/top1\n1,0.5,0.8\n2,0.4,\n3,0.3,0.9\n")  # a row without its metric
    assert tune.epoch_scores(results, "top1") == [0.8]


def test_a_cut_off_trial_is_asked_again_once_and_an_unclaimed_one_too(tmp_path):
    import optuna

    study = tune.open_study(f"sqlite:///{tmp_path / 'study.db'}", "s", create=True)
    trial = study.ask({"optim.lr": optuna.distributions.FloatDistribution(0.01, 0.1)})
    assert tune.cut_off(study, trial.number, trial.params)
    assert not tune.cut_off(study, trial.number, trial.params)  # a second worker finds it done
    waiting = study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert len(waiting) == 1 and waiting[0].user_attrs == {"retry_of": 0}
    unclaimed = study.ask({"optim.lr": optuna.distributions.FloatDistribution(0.01, 0.1)})  # the retry, no worker
    tune.retry_dead_trials(study, unclaimed_after=0)
    states = {t.number: t.state.name for t in study.get_trials()}
    assert states == {0: "FAIL", 1: "FAIL", 2: "WAITING"} and unclaimed.number == 1


def test_each_trial_draws_from_its_own_seed(tmp_path):
    """The same seed draws the same keys for the same trial number, in another study too; trials differ."""
    space = tune.read_space(ROOT / "spaces" / "cls.yaml", "cls.yaml", [])
    drawn = []
    for k, seed in enumerate((0, 0, 1)):
        study = tune.open_study(f"sqlite:///{tmp_path / f'study{k}.db'}", "s", create=True)
        drawn.append([tune.ask(study, space, seed).params for _ in range(3)])
    assert drawn[0] == drawn[1]
    assert len({tuple(p.values()) for p in drawn[0]}) == 3 and drawn[2] != drawn[0]


def test_workers_starting_together_both_open_the_new_study(tmp_path):
    """Two workers creating one SQLite study at once race to create its tables; the later one tries again."""
    for k in range(8):
        url, studies = f"sqlite:///{tmp_path / f'study{k}.db'}", []
        workers = [threading.Thread(target=lambda: studies.append(tune.open_study(url, "s", create=True)))
                   for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert len(studies) == 2 and studies[0]._study_id == studies[1]._study_id


def test_two_workers_on_one_study_run_distinct_trials(space, tmp_path):
    command = [sys.executable, *sweep_command(space, tmp_path, 4)]
    workers = [subprocess.Popen(command, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    outputs = [w.communicate(timeout=300) for w in workers]
    assert all(w.returncode == 0 for w in workers), [err[-2000:] for _, err in outputs]
    trials = read_trials(tmp_path / "cls-space")
    assert 4 <= len(trials) <= 5 and all(t["state"] == "COMPLETE" for t in trials)  # each checks, then asks
    ran = [[line.split()[2].rstrip(":") for line in out.splitlines() if line.startswith("tune: trial")]
           for out, _ in outputs]
    assert all(ran) and not set(ran[0]) & set(ran[1])  # both worked, never on the same trial
    assert sorted(ran[0] + ran[1], key=int) == [t["trial"] for t in trials]
    best = yaml.safe_load((tmp_path / "cls-space" / "best.yaml").read_text())
    assert best["optim"]["lr"] == pytest.approx(float(max(trials, key=lambda t: float(t["value"]))["optim.lr"]))
