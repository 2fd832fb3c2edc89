"""The seeded distributed sampler (disjoint, complete, reshuffled per epoch, seeded, same global batches at any N)
and per-sample augmentation seeds (the same augmentation whoever loads a sample)."""

import pytest
import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from data.batches import SeededSamples, keep_batch
from data.sampler import BalancedSampler, DistributedShuffleSampler, shard_permutation
from data.transforms import train_transforms
import utils.config
from utils.config import DataConfig, RecipeError, load_recipe


def shares(n, world, epoch=0, seed=0, shuffle=True, batch_size=None, drop_last=False, group=1, repeats=1):
    samplers = [DistributedShuffleSampler(n, rank, world, shuffle=shuffle, seed=seed, batch_size=batch_size,
                                          drop_last=drop_last, group=group, repeats=repeats) for rank in range(world)]
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


def global_batches(n, world, global_batch, epoch=0, drop_last=False, group=1, repeats=1):
    """The set of samples in each optimizer step, united over ranks, with per-rank batch global_batch / world."""
    b = global_batch // world
    parts = shares(n, world, epoch=epoch, batch_size=global_batch, drop_last=drop_last, group=group, repeats=repeats)
    steps = max(-(-len(p) // b) for p in parts)
    return [sorted(i for p in parts for i in p[step * b:(step + 1) * b]) for step in range(steps)]


@pytest.mark.parametrize("n", [96, 100, 101])
def test_same_global_batches_at_any_world_size(n):
    reference = global_batches(n, 1, 8, epoch=2)
    for world in (2, 4, 8):
        assert global_batches(n, world, 8, epoch=2) == reference


def steps(n, world, global_batch, drop_last=False):
    return DistributedShuffleSampler(n, 0, world, batch_size=global_batch, drop_last=drop_last).steps()


def test_steps_count_the_longest_and_shortest_share():
    assert steps(1437, 2, 64) == (23, 23)
    assert steps(9, 2, 4) == (3, 2)  # rank 0 holds 5 samples (3 steps), rank 1 holds 4 (2 steps)
    assert steps(64, 1, 32) == (2, 2)


def test_step_samples_count_the_last_partial_global_step():
    sampler = DistributedShuffleSampler(13, 1, 3, batch_size=6)
    assert [sampler.step_samples(i) for i in range(3)] == [6, 6, 1]


def test_epoch_order_is_a_hash_of_seed_and_epoch_not_their_sum():
    assert shares(100, 1, epoch=1, seed=0) != shares(100, 1, epoch=0, seed=1)


def test_drop_last_gives_every_rank_the_same_full_steps_at_any_world_size():
    reference = global_batches(21, 1, 4, drop_last=True)
    assert len(reference) == 5 and all(len(batch) == 4 for batch in reference)
    for world in (2, 4):
        assert global_batches(21, world, 4, drop_last=True) == reference
        assert steps(21, world, 4, drop_last=True) == (5, 5)
    assert sorted(i for batch in reference for i in batch) != list(range(21))  # one image left out this epoch


def test_drop_last_leaves_out_a_different_remainder_each_epoch():
    left_out = [set(range(21)) - {i for batch in global_batches(21, 2, 4, epoch, drop_last=True) for i in batch}
                for epoch in range(12)]
    assert all(len(s) == 1 for s in left_out)
    assert len(set.union(*left_out)) > 5  # not always the dataset's last image


@pytest.mark.parametrize("n", [40, 41, 45])
def test_pairs_stay_on_one_rank_and_global_batches_do_not_change(n):
    reference = global_batches(n, 1, 8, epoch=1)
    order = DistributedShuffleSampler(n, group=2)
    order.set_epoch(1)
    pairs = order.permutation().view(-1, 2).tolist() if n % 2 == 0 else order.permutation()[:-1].view(-1, 2).tolist()
    for world in (2, 4):
        assert global_batches(n, world, 8, epoch=1, group=2) == reference
        for part in shares(n, world, epoch=1, batch_size=8, group=2):
            assert all(part[i:i + 2] in pairs for i in range(0, len(part) - 1, 2))  # consecutive = one pair
        parts = shares(n, world, epoch=1, batch_size=8, group=2)
        assert sorted(i for p in parts for i in p) == list(range(n))
        most, fewest = DistributedShuffleSampler(n, 0, world, batch_size=8, group=2).steps()
        assert (most, fewest) == (max(-(-len(p) // (8 // world)) for p in parts),
                                  min(-(-len(p) // (8 // world)) for p in parts))


def test_repeats_show_each_sample_several_times_in_a_row_in_an_epoch_of_the_same_length():
    reference = shares(30, 1, epoch=2, repeats=3)[0]
    assert len(reference) == 30
    assert [i % 30 for i in reference[0:3]] == [reference[0]] * 3 and len(set(reference[0:3])) == 3  # 3 copies
    assert all(len({i % 30 for i in reference[k:k + 3]}) == 1 for k in range(0, 30, 3))
    assert len({i % 30 for i in reference}) == 10  # an epoch of 30 shows 10 images 3 times
    for world in (2, 3):
        assert global_batches(30, world, 6, epoch=2, repeats=3) == global_batches(30, 1, 6, epoch=2, repeats=3)


def test_start_step_skips_exactly_the_steps_done():
    for rank in range(2):
        full, resumed = (DistributedShuffleSampler(9, rank, 2, batch_size=4) for _ in range(2))
        full.set_epoch(3)
        resumed.set_epoch(3, start_step=2)
        assert list(resumed) == list(full)[4:] and len(resumed) == len(list(full)[4:])  # 2 steps of 2 per rank


def test_global_batch_must_divide_by_world_size(monkeypatch):
    monkeypatch.setattr(utils.config, "WORLD_SIZE", 4)
    assert load_recipe("cls.yaml", ["train.batch_size=64"]).train.batch_size == 64
    with pytest.raises(RecipeError, match=r"cls.yaml .*train.batch_size must be a multiple of the 4 processes.*got 10"):
        load_recipe("cls.yaml", ["train.batch_size=10"])


def augmented_epoch(dataset, world, workers, epoch, seed=0):
    """{sample index: augmented image} for one epoch, loaded through one DataLoader per rank as train.py does."""
    images = {}
    for rank in range(world):
        sampler = DistributedShuffleSampler(len(dataset), rank, world, seed=seed)
        samples = SeededSamples(dataset, seed)
        sampler.set_epoch(epoch)
        samples.set_epoch(epoch)
        loader = DataLoader(samples, batch_size=2, sampler=sampler, num_workers=workers, collate_fn=keep_batch)
        batches = torch.cat([batch for batch, _ in loader])
        images.update(zip(list(sampler), batches))
    return images


@pytest.fixture
def augmenting_dataset(image_folder):
    cfg = OmegaConf.structured(DataConfig(img_size=6, scale=[0.1, 1.0], hflip=0.5))
    return ImageFolder(str(image_folder({"train": {"a": 6, "b": 5}}, size=16) / "train"), train_transforms(cfg))


def test_augmentation_depends_only_on_seed_epoch_and_sample(augmenting_dataset):
    reference = augmented_epoch(augmenting_dataset, world=1, workers=0, epoch=3)
    assert sorted(reference) == list(range(11))
    for world, workers in ((2, 0), (3, 2), (1, 2)):
        other = augmented_epoch(augmenting_dataset, world, workers, epoch=3)
        assert all(torch.equal(other[i], reference[i]) for i in reference), (world, workers)
    next_epoch = augmented_epoch(augmenting_dataset, world=1, workers=0, epoch=4)
    assert sum(torch.equal(next_epoch[i], reference[i]) for i in reference) < 3  # re-drawn every epoch
    other_seed = augmented_epoch(augmenting_dataset, world=1, workers=0, epoch=3, seed=1)
    assert sum(torch.equal(other_seed[i], reference[i]) for i in reference) < 3


def test_seeded_samples_leave_the_callers_random_stream_alone(augmenting_dataset):
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    SeededSamples(augmenting_dataset)[3]
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("n", [1, 2, 7, 20, 21])
@pytest.mark.parametrize("world, group, batch", [(1, 1, 4), (3, 1, 6), (2, 2, 8), (3, 2, 6), (4, 2, 16)])
def test_share_sizes_and_step_shares_count_what_each_rank_yields(n, world, group, batch):
    for drop_last in (False, True):
        samplers = [DistributedShuffleSampler(n, r, world, batch_size=batch, drop_last=drop_last, group=group)
                    for r in range(world)]
        for rank, sampler in enumerate(samplers):
            share = list(sampler)
            assert sampler.share_size(rank) == len(share)
            rank_batch = batch // world
            assert [sampler.step_share(s, rank) for s in range(sampler.steps()[0] + 1)] == \
                [len(share[s * rank_batch:(s + 1) * rank_batch]) for s in range(sampler.steps()[0] + 1)]


def test_repeated_pairs_are_two_different_images_and_repeat_together():
    order = DistributedShuffleSampler(21, group=2, repeats=4)
    order.set_epoch(3)
    ids = order.permutation().tolist()
    assert len(ids) == 21
    pairs = [(ids[i], ids[i + 1]) for i in range(0, 20, 2)]
    assert all(a % 21 != b % 21 for a, b in pairs)  # MixUp never mixes two copies of one image
    assert [(a % 21, b % 21) for a, b in pairs[:4]] == [(pairs[0][0] % 21, pairs[0][1] % 21)] * 4  # a b, a b, ...
    assert len({a for a, _ in pairs[:4]}) == 4  # each copy its own id (its own augmentation)


@pytest.mark.parametrize("balanced", [False, True])
def test_shard_windows_read_w_shards_at_a_time_and_keep_every_promise_of_the_order(balanced):
    # 11 shards of 1-9 samples (97 in all), windows of 3 shards: the epoch reads shard_permutation's shards three at
    # a time, every sample once (balanced: draws), in the same global batches at any world size.
    lengths = [9, 1, 8, 12, 5, 9, 7, 3, 15, 11, 17]
    shard_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    targets = torch.arange(len(shard_of)) % 4

    def sampler(rank, world, epoch, window=3):
        options = dict(rank=rank, world_size=world, seed=5, batch_size=12, windows=(shard_of, window, len(lengths)))
        s = BalancedSampler(targets, **options) if balanced else DistributedShuffleSampler(len(shard_of), **options)
        s.set_epoch(epoch)
        return s

    for epoch in (0, 1):
        order = sampler(0, 1, epoch).permutation() % len(shard_of)
        if not balanced:
            assert sorted(order.tolist()) == list(range(len(shard_of)))
        shards = shard_permutation(5, epoch, len(lengths)).tolist()
        windows = [set(shards[i:i + 3]) for i in range(0, len(shards), 3)]
        read = [int(shard_of[i]) for i in order]
        cuts = [0]  # where each window's samples end in the order
        for window in windows:
            cuts.append(cuts[-1] + sum(1 for s in read[cuts[-1]:] if s in window))
            assert set(read[cuts[-2]:cuts[-1]]) <= window
        assert cuts[-1] == len(read)
        one = list(sampler(0, 1, epoch))
        for world in (2, 3):
            parts = [list(sampler(r, world, epoch)) for r in range(world)]
            b = 12 // world
            for step in range(-(-len(one) // 12)):
                assert sorted(i for p in parts for i in p[step * b:(step + 1) * b]) == sorted(one[step * 12:(step + 1) * 12])
    # The same draws, regrouped: a window of every shard leaves the plain order as it was.
    assert torch.equal(sampler(0, 1, 0, window=len(lengths)).permutation(),
                       (BalancedSampler(targets, seed=5, batch_size=12) if balanced else
                        DistributedShuffleSampler(len(shard_of), seed=5, batch_size=12)).permutation())
