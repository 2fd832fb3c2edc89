"""How long training waits for its data: the share of step time spent waiting for the next batch.

For the digits (8x8 PNG) and a generated ImageFolder of JPEGs between 64 and 160 px (written once by this script
into a temporary folder), one process trains the recipe's convnet through train.py's own data path (datasets,
seeded sampler, per-sample augmentation seeds, batch_to) with images decoded per sample by data.workers 0, 1, 2
and auto, and with data.cache=ram (decoded once, cropped per batch); threads and workers are split as train.py
splits them. Per epoch it sums the time from the end of one step to the moment the next batch is on the device
and cropped (wait) and the whole epoch (with no workers, loading happens in the wait); each setting runs --rounds
epochs after a warm-up epoch, medians reported, and the epoch time is given relative to per-sample decoding with
no workers. It also times decoding the JPEGs with PIL (as the loader does) against torchvision.io.decode_image.

Then the input paths alone (no model): the JPEGs' training images delivered as cropped 64 px batches per second by
train.py's loader (data.workers=auto) from per-image files (data.cache=none), the JPEG cache (data.cache=jpeg),
the same images as shards (python -m data.shards) read in place, and those shards served over HTTP by Python's
http.server in another process, kept in the node cache after the first epoch, and fetched anew every epoch
(data.shard_cache_gb smaller than the set). Each setting reads --rounds epochs after a warm-up epoch, the settings
alternating, medians printed as ratios to data.cache=jpeg; the HTTP line's warm-up epoch (the download) too.

    python benchmarks/data.py [--rounds 3] [--jpegs 2000] [--shard-size 256KB]
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.cache import batch_to  # noqa: E402
from data.shards import main as write_shards  # noqa: E402
from data.datasets import build_dataloader, input_feed, set_epoch, training_datasets  # noqa: E402
from data.transforms import crop_spec, normalizer  # noqa: E402
from data.verify import decode  # noqa: E402
from models import build_model  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.optim import build_optimizer  # noqa: E402
from utils.torch_utils import set_threads  # noqa: E402


def write_jpegs(root, count, seed=0):
    """An ImageFolder of `count` smooth random JPEGs (10 classes, 64-160 px sides) under root/train and root/val."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        split = "val" if i % 10 == 9 else "train"
        folder = root / split / str(i // 10 % 10)
        folder.mkdir(parents=True, exist_ok=True)
        h, w = rng.integers(64, 161, size=2)
        small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)  # upscaled: compresses as photos do
        Image.fromarray(small).resize((int(w), int(h)), Image.BILINEAR).save(folder / f"{i:05d}.jpg", quality=90)
    return root


def epoch_times(cfg, rounds):
    """Per epoch (wait seconds, epoch seconds) of train.py's loader feeding SGD steps of the recipe's model."""
    device = torch.device("cpu")
    threads, workers, _ = set_threads(cfg.data.workers, input_feed(cfg.data, device), device.type)
    train_set, _ = training_datasets(cfg.data, cfg.seed)
    loader = build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, device)
    model = build_model(cfg.model, len(train_set.classes), cfg.data.img_size)
    optimizer, normalize = build_optimizer(model, cfg.optim), normalizer(cfg.data, device)
    criterion, crop = torch.nn.CrossEntropyLoss(), crop_spec(cfg.data)
    results = []
    for epoch in range(rounds + 1):  # epoch 0 warms up
        set_epoch(loader, epoch)
        wait, start = 0.0, time.perf_counter()
        ready = start
        for batch in loader:
            images, targets = batch_to(batch, device, crop)
            wait += time.perf_counter() - ready
            optimizer.zero_grad(set_to_none=True)
            criterion(model(normalize(images)), targets).backward()
            optimizer.step()
            ready = time.perf_counter()
        if epoch:
            results.append((wait, time.perf_counter() - start))
    return threads, workers, results


SETTINGS = [("none", "0"), ("none", "1"), ("none", "2"), ("none", "auto"), ("ram", "auto")]  # (data.cache, workers)


def cfg_with(overrides, cache, workers):
    """cls.yaml with overrides, data.cache and data.workers."""
    return load_recipe("cls.yaml", [*overrides, f"data.cache={cache}", f"data.workers={workers}"])


def decode_rates(folder, limit=500):
    """Microseconds per image to decode JPEGs with PIL and with torchvision.io (alternated, medians of 3)."""
    from torchvision.io import ImageReadMode, decode_image, read_file

    paths = sorted(folder.rglob("*.jpg"))[:limit]
    sides = {"PIL": lambda p: decode(p), "torchvision.io": lambda p: decode_image(read_file(str(p)),
                                                                                 mode=ImageReadMode.RGB)}
    times = {name: [] for name in sides}
    for round_ in range(3):
        for name in list(sides)[:: 1 if round_ % 2 == 0 else -1]:
            start = time.perf_counter()
            for path in paths:
                sides[name](path)
            times[name].append((time.perf_counter() - start) / len(paths) * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def input_paths(jpegs, shards, url, tmp):
    """The input paths' overrides of cls.yaml (see the module's docstring), each with a node cache of its own."""
    common = ["data.cache=none", "data.img_size=64", "data.scale=[0.25,1.0]", "data.hflip=0.5", "data.crop_pct=0.875",
              "data.workers=auto"]
    paths = {"per-image files (data.cache=none)": [f"data.name={jpegs}"],
             "JPEG cache (data.cache=jpeg)": [f"data.name={jpegs}", "data.cache=jpeg"],
             "shards, local": [f"data.name={shards}"],
             "shards over HTTP, node cache": [f"data.name={url}"],
             "shards over HTTP, fetched every epoch": [f"data.name={url}", "data.shard_window=4",
                                                       "data.shard_cache_gb=0.005"]}
    return {name: load_recipe("cls.yaml", [*common, *overrides, f"data.cache_dir={tmp / f'cache{i}'}"])
            for i, (name, overrides) in enumerate(paths.items())}


def loader_epochs(cfg):
    """Endless epoch seconds of train.py's training loader for cfg, cropped batches on the CPU."""
    device = torch.device("cpu")
    _, workers, _ = set_threads(cfg.data.workers, input_feed(cfg.data, device), device.type)
    train_set, _ = training_datasets(cfg.data, cfg.seed)
    loader = build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, device)
    spec, epoch = crop_spec(cfg.data), 0
    while True:
        set_epoch(loader, epoch)
        start = time.perf_counter()
        for batch in loader:
            batch_to(batch, device, spec)
        yield len(train_set), time.perf_counter() - start
        epoch += 1


def serve(root):
    """Python's http.server serving root in a process of its own: (process, base URL)."""
    server = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory",
                               str(root)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    port = server.stdout.readline().split(" port ")[1].split()[0]  # "Serving HTTP on 127.0.0.1 port N (...)"
    return server, f"http://127.0.0.1:{port}"


def input_rates(jpegs, tmp, args):
    """Images per second of each input path (medians of --rounds epochs, alternating), and the HTTP download's."""
    write_shards([str(jpegs), str(tmp / "served" / "shards"), "--shard-size", args.shard_size])
    server, url = serve(tmp / "served")
    try:
        feeds = {name: loader_epochs(cfg) for name, cfg in input_paths(jpegs, tmp / "served" / "shards",
                                                                        f"{url}/shards", tmp).items()}
        first = {name: next(feed) for name, feed in feeds.items()}  # warm-up: caches written, shards fetched
        rates = {name: [] for name in feeds}
        for _ in range(args.rounds):
            for name, feed in feeds.items():
                images, seconds = next(feed)
                rates[name].append(images / seconds)
    finally:
        server.kill()
    return {name: statistics.median(r) for name, r in rates.items()}, first


def print_input_rates(rates, first):
    base = rates["JPEG cache (data.cache=jpeg)"]
    print(f"{'input path, cropped 64 px batches':40s} {'img/s':>8s} {'of jpeg':>8s}")
    for name, rate in rates.items():
        print(f"{name:40s} {rate:8.0f} {rate / base:7.2f}x")
    images, seconds = first["shards over HTTP, node cache"]
    print(f"shards over HTTP, first epoch (download into the node cache): {images / seconds:.0f} img/s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs per setting, after a warm-up epoch")
    parser.add_argument("--jpegs", type=int, default=2000, help="images in the generated JPEG ImageFolder")
    parser.add_argument("--shard-size", default="256KB", help="python -m data.shards --shard-size (the set is "
                                                              "about 4 KB an image)")
    parser.add_argument("--only-inputs", action="store_true", help="the input paths alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jpegs = write_jpegs(Path(tmp) / "jpegs", args.jpegs)
        if args.only_inputs:
            return print_input_rates(*input_rates(jpegs, Path(tmp), args))
        datasets = {"digits 8px": [],  # overrides of cls.yaml
                    "JPEG 64-160px -> 64px": [f"data.name={jpegs}", "data.img_size=64", "data.scale=[0.25,1.0]",
                                              "data.hflip=0.5", "data.crop_pct=0.875"]}
        print(f"one process, {torch.get_num_threads()} core(s) to share; {args.rounds} timed epochs per setting, "
              f"medians")
        print(f"{'data':24s} {'cache':>5s} {'asked':>5s} {'workers':>7s} {'threads':>7s} {'wait share':>10s} "
              f"{'epoch time':>10s}")
        for name, overrides in datasets.items():
            first = None
            for cache, workers in SETTINGS:
                threads, used, results = epoch_times(cfg_with(overrides, cache, workers), args.rounds)
                share = statistics.median(w / e for w, e in results)
                epoch = statistics.median(e for _, e in results)
                first = first or epoch
                print(f"{name:24s} {cache:>5s} {workers:>5s} {used:7d} {threads:7d} {share:10.1%} "
                      f"{epoch / first:9.2f}x")
        rates = decode_rates(jpegs)
        print("decode, us per JPEG: " + ", ".join(f"{name} {us:.0f}" for name, us in rates.items()))
        print_input_rates(*input_rates(jpegs, Path(tmp), args))


if __name__ == "__main__":
    main()
