"""Networks: build_model() turns the recipe's model section into an nn.Module, start_from() and load_weights() start it
from a local state_dict or weights by name (models/pretrained.py), check_input_size() tries it once."""

import difflib
import importlib.util
from functools import cache
from pathlib import Path

import torch
import torchvision

from models.convnet import ConvNet
from models.pretrained import follow_weights, head_keys, named_state, weights_kind
from models.resnet_cifar import resnet18_cifar
from utils.checkpoint import load_checkpoint, state_dict_mismatch
from utils.distributed import on_rank0
from utils.general import LOGGER, WORLD_SIZE, SharedError, UsageError, colorstr
from utils.precision import settle_auto
from utils.torch_utils import batchnorm_layers, memory_format

# Their training-mode output is (logits, aux logits): build them with the main head only, so every model
# returns plain logits. init_weights=True keeps torchvision's current initialisation and silences its warning.
MAIN_HEAD_ONLY = {"googlenet": {"aux_logits": False, "init_weights": True},
                  "inception_v3": {"aux_logits": False, "init_weights": True}}


OURS = ("convnet", "resnet18_cifar")  # built here (models/), not by torchvision or timm


@cache
def model_names():
    """Every name model.name accepts besides timm/NAME: ours and torchvision's classification models."""
    return [*OURS, *torchvision.models.list_models(module=torchvision.models)]


def check_model_name(name):
    """None if model.name can be built here, else what is wrong with it (a timm model without timm installed, a
    name that no library has)."""
    if name.startswith("timm/"):
        if importlib.util.find_spec("timm") is None:
            return "needs timm, which is not installed here (pip install timm)"
        import timm
        return None if timm.is_model(name.removeprefix("timm/")) else "timm has no model of that name"
    if name in model_names():
        return None
    match = difflib.get_close_matches(name, model_names(), n=1)
    return (f"no such model; give {', '.join(OURS)}, a torchvision classification model or timm/NAME"
            f"{f' (closest: {match[0]!r})' if match else ''}")


def build_model(cfg, num_classes, img_size=224):
    """A randomly initialised classifier for num_classes classes from the recipe's model section, built for
    img_size x img_size images where the architecture fixes its input size (vit_*, maxvit_t)."""
    if cfg.name == "convnet":
        return ConvNet(num_classes, width=cfg.width, depth=cfg.depth, dropout=cfg.dropout, norm=cfg.norm)
    if cfg.name == "resnet18_cifar":
        return resnet18_cifar(num_classes)
    if cfg.name.startswith("timm/"):
        import timm  # optional; check_model_name said whether it is installed
        return timm.create_model(cfg.name.removeprefix("timm/"), pretrained=False, num_classes=num_classes,
                                 **({"img_size": img_size} if cfg.name.startswith("timm/vit") else {}))
    size = {"image_size": img_size} if cfg.name.startswith("vit_") else \
        {"input_size": (img_size, img_size)} if cfg.name.startswith("maxvit") else {}
    try:  # weights=None: nothing is downloaded; these machines may have no internet
        return torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes, **size,
                                            **MAIN_HEAD_ONLY.get(cfg.name, {}))
    except (AssertionError, ValueError) as e:  # built for a size it cannot take (vit_*, maxvit_t)
        reason = str(e).strip().splitlines()[0]
        raise UsageError(f"model.name={cfg.name!r} cannot be built for {img_size}x{img_size} images "
                         f"(data.img_size={img_size}): {reason}; choose another data.img_size or model.name") from None


def has_batchnorm(cfg, img_size):
    """Whether the network of the model section cfg has BatchNorm layers."""
    return bool(batchnorm_layers(meta_model(cfg, img_size)))


def settle(cfg):
    """The recipe with what it leaves to its pretrained weights (data preprocessing) and to the hardware ('auto'
    precision and memory format) settled, before the run saves it: recipe.yaml and the checkpoints hold what ran."""
    return settle_auto(follow_weights(cfg), is_convolutional)


def is_convolutional(cfg):
    """Whether the recipe's network computes mostly in convolutions: more than one Conv2d (a vision transformer's
    only one is its patch embedding). train.channels_last=auto follows it (utils/precision.settle_auto)."""
    model = meta_model(cfg.model, cfg.data.img_size)
    return sum(isinstance(m, torch.nn.Conv2d) for m in model.modules()) > 1


def meta_model(cfg, img_size):
    """The network of the model section cfg, built on the meta device (no memory, no weights drawn), or on the CPU
    where its construction reads a tensor's value (timm's drop-path rates)."""
    try:
        with torch.device("meta"):
            return build_model(cfg, 2, img_size)
    except (RuntimeError, NotImplementedError):
        return build_model(cfg, 2, img_size)


def check_batch_for_batchnorm(cfg, world_size=WORLD_SIZE):
    """Refuse, before any data is read, a recipe whose every step gives a process one image per micro-batch while the
    model has BatchNorm layers, which normalise a batch by its own statistics: one image has none worth the name
    (and a 1x1 feature map fails). An epoch's last, partial step may still leave a process one image: train_step
    normalises it by the running statistics (one_image_batchnorm)."""
    batch, accumulate = cfg.train.batch_size, cfg.train.accumulate
    per_process = batch // world_size
    statistics_over = per_process // accumulate * (world_size if cfg.model.sync_bn else 1)
    if statistics_over >= 2 or not has_batchnorm(cfg.model, cfg.data.img_size):
        return
    images = f"{per_process} image{'s' * (per_process != 1)} per step"
    if accumulate > 1:
        images += f" in micro-batches {'of' if per_process == accumulate else 'as small as'} 1 image"
    ways = [f"train.batch_size={2 * accumulate * world_size} or more",
            *(["a lower train.accumulate"] if accumulate > 1 else []),
            *(["model.norm=group"] if cfg.model.name == "convnet" else [])]
    ways = ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]
    processes = f"{world_size} process{'es' * (world_size != 1)}"
    accumulating = f" with train.accumulate={accumulate}" if accumulate > 1 else ""
    raise SharedError(f"train.batch_size={batch} on {processes}{accumulating} gives each process {images}: too few "
                      f"for the BatchNorm layers of model.name={cfg.model.name}, which normalise by the batch's own "
                      f"statistics; use {ways}")


def read_weights(path):
    """The state_dict file model.weights names (weights_only), or a clear error."""
    if not Path(path).is_file():
        raise UsageError(f"model.weights={path!r}: no such file; give a local state_dict file, or weights by name: "
                         f"DEFAULT or a torchvision weights name of model.name (IMAGENET1K_V1, ...; for timm/NAME, a "
                         f"timm tag)")
    state = load_checkpoint(path)
    if not isinstance(state, dict):
        raise UsageError(f"model.weights={path!r}: not a state_dict")
    return state


def load_weights(model, state, num_classes, source):
    """Load a state_dict (a train.py checkpoint's 'model', or a plain one such as torchvision's files) into model,
    except its classifier head where the class count differs, which stays as initialised; returns the head's keys
    that were left so. Anything else that does not fit is an error naming the key."""
    if isinstance(state.get("model"), dict):  # a checkpoint of train.py
        state = state["model"]
    state = {k.removeprefix("module.").removeprefix("_orig_mod."): v for k, v in state.items()}  # DDP, compile
    own, head = model.state_dict(), head_keys(model, num_classes)
    for key, value in state.items():
        if key not in own:
            raise SharedError(f"{source}: '{key}' is not a weight of this model; the file is for another model.name")
        if value.shape != own[key].shape and key not in head:
            raise SharedError(f"{source}: '{key}' has shape {tuple(value.shape)}, the model {tuple(own[key].shape)}; "
                             f"the file is for another model.name or size")
    missing = [k for k in own if k not in state and k not in head and not k.endswith("num_batches_tracked")]
    if missing:
        raise SharedError(f"{source}: has no '{missing[0]}' ({len(missing)} weight(s) missing); the file is for "
                         f"another model.name")
    kept = {k: v for k, v in state.items() if v.shape == own[k].shape}
    model.load_state_dict(kept, strict=False)
    return [k for k in head if k not in kept]


def start_from(model, cfg, num_classes):
    """model.weights: a local file (rank 0 reads it and shares it) or weights by name (downloaded once per machine,
    every rank reads the cache); every rank loads them, the classifier head resized. Logs what came from where."""
    source = f"model.weights={cfg.weights}"
    if weights_kind(cfg.name, cfg.weights) == "file":
        state, what = on_rank0(read_weights, cfg.weights), f"weights from {cfg.weights}"
    else:
        state, what = named_state(cfg.name, cfg.weights, source)
    resized = load_weights(model, state, num_classes, source)
    head = f"; {', '.join(resized)} initialised afresh for {num_classes} classes" if resized else ""
    LOGGER.info(f"{colorstr('model:')} loaded {what}{head}")


def model_from_checkpoint(ckpt, cfg, source, device=None):
    """The network a checkpoint holds (built from its recipe cfg, with its weights) in eval mode; with a device, on
    it in the memory format it trained in (in bf16 another layout's kernels round otherwise than the run's
    validation; a checkpoint older than train.channels_last trained contiguous: its 'auto' is the key's default,
    never saved)."""
    model = build_model(cfg.model, len(ckpt["classes"]), cfg.data.img_size)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UsageError(f"{source}: its weights do not fit the model of its recipe ({cfg.model.name}): "
                         f"{state_dict_mismatch(e)}") from None
    if device is not None:
        model = model.to(device, memory_format=memory_format(cfg.train.channels_last is True))
    return model.eval()


@torch.no_grad()
def check_input_size(model, name, img_size, device, key="data.img_size"):
    """Run one blank image through model, so a network too deep for img_size, or built for one fixed size (vit_*),
    fails here with the recipe keys named instead of mid-run with a traceback."""
    was_training = model.training
    model.eval()  # no BatchNorm statistics are updated, no random number is drawn
    try:
        model(torch.zeros(1, 3, img_size, img_size, device=device))
    except torch.cuda.OutOfMemoryError:  # not a size problem: say so as torch does
        raise
    except (RuntimeError, AssertionError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"model.name={name!r} cannot take {img_size}x{img_size} images ({key}={img_size}): "
                         f"{reason}; choose another {key} or model.name") from None
    finally:
        model.train(was_training)
