"""bench/first_run.py, the first-run check for a new server, as CI runs it: the tiny config on the CPU, eager
mode (compile mode took 3.5 min there: inductor compiles on this CPU, and step 2 recompiled)."""

import subprocess
import sys

import pytest

import helpers


@pytest.mark.slow
def test_first_run_check_on_the_cpu_passes_every_check(tmp_path):
    result = subprocess.run([sys.executable, str(helpers.REPO_ROOT / "bench" / "first_run.py"), "--tiny", "--no_cuda",
                             "--modes", "eager", "--steps", "2", "--work_dir", str(tmp_path)],
                            env=helpers.launcher_env(), capture_output=True, text=True, timeout=600)
    verdicts = [line for line in result.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [line.split(":")[1].strip() for line in verdicts] == ["finite loss", "MFU", "peak memory / planned"] * (
        len(verdicts) // 3) and verdicts and all(line.startswith("PASS") for line in verdicts)
