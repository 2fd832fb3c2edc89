"""The EMA of the weights is updated every train.ema_steps steps of the run, also when epochs are shorter."""

import pytest

import train
from utils.checkpoint import load_checkpoint


def test_epochs_shorter_than_ema_steps_still_update_the_ema(image_folder, tmp_path):
    # 9 images in batches of 3: 3 steps an epoch, 9 in the run. With ema_steps=4 the EMA moves at the run's steps 4
    # and 8; warmup (the first epoch) ends before step 4, so both updates average.
    root = image_folder({"train": {"a": 5, "b": 4}, "val": {"a": 2, "b": 2}})
    train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=3", "train.batch_size=3", "model.width=4",
                "model.depth=1", "train.ema_decay=0.9", "train.ema_steps=4", f"project={tmp_path}"])
    ckpt = load_checkpoint(tmp_path / "exp" / "weights" / "last.pt")
    assert ckpt["ema"]["n_averaged"].item() == 2
    ema = {k.removeprefix("module."): v for k, v in ckpt["ema"].items() if k.startswith("module.")}
    assert any((ema[k] - v).abs().max() > 1e-6 for k, v in ckpt["model"].items())  # an average, not a copy


def test_ema_steps_beyond_the_run_are_refused(image_folder, tmp_path, capsys):
    root = image_folder({"train": {"a": 5, "b": 4}, "val": {"a": 2, "b": 2}})
    with pytest.raises(SystemExit) as e:
        train.main(["--recipe", "cls.yaml", f"data.name={root}", "train.epochs=2", "train.batch_size=3",
                    "model.width=4", "train.ema_decay=0.9", "train.ema_steps=7", f"project={tmp_path}"])
    assert e.value.code == 2
    assert ("train.ema_steps=7 is more than the run's 6 steps (2 epochs of 3): the EMA would never be updated; "
            "lower it") in capsys.readouterr().err
    assert not (tmp_path / "exp").exists()
