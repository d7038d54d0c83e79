"""README.md tells a new user what the commands need: the virtual environment before any `python` command."""

import re

import helpers

ACTIVATE = "source .venv/bin/activate"


def test_python_commands_come_after_the_way_into_the_virtual_environment():
    for readme in (helpers.REPO_ROOT / "README.md", helpers.REPO_ROOT / "data" / "README.md"):
        text = readme.read_text()
        assert ACTIVATE in text, f"{readme} never says how to enter the virtual environment"
        first_python = re.search(r"(^|`)python ", text, re.MULTILINE)
        assert first_python is None or text.index(ACTIVATE) < first_python.start(), (
            f"{readme}: a python command before '{ACTIVATE}'")


def test_data_script_finds_the_virtual_environment(tmp_path):
    """create_datasets_from_start.sh runs its steps with <repo>/.venv/bin/python when no environment is active."""
    import shutil
    import subprocess
    clone = tmp_path / "clone"
    (clone / "data").mkdir(parents=True)
    shutil.copy(helpers.REPO_ROOT / "data" / "create_datasets_from_start.sh", clone / "data")
    fake_python = clone / ".venv" / "bin" / "python"
    fake_python.parent.mkdir(parents=True)
    fake_python.write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path}/calls\n')
    fake_python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(clone / "data" / "create_datasets_from_start.sh"), "sample"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls and all(call.startswith(str(clone / "data" / "bert_prep.py")) for call in calls)
