"""scripts/lint.sh: the tree has no ruff, mypy or shellcheck finding, and a file with one fails the lint; mypy's
files are the project's modules."""

import os
import subprocess
import tomllib

import helpers

LINT = helpers.REPO_ROOT / "scripts" / "lint.sh"


def lint(*paths):
    # ruff and shellcheck are in the environment that runs the tests (requirements-dev.txt).
    env = dict(os.environ, PATH=f"{helpers.VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(["bash", str(LINT), *map(str, paths)], env=env, capture_output=True, text=True, timeout=120)


def test_the_tree_has_no_lint_finding():
    result = lint()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "== ruff " in result.stdout and "== shellcheck " in result.stdout and ".ci/run" in result.stdout
    assert "== mypy " in result.stdout and "Success: no issues found" in result.stdout


def test_a_python_and_a_shell_finding_each_fail_the_lint(tmp_path):
    clean_py, clean_sh = tmp_path / "clean.py", tmp_path / "clean.sh"
    clean_py.write_text('import os\n\nprint(os.sep)\n')
    clean_sh.write_text('#!/usr/bin/env bash\necho "$1"\n')
    assert lint(clean_py, clean_sh).returncode == 0
    unused_import = tmp_path / "unused_import.py"
    unused_import.write_text("import os\n")  # F401
    unquoted = tmp_path / "unquoted.sh"
    unquoted.write_text("#!/usr/bin/env bash\necho $1\n")  # SC2086
    for path, finding in ((unused_import, "F401"), (unquoted, "SC2086")):
        result = lint(clean_py, clean_sh, path)
        assert result.returncode != 0 and finding in result.stdout, result.stdout + result.stderr


def test_a_type_error_and_an_unannotated_function_each_fail_the_lint(tmp_path):
    annotated = tmp_path / "annotated.py"
    annotated.write_text("def double(x: int) -> int:\n    return 2 * x\n")
    assert lint(annotated).returncode == 0
    wrong_return = tmp_path / "wrong_return.py"
    wrong_return.write_text("def double(x: int) -> str:\n    return 2 * x\n")
    unannotated = tmp_path / "unannotated.py"  # the strictness: every function annotated
    unannotated.write_text("def double(x):\n    return 2 * x\n")
    for path, finding in ((wrong_return, "[return-value]"), (unannotated, "[no-untyped-def]")):
        result = lint(annotated, path)
        assert result.returncode != 0 and finding in result.stdout, result.stdout + result.stderr


def test_the_type_check_covers_every_module_of_the_project():
    """mypy's files are the root modules and the packages that pyproject.toml installs: a new one is checked."""
    pyproject = tomllib.loads((helpers.REPO_ROOT / "pyproject.toml").read_text())
    installed = pyproject["tool"]["setuptools"]
    project = {f"{module}.py" for module in installed["py-modules"]} | set(installed["packages"])
    assert set(pyproject["tool"]["mypy"]["files"]) == project
