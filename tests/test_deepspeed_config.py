"""common/deepspeed_config.py: the one reader of the DeepSpeed JSON, without torch, and its one error type,
seen through both of its users: the launchers' preflight (a CLI run before any rank) and the driver's check."""

import json
import subprocess
import sys

import pytest

import helpers
from common import deepspeed_config
from common.deepspeed_config import DeepSpeedConfigError
from common.errors import InputError
from training import pretraining_config


def test_the_reader_imports_neither_torch_nor_deepspeed():
    code = "import sys; from common import deepspeed_config; print(sorted({'torch', 'deepspeed'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO_ROOT, capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def test_batch_arithmetic_against_the_division_done_by_hand(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 96, "train_micro_batch_size_per_gpu": 4}))
    config = deepspeed_config.load(path, world_size=8)
    assert config["gradient_accumulation_steps"] == 3  # 96 = 4 x 3 x 8
    assert deepspeed_config.batch_arithmetic(config, 2, path) == (4, 12, 96)  # 96 = 4 x 12 x 2


@pytest.mark.parametrize("content, message", [
    ("{", "Expecting property name"),
    ("[1, 2]", "not a JSON object"),
    ('{"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4}', "train_batch_size 10 is not a multiple"),
    ('{"train_batch_size": 8}', "set positive integers train_batch_size and train_micro_batch_size_per_gpu"),
])
def test_preflight_and_driver_report_one_error_type_with_one_text(tmp_path, content, message):
    path = tmp_path / "ds.json"
    path.write_text(content)
    with pytest.raises(DeepSpeedConfigError, match=message) as raised:
        deepspeed_config.load(path, world_size=1)
    assert isinstance(raised.value, InputError)
    (tmp_path / "data").mkdir()
    preflight = subprocess.run([sys.executable, "-m", "training.preflight", "--deepspeed_config", str(path),
                                "--data_dir", str(tmp_path / "data"), "--num_nodes", "1", "--ngpu_per_node", "1"],
                               cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert preflight.returncode == 1 and preflight.stderr.strip() == f"error: preflight: {raised.value}"
    with pytest.raises(DeepSpeedConfigError) as driver:
        pretraining_config.deepspeed_config_with_optimizer(str(path), 1, "lans")
    assert str(driver.value) == str(raised.value)


# ZeRO offload puts the fp32 partitions on the CPU, where training/zero_partitions.py's all-reduce over the
# data-parallel group fails under NCCL at the first step: the check refuses it before any work.
@pytest.mark.parametrize("zero, named", [
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "zero_optimization.offload_optimizer.device cpu"),
    ({"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme"}},
     "zero_optimization.offload_optimizer.device nvme"),
    ({"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "none"}},
     "zero_optimization.offload_param.device cpu"),
    ({"stage": 2, "cpu_offload": True}, "zero_optimization.cpu_offload true"),
])
def test_zero_offload_is_refused_with_one_line(tmp_path, zero, named):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                "zero_optimization": zero, "zero_allow_untested_optimizer": True}))
    expected = (f"{path}: ZeRO offload is not supported by this repository ({named}): remove the offload setting "
                '(or use device "none")')
    with pytest.raises(DeepSpeedConfigError) as raised:
        deepspeed_config.load(path, world_size=1)
    assert str(raised.value) == expected
    with pytest.raises(DeepSpeedConfigError) as driver:
        pretraining_config.deepspeed_config_with_optimizer(str(path), 1, "lans")
    assert str(driver.value) == expected


# DeepSpeed's decoupled writer (and DataStates') write a checkpoint's files after engine.save_checkpoint has
# returned; training/checkpointing.py would commit the checkpoint (manifest, `latest`) before they exist.
@pytest.mark.parametrize("section, named", [
    ({"checkpoint": {"writer": {"type": "mock", "decoupled": True}}}, "checkpoint.writer.decoupled"),
    ({"datastates_ckpt": {"enabled": True}}, "datastates_ckpt.enabled"),
])
def test_background_checkpoint_writers_are_refused_with_one_line(tmp_path, section, named):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, **section}))
    with pytest.raises(DeepSpeedConfigError) as raised:
        deepspeed_config.load(path, world_size=1)
    assert str(raised.value) == (f"{path}: checkpoint writers that finish in the background are not supported by "
                                 f"this repository ({named}): remove the setting")


def test_a_synchronous_checkpoint_writer_passes(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                "checkpoint": {"writer": {"type": "fast", "decoupled": False}},
                                "datastates_ckpt": {"enabled": False}}))
    assert deepspeed_config.load(path, world_size=1)["gradient_accumulation_steps"] == 2  # 8 = 4 x 2 x 1


@pytest.mark.parametrize("zero", [
    {"stage": 2},
    {"stage": 2, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}},
    {"stage": 1, "offload_optimizer": None, "cpu_offload": False},
])
def test_zero_without_offload_passes(tmp_path, zero):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
                                "zero_optimization": zero, "zero_allow_untested_optimizer": True}))
    assert deepspeed_config.load(path, world_size=2)["gradient_accumulation_steps"] == 1  # 8 = 4 x 1 x 2
