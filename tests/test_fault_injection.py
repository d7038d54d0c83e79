"""Fault injection: SIGKILL training at 20 random moments and resume each time until the target step.

The moments are drawn from a seeded RNG (FAULT_SEED overrides): mid step (before a backward), right
after an optimizer step, inside a checkpoint save (a torn torch.save file, or before one of the
renames that commit the rank file, the manifest or `latest`), or after a random delay from the
outside (start-up included). After every kill, `latest` must name a complete checkpoint (or be
absent), and the run is resumed with --resume_from_checkpoint. At the end, every step's loss (a step
re-done after a kill included) and every tensor of the final checkpoint must equal those of one
uninterrupted run. The figures are printed:

    python -m pytest tests/test_fault_injection.py -m slow -s
"""

import os
import random
import signal
import subprocess
import warnings

import pytest
import torch

import checkpointing
import run_pretraining
from test_resume import (SHARD_SIZES, STEP_LOSS, checkpoint_differences, driver_args, ds_config, finish, run,
                         start, step_losses)
import helpers

KILLS = 20
TARGET_STEPS = 48          # 192 samples: the runs cross two epoch boundaries (81 samples each)
EVERY = 2                  # --num_steps_per_checkpoint
KINDS = ("backward", "step", "torch_save", "replace", "delay")
KIND_WEIGHTS = (3, 2, 2, 2, 1)
MAX_DELAY_S = 12.0         # covers start-up (imports, engine) and the first steps on a loaded machine


def calls_per_save(tmp_path, data, config, monkeypatch) -> dict:
    """{"torch_save": n, "replace": n}: the calls one checkpoint save makes, counted on an in-process probe
    run with the test's own configuration (so the draws reach every write and rename of a save, the
    commit's last ones included, whatever the ZeRO stage). The kills count these calls from the start
    of the process, so none may happen outside a save."""
    counts, inside = {"torch_save": 0, "replace": 0, "saves": 0, "outside": 0}, [False]

    def counting(function, kind):
        def wrapper(*args, **kwargs):
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


def draw_kill(rng: random.Random, remaining_steps: int, per_save: dict) -> tuple[str, float]:
    """(kind, n): die at the n-th event of that kind (or after n seconds for "delay"), chosen within
    the next few steps so that every draw happens before the run could end. per_save: calls_per_save."""
    # A delay could outlast a short remaining run, which would then end without being killed.
    kinds = KINDS if remaining_steps > 12 else KINDS[:-1]
    kind = rng.choices(kinds, KIND_WEIGHTS[:len(kinds)])[0]
    steps_ahead = min(remaining_steps, 2 * EVERY + 1)
    saves_ahead = max(1, steps_ahead // EVERY)
    if kind in ("backward", "step"):
        return kind, rng.randint(1, steps_ahead)
    if kind in per_save:
        return kind, rng.randint(1, per_save[kind] * saves_ahead)
    return kind, round(rng.uniform(0.0, MAX_DELAY_S), 2)


def run_once(argv, kill):
    """One resumed run; returns (status, output). Kills from inside (FAULT_KILL) or, for "delay",
    SIGKILL to the whole process group from here."""
    kind, amount = kill if kill else (None, None)
    process = start(argv, 1, kill=f"{kind}:{amount}" if kind not in (None, "delay") else None)
    if kind == "delay":
        try:
            process.wait(timeout=amount)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
    return finish(process)


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
    reference = run(driver_args(data, tmp_path / "ref", config, tmp_path / "ref.json", TARGET_STEPS), 1)

    out, outputs, kills, resumes, broken_latest, history = tmp_path / "out", [], 0, 0, 0, []
    while latest_step(out) < TARGET_STEPS:
        assert len(outputs) < 4 * KILLS, f"no progress: {history}"
        kill = draw_kill(rng, TARGET_STEPS - latest_step(out), per_save) if kills < KILLS else None
        status, output = run_once(driver_args(data, out, config, tmp_path / f"run{len(outputs)}.json",
                                              TARGET_STEPS, num_steps_per_checkpoint=EVERY), kill)
        outputs.append(output)
        resumes += "resumed from checkpoint" in output
        history.append((kill, status, latest_step(out)))
        if status == -signal.SIGKILL:
            kills += 1
            broken_latest += not latest_is_complete(out)
        else:
            assert status == 0, f"run {len(outputs)} ({kill}) failed:\n{output[-3000:]}"

    expected = step_losses(reference)
    logged = [(int(step), float(loss)) for output in outputs for step, loss in STEP_LOSS.findall(output)]
    assert {step for step, _ in logged} == set(expected) == set(range(1, TARGET_STEPS + 1))
    loss_mismatches = sum(loss != expected[step] for step, loss in logged)  # re-done steps count each time
    tensor_mismatches = len(checkpoint_differences(tmp_path / "ref" / str(TARGET_STEPS), out / str(TARGET_STEPS)))
    mismatches = loss_mismatches + tensor_mismatches + broken_latest
    print(f"\nfault injection ({per_save} calls per save): {kills} kills, {resumes} resumes, {len(outputs)} runs, "
          f"{mismatches} mismatches ({loss_mismatches} step losses, {tensor_mismatches} checkpoint tensors, {broken_latest} unusable "
          f"`latest`); kills: {[k for k, s, _ in history if s == -signal.SIGKILL]}")
    assert kills == KILLS
    assert mismatches == 0
