"""Weights by name (models/pretrained.py): torchvision's names and the cache file torch.hub reads; the download,
replaced here (no internet), once per machine under torchrun and nothing half-written when it fails; the
preprocessing that follows the weights; and fine-tuning: the pretrained part's learning rate, and its frozen first
epochs, which resume exactly."""

import contextlib
import email.message
import importlib.machinery
import re
import socket
import sys
import threading
import time
import types
import urllib.error

import pytest
import torch
import torchvision
from omegaconf import OmegaConf

import models.pretrained
import train
import utils.download
from conftest import console_lines, make_image_folder, read_results, run_python, run_torchrun
from models import build_model, head_keys, start_from
from models.pretrained import (cache_path, fine_tuning, follow_weights, torchvision_weights, weights_kind,
                               weights_preprocessing)
from test_download import byte_at_a_time
from utils.checkpoint import load_checkpoint
from utils.config import IMAGENET_MEAN, IMAGENET_STD, ModelConfig, OptimConfig, SchedConfig, load_recipe
from utils.general import SharedError, UsageError
from utils.optim import build_optimizer, build_scheduler, stepped_parameters

RESNET18 = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
URL = "https://download.pytorch.org/models/resnet18-f37072fd.pth"


@pytest.fixture
def torch_home(tmp_path, monkeypatch):
    """An empty TORCH_HOME; returns the file torchvision's resnet18 IMAGENET1K_V1 weights are cached as in it."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"


def resnet18_state(seed=0):
    """A state_dict of torchvision's resnet18 as its file holds it (1,000 classes), of seeded random weights."""
    torch.manual_seed(seed)
    return torchvision.models.resnet18().state_dict()


def model_cfg(**kw):
    return OmegaConf.structured(ModelConfig(**kw))


def test_names_resolve_to_torchvision_weights_and_a_wrong_one_lists_those_there_are():
    assert weights_kind("resnet18", "DEFAULT") == weights_kind("resnet18", "IMAGENET1K_V1") == "torchvision"
    assert weights_kind("resnet18", "resnet18.pth") == weights_kind("resnet18", "runs/exp/weights/best.pt") == "file"
    assert weights_kind("timm/resnet18", "a1_in1k") == weights_kind("timm/resnet18", "DEFAULT") == "timm"
    assert weights_kind("timm/resnet18", "resnet18.pth") == "file" and weights_kind("resnet18", "") is None
    assert torchvision_weights("resnet18", "DEFAULT") is RESNET18
    assert torchvision_weights("resnet50", "IMAGENET1K_V2") is torchvision.models.ResNet50_Weights.IMAGENET1K_V2
    with pytest.raises(SharedError, match=r"^model.weights='IMAGENET1K_V2': torchvision has no such weights for "
                                          r"resnet18; it has IMAGENET1K_V1, DEFAULT$"):
        torchvision_weights("resnet18", "IMAGENET1K_V2")
    with pytest.raises(SharedError, match=r"model.name='convnet' has no torchvision weights by name; give a local"):
        torchvision_weights("convnet", "DEFAULT")


def test_the_cache_path_is_the_file_torchvision_reads(torch_home):
    assert cache_path(RESNET18) == torch_home
    torch_home.parent.mkdir(parents=True)
    torch.save(resnet18_state(), torch_home)
    # torchvision's own loader finds it there and downloads nothing (it has no internet here): the same file
    loaded = RESNET18.get_state_dict(progress=False)
    assert all(torch.equal(loaded[k], v) for k, v in resnet18_state().items())


def test_the_download_happens_once_into_the_cache(torch_home, monkeypatch, log):
    calls = []

    def download(url, dst, hash_prefix, report):  # fetch_url, with the network replaced
        calls.append((url, str(dst), hash_prefix))
        torch.save(resnet18_state(), dst)
    monkeypatch.setattr(models.pretrained, "fetch_url", download)
    model = build_model(model_cfg(name="resnet18"), 3)
    start_from(model, model_cfg(name="resnet18", weights="DEFAULT"), 3)
    assert calls == [(URL, str(torch_home), "f37072fd")]  # the checksum torch.hub checks: the name's hash prefix
    assert f"model: downloading ResNet18_Weights.IMAGENET1K_V1 from {URL} to {torch_home}" in log.text
    assert f"model: loaded ResNet18_Weights.IMAGENET1K_V1 from {torch_home}; fc.weight, fc.bias initialised afresh " \
           f"for 3 classes" in log.text
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in resnet18_state().items() if not k.startswith("fc."))
    start_from(build_model(model_cfg(name="resnet18"), 3), model_cfg(name="resnet18", weights="IMAGENET1K_V1"), 3)
    assert len(calls) == 1  # cached


class Response:
    """What urllib's opener returns, serving chunks of bytes, then a chunk that is an exception raised
    mid-download."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.headers = email.message.Message()  # without a Content-Length

    def read1(self, size):
        chunk = self.chunks.pop(0) if self.chunks else b""
        if isinstance(chunk, Exception):
            raise chunk
        return chunk

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("network, reason", [
    (urllib.error.URLError("[Errno -3] Temporary failure in name resolution"),
     "<urlopen error [Errno -3] Temporary failure in name resolution>"),
    (Response([b"x" * 1000, ConnectionResetError("Connection reset by peer")]), "Connection reset by peer"),
    (Response([b"not the weights"]), 'invalid hash value (expected "f37072fd", got "'),
])
def test_a_failed_download_names_the_weights_url_and_cache_file_and_leaves_nothing(network, reason, torch_home,
                                                                                   image_folder, tmp_path,
                                                                                   monkeypatch, capsys):
    def urlopen(request, timeout):  # the real download, over a network that fails
        if isinstance(network, Exception):
            raise network
        return network
    monkeypatch.setattr(utils.download, "opener", lambda *args: types.SimpleNamespace(open=urlopen))
    root = image_folder({"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}})
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--recipe", "folder.yaml", f"data.name={root}", "data.img_size=16", "train.batch_size=4",
                    "data.workers=0", f"project={tmp_path / 'runs'}"])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and error.count("\n") == 1, error
    assert error.startswith(f"train.py: error: model.weights=DEFAULT: cannot download "
                            f"ResNet18_Weights.IMAGENET1K_V1 from {URL} ({reason}")
    assert error.endswith(f"); without internet, place a copy of that file at {torch_home}, or train from "
                          f"scratch with model.weights=''\n")
    assert list(torch_home.parent.iterdir()) == []  # no file, whole or partial
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_offline_a_file_placed_in_the_cache_starts_the_run_and_preprocessing_follows_it(torch_home, image_folder,
                                                                                       tmp_path, monkeypatch, log):
    torch_home.parent.mkdir(parents=True)
    torch.save(resnet18_state(), torch_home)
    monkeypatch.setattr(models.pretrained, "fetch_url", None)  # called, it would fail the test
    initial, check_input_size = {}, train.check_input_size

    def keep_initial_weights(model, *args, **kw):  # called after start_from, before the first step
        initial.update({k: v.clone() for k, v in model.state_dict().items()} if not initial else {})
        return check_input_size(model, *args, **kw)
    monkeypatch.setattr(train, "check_input_size", keep_initial_weights)
    root = image_folder({"train": {"a": 3, "b": 3, "c": 3}, "val": {"a": 1, "b": 1, "c": 1}})
    train.main(["--recipe", "folder.yaml", f"data.name={root}", "data.img_size=16", "train.epochs=1",
                "train.batch_size=9", "data.workers=0", f"project={tmp_path / 'runs'}",
                "train.precision=fp32"])  # at 16 px, bf16 on a CPU breaks layer4's gradient (docs/techniques.md)
    assert f"model: loaded ResNet18_Weights.IMAGENET1K_V1 from {torch_home}; fc.weight, fc.bias initialised " \
           f"afresh for 3 classes" in log.text
    assert all(torch.equal(initial[k], v) for k, v in resnet18_state().items() if not k.startswith("fc."))
    assert initial["fc.weight"].shape == (3, 512)
    # The recipe leaves mean, std, the val crop and crop_pct at their defaults: they follow the weights' own
    # transforms (resize 256, centre crop 224), in the saved recipe that val.py, predict.py and export.py read.
    data = load_checkpoint(tmp_path / "runs" / "exp" / "weights" / "last.pt")["recipe"]["data"]
    assert (data["mean"], data["std"], data["val_img_size"], data["crop_pct"]) == (IMAGENET_MEAN, IMAGENET_STD, 224,
                                                                                  224 / 256)
    assert "val_img_size: 224" in (tmp_path / "runs" / "exp" / "recipe.yaml").read_text()
    assert "differ from the preprocessing" not in log.text


def test_preprocessing_is_the_weights_own_and_a_recipe_that_sets_other_values_keeps_them(log):
    assert weights_preprocessing("resnet50", "IMAGENET1K_V2") == {"mean": IMAGENET_MEAN, "std": IMAGENET_STD,
                                                                  "val_img_size": 224, "crop_pct": 224 / 232}
    assert weights_preprocessing("vit_b_16", "IMAGENET1K_SWAG_E2E_V1")["val_img_size"] == 384
    assert weights_preprocessing("resnet18", "resnet18.pth") is None
    # Left at the defaults, the keys follow the weights; set otherwise, the recipe's stay, with one warning.
    cfg = follow_weights(load_recipe("folder.yaml", ["model.name=resnet50", "model.weights=IMAGENET1K_V2",
                                                     "data.mean=[0.5,0.5,0.5]"]))
    assert list(cfg.data.mean) == [0.5] * 3
    assert cfg.data.val_img_size == 224 and cfg.data.crop_pct == pytest.approx(224 / 232)
    assert "the recipe's data.mean=[0.5, 0.5, 0.5] (theirs: [0.485, 0.456, 0.406]) differ" in log.text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """17 training images (3 steps of 8) and 7 val images of 2 classes, 12 px."""
    return make_image_folder(tmp_path_factory.mktemp("data") / "d", {"train": {"a": 9, "b": 8},
                                                                      "val": {"a": 3, "b": 4}})


@pytest.mark.slow
def test_two_processes_download_once_per_machine_and_every_rank_reads_the_cache(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # the launched processes' environment
    source, cache = tmp_path / "weights.pth", tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    torch.save(resnet18_state(), source)
    args = ["--recipe", "cls.yaml", f"data.name={tiny}", "model.name=resnet18", "model.weights=IMAGENET1K_V1",
            "data.img_size=16", "data.val_img_size=16", "train.epochs=2", "train.batch_size=8",
            "data.drop_last=true", "model.freeze_epochs=1", "model.backbone_lr=0.5", f"project={tmp_path / 'runs'}",
            "train.precision=fp32"]  # at 16 px, bf16 on a CPU breaks layer4's gradient (docs/techniques.md)
    record = tmp_path / "record.txt"
    result = run_torchrun("tests/pretrained_driver.py", record, source, "train.py", *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    lines = record.read_text().splitlines()
    assert lines[0] == f"download 0 0 {URL} f37072fd"  # local rank 0, before any rank reads
    assert sorted(lines[1:]) == [f"read 0 {cache}", f"read 1 {cache}"]
    output = result.stdout + result.stderr
    # cls.yaml sets its own mean, std and crop_pct, and the command the val crop: one warning, from rank 0
    assert output.count("differ from the preprocessing the weights were trained with") == 1
    assert "data.val_img_size=16 (theirs: 224), data.crop_pct=1.0 (theirs: 0.875)" in output
    assert output.count("fine-tuning: the pretrained part at lr x0.5, frozen for the first 1 epoch(s)") == 1
    assert len(read_results(tmp_path / "runs" / "exp")[1]) == 2
    # Offline: every rank stops with the one line, said once, and nothing is left in the cache.
    cache.unlink()
    result = run_torchrun("tests/pretrained_driver.py", record, "offline", "train.py", *args)
    assert result.returncode != 0
    assert console_lines(result.stderr, "train.py: error:") == [
        f"train.py: error: model.weights=IMAGENET1K_V1: cannot download ResNet18_Weights.IMAGENET1K_V1 from {URL} "
        f"(<urlopen error [Errno -3] Temporary failure in name resolution>); without internet, place a copy of that "
        f"file at {cache}, or train from scratch with model.weights=''"]
    assert record.read_text().splitlines()[3:] == [f"download 0 0 {URL} f37072fd"]
    assert list(cache.parent.iterdir()) == []


def test_the_pretrained_part_learns_at_its_factor_and_not_at_all_in_its_frozen_epochs():
    model = build_model(model_cfg(name="convnet", width=4, depth=2), 3)
    head = head_keys(model, 3)
    optimizer = build_optimizer(model, OmegaConf.structured(OptimConfig(lr=0.1)), head, backbone_lr=0.2)
    groups = optimizer.param_groups
    assert [(g["backbone"], g["lr"], g["weight_decay"] > 0) for g in groups] == [
        (False, 0.1, True), (False, 0.1, False), (True, pytest.approx(0.02), True), (True, pytest.approx(0.02), False)]
    names = {p: n for n, p in model.named_parameters()}
    assert sorted(names[p] for g in groups[:2] for p in g["params"]) == sorted(head) == ["head.3.bias", "head.3.weight"]
    assert sum(len(g["params"]) for g in groups) == len(names)  # each parameter once
    # 10 steps an epoch, warmup over the first, the pretrained part frozen for two: its lr is 0 for 20 steps, then
    # the head's schedule times its factor.
    scheduler = build_scheduler(optimizer, OmegaConf.structured(SchedConfig(warmup_epochs=1)), 4, 10, frozen_epochs=2)
    lrs = []
    # what gradient clipping counts: while frozen, the head's parameters alone
    assert stepped_parameters(optimizer) == groups[0]["params"] + groups[1]["params"]
    for _ in range(40):
        lrs.append([g["lr"] for g in groups])
        optimizer.step()
        scheduler.step()
    assert all(head_lr > 0 and backbone_lr == 0 for head_lr, _, backbone_lr, _ in lrs[:20])
    assert stepped_parameters(optimizer) == [p for g in groups for p in g["params"]]  # at step 40: all of them
    assert all(backbone_lr == pytest.approx(0.2 * head_lr) for head_lr, _, backbone_lr, _ in lrs[20:])
    # Without fine-tuning, the two groups of before: checkpoints of earlier runs still resume.
    assert len(build_optimizer(model, OmegaConf.structured(OptimConfig())).param_groups) == 2


def test_fine_tuning_controls_act_with_model_weights_only(log):
    model = build_model(model_cfg(name="convnet", width=4, depth=2), 3)
    assert fine_tuning(model_cfg(name="convnet", backbone_lr=0.1, freeze_epochs=2), 3, model) == (None, 1.0, 0)
    assert "fine-tuning: off: model.backbone_lr=0.1 and model.freeze_epochs=2 act with model.weights only" in log.text
    head = ["head.3.weight", "head.3.bias"]
    assert fine_tuning(model_cfg(name="convnet", weights="w.pt", backbone_lr=0.1), 3, model) == (head, 0.1, 0)
    assert fine_tuning(model_cfg(name="convnet", weights="w.pt"), 3, model) == (None, 1.0, 0)


@pytest.mark.slow
def test_frozen_epochs_hold_the_pretrained_weights_and_statistics_and_resume_exactly_across_the_boundary(tiny,
                                                                                                        tmp_path):
    weights = tmp_path / "pretrained.pt"
    torch.save(build_model(model_cfg(name="convnet", width=4), 2).state_dict(), weights)
    pretrained = load_checkpoint(weights)
    recipe = ["train.py", "--recipe", "cls.yaml", f"data.name={tiny}", "model.width=4", f"model.weights={weights}",
              "model.freeze_epochs=2", "model.backbone_lr=0.5", "train.epochs=3", "train.batch_size=8",
              f"project={tmp_path}"]
    head = ["head.3.weight", "head.3.bias"]

    def frozen(run):  # the pretrained part bit for bit as loaded, BatchNorm statistics too; the head trained
        model = load_checkpoint(tmp_path / run / "weights" / "last.pt")["model"]
        return all(torch.equal(v, pretrained[k]) for k, v in model.items() if k not in head) and \
            not any(torch.equal(model[k], pretrained[k]) for k in head)
    result = run_python(*recipe, "name=reference")
    assert result.returncode == 0, result.stderr[-3000:]
    reference = load_checkpoint(tmp_path / "reference" / "weights" / "last.pt")["model"]
    moved = [k for k, v in reference.items() if not torch.equal(v, pretrained[k])]
    assert {"features.0.0.weight", "features.0.1.running_mean", "features.0.1.num_batches_tracked"} <= set(moved)
    # Killed (SIGKILL, at no step of its choosing) right after its 3rd save of last.pt: with a save every 2 steps of
    # 3-step epochs, at step 1 of the second frozen epoch. Resumed to the end, across the boundary: the same run.
    result = run_python("tests/faults.py", "killpg-after-save:3", *recipe, "train.save_every_steps=2", "name=run")
    assert result.returncode != 0 and frozen("run")
    ckpt = load_checkpoint(tmp_path / "run" / "weights" / "last.pt")
    assert (ckpt["epoch"], ckpt["step"]) == (1, 1)
    weights.unlink()  # a resumed run takes every weight from its checkpoint: the pretrained file is not read
    result = run_python("train.py", "--resume", tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = load_checkpoint(tmp_path / "run" / "weights" / "last.pt")["model"]
    assert resumed.keys() == reference.keys() and all(torch.equal(resumed[k], reference[k]) for k in reference)
    rows = [[v for k, v in row.items() if not k.startswith("time/")] for row in read_results(tmp_path / "run")[1]]
    assert rows == [[v for k, v in row.items() if not k.startswith("time/")]
                    for row in read_results(tmp_path / "reference")[1]]


class TinyTimmModel(torch.nn.Module):
    """A model as timm builds one, with its classifier named head."""

    def __init__(self, num_classes):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(4, num_classes)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


@pytest.fixture
def fake_timm(monkeypatch, tmp_path):
    """A stand-in for the optional timm (and the huggingface_hub it installs) with its API for pretrained weights:
    get_pretrained_cfg, list_pretrained and create_model(pretrained=True), which downloads unless offline is set."""
    timm = types.ModuleType("timm")
    timm.__spec__ = importlib.machinery.ModuleSpec("timm", None)
    timm.calls, timm.offline = [], False
    configs = {name: types.SimpleNamespace(has_weights=True, hf_hub_id=f"timm/{name}", url=None, mean=(0.5,) * 3,
                                           std=(0.25,) * 3, input_size=(3, 20, 20), crop_pct=0.9)
               for name in ("tiny.a1_in1k", "tiny.b2_in1k")}
    configs["tiny"] = configs["tiny.a1_in1k"]  # the default tag

    def get_pretrained_cfg(name):
        if name not in configs:
            raise RuntimeError(f"Invalid pretrained tag for {name}.")
        return configs[name]

    def create_model(name, pretrained=False, num_classes=1000):
        timm.calls.append((name, pretrained))
        if pretrained and timm.offline:
            raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")
        torch.manual_seed(1)
        return TinyTimmModel(num_classes)
    timm.models = types.SimpleNamespace(get_pretrained_cfg=get_pretrained_cfg)
    timm.list_pretrained = lambda pattern: ["tiny.a1_in1k", "tiny.b2_in1k"] if pattern == "tiny.*" else []
    timm.is_model = lambda name: name == "tiny"
    timm.create_model = create_model
    hub = types.ModuleType("huggingface_hub")
    hub.constants = types.SimpleNamespace(HF_HUB_CACHE=str(tmp_path / "hf"))
    monkeypatch.setitem(sys.modules, "timm", timm)
    monkeypatch.setitem(sys.modules, "huggingface_hub", hub)
    return timm


def test_timm_tags_load_through_timm_and_name_the_hugging_face_cache_offline(fake_timm, tmp_path, log):
    assert weights_preprocessing("timm/tiny", "b2_in1k") == {"mean": [0.5] * 3, "std": [0.25] * 3,
                                                             "val_img_size": 20, "crop_pct": 0.9}
    with pytest.raises(SharedError, match=r"^model.weights='c3': timm has no such pretrained weights for timm/tiny; "
                                          r"it has DEFAULT, a1_in1k, b2_in1k$"):
        weights_preprocessing("timm/tiny", "c3")
    model = TinyTimmModel(3)
    start_from(model, model_cfg(name="timm/tiny", weights="DEFAULT"), 3)
    assert fake_timm.calls[0] == ("tiny", True)  # timm's own download, of its default tag
    assert torch.equal(model.conv.weight, fake_timm.create_model("tiny", pretrained=True).conv.weight)
    folder = tmp_path / "hf" / "models--timm--tiny.a1_in1k"
    assert f"model: loaded timm's tiny from {folder}; head.weight, head.bias initialised afresh for 3 classes" \
           in log.text
    fake_timm.offline = True
    with pytest.raises(UsageError, match=r"^model.weights=a1_in1k: cannot download timm's tiny.a1_in1k from "
                                          r"https://huggingface.co/timm/tiny.a1_in1k \(We couldn't connect .*\); "
                                          r"without internet, place a copy at (.*) \(hf download "
                                          r"timm/tiny.a1_in1k fills it\), or train from scratch with "
                                          r"model.weights=''$") as error:
        start_from(TinyTimmModel(3), model_cfg(name="timm/tiny", weights="a1_in1k"), 3)
    assert str(folder) in str(error.value)


def test_a_file_in_the_cache_that_is_not_weights_is_named_with_what_to_do(torch_home):
    torch_home.parent.mkdir(parents=True)
    torch.save(resnet18_state(), torch_home)
    torch_home.write_bytes(torch_home.read_bytes()[:100_000])  # a copy cut short
    with pytest.raises(SharedError, match=rf"^model.weights=DEFAULT: {torch_home}: not a readable checkpoint .*; "
                                          rf"replace it with {URL}, or remove it to download it$"):
        start_from(build_model(model_cfg(name="resnet18"), 3), model_cfg(name="resnet18", weights="DEFAULT"), 3)


@pytest.fixture
def silent_server():
    """The address of a local server that accepts connections and never answers."""
    server, accepted = socket.create_server(("127.0.0.1", 0)), []

    def accept():
        with contextlib.suppress(OSError):
            while True:
                accepted.append(server.accept()[0])  # held open, never read nor answered
    threading.Thread(target=accept, daemon=True).start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    server.close()
    for connection in accepted:
        connection.close()


def test_a_server_that_never_answers_fails_the_download_after_the_read_timeout_and_leaves_nothing(silent_server,
                                                                                                  tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setattr(models.pretrained, "READ_TIMEOUT", 0.5)
    reported = []
    with pytest.raises(TimeoutError, match=r"^no answer for 0.5 s$"):
        models.pretrained.fetch_url(f"http://{silent_server}/w.pth", tmp_path / "w.pth", None, reported.append)
    assert reported == [] and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_trickling_weights_server_ends_at_its_rate_bound_naming_the_url_and_reports_each_byte_as_it_comes(
        torch_home, monkeypatch):
    monkeypatch.setattr(models.pretrained, "READ_TIMEOUT", 0.5)  # a byte every 0.05 s: each read is answered in time
    monkeypatch.setattr(models.pretrained, "READ_MIN_RATE", 1e6)  # 1 MB announced: 0.5 + 1 s in all
    announced = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n"
    reported = []
    with byte_at_a_time(b"x" * 60, head=announced) as url:  # 60 bytes, then the connection closes, at 3 s
        monkeypatch.setattr(RESNET18.value, "url", f"{url}/resnet18-f37072fd.pth")
        start = time.monotonic()
        line = models.pretrained.download(RESNET18, torch_home, "model.weights=DEFAULT", reported.append)
        assert time.monotonic() - start < 2.9  # before the server closes
    took = re.search(r" bytes in ([\d.]+) s", line).group(1)
    assert line == (f"model.weights=DEFAULT: cannot download ResNet18_Weights.IMAGENET1K_V1 from {url}/resnet18-"
                    f"f37072fd.pth ({sum(reported)} of 1000000 bytes in {took} s: slower than 1,000 kB/s on "
                    f"average); without internet, place a copy of that file at {torch_home}, or train from scratch "
                    f"with model.weights=''")
    assert 1.5 <= float(took) < 2.9
    assert len(reported) > 5 and sum(reported) < 60  # reported as they came, the waiting ranks see them
    assert list(torch_home.parent.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("proxy", ["https_proxy", "http_proxy"])
def test_a_silent_proxy_fails_the_run_with_one_line_naming_the_url(proxy, silent_server, torch_home, image_folder,
                                                                   tmp_path, monkeypatch):
    root = image_folder({"train": {"a": 2, "b": 2}, "val": {"a": 1, "b": 1}})
    url = URL if proxy == "https_proxy" else URL.replace("https:", "http:")  # the proxy urllib uses for each
    for key, value in {proxy: f"http://{silent_server}", "no_proxy": "", "CLS_READ_TIMEOUT": "1"}.items():
        monkeypatch.setenv(key, value)
    script = ("import sys, torchvision, train; torchvision.models.ResNet18_Weights.IMAGENET1K_V1.value.url = "
              "sys.argv[1]; train.main(sys.argv[2:])")
    result = run_python("-c", script, url, "--recipe", "folder.yaml", f"data.name={root}", "data.img_size=16",
                        "train.batch_size=4", "data.workers=0", f"project={tmp_path / 'runs'}", timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        f"train.py: error: model.weights=DEFAULT: cannot download ResNet18_Weights.IMAGENET1K_V1 from {url} (no answer "
        f"for 1 s); without internet, place a copy of that file at {torch_home}, or train from scratch with "
        f"model.weights=''")
    assert list(torch_home.parent.iterdir()) == []
