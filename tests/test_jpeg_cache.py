"""data.cache=jpeg: one file per split, shared by the processes on a machine, checked on every open and rewritten when
unusable; the RAM cache's crops and flips from the same per-sample seeds, decoded in workers or on the device."""

import numpy as np
import pytest
import torch
from PIL import Image

import train
import val
from conftest import read_results, run_python, run_torchrun
from data.cache import batch_to
from data.datasets import build_datasets
from data.jpeg_cache import FOOTER, StaleCache, jpeg_datasets, open_cache
from data.transforms import crop_spec, val_transforms
from test_cache import SIZES, data_cfg, per_image_epoch
from utils.checkpoint import load_checkpoint
from utils.config import RecipeError, load_recipe
from utils.general import DatasetError

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
    return jpeg_datasets(*build_datasets(root, None, None), cfg, 3, val_transforms(cfg), device)


def cache_files(folder):
    return sorted(path.name for path in folder.iterdir() if ".jpegcache" in path.name)


# Up to JPEG's loss at quality 90 and resizes of one box by torchvision and PIL; at 0.25, the 40x40 image is stored
# at 32x32 and its crops resampled by roi_align.
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
        assert isinstance(bytes_batch[0], list) and bytes_batch[0][0].dtype == torch.uint8  # JPEG bytes only
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


def test_an_unwritable_cache_dir_is_named_with_the_way_out(root, tmp_path):
    (tmp_path / "file").write_text("")
    cfg = data_cfg(img_size=16, cache="jpeg", cache_dir=str(tmp_path / "file" / "cache"))
    with pytest.raises(DatasetError, match=rf"data.cache=jpeg: cannot write {tmp_path}/file/cache/\S+\.jpegcache "
                                           r"\(Not a directory\); set data.cache_dir to a writable directory"):
        jpeg_sets(root, cfg)


def test_recipe_check_names_what_the_jpeg_cache_cannot_do():
    with pytest.raises(RecipeError, match=r"data.random_erase must be off with data.cache=jpeg, which crops and flips "
                                          r"whole batches \(it runs per image: set data.cache=none\)"):
        load_recipe("cls.yaml", ["data.cache=jpeg", "data.random_erase=0.25"])
    with pytest.raises(RecipeError, match="data.jpeg_decode must be auto, cpu or device, got 'gpu'"):
        load_recipe("cls.yaml", ["data.cache=jpeg", "data.jpeg_decode=gpu"])


def test_two_processes_write_each_file_once_and_share_it(root, tmp_path):
    result = run_torchrun("tests/jpeg_cache_driver.py", root, tmp_path / "cache", nproc=2, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    writers = (tmp_path / "cache" / "writers.txt").read_text().split()
    assert writers == ["rank0:train", "rank0:val"]  # local rank 0 wrote, rank 1 waited and read the same files
    assert len(cache_files(tmp_path / "cache")) == 2
    assert (tmp_path / "cache" / "rank0.txt").read_text() == (tmp_path / "cache" / "rank1.txt").read_text() != ""


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
