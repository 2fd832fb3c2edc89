"""Export a checkpoint's model for deployment, next to the weights: TorchScript (best.torchscript) or ONNX
(best.onnx), with the class names and preprocessing inside the file; then run a batch through the exported model
and check that its outputs match PyTorch's.

The exported model takes float32 images (N, 3, img_size, img_size), prepared as the file's metadata says (resize,
centre crop, scale to [0, 1], normalise), and returns logits (N, classes); a multi-label model returns each class's
probability (sigmoid) instead, and its metadata holds the per-class thresholds chosen on val.

Usage:
    python export.py --weights runs/train/exp/weights/best.pt --format torchscript onnx --dynamic-batch
ONNX needs the optional packages of requirements-export.txt (onnx, onnxscript, onnxruntime).
"""

import argparse
import importlib.util
import inspect
import json
import warnings
from pathlib import Path

from utils.general import LOGGER, UsageError, after_imports, before_imports, colorstr, quiet_ctrl_c, script

if __name__ == "__main__":  # no collection during the imports below (utils/general.before_imports)
    before_imports()

import torch

from data.transforms import preprocessing, val_size
from models import model_from_checkpoint
from utils.checkpoint import load_model_checkpoint
from utils.config import checkpoint_recipe
from utils.distributed import exit_on_error
from utils.once import atomic_write

SUFFIXES = {"torchscript": ".torchscript", "onnx": ".onnx"}
ATOL, RTOL = 1e-4, 1e-3  # exported logits must match PyTorch's within ATOL + RTOL * |PyTorch's| (fp32 on the CPU)
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


class ExportMismatch(Exception):
    """The exported model's outputs differ from PyTorch's beyond the tolerance."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Export a checkpoint of train.py to TorchScript or ONNX.")
    parser.add_argument("--weights", required=True, help="checkpoint of train.py (e.g. runs/train/exp/weights/best.pt)")
    parser.add_argument("--format", nargs="+", default=["onnx"], choices=list(SUFFIXES),
                        help="one or more (default: onnx; torchscript needs no extra package, but torch deprecates it)")
    parser.add_argument("--dynamic-batch", action="store_true", help="accept any batch size (else --batch-size only)")
    parser.add_argument("--batch-size", type=int, default=1, help="batch size of the exported model's input")
    return parser.parse_args(argv)


def main(argv=None):
    """Export and check; bad input exits with code 2 and one line, outputs that do not match with code 1."""
    args = parse_args(argv)
    try:
        return export(args)
    except UsageError as e:
        exit_on_error("export.py", e)
    except ExportMismatch as e:
        LOGGER.error(f"export.py: {e}")
        raise SystemExit(1) from None


def export(args):
    """Write each format next to the weights and check it; returns {format: (path, largest difference)}."""
    if args.batch_size < 1:
        raise UsageError(f"--batch-size {args.batch_size}: must be >= 1")
    if "onnx" in args.format:
        check_onnx_packages()
    ckpt = load_model_checkpoint(args.weights)
    weights = Path(ckpt["path"])  # a run directory's weights/best.pt
    cfg, classes = checkpoint_recipe(ckpt["recipe"], weights), ckpt["classes"]
    model = model_from_checkpoint(ckpt, cfg, weights)
    metadata = {"classes": list(classes), **preprocessing(cfg.data), "model": cfg.model.name,
                "output": f"logits (N, {len(classes)}); softmax gives class probabilities", "weights": str(weights)}
    if cfg.data.multilabel:  # probabilities: what a deployment compares with the thresholds
        model = torch.nn.Sequential(model, torch.nn.Sigmoid()).eval()
        metadata.update(output=f"probabilities (N, {len(classes)}), one per class (sigmoid); a class is predicted "
                               f"when its probability reaches its threshold",
                        thresholds=ckpt["thresholds"] or [cfg.train.threshold] * len(classes))
    size = val_size(cfg.data)
    # A dynamic batch is traced on a batch of 2 or more: torch.export specialises a batch of 1 to that size.
    example = torch.randn(max(args.batch_size, 2 if args.dynamic_batch else 1), 3, size, size,
                          generator=torch.Generator().manual_seed(0))
    # Checked on the export's batch size and, for a dynamic batch, on another.
    checks = [example] + ([torch.randn(1, 3, size, size), torch.randn(len(example) + 3, 3, size, size)]
                          if args.dynamic_batch else [])
    results = {}
    for fmt in args.format:
        path = weights.with_suffix(SUFFIXES[fmt])
        with atomic_write(path, suffix=path.suffix) as tmp:  # in place only once checked
            run = (export_torchscript if fmt == "torchscript" else export_onnx)(model, example, metadata, tmp,
                                                                                args.dynamic_batch)
            difference = check_outputs(model, run, checks, f"{fmt} ({path})")
        LOGGER.info(f"{colorstr(fmt + ':')} {path} ({path.stat().st_size / 1e6:.1f} MB); outputs match PyTorch's "
                    f"within {ATOL:g} + {RTOL:g} x |output| (largest difference {difference:.1e} on batches of "
                    f"{', '.join(str(len(x)) for x in checks)})")
        results[fmt] = (path, difference)
    if cfg.train.precision != "fp32":  # the checks above compared fp32 with fp32
        LOGGER.info(f"{colorstr('export:')} the model trained and was validated in {cfg.train.precision}; exported "
                    f"models compute in fp32, which moves its logits by about {cfg.train.precision}'s rounding "
                    f"(python {script('val.py')} --weights {weights} --precision fp32 gives their figures)")
    return results


def check_onnx_packages():
    """ONNX export and its check need optional packages: name the missing ones and how to install them."""
    missing = [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(f"--format onnx (the default) needs {', '.join(missing)} (not installed): pip install -r "
                         f"requirements-export.txt, or --format torchscript")


def export_torchscript(model, example, metadata, path, dynamic_batch):
    """Trace the model to TorchScript with the metadata as the extra file metadata.json; returns a runner."""
    with warnings.catch_warnings():  # torch deprecates TorchScript for torch.export; C++ and mobile users still need it
        warnings.simplefilter("ignore", FutureWarning)
        traced = torch.jit.trace(model, example, check_trace=False)
        torch.jit.save(traced, str(path), _extra_files={"metadata.json": json.dumps(metadata)})
        loaded = torch.jit.load(str(path), map_location="cpu")
    return lambda x: loaded(x)


def export_onnx(model, example, metadata, path, dynamic_batch):
    """Export to ONNX (torch.export-based exporter) with each metadata item, JSON-encoded, in the model's
    metadata_props; returns a runner on onnxruntime's CPU provider."""
    import onnx
    import onnxruntime

    if "dynamo" in inspect.signature(torch.onnx.export).parameters:  # torch >= 2.5
        options = {"dynamo": True, "dynamic_shapes": ({0: torch.export.Dim("batch")},) if dynamic_batch else None}
    else:  # torch 2.4: the TorchScript-based exporter
        options = {"dynamic_axes": {"images": {0: "batch"}, "logits": {0: "batch"}, "probs": {0: "batch"}}
                   if dynamic_batch else None}
    if "external_data" in inspect.signature(torch.onnx.export).parameters:
        options["external_data"] = False  # one file, weights inside
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        output = "probs" if "thresholds" in metadata else "logits"  # multi-label models output probabilities
        torch.onnx.export(model, (example,), str(path), input_names=["images"], output_names=[output],
                          verbose=False, **options)
    proto = onnx.load(str(path))
    for key, value in metadata.items():
        proto.metadata_props.add(key=key, value=json.dumps(value))
    onnx.save(proto, str(path))
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"images": x.numpy()})[0])


@torch.no_grad()
def check_outputs(model, run, batches, name):
    """The largest difference between the exported model's and PyTorch's outputs over batches; an ExportMismatch
    beyond ATOL + RTOL * |PyTorch's|, or where either is not finite."""
    largest = 0.0
    for x in batches:
        expected, got = model(x), run(x)
        if not expected.isfinite().all():
            raise ExportMismatch(f"{name}: the checkpoint's own outputs are not finite (nan or inf); its weights "
                                 f"are broken, nothing to export")
        if got.shape != expected.shape:
            raise ExportMismatch(f"{name}: output shape {tuple(got.shape)}, PyTorch's {tuple(expected.shape)}")
        difference = (got - expected).abs()
        if not torch.isclose(got, expected, rtol=RTOL, atol=ATOL).all():  # nan in got is never close
            raise ExportMismatch(f"{name}: outputs differ from PyTorch's by up to {difference.max():.3g} (tolerance "
                                 f"{ATOL:g} + {RTOL:g} x |output|) on a batch of {len(x)}")
        largest = max(largest, difference.max().item())
    return largest


if __name__ == "__main__":
    after_imports()
    with quiet_ctrl_c("export.py"):
        main()
