"""Every command that README.md, docs/*.md and the recipes' comments show works as a user types it: each is
collected from the text and run through bash in a scratch project, shortened (tiny data, one epoch, small images),
or, where it cannot run here, listed in NOT_RUN with the reason and checked as far as it can be."""

import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torchvision

from conftest import ROOT, clean_env, make_image_folder, run_python
from models import check_model_name
from models.pretrained import cache_path, torchvision_weights
from utils.config import RECIPES_DIR, load_recipe

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = r"(?:python|torchrun|tensorboard) "  # how an inline code span that is a command starts

# Run in this order, each in a project whose runs/train/exp is a run stopped in its second epoch (best.pt saved).
RUN = [
    "python val.py --weights runs/train/exp/weights/best.pt",
    "python predict.py --weights runs/train/exp/weights/best.pt --source path/to/new_photos --save-images",
    "python predict.py --weights ... --source photos/ --save-images",
    "python train.py --resume runs/train/exp",
    "torchrun --nproc_per_node=2 train.py --resume runs/train/exp/weights/last.pt",
    "python train.py --resume",
    "python train.py --resume runs/train/exp train.epochs=30",
    "python train.py --recipe cls.yaml",
    "torchrun --nproc_per_node=2 train.py --recipe multilabel.yaml",
    "torchrun --nproc_per_node=2 train.py --recipe multilabel-photos.yaml data.name=path/to/my_labels",
    "python train.py --recipe multilabel-photos.yaml data.name=path/to/my_labels model.weights='' optim.lr=0.002 "
    "train.epochs=40 train.patience=10 sched.warmup_epochs=2",
    "python train.py --recipe cls.yaml optim.lr=0.05 train.epochs=3 data.scale=[0.5,1.0]",
    "python -m utils.config",
    "python train.py --help",
    "python3 -m venv .venv && source .venv/bin/activate",
    "torchrun --nproc_per_node=2 train.py --recipe cls.yaml",
    "torchrun --nproc_per_node=2 train.py --recipe cls.yaml data.name=/path/to/my_data model.name=resnet18 "
    "data.img_size=224 data.scale=[0.08,1.0] data.hflip=0.5 data.crop_pct=0.875 data.mean=[0.485,0.456,0.406] "
    "data.std=[0.229,0.224,0.225]",
    "python train.py --recipe folder.yaml data.name=path/to/your/data",
    "python train.py --recipe folder.yaml data.name=path/to/data",
    "python train.py --recipe folder.yaml data.name=path/to/data --check",
    "torchrun --nproc_per_node=2 train.py --recipe folder.yaml data.name=path/to/my_data",
    "python train.py --recipe folder.yaml data.name=path/to/your/data model.weights='' optim.lr=0.002 "
    "train.epochs=40 train.patience=10 sched.warmup_epochs=2",
    "python train.py --recipe imagenet-resnet50.yaml data.name=path/to/imagenet data.cache=jpeg "
    "data.auto_augment='' data.random_erase=0",
    "torchrun --nproc_per_node=8 train.py --recipe imagenet-resnet50.yaml",
    "python -m data.shards path/to/my_data path/to/shards",
    "torchrun --nproc_per_node=2 train.py --recipe folder.yaml data.name=path/to/shards",
    "python train.py --recipe cls.yaml 'log.to=[tensorboard,mlflow]'",
    "WANDB_MODE=offline python train.py --recipe cls.yaml 'log.to=[tensorboard,wandb]'",
]

BENCHMARK = "a benchmark: minutes of measurement on this machine"
SLURM = "SLURM's batch script: sbatch, srun and scontrol on a cluster"
SWEEP = "needs a sweep's folder: tests/test_tune.py trains a sweep's best.yaml and reports a sweep from its folder"
NOT_RUN = {
    "pip install -r requirements-lock.txt && torchrun --nproc_per_node=2 train.py --recipe cls.yaml":
        "it would reinstall the lock over the environment the suite runs in (.ci/run installs it); the torchrun "
        "command after it is run on its own",
    "pip install -r requirements-lock.txt && python -m pytest -q -n auto --dist loadfile tests":
        "it is .ci/run, which runs this suite (this test in it)",
    "pip install -r requirements-lock.txt": "it is .ci/run's install: the suite runs in what it installed",
    "pip install -r requirements.txt -r requirements-export.txt -c requirements-lock.txt --extra-index-url "
    "https://download.pytorch.org/whl/cpu": "PyTorch's CPU index is not reachable here",
    "python -m pytest -m cuda": "needs a CUDA GPU",
    "python -m pytest -q tests -m 'not slow'": "the suite's fast tier: this suite, which runs every test, holds it",
    "torchrun --nproc_per_node=8 train.py --recipe cls.yaml device=cuda": "needs 8 CUDA GPUs",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d "
    "--rdzv-endpoint=HOST:29500 --rdzv-id=job1 --max-restarts=3 train.py --recipe cls.yaml": "two machines",
    "torchrun --nnodes=8 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=vit "
    "train.py --recipe imagenet-vit_b_16.yaml": "eight machines of 8 GPUs",
    "python train.py --recipe cifar10-resnet18.yaml": "CIFAR-10's files are not here (nothing is downloaded)",
    "python train.py --recipe cifar100-resnet18.yaml": "CIFAR-100's files are not here (nothing is downloaded)",
    "#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --signal=TERM@120": SLURM,
    'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': SLURM,
    "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1": "a line of SLURM's batch script, which sets it for srun",
    'srun torchrun --nnodes="$SLURM_NNODES" --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint="$head:29500" '
    '--rdzv-id="$SLURM_JOB_ID" --max-restarts=3 train.py --recipe cls.yaml': SLURM,
    "tensorboard --logdir runs/train": "a server that runs until stopped",
    "mlflow ui --backend-store-uri sqlite:///runs/mlflow.db": "a server that runs until stopped, from the full mlflow "
                                                             "package (pip install mlflow), which the lock leaves out",
    "torchrun --max-restarts=K": "a flag named in a sentence, K standing for a number",
    "python benchmarks/scale.py": BENCHMARK,
    "python benchmarks/scale.py --only startup": BENCHMARK,
    "python benchmarks/time_to_accuracy.py": BENCHMARK,
    "python benchmarks/digits_sweep.py": BENCHMARK,
    "python benchmarks/multilabel_sweep.py": BENCHMARK,
    "python benchmarks/overhead.py": BENCHMARK,
    "python benchmarks/compute.py": BENCHMARK,
    "python benchmarks/data.py": BENCHMARK,
    "python benchmarks/data.py --only-decode": BENCHMARK,
    "python benchmarks/gpu.py": BENCHMARK,
    "torchrun --nproc_per_node=2 benchmarks/ddp.py": BENCHMARK,
    "python benchmarks/finetune.py": BENCHMARK,
    "python benchmarks/finetune.py --multilabel": BENCHMARK,
    "python benchmarks/sweep.py": BENCHMARK,
    "python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 20":
        "20 trials of training: tests/test_tune.py runs sweeps of this recipe of 1 to 4 one-epoch trials, and reads "
        "spaces/cls.yaml as this command does",
    "python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 40 --storage "
    "postgresql://user:password@host/optuna --study cls": "needs a PostgreSQL server (tests/test_tune.py shares one "
                                                         "SQLite study between two tune.py)",
    "python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 3 train.epochs=3 'log.to=[tensorboard,mlflow]'":
        "3 trials of training: tests/test_trackers.py runs this sweep with one-epoch trials and reads it from MLflow",
    "python tune.py --recipe cls.yaml --space spaces/cls.yaml --trials 3 train.epochs=3":
        "3 trials of training: tests/test_tune.py runs sweeps of this recipe of 1 to 4 one-epoch trials",
    "python train.py --recipe runs/tune/cls-cls/best.yaml": SWEEP,
    "python tune.py --report runs/tune/cls-cls": SWEEP,
    "python train.py --resume runs/tune/cls-cls/trial-K": SWEEP,
    "tensorboard --logdir runs/tune": "a server that runs until stopped",
    "python -m data.shards": "the writer named in a sentence; the command above it with its arguments is run",
    "python -m data.shard_index path/to/webdataset": "needs shards another tool wrote: test_shards.py writes such a "
                                                     "set, indexes it with this command and trains on it",
    "python -m http.server 8000 --directory path/to": "a server that runs until stopped (the shard tests run one)",
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=job1 train.py "
    "--recipe folder.yaml data.name=http://SERVER:8000/shards": "two machines and a server",
}

# What a documented placeholder becomes in the scratch project: my_data/ holds train/ and val/, my_shards/ the same
# as a shard set, new_photos/ images.
STAND_INS = [("data.name=path/to/shards", "data.name=my_shards"), ("path/to/my_labels", "my_labels"),
             ("/path/to/my_data", "my_data"), ("path/to/my_data", "my_data"), ("path/to/your/data", "my_data"),
             ("path/to/data", "my_data"), ("path/to/imagenet", "my_data"), ("path/to/new_photos", "new_photos"),
             ("--source photos/", "--source new_photos"), ("--weights ...", "--weights runs/train/exp/weights/best.pt"),
             ("--nproc_per_node=8", "--nproc_per_node=2")]
# Appended, so that they win over the recipe's and the command's own values: a new run trains one short epoch of
# the tiny data at 32 px (the recipe's model, except ResNet-50: a small convnet, its EMA updated every step; not 16,
# where a ResNet's layer4 strides over 1x1 maps, whose bf16 weight gradient a CPU's oneDNN gets wrong:
# docs/techniques.md), drawing no plots but in the run whose output the README shows; a resumed run adds an epoch.
NEW_RUN = ("data.name=my_data train.epochs=1 train.batch_size=4 data.img_size=32 data.val_img_size=32 data.workers=0 "
           "log.plots=false")
SMALLER_MODEL = {"imagenet-resnet50.yaml": "model.name=convnet model.width=4 train.ema_steps=1"}
RESUMED = "train.epochs=3 data.workers=0 log.plots=false"


def bash_block_commands(block):
    """The commands of a ```bash block: `\\` continuations joined, comments dropped (#SBATCH lines kept)."""
    commands, command = [], ""
    for line in block.splitlines():
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line.startswith("#") and not line.startswith("#SBATCH"):
            continue
        command += line
        if command.endswith("\\"):
            command = command[:-1].rstrip() + " "
        elif command:
            commands.append(command)
            command = ""
    return commands


def doc_commands(text):
    """The commands of a Markdown page: its ```bash blocks' lines, and inline code spans that start with python,
    torchrun or tensorboard."""
    commands = [c for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S) for c in bash_block_commands(block)]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return commands + re.findall(rf"`({COMMAND}[^`]*)`", prose)


def recipe_commands(text):
    """The commands in a recipe's comments: lines `#   python ...` or `#   torchrun ...`, with their `\\`
    continuations on the comment lines that follow."""
    commands, lines = [], iter(text.splitlines())
    for line in lines:
        match = re.match(r"#\s+((?:python|torchrun) .*)", line)
        if match:
            command = match[1].strip()
            while command.endswith("\\"):
                command = command[:-1].rstrip() + " " + next(lines).lstrip("#").strip()
            commands.append(command)
    return commands


def documented_commands():
    """{command: [the files that show it]} over README.md, docs/*.md and recipes/*.yaml."""
    found = {}
    for path in DOCS:
        for command in doc_commands(path.read_text()):
            found.setdefault(command, []).append(path.relative_to(ROOT).as_posix())
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        for command in recipe_commands(path.read_text()):
            found.setdefault(command, []).append(path.relative_to(ROOT).as_posix())
    return found


NUMBER = r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?(?: (?:B|KiB|MiB|GiB)\b)?"  # with a size's unit, which scales
# Where a documented output line may differ from a scratch project's, each (the part as the README shows it, what
# the scratch project may print there): the data's paths; exp's number (the scratch project holds a stopped run
# as runs/train/exp, so a new run is exp2); an epoch in the singular; top-5, shown with 5 classes or more (the
# scratch data has 2); why the threads and workers (the scratch runs set data.workers); the stored size, when the
# tiny images were resized; the images and contact sheet --save-images adds to predict.py's files; the precision,
# which train.precision=auto makes fp32 on a CPU without bf16 instructions.
OUTPUT_PLACES = [(r"datasets/digits(?:/val)?", r"\S+"), (r"/exp\b", r"/exp\d*"), (r"epochs in", r"epochs? in"),
                 (rf" +top-?5 {NUMBER}%", rf"(?: +top-?5 {NUMBER}%)?"), (r" \(auto: [^)]*\)", r" \([^)]*\)"),
                 (r" per train image", r" per train image(?: \([^)]*\))?"),
                 (r"predictions\.json$", r"predictions\.json(?:, .*)?"),
                 (r"\bbf16\b", "(?:bf16|fp32)"), (r"\bbfloat16\b", "(?:bfloat16|float32)")]
OUTPUT_NOT_RUN = {"export.py": "no command of RUN runs it"}


def documented_outputs():
    """{command: the lines README.md shows it printing}: a plain ``` block right after a paragraph that ends 'It
    prints:' holds the output of the last command in that paragraph; in a block of `$ command` lines, each command's
    lines follow it ('...' lines, which stand for more of the same, dropped)."""
    outputs, paragraph, fence, ended = {}, [], None, False
    for line in (ROOT / "README.md").read_text().splitlines():
        if fence is None and line.startswith("```"):
            fence, block = line, []
        elif fence is not None and line == "```":
            if fence == "```" and block and block[0].startswith("$ "):
                for entry in block:
                    if entry.startswith("$ "):
                        command = outputs.setdefault(entry[2:], [])
                    else:
                        command.append(entry)
            elif fence == "```" and " ".join(paragraph).endswith("It prints:"):
                outputs[re.findall(rf"`({COMMAND}[^`]*)`", " ".join(paragraph))[-1]] = block
            fence, paragraph = None, []
        elif fence is not None:
            block.append(line)
        elif line.strip():  # a line of the paragraph before the next block, or the first of a new one
            paragraph, ended = [*([] if ended else paragraph), line], False
        else:
            ended = True
    return {command: [line for line in lines if line.strip() not in ("", "...")]
            for command, lines in outputs.items()}


def output_shape(line):
    """A documented output line as a pattern: its words as they are, any number where it shows one, and what the
    scratch project may print in OUTPUT_PLACES."""
    places = "|".join(f"(?P<p{i}>{documented})" for i, (documented, _) in enumerate(OUTPUT_PLACES))
    pattern, end = "", 0
    for match in re.finditer(f"{places}|(?P<number>{NUMBER})", line):
        kind = match.lastgroup
        place = NUMBER if kind == "number" else OUTPUT_PLACES[int(kind[1:])][1]
        pattern += re.escape(line[end:match.start()]) + place
        end = match.end()
    return pattern + re.escape(line[end:])


def documented_run(command):
    """The command of RUN whose output shows what command's documented output does: itself, or the first of the
    same script on the same weights (predict.py's documented options are not run: they print the same lines)."""
    if command in RUN:
        return command
    script, weights = re.search(r"\S+\.py", command)[0], re.search(r"--weights \S+", command)
    return next((run for run in RUN if script in run and weights and weights[0] in run), None)


def shortened(command):
    """The command with its placeholders stood in for, and the overrides that make it quick appended."""
    for placeholder, stand_in in STAND_INS:
        command = command.replace(placeholder, stand_in)
    recipe = re.search(r"--recipe (\S+)", command)
    if recipe:
        new_run = NEW_RUN.replace("data.name=my_data", "") if "data.name=my_shards" in command else NEW_RUN
        if load_recipe(recipe[1]).data.multilabel:  # a CSV root with a labels column
            new_run = new_run.replace("data.name=my_data", "data.name=my_labels")
        if command in documented_outputs():  # its results.png is in the line the README shows
            new_run = new_run.replace(" log.plots=false", "")
        return " ".join(filter(None, [command, new_run, SMALLER_MODEL.get(recipe[1])]))
    return f"{command} {RESUMED}" if "train.py --resume" in command else command


RUNS = list(dict.fromkeys(shortened(command) for command in RUN))  # placeholders stood in for: some coincide


def test_every_documented_command_is_run_or_listed_with_the_reason_it_is_not():
    found = documented_commands()
    assert not set(RUN) & set(NOT_RUN)
    unplaced = {command: where for command, where in found.items() if command not in RUN and command not in NOT_RUN}
    assert not unplaced, f"documented commands in neither RUN nor NOT_RUN: {unplaced}"
    stale = [command for command in [*RUN, *NOT_RUN] if command not in found]
    assert not stale, f"RUN or NOT_RUN name commands no longer documented: {stale}"


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """(a scratch project, the environment): the repository's files linked in, with the tiny data sets, a
    stand-in for torchvision's ResNet-18 weights in TORCH_HOME, and runs_stopped/train/exp, a run stopped by SIGTERM
    in its second epoch (best.pt saved), which each command's own copy of the project holds as runs/train/exp."""
    root = tmp_path_factory.mktemp("project")
    for entry in ROOT.iterdir():
        if not entry.name.startswith(".") and entry.name not in ("runs", "datasets"):
            (root / entry.name).symlink_to(entry)
    make_image_folder(root / "my_data", {"train": {"cat": 4, "dog": 4}, "val": {"cat": 1, "dog": 1}}, size=20)
    make_image_folder(root, {"new_photos": {"": 3}}, size=20, seed=1)  # class "": images straight in new_photos/
    assert run_python("-m", "data.shards", "my_data", "my_shards", cwd=root).returncode == 0  # data.name=my_shards
    for split, rows in (("train", ["cat/000.png,cat|dog", "cat/001.png,", "dog/000.png,dog", "dog/001.png,cat"]),
                        ("val", ["cat/000.png,cat", "dog/000.png,dog|cat"])):  # data.name=my_labels: multi-label
        (root / "my_labels").mkdir(exist_ok=True)
        if not (root / "my_labels" / split).exists():
            (root / "my_labels" / split).symlink_to(root / "my_data" / split)
        (root / "my_labels" / f"{split}.csv").write_text("\n".join(["path,labels", *[f"{split}/{r}" for r in rows]]))
    env = {**clean_env(), "TORCH_HOME": str(root / "torch"),
           "PATH": f"{Path(sys.executable).parent}:{clean_env()['PATH']}"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_HOME", env["TORCH_HOME"])
        weights = cache_path(torchvision_weights("resnet18", "DEFAULT"))
    weights.parent.mkdir(parents=True)
    torch.save(torchvision.models.resnet18().state_dict(), weights)
    stop = ["--recipe", "cls.yaml", "data.name=my_data", "train.epochs=2", "train.batch_size=4", "data.workers=0"]
    result = run_python(ROOT / "tests" / "faults.py", "signal-at-step:4:SIGTERM", "train.py", *stop, cwd=root)
    assert (root / "runs" / "train" / "exp" / "weights" / "best.pt").is_file(), result.stdout + result.stderr[-3000:]
    (root / "runs").rename(root / "runs_stopped")
    return root, env


def project_copy(scratch_root, where):
    """A project of its own for one command (commands run two at a time): links to the scratch project's files,
    copies of what a run writes into (the data, for its caches) and of the stopped run as runs/."""
    where.mkdir()
    for entry in scratch_root.iterdir():
        if entry.name in ("my_data", "my_labels", "runs_stopped"):
            shutil.copytree(entry, where / ("runs" if entry.name == "runs_stopped" else entry.name), symlinks=True)
        else:
            (where / entry.name).symlink_to(entry.resolve() if entry.is_symlink() else entry)
    return where


def free_port():
    """A TCP port free now, for torchrun's master (so that runs side by side never meet on 29500)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(command, scratch_root, env, where):
    """(command, its CompletedProcess) run through bash in a project of its own."""
    cwd = project_copy(scratch_root, where)
    return command, subprocess.run(["bash", "-c", command], cwd=cwd, env={**env, "PET_MASTER_PORT": str(free_port())},
                                   capture_output=True, text=True, timeout=300, start_new_session=True)


@pytest.mark.slow
def test_every_runnable_documented_command_runs_as_typed(scratch, tmp_path):
    """Each command of RUN, two at a time (most of a short run is starting Python and importing torch, one core)."""
    root, env = scratch
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda c: run_command(c[1], root, env, tmp_path / str(c[0])), enumerate(RUNS)))
    failed = [f"{command}\nexit {r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}" for command, r in results
              if r.returncode != 0]
    assert not failed, f"{len(failed)} of {len(RUNS)} documented commands failed:\n\n" + "\n\n".join(failed)
    # What the README shows them print, they print, in shape.
    printed = {command: re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr).splitlines() for command, r in results}
    outputs, unlike = documented_outputs(), []
    assert outputs, "README.md shows no command's output"
    for documented, lines in outputs.items():
        run = documented_run(documented)
        if run is None:
            assert re.search(r"\S+\.py", documented)[0] in OUTPUT_NOT_RUN, f"{documented}: no run shows its output"
            continue
        unlike += [f"{documented}\n    {line}" for line in lines
                   if not any(re.fullmatch(output_shape(line), out) for out in printed[shortened(run)])]
    assert not unlike, "documented output lines no run printed (in shape):\n" + "\n".join(unlike)


@pytest.mark.parametrize("command", NOT_RUN)
def test_a_command_that_cannot_run_here_is_checked_as_far_as_it_can_be(command):
    """Its shell syntax; the files it names; torchrun's parser accepts its options; its recipe and overrides load;
    tensorboard's parser accepts its flags."""
    assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0
    words = shlex.split(command, comments=True)
    missing = [w for w in words if w.endswith((".py", ".txt")) and "=" not in w and not (ROOT / w).is_file()]
    assert not missing, f"{command}: no such file {missing}"
    if "torchrun" in words and any(w.endswith(".py") for w in words):
        start = words.index("torchrun") + 1
        script = next(i for i in range(start, len(words)) if words[i].endswith(".py"))
        from torch.distributed.run import get_args_parser

        get_args_parser().parse_args(words[start:script + 1])
    if "--recipe" in words and not words[words.index("--recipe") + 1].startswith("runs/"):  # runs/: a sweep's
        at = words.index("--recipe") + 1                                                   # best.yaml (test_tune)
        load_recipe(words[at], [w for w in words[at + 1:] if "=" in w], model_check=check_model_name)
    if words and words[0] == "tensorboard":
        from tensorboard import program

        program.TensorBoard().configure(argv=words)
