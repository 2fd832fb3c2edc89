"""The project's imports go one way: the scripts (train, val, predict, export, tune) -> data/, models/ -> utils/, with no
cycle; read from the source with ast, imports inside functions included (a function-level import is still an
arrow, only a later one). A script run as a command collects no garbage while it imports, then freezes what it
imported."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("utils", "data", "models")
SCRIPTS = ("train", "val", "predict", "export", "tune")


def project_modules():
    """{module name: file} of the packages' modules (a package's __init__.py is the package) and the scripts."""
    modules = {name: ROOT / f"{name}.py" for name in SCRIPTS}
    for package in PACKAGES:
        for path in sorted((ROOT / package).glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported(source, module, is_package, known):
    """[(imported project module, line)] for every import statement in source, at any depth, of the modules in
    known: `import a.b` names a.b, `from a import b` names a.b where that is a module, else a."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            prefixes = [".".join(parts[:n]) for n in range(len(parts), 0, -1)]
            target = next((p for p in prefixes if p in known), None)  # import a.b.c of a.b's attribute: a.b
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


def import_graph():
    """{module: {imported project module: first line importing it}} over project_modules()."""
    modules = project_modules()
    graph = {}
    for module, path in modules.items():
        graph[module] = {}
        for target, line in imported(path.read_text(), module, path.stem == "__init__", modules):
            graph[module].setdefault(target, line)
    return graph


def cycles(graph):
    """One cycle [a, b, ..., a] per group of modules that import each other (Tarjan's strongly connected
    components), in a stable order."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [path_around(graph, group) for group in groups]


def path_around(graph, group):
    """A shortest cycle through the first module of group, staying inside group (breadth first)."""
    start = min(group)
    paths = {target: [start, target] for target in sorted(graph[start]) if target in group}
    queue = list(paths)
    while start not in paths:
        node = queue.pop(0)
        for target in sorted(graph[node]):
            if target in group and target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    return paths[start]


def arrows(graph, sources, targets):
    """'source -> target (file:line)' for every import from a module in sources of a module in targets."""
    return [f"{module} -> {target} ({project_modules()[module].relative_to(ROOT)}:{line})"
            for module, imports in sorted(graph.items()) if in_group(module, sources)
            for target, line in sorted(imports.items()) if in_group(target, targets)]


def in_group(module, group):
    """Whether module is one of group: a script's name, or a package and its modules."""
    return any(module == name or module.startswith(f"{name}.") for name in group)


def test_the_graph_sees_module_and_function_level_imports_of_every_form():
    known = {"utils", "utils.general", "utils.config", "data", "data.cifar", "models"}
    source = ("import os\nimport utils.general\nfrom utils import config, general\nfrom data.cifar import CIFAR\n"
              "def f():\n    from models import build_model\n    import torch.nn\n    from . import general\n")
    assert imported(source, "utils.config", False, known) == [
        ("utils.general", 2), ("utils.general", 3), ("data.cifar", 4), ("models", 6), ("utils.general", 8)]
    graph = import_graph()
    assert {"train", "val", "predict", "export", "utils.config", "data.cifar", "models"} <= set(graph)
    assert "data.cifar" in graph["data.sources"] and "utils.checkpoint" in graph["models"]  # it does read them


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycle(s): " + "; ".join(" -> ".join(cycle) for cycle in found)


def test_utils_imports_nothing_above_it():
    wrong = arrows(import_graph(), ["utils"], ["data", "models", *SCRIPTS])
    assert not wrong, "utils/ must not import data/, models/ or a script: " + "; ".join(wrong)


def test_data_and_models_import_no_script_nor_each_other():
    graph = import_graph()
    wrong = (arrows(graph, ["data", "models"], SCRIPTS) + arrows(graph, ["data"], ["models"])
             + arrows(graph, ["models"], ["data"]))
    assert not wrong, "data/ and models/ import only utils/ (and themselves): " + "; ".join(wrong)


def test_jpeg_bytes_are_decoded_in_one_place_by_torchcodec_not_torchvisions_deprecated_decoders():
    """data/batches.py's decode_jpegs is the one decoder of JPEG bytes; torchvision.io's decoders appear only in
    benchmarks/data.py, which measures TorchCodec against them."""
    users = {str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py") if "tests" not in path.parts
             and ".venv" not in str(path) and re.search(r"torchvision\.io import|torchvision\.io\.decode",
                                                         path.read_text())}
    assert users == {"benchmarks/data.py"}
    decoders = {str(path.relative_to(ROOT)) for path in ROOT.rglob("*.py") if "tests" not in path.parts
                and "from torchcodec" in path.read_text()}
    assert decoders == {"data/batches.py"}


# Run with a script's path: runs it as a command (--help), counting the garbage collections that start once it began
# importing torch until it froze its imports' objects (utils/general.after_imports), how many it froze, and whether
# it collects again after.
PROBE = """
import atexit, gc, sys
path = sys.argv[1]
code = compile(open(path).read(), path, "exec")
unfrozen = []
gc.callbacks.append(lambda phase, info: phase == "start" and "torch" in sys.modules and not gc.get_freeze_count() and
                    unfrozen.append(info))
atexit.register(lambda: print(f"collections importing torch before the freeze: {len(unfrozen)}, "
                             f"frozen: {gc.get_freeze_count()}, collecting: {gc.isenabled()}"))
sys.argv = [path, "--help"]
exec(code, {"__name__": "__main__", "__file__": path})
"""


@pytest.mark.parametrize("script", [*(f"{s}.py" for s in SCRIPTS), "data/shards.py", "data/shard_index.py"])
def test_a_script_run_as_a_command_collects_no_garbage_while_importing_then_freezes_its_imports(script):
    result = subprocess.run([sys.executable, "-c", PROBE, script], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]
    counts = re.search(r"collections importing torch before the freeze: (\d+), frozen: (\d+), collecting: (\w+)",
                       result.stdout)
    before, frozen, collecting = int(counts[1]), int(counts[2]), counts[3]
    # frozen: about 550,000 objects of torch, torchvision and the rest (350,000 of them survive a collection)
    assert before == 0 and frozen > 100_000 and collecting == "True", (before, frozen, collecting)
