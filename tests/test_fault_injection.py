"""Fault injection: SIGKILL training at 20 random moments and resume each time until the target step.

The moments are drawn from a seeded RNG (FAULT_SEED overrides): mid step (before a backward), right
after an optimizer step, inside a checkpoint save (a torn torch.save file, or before one of the
renames that commit the rank file, the manifest or `latest`), or from the outside at a moment tied to
the run's progress (start-up included). After every kill, `latest` must name a complete checkpoint (or
be absent), and the run is resumed with --resume_from_checkpoint. At the end, every step's loss (a step
re-done after a kill included) and every tensor of the final checkpoint must equal those of one
uninterrupted run. Every kill falls within the next few steps of its run, counted in events and output
lines rather than seconds, so all 20 land whatever the machine's speed. The figures are printed:

    python -m pytest tests/test_fault_injection.py -m slow -s
"""

import os
import random
import signal
import threading
import time
import warnings

import pytest
import torch

import helpers
import run_pretraining
from test_resume import (
    HOLD_LINE,
    SHARD_SIZES,
    STEP_LOSS,
    checkpoint_differences,
    driver_args,
    ds_config,
    finish,
    is_status_file,
    output_until,
    start,
    step_losses,
)
from training import checkpointing

KILLS = 20
TARGET_STEPS = 48          # 192 samples: the runs cross two epoch boundaries (81 samples each)
EVERY = 2                  # --num_steps_per_checkpoint
KINDS = ("backward", "step", "torch_save", "replace", "outside")
KIND_WEIGHTS = (3, 2, 2, 2, 2)


def calls_per_save(tmp_path, data, config, monkeypatch) -> dict:
    """{"torch_save": n, "replace": n}: the calls one checkpoint save makes, counted on an in-process probe
    run with the test's own configuration (so the draws reach every write and rename of a save, the
    commit's last ones included, whatever the ZeRO stage). The kills count these calls from the start
    of the process, so none may happen outside a save."""
    counts, inside = {"torch_save": 0, "replace": 0, "saves": 0, "outside": 0}, [False]

    def counting(function, kind):
        def wrapper(*args, **kwargs):
            if not (kind == "replace" and is_status_file(args[1])):  # as the kill wrapper counts renames
                counts[kind if inside[0] else "outside"] += 1
            return function(*args, **kwargs)
        return wrapper

    def counted_save(*args, **kwargs):
        inside[0] = True
        counts["saves"] += 1
        try:
            return real_save_checkpoint(*args, **kwargs)
        finally:
            inside[0] = False

    real_save_checkpoint = checkpointing.save_checkpoint
    monkeypatch.setattr(torch, "save", counting(torch.save, "torch_save"))
    monkeypatch.setattr(os, "replace", counting(os.replace, "replace"))
    monkeypatch.setattr(checkpointing, "save_checkpoint", counted_save)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    run_pretraining.main(driver_args(data, tmp_path / "probe", config, tmp_path / "probe.json", 2 * EVERY,
                                     num_steps_per_checkpoint=EVERY))
    monkeypatch.undo()
    assert counts["saves"] == 2 and counts["outside"] == 0, counts
    assert counts["torch_save"] % 2 == 0 and counts["replace"] % 2 == 0, counts
    return {"torch_save": counts["torch_save"] // 2, "replace": counts["replace"] // 2}


def draw_kill(rng: random.Random, remaining_steps: int, per_save: dict, startup_lines: int) -> tuple[str, tuple]:
    """(kind, where), within the run's next few steps, so that every kill lands before the run could end.
    In-process kinds: where = (n,), die at the n-th event of that kind. "outside": where = (line, fraction,
    hold): SIGKILL from here after the run's line-th line of output (0: its start), plus that fraction
    of the gap before that line; the run holds before its hold-th backward (see run_once).
    per_save: calls_per_save; startup_lines: lines a run prints before its first step."""
    kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
    steps_ahead = min(remaining_steps, 2 * EVERY + 1)
    saves_ahead = max(1, steps_ahead // EVERY)
    if kind in ("backward", "step"):  # one of each per step (no accumulation)
        return kind, (rng.randint(1, steps_ahead),)
    if kind in per_save:
        return kind, (rng.randint(1, per_save[kind] * saves_ahead),)
    return kind, (rng.randint(0, startup_lines + steps_ahead), round(rng.random(), 2), steps_ahead)


def run_once(argv, kill, time_to_first_line):
    """One resumed run; returns (status, output, held). In-process kills come from FAULT_KILL. An
    "outside" kill is SIGKILL to the whole process group from here, at a moment set by the run's own
    progress: its line-th line of output, then a fraction of the gap between that line and the one
    before (line 0 is the start, and its gap the reference run's time to its first line). The run holds
    (sleeps) before the backward that ends the kill's window, so a kill that the run's progress outran
    lands there (held = True) instead of never."""
    kind, where = kill if kill else (None, None)
    if kind != "outside":
        process = start(argv, 1, kill=f"{kind}:{where[0]}" if kind else None)
        return (*finish(process), False)
    line, fraction, hold = where
    process = start(argv, 1, kill=f"hold:{hold}")
    lines, times, ended, changed = [], [time.monotonic()], [False], threading.Condition()

    def read():
        for text in process.stdout:
            with changed:
                lines.append(text)
                times.append(time.monotonic())
                changed.notify_all()
        with changed:
            ended[0] = True
            changed.notify_all()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def held():
        return bool(lines) and HOLD_LINE in lines[-1]  # after any partial line of another thread

    try:
        with changed:
            assert changed.wait_for(lambda: len(lines) >= line or held() or ended[0], timeout=300), "no output"
            if len(lines) >= line and not held():
                gap = times[line] - times[line - 1] if line else time_to_first_line
                changed.wait_for(lambda: held() or ended[0], timeout=fraction * gap)
            was_held = held()
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:  # it ended by itself: the caller reports the kill as not delivered
            pass
    reader.join(timeout=60)
    return process.wait(timeout=60), "".join(lines), was_held


def latest_is_complete(out) -> bool:
    """`latest` absent (no save ever finished), or naming a checkpoint that resume takes as is
    (no fallback warning, no error)."""
    if not (out / "latest").exists():
        return True
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkpointing.CheckpointWarning)
        try:
            return checkpointing.find_resume_tag(out) == (out / "latest").read_text()
        except (checkpointing.CheckpointError, checkpointing.CheckpointWarning):
            return False


def latest_step(out) -> int:
    return int((out / "latest").read_text()) if (out / "latest").exists() else 0


@pytest.mark.slow
def test_twenty_random_kills_then_same_result(tmp_path, monkeypatch):
    rng = random.Random(int(os.environ.get("FAULT_SEED", "20261122")))
    data = tmp_path / "data"
    helpers.write_synthetic_shards(data, SHARD_SIZES)
    config = ds_config(tmp_path, stage=1, bf16=True, world=1)
    per_save = calls_per_save(tmp_path, data, config, monkeypatch)
    started = time.monotonic()
    process = start(driver_args(data, tmp_path / "ref", config, tmp_path / "ref.json", TARGET_STEPS), 1)
    # its first line (with whatever came in the same read), or its stacks if it hangs before
    first_output = output_until(process, lambda text: "\n" in text)
    time_to_first_line = time.monotonic() - started
    status, reference = finish(process)
    reference = first_output + reference
    assert status == 0, reference[-3000:]
    startup_lines = next(i for i, line in enumerate(reference.splitlines()) if STEP_LOSS.search(line))

    out, outputs, kills, holds, resumes, broken_latest, history = tmp_path / "out", [], 0, 0, 0, 0, []
    while latest_step(out) < TARGET_STEPS:
        assert len(outputs) < 4 * KILLS, f"no progress: {history}"
        kill = draw_kill(rng, TARGET_STEPS - latest_step(out), per_save, startup_lines) if kills < KILLS else None
        status, output, held = run_once(driver_args(data, out, config, tmp_path / f"run{len(outputs)}.json",
                                                    TARGET_STEPS, num_steps_per_checkpoint=EVERY),
                                        kill, time_to_first_line)
        outputs.append(output)
        resumes += "resumed from checkpoint" in output
        holds += held
        history.append((kill, status, latest_step(out)))
        if kill:
            assert status == -signal.SIGKILL, \
                f"run {len(outputs)}: kill {kill} not delivered ({status}):\n{output[-3000:]}"
            kills += 1
            broken_latest += not latest_is_complete(out)
        else:
            assert status == 0, f"run {len(outputs)} failed:\n{output[-3000:]}"

    expected = step_losses(reference)
    logged = [(int(step), float(loss)) for output in outputs for step, loss in STEP_LOSS.findall(output)]
    assert {step for step, _ in logged} == set(expected) == set(range(1, TARGET_STEPS + 1))
    loss_mismatches = sum(loss != expected[step] for step, loss in logged)  # re-done steps count each time
    tensor_mismatches = len(checkpoint_differences(tmp_path / "ref" / str(TARGET_STEPS), out / str(TARGET_STEPS)))
    mismatches = loss_mismatches + tensor_mismatches + broken_latest
    print(f"\nfault injection ({per_save} calls per save): {kills} kills ({holds} outside kills held at the "
          f"window's end), {resumes} resumes, {len(outputs)} runs, "
          f"{mismatches} mismatches ({loss_mismatches} step losses, {tensor_mismatches} checkpoint tensors, "
          f"{broken_latest} unusable `latest`); kills: {[k for k, s, _ in history if s == -signal.SIGKILL]}")
    assert kills == KILLS
    assert mismatches == 0
