"""The batched resized crop (data/transforms.resized_crops) against torchvision's per-image resized_crop, which the
per-image path and the caches' CPU path use: the same pixels to within one grey level, for every kind of box."""

import threading

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from data.batches import device_batches
from data.transforms import BATCHED_CPU_PIXELS, CropSpec, crop_batch, resized_crop, resized_crops, stacked

SIZE = 24


def photo(height, width, seed):
    """A smooth random image (upscaled noise, like a photo's detail) of height x width: a box moved by one pixel
    changes many of its crop's pixels by more than one grey level."""
    generator = torch.Generator().manual_seed(seed)
    small = torch.randint(0, 256, (3, height // 4 + 2, width // 4 + 2), generator=generator, dtype=torch.uint8)
    return TF.resize(small, [height, width], antialias=True)


IMAGES = [photo(40, 60, 0), photo(60, 40, 1), photo(13, 9, 2), photo(40, 60, 3), photo(50, 50, 4), photo(33, 47, 5)]
# (top, left, height, width, flip) on each image: whole images (shrunk, or grown where smaller than the crop),
# boxes at each corner and edge, a box of one pixel, thin boxes, flips
BOXES = [[0, 0, 40, 60, 0], [0, 0, 60, 40, 1], [0, 0, 13, 9, 0], [39, 59, 1, 1, 1], [0, 37, 13, 13, 0],
         [20, 0, 13, 47, 1]]
MORE = [[30, 45, 10, 15, 0], [7, 3, 40, 30, 1], [5, 2, 8, 7, 1], [0, 0, 3, 60, 0], [37, 0, 13, 50, 1],
        [0, 30, 33, 17, 0]]


def per_image(images, boxes, size=SIZE):
    """torchvision's resized_crop and flip of each image: the reference."""
    crops = [TF.resized_crop(image, t, l, h, w, [size, size], antialias=True) for image, (t, l, h, w, _) in
             zip(images, boxes.tolist())]
    return torch.stack([crop.flip(-1) if flip else crop for crop, flip in zip(crops, boxes[:, 4].tolist())])


def batched(images, boxes, size=SIZE):
    return resized_crops(stacked(images), boxes[:, :4].double(), boxes[:, 4], size)


def grey_levels(a, b):
    return (a.int() - b.int()).abs()


@pytest.mark.parametrize("boxes", [BOXES, MORE])
def test_the_batched_crop_gives_torchvisions_pixels_to_within_a_grey_level(boxes):
    boxes = torch.tensor(boxes)
    difference = grey_levels(batched(IMAGES, boxes), per_image(IMAGES, boxes))
    assert difference.max() <= 1, difference.amax((1, 2, 3))
    assert difference.float().mean() < 0.2  # torchvision's uint8 kernels round between passes; mostly equal


@pytest.mark.parametrize("axis", [0, 1])
def test_a_box_one_pixel_off_is_told_apart(axis):
    """The tolerance above is tight enough to catch a box off by one pixel, on any sample of the test's."""
    boxes = torch.tensor(MORE)
    moved = boxes.clone()
    moved[:, axis] += torch.where(moved[:, axis] > 0, -1, 1)  # inside the image either way
    difference = grey_levels(batched(IMAGES, moved), per_image(IMAGES, boxes))
    assert (difference.amax((1, 2, 3)) > 1).all(), difference.amax((1, 2, 3))


def test_the_whole_image_at_its_own_size_is_the_image_and_a_flip_mirrors_it():
    image = IMAGES[4]
    boxes = torch.tensor([[0, 0, 50, 50, 0], [0, 0, 50, 50, 1]])
    crops = batched([image, image], boxes, size=50)
    assert torch.equal(crops[0], image) and torch.equal(crops[1], image.flip(-1))


def test_what_the_batch_pads_is_never_read():
    boxes = torch.tensor(BOXES)
    batch = stacked(IMAGES)
    noisy = batch.clone()
    for out, image in zip(noisy, IMAGES):  # fill the padding with noise: the crops stay the same
        mask = torch.ones_like(out, dtype=torch.bool)
        mask[:, : image.shape[1], : image.shape[2]] = False
        out[mask] = torch.randint(0, 256, (int(mask.sum()),), dtype=torch.uint8)
    args = boxes[:, :4].double(), boxes[:, 4], SIZE
    assert torch.equal(resized_crops(batch, *args), resized_crops(noisy, *args))


def test_a_fractional_box_one_image_at_a_time_matches_the_batch():
    """An image stored smaller than the one its box was drawn on crops a box in fractional pixels: crop_batch's
    path for it on a CPU (one image, on the pixels its box covers) and the batched one give the same pixels, but for
    float rounding (and torchvision's own kernels for the whole-pixel box)."""
    boxes = torch.tensor([[3.5, 2.25, 20.5, 30.75], [0.0, 0.0, 60.0, 40.0], [1.2, 0.7, 9.1, 7.3]], dtype=torch.float64)
    flips = torch.tensor([0, 1, 1])
    images = IMAGES[:3]
    whole = resized_crops(stacked(images), boxes, flips, SIZE)
    one_by_one = torch.stack([resized_crop(i, b, bool(f), SIZE) for i, b, f in zip(images, boxes, flips)])
    difference = grey_levels(whole, one_by_one)
    assert difference.max() <= 1 and difference[[0, 2]].float().mean() < 0.01


def test_a_fractional_box_crops_a_smaller_stored_image_like_the_original():
    """A photo stored at half size, its box scaled by one half: about the original's crop (3.5 grey levels apart on
    average, the detail the stored image lost), where the box moved by one stored pixel is 20 or more apart."""
    original = photo(80, 120, 7)
    stored = TF.resize(original, [40, 60], antialias=True)
    from_original = per_image([original], torch.tensor([[10, 20, 60, 90, 1]]))
    spec, half = CropSpec(SIZE, (0.08, 1.0), 0.5, 0), torch.tensor([[0.5, 0.5]])
    scaled = crop_batch([stored], torch.tensor([[10, 20, 60, 90, 1]]), spec, half)
    assert grey_levels(scaled, from_original).float().mean() < 5
    for moved in ([12, 20, 60, 90, 1], [10, 22, 60, 90, 1]):
        off = crop_batch([stored], torch.tensor([moved]), spec, half)
        assert grey_levels(off, from_original).float().mean() > 15


def test_crop_batch_takes_a_list_or_a_padded_batch_and_chooses_by_size_on_a_cpu():
    spec = CropSpec(SIZE, (0.08, 1.0), 0.5, 0)
    boxes = torch.tensor(MORE)
    assert 40 * 60 > BATCHED_CPU_PIXELS  # these take the one-by-one path on a CPU: torchvision's own pixels
    assert torch.equal(crop_batch(IMAGES, boxes, spec), per_image(IMAGES, boxes))
    assert torch.equal(crop_batch(stacked(IMAGES), boxes, spec), per_image(IMAGES, boxes))
    small = [TF.resize(image, [8, 8], antialias=True) for image in IMAGES]
    boxes = torch.tensor([[0, 0, 8, 8, 1], [2, 1, 5, 6, 0], [7, 7, 1, 1, 0], [0, 3, 8, 5, 1], [1, 1, 6, 6, 0],
                          [4, 0, 4, 8, 1]])
    assert torch.equal(crop_batch(small, boxes, spec), batched(small, boxes))  # small: the batched path
    assert grey_levels(crop_batch(small, boxes, spec), per_image(small, boxes)).max() <= 1


def test_padded_windows_of_a_list_read_zeros_outside_each_image():
    spec = CropSpec(8, (0.08, 1.0), 0.5, 2)
    images = [torch.full((3, 8, 8), 200, dtype=torch.uint8), torch.full((3, 6, 8), 100, dtype=torch.uint8)]
    crops = crop_batch(images, torch.tensor([[-2, -2, 8, 8, 0], [2, 0, 8, 8, 0]]), spec)
    assert (crops[0, :, :2] == 0).all() and (crops[0, :, 2:, 2:] == 200).all()
    assert (crops[1, :, :4] == 100).all() and (crops[1, :, 4:] == 0).all()  # below the shorter image: zeros


@pytest.mark.parametrize("ahead", [None, True])  # a CPU's default, in line; the thread CUDA takes by default
def test_device_batches_hands_over_every_batch_in_order_and_ends(ahead):
    loader = [(torch.full((2, 3, 4, 4), i, dtype=torch.uint8), torch.tensor([i, i])) for i in range(5)]
    got = list(device_batches(loader, torch.device("cpu"), CropSpec(4, (1.0, 1.0), 0, 0), ahead))
    assert [int(targets[0]) for _, targets in got] == [0, 1, 2, 3, 4]
    assert all(torch.equal(images, batch[0]) for (images, _), batch in zip(got, loader))
    assert list(device_batches([], torch.device("cpu"), None, ahead)) == []


def test_device_batches_raises_the_loaders_error_in_the_training_loop():
    def loader():
        yield torch.zeros(1, 3, 4, 4, dtype=torch.uint8), torch.tensor([0])
        raise OSError("image 7 is damaged")
    batches = device_batches(loader(), torch.device("cpu"), None, ahead=True)
    next(batches)
    with pytest.raises(OSError, match="image 7 is damaged"):
        next(batches)


def test_closing_device_batches_stops_its_thread_one_batch_ahead_at_most():
    taken = []

    def loader():  # without end, as a loader that the loop leaves early
        i = 0
        while True:
            taken.append(i)
            yield torch.zeros(1, 3, 4, 4, dtype=torch.uint8), torch.tensor([i])
            i += 1
    batches = device_batches(loader(), torch.device("cpu"), None, ahead=True)
    assert [int(next(batches)[1]) for _ in range(3)] == [0, 1, 2]
    batches.close()
    assert not [t for t in threading.enumerate() if t.name == "device_batches"]
    assert len(taken) <= 3 + 2  # the one in the queue and the one being prepared
