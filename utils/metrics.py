"""Validation metrics, exact across ranks: every sample is counted once and totals are summed over ranks."""

import torch
import torch.nn.functional as F

from utils.torch_utils import all_reduce_sum, autocast


@torch.no_grad()
def evaluate(model, loader, normalize, num_classes, device, dtype=None, keep_wrong=0):
    """Mean cross-entropy (no label smoothing), top-1 and top-5 accuracy (top-5 only with 5+ classes), the sample
    count, the confusion matrix ('confusion', rows true class, columns predicted; int64 on the CPU) and each class's
    top-5 hits ('top5_hits'), all summed over ranks; and up to keep_wrong of this rank's misclassified images as
    (uint8 image, true class, predicted class) in 'wrong'."""
    was_training = model.training
    model.eval()
    c, k = num_classes, min(5, num_classes)
    loss = torch.zeros((), dtype=torch.float64, device=device)
    confusion = torch.zeros(c * c, dtype=torch.int64, device=device)
    top5_hits = torch.zeros(c, dtype=torch.int64, device=device)
    wrong = []
    for images, targets in loader:
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with autocast(device, dtype):
            logits = model(normalize(images))
        predicted = logits.topk(k, dim=1).indices
        loss += F.cross_entropy(logits.float(), targets, reduction="sum").double()
        confusion += torch.bincount(targets * c + predicted[:, 0], minlength=c * c)
        hit = (predicted == targets[:, None]).any(dim=1)
        top5_hits += torch.bincount(targets + c * ~hit, minlength=2 * c)[:c]  # misses land past the first c bins
        if len(wrong) < keep_wrong:
            wrong += collect_wrong(images, targets, predicted[:, 0], keep_wrong - len(wrong))
    # One all-reduce of every count; float64 holds counts exactly up to 2**53.
    totals = all_reduce_sum(torch.cat([loss[None], confusion.double(), top5_hits.double()])).cpu()
    model.train(was_training)
    confusion = totals[1 : 1 + c * c].long().view(c, c)
    top5_hits, n = totals[1 + c * c :].long(), int(confusion.sum())
    if n == 0:
        raise RuntimeError("the validation set is empty")
    return {"val/loss": totals[0].item() / n, "val/top1": confusion.trace().item() / n,
            "val/top5": top5_hits.sum().item() / n if num_classes >= 5 else None, "val/samples": n,
            "confusion": confusion, "top5_hits": top5_hits, "wrong": wrong}


def collect_wrong(images, targets, predicted, most):
    """Up to `most` (image, true class, predicted class) of a batch's misclassified samples, on the CPU."""
    index = (predicted != targets).nonzero().flatten()[:most].cpu()
    images, targets, predicted = images.cpu(), targets.cpu(), predicted.cpu()
    return [(images[i], int(targets[i]), int(predicted[i])) for i in index]


def per_class(confusion, top5_hits):
    """Per class: (images, precision, recall, top-5 accuracy); recall is the class's top-1 accuracy. A class never
    predicted has precision 0; one without images has recall and top-5 accuracy None."""
    images, predicted, correct = confusion.sum(1).tolist(), confusion.sum(0).tolist(), confusion.diagonal().tolist()
    return [(n, right / guessed if guessed else 0.0, right / n if n else None, top5 / n if n else None)
            for n, guessed, right, top5 in zip(images, predicted, correct, top5_hits.tolist())]
