"""A run's directory over its life: made for a new run, found again for --resume or after a torchrun restart
of the workers, and the commands printed for what comes next (resume, val, predict, export)."""

import argparse
import glob
import hashlib
import json
import os
import shlex
import shutil
import socket
import sys
from pathlib import Path

from omegaconf import OmegaConf

import utils.distributed
from utils.checkpoint import find_resume_checkpoint, load_training_checkpoint, run_dir_of
from utils.config import (MACHINE_KEYS, Recipe, RecipeError, check_resumable, differing_keys, flag_as_key,
                          keys_help, load_recipe, load_resumed_recipe, parse_overrides, recipe_to_yaml)
from utils.distributed import gather_object, on_rank0, when_failing
from utils.general import (LOCAL_WORLD_SIZE, LOGGER, RANK, RESTART_COUNT, RUN_ID, WORLD_SIZE, SharedError, UsageError,
                           colorstr, increment_path, script, short_path)
from utils.metrics import BEST_METRIC_NAMES


def parse_args(argv=None):
    """--recipe NAME or --resume [PATH], --project and --name (the recipe keys project and name, spelled as val.py
    and predict.py spell them), and key=value overrides; any other --flag that names a recipe key (--epochs 3) is
    refused with the key=value that sets it."""
    parser = argparse.ArgumentParser(description="Train an image classifier from a recipe.", epilog=keys_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", help="recipe path, or a name in recipes/ (default: cls.yaml)")
    parser.add_argument("--resume", nargs="?", const="", metavar="PATH",
                        help="continue a run exactly: a checkpoint, a run directory, or (no PATH) the newest run "
                             "under project; the recipe comes from the checkpoint")
    parser.add_argument("--check", action="store_true",
                        help="check the recipe, data and model as a run would, then exit without training or "
                             "writing a run (tune.py checks a sweep's recipe so)")
    for key, what in (("project", "runs go to PROJECT/NAME"), ("name", "run name, incremented (exp, exp2, ...)")):
        parser.add_argument(f"--{key}", help=f"the same as the recipe key {key}={key.upper()} (val.py and predict.py "
                                             f"take --{key} too): {what}")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. optim.lr=0.05")
    words = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_intermixed_args(words)  # key=value after a --flag VALUE too
    if hint := flag_as_key(words, unknown):
        raise RecipeError(hint)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.resume and "=" in args.resume and not Path(args.resume).exists():  # `--resume key=value`: no PATH
        args.overrides.insert(0, args.resume)
        args.resume = ""
    for key, value in (("project", args.project), ("name", args.name)):
        given = [item for item in args.overrides if item.partition("=")[0] == key]
        if value is not None and given:
            raise RecipeError(f"--{key} {value} and {given[0]} both set {key}; give one")
        args.overrides += [] if value is None else [f"{key}={value}"]
    return args


def prepare_run(args, model_check=None, settle=None):
    """(recipe, run directory or None for a new one, (checkpoint path, checkpoint) or None) for this launch: a new
    run, an explicit --resume, or this torchrun job's own run after torchrun restarted the workers. model_check
    (models.check_model_name) checks model.name with the rest of the recipe; settle (recipe -> recipe, the same for a
    settled one: models.pretrained.follow_weights, then utils.precision.settle_auto) fills in what the recipe leaves
    to its pretrained weights and to the hardware, before a restarted run's recipe is compared with the one it
    saved."""
    if args.resume is not None:
        if args.recipe:
            raise SharedError("--resume takes the recipe from the checkpoint: leave out --recipe (key=value "
                              "overrides may still extend train.epochs, or change data.workers or device)")
        project = parse_overrides(args.overrides).get("project", Recipe.project)
        run_dir, path, ckpt = on_rank0(read_resume, args.resume, project)
        cfg = check_same_recipe(load_resumed_recipe(ckpt["recipe"], args.overrides, source=path,
                                                    model_check=model_check))
        check_unfinished(path, ckpt, cfg.train)  # before any data is read
        return settle(cfg) if settle else cfg, Path(run_dir), (path, ckpt)
    cfg = check_same_recipe(load_recipe(args.recipe or "cls.yaml", args.overrides, model_check=model_check))
    cfg = settle(cfg) if settle else cfg
    on_rank0(check_project, cfg.project)  # before the data is read: that may take minutes
    if RESTART_COUNT:  # torchrun restarted the workers after a failure: continue this job's run where it stopped
        run_dir, path, ckpt = on_rank0(read_restarted_run, cfg.project, cfg.name)
        if ckpt is not None:
            saved = load_resumed_recipe(ckpt["recipe"], source=path, model_check=model_check)
            check_resumable(saved, cfg, "the recipe on restart", own=MACHINE_KEYS)
            check_unfinished(path, ckpt, cfg.train)
        LOGGER.info(f"torchrun restart {RESTART_COUNT}: continuing {run_dir or 'a new run'} "
                    f"{'from ' + path if path else 'from the start'}")
        return cfg, run_dir and Path(run_dir), (path, ckpt) if ckpt is not None else None
    return cfg, None, None


def check_same_recipe(cfg):
    """cfg, if every rank holds the same recipe as rank 0 but for MACHINE_KEYS (before settle, whose collectives
    depend on it): machines started with another override or recipe file would train apart, as DDP averages the
    gradients of ranks on any schedule. Else a SharedError, raised on every rank, naming the first key that differs
    and the first rank where it does."""
    recipe = OmegaConf.to_container(cfg)
    for key in MACHINE_KEYS:  # each machine's own
        section, _, name = key.rpartition(".")
        (recipe[section] if section else recipe).pop(name)
    digests = gather_object(hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest())
    if len(set(digests)) == 1:
        return cfg
    recipes, hosts = zip(*gather_object((recipe, utils.distributed.HOST)))  # every rank saw the same digests
    rank = next(r for r, digest in enumerate(digests) if digest != digests[0])
    keys = differing_keys(recipes[rank], recipes[0])  # of both: another version of the code may have other keys
    if not keys:
        raise SharedError(f"the ranks were started with different recipes: rank {rank} on {hosts[rank]}'s differs "
                          f"from rank 0's on {hosts[0]}; start every machine with the same command and code")
    (first, value, value0), more = keys[0], f" (and {len(keys) - 1} other key(s))" if len(keys) > 1 else ""
    raise SharedError(f"the ranks were started with different recipes: rank {rank} on {hosts[rank]} has "
                      f"{first}={value!r}, rank 0 on {hosts[0]} {first}={value0!r}{more}; start every machine with the "
                      f"same command")



def check_project(project):
    """Rank 0: a UsageError unless the run directory can be made under project (a folder, or a path to create)."""
    path = Path(project)
    there = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not there.is_dir():
        raise UsageError(f"project={project!r}: {short_path(there)} is a file, not a folder; give another project")
    if not os.access(there, os.W_OK | os.X_OK):
        raise UsageError(f"project={project!r}: cannot create runs in {short_path(there)}: permission denied; give "
                         f"another project")


def read_resume(resume, project):
    """Rank 0: (run directory, checkpoint path, checkpoint) for --resume."""
    path = find_resume_checkpoint(resume, project)
    ckpt = load_training_checkpoint(path)
    check_latest(path, ckpt)
    return str(short_path(run_dir_of(path))), str(path), ckpt  # as typed: relative where it lies below here


def read_restarted_run(project, name):
    """Rank 0: (run directory, last.pt path, checkpoint) of this torchrun job's run, Nones where there is none."""
    runs = [d for d in Path(project).glob(f"{glob.escape(name)}*") if (d / ".torchrun_id").is_file()]
    for run_dir in sorted(runs, key=lambda d: d.stat().st_mtime, reverse=True):
        if (run_dir / ".torchrun_id").read_text() == job_id():
            last = run_dir / "weights" / "last.pt"
            return (str(run_dir), str(last), load_training_checkpoint(last)) if last.exists() else (str(run_dir),
                                                                                                   None, None)
    return None, None, None


def job_id():
    """What tells this torchrun job from any other: its run id, or under static rendezvous (--master-addr and
    --master-port without --rdzv-id), where every job's run id is 'none', the launching agent (host and process),
    which stays the same across its restarts and holds rank 0 on node 0."""
    if RUN_ID != "none":
        return RUN_ID
    return f"none:{socket.gethostname()}:{os.getppid()}"


def check_latest(path, ckpt):
    """--resume continues a run only from its latest state: not from best.pt's EMA weights, and not from an older
    checkpoint, which would rewind the run (drop later results and overwrite last.pt)."""
    last = run_dir_of(path) / "weights" / "last.pt"
    if ckpt.get("model_source", "training") != "training":
        raise UsageError(f"--resume {path}: it holds the EMA of the weights (a best.pt), not the training state; "
                         f"resume from {last}")
    if last.is_file() and not last.samefile(path):
        latest = load_training_checkpoint(last)
        if (latest["epoch"], latest["step"]) != (ckpt["epoch"], ckpt["step"]):
            raise UsageError(f"--resume {path}: not the run's latest state (saved {saved_at(ckpt)}, {last} "
                             f"{saved_at(latest)}); resuming from it would rewind the run. Resume from {last}, or "
                             f"start a new run from its weights with model.weights={path}")


def check_unfinished(path, ckpt, train):
    """Refuse to resume a run with nothing left to train under its train.epochs and train.patience (as the recipe
    says, overrides included)."""
    if done := run_done(ckpt, train):
        way_on = f"train.epochs=N (N > {ckpt['epoch']})" if (ckpt["epoch"], ckpt["step"]) >= (train.epochs, 0) else \
            f"train.patience=N (N > {ckpt['epoch'] - ckpt['best_epoch']}) or train.patience=0"  # out of patience
        raise SharedError(f"{path}: the run {done}; to train longer, resume with {way_on}")


def run_done(ckpt, train):
    """How a run whose latest checkpoint is ckpt has ended under the recipe's train section (epochs, patience), in
    words; None while it has epochs to train. A run that ran out of patience is done: resumed, it would train one
    more epoch and stop again."""
    at, waited = (ckpt["epoch"], ckpt["step"]), ckpt["epoch"] - ckpt.get("best_epoch", ckpt["epoch"])
    epochs, patience = train.epochs, train.patience
    if at == (epochs, 0):
        return f"has already trained all {epochs} epoch{'s' * (epochs != 1)}"
    if at > (epochs, 0):
        return f"is already past train.epochs={epochs} (saved {saved_at(ckpt)})"
    if patience and not ckpt["step"] and waited >= patience:
        return (f"ran out of patience after epoch {ckpt['epoch']}: no better val score in {waited} "
                f"epoch{'s' * (waited != 1)} since its best, at epoch {ckpt['best_epoch']} (train.patience={patience})")
    return None


def saved_at(ckpt):
    """Where in its run a checkpoint was saved, in a few words."""
    return f"at epoch {ckpt['epoch'] + 1}, step {ckpt['step']}" if ckpt["step"] else f"after epoch {ckpt['epoch']}"


def make_run_dir(cfg):
    """Rank 0 claims project/name (exp, exp2, ...) and saves the resolved recipe there; every rank gets the path. A
    run that fails before its first checkpoint leaves nothing behind (remove_if_unsaved)."""
    def claim():
        try:
            run_dir = increment_path(Path(cfg.project) / cfg.name, mkdir=True)
            (run_dir / "weights").mkdir()
            (run_dir / "recipe.yaml").write_text(recipe_to_yaml(cfg))
            if RUN_ID is not None:  # lets a torchrun restart of this job find its run
                (run_dir / ".torchrun_id").write_text(job_id())
        except OSError as e:
            raise UsageError(f"project={cfg.project!r} name={cfg.name!r}: cannot create the run directory: "
                             f"{e}") from None
        return str(run_dir)
    run_dir = Path(on_rank0(claim))
    when_failing(lambda: remove_if_unsaved(run_dir))
    return run_dir


def remove_if_unsaved(run_dir):
    """Rank 0, for a new run that fails: remove its directory unless it holds a checkpoint, so that a run which saved
    nothing leaves nothing (no TensorBoard entry, no run for --resume to find)."""
    if RANK == 0 and run_dir.is_dir() and not any((run_dir / "weights").glob("*.pt")):
        shutil.rmtree(run_dir, ignore_errors=True)


def resumed_run_dir(run_dir, cfg):
    """The run directory a resumed run continues in; rank 0 saves the (possibly extended) recipe there."""
    def update():
        (run_dir / "weights").mkdir(exist_ok=True)
        (run_dir / "recipe.yaml").write_text(recipe_to_yaml(cfg))
    on_rank0(update)
    return run_dir


def resume_command(run_dir):
    """The command that continues this run from its last checkpoint, launched as this one was."""
    run_dir = shlex.quote(str(run_dir))
    if RUN_ID is None:
        return f"python {script('train.py')} --resume {run_dir}"
    nodes = WORLD_SIZE // LOCAL_WORLD_SIZE
    extra = f" --nnodes={nodes} (and this launch's --rdzv options, on every node)" if nodes > 1 else ""
    return f"torchrun --nproc_per_node={LOCAL_WORLD_SIZE}{extra} {script('train.py')} --resume {run_dir}"


def next_steps(run_dir, state, seconds, held_out, started_at=(0, 0), viewers=None):
    """The end of a run: what this launch trained in how long, where the results are, the best score, and the
    commands that use them. held_out: the folder of the val images alone, or None where they lie among the
    training images (data.val_split, a CSV list) or are not files; started_at: the (epoch, step) this launch
    started from, a resumed run's; viewers: the commands that show its record (RunLogger.close), by default
    TensorBoard's."""
    viewers = [f"tensorboard --logdir {shlex.quote(str(run_dir.parent))}"] if viewers is None else viewers
    best = shlex.quote(str(run_dir / "weights" / "best.pt"))  # pasted into a shell as printed
    epochs = state.epoch - started_at[0]
    resumed = f", resumed at epoch {started_at[0] + 1}, step {started_at[1]}; {state.epoch} in all" if any(
        started_at) else ""
    source = shlex.quote(str(short_path(held_out))) if held_out else "path/to/new_images"
    plots = "results.png, " if (run_dir / "results.png").exists() else ""  # not with log.plots=false
    events = "TensorBoard events, " if any(viewer.startswith("tensorboard ") for viewer in viewers) else ""
    return (f"\n{epochs} epoch{'s' * (epochs != 1)} in {seconds:.1f}s{resumed}. Results saved to "
            f"{colorstr('bold', str(run_dir))} (results.csv, {plots}{events}weights/)\n"
            f"Best {BEST_METRIC_NAMES[state.best_metric]} {state.best_score:.2%} at epoch {state.best_epoch}: {best}\n"
            f"Next:\n"
            + "".join(f"  {viewer}\n" for viewer in viewers) +
            f"  python {script('val.py')} --weights {best}\n"
            f"  python {script('predict.py')} --weights {best} --source {source}"
            f"{'' if held_out else '     # a folder of new images'}\n"
            f"  python {script('export.py')} --weights {best} --format onnx")


def end_stopped(logger, run_dir, epoch, step, steps):
    """Every rank agreed to stop on a signal, and last.pt holds where the run is: rank 0's record (logger, None on
    the others) ends as stopped, and it says how to resume. Returns None, train()'s value for a stopped run."""
    if logger:
        logger.close("stopped")
    LOGGER.info(stopped_message(run_dir, epoch, step, steps))


def stopped_message(run_dir, epoch, step, steps):
    """What to say when every rank agreed to stop on a signal and last.pt holds where the run is."""
    where = f"at epoch {epoch + 1}, step {step}/{steps}" if step else f"after epoch {epoch} and its validation"
    return (f"\nStopped {where}; saved {run_dir / 'weights' / 'last.pt'}. Resume with:\n  {resume_command(run_dir)}")
