"""Shard sets: a data set kept as WebDataset tar shards, in a local folder or behind an http(s):// URL, read by
index through wids, with the guarantees folders have (the same steps at any N, exact resume, every sample once an
epoch).

A shard set (written by `python -m data.shards`, see data/shards.py) is a top file, dataset.json, naming the
classes and a wids shard index per split (train/index.json, val/index.json: `wids-shard-index-v1`, each shard's
url relative to the index, its sample count, size and SHA-256, and per sample its label and the CRC-32 of its
image's bytes and its size). The labels are in the index, so the sampler (balanced draws too) knows every
sample's class without reading a shard, and the sizes, so training crops are drawn without reading a header.

Order and locality: the global order stays a function of (seed, epoch) alone (data/sampler.py); for shards it
is the epoch's shuffled samples regrouped window by window, a window being data.shard_window shards of a
shuffled shard order, so a stretch of steps reads a few shards, not all of them.

Fetching: a shard behind a URL is fetched once per machine into a node-local cache (data.cache_dir, by default
datasets/shard-cache/) that its ranks and DataLoader workers share: one process downloads it under a file lock
while the others wait for the lock as long as its download moves, then find it there (fetch_lock); it is written
under a temporary name, checked against its SHA-256 and renamed, so a half-fetched or damaged shard is never read.
A cached shard is named by its SHA-256, so a changed shard is never taken for the old one. Local rank 0's workers
fetch the next window's shards ahead.
A try of a fetch ends by a deadline whatever the server sends (utils/download.py: its answer within FETCH_TIMEOUT,
its body at FETCH_MIN_RATE); a fetch that fails is retried with back-off, each failure and each try that waits long
for an answer said on rank 0, then the run stops with one line naming the URL and the option that names the set
(train.py's data.name, val.py's --data). The top file and indexes fetched are kept in the cache too: val.py reads
its split's index only, and reads those copies when the server cannot be reached, so a run's cached shards are
evaluated without it. Local shards are read where they are. A shard opened (with wids' IndexedTarSamples) is
checked against its index's size and sample count, and every image's bytes against their CRC-32 as they are read.

A set's files may come from anyone's server, so every field of the top file and indexes is checked before use
(digests, counts, files named inside the set and, at a URL, on the origin of the file that names them or on
data.shard_hosts; redirects too), both are read up to a bound (TOP_BYTES, INDEX_BYTES), and a shard's download
stops at its index's size, which its temporary file holds in data.shard_cache_gb from the download's start.
"""

import collections
import contextlib
import hashlib
import http.client
import io
import itertools
import json
import os
import re
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from data.batches import SeededBatches
from data.transforms import train_transforms
from data.sampler import shard_permutation
from data.verify import UNREADABLE, decode, unreadable_reason
from utils.download import Refused, TooLong, fetch
from utils.memory import size_text
from utils.once import LOCK, atomic_write, clean_leftovers, locked, written
from utils.general import DATASETS_DIR, LOGGER, DatasetError, ImageError, colorstr, short_path

TOP = "dataset.json"  # the top file of a shard set: classes and the splits' indexes
KIND = "cls-shards-v1"
INDEX_KIND = "wids-shard-index-v1"
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".ppm", ".tif", ".tiff")
FETCH_TRIES = 6  # a failing fetch is tried this many times, waiting 1, 2, 4, 8, 16 s (CLS_FETCH_BACKOFF x) between
FETCH_TIMEOUT = 60  # seconds from a try's start to the server's whole answer (status line, headers); and per byte
FETCH_MIN_RATE = 100e3  # bytes a second: a try ends FETCH_TIMEOUT + the size at this rate after its start
ANSWER_NOTICE = 5  # seconds a try waits for the server's answer before rank 0 says it is waiting
# The most bytes read of a fetched top file and index, so that a server cannot fill memory with one: every rank
# parses them whole. The top file holds class names (ImageNet-21k's 21,841 take under 1 MB). An index holds what
# a sample needs: the writers' compact JSON of a label, a CRC-32 and [height, width] takes 26 to 30 bytes, 40 with
# other tools' spaces; 20 million samples, ImageNet-21k's 14.2 million with 40% room, make 800 MB. Parsed, a
# shard's lists become arrays as they are read (per_sample_arrays): an index costs a rank about 3.5x its bytes, not
# 12x (ImageNet-21k's, 373 MB: 1.2 GB, not 4.3).
TOP_BYTES = 64 * 2**20
INDEX_SAMPLE_BYTES, INDEX_SAMPLES = 40, 20_000_000
INDEX_BYTES = INDEX_SAMPLE_BYTES * INDEX_SAMPLES
SHARD_BYTES = 2**40  # the most a shard's filesize may say: far above the 1 GB WebDataset advises
COUNT_MOST = 10**9  # the most samples a shard (or a split's count in the top file) may hold
SHA256 = re.compile(r"[0-9a-f]{64}")
CACHED = re.compile(r"[0-9a-f]{16}-.*", re.S)  # a cached shard: its SHA-256's start, then its name (ShardCache.local)
FETCHING = re.compile(r"\.([0-9a-f]{16}-.*)\.tmp-.*", re.S)  # one being fetched, or its lock (ShardCache.fetch)


def is_url(name):
    return str(name).startswith(("http://", "https://"))


def top_location(name):
    """The top file data.name names: the file itself, or dataset.json in the folder (or under the URL)."""
    name = str(name)
    if name.endswith(".json"):
        return name
    return f"{name.rstrip('/')}/{TOP}" if is_url(name) else str(Path(name) / TOP)


def resolve(base, relative):
    """A shard's or index's location relative to the file that names it (a URL or a local path)."""
    if is_url(base):
        return urllib.parse.urljoin(base, relative)
    return str(Path(base).parent / relative)


def backoff():
    return float(os.environ.get("CLS_FETCH_BACKOFF", "1"))


RERUN = "check the server, then run it again"
RESUME = "check the server, then resume the run (weights/last.pt holds its last saved step)"


def said(line):
    """A line about the data on rank 0 (LOGGER prints nothing else elsewhere)."""
    LOGGER.info(f"{colorstr('data:')} {line}")


def read_location(location, what, cache=None, limit=TOP_BYTES, parse=lambda content: content, hosts=()):
    """parse(the bytes of a local file or a URL): parse raises on bad content, before anything is kept. A URL is
    read up to limit bytes (retried with back-off, see retried; a host that does not resolve is not: data.name is
    mistyped more often than a name server fails at the start) and its bytes kept in cache (a ShardCache); with its
    use_copies, that copy is read when the server cannot be reached, after one try. hosts: see download."""
    if not is_url(location):
        try:
            return parse(Path(location).read_bytes())
        except OSError as e:
            raise DatasetError(f"data.name: {location}: {what} cannot be read ({e.strerror or e})") from None
    buffer = io.BytesIO()

    def fetch(answered):
        download(location, buffer, limit, what=what, answered=answered, hosts=hosts)
        content = parse(buffer.getvalue())
        if cache:
            cache.keep_copy(location, buffer.getvalue())
        return content

    then = "check the server and data.name"
    copy = cache.copy_of(location) if cache else None
    if cache and cache.use_copies and copy.is_file():
        return retried(location, fetch, DatasetError, then, tries=1,
                       instead=lambda reason: parse(read_copy(location, copy, reason)))
    return retried(location, fetch, DatasetError, then, dns=False)


def read_copy(location, copy, reason):
    """The copy of location kept in the node cache, read (and said) because the server cannot be reached."""
    fetched = time.strftime("%Y-%m-%d %H:%M", time.localtime(copy.stat().st_mtime))
    said(f"{location}: {reason}; reading its copy fetched {fetched}, {short_path(copy)}")
    return copy.read_bytes()


class CacheWriteError(Exception):
    """The node cache's disk failed a write (full, read-only): not the server's fault, so not retried."""


def origin(url):
    """(scheme, host, port) of a URL, the port its scheme's where it names none."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, parts.hostname or "", parts.port or {"http": 80, "https": 443}.get(scheme)


def host_of(url):
    """A URL's host:port, as data.shard_hosts names it."""
    _, host, port = origin(url)
    return f"{host}:{port}"


def on_allowed_host(url, base, hosts):
    """Whether url is on base's origin or on one of hosts (data.shard_hosts: host, or host:port)."""
    hosts = {host.lower() for host in hosts}
    return origin(url) == origin(base) or origin(url)[1] in hosts or host_of(url) in hosts


class KeptRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects followed on the origin of the URL asked for, or to data.shard_hosts: the rule files' URLs follow."""

    def __init__(self, hosts):
        self.hosts = hosts

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not on_allowed_host(newurl, req.full_url, self.hosts):
            fp.close()
            raise Refused(f"the server redirects to {newurl}, another host; add {host_of(newurl)} to "
                          f"data.shard_hosts to fetch from it")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def download(url, out, limit, exact=False, what="the shard", answered=lambda: None, hosts=()):
    """Copy url's body into the file object out (from its start, out cut at its end) with utils/download.py's
    bounds: the server's answer within FETCH_TIMEOUT s of the start, then the body at FETCH_MIN_RATE on average,
    limit bytes at most (exact: the shard index's size, which a Content-Length must announce, else the transfer is
    refused unread); answered() is called once the server has answered; redirects are followed on url's origin or
    to hosts. A failure (Refused aside) fails the try."""
    out.seek(0)  # not truncated: a shard's temporary file keeps the size it reserves (ShardCache.fetch)

    def checked(announced):
        answered()
        if exact and announced not in (None, limit):
            raise Refused(f"the server announces {announced} bytes, the shard index says {limit}: the shard was "
                          f"changed since its index was written")
    try:
        fetch(url, cache_writes(out), limit, FETCH_TIMEOUT, FETCH_MIN_RATE, what, expected=limit if exact else None,
              redirects=KeptRedirects(hosts), answered=checked)
    except TooLong:
        if not exact:
            raise
        raise TooLong(f"the server sent more than the {limit} bytes the shard index says") from None
    out.truncate()


def cache_writes(out):
    """out.write, its failures the node cache's disk's (CacheWriteError), not the server's."""
    def write(chunk):
        try:
            out.write(chunk)
        except OSError as e:
            raise CacheWriteError(e.strerror or str(e)) from None
    return write


def retried(url, work, error=ImageError, then=RESUME, dns=True, tries=FETCH_TRIES, instead=None):
    """work(answered) tried `tries` times with doubling waits, rank 0 saying each failure and each try that waits
    ANSWER_NOTICE s for the server's answer (work calls answered() when it comes); a missing file (404, 403, 410) is
    not retried, nor (with dns=False) a host name that does not resolve. The last failure is raised as error, naming
    url and data.name and saying what to do then; or, for a server that cannot be reached,
    instead(reason) is returned when given."""
    start = time.monotonic()
    for attempt in range(tries):
        waiting = threading.Timer(ANSWER_NOTICE, said, [f"{url}: no answer in {ANSWER_NOTICE:g} s; try {attempt + 1} "
                                                        f"of {tries} waits up to {FETCH_TIMEOUT:g} s"])
        waiting.daemon = True
        waiting.start()
        try:
            return work(waiting.cancel)
        except Refused as e:
            raise error(f"data.name: {url}: {e}") from None
        except urllib.error.HTTPError as e:
            reason = f"HTTP {e.code} {e.reason}"
            if e.code in (403, 404, 410):
                raise error(f"data.name: {url} cannot be fetched ({reason})") from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            cause = getattr(e, "reason", None) or e
            reason = (getattr(cause, "strerror", None) or str(cause)) or type(e).__name__
            if not dns and instead is None and isinstance(cause, socket.gaierror):
                raise error(f"data.name: {url} cannot be fetched: its host does not resolve ({reason}); "
                            f"check data.name") from None
        finally:
            waiting.cancel()
        if attempt + 1 < tries:
            wait = backoff() * 2**attempt
            said(f"{url}: {reason}; try {attempt + 2} of {tries} in {wait:.3g} s")
            time.sleep(wait)
    if instead is not None:
        return instead(reason)
    raise error(f"data.name: {url} cannot be fetched after {tries} tries in {time.monotonic() - start:.3g} s "
                f"({reason}); {then}")


def read_json(location, kind, what, fields, cache=None, limit=TOP_BYTES, check=lambda content: None, hosts=(),
              hook=None):
    """A JSON file of the given __kind__ with fields {field: type}, read up to limit bytes and given to check (which
    raises on a bad field) before its copy is kept, with errors that name it, the field and data.name; whatever the
    bytes, one line (DatasetError). hook: json's object_hook; cache, hosts: see read_location."""

    def parsed(raw):
        try:
            content = json.loads(raw, object_hook=hook)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DatasetError(f"data.name: {location}: {what} is not JSON ({e})") from None
        except (RecursionError, ValueError) as e:  # brackets nested too deep; a number of over 4,300 digits
            raise DatasetError(f"data.name: {location}: {what} is JSON too deeply nested or too long to read "
                               f"({str(e).partition(';')[0]})") from None
        if not isinstance(content, dict) or content.get("__kind__") != kind:
            raise DatasetError(f"data.name: {location}: {what} is not a {kind} file (its __kind__ is "
                               f"{content.get('__kind__') if isinstance(content, dict) else None!r:.80})")
        for field, kind_of in fields.items():
            if not isinstance(content.get(field), kind_of):
                raise DatasetError(f"data.name: {location}: {what} has no {field} {kind_of.__name__} (it has "
                                   f"{sorted(k for k in content if k != '__kind__')})" if field not in content else
                                   f"data.name: {location}: {what}'s {field} is not a {kind_of.__name__}")
        check(content)
        return content

    return read_location(location, what, cache, limit, parsed, hosts)


def malformed(location, problem):
    return DatasetError(f"data.name: {location}: {problem}; index shards another tool wrote with "
                        f"`python -m data.shard_index`, or write the set with `python -m data.shards`")


def reference_problem(base, reference, hosts):
    """What is wrong with the name of a shard or index in the file at base, or None: a local set's is a path inside
    the folder of the file that names it; a URL's may be an absolute http(s) URL too, on base's origin (scheme,
    host and port) or on one of hosts (data.shard_hosts)."""
    if not reference:
        return "is empty"
    if "\\" in reference or "\0" in reference:
        return "holds a backslash or a NUL"
    parts = urllib.parse.urlsplit(reference) if is_url(base) else None
    if not parts:
        path = reference
        if is_url(reference):
            return "is a URL: a local set names its files by paths relative to the file that names them"
    elif parts.scheme or parts.netloc:
        path, url = parts.path, urllib.parse.urljoin(base, reference)
        try:
            if not is_url(url) or not origin(url)[1]:
                return "is not an http(s) URL"
        except ValueError:  # a port that is not a number
            return "is not an http(s) URL"
        if not on_allowed_host(url, base, hosts):
            return f"is on another host than {base}; add {host_of(url)} to data.shard_hosts to fetch from it"
    else:
        path = urllib.parse.unquote(parts.path)  # as a server may read %2e%2e
    if path.startswith("/") and not (parts and (parts.scheme or parts.netloc)):
        return "is an absolute path"
    if ".." in path.split("/"):
        return "climbs out of its folder ('..')"
    return None


class ShardSplit:
    """One split of a shard set: its shards (each with its location resolved), classes and samples' labels, every
    field of its index checked before use (the index may come from a server: see checked_entry). hosts: see
    reference_problem."""

    def __init__(self, index_location, classes, cache=None, hosts=()):
        self.location, self.classes, self.hosts = index_location, list(classes), hosts
        read_json(index_location, INDEX_KIND, "the shard index", {"shardlist": list}, cache, INDEX_BYTES, self.take,
                  hosts, per_sample_arrays)

    def take(self, index):
        """The index's shards and per-sample lists, checked."""
        if index.get("wids_version", 1) != 1:
            raise malformed(self.location, f"its wids_version is {str(index['wids_version'])[:40]}, not 1")
        if not index["shardlist"]:
            raise DatasetError(f"data.name: {self.location}: the shard index lists no shards")
        entries = [checked_entry(self.location, k, shard, self.hosts) for k, shard in enumerate(index["shardlist"])]
        self.shards = [entry for entry, _ in entries]  # without per-sample lists: every process and worker holds it
        self.labels, self.crcs, sizes = (np.concatenate(column) for column in zip(*(c for _, c in entries)))
        if len(self.labels) and self.labels.max() >= len(self.classes):
            raise DatasetError(f"data.name: {self.location}: labels outside the {len(self.classes)} classes")
        self.sizes = torch.from_numpy(sizes)  # (height, width)
        self.lengths = np.array([s["nsamples"] for s in self.shards], np.int64)

    def identity(self):
        """[(shard's name in the index, SHA-256)]: what a resumed run must find unchanged."""
        return [[Path(urllib.parse.urlparse(s["url"]).path).name, s.get("sha256", "")] for s in self.shards]


def checked_entry(index_location, k, shard, hosts=()):
    """(an index's shard entry k, its url resolved against the index and its per-sample lists left out; those lists
    as arrays: labels (int64), crcs (uint32), sizes ((n, 2) int64)), each field checked: its url (reference_problem),
    counts (check_counts) and per-sample lists."""
    if not (isinstance(shard, dict) and isinstance(shard.get("url"), str) and isinstance(shard.get("nsamples"), int)):
        raise malformed(index_location, f"a shardlist entry lacks a url or nsamples ({str(shard)[:80]})")
    url, n = shard["url"], shard["nsamples"]
    problem = reference_problem(index_location, url, hosts)
    if problem:
        raise DatasetError(f"data.name: {index_location}: shard {k}'s url {url[:120]!r} {problem}")
    check_counts(index_location, shard, is_url(index_location))
    entry = {**{key: value for key, value in shard.items() if key not in PER_SAMPLE},
             "url": resolve(index_location, url)}
    columns = [shard.get(key, []) for key in PER_SAMPLE]
    if not all(isinstance(column, (list, np.ndarray)) and len(column) == n for column in columns):
        raise malformed(index_location, f"{url} lacks a label, CRC-32 or size for each of its {n} samples")
    labels, crcs, sizes = (whole_numbers(column, pairs) for column, pairs in zip(columns, PER_SAMPLE.values()))
    if labels is None or n and labels.min() < 0:
        raise malformed(index_location, f"{url}: its labels are not class indexes")
    if crcs is None or n and (crcs.min() < 0 or crcs.max() >= 2**32):
        raise malformed(index_location, f"{url}: its crcs are not CRC-32s")
    if sizes is None or n and sizes.min() <= 0:
        raise malformed(index_location, f"{url}: its sizes are not [height, width] pairs of pixels")
    return entry, (labels, crcs.astype(np.uint32), sizes)


PER_SAMPLE = {"labels": False, "crcs": False, "sizes": True}  # an index entry's per-sample lists: of pairs?


def per_sample_arrays(entry):
    """A JSON object as json parses it (object_hook): a shard entry's per-sample lists made arrays at once, so that
    an index's millions of numbers are never Python objects all together (12x its bytes); a list that is not
    whole numbers is left for checked_entry to name."""
    for key, pairs in PER_SAMPLE.items():
        if (column := whole_numbers(entry.get(key), pairs)) is not None:
            entry[key] = column
    return entry


def whole_numbers(values, pairs=False):
    """A JSON list of whole numbers (pairs: of [a, b] pairs of them) as an int64 array, (n,) or (n, 2); None where it
    is not one. Types are checked before numpy sees them: an array of text is as wide as its longest string."""
    if isinstance(values, np.ndarray):  # made while parsing
        return values
    if type(values) is not list:
        return None
    numbers = values
    if pairs:
        if set(map(type, values)) - {list} or set(map(len, values)) - {2}:
            return None
        numbers = itertools.chain.from_iterable(values)
    if set(map(type, numbers)) - {int}:  # type: not bool, float or text
        return None
    try:
        return np.array(values, np.int64).reshape((-1, 2) if pairs else -1)
    except OverflowError:  # beyond 64 bits
        return None


def check_counts(index_location, shard, fetched):
    """A shard entry's nsamples, filesize and sha256 (the cache names its copy by it): whole numbers in range and a
    hex digest. A shard fetched from a server needs the last two: they bound its download and check it."""
    url = shard["url"]
    for field, most in (("nsamples", COUNT_MOST), ("filesize", SHARD_BYTES)):
        value = shard.get(field, 0)
        if type(value) is not int or not 0 <= value <= most:  # type: not a bool
            raise malformed(index_location, f"{url}: its {field} is not a whole number from 0 to {most} "
                                            f"({str(value)[:40]})")
    digest = shard.get("sha256", "0" * 64)
    if not (isinstance(digest, str) and SHA256.fullmatch(digest)):
        raise malformed(index_location, f"{url}: its sha256 is not 64 lowercase hex digits ({str(digest)[:80]!r})")
    if fetched and not ("filesize" in shard and "sha256" in shard):
        raise malformed(index_location, f"{url}: it has no {'sha256' if 'filesize' in shard else 'filesize'}, which "
                                        f"a shard fetched from a server needs (its download is bounded and checked by "
                                        f"its filesize and sha256)")


def open_shard_set(name, cache=None, only=None, hosts=()):
    """(classes, {split: ShardSplit}) of the shard set data.name names: its top file and its
    splits' indexes (only: that split's, if the set has it) read, or fetched, by every rank: they are small beside
    the shards. Every field is checked before use (check_top). cache: the ShardCache keeping the copies of those
    fetched (see read_location); hosts: data.shard_hosts (see reference_problem)."""
    top_file = top_location(name)
    top = read_json(top_file, KIND, "the shard set's top file", {"classes": list, "splits": dict}, cache,
                    check=lambda content: check_top(top_file, content, hosts), hosts=hosts)
    if only is not None and only not in top["splits"]:
        raise DatasetError(f"data.name: {top_file}: no {only} split (it names {sorted(top['splits'])})")
    wanted = [only] if only is not None else list(top["splits"])
    return top["classes"], {split: ShardSplit(resolve(top_file, top["splits"][split]), top["classes"], cache, hosts)
                            for split in wanted}


def check_top(top_file, top, hosts):
    """A top file's classes (distinct names, one line each), splits (each naming its index: reference_problem) and
    image counts."""
    classes = top["classes"]
    if not classes or not all(isinstance(c, str) and c and "\0" not in c and "\n" not in c for c in classes):
        raise DatasetError(f"data.name: {top_file}: its classes are not a list of class names")
    if len(set(classes)) < len(classes):
        twice = next(c for i, c in enumerate(classes) if c in classes[:i])
        raise DatasetError(f"data.name: {top_file}: its classes name {twice[:80]!r} twice")
    if not all(isinstance(index, str) for index in top["splits"].values()):
        raise DatasetError(f"data.name: {top_file}: its splits do not map each split to its index file")
    for split, index in top["splits"].items():
        problem = reference_problem(top_file, index, hosts)
        if problem:
            raise DatasetError(f"data.name: {top_file}: its {split[:40]} split's index {index[:120]!r} {problem}")
    images = top.get("images", {})
    if not isinstance(images, dict) or not all(type(n) is int and 0 <= n <= COUNT_MOST for n in images.values()):
        raise DatasetError(f"data.name: {top_file}: its images are not a count from 0 to {COUNT_MOST} per split")


class ShardCache:
    """Where a process finds a shard's bytes: a local shard where it is; a URL's in the node-local cache folder,
    fetched first if missing (one process per machine, the others wait on its lock). Picklable: DataLoader workers
    get a copy. budget (bytes, 0: none): cached shards beyond it are removed, least recently opened first (a process
    that has a shard open keeps reading it). then: what a failed fetch's line tells the user to do (every line names
    the set as data.name: val.py says it as --data, utils.distributed.exit_on_error). The top file and indexes fetched are
    kept here too; use_copies: read them when the server cannot be reached (val.py: the set a run trained on).
    keeper: whether this process keeps those copies and fetches the next window's shards ahead for its machine (the
    caller says which process: its machine's local rank 0), where the machine's others only read."""

    def __init__(self, folder, budget=0, then=RESUME, use_copies=False, hosts=(), keeper=True):
        self.folder, self.budget, self.then, self.use_copies = Path(folder), budget, then, use_copies
        self.hosts = hosts  # data.shard_hosts: where a server may redirect a shard's fetch (download)
        self.keeper = keeper

    def local(self, shard):
        """The local path of shard (a ShardSplit entry, its fields checked), fetched first where it is a URL."""
        url = shard["url"]
        if not is_url(url):
            return url
        path = self.folder / f"{shard['sha256'][:16]}-{Path(urllib.parse.urlparse(url).path).name}"
        try:
            os.utime(path)  # its time is its last use: the budget removes the shards least recently opened
        except FileNotFoundError:
            self.fetch(url, path, shard)
        return str(path)

    def fetch(self, url, path, shard):
        """Download url to path once per machine: under its lock (fetch_lock), into a temporary file of the shard's
        size (reserved in the budget before the download, see make_room), checked, then renamed."""
        with self.disk_errors(), self.fetch_lock(url, path):
            if path.exists():
                return
            with atomic_write(path) as tmp, open(tmp, "w+b") as out:  # removes what a killed fetch left
                self.reserve(out, shard["filesize"])
                retried(url, lambda answered: download(url, out, shard["filesize"], exact=True,
                                                       answered=answered, hosts=self.hosts), then=self.then)
                out.flush()
                check_shard(url, tmp, shard)

    def fetch_lock(self, url, path):
        """Hold path's lock (.NAME.lock) while inside (utils/once.locked, which removes it after): another process
        of this machine fetching it is waited on while its temporary file changes (bytes written, a try started
        again), and STALL_SECONDS without end the wait with one line naming url and that process (Stalled)."""
        return locked(self.made_folder() / f".{path.name}.lock", lambda: written(path),
                      f"waiting for {url} to be fetched into {self.folder}")

    def reserve(self, tmp, nbytes):
        """Room for a download of nbytes, made under the folder's lock and held by its temporary file, cut to that
        size (sparse: no disk yet), so that fetches at the same time count each other (make_room)."""
        with locked(self.folder / ".room.lock", doing=f"waiting to make room in {self.folder}"):
            self.make_room(nbytes)
            tmp.truncate(nbytes)

    def copy_of(self, url):
        """Where the copy of the top file or index fetched from url is kept (named by a digest of url alone)."""
        return self.folder / f"copy-{hashlib.sha256(url.encode()).hexdigest()[:16]}.json"

    def keep_copy(self, url, content):
        """Keep content, fetched from url, as its copy (written whole, then renamed; by the keeper, once a
        machine)."""
        if not self.keeper:
            return
        with self.disk_errors(), atomic_write(self.copy_of(url)) as tmp:
            tmp.write_bytes(content)

    def made_folder(self):
        """The cache folder, made if it is not there yet."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return self.folder

    @contextlib.contextmanager
    def disk_errors(self):
        """The cache folder's own failures (unwritable, full) as one line naming data.cache_dir, not the server."""
        try:
            yield
        except (CacheWriteError, OSError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise DatasetError(f"data.cache_dir: {self.folder} cannot hold the shards fetched ({reason}); free space "
                               f"there or give data.cache_dir=a folder on a local disk with room") from None

    def make_room(self, nbytes):
        """Remove the least recently opened cached shards until nbytes more fit the budget, beside the shards cached
        and those being fetched (their temporary files hold their whole size from the start); a killed fetch's
        temporary file (its lock free) is removed first, holding no room."""
        if not self.budget:
            return
        for name in {found[1] for path in self.folder.iterdir() if (found := FETCHING.fullmatch(path.name))}:
            clean_leftovers(self.folder / name)
        cached, held = [], 0
        for path in self.folder.glob("*"):
            if not (CACHED.fullmatch(path.name) or FETCHING.fullmatch(path.name)) or path.name.endswith(LOCK):
                continue  # a lock or a copy of an index
            with contextlib.suppress(FileNotFoundError):  # another process of this machine removed it just now
                info = path.stat()
                held += info.st_size
                if CACHED.fullmatch(path.name):
                    cached.append((info.st_mtime, info.st_size, path))
        for _, size, path in sorted(cached):
            if held + nbytes <= self.budget:
                break
            path.unlink(missing_ok=True)  # a process reading it keeps its mapping
            held -= size


def check_shard(url, path, shard):
    """A fetched shard's size and SHA-256 against its index's: a mismatch names the shard."""
    size = path.stat().st_size
    if "filesize" in shard and size != shard["filesize"]:
        raise ImageError(f"data.name: {url}: fetched {size} bytes, the shard index says {shard['filesize']}: the "
                         f"shard is damaged or was changed since its index was written")
    if shard.get("sha256"):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != shard["sha256"]:
            raise ImageError(f"data.name: {url}: its SHA-256 is {digest.hexdigest()[:16]}..., the shard index says "
                             f"{shard['sha256'][:16]}...: the shard is damaged or was changed since its index was "
                             f"written")


class ShardSamples(Dataset):
    """A split's samples by global index: each shard opened with wids (IndexedTarSamples, which maps the tar and
    indexes its members), the last window's shards kept open, the image's bytes checked against their CRC-32."""

    def __init__(self, split, cache, window=8):
        self.split, self.cache, self.window = split, cache, window
        self.root, self.classes, self.samples = split.location, split.classes, None
        self.targets = torch.from_numpy(split.labels)
        self.starts = np.concatenate([[0], np.cumsum(split.lengths)])
        self.shard_of = torch.from_numpy(np.repeat(np.arange(len(split.shards)), split.lengths))
        self.opened = collections.OrderedDict()  # shard number -> (IndexedTarSamples, path), least recent first

    def __getstate__(self):
        return {**self.__dict__, "opened": collections.OrderedDict()}  # each worker opens its own shards

    def tar(self, k):
        """Shard k's (IndexedTarSamples, local path), opened if it is not among the last window+1 opened."""
        if k in self.opened:
            self.opened.move_to_end(k)
        else:
            self.opened[k] = self.open(self.split.shards[k])
            while len(self.opened) > self.window + 1:
                self.opened.popitem(last=False)[1][0].close()
        return self.opened[k]

    def open(self, shard):
        """A shard's (tar, local path): its file opened (open_file), then indexed by wids' IndexedTarSamples, its
        size and sample count checked against the index."""
        from wids.wids import IndexedTarSamples  # noqa: PLC0415 (only shard sets need it)
        stream, path = self.open_file(shard)
        url, size = shard["url"], os.fstat(stream.fileno()).st_size
        try:
            if "filesize" in shard and size != shard["filesize"]:
                raise ImageError(f"data.name: {url}: {size} bytes, the shard index says {shard['filesize']}: "
                                 f"the shard is damaged or was changed since its index was written")
            try:
                tar = IndexedTarSamples(path=path, stream=stream)
            except (struct.error, ValueError, OSError, AssertionError, IndexError, KeyError) as e:  # as wids meets it
                raise ImageError(f"data.name: {url}: not a readable tar file ({e or type(e).__name__}): the "
                                 f"shard is damaged") from None
            if len(tar) != shard["nsamples"]:
                tar.close()
                raise ImageError(f"data.name: {url}: holds {len(tar)} samples, the shard index says "
                                 f"{shard['nsamples']}: the shard was changed since its index was written")
        except ImageError:
            stream.close()
            raise
        return tar, path

    def open_file(self, shard):
        """(file object, path) of a shard's local file. A cached shard removed for room between its lookup and its
        opening is fetched again; once open, it stays readable when it is removed."""
        url = shard["url"]
        for _ in range(3):
            path = self.cache.local(shard)
            try:
                return open(path, "rb"), path
            except FileNotFoundError:
                if not is_url(url):
                    raise DatasetError(f"data.name: {url}: the shard index names it, but it is not "
                                       f"there") from None
            except OSError as e:  # a folder, no permission
                raise DatasetError(f"data.name: {url}: the shard cannot be opened ({e.strerror or e})") from None
        raise ImageError(f"data.name: {url}: removed from the cache {short_path(self.cache.folder)} three times "
                         f"before it could be opened; raise data.shard_cache_gb")

    def image_bytes(self, i):
        """Sample i's image bytes, checked against their CRC-32."""
        k = int(self.shard_of[i])
        tar, path = self.tar(k)
        sample = tar[i - int(self.starts[k])]
        data = next((value for key, value in sample.items() if key.lower() in IMAGE_EXTENSIONS), None)
        if hasattr(data, "getvalue"):
            data = data.getvalue()
        if data is None or zlib.crc32(data) != int(self.split.crcs[i]):
            raise ImageError(self.damaged(k, path, f"sample {sample.get('__key__')} (image {i})", data is None))
        return data

    def damaged(self, k, path, sample, no_image):
        """The line for a damaged sample; a fetched shard's cached copy (checked when fetched, so damaged on this
        machine's disk since) is removed, so that the next run fetches it again."""
        shard = self.split.shards[k]
        url = shard["url"]
        if no_image:  # the shard as written: fetching it again would not help
            return (f"data.name: {url}: {sample} has no image member ({', '.join(IMAGE_EXTENSIONS)}); write "
                    f"the set again with `python -m data.shards`")
        what = "does not match its CRC-32"
        if not is_url(url) or not shard.get("sha256"):
            return f"data.name: {url}: {sample} {what}: the shard is damaged"
        Path(path).unlink(missing_ok=True)
        return (f"data.name: {url}: {sample} {what} in its cached copy {short_path(path)}, damaged since it was "
                f"fetched: the copy is removed, so that the next run fetches the shard again")

    def __len__(self):
        return len(self.targets)


class TrainShards(ShardSamples, SeededBatches):
    """Training samples, a batch at a time (a SeededBatches, as the JPEG cache's JpegImages): JPEG bytes, cropped and
    flipped from the per-sample seeds, decoded in the worker or, on_device, on the training device. With a transform
    (data.auto_augment or data.random_erase, which act per image), each image is decoded by PIL and transformed as
    an image file is, torch's generator seeded per sample as SeededSamples seeds it."""

    def __init__(self, split, cache, spec, seed=0, on_device=False, window=8, transform=None):
        super().__init__(split, cache, window)
        self.spec, self.seed, self.on_device, self.ahead = spec, seed, on_device, None  # ahead: (epoch, window)
        self.transform = transform
        self.windows = (self.shard_of, window, len(split.shards))  # for the sampler's order

    def read(self, ids, index):
        """A batch's (images, targets, sizes, scales) (see SeededBatches): JPEG bytes with the sizes the index holds
        (stored at their own size), or with a per-image transform the finished images."""
        self.read_ahead(int(index[0]))
        data = [self.image_bytes(int(i)) for i in index]
        targets = self.targets[torch.from_numpy(index)]
        if self.transform is not None:
            images = [self.seeded(int(i), lambda d=d: self.transform(decode(io.BytesIO(d)))) for d, i in zip(data, ids)]
            return torch.stack(images), targets, None, None
        blobs = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
        return blobs, targets, self.split.sizes[torch.from_numpy(index)], torch.ones(len(index), 2)

    def read_ahead(self, i):
        """On the cache's keeper, fetch the shards of the window after sample i's in the background (once a
        window)."""
        if not self.cache.keeper or not is_url(self.split.shards[0]["url"]):
            return
        order = shard_permutation(self.seed, self.epoch, len(self.split.shards))
        position = int((order == int(self.shard_of[i])).nonzero()[0, 0])
        following = position // self.window + 1
        if (self.epoch, following) == self.ahead:
            return
        self.ahead = (self.epoch, following)
        shards = [self.split.shards[int(s)] for s in order[following * self.window : (following + 1) * self.window]]
        threading.Thread(target=self.fetch_quietly, args=(shards,), daemon=True).start()

    def fetch_quietly(self, shards):
        """Fetch shards ahead; a failure is left to the read that needs the shard, which says it."""
        for shard in shards:
            with contextlib.suppress(Exception):
                self.cache.local(shard)


class ValShards(ShardSamples):
    """Validation (or evaluation) samples, one at a time: decoded (data/verify.py) and given the per-image path's
    transform, exactly as an image file of the folder layouts is."""

    def __init__(self, split, cache, transform):
        super().__init__(split, cache)
        self.transform = transform

    def __getitem__(self, i):
        data = self.image_bytes(i)
        try:
            image = decode(io.BytesIO(data))
        except UNREADABLE as e:
            url = self.split.shards[int(self.shard_of[i])]["url"]
            raise ImageError(f"data.name: {url}: image {i} is unreadable ({unreadable_reason(e)})") from None
        return (self.transform(image) if self.transform else image), int(self.targets[i])


def shard_cache(name, cache_dir="", budget_gb=0.0, then=RESUME, use_copies=False, hosts=(), keeper=True):
    """The node-local cache of data.name's shard set: data.cache_dir, or datasets/shard-cache/, then a folder per
    set (a digest of its location). A set behind a URL needs it writable, which is checked here, before any work.
    then, use_copies, hosts, keeper: see ShardCache."""
    root = Path(cache_dir) if cache_dir else DATASETS_DIR / "shard-cache"
    location = top_location(name) if is_url(name) else str(Path(top_location(name)).resolve())
    cache = ShardCache(root / hashlib.sha256(location.encode()).hexdigest()[:16], int(budget_gb * 1e9), then,
                       use_copies, hosts, keeper)
    if is_url(name):
        with cache.disk_errors():
            probe = cache.made_folder() / f".probe-{socket.gethostname()}-{os.getpid()}"
            probe.touch()
            probe.unlink()
    return cache


def check_options(cfg):
    """The data keys a shard set cannot take: it is its own storage, split and per-batch crop."""
    for key, off, why in (("cache", "none", "a shard set is read as it is stored"),
                          ("val_split", 0, "a shard set holds its own val split")):
        if cfg[key] != off:
            raise DatasetError(f"data.{key}={cfg[key]}: {why}; set data.{key}={off} with data.name={cfg.name}")


def shard_datasets(cfg, seed, spec, on_device, val_transform, keeper):
    """data.name's shard set as (TrainShards, ValShards), its train and val splits; keeper: see ShardCache."""
    check_options(cfg)
    hosts = list(cfg.shard_hosts)
    cache = shard_cache(cfg.name, cfg.cache_dir, cfg.shard_cache_gb, hosts=hosts, keeper=keeper)
    classes, splits = open_shard_set(cfg.name, cache, hosts=hosts)
    missing = [split for split in ("train", "val") if split not in splits]
    if missing:
        raise DatasetError(f"data.name: {top_location(cfg.name)}: no {' or '.join(missing)} split (it names "
                           f"{sorted(splits)})")
    check_budget(cfg, splits["train"])
    per_image = train_transforms(cfg) if cfg.auto_augment or cfg.random_erase else None
    train = TrainShards(splits["train"], cache, spec, seed, on_device and per_image is None, cfg.shard_window,
                        per_image)
    train.identity = {split: s.identity() for split, s in splits.items()}
    return train, ValShards(splits["val"], cache, val_transform)


def check_budget(cfg, split):
    """data.shard_cache_gb must hold two windows of the largest shards: the one read and the one fetched ahead."""
    if not cfg.shard_cache_gb or not is_url(split.shards[0]["url"]):
        return
    largest = sorted((s.get("filesize", 0) for s in split.shards), reverse=True)[: 2 * cfg.shard_window]
    if sum(largest) > cfg.shard_cache_gb * 1e9:
        raise DatasetError(f"data.shard_cache_gb={cfg.shard_cache_gb} holds fewer than two windows of "
                           f"data.shard_window={cfg.shard_window} shards ({size_text(sum(largest))}): raise it or "
                           f"lower data.shard_window")


def eval_shards(name, split, transform, classes, weights, cache_dir="", hosts=(), keeper=True):
    """The shard set's split that name (val.py's --data, or the checkpoint's data.name) names,
    labelled as a checkpoint's classes, which it must have. Only that split's index is read; with the server down,
    the copies of the top file and index that training (or an earlier val.py) kept in the node cache are read, so
    that the shards cached there, checked when fetched, are evaluated without it."""
    cache = shard_cache(name, cache_dir, then=RERUN, use_copies=True, hosts=hosts, keeper=keeper)
    set_classes, splits = open_shard_set(name, cache, only=split, hosts=hosts)
    if set_classes != list(classes):
        raise DatasetError(f"{top_location(name)}: its {len(set_classes)} classes are not the {len(classes)} classes "
                           f"{weights} was trained on")
    return ValShards(splits[split], cache, transform)


def check_same_shards(path, ckpt, train_set):
    """A resumed run's shard set must be the one its checkpoint trained on: the line names what changed."""
    saved, now = ckpt.get("data_identity"), getattr(train_set, "identity", None)
    if saved == now:
        return
    if saved is None or now is None:
        was, is_ = ("a shard set", "other data") if now is None else ("other data", "a shard set")
        raise DatasetError(f"{path}: trained on {was}, data.name names {is_}; resume with the same data")
    changes = []
    for split in sorted(set(saved) | set(now)):
        before, after = dict(map(tuple, saved.get(split, []))), dict(map(tuple, now.get(split, [])))
        changed = [n for n in before if n in after and before[n] != after[n]]
        gone, added = [n for n in before if n not in after], [n for n in after if n not in before]
        for what, names in (("changed", changed), ("removed", gone), ("added", added)):
            if names:
                changes.append(f"{split}: {len(names)} shard(s) {what} ({', '.join(names[:3])}"
                               f"{', ...' if len(names) > 3 else ''})")
    raise DatasetError(f"{path}: its shard set changed since it was trained: {'; '.join(changes)}; resume with the "
                       f"shards it trained on, or start a new run")


def describe(train_set, val_set):
    """The data line for a shard set."""
    fetched = is_url(train_set.split.shards[0]["url"])
    where = f"fetched into {short_path(train_set.cache.folder)}" if fetched else "read in place"
    return (f"{len(train_set.split.shards)} train shards and {len(val_set.split.shards)} val shards, {where}; "
            f"windows of data.shard_window={train_set.window} shards")
