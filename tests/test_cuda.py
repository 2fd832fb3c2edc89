"""The CUDA lane: what only a GPU runs (fp16 with its GradScaler, bf16, channels_last with torch.compile, the stop
vote's pinned copy, a resume, JPEG decoding on the GPU, the batched crop and the side stream that prepares the next
batch, DDP). Skipped without a GPU; run with

    python -m pytest -m cuda
"""

import shutil

import pytest
import torch
from torch import nn

import train
from conftest import read_results, run_python, run_torchrun
from data.batches import batch_to, device_batches
from data.sources import build_datasets
from data.jpeg_cache import jpeg_datasets
from data.transforms import CropSpec, crop_batch, crop_spec, val_transforms
from models import settle
from test_cache import SIZES, data_cfg, ramp_folder
from test_crops import IMAGES, MORE, per_image
from utils.checkpoint import load_checkpoint
from utils.config import load_recipe
from utils.distributed import topology
from utils.precision import autocast_dtype
from utils.stopping import StopVote
from utils.torch_utils import de_parallel

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: python -m pytest -m cuda")]
GPU = torch.device("cuda", 0)
DIGITS = ["--recipe", "cls.yaml", "device=0", "train.epochs=2"]  # the default recipe, shortened


def digits_state(precision):
    cfg = settle(load_recipe("cls.yaml", [f"train.precision={precision}", "device=0"]))
    dtype = autocast_dtype(cfg.train.precision, GPU)
    return cfg, dtype, train.build_state(cfg, 10, GPU, dtype, steps=10)


def step(state, cfg, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(8, 3, 8, 8, generator=generator).to(GPU)
    targets = torch.randint(0, 10, (8,), generator=generator).to(GPU)
    return train.train_step(state, images, targets, nn.CrossEntropyLoss(reduction="sum"), dtype, cfg, 8)


def weights(state):
    return [p.detach().clone() for p in state.model.parameters()]


def test_fp16_scales_the_loss_and_skips_a_step_whose_gradients_overflow():
    cfg, dtype, state = digits_state("fp16")
    assert dtype is torch.float16 and state.scaler.is_enabled()
    before = weights(state)
    step(state, cfg, dtype)
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(state)))  # a normal step moves the weights
    state.scaler.update(2.0 ** 100)  # fp16 gradients of a loss scaled this much are inf
    before = weights(state)
    loss = step(state, cfg, dtype, seed=1)
    assert torch.isfinite(loss)
    assert all(torch.equal(a, b) for a, b in zip(before, weights(state)))  # the step was skipped
    assert state.scaler.get_scale() == 2.0 ** 99  # and the scale backed off


def test_bf16_trains_without_a_scaler():
    cfg, dtype, state = digits_state("bf16")
    assert dtype is torch.bfloat16 and not state.scaler.is_enabled()
    before = weights(state)
    assert torch.isfinite(step(state, cfg, dtype))
    assert any(not torch.equal(a, b) for a, b in zip(before, weights(state)))


def test_the_stop_vote_reads_its_flags_from_pinned_memory_one_step_later():
    with StopVote(GPU) as vote:
        assert vote.cast(torch.tensor(float("nan"), device=GPU), 3) == (False, None)
        assert vote.pending[1].device.type == "cpu" and vote.pending[1].is_pinned()
        vote.signal = 15
        assert vote.cast(torch.tensor(1.0, device=GPU), 4) == (False, 3)  # step 3's loss was not finite
        assert vote.count() == (True, None)  # the signal, voted at step 4


def test_channels_last_and_compile_train_the_digits(tmp_path, monkeypatch, log):
    steps = []  # per training step: the model it ran and whether its batch was channels_last
    train_step = train.train_step

    def recorded(state, images, *args):
        steps.append((state.model, images.is_contiguous(memory_format=torch.channels_last)))
        return train_step(state, images, *args)
    monkeypatch.setattr(train, "train_step", recorded)
    torch._dynamo.utils.counters.clear()
    best = train.main([*DIGITS, "train.channels_last=true", "train.compile=true", f"project={tmp_path}"])
    assert "1 process(es) on cuda," in log.text and best >= 0.95
    model = steps[0][0]
    assert isinstance(model, torch._dynamo.eval_frame.OptimizedModule) and all(nhwc for _, nhwc in steps)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # the steps ran through compiled graphs
    convs = [p for p in de_parallel(model).parameters() if p.dim() == 4]
    assert convs and all(p.is_cuda and p.is_contiguous(memory_format=torch.channels_last) for p in convs)


def test_a_run_stopped_mid_epoch_on_the_gpu_resumes_bit_identical(tmp_path):
    recipe = [*DIGITS, "train.batch_size=96", f"project={tmp_path}"]
    assert run_python("train.py", *recipe, "name=whole").returncode == 0
    result = run_python("tests/faults.py", "signal-at-step:5:SIGINT", "train.py", *recipe, "name=resumed")
    assert result.returncode == 130 and "Stopped at epoch 1" in result.stdout, result.stderr[-3000:]
    assert run_python("train.py", "--resume", str(tmp_path / "resumed")).returncode == 0
    whole, resumed = (load_checkpoint(tmp_path / name / "weights" / "last.pt")["model"] for name in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_gpu_decoding_of_the_jpeg_cache_matches_the_cpus(tmp_path):
    ramp_folder(tmp_path / "data", SIZES)
    shutil.copytree(tmp_path / "data" / "train", tmp_path / "data" / "val")
    cfg = data_cfg(img_size=16, scale=[0.25, 1.0], hflip=0.5, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    train_set, _ = jpeg_datasets(*build_datasets(tmp_path / "data", None, None), cfg, 3, val_transforms(cfg), GPU,
                                 topology())
    batch = train_set.__getitems__(range(len(SIZES)))
    assert isinstance(batch[0], tuple)  # packed bytes: auto decodes on the GPU
    on_gpu = batch_to(batch, GPU, crop_spec(cfg))[0]
    on_cpu = batch_to(batch, torch.device("cpu"), crop_spec(cfg))[0]
    assert on_gpu.device.type == "cuda" and on_gpu.shape == on_cpu.shape
    assert (on_gpu.cpu().float() - on_cpu.float()).abs().mean() < 1.5  # nvJPEG and libjpeg-turbo round differently


def test_the_jpeg_cache_decoded_on_the_gpu_trains_the_digits(tmp_path):
    result = run_python("train.py", *DIGITS, "data.cache=jpeg", f"data.cache_dir={tmp_path / 'cache'}",
                        f"project={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "decoded on the training device" in result.stdout
    assert float(read_results(tmp_path / "exp")[1][-1]["val/top1"]) >= 0.95


def test_two_processes_share_one_gpu_over_gloo(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARE_ONE_GPU_FOR_TESTS", "1")  # nccl refuses two ranks on one GPU
    result = run_torchrun("train.py", "--recipe", "cls.yaml", "device=cuda", "train.epochs=2", f"project={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es) on cuda," in result.stdout
    assert float(read_results(tmp_path / "exp")[1][-1]["val/top1"]) >= 0.95


def test_the_batched_crop_on_the_gpu_gives_the_cpus_pixels():
    spec, boxes = CropSpec(24, (0.08, 1.0), 0.5, 0), torch.tensor(MORE)
    on_gpu = crop_batch([image.to(GPU) for image in IMAGES], boxes.to(GPU), spec)
    assert on_gpu.is_cuda
    difference = (on_gpu.cpu().int() - per_image(IMAGES, boxes).int()).abs()
    assert difference.max() <= 1 and difference.float().mean() < 0.2


def test_batches_prepared_on_the_side_stream_are_the_batches_prepared_in_line(tmp_path):
    ramp_folder(tmp_path / "data", SIZES * 4)
    shutil.copytree(tmp_path / "data" / "train", tmp_path / "data" / "val")
    cfg = data_cfg(img_size=16, scale=[0.25, 1.0], hflip=0.5, cache="jpeg", cache_dir=str(tmp_path / "cache"))
    train_set, _ = jpeg_datasets(*build_datasets(tmp_path / "data", None, None), cfg, 3, val_transforms(cfg), GPU,
                                 topology())
    loader = [train_set.__getitems__(range(start, start + 8)) for start in range(0, len(SIZES) * 4, 8)]
    in_line = [batch_to(batch, GPU, crop_spec(cfg)) for batch in loader]
    ahead = []
    for images, targets in device_batches(loader, GPU, crop_spec(cfg)):
        torch.cuda._sleep(10**7)  # a long step on the training stream while the next batch is prepared
        ahead.append((images.clone(), targets.clone()))
    assert len(ahead) == len(in_line)
    assert all(torch.equal(a, b) and torch.equal(x, y) for (a, x), (b, y) in zip(ahead, in_line))
