"""bench/bench_driver.py: a timed driver run leaves nothing of its engine behind in the benchmark's process; the
benchmark runs on the CPU, as it says, also where DeepSpeed would pick CUDA."""

import gc
import importlib.util
import subprocess
import sys
import types

import pytest

import helpers
from modeling import BertForPreTraining


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_driver", helpers.REPO_ROOT / "bench" / "bench_driver.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def live_models() -> int:
    gc.collect()
    return sum(type(obj) is BertForPreTraining for obj in gc.get_objects())


@pytest.mark.slow
def test_a_timed_driver_run_leaves_no_model_behind(tmp_path, monkeypatch):
    """With bf16 and ZeRO-1 (the MFU and compile commands of bench/README.md) DeepSpeed's hooks kept the
    driver's engine alive after run_pretraining.main until the driver destroyed it: the benchmark runs the driver
    several times in one process (--repeats, --compile), so each run kept its model and optimizer states
    through the runs after it."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE"):
        monkeypatch.delenv(key, raising=False)  # a world of one, on a free port (not this process's group's)
    bench = load_bench()
    args = types.SimpleNamespace(micro=4, gas=1, steps=2, max_pred=20, bf16=True, stage=1,
                                 model_config=bench.MODEL_CONFIG)
    (tmp_path / "shards").mkdir()
    bench.write_shard(tmp_path / "shards" / "bench_training_0.hdf5", bench.synthetic_arrays(8, 128, 20, 30522))
    before = live_models()
    steps_per_second, _, summary, breakdown = bench.time_driver(args, tmp_path)
    assert steps_per_second > 0 and summary["global_step"] == 2 and set(breakdown) == {"forward", "backward",
                                                                                        "step", "rest"}
    assert live_models() == before


@pytest.mark.slow
def test_it_runs_on_the_cpu_where_deepspeed_would_pick_cuda():
    """DS_ACCELERATOR=cuda stands for a GPU server, where DeepSpeed picks CUDA at its first import, which the
    phase timers made before the driver (--no_cuda) could choose the CPU: the driver failed (here in
    torch.cuda.set_device; on a GPU its engine would have been on the GPU, the plain loop on the CPU)."""
    result = subprocess.run([sys.executable, str(helpers.REPO_ROOT / "bench" / "bench_driver.py"), "--steps", "2",
                             "--repeats", "1", "--micro", "4", "--driver_only"],
                            env=helpers.launcher_env(DS_ACCELERATOR="cuda"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "driver, steps after the first:" in result.stdout
