"""How long training waits for its data: the share of step time spent waiting for the next batch.

For the digits (8x8 PNG) and a generated ImageFolder of JPEGs between 64 and 160 px (written once by this script
into a temporary folder), one process trains the recipe's convnet through train.py's own data path (datasets,
seeded sampler, per-sample augmentation seeds, batch_to) with images decoded per sample by data.workers 0, 1, 2
and auto, and with data.cache=ram (decoded once, cropped per batch); threads and workers are split as train.py
splits them. Per epoch it sums the time from the end of one step to the moment the next batch is on the device
and cropped (wait) and the whole epoch (with no workers, loading happens in the wait); each setting runs --rounds
epochs after a warm-up epoch, medians reported, and the epoch time is given relative to per-sample decoding with
no workers. It also times decoding the JPEGs with PIL (as the loader does), TorchCodec (as the JPEG cache and shards
do) and torchvision.io, and, on 500x375 photos, those and PIL's reduced-scale decode.

Then the input paths alone (no model): the JPEGs' training images delivered as cropped 64 px batches per second by
train.py's loader (data.workers=auto) from per-image files (data.cache=none), the JPEG cache (data.cache=jpeg),
the same images as shards (python -m data.shards) read in place, and those shards served over HTTP by Python's
http.server in another process, kept in the node cache after the first epoch, and fetched anew every epoch
(data.shard_cache_gb smaller than the set). Each setting reads --rounds epochs after a warm-up epoch, the settings
alternating, medians printed as ratios to data.cache=jpeg; the HTTP line's warm-up epoch (the download) too.

    python benchmarks/data.py [--rounds 3] [--jpegs 2000] [--shard-size 256KB]
    python benchmarks/data.py --only-decode     # JPEG decoders alone, on 500x375 photos
"""

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.batches import batch_to, decode_jpegs  # noqa: E402
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
    """Microseconds per image to decode JPEGs: PIL (as the per-image loader does), TorchCodec one image a call and
    the whole list in one call (decode_jpegs, as the JPEG cache and shards do), and torchvision.io's decode_jpeg,
    which TorchCodec replaced (deprecated since torchvision 0.29; kept here as the baseline). Sides alternated,
    medians of 3."""
    from torchvision.io import ImageReadMode, decode_jpeg

    paths = sorted(folder.rglob("*.jpg"))[:limit]
    blobs = [torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8) for path in paths]
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exact = [decode_jpeg(blob, mode=ImageReadMode.RGB) for blob in blobs]
    assert all(torch.equal(a, b) for a, b in zip(exact, decode_jpegs(blobs, cpu))), "TorchCodec's pixels differ"
    sides = {"PIL": lambda: [decode(path) for path in paths],
             "TorchCodec": lambda: [decode_jpegs([blob], cpu) for blob in blobs],
             "TorchCodec, one call": lambda: decode_jpegs(blobs, cpu),
             "torchvision.io": lambda: [decode_jpeg(blob, mode=ImageReadMode.RGB) for blob in blobs]}
    return alternated(sides, len(paths))


def reduced_decode_rates(folder, limit=300):
    """Microseconds per image to decode JPEGs whole and at 1/2 and 1/4 of their size by libjpeg-turbo's DCT scaling
    (PIL's Image.draft, which TorchCodec's and torchvision's decoders do not offer), and how far the reduced decode,
    resized to 176 px, lies from the whole decode resized to 176 px (mean and largest difference, in grey levels)."""
    paths = sorted(folder.rglob("*.jpg"))[:limit]

    def decoded(path, scale):
        with Image.open(path) as image:
            if scale > 1:
                image.draft("RGB", (image.width // scale, image.height // scale))
            return image.convert("RGB")

    sides = {f"1/{scale}" if scale > 1 else "whole": (lambda s=scale: [decoded(p, s) for p in paths])
             for scale in (1, 2, 4)}
    rates = alternated(sides, len(paths))
    apart = {name: [] for name in sides}
    for path in paths[:50]:
        exact = np.asarray(decoded(path, 1).resize((176, 176), Image.BILINEAR, reducing_gap=None), dtype=np.int16)
        for name, scale in zip(sides, (1, 2, 4)):
            reduced = np.asarray(decoded(path, scale).resize((176, 176), Image.BILINEAR), dtype=np.int16)
            apart[name].append(np.abs(reduced - exact))
    return rates, {name: (float(np.mean(a)), int(np.max(a))) for name, a in apart.items()}


def alternated(sides, count):
    """Microseconds per item of each side's work on count items: sides alternated, medians of 3 rounds."""
    times = {name: [] for name in sides}
    for round_ in range(3):
        for name in list(sides)[:: 1 if round_ % 2 == 0 else -1]:
            start = time.perf_counter()
            sides[name]()
            times[name].append((time.perf_counter() - start) / count * 1e6)
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
    parser.add_argument("--only-decode", action="store_true", help="JPEG decoding alone, on 500x375 photos")
    args = parser.parse_args()
    if args.only_decode:
        return print_decode_rates()
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
    print_decode_rates()


def print_decode_rates(count=300):
    """decode_rates and reduced_decode_rates on count 500x375 photo-like JPEGs (benchmarks/gpu.py's)."""
    from gpu import write_photos

    with tempfile.TemporaryDirectory() as tmp:
        photos = write_photos(Path(tmp), count)
        rates = decode_rates(photos, count)
        print(f"decode of {count} 500x375 JPEGs, us per image, one process: " +
              ", ".join(f"{name} {us:.0f}" for name, us in rates.items()) + " (TorchCodec's pixels = torchvision's)")
        rates, apart = reduced_decode_rates(photos, count)
        print("  PIL with DCT scaling (Image.draft), us per image: " + ", ".join(
            f"{name} {us:.0f} (resized to 176 px: {apart[name][0]:.2f} grey levels from the whole decode's on "
            f"average, at most {apart[name][1]})" for name, us in rates.items()))


if __name__ == "__main__":
    main()
