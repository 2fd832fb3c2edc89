"""The recipe schema (every key, its type, default and meaning) and the loader that validates recipes against it."""

import difflib
import inspect
import json
import math
import re
import textwrap
from collections.abc import Hashable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Union
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from utils.general import ROOT, WORLD_SIZE, SharedError
from utils.trackers import TRACKERS, missing

RECIPES_DIR = ROOT / "recipes"
COMMAND_LINE = "command line"  # the source of key=value overrides, as errors name it
SCHEDULES = ("cosine", "step", "multistep", "constant")  # sched.name: the lr's shape after warmup
COMM_HOOKS = ("none", "bf16", "fp16")  # ddp.comm_hook: the dtype gradients are all-reduced in (none: as they are)
AUTO_AUGMENTS = ("", "autoaugment", "autoaugment_cifar10", "randaugment", "trivialaugment", "augmix")
DEVICES = "auto, cpu, cuda, cuda:N or a GPU index N"  # device: what select_device() accepts
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


@dataclass
class ModelConfig:
    name: str = "resnet18"  # convnet (small VGG-style net), resnet18_cifar, a torchvision.models name or timm/NAME
    width: int = 32  # convnet: channels of the first stage, doubled at each following stage
    depth: int = 3  # convnet: number of stages (two 3x3 convs each); a 2x max-pool sits between stages
    dropout: float = 0.0  # convnet: dropout before the classifier
    norm: str = "batch"  # convnet: batch, group (per-sample statistics, the same at any number of processes) or none
    sync_bn: bool = False  # CUDA, several processes, with data.drop_last: BatchNorm over the global batch (SyncBatchNorm)
    weights: str = ""  # start from: a local state_dict file, DEFAULT or a torchvision weights name (IMAGENET1K_V2, ...; timm/NAME: a timm tag); the head is resized
    backbone_lr: float = 1.0  # with model.weights: the pretrained part's learning rate as a factor of optim.lr (the new head: 1)
    freeze_epochs: int = 0  # with model.weights: train only the new head for this many epochs (pretrained BatchNorm statistics frozen too)


@dataclass
class DataConfig:
    name: str = "digits"  # 'digits', cifar10/100, or a root: train/ and val/, valid/ or test/ class folders; train.csv and val.csv; or class folders (data.val_split); or a shard set (python -m data.shards): its folder, dataset.json or http(s):// URL
    img_size: int = 224  # side of the square images the model sees, in pixels
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])  # train RandomResizedCrop area range
    hflip: float = 0.5  # train horizontal flip probability (0 for digits and text)
    crop_padding: int = 0  # train: > 0 crops img_size from the image padded by this many pixels (CIFAR), not scale
    auto_augment: str = ""  # '', autoaugment, autoaugment_cifar10, randaugment, trivialaugment or augmix (per image)
    ra_magnitude: int = 9  # randaugment: the magnitude of its operations (0-30)
    augmix_severity: int = 3  # augmix: the severity of its operations (1-10)
    random_erase: float = 0.0  # train: probability of erasing a random rectangle of each image (filled with the mean)
    mixup_alpha: float = 0.0  # MixUp of pairs in each batch, lambda ~ Beta(alpha, alpha); 0: off
    cutmix_alpha: float = 0.0  # CutMix of pairs in each batch, lambda ~ Beta(alpha, alpha); 0: off
    mix_switch_prob: float = 0.5  # with both MixUp and CutMix on: the share of batches that use CutMix
    repeats: int = 1  # repeated augmentation: each image this many times in a row, augmented afresh; epochs keep length
    val_img_size: int = 0  # side of validation's (and inference's) centre crop; 0: data.img_size
    crop_pct: float = 0.875  # val: resize to val_img_size / crop_pct, then centre-crop val_img_size
    val_resize: str = "crop"  # val and inference: crop (as data.crop_pct says) or squash (the whole image to a square: nothing cut off, for multi-label)
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))  # per-channel normalisation mean (RGB)
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))  # per-channel normalisation std (RGB)
    cache: str = "none"  # none: decode per sample; ram: decode once into memory; jpeg: one shared file of JPEGs per split (crop and flip per batch with either)
    cache_dir: str = ""  # data.cache=jpeg's files, a shard set's fetched shards: where they go; '': beside the images (shards: datasets/shard-cache/)
    jpeg_decode: str = "auto"  # data.cache=jpeg and shard sets: where training JPEGs are decoded: auto (the GPU on CUDA, else workers), cpu (workers) or device
    shard_window: int = 8  # shard sets: each epoch shuffles the shards, then the samples within windows of this many shards
    shard_cache_gb: float = 0.0  # shard sets at a URL: the most GB of training shards each machine keeps; 0: every shard fetched
    shard_hosts: list[str] = field(default_factory=list)  # shard sets at a URL: other hosts (host or host:port) whose shards and indexes the set's files may name; by default only the origin of the file that names them
    workers: str = "auto"  # DataLoader workers per process, or auto (by data.cache and device; printed)
    drop_last: bool = False  # train: drop each epoch's last partial global batch (so no step sees a batch of one)
    skip_corrupt: bool = False  # check each image once first (in parallel, cached next to the data); skip unreadable ones
    val_split: float = 0.0  # a root of class folders with no split: the share held out for val (stratified, seeded, saved with the run)
    csv_allow_outside: bool = False  # train.csv and val.csv: also read paths that leave the CSV's folder ('..', absolute paths)
    sampler: str = "shuffle"  # train order: shuffle (every image once an epoch) or balanced (each class equally often)
    multilabel: bool = False  # each image has any number of the classes (a CSV with a labels column, or multidigits): sigmoid outputs, BCE loss, mAP


@dataclass
class TrainConfig:
    epochs: int = 10  # passes over the training set
    batch_size: int = 64  # global batch over all processes; each process takes batch_size / WORLD_SIZE
    accumulate: int = 1  # split each process's batch into this many micro-batches, one optimizer step and all-reduce
    channels_last: Union[bool, str] = "auto"  # NHWC memory format for the model and batches: true, false, auto (true for convolutional models, measured faster)
    compile: bool = False  # torch.compile the training model (pays off on long runs; the first steps compile)
    label_smoothing: float = 0.0  # cross-entropy label smoothing; multi-label: targets 1 - s + s/classes and s/classes, as timm's
    precision: str = "auto"  # auto: bf16 where every process computes it natively (Ampere+ GPUs, AMX or AVX512-BF16 CPUs), else fp32 (older GPUs: fp16); fp32; bf16 (autocast); fp16 (+ GradScaler; CUDA)
    deterministic: bool = True  # ask torch for deterministic kernels (reproducible runs; may be slower on GPU)
    save_every_steps: int = 0  # also save weights/last.pt every this many steps within an epoch; 0: at epoch ends only
    ema_decay: float = 0.0  # EMA of the weights, validated beside them: its decay per update (e.g. 0.99998); 0: off
    ema_steps: int = 32  # update the EMA every this many steps; the decay is adjusted for batch, steps and epochs
    patience: int = 0  # early stopping: stop after this many epochs without a better val top-1; 0: off
    log_every_steps: int = 10  # TensorBoard train/loss_step: the mean loss of every this many steps, over all ranks; 0: off
    class_weights: str = ""  # '' or balanced: weight the loss of each class inversely to its number of training images
    best_metric: str = "auto"  # what best.pt and train.patience follow: top1, balanced_top1 (mean per-class recall) or map (multi-label); auto: top1, or map for multi-label
    threshold: float = 0.5  # multi-label: val F1, precision, recall and exact match count a label from this probability (per-class thresholds, chosen on val, are saved too)
    tta: bool = False  # validate with test-time augmentation: the mean softmax of each image and its horizontal flip
    hang_seconds: float = 60.0  # several processes: a rank silent this long, or standing still while the others wait for it, is named and the job ended; 0: off (the collectives' 10-minute timeout)


@dataclass
class OptimConfig:
    name: str = "sgd"  # sgd or adamw
    lr: float = 0.1  # peak learning rate, for the global batch, reached at the end of warmup
    momentum: float = 0.9  # sgd momentum; adamw beta1
    nesterov: bool = True  # sgd: Nesterov momentum
    weight_decay: float = 5e-5  # decoupled for adamw; applied to weights only, not to biases or norm layers
    clip_grad_norm: float = 0.0  # clip the global gradient norm to this value; 0 disables


@dataclass
class SchedConfig:
    name: str = "cosine"  # after warmup: cosine, step, multistep or constant; stepped per iteration
    warmup_epochs: float = 1.0  # linear warmup length, in epochs (fractions allowed)
    warmup_factor: float = 0.1  # warmup starts at lr * warmup_factor
    min_lr_factor: float = 0.01  # cosine decay ends at lr * min_lr_factor
    step_epochs: float = 30.0  # step: multiply the lr by gamma every this many epochs after warmup
    milestones: list[float] = field(default_factory=lambda: [30.0, 60.0, 90.0])  # multistep: lr *= gamma at these epochs after warmup
    gamma: float = 0.1  # step and multistep: the factor at each decay


@dataclass
class DDPConfig:  # smart_DDP's keyword arguments (train.py passes the section as they are); several processes only
    bucket_cap_mb: float = 25.0  # DDP all-reduces gradients in buckets of this many MB, each as soon as it is ready
    gradient_as_bucket_view: bool = False  # gradients are views into DDP's buckets: saves a copy and their memory
    comm_hook: str = "none"  # none, bf16 or fp16: all-reduce gradients in that dtype (half the bytes, the mean rounded)


@dataclass
class LogConfig:  # where rank 0 records the run besides results.csv and results.png
    to: list[str] = field(default_factory=lambda: ["tensorboard"])  # any of tensorboard, mlflow, wandb (the last two: pip install -r requirements-track.txt; docs/outputs.md)
    weights: bool = False  # mlflow, wandb: also upload weights/best.pt at the end of a finished run (weights are large)
    required: bool = False  # mlflow, wandb: refuse to train when one cannot be reached; false: one line, then train on without it
    plots: bool = True  # draw results.png and the confusion matrix (matplotlib, about a second of CPU each time); false: none


@dataclass
class Recipe:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    log: LogConfig = field(default_factory=LogConfig)
    device: str = "auto"  # auto (CUDA when present), cpu, cuda (GPU LOCAL_RANK); one process per machine: N or cuda:N
    seed: int = 0  # seeds model init, data order and augmentation
    project: str = "runs/train"  # runs are saved to project/name
    name: str = "exp"  # run name (a folder: no /), incremented if taken: exp, exp2, ...; lr0.1, lr0.1-2, ... (ends in a digit)


# What a resumed run may change: none of these changes what the run has trained so far.
RESUME_KEYS = ("train.epochs", "train.patience", "train.save_every_steps", "train.log_every_steps", "train.accumulate",
               "train.hang_seconds",
               "train.compile", "train.channels_last", "data.workers", "data.skip_corrupt", "data.cache_dir",
               "data.shard_cache_gb", "ddp.bucket_cap_mb",
               "ddp.gradient_as_bucket_view", "device", "project", "name", "log.to", "log.weights", "log.required",
               "log.plots")
# Keys that may differ between machines, each its own: where it finds the data (data/layouts.listed_alike checks
# that every rank lists the same images) and keeps its caches, and its device and workers. Every other key must be
# rank 0's on every rank (utils/run.check_same_recipe).
MACHINE_KEYS = ("device", "data.name", "data.workers", "data.cache_dir", "data.shard_cache_gb")
# Not ddp.comm_hook: like train.precision it changes every gradient's value (bf16 keeps 8 bits of it), not only the
# order of fp32 sums, so a run resumed with another hook would not be the run it continues.


def always(cfg):
    """For keys that change what every run learns."""
    return True


def never(cfg):
    """For keys that set where a run is saved, what it logs or how fast it goes (up to float rounding), never what
    it learns: comparing runs on them says nothing about their results."""
    return False


def names_shards(name):
    """Whether data.name names a shard set (data/shard_sets.py reads it): a URL, a .json file, or a folder with
    dataset.json."""
    return (name.startswith(("http://", "https://")) or name.endswith(".json")
            or (Path(name) / "dataset.json").is_file())


def several_processes(cfg):
    """For keys of DDP and SyncBatchNorm, inert in a single process."""
    return WORLD_SIZE > 1


# When a key changes what a run learns, as a predicate on the resolved recipe: a key waits on the key that switches
# it on, or on the model, optimizer or schedule it belongs to; a key not listed here always does. TensorBoard's HParams
# tab holds only the keys that do (results_keys), so runs compare on what made them differ.
CHANGES_RESULTS_WHEN = {
    **dict.fromkeys(("model.width", "model.depth", "model.dropout", "model.norm"),
                    lambda cfg: cfg.model.name == "convnet"),
    "model.sync_bn": several_processes,
    **dict.fromkeys(("model.backbone_lr", "model.freeze_epochs"), lambda cfg: bool(cfg.model.weights)),
    "data.scale": lambda cfg: cfg.data.crop_padding == 0,
    "data.ra_magnitude": lambda cfg: cfg.data.auto_augment == "randaugment",
    "data.augmix_severity": lambda cfg: cfg.data.auto_augment == "augmix",
    "data.mix_switch_prob": lambda cfg: cfg.data.mixup_alpha > 0 and cfg.data.cutmix_alpha > 0,
    "data.jpeg_decode": lambda cfg: cfg.data.cache == "jpeg" or names_shards(cfg.data.name),  # a GPU decoder rounds
    "data.shard_window": lambda cfg: names_shards(cfg.data.name),
    "train.ema_steps": lambda cfg: cfg.train.ema_decay > 0,
    "train.threshold": never,  # what val's F1 counts, not what the model learns
    "optim.nesterov": lambda cfg: cfg.optim.name == "sgd" and cfg.optim.momentum > 0,
    "sched.warmup_factor": lambda cfg: cfg.sched.warmup_epochs > 0,
    "sched.min_lr_factor": lambda cfg: cfg.sched.name == "cosine",
    "sched.step_epochs": lambda cfg: cfg.sched.name == "step",
    "sched.milestones": lambda cfg: cfg.sched.name == "multistep",
    "sched.gamma": lambda cfg: cfg.sched.name in ("step", "multistep"),
    "ddp.comm_hook": several_processes,
    # device and data.workers are mostly 'auto', a request rather than what ran; train.deterministic trades speed
    # for runs that repeat exactly.
    **dict.fromkeys(("project", "name", "device", "data.workers", "data.cache_dir", "data.shard_cache_gb",
                     "data.shard_hosts", "data.skip_corrupt", "data.csv_allow_outside", "train.log_every_steps", "train.save_every_steps",
                     "train.hang_seconds",
                     "train.compile", "train.channels_last", "train.deterministic", "ddp.bucket_cap_mb",
                     "ddp.gradient_as_bucket_view", "log.to", "log.weights", "log.required", "log.plots"), never),
}
# Not train.accumulate, which a resume may change too: BatchNorm sees each micro-batch's statistics.


class RecipeError(SharedError):
    """A recipe that cannot be used, with a message naming the key and the file."""


def find_recipe(recipe, relative_to=None):
    """Path of a recipe given as a path (relative to relative_to, e.g. the folder of the recipe naming it as its
    base, else to the current directory), else as a name in recipes/ ('.yaml' may be left off)."""
    folders = [Path(relative_to) if relative_to is not None else Path(), RECIPES_DIR]
    names = [recipe] if recipe.endswith((".yaml", ".yml")) else [recipe, f"{recipe}.yaml"]
    for path in (folder / name for folder in folders for name in names):
        if path.is_file():
            return path
    available = ", ".join(sorted(p.name for p in RECIPES_DIR.glob("*.yaml")))
    if (folders[0] / recipe).is_dir():
        raise RecipeError(f"recipe '{recipe}' is a folder; give a recipe file in it, or the name of one in "
                          f"{RECIPES_DIR} ({available})")
    where = f"in {folders[0]}" if relative_to is not None else "as a path"
    raise RecipeError(f"recipe '{recipe}' not found {where} or in {RECIPES_DIR} (available: {available})")


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping, which PyYAML lets the later silently replace
    (a recipe's second 'train:' section would drop the first's keys)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor', which SafeLoader merges
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # PyYAML's own error says so
                continue
            if key in seen:
                raise yaml.MarkedYAMLError(problem=f"{key!r} is given twice in one mapping (the second would replace "
                                                   f"the first: merge them)", problem_mark=key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(path):
    """The YAML file at path, parsed (duplicate keys refused); an error names the file, line and column."""
    try:
        return yaml.load(Path(path).read_text(), UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = next((m for m in (e.problem_mark, e.context_mark) if marked_line(m).strip()), e.problem_mark)
        if mark is None:
            raise RecipeError(f"{path}: invalid YAML: {e}") from None
        what = ", ".join(filter(None, (e.context, e.problem)))
        snippet = f"\n{mark.get_snippet()}" if mark.buffer else ""
        raise RecipeError(f"{path}, line {mark.line + 1}, column {mark.column + 1}: invalid YAML: {what}{snippet}"
                          ) from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: invalid YAML: {e}") from None


def marked_line(mark):
    """The text of the line a YAML error's mark points into ('' without one): a problem found at the end of the
    text (a key without its ':', a list left open) is told by where its context began."""
    if mark is None or mark.buffer is None:
        return ""
    return mark.buffer[mark.buffer.rfind("\n", 0, mark.pointer) + 1:].split("\n", 1)[0].rstrip("\0")


def read_yaml(path):
    """Parse a recipe file into a dict, with errors that name the file."""
    content = load_yaml(path)
    if content is None:  # an empty file, or comments only: a file saved empty, not a recipe of defaults
        raise RecipeError(f"{path}: the recipe is empty; give it keys, or start from another: base: cls.yaml")
    if not isinstance(content, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of keys to values, got {type(content).__name__}")
    return content


def recipe_layers(path, seen=()):
    """(source, dict) pairs from the deepest base recipe to this one, following each 'base:' key."""
    path = Path(path).resolve()
    if path in seen:
        raise RecipeError(f"{path}: base recipes form a cycle: {' -> '.join(str(p) for p in (*seen, path))}")
    content = read_yaml(path)
    base = content.pop("base", None)
    layers = []
    if base is not None:
        if not isinstance(base, str):
            raise RecipeError(f"{path}: base must be a recipe name or path, got {base!r}")
        try:
            found = find_recipe(base, relative_to=path.parent)
        except RecipeError as e:
            raise RecipeError(f"{path}: base: {e}") from None
        layers = recipe_layers(found, (*seen, path))
    return [*layers, (str(path), content)]


def optional_strings(cls=None, prefix=""):
    """Dotted keys of the schema's optional strings: str keys whose default, '', means off."""
    keys = set()
    for f in fields(cls or Recipe):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            keys |= optional_strings(type(default), f"{prefix}{f.name}.")
        elif default == "" and f.type in (str, "str"):
            keys.add(f"{prefix}{f.name}")
    return keys


def spelled_off(layer, prefix=""):
    """layer with each optional string given as nothing ('key=', which the shell makes of key=''), null or none
    set to '', which is how the schema says off: every natural spelling of off works."""
    if not isinstance(layer, dict):
        return layer
    off = optional_strings()
    return {name: spelled_off(value, f"{prefix}{name}.") if isinstance(value, dict)
            else "" if f"{prefix}{name}" in off and (value is None or str(value).lower() in ("none", "null"))
            else value for name, value in layer.items()}


def merge_layer(cfg, layer, source):
    """Merge one layer onto the typed config, with errors that name the key, what it takes and the source."""
    if isinstance(layer, DictConfig):
        layer = OmegaConf.to_container(layer)
    layer = spelled_off(layer)
    check_keys(layer, source)
    try:
        return OmegaConf.merge(cfg, layer)
    except OmegaConfBaseException as e:
        key = re.sub(r"\[\d+\]$", "", getattr(e, "full_key", None) or "")  # data.scale[0]: the list is data.scale
        if key in schema_leaves():
            raise RecipeError(f"{source}: {key} must be {expected(key)}, got {shown(given(layer, key))}") from None
        raise RecipeError(f"{source}: {f'{key}: ' if key else ''}{str(e).splitlines()[0]}") from None


def schema_leaves(cls=Recipe, prefix=""):
    """{dotted key: (type, default)} of every key of the schema that holds a value, in the schema's order."""
    leaves = {}
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            leaves.update(schema_leaves(type(default), f"{prefix}{f.name}."))
        else:
            leaves[f"{prefix}{f.name}"] = (f.type, default)
    return leaves


SECTIONS = {f.name: type(f.default_factory()) for f in fields(Recipe) if callable(f.default_factory)}
LIST_LENGTHS = {"data.scale": 2, "data.mean": 3, "data.std": 3}  # the lists check_data_values takes at one length
TYPE_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text",
              Union[bool, str]: "true, false or auto"}


def as_override(value):
    """A value as key=value writes it on the command line: [0.5,1.0], true, resnet18."""
    if isinstance(value, (list, tuple, ListConfig)):
        return f"[{','.join(as_override(v) for v in value)}]"
    return str(value).lower() if isinstance(value, bool) else "" if value is None else str(value)


def expected(key):
    """What a schema key takes, in words with an example: 'a list of two numbers like data.scale=[0.08,1.0]'."""
    kind, default = schema_leaves()[key]
    if isinstance(default, list):
        count = {2: "two ", 3: "three "}.get(LIST_LENGTHS.get(key), "")
        words = f"a list of {count}{'names' if kind == list[str] else 'numbers'}"
    else:
        words = TYPE_WORDS[kind]
    return f"{words} like {key}={as_override(default)}" if default not in ("", []) else words


def shown(value):
    """A value given for a key, as an error message quotes it."""
    return "nothing" if value is None else repr(value)


def given(layer, key):
    """The value a layer (nested dicts) gives a dotted key, None where it gives none."""
    for name in key.split("."):
        layer = layer.get(name) if isinstance(layer, dict) else None
    return layer


def check_keys(layer, source):
    """Refuse a layer's unknown keys, with the key meant where one is near (on the command line with its value:
    epochs=3 -> train.epochs=3), and a section given a value (optim=3)."""
    leaves = schema_leaves()
    for key in flat_keys(layer):
        if key in SECTIONS:
            first = next(k for k in leaves if k.startswith(f"{key}."))
            raise RecipeError(f"{source}: {key} is a section, not a value: set its keys one by one, like "
                              f"{first}={as_override(leaves[first][1])}; got {shown(given(layer, key))}")
        if key in leaves:
            continue
        leaf = next((leaf for leaf in leaves if key.startswith(f"{leaf}.")), None)
        if leaf is not None:  # a leaf given a mapping
            raise RecipeError(f"{source}: {leaf} must be {expected(leaf)}, got {shown(given(layer, leaf))}")
        meant = closest_key(key)
        if meant is None:
            raise RecipeError(f"{source}: unknown key '{key}' (every key is in docs/recipes.md)")
        spelled = f"{meant}={as_override(given(layer, key))}" if source == COMMAND_LINE else f"'{meant}'"
        raise RecipeError(f"{source}: unknown key '{key}' (did you mean {spelled}?)")


def closest_key(name):
    """The schema key a mistyped or unqualified one means, or None: the key itself; a key whose last part it is
    (epochs -> train.epochs; of several, the most alike); a near miss of the whole key (optim.lrr -> optim.lr), then
    of its last part (epoch -> train.epochs)."""
    leaves = list(schema_leaves())
    last = name.rpartition(".")[2]
    same_last = [key for key in leaves if key.rpartition(".")[2] == last]
    if name in leaves or same_last:
        return name if name in leaves else max(same_last, key=lambda k: difflib.SequenceMatcher(None, name, k).ratio())
    near = difflib.get_close_matches(name, leaves, n=1)
    if near:
        return near[0]
    near = difflib.get_close_matches(last, [key.rpartition(".")[2] for key in leaves], n=1)
    return next(key for key in leaves if key.rpartition(".")[2] == near[0]) if near else None


def flag_as_key(words, flags):
    """'--epochs 3: recipe keys are set as key=value: train.epochs=3' for the first of flags (a command line's
    unrecognised words) that names a recipe key, as yolov5's --epochs and --batch-size do, else None. words: the
    whole command line, where a flag's value may follow it."""
    for i, word in enumerate(words):
        flag, _, value = word.partition("=")
        key = closest_key(flag[2:].replace("-", "_")) if word in flags and flag.startswith("--") else None
        if key is None:
            continue
        if not value and i + 1 < len(words) and not words[i + 1].startswith("-") and "=" not in words[i + 1]:
            value, word = words[i + 1], f"{word} {words[i + 1]}"
        value = value or ("true" if schema_leaves()[key][0] in (bool, Union[bool, str]) else "VALUE")
        return f"{word}: recipe keys are set as key=value: {key}={value}"
    return None


def keys_help(width=80):
    """The --help text on recipe keys: how they are set, where they are described, and each section's keys."""
    sections = {}
    for key in schema_leaves():
        section, _, name = key.rpartition(".")
        sections.setdefault(section or "top level", []).append(name)
    lines = textwrap.wrap("recipe keys: set any key as key=value after the options, over the recipe's value (e.g. "
                          "train.epochs=3 optim.lr=0.05 data.scale=[0.5,1.0]); each key's type, default and meaning "
                          "are in docs/recipes.md (python -m utils.config prints them). The keys:", width)
    for section, names in sections.items():
        lines += textwrap.wrap(", ".join(names), width, initial_indent=f"  {section}: ", subsequent_indent="    ")
    return "\n".join(lines)


def parse_device(device):
    """(type, GPU index or None) of a device value: auto, cpu, cuda, cuda:N or N (OmegaConf may give an int); None
    for anything else."""
    match = re.fullmatch(r"(auto|cpu|cuda)|(?:cuda:)?(\d+)", str(device))
    return None if match is None else (match[1], None) if match[1] else ("cuda", int(match[2]))


def parse_overrides(overrides):
    """OmegaConf dot-list ('optim.lr=0.05') to a config, with a clear error for a malformed pair."""
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0]:
            raise RecipeError(f"{COMMAND_LINE}: override '{item}' must look like key=value (e.g. optim.lr=0.05)")
        try:
            OmegaConf.from_dotlist([item])
        except (yaml.YAMLError, OmegaConfBaseException) as e:  # data.scale=[0.5,1 : YAML that does not parse
            key, value = item.split("=", 1)
            takes = f"{key} must be {expected(key)}, got {value!r}, which" if key in schema_leaves() else item
            raise RecipeError(f"{COMMAND_LINE}: {takes} does not parse as YAML ({str(e).splitlines()[0]})") from None
    return OmegaConf.from_dotlist(list(overrides))


def load_recipe(recipe, overrides=(), model_check=None):
    """Load a recipe (with its bases) and key=value overrides onto the schema; validate; return a read-only config.
    model.name is checked by model_check (name -> problem or None) when given: models.check_model_name."""
    path = find_recipe(recipe)
    cfg = OmegaConf.structured(Recipe)
    for source, layer in recipe_layers(path):
        cfg = merge_layer(cfg, layer, source)
    cfg = merge_layer(cfg, parse_overrides(overrides), COMMAND_LINE)
    source = f"{path} (with command-line overrides)" if overrides else str(path)
    if "/" in cfg.name or cfg.name in (".", ".."):  # a new run's (a resumed one keeps the name it had)
        raise RecipeError(f"{source}: name must be a folder's name, without '/' (to group runs in a folder, set "
                          f"project: project=runs/train/mine), got {cfg.name!r}")
    return checked(cfg, source, model_check)


def load_resumed_recipe(saved, overrides=(), source="checkpoint", model_check=None):
    """The recipe saved in a checkpoint, with key=value overrides of RESUME_KEYS only; validated (model.name by
    model_check, as in load_recipe) and read-only."""
    cfg = merge_layer(OmegaConf.structured(Recipe), saved, f"{source} recipe")
    resumed = merge_layer(cfg, parse_overrides(overrides), COMMAND_LINE)
    check_resumable(cfg, resumed, COMMAND_LINE)
    return checked(resumed, f"{source} recipe (with command-line overrides)" if overrides else f"{source} recipe",
                   model_check)


def checkpoint_recipe(saved, source):
    """The recipe saved in a checkpoint on the schema (keys added since take their defaults), read-only, for
    evaluating and exporting its model."""
    cfg = merge_layer(OmegaConf.structured(Recipe), saved, f"{source} recipe")
    OmegaConf.set_readonly(cfg, True)
    return cfg


def check_resumable(saved, resumed, source, own=()):
    """Refuse a resumed recipe that changes anything but RESUME_KEYS (and own: a machine's own keys, for a restart's
    ranks, each with its own recipe), naming the first such key. data.name may move
    from one shard set's location to another's (a server's new address, a local copy): the resume then checks each
    shard's SHA-256 against the checkpoint's (data/shard_sets.py check_same_shards). The old location may be gone
    (the set moved), so it counts as a shard set's unless it is still there as other data."""
    for key, new, old in differing_keys(OmegaConf.to_container(resumed), OmegaConf.to_container(saved)):
        moved_shards = (key == "data.name" and names_shards(new)
                        and (names_shards(old) or not Path(old).expanduser().exists()))
        if key not in RESUME_KEYS and key not in own and not moved_shards:
            raise RecipeError(f"{source}: {key}={new!r} cannot change on resume: the run so far was trained with "
                              f"{key}={old!r}; only {', '.join(RESUME_KEYS)} may change (start a new run for the "
                              f"others)")


def results_keys(cfg):
    """The dotted keys that change what this run learns (CHANGES_RESULTS_WHEN), in the schema's order."""
    return [key for key in flat_keys(OmegaConf.to_container(cfg)) if CHANGES_RESULTS_WHEN.get(key, always)(cfg)]


def differing_keys(recipe, other):
    """[(dotted key, its value in recipe, in other)] for each key of either nested dict whose values differ (None
    where a dict lacks it)."""
    a, b = OmegaConf.create(recipe), OmegaConf.create(other)
    keys = dict.fromkeys(flat_keys(recipe) + flat_keys(other))
    return [(key, OmegaConf.select(a, key), OmegaConf.select(b, key)) for key in keys
            if OmegaConf.select(a, key) != OmegaConf.select(b, key)]


def flat_keys(tree, prefix=""):
    """Dotted keys of the leaves of a nested dict: {'a': {'b': 1}} -> ['a.b']."""
    keys = []
    for name, value in tree.items():
        keys += flat_keys(value, f"{prefix}{name}.") if isinstance(value, dict) else [f"{prefix}{name}"]
    return keys


def checked(cfg, source, model_check=None):
    """Resolve interpolations, check values, and make the config read-only."""
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as e:
        raise RecipeError(f"{source}: cannot resolve interpolation: {str(e).splitlines()[0]}") from None
    check_values(cfg, source, model_check)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def nearest_multiples(value, factor):
    """The multiples of factor just below and above value, in words ('63 or 66')."""
    below = value // factor * factor
    return f"{below} or {below + factor}" if below else str(factor)


def check_values(cfg, source, model_check=None):
    """Reject values the schema types allow but training can't use, naming the key and the source; model.name by
    model_check (name -> problem or None) when given: which names can be built is for models/ to say."""
    problem = model_check(cfg.model.name) if model_check else None
    if problem:
        raise RecipeError(f"{source}: model.name={cfg.model.name!r}: {problem}")

    def require(ok, key, expected):
        if not ok:
            raise RecipeError(f"{source}: {key} must be {expected}, got {OmegaConf.select(cfg, key)!r}")

    for check in (check_model_values, check_data_values, check_train_values, check_other_values):
        check(cfg, require)


def check_model_values(cfg, require):
    """The model section's values (check_values)."""
    require(cfg.model.width >= 1 and cfg.model.depth >= 1, "model.width", "positive (and so must model.depth)")
    require(0 <= cfg.model.dropout < 1, "model.dropout", "in [0, 1)")
    require(cfg.model.norm in ("batch", "group", "none"), "model.norm", "batch, group or none")
    require(cfg.model.backbone_lr >= 0, "model.backbone_lr", ">= 0 (0 trains only the new head)")
    require(cfg.model.freeze_epochs >= 0, "model.freeze_epochs", ">= 0 (0: no freezing)")
    require(not cfg.model.sync_bn or cfg.data.drop_last or WORLD_SIZE == 1, "model.sync_bn",
            "used with data.drop_last=true on several processes (SyncBatchNorm's collectives need every rank to "
            "take every step)")


def check_data_values(cfg, require):
    """The data section's values (check_values)."""
    require(cfg.data.img_size >= 1, "data.img_size", "a positive number of pixels")
    require(len(cfg.data.scale) == 2 and 0 < cfg.data.scale[0] <= cfg.data.scale[1] <= 1, "data.scale",
            "[min, max] with 0 < min <= max <= 1")
    require(0 <= cfg.data.hflip <= 1, "data.hflip", "a probability in [0, 1]")
    require(cfg.data.crop_padding >= 0, "data.crop_padding", ">= 0 (0 uses RandomResizedCrop over data.scale)")
    require(cfg.data.auto_augment in AUTO_AUGMENTS, "data.auto_augment", f"one of {', '.join(map(repr, AUTO_AUGMENTS))}")
    require(0 <= cfg.data.ra_magnitude <= 30, "data.ra_magnitude", "in [0, 30]")
    require(1 <= cfg.data.augmix_severity <= 10, "data.augmix_severity", "in [1, 10]")
    require(0 <= cfg.data.random_erase <= 1, "data.random_erase", "a probability in [0, 1]")
    require(cfg.data.mixup_alpha >= 0, "data.mixup_alpha", ">= 0 (0 turns MixUp off)")
    require(cfg.data.cutmix_alpha >= 0, "data.cutmix_alpha", ">= 0 (0 turns CutMix off)")
    require(0 <= cfg.data.mix_switch_prob <= 1, "data.mix_switch_prob", "a probability in [0, 1]")
    mixing = cfg.data.mixup_alpha > 0 or cfg.data.cutmix_alpha > 0
    require(not mixing or cfg.train.batch_size // WORLD_SIZE % 2 == 0, "train.batch_size",
            f"an even number per process with MixUp or CutMix (they mix pairs of images on one process), that is a "
            f"multiple of {2 * WORLD_SIZE} on {WORLD_SIZE} process(es)")
    require(cfg.data.repeats >= 1, "data.repeats", ">= 1 (1: no repeated augmentation)")
    require(cfg.data.val_img_size >= 0, "data.val_img_size", ">= 0 (0: data.img_size)")
    require(0 < cfg.data.crop_pct <= 1, "data.crop_pct", "in (0, 1]")
    require(cfg.data.val_resize in ("crop", "squash"), "data.val_resize", "crop (centre crop) or squash (whole image)")
    require(len(cfg.data.mean) == 3, "data.mean", "three values (R, G, B)")
    require(len(cfg.data.std) == 3 and all(s > 0 for s in cfg.data.std), "data.std", "three positive values")
    require(cfg.data.cache in ("none", "ram", "jpeg"), "data.cache", "none (decode per image), ram or jpeg")
    require(cfg.data.jpeg_decode in ("auto", "cpu", "device"), "data.jpeg_decode", "auto, cpu or device")
    require(0 <= cfg.data.val_split < 1, "data.val_split", "in [0, 1) (0: the data holds its own val split)")
    require(cfg.data.sampler in ("shuffle", "balanced"), "data.sampler", "shuffle or balanced")
    require(cfg.data.shard_window >= 1, "data.shard_window", "a number of shards >= 1")
    require(cfg.data.shard_cache_gb >= 0, "data.shard_cache_gb", ">= 0 (0: keep every fetched shard)")
    require(all(host and not set("/ @") & set(host) for host in cfg.data.shard_hosts), "data.shard_hosts",
            "a list of hosts, each host or host:port (no scheme, path or user)")
    for key in ("auto_augment", "random_erase"):
        require(cfg.data.cache == "none" or not cfg.data[key], f"data.{key}",
                f"off with data.cache={cfg.data.cache}, which crops and flips whole batches (it runs per image: set "
                f"data.cache=none)")
    require(cfg.data.workers == "auto" or cfg.data.workers.isdigit(), "data.workers", "auto or a number >= 0")
    if cfg.data.multilabel:
        require(cfg.data.cache != "jpeg", "data.cache", "none or ram with data.multilabel=true (the JPEG cache holds "
                                                         "one label per image)")
        require(not names_shards(cfg.data.name), "data.name", "a CSV root or multidigits with data.multilabel=true "
                                                              "(shard sets hold one label per image)")
        require(cfg.data.sampler == "shuffle", "data.sampler", "shuffle with data.multilabel=true (balanced draws a "
                                                               "class, then one of its images: one class per image)")


def check_train_values(cfg, require):
    """The train section's values (check_values)."""
    require(cfg.train.epochs >= 1, "train.epochs", ">= 1")
    require(cfg.train.batch_size >= 1, "train.batch_size", ">= 1")
    require(cfg.train.batch_size % WORLD_SIZE == 0, "train.batch_size",
            f"a multiple of the {WORLD_SIZE} processes (the global batch is split evenly between them), e.g. "
            f"{nearest_multiples(cfg.train.batch_size, WORLD_SIZE)}")
    require(cfg.train.accumulate >= 1, "train.accumulate", ">= 1 (1: no gradient accumulation)")
    require(cfg.train.batch_size // WORLD_SIZE >= cfg.train.accumulate, "train.accumulate",
            f"at most the per-process batch ({cfg.train.batch_size // WORLD_SIZE}), so no micro-batch is empty")
    require(0 <= cfg.train.label_smoothing < 1, "train.label_smoothing", "in [0, 1)")
    require(cfg.train.save_every_steps >= 0, "train.save_every_steps", ">= 0 (0 saves at epoch ends only)")
    require(0 <= cfg.train.ema_decay < 1, "train.ema_decay", "in [0, 1) (0 turns EMA off)")
    require(cfg.train.ema_steps >= 1, "train.ema_steps", ">= 1")
    require(cfg.train.patience >= 0, "train.patience", ">= 0 (0 trains every epoch)")
    require(cfg.train.hang_seconds == 0 or 2 <= cfg.train.hang_seconds < math.inf, "train.hang_seconds",
            "0 (off) or a number of seconds >= 2 (each rank shows it lives every 0.5 s)")
    require(cfg.train.log_every_steps >= 0, "train.log_every_steps", ">= 0 (0 logs the loss per epoch only)")
    require(cfg.train.precision in ("fp32", "bf16", "fp16", "auto"), "train.precision", "one of fp32, bf16, fp16, auto")
    require(cfg.train.channels_last in (True, False, "auto"), "train.channels_last", "true, false or auto")
    require(cfg.train.class_weights in ("", "balanced"), "train.class_weights", "'' (off) or balanced")
    require(cfg.train.best_metric in (("auto", "map") if cfg.data.multilabel else ("auto", "top1", "balanced_top1")),
            "train.best_metric", "auto or map with data.multilabel=true" if cfg.data.multilabel else
            "auto, top1 or balanced_top1 (map is for data.multilabel=true)")
    require(0 < cfg.train.threshold < 1, "train.threshold", "a probability in (0, 1)")


def check_other_values(cfg, require):
    """The optim, sched and ddp sections' values, and the top-level keys (check_values)."""
    require(cfg.optim.name in ("sgd", "adamw"), "optim.name", "sgd or adamw")
    require(cfg.optim.lr > 0, "optim.lr", "> 0")
    require(cfg.optim.weight_decay >= 0, "optim.weight_decay", ">= 0")
    require(cfg.optim.clip_grad_norm >= 0, "optim.clip_grad_norm", ">= 0 (0 disables clipping)")
    require(cfg.sched.warmup_epochs >= 0, "sched.warmup_epochs", ">= 0")
    require(0 < cfg.sched.warmup_factor <= 1, "sched.warmup_factor", "in (0, 1]")
    require(0 <= cfg.sched.min_lr_factor <= 1, "sched.min_lr_factor", "in [0, 1]")
    require(cfg.sched.name in SCHEDULES, "sched.name", ", ".join(SCHEDULES))
    require(cfg.sched.step_epochs > 0, "sched.step_epochs", "> 0")
    require(list(cfg.sched.milestones) == sorted(cfg.sched.milestones) and all(m > 0 for m in cfg.sched.milestones),
            "sched.milestones", "increasing positive epochs")
    require(0 < cfg.sched.gamma <= 1, "sched.gamma", "in (0, 1]")
    require(cfg.ddp.bucket_cap_mb > 0, "ddp.bucket_cap_mb", "> 0 (MB of gradients per all-reduce)")
    require(cfg.ddp.comm_hook in COMM_HOOKS, "ddp.comm_hook", ", ".join(COMM_HOOKS))
    require(parse_device(cfg.device) is not None, "device", DEVICES)
    require(0 <= cfg.seed < 2**31, "seed", "in [0, 2**31)")
    require(bool(cfg.name.strip()), "name", "a non-empty run name")
    require(set(cfg.log.to) <= {"tensorboard", *TRACKERS} and len(set(cfg.log.to)) == len(cfg.log.to), "log.to",
            f"a list of distinct loggers among tensorboard, {', '.join(TRACKERS)} (e.g. [tensorboard,mlflow])")
    for name in cfg.log.to:
        require(missing(name) is None, "log.to", f"loggers that are installed ({name} {missing(name)})")


def best_metric(cfg):
    """train.best_metric as it applies: auto is top1, or map for multi-label data."""
    if cfg.train.best_metric == "auto":
        return "map" if cfg.data.multilabel else "top1"
    return cfg.train.best_metric


def recipe_to_yaml(cfg):
    """The resolved recipe as YAML text, as saved with each run."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def key_table(cls=Recipe, prefix=""):
    """docs/recipes.md's table of recipe keys, generated from the schema: key, default and the comment beside it
    (print it with `python -m utils.config`)."""
    comments = dict(re.findall(r"^    (\w+): [^#\n]*?  # (.*)$", inspect.getsource(cls), re.MULTILINE))
    rows = [] if prefix else ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            rows += key_table(type(default), f"{prefix}{f.name}.")
        else:
            shown = json.dumps(default) if isinstance(default, str) else repr(default)
            rows.append(f"| `{prefix}{f.name}` | {shown} | {comments[f.name]} |")
    return rows if prefix else "\n".join(rows)


if __name__ == "__main__":
    print(key_table())
