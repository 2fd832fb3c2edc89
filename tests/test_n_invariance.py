"""A recipe means the same run at any number of processes: one epoch at N=1, 2 and 3, whose last step is partial and
unevenly shared, on every data path (the shard set's served by a real HTTP server) and in bf16, step by step and in
the final weights, against the float rounding of computations equivalent to N=1's: one thread instead of two, and
each global batch in three micro-batches."""

import numpy as np
import pytest
from PIL import Image

from conftest import (AMPLIFICATION, ROUNDING_FLOOR, http_server, launch_n_invariance, rounding_tolerances, run_python,
                      run_weights, step_losses)

# data.cache: crops per batch on the device (two caches), or per image as loaded; the images as a shard set; and the
# RAM cache in bf16 and channels_last
PATHS = ("ram", "jpeg", "none", "shards")
EQUIVALENT = ("1, one thread", "1, accumulate 3")  # launch_n_invariance's computations equivalent to N=1's


def write_images(root):
    """37 training images of two sizes (smooth, so crops and flips change them) in 2 classes, and a small val set."""
    rng = np.random.default_rng(0)
    for split, n in (("train", 37), ("val", 6)):
        for i in range(n):
            h, w = (12, 12) if i % 3 else (10, 15)
            y, x = np.mgrid[:h, :w]
            phase = rng.uniform(0, 6.28, 3)
            pixels = np.stack([127 + 120 * np.sin(x / 2 + y * (i % 2) + p) for p in phase], -1).astype(np.uint8)
            folder = root / split / "ab"[i % 2]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(folder / f"{i:02d}.png")
    return root


def served_shards(base):
    """base/data (write_images) as a shard set of about 2 images a shard (19 training shards, read in windows of 2
    by the tests, so the order is regrouped window by window) under base/served/shards; returns base/served."""
    result = run_python("-m", "data.shards", base / "data", base / "served" / "shards", "--shard-size", "2KB")
    assert result.returncode == 0, result.stderr[-3000:]
    return base / "served"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{launch: project}: N=1 on two threads, on one and in three micro-batches, N=2 and N=3, each having trained
    every path."""
    base = tmp_path_factory.mktemp("n")
    data = write_images(base / "data")
    with http_server(served_shards(base)) as (url, _):
        return launch_n_invariance(base, data, f"shards={url}/shards")


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_two_and_three_processes_train_what_one_does_up_to_float_rounding(runs, path):
    reference = run_weights(runs["1"] / path)
    tolerance, _ = rounding_tolerances(runs, path)
    moved = (reference - run_weights(runs["1"] / ("none" if path == "ram" else "ram"))).abs().max().item()
    assert moved > 100 * tolerance  # the two paths' pixels differ (interpolation): a split batch would show as much
    for n in ("2", "3"):
        gap = (run_weights(runs[n] / path) - reference).abs().max().item()
        assert gap <= tolerance, f"N={n}: weights {gap:.2e} from N=1's, rounding {tolerance:.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("path", PATHS)
def test_every_process_count_takes_every_step_one_does_up_to_float_rounding(runs, path):
    reference = step_losses(runs["1"] / path)
    _, tolerance = rounding_tolerances(runs, path)
    assert sorted(reference) == [1, 2, 3, 4]  # every step, the last one too, which only rank 0 takes at N > 1
    other = step_losses(runs["1"] / ("none" if path == "ram" else "ram"))
    assert max(abs(other[s] - reference[s]) for s in reference) > 10 * tolerance  # as the weights' test
    for n in ("2", "3"):
        losses = step_losses(runs[n] / path)
        assert losses.keys() == reference.keys()
        gaps = [abs(losses[s] - reference[s]) for s in reference]
        assert max(gaps) <= tolerance, f"N={n}: step losses {gaps} from N=1's, rounding {tolerance:.2e}"


@pytest.mark.slow
def test_bf16_at_two_and_three_processes_stays_within_the_spread_of_bf16s_equivalent_computations(runs):
    # bf16 rounds each process's gradient to 8 bits before the all-reduce, so from step 2 on the runs carry bf16's
    # rounding (about 3e-3 in the weights, as far as bf16 is from fp32 and as far as the fp32 paths' pixels move
    # them), bounded as the other paths are, by the spread of equivalent computations in bf16. Step 1 starts from
    # the same weights everywhere: its loss agrees to fp32's rounding (crops seeded by rank miss it by 500x, the
    # final weights by 1.2x).
    weights, losses = run_weights(runs["1"] / "bf16"), step_losses(runs["1"] / "bf16")
    weights_tolerance, loss_tolerance = rounding_tolerances(runs, "bf16")
    first_step = AMPLIFICATION * max([abs(step_losses(runs[n] / "bf16")[1] - losses[1]) for n in EQUIVALENT] +
                                     [ROUNDING_FLOOR])
    bf16_moved = (weights - run_weights(runs["1"] / "ram")).abs().max().item()
    assert bf16_moved > 100 * rounding_tolerances(runs, "ram")[0]  # it computed in bf16, not as the fp32 run did
    assert sorted(losses) == [1, 2, 3, 4]
    for n in ("2", "3"):
        gaps = [abs(step_losses(runs[n] / "bf16")[s] - losses[s]) for s in losses]
        assert gaps[0] <= first_step, f"N={n}: step 1's loss {gaps[0]:.2e} from N=1's, rounding {first_step:.2e}"
        assert max(gaps) <= loss_tolerance, f"N={n}: step losses {gaps} from N=1's, bf16 rounding {loss_tolerance:.2e}"
        gap = (run_weights(runs[n] / "bf16") - weights).abs().max().item()
        assert gap <= weights_tolerance, f"N={n}: weights {gap:.2e} from N=1's, bf16 rounding {weights_tolerance:.2e}"
