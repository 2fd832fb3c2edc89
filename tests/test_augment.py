"""The augmentation keys: MixUp and CutMix (soft targets, seeded per step), the AutoAugment family and random
erasing (seeded per sample, repeats augmented afresh), CIFAR's padded crop and a separate validation size."""

import pytest
import torch
from omegaconf import OmegaConf
from torchvision.datasets import ImageFolder

from data.mix import batch_mixer, pair_partners
from data.batches import SeededSamples
from data.transforms import preprocessing, train_transforms, val_transforms
from utils.config import DataConfig


def data_cfg(**keys):
    return OmegaConf.structured(DataConfig(**keys))


def batch(n=6, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, size, size, generator=g), torch.tensor([0, 1, 2, 0, 1, 2, 0][:n])


def test_mixup_blends_pairs_with_one_lambda_and_soft_targets_to_match():
    mix = batch_mixer(data_cfg(mixup_alpha=0.4), 3, seed=0)
    images, targets = batch()
    mixed, soft = mix(images, targets, epoch=0, step=5)
    assert torch.allclose(soft.sum(1), torch.ones(6))
    lam = soft[0, targets[0]].item()  # sample 0 (class 0) is mixed with sample 1 (class 1)
    assert 0 < lam < 1 and soft[0, targets[1]].item() == pytest.approx(1 - lam)
    assert torch.allclose(mixed[0], lam * images[0] + (1 - lam) * images[1], atol=1e-6)
    assert torch.allclose(mixed[1], lam * images[1] + (1 - lam) * images[0], atol=1e-6)
    assert torch.allclose(mixed[4], lam * images[4] + (1 - lam) * images[5], atol=1e-6)  # one lambda per batch


def test_cutmix_pastes_a_box_from_the_partner_and_weights_targets_by_its_area():
    mix = batch_mixer(data_cfg(cutmix_alpha=1.0), 3, seed=0)
    images, targets = batch(size=16)
    for step in range(10):
        mixed, soft = mix(images, targets, epoch=1, step=step)
        from_partner = (mixed[0] == images[1]).all(0)  # pixels of sample 1 pasted into sample 0
        kept = (mixed[0] == images[0]).all(0)
        assert (from_partner | kept).all()
        assert soft[0, targets[1]].item() == pytest.approx(from_partner.float().mean().item())
        rows, cols = from_partner.any(1).nonzero(), from_partner.any(0).nonzero()
        if len(rows):  # one rectangle
            assert from_partner[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()


def test_mixing_is_drawn_from_seed_epoch_and_step_alone():
    cfg = data_cfg(mixup_alpha=0.2, cutmix_alpha=1.0)
    images, targets = batch()
    a = batch_mixer(cfg, 3, seed=0)(images, targets, 2, 7)
    b = batch_mixer(cfg, 3, seed=0)(images, targets, 2, 7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # 40 steps draw both kinds (a batch is one or the other) and different lambdas
    soft = [batch_mixer(cfg, 3, seed=0)(images, targets, 2, step)[1][0, 0].item() for step in range(40)]
    assert len({round(s, 6) for s in soft}) > 30
    kinds = {torch.equal(batch_mixer(cfg, 3, 0)(images, targets, 2, s)[0][2, :, 0, 0], images[2, :, 0, 0])
             for s in range(40)}
    assert kinds == {True, False}  # corner pixel untouched (CutMix elsewhere) and changed (MixUp)


def test_an_unpaired_last_sample_stays_unmixed():
    assert pair_partners(5, "cpu").tolist() == [1, 0, 3, 2, 4]
    images, targets = batch(n=5)
    mixed, soft = batch_mixer(data_cfg(mixup_alpha=1.0), 3, 0)(images, targets, 0, 0)
    assert torch.allclose(mixed[4], images[4]) and soft[4, targets[4]] == 1


def test_no_mixer_without_mixup_or_cutmix():
    assert batch_mixer(data_cfg(), 3, 0) is None


@pytest.fixture
def photos(image_folder):
    return image_folder({"train": {"a": 4, "b": 4}}, size=24) / "train"


@pytest.mark.parametrize("policy", ["autoaugment", "autoaugment_cifar10", "randaugment", "trivialaugment", "augmix"])
def test_auto_augment_changes_images_seeded_per_sample_and_afresh_for_each_repeat(photos, policy):
    geometry_only = data_cfg(img_size=16, scale=[1.0, 1.0], hflip=0.0)
    plain = SeededSamples(ImageFolder(str(photos), train_transforms(geometry_only)))
    augmented = SeededSamples(ImageFolder(str(photos), train_transforms(
        data_cfg(img_size=16, scale=[1.0, 1.0], hflip=0.0, auto_augment=policy))))
    n = len(plain)
    changed = sum(not torch.equal(augmented[i][0], plain[i][0]) for i in range(n))
    assert changed >= n // 2
    assert all(torch.equal(augmented[i][0], augmented[i][0]) for i in range(n))  # seeded by (seed, epoch, sample)
    repeats_differ = sum(not torch.equal(augmented[i][0], augmented[i + n][0]) for i in range(n))
    assert repeats_differ >= n // 2 and augmented[n][1] == augmented[0][1]  # copy n of sample 0: same label


def test_random_erasing_fills_a_rectangle_with_the_mean(photos):
    cfg = data_cfg(img_size=16, scale=[1.0, 1.0], hflip=0.0, random_erase=1.0, mean=[0.2, 0.4, 0.6])
    image = SeededSamples(ImageFolder(str(photos), train_transforms(cfg)))[0][0]
    erased = (image == torch.tensor([51, 102, 153], dtype=torch.uint8).view(3, 1, 1)).all(0)
    assert 0 < erased.float().mean() < 0.5
    rows, cols = erased.any(1).nonzero(), erased.any(0).nonzero()
    assert erased[rows.min():rows.max() + 1, cols.min():cols.max() + 1].all()


def test_crop_padding_crops_the_padded_image_at_a_random_offset(photos):
    cfg = data_cfg(img_size=24, crop_padding=4, hflip=0.0)
    samples = SeededSamples(ImageFolder(str(photos), train_transforms(cfg)))
    plain = ImageFolder(str(photos))[0][0]
    original = torch.as_tensor(list(plain.getdata()), dtype=torch.uint8).view(24, 24, 3).permute(2, 0, 1)
    shifts = set()
    for epoch in range(8):
        samples.set_epoch(epoch)
        image = samples[0][0]
        assert image.shape == (3, 24, 24)
        padded = torch.nn.functional.pad(original, (4, 4, 4, 4))
        found = [(dy, dx) for dy in range(9) for dx in range(9)
                 if torch.equal(padded[:, dy:dy + 24, dx:dx + 24], image)]
        assert found  # a window of the zero-padded image, not a rescaled crop
        shifts.add(found[0])
    assert len(shifts) > 3


def test_val_img_size_sets_the_validation_crop_and_what_export_records(photos):
    cfg = data_cfg(img_size=16, val_img_size=20, crop_pct=0.8)
    assert ImageFolder(str(photos), val_transforms(cfg))[0][0].shape == (3, 20, 20)
    assert preprocessing(cfg)["img_size"] == 20 and preprocessing(cfg)["resize"] == 25
    assert SeededSamples(ImageFolder(str(photos), train_transforms(cfg)))[0][0].shape == (3, 16, 16)


def test_val_resize_squash_keeps_what_the_centre_crop_cuts_off_and_export_says_so():
    from PIL import Image
    wide = Image.new("RGB", (40, 20))  # black, a white stripe at each end: objects at the edges of a wide photo
    wide.paste((255, 255, 255), (0, 0, 4, 20))
    wide.paste((255, 255, 255), (36, 0, 40, 20))
    cropped = val_transforms(data_cfg(img_size=10, crop_pct=1.0))(wide)
    squashed = val_transforms(data_cfg(img_size=10, val_resize="squash"))(wide)
    assert cropped.shape == squashed.shape == (3, 10, 10)
    assert cropped.max() == 0  # the centre square of a 2:1 image leaves both ends out
    assert squashed[:, :, [0, -1]].min() > 200 and squashed[:, :, 3:7].max() == 0  # both ends, squeezed
    steps = preprocessing(data_cfg(img_size=10, val_resize="squash"))
    assert steps["resize"] == "squash" and "crop_pct" not in steps and "whole image to img_size x img_size" in \
        steps["steps"] and "crop" not in steps["steps"]


def test_switch_probability_chooses_between_cutmix_and_mixup():
    images, targets = batch(size=16)
    for prob, cutmix in ((0.0, False), (1.0, True)):
        mix = batch_mixer(data_cfg(mixup_alpha=0.4, cutmix_alpha=1.0, mix_switch_prob=prob), 3, 0)
        for step in range(10):
            mixed = mix(images, targets, 0, step)[0]
            untouched = (mixed[0] == images[0]).all(0).float().mean().item()
            assert (untouched > 0) == cutmix  # CutMix keeps pixels outside its box; MixUp blends every pixel
