"""The pretraining loop's state and its checkpoints: TrainState (what a checkpoint saves of the loop), the
checkpoint a resume takes (chosen and checked before the model is built), the restore (phase 2 included) and the
save."""

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from common.errors import InputError
from data.dataset import ShardInfo
from schedulers import PolyWarmUpScheduler
from training import checkpoint_resume, checkpoint_s3, checkpointing, device_setup
from training.pretraining_config import Config
from training.pretraining_inputs import shard_listing
from training.pretraining_run import RunObjects, RunSettings
from training.schedule_resume import follow_changed_schedule

if TYPE_CHECKING:  # deepspeed is imported only after device_setup.choose_accelerator has picked the device
    from deepspeed import DeepSpeedEngine


@dataclass
class TrainState:
    """Everything the loop needs to continue; saved in every checkpoint's client_state."""
    global_step: int = 0            # optimizer steps in this phase
    samples_consumed: int = 0       # stream position of the next global micro-batch (data/dataset.py)
    phase: int = 1
    skipped_shards: list[str] = field(default_factory=list)  # names
    bad_steps: int = 0              # steps skipped for a non-finite loss, in total
    bad_steps_in_a_row: int = 0     # the current streak of those: a resume continues it (--max_bad_steps)
    # This rank's losses in the log window open at the save ({"local_losses", "all_rank_losses"}), kept in its
    # rank state (they differ between ranks): the first record after a resume averages the steps the
    # uninterrupted run's does. Empty for a fresh run, a resume on another world size or an older checkpoint.
    open_window: dict[str, list[float]] = field(default_factory=dict)


def steps_of_both_phases(state: TrainState, phase1_end_step: int) -> int:
    """The global step counted from phase 1's start: phase 2's steps continue after phase 1's."""
    return state.global_step + (phase1_end_step if state.phase == 2 else 0)


def checkpoint_tag(state: TrainState, phase1_end_step: int) -> str:
    # Phase-2 tags continue after phase 1's, so both phases can share one output directory.
    return str(steps_of_both_phases(state, phase1_end_step))


def describe_data_layout(shards: list[ShardInfo], window_size: int, seed: int, shuffle: bool) -> dict[str, Any]:
    """What the stream position indexes into (data/dataset.py): a resume must see the same layout, or the
    saved position would point at other samples (repeats and gaps in the epoch)."""
    return {"seed": seed, "window_size": window_size, "shuffle": shuffle, "shards": shard_listing(shards)}


LAYOUT_FLAGS = {"seed": "--seed", "window_size": "--data_memory_budget_mb", "shuffle": "--disable_random_sampler",
                "shards": "the training shards of --input_dir (names and sizes)"}


def check_data_layout(saved: dict[str, Any], current: dict[str, Any], tag: str) -> None:
    for key, flag in LAYOUT_FLAGS.items():
        if saved[key] != current[key]:
            raise InputError(f"checkpoint {tag} was saved with another data layout: {key} {saved[key]!r} then, "
                             f"{current[key]!r} now (set by {flag}); resume with the same data and settings")


def choose_checkpoint(config: Config, checkpoint_dir: Path, copies: checkpoint_s3.CheckpointUploader | None,
                      device: torch.device, data_layout: dict[str, Any], say: Callable[[str], None]) -> str | None:
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


def restore_state(run: RunObjects, config: Config, tag: str | None) -> TrainState:
    """Resume from checkpoint `tag` (choose_checkpoint's, which has checked it) in run.checkpoint_dir
    (--output_dir, or the staging copy of an s3:// one); a fresh state when tag is None. --phase2 with a phase-1
    checkpoint starts phase 2 from it; a resume on another world size re-seeds the ranks."""
    fresh = TrainState(phase=2 if config.phase2 else 1)
    if tag is None:
        return fresh
    engine, world, rank = run.engine, dist.get_world_size(), dist.get_rank()
    fresh_schedule = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    with run.costs.checkpoint_io("load"):
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
    if (isinstance(engine.lr_scheduler, PolyWarmUpScheduler) and fresh_schedule is not None
            and not (config.phase2 and client["phase"] == 1)):
        follow_changed_schedule(engine.lr_scheduler, fresh_schedule, run.say)
    return state


def start_phase2(engine: "DeepSpeedEngine", optimizer: torch.optim.Optimizer,
                 fresh_schedule: dict[str, Any] | None) -> None:
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


def save(run: RunObjects, settings: RunSettings, state: TrainState, open_window: dict[str, list[float]]) -> str:
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
    rank_state = {"rng": checkpointing.capture_rng_state(run.device), "log_window": open_window}
    with run.costs.checkpoint_io("save"):
        checkpointing.save_checkpoint(run.engine, run.checkpoint_dir, tag, client_state, rank_state)
    if config.keep_last_n_checkpoints > 0 and dist.get_rank() == 0:
        checkpointing.prune_checkpoints(run.checkpoint_dir, config.keep_last_n_checkpoints)
    if run.copies is not None:
        run.copies.start(tag)
    run.say(f"saved checkpoint {tag}")
    run.status_file.saved(tag)
    return tag
