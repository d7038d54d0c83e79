"""Lines a user should not have to read past (issue 19 defect 7), while real errors still show."""
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT

ENTRY_POINTS = ["run_pretraining.py", "run_squad.py", "run_glue.py"]


def run_entry_point(script, *args):
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # as a user's shell has it
    return subprocess.run([sys.executable, str(REPO_ROOT / script), *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_and_errors_have_no_deepspeed_accelerator_line(script):
    shown = run_entry_point(script, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage:"), shown.stderr
    assert "Setting accelerator" not in shown.stdout + shown.stderr
    failed = run_entry_point(script)  # the required flags are missing: that error is all stderr says
    assert failed.returncode == 2
    assert failed.stderr.splitlines() == [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert "the following arguments are required" in failed.stderr
