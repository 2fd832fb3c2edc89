"""Runs recorded in MLflow and W&B (log.to), read back as their users read them: MLflow through its client from the
local store, W&B from an offline run's own files; and the progress a log file shows. A sweep's record in MLflow is
tested with the sweep it records, in tests/test_tune.py."""

import io
import os
import struct
from pathlib import Path

import pytest
import yaml

from tests.conftest import closed_port, read_results, run_python, run_torchrun, step_losses

mlflow = pytest.importorskip("mlflow")
TRAIN = ("--recipe", "cls.yaml")  # digits: 1437 training images, batch 48: 30 steps an epoch
STEPS = 30


def flat(tree, prefix=""):
    """recipe.yaml's keys flattened as the trackers name them ({'optim': {'lr': 0.1}} -> {'optim.lr': 0.1})."""
    out = {}
    for key, value in tree.items():
        out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def as_mlflow_param(value):
    """A recipe value as MLflow shows the parameter: lists as YAML inline ([0.08, 1.0]), the rest as str()."""
    return yaml.safe_dump(value, default_flow_style=True).strip() if isinstance(value, list) else str(value)


def assert_same_figures(history, run_dir):
    """history: {metric: {step: value}}. Every results.csv figure is there once, at its epoch's last step (blank
    cells: not logged), and train/loss_step is TensorBoard's, step for step."""
    header, rows = read_results(run_dir)
    for row in rows:
        step = int(row["epoch"]) * STEPS
        for name in header:
            if row[name]:
                assert history[name][step] == pytest.approx(float(row[name]), rel=1e-5), (name, step)
            else:
                assert step not in history.get(name, {}), name
    assert sorted({s for values in history.values() for s in values if s % STEPS == 0}) == [
        int(row["epoch"]) * STEPS for row in rows]
    assert history["train/loss_step"] == pytest.approx(step_losses(run_dir))


def mlflow_history(client, run_id, names):
    """{metric: {step: value}}, failing where a step holds two values (a resumed run logging a step again)."""
    history = {}
    for name in names:
        points = client.get_metric_history(run_id, name)
        assert len({m.step for m in points}) == len(points), f"{name}: a step logged twice"
        history[name] = {m.step: m.value for m in points}
    return history


@pytest.mark.slow
def test_a_run_under_torchrun_is_one_mlflow_run_that_a_resume_continues(tmp_path):
    """Two processes, stopped by SIGTERM in epoch 2 and resumed: one MLflow run (not one per rank) in the local
    store beside the project, every results.csv figure at TensorBoard's steps, the recipe as its parameters, the
    plots, recipe.yaml and best.pt (log.weights=true, set on resume) as artifacts, KILLED while stopped and FINISHED
    at the end."""
    project = tmp_path / "runs" / "train"
    stopped = run_torchrun("tests/faults.py", "signal-at-step:40:SIGTERM", "train.py", *TRAIN, f"project={project}",
                           "train.epochs=3", "log.to=[tensorboard,mlflow]")
    assert "exitcode  : 143" in stopped.stderr and "Stopped at epoch 2, step" in stopped.stdout, stopped.stderr[-3000:]
    assert "MLflow run " in stopped.stdout and f"at sqlite:///{tmp_path / 'runs' / 'mlflow.db'}" in stopped.stdout
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("train").experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "KILLED"

    resumed = run_python("train.py", "--resume", project / "exp", "log.weights=true")  # best.pt uploaded too
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'runs' / 'mlflow.db'}" in resumed.stdout
    (run,) = client.search_runs([client.get_experiment_by_name("train").experiment_id])  # still the one run
    assert run.info.status == "FINISHED"
    run_dir = project / "exp"
    header, rows = read_results(run_dir)
    assert len(rows) == 3
    assert_same_figures(mlflow_history(client, run.info.run_id, [*header, "train/loss_step"]), run_dir)
    recipe = flat(yaml.safe_load((run_dir / "recipe.yaml").read_text()))
    recipe["log.weights"] = False  # MLflow keeps a parameter's first value; the resume set it true
    assert run.data.params == {key: as_mlflow_param(value) for key, value in recipe.items()}
    assert run.data.params["log.to"] == "[tensorboard, mlflow]" and run.data.params["data.scale"] == "[1.0, 1.0]"
    assert run.data.tags["mlflow.source.name"].endswith("train.py")  # MLflow's own tags of where a run came from
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"results.png", "recipe.yaml",
                                                                          "confusion_matrix.png", "best.pt"}
    files = tmp_path / "runs" / "mlartifacts"  # beside the store, not ./mlruns wherever train.py started
    assert client.get_experiment_by_name("train").artifact_location == files.as_uri()
    assert (files / run.info.run_id / "artifacts" / "results.png").is_file()


@pytest.mark.slow
def test_an_mlflow_server_that_is_down_costs_one_line_or_refuses_when_required(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{closed_port()}")
    result = run_python("train.py", *TRAIN, f"project={tmp_path}", "train.epochs=1", "log.to=[tensorboard,mlflow]")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    said = [line for line in (result.stdout + result.stderr).splitlines() if "MLflow" in line]
    assert said == [f"log.to: MLflow cannot record this run (at {os.environ['MLFLOW_TRACKING_URI']}: [Errno 111] "
                    f"Connection refused); training on without it (log.required=true refuses to start instead)"]
    assert len(read_results(tmp_path / "exp")[1]) == 1 and "mlflow ui" not in result.stdout

    required = run_python("train.py", *TRAIN, f"project={tmp_path}", "train.epochs=1", "log.to=[tensorboard,mlflow]",
                          "log.required=true")
    assert required.returncode == 2
    assert "train.py: error: log.to: MLflow cannot record this run (at http://127.0.0.1:" in required.stderr
    assert "and log.required=true; fix it, or set log.required=false to train on without it" in required.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # the refused run left no folder


def wandb_records(path):
    """The records of a W&B run file (run-ID.wandb): LevelDB's log format, in 32 KiB blocks after a 7-byte header,
    each record a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data, records, pos, record = Path(path).read_bytes(), [], 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        record = data[pos + 7:pos + 7 + length] if kind in (1, 2) else record + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a record whole, or its last part
            records.append(wandb_internal_pb2.Record.FromString(record))
    return records


@pytest.mark.slow
def test_wandb_offline_records_a_run_and_its_resume_as_one_run(tmp_path, monkeypatch):
    """WANDB_MODE=offline (no account, no network): the run's files under its folder's wandb/, read back: the
    recipe as its config, every results.csv figure at TensorBoard's steps, the files, status finished; a resume
    goes on with the same run id. log.to without tensorboard writes no events."""
    import json

    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_PROJECT", "WANDB_DIR", "WANDB_RUN_ID", "WANDB_NAME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(name, raising=False)
    first = run_python("train.py", *TRAIN, f"project={tmp_path}", "train.epochs=2", "log.to=[wandb,tensorboard]")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    again = run_python("train.py", "--resume", tmp_path / "exp", "train.epochs=3")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    run_dir = tmp_path / "exp"
    tries = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(tries) == 2 and f"wandb sync {run_dir / 'wandb'}/offline-run-*-{tries[0].name[-8:]}" in again.stdout
    history, ids, config, summary = {}, set(), {}, {}
    for folder in tries:
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "history":  # 'val/top1' is kept as the nested key ['val', 'top1']
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        assert step not in history.setdefault(key, {}), (key, step)
                        history[key][step] = json.loads(item.value_json)
            elif kind == "summary":
                summary.update({i.key: json.loads(i.value_json) for i in record.summary.update if i.key})
    assert len(ids) == 1
    assert len(read_results(run_dir)[1]) == 3
    assert_same_figures(history, run_dir)
    recipe = flat(yaml.safe_load((run_dir / "recipe.yaml").read_text()))
    assert {k: v for k, v in config.items() if k != "_wandb"} == recipe  # train.epochs=3 as resumed
    assert summary["status"] == "finished"
    assert {"results.png", "recipe.yaml", "confusion_matrix.png"} <= {p.name for p in (tries[1] / "files").iterdir()}

    monkeypatch.setenv("WANDB_MODE", "disabled")  # W&B's own off switch: nothing recorded, nothing said to fail
    alone = run_python("train.py", *TRAIN, f"project={tmp_path}", "train.epochs=1", "log.to=[wandb]")
    assert alone.returncode == 0 and not list((tmp_path / "exp2").glob("events.out.tfevents.*"))
    assert "tensorboard --logdir" not in alone.stdout and "TensorBoard" not in alone.stdout
    assert "failed" not in alone.stdout + alone.stderr and "wandb sync" not in alone.stdout


def test_a_tracker_that_is_not_installed_is_refused_with_the_pip_command(monkeypatch):
    import importlib.util

    from utils.config import RecipeError, load_recipe

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    with pytest.raises(RecipeError, match=r"log.to must be loggers that are installed \(wandb needs wandb, an optional "
                                          r"extra not installed here: pip install -r requirements-track.txt\)"):
        load_recipe("cls.yaml", ["log.to=[tensorboard,wandb]"])
    load_recipe("cls.yaml", ["log.to=[tensorboard,mlflow]"])


def test_output_to_a_file_shows_a_progress_line_within_an_epoch(monkeypatch, log):
    """A log file (nohup, SLURM) gets a plain line every PROGRESS_SECONDS: the step, the bar's loss and speed,
    and the time left in the epoch."""
    import utils.loggers as loggers

    clock = iter(range(0, 1000, 10))  # each step takes 10 s
    monkeypatch.setattr(loggers.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(loggers.sys, "stderr", io.StringIO())  # not a terminal, as under pytest -s it would be
    bar, reads = loggers.progress(range(10), "2/10", 2, 12), []
    for _ in bar:  # steps 3 to 12 of 12; the body is the step
        if not bar.disable:  # as EpochLoss.show reads the loss (a sync on a GPU): only for the step before a line
            reads.append(bar.n + 1)
            bar.set_postfix_str("loss 0.5000  96 img/s")
    lines = [r.getMessage() for r in log.records]
    assert lines == ["epoch 2/10: step 5/12, loss 0.5000  96 img/s, 1m 10s left in the epoch",
                     "epoch 2/10: step 8/12, loss 0.5000  96 img/s, 40s left in the epoch",
                     "epoch 2/10: step 11/12, loss 0.5000  96 img/s, 10s left in the epoch"]
    assert reads == [5, 8, 11]
