"""Run by test_jpeg_cache.py under torchrun: every rank builds the data.cache=jpeg datasets of DATA with their files
in CACHE, recording the images each local rank encoded per file (its header's writers) in CACHE/writers.txt and the
images it reads in CACHE/rank{RANK}.txt. FAULTS (comma-separated) make a rank's encoding slow, stop or fail, or
make the other ranks claim images only once RANK has claimed two chunks of each file (lead:RANK, so that its share
does not depend on which rank started first):

    torchrun --nproc_per_node=2 tests/jpeg_cache_driver.py DATA CACHE [slow:RANK:SECONDS,hang:RANK,fail:RANK,lead:RANK]
    (RANK may be all, but for lead)
"""

import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.general import after_imports, before_imports  # noqa: E402

if __name__ == "__main__":
    before_imports()  # as the project's scripts start

import torch  # noqa: E402

import data.jpeg_cache  # noqa: E402
from data.sources import build_datasets  # noqa: E402
from data.transforms import val_transforms  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.distributed import FAILURE_GRACE_S, cleanup_distributed, setup_distributed, topology  # noqa: E402
from utils.general import RANK, ImageError  # noqa: E402


def follow(leader):
    """Start claiming a file's images only once the leader has claimed two chunks (one image each at 8 images)."""
    encode_chunks = data.jpeg_cache.encode_chunks

    def after_the_leader(source, path, tmp, form, transform, store, job, work, topology):
        deadline = time.monotonic() + 60
        while store.add(f"{work}/chunks", 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return encode_chunks(source, path, tmp, form, transform, store, job, work, topology)
    if str(RANK) != leader:
        data.jpeg_cache.encode_chunks = after_the_leader


def inject(fault):
    """Make this rank's encoding (JPEG and raw), in one thread, sleep SECONDS per image (slow:RANK:SECONDS), forever
    (hang:RANK), or raise the ImageError of an unreadable image (fail:RANK)."""
    kind, rank, *seconds = fault.split(":")
    if kind == "lead":
        return follow(rank)
    if rank not in ("all", str(RANK)):
        return
    released = threading.Event()
    if kind == "hang":  # torchrun's SIGTERM releases the hung image, so the writer's own handler ends the rank at once,
        # not after torchrun's 30 s grace before SIGKILL (the writer's pool waits for the image it is on)
        set_handler = signal.signal
        signal.signal = lambda signum, handler: set_handler(signum, handler if signum != signal.SIGTERM or not callable(
            handler) else lambda *args: (released.set(), handler(*args)))

    def faulty(encode):
        def sleep_and_encode(image):
            if kind == "fail":
                raise ImageError(f"image of rank {RANK}: unreadable image (test)")
            if kind == "hang":
                released.wait()
            else:
                time.sleep(float(seconds[0]))
            return encode(image)
        return sleep_and_encode
    for name in ("jpeg_bytes", "raw_pixels"):
        setattr(data.jpeg_cache, name, faulty(getattr(data.jpeg_cache, name)))
    data.jpeg_cache.cpu_count = lambda: 1  # one encoding thread: a slowed rank's progress is one image at a time


def main(root, cache, fault=None):
    signal.signal(signal.SIGTERM, lambda *_: None)  # as train.py defers it: a rank torchrun stops cleans up first
    setup_distributed()
    try:
        cache.mkdir(parents=True, exist_ok=True)
        for one in fault.split(",") if fault else ():
            inject(one)
        cfg = load_recipe("cls.yaml", ["data.cache=jpeg", f"data.cache_dir={cache}", "data.img_size=16"]).data
        train_set, val_set = data.jpeg_cache.jpeg_datasets(*build_datasets(root, None, None), cfg, 0,
                                                           val_transforms(cfg), torch.device("cpu"), topology())
        if RANK == 0:
            with open(cache / "writers.txt", "w") as f:
                for dataset in (train_set, val_set):
                    f.write(" ".join(map(str, data.jpeg_cache.open_cache(dataset.path, len(dataset))[0]["writers"])))
                    f.write("\n")
        train_set.set_epoch(1)
        images = [train_set.__getitems__(range(len(train_set)))[0], val_set.__getitems__(range(len(val_set)))[0]]
        (cache / f"rank{RANK}.txt").write_text(" ".join(str(int(t.long().sum())) for t in images))
    except ImageError:  # as train.py's exit_on_error, the failed rank waits for the others' lines before it exits
        time.sleep(FAILURE_GRACE_S)
        raise
    finally:
        cleanup_distributed()


if __name__ == "__main__":
    after_imports()
    main(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:])
