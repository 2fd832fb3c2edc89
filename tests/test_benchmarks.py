"""The benchmarks' own arithmetic and argument checks (their measurements are run by hand: benchmarks/README.md)."""

from benchmarks.digits_sweep import misses, tally
from conftest import run_python


def test_digits_sweep_counts_the_val_images_each_run_missed():
    assert [misses(top1) for top1 in (1.0, 359 / 360, 357 / 360, 356 / 360)] == [0, 1, 3, 4]
    assert tally([2, 0, 3, 2, 0, 2]) == "0 (2), 2 (3), 3 (1); mean 1.50"


def test_digits_sweep_refuses_a_recipe_override_taken_as_an_instruction_set():
    # One seed at one process: were it taken as an ISA, the sweep would be a single run, not 30.
    result = run_python("benchmarks/digits_sweep.py", "--seeds", "0", "--nprocs", "1", "--isas", "train.epochs=8")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == ("digits_sweep.py: error: --isas train.epochs=8: recipe overrides go "
                                              "before --isas or after --")
