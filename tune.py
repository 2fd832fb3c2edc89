"""Search a recipe's keys with Optuna: each trial a real run of train.py, the best trial forked as a recipe.

Usage:
    python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 20
    python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 20 --nproc 2      # each trial under torchrun
    python tune.py --recipe cls.yaml --space spaces/cls.yaml --storage postgresql://host/db --study cls   # each machine
    python tune.py --report runs/tune/cls-cls                                            # the table, best.yaml, plots
    python train.py --recipe runs/tune/cls-cls/best.yaml

The space file maps recipe keys to a range ({low: 0.01, high: 0.3, log: true}; whole numbers for a key that takes them)
or to choices ({choices: [sgd, adamw]}); every value is checked as train.py checks an override, and the recipe with
the sweep's fixed overrides by train.py --check, before any trial runs. The sweep lives in runs/tune/NAME (--name;
the recipe's and the space's names, and the data set's where data.name is set, by default): study.db (the Optuna
study, SQLite, unless --storage), trial-K/ (trial K's run: TensorBoard logs with its keys on the HParams page,
results.csv, weights), logs/trial-K.txt (its output), trials.csv, best.yaml, history.png and importances.png.

Optuna runs the study (Study.optimize): TPE samples each trial's keys (seeded by --seed and the trial's number), the
median pruner stops a trial whose score trails the finished trials' at the same fraction of their schedules, workers
show they live by Optuna's heartbeat, and a trial whose worker died or was stopped is run again (resumed from its
last.pt where its run is here). The same command run again goes on with the sweep.
"""

import argparse
import csv
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager, suppress
from pathlib import Path

from utils.general import UsageError, after_imports, before_imports, colorstr, script, short_path

if __name__ == "__main__":  # no collection during the imports below (utils/general.before_imports)
    before_imports()

import numpy as np
import yaml
from omegaconf import OmegaConf

try:
    import optuna
    import optuna.distributions as od
    from optuna.storages import RetryHeartbeatStaleTrialCallback
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState
except ImportError:
    sys.exit("tune.py: error: needs Optuna, an optional extra: pip install -r requirements-tune.txt")

from models import check_model_name
from utils.checkpoint import load_training_checkpoint
from utils.config import (CHANGES_RESULTS_WHEN, RECIPES_DIR, SECTIONS, RecipeError, as_override, best_metric,
                          checkpoint_recipe, differing_keys, find_recipe, load_recipe, load_yaml, never, schema_leaves)
from utils.once import atomic_write
from utils.run import run_done
from utils.trackers import MLflowSweep, first_line, flat_params, sweep_environment

ROOT = Path(__file__).resolve().parent
HOST = socket.gethostname()
SWEEP_FILES = ("trials.csv", "best.yaml", "history.png", "importances.png")  # what report() writes
RANGE_KEYS, CHOICE_KEYS = {"low", "high", "log", "step"}, {"choices"}
VERDICTS = (TrialState.COMPLETE, TrialState.PRUNED)  # the trials --trials counts: those that gave a verdict
with warnings.catch_warnings():  # experimental in Optuna since 2.8
    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
    RETRY = RetryHeartbeatStaleTrialCallback(max_retry=3)  # a trial cut off (its worker died, or stopped) runs again
PARENT_WAIT = 60  # seconds a worker waits for the worker that created the study to create its MLflow run
PRUNE_FROM = 50  # percent of its schedule a trial runs before the pruner may stop it: at a third, the best trials
# of benchmarks/sweep.py still trailed the median (their learning rate near its peak)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="the recipe to search (a name in recipes/ or a path)")
    parser.add_argument("--space", help="YAML file: recipe keys to search, each with a range or choices")
    parser.add_argument("--trials", type=int, default=20,
                        help="the sweep ends when this many trials finished or were pruned (or failed), all workers "
                             "together")
    parser.add_argument("--nproc", type=int, default=1, help="processes per trial: >1 launches each under torchrun")
    parser.add_argument("--storage", help="an Optuna storage URL shared by several machines (default: SQLite here)")
    parser.add_argument("--study", help="the study's name in --storage (default: the sweep's name)")
    parser.add_argument("--project", default="runs/tune", help="sweeps go to PROJECT/NAME")
    parser.add_argument("--name", help="the sweep's name (default: RECIPE-SPACE, and -DATA where data.name is set)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed (>= 0)")
    parser.add_argument("--no-prune", action="store_true", help="run every trial to its end (no median pruning)")
    parser.add_argument("--heartbeat", type=int, default=10, metavar="SECONDS",
                        help="how often a worker records that its trial lives; a trial silent for 3 times as long is "
                             "failed and run again by any worker")
    parser.add_argument("--report", metavar="SWEEP", help="only report a sweep's folder: table, best.yaml, plots")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides for every trial")
    args = parser.parse_args(argv)
    if args.report is None and not (args.recipe and args.space):
        parser.error("--recipe and --space are needed (or --report SWEEP)")
    if args.trials < 1 or args.nproc < 1 or args.heartbeat < 1 or args.seed < 0:
        parser.error("--trials, --nproc and --heartbeat must be >= 1, --seed >= 0")
    return args


class Stopped(KeyboardInterrupt):
    """A stop signal to tune.py: the trial running is passed the signal too (train.py saves and stops)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


CHILD = {}  # the trial's process while one runs, for stop() to pass a signal on


def stop(signum, frame):
    child = CHILD.get("process")
    if child is not None and child.poll() is None:
        child.send_signal(signum)
    raise Stopped(signum)


def main(argv=None):
    """Run or report a sweep; bad input exits with code 2 and one line, a stop signal with 128 + its number."""
    args = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # tune.py says what became of each trial, in a line
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    previous = signal.signal(signal.SIGTERM, stop)
    record = None
    try:
        if args.report:
            sweep, settings = Path(args.report), read_settings(Path(args.report))
            study, _ = open_study(storage_of(sweep, args.storage, settings), args.study or settings["study"],
                                  heartbeat=args.heartbeat)
        else:
            space = read_space(args.space, args.recipe, args.overrides)
            sweep, settings = claim_sweep(args)
            check_recipe(settings, sweep)
            study, created = open_study(storage_of(sweep, args.storage, settings), settings["study"], create=True,
                                        prune=not args.no_prune, heartbeat=args.heartbeat)
            record = sweep_record(study, sweep, settings, created)
            run_sweep(study, space, sweep, settings, args.trials, args.seed, args.heartbeat, record)
        report(study, sweep, settings, fail_stale=not args.report)  # --report's --heartbeat may not be the sweep's
        if record:  # the sweep's files on its MLflow run
            record.end(study.best_trial, [sweep / n for n in SWEEP_FILES if (sweep / n).exists()])
    except UsageError as e:
        print(f"tune.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        print("tune.py: stopped; the same command goes on with the sweep", file=sys.stderr)
        sys.exit(128 + getattr(e, "signum", signal.SIGINT))
    except optuna.exceptions.StorageInternalError as e:
        print(f"tune.py: error: the study's database failed: {str(e).splitlines()[0]}; the same command goes on "
              f"with the sweep", file=sys.stderr)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, previous)


def read_space(path, recipe, overrides):
    """{key: Optuna distribution} of a space file, each bound or choice checked as an override of the recipe."""
    try:
        space = load_yaml(path)
    except OSError as e:
        raise UsageError(f"--space {path}: cannot be read: {e}") from None
    if not isinstance(space, dict) or not space:
        raise UsageError(f"--space {path}: must map recipe keys to a range or choices, e.g. 'optim.lr: {{low: 0.01, "
                         f"high: 0.3, log: true}}'")
    load_recipe(recipe, overrides, check_model_name)  # the recipe itself, before its keys
    leaves, distributions = schema_leaves(), {}
    fixed = {item.partition("=")[0] for item in overrides}
    for key, spec in space.items():
        where = f"--space {path}: {key}"
        if key not in leaves:
            dotted = "; name a section's keys dotted, as optim.lr" if key in SECTIONS else ""
            raise UsageError(f"{where}: not a recipe key (python -m utils.config lists them){dotted}")
        if key in fixed:
            raise UsageError(f"{where}: searched, and also set on the command line ({key}=...): drop one")
        kind = leaves[key][0]
        if isinstance(spec, dict) and set(spec) <= CHOICE_KEYS | RANGE_KEYS and "choices" in spec:
            choices = spec["choices"]
            if set(spec) != CHOICE_KEYS or not isinstance(choices, list) or not choices or \
                    not all(isinstance(c, (str, int, float, bool)) for c in choices):
                raise UsageError(f"{where}: choices must be a non-empty list of numbers, words or true/false, and "
                                 f"alone, got {spec!r}")
            distribution = od.CategoricalDistribution(spec["choices"])
            values = spec["choices"]
        elif isinstance(spec, dict) and {"low", "high"} <= set(spec) <= RANGE_KEYS:
            distribution, values = numeric_range(where, kind, spec), [spec["low"], spec["high"]]
        else:
            raise UsageError(f"{where}: give {{low: L, high: H}} (log: true, step: S optional) or {{choices: [...]}}, "
                             f"got {spec!r}")
        for value in values:  # as train.py checks an override
            try:
                load_recipe(recipe, [*overrides, f"{key}={as_override(value)}"], check_model_name)
            except RecipeError as e:
                raise UsageError(f"{where}: {value!r} is refused: {e}") from None
        distributions[key] = distribution
    return distributions


def numeric_range(where, kind, spec):
    """The Optuna distribution of a {low, high, log, step} range of a key of type kind, as Optuna checks it (and
    its warning that it would shrink a range that is not a whole number of steps, as an error)."""
    numbers = [spec[k] for k in ("low", "high", "step") if k in spec]
    if kind not in (int, float) or not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
        raise UsageError(f"{where}: a range needs a key that takes a number and numbers for its bounds; "
                         f"this key takes {getattr(kind, '__name__', kind)}, given {spec!r} (use choices)")
    if kind is int and not all(isinstance(n, int) for n in numbers):
        raise UsageError(f"{where}: takes a whole number, so its range must be whole numbers, given {spec!r}")
    if not isinstance(spec.get("log", False), bool):
        raise UsageError(f"{where}: log must be true or false, given {spec!r}")
    if not spec["low"] < spec["high"] or (spec.get("log") and spec["low"] <= 0):
        raise UsageError(f"{where}: needs low < high (and low > 0 with log: true), given {spec!r}")
    options = {"log": spec.get("log", False), **({"step": spec["step"]} if "step" in spec else {})}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            if kind is int:
                return od.IntDistribution(spec["low"], spec["high"], **options)
            return od.FloatDistribution(float(spec["low"]), float(spec["high"]), **options)
    except (ValueError, UserWarning) as e:
        raise UsageError(f"{where}: {str(e).replace('`', '')} (Optuna), given {spec!r}") from None


def claim_sweep(args):
    """The sweep's folder and settings: made for a new sweep, checked against this command for one going on. A
    command goes on with a sweep when its recipe and space mean the same (resolved values, not their text)."""
    cfg = load_recipe(args.recipe, args.overrides)
    data = [Path(cfg.data.name.rstrip("/")).stem] if any(o.startswith("data.name=") for o in args.overrides) else []
    name = args.name or "-".join([Path(args.recipe).stem, Path(args.space).stem, *data])
    sweep = Path(args.project) / name
    settings = {"recipe": args.recipe, "overrides": list(args.overrides), "space": yaml.safe_load(
        Path(args.space).read_text()), "nproc": args.nproc, "shared": bool(args.storage),
        "study": args.study or name, "metric": best_metric(cfg), "resolved": OmegaConf.to_container(cfg)}
    if (sweep / "sweep.yaml").exists():
        before = read_settings(sweep)
        if isinstance(before.get("space"), str):  # written by an earlier tune.py, as the file's text
            before["space"] = yaml.safe_load(before["space"])
        before.setdefault("resolved", OmegaConf.to_container(load_recipe(before["recipe"], before["overrides"])))
        changed = [what_changed(key, before[key], settings[key]) for key in SETTINGS if differs(key, before, settings)]
        if changed:
            raise UsageError(f"{sweep} holds a sweep of another command ({'; '.join(changed)}): give another --name, "
                             f"or the command that started it")
        if before["resolved"] == settings["resolved"]:
            return sweep, before
        keys = ", ".join(f"{key}={as_override(now)}" for key, _, now in differing_keys(before["resolved"],
                                                                                       settings["resolved"]))
        print(f"{colorstr('tune:')} going on with the sweep in {short_path(sweep)}; its new trials take {keys}, which "
              f"change no trial's results")
        return sweep, {**before, **{key: settings[key] for key in ("recipe", "overrides", "resolved")}}
    (sweep / "logs").mkdir(parents=True, exist_ok=True)
    with atomic_write(sweep / "sweep.yaml") as tmp:
        Path(tmp).write_text(yaml.safe_dump(settings, sort_keys=False))
    return sweep, settings


SETTINGS = {"resolved": "the recipe", "space": "the --space file's ranges", "nproc": "--nproc",
            "shared": "--storage (given or not)", "study": "--study"}  # what a sweep's folder holds it to


def differs(setting, before, settings):
    """Whether a setting of a sweep (SETTINGS) differs in a command's settings from those it was started with; the
    recipe only in keys that may change what a trial learns (results_differ): not log.to, data.workers, ..."""
    return bool(results_differ(before[setting], settings[setting])) if setting == "resolved" else \
        before[setting] != settings[setting]


def results_differ(then, now):
    """The keys (differing_keys) of two resolved recipes that differ, but for those that never change what a run
    learns (utils/config.CHANGES_RESULTS_WHEN: where it is saved, what it logs, how fast it goes)."""
    return [(key, *values) for key, *values in differing_keys(then, now) if CHANGES_RESULTS_WHEN.get(key) is not never]


def what_changed(setting, then, now):
    """How a setting of a sweep differs from the command's now: the recipe by its first key that matters."""
    if setting == "space":
        return f"{SETTINGS[setting]} differ"
    if setting == "resolved":
        key, then, now = results_differ(then, now)[0]
        setting = f"the recipe's {key}"
    return f"{SETTINGS.get(setting, setting)}: {then!r} then, {now!r} now"


def read_settings(sweep):
    try:
        return yaml.safe_load((sweep / "sweep.yaml").read_text())
    except OSError:
        raise UsageError(f"{sweep}: no sweep.yaml: not a sweep folder of tune.py") from None


def check_recipe(settings, sweep):
    """train.py --check of the recipe with the sweep's fixed overrides, launched as a trial is: what train.py would
    refuse before any work (a data set that is not there, a batch the processes cannot share) is refused once, here,
    not by every trial."""
    command = train_command(settings, ["--recipe", settings["recipe"], *settings["overrides"], f"project={sweep}",
                                       "--check"])  # the project the trials' runs go to
    print(f"{colorstr('tune:')} checking the recipe with the sweep's overrides (train.py --check)", flush=True)
    returncode, output = run_to_end(command)
    if returncode != 0:
        raise UsageError(f"train.py refuses the sweep's recipe and overrides, so every trial would fail: "
                         f"{failure_line(output)}")


def run_to_end(command):
    """(exit code, output) of a child run as a trial is (child_process: stopped with tune.py)."""
    with tempfile.TemporaryFile("w+") as out:
        with child_process(command, out) as process:
            process.wait()
        out.seek(0)
        return process.returncode, out.read()


def train_command(settings, arguments):
    """train.py with arguments, under torchrun for a sweep of several processes per trial."""
    if settings["nproc"] > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={settings['nproc']}", str(ROOT / "train.py"), *arguments]
    return [sys.executable, str(ROOT / "train.py"), *arguments]


def storage_of(sweep, storage, settings):
    """The study's storage: --storage where given, else the sweep folder's SQLite file (a shared study's URL is not
    saved in sweep.yaml: it may hold a password)."""
    if storage:
        return storage
    if settings.get("shared"):
        raise UsageError(f"{sweep}: its study is in a database of its own: give --storage URL (and --study NAME)")
    return f"sqlite:///{(sweep / 'study.db').resolve()}"


def open_study(url, name, create=False, prune=True, heartbeat=10, tries=5):
    """(study, created): the Optuna study (maximising the metric) in an RDB storage whose workers record a
    heartbeat: a trial silent for 3 heartbeats is failed and run again (RETRY) by the next worker to start a trial.
    Median pruning at the same percent of the schedule, unless not prune. With create, made if it does not exist;
    created says whether this call made it: of workers starting together exactly one did (the database's unique
    study name decides), and that one creates what the workers share (sweep_record)."""
    from sqlalchemy.exc import SQLAlchemyError

    pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=PRUNE_FROM) if prune else \
        optuna.pruners.NopPruner()
    for attempt in range(tries):
        try:
            with warnings.catch_warnings():  # the heartbeat: experimental in Optuna since 2.9
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(url, heartbeat_interval=heartbeat, grace_period=3 * heartbeat,
                                                     heartbeat_stale_trial_callback=RETRY)
            if create:
                with suppress(optuna.exceptions.DuplicatedStudyError):
                    return optuna.create_study(storage=storage, study_name=name, direction="maximize",
                                               pruner=pruner), True
            return optuna.load_study(storage=storage, study_name=name, pruner=pruner), False
        except (KeyError, ImportError, ValueError) as e:
            raise UsageError(f"study {name!r} in {url.split('@')[-1]}: {e}") from None
        except SQLAlchemyError as e:  # workers starting together race to create the database's tables: try again
            if attempt == tries - 1:
                raise UsageError(f"study {name!r} in {url.split('@')[-1]}: {str(e).splitlines()[0]}") from None
            time.sleep(0.2 * (attempt + 1))


def sweep_record(study, sweep, settings, created=True):
    """The sweep's record in MLflow (utils/trackers.MLflowSweep: a parent run, a child run per trial) where its
    recipe's log.to names mlflow, else None; W&B groups the trials' runs after the sweep (sweep_environment). An
    MLflow that cannot be reached is one line, and the sweep goes on without it (unless log.required). The worker
    that created the study creates the parent run; workers that started with it wait for its id (parent_run)."""
    log = settings.get("resolved", {}).get("log", {})
    if grouped := sweep_environment(log.get("to", []), sweep):
        print(f"{colorstr('tune:')} W&B records each trial as a run of project {grouped[0]}, group {grouped[1]}")
    if "mlflow" not in log.get("to", []):
        return None
    try:
        fixed = {k: v for k, v in flat_params(settings["resolved"]).items() if k not in settings["space"]}
        params = {**fixed, **{f"space.{k}": yaml.safe_dump(v, default_flow_style=True).strip()
                                       for k, v in settings["space"].items()}}
        record = MLflowSweep(sweep, params, parent_run(study, created))
    except Exception as e:  # whatever MLflow raises for a server down or a bad URI
        if created:  # none: the workers that started with this one need not wait for it
            study.set_user_attr("mlflow_parent", "")
        if log.get("required"):
            raise UsageError(f"log.to: MLflow cannot record the sweep ({first_line(e)}) and log.required=true; fix it, "
                             f"or set log.required=false to sweep on without it") from None
        print(f"{colorstr('tune:')} MLflow cannot record the sweep ({first_line(e)}); going on without it")
        return None
    if not study.user_attrs.get("mlflow_parent"):  # the sweep's first record; a shared one is never replaced
        study.set_user_attr("mlflow_parent", record.parent_id)
    print(f"{colorstr('tune:')} recorded in MLflow at {record.uri}: run {sweep.name} (the sweep) and a child run "
          f"per trial (mlflow ui --backend-store-uri {record.uri})")
    return record


def parent_run(study, created, wait=PARENT_WAIT):
    """The sweep's MLflow parent run id that the study keeps, or None where this worker is to create it: it created
    the study; the study has trials already (a sweep going on, whose first record failed or predates this); or the
    worker that created it has not said within wait seconds (it died first; one line). Only a worker that started
    with the creator waits: two workers each creating a parent would split the sweep's trials between two runs."""
    deadline = time.monotonic() + wait
    while (parent := study.user_attrs.get("mlflow_parent")) is None and not created and not study.trials:
        if time.monotonic() > deadline:
            print(f"{colorstr('tune:')} the worker that created study {study.study_name} has not created its MLflow "
                  f"run in {wait:.0f} s; this worker creates it")
            return None
        time.sleep(0.5)
    return parent or None


def run_sweep(study, space, sweep, settings, trials, seed=0, heartbeat=10, record=None):
    """Optuna's optimize loop until `trials` trials finished or were pruned, or as many failed (a failure of the
    sweep's own: train.py failed); a trial stopped or cut off is left out of the count, and runs again. record: the
    sweep's MLflow record, or None."""
    if len(study.get_trials(deepcopy=False, states=VERDICTS)) >= trials or len(own_failures(study)) >= trials:
        return  # done already: optimize would run one more trial before its callbacks
    study.optimize(lambda trial: run_trial(trial, space, sweep, settings, seed, heartbeat, record),
                   catch=(TrialFailed,),
                   callbacks=[MaxTrialsCallback(trials, states=VERDICTS), stop_after_failures(trials)])


def own_failures(study):
    """The trials whose train.py failed (their error line kept), not those cut off by a stop or a dead worker."""
    return [t for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if "error" in t.user_attrs]


def stop_after_failures(trials):
    """An optimize callback that stops the sweep once `trials` trials failed (own_failures)."""
    def callback(study, trial):
        if len(own_failures(study)) >= trials:
            study.stop()
    return callback


class TrialFailed(Exception):
    """A trial's train.py failed: Optuna records the trial as failed, and the sweep goes on."""


def seeded_sampler(seed, number):
    """TPE (with constant_liar: workers draw away from each other's running trials), its random stream NumPy's
    SeedSequence of (seed, trial number): a trial's draws depend on the seed and its number only (and the study's
    history), and two seeds' streams never overlap."""
    entropy = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=entropy, constant_liar=True)


def run_trial(trial, space, sweep, settings, seed, heartbeat, record=None):
    """Optuna's objective: train the trial (train_trial). A trial stopped (Ctrl-C, SIGTERM) is asked again at once,
    to be resumed from its last.pt by whichever worker goes on; its seconds are kept however it ends."""
    try:
        return train_trial(trial, space, sweep, settings, seed, heartbeat, record)
    except KeyboardInterrupt:
        with suppress(Exception):
            RETRY(trial.study, study_trial(trial))
        raise
    finally:
        with suppress(Exception):
            record_seconds(trial)


def train_trial(trial, space, sweep, settings, seed, heartbeat, record=None):
    """Run the trial's training; returns its best val score, or raises TrialPruned or TrialFailed. record: the
    sweep's MLflow record, where the trial's train.py records its child run."""
    params = draw(trial, space, seed)
    retried = RETRY.retried_trial_number(study_trial(trial))
    run = sweep / trial.user_attrs.get("run", f"trial-{trial.number}")  # a retry's: its first try's
    trial.set_user_attr("run", run.name)
    trial.set_user_attr("host", HOST)
    log, epochs = sweep / "logs" / f"trial-{trial.number}.txt", trial_epochs(settings, params)
    if retried is not None and (done := finished_run(run, trial, settings, epochs)):
        print(f"{colorstr('tune:')} trial {trial.number}: {shown(params)} (trial {retried} again): its run had "
              f"ended before the stop: it {done}", flush=True)
        return trial_score(trial, run, settings, record)
    arguments, started = trial_arguments(settings, run, params, retried)
    again = "" if retried is None else f" (trial {retried} again{started})"
    print(f"{colorstr('tune:')} trial {trial.number}: {shown(params)}{again}", flush=True)
    env = record.trial_env(trial, run.name) if record else None
    with open(log, "a") as out, child_process(train_command(settings, arguments), out, env) as process:
        pruned = watch(process, trial, run / "results.csv", settings["metric"], epochs, heartbeat)
    scores, metric = epoch_scores(run / "results.csv", settings["metric"]), settings["metric"]
    if pruned:
        epoch, median = pruned
        why = (f"pruned after epoch {epoch}/{epochs}: val {metric} {max(scores[:epoch]):.2%} at "
               f"{percent_done(epoch, epochs)}% of its schedule, below the finished trials' median there "
               f"({median:.2%})")
        with open(log, "a") as out:
            out.write(f"tune.py: trial {trial.number} {why}\n")
        print(f"  {why}; {short_path(run)}")
        if record:
            record.trial_ended(trial, "PRUNED")
        raise optuna.TrialPruned()
    if process.returncode != 0 or not scores:
        line = failure_line(Path(log).read_text(errors="replace"))
        trial.set_user_attr("error", line)
        print(f"  failed (exit {process.returncode}): {line}; output in {short_path(log)}")
        if record:
            record.trial_ended(trial, "FAIL")
        raise TrialFailed(line)
    return trial_score(trial, run, settings, record)


def trial_score(trial, run, settings, record=None):
    """The best val score of a trial's run that has ended, from its results.csv; said, and recorded in MLflow."""
    scores, metric = epoch_scores(run / "results.csv", settings["metric"]), settings["metric"]
    print(f"  val {metric} {max(scores):.2%} (best of {len(scores)} epoch{'s' * (len(scores) != 1)}); "
          f"{short_path(run)}")
    if record:
        record.trial_ended(trial, "COMPLETE", max(scores))
    return max(scores)


def finished_run(run, trial, settings, epochs):
    """How a retried trial's run ended (utils/run.run_done, in words) where its first try trained it to the end
    before the stop that cut the trial off (tune.py stopped as train.py finished; tune.py killed after it), its
    epochs reported to the trial as watch() does; else None: the retry trains, resuming its last.pt."""
    try:
        ckpt = load_training_checkpoint(run / "weights" / "last.pt")
        done = run_done(ckpt, checkpoint_recipe(ckpt["recipe"], str(run)).train)
    except (OSError, UsageError, KeyError):
        return None
    scores = epoch_scores(run / "results.csv", settings["metric"])
    if not done or not scores:
        return None
    for epoch in range(len(scores)):
        report_epoch(trial, scores, epoch, epochs)
    return done


def trial_arguments(settings, run, params, retried):
    """train.py's arguments for a trial, and how it starts in words: a retried trial whose first try saved last.pt
    here resumes it; any other starts its run afresh, the recipe with the sweep's overrides and the trial's keys."""
    if retried is not None and (run / "weights" / "last.pt").exists():
        return ["--resume", str(run)], ", resumed from its last.pt"
    if run.exists() and retried is None:
        raise UsageError(f"{run} exists, but the study does not know it: the study was replaced; give another --name")
    shutil.rmtree(run, ignore_errors=True)  # a first try cut off before it saved anything
    return ["--recipe", settings["recipe"], *trial_overrides(settings, params), f"project={run.parent}",
            f"name={run.name}"], ""


def trial_overrides(settings, params):
    """The sweep's fixed overrides, then the trial's keys, as key=value."""
    return [*settings["overrides"], *(f"{k}={as_override(v)}" for k, v in params.items())]


def record_seconds(trial):
    """The seconds the trial has run, kept in the study with each heartbeat and at its end: a trial cut off shows the
    time it ran, not the time until a worker found it dead."""
    trial.set_user_attr("seconds", round(time.time() - trial.datetime_start.timestamp(), 1))


def draw(trial, space, seed):
    """The trial's keys: a retried trial's own, else drawn by a sampler seeded for this trial (seeded_sampler)."""
    trial.study.sampler = seeded_sampler(seed, trial.number)  # before the first suggest, where TPE draws
    return {key: suggest(trial, key, distribution) for key, distribution in space.items()}


def suggest(trial, key, distribution):
    """The trial's value of key (a retried trial's own, else the sampler's)."""
    if isinstance(distribution, od.CategoricalDistribution):
        return trial.suggest_categorical(key, distribution.choices)
    if isinstance(distribution, od.IntDistribution):
        return trial.suggest_int(key, distribution.low, distribution.high, step=distribution.step,
                                 log=distribution.log)
    return trial.suggest_float(key, distribution.low, distribution.high, step=distribution.step, log=distribution.log)


def study_trial(trial):
    """The study's record of a running trial (a FrozenTrial, as Optuna's callbacks take it)."""
    return next(t for t in trial.study.get_trials(deepcopy=False) if t.number == trial.number)


def trial_epochs(settings, params):
    """train.epochs of the trial's recipe."""
    return load_recipe(settings["recipe"], trial_overrides(settings, params)).train.epochs


@contextmanager
def child_process(command, out, env=None):
    """A child of tune.py (a trial's train.py, the check, val.py), its output to out; it is told (SIGTERM) to save
    and stop if tune.py dies or is stopped, and on any error here it is stopped and waited for."""
    parent = os.getpid()
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                               preexec_fn=lambda: die_with_parent(parent))
    CHILD["process"] = process
    try:
        yield process
    finally:
        CHILD.pop("process", None)
        if process.poll() is None:  # a Ctrl-C from the terminal reached it too; this makes sure
            process.send_signal(signal.SIGTERM)
        process.wait()


def percent_done(epoch, epochs):
    """How much of a schedule of epochs the first epoch epochs are, in whole percent: the step the pruner compares
    trials at, so that a trial of 10 epochs at its third is judged against a 4-epoch trial's first, not its third."""
    return math.floor(100 * epoch / epochs)


def watch(process, trial, results, metric, epochs, heartbeat=10):
    """Report each epoch's best score so far to the trial, at every percent of the schedule it covers, and print it;
    stop the run (SIGTERM: train.py saves and stops) if the pruner says so. Returns (epochs done, the median they
    trailed) when it was pruned, else None."""
    reported, best, recorded = 0, sweep_best(trial.study), time.monotonic()
    while True:
        ended = process.poll() is not None
        if time.monotonic() - recorded >= heartbeat:
            record_seconds(trial)
            recorded = time.monotonic()
        scores = epoch_scores(results, metric)
        for epoch in range(reported, len(scores)):
            so_far = report_epoch(trial, scores, epoch, epochs)
            print(f"  epoch {epoch + 1}/{epochs}: val {metric} {scores[epoch]:.2%} (trial best {so_far:.2%}"
                  f"{f', sweep best {best:.2%}' if best is not None else ''})", flush=True)
            if not ended and epoch + 1 < epochs and trial.should_prune():
                process.send_signal(signal.SIGTERM)
                process.wait()
                return epoch + 1, median_at(trial.study, percent_done(epoch + 1, epochs))
        reported = len(scores)
        if ended:
            return None
        time.sleep(0.5)


def report_epoch(trial, scores, epoch, epochs):
    """Report the trial's best score up to epoch (from 0) at every percent of its schedule that epoch covers."""
    so_far = max(scores[:epoch + 1])
    for step in range(percent_done(epoch, epochs) + 1, percent_done(epoch + 1, epochs) + 1):
        trial.report(so_far, step)
    return so_far


def sweep_best(study):
    values = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    return max(values) if values else None


def median_at(study, step):
    """The median of the finished trials' scores at step, which the median pruner compared a trial with."""
    values = [t.intermediate_values[step] for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
              if step in t.intermediate_values]
    return statistics.median(values) if values else math.nan


def epoch_scores(results, metric):
    """Each epoch's val metric in a run's results.csv (the better of the weights' and their EMA's), up to the first
    row not yet whole (read while the run appends it)."""
    try:
        text = Path(results).read_text()
    except OSError:
        return []
    scores = []
    for row in csv.DictReader(text[: text.rfind("\n") + 1].splitlines()):
        try:
            scores.append(max(float(row[c]) for c in (f"val/{metric}", f"val/ema_{metric}") if row.get(c)))
        except ValueError:  # a row cut short
            break
    return scores


def failure_line(output):
    """What a failed train.py's output says of its failure: its error line (under torchrun, the first a rank said),
    else its last line that is not a border of torchrun's summary (a crash's exception)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("train.py: error:")]
    lines = said or [line for line in lines if set(line) - set("=-")]
    return (lines[0] if said else lines[-1]) if lines else "no output"


def die_with_parent(parent):
    """In the trial's process: ask Linux for a SIGTERM when tune.py dies, so that a killed sweep leaves no run (and
    if it died already, while this process started, stop now)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def report(study, sweep, settings, fail_stale=True):
    """The best trials as a table and trials.csv, the best one as best.yaml, and Optuna's plots. With fail_stale (a
    worker's report), a trial whose worker died (no heartbeat for 3 intervals) is failed first, and queued to run
    again, as a worker starting a trial does: once --trials have ended no worker starts one, and it would show as
    running for ever."""
    if fail_stale:
        with warnings.catch_warnings():  # experimental in Optuna since 2.9
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            optuna.storages.fail_stale_trials(study)
    trials = study.get_trials(deepcopy=False)
    write_trials_csv(sweep / "trials.csv", trials)
    done = sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: -t.value)
    states = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState if any(t.state == s for t in trials)}
    print(f"{colorstr('tune:')} {len(trials)} trial{'s' * (len(trials) != 1)} ("
          f"{', '.join(f'{n} {s}' for s, n in states.items())}); "
          f"val {settings['metric']}, best first (chosen on the val images these figures are measured on):")
    for t in done[:5]:
        print(f"  trial {t.number:3d}  {t.value:.2%}  {shown(t.params)}")
    if not done:
        raise UsageError(f"{sweep}: no trial has finished yet (their output: {short_path(sweep / 'logs')})")
    write_best(sweep / "best.yaml", done[0], settings)
    plots(study, sweep)
    if held_out := held_out_score(sweep, done[0], settings):
        print(f"held out: trial {done[0].number}'s best.pt scores {settings['metric']} {held_out[1]:.2%} on "
              f"{held_out[0]}, which chose nothing")
    print(f"best: python {script('train.py')} --recipe {short_path(sweep / 'best.yaml')}")


def held_out_score(sweep, trial, settings):
    """The best trial's weights scored by val.py on the data's test split, which the sweep never saw: (split folder,
    score), or None where the data has no test/ beside its val/ or valid/ (or the weights are on another machine)."""
    root, metric = Path(settings.get("resolved", {}).get("data", {}).get("name", "")), settings["metric"]
    weights = sweep / trial.user_attrs.get("run", f"trial-{trial.number}") / "weights" / "best.pt"
    if not (weights.exists() and (root / "test").is_dir() and any((root / n).is_dir() for n in ("val", "valid"))):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        returncode, output = run_to_end([sys.executable, str(ROOT / "val.py"), "--weights", str(weights), "--split",
                                         "test", "--project", tmp, "--name", "test"])
        if returncode != 0:
            print(f"  the test split was not scored: {failure_line(output)}")
            return None
        return root / "test", json.loads((Path(tmp) / "test" / "metrics.json").read_text())[metric]


def shown(params):
    """A trial's keys as key=value, numbers to 4 significant digits (the runs take them whole)."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={as_override(v)}" for k, v in params.items())


def write_trials_csv(path, trials):
    """Every trial: its state, value and keys; the seconds its training ran (to its last epoch, for one cut off);
    the trial it runs again, the machine that ran it, and a failed one's error line."""
    keys = sorted({k for t in trials for k in t.params})
    with atomic_write(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", "value", *keys, "seconds", "retry_of", "host", "error"])
        for t in trials:
            history = RETRY.retry_history(t)
            writer.writerow([t.number, t.state.name, "" if t.value is None else t.value,
                             *(t.params.get(k, "") for k in keys), t.user_attrs.get("seconds", ""),
                             history[-1] if history else "", t.user_attrs.get("host", ""),
                             t.user_attrs.get("error", "")])


def write_best(path, trial, settings):
    """The best trial as a recipe: the searched recipe as its base, then the sweep's overrides and the trial's keys."""
    recipe = find_recipe(settings["recipe"]).resolve()
    base = recipe.name if recipe.parent == RECIPES_DIR.resolve() else str(recipe)  # the user's own: its full path
    keys = OmegaConf.to_container(OmegaConf.from_dotlist(trial_overrides(settings, trial.params)))
    header = (f"# The best trial of {path.parent} (trial {trial.number}: val {settings['metric']} {trial.value:.4f}),"
              f" written by tune.py\n")
    with atomic_write(path) as tmp:
        Path(tmp).write_text(header + yaml.safe_dump({"base": base, **keys}, sort_keys=False))


def plots(study, sweep):
    """Optuna's optimisation history and, from three finished trials, parameter importances, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as optuna_plots

    wanted = {"history": optuna_plots.plot_optimization_history}
    if len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))) >= 3:
        wanted["importances"] = optuna_plots.plot_param_importances
    for name, plot in wanted.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            figure = plot(study).figure
        figure.tight_layout()
        figure.savefig(sweep / f"{name}.png", dpi=100)
        plt.close(figure)


if __name__ == "__main__":
    after_imports()
    main()
