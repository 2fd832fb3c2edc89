"""Search a recipe's keys with Optuna: each trial a real run of train.py, the best trial forked as a recipe.

Usage:
    python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 20
    python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 20 --nproc 2      # each trial under torchrun
    python tune.py --recipe cls.yaml --space spaces/cls.yaml --storage postgresql://host/db --study cls   # each machine
    python tune.py --report runs/tune/cls-cls                                            # the table, best.yaml, plots
    python train.py --recipe runs/tune/cls-cls/best.yaml

The space file maps recipe keys to a range ({low: 0.01, high: 0.3, log: true}; whole numbers for a key that takes them)
or to choices ({choices: [sgd, adamw]}); every value is checked as train.py checks an override before any trial runs.
The sweep lives in runs/tune/NAME (--name; the recipe's and the space's names by default): study.db (the Optuna study,
SQLite, unless --storage), trial-K/ (trial K's run: TensorBoard logs with its keys on the HParams page, results.csv,
weights), logs/trial-K.txt (its output), trials.csv, best.yaml, history.png and importances.png. Trials are sampled
by TPE (seeded by --seed) and pruned by the median of the others' validation metric (train.best_metric) at the same
epoch: a pruned trial is a run stopped early, its checkpoint saved. The same command run again goes on with the
sweep: finished trials are kept, one that was cut off (Ctrl-C, SIGTERM, a crash, a killed machine) is run again.
"""

import argparse
import csv
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from contextlib import suppress
from pathlib import Path

import yaml
from omegaconf import OmegaConf

try:
    import optuna
    import optuna.distributions as od
    from optuna.trial import TrialState
except ImportError:
    sys.exit("tune.py: error: needs Optuna, an optional extra: pip install -r requirements-tune.txt")

from models import check_model_name
from utils.config import (RECIPES_DIR, SECTIONS, RecipeError, as_override, best_metric, find_recipe, load_recipe,
                          schema_leaves)
from utils.general import UsageError, colorstr, short_path
from utils.once import atomic_write

ROOT = Path(__file__).resolve().parent
HOST = socket.gethostname()
RANGE_KEYS, CHOICE_KEYS = {"low", "high", "log", "step"}, {"choices"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="the recipe to search (a name in recipes/ or a path)")
    parser.add_argument("--space", help="YAML file: recipe keys to search, each with a range or choices")
    parser.add_argument("--trials", type=int, default=20, help="trials in the study, all workers together")
    parser.add_argument("--nproc", type=int, default=1, help="processes per trial: >1 launches each under torchrun")
    parser.add_argument("--storage", help="an Optuna storage URL shared by several machines (default: SQLite here)")
    parser.add_argument("--study", help="the study's name in --storage (default: the sweep's name)")
    parser.add_argument("--project", default="runs/tune", help="sweeps go to PROJECT/NAME")
    parser.add_argument("--name", help="the sweep's name (default: RECIPE-SPACE)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--no-prune", action="store_true", help="run every trial to its end (no median pruning)")
    parser.add_argument("--report", metavar="SWEEP", help="only report a sweep's folder: table, best.yaml, plots")
    parser.add_argument("overrides", nargs="*", help="key=value recipe overrides for every trial")
    args = parser.parse_args(argv)
    if args.report is None and not (args.recipe and args.space):
        parser.error("--recipe and --space are needed (or --report SWEEP)")
    if args.trials < 1 or args.nproc < 1:
        parser.error("--trials and --nproc must be >= 1")
    return args


def main(argv=None):
    """Run or report a sweep; bad input exits with code 2 and one line."""
    args = parse_args(argv)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        if args.report:
            sweep, settings = Path(args.report), read_settings(Path(args.report))
            study = open_study(storage_of(sweep, args.storage, settings), args.study or settings["study"])
        else:
            space = read_space(args.space, args.recipe, args.overrides)
            sweep, settings = claim_sweep(args)
            study = open_study(storage_of(sweep, args.storage, settings), settings["study"], create=True,
                               prune=not args.no_prune)
            run_sweep(study, space, sweep, settings, args.trials, args.seed)
        report(study, sweep, settings)
    except UsageError as e:
        print(f"tune.py: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("tune.py: stopped; the same command goes on with the sweep", file=sys.stderr)
        sys.exit(130)
    except optuna.exceptions.StorageInternalError as e:
        print(f"tune.py: error: the study's database failed: {str(e).splitlines()[0]}; the same command goes on "
              f"with the sweep", file=sys.stderr)
        sys.exit(1)


def read_space(path, recipe, overrides):
    """{key: Optuna distribution} of a space file, each bound or choice checked as an override of the recipe."""
    try:
        space = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
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
    """The Optuna distribution of a {low, high, log, step} range of a key of type kind."""
    numbers = [spec[k] for k in ("low", "high", "step") if k in spec]
    if kind not in (int, float) or not all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in numbers):
        raise UsageError(f"{where}: a range needs a key that takes a number and numbers for its bounds; "
                         f"this key takes {getattr(kind, '__name__', kind)}, given {spec!r} (use choices)")
    if kind is int and not all(isinstance(n, int) for n in numbers):
        raise UsageError(f"{where}: takes a whole number, so its range must be whole numbers, given {spec!r}")
    if not spec["low"] < spec["high"] or (spec.get("log") and spec["low"] <= 0):
        raise UsageError(f"{where}: needs low < high (and low > 0 with log: true), given {spec!r}")
    options = {"log": bool(spec.get("log", False)), "step": spec.get("step")}
    if kind is int:
        return od.IntDistribution(spec["low"], spec["high"], log=options["log"], step=options["step"] or 1)
    return od.FloatDistribution(float(spec["low"]), float(spec["high"]), **options)


def claim_sweep(args):
    """The sweep's folder and settings: made for a new sweep, checked against this command for one going on."""
    name = args.name or f"{Path(args.recipe).stem}-{Path(args.space).stem}"
    sweep = Path(args.project) / name
    settings = {"recipe": args.recipe, "space": Path(args.space).read_text(), "overrides": list(args.overrides),
                "nproc": args.nproc, "shared": bool(args.storage), "study": args.study or name}
    settings["metric"] = best_metric(load_recipe(args.recipe, args.overrides))
    if (sweep / "sweep.yaml").exists():
        before = read_settings(sweep)
        changed = [key for key in settings if before.get(key) != settings[key]]
        if changed:
            raise UsageError(f"{sweep} holds a sweep of another command (its {', '.join(changed)} differ): give "
                             f"another --name, or the command that started it")
        return sweep, before
    (sweep / "logs").mkdir(parents=True, exist_ok=True)
    with atomic_write(sweep / "sweep.yaml") as tmp:
        Path(tmp).write_text(yaml.safe_dump(settings, sort_keys=False))
    return sweep, settings


def read_settings(sweep):
    try:
        return yaml.safe_load((sweep / "sweep.yaml").read_text())
    except OSError:
        raise UsageError(f"{sweep}: no sweep.yaml: not a sweep folder of tune.py") from None


def storage_of(sweep, storage, settings):
    """The study's storage: --storage where given, else the sweep folder's SQLite file (a shared study's URL is not
    saved in sweep.yaml: it may hold a password)."""
    if storage:
        return storage
    if settings.get("shared"):
        raise UsageError(f"{sweep}: its study is in a database of its own: give --storage URL (and --study NAME)")
    return f"sqlite:///{(sweep / 'study.db').resolve()}"


def open_study(storage, name, create=False, prune=True, tries=5):
    """The Optuna study (maximising the metric): TPE (run_sweep seeds it per trial), median pruning unless not prune;
    created with the sweep."""
    from sqlalchemy.exc import SQLAlchemyError

    sampler = optuna.samplers.TPESampler()
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1) if prune else optuna.pruners.NopPruner()
    for attempt in range(tries):
        try:
            if create:
                return optuna.create_study(storage=storage, study_name=name, direction="maximize", sampler=sampler,
                                           pruner=pruner, load_if_exists=True)
            return optuna.load_study(storage=storage, study_name=name, sampler=sampler, pruner=pruner)
        except (KeyError, ImportError, ValueError) as e:
            raise UsageError(f"study {name!r} in {storage.split('@')[-1]}: {e}") from None
        except SQLAlchemyError as e:  # workers starting together race to create the database's tables: try again
            if attempt == tries - 1:
                raise UsageError(f"study {name!r} in {storage.split('@')[-1]}: {str(e).splitlines()[0]}") from None
            time.sleep(0.2 * (attempt + 1))


def run_sweep(study, space, sweep, settings, trials, seed=0):
    """Trials until the study holds `trials` that finished, were pruned, failed of their own or are running."""
    retry_dead_trials(study)
    while counted(study) < trials:
        trial = ask(study, space, seed)
        try:
            state, value = run_trial(trial, sweep, settings)
        except BaseException:  # stopped, or the study's database failed: the trial is run again by whoever goes on
            with suppress(Exception):
                cut_off(study, trial.number, trial.params)
            raise
        study.tell(trial, value, state=getattr(TrialState, state))


def ask(study, space, seed):
    """A new trial of the study, named as this worker's, its keys drawn (or an enqueued trial's own) from a sampler
    seeded by seed + its number: workers, and a sweep run again, draw different keys, and the same seed draws the
    same keys for the same trial number."""
    trial = study.ask()
    trial.set_user_attr("worker", worker_id())
    study.sampler = optuna.samplers.TPESampler(seed=seed + trial.number)
    for key, distribution in space.items():
        suggest(trial, key, distribution)
    return trial


def suggest(trial, key, distribution):
    """The trial's value of key (an enqueued trial's own, else the sampler's)."""
    if isinstance(distribution, od.CategoricalDistribution):
        return trial.suggest_categorical(key, distribution.choices)
    if isinstance(distribution, od.IntDistribution):
        return trial.suggest_int(key, distribution.low, distribution.high, step=distribution.step,
                                 log=distribution.log)
    return trial.suggest_float(key, distribution.low, distribution.high, step=distribution.step, log=distribution.log)


def cut_off(study, number, params):
    """Fail a trial that did not end and ask for its keys again, once: only the worker whose tell changed its state
    enqueues them."""
    try:
        study.tell(number, state=TrialState.FAIL)
    except (ValueError, optuna.exceptions.UpdateFinishedTrialError):  # finished meanwhile: another worker did it
        return False
    study.enqueue_trial(params, user_attrs={"retry_of": number})
    return True


def counted(study):
    return sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING) or
               (t.state == TrialState.FAIL and "error" in t.user_attrs) for t in study.get_trials(deepcopy=False))


def worker_id():
    """This process on this machine, as a trial records who runs it: host, pid and the pid's start time."""
    return f"{HOST}:{os.getpid()}:{started(os.getpid())}"


def started(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def retry_dead_trials(study, unclaimed_after=60):
    """Trials left running by a tune.py of this machine that is gone (killed, crashed), or by one that died before it
    put its name on the trial, are failed and asked again."""
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get("worker")
        if worker is None:
            dead = time.time() - trial.datetime_start.timestamp() > unclaimed_after
        else:
            host, pid, start = worker.rsplit(":", 2)
            dead = host == HOST and pid.isdigit() and started(int(pid)) != start
        if dead and cut_off(study, trial.number, trial.params):
            print(f"tune.py: trial {trial.number} was cut off (its tune.py is gone): running it again")


def run_trial(trial, sweep, settings):
    """Run trial's training and return (state, value): COMPLETE with the best val metric, PRUNED, or FAIL."""
    run, log = sweep / f"trial-{trial.number}", sweep / "logs" / f"trial-{trial.number}.txt"
    overrides = [*settings["overrides"], *(f"{k}={as_override(v)}" for k, v in trial.params.items())]
    command = [sys.executable, str(ROOT / "train.py"), "--recipe", settings["recipe"], *overrides,
               f"project={sweep}", f"name={run.name}"]
    if settings["nproc"] > 1:
        command[1:2] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={settings['nproc']}",
                        str(ROOT / "train.py")]
    if run.exists():
        raise UsageError(f"{run} exists, but the study does not know it: the study was replaced; give another --name")
    print(f"{colorstr('tune:')} trial {trial.number}: {shown(trial.params)}", flush=True)
    parent = os.getpid()
    with open(log, "w") as out, stopping_with_child() as child:
        child.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=lambda: die_with_parent(parent))
        pruned = watch(child.process, trial, run / "results.csv", settings["metric"])
    scores = epoch_scores(run / "results.csv", settings["metric"])
    if pruned:
        print(f"  pruned after epoch {len(scores)}: {max(scores):.4f}; {short_path(run)}")
        return "PRUNED", None
    if child.process.returncode != 0 or not scores:
        line = failure_line(log)
        trial.set_user_attr("error", line)
        print(f"  failed (exit {child.process.returncode}): {line}; output in {short_path(log)}")
        return "FAIL", None
    print(f"  val {settings['metric']} {max(scores):.4f} (best of {len(scores)} epochs); {short_path(run)}")
    return "COMPLETE", max(scores)


def watch(process, trial, results, metric):
    """Report each epoch's score to the trial as the run writes it; stop the run (SIGTERM: train.py saves and stops)
    if the pruner says so. Returns whether it was pruned."""
    reported = 0
    while True:
        ended = process.poll() is not None
        scores = epoch_scores(results, metric)
        for epoch in range(reported, len(scores)):
            trial.report(scores[epoch], epoch)  # all of them: the pruner compares later trials with these
            if not ended and trial.should_prune():
                process.send_signal(signal.SIGTERM)
                process.wait()
                return True
        reported = len(scores)
        if ended:
            return False
        time.sleep(0.5)


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


def failure_line(log):
    """What a failed trial's output says of its failure: train.py's error line (under torchrun, the first a rank
    said), else its last line that is not a border of torchrun's summary (a crash's exception)."""
    lines = [line.strip() for line in Path(log).read_text(errors="replace").splitlines() if line.strip()]
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


class stopping_with_child:
    """While a trial runs, a SIGTERM to tune.py is passed to the trial (which saves and stops), then tune.py stops;
    Ctrl-C reaches both from the terminal. On any error the trial is stopped and waited for."""

    process = None

    def __enter__(self):
        self.previous = signal.signal(signal.SIGTERM, self.forward)
        return self

    def forward(self, signum, frame):
        if self.process is not None:
            self.process.send_signal(signum)
        raise KeyboardInterrupt

    def __exit__(self, kind, *_):
        signal.signal(signal.SIGTERM, self.previous)
        if kind is not None and self.process is not None:
            if self.process.poll() is None:  # a Ctrl-C from the terminal reached it too; this makes sure
                self.process.send_signal(signal.SIGTERM)
            self.process.wait()
        return False


def report(study, sweep, settings):
    """The best trials as a table and trials.csv, the best one as best.yaml, and Optuna's plots."""
    trials = study.get_trials(deepcopy=False)
    write_trials_csv(sweep / "trials.csv", trials)
    done = sorted((t for t in trials if t.state == TrialState.COMPLETE), key=lambda t: -t.value)
    states = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState if any(t.state == s for t in trials)}
    print(f"{colorstr('tune:')} {len(trials)} trials ({', '.join(f'{n} {s}' for s, n in states.items())}); "
          f"val {settings['metric']}, best first:")
    for t in done[:5]:
        print(f"  trial {t.number:3d}  {t.value:.4f}  {shown(t.params)}")
    if not done:
        raise UsageError(f"{sweep}: no trial has finished yet (their output: {short_path(sweep / 'logs')})")
    write_best(sweep / "best.yaml", done[0], settings)
    plots(study, sweep)
    print(f"best: python train.py --recipe {short_path(sweep / 'best.yaml')}")


def shown(params):
    """A trial's keys as key=value, numbers to 4 significant digits (the runs take them whole)."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={as_override(v)}" for k, v in params.items())


def write_trials_csv(path, trials):
    keys = sorted({k for t in trials for k in t.params})
    with atomic_write(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", "value", *keys, "seconds", "retry_of", "error"])
        for t in trials:
            seconds = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete else ""
            writer.writerow([t.number, t.state.name, "" if t.value is None else t.value,
                             *(t.params.get(k, "") for k in keys), seconds, t.user_attrs.get("retry_of", ""),
                             t.user_attrs.get("error", "")])


def write_best(path, trial, settings):
    """The best trial as a recipe: the searched recipe as its base, then the sweep's overrides and the trial's keys."""
    recipe = find_recipe(settings["recipe"]).resolve()
    base = recipe.name if recipe.parent == RECIPES_DIR.resolve() else str(recipe)  # the user's own: its full path
    keys = OmegaConf.to_container(OmegaConf.from_dotlist(
        [*settings["overrides"], *(f"{k}={as_override(v)}" for k, v in trial.params.items())]))
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
    main()
