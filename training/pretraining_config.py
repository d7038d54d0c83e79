"""The pretraining driver's settings: the typed, frozen Config that build_config makes from the parsed flags and
the two JSON files, checking every value in one place (InputError) before anything touches a file of data."""

import argparse
from dataclasses import dataclass, fields
from typing import Any

from common import deepspeed_config, storage
from common.errors import InputError
from modeling import BertConfig
from optimization import OPTIMIZERS
from training import command_line, compile_mode, profiling


@dataclass(frozen=True, kw_only=True)
class Config:
    """The settings of a run, typed and checked: every flag that does something (the reference's names; its
    float step counts as whole numbers), the DeepSpeed JSON and the model config. build_config makes it from
    the flags, once; nothing below run_pretraining.main reads the flags themselves."""
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
    ds_config: dict[str, Any]      # read from deepspeed_config, with its optimizer (common/deepspeed_config.py)

    @property
    def activation_checkpoint_interval(self) -> int:
        """Layers per activation-checkpointed chunk, 0 for none."""
        return self.checkpoint_activations_interval if self.checkpoint_activations else 0

    @property
    def lr_schedule(self) -> dict[str, Any] | None:
        """PolyWarmUpScheduler's keyword arguments with --use_lr_scheduler, else None."""
        if not self.use_lr_scheduler:
            return None
        return {"warmup": self.warmup_proportion, "total_steps": self.max_steps, "degree": self.scheduler_degree,
                "constant": self.constant_proportion}

    @property
    def resume_tag(self) -> str | None:
        return str(self.resume_step) if self.resume_step >= 0 else None

    def flags(self) -> dict[str, Any]:
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


def deepspeed_config_with_optimizer(path: str, world_size: int, client_optimizer: str | None) -> dict[str, Any]:
    """The DeepSpeed JSON (common/deepspeed_config.py) and an optimizer from it or --optimizer."""
    config = deepspeed_config.load(path, world_size, client_optimizer=client_optimizer)
    if client_optimizer is None and "optimizer" not in config:
        raise InputError(f"no optimizer: pass --optimizer or add an optimizer section to {path}")
    return config
