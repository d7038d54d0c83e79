"""The held-out evaluation (--eval_dir) in a pretraining run: this rank's share of the held-out samples, read and
checked before the first step, and the evaluation at a step or alone (--skip_train), reported in the log, the
DeepSpeed monitors and one line. training/evaluation.py computes the figures."""

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from common.errors import InputErrorOnEveryRank
from data.dataset import WindowReader, fixed_chunks, window_size_for_budget
from data.shard_format import ShardError
from training import evaluation
from training.pretraining_config import Config
from training.pretraining_inputs import DataInfo
from training.pretraining_log import log_summary_without_steps
from training.pretraining_run import RunObjects, RunSettings
from training.pretraining_state import TrainState

if TYPE_CHECKING:  # deepspeed is imported only after device_setup.choose_accelerator has picked the device
    from deepspeed import DeepSpeedEngine


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


def evaluate_and_log(run: RunObjects, held_out: evaluation.HeldOutSet, settings: RunSettings,
                     state: TrainState) -> tuple[dict[str, float], float]:
    """Collective: the held-out figures of the model after step state.global_step, in a dllogger record at that
    step (with eval_time, its seconds) and the DeepSpeed monitors; returns (figures, seconds)."""
    started = run.clock()
    figures = evaluation.evaluate(run.engine.module, held_out, run.device, run.all_gather_object, settings.world,
                                  after_batch=run.graph_breaks.after_step)
    seconds = run.clock() - started
    report_evaluation(run.engine, run.say, state.global_step, figures, seconds)
    run.logger.log(step=(state.samples_consumed // settings.epoch_size, state.global_step),
                   data={**figures, "eval_time": seconds})
    run.logger.flush()
    return figures, seconds


def evaluate_only(run: RunObjects, held_out: evaluation.HeldOutSet, state: TrainState,
                  started: float) -> dict[str, Any]:
    """--skip_train: the held-out figures of the model as loaded, in the final record; no step, no checkpoint."""
    eval_started = run.clock()
    figures = evaluation.evaluate(run.engine.module, held_out, run.device, run.all_gather_object,
                                  dist.get_world_size(), after_batch=run.graph_breaks.after_step)
    seconds = run.clock() - eval_started
    report_evaluation(run.engine, run.say, state.global_step, figures, seconds)
    return log_summary_without_steps(state, run.logger, run.clock() - started, **figures, eval_time=seconds)


def report_evaluation(engine: "DeepSpeedEngine", say: Callable[[str], None], global_step: int,
                      figures: dict[str, float], seconds: float) -> None:
    if engine.monitor.enabled:  # TensorBoard / CSV / W&B, as the DeepSpeed JSON asks
        engine.monitor.write_events([(f"Eval/{key}", value, global_step) for key, value in figures.items()])
    say(f"step {global_step}: held-out MLM loss {figures['eval_mlm_loss']:.4f}, MLM accuracy "
        f"{figures['eval_mlm_accuracy']:.4f}, NSP accuracy {figures['eval_nsp_accuracy']:.4f} ({seconds:.1f} s)")
