"""What each training step sees, from (seed, epoch) alone: the seeded distributed sampler, one permutation per epoch
dealt out to the ranks with nothing padded, and per-sample augmentation seeds."""

import math

import torch
from torch.utils.data import Dataset, Sampler

MASK64 = (1 << 64) - 1


class DistributedShuffleSampler(Sampler):
    """Yield this rank's share of a dataset: positions rank, rank + world_size, ... of a permutation of it.

    The permutation depends only on (seed, epoch), so every rank draws the same one and the shares are disjoint
    and together cover the dataset exactly once: nothing is padded or dropped, and ranks may differ by one
    sample. With a per-rank batch of B / world_size, step i's batches across ranks are together exactly
    positions [i*B, (i+1)*B) of the permutation, the same global batch at any world size.
    """

    def __init__(self, dataset_size, rank=0, world_size=1, shuffle=True, seed=0):
        self.dataset_size, self.rank, self.world_size = dataset_size, rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch):
        """Choose the epoch whose permutation the next iteration yields."""
        self.epoch = epoch

    def permutation(self):
        """The epoch's global order of sample indices, identical on every rank."""
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def __iter__(self):
        return iter(self.permutation()[self.rank :: self.world_size].tolist())

    def __len__(self):
        return max(0, math.ceil((self.dataset_size - self.rank) / self.world_size))


def epoch_steps(dataset_size, rank_batch, world_size):
    """(most, fewest) steps a rank takes per epoch over its share: ranks differ by at most one step."""
    most = math.ceil(math.ceil(dataset_size / world_size) / rank_batch)
    fewest = math.ceil(dataset_size // world_size / rank_batch)
    return most, fewest


class SeededSamples(Dataset):
    """Wrap a dataset so that sample i's random transforms in epoch e draw from torch's generator seeded by
    (seed, e, i) alone.

    A sample is then augmented the same way whichever rank or DataLoader worker loads it, at any world size or
    number of workers, and a run resumed mid-epoch can redo any step exactly. The caller's generator state is
    restored afterwards, so with no workers the main process's stream (dropout, ...) is left as it was.
    """

    def __init__(self, dataset, seed=0):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch):
        """Choose the epoch whose augmentation the next iteration draws. Workers get a fresh copy of this object
        each epoch (the DataLoader's workers are not persistent), so they see it."""
        self.epoch = epoch

    def __getitem__(self, index):
        state = torch.get_rng_state()
        # The CPU generator alone: torch.manual_seed would also reseed every GPU's stream.
        torch.default_generator.manual_seed(sample_seed(self.seed, self.epoch, index))
        try:
            return self.dataset[index]
        finally:
            torch.set_rng_state(state)

    def __len__(self):
        return len(self.dataset)


def sample_seed(seed, epoch, index):
    """A well-mixed 32-bit seed for one sample in one epoch (torch's CPU generator keeps 32 bits of a seed).

    Hashed with SplitMix64 rather than numpy's SeedSequence, which costs more than augmenting an 8x8 image.
    """
    return splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ index) & 0xFFFFFFFF


def splitmix64(x):
    """SplitMix64 (Steele, Lea and Flood, 2014): a 64-bit mix in which every input bit flips about half the output."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
