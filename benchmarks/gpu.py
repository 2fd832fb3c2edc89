"""Feeding the GPU: ResNet-50 training speed on real JPEGs through each input path, against the GPU's own limit.

Over generated ImageNet-like photos (--images of them, 500x375 JPEGs at quality 90 in 10 classes, written once into a
temporary folder), recipes/imagenet-resnet50.yaml trains ResNet-50 at 176 px in bf16 with channels_last, batch
--batch, with crops and flips only (its per-image augmentations off, so every path does the same work), through
train.py's own data path (datasets, sampler, workers as data.workers=auto splits them, batch_to). Images per second
of whole training steps for

  (a) synthetic: one batch already on the GPU, the compute limit;
  (b) per image: PIL decodes and crops each JPEG in the DataLoader workers (data.cache=none);
  (c) JPEG cache decoded in the workers by TorchCodec's decode_jpeg (data.cache=jpeg data.jpeg_decode=cpu);
  (d) JPEG cache decoded on the GPU by nvJPEG, a batch per call (data.cache=jpeg data.jpeg_decode=device);
  (e) the same photos as WebDataset shards (python -m data.shards), decoded in the workers;
  (f) those shards decoded on the GPU by nvJPEG;

each with torch.compile off and on, printed as a ratio to (a) with the same compile setting, with the peak GPU memory
of each. As train.py does (data.batches.device_batches), each batch is moved, decoded and cropped on a side stream
while the step before it runs; (d) is also timed without that, each batch prepared between steps.

--crops times the resized crops alone on 256 of the photos, decoded: torchvision's resized_crop one image at a time
against resized_crops' batched products (data/transforms.py), on the GPU and on one CPU core, and prints how far
their pixels are apart.

Without CUDA a CPU is the model's bottleneck, so the script times the input paths alone: cropped uint8 batches
delivered on the device per second for (b) to (f) (decoding in the main process), alternating the paths for
--rounds rounds, medians printed as ratios to (b).

    python benchmarks/gpu.py [--images 4000] [--batch 256] [--steps 30] [--compile both] [--rounds 3] [--crops] [--stages]
                             [--paths device ...]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.batches import batch_to, decode_jpegs, device_batches  # noqa: E402
from data.shards import main as write_shards  # noqa: E402
from data.datasets import build_dataloader, input_feed, set_epoch, training_datasets  # noqa: E402
from data.sampler import sample_seed  # noqa: E402
from data.transforms import crop_params, crop_spec, normalizer, resized_crop, resized_crops, stacked  # noqa: E402
from models import build_model  # noqa: E402
from utils.config import load_recipe  # noqa: E402
from utils.general import cpu_count  # noqa: E402
from utils.precision import autocast  # noqa: E402
from utils.torch_utils import compiled, memory_format, set_threads  # noqa: E402

PATHS = {"(b) per image, PIL in workers": ["data.cache=none"],
         "(c) JPEG cache, decoded in workers": ["data.cache=jpeg", "data.jpeg_decode=cpu"],
         "(d) JPEG cache, decoded on the device": ["data.cache=jpeg", "data.jpeg_decode=device"]}
SHARDS = {"(e) shards, decoded in workers": ["data.jpeg_decode=cpu"],
          "(f) shards, decoded on the device": ["data.jpeg_decode=device"]}
ONLY_CROPS = ["data.auto_augment=''", "data.random_erase=0", "data.mixup_alpha=0", "data.cutmix_alpha=0",
              "data.repeats=1"]


def write_photos(root, count, seed=0):
    """An ImageFolder of count smooth random 500x375 (or 375x500) JPEGs at quality 90 in 10 classes, train/ and val/."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        folder = root / ("val" if i % 20 == 19 else "train") / str(i % 10)
        folder.mkdir(parents=True, exist_ok=True)
        w, h = (500, 375) if i % 4 else (375, 500)
        small = rng.integers(0, 256, (h // 12 + 1, w // 12 + 1, 3), dtype=np.uint8)  # upscaled: compresses like photos
        Image.fromarray(small).resize((w, h), Image.BICUBIC).save(folder / f"{i:05d}.jpg", quality=90)
    return root


def recipe(root, batch, overrides, compile_model=False):
    return load_recipe("imagenet-resnet50.yaml", [f"data.name={root}", f"train.batch_size={batch}", *ONLY_CROPS,
                                                  "train.precision=bf16", f"train.compile={compile_model}",
                                                  "data.cache_dir=" + str(root / "cache"), *overrides])


def loader_of(cfg, device):
    """train.py's training loader for cfg on device (threads and workers split as train.py splits them)."""
    _, workers, _ = set_threads(cfg.data.workers, input_feed(cfg.data, device), device.type)
    train_set, _ = training_datasets(cfg.data, cfg.seed, device=device)
    return build_dataloader(train_set, cfg.train.batch_size, True, cfg.seed, workers, device), workers


def epochs(loader):
    """The loader's batches, epoch after epoch, without end."""
    epoch = 0
    while True:
        set_epoch(loader, epoch)
        yield from loader
        epoch += 1


def batches(loader, device, spec, ahead=True):
    """Endless (images, targets) on device from loader: each prepared while the step before runs, as train.py
    does (device_batches), or with ahead=False between steps."""
    if ahead:
        return device_batches(epochs(loader), device, spec)
    return (batch_to(batch, device, spec) for batch in epochs(loader))


def rate(feed, steps, warmup, work, device):
    """Images per second of `work` over `steps` batches of feed, after `warmup` batches."""
    for _ in range(warmup):
        work(*next(feed))
    synchronize(device)
    start, seen = time.perf_counter(), 0
    for _ in range(steps):
        images, targets = next(feed)
        work(images, targets)
        seen += len(targets)
    synchronize(device)
    return seen / (time.perf_counter() - start)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trainer(cfg, device):
    """A training step of cfg's model (bf16 autocast, channels_last, SGD) on a uint8 batch."""
    model = build_model(cfg.model, 10, cfg.data.img_size).to(device, memory_format=torch.channels_last)
    model = compiled(model, cfg.train.compile)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    normalize, criterion = normalizer(cfg.data, device), torch.nn.CrossEntropyLoss()

    def step(images, targets):
        images = normalize(images).contiguous(memory_format=memory_format(True))
        with autocast(device, torch.bfloat16):
            loss = criterion(model(images), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return step


def on_gpu(root, args, device):
    print(f"{torch.cuda.get_device_name(device)}, {cpu_count()} CPU cores; ResNet-50 at 176 px, bf16, channels_last, "
          f"batch {args.batch}; {args.steps} timed steps after {args.warmup}; images/s; peak GPU memory")
    print(f"{'path':52s} {'compile':>7s} {'img/s':>8s} {'of (a)':>7s} {'memory':>8s}")
    paths = {**PATHS, "(d) prepared between steps": PATHS["(d) JPEG cache, decoded on the device"]}
    paths = {name: overrides for name, overrides in paths.items() if any(word in name for word in args.paths)}
    for compile_model in {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]:
        cfg = recipe(root, args.batch, PATHS["(b) per image, PIL in workers"], compile_model)
        step = trainer(cfg, device)
        images = torch.randint(0, 256, (args.batch, 3, 176, 176), dtype=torch.uint8, device=device)
        targets = torch.randint(0, 10, (args.batch,), device=device)
        torch.cuda.reset_peak_memory_stats(device)
        limit = rate(iter(lambda: (images, targets), None), args.steps, args.warmup, step, device)
        print(f"{'(a) synthetic, on the GPU':52s} {str(compile_model):>7s} {limit:8.0f} {1:7.2f} {peak(device):>8s}",
              flush=True)
        for name, overrides in paths.items():
            cfg = recipe(root, args.batch, overrides, compile_model)
            loader, workers = loader_of(cfg, device)
            warmup = max(args.warmup, len(loader) + 1)  # an epoch's partial last batch compiles a graph of its own
            feed = batches(loader, device, crop_spec(cfg.data), ahead="between" not in name)
            torch.cuda.reset_peak_memory_stats(device)
            speed = rate(feed, args.steps, warmup, step, device)
            print(f"{name + f' ({workers} workers)':52s} {str(compile_model):>7s} {speed:8.0f} {speed / limit:7.2f} "
                  f"{peak(device):>8s}", flush=True)
            del feed, loader


def peak(device):
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GB"


def crops(root, args, device):
    """The resized crops alone: per image (torchvision) against batched (resized_crops), on device and one CPU core."""
    files = sorted((root / "train").rglob("*.jpg"))[: args.batch]
    images = [decode(f) for f in files]
    sizes = np.array([image.shape[1:] for image in images])
    spec = crop_spec(recipe(root, args.batch, []).data)
    params = torch.from_numpy(crop_params(sample_seed(0, 0, np.arange(len(images), dtype=np.uint64)), sizes[:, 0],
                                          sizes[:, 1], spec))
    boxes, flips = params[:, :4].double(), params[:, 4]
    print(f"resized crops of {len(images)} decoded photos (500x375 and 375x500) to {spec.size} px, boxes of "
          f"RandomResizedCrop over {spec.scale}; ms a batch, medians of {args.rounds} rounds, alternating")
    torch.set_num_threads(1)
    for where in ([torch.device("cpu")] + ([device] if device.type == "cuda" else [])):
        on = [image.to(where) for image in images]
        ways = {"per image (torchvision resized_crop)":
                lambda: torch.stack([resized_crop(i, b, bool(f), spec.size) for i, b, f in zip(on, boxes, flips)]),
                "batched (resized_crops, padded batch made)":
                lambda: resized_crops(stacked(on), boxes, flips, spec.size)}
        times = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, way in ways.items():
                way()
                synchronize(where)
                start = time.perf_counter()
                out = way()
                synchronize(where)
                times[name].append((time.perf_counter() - start) * 1e3)
        outs = [way().cpu().int() for way in ways.values()]
        apart = (outs[0] - outs[1]).abs()
        base = statistics.median(times[next(iter(ways))])
        for name, values in times.items():
            print(f"  {where.type:4s} {name:44s} {statistics.median(values):8.1f} ms  {base / statistics.median(values):6.1f}x")
        print(f"  {where.type:4s} pixels apart: at most {int(apart.max())} grey level(s), {float((apart > 0).float().mean()):.2%} "
              f"of them differ", flush=True)
        del out


def stages(root, args, device):
    """What a batch of the JPEG cache decoded on the device costs, stage by stage, each alone and synchronised: the
    loader's hand-over, the copy and nvJPEG decode, the crop's padded batch, its weights and products, the step."""
    from data.transforms import resize_weights
    cfg = recipe(root, args.batch, PATHS["(d) JPEG cache, decoded on the device"])
    loader, workers = loader_of(cfg, device)
    feed, spec, step = epochs(loader), crop_spec(cfg.data), trainer(cfg, device)
    times = {}

    def timed(name, work):
        synchronize(device)
        start = time.perf_counter()
        out = work()
        synchronize(device)
        times.setdefault(name, []).append((time.perf_counter() - start) * 1e3)
        return out
    for i in range(args.warmup + args.steps):
        batch = timed("loader hand-over (next batch, %d workers)" % workers, lambda: next(feed))
        (flat, lengths), targets, params, scales = batch
        blobs = list(flat.split(lengths.tolist()))
        images = timed("decode_jpegs (nvJPEG), the whole batch", lambda: decode_jpegs(blobs, device))
        padded = timed("crop: the padded batch (stacked)", lambda: stacked(images))
        boxes = params[:, :4].double().to(device) * scales.double().repeat(1, 2).to(device)
        timed("crop: weights (resize_weights x 2)", lambda: (resize_weights(boxes[:, 0], boxes[:, 2], spec.size,
                                                                            padded.shape[2]),
                                                             resize_weights(boxes[:, 1], boxes[:, 3], spec.size,
                                                                            padded.shape[3])))
        crops = timed("crop: all of resized_crops", lambda: resized_crops(padded, boxes, params[:, 4], spec.size))
        timed("training step", lambda: step(crops, targets.to(device)))
        if i < args.warmup:
            times.clear()
    print(f"the JPEG cache decoded on the device, stage by stage, each alone; ms a batch of {args.batch}, medians of "
          f"{args.steps}")
    for name, values in times.items():
        print(f"  {name:48s} {statistics.median(values):7.1f} ms")


def decode(path):
    return decode_jpegs([torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)],
                        torch.device("cpu"))[0]


def on_cpu(root, args, device):
    print(f"no CUDA: the input paths alone on {cpu_count()} CPU core(s), cropped 176 px uint8 batches of {args.batch} "
          f"per second; {args.rounds} rounds of {args.steps} batches after {args.warmup}, alternating, medians")
    feeds = {}
    for name, overrides in PATHS.items():
        cfg = recipe(root, args.batch, overrides)
        loader, workers = loader_of(cfg, device)
        feeds[f"{name} ({workers} workers)"] = batches(loader, device, crop_spec(cfg.data))
    rates = {name: [] for name in feeds}
    for _ in range(args.rounds):
        for name, feed in feeds.items():
            rates[name].append(rate(feed, args.steps, args.warmup, lambda images, targets: None, device))
    base = statistics.median(next(iter(rates.values())))
    print(f"{'path':48s} {'img/s':>8s} {'of (b)':>7s}")
    for name, values in rates.items():
        print(f"{name:48s} {statistics.median(values):8.0f} {statistics.median(values) / base:7.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=4000, help="generated 500x375 JPEGs")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30, help="timed batches per path")
    parser.add_argument("--warmup", type=int, default=5, help="untimed batches first (compilation, workers)")
    parser.add_argument("--compile", choices=("both", "off", "on"), default="both", help="GPU: torch.compile")
    parser.add_argument("--rounds", type=int, default=3, help="CPU: rounds over the paths")
    parser.add_argument("--crops", action="store_true", help="time the resized crops alone, then stop")
    parser.add_argument("--stages", action="store_true", help="GPU: time the device path's stages alone, then stop")
    parser.add_argument("--paths", nargs="+", default=["("], help="GPU: only the paths whose names hold a word given")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        root = write_photos(Path(tmp) / "photos", args.images)
        if args.crops:
            return crops(root, args, device)
        if args.stages:
            return stages(root, args, device)
        write_shards([str(root), str(Path(tmp) / "shards"), "--shard-size", "50MB"])
        PATHS.update({name: [f"data.name={Path(tmp) / 'shards'}", *overrides] for name, overrides in SHARDS.items()})
        print(f"wrote {args.images} JPEGs and their shards in {time.perf_counter() - start:.0f}s", flush=True)
        (on_gpu if device.type == "cuda" else on_cpu)(root, args, device)


if __name__ == "__main__":
    main()
