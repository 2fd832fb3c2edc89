"""tune.py: a sweep end to end (and its record in MLflow), refused spaces, a sweep killed and run again, failed
trials, two workers on one study. Trials are real train.py runs of the digits, one short epoch each."""

import csv
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

import train
import tune
from conftest import ROOT, clean_env, closed_port, make_image_folder, run_python

SPACE = "optim.lr: {low: 0.02, high: 0.2, log: true}\ntrain.label_smoothing: {choices: [0.0, 0.1]}\n"
FIXED = ["train.epochs=1", "model.width=8", "log.plots=false"]


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


TRACKED = ["log.to=[tensorboard,mlflow]"] if find_spec("mlflow") else []  # the tracker's side: test_a_sweep_is_one_...


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(project, [the two workers' CompletedProcess]) of a sweep of 3 trials of SPACE run by two tune.py started
    together on one study, recorded in MLflow where it is installed; read by the tests of what a sweep writes, of
    how workers share it, and of what MLflow holds."""
    base = tmp_path_factory.mktemp("sweep")
    space = base / "space.yaml"
    space.write_text(SPACE)
    project = base / "runs" / "tune"
    command = [sys.executable, *sweep_command(space, project, 3, *TRACKED)]
    workers = [subprocess.Popen(command, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True) for _ in range(2)]
    try:
        outputs = [w.communicate(timeout=600) for w in workers]
    finally:
        for worker in workers:  # after a timeout, none is left running
            worker.kill()
    return project, [subprocess.CompletedProcess(command, w.returncode, *out) for w, out in zip(workers, outputs)]


@pytest.mark.slow
def test_a_sweep_runs_its_trials_and_writes_the_best_as_a_recipe_that_trains(sweep, tmp_path, capsys):
    project, workers = sweep
    assert all(w.returncode == 0 for w in workers), [w.stderr[-2000:] for w in workers]
    folder, printed = project / "cls-space", "".join(w.stdout for w in workers)
    trials = read_trials(folder)
    assert 3 <= len(trials) <= 4 and all(t["state"] == "COMPLETE" for t in trials)  # each worker checks, then asks
    for t in trials:  # each trial is a run of its own, with the trial's keys, and the value its best val top-1
        recipe = yaml.safe_load((folder / f"trial-{t['trial']}" / "recipe.yaml").read_text())
        assert recipe["optim"]["lr"] == pytest.approx(float(t["optim.lr"])) and recipe["train"]["epochs"] == 1
        assert 0.02 <= float(t["optim.lr"]) <= 0.2 and t["train.label_smoothing"] in ("0.0", "0.1")
        with open(folder / f"trial-{t['trial']}" / "results.csv", newline="") as f:
            assert float(t["value"]) == pytest.approx(max(float(r["val/top1"]) for r in csv.DictReader(f)))
        assert list((folder / f"trial-{t['trial']}").glob("events.out.tfevents.*"))
    best = max(trials, key=lambda t: float(t["value"]))
    recipe = yaml.safe_load((folder / "best.yaml").read_text())
    assert recipe == {"base": "cls.yaml", "train": {"epochs": 1, "label_smoothing": float(best["train.label_smoothing"])},
                      "model": {"width": 8}, "optim": {"lr": pytest.approx(float(best["optim.lr"]))},
                      "log": {"plots": False, **({"to": ["tensorboard", "mlflow"]} if TRACKED else {})}}
    assert (folder / "history.png").stat().st_size > 0 and f"trial {best['trial']:>3s}" in printed
    for t in trials:  # each trial's epochs are shown as they end, as train.py shows its figures
        assert f"  epoch 1/1: val top1 {float(t['value']):.2%} (trial best {float(t['value']):.2%}" in printed
    train.main(["--recipe", str(folder / "best.yaml"), f"project={tmp_path}", "name=best"])
    saved = yaml.safe_load((tmp_path / "best" / "recipe.yaml").read_text())
    assert saved["optim"]["lr"] == pytest.approx(float(best["optim.lr"])) and saved["model"]["width"] == 8
    capsys.readouterr()
    tune.main(["--report", str(folder)])  # the report alone, from the folder
    assert f"{len(trials)} trials ({len(trials)} complete)" in capsys.readouterr().out


@pytest.mark.slow
def test_two_workers_on_one_study_run_distinct_trials(sweep):
    project, workers = sweep
    assert all(w.returncode == 0 for w in workers), [w.stderr[-2000:] for w in workers]
    trials = read_trials(project / "cls-space")
    ran = [[line.split()[2].rstrip(":") for line in w.stdout.splitlines() if line.startswith("tune: trial")]
           for w in workers]
    assert all(ran) and not set(ran[0]) & set(ran[1])  # both worked, never on the same trial
    assert sorted(ran[0] + ran[1], key=int) == [t["trial"] for t in trials]


@pytest.mark.slow
def test_a_sweep_is_one_mlflow_parent_run_with_a_child_run_per_trial(sweep):
    """tune.py with log.to naming mlflow: the sweep's parent run, one for both workers that started it together, and
    each trial's train.py recording into its own child run, with the trial's sampled keys as parameters and its state
    as a tag."""
    mlflow, optuna = pytest.importorskip("mlflow"), pytest.importorskip("optuna")
    project, workers = sweep
    assert all(w.returncode == 0 for w in workers), [w.stdout[-2000:] + w.stderr[-2000:] for w in workers]
    client = mlflow.MlflowClient(f"sqlite:///{project.parent / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tune").experiment_id])
    study = optuna.load_study(study_name="cls-space", storage=f"sqlite:///{project / 'cls-space' / 'study.db'}")
    (parent,) = [r for r in runs if r.info.run_name == "cls-space"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert len(runs) == len(study.trials) + 1
    assert sorted(children) == [f"trial-{t.number}" for t in study.trials]
    assert parent.data.params["space.optim.lr"] == "{high: 0.2, log: true, low: 0.02}"
    assert "optim.lr" not in parent.data.params and parent.data.params["train.epochs"] == "1"
    assert parent.data.params["model.width"] == "8"
    for trial in study.trials:
        child = children[f"trial-{trial.number}"]
        assert child.data.tags["trial_state"] == trial.state.name == "COMPLETE"
        assert child.info.status == "FINISHED"
        assert {k: child.data.params[k] for k in trial.params} == {k: str(v) for k, v in trial.params.items()}
        assert child.data.metrics["val/top1"] == pytest.approx(trial.value, abs=5e-7)  # results.csv's 6 digits
    scores = {m.step: m.value for m in client.get_metric_history(parent.info.run_id, "value")}
    assert scores == pytest.approx({t.number: t.value for t in study.trials})  # each trial's score, by its number
    parent = client.get_run(parent.info.run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["best_trial"] == str(study.best_trial.number)
    assert parent.data.metrics["best_value"] == pytest.approx(study.best_value)
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"trials.csv", "best.yaml", "history.png",
                                                                            "importances.png"}


def test_only_a_worker_that_started_with_the_studys_creator_waits_for_its_mlflow_run(tmp_path, monkeypatch, capsys):
    """parent_run: the creator makes the parent run, a joining worker takes the study's, a sweep going on (trials
    recorded) or a creator without MLflow ("") is not waited for, and a creator silent for `wait` seconds is named."""
    study, created = tune.open_study(f"sqlite:///{tmp_path / 'study.db'}", "s", create=True)
    assert created and tune.parent_run(study, created=True) is None

    def no_wait(seconds):
        raise AssertionError("waited")
    with monkeypatch.context() as patch:
        patch.setattr(tune.time, "sleep", no_wait)
        study.set_user_attr("mlflow_parent", "")
        assert tune.parent_run(study, created=False) is None  # the creator has no MLflow run: make one
        study.set_user_attr("mlflow_parent", "abc")
        assert tune.parent_run(study, created=False) == "abc"
        later, _ = tune.open_study(f"sqlite:///{tmp_path / 'later.db'}", "s", create=True)
        later.tell(later.ask(), 0.5)  # a sweep going on whose parent run was never recorded
        assert tune.parent_run(later, created=False) is None
    fresh, _ = tune.open_study(f"sqlite:///{tmp_path / 'fresh.db'}", "s", create=True)
    assert tune.parent_run(fresh, created=False, wait=0.2) is None
    assert capsys.readouterr().out.endswith("the worker that created study s has not created its MLflow run in 0 s; "
                                            "this worker creates it\n")


@pytest.mark.skipif(not TRACKED, reason="needs mlflow (requirements-track.txt)")
def test_a_worker_whose_mlflow_fails_keeps_the_sweeps_parent_run_and_one_without_it_makes_its_own(tmp_path,
                                                                                                monkeypatch):
    """A worker that cannot reach MLflow leaves the study's parent run id as it was; a worker whose MLflow (a store
    of its machine's own) does not hold that run records under a parent run of its own, and does not replace it."""
    study, _ = tune.open_study(f"sqlite:///{tmp_path / 'study.db'}", "s", create=True)
    study.set_user_attr("mlflow_parent", "0" * 32)
    settings = {"resolved": {"log": {"to": ["tensorboard", "mlflow"]}}, "space": {}}
    sweep = tmp_path / "tune" / "cls-space"
    with monkeypatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
        assert tune.sweep_record(study, sweep, settings, created=False) is None
    assert study.user_attrs["mlflow_parent"] == "0" * 32
    record = tune.sweep_record(study, sweep, settings, created=False)  # the store beside the project: not there
    assert record.parent_id != "0" * 32 and record.client.get_run(record.parent_id).info.run_name == "cls-space"
    assert study.user_attrs["mlflow_parent"] == "0" * 32


@pytest.mark.parametrize("space_text, expected", [
    ("optim.learning_rate: {low: 0.01, high: 0.1}", "optim.learning_rate: not a recipe key"),
    ("optim.name: {low: 1, high: 2}", "optim.name: a range needs a key that takes a number"),
    ("model.depth: {low: 1.5, high: 3}", "model.depth: takes a whole number, so its range must be whole numbers"),
    ("optim.lr: {low: -0.1, high: 0.1}", "optim.lr: -0.1 is refused:"),
    ("optim.name: {choices: [sgd, lamb]}", "optim.name: 'lamb' is refused:"),
    ("optim.lr: {low: 0.1, high: 0.01}", "optim.lr: needs low < high"),
    ("optim.lr: [0.1, 0.2]", "optim.lr: give {low: L, high: H}"),
    ("model.width: {low: 4, high: 8}", "model.width: searched, and also set on the command line"),
    ("optim.lr: {low: 0.01, high: 0.3, log: true, step: 0.01}", "optim.lr: The parameter step is not supported when "
                                                                "log is true. (Optuna)"),
    ("optim.lr: {low: 0.01, high: 0.3, step: -1}", "optim.lr: step > 0 must hold, but got step=-1. (Optuna)"),
    ("optim.lr: {low: 0.01, high: 0.3, step: 0.0}", "optim.lr: step > 0 must hold, but got step=0.0. (Optuna)"),
    ("model.depth: {low: 1, high: 4, step: 0}", "model.depth: step > 0 must hold, but got step=0. (Optuna)"),
    ("optim.lr: {low: 0.01, high: 0.3, step: 0.5}", "optim.lr: The distribution is specified by [0.01, 0.3] and "
                                                    "step=0.5, but the range is not divisible by step. It will be "
                                                    "replaced with [0.01, 0.01]. (Optuna)"),
    ("optim.lr: {low: 0.01, high: 0.3, log: yes-please}", "optim.lr: log must be true or false"),
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


def test_the_shipped_space_reads_as_three_searched_keys_of_cls_yaml():
    space = tune.read_space(ROOT / "spaces" / "cls.yaml", "cls.yaml", [])
    assert list(space) == ["optim.lr", "optim.weight_decay", "train.label_smoothing"]
    assert space["optim.lr"].log and not space["train.label_smoothing"].log


def start_sweep_and_wait_for_a_checkpoint(command, sweep):
    """tune.py launched with command, once its first trial's run has saved mid-epoch."""
    sweeper = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((sweep / "trial-0" / "weights").glob("*.pt")):
        assert sweeper.poll() is None and time.monotonic() < deadline, sweeper.stderr.read()[-3000:]
        time.sleep(0.2)
    return sweeper


@pytest.mark.slow
def test_a_sweep_stopped_mid_trial_goes_on_with_the_same_command_resuming_the_trial(space, tmp_path):
    command = sweep_command(space, tmp_path, 2, "train.save_every_steps=5")
    command[command.index("train.epochs=1")] = "train.epochs=3"  # left alone, a trial runs on for seconds
    sweep = tmp_path / "cls-space"
    sweeper = start_sweep_and_wait_for_a_checkpoint(command, sweep)
    sweeper.send_signal(signal.SIGTERM)
    assert sweeper.wait(timeout=60) == 128 + signal.SIGTERM  # as train.py ends on it
    assert "tune.py: stopped; the same command goes on with the sweep" in sweeper.stderr.read()
    saved = (sweep / "logs" / "trial-0.txt").read_text()
    assert "SIGTERM: stopping after the current step" in saved and not running(f"project={sweep}")
    result = run_python(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(trial 0 again, resumed from its last.pt)" in result.stdout
    trials = read_trials(sweep)
    assert [t["state"] for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert trials[1]["retry_of"] == "0" and trials[1]["optim.lr"] == trials[0]["optim.lr"]  # trial 0 ran again
    assert "resuming at epoch" in (sweep / "logs" / "trial-1.txt").read_text()  # in trial 0's run, from its last.pt
    assert not (sweep / "trial-1").exists() and len(tune.epoch_scores(sweep / "trial-0" / "results.csv", "top1")) == 3
    assert trials[2]["optim.lr"] != trials[0]["optim.lr"]  # a new trial draws new keys (its own seed)
    assert float(trials[0]["seconds"]) < float(trials[1]["seconds"]) + 60  # the time it ran, not until the retry
    assert "3 trials (2 complete, 1 fail)" in result.stdout


@pytest.mark.slow
def test_a_dead_workers_trial_is_failed_by_its_heartbeat_and_run_again_by_another_worker(space, tmp_path):
    """Worker A (its machine's folder runs/a) is killed mid-trial; worker B on the same study (another machine's
    folder) finds the trial's heartbeat stale, and runs it again: from the start, as its run is not on B's disk."""
    storage = f"sqlite:///{tmp_path / 'shared.db'}"
    command = sweep_command(space, tmp_path / "a", 1, "train.save_every_steps=5", "--storage", storage, "--study",
                            "s", "--heartbeat", "1")
    command[command.index("train.epochs=1")] = "train.epochs=3"
    started = time.time()
    worker = start_sweep_and_wait_for_a_checkpoint(command, tmp_path / "a" / "cls-space")
    worker.send_signal(signal.SIGKILL)  # at once, most of the trial to go (its heartbeats began with it)
    worker.wait()
    killed = time.time()
    time.sleep(4)  # its heartbeat is more than 3 heartbeats old
    # Once --trials have ended no worker starts a trial that would find it dead: a worker's report does
    study, _ = tune.open_study(storage, "s", heartbeat=1)
    with pytest.raises(tune.UsageError, match="no trial has finished yet"):
        tune.report(study, tmp_path / "a" / "cls-space", tune.read_settings(tmp_path / "a" / "cls-space"))
    assert [t["state"] for t in read_trials(tmp_path / "a" / "cls-space")] == ["FAIL", "WAITING"]
    command[command.index(str(tmp_path / "a"))] = str(tmp_path / "b")
    result = run_python(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = read_trials(tmp_path / "b" / "cls-space")
    assert [t["state"] for t in trials] == ["FAIL", "COMPLETE"], trials
    assert trials[1]["retry_of"] == "0" and trials[1]["optim.lr"] == trials[0]["optim.lr"]
    assert "tune: trial 1: " in result.stdout and "(trial 0 again)" in result.stdout
    assert (tmp_path / "b" / "cls-space" / "trial-0" / "results.csv").exists()  # its first try's name, on B
    assert 0 < float(trials[0]["seconds"]) < killed - started  # the time it ran, not until B found it dead


@pytest.mark.slow
def test_a_trial_whose_run_ended_as_the_sweep_was_stopped_is_retried_by_reading_its_score(space, tmp_path,
                                                                                          monkeypatch, capsys):
    """A Ctrl-C that reaches tune.py as the trial's train.py ends (or tune.py killed then) cuts the trial off, and
    its retry finds a run with nothing left to train: it takes the run's score, and trains nothing."""
    watch = tune.watch

    def stopped_as_the_run_ends(process, *args):
        watch(process, *args)
        raise tune.Stopped(signal.SIGINT)

    command, sweep = sweep_command(space, tmp_path, 1)[1:], tmp_path / "cls-space"
    monkeypatch.setattr(tune, "check_recipe", lambda settings, sweep: None)  # a train.py launch each: tested above
    monkeypatch.setattr(tune, "watch", stopped_as_the_run_ends)
    with pytest.raises(SystemExit) as stopped:
        tune.main(command)
    assert stopped.value.code == 128 + signal.SIGINT and (sweep / "trial-0" / "weights" / "last.pt").exists()
    monkeypatch.setattr(tune, "watch", watch)
    tune.main(command)
    out, score = capsys.readouterr().out, max(tune.epoch_scores(sweep / "trial-0" / "results.csv", "top1"))
    assert "(trial 0 again): its run had ended before the stop: it has already trained all 1 epoch" in out
    trials = read_trials(sweep)
    assert [(t["state"], t["retry_of"]) for t in trials] == [("FAIL", ""), ("COMPLETE", "0")]
    assert float(trials[1]["value"]) == score and not (sweep / "logs" / "trial-1.txt").exists()  # nothing trained


def running(word):
    """Whether a process of this machine has word in its command line."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if word.encode() in cmdline.read_bytes():
                return True
        except OSError:
            pass
    return False


@pytest.mark.slow
def test_a_fixed_override_that_train_py_refuses_is_refused_once_before_any_trial(space, tmp_path):
    result = run_python(*sweep_command(space, tmp_path, 2, "data.name=no_such_folder"))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-3000:]
    assert result.stderr.startswith("tune.py: error: train.py refuses the sweep's recipe and overrides, so every "
                                    "trial would fail: train.py: error: data.name 'no_such_folder' is neither a "
                                    "dataset here"), result.stderr
    assert "trial 0" not in result.stdout and not list((tmp_path / "cls-space-no_such_folder").glob("trial-*"))


@pytest.mark.slow
def test_failed_trials_are_recorded_with_their_line_and_the_sweep_goes_on(tmp_path):
    space = tmp_path / "ema.yaml"
    space.write_text("train.ema_decay: {choices: [0.99]}\n")  # the EMA on, its steps more than a trial has: each fails
    result = run_python(*sweep_command(space, tmp_path, 2, "train.ema_steps=100000"))
    assert result.returncode == 2
    trials = read_trials(tmp_path / "cls-ema")
    assert [t["state"] for t in trials] == ["FAIL", "FAIL"]  # the second ran after the first failed
    assert all(t["error"].startswith("train.py: error: train.ema_steps=100000 is more than the run's 30 steps")
               for t in trials)
    assert result.stderr.strip().endswith("no trial has finished yet (their output: "
                                          f"{tmp_path / 'cls-ema' / 'logs'})")
    assert len(result.stderr.strip().splitlines()) == 1  # each failure said in its line, not Optuna's traceback


@pytest.mark.slow
def test_a_pruned_trial_is_a_run_stopped_early_with_its_checkpoint(tmp_path):
    """watch reports each epoch's best score so far at every percent of the schedule it covers and, when the pruner
    says so, stops train.py, which saves and stops."""
    import optuna

    class Trial:  # the pruner's side, as Optuna's trial offers it: prune once two epochs of 20 are reported
        reports, study, datetime_start = [], optuna.create_study(), datetime.now()

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return len(self.reports) >= 10

        def set_user_attr(self, key, value):
            pass

    command = [sys.executable, "train.py", "--recipe", "cls.yaml", "train.epochs=20", f"project={tmp_path}", "name=t"]
    process = subprocess.Popen(command, cwd=ROOT, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert tune.watch(process, Trial(), tmp_path / "t" / "results.csv", "top1", 20)[0] == 2
    assert process.returncode == 128 + signal.SIGTERM, process.stderr.read()[-2000:]
    scores = tune.epoch_scores(tmp_path / "t" / "results.csv", "top1")
    assert Trial.reports == [(step, scores[0]) for step in range(1, 6)] + [(step, max(scores[:2])) for step in
                                                                           range(6, 11)]
    assert (tmp_path / "t" / "weights" / "last.pt").exists() and len(scores) < 20


def test_a_pruned_trials_log_ends_with_the_line_that_says_where_and_why(tmp_path, monkeypatch):
    """run_trial around a run the pruner stopped after its first epoch of 4 (its train.py stood in for)."""
    import optuna

    sweep = tmp_path / "sweep"
    (sweep / "logs").mkdir(parents=True)
    settings = {"recipe": "cls.yaml", "overrides": ["train.epochs=4"], "nproc": 1, "metric": "top1"}
    monkeypatch.setattr(tune, "train_command", lambda settings, arguments: [
        sys.executable, "-c", f"import os; os.makedirs({str(sweep / 'trial-0')!r}); open({str(sweep / 'trial-0')!r} + "
                              f"'/results.csv', 'w').write('epoch,val/top1\\n1,0.5\\n')"])

    def pruned_after_its_first_epoch(process, *_):  # below a median of 75%
        process.wait()
        return 1, 0.75

    monkeypatch.setattr(tune, "watch", pruned_after_its_first_epoch)
    study, _ = tune.open_study(f"sqlite:///{tmp_path / 'study.db'}", "s", create=True)
    space = tune.read_space(ROOT / "spaces" / "cls.yaml", "cls.yaml", [])
    with pytest.raises(optuna.TrialPruned):
        tune.run_trial(study.ask(), space, sweep, settings, 0, 10)
    assert (sweep / "logs" / "trial-0.txt").read_text().splitlines()[-1] == (
        "tune.py: trial 0 pruned after epoch 1/4: val top1 50.00% at 25% of its schedule, below the finished "
        "trials' median there (75.00%)")


def test_trials_of_different_schedules_are_compared_at_the_same_fraction_of_them():
    assert [tune.percent_done(e, 4) for e in range(5)] == [0, 25, 50, 75, 100]
    assert [tune.percent_done(e, 10) for e in (1, 3, 10)] == [10, 30, 100]
    assert tune.percent_done(1, 3) == 33 and tune.percent_done(2, 3) == 66


@pytest.mark.slow
def test_nproc_runs_each_trial_under_torchrun_and_the_best_is_scored_on_a_test_split_that_chose_nothing(tmp_path):
    """--nproc 2: each trial is a torchrun launch; and with a test split beside val, the best trial's best.pt is
    scored there; the sweep is named after its data."""
    data = make_image_folder(tmp_path / "shapes", {split: {"a": n, "b": n} for split, n in
                                                   (("train", 12), ("val", 4), ("test", 5))})
    space = tmp_path / "lr.yaml"
    space.write_text("optim.lr: {low: 0.02, high: 0.2, log: true}\n")
    result = run_python(*sweep_command(space, tmp_path, 1, f"data.name={data}", "data.img_size=12", "--nproc", "2"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert [t["state"] for t in read_trials(tmp_path / "cls-lr-shapes")] == ["COMPLETE"]
    assert "train: 2 process(es) on cpu" in (tmp_path / "cls-lr-shapes" / "logs" / "trial-0.txt").read_text()
    held_out = [line for line in result.stdout.splitlines() if line.startswith("held out: ")]
    assert held_out == [f"held out: trial 0's best.pt scores top1 {held_out[0].split()[7]} on {data / 'test'}, which "
                        "chose nothing"]
    assert round(float(held_out[0].split()[7].rstrip("%")) * 10) % 100 == 0  # right of 10 test images, in tenths
    assert (tmp_path / "cls-lr-shapes" / "best.yaml").exists()


@pytest.mark.slow
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
    assert tune.failure_line(log.read_text()) == "RuntimeError: boom"
    assert tune.failure_line("") == "no output"


def test_scores_stop_at_a_row_the_run_is_still_writing(tmp_path):
    results = tmp_path / "results.csv"
    results.write_text("epoch,val/loss,val/top1,val/ema_top1\n1,0.5,0.8,0.85\n2,0.4,0.9,\n3,0.3,0.9")  # row 3: cut
    assert tune.epoch_scores(results, "top1") == [0.85, 0.9]
    results.write_text("epoch,val/loss,val/top1\n1,0.5,0.8\n2,0.4,\n3,0.3,0.9\n")  # a row without its metric
    assert tune.epoch_scores(results, "top1") == [0.8]


def drawn_keys(path, seed, trials=14):
    """The keys a sweep of spaces/cls.yaml with this seed draws for its trials, scored by a fixed function."""
    space = tune.read_space(ROOT / "spaces" / "cls.yaml", "cls.yaml", [])
    (study, _), drawn = tune.open_study(f"sqlite:///{path}", "s", create=True, prune=False), []
    study.optimize(lambda trial: drawn.append(tune.draw(trial, space, seed)) or -abs(drawn[-1]["optim.lr"] - 0.1),
                   n_trials=trials)
    return [tuple(keys.values()) for keys in drawn]


@pytest.mark.slow
def test_the_same_seed_draws_the_same_keys_and_two_seeds_never_the_same(tmp_path):
    """Across TPE's random start-up trials and its model's: seed 1's trials are none of seed 0's (with seed + trial
    number, seed 1's trial 0 was seed 0's trial 1)."""
    zero, again, one = (drawn_keys(tmp_path / f"{k}.db", seed) for k, seed in enumerate((0, 0, 1)))
    assert zero == again and len(set(zero)) == len(zero)
    assert not set(zero) & set(one)


def test_a_sweep_goes_on_after_changes_that_keep_its_meaning_and_not_after_others(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)

    def claim(recipe, *overrides):
        return tune.claim_sweep(tune.parse_args(["--recipe", recipe, "--space", str(space), "--project",
                                                 str(tmp_path), *overrides]))

    sweep, first = claim("cls.yaml", "train.epochs=1")
    space.write_text("# a comment\n" + SPACE.replace("low: 0.02, high: 0.2", "high: 0.2, low: 0.02"))
    assert claim("recipes/cls.yaml", "train.epochs=1") == (sweep, first)  # the same recipe, the same space
    assert claim(str(ROOT / "recipes" / "cls.yaml"), "train.epochs=1", "--name", "cls-space")[0] == sweep
    with pytest.raises(tune.UsageError) as e:
        claim("cls.yaml", "train.epochs=2", "--nproc", "2")
    assert str(e.value) == (f"{sweep} holds a sweep of another command (the recipe's train.epochs: 1 then, 2 now; "
                            f"--nproc: 1 then, 2 now): give another --name, or the command that started it")
    # Keys that change no trial's results (what is logged, the workers) may change; later trials take them
    assert claim("cls.yaml", "train.epochs=1", "log.to=[tensorboard,mlflow]", "data.workers=1") == (sweep, {
        **first, "overrides": ["train.epochs=1", "log.to=[tensorboard,mlflow]", "data.workers=1"],
        "resolved": {**first["resolved"], "log": {**first["resolved"]["log"], "to": ["tensorboard", "mlflow"]},
                     "data": {**first["resolved"]["data"], "workers": "1"}}})
    assert "its new trials take data.workers=1, log.to=[tensorboard,mlflow], which change no" in \
        capsys.readouterr().out
    space.write_text(SPACE.replace("0.2,", "0.3,"))
    with pytest.raises(tune.UsageError, match="\\(the --space file's ranges differ\\)"):
        claim("cls.yaml", "train.epochs=1")


@pytest.mark.slow
def test_workers_starting_together_both_open_the_new_study(tmp_path):
    """Two workers creating one SQLite study at once race to create its tables; the later one tries again. Exactly
    one of them created the study (and so creates the sweep's MLflow run)."""
    for k in range(8):
        url, studies = f"sqlite:///{tmp_path / f'study{k}.db'}", []
        workers = [threading.Thread(target=lambda: studies.append(tune.open_study(url, "s", create=True)))
                   for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert len(studies) == 2 and studies[0][0]._study_id == studies[1][0]._study_id
        assert sorted(created for _, created in studies) == [False, True]
