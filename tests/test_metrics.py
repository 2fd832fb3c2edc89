"""evaluate(): the loss, top-1/top-5, confusion matrix, per-class counts and misclassified images of known logits."""

import math

import torch
from torch.utils.data import DataLoader, TensorDataset

import utils.metrics
from conftest import Lookup
from utils.metrics import evaluate, per_class


def test_confusion_matrix_per_class_counts_and_misclassified_images_of_known_logits():
    # Six classes; each row ranks the classes by its logits, the first is predicted.
    ranks = [[0, 1, 2, 3, 4, 5], [1, 0, 2, 3, 4, 5], [2, 1, 0, 3, 4, 5], [5, 4, 3, 2, 1, 0], [0, 2, 1, 3, 4, 5],
             [3, 4, 5, 2, 1, 0], [0, 1, 2, 3, 4, 5]]
    targets = torch.tensor([0, 0, 1, 0, 2, 3, 5])  # right, then wrong but for the last but one
    logits = torch.zeros(len(ranks), 6)
    for i, order in enumerate(ranks):
        logits[i, order] = torch.arange(6, 0, -1, dtype=torch.float)
    images = torch.arange(len(ranks), dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 2, 2).contiguous()
    loader = DataLoader(TensorDataset(images, targets), batch_size=3)  # batches of 3, 3, 1
    metrics = evaluate(Lookup(logits), loader, lambda x: x.float(), 6, torch.device("cpu"), keep_wrong=3)

    expected = torch.zeros(6, 6, dtype=torch.long)
    for order, target in zip(ranks, targets.tolist()):
        expected[target, order[0]] += 1
    assert torch.equal(metrics["confusion"], expected)
    assert metrics["val/top1"] == 2 / 7 and metrics["val/samples"] == 7
    assert metrics["val/balanced_top1"] == (1 / 3 + 1) / 5  # classes 0, 1, 2, 3, 5; in float64, as top-1 is
    images, predicted, correct, top5 = metrics["class_counts"].tolist()
    assert images == [3, 1, 1, 1, 0, 1] and predicted == [3, 1, 1, 1, 0, 1] and correct == [1, 0, 0, 1, 0, 0]
    # top-5 hits: all but the two samples whose class is ranked 6th (the fourth and the last).
    assert top5 == [2, 1, 1, 1, 0, 0] and metrics["val/top5"] == 5 / 7
    loss = torch.nn.functional.cross_entropy(logits, targets).item()
    assert math.isclose(metrics["val/loss"], loss, rel_tol=1e-6)  # float32 logits
    assert [(int(image[0, 0, 0]), t, p) for image, t, p in metrics["wrong"]] == [(1, 0, 1), (2, 1, 2), (3, 0, 5)]
    rows = per_class(metrics["class_counts"])
    assert rows[0] == (3, 1 / 3, 1 / 3, 2 / 3)  # predicted 0 three times, once rightly; one of three images right
    assert rows[4] == (0, None, None, None)  # no images, never predicted: neither precision nor recall
    assert rows[5] == (1, 0.0, 0.0, 0.0)  # an image, never predicted rightly


def test_without_five_classes_there_is_no_top5_and_above_the_limit_no_confusion_matrix(monkeypatch):
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    images = torch.arange(2, dtype=torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 2, 2).contiguous()
    loader = DataLoader(TensorDataset(images, torch.tensor([0, 2])), batch_size=2)
    metrics = evaluate(Lookup(logits), loader, lambda x: x.float(), 3, torch.device("cpu"))
    assert metrics["val/top5"] is None and [row[3] for row in per_class(metrics["class_counts"])] == [None] * 3
    assert metrics["confusion"].tolist() == [[1, 0, 0], [0, 0, 0], [0, 1, 0]]
    monkeypatch.setattr(utils.metrics, "MAX_CONFUSION_CLASSES", 2)
    metrics = evaluate(Lookup(logits), loader, lambda x: x.float(), 3, torch.device("cpu"))
    assert metrics["confusion"] is None and metrics["class_counts"][2].tolist() == [1, 0, 0]
