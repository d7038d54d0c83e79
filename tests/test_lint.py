"""scripts/lint.sh: the tree has no ruff or shellcheck finding, and a file with one fails the lint."""

import os
import subprocess

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
