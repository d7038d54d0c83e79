#!/usr/bin/env python
"""BERT pretraining on DeepSpeed (ZeRO 0/1/2, fp32 or bf16) on HPU, CUDA or CPU.

Launch through the DeepSpeed launcher (scripts/run_bert_*.sh), e.g. for 2 CPU ranks:

    deepspeed --num_gpus 2 --no_local_rank run_pretraining.py --config_file scripts/bert_tiny_config.json \
        --input_dir DATA --output_dir OUT --optimizer lans --use_lr_scheduler --deepspeed \
        --deepspeed_config scripts/deepspeed_config_bert_tiny_cpu.json

or as one process with `python run_pretraining.py ...`. Flags follow the Habana reference (same names and
defaults); docs/differences.md lists where the behaviour differs. `main(argv)` returns the run summary as a dict,
so tests drive the real program in-process.

Stages of a run: parse the flags (build_parser) into one frozen Config (training/pretraining_config.py) and check
the files it names (training/pretraining_inputs.py): one clear error before any step -> device, backend and
DeepSpeed's CPU traps -> the checkpoint to resume from, checked before anything is built
(training/pretraining_state.py) -> model, optimizer, scheduler, engine (build_model, build_engine) -> resume /
init / phase 2 -> the training loop (`train`: one step is training/pretraining_step.py, the log
training/pretraining_log.py, the held-out evaluation training/held_out.py) -> final checkpoint and summary.
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
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from common import storage
from common.errors import InputError, InputErrorOnEveryRank
from data.dataset import RankBatches, WindowReader, window_size_for_budget
from data.shard_format import ShardError
from lans import AdaptiveMomentOptimizer
from modeling import BertConfig, BertForPreTraining, BertPretrainingCriterion
from optimization import OPTIMIZERS, build_optimizer, get_parameter_groups
from schedulers import PolyWarmUpScheduler
from training import (
    checkpoint_s3,
    checkpointing,
    command_line,
    compile_mode,
    deepspeed_engine,
    device_setup,
    distributed,
    gaudi,
    hardware,
    init_weights,
    logs,
    profiling,
    progress_display,
    rank_costs,
    run_status,
    sizing,
    zero_partitions,
)
from training.held_out import evaluate_and_log, evaluate_only, read_held_out
from training.pretraining_config import Config, build_config
from training.pretraining_inputs import DataInfo, check_memory, check_same_shards_on_every_rank, open_inputs
from training.pretraining_log import LogWindow, log_parameters, log_summary, log_summary_without_steps, log_window
from training.pretraining_run import RunObjects, RunSettings
from training.pretraining_state import (
    TrainState,
    checkpoint_tag,
    choose_checkpoint,
    describe_data_layout,
    restore_state,
    save,
    steps_of_both_phases,
)
from training.pretraining_step import agree_on_skipped_shards, train_step

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


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    argv = sys.argv[1:] if argv is None else list(argv)
    device_setup.choose_accelerator(use_hpu="--use_hpu" in argv, no_cuda="--no_cuda" in argv)
    import deepspeed
    parser = build_parser()
    deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


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


def build_engine(model: BertForPreTraining, ds_config: dict[str, Any], *, optimizer_name: str | None,
                 learning_rate: float, betas: Sequence[float] | None, lr_schedule: dict[str, Any] | None,
                 lans_blocks: str, torch_compile: tuple[str | None, str | None] | None
                 ) -> tuple["DeepSpeedEngine", torch.optim.Optimizer]:
    """The client optimizer (--optimizer; None: the DeepSpeed JSON's) and LR schedule, then
    deepspeed_engine.initialize_engine. lr_schedule: PolyWarmUpScheduler's keyword arguments (--use_lr_scheduler), or
    None. lans_blocks: --lans_blocks. torch_compile: (backend, mode) with --enable_torch_compile, else None.
    With inductor, compile mode compiles LANS's update too (lans.LANS, compile_update)."""
    groups = get_parameter_groups(model)
    optimizer: torch.optim.Optimizer | None = None
    scheduler: PolyWarmUpScheduler | None = None
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
        # the client LANS is the optimizer that steps
        zero_partitions.use_tensor_blocks(engine.optimizer, cast(AdaptiveMomentOptimizer, optimizer))
    if torch_compile is not None:
        compile_mode.compile_model(engine, backend, torch_compile[1])
    return engine, optimizer


# ============================================================================ the loop

def train(run: RunObjects, settings: RunSettings, state: TrainState, batches: RankBatches, stop_event: threading.Event,
          profiler: torch.profiler.profile | None) -> dict[str, Any]:
    """Optimizer steps until max_steps / steps_this_run / a stop request; returns the final record."""
    say, every, clock, config = run.say, settings.checkpoint_every, run.clock, settings.config
    progress = progress_display.progress_bar(settings.progress_bar, config.max_steps, state.global_step, "steps",
                                             config.log_freq)
    window, last_window, steps_done = LogWindow(clock()), LogWindow(clock()), 0
    last_saved: str | None = None
    eval_time = 0.0  # seconds of the evaluations between steps
    held_out_figures: dict[str, float] = {}
    evaluated_at: int | None = None
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
            held_out_figures, seconds = evaluate_and_log(run, run.held_out, settings, state)
            eval_time, evaluated_at = eval_time + seconds, state.global_step
            window.started += seconds  # the logged step times and speeds leave the evaluation out
            last_window.started += seconds
        # As NVIDIA's driver: at multiples of the interval, so that a resumed run saves the checkpoints the
        # uninterrupted run saves.
        if every is not None and steps_of_both_phases(state, config.phase1_end_step) % every == 0:
            last_saved = save(run, settings, state, window.losses())
        # ---------------------------------------------------------------- stop early
        if state.bad_steps_in_a_row >= config.max_bad_steps:
            if every is not None and last_saved != checkpoint_tag(state, config.phase1_end_step):
                save(run, settings, state, window.losses())
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
        held_out_figures, final_eval_time = evaluate_and_log(run, run.held_out, settings, state)
    if every is not None and steps_done and last_saved != checkpoint_tag(state, config.phase1_end_step):
        save(run, settings, state, window.losses())
    return {**final, "ended": ended, "steps_done": steps_done, "eval_time_between_steps": eval_time,
            "eval_time": eval_time + final_eval_time, "held_out": held_out_figures,
            "stopped_by_signal": bool(steps_done and result.stop_requested)}


# ============================================================================ main

GraphBreaksFactory = Callable[[torch.device, torch.nn.Module, bool], gaudi.NoGraphBreaks]  # as gaudi.graph_breaks


def main(argv: Sequence[str] | None = None, *, clock: Callable[[], float] = time.perf_counter,
         criterion: BertPretrainingCriterion | None = None,
         make_graph_breaks: GraphBreaksFactory = gaudi.graph_breaks,
         device_memory: Callable[[torch.device], tuple[float | None, str]] = hardware.device_memory_bytes,
         status_file: run_status.StatusFile | None = None, job: distributed.Job | None = None) -> dict[str, Any]:
    """Run the training; returns the summary (the reference's final dllogger record) on every rank.
    clock (seconds), criterion (default: BertPretrainingCriterion()), make_graph_breaks (device, model,
    is 5B) and device_memory (device -> (bytes, description)) are there for tests: a fake clock, a loss that
    turns NaN on chosen steps, HPU lazy-mode graph breaks on the CPU, a device smaller than the run.
    status_file: the one cli's run_cli reports the end to (default: a new one). job: run_cli's (default: a new one,
    for a caller without run_cli)."""
    started, costs = clock(), rank_costs.RankCosts.from_start()
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
            return train_run(config, data, held_out_data, copies, stop_event, status_file, job, started, costs,
                             clock=clock,
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
              status_file: run_status.StatusFile, job: distributed.Job, started: float, costs: rank_costs.RankCosts,
              *, clock: Callable[[], float], criterion: BertPretrainingCriterion, make_graph_breaks: GraphBreaksFactory,
              device_memory: Callable[[torch.device], tuple[float | None, str]]) -> dict[str, Any]:
    """main after the checks without a device: the device and the checks that need it, the checkpoint to
    resume from, then model, log and engine, and run_training."""
    device = distributed.setup_device_and_distributed(job, config.use_hpu, config.no_cuda, config.local_rank,
                                                      config.collective_timeout_s, stop_event, config.ds_config)
    costs.mark("rendezvous_done")
    rank = dist.get_rank()
    check_same_shards_on_every_rank(data, config.input_dir, job.hosts)
    held_out = read_held_out(held_out_data, config, rank, dist.get_world_size()) if held_out_data else None
    device_setup.seed_everything(config.seed + rank)

    def say(text: str) -> None:  # rank 0's lines; the other ranks say nothing
        if rank == 0:
            print(f"[run_pretraining] {text}", flush=True)

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
                     status_file=status_file, held_out=held_out, costs=costs)
    # Every normal way out from here (the end, nothing to train, a stop during start-up) frees the engine:
    # DeepSpeed's gradient hooks would otherwise keep it, the model and the optimizer states alive after main.
    with deepspeed_engine.destroyed_on_exit(engine):
        return run_training(run, config, data, data_layout, resume_tag, peak, stop_event, started)


def run_training(run: RunObjects, config: Config, data: DataInfo, data_layout: dict[str, Any], resume_tag: str | None,
                 peak_tflops: float, stop_event: threading.Event, started: float) -> dict[str, Any]:
    """Resume (or start), the loop, the last checkpoint's copy and the summary: logged, and returned."""
    state = restore_state(run, config, resume_tag)
    run.costs.mark("engine_ready")
    run.status_file.saved(resume_tag)
    if config.skip_train:
        assert run.held_out is not None  # build_config: --skip_train needs --eval_dir
        return evaluate_only(run, run.held_out, state, started)
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


def nothing_to_train(tag: str, max_steps: int, state: TrainState, logger: "dllogger.Logger",
                     say: Callable[[str], None], elapsed: float) -> dict[str, Any]:
    say(f"checkpoint {tag} is already at --max_steps {max_steps}: nothing to train")
    return log_summary_without_steps(state, logger, elapsed, stopped_by_signal=False, nothing_to_train=True)


def stop_requested_on_any_rank(stop_event: threading.Event, device: torch.device) -> bool:
    """Collective: whether any rank was asked to stop (the ranks may get a forwarded signal at different times)."""
    flag = torch.tensor([float(stop_event.is_set())], device=device)
    dist.all_reduce(flag)
    return flag.item() > 0


def stopped_before_training(state: TrainState, logger: "dllogger.Logger", say: Callable[[str], None],
                            elapsed: float) -> dict[str, Any]:
    say(f"stop requested (SIGTERM/SIGINT) during start-up: stopping before the first step, at step "
        f"{state.global_step}")
    return log_summary_without_steps(state, logger, elapsed, stopped_by_signal=True)


def cli(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: one clear error line instead of a traceback, and an exit status and status file for
    the supervisor (training/run_status.py). Bad input and a deliberate stop are final (NO_RESTART, the line
    says [no restart]): a restart would meet them again."""
    status_file = run_status.StatusFile()
    return command_line.run_cli(functools.partial(main, status_file=status_file), argv,
                                (ShardError, checkpointing.CheckpointError, TrainingStopped, storage.StorageError),
                                final=(InputError, TrainingStopped), report=status_file.ended)


if __name__ == "__main__":
    sys.exit(cli())
