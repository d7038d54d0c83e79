"""bench/bench_evaluation.py runs as bench/README.md says, at a tiny size: one driver run evaluating every step,
and a table of its timings (no timed assertion)."""

import re
import subprocess
import sys

import pytest

import helpers


@pytest.mark.slow
def test_the_benchmark_reports_the_evaluations_share_of_the_step_time():
    command = [sys.executable, str(helpers.REPO_ROOT / "bench" / "bench_evaluation.py"), "--steps", "2",
               "--eval_interval", "1", "--num_eval_examples", "8", "--eval_batch_size", "4", "--micro", "4"]
    result = subprocess.run(command, cwd=helpers.REPO_ROOT, env=helpers.launcher_env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^training step: [0-9.]+ s \(2 steps\)$", result.stdout, re.M), result.stdout
    assert re.search(r"^one evaluation of 8 samples \(batch 4\): [0-9.]+ s \(median of 2\)$", result.stdout, re.M)
    assert re.search(r"^share of the step time at --eval_interval 1: [0-9.]+%$", result.stdout, re.M)
