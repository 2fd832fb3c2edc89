"""Shard sets (data/shards.py writes them, data/shard_sets.py reads them): what the writer stores, exact mid-epoch
resume over HTTP, a server that dies, a damaged shard, a changed set, and the keys a shard set refuses. The same steps
at N=1, 2 and 3 are tested with the other data paths, in test_n_invariance.py."""

import hashlib
import io
import json
import shutil
import tarfile
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import val
from conftest import closed_port, console_lines, fails, http_server, read_results, run_python, untimed
from data.sampler import shard_permutation
from data.shard_sets import ShardCache, TrainShards, open_shard_set
from data.transforms import CropSpec
from test_n_invariance import served_shards, write_images
from utils.checkpoint import load_checkpoint

RECIPE = ["--recipe", "cls.yaml", "train.epochs=2", "train.batch_size=8", "model.width=4", "model.depth=2",
          "model.dropout=0", "data.img_size=8", "data.scale=[0.3,1.0]", "data.cache=none", "data.workers=1",
          "data.shard_window=2", "train.save_every_steps=2", "log.plots=false"]


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    """write_images' 37 + 6 images as a shard set of about 2 images a shard, under served/shards."""
    base = tmp_path_factory.mktemp("shards")
    write_images(base / "data")
    return served_shards(base)


@pytest.fixture(scope="module")
def run_over_http(shard_set, tmp_path_factory):
    """The set trained over HTTP (RECIPE) into a node cache of its own, then val.py on the run while the server is
    up, each GET logged; the server gone once it returns {url, base, run (directory), train (its CompletedProcess),
    gets (val.py's [path, bytes sent]), metrics (val.py's metrics.json)}."""
    base = tmp_path_factory.mktemp("over-http")
    log = base / "gets.log"
    with http_server(shard_set, log=log) as (url, _):
        train = run_python("train.py", *RECIPE, f"data.name={url}/shards", f"project={base}", "name=reference",
                           f"data.cache_dir={base}/cache")
        assert train.returncode == 0, train.stderr[-3000:]
        log.unlink()
        val.main(["--weights", str(base / "reference" / "weights" / "best.pt"), f"--project={base}/val"])
        gets = [line.split() for line in log.read_text().splitlines()]
    metrics = json.loads((base / "val" / "exp" / "metrics.json").read_text())
    return {"url": url, "base": base, "run": base / "reference", "train": train, "gets": gets, "metrics": metrics}


def members(tar_path):
    """{member name: bytes} of a tar file, in order."""
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def jpeg_file(path, size=(20, 14), colour=(200, 30, 90)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).save(path, quality=80)
    return path.read_bytes()


def png_file(path, size=(9, 9), value=60):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((*size, 3), value, np.uint8)).save(path)
    return path.read_bytes()


@pytest.mark.slow
def test_the_writer_stores_jpegs_untouched_reencodes_the_rest_and_indexes_every_shard(tmp_path):
    data = tmp_path / "data"
    jpeg = jpeg_file(data / "train" / "cat" / "a.jpg")
    png_file(data / "train" / "dog" / "b.png")
    for i in range(4):
        png_file(data / "train" / "dog" / f"c{i}.png", value=10 * i)
    val_png = png_file(data / "val" / "cat" / "v.png")
    result = run_python("-m", "data.shards", data, tmp_path / "out", "--shard-size", "1KB")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "6 train images in" in result.stdout and "1 val images in 1 shard(s)" in result.stdout
    top = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert top["classes"] == ["cat", "dog"] and top["splits"] == {"train": "train/index.json", "val": "val/index.json"}
    index = json.loads((tmp_path / "out" / "train" / "index.json").read_text())
    assert index["__kind__"] == "wids-shard-index-v1"
    samples, labels = {}, []
    for shard in index["shardlist"]:
        path = tmp_path / "out" / "train" / shard["url"]
        assert shard["filesize"] == path.stat().st_size
        assert shard["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        content = members(path)
        images = [v for k, v in content.items() if k.endswith(".jpg")]
        assert shard["nsamples"] == len(images) == len(shard["labels"]) == len(shard["crcs"])
        assert shard["crcs"] == [zlib.crc32(v) for v in images]
        assert shard["sizes"] == [[Image.open(io.BytesIO(v)).height, Image.open(io.BytesIO(v)).width] for v in images]
        assert [int(v) for k, v in content.items() if k.endswith(".cls")] == shard["labels"]
        assert shard["nsamples"] == 1 or sum(map(len, images)) <= 1000  # --shard-size 1KB
        samples.update({k: v for k, v in content.items() if k.endswith(".jpg")})
        labels += shard["labels"]
    assert len(index["shardlist"]) > 1 and sorted(labels) == [0, 1, 1, 1, 1, 1]
    images = list(samples.values())
    assert images[labels.index(0)] == jpeg  # cat/a.jpg: its bytes as they are
    for image, label in zip(images, labels):  # the PNGs: re-encoded as JPEGs
        assert label == 0 or image[:2] == b"\xff\xd8" and Image.open(io.BytesIO(image)).size == (9, 9)
    val_shard = tmp_path / "out" / "val" / "val-000000.tar"
    assert members(val_shard) == {"000000000.png": val_png, "000000000.cls": b"0"}  # val: as it is


@pytest.mark.slow
def test_the_writer_splits_class_folders_and_reads_csv_lists(tmp_path):
    data = tmp_path / "folders"
    for c in "ab":
        for i in range(10):
            png_file(data / c / f"{i}.png", value=i)
    result = run_python("-m", "data.shards", data, tmp_path / "split", "--val-split", "0.2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "split" / "dataset.json").read_text())["images"] == {"train": 16, "val": 4}
    labels = [label for s in json.loads((tmp_path / "split" / "train" / "index.json").read_text())["shardlist"]
              for label in s["labels"]]
    assert sorted(labels) == [0] * 8 + [1] * 8 and labels != sorted(labels)  # a seeded order, not class by class
    assert run_python("-m", "data.shards", data, tmp_path / "again", "--val-split", "0.2").returncode == 0
    assert (tmp_path / "again" / "train" / "train-000000.tar").read_bytes() == (
        tmp_path / "split" / "train" / "train-000000.tar").read_bytes()  # the same images make the same shards
    csv_root = tmp_path / "csv"
    for i in range(3):
        png_file(csv_root / "img" / f"{i}.png", value=i)
    (csv_root / "train.csv").write_text("path,label\nimg/0.png,x\nimg/1.png,y\n")
    (csv_root / "val.csv").write_text("path,label\nimg/2.png,y\n")
    result = run_python("-m", "data.shards", csv_root, tmp_path / "from_csv")
    assert result.returncode == 0, result.stderr[-3000:]
    val_index = json.loads((tmp_path / "from_csv" / "val" / "index.json").read_text())
    assert val_index["shardlist"][0]["labels"] == [1]  # y, of the classes [x, y]


@pytest.mark.slow
def test_the_writer_leaves_nothing_behind_when_an_image_is_unreadable_and_never_overwrites(tmp_path):
    data = tmp_path / "data"
    png_file(data / "train" / "a" / "0.png")
    (data / "train" / "a" / "1.png").write_bytes(b"not an image")
    png_file(data / "val" / "a" / "0.png")
    result = run_python("-m", "data.shards", data, tmp_path / "out")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (f"python -m data.shards: error: {data}/train/a/1.png: unreadable "
                                                      f"image (not an image format PIL can identify); remove it (or "
                                                      f"replace it) and write the set again")
    assert list(tmp_path.iterdir()) == [data]  # no OUT, no temporary folder
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    result = run_python("-m", "data.shards", data, tmp_path / "out")
    assert result.returncode == 2 and "already exists" in result.stderr
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("layout, flags, line", [
    ({"a": 1, "b": 1}, [], "{src}: no train/ folder or train.csv; if its folders are the classes, set --val-split (e.g. "
                           "--val-split 0.2) to hold out that share of each class for val"),
    ({"train/a": 1, "val/a": 1}, ["--val-split", "0.2"], "--val-split 0.2: {src} has its own split (train/, val/); set "
                                                         "--val-split 0, or name a folder of class folders only"),
    ({"train/a": 1}, [], "{src}: no val/, valid/ or test/ folder; an ImageFolder root holds train/<class>/* and "
                         "val/<class>/* (or valid/, test/); or hold out part of train/: {src}/train --val-split 0.2"),
    ({}, [], "src '{src}/none' is neither a dataset here (digits, multidigits, cifar10, cifar100) nor a directory; give "
             "the path of a dataset root holding train/<class>/* and val/<class>/*, train.csv and val.csv, or class "
             "folders (nothing is downloaded)"),
])
def test_the_writers_errors_name_its_own_flags_and_exit_2(layout, flags, line, tmp_path, capfd):
    from data import shards
    src = tmp_path / "data"
    for folder, count in layout.items():
        for i in range(count):
            png_file(src / folder / f"{i}.png")
    with pytest.raises(SystemExit) as exit_:
        shards.main([str(src / "none" if not layout else src), str(tmp_path / "out"), *flags])
    assert exit_.value.code == 2
    assert capfd.readouterr().err == f"python -m data.shards: error: {line.format(src=src)}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_run_over_http_stopped_mid_epoch_resumes_bit_identically_and_val_py_reproduces_it(shard_set, tmp_path,
                                                                                             run_over_http):
    reference = run_over_http["train"]
    assert f"data: {run_over_http['url']}/shards: 19 train shards and 1 val shards, fetched into" in reference.stdout
    with http_server(shard_set) as (url, _):
        name = f"data.name={url}/shards"
        # Stopped by SIGTERM, as a scheduler's preemption: the ranks stop and save at step 2 of epoch 1's 5; a fresh
        # cache, so the resumed part fetches what the stopped one had not.
        result = run_python("tests/faults.py", "signal-at-step:3:SIGTERM", "train.py", *RECIPE, name,
                            f"project={tmp_path}", "name=stopped", f"data.cache_dir={tmp_path}/cache-stopped")
        assert result.returncode == 143, result.stderr[-3000:]
        run_dir = tmp_path / "stopped"
        assert load_checkpoint(run_dir / "weights" / "last.pt")["step"] == 2
        result = run_python("train.py", "--resume", run_dir)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "resuming at epoch 1, step 2" in result.stdout
        ours, theirs = (load_checkpoint(d / "weights" / "last.pt")["model"] for d in (run_dir, run_over_http["run"]))
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
        val.main(["--weights", str(run_dir / "weights" / "best.pt"), f"--project={tmp_path}/val"])
    best = max(float(row["val/top1"]) for row in read_results(run_dir)[1])
    metrics = json.loads((tmp_path / "val" / "exp" / "metrics.json").read_text())
    assert metrics["images"] == 6 and abs(metrics["top1"] - best) < 1e-9


@pytest.mark.slow
def test_val_py_on_a_run_trained_over_http_fetches_the_top_file_and_its_split_s_index_not_the_cached_shards(
        run_over_http):
    assert [path for path, _ in run_over_http["gets"]] == ["/shards/dataset.json", "/shards/val/index.json"]
    assert run_over_http["metrics"]["images"] == 6


@pytest.mark.slow
def test_val_py_with_the_server_down_evaluates_the_run_from_the_copies_and_shards_in_its_node_cache(run_over_http):
    url, base = run_over_http["url"], run_over_http["base"]
    result = run_python("val.py", "--weights", run_over_http["run"] / "weights" / "best.pt", f"--project={base}/down")
    assert result.returncode == 0, result.stderr[-3000:]
    cache = base / "cache" / digest(f"{url}/shards/dataset.json")
    lines = []
    for fetched in (f"{url}/shards/dataset.json", f"{url}/shards/val/index.json"):
        copy = cache / f"copy-{digest(fetched)}.json"
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(copy.stat().st_mtime))
        lines.append(f"data: {fetched}: Connection refused; reading its copy fetched {when}, {copy}")
    assert console_lines(result.stdout, "data: ") == lines
    metrics = json.loads((base / "down" / "exp" / "metrics.json").read_text())
    assert {k: metrics[k] for k in ("images", "top1", "loss")} == \
        {k: run_over_http["metrics"][k] for k in ("images", "top1", "loss")}


def digest(url):
    return hashlib.sha256(url.encode()).hexdigest()[:16]


@pytest.mark.slow
def test_val_py_names_its_data_option_when_the_set_cannot_be_fetched(run_over_http, monkeypatch):
    monkeypatch.setenv("CLS_FETCH_BACKOFF", "0.01")
    top = f"http://127.0.0.1:{closed_port()}/shards/dataset.json"
    result = run_python("val.py", "--weights", run_over_http["run"] / "weights" / "best.pt", "--data", top,
                        f"--project={run_over_http['base']}/val")
    assert result.returncode == 2, result.stderr[-3000:]
    assert console_lines(result.stdout, "data: ") == [
        f"data: {top}: Connection refused; try {n + 1} of 6 in {0.01 * 2 ** (n - 1):.3g} s" for n in range(1, 6)]
    assert untimed(result.stderr.strip()) == (f"val.py: error: --data: {top} cannot be fetched after 6 tries in T "
                                              f"s (Connection refused); check the server and --data")


@pytest.mark.slow
def test_a_server_that_dies_mid_run_stops_it_with_one_line_and_a_resume_goes_on(shard_set, tmp_path, monkeypatch):
    monkeypatch.setenv("CLS_FETCH_BACKOFF", "0.01")
    # A cache of 100 kB, about 9 of the 19 shards (of 10 kB: a tar file takes at least that): epoch 2 fetches again
    # what epoch 1 read, and the server, which answers the top file, two indexes and about epoch 1's 20 shards, dies
    # early in epoch 2.
    recipe = [*RECIPE, f"project={tmp_path}", f"data.cache_dir={tmp_path}/cache", "data.shard_cache_gb=0.0001"]
    with http_server(shard_set, stop_after=27) as (url, server):
        result = run_python("train.py", *recipe, f"data.name={url}/shards")
        assert server.wait(timeout=5) == 0, result.stdout[-2000:] + result.stderr[-2000:]  # it did die
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith(f"train.py: error: data.name: {url}/shards/train/train-0000")
    assert "cannot be fetched after 6 tries" in lines[0] and "resume the run" in lines[0]
    assert "epoch 1/2 " in result.stdout
    saved = load_checkpoint(tmp_path / "exp" / "weights" / "last.pt")
    assert len(list((tmp_path / "cache").rglob("*.tar"))) <= 10  # the budget held
    # The same set served again (another port: data.name is given anew with --resume's override): the run goes on.
    with http_server(shard_set) as (url, _):
        result = run_python("train.py", "--resume", tmp_path / "exp", f"data.name={url}/shards")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming at epoch {saved['epoch'] + 1}, step {saved['step']}" in result.stdout


def damaged_copy(shard_set, tmp_path, shard="train-000003.tar"):
    """A copy of the shard set with one byte flipped inside shard's first image."""
    copy = tmp_path / "served"
    shutil.copytree(shard_set, copy)
    path = copy / "shards" / "train" / shard
    content = bytearray(path.read_bytes())
    content[512 + 300] ^= 0x55  # the first member's data starts after its 512-byte header
    path.write_bytes(bytes(content))
    return copy


@pytest.mark.slow
def test_the_node_cache_keeps_its_budget_removing_the_shard_least_recently_opened(shard_set, tmp_path):
    with http_server(shard_set) as (url, _):
        a, b, c = open_shard_set(f"{url}/shards")[1]["train"].shards[:3]
        cache = ShardCache(tmp_path / "cache", budget=2 * max(s["filesize"] for s in (a, b, c)))
        paths = {}
        for shard in (a, b, a, c):  # a is opened again after b was fetched: b is the least recently opened
            paths[shard["url"]] = cache.local(shard)
            time.sleep(0.05)  # file times move in steps of a few ms
    assert sorted(p.name for p in (tmp_path / "cache").glob("*.tar")) == sorted(
        Path(paths[s["url"]]).name for s in (a, c))
    assert Path(paths[a["url"]]).read_bytes() == (shard_set / "shards" / "train" / "train-000000.tar").read_bytes()


@pytest.mark.slow
def test_reading_a_window_fetches_the_next_windows_shards_before_they_are_read_each_once(shard_set, tmp_path):
    log, cache = tmp_path / "gets.log", tmp_path / "cache"

    def fetched():
        """The shards the server sent, a name for each GET, in order."""
        return [Path(line.split()[0]).name for line in log.read_text().splitlines() if line.split()[0].endswith(".tar")]

    def wait_until_cached(names):
        """Wait (up to a minute) until the shards named are in the cache and the server's log."""
        for _ in range(1200):
            cached = {p.name.split("-", 1)[1] for p in cache.glob("*.tar")}
            if names <= cached and names <= set(fetched()):
                return
            time.sleep(0.05)

    with http_server(shard_set, log=log) as (url, _):
        split = open_shard_set(f"{url}/shards")[1]["train"]
        samples = TrainShards(split, ShardCache(cache), CropSpec(8, (0.3, 1.0), 0.5, 0), seed=0, window=2)
        order = shard_permutation(0, 0, len(split.shards)).tolist()  # the epoch's shards, a window every 2
        windows = [order[:2], order[2:4], order[4:6]]
        names = [{Path(split.shards[k]["url"]).name for k in window} for window in windows]
        ids = [[i for k in window for i in range(samples.starts[k], samples.starts[k + 1])] for window in windows]
        samples.__getitems__(ids[0])
        wait_until_cached(names[1])
        assert sorted(fetched()) == sorted(names[0] | names[1])  # the next window's, each once, and none beyond
        samples.__getitems__(ids[0][::-1])  # the same window again: nothing more is fetched
        samples.__getitems__(ids[1])  # read from the cache; the window after it is fetched ahead in turn
        wait_until_cached(names[2])
        assert sorted(fetched()) == sorted(names[0] | names[1] | names[2])


@pytest.mark.slow
@pytest.mark.parametrize("keeper", [True, False])
def test_only_the_machines_keeper_fetches_ahead_and_keeps_the_indexes_copies(shard_set, tmp_path, keeper):
    # The caller says which process keeps the machine's cache (its local rank 0): the others read what they need.
    log, folder = tmp_path / "gets.log", tmp_path / "cache"
    folder.mkdir()
    with http_server(shard_set, log=log) as (url, _):
        cache = ShardCache(folder, keeper=keeper)
        split = open_shard_set(f"{url}/shards", cache)[1]["train"]
        samples = TrainShards(split, cache, CropSpec(8, (0.3, 1.0), 0.5, 0), seed=0, window=2)
        first = shard_permutation(0, 0, len(split.shards)).tolist()[:2]
        samples.__getitems__([i for k in first for i in range(samples.starts[k], samples.starts[k + 1])])
        time.sleep(1)  # the keeper's fetch ahead ends within milliseconds from a local server
    shards = [line.split()[0] for line in log.read_text().splitlines() if line.split()[0].endswith(".tar")]
    assert len(shards) == (4 if keeper else 2)
    assert len(list(folder.glob("copy-*.json"))) == (3 if keeper else 0)  # the top file and both indexes


@pytest.mark.slow
def test_a_damaged_shard_is_named_fetched_or_read_in_place(shard_set, tmp_path):
    copy = damaged_copy(shard_set, tmp_path)
    with http_server(copy) as (url, _):
        result = run_python("train.py", *RECIPE, f"data.name={url}/shards", f"project={tmp_path}",
                            f"data.cache_dir={tmp_path}/cache")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        line for line in result.stderr.strip().splitlines() if line.startswith("train.py: error: ")]
    assert f"data.name: {url}/shards/train/train-000003.tar: its SHA-256 is " in result.stderr
    assert "the shard is damaged or was changed since its index was written" in result.stderr
    assert not list((tmp_path / "cache").rglob("*train-000003.tar"))  # never taken into the cache
    result = run_python("train.py", *RECIPE, f"data.name={copy}/shards", f"project={tmp_path}",
                        f"data.cache_dir={tmp_path}/cache")
    assert result.returncode == 2
    assert (f"train.py: error: data.name: {copy}/shards/train/train-000003.tar: sample 0000000" in result.stderr and
            "does not match its CRC-32: the shard is damaged" in result.stderr), result.stderr[-3000:]


@pytest.mark.slow
def test_a_resume_on_a_changed_shard_set_is_refused_naming_what_changed(shard_set, tmp_path, capsys):
    local = tmp_path / "shards"
    shutil.copytree(shard_set / "shards", local)
    recipe = [*RECIPE, "train.epochs=1", f"project={tmp_path}", f"data.cache_dir={tmp_path}/cache"]
    result = run_python("train.py", *recipe, f"data.name={local}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"data: {local}: 19 train shards and 1 val shards, read in place" in result.stdout
    shutil.rmtree(local)  # the same images, written again in larger shards
    result = run_python("-m", "data.shards", write_images(tmp_path / "data"), local, "--shard-size", "4KB")
    assert result.returncode == 0, result.stderr[-3000:]
    line = fails(["--resume", tmp_path / "exp", "train.epochs=2"], capsys).strip().splitlines()[-1]
    assert line.startswith(f"train.py: error: {tmp_path}/exp/weights/last.pt: its shard set changed since it was "
                           f"trained: train: "), line
    assert "shard(s) changed (train-000000.tar, train-000001.tar, train-000002.tar, ...)" in line
    assert "shard(s) removed (" in line and line.endswith("; resume with the shards it trained on, or start a new run")


@pytest.mark.slow
def test_keys_a_shard_set_cannot_take_are_refused_before_any_work(shard_set, tmp_path, capsys):
    for key, value in (("data.cache", "ram"), ("data.val_split", "0.2")):
        error = fails([*RECIPE, f"data.name={shard_set}/shards", f"{key}={value}", f"project={tmp_path}"],
                      capsys).strip()
        assert not (tmp_path / "exp").exists()
        reason = "a shard set is read as it is stored" if key == "data.cache" else "a shard set holds its own val split"
        assert error == (f"train.py: error: {key}={value}: {reason}; set {key}={'none' if key == 'data.cache' else 0} "
                         f"with data.name={shard_set}/shards")
    error = fails([*RECIPE, f"data.name={shard_set}/shards/train/index.json", f"project={tmp_path}"], capsys).strip()
    assert error == (f"train.py: error: data.name: {shard_set}/shards/train/index.json: the shard set's top file is "
                     f"not a cls-shards-v1 file (its __kind__ is 'wids-shard-index-v1')")


def webdataset_tar(path, samples):
    """A WebDataset shard written as another tool writes one: per sample key.jpg|png, key.cls and key.json."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, image, label in samples:
            for ext, data in (("jpg" if image[:2] == b"\xff\xd8" else "png", image), ("cls", label.encode()),
                              ("json", b"{}")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def image_bytes(kind, value):
    buffer = io.BytesIO()
    Image.fromarray(np.full((10, 14, 3), value, np.uint8)).save(buffer, kind)
    return buffer.getvalue()


def test_the_writer_refuses_a_root_with_several_labels_per_image_in_one_line(tmp_path, capfd):
    from data import shards
    src = tmp_path / "data"
    for split in ("train", "val"):
        png_file(src / "img" / f"{split}.png")
        (src / f"{split}.csv").write_text(f"path,labels\nimg/{split}.png,cat|dog\n")
    with pytest.raises(SystemExit) as exit_:
        shards.main([str(src), str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capfd.readouterr().err.splitlines()[-1] == (
        f"python -m data.shards: error: {src}: lists several labels per image (a labels column); a shard set holds one "
        f"label per image: train on the root as it is (train.py --recipe multilabel.yaml with its path)")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_shards_another_tool_wrote_are_indexed_in_place_and_train(tmp_path):
    src = tmp_path / "webdataset"
    train = [[(f"part{t}/s{t}{i:02d}", image_bytes("JPEG", 20 * i), "cat" if i % 2 else "dog") for i in range(6)]
             for t in range(2)]
    for t, samples in enumerate(train):
        webdataset_tar(src / "train" / f"shard-{t}.tar", samples)
    webdataset_tar(src / "val" / "val.tar", [(f"v{i}", image_bytes("PNG", 50 * i), "dog cat".split()[i % 2])
                                             for i in range(4)])
    before = {p: p.read_bytes() for p in src.rglob("*.tar")}
    result = run_python("-m", "data.shard_index", src)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "12 train images in 2 shard(s), 4 val images in 1 shard(s) indexed" in result.stdout
    assert {p: p.read_bytes() for p in src.rglob("*.tar")} == before  # the shards are not changed
    assert json.loads((src / "dataset.json").read_text())["classes"] == ["cat", "dog"]
    index = json.loads((src / "train" / "index.json").read_text())["shardlist"]
    assert [s["labels"] for s in index] == [[1, 0, 1, 0, 1, 0]] * 2
    assert index[1]["crcs"] == [zlib.crc32(image) for _, image, _ in train[1]] and index[1]["sizes"][0] == [10, 14]
    result = run_python("train.py", *RECIPE, "train.epochs=1", f"data.name={src}", f"project={tmp_path}",
                        f"data.cache_dir={tmp_path}/cache")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "12 train / 4 val images, 2 classes" in result.stdout
    assert run_python("-m", "data.shard_index", src).stderr.strip().endswith("the set is indexed (remove it to "
                                                                              "index it again)")
    webdataset_tar(tmp_path / "png" / "train" / "a.tar", [("x", image_bytes("PNG", 9), "0")])
    webdataset_tar(tmp_path / "png" / "val" / "b.tar", [("y", image_bytes("PNG", 9), "0")])
    result = run_python("-m", "data.shard_index", tmp_path / "png")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"python -m data.shard_index: error: {tmp_path}/png/train/a.tar: sample x is a PNG image (RGB): training "
        f"images of a shard set are upright RGB or grey JPEGs; write the set from its images with "
        f"`python -m data.shards`")
    assert not any((tmp_path / "png").rglob("*.json"))  # nothing written
