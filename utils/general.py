"""General helpers shared by every script: paths, logging, the errors reported as one line, run directories."""

import contextlib
import gc
import logging
import os
import re
import shlex
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # repository root
DATASETS_DIR = ROOT / "datasets"  # digits/ (written on first use), cifar10/ and cifar100/ (see data/cifar.py)
# Set by torchrun; absent means one process.
RANK = int(os.getenv("RANK", 0))  # global rank
WORLD_SIZE = int(os.getenv("WORLD_SIZE", 1))  # processes in the whole job
LOCAL_RANK = int(os.getenv("LOCAL_RANK", 0))
LOCAL_WORLD_SIZE = int(os.getenv("LOCAL_WORLD_SIZE", 1))  # processes on this machine
MACHINE = int(os.getenv("GROUP_RANK", 0))  # this machine's number (torchrun's node rank)
RESTART_COUNT = int(os.getenv("TORCHELASTIC_RESTART_COUNT", 0))  # > 0: torchrun restarted the workers after a failure
MAX_RESTARTS = int(os.getenv("TORCHELASTIC_MAX_RESTARTS", 0))  # torchrun's --max-restarts
# Tests only: the processes on a machine share GPU 0 over gloo (nccl refuses two ranks on one GPU), so the CUDA test
# lane can run DDP on a machine with one GPU.
SHARE_ONE_GPU = os.getenv("SHARE_ONE_GPU_FOR_TESTS") == "1"
RUN_ID = os.getenv("TORCHELASTIC_RUN_ID")  # the torchrun job (--rdzv-id; with --standalone, one per launch)


class ConsoleHandler(logging.StreamHandler):
    """logging's StreamHandler, which goes on into /dev/null once the reader of its stream is gone
    (`predict.py ... | head -3`): the run finishes and saves its files, without a 'Logging error' per line."""

    def handleError(self, record):
        if isinstance(sys.exc_info()[1], BrokenPipeError):
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, self.stream.fileno())  # also for the interpreter's last flush
                os.close(devnull)
                return
            except (OSError, ValueError):  # a stream without a file descriptor
                pass
        super().handleError(record)


def set_logging(name="cls"):
    """Return a logger that prints plain messages on rank 0 and only warnings elsewhere."""
    logger = logging.getLogger(name)
    if not logger.handlers:
        handler = ConsoleHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if RANK == 0 else logging.WARNING)
    return logger


LOGGER = set_logging()


def before_imports(quiet_interrupt=False):
    """Called by a script run as a command, before it imports torch: no garbage collection until after_imports.
    The imports make about 350,000 objects (torch, torchvision and torch._dynamo, which torchvision imports), every
    one of them alive until the process ends, and each collection on the way traverses those made so far for
    nothing: 0.6 s of the process's CPU. quiet_interrupt (train.py, until its StopVote takes the signal over):
    Ctrl-C (SIGINT) while the process starts (importing torch takes seconds) ends it at once (end_on_interrupt), not
    with a KeyboardInterrupt traceback from every process."""
    gc.disable()
    if quiet_interrupt:
        signal.signal(signal.SIGINT, end_on_interrupt)


def after_imports():
    """After a script's imports (before_imports): the objects alive now move to where no collection looks (gc.freeze),
    so that neither the collections while it runs nor the one at its exit (0.8 s of CPU) traverse them again, and a
    DataLoader worker forked later does not copy the pages a traversal would write to; collection resumes for the
    objects made from here on. The imports' few thousand garbage objects are kept with them (a few MB)."""
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def quiet_ctrl_c(script):
    """For val.py, predict.py and export.py: Ctrl-C ends the command with one line and code 130 (128 + SIGINT), as
    train.py's does, not with a KeyboardInterrupt traceback (from every process, under torchrun)."""
    try:
        yield
    except KeyboardInterrupt:
        if LOCAL_RANK == 0:
            print(f"\n{script}: stopped by Ctrl-C (SIGINT) before it finished", file=sys.stderr, flush=True)
        sys.exit(128 + signal.SIGINT)


def end_on_interrupt(signum, frame=None):
    """End this process on a stop signal that came before training started: code 128 + its number and one line on
    each machine, as a later Ctrl-C is said (torchrun passes the signal on to every process)."""
    if LOCAL_RANK == 0:
        print(f"\n{signal.Signals(signum).name}: stopped while starting, before any training; nothing was saved",
              file=sys.stderr, flush=True)
    os._exit(128 + signum)  # not SystemExit: it would unwind a half-done import or collective, with errors of its own


class UsageError(ValueError):
    """Bad input (recipe, data, device): reported as one line naming what is wrong, exit code 2."""


class SharedError(UsageError):
    """An error every rank raises together (a bad recipe, or one rank 0 met and shared): reported once."""


class DatasetError(SharedError):
    """A dataset that cannot be used, with a message naming the path and what is wrong (the same on every rank)."""


class ImageError(UsageError):
    """An image that cannot be read, met by the one rank (or DataLoader worker) that loads it."""


def error_line(error):
    """The one-line message of an error; for one re-raised from a DataLoader worker (whose message is the worker's
    whole traceback), the original message at its end."""
    text = str(error).strip()
    if "Original Traceback" in text:
        text = text.splitlines()[-1].split(": ", 1)[-1]  # 'utils.general.DatasetError: <message>'
    return text


def in_flags(message, flags):
    """message with the recipe keys it names written as a command's flags set them, for a command that shares
    train.py's data code but not its key=value: with flags {'data.val_split': '--val-split', 'data.name': 'SRC'},
    data.val_split=0.2 -> --val-split 0.2, data.csv_allow_outside=true -> --csv-allow-outside (a switch),
    data.name=DIR -> DIR (a positional argument), data.name -> SRC."""
    def written(match):
        flag, value = flags[match["key"]], match["value"]
        if value is None:
            return flag
        if not flag.startswith("-"):  # a positional argument: its value alone
            return value
        return flag if value == "true" else f"{flag} {value}"
    keys = "|".join(map(re.escape, flags))
    return re.sub(rf"(?<![\w.])(?P<key>{keys})(?![\w.])(?:=(?P<value>[^\s;,)]+))?", written, message)


def script(name):
    """How a command this project prints names its script `name` (val.py): beside the script this process was
    launched as, written as that one was (train.py, ../cls/train.py), so that the command works as typed where the
    user launched; else its path from here."""
    beside = Path(sys.argv[0]).parent / name
    return shlex.quote(str(beside if beside.is_file() else short_path(ROOT / name)))


def short_path(path):
    """path relative to the current directory when it lies inside it (as a user would type it), else as given (a URL
    too)."""
    if "://" in str(path):
        return path
    path = Path(path)
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def colorstr(*args):
    """Colour a string for the terminal: colorstr('blue', 'bold', 'text'); plain when stdout is not a TTY."""
    *styles, text = args if len(args) > 1 else ("blue", "bold", args[0])
    if not sys.stdout.isatty():
        return text
    codes = {"black": 30, "red": 31, "green": 32, "yellow": 33, "blue": 34, "magenta": 35, "cyan": 36,
             "white": 37, "bold": 1, "underline": 4}
    return "".join(f"\033[{codes[s]}m" for s in styles) + text + "\033[0m"


def increment_path(path, mkdir=False):
    """First free one of path, path2, path3, ... (runs/train/exp -> runs/train/exp2), or of path, path-2, ... where
    path ends in a digit (adamw-0.003 -> adamw-0.003-2); mkdir=True also claims it, so two runs started at once
    never share a directory."""
    path, n = Path(path), 1
    separator = "-" if path.name[-1:].isdigit() else ""  # adamw-0.0032 would read as another learning rate
    while True:
        candidate = path if n == 1 else Path(f"{path}{separator}{n}")
        n += 1
        if candidate.exists():
            continue
        if not mkdir:
            return candidate
        try:
            candidate.mkdir(parents=True)
            return candidate
        except FileExistsError:  # another run claimed it between our check and mkdir
            continue


def cpu_count():
    """Number of cores this process may run on (respects taskset and container CPU sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS and Windows
        return os.cpu_count() or 1


def format_table(header, rows):
    """Rows of cells as aligned text columns under a header: the first column left-aligned, the others right."""
    cells = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def save_probabilities(path, files, classes, probs, labels=None):
    """probabilities.csv of val.py and predict.py --save-probs: per image its file, with labels its true label(s)
    ('|'-separated, as a training CSV lists them), then its probability of each class, a column per class; probs: an
    (N, C) tensor or array of floats, as many rows as files."""
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:  # class names in any script
        writer = csv.writer(f)
        writer.writerow(["file", *([] if labels is None else ["labels"]), *classes])
        for i, (file, row) in enumerate(zip(files, probs.tolist())):
            writer.writerow([file, *([] if labels is None else [labels[i]]), *(f"{p:.9g}" for p in row)])
