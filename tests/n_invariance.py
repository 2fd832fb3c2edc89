"""Run by test_n_invariance.py, as one process (argv[3] 'one-core': pinned to one core, so one compute thread) or
under torchrun: train RECIPE for one epoch on each data path (the RAM cache, the JPEG cache and per image), each
into project/<path> (argv[1], data argv[2])."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.distributed import cleanup_distributed, setup_distributed  # noqa: E402
from utils.stopping import StopVote  # noqa: E402
from utils.torch_utils import select_device  # noqa: E402

# 37 images in global batches of 12: 4 steps, the last of one image, which rank 0 takes while the other ranks have
# run out (DDP's join). GroupNorm and no dropout: nothing in the model depends on how a batch is split. Random crops and flips
# from per-sample seeds on both paths.
RECIPE = ["train.epochs=1", "train.batch_size=12", "model.width=4", "model.depth=2", "model.norm=group",
          "model.dropout=0", "data.img_size=8", "data.scale=[0.3,1.0]", "data.hflip=0.5", "data.workers=0",
          "train.log_every_steps=1"]


def main(project, data, one_core=False):
    if one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    setup_distributed()
    try:
        for cache in ("ram", "jpeg", "none"):
            cfg = load_recipe("cls.yaml", [*RECIPE, f"data.name={data}", f"data.cache={cache}", f"project={project}",
                                           f"name={cache}"])
            with StopVote() as vote:
                vote.device = select_device("cpu")
                train.train(cfg, vote, None)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["one-core"])
