"""The README documents the project as it is."""

import re
from dataclasses import fields, is_dataclass

from conftest import ROOT
from utils.config import Recipe, key_table

README = (ROOT / "README.md").read_text()
RECIPE_KEYS = (ROOT / "docs" / "recipes.md").read_text()


def schema_keys(cls, prefix=""):
    for f in fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            yield from schema_keys(type(default), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_readme_starts_with_the_two_setup_commands():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0]
    assert "pip install -r requirements-lock.txt && torchrun --nproc_per_node=2 train.py --recipe cls.yaml" in first_block
    assert "pip install -r requirements-lock.txt && python -m pytest -q -n auto --dist loadfile tests" in first_block


def test_docs_document_every_recipe_key():
    missing = [key for key in schema_keys(Recipe) if f"| `{key}` |" not in RECIPE_KEYS]
    assert not missing, f"docs/recipes.md's key table lacks {missing}"
    # The table is the schema's: defaults and comments as in utils/config.py (python -m utils.config prints it).
    assert key_table() in RECIPE_KEYS, "docs/recipes.md's key table differs from `python -m utils.config`"


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install --quiet --disable-pip-version-check -r requirements-lock.txt" in ci
    assert "\npython -m pytest -q -n auto --dist loadfile tests\n" in ci


def requirement_lines(name):
    """The requirement lines of a requirements file: comments, blanks and options dropped."""
    lines = (ROOT / name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip() and not line.startswith("-")]


def test_the_lock_pins_every_requirement_within_its_range():
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in requirement_lines("requirements-lock.txt"):
        pin = Requirement(line)
        if pin.marker is None or pin.marker.evaluate(default_environment()):  # this Python's line of a forked pin
            (version,) = [spec.version for spec in pin.specifier if spec.operator == "=="]
            pins[canonicalize_name(pin.name)] = version
    for line in [*requirement_lines("requirements.txt"), *requirement_lines("requirements-export.txt"),
                 *requirement_lines("requirements-tune.txt"), *requirement_lines("requirements-track.txt")]:
        wanted = Requirement(line)
        name = canonicalize_name(wanted.name)
        assert name in pins, f"requirements-lock.txt lacks {wanted.name}: refresh it (README, Install)"
        assert wanted.specifier.contains(pins[name], prereleases=True), f"{wanted.name}=={pins[name]} is not {wanted}"


def anchors(markdown):
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_readme_is_short_and_its_links_lead_somewhere():
    assert len(README.splitlines()) <= 300, "README.md is for a newcomer: move the detail to docs/"
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith("http"):
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            assert linked.exists(), f"{page.name} links to {target}: no such file"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked.read_text()), f"{page.name} links to {target}: no such heading"
