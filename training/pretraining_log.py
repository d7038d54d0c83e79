"""What a pretraining run logs (dllogger): the PARAMETER records, one record per log window computed as the
reference computes it, and the final summary, with or without steps."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from training.pretraining_config import Config
from training.pretraining_run import RunObjects, RunSettings
from training.pretraining_state import TrainState
from training.pretraining_step import StepResult

if TYPE_CHECKING:
    import dllogger


@dataclass
class LogWindow:
    """Loss and time accumulated since the last log record (the reference's average_loss etc.).

    Skipped (non-finite) steps count for the time but not for the losses: their loss is meaningless."""
    started: float               # RunObjects.clock() at the window's start
    steps: int = 0
    local_losses: list[float] = field(default_factory=list)     # this rank's mean loss per finite optimizer step
    all_rank_losses: list[float] = field(default_factory=list)  # the same averaged over ranks
    last_micro_loss: float = float("nan")
    learning_rate: float = float("nan")

    def record(self, result: StepResult) -> None:
        self.steps += 1
        if result.finite:
            self.local_losses.append(result.local_loss)
            self.all_rank_losses.append(result.mean_loss)
        self.last_micro_loss, self.learning_rate = result.last_micro_loss, result.learning_rate

    def losses(self) -> dict[str, list[float]]:
        """The window's losses as a checkpoint keeps them (TrainState.open_window after a resume)."""
        return {"local_losses": list(self.local_losses), "all_rank_losses": list(self.all_rank_losses)}


def log_window(run: RunObjects, settings: RunSettings, state: TrainState, window: LogWindow,
               final: bool = False) -> dict[str, Any]:
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


def mean_or_nan(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def log_parameters(logger: "dllogger.Logger", config: Config, peak_tflops: float, peak_source: str) -> None:
    """The reference's PARAMETER record ("Config": the flags, as text; the flags that do nothing left out),
    and the MFU's denominator."""
    logger.log(step="PARAMETER", data={"Config": str(config.flags()), "SEED": config.seed, "train_start": True,
                                       "batch_size_per_pu": config.ds_config["train_micro_batch_size_per_gpu"],
                                       "learning_rate": config.learning_rate, "deepspeed_config": config.ds_config})
    logger.log(step="PARAMETER", data={"peak_tflops": peak_tflops, "peak_tflops_source": peak_source})


def log_summary(run: RunObjects, settings: RunSettings, final: dict[str, Any], steps_done: int, state: TrainState,
                train_started: float, started: float) -> dict[str, Any]:
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
    run.costs.log_gathered(run.logger, run.all_gather_object, settings.world)
    run.logger.log(step=(), data=summary)
    run.logger.flush()
    return summary


def log_summary_without_steps(state: TrainState, logger: "dllogger.Logger", elapsed: float,
                              **flags: Any) -> dict[str, Any]:
    """The final record of a run that made no step (no loss, no speed), with `flags` added; returned."""
    summary = {"e2e_train_time": elapsed, "global_step": state.global_step, "skipped_steps": state.bad_steps,
               "skipped_shards": len(state.skipped_shards), **flags}
    logger.log(step=(), data=summary)
    logger.flush()
    return summary
