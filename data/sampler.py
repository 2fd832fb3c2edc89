"""The seeded distributed sampler: one permutation per epoch, shared by all ranks, dealt out with nothing padded."""

import math

import torch
from torch.utils.data import Sampler


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
