"""The README documents the project as it is."""

from dataclasses import fields, is_dataclass

from conftest import ROOT
from utils.config import Recipe, key_table

README = (ROOT / "README.md").read_text()


def schema_keys(cls, prefix=""):
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            yield from schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_readme_starts_with_the_two_setup_commands():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    assert "pip install -r requirements.txt && torchrun --nproc_per_node=2 train.py --recipe cls.yaml" in first_block
    assert "pip install -r requirements.txt -r requirements-export.txt && python -m pytest -q tests" in first_block


def test_readme_documents_every_recipe_key():
    missing = [key for key in schema_keys(Recipe) if f"| `{key}` |" not in README]
    assert not missing, f"README recipe-key table lacks {missing}"
    # The table is the schema's: defaults and comments as in utils/config.py (python -m utils.config prints it).
    assert key_table() in README, "README's recipe-key table differs from `python -m utils.config`"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-r requirements.txt -r requirements-export.txt" in ci and "python -m pytest -q tests" in ci
