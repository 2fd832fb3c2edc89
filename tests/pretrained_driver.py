"""Run train.py with models.pretrained's download replaced (these machines have no internet), recording which process
downloads and which read the cache, for the tests of weights by name under torchrun:

    python tests/pretrained_driver.py RECORD SOURCE train.py ARGS...     (or as the script torchrun launches)

The stand-in download appends 'download RANK LOCAL_RANK URL HASH_PREFIX' to RECORD, waits two seconds (a rank that
did not wait for it would look for the file meanwhile, and not find it), then copies SOURCE into place as fetch_url
does: a temporary file renamed. SOURCE 'offline' fails as urllib does without a network. Each read of a cached
weights file appends 'read RANK PATH'.
"""

import os
import shutil
import sys
import time
import urllib.error
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from utils.general import LOCAL_RANK, RANK, after_imports, before_imports  # noqa: E402

before_imports()  # as train.py starts as a command

import models.pretrained  # noqa: E402
import train  # noqa: E402

record, source = Path(sys.argv[1]), sys.argv[2]

def note(line):
    with open(record, "a") as f:  # one short write per line: the ranks' lines do not interleave
        f.write(line + "\n")

def download(url, dst, hash_prefix, report):
    note(f"download {RANK} {LOCAL_RANK} {url} {hash_prefix}")
    if source == "offline":
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")
    time.sleep(2)
    shutil.copy(source, f"{dst}.partial")
    os.replace(f"{dst}.partial", dst)

def read(path, *args, **kwargs):
    note(f"read {RANK} {path}")
    return load_checkpoint(path, *args, **kwargs)

load_checkpoint = models.pretrained.load_checkpoint
models.pretrained.fetch_url = download
models.pretrained.load_checkpoint = read
after_imports()
train.main(sys.argv[4:])
