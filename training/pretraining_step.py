"""One optimizer step of pretraining across the ranks: the micro-batches' forward and backward, one all-reduce on
which the ranks agree to skip a non-finite step or stop, the update; and the ranks' agreement on the shards
that --skip_bad_shards dropped."""

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from data.dataset import MicroBatch, RankBatches
from training.deepspeed_engine import optimizer_step_suppressed
from training.pretraining_run import RunObjects, RunSettings
from training.pretraining_state import TrainState


@dataclass
class StepResult:
    learning_rate: float     # the LR this step applied (group 0)
    local_loss: float        # this rank's mean loss over the step's micro-batches
    mean_loss: float         # local_loss averaged over ranks
    last_micro_loss: float
    finite: bool             # every rank's loss was finite and DeepSpeed did not skip the step
    stop_requested: bool     # some rank received SIGTERM/SIGINT
    skipped_shards: tuple[str, ...]  # shards this rank has dropped by --skip_bad_shards so far
    shards_newly_skipped: bool  # some rank dropped a shard in this step: the ranks must agree on the list
    next_position: int       # stream position after this step's last global micro-batch


def train_step(run: RunObjects, settings: RunSettings, batches: Iterator[MicroBatch], stop_event: threading.Event,
               profiler: torch.profiler.profile | None, agreed_skipped_shards: Sequence[str] = ()) -> StepResult:
    """GAS micro-batches: forward, backward, engine.step() (on an HPU in lazy mode with the reference's
    mark_steps, run.graph_breaks); the ranks agree on skip/stop before the update. agreed_skipped_shards:
    the shards every rank had dropped before this step."""
    engine, gas = run.engine, settings.gas
    losses: list[torch.Tensor] = []
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
                       all_reduce: Callable[[torch.Tensor], object]) -> tuple[bool, bool, bool, float]:
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
    lists: list[Any] = [None] * settings.world  # every rank's list of skipped shards
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
