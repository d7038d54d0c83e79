"""The common flags of the fine-tuning entry points (run_glue.py, run_squad.py; NVIDIA's names), their typed,
frozen Config and its checks (build_config: the one place that reads the flags, before any work), the DeepSpeed
settings that NVIDIA's batch flags give, and where a run's checkpoints go. An entry point subclasses Config
with its own flags; finetune/finetuning.py runs what it says."""

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from common import deepspeed_config
from common.errors import InputError
from training import command_line, compile_mode, device_setup

CHECKPOINT_SUBDIR = "checkpoints"
# NVIDIA's mixed-precision switches: accepting them would train in fp32 while the command line says fp16.
FP16_FLAGS = ("--fp16", "--amp")
Settings = TypeVar("Settings", bound="Config")  # an entry point's Config subclass


def checkpoint_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINT_SUBDIR


# ============================================================================ flags

def build_parser(description: str,
                 usage: str) -> tuple[argparse.ArgumentParser, dict[str, argparse._ArgumentGroup]]:
    """(parser, {title: argument group}) with the common flags in their groups; an entry point adds its own
    flags to these groups ("data", "model", ...)."""
    parser = command_line.OneLineErrorParser(description=description, usage=usage, epilog=command_line.SWITCHES_EPILOG,
                                             formatter_class=command_line.DefaultsHelpFormatter)
    groups = {title: parser.add_argument_group(title) for title in
              ("what to run", "data", "model", "schedule and optimizer", "prediction", "checkpoints",
               "devices and distribution", "logging")}
    add = groups["what to run"].add_argument
    add("--do_train", action="store_true", help="Fine-tune.")
    add("--do_eval", action="store_true", help="Score predictions against their answers: run_squad.py those of "
        "--predict_file, run_glue.py the task's dev sets.")
    add("--do_predict", action="store_true", help="Write predictions: run_squad.py of --predict_file (also what "
        "--do_eval scores), run_glue.py of the task's unlabelled test sets.")
    add = groups["data"].add_argument
    add("--vocab_file", required=True, help="vocab.txt of the pretrained model.")
    add("--do_lower_case", action="store_true", help="Lower-case the text (uncased vocab).")
    add = groups["model"].add_argument
    add("--init_checkpoint", default=None, help="Pretrained weights: a run_pretraining.py output or tag directory "
        "(any ZeRO stage and ranks; also s3://bucket/prefix[/tag]), a `python -m training.checkpointing export` "
        "file, or a Hugging Face BERT directory (default: none, fresh weights from --config_file).")
    add("--config_file", default=None, help="Model config JSON (default: the one --init_checkpoint records; "
        "needed when it records none).")
    compile_mode.add_compile_arguments(groups["model"])
    add = groups["schedule and optimizer"].add_argument
    add("--train_batch_size", type=int, default=None, help="Sequences per process (device) and optimizer step, "
        "as in NVIDIA's run_squad.py and run_glue.py: each of the --gradient_accumulation_steps micro-steps "
        "takes train_batch_size / gradient_accumulation_steps of them, and the global batch is train_batch_size x "
        "the number of processes (default: the DeepSpeed JSON's train_micro_batch_size_per_gpu x "
        "gradient_accumulation_steps, or its train_batch_size / processes, else 32). A train_batch_size in the "
        "JSON that differs from what the flags give is an error.")
    add("--gradient_accumulation_steps", type=int, default=None, help="Micro-steps per optimizer step; they "
        "share --train_batch_size (default: the DeepSpeed JSON's, or what its train_batch_size gives, else 1).")
    add("--learning_rate", type=float, default=5e-5, help="Peak learning rate (AdamW, linear warm-up and decay).")
    add("--num_train_epochs", type=float, default=3.0, help="Epochs of training.")
    add("--max_steps", type=float, default=-1.0, help="Optimizer steps; > 0 overrides --num_train_epochs.")
    add("--warmup_proportion", type=float, default=0.1, help="Warm-up fraction of the steps.")
    add("--seed", type=int, default=42, help="Seed: the model (a fresh head) is built under it on every "
        "process, which then uses seed + its global rank.")
    add = groups["checkpoints"].add_argument
    add("--output_dir", required=True, help="Predictions, results and checkpoints go here.")
    add("--resume_from_checkpoint", action="store_true", help="Continue from <output_dir>/checkpoints.")
    add("--num_steps_per_checkpoint", type=int, default=0, help="Save every N steps (0: only at the end "
        "and on SIGTERM/SIGINT).")
    add("--skip_checkpoint", action="store_true", help="Do not save the fine-tuned weights.")
    add = groups["devices and distribution"].add_argument
    add("--use_hpu", action="store_true", help="Run on Habana Gaudi (habana_frameworks), backend hccl.")
    add("--no_cuda", action="store_true", help="Run on CPU (gloo) even if CUDA is available.")
    add("--local_rank", type=int, default=-1, help="Set by launchers; the LOCAL_RANK environment variable wins.")
    add = groups["logging"].add_argument
    add("--json-summary", dest="json_summary", default=None, help="dllogger JSON (rank 0) (default: "
        "<output_dir>/dllogger.json).")
    add("--log_freq", type=int, default=10, help="Log the loss every this many optimizer steps.")
    add("--disable-progress-bar", dest="disable_progress_bar", action="store_true", help="No tqdm bar.")
    groups["ignored"] = parser.add_argument_group("ignored", "Accepted for compatibility with NVIDIA's command "
                                                  "lines; these do nothing.")
    add = groups["ignored"].add_argument
    add("--bert_model", default=None, help="Ignored: the model is --init_checkpoint's (or --config_file's); "
        "NVIDIA's scripts use the name only for their feature cache (default: none).")
    add("--loss_scale", type=float, default=0.0, help="Ignored: NVIDIA's fp16 loss scale (--fp16 is refused).")
    groups["refused"] = parser.add_argument_group("refused", "NVIDIA's flags for a setting this training does "
                                                  "not have: one error line.")
    for flag in FP16_FLAGS:
        groups["refused"].add_argument(flag, action="store_true", help="Refused: apex fp16 mixed precision; for "
                                       "mixed precision set \"bf16\": {\"enabled\": true} in the --deepspeed_config "
                                       "JSON.")
    return parser, groups


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    device_setup.choose_accelerator(use_hpu="--use_hpu" in argv, no_cuda="--no_cuda" in argv)
    import deepspeed
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.json_summary is None:
        args.json_summary = str(Path(args.output_dir) / "dllogger.json")
    return args


# ============================================================================ configuration

@dataclass(frozen=True, kw_only=True)
class Config:
    """The common fine-tuning flags, typed and checked by build_config, and the DeepSpeed settings. An entry
    point subclasses it (a frozen, keyword-only dataclass) with its own flags' fields, of the flags' names."""
    do_train: bool
    do_eval: bool
    do_predict: bool
    vocab_file: str
    do_lower_case: bool
    init_checkpoint: str | None
    config_file: str | None
    torch_compile: tuple[str | None, str | None] | None  # (backend, mode) with --enable_torch_compile, else None
    learning_rate: float
    num_train_epochs: float
    max_steps: int                  # > 0: overrides num_train_epochs
    warmup_proportion: float
    seed: int                       # the samples' order in epoch e is a permutation seeded with seed + e
    output_dir: str                 # checkpoints in its CHECKPOINT_SUBDIR
    resume_from_checkpoint: bool
    num_steps_per_checkpoint: int   # 0: only at the end and on SIGTERM/SIGINT
    skip_checkpoint: bool
    use_hpu: bool
    no_cuda: bool
    local_rank: int
    json_summary: str
    log_freq: int
    disable_progress_bar: bool
    ds_config: dict[str, Any] | None  # the DeepSpeed settings (deepspeed_settings); None without --do_train

    def flags(self) -> dict[str, Any]:
        """The flags' values, as the logged "Config" record shows them (the DeepSpeed settings are logged apart)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "ds_config"}


def build_config(args: argparse.Namespace, config_class: type[Settings]) -> Settings:
    """The common checks, before any work, and the entry point's Config (config_class) of the flags."""
    for flag in FP16_FLAGS:
        if getattr(args, flag[2:]):
            raise InputError(f"{flag} (NVIDIA's apex fp16) is not supported: for mixed precision set "
                             f"\"bf16\": {{\"enabled\": true}} in the --deepspeed_config JSON")
    if not (args.do_train or args.do_eval or args.do_predict):
        raise InputError("nothing to do: pass --do_train, --do_eval and/or --do_predict")
    compile_mode.check_compile_flags(args.enable_torch_compile, args.torch_compile_backend, args.torch_compile_mode,
                                     args.use_hpu)
    if args.init_checkpoint is None and args.config_file is None:
        raise InputError("pass --init_checkpoint (pretrained weights) and/or --config_file")
    if args.init_checkpoint is None and not args.do_train:
        raise InputError("evaluation without --do_train needs --init_checkpoint (fine-tuned weights)")
    for name in ("learning_rate", "num_train_epochs", "log_freq"):
        if not getattr(args, name) > 0:
            raise InputError(f"--{name} must be positive, got {getattr(args, name)}")
    if args.max_steps > 0 and not float(args.max_steps).is_integer():  # NVIDIA's parser reads a float
        raise InputError(f"--max_steps must be a whole number of steps, got {args.max_steps}")
    if not 0 <= args.warmup_proportion < 1:
        raise InputError(f"--warmup_proportion must be in [0, 1), got {args.warmup_proportion}")
    if args.seed < 0 or args.num_steps_per_checkpoint < 0:
        raise InputError("--seed and --num_steps_per_checkpoint must be 0 or more")
    checkpoints = checkpoint_dir(args.output_dir)
    if args.do_train and not args.resume_from_checkpoint and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise InputError(f"{checkpoints} holds checkpoints: pass --resume_from_checkpoint or use a new --output_dir")
    ds_config = None
    if args.do_train:
        ds_config = deepspeed_settings(args.deepspeed_config, args.train_batch_size, args.gradient_accumulation_steps,
                                       int(os.environ.get("WORLD_SIZE", "1")))
    return command_line.settings_from_flags(
        config_class, args, max_steps=int(args.max_steps), ds_config=ds_config,
        torch_compile=(args.torch_compile_backend, args.torch_compile_mode) if args.enable_torch_compile else None)


def deepspeed_settings(path: str | None, train_batch_size: int | None, gradient_accumulation_steps: int | None,
                       world_size: int) -> dict[str, Any]:
    """The DeepSpeed JSON at path (--deepspeed_config; optional: fp32 ZeRO-0 without it) with NVIDIA's batch flags
    filled in. As in NVIDIA's run_squad.py and run_glue.py, --train_batch_size is one process's batch per optimizer
    step: its micro-batch is train_batch_size / gradient_accumulation_steps (NVIDIA floors the division; here it
    must be exact). None: the flag was not given. The flags fix what they name; what they leave open comes from
    the JSON as DeepSpeed reads it (train_batch_size = micro-batch x accumulation steps x processes), else from
    NVIDIA's defaults; a JSON batch key that disagrees with the result is an InputError, never overridden."""
    where = path or "the DeepSpeed settings"
    config = deepspeed_config.read(path) if path else {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = config.get(key)
        if key in config and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise InputError(f"{key} in {where} must be a positive integer, got {value!r}")
    json_total, json_micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    batch = train_batch_size
    if batch is not None and batch < 1:
        raise InputError(f"--train_batch_size must be at least 1, got {batch}")
    accumulation = gradient_accumulation_steps
    if accumulation is not None:
        if accumulation < 1:
            raise InputError(f"--gradient_accumulation_steps must be at least 1, got {accumulation}")
        if config.get("gradient_accumulation_steps", accumulation) != accumulation:
            raise InputError(f"--gradient_accumulation_steps {accumulation} contradicts gradient_accumulation_steps "
                             f"{config['gradient_accumulation_steps']} in {where}: set one of them")
        accumulation_source = "--gradient_accumulation_steps"
    elif "gradient_accumulation_steps" in config:
        accumulation = config["gradient_accumulation_steps"]
        accumulation_source = f"gradient_accumulation_steps in {where}"
    elif batch is not None and json_micro is not None:
        if batch % json_micro:
            raise InputError(f"--train_batch_size {batch} (sequences per process and optimizer step) is not a "
                             f"multiple of train_micro_batch_size_per_gpu {json_micro} in {where}")
        accumulation, accumulation_source = batch // json_micro, "--train_batch_size / train_micro_batch_size_per_gpu"
    elif json_total is not None and json_micro is not None:
        _, accumulation, _ = deepspeed_config.batch_arithmetic(config, world_size, where)  # DeepSpeed's reading
        accumulation_source = f"train_batch_size / train_micro_batch_size_per_gpu / processes in {where}"
    else:
        accumulation, accumulation_source = 1, "the default"
    config["gradient_accumulation_steps"] = accumulation
    if batch is None and json_micro is None:
        if json_total is None:
            batch = 32  # NVIDIA's default of --train_batch_size
        elif json_total % (accumulation * world_size):
            raise InputError(f"train_batch_size {json_total} in {where} is not a multiple of {accumulation} "
                             f"accumulation steps x {world_size} process(es)")
        else:
            config["train_micro_batch_size_per_gpu"] = json_total // (accumulation * world_size)  # DeepSpeed's reading
    if batch is not None:
        if batch % accumulation:
            raise InputError(f"--train_batch_size {batch} (sequences per process and optimizer step) is not a "
                             f"multiple of gradient_accumulation_steps {accumulation}")
        micro = batch // accumulation
        if config.get("train_micro_batch_size_per_gpu", micro) != micro:
            raise InputError(f"--train_batch_size {batch} = micro-batch {micro} x {accumulation} accumulation steps "
                             f"contradicts train_micro_batch_size_per_gpu {config['train_micro_batch_size_per_gpu']} "
                             f"in {where}: set one of them")
        config["train_micro_batch_size_per_gpu"] = micro
    flags_total = config["train_micro_batch_size_per_gpu"] * accumulation * world_size
    if json_total is not None and json_total != flags_total:
        # deepspeed_config.check would otherwise recompute the accumulation steps from the JSON's global batch.
        if train_batch_size is not None:
            per_process = f"--train_batch_size {train_batch_size}"
        else:
            per_process = (f"micro-batch {config['train_micro_batch_size_per_gpu']} (train_micro_batch_size_per_gpu "
                           f"in {where}) x {accumulation} accumulation step(s) ({accumulation_source})")
        raise InputError(f"train_batch_size {json_total} in {where} contradicts {per_process} x {world_size} "
                         f"process(es) = {flags_total} sequences per optimizer step: make them agree, or leave "
                         f"train_batch_size out of {where}")
    config["train_batch_size"] = flags_total
    config.setdefault("gradient_clipping", 1.0)  # as NVIDIA's BertAdam (max_grad_norm 1.0)
    config.setdefault("steps_per_print", 10 ** 9)  # the loop logs
    # torch.optim.AdamW is an optimizer that ZeRO supports: no zero_allow_untested_optimizer needed.
    return deepspeed_config.check(config, world_size, where)
