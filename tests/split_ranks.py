"""Run train.py under torchrun with rank 1 unable to see one file of the data (as a rank on a machine whose copy of
the data lags, or one that lists the folder after a file was added), every rank writing the files its train and val
sets hold to OUT/rank{RANK}.json; for test_layouts.py's data.val_split test.

    torchrun --nproc_per_node=2 tests/split_ranks.py OUT train.py ARGS...
"""

import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import data.datasets  # noqa: E402
from utils.general import RANK  # noqa: E402

HIDDEN = ("hot dog", "005.png")  # (class folder, file) rank 1 does not see


def hide_from_listings(walk=os.walk):
    """Make os.walk (torchvision's ImageFolder lists with it) leave out the HIDDEN file."""
    def walk_without(top, *args, **kwargs):
        for folder, dirs, files in walk(top, *args, **kwargs):
            yield folder, dirs, [f for f in files if (Path(folder).name, f) != HIDDEN]
    os.walk = walk_without


def record_datasets(out, build=data.datasets.training_datasets):
    """Wrap training_datasets so that each rank writes the files of the sets it returns (relative to their root)."""
    def build_and_record(cfg, *args):
        sets = build(cfg, *args)
        lists = {which: [Path(path).relative_to(dataset.root).as_posix() for path, _ in dataset.samples]
                 for which, dataset in zip(("train", "val"), sets)}
        (out / f"rank{RANK}.json").write_text(json.dumps(lists, ensure_ascii=False), encoding="utf-8")
        return sets
    data.datasets.training_datasets = build_and_record


if __name__ == "__main__":
    if RANK == 1:
        hide_from_listings()
    record_datasets(Path(sys.argv[1]))
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")
