"""Recipes: the schema's defaults, base recipes, overrides, and an error naming key and file for each mistake."""

import re

import pytest
import yaml
from omegaconf import OmegaConf

from models import check_model_name
from utils.config import (MACHINE_KEYS, RECIPES_DIR, RESUME_KEYS, Recipe, RecipeError, check_resumable, load_recipe,
                          load_resumed_recipe, recipe_to_yaml)


def write(path, content):
    path.write_text(yaml.safe_dump(content) if isinstance(content, dict) else content)
    return path


def test_every_shipped_recipe_loads():
    for path in RECIPES_DIR.glob("*.yaml"):
        cfg = load_recipe(str(path), model_check=check_model_name)
        assert cfg.train.epochs >= 1


def test_recipe_found_by_name_in_recipes_dir():
    assert load_recipe("cls.yaml").data.name == "digits"
    assert load_recipe("cls") == load_recipe("cls.yaml")  # the suffix may be left off


def test_unset_keys_take_schema_defaults(tmp_path):
    cfg = load_recipe(str(write(tmp_path / "r.yaml", {"optim": {"lr": 0.05}})))
    assert cfg.optim.lr == 0.05
    assert cfg.optim.momentum == Recipe().optim.momentum
    assert cfg.project == "runs/train" and cfg.name == "exp"


def test_overrides_apply_after_recipe_with_types():
    cfg = load_recipe("cls.yaml", ["optim.lr=0.05", "train.epochs=3", "data.scale=[0.5,1.0]"])
    assert cfg.optim.lr == 0.05 and cfg.train.epochs == 3 and list(cfg.data.scale) == [0.5, 1.0]
    assert isinstance(cfg.train.epochs, int)


def test_loaded_recipe_is_read_only():
    cfg = load_recipe("cls.yaml")
    with pytest.raises(Exception):
        cfg.optim.lr = 1.0


def test_unknown_key_in_file_names_key_suggestion_and_file(tmp_path):
    path = write(tmp_path / "bad.yaml", {"optim": {"lrr": 0.1}})
    with pytest.raises(RecipeError) as e:
        load_recipe(str(path))
    assert "optim.lrr" in str(e.value) and "did you mean 'optim.lr'" in str(e.value) and str(path) in str(e.value)


def test_unknown_override_names_key_and_command_line():
    with pytest.raises(RecipeError, match=r"^command line: unknown key 'optim.lrr' \(did you mean optim.lr=0.1\?\)$"):
        load_recipe("cls.yaml", ["optim.lrr=0.1"])


@pytest.mark.parametrize("override, meant", [("epochs=3", "train.epochs=3"), ("lr=0.05", "optim.lr=0.05"),
                                             ("batch_size=8", "train.batch_size=8"), ("data.epochs=3", "train.epochs=3"),
                                             ("optimizer.lr=0.05", "optim.lr=0.05"), ("epoch=3", "train.epochs=3"),
                                             ("train.epoch=3", "train.epochs=3"), ("data.scal=[0.5,1.0]",
                                                                                 "data.scale=[0.5,1.0]")])
def test_an_unknown_key_suggests_the_full_key_it_likely_means_with_its_value(override, meant):
    unknown = override.split("=")[0]
    with pytest.raises(RecipeError, match=rf"^command line: unknown key '{unknown}' \(did you mean "
                                          rf"{re.escape(meant)}\?\)$"):
        load_recipe("cls.yaml", [override])


def test_an_unknown_key_like_no_other_points_to_the_key_table(tmp_path):
    with pytest.raises(RecipeError, match=r"^command line: unknown key 'colour' \(every key is in docs/recipes.md\)$"):
        load_recipe("cls.yaml", ["colour=red"])
    path = write(tmp_path / "r.yaml", {"epochs": 3})  # in a file: the key to write, not a key=value
    with pytest.raises(RecipeError, match=rf"^{re.escape(str(path))}: unknown key 'epochs' \(did you mean "
                                          rf"'train.epochs'\?\)$"):
        load_recipe(str(path))


@pytest.mark.parametrize("override, message", [
    ("data.scale=0.5", "data.scale must be a list of two numbers like data.scale=[0.08,1.0], got 0.5"),
    ("data.shard_hosts=example.com", "data.shard_hosts must be a list of names, got 'example.com'"),
    ("data.scale=[a,b]", "data.scale must be a list of two numbers like data.scale=[0.08,1.0], got ['a', 'b']"),
    ("data.scale=[0.5,1", "data.scale must be a list of two numbers like data.scale=[0.08,1.0], got '[0.5,1', "
                          "which does not parse as YAML (while parsing a flow sequence)"),
    ("data.mean=0.5", "data.mean must be a list of three numbers like data.mean=[0.485,0.456,0.406], got 0.5"),
    ("sched.milestones=30", "sched.milestones must be a list of numbers like sched.milestones=[30.0,60.0,90.0], "
                            "got 30"),
    ("train.epochs=ten", "train.epochs must be a whole number like train.epochs=10, got 'ten'"),
    ("train.epochs=2.5", "train.epochs must be a whole number like train.epochs=10, got 2.5"),
    ("optim.lr=fast", "optim.lr must be a number like optim.lr=0.1, got 'fast'"),
    ("train.compile=maybe", "train.compile must be true or false like train.compile=false, got 'maybe'"),
    ("model.name=[a]", "model.name must be text like model.name=resnet18, got ['a']"),
    ("optim=3", "optim is a section, not a value: set its keys one by one, like optim.name=sgd; got 3"),
])
def test_a_value_of_the_wrong_type_names_the_key_what_it_takes_and_the_command_line(override, message):
    with pytest.raises(RecipeError) as e:
        load_recipe("cls.yaml", [override])
    assert str(e.value) == f"command line: {message}"


def test_a_value_of_the_wrong_type_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path / "r.yaml", {"data": {"scale": {"min": 0.5}}})
    with pytest.raises(RecipeError) as e:
        load_recipe(str(path))
    assert str(e.value) == f"{path}: data.scale must be a list of two numbers like data.scale=[0.08,1.0], got " \
                           f"{{'min': 0.5}}"


def test_unknown_section_is_rejected(tmp_path):
    with pytest.raises(RecipeError, match=r"r.yaml: unknown key 'optimizer.lr' \(did you mean 'optim.lr'\?\)$"):
        load_recipe(str(write(tmp_path / "r.yaml", {"optimizer": {"lr": 0.1}})))


def test_wrong_type_names_key_and_file(tmp_path):
    path = write(tmp_path / "r.yaml", {"train": {"epochs": "ten"}})
    with pytest.raises(RecipeError) as e:
        load_recipe(str(path))
    assert "train.epochs" in str(e.value) and str(path) in str(e.value) and "'ten'" in str(e.value)


def test_section_given_a_scalar_is_rejected(tmp_path):
    with pytest.raises(RecipeError, match="r.yaml"):
        load_recipe(str(write(tmp_path / "r.yaml", {"optim": 3})))


def test_bad_values_name_the_key():
    cases = {"optim.name=sgdd": "optim.name", "train.precision=fp8": "train.precision", "device=tpu": "device",
             "model.name=resnet19": "closest: 'resnet18'", "data.scale=[0.5]": "data.scale",
             "train.epochs=0": "train.epochs", "data.hflip=1.5": "data.hflip", "seed=-1": "seed must be",
             "train.hang_seconds=1": "train.hang_seconds must be 0",
             "train.hang_seconds=inf": "train.hang_seconds must be 0", "train.hang_seconds=nan": "train.hang_seconds",
             "name=' '": "name must be", "name=..": "name must be",
             "name=a/b": "name must be a folder's name, without '/' (to group runs in a folder, set project",
             "data.shard_hosts=[http://example.com]": "data.shard_hosts must be a "
             "list of hosts, each host or host:port"}
    for override, message in cases.items():
        with pytest.raises(RecipeError, match=message.replace("(", r"\(")):
            load_recipe("cls.yaml", [override], model_check=check_model_name)


def test_model_name_is_checked_by_the_check_the_caller_gives():
    """utils/ imports nothing of models/: the scripts that build a model pass models.check_model_name."""
    assert load_recipe("cls.yaml", ["model.name=resnet19"]).model.name == "resnet19"  # no check given
    with pytest.raises(RecipeError, match=r"cls.yaml \(with command-line overrides\): model.name='resnet19': no such "):
        load_recipe("cls.yaml", ["model.name=resnet19"], model_check=check_model_name)
    saved = OmegaConf.to_container(load_recipe("cls.yaml", ["model.name=resnet19"]))
    with pytest.raises(RecipeError, match=r"^checkpoint recipe: model.name='resnet19': no such model"):
        load_resumed_recipe(saved, model_check=check_model_name)


def test_malformed_override():
    with pytest.raises(RecipeError, match="key=value"):
        load_recipe("cls.yaml", ["optim.lr"])


def test_missing_recipe_lists_available(tmp_path):
    with pytest.raises(RecipeError, match="not found.*cls.yaml"):
        load_recipe("nope.yaml")
    with pytest.raises(RecipeError, match=f"recipe '{tmp_path}' is a folder; give a recipe file in it, or the name of "
                                          f"one in {RECIPES_DIR} \\(cifar10"):
        load_recipe(str(tmp_path))


def test_invalid_yaml_names_file_line_and_column_and_a_key_given_twice_is_refused(tmp_path):
    path = write(tmp_path / "r.yaml", "optim:\n  lr: 0.1\n  momentum 0.9\n")
    with pytest.raises(RecipeError) as e:
        load_recipe(str(path))
    assert str(e.value) == (f"{path}, line 3, column 3: invalid YAML: while scanning a simple key, could not find "
                            f"expected ':'\n      momentum 0.9\n      ^")
    write(path, "train:\n  epochs: 3\n batch_size: 8\n")  # told where the problem is, not where its block began
    with pytest.raises(RecipeError) as e:
        load_recipe(str(path))
    assert str(e.value).startswith(f"{path}, line 3, column 2: invalid YAML: while parsing a block mapping, expected "
                                   f"<block end>, but found '<block mapping start>'\n     batch_size: 8\n     ^")
    write(path, "base: cls.yaml\nlr: &lr\n  lr: 0.1\noptim:\n  <<: *lr\n")  # YAML's merge key is no repeat
    with pytest.raises(RecipeError, match="unknown key 'lr.lr'"):  # read past the merge: optim.lr is known
        load_recipe(str(path))
    write(path, "train:\n  epochs: 3\ntrain:\n  batch_size: 8\n")  # PyYAML would keep the second section alone
    with pytest.raises(RecipeError) as e:
        load_recipe(str(path))
    assert str(e.value).splitlines()[0] == (f"{path}, line 3, column 1: invalid YAML: 'train' is given twice in one "
                                            f"mapping (the second would replace the first: merge them)")


def test_a_missing_base_is_named_with_the_recipe_that_asked_for_it_and_where_it_was_looked_for(tmp_path):
    path = write(tmp_path / "r.yaml", {"base": "nothere.yaml"})
    with pytest.raises(RecipeError) as e:
        load_recipe(str(path))
    assert str(e.value).startswith(f"{path}: base: recipe 'nothere.yaml' not found in {tmp_path} or in "
                                   f"{RECIPES_DIR} (available: cifar10")


def test_an_empty_recipe_is_refused_rather_than_trained_as_the_defaults(tmp_path):
    (tmp_path / "r.yaml").write_text("# a recipe\n")
    with pytest.raises(RecipeError, match=f"^{tmp_path / 'r.yaml'}: the recipe is empty; give it keys, or start from "
                                          f"another: base: cls.yaml$"):
        load_recipe(str(tmp_path / "r.yaml"))


def test_base_recipe_is_merged_under_the_child(tmp_path):
    write(tmp_path / "parent.yaml", {"optim": {"lr": 0.3, "name": "adamw"}, "train": {"epochs": 7}})
    child = write(tmp_path / "child.yaml", {"base": "parent.yaml", "optim": {"lr": 0.01}})
    cfg = load_recipe(str(child))
    assert cfg.optim.lr == 0.01 and cfg.optim.name == "adamw" and cfg.train.epochs == 7
    assert "base" not in recipe_to_yaml(cfg)


def test_base_from_recipes_dir(tmp_path):
    cfg = load_recipe(str(write(tmp_path / "c.yaml", {"base": "cls.yaml", "train": {"epochs": 2}})))
    assert cfg.data.name == "digits" and cfg.train.epochs == 2


def test_error_in_base_names_base_file(tmp_path):
    write(tmp_path / "parent.yaml", {"optim": {"lrr": 0.3}})
    child = write(tmp_path / "child.yaml", {"base": "parent.yaml"})
    with pytest.raises(RecipeError, match="parent.yaml: unknown key 'optim.lrr'"):
        load_recipe(str(child))


def test_base_cycle_is_an_error(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml"})
    write(tmp_path / "b.yaml", {"base": "a.yaml"})
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(str(tmp_path / "a.yaml"))


def test_resolved_yaml_round_trips():
    cfg = load_recipe("cls.yaml", ["optim.lr=0.02"])
    again = OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.create(recipe_to_yaml(cfg)))
    assert again == cfg


def test_base_is_found_next_to_the_recipe_before_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "recipes").mkdir()
    write(tmp_path / "here" / "parent.yaml", {"train": {"epochs": 1}})  # in the current directory
    write(tmp_path / "recipes" / "parent.yaml", {"train": {"epochs": 2}})  # next to the child
    child = write(tmp_path / "recipes" / "child.yaml", {"base": "parent.yaml"})
    monkeypatch.chdir(tmp_path / "here")
    assert load_recipe(str(child)).train.epochs == 2


def test_resume_may_change_only_what_cannot_change_the_run_so_far():
    saved = OmegaConf.to_container(load_recipe("cls.yaml"))
    cfg = load_resumed_recipe(saved, ["train.epochs=20", "data.workers=2", "project=elsewhere",
                                      "data.skip_corrupt=true"])  # what an unreadable image's line says to set
    assert cfg.train.epochs == 20 and cfg.data.workers == "2" and cfg.optim.lr == saved["optim"]["lr"]
    assert cfg.data.skip_corrupt
    with pytest.raises(RecipeError, match=r"command line: optim.lr=0.5 cannot change on resume: the run so far was "
                                          rf"trained with optim.lr={saved['optim']['lr']}; only train.epochs, .* may change"):
        load_resumed_recipe(saved, ["optim.lr=0.5"])
    with pytest.raises(RecipeError, match="unknown key 'optim.lrr'"):
        load_resumed_recipe(saved, ["optim.lrr=0.5"])


def test_a_restarted_machine_keeps_its_own_data_path_which_a_resume_may_not_change():
    saved = load_recipe("cls.yaml", ["data.name=/mnt/a/data"])
    mine = load_recipe("cls.yaml", ["data.name=/data/here", "data.cache_dir=/scratch"])  # another machine's paths
    check_resumable(saved, mine, "the recipe on restart", own=MACHINE_KEYS)
    with pytest.raises(RecipeError, match="data.name='/data/here' cannot change on resume"):
        check_resumable(saved, mine, "command line")


def test_docs_name_every_key_a_resume_may_change():
    listed = (RECIPES_DIR.parent / "docs" / "distributed.md").read_text().split("Overrides may change only")[1]
    listed = listed.split("; any other override is refused")[0]
    assert [key for key in RESUME_KEYS if f"`{key}`" not in listed and not key.startswith("log.")] == []
    assert "`log.*` keys" in listed


def test_sync_bn_on_several_processes_needs_drop_last(monkeypatch):
    import utils.config
    monkeypatch.setattr(utils.config, "WORLD_SIZE", 2)
    with pytest.raises(RecipeError, match="model.sync_bn must be used with data.drop_last=true on several processes"):
        load_recipe("cls.yaml", ["model.sync_bn=true"])
    assert load_recipe("cls.yaml", ["model.sync_bn=true", "data.drop_last=true"]).model.sync_bn


def test_new_keys_are_checked():
    for override, message in {"model.norm=layer": "model.norm must be batch, group or none",
                              "train.save_every_steps=-1": "train.save_every_steps must be >= 0"}.items():
        with pytest.raises(RecipeError, match=message):
            load_recipe("cls.yaml", [override])


def test_ddp_options_are_checked():
    checked = r"cls.yaml \(with command-line overrides\): "  # values are checked after the merge, types during it
    for override, message in {"ddp.comm_hook=int8": checked + "ddp.comm_hook must be none, bf16, fp16, got 'int8'",
                              "ddp.bucket_cap_mb=0": checked + "ddp.bucket_cap_mb must be > 0",
                              "ddp.gradient_as_bucket_view=maybe": "command line: ddp.gradient_as_bucket_view must be "
                                                                   "true or false like ddp.gradient_as_bucket_view=false, "
                                                                   "got 'maybe'",
                              }.items():
        with pytest.raises(RecipeError, match=message):
            load_recipe("cls.yaml", [override])


def test_resume_may_change_ddp_buckets_but_not_the_comm_hook():
    saved = OmegaConf.to_container(load_recipe("cls.yaml"))
    cfg = load_resumed_recipe(saved, ["ddp.bucket_cap_mb=100", "ddp.gradient_as_bucket_view=true"])
    assert cfg.ddp.bucket_cap_mb == 100 and cfg.ddp.gradient_as_bucket_view
    with pytest.raises(RecipeError, match="ddp.comm_hook='bf16' cannot change on resume"):
        load_resumed_recipe(saved, ["ddp.comm_hook=bf16"])


def test_device_takes_a_gpu_index_from_the_command_line_and_from_yaml(tmp_path, monkeypatch):
    import torch

    from utils.torch_utils import select_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    # device=1 reaches OmegaConf as an int, from the command line and from YAML alike
    recipes = [load_recipe("cls.yaml", ["device=1"]), load_recipe("cls.yaml", ["device=cuda:1"]),
               load_recipe(str(write(tmp_path / "r.yaml", "base: cls.yaml\ndevice: 1\n")))]
    assert [cfg.device for cfg in recipes] == ["1", "cuda:1", "1"]
    assert all(select_device(cfg.device, local_world_size=1) == torch.device("cuda", 1) for cfg in recipes)
    expected = "device must be auto, cpu, cuda, cuda:N or a GPU index N, got "
    with pytest.raises(RecipeError, match=r"^.*cls.yaml \(with command-line overrides\): " + expected + "'gpu'$"):
        load_recipe("cls.yaml", ["device=gpu"])
    with pytest.raises(RecipeError, match=f"^{tmp_path / 'r.yaml'}: {expected}'0,1'$"):
        load_recipe(str(write(tmp_path / "r.yaml", "base: cls.yaml\ndevice: 0,1\n")))


@pytest.mark.parametrize("spelling", ["", "''", "null", "none", "None", "NULL"])
def test_every_spelling_of_off_turns_an_optional_string_off(spelling, tmp_path):
    # The shell turns model.weights='' into model.weights=, which OmegaConf reads as None; none and null are
    # what users type too. Each means off ('') for every optional string key, on the command line and in a file.
    keys = ["model.weights", "data.auto_augment", "data.cache_dir", "train.class_weights"]
    cfg = load_recipe("folder.yaml", [f"{key}={spelling}" for key in keys])
    assert [OmegaConf.select(cfg, key) for key in keys] == [""] * 4
    recipe = tmp_path / "off.yaml"
    recipe.write_text(f"base: folder.yaml\nmodel:\n  weights: {spelling}\ndata:\n  auto_augment: {spelling}\n")
    cfg = load_recipe(str(recipe))
    assert (cfg.model.weights, cfg.data.auto_augment) == ("", "")
    resumed = load_resumed_recipe(OmegaConf.to_container(load_recipe("folder.yaml", ["model.weights="])),
                                  [f"model.weights={spelling}"])
    assert resumed.model.weights == ""


def test_off_spellings_leave_other_strings_and_values_alone():
    cfg = load_recipe("cls.yaml", ["data.cache=none", "model.weights=None.pt"])
    assert (cfg.data.cache, cfg.model.weights) == ("none", "None.pt")
    with pytest.raises(RecipeError, match="^command line: data.name must be text like data.name=digits, got nothing$"):
        load_recipe("cls.yaml", ["data.name="])  # not optional: no default of ''


@pytest.mark.parametrize("words, line", [
    (["--epochs", "3"], "--epochs 3: recipe keys are set as key=value: train.epochs=3"),
    (["--epochs=3"], "--epochs=3: recipe keys are set as key=value: train.epochs=3"),
    (["--recipe", "cls.yaml", "--batch-size", "64", "optim.lr=0.1"],
     "--batch-size 64: recipe keys are set as key=value: train.batch_size=64"),
    (["--compile"], "--compile: recipe keys are set as key=value: train.compile=true"),
])
def test_a_flag_that_names_a_recipe_key_says_how_keys_are_set(words, line, capfd):
    import train
    with pytest.raises(SystemExit) as e:
        train.main(words)
    assert e.value.code == 2 and capfd.readouterr().err == f"train.py: error: {line}\n"


def test_train_help_says_how_keys_are_set_where_they_are_described_and_lists_them(capfd):
    import train
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--help"])
    out = capfd.readouterr().out
    words = " ".join(out.split())
    assert e.value.code == 0
    assert "recipe keys: set any key as key=value after the options" in words
    assert "are in docs/recipes.md (python -m utils.config prints them)" in words
    assert "\n  train: epochs, batch_size, accumulate," in out and "\n  top level: device, seed, project, name" in out


def test_train_takes_project_and_name_as_val_and_predict_do_for_the_recipe_keys(capfd):
    import train
    args = train.parse_args(["--recipe", "cls.yaml", "train.epochs=1", "--project", "out", "optim.lr=0.1",
                             "--name=first"])
    assert args.overrides == ["train.epochs=1", "optim.lr=0.1", "project=out", "name=first"]  # after --project too
    cfg = load_recipe(args.recipe, args.overrides)
    assert (cfg.project, cfg.name, cfg.optim.lr) == ("out", "first", 0.1)
    assert train.parse_args(["--resume", "--project", "out"]).overrides == ["project=out"]  # the newest run there
    with pytest.raises(SystemExit) as e:
        train.main(["--project", "a", "project=b"])
    assert e.value.code == 2 and capfd.readouterr().err == ("train.py: error: --project a and project=b both set "
                                                            "project; give one\n")
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    words = " ".join(capfd.readouterr().out.split())
    assert "--project PROJECT the same as the recipe key project=PROJECT (val.py and predict.py take --project too)" \
        in words and "--name NAME the same as the recipe key name=NAME" in words
