"""The DeepSpeed JSON, read and checked without torch or DeepSpeed: the one reader for the launchers'
preflight, the supervisor and every DeepSpeed entry point, with one error type.

- `read`: the file as a dict;
- `batch_arithmetic` (`read_batch_arithmetic` from a file): (micro-batch, accumulation steps, global batch) at a
  world size: the global batch is what a recipe fixes, and it must split evenly over the ranks;
- `check`: the batch arithmetic plus what the runtime needs (a client optimizer under ZeRO, TensorBoard, no ZeRO
  offload);
- `load`: read and check.
"""

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from common.errors import InputError

EXAMPLE = "scripts/deepspeed_config_bert_tiny_cpu.json"


class DeepSpeedConfigError(InputError):
    """A DeepSpeed JSON that is missing, unreadable, or whose settings cannot run on the ranks asked for."""


def read(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    if not path:
        raise DeepSpeedConfigError(f"--deepspeed_config is required (e.g. {EXAMPLE})")
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: {err}") from err
    if not isinstance(config, dict):
        raise DeepSpeedConfigError(f"--deepspeed_config {path}: not a JSON object")
    return config


def batch_arithmetic(config: dict[str, Any], world_size: int, source: object) -> tuple[int, int, int]:
    """(micro-batch, accumulation steps, global batch) of a DeepSpeed config at this world size. `source`
    names the config in the error."""
    micro, total = config.get("train_micro_batch_size_per_gpu"), config.get("train_batch_size")
    if not isinstance(micro, int) or not isinstance(total, int) or micro < 1 or total < 1:
        raise DeepSpeedConfigError(f"{source}: set positive integers train_batch_size and "
                                   "train_micro_batch_size_per_gpu")
    # The global batch is what a recipe fixes: the accumulation steps follow from it on any world size
    # (a checkpoint resumed on another number of ranks keeps its batch; the driver logs the split).
    if total % (micro * world_size):
        raise DeepSpeedConfigError(f"{source}: train_batch_size {total} is not a multiple of "
                                   f"train_micro_batch_size_per_gpu {micro} x world size {world_size}: "
                                   f"this global batch cannot be kept on {world_size} ranks")
    gas = total // (micro * world_size)
    return micro, gas, total


def read_batch_arithmetic(path: str | os.PathLike[str] | None, world_size: int) -> tuple[int, int, int]:
    """`batch_arithmetic` of the JSON at `path` (the preflight's and the supervisor's check)."""
    return batch_arithmetic(read(path), world_size, path)


def check(config: dict[str, Any], world_size: int, source: object,
          client_optimizer: str | None = None) -> dict[str, Any]:
    """Check the batch arithmetic and what a client optimizer (its name, or None when the JSON's optimizer or
    one that ZeRO supports is used) needs; sets gradient_accumulation_steps from the global batch (pretraining's
    reading: a JSON's own value gives way, so a checkpoint resumes on another world size with the same batch;
    fine-tuning checks its flags against the JSON first). Refuses ZeRO offload and background checkpoint writers.
    `source` names the config."""
    _, config["gradient_accumulation_steps"], _ = batch_arithmetic(config, world_size, source)
    zero = config.get("zero_optimization", {})
    zero_stage = zero.get("stage", 0)
    offloaded = offload_sections(zero)
    if offloaded:
        # Offloaded fp32 partitions live on the CPU, where training/zero_partitions.py's all-reduce over the
        # data-parallel group cannot reach them under NCCL, and the memory planner does not model them.
        raise DeepSpeedConfigError(f"{source}: ZeRO offload is not supported by this repository "
                                   f"({', '.join(offloaded)}): remove the offload setting (or use device \"none\")")
    background_writers = [name for name, on in (
        ("checkpoint.writer.decoupled", (config.get("checkpoint", {}).get("writer") or {}).get("decoupled")),
        ("datastates_ckpt.enabled", config.get("datastates_ckpt", {}).get("enabled"))) if on]
    if background_writers:
        # engine.save_checkpoint returns before these writers have written the files (DeepSpeed commits them at
        # a later engine.step), while training/checkpointing.py commits a checkpoint as soon as it returns.
        raise DeepSpeedConfigError(f"{source}: checkpoint writers that finish in the background are not supported "
                                   f"by this repository ({', '.join(background_writers)}): remove the setting")
    if client_optimizer and zero_stage > 0 and not config.get("zero_allow_untested_optimizer", False):
        raise DeepSpeedConfigError(f"{source}: ZeRO with --optimizer {client_optimizer} needs "
                                   '"zero_allow_untested_optimizer": true')
    if config.get("tensorboard", {}).get("enabled") and importlib.util.find_spec("tensorboard") is None:
        raise DeepSpeedConfigError(f"{source} enables TensorBoard but the tensorboard package is not installed "
                                   "(pip install tensorboard, or set tensorboard.enabled to false)")
    return config


def offload_sections(zero: dict[str, Any]) -> list[str]:
    """The ZeRO offload settings of a zero_optimization section that move something off the accelerator, as text:
    offload_optimizer / offload_param with a device other than "none", and their deprecated boolean forms."""
    found = []
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        device = section.get("device", "none") if isinstance(section, dict) else section
        if device not in (None, "none"):
            found.append(f"zero_optimization.{key}.device {device}" if isinstance(section, dict)
                         else f"zero_optimization.{key} {section!r}")
    for key in ("cpu_offload", "cpu_offload_param"):  # DeepSpeed's older names for a CPU offload
        if zero.get(key):
            found.append(f"zero_optimization.{key} {json.dumps(zero[key])}")
    return found


def load(path: str | os.PathLike[str] | None, world_size: int, client_optimizer: str | None = None) -> dict[str, Any]:
    """`read`, then `check`."""
    return check(read(path), world_size, path, client_optimizer)
