"""Multi-process behaviour, launched with torchrun on 2 CPU processes (gloo)."""

import json

from conftest import run_torchrun


def test_uneven_shares_keep_ranks_identical_and_validation_exact(tmp_path):
    # 9 training samples, global batch 4: rank 0 takes 5 (3 steps), rank 1 takes 4 (2 steps); 7 val samples.
    out = tmp_path / "report.json"
    result = run_torchrun("tests/ddp_check.py", out, 9, 7, 4, 3)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rank0, rank1 = report["ranks"]
    assert sorted(rank0["train_share"] + rank1["train_share"]) == list(range(9))
    assert (len(rank0["train_share"]), len(rank1["train_share"])) == (5, 4)
    assert rank0["weights"] == rank1["weights"]  # bit-identical models after uneven epochs
    assert rank0["momentum"] == rank1["momentum"]  # and identical optimizer state
    assert rank0["lr"] == rank1["lr"]  # the short rank kept the schedule in step
    for metrics in (rank0["metrics"], rank1["metrics"]):
        assert metrics["val/samples"] == 7  # each val sample counted exactly once, none padded
        assert abs(metrics["val/top1"] - report["reference"]["val/top1"]) < 1e-12
        assert abs(metrics["val/loss"] - report["reference"]["val/loss"]) < 1e-6
