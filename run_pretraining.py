#!/usr/bin/env python
"""BERT pretraining on DeepSpeed (ZeRO 0/1/2, fp32 or bf16) on HPU, CUDA or CPU.

Launch through the DeepSpeed launcher (scripts/run_bert_*.sh), e.g. for 2 CPU ranks:

    deepspeed --num_gpus 2 --no_local_rank run_pretraining.py --config_file scripts/bert_tiny_config.json \
        --input_dir DATA --output_dir OUT --optimizer lans --use_lr_scheduler --deepspeed \
        --deepspeed_config scripts/deepspeed_config_bert_tiny_cpu.json

or as one process with `python run_pretraining.py ...`. Flags follow the Habana reference (same names and
defaults); docs/differences.md lists where the behaviour differs. `main(argv)` returns the run summary as a dict,
so tests drive the real program in-process.

Stages of a run: parse the flags into one frozen Config (build_config) and check the files it names
(open_inputs): one clear error before any step -> device, backend and DeepSpeed's CPU traps -> the checkpoint
to resume from, checked before anything is built (choose_checkpoint) -> model, optimizer, scheduler, engine
-> resume / init / phase-2 -> the training loop (`train`, with RunSettings and RunObjects) -> final
checkpoint and summary.
"""

import signal

# A SIGTERM or SIGINT that comes while the imports below run (seconds, far more on a loaded server) waits,
# blocked, for main's stop handler (training/command_line.stop_requests unblocks it there): else it would end
# the rank at once, without its error line or status file. DeepSpeed's per-node launcher sends one to every
# rank as soon as one rank exits with an error, and the supervisor needs rank 0's report of that same error.
# Only as a program: a process that imports this module (the tests) keeps its signals.
if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))

import argparse
import functools
import hashlib
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from common import deepspeed_config, storage
from common.errors import HostInputError, InputError, InputErrorOnEveryRank
from data.dataset import LocalShardFiles, RankBatches, WindowReader, fixed_chunks, scan_shards, window_size_for_budget
from data.shard_format import ShardError
from modeling import BertConfig, BertForPreTraining, BertPretrainingCriterion
from optimization import OPTIMIZERS, build_optimizer, get_parameter_groups
from schedulers import PolyWarmUpScheduler
from training import (
    checkpoint_resume,
    checkpoint_s3,
    checkpointing,
    command_line,
    compile_mode,
    deepspeed_engine,
    device_setup,
    distributed,
    evaluation,
    gaudi,
    hardware,
    init_weights,
    logs,
    profiling,
    progress_display,
    run_status,
    sizing,
    zero_partitions,
)
from training.deepspeed_engine import optimizer_step_suppressed
from training.schedule_resume import follow_changed_schedule

if TYPE_CHECKING:  # deepspeed is imported only after device_setup.choose_accelerator has picked the device
    import dllogger
    from deepspeed import DeepSpeedEngine

IGNORED_FLAGS_HELP = "Ignored."


class TrainingStopped(RuntimeError):
    """The run stopped on purpose before its end (too many non-finite steps); a checkpoint was saved."""


# ============================================================================ arguments

def build_parser() -> argparse.ArgumentParser:
    parser = command_line.OneLineErrorParser(
        description="BERT pretraining with DeepSpeed (Habana deepspeed-bert flags).",
        formatter_class=command_line.DefaultsHelpFormatter, epilog=command_line.SWITCHES_EPILOG,
        usage="%(prog)s --input_dir DIR --config_file JSON --output_dir DIR [flags]")
    data = parser.add_argument_group("data")
    data.add_argument("--input_dir", required=True, help="Directory (or s3://bucket/prefix) of HDF5 shards; the "
                      ".hdf5/.h5 files whose name contains 'training' are used (not dot-files). Their sequence "
                      "length is the run's.")
    data.add_argument("--max_predictions_per_seq", type=int, default=80, help="Upper bound of the shards' masked "
                      "positions.")
    data.add_argument("--disable_random_sampler", action="store_true", help="Read shards and samples in order "
                      "(debugging).")
    data.add_argument("--data_memory_budget_mb", type=float, default=256, help="Memory per rank for the data "
                      "window being read.")
    data.add_argument("--skip_bad_shards", action="store_true", help="Skip (and count) a shard that fails to read "
                      "mid-epoch instead of stopping.")

    model = parser.add_argument_group("model")
    model.add_argument("--config_file", required=True, help="Model configuration JSON (modeling.BertConfig).")
    model.add_argument("--checkpoint_activations", action="store_true", help="Recompute encoder activations in "
                       "the backward pass.")
    model.add_argument("--checkpoint_activations_interval", type=int, default=1, help="Layers per checkpointed "
                       "chunk.")
    compile_mode.add_compile_arguments(model, compiles_lans=True)

    schedule = parser.add_argument_group("schedule and optimizer")
    schedule.add_argument("--optimizer", default=None, help=f"The client optimizer: {', '.join(OPTIMIZERS)} "
                          "(default: none given, and then the DeepSpeed JSON's \"optimizer\" section is used; one "
                          "of the two is needed).")
    schedule.add_argument("--betas", type=float, nargs=2, default=None, help="Optimizer betas (default: the "
                          "optimizer's own, 0.9 0.999).")
    schedule.add_argument("--lans_blocks", choices=("tensor", "partition"), default="tensor",
                          help="LANS under ZeRO-1/2: norms and trust ratios per model tensor (across ranks; the "
                          "paper's), or per flat partition of each rank (the reference's; depends on the number of "
                          "ranks).")
    schedule.add_argument("--learning_rate", type=float, default=5e-5, help="Base learning rate.")
    schedule.add_argument("--use_lr_scheduler", action="store_true", help="PolyWarmUpScheduler (else the "
                          "DeepSpeed JSON's scheduler, or constant LR).")
    schedule.add_argument("--max_steps", type=float, default=1000, help="Optimizer steps of the LR schedule (and "
                          "of the phase).")
    schedule.add_argument("--warmup_proportion", type=float, default=0.01, help="Warm-up fraction of --max_steps.")
    schedule.add_argument("--constant_proportion", type=float, default=0.0, help="Fraction of --max_steps held at "
                          "the base LR after warm-up.")
    schedule.add_argument("--scheduler_degree", type=float, default=1.0, help="Exponent of the polynomial decay.")
    schedule.add_argument("--steps_this_run", type=int, default=-1, help="Optimizer steps in this run, at least 1 "
                          "(-1: until --max_steps). Unlike the reference, counted from the start of this run, not "
                          "from step 0.")
    schedule.add_argument("--phase2", action="store_true", help="Start phase 2 from a phase-1 checkpoint: reset "
                          "step counters and scheduler, keep moments.")
    schedule.add_argument("--phase1_end_step", type=int, default=7038, help="Global step at which phase 1 ended.")
    schedule.add_argument("--seed", type=int, default=42, help="Seed; each process uses seed + its global rank.")
    schedule.add_argument("--max_bad_steps", type=int, default=10, help="Stop after this many consecutive steps "
                          "with a non-finite loss.")

    checkpoints = parser.add_argument_group("checkpoints")
    checkpoints.add_argument("--output_dir", required=True, help="Checkpoint directory (or s3://bucket/prefix); "
                             "must be empty unless --resume_from_checkpoint.")
    checkpoints.add_argument("--resume_from_checkpoint", action="store_true", help="Resume from --output_dir "
                             "(fresh start, said so, if it holds no checkpoint).")
    checkpoints.add_argument("--resume_step", type=int, default=-1, help="Tag to resume from; -1 = the 'latest' "
                             "checkpoint.")
    checkpoints.add_argument("--init_checkpoint", default=None, help="Start from these weights (checkpoint tag "
                             "dir or state-dict file) with a fresh optimizer (default: none, fresh weights).")
    checkpoints.add_argument("--num_steps_per_checkpoint", type=int, default=100, help="Save when the global "
                             "step (in phase 2 counted on from --phase1_end_step) is a multiple of N.")
    checkpoints.add_argument("--keep_last_n_checkpoints", type=int, default=0, help="Keep only the newest N "
                             "checkpoints (0 = keep all).")
    checkpoints.add_argument("--skip_checkpoint", action="store_true", help="Never save checkpoints.")

    devices = parser.add_argument_group("devices and distribution")
    devices.add_argument("--use_hpu", action="store_true", help="Run on Habana Gaudi (needs habana_frameworks), "
                         "backend hccl.")
    devices.add_argument("--no_cuda", action="store_true", help="Run on CPU (gloo) even if CUDA is available.")
    devices.add_argument("--local_rank", type=int, default=-1, help="Set by launchers; the LOCAL_RANK environment "
                         "variable wins.")
    devices.add_argument("--collective_timeout_s", type=float, default=1800, help="A collective (all-reduce, "
                         "barrier) waiting this long ends the job with an error naming the rank and host: another "
                         "rank died or stalled (under NCCL, torch's watchdog ends the rank with its own message).")
    devices.add_argument("--skip_memory_check", action="store_true", help="Train even when the memory planner "
                         "(training/sizing.py) predicts that the run does not fit the device.")

    s3 = parser.add_argument_group("S3", "With an s3:// --input_dir or --output_dir (docs/s3.md).")
    s3.add_argument("--s3_cache_dir", default="results/s3_cache", help="Local directory for shards downloaded "
                    "from an s3:// --input_dir (one subdirectory per server, shared by its ranks) and for "
                    "checkpoints on their way to an s3:// --output_dir.")
    s3.add_argument("--s3_cache_gb", type=float, default=50, help="Bound of each server's S3 shard cache, GiB (at "
                    "least the largest shard; two shards or more let the next shard download while one is read).")
    s3.add_argument("--s3_endpoint_url", default=None, help="S3-compatible endpoint (default: AWS_ENDPOINT_URL, "
                    "else AWS).")

    logging = parser.add_argument_group("logging")
    logging.add_argument("--json-summary", dest="json_summary", default="results/dllogger.json",
                         help="dllogger JSON stream (rank 0).")
    logging.add_argument("--log_freq", type=float, default=1.0, help="Log every this many optimizer steps.")
    logging.add_argument("--disable_progress_bar", action="store_true", help="No tqdm bar on rank 0.")
    logging.add_argument("--peak_tflops", type=float, default=None, help="Matmul peak of one device for the "
                         "logged MFU, TFLOP/s (default: for a bf16 run on a known Gaudi/NVIDIA device, its "
                         "datasheet bf16 figure; else measured at start-up on the device, in the run's dtype).")
    logging.add_argument("--profile", default=None, help="pt | pt-full (torch profiler, full = with stacks) | hltv "
                         "(HPU only) (default: none, no profiling).")
    logging.add_argument("--profile_steps", default="2,3", help="start,end: micro-steps (inclusive) to profile.")

    held_out = parser.add_argument_group("held-out evaluation", "Held-out MLM loss and accuracy and NSP accuracy "
                                         "(training/evaluation.py), the same at any world size.")
    held_out.add_argument("--eval_dir", default=None, help="Directory of held-out HDF5 shards: the .hdf5/.h5 files "
                          "whose name contains 'test' and not 'training' (it may be --input_dir), in the training "
                          "shards' format and sequence length (default: none, no evaluation).")
    held_out.add_argument("--eval_interval", type=int, default=1000, help="Evaluate every this many optimizer "
                          "steps (global step), and at the end of the run.")
    held_out.add_argument("--num_eval_examples", type=int, default=10000, help="Evaluate the first this many "
                          "samples of --eval_dir (its shards in name order).")
    held_out.add_argument("--eval_batch_size", type=int, default=32, help="Held-out samples per forward pass on "
                          "one rank; the figures do not depend on the number of ranks.")
    held_out.add_argument("--skip_train", action="store_true", help="Evaluate the model (from "
                          "--resume_from_checkpoint or --init_checkpoint) once, without training, and stop.")

    ignored = parser.add_argument_group("ignored", "Accepted for compatibility with the reference's command "
                                        "lines; these do nothing.")
    ignored.add_argument("--max_seq_length", type=int, default=512, help="Ignored: the sequence length is that "
                         "of the HDF5 shards in --input_dir (the width of their input_ids, e.g. 128 in phase 1, "
                         "512 in phase 2).")
    ignored.add_argument("--num_train_epochs", type=float, default=3.0, help="Ignored: --max_steps and "
                         "--steps_this_run decide the length of a run.")
    for flag, kind, default in (("--bert_model", str, "bert-large-uncased"), ("--loss_scale", float, 0.0),
                                ("--init_loss_scale", int, 2 ** 20), ("--tensor_logger_max_iterations", int, 0),
                                ("--tensor_logger_path", str, None)):
        ignored.add_argument(flag, type=kind, default=default,
                             help=IGNORED_FLAGS_HELP if default is not None else "Ignored (default: none).")
    for flag in ("--do_train", "--use_env", "--use_ds_lamb_bias_correction", "--run_loss_in_fp32",
                 "--log_model_inputs", "--log_fwd_activations", "--log_bwd_grads"):
        ignored.add_argument(flag, action="store_true", help=IGNORED_FLAGS_HELP)
    return parser


def parse_arguments(argv=None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    device_setup.choose_accelerator(use_hpu="--use_hpu" in argv, no_cuda="--no_cuda" in argv)
    import deepspeed
    parser = build_parser()
    deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


# ============================================================================ configuration (before any step)

@dataclass(frozen=True, kw_only=True)
class Config:
    """The settings of a run, typed and checked: every flag that does something (the reference's names; its
    float step counts as whole numbers), the DeepSpeed JSON and the model config. build_config makes it from
    the flags, once; nothing below main reads the flags themselves."""
    # data
    input_dir: str
    max_predictions_per_seq: int
    disable_random_sampler: bool
    data_memory_budget_mb: float
    skip_bad_shards: bool
    # model
    config_file: str
    model_config: BertConfig       # read from config_file
    checkpoint_activations: bool
    checkpoint_activations_interval: int
    torch_compile: tuple[str | None, str | None] | None  # (backend, mode) with --enable_torch_compile, else None
    # schedule and optimizer
    optimizer: str | None          # None: the DeepSpeed JSON's
    betas: tuple[float, float] | None
    lans_blocks: str
    learning_rate: float
    use_lr_scheduler: bool
    max_steps: int
    warmup_proportion: float
    constant_proportion: float
    scheduler_degree: float
    steps_this_run: int            # -1: until max_steps
    phase2: bool
    phase1_end_step: int
    seed: int
    max_bad_steps: int
    # checkpoints
    output_dir: str
    resume_from_checkpoint: bool
    resume_step: int               # -1: the newest complete checkpoint
    init_checkpoint: str | None
    num_steps_per_checkpoint: int
    keep_last_n_checkpoints: int   # 0: keep all
    skip_checkpoint: bool
    # devices and distribution
    use_hpu: bool
    no_cuda: bool
    local_rank: int
    collective_timeout_s: float
    skip_memory_check: bool
    world_size: int                # the launcher's WORLD_SIZE
    # S3
    s3_cache_dir: str
    s3_cache_gb: float
    s3_endpoint_url: str | None
    # logging
    json_summary: str
    log_freq: int
    disable_progress_bar: bool
    peak_tflops: float | None
    profile: str | None
    profile_steps: str
    # held-out evaluation
    eval_dir: str | None           # None: no evaluation
    eval_interval: int
    num_eval_examples: int
    eval_batch_size: int
    skip_train: bool
    # DeepSpeed
    deepspeed_config: str | None
    ds_config: dict                # read from deepspeed_config, with its optimizer (common/deepspeed_config.py)

    @property
    def activation_checkpoint_interval(self) -> int:
        """Layers per activation-checkpointed chunk, 0 for none."""
        return self.checkpoint_activations_interval if self.checkpoint_activations else 0

    @property
    def lr_schedule(self) -> dict | None:
        """PolyWarmUpScheduler's keyword arguments with --use_lr_scheduler, else None."""
        if not self.use_lr_scheduler:
            return None
        return {"warmup": self.warmup_proportion, "total_steps": self.max_steps, "degree": self.scheduler_degree,
                "constant": self.constant_proportion}

    @property
    def resume_tag(self) -> str | None:
        return str(self.resume_step) if self.resume_step >= 0 else None

    def flags(self) -> dict:
        """The flags' values, as the logged "Config" record shows them (the JSON files are logged apart)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("model_config", "ds_config")}


def whole_steps(flag: str, value: float) -> int:
    """A step count that the reference's parser reads as a float (--max_steps, --log_freq), as an int: at
    least 1, and whole."""
    if value < 1:
        raise InputError(f"--{flag} must be at least 1, got {int(value) if float(value).is_integer() else value}")
    if not float(value).is_integer():
        raise InputError(f"--{flag} must be a whole number of steps, got {value}")
    return int(value)


def build_config(args: argparse.Namespace, world_size: int) -> Config:
    """The one place that reads the flags: checks every value that needs no file, reads the two JSON files
    and returns the run's Config; raises InputError."""
    if args.optimizer is not None and args.optimizer not in OPTIMIZERS:
        raise InputError(f"unknown --optimizer {args.optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    profiling.check_profiler(args.profile, args.profile_steps, args.use_hpu)
    compile_mode.check_compile_flags(args.enable_torch_compile, args.torch_compile_backend, args.torch_compile_mode,
                                     args.use_hpu)
    max_steps, log_freq = whole_steps("max_steps", args.max_steps), whole_steps("log_freq", args.log_freq)
    for name in ("num_steps_per_checkpoint", "max_bad_steps", "checkpoint_activations_interval"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name} must be at least 1, got {getattr(args, name)}")
    for name in ("seed", "keep_last_n_checkpoints"):  # numpy seeds are non-negative; 0 = keep all
        if getattr(args, name) < 0:
            raise InputError(f"--{name} must be 0 or more, got {getattr(args, name)}")
    if args.steps_this_run != -1 and args.steps_this_run < 1:  # 0 used to mean "no limit" silently
        raise InputError(f"--steps_this_run must be -1 (no limit) or at least 1, got {args.steps_this_run}")
    if args.resume_step < -1:  # used to mean "the latest" silently
        raise InputError(f"--resume_step must be -1 (the latest) or a checkpoint's step, got {args.resume_step}")
    if args.resume_step != -1 and not args.resume_from_checkpoint:  # used to start afresh silently
        raise InputError(f"--resume_step {args.resume_step} needs --resume_from_checkpoint")
    if not args.collective_timeout_s > 0:
        raise InputError(f"--collective_timeout_s must be positive, got {args.collective_timeout_s}")
    if not args.data_memory_budget_mb > 0:
        raise InputError(f"--data_memory_budget_mb must be positive, got {args.data_memory_budget_mb}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise InputError(f"--peak_tflops must be positive, got {args.peak_tflops}")
    for name in ("eval_interval", "num_eval_examples", "eval_batch_size"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.eval_dir is None and args.skip_train:
        raise InputError("--skip_train needs --eval_dir: it evaluates and does nothing else")
    if args.eval_dir is not None and storage.is_s3_url(args.eval_dir):
        raise InputError(f"--eval_dir {args.eval_dir}: held-out shards are read from a local directory only")
    ds_config = deepspeed_config_with_optimizer(args.deepspeed_config, world_size, args.optimizer)
    try:
        model_config = BertConfig.from_json_file(args.config_file)
    except (OSError, ValueError) as err:
        raise InputError(f"--config_file {args.config_file}: {err}") from err
    return command_line.settings_from_flags(
        Config, args, max_steps=max_steps, log_freq=log_freq, model_config=model_config, ds_config=ds_config,
        world_size=world_size, betas=tuple(args.betas) if args.betas is not None else None,
        torch_compile=(args.torch_compile_backend, args.torch_compile_mode) if args.enable_torch_compile else None)


@dataclass
class DataInfo:
    shards: list
    seq_len: int
    max_pred: int
    num_samples: int
    shard_files: LocalShardFiles | storage.ShardCache  # the cache for an s3:// --input_dir


def open_inputs(config: Config) -> tuple[DataInfo, DataInfo | None, checkpoint_s3.CheckpointUploader | None]:
    """Every check of the files and stores the run reads and writes that needs no device: returns the
    training data, the held-out data (None without --eval_dir) and the checkpoint copies to S3 (None for a
    local --output_dir); raises InputError."""
    try:
        copies = (open_s3_output(config.output_dir, config.s3_endpoint_url, Path(config.s3_cache_dir),
                                 config.keep_last_n_checkpoints, resuming=config.resume_from_checkpoint)
                  if storage.is_s3_url(config.output_dir) else None)
    except storage.StorageError as err:
        raise HostInputError(str(err)) from err
    output_dir = Path(config.output_dir)
    # Another rank's write probe (below) may be there for a moment: it does not count.
    if (copies is None and output_dir.is_dir() and not config.resume_from_checkpoint
            and any(not p.name.startswith(storage.WRITE_PROBE_PREFIX) for p in output_dir.iterdir())):
        raise InputError(f"--output_dir {output_dir} is not empty: pass --resume_from_checkpoint "
                         "or use an empty directory")
    if copies is None:
        command_line.check_writable_directory(output_dir, "--output_dir")
    else:  # checkpoints are written there before they are copied to S3
        command_line.check_writable_directory(copies.local_dir, "--s3_cache_dir")
    command_line.check_writable_file(config.json_summary, "--json-summary")
    if config.init_checkpoint is not None and not Path(config.init_checkpoint).exists():
        raise HostInputError(f"--init_checkpoint {config.init_checkpoint} does not exist")
    try:
        shard_files = open_shard_files(config.input_dir, config.s3_endpoint_url, config.s3_cache_dir,
                                       config.s3_cache_gb)
    except storage.StorageError as err:
        raise HostInputError(str(err)) from err
    data = inspect_data(config.input_dir, shard_files, config.max_predictions_per_seq,
                        config.ds_config["train_micro_batch_size_per_gpu"] * config.world_size)
    model_config = config.model_config
    if data.seq_len > model_config.max_position_embeddings:
        raise InputError(f"the shards' sequences have {data.seq_len} tokens, more than max_position_embeddings "
                         f"{model_config.max_position_embeddings} of --config_file {config.config_file}")
    return data, open_held_out(config, data), copies


def open_held_out(config: Config, data: DataInfo) -> DataInfo | None:
    """The headers of --eval_dir's shards, checked (their values are checked when the held-out samples are read,
    also before the first step); None without --eval_dir."""
    if config.eval_dir is None:
        return None
    held_out = inspect_data(config.eval_dir, open_shard_files(config.eval_dir, None, "", 0, flag="--eval_dir"),
                            config.max_predictions_per_seq, config.num_eval_examples, held_out=True)
    if held_out.seq_len != data.seq_len:
        raise InputError(f"--eval_dir {config.eval_dir} holds sequences of {held_out.seq_len} tokens, the training "
                         f"shards of --input_dir {config.input_dir} of {data.seq_len}: held-out shards must be made "
                         "like the training shards")
    return held_out


def read_held_out(held_out: DataInfo, config: Config, rank: int, world: int) -> evaluation.HeldOutSet:
    """This rank's chunks of the held-out samples (every rank reads and checks all of them: a token id beyond
    the model's vocabulary fails every rank alike, before the first step)."""
    window_size = window_size_for_budget(int(config.data_memory_budget_mb * 2 ** 20), held_out.seq_len,
                                         held_out.max_pred)
    model_config = config.model_config
    reader = WindowReader(held_out.shards, 0, window_size, model_config.vocab_size, shuffle=False,
                          shard_files=held_out.shard_files, type_vocab_size=model_config.type_vocab_size)
    try:
        chunks = fixed_chunks(reader, config.num_eval_examples, config.eval_batch_size, rank, world)
    except ShardError as err:
        raise InputErrorOnEveryRank(f"--eval_dir: {err}") from err
    return evaluation.HeldOutSet(chunks=chunks, num_chunks=math.ceil(config.num_eval_examples / config.eval_batch_size),
                                 num_samples=config.num_eval_examples)


def open_s3_output(url: str, endpoint_url: str | None, cache_dir: Path, keep_last_n: int, *,
                   resuming: bool) -> checkpoint_s3.CheckpointUploader:
    """Checkpoint copies for an s3:// --output_dir `url`: the prefix must be writable (checked by rank 0) and
    empty unless resuming; checkpoints are staged in <cache_dir (--s3_cache_dir)>/checkpoints."""
    store = storage.S3Store(url, endpoint_url)
    store.check_access(write=os.environ.get("RANK", "0") == "0")
    # Rank 0's write probe may be there for a moment while another rank looks: it does not count.
    if not resuming and any(not remote.name.startswith(storage.WRITE_PROBE_PREFIX)
                            for remote in store.list_objects(recursive=True)):
        raise InputError(f"--output_dir {url} is not empty: pass --resume_from_checkpoint or use an empty prefix")
    return checkpoint_s3.CheckpointUploader(store, cache_dir / "checkpoints", keep_last_n)


def open_shard_files(input_dir: str, endpoint_url: str | None, cache_dir: str, cache_gb: float,
                     flag: str = "--input_dir") -> LocalShardFiles | storage.ShardCache:
    """Where the shards are read from: the directory, or for an s3:// input_dir this server's download
    cache in cache_dir (--s3_cache_dir), bounded by cache_gb (--s3_cache_gb). flag: what messages call it."""
    if not storage.is_s3_url(input_dir):
        if not Path(input_dir).is_dir():
            raise HostInputError(f"{flag} {input_dir} does not exist or is not a directory")
        return LocalShardFiles(input_dir)
    if not cache_gb > 0:
        raise InputError(f"--s3_cache_gb must be positive, got {cache_gb}")
    store = storage.S3Store(input_dir, endpoint_url)
    store.check_access()
    return storage.ShardCache(store, storage.server_cache_dir(cache_dir), int(cache_gb * 2 ** 30))


def deepspeed_config_with_optimizer(path: str, world_size: int, client_optimizer: str | None) -> dict:
    """The DeepSpeed JSON (common/deepspeed_config.py) and an optimizer from it or --optimizer."""
    config = deepspeed_config.load(path, world_size, client_optimizer=client_optimizer)
    if client_optimizer is None and "optimizer" not in config:
        raise InputError(f"no optimizer: pass --optimizer or add an optimizer section to {path}")
    return config


def inspect_data(input_dir: str, shard_files: LocalShardFiles | storage.ShardCache, max_predictions_per_seq: int,
                 min_samples: int, *, held_out: bool = False) -> DataInfo:
    """Check the header of every training shard (the values, ids and labels, are checked later, per window
    read). min_samples: one global micro-batch. held_out: input_dir is --eval_dir, its held-out shards are
    checked, and min_samples is --num_eval_examples."""
    flag, needed = (("--eval_dir", f"--num_eval_examples {min_samples}") if held_out
                    else ("--input_dir", f"one global micro-batch ({min_samples})"))
    try:
        shards, seq_len, max_pred = scan_shards(input_dir, shard_files, held_out=held_out)
        if isinstance(shard_files, storage.ShardCache):
            shard_files.check_capacity([shard.path for shard in shards])
    except (ShardError, storage.StorageError) as err:  # this server's copy, or its way to the storage
        raise HostInputError(str(err)) from err
    if max_pred > max_predictions_per_seq:
        raise InputError(f"the shards of {flag} {input_dir} hold {max_pred} masked positions per sequence, more than "
                         f"--max_predictions_per_seq {max_predictions_per_seq}")
    num_samples = sum(s.num_samples for s in shards)
    if num_samples < min_samples:
        raise InputError(f"{flag} {input_dir} holds {num_samples} samples, fewer than {needed}")
    return DataInfo(shards, seq_len, max_pred, num_samples, shard_files)


def check_same_shards_on_every_rank(data: DataInfo, input_dir: str, hosts: list) -> None:
    """Each rank lists --input_dir itself, and the ranks cut one stream from their listings: a server whose
    copy lacks a shard (an unfinished copy) or holds another version of one would make the ranks train other
    samples than planned, silently. One all-gather of a digest; the listings themselves only when they differ.
    hosts: every rank's host (training/distributed.Job.hosts), for the message."""
    listing = {"shards": shard_listing(data.shards), "seq_len": data.seq_len, "max_pred": data.max_pred}
    digests = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(json.dumps(listing).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    listings = [None] * len(digests)
    dist.all_gather_object(listings, listing)
    other = next(rank for rank, digest in enumerate(digests) if digest != digests[0])
    first, second = ({name: size for name, size in listings[r]["shards"]} for r in (0, other))
    differences = [f"{name} only on rank 0" for name in sorted(first.keys() - second.keys())]
    differences += [f"{name} only on rank {other}" for name in sorted(second.keys() - first.keys())]
    differences += [f"{name} has {first[name]} samples on rank 0, {second[name]} on rank {other}"
                    for name in sorted(first.keys() & second.keys()) if first[name] != second[name]]
    differences += [f"{key} {listings[0][key]} on rank 0, {listings[other][key]} on rank {other}"
                    for key in ("seq_len", "max_pred") if listings[0][key] != listings[other][key]]
    shown = "; ".join(differences[:3]) + (f"; and {len(differences) - 3} more" if len(differences) > 3 else "")
    raise InputErrorOnEveryRank(f"--input_dir {input_dir} holds other training shards on rank {other} "
                                f"({hosts[other]}) than on rank 0 ({hosts[0]}): {shown}. Every server must hold "
                                "the same shards")


# ============================================================================ model, optimizer, engine

def build_model(config: BertConfig, init_checkpoint: str | Path | None, checkpoint_interval: int) -> BertForPreTraining:
    """checkpoint_interval: layers per activation-checkpointed chunk, 0 for none."""
    model = BertForPreTraining(config)
    if init_checkpoint:
        init_weights.load_init_weights(model, init_checkpoint)
    if checkpoint_interval:
        import deepspeed
        model.checkpoint_activations(True, checkpoint_interval, checkpoint_fn=deepspeed.checkpointing.checkpoint)
    return model


def build_engine(model: BertForPreTraining, ds_config: dict, *, optimizer_name: str | None, learning_rate: float,
                 betas: list | None, lr_schedule: dict | None, lans_blocks: str,
                 torch_compile: tuple[str, str] | None) -> tuple["DeepSpeedEngine", torch.optim.Optimizer]:
    """The client optimizer (--optimizer; None: the DeepSpeed JSON's) and LR schedule, then
    deepspeed_engine.initialize_engine. lr_schedule: PolyWarmUpScheduler's keyword arguments (--use_lr_scheduler), or
    None. lans_blocks: --lans_blocks. torch_compile: (backend, mode) with --enable_torch_compile, else None.
    With inductor, compile mode compiles LANS's update too (lans.LANS, compile_update)."""
    groups = get_parameter_groups(model)
    optimizer = scheduler = None
    backend = compile_mode.compile_backend(torch_compile[0]) if torch_compile is not None else None
    if optimizer_name:
        try:
            # adjust_step=False: no zero-gradient step ever reaches the optimizer (see optimizer_step_suppressed).
            optimizer = build_optimizer(optimizer_name, groups, learning_rate, betas=betas, adjust_step=False,
                                        compile_update=backend == "inductor")
            if lr_schedule is not None:
                scheduler = PolyWarmUpScheduler(optimizer, **lr_schedule)
        except ValueError as err:  # an impossible LR, betas or schedule
            raise InputError(f"optimizer / LR schedule: {err}") from err
    engine, optimizer = deepspeed_engine.initialize_engine(model, ds_config, optimizer, scheduler,
                                                           parameter_groups=groups)
    if optimizer_name == "lans" and lans_blocks == "tensor":
        zero_partitions.use_tensor_blocks(engine.optimizer, optimizer)
    if torch_compile is not None:
        compile_mode.compile_model(engine, backend, torch_compile[1])
    return engine, optimizer


# ============================================================================ resume, phase 2

@dataclass
class TrainState:
    """Everything the loop needs to continue; saved in every checkpoint's client_state."""
    global_step: int = 0            # optimizer steps in this phase
    samples_consumed: int = 0       # stream position of the next global micro-batch (data/dataset.py)
    phase: int = 1
    skipped_shards: list = field(default_factory=list)
    bad_steps: int = 0              # steps skipped for a non-finite loss, in total
    bad_steps_in_a_row: int = 0     # the current streak of those: a resume continues it (--max_bad_steps)
    # This rank's losses in the log window open at the save ({"local_losses", "all_rank_losses"}), kept in its
    # rank state (they differ between ranks): the first record after a resume averages the steps the
    # uninterrupted run's does. Empty for a fresh run, a resume on another world size or an older checkpoint.
    open_window: dict = field(default_factory=dict)


def steps_of_both_phases(state: TrainState, phase1_end_step: int) -> int:
    """The global step counted from phase 1's start: phase 2's steps continue after phase 1's."""
    return state.global_step + (phase1_end_step if state.phase == 2 else 0)


def checkpoint_tag(state: TrainState, phase1_end_step: int) -> str:
    # Phase-2 tags continue after phase 1's, so both phases can share one output directory.
    return str(steps_of_both_phases(state, phase1_end_step))


def describe_data_layout(shards: list, window_size: int, seed: int, shuffle: bool) -> dict:
    """What the stream position indexes into (data/dataset.py): a resume must see the same layout, or the
    saved position would point at other samples (repeats and gaps in the epoch)."""
    return {"seed": seed, "window_size": window_size, "shuffle": shuffle, "shards": shard_listing(shards)}


def shard_listing(shards: list) -> list:
    """What identifies the training shards, wherever they live: sorted [name, samples] pairs."""
    return sorted([shard.name, shard.num_samples] for shard in shards)


LAYOUT_FLAGS = {"seed": "--seed", "window_size": "--data_memory_budget_mb", "shuffle": "--disable_random_sampler",
                "shards": "the training shards of --input_dir (names and sizes)"}


def check_data_layout(saved: dict, current: dict, tag: str) -> None:
    for key, flag in LAYOUT_FLAGS.items():
        if saved[key] != current[key]:
            raise InputError(f"checkpoint {tag} was saved with another data layout: {key} {saved[key]!r} then, "
                             f"{current[key]!r} now (set by {flag}); resume with the same data and settings")


def choose_checkpoint(config: Config, checkpoint_dir: Path, copies: checkpoint_s3.CheckpointUploader | None,
                      device: torch.device, data_layout: dict, say: Callable[[str], None]) -> str | None:
    """The tag a resume loads (None: a fresh start), chosen and checked before the model and the engine are
    built (minutes for the 5B model): a --resume_step that --output_dir lacks, a checkpoint of another model
    config (its manifest says), of another data layout or, for --phase2, of another step than
    --phase1_end_step (its client state says) is refused. With an s3:// --output_dir, collective: the staging
    directory checkpoint_dir is emptied, or given the checkpoint to resume from."""
    if copies is not None:  # for an s3:// --output_dir, prepare() refuses a tag the prefix lacks
        copies.prepare(device, config.resume_from_checkpoint, config.resume_tag, say=say)
    if not config.resume_from_checkpoint:
        return None
    model_config = config.model_config.to_dict()
    tag = config.resume_tag
    if tag is None:
        tag = checkpointing.find_resume_tag(checkpoint_dir, model_config=model_config)
        if tag is None:
            say(f"no checkpoint in {config.output_dir}: starting from scratch")
            return None
    elif not (checkpoint_dir / tag).is_dir():
        raise InputError(f"--resume_step {tag}: {config.output_dir} holds no checkpoint {tag}")
    else:
        checkpoint_resume.check_resumable(checkpoint_dir, tag, model_config=model_config)
    client = checkpoint_resume.saved_client_state(checkpoint_dir, tag)
    if config.phase2 and client["phase"] == 1:
        if client["global_step"] != config.phase1_end_step:
            raise InputError(f"checkpoint {tag} is at step {client['global_step']}, "
                             f"but --phase1_end_step is {config.phase1_end_step}")
    else:  # phase 2 reads its own data from position 0
        check_data_layout(client["data_layout"], data_layout, tag)
    return tag


def restore_state(run: "RunObjects", config: Config, tag: str | None) -> TrainState:
    """Resume from checkpoint `tag` (choose_checkpoint's, which has checked it) in run.checkpoint_dir
    (--output_dir, or the staging copy of an s3:// one); a fresh state when tag is None. --phase2 with a phase-1
    checkpoint starts phase 2 from it; a resume on another world size re-seeds the ranks."""
    fresh = TrainState(phase=2 if config.phase2 else 1)
    if tag is None:
        return fresh
    engine, world, rank = run.engine, dist.get_world_size(), dist.get_rank()
    fresh_schedule = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    client, rank_state = checkpoint_resume.load_checkpoint(engine, run.checkpoint_dir, tag, rank, world,
                                                           model_config=config.model_config.to_dict(), say=run.say)
    # Checkpoints from before the streak was saved lack it: such a resume counts the streak from 0.
    state = TrainState(client["global_step"], client["samples_consumed"], client["phase"],
                       list(client["skipped_shards"]), client["bad_steps"], client.get("bad_steps_in_a_row", 0))
    if rank_state is None:  # another world size: new per-rank streams, distinct from those of step 0
        device_setup.seed_everything(config.seed + rank + world * state.global_step)
    else:
        checkpointing.restore_rng_state(rank_state["rng"], engine.device)
        state.open_window = rank_state.get("log_window", {})
    if config.phase2 and state.phase == 1:
        start_phase2(engine, run.optimizer, fresh_schedule)
        state = TrainState(phase=2)  # phase 2 reads its own data from position 0
    run.say(f"resumed from checkpoint {tag}: phase {state.phase}, step {state.global_step}, "
            f"{state.samples_consumed} samples consumed")
    # Only PolyWarmUp (--use_lr_scheduler) saves its schedule; a DeepSpeed JSON scheduler saves only its step
    # and takes its parameters from the JSON at every start.
    if isinstance(engine.lr_scheduler, PolyWarmUpScheduler) and not (config.phase2 and client["phase"] == 1):
        follow_changed_schedule(engine.lr_scheduler, fresh_schedule, run.say)
    return state


def start_phase2(engine: "DeepSpeedEngine", optimizer: torch.optim.Optimizer, fresh_schedule: dict | None) -> None:
    """As the reference: step counters and scheduler start again, the optimizer moments are kept."""
    for group in optimizer.param_groups:
        group["step"] = 0
    for param_state in optimizer.state.values():
        if "step" in param_state:
            param_state["step"] = torch.zeros_like(param_state["step"]) if torch.is_tensor(param_state["step"]) else 0
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(fresh_schedule)
        engine.lr_scheduler.step()  # sets the LR of phase 2's first step
    engine.global_steps = engine.global_samples = engine.skipped_steps = 0


def save(run: "RunObjects", settings: "RunSettings", state: TrainState, window: "LogWindow") -> str:
    """Collective: every rank calls it. Tag = global step (phase 2: continued from phase 1's). With an
    s3:// --output_dir, the copy of the previous checkpoint is waited for, and this one's started."""
    config = settings.config
    tag = checkpoint_tag(state, config.phase1_end_step)
    client_state = {"global_step": state.global_step, "samples_consumed": state.samples_consumed,
                    "epoch": state.samples_consumed // settings.epoch_size, "phase": state.phase,
                    "model_config": config.model_config.to_dict(), "world_size": settings.world,
                    "skipped_shards": list(state.skipped_shards), "bad_steps": state.bad_steps,
                    "bad_steps_in_a_row": state.bad_steps_in_a_row, "data_layout": settings.data_layout}
    if run.copies is not None:
        run.copies.finish(run.device)
    log_window_losses = {"local_losses": list(window.local_losses), "all_rank_losses": list(window.all_rank_losses)}
    checkpointing.save_checkpoint(run.engine, run.checkpoint_dir, tag, client_state,
                                  {"rng": checkpointing.capture_rng_state(run.device), "log_window": log_window_losses})
    if config.keep_last_n_checkpoints > 0 and dist.get_rank() == 0:
        checkpointing.prune_checkpoints(run.checkpoint_dir, config.keep_last_n_checkpoints)
    if run.copies is not None:
        run.copies.start(tag)
    run.say(f"saved checkpoint {tag}")
    run.status_file.saved(tag)
    return tag


# ============================================================================ logging

@dataclass
class LogWindow:
    """Loss and time accumulated since the last log record (the reference's average_loss etc.).

    Skipped (non-finite) steps count for the time but not for the losses: their loss is meaningless."""
    started: float               # RunObjects.clock() at the window's start
    steps: int = 0
    local_losses: list = field(default_factory=list)      # this rank's mean loss per finite optimizer step
    all_rank_losses: list = field(default_factory=list)   # the same averaged over ranks
    last_micro_loss: float = float("nan")
    learning_rate: float = float("nan")

    def record(self, result):
        self.steps += 1
        if result.finite:
            self.local_losses.append(result.local_loss)
            self.all_rank_losses.append(result.mean_loss)
        self.last_micro_loss, self.learning_rate = result.last_micro_loss, result.learning_rate


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """What the loop follows, fixed for the run: the Config, and what the data, the engine and the device add."""
    config: Config
    micro_batch: int
    gas: int
    world: int
    seq_len: int
    epoch_size: int
    data_layout: dict
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
    """The live objects of a run that the loop works with; built once in train_run."""
    engine: "DeepSpeedEngine"
    optimizer: torch.optim.Optimizer  # the one that steps (the client's, else the JSON's): its param_groups hold the LR
    criterion: BertPretrainingCriterion
    clock: Callable[[], float]  # time.perf_counter; a parameter of main, so a test can fake it
    all_reduce: Callable[[torch.Tensor], object]  # dist.all_reduce; a test stands in for other ranks with its own
    all_gather_object: Callable[[list, object], object]  # dist.all_gather_object (rare: shards skipped somewhere)
    device: torch.device
    logger: "dllogger.Logger"  # logs.build_logger: dllogger's, or dllogger_fallback's without the package
    say: Callable[[str], None]  # prints on rank 0, nothing elsewhere
    checkpoint_dir: Path  # where checkpoints are written: --output_dir, or the staging dir of an s3:// one
    copies: checkpoint_s3.CheckpointUploader | None  # for an s3:// --output_dir
    graph_breaks: gaudi.NoGraphBreaks  # HPU lazy mode: the reference's mark_steps (training/gaudi.py); else none
    status_file: run_status.StatusFile  # rank 0's report to the supervisor: the last checkpoint saved
    held_out: evaluation.HeldOutSet | None  # --eval_dir's samples (this rank's chunks), None without it


def log_window(run: RunObjects, settings: RunSettings, state: TrainState, window: LogWindow,
               final: bool = False) -> dict:
    """One dllogger record, computed as the reference computes it; returns the record."""
    step_time = (run.clock() - window.started) / max(window.steps, 1)
    sequences_per_step = settings.micro_batch * settings.gas  # per device
    model_tflops = sequences_per_step / step_time * settings.flops_per_sequence / 1e12
    record = {"average_loss": mean_or_nan(window.local_losses),
              "all_ranks_average_loss": mean_or_nan(window.all_rank_losses),
              "step_loss": window.last_micro_loss,
              "learning_rate": window.learning_rate,  # applied by the last step (the reference: the next one's)
              "average_training_time_step": step_time,
              "average_perf_per_step": sequences_per_step / step_time,
              "tokens_per_second": sequences_per_step * settings.world * settings.seq_len / step_time,
              "model_tflops": model_tflops, "mfu": model_tflops / settings.peak_tflops,
              "skipped_steps": state.bad_steps}
    if run.engine.monitor.enabled and not final:  # TensorBoard / CSV / W&B, as the DeepSpeed JSON asks
        run.engine.monitor.write_events([(f"Train/{key}", value, state.global_step) for key, value in record.items()])
    if final:
        record = {"final_loss": record["all_ranks_average_loss"],
                  "average_training_time_step": step_time, "average_perf_per_step": record["average_perf_per_step"],
                  "model_tflops": model_tflops, "mfu": record["mfu"]}
    run.logger.log(step=(state.samples_consumed // settings.epoch_size, state.global_step), data=record)
    # On disk at once: a rank whose collective fails leaves with os._exit (command_line.run_cli), which drops
    # what the stream still buffers, and a restarted job's log would lack the steps of the failed attempt.
    run.logger.flush()
    return record


def mean_or_nan(values: list) -> float:
    return sum(values) / len(values) if values else float("nan")


# ============================================================================ one optimizer step

@dataclass
class StepResult:
    learning_rate: float     # the LR this step applied (group 0)
    local_loss: float        # this rank's mean loss over the step's micro-batches
    mean_loss: float         # local_loss averaged over ranks
    last_micro_loss: float
    finite: bool             # every rank's loss was finite and DeepSpeed did not skip the step
    stop_requested: bool     # some rank received SIGTERM/SIGINT
    skipped_shards: tuple    # shards this rank has dropped by --skip_bad_shards so far
    shards_newly_skipped: bool  # some rank dropped a shard in this step: the ranks must agree on the list
    next_position: int       # stream position after this step's last global micro-batch


def train_step(run: RunObjects, settings: RunSettings, batches, stop_event, profiler,
               agreed_skipped_shards=()) -> StepResult:
    """GAS micro-batches: forward, backward, engine.step() (on an HPU in lazy mode with the reference's
    mark_steps, run.graph_breaks); the ranks agree on skip/stop before the update. agreed_skipped_shards:
    the shards every rank had dropped before this step."""
    engine, gas, losses = run.engine, settings.gas, []
    skipped_before = engine.skipped_steps
    for micro in range(gas):
        batch = next(batches)
        if batch.crosses_epoch:
            run.say(f"epoch {batch.epoch} ends inside the global micro-batch at sample {batch.position}: "
                    f"the rest of that micro-batch is the start of epoch {batch.epoch + 1}")
        input_ids, segment_ids, input_mask, labels, nsp_labels = (t.to(run.device) for t in batch.tensors)
        scores, nsp_scores = engine(input_ids, token_type_ids=segment_ids, attention_mask=input_mask,
                                    masked_lm_labels=labels)
        with run.graph_breaks.around_loss():
            loss = run.criterion(scores, nsp_scores, labels, nsp_labels)
        engine.backward(loss)
        run.graph_breaks.after_backward()
        losses.append(loss.detach().float())
        if micro == gas - 1:
            newly_skipped = len(batch.skipped_shards) > len(agreed_skipped_shards)
            nonfinite, stop, newly_skipped, loss_sum = agree_across_ranks(torch.stack(losses), stop_event.is_set(),
                                                                          newly_skipped, run.device, run.all_reduce)
            learning_rate = run.optimizer.param_groups[0]["lr"]
        with optimizer_step_suppressed(run.optimizer) if micro == gas - 1 and nonfinite else nullcontext():
            engine.step()
        run.graph_breaks.after_step()
        if profiler is not None:
            profiler.step()
    local_loss = float(torch.stack(losses).mean())
    finite = not nonfinite and engine.skipped_steps == skipped_before
    return StepResult(learning_rate, local_loss, loss_sum / settings.world, float(losses[-1]), finite, stop,
                      batch.skipped_shards, newly_skipped, batch.next_position)


def agree_across_ranks(losses: torch.Tensor, stop_local: bool, skipped_local: bool, device: torch.device,
                       all_reduce: Callable[[torch.Tensor], object]) -> tuple:
    """One all-reduce per optimizer step: (any rank non-finite, any rank asked to stop, any rank dropped a
    shard, sum of mean losses)."""
    flags = torch.tensor([float(stop_local), float(skipped_local)], device=device)
    stats = torch.cat([(~torch.isfinite(losses)).any().float().reshape(1), flags,
                       torch.nan_to_num(losses.mean(), nan=0.0, posinf=0.0, neginf=0.0).reshape(1)])
    all_reduce(stats)
    nonfinite, stop, skipped, loss_sum = stats.tolist()
    return nonfinite > 0, stop > 0, skipped > 0, loss_sum


def agree_on_skipped_shards(run: RunObjects, settings: RunSettings, state: TrainState, result: StepResult,
                            batches: RankBatches) -> None:
    """Some rank dropped a shard in this step (--skip_bad_shards): every rank drops the union of the ranks'
    lists from the next step on, so that the ranks keep slicing one stream (and the checkpoint, written by
    rank 0, holds every rank's list). The rank that met the bad shard read the rest of this step without it."""
    lists = [None] * settings.world
    run.all_gather_object(lists, list(result.skipped_shards))
    agreed = sorted(set(state.skipped_shards).union(*lists))
    for name in agreed:
        if name not in state.skipped_shards:
            ranks = ", ".join(str(rank) for rank, names in enumerate(lists) if name in names)
            run.say(f"step {state.global_step}: shard {name} could not be read on rank(s) {ranks} "
                    f"(--skip_bad_shards): every rank drops it from sample {result.next_position} on")
    if agreed != sorted(result.skipped_shards):
        batches.restart(result.next_position, agreed)
    state.skipped_shards = agreed


# ============================================================================ the loop

def train(run: RunObjects, settings: RunSettings, state: TrainState, batches, stop_event, profiler) -> dict:
    """Optimizer steps until max_steps / steps_this_run / a stop request; returns the final record."""
    say, every, clock, config = run.say, settings.checkpoint_every, run.clock, settings.config
    progress = progress_display.progress_bar(settings.progress_bar, config.max_steps, state.global_step, "steps",
                                             config.log_freq)
    window, last_window, steps_done, last_saved = LogWindow(clock()), LogWindow(clock()), 0, None
    eval_time, held_out_figures, evaluated_at = 0.0, {}, None  # eval_time: seconds of the evaluations between steps
    window.local_losses = list(state.open_window.get("local_losses", []))
    window.all_rank_losses = list(state.open_window.get("all_rank_losses", []))
    while state.global_step < config.max_steps and steps_done < settings.steps_this_run:
        # ---------------------------------------------------------------- step
        step_started = clock()
        result = train_step(run, settings, batches, stop_event, profiler, state.skipped_shards)
        if config.torch_compile is not None and steps_done == 0:  # the first step's time is mostly compilation
            compile_mode.log_first_step(run.logger, say, clock() - step_started)
        state.global_step += 1
        steps_done += 1
        state.samples_consumed = result.next_position
        if result.shards_newly_skipped:
            agree_on_skipped_shards(run, settings, state, result, batches)
        window.record(result)
        progress.update(1)
        # ---------------------------------------------------------------- non-finite loss
        if result.finite:
            state.bad_steps_in_a_row = 0
        else:
            state.bad_steps += 1
            state.bad_steps_in_a_row += 1
            say(f"step {state.global_step}: non-finite loss, update skipped ({state.bad_steps_in_a_row} in a row)")
        # ---------------------------------------------------------------- log, checkpoint
        if state.global_step % config.log_freq == 0:
            log_window(run, settings, state, window)
            window, last_window = LogWindow(clock()), window
        if run.held_out is not None and state.global_step % config.eval_interval == 0:
            held_out_figures, seconds = evaluate_and_log(run, settings, state)
            eval_time, evaluated_at = eval_time + seconds, state.global_step
            window.started += seconds  # the logged step times and speeds leave the evaluation out
            last_window.started += seconds
        # As NVIDIA's driver: at multiples of the interval, so that a resumed run saves the checkpoints the
        # uninterrupted run saves.
        if every is not None and steps_of_both_phases(state, config.phase1_end_step) % every == 0:
            last_saved = save(run, settings, state, window)
        # ---------------------------------------------------------------- stop early
        if state.bad_steps_in_a_row >= config.max_bad_steps:
            if every is not None and last_saved != checkpoint_tag(state, config.phase1_end_step):
                save(run, settings, state, window)
            raise TrainingStopped(f"{state.bad_steps_in_a_row} consecutive steps had a non-finite loss "
                                  f"(--max_bad_steps {config.max_bad_steps}); stopped at step {state.global_step}")
        if result.stop_requested:
            say(f"stop requested (SIGTERM/SIGINT): stopping after step {state.global_step}")
            break
    progress.close()
    # As the reference, the final record and the training time end before the final checkpoint is saved.
    ended = clock()
    final = log_window(run, settings, state, window if window.steps else last_window, final=True)
    final_eval_time = 0.0
    if run.held_out is not None and steps_done and evaluated_at != state.global_step and not result.stop_requested:
        held_out_figures, final_eval_time = evaluate_and_log(run, settings, state)
    if every is not None and steps_done and last_saved != checkpoint_tag(state, config.phase1_end_step):
        save(run, settings, state, window)
    return {**final, "ended": ended, "steps_done": steps_done, "eval_time_between_steps": eval_time,
            "eval_time": eval_time + final_eval_time, "held_out": held_out_figures,
            "stopped_by_signal": bool(steps_done and result.stop_requested)}


# ============================================================================ held-out evaluation

def evaluate_and_log(run: RunObjects, settings: RunSettings, state: TrainState) -> tuple[dict, float]:
    """Collective: the held-out figures of the model after step state.global_step, in a dllogger record at that
    step (with eval_time, its seconds) and the DeepSpeed monitors; returns (figures, seconds)."""
    started = run.clock()
    figures = evaluation.evaluate(run.engine.module, run.held_out, run.device, run.all_gather_object, settings.world,
                                  after_batch=run.graph_breaks.after_step)
    seconds = run.clock() - started
    report_evaluation(run.engine, run.say, state.global_step, figures, seconds)
    run.logger.log(step=(state.samples_consumed // settings.epoch_size, state.global_step),
                   data={**figures, "eval_time": seconds})
    run.logger.flush()
    return figures, seconds


def evaluate_only(run: RunObjects, state: TrainState, started: float) -> dict:
    """--skip_train: the held-out figures of the model as loaded, in the final record; no step, no checkpoint."""
    eval_started = run.clock()
    figures = evaluation.evaluate(run.engine.module, run.held_out, run.device, run.all_gather_object,
                                  dist.get_world_size(), after_batch=run.graph_breaks.after_step)
    seconds = run.clock() - eval_started
    report_evaluation(run.engine, run.say, state.global_step, figures, seconds)
    return log_summary_without_steps(state, run.logger, run.clock() - started, **figures, eval_time=seconds)


def report_evaluation(engine: "DeepSpeedEngine", say: Callable[[str], None], global_step: int, figures: dict,
                      seconds: float) -> None:
    if engine.monitor.enabled:  # TensorBoard / CSV / W&B, as the DeepSpeed JSON asks
        engine.monitor.write_events([(f"Eval/{key}", value, global_step) for key, value in figures.items()])
    say(f"step {global_step}: held-out MLM loss {figures['eval_mlm_loss']:.4f}, MLM accuracy "
        f"{figures['eval_mlm_accuracy']:.4f}, NSP accuracy {figures['eval_nsp_accuracy']:.4f} ({seconds:.1f} s)")


# ============================================================================ main

GraphBreaksFactory = Callable[[torch.device, torch.nn.Module, bool], gaudi.NoGraphBreaks]  # as gaudi.graph_breaks


def main(argv=None, *, clock: Callable[[], float] = time.perf_counter,
         criterion: BertPretrainingCriterion | None = None,
         make_graph_breaks: GraphBreaksFactory = gaudi.graph_breaks,
         device_memory: Callable[[torch.device], tuple] = hardware.device_memory_bytes,
         status_file: run_status.StatusFile | None = None, job: distributed.Job | None = None) -> dict:
    """Run the training; returns the summary (the reference's final dllogger record) on every rank.
    clock (seconds), criterion (default: BertPretrainingCriterion()), make_graph_breaks (device, model,
    is 5B) and device_memory (device -> (bytes, description)) are there for tests: a fake clock, a loss that
    turns NaN on chosen steps, HPU lazy-mode graph breaks on the CPU, a device smaller than the run.
    status_file: the one cli's run_cli reports the end to (default: a new one). job: run_cli's (default: a new one,
    for a caller without run_cli)."""
    started = clock()
    # From the start, SIGTERM/SIGINT (a preemption, forwarded by the launcher) only ask the run to stop: one that
    # comes during start-up (engine set-up, checkpoint load: minutes for the 5B model) stops the run before its
    # first step, one during training after the step under way, and none cuts a checkpoint copy short.
    with command_line.stop_requests() as stop_event:
        args = parse_arguments(argv)
        status_file = status_file if status_file is not None else run_status.StatusFile()
        job = job if job is not None else distributed.Job()
        status_file.place(args.json_summary)
        config = build_config(args, int(os.environ.get("WORLD_SIZE", "1")))
        data, held_out_data, copies = open_inputs(config)
        try:
            return train_run(config, data, held_out_data, copies, stop_event, status_file, job, started, clock=clock,
                             criterion=criterion if criterion is not None else BertPretrainingCriterion(),
                             make_graph_breaks=make_graph_breaks, device_memory=device_memory)
        except BaseException as err:  # the copy below may take minutes: no other rank's exit is a death meanwhile
            job.stop_watching_peers(goodbye=isinstance(err, InputErrorOnEveryRank))
            raise
        finally:  # also after an error: the process must not end in the middle of a checkpoint copy
            if copies is not None:
                copies.wait()
            data.shard_files.close()


def train_run(config: Config, data: DataInfo, held_out_data: DataInfo | None,
              copies: checkpoint_s3.CheckpointUploader | None, stop_event: threading.Event,
              status_file: run_status.StatusFile, job: distributed.Job, started: float,
              *, clock: Callable[[], float], criterion: BertPretrainingCriterion, make_graph_breaks: GraphBreaksFactory,
              device_memory: Callable[[torch.device], tuple]) -> dict:
    """main after the checks without a device: the device and the checks that need it, the checkpoint to
    resume from, then model, log and engine, and run_training."""
    device = distributed.setup_device_and_distributed(job, config.use_hpu, config.no_cuda, config.local_rank,
                                                      config.collective_timeout_s, stop_event, config.ds_config)
    rank = dist.get_rank()
    check_same_shards_on_every_rank(data, config.input_dir, job.hosts)
    held_out = read_held_out(held_out_data, config, rank, dist.get_world_size()) if held_out_data else None
    device_setup.seed_everything(config.seed + rank)
    say = (lambda text: print(f"[run_pretraining] {text}", flush=True)) if rank == 0 else (lambda text: None)
    check_memory(device, config, data, say, device_memory=device_memory)
    peak_dtype = torch.bfloat16 if sizing.bf16_enabled(config.ds_config) else torch.float32
    peak, peak_source = hardware.peak_tflops(device, peak_dtype, config.peak_tflops)
    say(f"MFU is model FLOPs / {peak:.3f} TFLOP/s per device ({peak_source})")
    window_size = window_size_for_budget(int(config.data_memory_budget_mb * 2 ** 20), data.seq_len, data.max_pred)
    data_layout = describe_data_layout(data.shards, window_size, config.seed,
                                       shuffle=not config.disable_random_sampler)
    checkpoint_dir = Path(config.output_dir) if copies is None else copies.local_dir
    resume_tag = choose_checkpoint(config, checkpoint_dir, copies, device, data_layout, say)
    model = build_model(config.model_config, config.init_checkpoint, config.activation_checkpoint_interval)
    # The log is started once the run is known to fit and its weights to load: a refused attempt of a
    # launcher (which resumes, appending) adds nothing to the run's log.
    logger = logs.build_logger(config.json_summary, rank, append=config.resume_from_checkpoint)
    log_parameters(logger, config, peak, peak_source)
    graph_breaks = make_graph_breaks(device, model, gaudi.is_bert_5b(config.config_file))
    engine, optimizer = build_engine(model, config.ds_config, optimizer_name=config.optimizer,
                                     learning_rate=config.learning_rate, betas=config.betas,
                                     lr_schedule=config.lr_schedule, lans_blocks=config.lans_blocks,
                                     torch_compile=config.torch_compile)
    run = RunObjects(engine=engine, optimizer=optimizer, criterion=criterion, clock=clock, all_reduce=dist.all_reduce,
                     all_gather_object=dist.all_gather_object, device=device, logger=logger, say=say,
                     checkpoint_dir=checkpoint_dir, copies=copies, graph_breaks=graph_breaks,
                     status_file=status_file, held_out=held_out)
    # Every normal way out from here (the end, nothing to train, a stop during start-up) frees the engine:
    # DeepSpeed's gradient hooks would otherwise keep it, the model and the optimizer states alive after main.
    with deepspeed_engine.destroyed_on_exit(engine):
        return run_training(run, config, data, data_layout, resume_tag, peak, stop_event, started)


def run_training(run: RunObjects, config: Config, data: DataInfo, data_layout: dict, resume_tag: str | None,
                 peak_tflops: float, stop_event: threading.Event, started: float) -> dict:
    """Resume (or start), the loop, the last checkpoint's copy and the summary: logged, and returned."""
    state = restore_state(run, config, resume_tag)
    run.status_file.saved(resume_tag)
    if config.skip_train:
        return evaluate_only(run, state, started)
    if state.global_step >= config.max_steps:  # a finished job relaunched: no step, so no loss or speed
        return nothing_to_train(checkpoint_tag(state, config.phase1_end_step), config.max_steps, state, run.logger,
                                run.say, run.clock() - started)
    if stop_requested_on_any_rank(stop_event, run.device):  # during start-up: no step made, so nothing new to save
        return stopped_before_training(state, run.logger, run.say, run.clock() - started)
    micro, gas = run.engine.train_micro_batch_size_per_gpu(), run.engine.gradient_accumulation_steps()
    rank, world = dist.get_rank(), dist.get_world_size()
    run.say(f"global batch {micro * gas * world} = micro-batch {micro} x {gas} accumulation steps x {world} ranks")
    reader = WindowReader(data.shards, config.seed, data_layout["window_size"], config.model_config.vocab_size,
                          shuffle=not config.disable_random_sampler, skip_bad_shards=config.skip_bad_shards,
                          skipped_shards=state.skipped_shards, shard_files=data.shard_files,
                          type_vocab_size=config.model_config.type_vocab_size)
    state.skipped_shards = list(reader.skipped_shards)  # names (checkpoints before 2026-11-27 held paths)
    batches = RankBatches(reader, rank, world, micro, state.samples_consumed)
    settings = RunSettings(config=config, micro_batch=micro, gas=gas, world=world, seq_len=data.seq_len,
                           epoch_size=reader.stream.epoch_size, data_layout=data_layout,
                           flops_per_sequence=sizing.model_flops_per_sequence(config.model_config, data.seq_len,
                                                                              data.max_pred),
                           peak_tflops=peak_tflops, progress_bar=rank == 0 and not config.disable_progress_bar)
    first_step = state.global_step
    profiler = profiling.build_profiler(config.profile, config.profile_steps, Path(config.json_summary).parent,
                                        config.use_hpu, config.no_cuda)
    train_started = run.clock()
    try:
        with profiler if profiler is not None else nullcontext():
            final = train(run, settings, state, batches, stop_event, profiler)
    finally:
        batches.close()
    # The last checkpoint is on S3 before the run reports success. Still under main's stop handler: a repeated
    # SIGTERM (a preemption's) must not cut that copy short, or the step it saved would only be local.
    if run.copies is not None:
        run.copies.finish(run.device)
    return log_summary(run, settings, final, state.global_step - first_step, state, train_started, started)


def log_summary(run: RunObjects, settings: RunSettings, final: dict, steps_done: int, state: TrainState,
                train_started: float, started: float) -> dict:
    """The run's final record (the reference's), from the loop's final record; logged, and returned."""
    raw_train_time = final["ended"] - train_started - final["eval_time_between_steps"]
    sequences = settings.micro_batch * settings.gas * settings.world * steps_done
    model_tflops = sequences / settings.world / raw_train_time * settings.flops_per_sequence / 1e12  # per device
    summary = {"e2e_train_time": run.clock() - started,
               "training_sequences_per_second": sequences / raw_train_time,
               "model_tflops": model_tflops, "mfu": model_tflops / settings.peak_tflops,
               "training_tokens_per_second": sequences * settings.seq_len / raw_train_time,
               "raw_train_time": raw_train_time,
               "final_loss": final["final_loss"], "global_step": state.global_step,
               "skipped_steps": state.bad_steps,
               "skipped_shards": len(state.skipped_shards), "stopped_by_signal": final["stopped_by_signal"],
               **({**final["held_out"], "total_eval_time": final["eval_time"]} if final["held_out"] else {})}
    run.logger.log(step=(), data=summary)
    run.logger.flush()
    return summary


def check_memory(device: torch.device, config: Config, data: DataInfo, say: Callable[[str], None], *,
                 device_memory: Callable[[torch.device], tuple]) -> None:
    """Refuse, before the model is built, a run the memory planner says cannot fit this device."""
    # the DeepSpeed JSON's own optimizer: planned as LANS, the one with the most temporaries
    optimizer = config.optimizer if config.optimizer in sizing.OPTIMIZER_TEMPORARIES else "lans"
    setup = sizing.TrainingSetup.from_deepspeed_config(config.ds_config, dist.get_world_size(), data.seq_len,
                                                       data.max_pred, config.activation_checkpoint_interval, optimizer,
                                                       on_cpu=device.type == "cpu")
    predicted = sizing.device_memory(config.model_config, setup)["total"]
    available, description = device_memory(device)
    if available is None:
        say(f"memory check skipped: the memory of {description} is unknown")
        return
    if sizing.fits(predicted, available):
        return
    message = (f"the memory planner predicts {predicted / 2**30:.2f} GiB per device at the peak, more than "
               f"{sizing.USABLE_FRACTION:.0%} of {available / 2**30:.1f} GiB ({description}); lower "
               "train_micro_batch_size_per_gpu, add --checkpoint_activations, or use more ranks or a higher "
               "ZeRO stage (scripts/plan_memory.py shows the parts)")
    if not config.skip_memory_check:
        raise InputError(message + "; --skip_memory_check trains anyway")
    say(f"warning: {message}; training anyway (--skip_memory_check)")


def nothing_to_train(tag: str, max_steps: int, state: TrainState, logger: "dllogger.Logger",
                     say: Callable[[str], None], elapsed: float) -> dict:
    say(f"checkpoint {tag} is already at --max_steps {max_steps}: nothing to train")
    return log_summary_without_steps(state, logger, elapsed, stopped_by_signal=False, nothing_to_train=True)


def stop_requested_on_any_rank(stop_event: threading.Event, device: torch.device) -> bool:
    """Collective: whether any rank was asked to stop (the ranks may get a forwarded signal at different times)."""
    flag = torch.tensor([float(stop_event.is_set())], device=device)
    dist.all_reduce(flag)
    return flag.item() > 0


def stopped_before_training(state: TrainState, logger: "dllogger.Logger", say: Callable[[str], None],
                            elapsed: float) -> dict:
    say(f"stop requested (SIGTERM/SIGINT) during start-up: stopping before the first step, at step "
        f"{state.global_step}")
    return log_summary_without_steps(state, logger, elapsed, stopped_by_signal=True)


def log_summary_without_steps(state: TrainState, logger: "dllogger.Logger", elapsed: float, **flags) -> dict:
    """The final record of a run that made no step (no loss, no speed), with `flags` added; returned."""
    summary = {"e2e_train_time": elapsed, "global_step": state.global_step, "skipped_steps": state.bad_steps,
               "skipped_shards": len(state.skipped_shards), **flags}
    logger.log(step=(), data=summary)
    logger.flush()
    return summary


def log_parameters(logger: "dllogger.Logger", config: Config, peak_tflops: float, peak_source: str) -> None:
    """The reference's PARAMETER record ("Config": the flags, as text; the flags that do nothing left out),
    and the MFU's denominator."""
    logger.log(step="PARAMETER", data={"Config": str(config.flags()), "SEED": config.seed, "train_start": True,
                                       "batch_size_per_pu": config.ds_config["train_micro_batch_size_per_gpu"],
                                       "learning_rate": config.learning_rate, "deepspeed_config": config.ds_config})
    logger.log(step="PARAMETER", data={"peak_tflops": peak_tflops, "peak_tflops_source": peak_source})


def cli(argv=None) -> int:
    """Command-line entry: one clear error line instead of a traceback, and an exit status and status file for
    the supervisor (training/run_status.py). Bad input and a deliberate stop are final (NO_RESTART, the line
    says [no restart]): a restart would meet them again."""
    status_file = run_status.StatusFile()
    return command_line.run_cli(functools.partial(main, status_file=status_file), argv,
                                (ShardError, checkpointing.CheckpointError, TrainingStopped, storage.StorageError),
                                final=(InputError, TrainingStopped), report=status_file.ended)


if __name__ == "__main__":
    sys.exit(cli())
