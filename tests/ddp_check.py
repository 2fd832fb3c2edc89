"""Run under torchrun by test_distributed.py: train on uneven shares, then report what every rank holds; and train
with the recipe techniques whose result must not depend on the number of processes.

For each uneven case (training images, global batch), rank 1 takes one step fewer per epoch than rank 0, running
out after its first, second or a later step. Writes JSON to argv[1] (rank 0): per case and rank the flat weights,
optimizer momentum, learning rate and GradScaler state after training, and the validation totals next to a
single-process reference computed on rank 0. Per technique case, rank 0's weights and how many times DDP's
communication hook ran, which test_distributed.py compares with a single-process run of the same case. Per ddp
options case, every rank's weights before and after one training step, the gradient it stepped with and its own
local gradient, from which test_distributed.py computes what the all-reduce should have given, and how many
buckets it all-reduced.
"""

import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.general import after_imports, before_imports  # noqa: E402

if __name__ == "__main__":
    before_imports()  # as the project's scripts start

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from data.cache import RamImages  # noqa: E402
from data.datasets import build_dataloader  # noqa: E402
from data.mix import batch_mixer  # noqa: E402
from data.transforms import crop_spec, normalizer  # noqa: E402
from models import build_model  # noqa: E402
from train import Loop, TrainState, train_one_epoch, train_step  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.distributed import cleanup_distributed, keep_ranks_in_step, setup_distributed  # noqa: E402
from utils.general import RANK, WORLD_SIZE  # noqa: E402
from utils.metrics import evaluate  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402
from utils.seeds import init_seeds  # noqa: E402
from utils.stopping import StopVote  # noqa: E402
from utils.torch_utils import de_parallel, no_sync, smart_DDP  # noqa: E402

# (training images, global batch, recipe overrides): rank 1 runs out after step 1, 2, 5 and 2 of 2, 3, 6 and 3; the
# last case all-reduces through a comm hook, which join() must match for the rank that has run out, after no_sync().
CASES = [(3, 2, []), (9, 4, []), (21, 4, []), (9, 4, ["ddp.comm_hook=bf16", "train.accumulate=2"])]
# Recipe overrides whose training must give the same weights at 1 and 2 processes (20 images, global batch 8); all
# but per_image read cls.yaml's RAM cache, whose random crops (data.scale=[0.5,1.0]) run per batch.
TECHNIQUES = {"accumulate": ["train.accumulate=2"],
              "mix_and_repeats": ["data.mixup_alpha=0.4", "data.cutmix_alpha=1.0", "data.repeats=2"],
              "plain": [], "per_image": ["data.cache=none"]}
# The ddp section's options, each compared with the defaults at the second step: DDP all-reduces the first step in
# one bucket, and only then buckets by ddp.bucket_cap_mb after a first bucket of 1 MB; so the bucket cases train
# cls.yaml's convnet (1.2 MB of gradients).
WIDE = ["model.width=32", "model.depth=3"]
DDP_OPTIONS = {"defaults": [], "bf16": ["ddp.comm_hook=bf16"], "wide_defaults": WIDE,
               "wide_buckets": [*WIDE, "ddp.bucket_cap_mb=0.05", "ddp.gradient_as_bucket_view=true"]}
# The loops below step with no autocast (dtype None) on contiguous tensors, as the recipe must then say
FP32 = ["train.precision=fp32", "train.channels_last=false"]


def images(n, seed):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 256, (n, 3, 8, 8), dtype=torch.uint8, generator=g),
                         torch.randint(0, 3, (n,), generator=g))


def run_case(n_train, n_val, batch, overrides, epochs, device):
    init_seeds(RANK)
    cfg = load_recipe("cls.yaml", [*FP32, f"train.epochs={epochs}", "model.width=4", "model.depth=2", *overrides])
    train_set, val_set = images(n_train, 0), images(n_val, 1)
    train_loader = build_dataloader(train_set, batch, True, 0, 0, device)
    val_loader = build_dataloader(val_set, batch, False, 0, 0, device)
    normalize = normalizer(cfg.data, device)
    model = build_model(cfg.model, 3)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.sched, epochs, train_loader.sampler.steps()[0])
    # An active GradScaler (as fp16 has; CPU runs it in fp32) whose scale grows every 2 steps: a rank that misses
    # an update would scale differently from then on.
    state = TrainState(smart_DDP(model, device, **cfg.ddp), optimizer, scheduler,
                       torch.amp.GradScaler("cpu", growth_interval=2))
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    with StopVote(device) as vote:
        loop = Loop(OmegaConf.to_object(cfg), train_loader, None, normalize, None, criterion, None, vote, None, None,
                    None, [0, 1, 2], n_train)  # validated below, not logged or saved
        for epoch in range(epochs):
            train_one_epoch(loop, state, epoch)
            keep_ranks_in_step(state, train_loader, epoch)
            state.step = 0
    metrics = scalars(evaluate(model, val_loader, normalize, 3, device))
    momentum = [optimizer.state[p]["momentum_buffer"].flatten() for p in model.parameters()]
    report = {"weights": torch.cat([t.flatten() for t in model.state_dict().values()]).double().tolist(),
              "momentum": torch.cat(momentum).tolist(), "lr": optimizer.param_groups[0]["lr"],
              "steps": train_loader.sampler.steps(), "train_share": list(train_loader.sampler),
              "scaler": state.scaler.state_dict(),
              "metrics": metrics}
    # Reference: every rank evaluates the whole val set without the sampler (summed over ranks, the means are
    # unchanged; the count is WORLD_SIZE times the set).
    reference = scalars(evaluate(de_parallel(model), DataLoader(val_set, batch_size=5), normalize, 3, device))
    reports = [None] * WORLD_SIZE
    dist.all_gather_object(reports, report)
    return {"ranks": reports, "reference": reference}


def scalars(metrics):
    """evaluate()'s metrics as JSON values: the confusion matrix and per-class hits as lists, no images."""
    return {**{k: v for k, v in metrics.items() if k != "wrong"}, "confusion": metrics["confusion"].tolist(),
            "class_counts": metrics["class_counts"].tolist()}


def run_technique(overrides, device=torch.device("cpu"), epochs=2):
    """Train a BatchNorm-free convnet (its result cannot depend on the split of the batch) with overrides; return
    the flat weights and the number of gradient all-reduces (DDP comm hook calls) and optimizer steps."""
    init_seeds(0)
    cfg = load_recipe("cls.yaml", [*FP32, f"train.epochs={epochs}", "model.width=4", "model.depth=2", "model.norm=none",
                                   "train.batch_size=8", "data.scale=[0.5,1.0]", *overrides])
    train_set = images(20, 2)
    if cfg.data.cache == "ram":
        train_set.classes, train_set.root, train_set.targets = [0, 1, 2], "images", train_set.tensors[1].tolist()
        train_set = RamImages(train_set, None, crop_spec(cfg.data), seed=0)
    train_loader = build_dataloader(train_set, 8, True, 0, 0, device, pairs=bool(batch_mixer(cfg.data, 3, 0)),
                                    repeats=cfg.data.repeats)
    model = build_model(cfg.model, 3)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.sched, epochs, train_loader.sampler.steps()[0])
    state = TrainState(model, optimizer, scheduler, torch.amp.GradScaler("cpu", enabled=False))
    all_reduces = [0]
    if WORLD_SIZE > 1:
        state.model = smart_DDP(model, device)
        all_reduces = count_all_reduces(state.model)
    with StopVote(device) as vote:
        loop = Loop(OmegaConf.to_object(cfg), train_loader, None, normalizer(cfg.data, device),
                    batch_mixer(cfg.data, 3, 0), torch.nn.CrossEntropyLoss(reduction="sum"), None, vote, None, None,
                    None, [0, 1, 2], len(train_set))  # no validation, logging or saving
        for epoch in range(epochs):
            train_one_epoch(loop, state, epoch)
            state.step = 0
    return {"weights": torch.cat([t.flatten() for t in model.state_dict().values()]).double().tolist(),
            "all_reduces": all_reduces[0], "steps": scheduler.last_epoch}


def run_ddp_options(overrides, device=torch.device("cpu"), batch=8):
    """Two train_steps of a BatchNorm-free convnet with plain SGD (no momentum, decay or warmup) and the ddp
    overrides; per rank, of the second step: the weights before and after, the gradient it stepped with, the rank's
    own (local) gradient, and its number of all-reduces (buckets; counted where there is no comm hook)."""
    init_seeds(0)
    cfg = load_recipe("cls.yaml", [*FP32, "model.width=4", "model.depth=2", "model.norm=none",
                                   f"train.batch_size={batch}", "optim.momentum=0", "optim.weight_decay=0",
                                   "sched.name=constant", "sched.warmup_epochs=0", *overrides])
    x, y = (t[RANK::WORLD_SIZE] for t in images(batch, 3).tensors)
    x = normalizer(cfg.data, device)(x)
    model = build_model(cfg.model, 3)
    optimizer = build_optimizer(model, cfg.optim)
    state = TrainState(smart_DDP(model, device, **cfg.ddp), optimizer, build_scheduler(optimizer, cfg.sched, 1, 1),
                       torch.amp.GradScaler("cpu", enabled=False))
    criterion = torch.nn.CrossEntropyLoss(reduction="sum")
    train_step(state, x, y, criterion, None, cfg, batch)
    optimizer.zero_grad(set_to_none=True)
    with no_sync(state.model):
        (criterion(state.model(x), y) * (WORLD_SIZE / batch)).backward()  # scaled as train_step scales it
    local, before = vector(p.grad for p in model.parameters()), vector(model.parameters())
    all_reduces = count_all_reduces(state.model) if cfg.ddp.comm_hook == "none" else [None]
    train_step(state, x, y, criterion, None, cfg, batch)
    after, grads = vector(model.parameters()), vector(p.grad for p in model.parameters())
    report = {"after_sha": digest(after), "grads_sha": digest(grads), "all_reduces": all_reduces[0],
              "grad_views": state.model.gradient_as_bucket_view, "lr": cfg.optim.lr}
    if len(after) < 10_000:  # the small convnet's values in full; the wide one's (290k) as digests only
        report.update(before=before.tolist(), after=after.tolist(), grads=grads.tolist(), local=local.tolist())
    reports = [None] * WORLD_SIZE
    dist.all_gather_object(reports, report)
    return reports


def count_all_reduces(ddp):
    """Register a comm hook that all-reduces as DDP does and counts its calls; return the counter, [calls]."""
    calls = [0]

    def counting_hook(_, bucket):
        calls[0] += 1
        return default_hooks.allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, counting_hook)
    return calls


def vector(tensors):
    """Tensors as one flat float32 tensor, copied."""
    return torch.cat([t.detach().flatten() for t in tensors]).clone()


def digest(tensor):
    """SHA-256 of a tensor's bytes: equal digests, bit-identical values."""
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def main(out, n_val, epochs):
    device = torch.device("cpu")
    setup_distributed()
    results = {"uneven": [run_case(n_train, n_val, batch, overrides, epochs, device)
                          for n_train, batch, overrides in CASES],
               "techniques": {name: run_technique(overrides, device) for name, overrides in TECHNIQUES.items()},
               "ddp_options": {name: run_ddp_options(overrides, device) for name, overrides in DDP_OPTIONS.items()}}
    if RANK == 0:
        Path(out).write_text(json.dumps(results))
    cleanup_distributed()


if __name__ == "__main__":
    after_imports()
    main(sys.argv[1], *map(int, sys.argv[2:]))
