"""Run train.py as torchrun's worker script and press Ctrl-C at a known point of the workers' start-up: once every
worker has reached it, rank 0 sends SIGINT to torchrun's process group, as the terminal does (torchrun passes it on).

    torchrun --nproc_per_node=N tests/startup_signal.py POINT DIR train.py ARGS...
    python tests/startup_signal.py POINT DIR train.py ARGS...      (one process: it sends SIGINT to itself)

POINT: import (as train.py begins to import torch, this driver having imported nothing of torch's) or setup (as the
workers join the process group). DIR: an empty folder where the workers meet.
"""

import importlib.abc
import os
import runpy
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK, WORLD_SIZE = int(os.getenv("RANK", 0)), int(os.getenv("WORLD_SIZE", 1))


def press_ctrl_c_when_all_here(meeting):
    """Every worker says it is here; rank 0, once all are, sends SIGINT to torchrun's process group. Each then waits
    for its signal (a handler that ends the process ends it here)."""
    (meeting / str(RANK)).touch()
    if RANK == 0:
        while len(list(meeting.iterdir())) < WORLD_SIZE:
            time.sleep(0.05)
        if os.getenv("TORCHELASTIC_RUN_ID"):
            os.killpg(os.getpgid(os.getppid()), signal.SIGINT)
        else:
            os.kill(os.getpid(), signal.SIGINT)
    for _ in range(600):  # a signal torchrun passes on arrives within moments; a held one lets the run go on
        time.sleep(0.05)
        if signal_held():
            return


def signal_held():
    """Whether this process's SIGINT handler (a StopVote's) has noted the signal."""
    vote = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
    return getattr(vote, "signal", None) is not None


class AtTorchImport(importlib.abc.MetaPathFinder):
    """Meets the other workers the first time torch is imported, then lets the import go on."""

    def __init__(self, meeting):
        self.meeting = meeting

    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            press_ctrl_c_when_all_here(self.meeting)
        return None


if __name__ == "__main__":
    point, meeting, script, *args = sys.argv[1:]
    sys.path.insert(0, str(ROOT))
    if point == "import":
        sys.meta_path.insert(0, AtTorchImport(Path(meeting)))
    else:
        import utils.distributed
        join = utils.distributed.setup_distributed

        def setup_distributed():
            press_ctrl_c_when_all_here(Path(meeting))
            join()
        utils.distributed.setup_distributed = setup_distributed
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
