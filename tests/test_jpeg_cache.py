"""data.cache=jpeg: one file per split, shared by the processes on a machine, checked on every open and rewritten when
unusable; the RAM cache's crops and flips from the same per-sample seeds, decoded in workers or on the device."""

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import zlib
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from PIL import Image

import train
import val
from conftest import ROOT, clean_env, read_results, run_python, run_torchrun
from data.batches import batch_to
from data.sources import build_datasets
from data.jpeg_cache import (FOOTER, INDEX_DTYPE, MAGIC, JpegImages, StaleCache, jpeg_datasets, open_cache, post,
                              posted, read_at)
from data.transforms import crop_spec, val_transforms
from test_cache import SIZES, data_cfg, per_image_epoch
from test_rank_errors import RECIPE, two_nodes
from utils.checkpoint import load_checkpoint
from utils.config import RecipeError, load_recipe
from utils.distributed import topology
from utils.general import DatasetError, ImageError

CPU = torch.device("cpu")


def smooth_folder(root, sizes):
    """train/ and val/ of smooth images of the given (height, width) sizes in two classes: ramps across and down and
    a slow wave, which JPEG keeps within a grey level or two, while another crop box or flip changes them widely."""
    for i, (h, w) in enumerate(sizes):
        y, x = np.mgrid[0:h, 0:w]
        pixels = np.stack([255 * x / (w - 1), 255 * y / (h - 1), 127 + 100 * np.sin((x + 2 * y) / 6)], -1)
        for split in ("train", "val"):
            folder = root / split / "ab"[i % 2]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels.round().astype(np.uint8)).save(folder / f"{i:03d}.png")
    return root


@pytest.fixture
def root(tmp_path):
    return smooth_folder(tmp_path / "data", SIZES)


def jpeg_sets(root, cfg, device=CPU):
    return jpeg_datasets(*build_datasets(root, None, None), cfg, 3, val_transforms(cfg), device, topology())


def cache_files(folder):
    return sorted(path.name for path in folder.iterdir() if ".jpegcache" in path.name)


# Up to JPEG's loss at quality 90 and resizes of one box by torchvision and PIL; at 0.25, the 40x40 image is stored
# at 32x32 and its crops resampled from the stored image, the box in fractional pixels.
@pytest.mark.parametrize("keys, most", [(dict(img_size=16, scale=[0.08, 1.0], hflip=0.5), 1.5),  # all stored whole
                                        (dict(img_size=16, scale=[0.25, 1.0], hflip=0.5), 3),
                                        (dict(img_size=16, crop_padding=2, hflip=0.5), 2.5)])  # stored at 16 px
def test_jpeg_cache_crops_what_the_per_image_path_crops_and_decodes_alike_in_workers_and_on_the_device(
        root, tmp_path, keys, most):
    cfg = data_cfg(**keys, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    spec, ids = crop_spec(cfg), list(range(len(SIZES))) + [len(SIZES) + 2, 2 * len(SIZES) + 5]
    in_workers, _ = jpeg_sets(root, cfg)
    on_device, _ = jpeg_sets(root, data_cfg(**keys, cache="jpeg", cache_dir=str(tmp_path / "cache"),
                                            jpeg_decode="device"))
    crops = {}
    for epoch in (0, 1):
        for dataset in (in_workers, on_device):
            dataset.set_epoch(epoch)
        bytes_batch = on_device.__getitems__(ids)
        flat, lengths = bytes_batch[0]  # JPEG bytes only, packed into one tensor
        assert flat.dtype == torch.uint8 and lengths.tolist() == [len(in_workers.blob(i % len(SIZES))) for i in ids]
        crops[epoch] = per_image_epoch(cfg, root / "train", ids, epoch).float()  # PIL, from the original files
        decoded = batch_to(in_workers.__getitems__(ids), CPU, spec)[0]
        assert torch.equal(batch_to(bytes_batch, CPU, spec)[0], decoded)  # one decoder, either place
        assert decoded.shape == crops[epoch].shape == (len(ids), 3, 16, 16)
        differs = (decoded.float() - crops[epoch]).abs().mean((1, 2, 3))
        assert differs.max() < most, differs
    # Another crop box or flip differs by far more than the JPEG's loss.
    other = (crops[0] - crops[1]).abs().mean((1, 2, 3))
    assert (other > 3 * differs).all(), (other, differs)


def test_jpeg_cache_validation_pixels_are_the_per_image_ones(root, tmp_path):
    cfg = data_cfg(img_size=12, crop_pct=0.8, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    _, val_set = jpeg_sets(root, cfg)
    _, per_image = build_datasets(root, None, val_transforms(cfg))
    images, targets = val_set.__getitems__(range(len(val_set)))
    assert torch.equal(images, torch.stack([per_image[i][0] for i in range(len(per_image))]))
    assert targets.tolist() == per_image.targets


def test_a_cache_file_is_reused_and_a_truncated_corrupt_or_stale_one_rewritten(root, tmp_path, log):
    cfg = data_cfg(img_size=16, scale=[0.25, 1.0], cache="jpeg", cache_dir=str(tmp_path / "cache"))
    train_set, _ = jpeg_sets(root, cfg)
    train_set.set_epoch(1)
    batch = batch_to(train_set.__getitems__(range(8)), CPU, crop_spec(cfg))[0]
    files = cache_files(tmp_path / "cache")
    assert len(files) == 2 and log.text.count("data: wrote") == 2
    inode = train_set.path.stat().st_ino
    log.clear()
    assert jpeg_sets(root, cfg)[0].path.stat().st_ino == inode and "wrote" not in log.text  # reused as it is

    def rewritten(damage, reason):
        damage(train_set.path)
        log.clear()
        again, _ = jpeg_sets(root, cfg)
        assert f"rewriting {again.path}: {reason}" in log.text and log.text.count("data: wrote") == 1
        again.set_epoch(1)
        assert torch.equal(batch_to(again.__getitems__(range(8)), CPU, crop_spec(cfg))[0], batch)
        assert cache_files(tmp_path / "cache") == files  # no temporary file left behind

    def truncate(path):
        path.write_bytes(path.read_bytes()[:-100])

    def flip_an_index_byte(path):
        data = bytearray(path.read_bytes())
        data[-FOOTER.size - 60] ^= 0xFF
        path.write_bytes(bytes(data))
    rewritten(truncate, "no footer at its end: truncated, or not a cache file")
    rewritten(flip_an_index_byte, "its index does not match its checksum")
    rewritten(lambda path: path.write_bytes(b""), "0 bytes, shorter than its footer: truncated")
    # An image changed in place: another file, of the new pixels.
    Image.new("RGB", (24, 24), (255, 0, 0)).save(root / "train" / "a" / "000.png")
    changed, _ = jpeg_sets(root, cfg)
    assert changed.path != train_set.path and len(cache_files(tmp_path / "cache")) == 3
    assert (changed.__getitems__([0])[0][0, :, :4, :4].float() - torch.tensor([255.0, 0, 0])[:, None, None]).abs() \
        .max() < 8


def test_a_cache_file_of_another_image_count_is_not_read(root, tmp_path):
    cfg = data_cfg(img_size=16, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    train_set, _ = jpeg_sets(root, cfg)
    with pytest.raises(StaleCache, match="8 images, not the dataset's 9"):
        open_cache(train_set.path, 9)


def flip_image_bytes(path, first, count=64):
    """XOR count bytes of path's image area from byte first, in place (the same inode)."""
    with open(path, "r+b") as f:
        f.seek(first)
        data = bytearray(f.read(count))
        f.seek(first)
        f.write(bytes(b ^ 0x5A for b in data))


@pytest.mark.parametrize("role", ["train", "val"])
def test_a_damaged_image_stops_the_run_naming_it_and_its_file_is_removed_and_rewritten(root, tmp_path, log, role):
    cfg = data_cfg(img_size=16, scale=[0.25, 1.0], cache="jpeg", cache_dir=str(tmp_path / "cache"))
    dataset = jpeg_sets(root, cfg)[role == "val"]
    before = dataset.__getitems__(range(len(dataset)))[0]
    flip_image_bytes(dataset.path, int(dataset.index["offset"][5]) + 4)
    damaged = jpeg_sets(root, cfg)[role == "val"]  # index and header intact: opened as it is
    assert damaged.path == dataset.path and "rewriting" not in log.text
    assert torch.equal(damaged.__getitems__(range(5))[0], before[:5])  # the images before it read as before
    with pytest.raises(ImageError) as error:
        damaged.__getitems__([4, 5])
    assert str(error.value) == (f"data.cache=jpeg: {dataset.path}: image 5 (from {damaged.samples[5][0]}) does not "
                                f"match its CRC-32: the file is damaged; removed it, so the next start rewrites it")
    assert not dataset.path.exists()
    again = jpeg_sets(root, cfg)[role == "val"]
    assert again.path == dataset.path and torch.equal(again.__getitems__(range(len(again)))[0], before)


def test_a_damaged_file_already_replaced_by_another_process_is_not_removed(root, tmp_path):
    cfg = data_cfg(img_size=16, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    train_set = jpeg_sets(root, cfg)[0]
    good = train_set.path.read_bytes()
    flip_image_bytes(train_set.path, int(train_set.index["offset"][2]))  # the file this dataset mapped
    replacement = train_set.path.with_name("replacement")
    replacement.write_bytes(good)
    os.replace(replacement, train_set.path)  # another process rewrote it meanwhile
    with pytest.raises(ImageError, match=r"image 2 .* does not match its CRC-32"):
        train_set.__getitems__([2])
    assert train_set.path.read_bytes() == good


def rewrite_index(path, change):
    """Apply change to path's index rows (a writable INDEX_DTYPE array) and write them back with a valid CRC."""
    data = bytearray(path.read_bytes())
    magic, index_at, header_length, _ = FOOTER.unpack(data[-FOOTER.size :])
    end = len(data) - FOOTER.size - header_length
    index = np.frombuffer(bytes(data[index_at:end]), dtype=INDEX_DTYPE).copy()
    change(index)
    data[index_at:end] = index.tobytes()
    tail = bytes(data[index_at : len(data) - FOOTER.size])
    data[-FOOTER.size :] = FOOTER.pack(magic, index_at, header_length, zlib.crc32(tail))
    path.write_bytes(bytes(data))


def test_an_index_whose_offsets_wrap_or_whose_raw_rows_have_the_wrong_size_is_not_read(root, tmp_path):
    cfg = data_cfg(img_size=16, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    train_set, val_set = jpeg_sets(root, cfg)

    def wrap(index):
        index["offset"][3], index["nbytes"][3] = 2**64 - 10, 20  # offset + nbytes wraps to 10 in uint64
    rewrite_index(train_set.path, wrap)
    with pytest.raises(StaleCache, match="its index points past its images: image 3"):
        open_cache(train_set.path, len(train_set))
    c, h, w = val_set.channels, int(val_set.index["height"][1]), int(val_set.index["width"][1])

    def short_row(index):
        index["nbytes"][1] -= 1
    rewrite_index(val_set.path, short_row)
    with pytest.raises(StaleCache, match=rf"image 1 holds {c * h * w - 1} bytes, not its {c}x{h}x{w} pixels' "
                                         rf"{c * h * w}"):
        open_cache(val_set.path, len(val_set))


def test_a_file_replaced_by_path_after_it_was_checked_is_not_read(root, tmp_path):
    cfg = data_cfg(img_size=16, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    train_set, val_set = jpeg_sets(root, cfg)
    before = pickle.loads(pickle.dumps(val_set)).__getitems__(range(len(val_set)))[0]  # the same file: re-opened
    os.replace(train_set.path, val_set.path)  # another file now at val's path, before val_set first reads
    assert torch.equal(val_set.__getitems__(range(len(val_set)))[0], before)  # the checked file, kept open
    # A DataLoader of the spawn start method pickles the dataset: re-opened by path, the replacement is refused.
    with pytest.raises(ImageError, match=rf"data.cache=jpeg: {val_set.path} was replaced since it was checked "
                                         rf"\(device, inode or size differ\); restart to check it again"):
        pickle.loads(pickle.dumps(val_set))


def test_index_rows_past_the_job_stores_value_limit_are_posted_whole():
    # Each writing process posts its index rows (56 bytes an image) for local rank 0 to gather: at ImageNet's size on
    # 8 processes, 9 MB each, past the 8 MiB a TCPStore takes in one value (it dropped the connection mid-write).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    rows = np.random.default_rng(0).bytes(10 << 20)
    post(store, "rows/0", rows)
    assert posted(store, "rows/0") == rows and int(store.get("rows/0")) == 3
    post(store, "rows/1", b"")
    assert posted(store, "rows/1") == b""


@pytest.mark.parametrize("under", ["file/cache", "file"])  # the OSError said 'Not a directory' and 'File exists'
def test_an_unwritable_cache_dir_is_named_with_the_way_out(root, tmp_path, under):
    (tmp_path / "file").write_text("")
    cfg = data_cfg(img_size=16, cache="jpeg", cache_dir=str(tmp_path / under))
    with pytest.raises(DatasetError, match=rf"data.cache=jpeg: cannot write {tmp_path}/{under}/\S+\.jpegcache "
                                           rf"\({tmp_path}/file is a file, not a folder\); set data.cache_dir to a "
                                           r"writable directory"):
        jpeg_sets(root, cfg)


def test_recipe_check_names_what_the_jpeg_cache_cannot_do():
    with pytest.raises(RecipeError, match=r"data.random_erase must be off with data.cache=jpeg, which crops and flips "
                                          r"whole batches \(it runs per image: set data.cache=none\)"):
        load_recipe("cls.yaml", ["data.cache=jpeg", "data.random_erase=0.25"])
    with pytest.raises(RecipeError, match="data.jpeg_decode must be auto, cpu or device, got 'gpu'"):
        load_recipe("cls.yaml", ["data.cache=jpeg", "data.jpeg_decode=gpu"])


def stored_images(path, count):
    """Each image's stored bytes in the cache file at path, and its index rows without their offsets."""
    header, index, (file, _) = open_cache(path, count)
    blobs = [read_at(file, o, n).tobytes() for o, n in zip(index["offset"].tolist(), index["nbytes"].tolist())]
    return blobs, index[[name for name in index.dtype.names if name != "offset"]].tolist()


def run_driver(root, cache, *fault, timeout=300):
    result = run_torchrun("tests/jpeg_cache_driver.py", root, cache, *fault, nproc=2, timeout=timeout)
    writers = [list(map(int, line.split())) for line in (cache / "writers.txt").read_text().splitlines()] \
        if result.returncode == 0 else None
    return result, writers


@pytest.mark.slow
def test_two_processes_write_each_file_together_and_it_holds_what_one_process_writes(root, tmp_path):
    result, writers = run_driver(root, tmp_path / "cache", "slow:all:0.2")  # both ranks in time to claim images
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(writers) == 2 and all(len(w) == 2 and min(w) > 0 and sum(w) == len(SIZES) for w in writers), writers
    assert len(cache_files(tmp_path / "cache")) == 2  # no temporary file left
    assert (tmp_path / "cache" / "rank0.txt").read_text() == (tmp_path / "cache" / "rank1.txt").read_text() != ""
    cfg = load_recipe("cls.yaml", ["data.cache=jpeg", f"data.cache_dir={tmp_path / 'one'}", "data.img_size=16"]).data
    jpeg_sets(root, cfg)
    assert cache_files(tmp_path / "one") == cache_files(tmp_path / "cache")
    for name in cache_files(tmp_path / "one"):
        assert stored_images(tmp_path / "one" / name, len(SIZES)) == stored_images(tmp_path / "cache" / name,
                                                                                   len(SIZES))


@pytest.mark.slow
def test_a_waiting_rank_outlasts_the_stall_limit_while_the_writer_progresses(root, tmp_path, monkeypatch):
    monkeypatch.setenv("CLS_STALL_SECONDS", "0.8")
    result, writers = run_driver(root, tmp_path / "cache", "slow:0:0.5,lead:0")  # rank 0 makes progress every 0.5 s
    assert result.returncode == 0, result.stderr[-3000:]
    assert writers[0][0] * 0.5 > 0.8  # rank 1, done with its share at once, waited on rank 0 longer than the limit


@pytest.mark.slow
def test_a_waiting_rank_stops_with_one_line_when_the_writer_makes_no_progress(root, tmp_path, monkeypatch):
    monkeypatch.setenv("CLS_STALL_SECONDS", "1")
    result, _ = run_driver(root, tmp_path / "cache", "hang:0", timeout=120)  # a stall never noticed times out
    assert result.returncode != 0
    assert re.search(r"Stalled: rank 1 on \S+: stopped waiting for local rank 0 to write \S+train\S+\.jpegcache: "
                     r"rank 0 on \S+ \(pid \d+\) made no progress for 1 s \(at \d+\)\n", result.stderr), \
        result.stderr[-3000:]


@pytest.mark.slow
def test_a_writer_that_fails_stops_the_others_at_once_and_leaves_no_temporary_file(root, tmp_path, monkeypatch):
    monkeypatch.setenv("CLS_STALL_SECONDS", "600")  # rank 0 stops on rank 1's failure, not on a stall
    result, _ = run_driver(root, tmp_path / "cache", "slow:0:0.2,fail:1", timeout=120)
    assert result.returncode != 0
    assert "ImageError: image of rank 1: unreadable image (test)" in result.stderr, result.stderr[-3000:]
    assert re.search(r"WorkFailed: rank 0 on \S+: (writing|waiting for the local ranks writing) \S+train\S+\.jpegcache "
                     r"stopped: it failed \(image of rank 1: unreadable image \(test\)\)", result.stderr), \
        result.stderr[-3000:]
    assert cache_files(tmp_path / "cache") == []  # neither a cache file nor a temporary one


def start_writing(root, cache):
    """A process writing root's JPEG cache into cache one image per 2 s (jpeg_cache_driver.py, one process), once
    its temporary file is there; and that file."""
    writer = subprocess.Popen([sys.executable, "tests/jpeg_cache_driver.py", root, cache, "slow:all:2"], cwd=ROOT,
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    for _ in range(1200):  # the temporary file is made once the images are listed, in a second or two
        if (tmp := [p for p in cache.glob(".*.jpegcache.tmp-*") if not p.name.endswith(".lock")]) or \
                writer.poll() is not None:
            break
        time.sleep(0.1)
    assert len(tmp) == 1 and writer.poll() is None, writer.communicate()
    return writer, tmp[0]


@pytest.mark.slow
def test_a_killed_writers_temporary_file_is_removed_by_the_next_writer_and_the_cache_is_whole(root, tmp_path):
    cache = tmp_path / "cache"
    writer, leftover = start_writing(root, cache)
    writer.send_signal(signal.SIGKILL)
    writer.communicate()
    assert leftover.exists()  # as a killed writer leaves it
    result = run_python("tests/jpeg_cache_driver.py", root, cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(rf"data: removed \S*{re.escape(leftover.name)}, left by a writer that is gone",
                     result.stdout + result.stderr), result.stdout
    assert len(cache_files(cache)) == 2  # the two files, no temporary one
    cfg = load_recipe("cls.yaml", ["data.cache=jpeg", f"data.cache_dir={tmp_path / 'one'}", "data.img_size=16"]).data
    jpeg_sets(root, cfg)
    for name in cache_files(cache):
        assert stored_images(tmp_path / "one" / name, len(SIZES)) == stored_images(cache / name, len(SIZES))


@pytest.mark.slow
def test_sigterm_while_the_cache_is_written_stops_at_once_leaving_no_file(root, tmp_path):
    cache = tmp_path / "cache"
    writer, _ = start_writing(root, cache)  # its SIGTERM deferred, as train.py's StopVote defers it
    writer.send_signal(signal.SIGTERM)
    _, stderr = writer.communicate(timeout=120)
    assert writer.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "SIGTERM: stopped while writing the train JPEG cache; nothing was saved" in stderr
    assert cache_files(cache) == []  # neither the file, which the write would have completed, nor its temporary


@pytest.mark.slow
def test_machines_sharing_a_cache_dir_leave_its_files_to_one_writer_and_both_train_on_them(image_folder, tmp_path):
    data = image_folder({"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}})
    cache = tmp_path / "shared-disk"
    # One process a node, node 1's named node-b as on another machine; its rank 1 SIGKILLs itself if it encodes an
    # image: both train only if node 0 alone writes each file.
    (code0, out0), (code1, out1) = two_nodes(
        tmp_path, [*RECIPE, f"data.name={data}", "data.cache=jpeg", f"data.cache_dir={cache}"], [],
        "as-host:node-b,kill-in-jpeg-cache:1", nproc=1, timeout=120)
    assert code0 == 0 and code1 == 0, out0[-3000:] + out1[-3000:]
    assert re.findall(r"wrote \S+\.jpegcache: (\d+) images, .*, encoded by 1 processes", out0) == ["12", "4"], out0
    files = sorted(path.name for path in cache.iterdir())  # no marker or temporary file left
    assert len(files) == 2 and all(name.endswith(".jpegcache") for name in files), files
    for name in files:
        count = 12 if "-train-" in name else 4
        assert open_cache(cache / name, count)[0]["writers"] == [count]  # whole: its footer and index check out


@pytest.mark.slow
def test_a_jpeg_cache_run_stopped_mid_epoch_resumes_bit_identical_and_val_py_agrees(image_folder, tmp_path):
    data = image_folder({"train": {"a": 9, "b": 8}, "val": {"a": 3, "b": 4}}, size=20)
    recipe = ["--recipe", "cls.yaml", f"data.name={data}", "data.cache=jpeg", "data.img_size=12",
              "data.scale=[0.5,1.0]", "data.hflip=0.5", "train.epochs=2", "train.batch_size=6", "model.width=4",
              "model.dropout=0.2", "data.workers=1", f"project={tmp_path}"]
    train.main([*recipe, "name=whole"])
    result = run_python("tests/faults.py", "signal-at-step:1:SIGINT", "train.py", *recipe, "name=resumed")
    assert result.returncode == 130 and "Stopped at epoch 1, step 2/3" in result.stdout, result.stderr[-3000:]
    train.main(["--resume", str(tmp_path / "resumed")])
    whole, resumed = (load_checkpoint(tmp_path / name / "weights" / "last.pt")["model"] for name in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert len(cache_files(data)) == 2  # beside the images, written by the first run, read by the others
    # val.py decodes per image: the same pixels as the cache's validation file, so the same top-1.
    metrics = val.main(["--weights", str(tmp_path / "whole" / "weights" / "last.pt"), f"--project={tmp_path}"])
    assert metrics["val/top1"] == pytest.approx(float(read_results(tmp_path / "whole")[1][-1]["val/top1"]), abs=1e-6)


def rss_file():
    """Bytes of files mapped into this process's resident memory (RssFile of /proc/self/status)."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssFile:"))


def rss_anon():
    """Bytes of this process's own resident memory, no file's pages (RssAnon of /proc/self/status)."""
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("RssAnon:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status")
def test_a_cache_files_index_stays_in_the_page_cache_not_in_each_process(tmp_path):
    # A file of 1,000,000 index rows (44 MB, no images): checked, then read from the file's pages, which every
    # process on the machine shares. Held as arrays, as before, each process (and a spawned worker) had its copy.
    count = 1_000_000
    rows = np.zeros(count, INDEX_DTYPE)
    rows["target"] = np.arange(count) % 7
    header = json.dumps({"raw": False, "channels": 3, "count": count}).encode()
    tail = rows.tobytes() + header
    path = tmp_path / "index.jpegcache"
    path.write_bytes(tail + FOOTER.pack(MAGIC, 0, len(header), zlib.crc32(tail)))
    del rows, tail
    before = rss_anon()
    header, index, opened = open_cache(path, count)
    spawned = pickle.loads(pickle.dumps(JpegImages(Source(), path, header, index, opened)))
    assert int(index["target"].sum()) == int(spawned.index["target"].sum()) == sum(i % 7 for i in range(count))
    assert rss_anon() - before < 0.1 * count * INDEX_DTYPE.itemsize, (rss_anon() - before)
    assert spawned.targets[:9].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1]


class Source:
    """What JpegImages reads of a dataset of no files."""
    classes, root = ["a"], "none"


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status")
def test_reading_every_image_leaves_the_cache_file_out_of_the_process_memory(tmp_path):
    # 60 validation images of 3 x 128 x 128 stored raw: a 2.8 MiB file. Mapped, reading each image once counted the
    # whole file in the process's resident memory, so an epoch of ImageNet took its 140 GB into every process's.
    root = smooth_folder(tmp_path / "data", [(128, 128)] * 60)
    cfg = data_cfg(img_size=128, crop_pct=1.0, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    _, val_set = jpeg_sets(root, cfg)
    assert val_set.nbytes > 60 * 3 * 128 * 128
    val_set.__getitems__([0])  # the code paths of a read, loaded once
    before = rss_file()
    images = torch.cat([val_set.__getitems__(list(range(i, i + 10)))[0] for i in range(0, 60, 10)])
    assert images.shape == (60, 3, 128, 128)
    assert rss_file() - before < 0.25 * val_set.nbytes, (rss_file() - before, val_set.nbytes)
