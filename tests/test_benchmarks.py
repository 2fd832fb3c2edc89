"""The benchmarks' own arithmetic and argument checks (their measurements are run by hand: benchmarks/README.md)."""

import pytest

from benchmarks.digits_sweep import misses, tally
from benchmarks.scale import (IMAGENET, IMAGENET_VAL, cache_write_estimates, fit, memory_estimates, startup_estimates,
                              verdict)
from conftest import run_python

TOTAL = IMAGENET + IMAGENET_VAL
LABELS = ["N=1", "N=2", "N=4"]
# benchmarks/README.md's scale.py run, by launch shape: launch to the first step (s) at 5,000 and 20,000 images, cache
# present; at 20,000 the listing and the cache's checks (s), and the cache's write: train s, val img/s per core; own
# memory (MB) once built and at the end, at 5,000 and 20,000.
RECORDED = {"N=1": {"first_step": (10.0, 8.6), "listing": 0.06, "checks": 0.208, "write": (43.9, 191),
                    "built_anon": (399, 406), "anon": (489, 581)},
            "N=2": {"first_step": (10.3, 10.0), "listing": 0.11, "checks": 0.104, "write": (41.0, 147),
                    "built_anon": (399, 407), "anon": (544, 580)},
            "N=4": {"first_step": (12.6, 13.4), "listing": 0.26, "checks": 0.0624, "write": (39.9, 168),
                    "built_anon": (400, 407), "anon": (489, 517)}}


def recorded_results():
    """The recorded figures as scale.py's Bench.results: {(launch shape, size, data.cache): summary}."""
    results = {}
    for label, r in RECORDED.items():
        for k, size in enumerate((5000, 20000)):
            results[(label, size, "jpeg")] = {"first_step": r["first_step"][k], "images": size, "val": size // 25,
                                              "built_anon": r["built_anon"][k] * 1e6, "anon": r["anon"][k] * 1e6,
                                              "listing": r["listing"] if size == 20000 else None,
                                              "checks": r["checks"]}
        train_s, val_rate = r["write"]
        results[(label, 20000, "jpeg write")] = {"images": 20000, "val": 800, "write_train": train_s,
                                                 "write_val": 800 / (val_rate * 2)}
    return results


def test_digits_sweep_counts_the_val_images_each_run_missed():
    assert [misses(top1) for top1 in (1.0, 359 / 360, 357 / 360, 356 / 360)] == [0, 1, 3, 4]
    assert tally([2, 0, 3, 2, 0, 2]) == "0 (2), 2 (3), 3 (1); mean 1.50"


def test_digits_sweep_refuses_a_recipe_override_taken_as_an_instruction_set():
    # One seed at one process: were it taken as an ISA, the sweep would be a single run, not 30.
    result = run_python("benchmarks/digits_sweep.py", "--seeds", "0", "--nprocs", "1", "--isas", "train.epochs=8")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == ("digits_sweep.py: error: --isas train.epochs=8: recipe overrides go "
                                              "before --isas or after --")


def test_scale_fits_through_three_sizes_with_their_residuals_and_takes_the_steepest_line_as_the_worst():
    line = fit([(20000, 10.6), (5000, 10.0), (10000, 9.0), (40000, None)])  # a launch that failed has no figure
    assert line.points == [(5000, 10.0), (10000, 9.0), (20000, 10.6)]
    assert (round(line.a, 2), round(line.b * 1e6, 2), round(line.at(TOTAL))) == (9.2, 57.14, 85)
    assert line.spread(lambda r: f"{r:+.1f} s", lambda b: f"{b * 1e6:.1f} us") == (
        "residuals +0.5 s/-0.8 s/+0.3 s; slopes between consecutive sizes -200.0 us to 160.0 us an image")
    assert round(line.highest(TOTAL)) == 220  # 9.0 s + 160 us x (1,331,167 - 10,000): the steepest pair's line
    assert "no spread" in fit([(5000, 10.0), (20000, 8.6)]).spread(str, str)
    assert fit([(5000, 10.0), (5000, 9.0), (20000, None)]) is None


def test_scale_start_up_verdict_on_the_recorded_figures_is_the_worst_estimate_over_n_and_ways():
    estimates = startup_estimates(recorded_results(), LABELS, [5000, 20000], TOTAL)
    assert {name: round(value, 1) for name, value in estimates.items()} == {
        "N=1, fitted": 10.0, "N=1, by stage": 25.5,  # a falling line (-93 us an image) is never below what was measured
        "N=2, fitted": 10.3, "N=2, by stage": 23.5, "N=4, fitted": 83.3, "N=4, by stage": 33.7}
    worst, name, said = verdict(estimates, 60)
    assert (round(worst), name, said) == (83, "N=4, fitted", "NOT MET")  # not the 24 s the README's headline took


def test_scale_memory_and_cache_write_verdicts_on_the_recorded_figures_take_the_worst_column_and_rate():
    growth = memory_estimates(recorded_results(), LABELS, [5000, 20000], TOTAL)
    assert {name: round(value / 1e6) for name, value in growth.items()} == {
        "N=1, own, built": 619, "N=1, own, at end": 8134, "N=2, own, built": 707, "N=2, own, at end": 3183,
        "N=4, own, built": 619, "N=4, own, at end": 2476}  # over the smallest size's: what the data's size adds
    assert verdict(growth, 100e6)[1:] == ("N=1, own, at end", "NOT MET")
    seconds = cache_write_estimates(recorded_results(), LABELS, 20000, disk_gbs=2.0, cores=2)
    assert {name: round(value, 1) for name, value in seconds.items()} == {"N=1": 92.0, "N=2": 87.4, "N=4": 84.5}
    assert verdict(seconds, 120)[1:] == ("N=1", "met")  # the slowest rate measured, not the best


@pytest.mark.slow
def test_gpu_crops_times_both_crops_and_finds_their_pixels_within_a_grey_level():
    result = run_python("benchmarks/gpu.py", "--crops", "--images", "24", "--batch", "12", "--rounds", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("  cpu")]
    assert [line[1:3] for line in lines] == [["per", "image"], ["batched", "(resized_crops,"], ["pixels", "apart:"]]
    assert "at most 1 grey level(s)" in result.stdout or "at most 0 grey level(s)" in result.stdout
