"""bench/bench_scale_cost.py at its smallest size: 1 rank on 1 server (a test host), two launches. Its figures are
checked against what the benchmark measures independently of the ranks' own report (each launch's wall time
around the launcher) and against the plausible: about 50 s, marker `scale` (root; not in CI's run):
bash scripts/run_tests.sh tests/test_bench_scale_cost.py -m scale."""

import json
import subprocess
import sys

import matplotlib.image
import pytest

import helpers
import multihost

pytestmark = [pytest.mark.slow, pytest.mark.scale]


def test_the_smallest_shape_reports_consistent_figures_and_a_plot(tmp_path):
    reason = multihost.unavailable_reason()
    if reason:
        pytest.skip(reason)
    figures, plot = tmp_path / "figures.json", tmp_path / "scale.png"
    result = subprocess.run([sys.executable, helpers.REPO_ROOT / "bench" / "bench_scale_cost.py", "--ranks", "1",
                             "--servers", "1", "--steps", "2", "--json", figures, "--plot", plot],
                            env=helpers.launcher_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [row] = json.loads(figures.read_text())
    assert (row["ranks"], row["servers"]) == (1, 1)
    first_launch, second_launch = row["launch_wall_s"]
    # The stages follow one another (every milestone after the last) and end within the launch's wall time.
    assert all(seconds > 0 for seconds in row["stages_s"].values()), row["stages_s"]
    assert row["to_first_step_s"] == pytest.approx(sum(row["stages_s"].values()))
    assert row["to_first_step_s"] < first_launch and row["resume_to_first_step_s"] < second_launch
    assert 0 < row["step_s"] < first_launch and 0 < row["save_s"] < first_launch and 0 < row["load_s"] < second_launch
    # A rank that imported torch and DeepSpeed and holds the tiny model: hundreds of MB, most of it its own.
    assert 200 < row["private_mb_max"] < row["peak_resident_mb_max"] < 2000, row
    assert "| 1 | 1 | " in result.stdout and "(1.0x)" in result.stdout
    assert matplotlib.image.imread(plot).shape[:2] == (720, 990)  # 11 x 8 inches at 90 dpi, 4 panels
