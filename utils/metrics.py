"""Validation metrics, exact across ranks: every sample is counted once and totals are summed over ranks."""

import torch
import torch.nn.functional as F

from utils.torch_utils import all_reduce_sum, autocast


@torch.no_grad()
def evaluate(model, loader, normalize, num_classes, device, dtype=None):
    """Mean cross-entropy (no label smoothing), top-1 and top-5 accuracy (top-5 only with 5+ classes) and the sample count."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, top-1 hits, top-5 hits, samples
    k = min(5, num_classes)
    for images, targets in loader:
        images, targets = normalize(images.to(device, non_blocking=True)), targets.to(device, non_blocking=True)
        with autocast(device, dtype):
            logits = model(images)
        hits = logits.topk(k, dim=1).indices == targets[:, None]
        loss = F.cross_entropy(logits.float(), targets, reduction="sum")
        totals += torch.stack([loss.double(), hits[:, 0].sum().double(), hits.sum().double(),
                               torch.tensor(len(targets), dtype=torch.float64, device=device)])
    loss, top1, top5, n = all_reduce_sum(totals).tolist()
    model.train(was_training)
    if n == 0:
        raise RuntimeError("the validation set is empty")
    return {"val/loss": loss / n, "val/top1": top1 / n, "val/top5": top5 / n if num_classes >= 5 else None,
            "val/samples": int(n)}
