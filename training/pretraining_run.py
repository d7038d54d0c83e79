"""The two halves of a running pretraining job that the loop is handed: RunSettings, fixed for the run (the Config
and what the data, the engine and the device add), and RunObjects, the live objects it works with."""

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from modeling import BertPretrainingCriterion
from training import checkpoint_s3, evaluation, gaudi, rank_costs, run_status
from training.pretraining_config import Config

if TYPE_CHECKING:  # deepspeed is imported only after device_setup.choose_accelerator has picked the device
    import dllogger
    from deepspeed import DeepSpeedEngine


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the loop follows, fixed for the run: the Config, and what the data, the engine and the device add."""
    config: Config
    micro_batch: int
    gas: int
    world: int
    seq_len: int
    epoch_size: int
    data_layout: dict[str, Any]  # pretraining_state.describe_data_layout
    flops_per_sequence: float  # model FLOPs of one training sequence (sizing.model_flops_per_sequence)
    peak_tflops: float         # one device's matmul peak, the denominator of MFU
    progress_bar: bool         # rank 0 without --disable_progress_bar

    @property
    def steps_this_run(self) -> float:
        return math.inf if self.config.steps_this_run == -1 else self.config.steps_this_run

    @property
    def checkpoint_every(self) -> int | None:
        return None if self.config.skip_checkpoint else self.config.num_steps_per_checkpoint


@dataclass(frozen=True, kw_only=True)
class RunObjects:
    """The live objects of a run that the loop works with; built once in run_pretraining.train_run."""
    engine: "DeepSpeedEngine"
    optimizer: torch.optim.Optimizer  # the one that steps (the client's, else the JSON's): its param_groups hold the LR
    criterion: BertPretrainingCriterion
    clock: Callable[[], float]  # time.perf_counter; a parameter of run_pretraining.main, so a test can fake it
    all_reduce: Callable[[torch.Tensor], object]  # dist.all_reduce; a test stands in for other ranks with its own
    all_gather_object: Callable[[list[Any], object], object]  # dist.all_gather_object (rare: shards skipped somewhere)
    device: torch.device
    logger: "dllogger.Logger"  # logs.build_logger: dllogger's, or dllogger_fallback's without the package
    say: Callable[[str], None]  # prints on rank 0, nothing elsewhere
    checkpoint_dir: Path  # where checkpoints are written: --output_dir, or the staging dir of an s3:// one
    copies: checkpoint_s3.CheckpointUploader | None  # for an s3:// --output_dir
    graph_breaks: gaudi.NoGraphBreaks  # HPU lazy mode: the reference's mark_steps (training/gaudi.py); else none
    status_file: run_status.StatusFile  # rank 0's report to the supervisor: the last checkpoint saved
    held_out: evaluation.HeldOutSet | None  # --eval_dir's samples (this rank's chunks), None without it
    costs: rank_costs.RankCosts  # this rank's start-up milestones, checkpoint times and memory
