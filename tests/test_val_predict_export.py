"""After training: val.py reproduces what training measured (at one and two processes), predict.py agrees with it
and skips unreadable images by name, export.py writes TorchScript and ONNX models that give PyTorch's outputs."""

import csv
import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import export
import predict
import val
from conftest import ROOT, check_metrics_json, forward_logits, read_results, run_torchrun
from data.sources import build_datasets, dataset_root
from data.transforms import normalizer, val_transforms
from models import model_from_checkpoint
from utils.checkpoint import load_checkpoint, load_model_checkpoint
from utils.config import checkpoint_recipe
from utils.general import DATASETS_DIR, UsageError

# requirements-export.txt: without it, `python -m pytest -m cuda` on a GPU machine still runs all but the ONNX tests.
HAS_ONNX = all(importlib.util.find_spec(name) for name in ("onnx", "onnxscript", "onnxruntime"))
needs_onnx = pytest.mark.skipif(not HAS_ONNX, reason="needs pip install -r requirements-export.txt")

VAL_DIR = DATASETS_DIR / "digits" / "val"


@pytest.fixture(scope="module")
def best(digits_run):
    """best.pt of the README's training run, and the top-1 results.csv recorded for its epoch."""
    project, _ = digits_run
    _, rows = read_results(project / "exp")
    top1 = max(float(r["val/top1"]) for r in rows)
    return project / "exp" / "weights" / "best.pt", top1


@pytest.mark.slow
def test_val_reproduces_the_top1_training_recorded_and_saves_its_tables(best, tmp_path, log):
    weights, recorded = best
    metrics = val.main(["--weights", str(weights), "--project", str(tmp_path), "--save-probs"])
    assert float(f"{metrics['val/top1']:.6g}") == recorded
    out = log.text
    assert f"{weights} (after epoch {load_model_checkpoint(weights)['epoch']}) on" in out
    assert f"top-1 {recorded:.2%}" in out and "(360 images)" in out and "class  images  precision  recall  top-5" in out
    ckpt = load_model_checkpoint(weights)
    summary = check_metrics_json(tmp_path / "exp", out, {
        "weights": str(weights), "epoch": ckpt["epoch"], "step": 0, "data": str(VAL_DIR), "processes": 1,
        "batch_size": ckpt["recipe"]["train"]["batch_size"], "precision": ckpt["recipe"]["train"]["precision"],
        "tta": False})
    assert summary["images"] == 360 and summary["top1"] == metrics["val/top1"]
    with open(tmp_path / "exp" / "probabilities.csv", newline="") as f:  # each image's softmax, in the folder's order
        header, *table = list(csv.reader(f))
    files = [path for path, _ in build_datasets(VAL_DIR.parent, None, None)[1].samples]
    assert header == ["file", "labels", *[str(d) for d in range(10)]] and [r[0] for r in table] == files
    assert [r[1] for r in table] == [Path(f).parent.name for f in files]
    probs = torch.tensor([[float(p) for p in r[2:]] for r in table])
    assert torch.allclose(probs, forward_logits(weights, files).softmax(1), atol=1e-6)
    assert (probs.argmax(1) == torch.tensor([int(r[1]) for r in table])).sum().item() == round(recorded * 360)
    with open(tmp_path / "exp" / "confusion_matrix.csv") as f:
        header, *rows = list(csv.reader(f))
    counts = np.array([[int(c) for c in row[1:]] for row in rows])
    assert header[1:] == [str(d) for d in range(10)] and counts.sum() == 360
    assert counts.trace() == round(recorded * 360)
    with open(tmp_path / "exp" / "per_class.csv") as f:
        per_class = list(csv.DictReader(f))
    assert [int(r["images"]) for r in per_class] == counts.sum(1).tolist()
    assert [float(r["recall"]) for r in per_class] == pytest.approx((counts.diagonal() / counts.sum(1)).tolist())
    assert [float(r["precision"]) for r in per_class] == pytest.approx((counts.diagonal() / counts.sum(0)).tolist())
    with Image.open(tmp_path / "exp" / "confusion_matrix.png") as image:
        image.verify()
        assert image.format == "PNG"


@pytest.mark.slow
def test_val_under_torchrun_counts_every_image_once(best, tmp_path):
    weights, recorded = best
    result = run_torchrun("val.py", "--weights", weights, "--project", tmp_path, "--batch-size", "50")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [p.name for p in tmp_path.iterdir()] == ["exp"] and result.stdout.count("Results saved to") == 1
    summary = json.loads((tmp_path / "exp" / "metrics.json").read_text())
    assert summary["images"] == 360 and summary["run"]["processes"] == 2
    assert float(f"{summary['top1']:.6g}") == recorded


@pytest.mark.slow
def test_val_names_a_class_the_checkpoint_does_not_know(best, image_folder, tmp_path, capfd):
    weights, _ = best
    root = image_folder({"val": {"3": 2, "cat": 1}}, size=8)
    with pytest.raises(SystemExit) as exit_:
        val.main(["--weights", str(weights), "--data", str(root), "--project", str(tmp_path / "v")])
    assert exit_.value.code == 2
    assert f"{root / 'val'}: classes ['cat'] are not among the 10 classes {weights} was trained on" in \
        capfd.readouterr().err
    assert not (tmp_path / "v").exists()


@pytest.mark.slow
def test_val_on_data_with_an_unreadable_image_names_its_own_flag_which_leaves_the_image_out(best, tmp_path, capfd,
                                                                                             log):
    weights, _ = best
    root = tmp_path / "data"
    for digit in ("3", "7"):
        (root / "val" / digit).mkdir(parents=True)
        for path in sorted((VAL_DIR / digit).iterdir())[:2]:
            shutil.copy(path, root / "val" / digit / path.name)
    bad = root / "val" / "7" / "broken.png"
    bad.write_bytes(b"not a png")
    metrics = refused_then_read(weights, root, tmp_path, capfd, "--skip-corrupt", (
        f"val.py: error: {bad}: unreadable image (not an image format PIL can identify); remove the file, or skip "
        f"unreadable images with --skip-corrupt (every image checked once first)"))
    assert metrics["val/samples"] == 4
    assert f"skipping 1 unreadable image(s) (--skip-corrupt):\n  {bad}: not an image format" in log.text


@pytest.mark.slow
def test_val_on_a_csv_listing_images_outside_its_folder_names_its_own_flag_which_reads_them(best, tmp_path, capfd):
    weights, _ = best
    root = tmp_path / "csv"
    root.mkdir()
    rows = [(os.path.relpath(path, root), digit)
            for digit in ("3", "7") for path in sorted((VAL_DIR / digit).iterdir())[:2]]
    (root / "val.csv").write_text("path,label\n" + "".join(f"{path},{label}\n" for path, label in rows))
    metrics = refused_then_read(weights, root, tmp_path, capfd, "--csv-allow-outside", (
        f"val.py: error: {root / 'val.csv'}, line 2: {rows[0][0]} lies outside the CSV's folder, {root} (4 of its 4 "
        f"paths are); list images inside it, or read paths outside it with --csv-allow-outside"))
    assert metrics["val/samples"] == 4


def refused_then_read(weights, root, tmp_path, capfd, flag, line):
    """val.py of weights on root: exit code 2 with line last on stderr, then with flag its metrics."""
    args = ["--weights", str(weights), "--data", str(root), "--project", str(tmp_path / "v")]
    with pytest.raises(SystemExit) as exit_:
        val.main(args)
    assert exit_.value.code == 2 and capfd.readouterr().err.splitlines()[-1] == line
    return val.main([*args, flag])


@pytest.mark.slow
def test_predict_agrees_with_val_on_the_val_images(best, tmp_path):
    weights, recorded = best
    rows, skipped = predict.main(["--weights", str(weights), "--source", str(VAL_DIR), "--project", str(tmp_path),
                                  "--save-probs"])
    assert len(rows) == 360 and not skipped
    correct = sum(r["top"][0]["class"] == r["file"].split("/")[-2] for r in rows)
    assert correct == round(recorded * 360)
    assert all(len(r["top"]) == 5 and r["top"][0]["prob"] >= r["top"][1]["prob"] for r in rows)
    with open(tmp_path / "exp" / "predictions.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["file"] for r in table] == [r["file"] for r in rows] and table[0]["class1"] == rows[0]["top"][0]["class"]
    assert len(json.loads((tmp_path / "exp" / "predictions.json").read_text())["predictions"]) == 360
    with open(tmp_path / "exp" / "probabilities.csv", newline="") as f:  # every class's, not only the top 5
        header, *table = list(csv.reader(f))
    assert header == ["file", *[str(d) for d in range(10)]] and [r[0] for r in table] == [r["file"] for r in rows]
    probs = torch.tensor([[float(p) for p in r[1:]] for r in table])
    assert torch.allclose(probs, forward_logits(weights, [r["file"] for r in rows]).softmax(1), atol=1e-6)


@pytest.mark.slow
def test_predict_names_and_skips_an_unreadable_image(best, tmp_path, log):
    weights, _ = best
    source = tmp_path / "photos"
    source.mkdir()
    for path in sorted((VAL_DIR / "3").iterdir())[:3]:
        shutil.copy(path, source / path.name)
    (source / "broken.png").write_bytes(b"not a png")
    rows, skipped = predict.main(["--weights", str(weights), "--source", str(source / "*.png"), "--topk", "2",
                                  "--project", str(tmp_path / "p")])
    assert [r["file"] for r in rows] == [str(p) for p in sorted(source.glob("0*.png"))]
    assert skipped == [{"file": str(source / "broken.png"), "reason": "not an image format PIL can identify"}]
    out = log.text
    assert f"skipped {source / 'broken.png'}: unreadable image" in out and "3 image(s) classified, 1 unreadable" in out
    assert json.loads((tmp_path / "p" / "exp" / "predictions.json").read_text())["skipped"] == skipped


@pytest.mark.slow
def test_predict_without_images_is_a_clear_error(best, tmp_path, capfd):
    weights, _ = best
    with pytest.raises(SystemExit) as exit_:
        predict.main(["--weights", str(weights), "--source", str(tmp_path / "*.jpg"), "--project", str(tmp_path)])
    assert exit_.value.code == 2 and "no images found" in capfd.readouterr().err


@pytest.mark.slow
def test_val_and_predict_choose_the_device_as_training_does(best, tmp_path, monkeypatch, capfd):
    weights, _ = best
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU: the index and the value are checked
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    errors = {"cuda:1": "--device='cuda:1' but only 1 GPU(s) are visible here (0 to 0); choose one of them, or see "
                        "CUDA_VISIBLE_DEVICES",
              "gpu": "--device must be auto, cpu, cuda, cuda:N or a GPU index N, got 'gpu'"}
    for script, main, source in (("val.py", val.main, []), ("predict.py", predict.main, ["--source", str(VAL_DIR)])):
        for device, error in errors.items():
            with pytest.raises(SystemExit) as exit_:
                main(["--weights", str(weights), *source, "--device", device, "--project", str(tmp_path)])
            assert exit_.value.code == 2 and capfd.readouterr().err == f"{script}: error: {error}\n"
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def exported(best, tmp_path_factory):
    """best.pt exported to TorchScript and ONNX with a dynamic batch, in a folder of its own."""
    weights = tmp_path_factory.mktemp("export") / "best.pt"
    shutil.copy(best[0], weights)
    formats = ["torchscript", "onnx"] if HAS_ONNX else ["torchscript"]
    return weights, export.main(["--weights", str(weights), "--format", *formats, "--dynamic-batch"])


def real_batch(weights, n):
    """n val images prepared as the checkpoint's preprocessing says, and the PyTorch model's logits for them."""
    ckpt = load_model_checkpoint(weights)
    cfg = checkpoint_recipe(ckpt["recipe"], weights)
    _, val_set = build_datasets(dataset_root("digits"), None, val_transforms(cfg.data))
    images = normalizer(cfg.data, torch.device("cpu"))(torch.stack([val_set[i * 7][0] for i in range(n)]))
    with torch.no_grad():
        return images, model_from_checkpoint(ckpt, cfg, weights)(images)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:FutureWarning")
def test_exported_torchscript_gives_pytorchs_outputs_and_carries_its_preprocessing(exported):
    weights, results = exported
    path, difference = results["torchscript"]
    assert path == weights.with_suffix(".torchscript") and difference <= 1e-4
    files = {"metadata.json": ""}
    model = torch.jit.load(str(path), _extra_files=files)
    metadata = json.loads(files["metadata.json"])
    assert metadata["classes"] == [str(d) for d in range(10)] and metadata["img_size"] == 8
    assert metadata["mean"] == [0.5, 0.5, 0.5] and metadata["resize"] == 8
    images, expected = real_batch(weights, 5)
    torch.testing.assert_close(model(images), expected, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
@needs_onnx
def test_exported_onnx_gives_pytorchs_outputs_at_any_batch_and_carries_its_preprocessing(exported):
    import onnxruntime

    weights, results = exported
    path, difference = results["onnx"]
    assert path == weights.with_suffix(".onnx") and difference <= 1e-4
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    metadata = {k: json.loads(v) for k, v in session.get_modelmeta().custom_metadata_map.items()}
    assert metadata["classes"] == [str(d) for d in range(10)] and metadata["std"] == [0.5, 0.5, 0.5]
    for n in (1, 7):
        images, expected = real_batch(weights, n)
        logits = torch.from_numpy(session.run(None, {"images": images.numpy()})[0])
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
def test_export_refuses_outputs_that_do_not_match(best):
    weights, _ = best
    ckpt = load_model_checkpoint(weights)
    model = model_from_checkpoint(ckpt, checkpoint_recipe(ckpt["recipe"], weights), weights)
    x = torch.randn(2, 3, 8, 8)
    assert export.check_outputs(model, model, [x], "same") == 0.0
    with pytest.raises(export.ExportMismatch, match=r"differ from PyTorch's by up to 0.01 .* on a batch of 2"):
        export.check_outputs(model, lambda x: model(x) + 0.01, [x], "shifted")
    with pytest.raises(export.ExportMismatch, match="differ from PyTorch's by up to nan"):
        export.check_outputs(model, lambda x: model(x) * torch.nan, [x], "nan")


@pytest.mark.slow
def test_an_export_that_fails_its_check_leaves_no_file(best, tmp_path, monkeypatch, caplog):
    weights = tmp_path / "best.pt"
    shutil.copy(best[0], weights)

    def mismatch(model, run, batches, name):
        raise export.ExportMismatch(f"{name}: outputs differ")
    monkeypatch.setattr(export, "check_outputs", mismatch)
    with pytest.raises(SystemExit) as exit_:
        export.main(["--weights", str(weights), "--format", "torchscript"])
    assert exit_.value.code == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


@pytest.mark.slow
def test_export_onnx_without_its_packages_says_what_to_install(best, monkeypatch, capfd):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "onnxruntime" else
                        real_find_spec(name))
    with pytest.raises(SystemExit) as exit_:
        export.main(["--weights", str(best[0])])  # ONNX, the default
    assert exit_.value.code == 2
    assert "--format onnx (the default) needs onnxruntime (not installed): pip install -r requirements-export.txt, " \
           "or --format torchscript" in capfd.readouterr().err


@pytest.mark.slow
def test_val_refuses_a_batch_size_below_one(best, tmp_path, capfd):
    with pytest.raises(SystemExit) as exit_:
        val.main(["--weights", str(best[0]), "--batch-size", "0", "--project", str(tmp_path)])
    assert exit_.value.code == 2 and "--batch-size 0: must be >= 1" in capfd.readouterr().err


def not_checkpoints(folder):
    """{file: what the one line says it is} for files that torch.save did not write."""
    (folder / "model.onnx").write_bytes(b"\x08\x08\x12\x07pytorch\x1a\x052.6.0")  # ONNX: a protobuf
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), folder / "best.torchscript")
    return {ROOT / "README.md": "it is text", sorted((VAL_DIR / "0").iterdir())[0]: "it is an image",
            folder / "model.onnx": "it is an ONNX model, as export.py writes; give the .pt file it was exported from",
            folder / "best.torchscript": "it is a TorchScript model, as export.py writes; give the .pt file it was "
                                         "exported from"}


def test_a_file_that_is_not_a_checkpoint_is_called_so_by_val_predict_and_export(tmp_path, capfd):
    for path, kind in not_checkpoints(tmp_path).items():
        for script, main, extra in (("val.py", val.main, []), ("predict.py", predict.main, ["--source", str(VAL_DIR)]),
                                    ("export.py", export.main, ["--format", "torchscript"])):  # without onnx
            with pytest.raises(SystemExit) as exit_:
                main(["--weights", str(path), *extra])
            assert exit_.value.code == 2
            assert capfd.readouterr().err == f"{script}: error: {path} is not a checkpoint ({kind})\n"


def test_a_checkpoint_in_torchs_older_format_still_loads(tmp_path):
    torch.save({"epoch": 1}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)  # a pickle, not a zip
    assert load_checkpoint(tmp_path / "old.pt") == {"epoch": 1}


@pytest.mark.slow
def test_a_run_directory_given_as_weights_means_its_best_pt_else_its_last_pt(best, tmp_path, log, capfd):
    weights, _ = best
    run_dir = tmp_path / "exp"
    (run_dir / "weights").mkdir(parents=True)
    shutil.copy(weights, run_dir / "weights" / "best.pt")
    image = sorted((VAL_DIR / "3").iterdir())[0]
    rows, _ = predict.main(["--weights", str(run_dir), "--source", str(image), "--project", str(tmp_path / "p")])
    assert f"{run_dir} is a run directory: using {run_dir / 'weights' / 'best.pt'}\n" in log.text
    assert rows[0]["file"] == str(image)
    assert json.loads((tmp_path / "p" / "exp" / "predictions.json").read_text())["weights"] == \
        str(run_dir / "weights" / "best.pt")
    (run_dir / "weights" / "best.pt").rename(run_dir / "weights" / "last.pt")
    assert load_model_checkpoint(run_dir)["path"] == str(run_dir / "weights" / "last.pt")
    (run_dir / "weights" / "last.pt").unlink()
    with pytest.raises(SystemExit) as exit_:
        val.main(["--weights", str(run_dir)])
    assert exit_.value.code == 2 and capfd.readouterr().err == (
        f"val.py: error: {run_dir}: a directory without weights/best.pt or weights/last.pt; give a checkpoint file "
        f"or a run directory\n")


@pytest.mark.slow
def test_predict_exits_1_with_one_line_when_no_image_could_be_read(best, tmp_path, capfd):
    weights, _ = best
    source = tmp_path / "photos"
    source.mkdir()
    for name in ("a.png", "b.jpg"):
        (source / name).write_bytes(b"not an image")
    with pytest.raises(SystemExit) as exit_:
        predict.main(["--weights", str(weights), "--source", str(source), "--project", str(tmp_path / "p")])
    assert exit_.value.code == 1
    assert capfd.readouterr().err.splitlines()[-1] == (f"predict.py: error: none of the 2 image(s) of --source "
                                                       f"{source} could be read (each is named above); nothing was "
                                                       f"classified")
    assert len(json.loads((tmp_path / "p" / "exp" / "predictions.json").read_text())["skipped"]) == 2


def test_predict_takes_several_sources_as_a_shell_gives_an_unquoted_glob_and_lists_each_image_once(tmp_path):
    paths = [tmp_path / "photos" / "a.png", tmp_path / "photos" / "sub" / "b.png", tmp_path / "other" / "c.jpg"]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4)).save(path)
    sources = [str(paths[0]), str(tmp_path / "photos"), str(tmp_path / "other" / "*.jpg")]  # a.png twice
    args = predict.parse_args(["--weights", "best.pt", "--source", *sources, "--topk", "1"])
    assert predict.list_images(args.source) == sorted(paths)
    with pytest.raises(UsageError, match=f"^--source {tmp_path / 'gone.png'}: no such file or folder$"):
        predict.list_images([*sources, str(tmp_path / "gone.png")])


@pytest.mark.slow
def test_predict_names_a_source_that_does_not_exist(best, tmp_path, capfd):
    weights, _ = best
    with pytest.raises(SystemExit) as exit_:
        predict.main(["--weights", str(weights), "--source", str(tmp_path / "nonexistent")])
    assert exit_.value.code == 2
    assert capfd.readouterr().err == f"predict.py: error: --source {tmp_path / 'nonexistent'}: no such file or folder\n"


@pytest.mark.slow
def test_val_refuses_data_of_the_other_kind_naming_what_the_checkpoint_was_trained_on(best, tmp_path, capfd):
    with pytest.raises(SystemExit) as e:
        val.main(["--weights", str(best[0]), "--data", "multidigits", "--project", str(tmp_path)])
    assert e.value.code == 2
    assert capfd.readouterr().err.splitlines()[-1] == (
        f"val.py: error: --data multidigits lists several labels per image (a labels column), but {best[0]} was "
        f"trained on one label per image (a label column); evaluate it on data of that kind")


def test_val_names_its_data_option_where_the_data_code_says_data_name(best, tmp_path, capfd):
    with pytest.raises(SystemExit) as e:
        val.main(["--weights", str(best[0]), "--data", str(tmp_path / "nowhere"), "--project", str(tmp_path)])
    err = capfd.readouterr().err
    assert e.value.code == 2
    assert err.startswith(f"val.py: error: --data '{tmp_path / 'nowhere'}' is neither a dataset here")
    assert "data.name" not in err
