"""The tree's architecture, read from the imports of every tracked module: which folder may import which (the
arrows form no circle; data/ knows nothing of training or fine-tuning), the modules import each other in no circle,
no library imports a command-line module or an entry point, and no file patches the import path."""

import ast
import subprocess

import helpers

ENTRY_POINTS = {"run_pretraining", "run_squad", "run_glue"}
MODEL = {"modeling", "optimization", "lans", "schedulers"}
# Modules whose job is their command line: no module imports them.
COMMAND_LINES = {"training.preflight", "training.supervisor"}
# What each layer of library code may import of the project (itself included).
ALLOWED = {
    "common": {"common"},
    "data": {"common", "data"},
    "model": {"common", "model"},
    "training": {"common", "data", "model", "training"},  # the pretraining driver's modules read the shards
    "finetune": {"common", "data", "model", "training", "finetune"},
}


def layer(module: str):
    """The layer of a project module ('common', 'data', 'model', 'training', 'finetune', 'entry point'), or
    None for a module from outside the project."""
    top = module.split(".")[0]
    if top in ALLOWED and top != "model":
        return top
    if top in MODEL:
        return "model"
    if top in ENTRY_POINTS:
        return "entry point"
    return None


def imported_modules(source: str) -> set:
    """Every module an import statement names, `from package import module` included as package.module."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def library_modules() -> dict:
    """{module name: its source} of the project's library code (the packages and the root's modules)."""
    files = subprocess.run(["git", "ls-files", "*.py"], cwd=helpers.REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    modules = {}
    for name in files:
        module = name.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if layer(module) is not None:
            modules[module] = (helpers.REPO_ROOT / name).read_text()
    return modules


def arrow_violations(modules: dict) -> list:
    problems = []
    for module, source in sorted(modules.items()):
        own = layer(module)
        for imported in sorted(imported_modules(source)):
            target = layer(imported)
            if target is None or imported == module:
                continue
            if own == "entry point":
                if target == "entry point":
                    problems.append(f"{module} imports the entry point {imported}")
                continue
            line = f"{module} ({own}) imports {target}"
            if target not in ALLOWED[own] and line not in problems:
                problems.append(line)
            if imported in COMMAND_LINES:
                problems.append(f"{module} imports the command-line module {imported}")
    return problems


def test_imports_follow_the_arrows_between_folders():
    modules = library_modules()
    assert {"common.errors", "data.dataset", "training.distributed", "training.command_line", "finetune.finetuning",
            "run_pretraining"} <= set(modules)
    assert arrow_violations(modules) == []


def test_the_check_finds_a_wrong_arrow():
    """Negative control: data/ importing training, a library importing the preflight CLI, two entry points."""
    modules = {"data.dataset": "from training import distributed\n",
               "training.distributed": "import training.preflight\n",
               "run_glue": "import run_squad\n", "common.errors": "from finetune.glue import TASKS\n"}
    assert arrow_violations(modules) == [
        "common.errors (common) imports finetune", "data.dataset (data) imports training",
        "run_glue imports the entry point run_squad",
        "training.distributed imports the command-line module training.preflight"]


def imports_as_a_module(source: str) -> set:
    """imported_modules of `source` without its `if __name__ == "__main__":` block: that block runs only where the
    file is the program (`python -m training.checkpointing export`), as the module __main__, and what it imports
    then imports the file's module afresh, with no circle."""
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if not (isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))]
    return imported_modules(ast.unparse(tree))


def import_cycle(modules: dict) -> list:
    """A circle of imports between the project modules of `modules` ([] when they form a DAG): the modules
    along it, the first repeated at the end."""
    arrows = {module: sorted(name for name in imports_as_a_module(source) if name in modules and name != module)
              for module, source in modules.items()}
    done, path = set(), []

    def visit(module):
        if module in path:
            return path[path.index(module):] + [module]
        if module in done:
            return []
        path.append(module)
        for imported in arrows[module]:
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        done.add(module)
        return []

    for module in sorted(modules):
        cycle = visit(module)
        if cycle:
            return cycle
    return []


def test_the_modules_import_each_other_in_no_circle():
    assert import_cycle(library_modules()) == []


def test_the_check_finds_a_circle():
    """Negative control: two training modules that import each other, through a third."""
    modules = {"training.command_line": "from training import distributed\n",
               "training.distributed": "from training import device_setup\n",
               "training.device_setup": "import training.command_line\n"}
    assert import_cycle(modules) == ["training.command_line", "training.distributed", "training.device_setup",
                                     "training.command_line"]
    # a program's own block is no arrow: the file runs there as __main__
    program = {"training.checkpointing": 'if __name__ == "__main__":\n    from training import checkpoint_export\n',
               "training.checkpoint_export": "from training import checkpointing\n"}
    assert import_cycle(program) == []
    program["training.checkpointing"] += "import training.checkpoint_export\n"
    assert import_cycle(program) == ["training.checkpoint_export", "training.checkpointing",
                                     "training.checkpoint_export"]


def test_no_file_patches_the_import_path():
    patch = "sys." + "path"  # spelled in two parts, so that this file does not match itself
    found = subprocess.run(["git", "grep", "-n", "-F", patch, "--", "*.py", "*.sh"], cwd=helpers.REPO_ROOT,
                           capture_output=True, text=True).stdout
    assert found == ""
