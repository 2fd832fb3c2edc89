"""The seeded distributed sampler: disjoint, complete, reshuffled per epoch, seeded, same global batches at any N."""

import pytest
import torch

from data.datasets import DatasetError, per_rank_batch
from data.sampler import DistributedShuffleSampler, epoch_steps


def shares(n, world, epoch=0, seed=0, shuffle=True):
    samplers = [DistributedShuffleSampler(n, rank, world, shuffle=shuffle, seed=seed) for rank in range(world)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers]


@pytest.mark.parametrize("n", [1, 7, 64, 101])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_shares_are_disjoint_and_cover_every_sample_once(n, world):
    parts = shares(n, world)
    flat = [i for part in parts for i in part]
    assert sorted(flat) == list(range(n))  # nothing lost, nothing doubled
    assert [len(p) for p in parts] == [len(DistributedShuffleSampler(n, r, world)) for r in range(world)]
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_every_rank_draws_the_same_permutation():
    s0, s1 = (DistributedShuffleSampler(50, r, 2, seed=3) for r in range(2))
    s0.set_epoch(4)
    s1.set_epoch(4)
    assert torch.equal(s0.permutation(), s1.permutation())


def test_reshuffled_every_epoch_and_repeatable():
    assert shares(100, 2, epoch=0) != shares(100, 2, epoch=1)
    assert shares(100, 2, epoch=1) == shares(100, 2, epoch=1)


def test_order_depends_on_seed():
    assert shares(100, 2, seed=0) != shares(100, 2, seed=1)
    assert shares(100, 2, seed=1) == shares(100, 2, seed=1)


def test_no_shuffle_keeps_dataset_order():
    assert shares(5, 2, shuffle=False) == [[0, 2, 4], [1, 3]]


def global_batches(n, world, global_batch, epoch=0):
    """The set of samples in each optimizer step, united over ranks, with per-rank batch global_batch / world."""
    b = global_batch // world
    parts = shares(n, world, epoch=epoch)
    steps = max(-(-len(p) // b) for p in parts)
    return [sorted(i for p in parts for i in p[step * b:(step + 1) * b]) for step in range(steps)]


@pytest.mark.parametrize("n", [96, 100, 101])
def test_same_global_batches_at_any_world_size(n):
    reference = global_batches(n, 1, 8, epoch=2)
    for world in (2, 4, 8):
        assert global_batches(n, world, 8, epoch=2) == reference


def test_epoch_steps_counts_the_longest_and_shortest_share():
    assert epoch_steps(1437, 32, 2) == (23, 23)
    assert epoch_steps(9, 2, 2) == (3, 2)  # rank 0 holds 5 samples (3 steps), rank 1 holds 4 (2 steps)
    assert epoch_steps(64, 32, 1) == (2, 2)


def test_global_batch_must_divide_by_world_size():
    assert per_rank_batch(64, 4) == 16
    with pytest.raises(DatasetError, match="train.batch_size=10 .* 4 processes"):
        per_rank_batch(10, 4)
