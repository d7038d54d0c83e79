"""scripts/setup_venv.sh installs the project itself (pip install -e .) exactly when the environment does not
import every name that pyproject.toml lists from this checkout. The environment is a stand-in: its python runs
without site-packages (so no earlier install is seen) and its pip only records how it was called."""

import subprocess
import sys
import tomllib

import helpers


def stand_in_venv(tmp_path):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text("#!/usr/bin/env bash\n"
                      f'if [[ "$1 $2" == "-m pip" ]]; then echo "${{@:3}}" >> {tmp_path}/pip_calls; exit 0; fi\n'
                      f'exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    (bin_dir / "activate").write_text("")
    return tmp_path / "venv"


def project_installs(tmp_path, **env) -> list:
    """The `pip install -e` calls that sourcing setup_venv.sh makes in the stand-in environment."""
    venv = stand_in_venv(tmp_path)
    result = subprocess.run(["bash", "-c", f"source {helpers.REPO_ROOT}/scripts/setup_venv.sh"], cwd=tmp_path,
                            env={"PATH": "/usr/bin:/bin", "VENV": str(venv), **env}, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "pip_calls").read_text().splitlines() if (tmp_path / "pip_calls").exists() else []
    return [call for call in calls if " -e " in call]


def test_an_environment_without_the_project_gets_it_installed(tmp_path):
    assert project_installs(tmp_path) == [
        f"install --quiet --disable-pip-version-check --no-deps -e {helpers.REPO_ROOT}"]


def test_an_environment_that_imports_this_checkout_is_left_alone(tmp_path):
    assert project_installs(tmp_path, PYTHONPATH=str(helpers.REPO_ROOT)) == []


def test_an_environment_that_imports_another_checkout_gets_this_one(tmp_path):
    listed = tomllib.loads((helpers.REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    other = tmp_path / "other_clone"  # every listed name, in another place
    for name in [f"{module}.py" for module in listed["py-modules"]] + [f"{p}/__init__.py" for p in listed["packages"]]:
        (other / name).parent.mkdir(parents=True, exist_ok=True)
        (other / name).write_text("")
    assert len(project_installs(tmp_path, PYTHONPATH=str(other))) == 1
