"""Process set-up: device choice, threads, seeds, version checks, mixed precision, run dirs."""

import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

import utils.torch_utils as tu
from conftest import ROOT, clean_env
from utils import distributed, general, precision, seeds
from utils.config import RecipeError, load_recipe
from utils.general import UsageError, increment_path


def test_auto_device_is_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tu.select_device("auto") == torch.device("cpu")
    for device in ("cuda", "0", 0, "cuda:1"):
        with pytest.raises(UsageError, match=f"^device='{device}' but CUDA is not available here; use device=cpu"):
            tu.select_device(device)


def test_cuda_device_follows_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert tu.select_device("auto", local_rank=3) == torch.device("cuda", 3)
    assert tu.select_device("cpu", local_rank=3) == torch.device("cpu")
    with pytest.raises(UsageError, match="LOCAL_RANK 4 needs GPU 4, but only 4"):
        tu.select_device("cuda", local_rank=4)


def test_a_gpu_index_picks_that_gpu_for_one_process_per_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for device, index in (("0", 0), (1, 1), ("cuda:1", 1), ("cuda:0", 0)):  # 1: OmegaConf's int from device=1
        assert tu.select_device(device, local_rank=0, local_world_size=1) == torch.device("cuda", index)
    with pytest.raises(UsageError, match=r"^device='2' but only 2 GPU\(s\) are visible here \(0 to 1\); choose one"):
        tu.select_device("2", local_world_size=1)
    with pytest.raises(UsageError, match=r"^--device='cuda:7' but only 2 GPU"):
        tu.select_device("cuda:7", key="--device", local_world_size=1)
    # Under torchrun with two processes here, each takes GPU LOCAL_RANK: one index for both is refused.
    assert tu.select_device("cuda", local_rank=1, local_world_size=2) == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="^device='cuda:1' names one GPU for the 2 processes on this machine; use "
                                         "device=cuda .* CUDA_VISIBLE_DEVICES$"):
        tu.select_device("cuda:1", local_rank=1, local_world_size=2)


@pytest.mark.parametrize("device", ["gpu", "0,1", "cuda:", "cuda:-1", "-1", "CPU", ""])
def test_a_device_that_is_none_of_the_choices_is_named(device):
    expected = f"--device must be auto, cpu, cuda, cuda:N or a GPU index N, got '{device}'"
    with pytest.raises(UsageError, match=f"^{re.escape(expected)}$"):
        tu.select_device(device, key="--device")


@pytest.mark.parametrize("current, minimum, pinned, expected", [
    ("2.4", "2.4", False, True), ("2.4.0", "2.4", True, True),  # equal, however many zeros
    ("2.3.1", "2.4", False, False), ("1.13.1", "2.4", False, False),  # older
    ("2.14.1", "2.4", False, True), ("10.0", "9.1", False, True),  # newer: compared as numbers, not as strings
    ("2.14.1+cu130", "2.4", False, True), ("2.14.1+cu130", "2.14.1", True, True),  # a local build is its release
    ("1.12.0+cu113", "1.12.0", True, True), ("2.4.0a0+3bcc3cd", "2.4", False, True),  # NVIDIA's containers' torch
    ("2.3.1+cpu", "2.4", False, False), ("1.12.1", "1.12.0", True, False), ("2.5.0", "2.4", True, False),
])
def test_check_version_compares_releases(current, minimum, pinned, expected):
    assert tu.check_version(current, minimum, pinned=pinned) is expected


def test_check_version_hard_names_the_package_the_version_found_and_the_one_required():
    assert tu.check_version("2.14.1+cu130", "2.4", "torch ", hard=True)
    with pytest.raises(UsageError, match=re.escape("torch 2.4 or newer is required, but torch 2.3.1+cpu is installed; "
                                                   "upgrade it (see requirements.txt)")):
        tu.check_version("2.3.1+cpu", "2.4", "torch ", hard=True)
    with pytest.raises(UsageError, match=re.escape("version 1.12.0 is required, but version 1.13.1 is installed; "
                                                   "install that version")):
        tu.check_version("1.13.1", "1.12.0", pinned=True, hard=True)


def test_train_and_val_refuse_a_torch_older_than_the_requirements(monkeypatch, tmp_path, capsys):
    import train
    import val

    assert f"torch>={tu.TORCH_MINIMUM}\n" in (ROOT / "requirements.txt").read_text()
    monkeypatch.setattr(torch, "__version__", "2.3.1+cu121")
    # Arguments that fail fast past the check: the version must be refused first.
    argv = {"train.py": ["--recipe", "cls.yaml", "optim.lrr=0.1", f"project={tmp_path}"],
            "val.py": ["--weights", str(tmp_path / "x.pt")]}
    for script, main in (("train.py", train.main), ("val.py", val.main)):
        with pytest.raises(SystemExit) as exit_info:
            main(argv[script])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == (f"{script}: error: torch 2.4 or newer is required, but torch 2.3.1+cu121 is "
                                           f"installed; upgrade it (see requirements.txt)\n")


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
    seeds.init_seeds(3)
    torch.save({"rng": seeds.rng_states()}, tmp_path / "rng.pt")
    expected = (random.random(), np.random.rand(), torch.rand(2))
    seeds.init_seeds(4)
    seeds.set_rng_states(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    again = (random.random(), np.random.rand(), torch.rand(2))
    assert again[:2] == expected[:2] and torch.equal(again[2], expected[2])


def test_rank0_errors_are_raised_as_one_shared_error():
    assert distributed.on_rank0(lambda: 7) == 7
    with pytest.raises(general.SharedError, match="disk full"):
        distributed.on_rank0(lambda: (_ for _ in ()).throw(OSError("disk full")))


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


def test_more_processes_than_cores_are_called_oversubscribed():
    before = torch.get_num_threads()
    try:
        threads, workers, why = tu.set_threads("auto", cores=2, procs_per_machine=4)  # torchrun, 4 processes on 2 cores
        assert (threads, workers) == (1, 0)
        assert why.endswith("; oversubscribed: 4 processes share this machine's 2 cores, each process a thread or "
                            "more (use --nproc_per_node=2 or fewer)")
        assert "oversubscribed" not in tu.set_threads("auto", cores=2, procs_per_machine=2)[2]
    finally:
        torch.set_num_threads(before)


def test_auto_workers_follow_the_data_path_and_device():
    before = torch.get_num_threads()
    try:
        assert tu.set_threads("auto", "memory", cores=8)[:2] == (8, 0)  # batches from memory: all compute
        assert tu.set_threads("auto", "bytes", "cuda", cores=8)[:2] == (6, 2)  # JPEG bytes, decoded on the GPU
        assert tu.set_threads("auto", device_type="cuda", cores=16, procs_per_machine=2)[:2] == (1, 7)
        assert tu.set_threads("auto", cores=8, procs_per_machine=2)[:2] == (2, 2)  # CPU, files: half and half
        one_core = [tu.set_threads("auto", feed, device, cores=2, procs_per_machine=2)
                    for feed in ("files", "bytes") for device in ("cpu", "cuda")]
        assert all(got[:2] == (1, 0) and "one core per process" in got[2] for got in one_core)
        threads, workers, why = tu.set_threads("auto", "memory", cores=4)
        assert "data.cache=ram" in why and torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)


def test_init_seeds_repeats_every_random_stream_and_asks_for_deterministic_kernels(monkeypatch):
    draws = lambda: (random.random(), np.random.rand(), torch.rand(1).item())
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored afterwards, as are the flags below
    flags = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark)
    try:
        seeds.init_seeds(5)
        first = draws()
        assert torch.backends.cudnn.benchmark and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
        seeds.init_seeds(5, deterministic=True)
        assert draws() == first
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cudnn.benchmark and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        seeds.init_seeds(6)
        assert all(a != b for a, b in zip(draws(), first))
    finally:
        torch.use_deterministic_algorithms(flags[0], warn_only=flags[1])
        torch.backends.cudnn.benchmark = flags[2]


def test_autocast_dtype_per_precision_and_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert precision.autocast_dtype("fp32", cpu) is None
    assert precision.autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(UsageError, match="fp16 needs a CUDA device"):
        precision.autocast_dtype("fp16", cpu)
    assert precision.autocast_dtype("fp16", cuda) is torch.float16


def test_auto_precision_is_bf16_only_where_the_hardware_computes_in_it(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    for amx, avx512_bf16, expected in ((True, False, "bf16"), (False, True, "bf16"), (False, False, "fp32")):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        assert precision.native_precision(cpu) == expected
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    for isa, expected in (("AVX2", "fp32"), ("avx512_core", "fp32"), ("AVX512_CORE_BF16", "bf16"),
                          ("AVX512_CORE_AMX", "bf16"), ("ALL", "bf16")):  # oneDNN held below bf16, or not
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
        assert precision.native_precision(cpu) == expected, isa
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported")  # a torch without the check: no bf16 assumed
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert precision.native_precision(cpu) == "fp32"
    for capability, expected in (((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 0), "fp16")):  # H100, A100, V100
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
        assert precision.native_precision(cuda) == expected
    monkeypatch.setattr(precision, "native_precision", lambda device: "bf16" if device.type == "cpu" else "fp16")
    assert precision.autocast_dtype("auto", cpu) is torch.bfloat16
    assert precision.autocast_dtype("auto", cuda) is torch.float16


def test_auto_settles_into_the_recipe_what_every_process_runs_and_the_model_gains_from(monkeypatch, log):
    from models import settle
    monkeypatch.setattr(precision, "native_precision", lambda device: "bf16")
    cfg = settle(load_recipe("cls.yaml"))
    assert (cfg.train.precision, cfg.train.channels_last) == ("bf16", True)
    assert ("train: auto: precision bf16 (the fastest this cpu trains in), channels_last true (a convolutional model)"
            in log.text)
    vit = settle(load_recipe("cls.yaml", ["model.name=vit_b_16", "data.img_size=32"]))
    assert vit.train.channels_last is False  # one convolution, the patch embedding
    asked = load_recipe("cls.yaml", ["train.precision=fp32", "train.channels_last=false"])
    assert settle(asked) == asked  # what the recipe says is kept
    # Processes whose devices differ (a job over machines with and without bf16 instructions) all train in fp32
    monkeypatch.setattr(precision, "gather_object", lambda native: ["bf16", "fp32"])
    log.clear()
    assert settle(load_recipe("cls.yaml")).train.precision == "fp32"
    assert "precision fp32 (the processes' devices differ: bf16, fp32)" in log.text
    # bf16 asked for where the CPU would emulate it: said, and kept
    monkeypatch.setattr(precision, "native_precision", lambda device: "fp32")
    log.clear()
    assert settle(load_recipe("cls.yaml", ["train.precision=bf16"])).train.precision == "bf16"
    assert ("train: precision bf16 on a cpu without AMX or AVX512-BF16 instructions (or ONEDNN_MAX_CPU_ISA below "
            "them): oneDNN emulates it, slower than fp32 (train.precision=auto picks fp32 here)") in log.text
    with pytest.raises(ValueError, match="train.channels_last='auto' is not settled"):
        tu.memory_format("auto")
    with pytest.raises(RecipeError, match="train.channels_last must be true, false or auto"):
        load_recipe("cls.yaml", ["train.channels_last=1"])


def test_grad_scaler_scales_the_loss_for_fp16_only():
    loss, cpu = torch.tensor(3.0), torch.device("cpu")
    assert precision.grad_scaler(cpu, None).scale(loss).item() == 3.0
    assert precision.grad_scaler(cpu, torch.bfloat16).scale(loss).item() == 3.0  # bf16 has fp32's range: nothing underflows
    assert precision.grad_scaler(cpu, torch.float16).scale(loss).item() == 3.0 * 2**16  # GradScaler's initial scale


def test_de_parallel_returns_plain_module():
    model = torch.nn.Linear(2, 2)
    assert tu.de_parallel(model) is model


def test_increment_path_claims_next_free_dir(tmp_path):
    assert increment_path(tmp_path / "exp", mkdir=True) == tmp_path / "exp"
    assert increment_path(tmp_path / "exp", mkdir=True) == tmp_path / "exp2"
    assert increment_path(tmp_path / "exp", mkdir=True) == tmp_path / "exp3"
    assert increment_path(tmp_path / "exp") == tmp_path / "exp4" and not (tmp_path / "exp4").exists()


def test_increment_path_separates_the_number_from_a_name_that_ends_in_a_digit(tmp_path):
    # adamw-0.0032 would read as a run with another learning rate
    runs = [increment_path(tmp_path / "adamw-0.003", mkdir=True) for _ in range(3)]
    assert runs == [tmp_path / "adamw-0.003", tmp_path / "adamw-0.003-2", tmp_path / "adamw-0.003-3"]
    assert all(run.is_dir() for run in runs)
    increment_path(tmp_path / "exp", mkdir=True)
    assert increment_path(tmp_path / "exp", mkdir=True) == tmp_path / "exp2"
    assert increment_path(tmp_path / "exp2") == tmp_path / "exp2-2"  # not exp22


def test_evaluation_falls_back_from_a_precision_the_device_cannot_run():
    cpu = torch.device("cpu")
    assert precision.inference_precision(None, "bf16", cpu) == ("bf16", torch.bfloat16)
    assert precision.inference_precision(None, "fp16", cpu) == ("fp32", None)  # trained on a GPU, evaluated on a CPU
    assert precision.inference_precision("fp32", "bf16", cpu) == ("fp32", None)
    with pytest.raises(UsageError, match="--precision=fp16 needs a CUDA device"):
        precision.inference_precision("fp16", "fp32", cpu)


def test_ema_follows_the_adjusted_decay_and_copies_during_warmup():
    model = torch.nn.Linear(3, 2)
    # torchvision's adjustment: alpha = (1 - decay) * global batch * steps between updates / epochs
    ema = tu.model_ema(model, decay=0.999, steps=4, global_batch=50, epochs=10)  # alpha = 0.001 * 50 * 4 / 10 = 0.02
    start = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    tu.update_ema(ema, model, warmup=True)  # the first update copies; in warmup, every update does
    assert torch.equal(ema.module.weight, model.weight)
    tu.update_ema(ema, model, warmup=False)
    with torch.no_grad():
        model.weight.add_(1.0)
    tu.update_ema(ema, model, warmup=False)
    expected = 0.98 * (start + 1) + 0.02 * (start + 2)
    torch.testing.assert_close(ema.module.weight, expected)
    assert not torch.equal(ema.module.weight, model.weight)
    assert tu.model_ema(model, 0.5, 32, 1024, 1).module is not model  # alpha capped at 1: a copy every update


def test_a_script_piped_into_a_reader_that_is_gone_goes_on_quietly_to_its_end(tmp_path):
    # `| true` reads nothing and is gone before the script writes (as `| head` is for the lines after its own):
    # logging printed a 'Logging error' and its stack for each line (predict.py's table, its last lines).
    (tmp_path / "say.py").write_text("import time\nfrom utils.general import LOGGER\ntime.sleep(0.3)\n"
                                     "for i in range(3):\n    LOGGER.info(f'line {i}')\nopen('done', 'w').close()\n")
    result = subprocess.run(["bash", "-o", "pipefail", "-c", f"'{sys.executable}' say.py | true"], cwd=tmp_path,
                            env={**clean_env(), "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, "") and (tmp_path / "done").exists()


def test_ctrl_c_ends_val_predict_and_export_with_one_line_and_code_130(tmp_path):
    # Each, run in turn in one interpreter as its own command line runs it, loads a checkpoint whose torch.load never
    # returns (a hung disk) and is stopped there by Ctrl-C. Python takes SIGINT as a terminal gives it
    # (pytest-xdist's workers ignore it, and their children inherit that).
    weights = tmp_path / "best.pt"
    torch.save({}, weights)
    commands = [["val.py"], ["predict.py", "--source", str(tmp_path)], ["export.py", "--format", "torchscript"]]
    hang = ("import runpy, signal, sys, time, torch\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "def hang(*args, **kwargs):\n    print('loading', flush=True)\n    time.sleep(60)\ntorch.load = hang\n"
            f"for command in {commands!r}:\n    sys.argv = [*command, '--weights', {str(weights)!r}]\n    try:\n"
            "        runpy.run_path(command[0], run_name='__main__')\n    except SystemExit as e:\n"
            "        print('exit', e.code, flush=True)\n")
    process = subprocess.Popen([sys.executable, "-c", hang], cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    said = []
    for _ in commands:
        said.append(process.stdout.readline())
        process.send_signal(signal.SIGINT)
        said.append(process.stdout.readline())
    _, err = process.communicate(timeout=60)
    assert said == ["loading\n", "exit 130\n"] * 3, err
    assert err == "".join(f"\n{command[0]}: stopped by Ctrl-C (SIGINT) before it finished\n" for command in commands)
