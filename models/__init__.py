"""Networks: build_model() turns the recipe's model section into an nn.Module; check_input_size() tries it once."""

from functools import cache

import torch
import torchvision

from models.convnet import ConvNet
from utils.general import UsageError

# Their training-mode output is (logits, aux logits): build them with the main head only, so every model
# returns plain logits. init_weights=True keeps torchvision's current initialisation and silences its warning.
MAIN_HEAD_ONLY = {"googlenet": {"aux_logits": False, "init_weights": True},
                  "inception_v3": {"aux_logits": False, "init_weights": True}}


@cache
def model_names():
    """Every name model.name accepts: 'convnet' and torchvision's classification models."""
    return ["convnet", *torchvision.models.list_models(module=torchvision.models)]


def build_model(cfg, num_classes):
    """A randomly initialised classifier for num_classes classes from the recipe's model section."""
    if cfg.name == "convnet":
        return ConvNet(num_classes, width=cfg.width, depth=cfg.depth, dropout=cfg.dropout, norm=cfg.norm)
    # weights=None: nothing is downloaded; these machines may have no internet
    return torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes,
                                        **MAIN_HEAD_ONLY.get(cfg.name, {}))


def model_from_checkpoint(ckpt, cfg, source):
    """The network a checkpoint holds (built from its recipe cfg, with its weights) in eval mode."""
    model = build_model(cfg.model, len(ckpt["classes"]))
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UsageError(f"{source}: its weights do not fit the model of its recipe ({cfg.model.name}): "
                         f"{str(e).strip().splitlines()[-1].strip()}") from None
    return model.eval()


@torch.no_grad()
def check_input_size(model, name, img_size, device):
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
        raise UsageError(f"model.name={name!r} cannot take {img_size}x{img_size} images (data.img_size={img_size}): "
                         f"{reason}; choose another data.img_size or model.name") from None
    finally:
        model.train(was_training)
