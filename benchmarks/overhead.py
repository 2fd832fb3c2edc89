"""What train.py's epoch loop costs beyond the training itself: its train_one_epoch against a bare PyTorch loop.

The loops train one initialisation of the recipe's model (copied), each on a loader built as train.py builds it
(seeded order, per-sample augmentation seeds, or the RAM cache's batches cropped per batch), with the same
optimizer, schedule, loss, precision, memory format, torch threads and deterministic setting. The bare loop is the
shortest correct one: normalise, forward under autocast, zero_grad(set_to_none=True), backward, step, schedule.
train() hands train_one_epoch the recipe as a plain dataclass (OmegaConf.to_object); a third loop is train.py's
given the OmegaConf node instead, whose per-step key reads (about 60 us each) that conversion saves. A round is one epoch of each
loop back to back, the order rotating; the result is the per-round ratio of images/s to the bare loop's, as its
median and spread (min-max), and the ratio of each loop's fastest epoch (the one least disturbed by other load).

Then, to see what a loop adds per step where the compute no longer hides it, the three run over one epoch's
batches held in memory with a tiny model on one thread, timed in CPU time, which another process's load on the
shared core moves less than wall time. Last, the CPU time that the watchdog's marks of a rank's place add to a step
(utils/watchdog.placed, two a step), timed alone: far below what the probe resolves.

    python benchmarks/overhead.py [--rounds 10] [--probe-rounds 20] [--threads N] [key=value ...]
    python benchmarks/overhead.py train.precision=bf16 data.img_size=32 model.width=64
"""

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.batches import batch_to  # noqa: E402
from data.datasets import build_dataloader, input_feed, set_epoch, training_datasets  # noqa: E402
from data.transforms import crop_spec, normalizer  # noqa: E402
from models import build_model, settle  # noqa: E402
from train import Loop, TrainState, train_one_epoch  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.optim import build_optimizer, build_scheduler  # noqa: E402
from utils.precision import autocast_dtype, grad_scaler  # noqa: E402
from utils.seeds import init_seeds  # noqa: E402
from utils.stopping import StopVote  # noqa: E402
from utils.torch_utils import memory_format, set_threads  # noqa: E402
from utils.watchdog import placed  # noqa: E402

BARE, OURS, PLAIN = "bare loop", "train.py", "train.py, recipe as OmegaConf node"
NAMES = (BARE, OURS, PLAIN)
TINY = ["model.name=convnet", "model.width=4", "model.depth=1"]  # steps of milliseconds, where overhead shows
PROBE_EPOCHS = 3  # held epochs per loop per probe round: long enough that a burst of load evens out
DEVICE = torch.device("cpu")


class Sides:
    """The loops compared, each with its own copy of the recipe's model, optimizer and schedule from one
    initialisation: the bare loop, train.py's, and train.py's reading the recipe from the OmegaConf node."""

    def __init__(self, cfg, classes, dtype, epochs, steps):
        self.cfg, self.plain_cfg, self.dtype = cfg, OmegaConf.to_object(cfg), dtype  # plain: same values
        init_seeds(cfg.seed, cfg.train.deterministic)  # as train.py: deterministic kernels change some ops' cost
        model = build_model(cfg.model, classes, cfg.data.img_size)
        model = model.to(memory_format=memory_format(cfg.train.channels_last))
        self.states = {name: self.trainable(copy.deepcopy(model), epochs, steps) for name in NAMES}
        self.normalize = normalizer(cfg.data, DEVICE)
        self.layout, self.crop = memory_format(cfg.train.channels_last), crop_spec(cfg.data)
        smoothing = cfg.train.label_smoothing
        self.mean_loss = nn.CrossEntropyLoss(label_smoothing=smoothing)
        self.summed_loss = nn.CrossEntropyLoss(label_smoothing=smoothing, reduction="sum")  # as train.py's
        self.vote = StopVote(DEVICE)

    def trainable(self, model, epochs, steps):
        """A TrainState, which the bare loop uses only as a holder of the same objects."""
        optimizer = build_optimizer(model, self.cfg.optim)
        return TrainState(model, optimizer, build_scheduler(optimizer, self.cfg.sched, epochs, steps),
                          grad_scaler(DEVICE, self.dtype))

    def epoch(self, name, loader, epoch):
        """One epoch of loop `name` over loader; returns the images trained on."""
        if name == BARE:
            return self.bare_epoch(self.states[name], loader)
        self.states[name].step = 0
        cfg = self.cfg if name == PLAIN else self.plain_cfg  # train() passes the plain dataclass
        loop = Loop(cfg, loader, None, self.normalize, None, self.summed_loss, self.dtype, self.vote, None, None, None,
                    [], len(loader.sampler))  # as train() builds it, without MixUp, EMA, logging or saving
        return train_one_epoch(loop, self.states[name], epoch)[0]

    def bare_epoch(self, state, loader):
        """The reference: the least a correct training epoch does."""
        state.model.train()
        for batch in loader:
            images, targets = batch_to(batch, DEVICE, self.crop)  # the RAM cache's batches are cropped here
            images = self.normalize(images).contiguous(memory_format=self.layout)
            with torch.autocast("cpu", dtype=self.dtype, enabled=self.dtype is not None):
                loss = self.mean_loss(state.model(images), targets)
            state.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            state.optimizer.step()
            state.scheduler.step()
        return len(loader.sampler)


class HeldBatches:
    """One epoch of a loader's batches held in memory, with its sampler (which train_one_epoch reads)."""

    def __init__(self, loader):
        set_epoch(loader, 0)
        self.batches, self.sampler, self.dataset, self.generator = list(loader), loader.sampler, loader.dataset, \
            loader.generator

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


def training_set(cfg):
    """The recipe's training set as train.py builds it (per-image transforms, or with data.cache=ram in memory)."""
    return training_datasets(cfg.data, cfg.seed)[0]


def alternate(rounds, clock, run):
    """{name: [seconds per round]} of run(name, epoch) for each loop; round 0 warms up and is not kept, and the
    order rotates, so each loop goes first, in the middle and last equally often."""
    times = {name: [] for name in NAMES}
    for epoch in range(rounds + 1):
        for name in NAMES[epoch % len(NAMES):] + NAMES[:epoch % len(NAMES)]:
            start = clock()
            run(name, epoch)
            if epoch:
                times[name].append(clock() - start)
    return times


def spread(values, digits=3):
    """'median (spread min-max)' of values."""
    return f"{statistics.median(values):.{digits}f} (spread {min(values):.{digits}f}-{max(values):.{digits}f})"


def ratios(times, name):
    """Per-round ratios of images/s, loop `name` / the bare loop, and the ratio of each one's fastest round (the
    one least disturbed by other load)."""
    return [b / t for b, t in zip(times[BARE], times[name])], min(times[BARE]) / min(times[name])


def epoch_times(cfg, args, dtype, threads, workers):
    """{loop: [seconds per round]} over real epochs, each loop with its own loader built as train.py builds it,
    and the steps per epoch."""
    train_set = training_set(cfg)
    loaders = {name: build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, DEVICE)
               for name in NAMES}
    steps = loaders[BARE].sampler.steps()[0]
    sides, images = Sides(cfg, len(train_set.classes), dtype, args.rounds + 1, steps), {}

    def run(name, epoch):
        torch.set_num_threads(threads)  # the same for every loop, whatever ran before
        set_epoch(loaders[name], epoch)
        images[name] = sides.epoch(name, loaders[name], epoch)

    with sides.vote:
        times = alternate(args.rounds, time.perf_counter, run)
    assert len(set(images.values())) == 1, images  # the same images, so seconds compare as images/s
    return times, steps


def probe(args, dtype):
    """{loop: [CPU seconds per step beyond the bare loop's, per round]} on held batches of a tiny model at one
    thread, and the bare loop's median CPU seconds per step there."""
    cfg = settle(load_recipe(args.recipe, [*args.overrides, *TINY]))
    torch.set_num_threads(1)  # one thread: its CPU time is the step's
    train_set = training_set(cfg)
    held = HeldBatches(build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, 0, DEVICE))
    sides = Sides(cfg, len(train_set.classes), dtype, PROBE_EPOCHS * (args.probe_rounds + 1), len(held))

    def run(name, epoch):
        for _ in range(PROBE_EPOCHS):
            sides.epoch(name, held, epoch)

    with sides.vote:
        times = alternate(args.probe_rounds, time.thread_time, run)
    steps = PROBE_EPOCHS * len(held)
    extra = {name: [(t - b) / steps for t, b in zip(times[name], times[BARE])] for name in (OURS, PLAIN)}
    return extra, statistics.median(times[BARE]) / steps


def marks_cost(steps=200_000):
    """CPU seconds a step that the watchdog's place marks add (utils/watchdog.placed, two a step, as train.py's
    epoch loop makes them), over iterating the same steps bare; the marks' share of the loop's cost above."""
    times = []
    for marked in (False, True, False, True):  # alternated; the second of each kept (the first warms up)
        items = range(steps)
        start = time.thread_time()
        for _ in placed(items, (0, 0), "epoch 1, step {}/" + str(steps), "in the step") if marked else items:
            pass
        times.append(time.thread_time() - start)
    return (times[3] - times[2]) / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="cls.yaml")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of one epoch per loop, after a warm-up round")
    parser.add_argument("--probe-rounds", type=int, default=20, help="rounds of the held-batch probe; 0: skip it")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of every loop; 0: train.py's choice (1 holds steadier on shared cores)")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args()
    cfg = settle(load_recipe(args.recipe, args.overrides))  # auto: what train.py would pick
    load = os.getloadavg()[0]
    dtype = autocast_dtype(cfg.train.precision, DEVICE)
    threads, workers, why = set_threads(cfg.data.workers, input_feed(cfg.data, DEVICE), DEVICE.type)  # as train.py
    threads, why = (args.threads, f"{why}; threads set by --threads") if args.threads else (threads, why)
    print(f"recipe {args.recipe} {' '.join(args.overrides)}: {cfg.model.name}, {cfg.data.img_size}px, batch "
          f"{cfg.train.batch_size}, {cfg.train.precision}, channels_last={cfg.train.channels_last}, "
          f"deterministic={cfg.train.deterministic}, data.cache={cfg.data.cache!r}; every loop {threads} "
          f"thread(s), {workers} worker(s) ({why})")
    times, steps = epoch_times(cfg, args, dtype, threads, workers)
    for name in (OURS, PLAIN):
        per_round, fastest = ratios(times, name)
        print(f"{name} / bare, images/s, {len(per_round)} rounds: {spread(per_round)}; fastest epochs: {fastest:.3f}")
        print("  rounds: " + ", ".join(f"{r:.3f}" for r in per_round))
    bare_step = statistics.median(times[BARE]) / steps
    if args.probe_rounds:
        extra, tiny_step = probe(args, dtype)
        print(f"per-step cost beyond the bare loop, held batches, tiny convnet ({' '.join(TINY[1:])}, "
              f"{1e3 * tiny_step:.1f} ms CPU per step), 1 thread, {args.probe_rounds} rounds:")
        for name, values in extra.items():
            median = statistics.median(values)
            print(f"  {name:30s} {1e6 * median:+6.0f} us/step (spread {1e6 * min(values):+.0f} to "
                  f"{1e6 * max(values):+.0f}) = {median / bare_step:.2%} of the recipe's bare step")
    marks = marks_cost()
    print(f"the watchdog's place marks (two a step, utils/watchdog.placed): {1e6 * marks:+.1f} us/step = "
          f"{marks / bare_step:.3%} of the recipe's bare step")
    print(f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
