"""The loss a run minimises: cross-entropy, or for multi-label data per-class BCE (utils/multilabel.py), each summed
over a batch."""

from torch import nn

from utils.multilabel import MultiLabelLoss


def build_criterion(cfg, num_classes, multilabel, class_weights=None):
    """Cross-entropy summed over a batch, with label smoothing and class_weights (train.class_weights: balanced, or
    None) (cfg: the train section); for multi-label data, BCE with per-class positive weights."""
    # train_step divides the sum by the global step's sample count: with class weights, the step's gradient is the
    # weighted sum over its samples / their count. A weighted mean would divide by the step's summed weight, which
    # takes every rank's share (a collective per step); the count is known to every rank at any N. The weights
    # average 1 over the training set, so train/loss, the weighted loss per image, keeps the unweighted scale.
    if multilabel:
        return MultiLabelLoss(num_classes, class_weights, cfg.label_smoothing)
    return nn.CrossEntropyLoss(class_weights, label_smoothing=cfg.label_smoothing, reduction="sum")
