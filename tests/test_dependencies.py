"""Every import is declared: the library's in `dependencies`, the experiments' in the
`experiments` extra (or an optional extra where the import is guarded), the tests' in `dev`;
and the layers import downwards only: library <- experiments (trainer, tasks, benchmarks) <-
configs; the entry points read a config file by its path, and nothing under experiments/
imports configs/."""

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIRST_PARTY = {"linear_transformers", "experiments", "configs"}
# Imported only inside a function, for an optional feature that says how to install it: torch
# (the `torch` extra), the authors' library (peers in benchmarks, live tests), tensorboardX,
# triton (the kernels' compilation for a GPU, `experiments/kernel_resources.py`; dev extra).
OPTIONAL = {"torch", "fast_transformers", "tensorboardX", "triton"}


def _imports(folder: str, *, first_party: bool = False) -> set[str]:
    """Top-level names `folder` imports: third-party ones, or first-party ones."""
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    if first_party:
        return names & FIRST_PARTY
    return names - set(sys.stdlib_module_names) - FIRST_PARTY - {"__future__"}


def _declared(requirements: list[str]) -> set[str]:
    """Import names of the distributions in `requirements`."""
    dists = {re.split(r"[<>=\[ ;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}
    return {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if any(owner.lower().replace("_", "-") in dists for owner in owners)
    }


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_library_imports_only_its_dependencies():
    project = _project()
    library = _declared(project["dependencies"])
    undeclared = _imports("linear_transformers") - library - {"torch"}
    assert not undeclared, f"linear_transformers imports undeclared {sorted(undeclared)}"


def test_the_experiments_import_only_declared_packages():
    project = _project()
    declared = _declared(project["dependencies"] + project["optional-dependencies"]["experiments"])
    used = _imports("experiments") | _imports("configs")
    undeclared = used - declared - OPTIONAL
    assert not undeclared, f"experiments/configs import undeclared {sorted(undeclared)}"


def test_the_tests_import_only_declared_packages():
    project = _project()
    extras = project["optional-dependencies"]
    declared = _declared(project["dependencies"] + extras["experiments"] + extras["dev"])
    local = {p.stem for p in (ROOT / "tests").rglob("*.py")}
    undeclared = _imports("tests") - declared - OPTIONAL - local
    assert not undeclared, f"tests import undeclared {sorted(undeclared)}"


def _modules_named_in_import_calls(folder: str) -> dict[str, set[str]]:
    """{file: module names} of `importlib.import_module(...)` / `__import__(...)` calls under
    `folder`, as far as their first argument is a literal (an f-string: its leading literal)."""
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in ("import_module", "__import__"):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.JoinedStr):
                arg = arg.values[0] if arg.values else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.setdefault(str(path.relative_to(ROOT)), set()).add(arg.value)
    return found


def test_the_library_imports_no_experiment_and_the_experiments_no_config_file():
    assert _imports("linear_transformers", first_party=True) == {"linear_transformers"}
    # The trainer, tasks and benchmarks take config objects from the tasks; config files import
    # the tasks' schemas and variants, never the reverse, by import statement or by name.
    assert "configs" not in _imports("experiments", first_party=True)
    by_name = {
        path: names
        for path, names in _modules_named_in_import_calls("experiments").items()
        if any(name.split(".")[0] == "configs" for name in names)
    }
    assert not by_name, f"experiments/ import configs/ by name: {by_name}"


def _modules_importing(folder: str, module: str) -> set[str]:
    """Files under `folder` that import `module` (absolute imports, any form)."""
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            if module in names:
                found.add(str(path.relative_to(ROOT)))
    return found


def test_one_training_path_from_the_entry_points_to_the_library():
    # Only the trainer builds an optimizer or takes gradients (config_checks reads the names of
    # the optimizers); every entry point that trains goes through experiments.tasks, which
    # hands the config's task to that trainer.
    assert _modules_importing("experiments", "experiments.training.optimizer") == {
        "experiments/training/trainer.py",
        "experiments/training/config_checks.py",
    }
    # (Benchmarks time gradients of ops; they train nothing.)
    gradients = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "experiments").rglob("*.py")
        if "benchmarking" not in path.parts
        and re.search(r"\b(value_and_grad|nnx\.Optimizer)\b", path.read_text())
    }
    assert gradients == {"experiments/training/trainer.py"}
    definitions = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "experiments").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "train_and_evaluate"
    }
    assert definitions == {"experiments/training/trainer.py", "experiments/tasks/__init__.py"}
    assert _modules_importing("experiments", "experiments.tasks") >= {
        "experiments/train.py",
        "experiments/benchmarking/copy_bench.py",
    }


def test_the_benchmarks_build_the_paper_image_model_in_one_place():
    # generation_bench.paper_config / paper_model (from the image task's paper_config) are the one
    # source of the paper's model; the prefill and accelerator benchmarks call them.
    assert _modules_importing("experiments/benchmarking", "experiments.tasks.image_generation") == {
        "experiments/benchmarking/generation_bench.py"
    }
    assert {
        "experiments/benchmarking/prefill_bench.py",
        "experiments/benchmarking/accelerator_bench.py",
    } <= _modules_importing("experiments/benchmarking", "experiments.benchmarking.generation_bench")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _first_party_imports() -> dict[str, set[str]]:
    """{first-party module: the first-party modules it imports, inside functions too}; `from
    package import name` imports the submodule `name` where there is one."""
    files = {_module_name(path): path for folder in FIRST_PARTY for path in (ROOT / folder).rglob("*.py")}
    graph = {}
    for module, path in files.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    imported.add(submodule if submodule in files else node.module)
        graph[module] = imported & set(files)
    return graph


def test_no_module_imports_one_that_imports_it_back():
    # Imports inside functions included: one there does not undo a circle, only hides it. What
    # both sides need belongs in a module below them (experiments/training/config_diff.py,
    # linear_transformers/core_options.py).
    graph = _first_party_imports()
    circles = []

    def visit(module, trail):
        for other in sorted(graph[module]):
            if other in trail:
                circles.append(trail[trail.index(other) :] + [other])
            elif other not in done:
                visit(other, trail + [other])
        done.add(module)

    done = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_trainer_imports_no_task_benchmark_or_entry_point():
    # experiments/training/ is the layer the tasks stand on: what only tasks use lives with them.
    upward = {
        (module, other)
        for module, imported in _first_party_imports().items()
        if module.startswith("experiments.training")
        for other in imported
        if not other.startswith(("experiments.training", "experiments.data", "linear_transformers"))
    }
    assert not upward, f"the trainer imports upward: {sorted(upward)}"
