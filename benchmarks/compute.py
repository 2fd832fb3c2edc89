"""Compute speed of train.py's training step on a CPU: its settings against a bare fp32 loop, and the share of the
machine's matmul peak a training step reaches.

For each model (torchvision's resnet18, the project's convnet) and image size, one process trains on the digits
upscaled to that size and held in memory (the point is the compute, not the data). The sides share one
initialisation, the same batches and the digits recipe's SGD and schedule:
  bare fp32             the plain loop a torchvision user writes: fp32, contiguous, torch.set_num_threads(2)
  train.py ...          train.py's train_step in each of fp32 and bf16 autocast, contiguous and channels_last,
                        with every core's thread (what train.py takes when data.cache=ram leaves no workers)
A round is --steps steps of each side, the order reversed every other round; per round each side's speed-up is
the bare side's time over its own, reported as median and spread (min-max). Training FLOPs are counted once
(FlopCounterMode on one forward and backward pass) and each side's FLOP/s given as a share of the fp32 and bf16
matmul peaks (torch.mm of 2048x2048 matrices at 2 threads), which are timed as two more sides of the same rounds.
Finally every side trains a short run from the same initialisation on the same batches, one step of each in turn;
its final train loss, val loss and val top-1, side by side, say whether a faster setting learns as well.

    python benchmarks/compute.py [--rounds 4] [--steps 1] [--models convnet resnet18] [--sizes 32 64]
    python benchmarks/compute.py --quick   # 2 rounds and a one-epoch short run: about half the time
"""

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.sources import build_datasets, dataset_root  # noqa: E402
from data.transforms import normalizer, val_transforms  # noqa: E402
from models import build_model, check_model_name  # noqa: E402
from train import TrainState, train_step  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.general import cpu_count  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402
from utils.precision import autocast, grad_scaler, native_precision  # noqa: E402
from utils.seeds import init_seeds  # noqa: E402
from utils.torch_utils import memory_format  # noqa: E402

DEVICE = torch.device("cpu")
BARE_THREADS = 2
BARE = "bare fp32"
# What train.precision=auto and train.channels_last=auto pick here for both models (convolutional)
AUTO = f"train.py {native_precision(DEVICE)}+channels_last"
SETTINGS = {"train.py fp32": (None, False), "train.py fp32+channels_last": (None, True),  # (autocast dtype, NHWC)
            "train.py bf16": (torch.bfloat16, False), "train.py bf16+channels_last": (torch.bfloat16, True)}
STEPS_PER_EPOCH = 23  # digits: 1,437 training images in batches of 64


class Side:
    """One way of training a copy of the model: a step on a float batch, under its own process-wide settings."""

    def __init__(self, model, cfg, steps, dtype=None, channels_last=False, bare=False):
        self.layout, self.dtype, self.cfg = memory_format(channels_last), dtype, cfg
        self.threads = BARE_THREADS if bare else cpu_count()
        self.deterministic = not bare and cfg.train.deterministic  # train.py asks for it (the recipe's default)
        model = model.to(memory_format=self.layout)
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.sched, max(1, steps // STEPS_PER_EPOCH), STEPS_PER_EPOCH)
        self.state = TrainState(model, optimizer, scheduler, grad_scaler(DEVICE, dtype))
        smoothing = cfg.train.label_smoothing
        self.criterion = nn.CrossEntropyLoss(label_smoothing=smoothing, reduction="mean" if bare else "sum")
        self.step = self.bare_step if bare else self.our_step

    def bare_step(self, images, targets):
        """The reference step: forward, loss, zero_grad, backward, SGD, schedule; returns the mean loss."""
        model, optimizer = self.state.model, self.state.optimizer
        loss = self.criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        self.state.scheduler.step()
        return loss.detach()

    def our_step(self, images, targets):
        """train.py's step, with the batch laid out as train_one_epoch lays it out; returns the mean loss."""
        images = images.contiguous(memory_format=self.layout)
        loss_sum = train_step(self.state, images, targets, self.criterion, self.dtype, self.cfg, len(targets))
        return loss_sum / len(targets)

    @torch.no_grad()
    def evaluate(self, images, targets):
        """(val loss, val top-1) of the side's model, in its own precision and layout."""
        model = self.state.model.eval()
        with autocast(DEVICE, self.dtype):
            logits = torch.cat([model(x.contiguous(memory_format=self.layout)) for x in images.split(256)]).float()
        model.train()
        return nn.functional.cross_entropy(logits, targets).item(), (logits.argmax(1) == targets).float().mean().item()


def digits(img_size):
    """Digits train and val sets upscaled to img_size, normalised as the digits recipe does: (x, y) float tensors."""
    cfg = load_recipe("cls.yaml", [f"data.img_size={img_size}"])
    upscale = val_transforms(cfg.data)  # resize and centre crop (crop_pct 1): the whole digit, no augmentation
    normalize = normalizer(cfg.data, DEVICE)
    splits = build_datasets(dataset_root("digits"), upscale, upscale)
    return [(normalize(torch.stack([image.as_subclass(torch.Tensor) for image, _ in split])),
             torch.tensor([t for _, t in split])) for split in splits]


def batches(images, targets, count, batch_size=64, seed=0):
    """The first `count` batches of seeded shuffled epochs (the same for every side)."""
    out, epoch = [], 0
    while len(out) < count:
        order = torch.randperm(len(targets), generator=torch.Generator().manual_seed(seed + epoch))
        out += [(images[i], targets[i]) for i in order.split(batch_size) if len(i) == batch_size]
        epoch += 1
    return out[:count]


def make_sides(name, img_size, steps):
    """{side name: Side} for one model and size, all from one initialisation."""
    cfg = load_recipe("cls.yaml", [f"model.name={name}", f"data.img_size={img_size}"], model_check=check_model_name)
    init_seeds(cfg.seed)
    model = build_model(cfg.model, 10, img_size)
    sides = {BARE: Side(copy.deepcopy(model), cfg, steps, bare=True)}
    sides.update({label: Side(copy.deepcopy(model), cfg, steps, dtype, nhwc) for label, (dtype, nhwc) in
                  SETTINGS.items()})
    return sides


def step_flops(side, images, targets):
    """FLOPs of one forward and backward pass (convolutions and matmuls, as FlopCounterMode counts them)."""
    model = copy.deepcopy(side.state.model)
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(images), targets).backward()
    return counter.get_total_flops()


def activate(side):
    """Set what torch holds per process, not per model, to a side's own: its threads, deterministic algorithms."""
    torch.set_num_threads(side.threads)
    torch.use_deterministic_algorithms(side.deterministic, warn_only=True)


def timed_rounds(sides, data, rounds, steps):
    """{side: [seconds of `steps` steps, per round]} after one warm-up step each (oneDNN builds its kernels then);
    the order of the sides is reversed every other round."""
    names, times = list(sides), {name: [] for name in sides}
    for name in names:
        activate(sides[name])
        sides[name].step(*data[0])
    for r in range(rounds):
        for name in names if r % 2 else names[::-1]:
            activate(sides[name])
            start = time.perf_counter()
            for images, targets in data[1 + r * steps : 1 + (r + 1) * steps]:
                sides[name].step(images, targets)
            times[name].append(time.perf_counter() - start)
    return times


class Matmul:
    """The machine's matmul peak, timed as a side among the others so that it meets the same load: torch.mm of two
    n x n matrices in dtype at BARE_THREADS threads."""

    def __init__(self, dtype, n=2048):
        self.threads, self.deterministic, self.flops = BARE_THREADS, False, 2 * n**3
        self.a, self.b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)

    def step(self, *batch):
        torch.mm(self.a, self.b)


def short_run(name, img_size, steps, data):
    """{side: (mean train loss of the last 10 steps, val loss, val top-1, seconds)} after `steps` steps from one
    initialisation on the same batches, one step of each side in turn."""
    (train_x, train_y), (val_x, val_y) = data
    sides = make_sides(name, img_size, steps)
    losses, seconds = {label: [] for label in sides}, dict.fromkeys(sides, 0.0)
    for i, (images, targets) in enumerate(batches(train_x, train_y, steps, seed=1)):
        for label in sides if i % 2 else list(sides)[::-1]:
            activate(sides[label])
            start = time.perf_counter()
            losses[label].append(sides[label].step(images, targets))
            seconds[label] += time.perf_counter() - start
    return {label: (torch.stack(losses[label][-10:]).float().mean().item(), *side.evaluate(val_x, val_y),
                    seconds[label]) for label, side in sides.items()}


def cpu_flags():
    """The CPU's AVX-512 and bf16 flags (/proc/cpuinfo, where there is one), and whether train.precision=auto trains
    in bf16 here (utils.precision.native_precision)."""
    native = f"native bf16: {'yes' if native_precision(DEVICE) == 'bf16' else 'no'}"
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return f"flags unknown; {native}"
    have = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags.split()]
    return f"{', '.join(have) or 'no AVX512'}; {native}"


def spread(values, fmt="{:.2f}"):
    """'median (min-max)' of values."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(name, size, flops, times, peak_rates, steps):
    """Print one model and size: each side's speed-up over the bare loop per round, its achieved FLOP/s, and that
    as a share of the peaks measured in the same rounds ({'fp32': [FLOP/s per round], 'bf16': [...]}); return the
    fastest train.py setting and its median speed-up, and those of fp32 (the default before auto) and of AUTO."""
    speedups = {label: [b / s for b, s in zip(times[BARE], seconds)] for label, seconds in times.items()}
    for i, (label, seconds) in enumerate(times.items()):
        rates = [flops * steps / s for s in seconds]
        shares = {p: statistics.median(r / peak for r, peak in zip(rates, peak_rates[p])) for p in peak_rates}
        first = (name, str(size), f"{flops / 1e9:.2f}") if not i else ("", "", "")
        print(f"{first[0]:9s} {first[1]:>3s} {first[2]:>6s} {label:28s} {spread(speedups[label]):>17s} "
              f"{statistics.median(rates) / 1e9:8.1f} {shares['fp32']:12.0%} {shares['bf16']:12.0%}")
    best = max(SETTINGS, key=lambda label: statistics.median(speedups[label]))
    return best, *(statistics.median(speedups[label]) for label in (best, "train.py fp32", AUTO))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds per model and size, after a warm-up step")
    parser.add_argument("--steps", type=int, default=1, help="steps of each side per round")
    parser.add_argument("--models", nargs="+", default=["convnet", "resnet18"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--train-steps", type=int, default=46, help="short run's steps (46: two digits epochs)")
    parser.add_argument("--train-model", default="convnet:32", help="MODEL:SIZE of the short run; '' skips it")
    parser.add_argument("--quick", action="store_true", help="2 rounds and a one-epoch short run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.train_steps = 2, STEPS_PER_EPOCH
    train_model, train_size = args.train_model.split(":") if args.train_model else (None, None)
    load = os.getloadavg()[0]
    print(f"CPU: {cpu_flags()}; torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()} kernels")
    print(f"threads: bare {BARE_THREADS}, train.py {cpu_count()} (every core, with deterministic algorithms as the "
          f"recipe asks); batch 64; {args.rounds} rounds of {args.steps} step(s) per side, order reversed every "
          f"other round; median (min-max) over rounds")
    print(f"\n{'model':9s} {'px':>3s} {'GFLOP':>6s} {'side':28s} {'speed-up vs bare':>17s} {'GFLOP/s':>8s} "
          f"{'of fp32 peak':>12s} {'of bf16 peak':>12s}")
    sizes = sorted({*args.sizes, *([int(train_size)] if train_size else [])})
    data_by_size = {size: digits(size) for size in sizes}
    peaks, peak_rates, best = {"fp32": Matmul(torch.float32), "bf16": Matmul(torch.bfloat16)}, [], []
    for name in args.models:
        for size in args.sizes:
            (train_x, train_y), _ = data_by_size[size]
            data = batches(train_x, train_y, 1 + args.rounds * args.steps)
            sides = make_sides(name, size, len(data))
            flops = step_flops(sides[BARE], *data[0])
            times = timed_rounds({**sides, **peaks}, data, args.rounds, args.steps)
            peak_rates.append({p: [m.flops * args.steps / t for t in times.pop(p)] for p, m in peaks.items()})
            best.append((name, size, *report(name, size, flops, times, peak_rates[-1], args.steps)))
    fp32, bf16 = ([r / 1e9 for rates in peak_rates for r in rates[p]] for p in ("fp32", "bf16"))
    print(f"matmul peak, torch.mm 2048x2048, {BARE_THREADS} threads, all rounds, GFLOP/s: fp32 {spread(fp32, '{:.0f}')}"
          f", bf16 {spread(bf16, '{:.0f}')}; bf16 / fp32 {statistics.median(bf16) / statistics.median(fp32):.2f}")
    print("fastest train.py setting: " + "; ".join(f"{n} {s}px {label.removeprefix('train.py ')} {x:.2f}x"
                                                  for n, s, label, x, _, _ in best))
    print(f"the default, fp32 before and auto ({AUTO.removeprefix('train.py ')} on this CPU) after: " + "; ".join(
        f"{n} {s}px {before:.2f}x -> {after:.2f}x" for n, s, _, _, before, after in best))
    if train_model:
        results = short_run(train_model, int(train_size), args.train_steps, data_by_size[int(train_size)])
        print(f"\nshort run: {train_model} at {train_size}px, {args.train_steps} steps of 64 from one initialisation, "
              f"same batches, one step of each side in turn")
        print(f"{'side':28s} {'train loss':>10s} {'val loss':>8s} {'val top-1':>9s} {'speed-up vs bare':>16s}")
        for label, (loss, val_loss, top1, seconds) in results.items():
            print(f"{label:28s} {loss:10.3f} {val_loss:8.3f} {top1:9.2%} {results[BARE][-1] / seconds:16.2f}")
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
