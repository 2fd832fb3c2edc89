"""Random state: seeding every generator, and saving and restoring their states for an exact resume."""

import os
import random

import numpy as np
import torch

def rng_states():
    """This process's random generator states (python, numpy, torch CPU and CUDA) as plain, weights_only-safe values."""
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_states(states):
    """Restore states saved by rng_states()."""
    random.setstate((states["python"][0], tuple(states["python"][1]), states["python"][2]))
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"][: torch.cuda.device_count()])


def init_seeds(seed=0, deterministic=False):
    """Seed python, numpy and torch; optionally ask torch for deterministic kernels."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    torch.backends.cudnn.benchmark = not deterministic  # benchmark picks the fastest, not the same, kernels
    if deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # required by deterministic cuBLAS
        # warn_only: some CUDA kernels (e.g. adaptive pooling backward) have no deterministic version
        torch.use_deterministic_algorithms(True, warn_only=True)
