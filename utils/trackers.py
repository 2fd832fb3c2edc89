"""Experiment trackers a run is also recorded in (the recipe's log.to): MLflow and Weights & Biases, each an optional
extra (requirements-track.txt) imported only when named, written by rank 0 alone through utils/loggers.RunLogger.

A tracker that cannot be reached costs the run nothing but its record there: opening it fails in one line and the
run trains on with results.csv and TensorBoard (log.required=true refuses to start instead), and a tracker that fails
later is dropped with one line. Metrics go through each library's own background sender (MLflow's asynchronous
logging, W&B's service process), so a slow server never holds a step, which the other ranks would wait for.
"""

import importlib.util
import logging
import os
import re
import shlex
import shutil
import time
from pathlib import Path

import yaml

from utils.general import LOGGER, UsageError

TRACKERS = {"mlflow": "MLflow", "wandb": "W&B"}  # log.to's names of trackers, and how lines name them
PACKAGES = {"mlflow": "mlflow", "wandb": "wandb"}  # the module each needs
INSTALL = "pip install -r requirements-track.txt"
# MLflow retries an unreachable server 7 times over about four minutes by default; unless these are set, a tracking
# server that is down costs the start of a run a few seconds (its usual environment variables, so set them to wait).
MLFLOW_PATIENCE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                   "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
WANDB_INIT_SECONDS = 30  # W&B's wait for its service at start-up, unless WANDB_INIT_TIMEOUT says (its default: 90)
MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}
PARAMS_PER_CALL = 100  # MLflow's limit on the parameters of one log_batch call


def missing(name):
    """Why log.to cannot name `name` here, or None."""
    if name in TRACKERS and importlib.util.find_spec(PACKAGES[name]) is None:
        return f"needs {PACKAGES[name]}, an optional extra not installed here: {INSTALL}"
    return None


def open_trackers(names, run_dir, params, ids=None, required=False):
    """The trackers among names, each recording this run as run_dir's name with params (flat recipe keys -> values)
    or continuing the run of ids[name] (a resumed run's, kept in its checkpoint). One that cannot be opened is left
    out with a warning, or refused (UsageError) when required."""
    trackers = []
    for name in (n for n in names if n in TRACKERS):
        try:
            trackers.append(OPENERS[name](run_dir, params, (ids or {}).get(name)))
        except Exception as e:  # whatever the library raises for a server down, a bad URI, no account
            reason = first_line(e) + ("; with no account: WANDB_MODE=offline" if "API key" in str(e) else "")
            if required:
                raise UsageError(f"log.to: {TRACKERS[name]} cannot record this run ({reason}) and log.required=true; "
                                 f"fix it, or set log.required=false to train on without it") from None
            LOGGER.warning(f"log.to: {TRACKERS[name]} cannot record this run ({reason}); training on without it "
                           f"(log.required=true refuses to start instead)")
    return trackers


def first_line(error, most=200):
    """An exception's first line, at most `most` characters, or its type's name where it says nothing; for a
    connection that failed after retries (requests' long chain of wrappers), the OS's reason alone."""
    text = str(error).strip()
    if reason := re.search(r"Max retries exceeded.*?(\[Errno -?\d+\] [^'\"()]+)", text, re.S):
        return reason[1].strip()
    line = text.splitlines()[0] if text else type(error).__name__
    return line if len(line) <= most else line[:most - 3] + "..."


def flat_params(tree, prefix=""):
    """A nested recipe dict as flat keys -> values, as trackers take them (TensorBoard's HParams, W&B's config)."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flat_params(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class MLflowRun:
    """A run in MLflow's tracking store: MLFLOW_TRACKING_URI, or else a local SQLite store beside the project
    (runs/mlflow.db for runs/train), which `mlflow ui` browses with no server. The experiment is
    MLFLOW_EXPERIMENT_NAME, else the project folder's name (train); MLFLOW_RUN_ID names a run to record into (tune.py
    gives each trial its child run so)."""

    key, label = "mlflow", "MLflow"

    def __init__(self, run_dir, params, run_id=None):
        self.mlflow, self.client, self.uri = mlflow_client(run_dir)
        self.sending = []  # the asynchronous log calls' operations, until waited for
        try:
            self.run_id = self.open_run(run_dir, os.environ.get("MLFLOW_RUN_ID") or run_id)
            # A parameter, once logged, cannot change; a resumed run may change train.epochs and the like.
            logged = self.client.get_run(self.run_id).data.params
            log_params(self.mlflow, self.client, self.run_id, {k: v for k, v in params.items() if k not in logged})
        except Exception as e:
            raise RuntimeError(f"at {self.uri}: {first_line(e)}") from None

    def open_run(self, run_dir, run_id):
        """run_id's run (a resumed run's, or a trial's that tune.py made) marked running again, or a new run named
        after run_dir, with MLflow's own tags of where it came from (user, script, git commit)."""
        if run_id:
            run_id = self.client.get_run(run_id).info.run_id
            self.client.update_run(run_id, status="RUNNING")
            return run_id
        from mlflow.tracking.context.registry import resolve_tags

        experiment = mlflow_experiment(self.client, self.uri, run_dir.parent.name)
        return self.client.create_run(experiment, run_name=run_dir.name, tags=resolve_tags()).info.run_id

    @property
    def id(self):
        return self.run_id

    def where(self):
        return f"MLflow run {self.run_id} at {self.uri}"

    def log(self, metrics, step):
        """Record metrics (name -> number) at step, in MLflow's background sender."""
        now = int(time.time() * 1000)
        batch = [self.mlflow.entities.Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.sending.append(self.client.log_batch(self.run_id, metrics=batch, synchronous=False))

    def upload(self, paths):
        """Copy files to the run's artifacts."""
        self.wait()  # the metrics first: a long upload after them
        for path in paths:
            self.client.log_artifact(self.run_id, str(path))

    def end(self, status):
        """Mark the run finished, stopped (MLflow's KILLED) or failed, after every metric is sent."""
        self.wait()
        self.client.set_terminated(self.run_id, MLFLOW_STATUS[status])

    def wait(self):
        """Until every metric logged is sent (raising a failure to send)."""
        while self.sending:
            self.sending.pop(0).wait()

    def browse(self):
        """The command that shows the run, for a local store."""
        if self.uri.startswith(("sqlite:", "file:")) or "://" not in self.uri:
            return f"mlflow ui --backend-store-uri {shlex.quote(self.uri)}     # the UI needs: pip install mlflow"
        return f"open {self.uri}"


def mlflow_client(run_dir):
    """(mlflow, a client, its tracking URI): MLFLOW_TRACKING_URI, else the local store beside the project."""
    for key, value in MLFLOW_PATIENCE.items():
        os.environ.setdefault(key, value)
    import mlflow

    for noisy in ("mlflow", "alembic"):  # its store's set-up lines, after its import sets them; errors still show
        logging.getLogger(noisy).setLevel(logging.WARNING)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or default_mlflow_uri(run_dir)
    return mlflow, mlflow.MlflowClient(uri), uri


def mlflow_experiment(client, uri, name):
    """MLFLOW_EXPERIMENT_ID, or the id of the experiment MLFLOW_EXPERIMENT_NAME or name, made if new: in a SQLite
    store with its files beside the database (mlartifacts/; MLflow's default is ./mlruns wherever the run starts)."""
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or name
    experiment = client.get_experiment_by_name(name)
    if experiment:
        return experiment.experiment_id
    database = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
    files = (Path(database).parent / "mlartifacts").resolve().as_uri() if database else None
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, artifact_location=files)
    except MlflowException as e:  # another process made it since (runs starting together): take theirs
        if e.error_code == "RESOURCE_ALREADY_EXISTS" and (experiment := client.get_experiment_by_name(name)):
            return experiment.experiment_id
        raise


def log_params(mlflow, client, run_id, params):
    """Log params (name -> value) in MLflow's batches, lists as YAML writes them inline ([0.08, 1.0])."""
    batch = [mlflow.entities.Param(k, param_text(v)) for k, v in params.items()]
    for i in range(0, len(batch), PARAMS_PER_CALL):
        client.log_batch(run_id, params=batch[i:i + PARAMS_PER_CALL])


class MLflowSweep:
    """tune.py's record in MLflow: a parent run for the sweep (named after it, its fixed recipe and space as
    parameters, the best score so far as a metric by trial number), and for each trial a child run that the trial's
    train.py records into (MLFLOW_RUN_ID), tagged with its number and, at its end, its state (COMPLETE, PRUNED,
    FAIL). parent_id: the sweep's parent run, which every worker shares (the study keeps it); where this worker's
    MLflow does not hold it (machines with a store each: MLFLOW_TRACKING_URI not shared), a parent run of its own."""

    def __init__(self, sweep, params, parent_id=None):
        self.mlflow, self.client, self.uri = mlflow_client(sweep)  # beside the project: runs/ for runs/tune
        self.experiment = mlflow_experiment(self.client, self.uri, sweep.parent.name)
        if parent_id is not None:
            try:
                self.client.get_run(parent_id)
            except self.mlflow.exceptions.MlflowException:  # RESOURCE_DOES_NOT_EXIST: another machine's store
                parent_id = None
        if parent_id is None:
            parent_id = self.client.create_run(self.experiment, run_name=sweep.name).info.run_id
            log_params(self.mlflow, self.client, parent_id, params)
        self.parent_id = parent_id

    def trial_env(self, trial, name):
        """The environment of an Optuna trial's train.py, which records into the trial's child run: its first try's
        for a retried trial (the trial's user attrs keep it), else a new one named `name` (its run folder's)."""
        run_id = trial.user_attrs.get("mlflow_run")
        if run_id is None:
            tags = {"mlflow.parentRunId": self.parent_id, "trial": str(trial.number)}
            run_id = self.client.create_run(self.experiment, run_name=name, tags=tags).info.run_id
            trial.set_user_attr("mlflow_run", run_id)
        return {**os.environ, "MLFLOW_TRACKING_URI": self.uri, "MLFLOW_RUN_ID": run_id}

    def trial_ended(self, trial, state, value=None):
        """A trial's end: its state on its child run (ended FAILED where its train.py could not end it), and a
        finished trial's score on the parent (metric 'value', at the trial's number). A failure here is one line."""
        try:
            run_id = trial.user_attrs["mlflow_run"]
            self.client.set_tag(run_id, "trial_state", state)
            if self.client.get_run(run_id).info.status == "RUNNING":
                self.client.set_terminated(run_id, "FAILED" if state == "FAIL" else "KILLED")
            if value is not None:
                self.client.log_metric(self.parent_id, "value", value, step=trial.number)
        except Exception as e:
            LOGGER.warning(f"log.to: MLflow did not record trial {trial.number}'s end ({first_line(e)})")

    def end(self, best, files):
        """The sweep's end: its best trial's number and score, and files (trials.csv, best.yaml, plots)."""
        self.client.set_tag(self.parent_id, "best_trial", str(best.number))
        self.client.log_metric(self.parent_id, "best_value", best.value)
        for path in files:
            self.client.log_artifact(self.parent_id, str(path))
        self.client.set_terminated(self.parent_id, "FINISHED")



def sweep_environment(names, sweep):
    """W&B's grouping of a sweep's trials: group after the sweep, project after tune.py's project folder (tune),
    unless WANDB_RUN_GROUP and WANDB_PROJECT say; returns (project, group), or None without W&B."""
    if "wandb" not in names:
        return None
    os.environ.setdefault("WANDB_RUN_GROUP", sweep.name)
    os.environ.setdefault("WANDB_PROJECT", sweep.parent.name)
    return os.environ["WANDB_PROJECT"], os.environ["WANDB_RUN_GROUP"]


def param_text(value):
    """A parameter's value as MLflow keeps it (text): lists and dicts as YAML inline, the rest as str()."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip() if isinstance(value, (list, dict)) \
        else str(value)


def default_mlflow_uri(run_dir):
    """The local store beside the project's folder: sqlite:///runs/mlflow.db for runs/train/exp, shared by train.py's
    and tune.py's runs (three slashes and a relative path, or four and an absolute one)."""
    return f"sqlite:///{(run_dir.parent.parent / 'mlflow.db').as_posix()}"


class WandbRun:
    """A Weights & Biases run, with its usual environment (WANDB_PROJECT, WANDB_MODE=offline with no account and no
    network, WANDB_RUN_GROUP, WANDB_DIR, WANDB_NAME, ...); by default project after the project folder (train), name
    after the run, its files in the run's folder (runs/train/exp/wandb/)."""

    key, label = "wandb", "W&B"

    def __init__(self, run_dir, params, run_id=None):
        import wandb

        settings = wandb.Settings(silent=True, init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT",
                                                                                  WANDB_INIT_SECONDS)))
        given = {"project": run_dir.parent.name, "name": run_dir.name, "dir": str(run_dir)}
        env = {"project": "WANDB_PROJECT", "name": "WANDB_NAME", "dir": "WANDB_DIR"}
        given = {k: v for k, v in given.items() if not os.environ.get(env[k])}  # W&B reads those itself
        self.run = wandb.init(id=os.environ.get("WANDB_RUN_ID") or run_id,
                              resume="allow", config=params, settings=settings, **given)
        self.wandb = wandb

    @property
    def id(self):
        return self.run.id

    def where(self):
        return f"W&B run {self.run.id} ({self.run.settings.mode}) in {self.run.dir.removesuffix('/files')}"

    def log(self, metrics, step):
        self.run.log(dict(metrics), step=step)

    def upload(self, paths):
        """Copy files into the run's files folder, which W&B uploads with the run (run.save would link them); none
        with WANDB_MODE=disabled."""
        for path in paths if self.run.settings.mode != "disabled" else []:
            shutil.copy2(path, Path(self.run.dir) / Path(path).name)

    def end(self, status):
        self.run.summary["status"] = status
        self.run.finish(exit_code={"finished": 0, "stopped": 143, "failed": 1}[status])

    def browse(self):
        if self.run.settings.mode == "offline":  # every launch's folder of the run, a resumed run's too
            folder = Path(self.run.dir).parent
            return f"wandb sync {shlex.quote(str(folder.parent))}/offline-run-*-{self.run.id}"
        return f"open {self.run.url}" if self.run.settings.mode != "disabled" else None


OPENERS = {"mlflow": MLflowRun, "wandb": WandbRun}
