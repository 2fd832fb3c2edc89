"""Multi-process behaviour, launched with torchrun on 2 CPU processes (gloo)."""

import json

import pytest
import torch

from conftest import run_torchrun
from data.sampler import DistributedShuffleSampler
from ddp_check import CASES, TECHNIQUES, run_technique


@pytest.fixture(scope="module")
def uneven_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "report.json"
    result = run_torchrun("tests/ddp_check.py", out, 7, 3)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)))
def test_uneven_shares_keep_ranks_identical_and_validation_exact(uneven_report, case):
    # Rank 0 holds one sample more than rank 1, which runs out one step earlier: after its 1st, 2nd or 5th step;
    # the last case all-reduces in bf16 (a comm hook) and accumulates gradients over 2 micro-batches.
    n_train, batch, _ = CASES[case]
    rank0, rank1 = uneven_report["uneven"][case]["ranks"]
    assert sorted(rank0["train_share"] + rank1["train_share"]) == list(range(n_train))
    most, fewest = rank0["steps"]
    assert most == fewest + 1 and fewest == [1, 2, 5, 2][case]
    assert rank0["weights"] == rank1["weights"]  # bit-identical models after uneven epochs
    assert rank0["momentum"] == rank1["momentum"]  # and identical optimizer state
    assert rank0["lr"] == rank1["lr"]  # the short rank kept the schedule in step
    assert rank0["scaler"] == rank1["scaler"] and rank0["scaler"]["scale"] > 65536  # and the loss scale
    for metrics in (rank0["metrics"], rank1["metrics"]):
        assert metrics["val/samples"] == 7  # each val sample counted exactly once, none padded
        assert abs(metrics["val/top1"] - uneven_report["uneven"][case]["reference"]["val/top1"]) < 1e-12
        assert abs(metrics["val/loss"] - uneven_report["uneven"][case]["reference"]["val/loss"]) < 1e-6
        # The reference's counts are those of both ranks evaluating the whole set: twice the true ones.
        assert [[2 * n for n in row] for row in metrics["confusion"]] == uneven_report["uneven"][case]["reference"]["confusion"]
        assert [[2 * n for n in row] for row in metrics["class_counts"]] == \
            uneven_report["uneven"][case]["reference"]["class_counts"]


@pytest.mark.slow
def test_accumulation_all_reduces_once_per_step_and_matches_larger_micro_batches(uneven_report):
    two_processes = uneven_report["techniques"]["accumulate"]
    assert two_processes["steps"] == 2 * 3  # 20 images in global batches of 8: 3 steps per epoch
    # One all-reduce (one bucket, this small model) per optimizer step, not per micro-batch: no_sync() held.
    assert two_processes["all_reduces"] == two_processes["steps"]
    assert uneven_report["techniques"]["plain"]["all_reduces"] == two_processes["steps"]
    # 2 processes x 2 micro-batches of 2 take the same steps as 1 process with whole batches of 8.
    one_process = run_technique([])
    assert torch.allclose(torch.tensor(two_processes["weights"]), torch.tensor(one_process["weights"]), atol=1e-6)


@pytest.mark.slow
def test_mixup_cutmix_and_repeats_give_the_same_run_at_one_and_two_processes(uneven_report):
    two_processes = torch.tensor(uneven_report["techniques"]["mix_and_repeats"]["weights"])
    one_process = run_technique(TECHNIQUES["mix_and_repeats"])
    assert torch.allclose(two_processes, torch.tensor(one_process["weights"]), atol=1e-6)
    unmixed = torch.tensor(run_technique(["data.repeats=2"])["weights"])
    assert (two_processes - unmixed).abs().max() > 1e-4  # the mixing itself took effect (100x the tolerance)


@pytest.mark.slow
def test_the_ram_caches_per_batch_crops_give_the_same_run_at_one_and_two_processes(uneven_report):
    two_processes = torch.tensor(uneven_report["techniques"]["plain"]["weights"])
    one_process = run_technique(TECHNIQUES["plain"])  # cls.yaml: data.cache=ram, random crops over data.scale
    assert torch.allclose(two_processes, torch.tensor(one_process["weights"]), atol=1e-6)
    uncropped = torch.tensor(uneven_report["techniques"]["per_image"]["weights"])  # tensors, no transforms
    assert (two_processes - uncropped).abs().max() > 1e-3  # the crops took effect


def test_every_rank_splits_a_step_into_as_many_micro_batches():
    # 9 images in global batches of 6 on 3 processes, in pairs: the last step holds 2, 1 and 0 images per rank.
    # With join() on, every forward is a collective, so the ranks that take it must agree on the count.
    samplers = [DistributedShuffleSampler(9, r, 3, batch_size=6, group=2) for r in range(3)]
    assert [s.step_share(1, r) for r, s in enumerate(samplers)] == [2, 1, 0]
    assert {s.micro_batches(1, 2) for s in samplers} == {1}
    assert {s.micro_batches(0, 2) for s in samplers} == {2}


def bf16_hook_mean(local_gradients):
    """What bf16_compress_hook all-reduces 2 ranks' gradients to: each rounded to bf16 and halved, summed in bf16."""
    halves = [torch.tensor(g).float().bfloat16() / 2 for g in local_gradients]
    return (halves[0] + halves[1]).float()


@pytest.mark.slow
def test_bf16_comm_hook_steps_with_the_bf16_rounded_mean_gradient(uneven_report):
    plain, bf16 = uneven_report["ddp_options"]["defaults"], uneven_report["ddp_options"]["bf16"]
    reference = bf16_hook_mean([rank["local"] for rank in bf16])
    for rank in bf16:
        assert torch.equal(torch.tensor(rank["grads"]).float(), reference)  # bit for bit, on every rank
        # Plain SGD: the weights moved by lr times that gradient, up to fp32 rounding.
        stepped = torch.tensor(rank["before"]).float() - rank["lr"] * reference
        assert (torch.tensor(rank["after"]).float() - stepped).abs().max() < 1e-7
    # The defaults step with the fp32 mean; bf16's weights differ from theirs by a little, not by nothing.
    mean = (torch.tensor(plain[0]["local"]) + torch.tensor(plain[1]["local"])) / 2
    assert torch.allclose(torch.tensor(plain[0]["grads"]), mean, rtol=1e-6, atol=1e-9)
    moved = (torch.tensor(bf16[0]["after"]) - torch.tensor(plain[0]["after"])).abs().max()
    assert 1e-6 < moved < 1e-3


@pytest.mark.slow
def test_bucket_size_and_gradient_views_leave_the_step_bit_identical(uneven_report):
    defaults, options = uneven_report["ddp_options"]["wide_defaults"], uneven_report["ddp_options"]["wide_buckets"]
    for rank, default in zip(options, defaults):
        assert default["all_reduces"] == 2  # torch's own default: a first bucket of 1 MB, then the rest (25 MB)
        assert rank["all_reduces"] > default["all_reduces"]  # the options took effect: more, smaller buckets
        assert rank["grad_views"] and not default["grad_views"]
        assert rank["grads_sha"] == default["grads_sha"] and rank["after_sha"] == default["after_sha"]


def test_processes_share_one_gpu_over_gloo_only_when_a_test_asks():
    from utils.distributed import distributed_backend

    assert distributed_backend(True) == "cpu:gloo,cuda:nccl"  # SHARE_ONE_GPU_FOR_TESTS is not set here
    assert distributed_backend(True, share_one_gpu=True) == "gloo"
    assert distributed_backend(False) == "gloo"
