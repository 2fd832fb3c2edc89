"""data.cache=ram's memory: the budget (available memory, container limits, processes per machine), the memory a
cache takes while it is built (its pixels, not a second copy), and training images stored no larger than their crops
need, each at its own size, with the per-image path's crop boxes."""

import json
import math
import sys
import threading
import time

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision.datasets import ImageFolder

import data.cache
import data.transforms
import utils.general
import utils.memory
from conftest import run_python
from data.batches import SeededSamples, batch_to
from data.cache import RamImages, store_side
from data.transforms import crop_spec, train_transforms
from utils.config import DataConfig
from utils.general import SharedError
from utils.memory import MEMORY_SHARE, Budget, memory_budget

GiB = 2**30
MiB = 2**20

def data_cfg(**keys):
    return OmegaConf.structured(DataConfig(**keys))

def smooth_folder(root, sizes):
    """An ImageFolder of smooth images of the given (height, width): ramps across and down, and a few broad waves,
    so that two resamplings of one box agree to a grey level or so at any image size, while boxes a few pixels
    apart do not."""
    for i, (h, w) in enumerate(sizes):
        y, x = np.mgrid[0:h, 0:w] / max(h, w)
        waves = 127 + 100 * np.cos(5 * np.pi * x) * np.cos(5 * np.pi * y)
        pixels = np.stack([255 * x * max(h, w) / w, 255 * y * max(h, w) / h, waves], -1)
        folder = root / "train" / "ab"[i % 2]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels.round().astype(np.uint8)).save(folder / f"{i:03d}.png")
    return root / "train"

# img_size 8 at data.scale [0.25, 1] stores shorter sides of at most 16: bigger ones of both orientations, and
# smaller ones, kept.
SIZES = [(48, 64), (12, 10), (70, 40), (16, 30), (33, 33), (9, 14)]

def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path

def meminfo(tmp_path, free_kb, available_kb, cached_kb):
    return write(tmp_path / "meminfo", f"MemTotal:       33554432 kB\nMemFree:        {free_kb} kB\n"
                                       f"MemAvailable:   {available_kb} kB\nBuffers:          102400 kB\n"
                                       f"Cached:         {cached_kb} kB\n")

def budget_of(tmp_path, processes=1, self_cgroup="0::/\n"):
    """memory_budget over the fake files under tmp_path (meminfo, cgroup/, self_cgroup)."""
    return memory_budget(tmp_path / "meminfo", tmp_path / "cgroup", write(tmp_path / "self_cgroup", self_cgroup),
                         processes)

def test_budget_counts_available_memory_not_free_memory(tmp_path):
    # 1 GiB free, 6 GiB of page cache, of which the kernel says 4 GiB more could be had: 5 GiB available.
    meminfo(tmp_path, free_kb=1 * 2**20, available_kb=5 * 2**20, cached_kb=6 * 2**20)
    budget = budget_of(tmp_path)
    assert budget.room == 5 * GiB and budget.source == "of memory available" and budget.processes == 1
    assert budget.nbytes == pytest.approx(MEMORY_SHARE * 5 * GiB)

def test_budget_is_the_room_under_a_lower_cgroup_v2_limit(tmp_path):
    meminfo(tmp_path, free_kb=1 * 2**20, available_kb=5 * 2**20, cached_kb=6 * 2**20)
    write(tmp_path / "cgroup" / "memory.max", f"{3 * GiB}\n")
    write(tmp_path / "cgroup" / "memory.current", f"{2 * GiB}\n")
    assert budget_of(tmp_path).room == 1 * GiB
    # Inactive page cache counts as used but is reclaimed before the limit bites: room, as container runtimes count.
    write(tmp_path / "cgroup" / "memory.stat", f"anon {GiB}\nfile {GiB}\ninactive_file {GiB // 2}\n")
    budget = budget_of(tmp_path)
    assert budget.room == 1.5 * GiB and budget.source == "left under the container's memory limit"
    assert budget.nbytes == pytest.approx(MEMORY_SHARE * 1.5 * GiB)
    # A higher limit leaves MemAvailable the least.
    write(tmp_path / "cgroup" / "memory.max", f"{16 * GiB}\n")
    assert budget_of(tmp_path).room == 5 * GiB

def test_budget_takes_the_tightest_of_the_processs_cgroup_and_its_parents(tmp_path):
    meminfo(tmp_path, free_kb=2**20, available_kb=50 * 2**20, cached_kb=0)
    job, step = tmp_path / "cgroup" / "job", tmp_path / "cgroup" / "job" / "step"
    write(job / "memory.max", f"{8 * GiB}\n"), write(job / "memory.current", f"{5 * GiB}\n")
    write(step / "memory.max", f"{10 * GiB}\n"), write(step / "memory.current", f"{4 * GiB}\n")
    assert budget_of(tmp_path, self_cgroup="0::/job/step\n").room == 3 * GiB  # the job's limit, not the step's
    write(step / "memory.max", "max\n")
    assert budget_of(tmp_path, self_cgroup="0::/job/step\n").room == 3 * GiB
    # In a container, /proc/self/cgroup may name the host's path, which the container's own root stands for.
    write(tmp_path / "cgroup" / "memory.max", f"{4 * GiB}\n"), write(tmp_path / "cgroup" / "memory.current", "0\n")
    assert budget_of(tmp_path, self_cgroup="0::/host/slice/abc\n").room == 4 * GiB

def test_budget_reads_cgroup_v1_and_a_no_limit_value(tmp_path):
    meminfo(tmp_path, free_kb=2**20, available_kb=5 * 2**20, cached_kb=0)
    memory = tmp_path / "cgroup" / "memory"
    write(memory / "memory.limit_in_bytes", f"{2 * GiB}\n")
    write(memory / "memory.usage_in_bytes", f"{GiB + GiB // 2}\n")
    write(memory / "memory.stat", f"inactive_file 0\ntotal_inactive_file {GiB // 4}\n")
    budget = budget_of(tmp_path, self_cgroup="4:memory:/docker/abc\n1:cpu:/\n")
    assert budget.room == 0.75 * GiB and budget.source == "left under the container's memory limit"
    write(memory / "memory.limit_in_bytes", "9223372036854771712\n")  # v1's "no limit"
    assert budget_of(tmp_path).room == 5 * GiB
    (tmp_path / "meminfo").unlink()
    assert budget_of(tmp_path) is None  # not a budget of exabytes

def test_budget_with_no_cgroup_limit_or_nothing_to_read(tmp_path):
    meminfo(tmp_path, free_kb=2**20, available_kb=5 * 2**20, cached_kb=0)
    write(tmp_path / "cgroup" / "memory.max", "max\n"), write(tmp_path / "cgroup" / "memory.current", f"{GiB}\n")
    assert budget_of(tmp_path).room == 5 * GiB
    (tmp_path / "meminfo").unlink()
    assert budget_of(tmp_path) is None  # not Linux, say: no check
    write(tmp_path / "cgroup" / "memory.max", f"{3 * GiB}\n")
    assert budget_of(tmp_path).room == 2 * GiB  # a limit alone still counts

def test_budget_is_shared_by_the_processes_on_the_machine(tmp_path, monkeypatch):
    meminfo(tmp_path, free_kb=2**20, available_kb=8 * 2**20, cached_kb=0)
    assert budget_of(tmp_path, processes=4).nbytes == pytest.approx(MEMORY_SHARE * 8 * GiB / 4)
    assert utils.memory.LOCAL_WORLD_SIZE is utils.general.LOCAL_WORLD_SIZE  # torchrun's, from the environment
    monkeypatch.setattr(utils.memory, "LOCAL_WORLD_SIZE", 3)  # by default, the processes on this machine
    budget = budget_of(tmp_path, processes=None)
    assert budget.processes == 3 and budget.nbytes == pytest.approx(MEMORY_SHARE * 8 * GiB / 3)

def test_a_cache_over_budget_says_what_it_needs_the_budget_and_how_it_was_derived(tmp_path):
    folder = smooth_folder(tmp_path / "data", [(12, 12)] * 8)  # 432 bytes each, decoded
    meminfo(tmp_path, free_kb=1, available_kb=5, cached_kb=0)  # 5 KiB: 2 KiB for each of 2 processes
    budget = budget_of(tmp_path, processes=2)
    with pytest.raises(SharedError) as error:
        RamImages(ImageFolder(str(folder)), None, crop_spec(data_cfg(img_size=8)), budget=budget)
    assert str(error.value) == ("data.cache=ram: the first 5 of 8 images take 2.1 KiB, more than this process's "
                                "budget of 2.0 KiB (80% of the 5.0 KiB of memory available, shared by the 2 "
                                "processes on this machine); set data.cache=none to decode per image")
    with pytest.raises(SharedError, match=r"the first 1 of 8 images take 432 B, 2.2 KiB with the 1.8 KiB cached "
                                          r"before them, more than this process's budget of 2.0 KiB"):
        RamImages(ImageFolder(str(folder)), budget=budget, used=1800)  # validation, after the training images
    assert len(RamImages(ImageFolder(str(folder)), budget=None)) == 8  # nothing to read: no check

class MemorySource:
    """n generated side x side RGB images, no files: image i's pixels are (j + 7 i) mod 256 in (H, W, C) order;
    `loads` counts the images read, and reading image 0 takes `first_delay` seconds."""

    def __init__(self, n, side, first_delay=0.0):
        self.n, self.side, self.first_delay, self.loads, self.lock = n, side, first_delay, 0, threading.Lock()
        self.classes, self.root, self.targets = ["a", "b"], "memory", [i % 2 for i in range(n)]
        self.ramp = np.arange(side * side * 3, dtype=np.int64)

    def pixels(self, start, stop):
        """The (stop - start, C, H, W) uint8 pixels of images start..stop-1, as a cache stores them."""
        i = np.arange(start, stop)[:, None]
        return ((self.ramp + 7 * i) % 256).astype(np.uint8).reshape(-1, self.side, self.side, 3).transpose(0, 3, 1, 2)

    def __getitem__(self, i):
        with self.lock:
            self.loads += 1
        if i == 0:
            time.sleep(self.first_delay)
        return Image.fromarray(self.pixels(i, i + 1)[0].transpose(1, 2, 0)), i % 2

    def __len__(self):
        return self.n


def status_bytes(key):
    """One memory figure of this process's /proc/self/status (VmRSS, VmHWM), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024


def cache_memory(n, side):
    """Build a RamImages of MemorySource(n, side) and print, as JSON, its pixels' bytes, how far the peak resident
    memory rose while it was built, and whether every pixel is right (run in a fresh interpreter)."""
    source = MemorySource(n, side)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak, to the memory resident now
    before = status_bytes("VmRSS")
    cache = RamImages(source, budget=Budget(4 * GiB, 5 * GiB, "of memory available", 1))
    rise = status_bytes("VmHWM") - before
    flat = cache.pixels.numpy().reshape(n, -1)
    right = all(np.array_equal(flat[i : i + 5000], source.pixels(i, min(i + 5000, n)).reshape(-1, flat.shape[1]))
                for i in range(0, n, 5000))
    print(json.dumps(dict(nbytes=cache.nbytes, rise=rise, right=right)))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_cache_takes_the_memory_of_its_pixels_while_it_is_built():
    # 60,000 images of 3 x 24 x 24: 99 MiB of pixels. Decoding each image into a tensor of its own and then packing
    # them into one took about 3 times that at its peak.
    result = run_python("-c", "import sys; sys.path.insert(0, 'tests'); import test_cache_memory as t; "
                              "t.cache_memory(60000, 24)")
    assert result.returncode == 0, result.stderr
    memory = json.loads(result.stdout.splitlines()[-1])
    assert memory["nbytes"] == 60000 * 3 * 24 * 24 and memory["right"]
    assert memory["rise"] < 1.25 * memory["nbytes"] + 16 * MiB, memory["rise"] / memory["nbytes"]


def test_decoding_keeps_a_few_chunks_of_images_in_flight_and_stops_at_the_budget(monkeypatch):
    monkeypatch.setattr(data.cache, "cpu_count", lambda: 2)  # two threads: four chunks of 16 images in flight
    # While image 0 decodes slowly, the other thread may run ahead by the chunks already in flight, no further;
    # the budget holds one image (48 bytes), so the second stops the cache.
    source = MemorySource(2000, 4, first_delay=0.5)
    with pytest.raises(SharedError, match="the first 2 of 2000 images take 96 B, more than this process's budget "
                                          "of 48 B"):
        RamImages(source, budget=Budget(48, 60, "of memory available", 1))
    assert 2 <= source.loads <= 5 * 16  # the four chunks in flight and the one that replaced the first


def test_a_cache_without_a_budget_stores_the_same_pixels(tmp_path):
    folder = str(smooth_folder(tmp_path, SIZES))
    budgeted, unbounded = RamImages(ImageFolder(folder), budget=Budget(GiB, GiB, "of memory available", 1)), \
        RamImages(ImageFolder(folder), budget=None)
    assert torch.equal(budgeted.pixels, unbounded.pixels) and np.array_equal(budgeted.offsets, unbounded.offsets)
    assert budgeted.nbytes == 3 * sum(h * w for h, w in SIZES)
    for i, (h, w) in enumerate(budgeted.stored.tolist()):
        image = np.asarray(Image.open(ImageFolder(folder).samples[i][0]).convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(budgeted.gather(torch.tensor([i]))[0, :, :h, :w].numpy(), image)


def test_training_images_are_stored_within_the_bound_each_at_its_own_size(tmp_path):
    cfg = data_cfg(img_size=8, scale=[0.25, 1.0])
    side = store_side(crop_spec(cfg))
    assert side == 16  # the smallest crop, a quarter of the image, still reads 8 x 8 stored pixels
    cache = RamImages(ImageFolder(str(smooth_folder(tmp_path, SIZES))), None, crop_spec(cfg))
    originals = [(h, w) for h, w in cache.sizes.tolist()]
    assert sorted(originals) == sorted(SIZES)
    for (h, w), (sh, sw) in zip(originals, cache.stored.tolist()):
        if min(h, w) <= side:
            assert (sh, sw) == (h, w)  # never upscaled
        else:
            assert min(sh, sw) == side and abs(max(sh, sw) - max(h, w) * side / min(h, w)) < 1  # aspect kept
    assert cache.nbytes == 3 * sum(h * w for h, w in cache.stored.tolist())  # nothing padded in memory
    # A batch is padded to its own largest image only, with zeros (which resized crops never read)
    small, big = originals.index((9, 14)), originals.index((16, 30))
    images = cache.__getitems__([small, big])[0]
    assert images.shape == (2, 3, 16, 30)
    assert images[0, :, :9, :14].any() and not images[0, :, :9, 14:].any() and not images[0, :, 9:].any()

def test_stored_images_keep_the_per_image_paths_crop_boxes(tmp_path, monkeypatch):
    cfg = data_cfg(img_size=8, scale=[0.25, 1.0], hflip=0.5)
    folder = smooth_folder(tmp_path, SIZES)
    cache = RamImages(ImageFolder(str(folder)), None, crop_spec(cfg), seed=3)
    assert (cache.stored != cache.sizes).any(1).sum() == 3  # boxes drawn on the stored sizes would differ
    drawn = []

    def recording(*args):
        drawn.append(params := crop_params(*args))
        return params
    crop_params = data.transforms.crop_params
    monkeypatch.setattr(data.transforms, "crop_params", recording)  # as SeededCropFlip draws them
    ids = list(range(len(SIZES))) + [len(SIZES) + 1, 3 * len(SIZES) + 2]
    for epoch in (0, 1):
        samples = SeededSamples(ImageFolder(str(folder), train_transforms(cfg)), seed=3)
        samples.set_epoch(epoch)
        drawn.clear()
        for i in ids:
            samples[i]
        cache.set_epoch(epoch)
        assert torch.equal(cache.__getitems__(ids)[2], torch.from_numpy(np.concatenate(drawn)))

def test_a_crop_of_a_big_stored_image_is_close_to_the_per_image_crop_of_the_original(tmp_path):
    cfg = data_cfg(img_size=16, scale=[0.25, 1.0], hflip=0.5)
    folder = smooth_folder(tmp_path, [(120, 160), (20, 24), (150, 90)])
    cache = RamImages(ImageFolder(str(folder)), None, crop_spec(cfg), seed=3)
    assert sorted(cache.stored.tolist()) == [[20, 24], [32, 42], [53, 32]]  # the big ones ~3.75 times smaller
    ids = list(range(24))  # 8 copies of each, each cropped afresh
    for epoch in (0, 1):
        cache.set_epoch(epoch)
        cached, _ = batch_to(cache.__getitems__(ids), torch.device("cpu"), crop_spec(cfg))
        samples = SeededSamples(ImageFolder(str(folder), train_transforms(cfg)), seed=3)
        samples.set_epoch(epoch)
        reference = torch.stack([samples[i][0] for i in ids])
        # The same box, resampled by PIL from the original here and by two antialiased resizes (stored, then cropped)
        # there: under 1 grey level apart on these smooth images, where the box moved by 2 original pixels
        # already differs by 3.5; 2 leaves room for the two filters and no room for a misplaced box.
        diff = (cached.float() - reference.float()).abs().mean((1, 2, 3))
        assert diff.max() < 2, diff
    assert math.isclose(cache.scales[0, 0].item(), 32 / 120, rel_tol=1e-6)
