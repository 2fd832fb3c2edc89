"""Run by test_n_invariance.py, as one process ('one-core': pinned to one core, so one compute thread) or under
torchrun: train RECIPE for one epoch on each data path (the RAM cache, the JPEG cache, per image, and the same images
as a shard set served over HTTP: 'shards=URL'; and the RAM cache in bf16 autocast and channels_last: 'bf16'), each
into project/<path>. 'multilabel': DATA is a multi-label CSV
root, trained with MULTILABEL's options on the RAM cache and per image. 'accumulate=K': each process's batch in K
micro-batches (train.accumulate).

    python tests/n_invariance.py PROJECT DATA [one-core] [accumulate=K] [shards=URL] [multilabel]
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.general import after_imports, before_imports  # noqa: E402

if __name__ == "__main__":
    before_imports()  # as train.py run as a command

import train  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.distributed import cleanup_distributed, setup_distributed  # noqa: E402
from utils.precision import autocast_dtype  # noqa: E402
from utils.stopping import StopVote  # noqa: E402
from utils.torch_utils import select_device  # noqa: E402

# 37 images in global batches of 12: 4 steps, the last of one image, which rank 0 takes while the other ranks have
# run out (DDP's join). GroupNorm and no dropout: nothing in the model depends on how a batch is split. Random crops
# and flips from per-sample seeds on every path. fp32 and contiguous, as the recipe says, but for the 'bf16' path.
RECIPE = ["train.epochs=1", "train.batch_size=12", "model.width=4", "model.depth=2", "model.norm=group",
          "model.dropout=0", "data.img_size=8", "data.scale=[0.3,1.0]", "data.hflip=0.5", "data.workers=0",
          "train.log_every_steps=1", "train.precision=fp32", "train.channels_last=false", "log.plots=false"]
# Multi-label: BCE with positive weights and smoothing, MixUp of label vectors (pairs on one process)
MULTILABEL = ["data.multilabel=true", "train.class_weights=balanced", "train.label_smoothing=0.1",
              "data.mixup_alpha=0.4"]


def main(project, data, one_core=False, shards=None, multilabel=False, accumulate=1):
    if one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    setup_distributed()
    # Shards: windows of 2 of the set's shards, fetched into a cache of this launch's own.
    paths = {cache: [f"data.name={data}", f"data.cache={cache}", *(MULTILABEL if multilabel else [])]
             for cache in (("ram", "none") if multilabel else ("ram", "jpeg", "none"))}
    if not multilabel:  # bf16's rounding, compared with computations equivalent in bf16
        paths["bf16"] = [f"data.name={data}", "data.cache=ram", "train.precision=bf16", "train.channels_last=true"]
    if shards:
        paths["shards"] = [f"data.name={shards}", "data.cache=none", "data.shard_window=2",
                           f"data.cache_dir={project}/shard-cache"]
    try:
        for path, options in paths.items():
            cfg = load_recipe("cls.yaml", [*RECIPE, *options, f"train.accumulate={accumulate}", f"project={project}",
                                           f"name={path}"])
            with StopVote() as vote:
                vote.device = select_device("cpu")
                train.train(cfg, vote, autocast_dtype(cfg.train.precision, vote.device))
    finally:
        cleanup_distributed()


def option(options, key, default=None):
    """The value of the command-line option key=VALUE, else default."""
    return next((o.removeprefix(key + "=") for o in options if o.startswith(key + "=")), default)


if __name__ == "__main__":
    after_imports()
    options = sys.argv[3:]
    main(sys.argv[1], sys.argv[2], "one-core" in options, option(options, "shards"), "multilabel" in options,
         int(option(options, "accumulate", 1)))
