"""What each training step sees, from (seed, epoch) alone: the seeded distributed sampler, one permutation per epoch
(or class-balanced draws) dealt out to the ranks with nothing padded, and per-sample augmentation seeds."""

import itertools
import math

import numpy as np
import torch
from torch.utils.data import Sampler

MASK64 = (1 << 64) - 1
SHARD_ORDER = 0x5A4D  # a salt: the shard order's seed is not any sample's
ITER_CHUNK = 4096  # sample ids an epoch's iterator turns into Python ints at a time


class DistributedShuffleSampler(Sampler):
    """Yield this rank's share of a dataset: groups rank, rank + world_size, ... of a permutation of it cut into
    groups of `group` consecutive samples (single samples by default; pairs where samples are mixed in pairs).

    The permutation depends only on (seed, epoch), so every rank draws the same one and the shares are disjoint
    and together cover it exactly once: nothing is padded, and ranks differ by at most one group. With a per-rank
    batch of batch_size / world_size (a multiple of group), step i's batches across ranks are together exactly
    positions [i*B, (i+1)*B) of the permutation, the same global batch at any world size, and each group lies on
    one rank. drop_last drops the permutation's last partial global batch, so every rank takes the same number of
    steps. With repeats=K (repeated augmentation), each sample appears K times in a row, each copy with its own id
    (index + copy * dataset_size, see data/batches.py) and augmentation, and the epoch is cut back to dataset_size
    samples, so it costs what an epoch without repeats does. set_epoch(epoch, start_step) skips the steps a
    resumed run has already done, without loading their images. windows=(shard_of, W, shards), for a shard set: the
    epoch's samples regrouped window by window (see windowed), so a stretch of steps reads W shards.
    """

    def __init__(self, dataset_size, rank=0, world_size=1, shuffle=True, seed=0, batch_size=None, drop_last=False,
                 group=1, repeats=1, windows=None):
        self.rank, self.world_size, self.shuffle, self.seed, self.windows = rank, world_size, shuffle, seed, windows
        self.dataset_size, self.group, self.repeats = dataset_size, group, repeats
        self.batch_size = batch_size or world_size * group  # global batch: a multiple of world_size * group
        self.size = dataset_size // self.batch_size * self.batch_size if drop_last else dataset_size
        self.epoch, self.start_step = 0, 0

    def set_epoch(self, epoch, start_step=0):
        """Choose the epoch whose permutation the next iteration yields, starting after start_step steps."""
        self.epoch, self.start_step = epoch, start_step

    def permutation(self):
        """The epoch's global order of sample ids, identical on every rank."""
        if not self.shuffle:
            return torch.arange(self.size)
        # A hash, not seed + epoch: seed 1 is then not seed 0 shifted by one epoch.
        generator = torch.Generator().manual_seed(seed_hash(self.seed, self.epoch))
        order = self.draw(generator)
        if self.windows is not None:
            shard_of, window, shards = self.windows
            order = windowed(order, shard_of, window, shard_permutation(self.seed, self.epoch, shards))
        if self.repeats > 1:
            order = self.repeated(order)
        return order[: self.size]  # drop_last: a different remainder is left out each epoch

    def draw(self, generator):
        """The epoch's order of samples before repeats: every sample once."""
        return torch.randperm(self.dataset_size, generator=generator)

    def repeated(self, order):
        """order with each group of `group` images repeated `repeats` times in a row (a b, a b, ... for pairs, so
        a pair mixes two images, never two copies of one), copy k of image i as id i + k * dataset_size."""
        whole = len(order) // self.group * self.group
        blocks = [order[:whole].view(-1, self.group), order[whole:].view(-1, 1)]  # a last, partial group: alone
        ids = [(block.repeat_interleave(self.repeats, 0) +
                torch.arange(self.repeats).repeat(len(block))[:, None] * self.dataset_size).flatten()
               for block in blocks]
        return torch.cat(ids)

    def __iter__(self):
        share = self.share(self.permutation(), self.rank)[self.start_step * self.batch_size // self.world_size :]
        # Drawn now; turned into Python ints a chunk at a time, not all at once (36 bytes an image for the epoch).
        return itertools.chain.from_iterable(chunk.tolist() for chunk in share.split(ITER_CHUNK))

    def share(self, order, rank):
        """rank's part of a global order: its groups (every world_size-th, from its rank's), in order, the last
        partial group too where it is rank's. Strided views of order: no index arrays as long as the epoch."""
        whole = len(order) // self.group
        mine = order[: whole * self.group].view(whole, self.group)[rank :: self.world_size].flatten()
        return torch.cat([mine, order[whole * self.group :]]) if whole % self.world_size == rank else mine

    def gathered_ids(self):
        """The sample ids of every rank's share of the epoch, in rank order: what all_gather_rows of per-sample rows
        (validation's probabilities) holds, row by row."""
        order = self.permutation()
        return torch.cat([self.share(order, rank) for rank in range(self.world_size)])

    def __len__(self):
        return max(0, self.share_size(self.rank) - self.start_step * self.batch_size // self.world_size)

    def share_size(self, rank):
        """Samples in rank's share of an epoch: its groups, less what the last group lacks if it is rank's."""
        groups = math.ceil(self.size / self.group)
        count = max(0, math.ceil((groups - rank) / self.world_size)) * self.group
        short = -self.size % self.group  # samples the last group lacks
        return count - short if groups and (groups - 1) % self.world_size == rank else count

    def step_share(self, step, rank):
        """Samples rank takes in step `step` (0 where it has run out)."""
        rank_batch = self.batch_size // self.world_size
        return min(max(self.share_size(rank) - step * rank_batch, 0), rank_batch)

    def steps(self):
        """(most, fewest) steps a rank takes per epoch: ranks differ by at most one step (never with drop_last)."""
        rank_batch = self.batch_size // self.world_size
        counts = [math.ceil(self.share_size(rank) / rank_batch) for rank in range(self.world_size)]
        return max(counts), min(counts)

    def step_samples(self, step):
        """Samples in global step `step` over all ranks: the batch size, or fewer in the last, partial step."""
        return min(self.batch_size, self.size - step * self.batch_size)

    def micro_batches(self, step, accumulate):
        """How many micro-batches step `step` is split into: train.accumulate, or fewer where a rank holds fewer
        samples in an epoch's last step. The same on every rank that takes the step: with join() on, DDP's every
        forward is a collective."""
        if self.step_samples(step) == self.batch_size:  # a whole global batch: every rank holds its full share
            return accumulate
        return min(accumulate, *(n for n in (self.step_share(step, r) for r in range(self.world_size)) if n))


class BalancedSampler(DistributedShuffleSampler):
    """data.sampler=balanced: a DistributedShuffleSampler whose epoch is len(targets) draws with replacement, each
    a class chosen uniformly (among those with samples), then one of its samples: every class is drawn equally
    often, in expectation, however many samples it has.

    The draws come from (seed, epoch) alone and are dealt to the ranks as the permutation is, so the global order is
    the same at any world size and a resumed epoch continues it. A sample drawn k times in an epoch has ids i,
    i + n, ..., i + (k - 1) * n (n samples), as repeated augmentation's copies: each copy is augmented afresh, where
    its one per-sample seed would augment all k alike.
    """

    def __init__(self, targets, **kwargs):
        targets = torch.from_numpy(np.asarray(targets, dtype=np.int64))  # a list, or a Listing's (an array)
        super().__init__(len(targets), **kwargs)
        counts = torch.bincount(targets)
        present = counts.nonzero().flatten()
        self.by_class = torch.argsort(targets, stable=True)  # sample indices, class by class
        self.counts, self.starts = counts[present], (counts.cumsum(0) - counts)[present]

    def draw(self, generator):
        """len(targets) samples: a class uniformly, then one of its samples uniformly."""
        pick = torch.randint(len(self.counts), (self.dataset_size,), generator=generator)
        # An integer modulo the class's count: uniform but for a bias below count / 2**62.
        within = torch.randint(2**62, (self.dataset_size,), generator=generator) % self.counts[pick]
        return self.by_class[self.starts[pick] + within]

    def permutation(self):
        """The epoch's draws, each sample's repeats numbered as copies (repeated augmentation's ids included)."""
        order = super().permutation() % self.dataset_size
        return order + self.dataset_size * occurrence(order)


def shard_permutation(seed, epoch, shards):
    """The epoch's order of a shard set's shards, from (seed, epoch) alone (its own stream: not the samples')."""
    generator = torch.Generator().manual_seed(seed_hash(seed, epoch, SHARD_ORDER))
    return torch.randperm(shards, generator=generator)


def windowed(order, shard_of, window, shard_order):
    """order (sample indices) regrouped into windows: the samples of shard_order's first `window` shards first,
    then the next window's, each window's in the order they had in order (itself random, so random within the
    window). A window of W shards of n samples each mixes W * n samples; the whole epoch still covers every sample
    of order once."""
    position = torch.empty_like(shard_order)
    position[shard_order] = torch.arange(len(shard_order))
    return order[torch.argsort(position[shard_of[order]] // window, stable=True)]


def occurrence(order):
    """For each position of order, how many times its value came before it."""
    values, index = torch.sort(order, stable=True)
    position = torch.arange(len(order))
    first = torch.ones(len(order), dtype=torch.bool)
    first[1:] = values[1:] != values[:-1]
    run_start = torch.where(first, position, 0).cummax(0).values
    return torch.empty_like(order).scatter_(0, index, position - run_start)


def sample_seed(seed, epoch, index):
    """A well-mixed 32-bit seed for one sample in one epoch (torch's CPU generator keeps 32 bits of a seed)."""
    return seed_hash(seed, epoch, index) & 0xFFFFFFFF


def uniforms(keys, count):
    """A (len(keys), count) array of uniform floats in [0, 1): draw j of key k is seed_hash(k, j), so a sample's
    draws need no generator of its own and a whole batch's come from one vectorised call."""
    keys = np.asarray(keys, dtype=np.uint64)
    bits = seed_hash(keys[:, None], np.arange(count, dtype=np.uint64))
    return (bits >> 11).astype(np.float64) * 2.0**-53  # the top 53 bits: every double in [0, 1) a multiple of 2**-53


def seed_hash(*values):
    """A well-mixed 64-bit seed from non-negative integers, each changing about half its bits; also elementwise over
    numpy uint64 arrays (which wrap as the masks do).

    Chained SplitMix64 rather than numpy's SeedSequence, which costs more than augmenting an 8x8 image.
    """
    x = 0
    for value in values:
        x = splitmix64(x ^ value)
    return x


def splitmix64(x):
    """SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit mix in which every input bit flips about half the output."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
