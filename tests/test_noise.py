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


def test_a_cpu_launch_has_no_cuda_visible_devices_line_and_a_failing_rank_still_shows(tmp_path):
    from helpers import free_port
    env = dict(os.environ, HL_DEVICE="cpu", NUM_NODES="1", NGPU_PER_NODE="2", HL_NGPU_PER_NODE="2",
               RESULTS_DIR=str(tmp_path), REPO_ROOT=str(REPO_ROOT), HL_MASTER_PORT=str(free_port()))
    # one write(2) per rank: a pipe keeps a write this short whole, so the two ranks' lines cannot interleave
    # (print may write the text and its newline apart, e.g. under PYTHONUNBUFFERED)
    rank = 'import os, sys; os.write(1, b"rank up\\n"); sys.exit(3)'
    result = subprocess.run(["bash", "-c", 'source scripts/launch_common.sh; device_args; find_launcher_and_python; '
                             'rendezvous_args; launch_ranks -c "$0"', rank], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 3 and output.splitlines().count("rank up") == 2, output
    assert "CUDA_VISIBLE_DEVICES" not in output
    assert "exits with return code = 3" in output


def test_deepspeeds_gather_shows_no_deprecation_line_and_other_warnings_still_show(tmp_path):
    script = ("import warnings, torch\nfrom training import runtime\n"
              "runtime.setup_device_and_distributed(use_hpu=False, no_cuda=True)\n"
              "out = torch.zeros(2)\n"
              "torch.distributed.all_gather_into_tensor(out, torch.ones(2))  # as DeepSpeed's comm falls through to\n"
              "warnings.warn('another deprecation', FutureWarning)\n"
              "print(out.tolist())\n"
              "torch.distributed.destroy_process_group()\n")  # not left to the exit, where gloo can abort
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO_ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[1.0, 1.0]"  # the gather ran (a world of one)
    assert "all_gather_into_tensor` is deprecated" not in result.stderr
    assert "FutureWarning: another deprecation" in result.stderr
