"""Metrics exact across ranks: validation counts every sample once, and the training loss is summed over ranks."""

import time

import torch
import torch.nn.functional as F

from utils.distributed import all_gather_rows, all_reduce_sum
from utils.general import WORLD_SIZE
from utils.precision import autocast
from utils.tta import tta_logits

# Above this many classes the C x C confusion matrix is not kept (at 20k classes it would take gigabytes on the
# device); the per-class counts, which give precision, recall and top-5 per class, always are.
MAX_CONFUSION_CLASSES = 2048
BEST_METRIC_NAMES = {"top1": "val top-1", "balanced_top1": "val balanced top-1",
                     "map": "val mAP"}  # train.best_metric, in messages


@torch.no_grad()
def evaluate(model, loader, normalize, num_classes, device, dtype=None, keep_wrong=0, tta=False, keep_probs=False):
    """Validation metrics, summed over ranks: mean cross-entropy (no label smoothing), top-1 and top-5 accuracy
    (top-5 only with 5+ classes), balanced top-1 (the mean recall of the classes with val images) and the sample
    count; 'class_counts', an int64 (4, C) tensor of each class's images, predictions, correct predictions and
    top-5 hits; 'confusion', the (C, C) confusion matrix (rows true class, columns predicted; None above
    MAX_CONFUSION_CLASSES); and in 'wrong' up to keep_wrong of this rank's
    misclassified images as (uint8 image, true class, predicted class). Tensors are returned on the CPU. With tta,
    each image is scored by the mean softmax of it and its horizontal flip (utils/tta.py): the loss is the NLL of
    that mean, top-1 and top-5 its largest probabilities. With keep_probs, 'probs' and 'targets' hold every rank's
    images' (N, C) probabilities and classes (CPU), in rank order (the sampler's gathered_ids)."""
    was_training = model.training
    model.eval()
    c, k = num_classes, min(5, num_classes)
    loss = torch.zeros(1, dtype=torch.float64, device=device)
    counts = torch.zeros(4, c, dtype=torch.int64, device=device)
    confusion = torch.zeros(c * c if c <= MAX_CONFUSION_CLASSES else 0, dtype=torch.int64, device=device)
    wrong, kept = [], [(torch.zeros(0, c, device=device), torch.zeros(0, dtype=torch.int64, device=device))]
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(device, dtype):
            logits = tta_logits(model, normalize(images)) if tta else model(normalize(images))
        top = logits.topk(k, dim=1).indices
        predicted, in_top5 = top[:, 0], (top == targets[:, None]).any(dim=1)
        loss += F.cross_entropy(logits.float(), targets, reduction="sum").double()
        counts += torch.stack([torch.bincount(targets, minlength=c), torch.bincount(predicted, minlength=c),
                               hits_per_class(targets, predicted == targets, c), hits_per_class(targets, in_top5, c)])
        if len(confusion):
            confusion += torch.bincount(targets * c + predicted, minlength=c * c)
        if keep_probs:
            kept.append((logits.float().softmax(dim=1), targets))
        if len(wrong) < keep_wrong:
            wrong += collect_wrong(images, targets, predicted, keep_wrong - len(wrong))
    # One all-reduce of every count; float64 holds counts exactly up to 2**53.
    totals = all_reduce_sum(torch.cat([loss, counts.flatten().double(), confusion.double()])).cpu()
    model.train(was_training)
    counts = totals[1 : 1 + 4 * c].long().view(4, c)
    probs, targets = (all_gather_rows(torch.cat(part)).cpu() if keep_probs else None for part in zip(*kept))
    n = int(counts[0].sum())
    if n == 0:
        raise RuntimeError("the validation set is empty")
    present = counts[0] > 0  # a class without val images has no recall; it does not count
    return {"val/loss": totals[0].item() / n, "val/top1": counts[2].sum().item() / n,
            "val/balanced_top1": (counts[2][present].double() / counts[0][present]).mean().item(),
            "val/top5": counts[3].sum().item() / n if num_classes >= 5 else None, "val/samples": n,
            "class_counts": counts, "confusion": totals[1 + 4 * c :].long().view(c, c) if len(confusion) else None,
            "wrong": wrong, "probs": probs, "targets": targets}


def evaluate_ema(ema, loader, normalize, num_classes, device, dtype, tta=False):
    """The EMA's val/ema_loss, val/ema_top1, val/ema_top5 and val/ema_balanced_top1 (None without EMA), with TTA as
    the weights'."""
    names = ("loss", "top1", "top5", "balanced_top1")
    if ema is None:
        return dict.fromkeys(f"val/ema_{name}" for name in names)
    metrics = evaluate(ema.module, loader, normalize, num_classes, device, dtype, tta=tta)
    return {f"val/ema_{name}": metrics[f"val/{name}"] for name in names}


def hits_per_class(targets, hit, num_classes):
    """How many samples of each class are hits: a bincount with the misses moved past the first num_classes bins
    (a bincount with weights is not deterministic on CUDA)."""
    return torch.bincount(targets + num_classes * ~hit, minlength=2 * num_classes)[:num_classes]


def collect_wrong(images, targets, predicted, most):
    """Up to `most` (image, true class, predicted class) of a batch's misclassified samples, on the CPU."""
    index = (predicted != targets).nonzero().flatten()[:most].cpu()
    images, targets, predicted = images.cpu(), targets.cpu(), predicted.cpu()
    return [(images[i], int(targets[i]), int(predicted[i])) for i in index]


def per_class(class_counts):
    """Per class, from evaluate()'s class_counts: (images, precision, recall, top-5 accuracy); recall is the class's
    top-1 accuracy. A class never predicted has precision 0 (as scikit-learn gives it), or None where it has no
    images either (nothing to find, nothing wrongly found); one without images has recall None; top-5 accuracy is
    None with fewer than 5 classes (every class is then in the top 5)."""
    images, predicted, correct, top5 = class_counts.tolist()
    with_top5 = len(images) >= 5
    return [(n, right / guessed if guessed else 0.0 if n else None, right / n if n else None,
             hits / n if n and with_top5 else None)
            for n, guessed, right, hits in zip(images, predicted, correct, top5)]


class EpochLoss:
    """This rank's summed training loss and images since the epoch, or its resumed part, began; total() adds every
    rank's to `before`, the epoch's totals until then (a collective)."""

    def __init__(self, before, device):
        self.before, self.sum, self.seen = before, torch.zeros((), dtype=torch.float64, device=device), 0
        self.start = self.last_shown = time.monotonic()

    def add(self, loss, images):
        self.sum += loss
        self.seen += images

    def total(self):
        both = torch.stack([self.sum.double(), torch.tensor(self.seen, dtype=torch.float64, device=self.sum.device)])
        total = all_reduce_sum(both)
        return self.before[0] + total[0].item(), self.before[1] + int(total[1].item())

    def show(self, bar):
        """The running loss and speed on rank 0's progress bar, at most twice a second (.item() syncs)."""
        if not bar.disable and time.monotonic() - self.last_shown > 0.5:
            self.last_shown = time.monotonic()
            rate = self.seen * WORLD_SIZE / (self.last_shown - self.start)
            bar.set_postfix_str(f"loss {self.sum.item() / max(self.seen, 1):.4f}  {rate:.0f} img/s", refresh=False)
