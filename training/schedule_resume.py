"""One answer, for pretraining and fine-tuning, to a resume whose LR schedule flags changed since the
checkpoint: the run follows the schedule of the new flags from the step reached on (docs/checkpoints.md,
"Resuming with other schedule flags"). This is how a run is extended: raise --max_steps and resume."""

from collections.abc import Callable
from typing import Any

from schedulers import WarmUpScheduler

# What makes up a schedule: the entries of a scheduler's state (schedulers.WarmUpScheduler.state_dict), with the
# flag that sets each. A scheduler without an entry (LinearWarmUp has no constant part or degree) skips it.
SCHEDULE_FLAGS = {"total_steps": "--max_steps", "warmup": "--warmup_proportion",
                  "constant": "--constant_proportion", "degree": "--scheduler_degree", "base_lrs": "--learning_rate"}


def follow_changed_schedule(scheduler: WarmUpScheduler, wanted: dict[str, Any], say: Callable[[str], None],
                            flags: dict[str, str] = SCHEDULE_FLAGS) -> None:
    """scheduler: restored from the checkpoint; wanted: the state_dict of the scheduler this run's flags built.
    When they differ, the schedule of the new flags from the step reached on, said: the restored scheduler
    would follow the old flags, and past the old --max_steps its LR is 0, so a longer run would train at LR 0.
    The LR curve bends (or jumps) there. flags: the text naming each entry's flag (SCHEDULE_FLAGS, where an
    entry point sets one otherwise)."""
    saved = scheduler.state_dict()

    def shown(state: dict[str, Any], key: str) -> Any:
        return state[key][0] if key == "base_lrs" else state[key]

    changes = [f"{flags[key]} {shown(saved, key)} -> {shown(wanted, key)}"
               for key in SCHEDULE_FLAGS if key in saved and saved[key] != wanted[key]]
    if not changes:
        return
    old_lr = scheduler.get_lr()[0]
    scheduler.load_state_dict({**wanted, "last_step": saved["last_step"]})
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_lr(), strict=True):
        group["lr"] = lr
    say(f"the LR schedule changed since the checkpoint ({', '.join(changes)}): from step {saved['last_step']} on, "
        f"the LR follows the new flags ({old_lr:.4g} -> {scheduler.get_lr()[0]:.4g} at that step); the LR curve "
        f"bends there")
