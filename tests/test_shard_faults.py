"""Faults on the way to a shard's bytes (data/shard_sets.py): transfers cut short or trickling, a cache folder that
cannot hold the shards, a copy removed or damaged in the node cache, a truncated or missing local shard, a host that
does not resolve, malformed top files and indexes, a local set moved before a resume; and images the writer
(data/shards.py) must refuse or store by a known extension."""

import contextlib
import hashlib
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import data.shard_sets as shard_sets
import data.shards as shards
import utils.once
from conftest import ROOT, closed_port, console_lines, fails, http_server, run_python, untimed
from data.shard_sets import INDEX_KIND, ShardCache, ShardSamples, open_shard_set, per_sample_arrays, read_json
from test_download import SLOW_ANSWER, byte_at_a_time
from test_n_invariance import served_shards, write_images
from test_shards import RECIPE, jpeg_file, members, png_file
from utils.general import DatasetError, ImageError
from utils.once import HOST, Stalled


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    base = tmp_path_factory.mktemp("faults")
    write_images(base / "data")
    return served_shards(base)


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setenv("CLS_FETCH_BACKOFF", "0.01")


def served_file(shard_set, shard):
    return shard_set / "shards" / "train" / Path(shard["url"]).name


@pytest.mark.slow
def test_a_transfer_cut_short_is_fetched_again_and_one_always_cut_is_named(shard_set, tmp_path, quick_retries):
    with http_server(shard_set, cut_first=2) as (url, _):
        shard = open_shard_set(f"{url}/shards")[1]["train"].shards[0]
        path = ShardCache(tmp_path / "cache").local(shard)  # the first two tries stop halfway, the third is whole
        assert Path(path).read_bytes() == served_file(shard_set, shard).read_bytes()
    with http_server(shard_set, cut_first=99) as (url, _):
        shard = open_shard_set(f"{url}/shards")[1]["train"].shards[0]
        with pytest.raises(ImageError) as error:
            ShardCache(tmp_path / "cache-2").local(shard)
    half = shard["filesize"] // 2
    assert untimed(str(error.value)) == (f"data.name: {shard['url']} cannot be fetched after 6 tries in T s (the "
                                         f"connection closed after {half} of {shard['filesize']} bytes); check the "
                                         f"server, then resume the run (weights/last.pt holds its last saved step)")
    assert list((tmp_path / "cache-2").iterdir()) == []  # no half shard, and no lock file either


@pytest.mark.slow
@pytest.mark.parametrize("no_length", [False, True])
def test_a_trickling_server_fails_each_try_after_its_time(shard_set, tmp_path, quick_retries, monkeypatch, no_length):
    monkeypatch.setattr(shard_sets, "FETCH_TIMEOUT", 0.3)  # each try: 0.3 s + the size at FETCH_MIN_RATE, 1 GB/s here
    monkeypatch.setattr(shard_sets, "FETCH_MIN_RATE", 1e9)
    with http_server(shard_set, trickle=True, no_length=no_length) as (url, _):
        shard = open_shard_set(f"{url}/shards")[1]["train"].shards[0]
        with pytest.raises(ImageError) as error:
            ShardCache(tmp_path / "cache").local(shard)
        if no_length:  # the top file and indexes: no size known from an index
            with pytest.raises(DatasetError) as unknown:
                shard_sets.read_location(shard["url"], "the index")
            assert " of unknown bytes in 0.3" in str(unknown.value), str(unknown.value)
    assert "cannot be fetched after 6 tries" in str(error.value)
    assert f" of {shard['filesize']} bytes in 0.3" in str(error.value), str(error.value)
    assert " s: slower than 1,000,000 kB/s on average); check the server" in str(error.value), str(error.value)


@pytest.mark.slow
def test_a_server_sending_its_answer_a_byte_at_a_time_fails_each_try_at_its_deadline(tmp_path, quick_retries,
                                                                                       monkeypatch):
    monkeypatch.setattr(shard_sets, "FETCH_TIMEOUT", 0.3)  # each read is answered in time: the whole try is not
    with byte_at_a_time(SLOW_ANSWER) as url:
        shard = {"url": f"{url}/shards/train/train-000000.tar", "filesize": 100, "sha256": "0" * 64, "nsamples": 1}
        start = time.monotonic()
        with pytest.raises(DatasetError) as top:
            open_shard_set(f"{url}/shards")
        with pytest.raises(ImageError) as error:
            ShardCache(tmp_path / "cache").local(shard)
        assert time.monotonic() - start < 20  # 2 x 6 tries of 0.3 s; each answer would take 5 s
    tries = "cannot be fetched after 6 tries in T s (no answer for 0.3 s); check the server"
    assert untimed(str(top.value)) == f"data.name: {url}/shards/dataset.json {tries} and data.name"
    assert untimed(str(error.value)) == (f"data.name: {shard['url']} {tries}, then resume the run (weights/last.pt "
                                         f"holds its last saved step)")
    # The time said is the tries' waits too, not the pauses between them alone (0.31 s): 6 x 0.3 s at least.
    assert float(re.search(r"tries in (\S+) s", str(error.value))[1]) >= 6 * 0.3 + 0.31



def dead_pid():
    """The pid of a process of this machine that has ended."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.mark.slow
def test_a_tmp_file_left_by_a_killed_fetch_is_removed_by_the_next(shard_set, tmp_path):
    with http_server(shard_set) as (url, _):
        shard = open_shard_set(f"{url}/shards")[1]["train"].shards[0]
        cache = ShardCache(tmp_path / "cache")
        name = f"{shard['sha256'][:16]}-{Path(shard['url']).name}"
        stale = tmp_path / "cache" / f".{name}.tmp-{socket.gethostname()}-{dead_pid()}"  # a fetch killed here
        stale.parent.mkdir(parents=True)
        stale.write_bytes(b"half a shard")
        cache.local(shard)
    assert not stale.exists() and (tmp_path / "cache" / name).is_file()


@pytest.mark.slow
def test_a_cache_folder_that_cannot_hold_the_shards_is_named_not_the_server(shard_set, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file")
    with http_server(shard_set) as (url, _):
        result = run_python("train.py", *RECIPE, f"data.name={url}/shards", f"data.cache_dir={blocker}",
                            f"project={tmp_path}")
        assert result.returncode == 2 and not (tmp_path / "exp").exists()
        assert result.stderr.strip().startswith(f"train.py: error: data.cache_dir: {blocker}/")
        assert "cannot hold the shards fetched (Not a directory); free space there or give data.cache_dir=" in \
            result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr[-2000:]
        # A disk that fills mid-fetch (here: a file size limit of 4 kB): the cache's disk is named, after one try.
        script = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
                  "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); "
                  "from data.shard_sets import ShardCache, open_shard_set; from utils.general import DatasetError\n"
                  f"shard = max(open_shard_set('{url}/shards')[1]['train'].shards, key=lambda s: s['filesize'])\n"
                  "try: ShardCache(sys.argv[1]).local(shard)\n"
                  "except DatasetError as e: print(e)")
        result = run_python("-c", script, tmp_path / "small-disk")
    assert result.stdout.strip() == (f"data.cache_dir: {tmp_path}/small-disk cannot hold the shards fetched (File "
                                     f"too large); free space there or give data.cache_dir=a folder on a local disk "
                                     f"with room"), result.stdout + result.stderr[-2000:]


@pytest.mark.slow
def test_a_cached_shard_removed_before_it_is_opened_is_fetched_again(shard_set, tmp_path, monkeypatch):
    with http_server(shard_set) as (url, _):
        split = open_shard_set(f"{url}/shards")[1]["train"]
        cache = ShardCache(tmp_path / "cache")
        looked_up = cache.local

        def evicted_at_once(shard):  # another process of the machine makes room just after the lookup
            path = looked_up(shard)
            if not evicted:
                evicted.append(path)
                Path(path).unlink()
            return path

        evicted = []
        monkeypatch.setattr(cache, "local", evicted_at_once)
        samples = ShardSamples(split, cache)
        first = samples.image_bytes(0)
        assert evicted and Path(evicted[0]).is_file()  # fetched again and opened
    assert first in members(served_file(shard_set, split.shards[0])).values()


@pytest.mark.slow
def test_a_cached_copy_damaged_on_this_disk_is_named_and_removed_then_fetched_again(shard_set, tmp_path):
    with http_server(shard_set) as (url, _):
        split = open_shard_set(f"{url}/shards")[1]["train"]
        cache = ShardCache(tmp_path / "cache")
        path = Path(cache.local(split.shards[0]))
        content = bytearray(path.read_bytes())
        content[512 + 300] ^= 0x55  # inside the first image
        path.write_bytes(bytes(content))
        with pytest.raises(ImageError) as error:
            ShardSamples(split, cache).image_bytes(0)
        assert str(error.value).startswith(f"data.name: {split.shards[0]['url']}: sample 0")
        assert str(error.value).endswith(f"does not match its CRC-32 in its cached copy {path}, damaged since it was "
                                         f"fetched: the copy is removed, so that the next run fetches the shard again")
        assert not path.exists()
        assert ShardSamples(split, cache).image_bytes(0) in members(served_file(shard_set, split.shards[0])).values()


@pytest.mark.slow
def test_a_local_shard_cut_short_or_missing_is_named(shard_set, tmp_path, capsys):
    local = tmp_path / "shards"
    shutil.copytree(shard_set / "shards", local)
    shard = local / "train" / "train-000002.tar"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-1024])  # a copy that stopped before its end-of-archive blocks
    split = open_shard_set(local)[1]["train"]
    samples = ShardSamples(split, ShardCache(tmp_path / "cache"))
    first = int(samples.starts[2])
    with pytest.raises(ImageError) as error:
        samples.image_bytes(first)
    assert str(error.value) == (f"data.name: {shard}: {size - 1024} bytes, the shard index says {size}: the shard is "
                                f"damaged or was changed since its index was written")
    shard.unlink()
    shard.mkdir()
    with pytest.raises(DatasetError, match=f"^data.name: {shard}: the shard cannot be opened \\(Is a directory\\)$"):
        ShardSamples(split, ShardCache(tmp_path / "cache")).image_bytes(first)
    shard.rmdir()
    error = fails([*RECIPE, f"data.name={local}", f"project={tmp_path}"], capsys).strip()
    assert len(error.splitlines()) == 1 and error.endswith(f"data.name: {shard}: the shard index names it, but it is "
                                                           f"not there"), error[-3000:]


@pytest.mark.slow
def test_a_server_down_at_the_start_is_said_try_by_try_then_named_with_data_name(tmp_path, quick_retries):
    top = f"http://127.0.0.1:{closed_port()}/shards/dataset.json"
    result = run_python("train.py", *RECIPE, f"data.name={top}", f"project={tmp_path}")
    assert result.returncode == 2, result.stderr[-3000:]
    assert console_lines(result.stdout, "data: ") == [
        f"data: {top}: Connection refused; try {n + 1} of 6 in {0.01 * 2 ** (n - 1):.3g} s" for n in range(1, 6)]
    assert untimed(result.stderr.strip()) == (f"train.py: error: data.name: {top} cannot be fetched after 6 tries in "
                                              f"T s (Connection refused); check the server and data.name")


def test_a_server_that_does_not_answer_is_said_while_each_try_waits(log, quick_retries, monkeypatch):
    monkeypatch.setattr(shard_sets, "ANSWER_NOTICE", 0.05)
    monkeypatch.setattr(shard_sets, "FETCH_TIMEOUT", 5)  # a try ends after 5 s without an answer where none is said
    listener = socket.create_server(("127.0.0.1", 0))
    top = f"http://127.0.0.1:{listener.getsockname()[1]}/shards/dataset.json"

    def answer_once_waiting_is_said():  # each try's connection is closed, unanswered, once the try's wait is said
        n = 1
        while n <= 6:
            connection, request = listener.accept()[0], b""
            connection.settimeout(1)
            with contextlib.suppress(OSError):  # the whole request: closing then sends no reset
                while b"\r\n\r\n" not in request and (chunk := connection.recv(4096)):
                    request += chunk
            # Not a try: another test's process that took this port for a free one it had checked, and connects.
            if request.startswith(b"GET /shards/dataset.json "):
                while sum("no answer" in m for m in log.messages) < n and time.monotonic() < deadline:
                    time.sleep(0.01)
                n += 1
            connection.close()

    deadline = time.monotonic() + 60
    threading.Thread(target=answer_once_waiting_is_said, daemon=True).start()
    with listener, pytest.raises(DatasetError) as error:
        shard_sets.read_location(top, "the shard set's top file")
    closed = "Remote end closed connection without response"
    assert log.messages == [line for n in range(1, 7) for line in (
        f"data: {top}: no answer in 0.05 s; try {n} of 6 waits up to 5 s",
        *([f"data: {top}: {closed}; try {n + 1} of 6 in {0.01 * 2 ** (n - 1):.3g} s"] if n < 6 else []))]
    assert untimed(str(error.value)) == (f"data.name: {top} cannot be fetched after 6 tries in T s ({closed}); check "
                                         f"the server and data.name")


@pytest.mark.slow
def test_a_host_that_does_not_resolve_is_named_at_once(tmp_path, capsys):
    error = fails([*RECIPE, "data.name=http://no-such-host.invalid/shards", f"project={tmp_path}"], capsys).strip()
    assert error.startswith("train.py: error: data.name: http://no-such-host.invalid/shards/dataset.json cannot be "
                            "fetched: its host does not resolve (")
    assert error.endswith("); check data.name")  # and no traceback: fails checks it


def changed_copy(shard_set, tmp_path, change):
    """A copy of the shard set under tmp_path whose top file and train index change(top, index) edited."""
    local = tmp_path / "shards"
    shutil.copytree(shard_set / "shards", local)
    top, index = (json.loads(p.read_text()) for p in (local / "dataset.json", local / "train" / "index.json"))
    change(top, index)
    (local / "dataset.json").write_text(json.dumps(top))
    (local / "train" / "index.json").write_text(json.dumps(index))
    return local


@pytest.mark.parametrize("change, message", [
    (lambda top, index: top.pop("classes"), "the shard set's top file has no classes list (it has ['images', "
                                            "'splits'])"),
    (lambda top, index: top.update(splits=["train"]), "the shard set's top file's splits is not a dict"),
    (lambda top, index: index["shardlist"][1].pop("sizes"),
     "train-000001.tar lacks a label, CRC-32 or size for each of its 2 samples; index shards another tool wrote "
     "with `python -m data.shard_index`, or write the set with `python -m data.shards`"),
    (lambda top, index: index["shardlist"][0].pop("nsamples"), "a shardlist entry lacks a url or nsamples ("),
    (lambda top, index: index["shardlist"][0]["labels"].__setitem__(0, "cat"),
     "train-000000.tar: its labels are not class indexes"),
    (lambda top, index: index["shardlist"][0]["crcs"].__setitem__(0, -1), "train-000000.tar: its crcs are not CRC-32s"),
    (lambda top, index: index["shardlist"][0]["sizes"].__setitem__(0, ["a", 1]),
     "train-000000.tar: its sizes are not [height, width] pairs of pixels"),
])
@pytest.mark.slow
def test_a_top_file_or_index_without_a_key_is_named(shard_set, tmp_path, change, message):
    local = changed_copy(shard_set, tmp_path, change)
    with pytest.raises(DatasetError) as error:
        open_shard_set(local)
    where = local / ("dataset.json" if "top file" in message else "train/index.json")
    assert str(error.value).startswith(f"data.name: {where}: {message}"), str(error.value)


ADVICE = ("; index shards another tool wrote with `python -m data.shard_index`, or write the set with "
          "`python -m data.shards`")


def shard_field(k, field, value):
    return lambda top, index: index["shardlist"][k].__setitem__(field, value)


@pytest.mark.parametrize("change, message", [
    (shard_field(0, "sha256", "../../elsewhere/" + "0" * 48), "train-000000.tar: its sha256 is not 64 lowercase hex "
                                                              f"digits ('../../elsewhere/{'0' * 48}'){ADVICE}"),
    (shard_field(0, "sha256", "A" * 64), f"train-000000.tar: its sha256 is not 64 lowercase hex digits ('{'A' * 64}')"
                                         f"{ADVICE}"),
    (shard_field(0, "url", "../../val/val-000000.tar"), "shard 0's url '../../val/val-000000.tar' climbs out of its "
                                                        "folder ('..')"),
    (shard_field(1, "url", "/etc/hostname"), "shard 1's url '/etc/hostname' is an absolute path"),
    (shard_field(1, "url", "sub\\..\\x.tar"), "shard 1's url 'sub\\\\..\\\\x.tar' holds a backslash or a NUL"),
    (shard_field(1, "url", "http://127.0.0.1/x.tar"), "shard 1's url 'http://127.0.0.1/x.tar' is a URL: a local set "
                                                      "names its files by paths relative to the file that names them"),
    (shard_field(0, "nsamples", True), f"train-000000.tar: its nsamples is not a whole number from 0 to 1000000000 "
                                       f"(True){ADVICE}"),
    (shard_field(0, "filesize", -1), f"train-000000.tar: its filesize is not a whole number from 0 to 1099511627776 "
                                     f"(-1){ADVICE}"),
    (lambda top, index: index.update(wids_version=2), f"its wids_version is 2, not 1{ADVICE}"),
    (lambda top, index: top.update(classes=["a", "b", "a"]), "its classes name 'a' twice"),
    (lambda top, index: top.update(classes=["a", "b\nc"]), "its classes are not a list of class names"),
    (lambda top, index: top["splits"].update(train="../shards/train/index.json"),
     "its train split's index '../shards/train/index.json' climbs out of its folder ('..')"),
    (lambda top, index: top["images"].update(val=-6), "its images are not a count from 0 to 1000000000 per split"),
])
@pytest.mark.slow
def test_a_hostile_top_file_or_index_is_refused_naming_the_file_shard_and_field(shard_set, tmp_path, change,
                                                                                message):
    local = changed_copy(shard_set, tmp_path, change)
    with pytest.raises(DatasetError) as error:
        open_shard_set(local)
    where = local / ("dataset.json" if message.startswith(("its classes", "its train", "its images")) else
                     "train/index.json")
    assert str(error.value) == f"data.name: {where}: {message}"


@pytest.mark.parametrize("file, what", [("dataset.json", "the shard set's top file"),
                                        ("train/index.json", "the shard index")])
@pytest.mark.parametrize("change, reason", [
    (lambda text: text[:-1] + ', "deep": ' + "[" * 400_000, "maximum recursion depth exceeded"),  # 400 KB of [
    (lambda text: text.replace("{", '{"long": ' + "9" * 5000 + ", ", 1), "Exceeds the limit (4300 digits) for "
                                                                         "integer string conversion"),
])
@pytest.mark.slow
def test_a_top_file_or_index_nested_too_deep_or_with_a_number_too_long_ends_the_run_in_one_line(
        shard_set, tmp_path, file, what, change, reason, capsys):
    local = tmp_path / "shards"
    shutil.copytree(shard_set / "shards", local)
    (local / file).write_text(change((local / file).read_text()))
    error = fails([*RECIPE, f"data.name={local}", f"project={tmp_path}"], capsys).strip()  # in this process
    assert len(error.splitlines()) == 1, error[-3000:]
    assert error.startswith(f"train.py: error: data.name: {local / file}: {what} is JSON too deeply nested or too long "
                            f"to read ({reason}"), error


@pytest.mark.slow
def test_an_index_s_digest_that_names_a_path_writes_and_reads_nothing_outside_the_cache(shard_set, tmp_path):
    """The issue's repro: a cache name built from sha256[:16] unchecked left data.cache_dir."""
    copy = tmp_path / "served"
    shutil.copytree(shard_set, copy)
    index_file = copy / "shards" / "train" / "index.json"
    index = json.loads(index_file.read_text())
    index["shardlist"][0]["sha256"] = "../../elsewhere/" + "0" * 48  # 64 characters: 16 of them climb out
    index_file.write_text(json.dumps(index))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    planted = elsewhere / "-train-000000.tar"
    planted.write_bytes(b"a file the run must not read")
    before = planted.stat().st_mtime_ns
    cache = ShardCache(tmp_path / "node" / "cache")
    cache.made_folder()
    with http_server(copy) as (url, _):
        with pytest.raises(DatasetError) as error:
            split = open_shard_set(f"{url}/shards", cache)[1]["train"]
            cache.local(split.shards[0])
    assert str(error.value) == (f"data.name: {url}/shards/train/index.json: train-000000.tar: its sha256 is not 64 "
                                f"lowercase hex digits ('../../elsewhere/{'0' * 48}'){ADVICE}")
    assert [p.name for p in elsewhere.iterdir()] == ["-train-000000.tar"] and planted.stat().st_mtime_ns == before
    assert not cache.copy_of(f"{url}/shards/train/index.json").exists()  # the bad index is not kept either


@pytest.mark.slow
def test_a_shard_server_that_sends_without_end_or_announces_another_size_is_stopped(shard_set, tmp_path,
                                                                                      quick_retries, monkeypatch):
    with http_server(shard_set, endless=".tar") as (url, _):
        shard = open_shard_set(f"{url}/shards")[1]["train"].shards[0]
        with pytest.raises(ImageError) as error:
            ShardCache(tmp_path / "cache").local(shard)
    assert untimed(str(error.value)) == (f"data.name: {shard['url']} cannot be fetched after 6 tries in T s (the "
                                         f"server sent more than the {shard['filesize']} bytes the shard index says); "
                                         f"check the server, then resume the run (weights/last.pt holds its last "
                                         f"saved step)")
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]  # no partial file
    with http_server(shard_set, announce=10**12) as (url, _):
        shard = open_shard_set(f"{url}/shards")[1]["train"].shards[0]
        with pytest.raises(ImageError) as error:
            ShardCache(tmp_path / "cache-2").local(shard)  # refused at once: not tried again
    assert str(error.value) == (f"data.name: {shard['url']}: the server announces 1000000000000 bytes, the shard "
                                f"index says {shard['filesize']}: the shard was changed since its index was written")
    assert not [p for p in (tmp_path / "cache-2").iterdir() if not p.name.endswith(".lock")]
    monkeypatch.setattr(shard_sets, "INDEX_BYTES", 2**16)  # the index here is 2 kB; 64 kB of spaces is still JSON
    with http_server(shard_set, endless="index.json") as (url, _):
        with pytest.raises(DatasetError) as error:
            open_shard_set(f"{url}/shards")
    assert untimed(str(error.value)) == (f"data.name: {url}/shards/train/index.json cannot be fetched after 6 tries "
                                         f"in T s (the server sent more than 64.0 KiB: the shard index is read up to "
                                         f"that); check the server and data.name")
    monkeypatch.setattr(shard_sets, "INDEX_BYTES", 1000)
    with http_server(shard_set) as (url, _), pytest.raises(DatasetError) as error:
        open_shard_set(f"{url}/shards")
    size = (shard_set / "shards" / "train" / "index.json").stat().st_size
    assert str(error.value) == (f"data.name: {url}/shards/train/index.json: the server announces {size} bytes: the "
                                f"shard index is read up to 1000 B")


@pytest.mark.slow
def test_shards_and_indexes_on_another_host_are_refused_unless_data_shard_hosts_names_it(shard_set, tmp_path):
    copy = tmp_path / "served"
    shutil.copytree(shard_set, copy)
    with http_server(copy, redirect_to="localhost") as (url, _):
        port = url.rsplit(":", 1)[1]
        index_file = copy / "shards" / "train" / "index.json"
        index = json.loads(index_file.read_text())
        first = index["shardlist"][0]["url"]
        index["shardlist"][0]["url"] = f"{url}/shards/train/{first}"  # an absolute URL on the index's origin: taken
        index["shardlist"][1]["url"] = f"http://localhost:{port}/shards/train/{index['shardlist'][1]['url']}"
        index_file.write_text(json.dumps(index))
        result = run_python("train.py", *RECIPE, f"data.name={url}/shards", f"project={tmp_path}",
                            f"data.cache_dir={tmp_path}/cache")
        assert result.returncode == 2 and not (tmp_path / "exp").exists(), result.stderr[-3000:]
        assert result.stderr.strip() == (
            f"train.py: error: data.name: {url}/shards/train/index.json: shard 1's url 'http://localhost:{port}/"
            f"shards/train/train-000001.tar' is on another host than {url}/shards/train/index.json; add "
            f"localhost:{port} to data.shard_hosts to fetch from it")
        split = open_shard_set(f"{url}/shards", hosts=["LocalHost"])[1]["train"]  # a host: any of its ports
        assert split.shards[0]["url"] == f"{url}/shards/train/{first}"
        cache = ShardCache(tmp_path / "cache-2")
        with pytest.raises(ImageError) as error:  # the server redirects every other shard to localhost
            cache.local(split.shards[2])
        assert str(error.value) == (f"data.name: {split.shards[2]['url']}: the server redirects to http://localhost:"
                                    f"{port}/shards/train/train-000002.tar, another host; add localhost:{port} to "
                                    f"data.shard_hosts to fetch from it")
        hosted = ShardCache(tmp_path / "cache-3", hosts=[f"localhost:{port}"])
        for shard in split.shards[1:3]:  # named on localhost; redirected there
            assert Path(hosted.local(shard)).read_bytes() == served_file(copy, shard).read_bytes()
        top = json.loads((copy / "shards" / "dataset.json").read_text())
        top["splits"]["val"] = f"http://localhost:{port}/shards/val/index.json"
        (copy / "shards" / "dataset.json").write_text(json.dumps(top))
        with pytest.raises(DatasetError) as error:
            open_shard_set(f"{url}/shards")
    assert str(error.value) == (f"data.name: {url}/shards/dataset.json: its val split's index 'http://localhost:"
                                f"{port}/shards/val/index.json' is on another host than {url}/shards/dataset.json; "
                                f"add localhost:{port} to data.shard_hosts to fetch from it")


@pytest.mark.slow
def test_the_cache_budget_counts_the_shards_being_fetched(shard_set, tmp_path, monkeypatch):
    """A fetch under way holds its shard's size in data.shard_cache_gb, so fetches at the same time stay within it."""
    downloading, go_on = threading.Event(), threading.Event()
    real_download = shard_sets.download

    def held_download(url, out, *args, **kwargs):  # shard b's transfer waits, under way, until go_on
        if url.endswith("train-000001.tar"):
            downloading.set()
            assert go_on.wait(30)
        return real_download(url, out, *args, **kwargs)

    monkeypatch.setattr(shard_sets, "download", held_download)
    with http_server(shard_set) as (url, _):
        a, b, c = open_shard_set(f"{url}/shards")[1]["train"].shards[:3]
        folder = tmp_path / "cache"
        cache = ShardCache(folder, budget=a["filesize"] + max(b["filesize"], c["filesize"]))
        cache.local(a)
        fetching_b = threading.Thread(target=cache.local, args=(b,))
        fetching_b.start()
        assert downloading.wait(30)
        cache.local(c)  # a, b (under way) and c do not fit: a, the least recently opened, makes room
        on_disk = sorted(p.name.split("-", 1)[1] for p in folder.glob("[0-9a-f]*"))
        go_on.set()
        fetching_b.join()
    assert on_disk == ["train-000002.tar"]  # before b's fetch ended: a removed, c in
    assert sorted(p.name.split("-", 1)[1] for p in folder.glob("[0-9a-f]*")) == ["train-000001.tar",
                                                                                 "train-000002.tar"]


# A fetch of path in another process: it takes path's lock as ShardCache.fetch_lock does, then writes a temporary
# file for 1.5 s and stops there (its server silent, or the process SIGSTOPped), holding the lock.
STALLING_FETCH = """import sys, time
from pathlib import Path
from utils.once import hold, temporary
path = Path(sys.argv[1])
hold(path.with_name(f".{path.name}.lock"))
with open(temporary(path), "wb") as out:
    print("fetching", flush=True)
    for _ in range(15):
        out.write(bytes(1000))
        out.flush()
        time.sleep(0.1)
    time.sleep(60)
"""


@pytest.mark.slow
def test_a_fetch_waits_on_another_s_lock_while_its_file_grows_then_stops_naming_it_and_the_shard(shard_set, tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.setattr(utils.once, "STALL_SECONDS", 0.5)
    with http_server(shard_set) as (url, _):
        shard = open_shard_set(f"{url}/shards")[1]["train"].shards[0]
        cache = ShardCache(tmp_path / "cache")
        path = cache.made_folder() / f"{shard['sha256'][:16]}-{Path(shard['url']).name}"
        fetch = subprocess.Popen([sys.executable, "-c", STALLING_FETCH, path], cwd=ROOT, stdout=subprocess.PIPE,
                                 text=True)
        try:
            assert fetch.stdout.readline() == "fetching\n"
            start = time.monotonic()
            with pytest.raises(Stalled) as stalled:
                cache.local(shard)
            waited = time.monotonic() - start
        finally:
            fetch.kill()
            fetch.wait()
        assert 1.4 < waited < 10  # while its file grew (1.5 s), then the stall limit
        assert str(stalled.value) == (f"rank 0 on {HOST}: stopped waiting for {shard['url']} to be fetched into "
                                      f"{tmp_path / 'cache'}: pid {fetch.pid} on {HOST}, which holds its lock "
                                      f".{path.name}.lock, made no progress for 0.5 s")
        assert Path(cache.local(shard)).read_bytes() == served_file(shard_set, shard).read_bytes()  # killed: taken
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # its temporary and the locks removed


@pytest.mark.slow
def test_a_killed_fetch_s_temporary_file_holds_no_room_in_the_cache_budget(shard_set, tmp_path):
    with http_server(shard_set) as (url, _):
        a, b, c = open_shard_set(f"{url}/shards")[1]["train"].shards[:3]
        folder = tmp_path / "cache"
        cache = ShardCache(folder, budget=a["filesize"] + b["filesize"])
        cache.local(a)
        killed = run_python("-c", "import os, sys; from pathlib import Path; from utils.once import temporary\n"
                                  "open(temporary(Path(sys.argv[1])), 'wb').truncate(int(sys.argv[2]))\n"
                                  "os.kill(os.getpid(), 9)",  # a fetch of c killed: its size reserved, lock left
                            folder / f"{c['sha256'][:16]}-{Path(c['url']).name}", c["filesize"])
        assert killed.returncode == -9 and len(list(folder.glob(".*.tmp-*"))) == 2  # its temporary and lock file
        cache.local(b)  # a and b fit the budget: c's temporary is no fetch under way
    assert sorted(p.name.split("-", 1)[1] for p in folder.iterdir()) == ["train-000000.tar", "train-000001.tar"]


@pytest.mark.slow
def test_a_local_set_moved_before_a_resume_is_resumed_from_its_new_place(shard_set, tmp_path, capsys):
    local, moved = tmp_path / "shards", tmp_path / "elsewhere" / "shards"
    shutil.copytree(shard_set / "shards", local)
    recipe = [*RECIPE, "train.epochs=1", f"project={tmp_path}"]
    assert run_python("train.py", *recipe, f"data.name={local}").returncode == 0
    moved.parent.mkdir()
    local.rename(moved)
    result = run_python("train.py", "--resume", tmp_path / "exp", "train.epochs=2", f"data.name={moved}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "epoch 2/2 " in result.stdout
    error = fails(["--resume", tmp_path / "exp", "train.epochs=3", "data.name=digits"], capsys).strip()
    assert "data.name='digits' cannot change on resume" in error, error[-2000:]


def mpo_file(path):
    """A camera's multi-picture JPEG: the photo, then a preview."""
    path.parent.mkdir(parents=True, exist_ok=True)
    photo, preview = (Image.fromarray(np.full((12, 16, 3), v, np.uint8)) for v in (90, 30))
    photo.save(path, "MPO", save_all=True, append_images=[preview])
    assert Image.open(path).format == "MPO"
    return path.read_bytes()


@pytest.mark.slow
def test_the_writer_stores_a_camera_mpo_as_jpg_a_gif_as_png_and_refuses_a_jpeg_cut_short(tmp_path):
    data = tmp_path / "data"
    for i in range(3):
        jpeg_file(data / "train" / "cat" / f"{i}.jpg")
        png_file(data / "train" / "dog" / f"{i}.png")
    photo = mpo_file(data / "val" / "cat" / "camera.jpg")
    shutil.copy(data / "val" / "cat" / "camera.jpg", data / "train" / "cat" / "camera.jpg")
    Image.fromarray(np.full((8, 8, 3), 40, np.uint8)).save(data / "val" / "cat" / "drawing.png", "GIF")  # misnamed
    result = run_python("-m", "data.shards", data, tmp_path / "out")
    assert result.returncode == 0, result.stderr[-3000:]
    stored = members(tmp_path / "out" / "val" / "val-000000.tar")
    assert list(stored) == ["000000000.jpg", "000000000.cls", "000000001.png", "000000001.cls"]
    assert stored["000000000.jpg"] == photo  # as it is, by the extension the reader knows
    assert photo in members(tmp_path / "out" / "train" / "train-000000.tar").values()  # training's JPEGs too
    assert np.asarray(Image.open(io.BytesIO(stored["000000001.png"]))).tolist() == [[[40] * 3] * 8] * 8
    result = run_python("train.py", *RECIPE, "train.epochs=1", f"data.name={tmp_path}/out", f"project={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    cut = data / "train" / "cat" / "big.jpg"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), np.uint8)).save(cut)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # Image.verify() passes it
    result = run_python("-m", "data.shards", data, tmp_path / "out-2")
    assert result.returncode == 2 and not (tmp_path / "out-2").exists()
    assert result.stderr.strip().splitlines()[-1].startswith(f"python -m data.shards: error: {cut}: unreadable "
                                                             f"image (image file is truncated")


def test_the_writer_stops_at_a_bad_image_without_reading_all_the_others(tmp_path, monkeypatch):
    read = []

    def stored(path, train, max_side):
        read.append(path)
        if path == "bad.jpg":
            raise OSError("unreadable")
        return b"x", ".jpg", (1, 1)

    monkeypatch.setattr(shards, "stored", stored)
    samples = [("bad.jpg", 0)] + [(f"{i}.jpg", 0) for i in range(2000)]
    with pytest.raises(DatasetError, match="bad.jpg: unreadable image"):
        shards.write_split(samples, tmp_path / "train", "train", True, 10**9, 0)
    assert len(read) <= 5 * shards.cpu_count() + 1, len(read)  # pool.map would read all 2001 first


@pytest.mark.slow
def test_a_fetched_shard_without_an_image_member_is_named_and_its_copy_kept(shard_set, tmp_path):
    """As an older writer stored a camera's photo in val: 000000000.mpo, an extension the reader does not know."""
    copy = tmp_path / "served"
    shutil.copytree(shard_set, copy)
    path = copy / "shards" / "train" / "train-000000.tar"
    content = members(path)
    with tarfile.open(path, "w") as tar:
        for name, data in content.items():
            info = tarfile.TarInfo(name.replace(".jpg", ".mpo"))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index_file = copy / "shards" / "train" / "index.json"
    index = json.loads(index_file.read_text())
    index["shardlist"][0].update(filesize=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest())
    index_file.write_text(json.dumps(index))
    with http_server(copy) as (url, _):
        split = open_shard_set(f"{url}/shards")[1]["train"]
        cache = ShardCache(tmp_path / "cache")
        with pytest.raises(ImageError) as error:
            ShardSamples(split, cache).image_bytes(0)
    assert str(error.value) == (f"data.name: {url}/shards/train/train-000000.tar: sample 000000000 (image 0) has no "
                                f"image member (.jpg, .jpeg, .png, .webp, .bmp, .ppm, .tif, .tiff); write the set "
                                f"again with `python -m data.shards`")
    assert Path(cache.local(split.shards[0])).is_file()  # the copy is the shard as written: kept


@pytest.mark.slow
def test_an_index_is_parsed_into_arrays_at_a_few_times_its_bytes_not_a_dozen(tmp_path):
    rng = np.random.default_rng(0)
    n = 200_000  # per shard of 20: the writers' compact JSON, about 28 bytes a sample
    shards = [{"url": f"s{k}.tar", "nsamples": n // 20, "labels": rng.integers(0, 1000, n // 20).tolist(),
               "crcs": rng.integers(0, 2**32, n // 20).tolist(), "sizes": [[375, 500]] * (n // 20)}
              for k in range(20)]
    path = tmp_path / "index.json"
    path.write_text(json.dumps({"__kind__": INDEX_KIND, "shardlist": shards}, separators=(",", ":")))
    del shards
    tracemalloc.start()
    index = read_json(str(path), INDEX_KIND, "the shard index", {"shardlist": list}, hook=per_sample_arrays)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert all(isinstance(s[key], np.ndarray) for s in index["shardlist"] for key in ("labels", "crcs", "sizes"))
    # Parsed as Python lists, the same index peaks at about 12x its bytes
    assert peak < 6 * path.stat().st_size, (peak, path.stat().st_size)
