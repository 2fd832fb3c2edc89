"""Process set-up: device choice, backend, threads, seeds, DDP version checks, mixed precision, run dirs."""

import pytest
import torch

import utils.torch_utils as tu
from utils.general import UsageError, increment_path


def test_auto_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tu.select_device("auto") == torch.device("cpu")
    with pytest.raises(UsageError, match="CUDA is not available"):
        tu.select_device("cuda")


def test_cuda_device_follows_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert tu.select_device("auto", local_rank=3) == torch.device("cuda", 3)
    assert tu.select_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(UsageError, match="LOCAL_RANK 4 needs GPU 4, but only 4"):
        tu.select_device("cuda", local_rank=4)


def test_backend_is_gloo_for_cpu_tensors_and_nccl_for_gpu_tensors():
    assert tu.distributed_backend(cuda_available=True) == "cpu:gloo,cuda:nccl"
    assert tu.distributed_backend(cuda_available=False) == "gloo"


def test_sync_bn_converts_batchnorm_on_several_gpus_and_refuses_cpu(monkeypatch):
    from models.convnet import ConvNet
    with pytest.raises(UsageError, match="model.sync_bn=true needs CUDA devices"):
        tu.sync_batchnorm(ConvNet(3, width=4), True, torch.device("cpu"))
    monkeypatch.setattr(tu, "WORLD_SIZE", 2)
    model = tu.sync_batchnorm(ConvNet(3, width=4), True, torch.device("cuda", 0))
    kinds = {type(m) for m in model.modules()}
    assert torch.nn.SyncBatchNorm in kinds and torch.nn.BatchNorm2d not in kinds
    assert tu.sync_batchnorm(model := ConvNet(3, width=4), False, torch.device("cuda", 0)) is model


def test_rng_states_survive_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np
    tu.init_seeds(3)
    torch.save({"rng": tu.rng_states()}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(2))
    tu.init_seeds(4)
    tu.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert again[:2] == expected[:2] and torch.equal(again[2], expected[2])


def test_rank0_errors_are_raised_as_one_shared_error():
    assert tu.on_rank0(lambda: 7) == 7
    with pytest.raises(tu.SharedError, match="disk full"):
        tu.on_rank0(lambda: (_ for _ in ()).throw(OSError("disk full")))


def test_threads_and_workers_never_oversubscribe_cores():
    before = torch.get_num_threads()
    try:
        assert tu.set_threads("4", cores=2, procs_per_machine=2)[:2] == (1, 0)  # torchrun, 2 processes on 2 cores
        assert tu.set_threads("4", cores=2, procs_per_machine=1)[:2] == (1, 1)
        assert tu.set_threads("0", cores=2, procs_per_machine=1)[:2] == (2, 0)
        assert tu.set_threads("2", cores=16, procs_per_machine=2)[:2] == (6, 2)
        assert torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)


def test_auto_workers_follow_the_data_path_and_device():
    before = torch.get_num_threads()
    try:
        assert tu.set_threads("auto", cached=True, cores=8)[:2] == (8, 0)  # batches from memory: all compute
        assert tu.set_threads("auto", device_type="cuda", cores=16, procs_per_machine=2)[:2] == (1, 7)
        assert tu.set_threads("auto", cores=8, procs_per_machine=2)[:2] == (2, 2)  # CPU, files: half and half
        assert tu.set_threads("auto", cores=2, procs_per_machine=2)[:2] == (1, 0)  # one core: it computes
        threads, workers, why = tu.set_threads("auto", cached=True, cores=4)
        assert "data.cache=ram" in why and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_init_seeds_repeats_random_streams():
    tu.init_seeds(5)
    a = torch.rand(3)
    tu.init_seeds(5)
    assert torch.equal(a, torch.rand(3))


def test_autocast_dtype_per_precision_and_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert tu.autocast_dtype("fp32", cpu) is None
    assert tu.autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(UsageError, match="fp16 needs a CUDA device"):
        tu.autocast_dtype("fp16", cpu)
    assert tu.autocast_dtype("fp16", cuda) is torch.float16


def test_auto_precision_is_bf16_only_where_the_hardware_computes_in_it(tmp_path, monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    (tmp_path / "amx").write_text("flags\t\t: fpu sse avx512f amx_bf16 amx_tile\n")
    (tmp_path / "avx512").write_text("flags\t\t: fpu sse avx512f avx512bw\n")
    assert tu.native_precision(cpu, tmp_path / "amx") == "bf16"
    assert tu.native_precision(cpu, tmp_path / "avx512") == "fp32"
    assert tu.native_precision(cpu, tmp_path / "missing") == "fp32"
    monkeypatch.setattr(tu, "native_precision", lambda device: "bf16" if device.type == "cpu" else "fp16")
    assert tu.autocast_dtype("auto", cpu) is torch.bfloat16 and tu.autocast_dtype("auto", cuda) is torch.float16
    for supported, precision in ((True, "bf16"), (False, "fp16")):
        monkeypatch.undo()
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: supported)
        assert tu.native_precision(cuda) == precision


def test_bf16_autocast_runs_matmuls_in_bf16_on_cpu():
    cpu = torch.device("cpu")
    with tu.autocast(cpu, torch.bfloat16):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    with tu.autocast(cpu, None):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32


def test_grad_scaler_only_for_fp16():
    assert not tu.grad_scaler(torch.device("cpu"), None).is_enabled()
    assert not tu.grad_scaler(torch.device("cpu"), torch.bfloat16).is_enabled()
    assert tu.grad_scaler(torch.device("cpu"), torch.float16)._enabled  # the object asks for scaling


def test_smart_ddp_refuses_torch_1_12_0(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "1.12.0+cu113")
    with pytest.raises(RuntimeError, match="1.12.0 .*issues/8395"):
        tu.smart_DDP(torch.nn.Linear(2, 2), torch.device("cpu"))


def test_de_parallel_returns_plain_module():
    model = torch.nn.Linear(2, 2)
    assert tu.de_parallel(model) is model


def test_increment_path_claims_next_free_dir(tmp_path):
    assert increment_path(tmp_path / "exp", mkdir=True) == tmp_path / "exp"
    assert increment_path(tmp_path / "exp", mkdir=True) == tmp_path / "exp2"
    assert increment_path(tmp_path / "exp", mkdir=True) == tmp_path / "exp3"
    assert increment_path(tmp_path / "exp") == tmp_path / "exp4" and not (tmp_path / "exp4").exists()


def test_evaluation_falls_back_from_a_precision_the_device_cannot_run():
    cpu = torch.device("cpu")
    assert tu.inference_precision(None, "bf16", cpu) == ("bf16", torch.bfloat16)
    assert tu.inference_precision(None, "fp16", cpu) == ("fp32", None)  # trained on a GPU, evaluated on a CPU
    assert tu.inference_precision("fp32", "bf16", cpu) == ("fp32", None)
    with pytest.raises(UsageError, match="--precision=fp16 needs a CUDA device"):
        tu.inference_precision("fp16", "fp32", cpu)


def test_ema_follows_the_adjusted_decay_and_copies_during_warmup():
    from train import update_ema

    model = torch.nn.Linear(3, 2)
    # torchvision's adjustment: alpha = (1 - decay) * global batch * steps between updates / epochs
    ema = tu.model_ema(model, decay=0.999, steps=4, global_batch=50, epochs=10)  # alpha = 0.001 * 50 * 4 / 10 = 0.02
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    update_ema(ema, model, warmup=True)  # the first update copies; in warmup, every update does
    assert torch.equal(ema.module.weight, model.weight)
    update_ema(ema, model, warmup=False)
    with torch.no_grad():
        model.weight.add_(1.0)
    update_ema(ema, model, warmup=False)
    expected = 0.98 * (start + 1) + 0.02 * (start + 2)
    torch.testing.assert_close(ema.module.weight, expected)
    assert not torch.equal(ema.module.weight, model.weight)
    assert tu.model_ema(model, 0.5, 32, 1024, 1).module is not model  # alpha capped at 1: a copy every update
