"""Run by benchmarks/scale.py, as one process or under torchrun: train.py's main() with its start-up stages timed and
stopped after its first steps, or the digits trained for one epoch on each data path.

    torchrun ... benchmarks/scale_driver.py first-steps STEPS READS train.py-ARGS...
    torchrun ... benchmarks/scale_driver.py digits PROJECT CACHE_DIR BATCH [one-core]
    python benchmarks/scale_driver.py listing-memory ROOT WORKERS

first-steps: every rank records when it entered and left each function of STAGES that exists (wrapped wherever the
project's modules refer to it, so a renamed or moved one is simply absent), and when each optimizer step ended (a
global optimizer hook: no name in train.py is relied on). After STEPS steps the ranks meet, each reads READS batches
of its training loader with no model (its read throughput), reports its memory, prints one line `SCALE {json}` and
leaves. Times are seconds since the epoch, the launch's own (SCALE_LAUNCHED_AT) included, so scale.py can subtract.

digits: as tests/n_invariance.py, on the embedded digits with a global batch of BATCH, into PROJECT/<data.cache>.

listing-memory: ROOT's training set listed as train.py lists it, held as data.cache=jpeg holds it (JpegImages over
a cache file of as many index rows and no images), read by a DataLoader of WORKERS forked workers that each take one
batch, its share of a shuffled epoch: each worker reads every one of its samples' (path, target) and index row, as
the workers read a batch's, and collects garbage, as a worker's full collection does, then reports its own memory;
the main process reports its own once the workers are gone (while they live, the pages they share with it are not
its own). One line `SCALE {json}`.
"""

import functools
import importlib
import json
import os
import socket
import sys
import time
import zlib
from pathlib import Path

STARTED = time.time()  # before torch is imported: the interpreter's own start is in the launch's time
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_post_hook  # noqa: E402

import train  # noqa: E402
from utils.general import LOCAL_RANK, RANK, WORLD_SIZE  # noqa: E402

IMPORTED = time.time()
STAGES = {"data.datasets": ("training_data", "training_datasets", "train_val_datasets", "jpeg_datasets",
                            "cached_datasets"),
          "data.jpeg_cache": ("cache", "write_shared", "fingerprint", "open_cache")}
# 37 images in the test; the digits' 1,437 here. GroupNorm and no dropout: nothing depends on how a batch is split.
DIGITS = ["train.epochs=1", "model.width=4", "model.depth=2", "model.norm=group", "model.dropout=0",
          "data.img_size=8", "data.scale=[0.3,1.0]", "data.hflip=0.5", "data.workers=0", "train.log_every_steps=1",
          "train.precision=fp32", "train.channels_last=false"]


class Done(BaseException):
    """Raised after the last measured step: not an Exception, so train.py's handlers let it through."""


record = {"stages": {}, "steps": [], "writes": [], "data": {}}
seen = {"loader": None, "spec": None}


def wrap_everywhere(module_name, name, make_wrapper):
    """Replace function `name` of module_name by make_wrapper(it) in every project module that refers to it."""
    original = getattr(importlib.import_module(module_name), name, None)
    if original is None:
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    for module in list(sys.modules.values()):
        if str(getattr(module, "__file__", "")).startswith(str(ROOT)) and getattr(module, name, None) is original:
            setattr(module, name, wrapper)


def timed(name, original):
    """original, recording [start, end] of each call under name; a cache write also notes what it wrote."""
    def call(*args, **kwargs):
        start = time.time()
        result = original(*args, **kwargs)
        record["stages"].setdefault(name, []).append([start, time.time()])
        if name == "write_shared":
            record["writes"].append(written(args, start))
        if name == "training_data":
            seen["loader"] = next((x for x in result if isinstance(x, torch.utils.data.DataLoader)), None)
            seen["spec"] = crop_spec_of(args)
        if name == "training_data":
            record["built_anon"] = memory()["anon"]  # the data's bookkeeping, before any batch is decoded
        if name == "training_datasets":
            record["data"] = {f"{which}_{key}": value for which, dataset in zip(("train", "val"), result)
                              for key, value in (("images", len(dataset)), ("nbytes", getattr(dataset, "nbytes", 0)))}
        return result
    return call


def written(args, start):
    """What a call of write_cache(source, path, form, ...) wrote: its role (train or val), images and time."""
    form = next((a for a in args if isinstance(a, dict) and "raw" in a), {})
    path = next((Path(a) for a in args if isinstance(a, (str, Path))), Path(""))
    role = "val" if form.get("raw") else "train"
    return {"role": role, "images": len(args[0]) if args else 0, "start": start, "end": time.time(),
            "bytes": path.stat().st_size if path.is_file() else 0}


def crop_spec_of(args):
    """The training crop of training_data(cfg, ...)'s recipe, for batch_to."""
    from data.transforms import crop_spec

    return crop_spec(args[0].data)


def memory():
    """Bytes of this process's peak and current resident memory (anonymous and file-backed), and its DataLoader
    workers' largest peak."""
    def status(pid):
        try:
            lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            return {}
        return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in lines)
                if k in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")}
    def children_of(task):
        try:
            return [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:  # a thread that ended since the folder was listed
            return []
    tasks = Path("/proc/self/task")
    children = [pid for task in tasks.iterdir() for pid in children_of(task)] if tasks.is_dir() else []
    own, workers = status("self"), [status(pid) for pid in children]
    return {"peak": own.get("VmHWM", 0), "anon": own.get("RssAnon", 0), "file": own.get("RssFile", 0),
            "workers": len(children), "workers_peak": max((w.get("VmHWM", 0) for w in workers), default=0),
            "workers_anon": max((w.get("RssAnon", 0) for w in workers), default=0)}


def read_rate(loader, device, spec, batches):
    """(images, start, end) of reading `batches` batches of loader onto device after one untimed batch, the ranks
    starting together; the memory figures taken while its workers live."""
    from data.batches import batch_to

    feed = iter(loader)
    batch_to(next(feed), device, spec)  # starts the workers
    barrier()
    start, images = time.time(), 0
    for _ in range(batches):
        images += len(batch_to(next(feed), device, spec)[1])
    end = time.time()
    return {"images": images, "start": start, "end": end}, memory()


def barrier():
    if dist.is_initialized():
        dist.barrier()


def after_steps(steps, reads):
    """An optimizer hook: note when each step ended; after `steps`, measure, report and stop."""
    def hook(optimizer, args, kwargs):
        record["steps"].append(time.time())
        if len(record["steps"]) < steps:
            return
        barrier()  # every rank is done with the last step's collectives
        device = optimizer.param_groups[0]["params"][0].device
        loader = seen["loader"]
        reads_left = min(reads, len(loader) - 1) if loader is not None else 0
        if reads_left > 0:
            record["read"], record["memory"] = read_rate(loader, device, seen["spec"], reads_left)
        else:
            record["read"], record["memory"] = None, memory()
        record["threads"], record["workers"] = torch.get_num_threads(), getattr(loader, "num_workers", None)
        report()
        barrier()
        raise Done
    return hook


def report():
    """One line, written at once (a pipe keeps writes under 4 KiB whole among the ranks' output)."""
    record.update(rank=RANK, local_rank=LOCAL_RANK, world=WORLD_SIZE, host=socket.gethostname(),
                  node=int(os.getenv("GROUP_RANK", 0)), launched=float(os.getenv("SCALE_LAUNCHED_AT", STARTED)),
                  started=STARTED, imported=IMPORTED)
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"SCALE {json.dumps(record, separators=(',', ':'))}\n".encode())


def first_steps(steps, reads, argv):
    """train.py's main(argv), timed, until `steps` optimizer steps and `reads` batches read have been measured."""
    for module, names in STAGES.items():
        for name in names:
            wrap_everywhere(module, name, functools.partial(timed, name))
    register_optimizer_step_post_hook(after_steps(steps, reads))
    try:
        train.main(argv)
    except Done:
        return
    raise SystemExit(f"scale_driver.py: train.py ended before {steps} steps")


def own_memory(pid="self"):
    """{"uss", "pss", "anon"}: bytes of a process's unique memory (private pages, clean and dirty: what it alone
    holds, a file's pages that no other process maps included), its proportional share, and its anonymous memory
    (its own, not a file's pages: what it cannot share with another process), from /proc/PID/smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        fields[key] = int(value.split()[0]) * 1024
    return {"uss": fields["Private_Clean"] + fields["Private_Dirty"], "pss": fields["Pss"], "anon": fields["Anonymous"]}


class TouchSamples(torch.utils.data.Dataset):
    """A dataset's listing read as the per-image path's workers read it: item k is worker k's share of a shuffled
    epoch (order[k::workers], an array forked with the dataset, so no list of ids is made), each sample's (path,
    target) read and dropped; it returns the worker's memory once it has read them and collected garbage."""

    def __init__(self, dataset, order, workers):
        self.dataset, self.order, self.workers = dataset, order, workers

    def __getitem__(self, k):
        import gc

        samples, index = self.dataset.samples, self.dataset.index
        for i in self.order[k :: self.workers]:
            samples[int(i)], index[int(i)]  # read, as a worker reads a batch's
        gc.collect()
        return own_memory()

    def __len__(self):
        return self.workers


def listing_memory(root, workers):
    """Report the memory of a process holding root's training listing as data.cache=jpeg does, and of its workers
    after each read its share of an epoch."""
    import gc

    import numpy as np

    from data.sources import train_val_datasets
    from data.jpeg_cache import FOOTER, INDEX_DTYPE, MAGIC, JpegImages, open_cache
    from utils.memory import release_freed_memory

    start = own_memory()
    source, _ = train_val_datasets(str(root), None, None)
    count = len(source)
    path = Path(root) / "index-only.jpegcache"  # no images: an index of empty rows, read as a cache file is
    tail = np.zeros(count, INDEX_DTYPE).tobytes() + json.dumps({"raw": False, "channels": 3, "count": count}).encode()
    path.write_bytes(tail + FOOTER.pack(MAGIC, 0, len(tail) - count * INDEX_DTYPE.itemsize, zlib.crc32(tail)))
    dataset = JpegImages(source, path, *open_cache(path, count))
    del source, tail
    gc.collect()
    release_freed_memory()  # as training_data does once the datasets are built
    built = own_memory()
    order = np.random.default_rng(0).permutation(count)
    loader = torch.utils.data.DataLoader(TouchSamples(dataset, order, workers), batch_size=None,
                                         num_workers=workers)
    seen = list(loader)  # item k from worker k; the workers end with the iterator
    del loader
    gc.collect()
    record.update(images=count, start=start, built=built, workers=seen, end=own_memory())
    report()


def digits(project, cache_dir, batch, one_core=False):
    """One epoch of the digits on each data path into project/<path>, as tests/n_invariance.py trains."""
    from utils.config import load_recipe
    from utils.distributed import cleanup_distributed, setup_distributed
    from utils.stopping import StopVote
    from utils.torch_utils import select_device

    if one_core:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    setup_distributed()
    try:
        for cache in ("ram", "jpeg", "none"):
            cfg = load_recipe("cls.yaml", [*DIGITS, f"train.batch_size={batch}", f"data.cache={cache}",
                                           f"data.cache_dir={cache_dir}", f"project={project}", f"name={cache}"])
            with StopVote() as vote:
                vote.device = select_device("cpu")
                train.train(cfg, vote, None)
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "first-steps":
        first_steps(int(rest[0]), int(rest[1]), rest[2:])
    elif mode == "listing-memory":
        listing_memory(rest[0], int(rest[1]))
    else:
        digits(rest[0], rest[1], int(rest[2]), rest[3:] == ["one-core"])
