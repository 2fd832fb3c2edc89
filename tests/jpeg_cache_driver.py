"""Run by test_jpeg_cache.py under torchrun: every rank builds the data.cache=jpeg datasets of DATA with their files
in CACHE, recording each file write as rank:role in CACHE/writers.txt and the images it reads in CACHE/rank{RANK}.txt.

    torchrun --nproc_per_node=2 tests/jpeg_cache_driver.py DATA CACHE
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import data.jpeg_cache  # noqa: E402
from data.datasets import build_datasets  # noqa: E402
from data.transforms import val_transforms  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.distributed import cleanup_distributed, setup_distributed  # noqa: E402
from utils.general import RANK  # noqa: E402


def record_writes(out, write=data.jpeg_cache.write_cache):
    def write_and_record(source, path, *args):
        with open(out, "a") as f:
            f.write(f"rank{RANK}:{path.name.split('-')[1]}\n")
        return write(source, path, *args)
    data.jpeg_cache.write_cache = write_and_record


def main(root, cache):
    setup_distributed()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        record_writes(cache / "writers.txt")
        cfg = load_recipe("cls.yaml", ["data.cache=jpeg", f"data.cache_dir={cache}", "data.img_size=16"]).data
        train_set, val_set = data.jpeg_cache.jpeg_datasets(*build_datasets(root, None, None), cfg, 0,
                                                           val_transforms(cfg), torch.device("cpu"))
        train_set.set_epoch(1)
        images = [train_set.__getitems__(range(len(train_set)))[0], val_set.__getitems__(range(len(val_set)))[0]]
        (cache / f"rank{RANK}.txt").write_text(" ".join(str(int(t.long().sum())) for t in images))
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
