"""Shared fixtures: tiny ImageFolders and launchers for train.py as one process or under torchrun."""

import contextlib
import csv
import gc
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

# The suite runs more threads than cores (two xdist workers, each starting train.py, torchrun's ranks, DataLoader
# workers), and OpenMP's threads that spin while they wait for work take the cores from the threads that have work:
# 2 to 4 short runs at once on 2 cores took up to 6x as long spinning, the suite 8% longer. Set before torch loads
# OpenMP, for this process and every one it starts; a run alone on its cores spins (faster there).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from utils.checkpoint import load_checkpoint  # noqa: E402

# Float rounding, for the runs of launch_n_invariance, where the equivalent computations agree to their last bits: one
# float32 unit in the last place of a number near 1 (weights, losses).
ROUNDING_FLOOR = torch.finfo(torch.float32).eps
# Each step starts from the previous steps' rounding, so differences grow with the steps, and unevenly: over these
# runs' 4 steps N=2 and 3 measured within 2x of the spread, where 24 steps of cls.yaml at batch 60 reach 15x in a late
# step's loss (while the same runs in float64 agree to 1e-15): a bound for short runs like these.
AMPLIFICATION = 10


def pytest_configure(config):
    """Register the cuda mark (tests that need a GPU: python -m pytest -m cuda). Without -m cuda, the suite tests the
    CPU (gloo) path, as CI runs it, also on a machine with GPUs: two processes on one GPU are not a launch nccl
    supports, and device=auto would pick CUDA. Set before torch first looks for a GPU."""
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; run with python -m pytest -m cuda")
    config.addinivalue_line("markers", "slow: launches training processes (most run torchrun); the edit-test loop "
                                       "skips them with python -m pytest -m 'not slow'")
    markexpr = config.option.markexpr or ""
    if "cuda" not in markexpr or "not cuda" in markexpr:  # -m "not cuda" tests the CPU path too
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist would order modules by their count of tests
        config.option.loadscopereorder = False  # instead of LONGEST_FIRST's


# The modules that take longest, longest first (their tests' time added up under -n 2, measured on 2026-11-28): with
# -n --dist loadfile (pytest-xdist) each worker takes the next module in this order as it frees, so the modules that
# end the run are short ones and no worker waits long for the other at the end. The rest, each under about 30 s,
# follow in collection order.
LONGEST_FIRST = ["test_tune.py", "test_resume.py", "test_commands.py", "test_multilabel.py", "test_shards.py",
                 "test_train.py", "test_recipes.py", "test_shard_faults.py", "test_rank_errors.py", "test_trackers.py",
                 "test_jpeg_cache.py", "test_pretrained.py", "test_n_invariance.py", "test_torchrun_summary.py",
                 "test_layouts.py", "test_val_predict_export.py", "test_bad_data.py", "test_checkpoint.py"]


def pytest_collection_modifyitems(config, items):
    """Order the modules longest first (LONGEST_FIRST), the rest as collected; the tests within a module keep their
    order."""
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # stable


def pytest_collection_finish(session):
    """Freeze what collection made (the modules imported, torch's among them, and the tests), as the scripts freeze
    their imports (utils/general.after_imports): it lives through the session, and the collections while the tests
    run, 15% of a worker's CPU before, no longer traverse it."""
    gc.freeze()


def make_image_folder(root, counts, size=12, seed=0):
    """Write an ImageFolder of random RGB PNGs: counts = {'train': {'cat': 5, ...}, 'val': {...}}."""
    rng = np.random.default_rng(seed)
    for split, classes in counts.items():
        for name, n in classes.items():
            folder = Path(root) / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    return Path(root)


@pytest.fixture
def image_folder(tmp_path):
    """Factory for tiny ImageFolders under tmp_path."""
    return lambda counts, **kw: make_image_folder(tmp_path / "data", counts, **kw)


@pytest.fixture
def log(caplog):
    """caplog that also sees LOGGER, which prints through its own handler and does not propagate."""
    from utils.general import LOGGER

    LOGGER.addHandler(caplog.handler)
    yield caplog
    LOGGER.removeHandler(caplog.handler)


def clean_env():
    """The environment without torchrun's variables, so a child is one process unless launched by torchrun."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # packages too
    return env


def run_python(*args, cwd=ROOT, timeout=600):
    """Run `python ARGS` from the repository root in a session of its own (a fault may kill its whole process
    group); return the CompletedProcess (output captured as text)."""
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout, start_new_session=True)


# torchrun's own main(), as its command calls it, started as the project's scripts start (before_imports,
# after_imports): half a second of CPU less for each of the suite's many launches.
TORCHRUN = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from utils.general import after_imports, before_imports; "
            "before_imports(); from torch.distributed.run import main; after_imports(); main()")


def run_torchrun(*args, nproc=2, cwd=ROOT, timeout=600, launcher=("--standalone",)):
    """Run `torchrun --standalone --nproc_per_node=nproc ARGS`; return the CompletedProcess."""
    return run_python("-c", TORCHRUN, *launcher, f"--nproc_per_node={nproc}", *args, cwd=cwd, timeout=timeout)


def launch_n_invariance(base, data, *options):
    """tests/n_invariance.py on data at N=1 on two threads, on one, and in three micro-batches (as N=3 splits each
    global batch), N=2 and N=3, each into a project under base; returns {'1': project, '1, one thread': ...,
    '1, accumulate 3': ..., '2': ..., '3': ...}."""
    launches = {"1": lambda p: run_python("tests/n_invariance.py", p, data, *options),
                "1, one thread": lambda p: run_python("tests/n_invariance.py", p, data, "one-core", *options),
                "1, accumulate 3": lambda p: run_python("tests/n_invariance.py", p, data, "accumulate=3", *options),
                "2": lambda p: run_torchrun("tests/n_invariance.py", p, data, *options, nproc=2),
                "3": lambda p: run_torchrun("tests/n_invariance.py", p, data, *options, nproc=3)}
    projects = {}
    for name, launch in launches.items():
        projects[name] = base / name.replace(", ", "-").replace(" ", "")
        result = launch(projects[name])
        assert result.returncode == 0, name + result.stdout[-2000:] + result.stderr[-3000:]
    return projects


def fails(argv, capsys, script=None):
    """The one-line error of script.main(argv) (train.py by default), run in this process: after checking that it
    exits with code 2 and no traceback, what it wrote to stderr."""
    if script is None:
        import train as script
    with pytest.raises(SystemExit) as exit_info:
        script.main(list(map(str, argv)))
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in error
    return error


def run_weights(run_dir):
    """A run's final weights (last.pt) as one float64 vector."""
    model = load_checkpoint(run_dir / "weights" / "last.pt")["model"]
    return torch.cat([t.flatten().double() for t in model.values()])


def step_losses(run_dir):
    """{step: loss} as a run logged them (train/loss_step)."""
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}).Reload()
    return {e.step: e.value for e in events.Scalars("train/loss_step")}


def rounding_tolerances(runs, path):
    """(weights, loss): how far launch_n_invariance's runs at N=2 and 3 on path may land from N=1's, in the final
    weights and in any step's loss. Float rounding as this CPU does it: the spread of computations equivalent to N=1
    (one compute thread instead of two; each global batch summed in three micro-batches, as N=3 splits it), at
    least ROUNDING_FLOOR, times AMPLIFICATION."""
    weights, losses = run_weights(runs["1"] / path), step_losses(runs["1"] / path)
    equivalents = [runs["1, one thread"] / path, runs["1, accumulate 3"] / path]
    weights_spread = max((run_weights(run) - weights).abs().max().item() for run in equivalents)
    loss_spread = max(abs(step_losses(run)[step] - loss) for run in equivalents for step, loss in losses.items())
    return tuple(AMPLIFICATION * max(spread, ROUNDING_FLOOR) for spread in (weights_spread, loss_spread))


def console_lines(output, start):
    """The lines of output that start with start: what the processes said, without torchrun's summary of a failure,
    which quotes each failed rank's last line again, indented."""
    return [line for line in output.splitlines() if line.startswith(start)]


def untimed(line):
    """line with the seconds that a fetch's tries took, measured, written T ('after 6 tries in T s')."""
    return re.sub(r"(after \d+ tries in )\d[\d.e+]* s", r"\1T s", line)


FIGURE_NAMES = {"mAP": "map", "F1": "f1", "precision": "precision", "recall": "recall", "exact match": "exact_match",
                "balanced top-1": "balanced_top1", "top-1": "top1", "top-5": "top5", "loss": "loss"}


def printed_figures(text):
    """val.py's headline as printed ('mAP 97.12%  F1 ...  loss 0.1234  (9 images)'): {metrics.json's name: the
    figure as printed}, with 'images'."""
    import re

    line = next(line for line in text.splitlines() if re.search(r"\(\d+ images\)$", line))
    figures = {FIGURE_NAMES[name]: value for name, value in
               re.findall(r"(mAP|F1|precision|recall|exact match|balanced top-1|top-1|top-5|loss) (\d+\.\d+%?)", line)}
    return {**figures, "images": re.search(r"\((\d+) images\)$", line)[1]}


def check_metrics_json(folder, text, run):
    """Every key of val.py's metrics.json in folder: each metric is the figure printed in text (as printed: to two
    decimals of a percent, the loss to four), 'images' the count printed, and 'run' exactly run. Returns it."""
    import json

    summary = json.loads((Path(folder) / "metrics.json").read_text())
    printed = printed_figures(text)
    unprinted = {name for name, value in summary.items() if value is None}  # top-5 with fewer than 5 classes
    assert set(summary) - unprinted == {*printed, "run"}, (sorted(summary), sorted(printed))
    for name, shown in printed.items():
        value = summary[name]
        assert (str(value) if name == "images" else f"{value:.4f}" if name == "loss" else f"{value:.2%}") == shown, \
            name
    assert summary["run"] == run
    return summary


def read_results(run_dir):
    """results.csv of a run: (header, rows as dicts)."""
    with open(run_dir / "results.csv") as f:
        rows = list(csv.reader(f))
    return rows[0], [dict(zip(rows[0], row)) for row in rows[1:]]


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """The README's first command: two processes under torchrun train the cls.yaml recipe on digits; (project,
    CompletedProcess). Shared by the tests of training and of what comes after it (val.py, predict.py, export.py)."""
    project = tmp_path_factory.mktemp("runs")
    result = run_torchrun("train.py", "--recipe", "cls.yaml", f"project={project}")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return project, result


class Lookup(torch.nn.Module):
    """A 'model' whose logits for an image are a row of a table, picked by the image's first pixel."""

    def __init__(self, logits):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, images):
        return self.logits[images[:, 0, 0, 0].long()]


def closed_port():
    """A loopback port nothing listens on: connections to it are refused."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        return listener.getsockname()[1]


@contextlib.contextmanager
def http_server(root, stop_after=None, cut_first=0, trickle=False, no_length=False, log=None, endless=None,
                announce=None, redirect_to=None):
    """A real HTTP server (tests/http_server.py) serving root: yields (its base URL, its process). With stop_after,
    it exits when a request after the first stop_after GETs arrives, as a server that dies mid-run; with cut_first,
    the first cut_first shards it sends stop halfway; with trickle, it sends shards a byte every 50 ms (with
    no_length, without announcing their length); with log, it appends `PATH BYTES` to that file for each GET; with
    endless (a suffix), files ending so are followed by bytes without end; with announce, shards announce that
    length; with redirect_to (a host name), shards asked for under another name are redirected there."""
    options = [*([] if stop_after is None else ["--stop-after", str(stop_after)]), "--cut-first", str(cut_first),
               *(["--trickle"] if trickle else []), *(["--no-length"] if no_length else []),
               *([] if log is None else ["--log", str(log)]), *([] if endless is None else ["--endless", endless]),
               *([] if announce is None else ["--announce", str(announce)]),
               *([] if redirect_to is None else ["--redirect-to", redirect_to])]
    server = subprocess.Popen([sys.executable, "-u", str(ROOT / "tests" / "http_server.py"), str(root), *options],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline().split()[1])
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.kill()
        server.wait()


def forward_logits(weights, files):
    """The checkpoint's model's outputs for each image file, prepared as val.py and predict.py prepare it and
    computed in the precision and memory format it was trained in (fp32 logits)."""
    from data.transforms import normalizer, val_transforms
    from data.verify import decode
    from models import model_from_checkpoint
    from utils.checkpoint import load_model_checkpoint
    from utils.config import checkpoint_recipe
    from utils.precision import autocast, autocast_dtype

    ckpt, cpu = load_model_checkpoint(weights), torch.device("cpu")
    cfg = checkpoint_recipe(ckpt["recipe"], weights)
    model = model_from_checkpoint(ckpt, cfg, weights, cpu)  # as val.py
    transform, normalize = val_transforms(cfg.data), normalizer(cfg.data, cpu)
    with torch.no_grad(), autocast(cpu, autocast_dtype(cfg.train.precision, cpu)):
        return model(normalize(torch.stack([transform(decode(f)) for f in files]))).float()
