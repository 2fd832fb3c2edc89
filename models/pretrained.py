"""Pretrained weights by name: model.weights as DEFAULT or a torchvision weights name (IMAGENET1K_V1, ...), or for
timm/NAME a timm pretrained tag, downloaded by torchvision's and timm's own machinery into their standard caches
(one process per machine, the others waiting), with the preprocessing the weights were trained with; and the
fine-tuning controls of the pretrained part (model.backbone_lr, model.freeze_epochs)."""

import hashlib
import http.client
import math
import os
import re
from pathlib import Path
from urllib.parse import urlparse

import torch
import torchvision
from omegaconf import OmegaConf
from torch import nn

from utils.checkpoint import load_checkpoint
from utils.config import DataConfig
from utils.download import Refused, fetch
from utils.general import LOGGER, RANK, SharedError, UsageError, colorstr, error_line
from utils.torch_utils import batchnorm_layers
from utils.once import atomic_write, watching
from utils.once import once_per_machine as once_per_machine_writing

# How torchvision's weights enums spell their members (DEFAULT, IMAGENET1K_V1, IMAGENET1K_SWAG_E2E_V1): a value so
# spelled is a name, anything else a file. timm's tags (a1_in1k, tv_in1k) are lower case, so for timm/NAME a value
# is a tag unless it looks like a path.
TORCHVISION_NAME = re.compile(r"[A-Z][A-Z0-9_]*")
READ_TIMEOUT = float(os.getenv("CLS_READ_TIMEOUT", 60))  # seconds a download waits for the answer, and per byte
# bytes a second: a download ends READ_TIMEOUT + its size at this rate after its start (a trickling server); low, as
# the weights come over the internet: ResNet-50's 98 MB may take 80 minutes
READ_MIN_RATE = float(os.getenv("CLS_READ_MIN_RATE", 20e3))
WEIGHTS_BYTES = 2**34  # the most a weights file may hold: torchvision's largest (ViT-H/14 SWAG) is 2.5 GB


def weights_kind(model_name, weights):
    """What model.weights names: None (nothing), 'file' (a local state_dict), 'torchvision' or 'timm' (by name)."""
    if not weights:
        return None
    if model_name.startswith("timm/"):
        path = Path(weights)
        return "file" if path.suffix or "/" in weights or path.exists() else "timm"
    return "torchvision" if TORCHVISION_NAME.fullmatch(weights) else "file"


def torchvision_weights(model_name, name):
    """The member of model_name's torchvision weights enum that name (DEFAULT or e.g. IMAGENET1K_V2) names, or an
    error that lists the names it has."""
    try:
        members = torchvision.models.get_model_weights(model_name).__members__
    except (ValueError, KeyError):
        raise SharedError(f"model.weights={name!r}: model.name={model_name!r} has no torchvision weights by name; "
                          f"give a local state_dict file") from None
    if name not in members:
        raise SharedError(f"model.weights={name!r}: torchvision has no such weights for {model_name}; it has "
                          f"{', '.join(members)}")
    return members[name]


def cache_path(weights):
    """Where torch.hub.load_state_dict_from_url (and so torchvision) keeps a weights file: TORCH_HOME's hub/checkpoints,
    under the URL's file name."""
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(weights.url).path).name


def download(weights, path, source, report):
    """Download the weights to path (fetch_url, checked against the SHA-256 prefix in the file name as torch.hub
    checks it), reporting the bytes received; None, or on failure the one line to report."""
    LOGGER.info(f"{colorstr('model:')} downloading {weights} from {weights.url} to {path}")
    match = torch.hub.HASH_REGEX.search(path.name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fetch_url(weights.url, path, match and match.group(1), report)
    except (OSError, http.client.HTTPException, Refused, RuntimeError) as e:  # fetch's failures; a wrong checksum
        return (f"{source}: cannot download {weights} from {weights.url} ({error_line(e) or type(e).__name__}); "
                f"without internet, place a copy of that file at {path}, or train from scratch with "
                f"model.weights=''")
    return None


def fetch_url(url, path, hash_prefix, report):
    """Download url to path whole (utils/once.atomic_write) with utils/download.py's bounds (the answer within
    READ_TIMEOUT s, then READ_MIN_RATE on average; torch.hub's download has none: a silent server held every rank
    forever), reporting the bytes of each chunk as it arrives. A file whose SHA-256 does not start with hash_prefix
    is refused with torch.hub's words."""
    digest = hashlib.sha256()
    with atomic_write(path) as tmp, open(tmp, "wb") as out:

        def write(chunk):
            out.write(chunk)
            digest.update(chunk)
            report(len(chunk))
        fetch(url, write, WEIGHTS_BYTES, READ_TIMEOUT, READ_MIN_RATE, "a weights file", headers={"User-Agent": "cls"})
        if hash_prefix and not digest.hexdigest().startswith(hash_prefix):
            raise RuntimeError(f'invalid hash value (expected "{hash_prefix}", got "{digest.hexdigest()}")')


def once_per_machine(fetch):
    """Run fetch(report) (None, or the line to report when it failed) on local rank 0 while the other ranks of its
    machine wait on the progress it reports (utils/once.py); a failure on any machine stops every rank with that
    line."""
    def fetch_or_raise(report):
        error = fetch(report)
        if error:
            raise UsageError(error)  # met by this rank alone: the others stop on its report
    once_per_machine_writing("weights", "downloading weights", fetch_or_raise)


def torchvision_state(weights, source):
    """The state_dict of torchvision weights, from torch's cache, downloaded there first where missing (once per
    machine); every rank reads the cached file. A file placed there by hand is used as it is."""
    path = cache_path(weights)
    once_per_machine(lambda report: None if path.is_file() else download(weights, path, source, report))
    try:
        return load_checkpoint(path), f"{weights} from {path}"
    except UsageError as e:  # a file placed there by hand that is not one; every rank reads the same
        raise SharedError(f"{source}: {e}; replace it with {weights.url}, or remove it to download it") from None


def timm_name(model_name, tag):
    """timm's name for a model and pretrained tag: 'resnet18.a1_in1k', or the architecture alone for its default."""
    arch = model_name.removeprefix("timm/")
    return arch if tag == "DEFAULT" else f"{arch}.{tag}"


def timm_config(model_name, tag):
    """timm's pretrained config (source and preprocessing) of the tagged weights, or an error listing the tags."""
    import timm  # optional; check_model_name said whether it is installed

    name = timm_name(model_name, tag)
    try:
        config = timm.models.get_pretrained_cfg(name)
    except RuntimeError:  # an unknown tag
        config = None
    if config is None or not config.has_weights:
        tags = [n.partition(".")[2] for n in timm.list_pretrained(f"{timm_name(model_name, 'DEFAULT')}.*")]
        raise SharedError(f"model.weights={tag!r}: timm has no such pretrained weights for {model_name}; it has "
                          f"{', '.join(['DEFAULT', *tags]) if tags else 'none'}")
    return config


def timm_state(model_name, tag, source):
    """The state_dict of timm's pretrained weights, through timm (the Hugging Face cache, or TORCH_HOME for weights
    hosted elsewhere), downloaded there first where missing (once per machine); then every rank reads the cache."""
    import timm

    name, config = timm_name(model_name, tag), timm_config(model_name, tag)
    url, place = timm_source(config)

    loaded = {}

    def fetch(report):
        try:
            with watching(place if config.hf_hub_id else place.parent, report):  # timm reports no progress itself
                loaded.update(timm.create_model(name, pretrained=True).state_dict())  # kept: not built twice here
        except (OSError, RuntimeError, ValueError) as e:  # requests' and huggingface_hub's errors are OSErrors
            fill = f" (hf download {config.hf_hub_id} fills it)" if config.hf_hub_id else ""
            return (f"{source}: cannot download timm's {name} from {url} ({error_line(e) or type(e).__name__}); "
                    f"without internet, place a copy at {place}{fill}, or train from scratch with "
                    f"model.weights=''")
        return None
    once_per_machine(fetch)
    return loaded or timm.create_model(name, pretrained=True).state_dict(), f"timm's {name} from {place}"


def timm_source(config):
    """(URL, where in the cache it goes) of timm's pretrained weights: a Hugging Face Hub repository and its cache
    folder, else a URL and torch's cache file for it."""
    if config.hf_hub_id:
        from huggingface_hub import constants  # installed with timm

        folder = Path(constants.HF_HUB_CACHE) / f"models--{config.hf_hub_id.replace('/', '--')}"
        return f"https://huggingface.co/{config.hf_hub_id}", folder
    return config.url, cache_path(config)


def named_state(model_name, weights, source):
    """(state_dict, what it is and where it came from) of weights named by model.weights."""
    if weights_kind(model_name, weights) == "timm":
        return timm_state(model_name, weights, source)
    return torchvision_state(torchvision_weights(model_name, weights), source)


def weights_preprocessing(model_name, weights):
    """The data keys the named weights were trained and evaluated with, from their own transforms (torchvision) or
    pretrained config (timm): mean, std, val_img_size (their centre crop) and crop_pct (crop / resize); None for no
    weights or a file. Nothing is downloaded."""
    kind = weights_kind(model_name, weights)
    if kind == "torchvision":
        own = torchvision_weights(model_name, weights).transforms()
        crop, resize = own.crop_size[0], own.resize_size[0]
        return {"mean": list(own.mean), "std": list(own.std), "val_img_size": crop, "crop_pct": crop / resize}
    if kind == "timm":
        config = timm_config(model_name, weights)
        return {"mean": list(config.mean), "std": list(config.std), "val_img_size": config.input_size[-1],
                "crop_pct": config.crop_pct}
    return None


def follow_weights(cfg):
    """The recipe with the data keys of weights_preprocessing set as its named weights were trained with, where the
    recipe leaves them at the schema's defaults; where it sets other values, it keeps them and rank 0 warns once.
    Settled before the run, so the saved recipe (recipe.yaml, checkpoints) holds what was used: val.py, predict.py
    and export.py read it from there."""
    own = weights_preprocessing(cfg.model.name, cfg.model.weights)
    if own is None:
        return cfg
    default, follow, differ = DataConfig(), {}, []
    for key, theirs in own.items():
        ours = cfg.data[key]
        if same(ours, getattr(default, key)):
            follow[key] = theirs
        elif not same(ours, theirs):
            differ.append(f"data.{key}={plain(ours)} (theirs: {round(theirs, 4) if key == 'crop_pct' else theirs})")
    if differ and RANK == 0:
        LOGGER.warning(f"model.weights={cfg.model.weights}: the recipe's {', '.join(differ)} differ from the "
                       f"preprocessing the weights were trained with; the recipe's are used")
    return OmegaConf.merge(cfg, {"data": follow}) if follow else cfg


def plain(value):
    """A recipe value as a plain number or list of numbers."""
    return list(value) if OmegaConf.is_list(value) or isinstance(value, (list, tuple)) else value


def same(a, b):
    """Whether two numbers, or lists of numbers, are equal up to float rounding (0.875 and 224 / 256 are)."""
    a, b = ([float(x) for x in v] if isinstance(v, list) else [float(v)] for v in (plain(a), plain(b)))
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-6) for x, y in zip(a, b))


def fine_tuning(cfg, num_classes, model):
    """(the head's parameter names, the pretrained part's lr factor, its frozen epochs) of model.backbone_lr and
    model.freeze_epochs, which act with model.weights only; (None, 1.0, 0) when they do not act."""
    backbone_lr, freeze = cfg.backbone_lr, cfg.freeze_epochs
    if backbone_lr == 1 and freeze == 0:
        return None, 1.0, 0
    if not cfg.weights:  # e.g. folder.yaml trained from scratch: said, as it is no mistake
        LOGGER.info(f"{colorstr('fine-tuning:')} off: model.backbone_lr={backbone_lr} and model.freeze_epochs={freeze} "
                    f"act with model.weights only; without it every layer is new and trains at optim.lr")
        return None, 1.0, 0
    head = head_keys(model, num_classes)
    if not head:
        raise SharedError(f"model.backbone_lr, model.freeze_epochs: model.name={cfg.name!r} has no classifier layer of "
                          f"{num_classes} outputs to tell the new head from the pretrained part; leave them at 1 and 0")
    frozen = f", frozen for the first {freeze} epoch(s) (BatchNorm statistics too)" if freeze else ""
    LOGGER.info(f"{colorstr('fine-tuning:')} the pretrained part at lr x{backbone_lr:g}{frozen}; the new head "
                f"({', '.join(head)}) at optim.lr")
    return head, backbone_lr, freeze


def head_keys(model, num_classes):
    """The state_dict keys of the classifier head: the last Linear or Conv2d layer with num_classes outputs."""
    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and m.out_features == num_classes
              or isinstance(m, nn.Conv2d) and m.out_channels == num_classes]
    if not layers:
        return []
    name, layer = layers[-1]
    return [f"{name}.{k}" for k, _ in layer.named_parameters()]


def freeze_batchnorm(model):
    """Put every BatchNorm layer in eval mode: its running statistics stay as they are, as the frozen weights do
    (the head, the last layer, has none)."""
    for layer in batchnorm_layers(model):
        layer.eval()
