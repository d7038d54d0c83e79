"""bench/bench_lans_blocks.py runs on the CPU with gloo, as it says, also where DeepSpeed would pick CUDA."""

import subprocess

import pytest

import helpers


@pytest.mark.slow
def test_it_runs_on_the_cpu_where_deepspeed_would_pick_cuda():
    """DS_ACCELERATOR=cuda stands for a GPU server, where DeepSpeed picks CUDA by itself: the benchmark put
    its model on cuda:LOCAL_RANK (here: 'device_id cuda:0 does not match ...', on a GPU a model on CUDA fed
    CPU batches)."""
    result = subprocess.run([str(helpers.VENV_BIN / "torchrun"), "--nproc_per_node", "2", "--master_port",
                             str(helpers.free_port()), str(helpers.REPO_ROOT / "bench" / "bench_lans_blocks.py"),
                             "--model", "tiny", "--steps", "1", "--warmup", "0"],
                            env=helpers.launcher_env(DS_ACCELERATOR="cuda"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ratio tensor/partition" in result.stdout
