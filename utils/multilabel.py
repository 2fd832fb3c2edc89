"""Multi-label training's loss and metrics: BCE on sigmoid outputs; validation's mAP (macro) and per-class AP
(scikit-learn's), F1, precision, recall and exact match at a threshold, and the per-class thresholds that maximise F1
on val. Every rank's probabilities are gathered, so each val image counts once at any number of processes; the
per-class curves are shared out between the ranks."""

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from utils.distributed import all_gather_rows, all_reduce_sum, shared_work
from utils.general import SharedError, UsageError
from utils.precision import autocast
from utils.tta import tta_logits

EMA_NAMES = ("loss", "map", "f1")  # the EMA's multi-label metrics: val/ema_loss, val/ema_map, val/ema_f1


class MultiLabelLoss(nn.Module):
    """Binary cross-entropy with logits against multi-hot (or MixUp's and CutMix's mixed) targets, averaged over the
    classes and summed over the batch: train_step divides by the step's samples, so a step's loss is the mean over
    its samples and classes, as torch's BCEWithLogitsLoss. pos_weight: train.class_weights=balanced's per-class
    positive weights; smoothing: train.label_smoothing, which moves the targets to 1 - s + s/C and s/C (timm's)."""

    def __init__(self, num_classes, pos_weight=None, smoothing=0.0):
        super().__init__()
        self.num_classes, self.smoothing = num_classes, smoothing
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, logits, targets):
        targets = targets.float()
        if self.smoothing:
            targets = targets * (1 - self.smoothing) + self.smoothing / self.num_classes
        loss = F.binary_cross_entropy_with_logits(logits.float(), targets, pos_weight=self.pos_weight, reduction="sum")
        return loss / self.num_classes


@torch.no_grad()
def evaluate_multilabel(model, loader, normalize, num_classes, device, dtype=None, threshold=0.5, tta=False):
    """Validation metrics of a multi-label model over every rank's share (multilabel_metrics), with the mean BCE
    (over samples and classes, no smoothing or weights) as val/loss; 'probs' and 'targets' hold every val image's
    probabilities and labels (CPU), for PR curves. threshold: one for all classes, or one per class. With tta, each
    image's probabilities are the mean of its and its flip's (utils/tta.py)."""
    was_training = model.training
    model.eval()
    loss = torch.zeros(1, dtype=torch.float64, device=device)
    probs, targets = [torch.zeros(0, num_classes, device=device)], [torch.zeros(0, num_classes, dtype=torch.uint8,
                                                                                 device=device)]
    for images, target in loader:
        images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
        with autocast(device, dtype):
            logits = tta_logits(model, normalize(images), multilabel=True) if tta else model(normalize(images))
        logits = logits.float()
        loss += F.binary_cross_entropy_with_logits(logits, target.float(), reduction="sum").double() / num_classes
        probs.append(logits.sigmoid())
        targets.append(target)
    model.train(was_training)
    probs, targets = all_gather_rows(torch.cat(probs)).cpu(), all_gather_rows(torch.cat(targets)).cpu()
    loss = all_reduce_sum(loss).item()
    if len(probs) == 0:
        raise RuntimeError("the validation set is empty")
    metrics = multilabel_metrics(probs.numpy(), targets.numpy(), threshold)
    return {"val/loss": loss / len(probs), **metrics, "probs": probs, "targets": targets}


def evaluate_multilabel_ema(ema, *args, **kwargs):
    """The EMA's val/ema_loss, val/ema_map and val/ema_f1, and 'ema_thresholds' (None without EMA); arguments as
    evaluate_multilabel's."""
    if ema is None:
        return {**dict.fromkeys(f"val/ema_{name}" for name in EMA_NAMES), "ema_thresholds": None}
    metrics = evaluate_multilabel(ema.module, *args, **kwargs)
    return {**{f"val/ema_{name}": metrics[f"val/{name}"] for name in EMA_NAMES},
            "ema_thresholds": metrics["thresholds"]}


def multilabel_metrics(probs, targets, threshold=0.5):
    """Metrics of (N, C) probabilities against (N, C) 0/1 targets (numpy): 'val/map', the mean of the per-class APs
    of the classes with positives; at threshold (a probability, or one per class) 'val/f1', 'val/precision' and
    'val/recall', macro means over the same classes, and 'val/exact_match', the share of images whose labels are
    all right; 'val/samples'; 'per_class', per class (positives, AP, precision, recall, F1, threshold), None where a
    class has no positives (precision: None where nothing was predicted); 'thresholds', per class the one that
    maximises its F1 (best_thresholds)."""
    if not np.isfinite(probs).all():  # every rank holds the same: every rank says it
        raise SharedError("the model's val probabilities are not finite (nan); its weights are broken")
    targets = targets.astype(bool)
    if not targets.any():
        raise SharedError(f"none of the {len(targets)} images has a label, so no class has an average precision (mAP) "
                          f"or recall; evaluate images with labels")
    predicted = probs >= np.broadcast_to(np.asarray(threshold, dtype=probs.dtype), probs.shape[1:])
    hits = (predicted & targets).sum(0)
    positives, guessed = targets.sum(0), predicted.sum(0)
    defaults = np.broadcast_to(np.asarray(threshold, dtype=np.float64), probs.shape[1:])
    curves = shared_work(lambda c: class_curve(targets[:, c], probs[:, c], float(defaults[c])), probs.shape[1])
    per_class = []
    for c, (ap, best) in enumerate(curves):
        n, tp, p = int(positives[c]), int(hits[c]), int(guessed[c])
        per_class.append((n, ap, tp / p if p else None, tp / n if n else None, 2 * tp / (n + p) if n else None,
                          best))
    present = [row for row in per_class if row[0]]

    def mean(column):
        values = [0.0 if row[column] is None else row[column] for row in present]  # unpredicted: precision 0
        return float(np.mean(values)) if values else None
    return {"val/map": mean(1), "val/precision": mean(2), "val/recall": mean(3), "val/f1": mean(4),
            "val/exact_match": float((predicted == targets).all(1).mean()), "val/samples": len(probs),
            "per_class": per_class, "thresholds": [best for _, best in curves]}


SAVED = "saved"  # --threshold saved: the per-class thresholds train.py chose on val and saved in the checkpoint


def threshold_option(text):
    """argparse type of --threshold: a number, or 'saved'."""
    if text == SAVED:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a probability such as 0.5, or '{SAVED}' for the "
                                         f"checkpoint's per-class thresholds") from None


def chosen_thresholds(given, ckpt, cfg, weights, default=SAVED):
    """What val.py and predict.py count a checkpoint's labels from: (one threshold for every class or one per class,
    how it was chosen, in words), for --threshold (given: a probability, 'saved', or None for `default`): a
    probability for every class; 'saved': the checkpoint's per-class thresholds (else, where it holds none, its
    recipe's train.threshold); 'recipe': its recipe's train.threshold. (None, None) for a single-label checkpoint.
    --threshold outside (0, 1), or on a single-label checkpoint, is a UsageError."""
    if given is not None and not cfg.data.multilabel:
        raise UsageError(f"--threshold {given}: {weights} is a single-label checkpoint (one class per image); "
                         f"--threshold is for multi-label ones (data.multilabel=true)")
    if given not in (None, SAVED) and not 0 < given < 1:
        raise UsageError(f"--threshold {given}: must be a probability in (0, 1)")
    if not cfg.data.multilabel:
        return None, None
    if given not in (None, SAVED):
        return given, f"--threshold {given} for every class"
    recipe = f"train.threshold={cfg.train.threshold} for every class"
    if (given or default) == SAVED and ckpt.get("thresholds") is not None:
        return ckpt["thresholds"], "per class, as saved by train.py (each maximised its class's F1 on val)"
    return cfg.train.threshold, recipe if given is None else f"{recipe} (the checkpoint saved none per class)"


def class_curve(positive, probs, default=0.5):
    """(AP, the threshold maximising F1) of one class's 0/1 labels and probabilities, from scikit-learn's
    precision-recall curve: AP as average_precision_score computes it from that curve (the precision at each
    threshold times the recall it adds; one call instead of two, whose input checks cost three times the curve),
    and the threshold (a label counts from it up) of the best cut, the lowest of equally good ones. (None, default)
    without positives."""
    from sklearn.metrics import precision_recall_curve  # here: importing scikit-learn costs a second at start-up

    if not positive.any():
        return None, default
    precision, recall, thresholds = precision_recall_curve(positive, probs)
    f1 = 2 * precision[:-1] * recall[:-1] / np.maximum(precision[:-1] + recall[:-1], 1e-12)
    return float(-np.sum(np.diff(recall) * precision[:-1])), between_scores(probs, thresholds[int(np.argmax(f1))])


def between_scores(probs, cut):
    """A threshold that labels what `cut` (one of probs) does, halfway between it and the next lower score (or 0):
    at a score itself, a change of that image's probability in the last digits (another batch size or machine)
    would flip its label."""
    below = probs[probs < cut]
    return (float(cut) + (float(below.max()) if len(below) else 0.0)) / 2
