"""Sample-exact resume of run_pretraining.py, end to end, with the real DeepSpeed (CPU, gloo).

The check is always the same: an uninterrupted run of N steps against a run that is stopped (cleanly,
by SIGKILL, or by SIGTERM preemption) and resumed until N. The per-step losses (dllogger JSON) and
every tensor of the final checkpoint (weights, optimizer state, scheduler, RNG states) must be
bit-identical. Interruptions sit inside a shard and right before an epoch boundary, so the resumed
run has to find its place in the shuffled sample stream.

This file is also the program that the kill tests launch instead of run_pretraining.py:
``python tests/test_resume.py <driver args>`` with FAULT_KILL=<event>:<n>[:<rank>] in the environment
SIGKILLs the process at the n-th <event> (see KILL_EVENTS; "hold" instead stops there until killed from
outside), then runs the driver unchanged.
"""

import codecs
import contextlib
import errno
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# As a program (the rank of the launcher tests), it blocks stop signals during its imports as run_pretraining.py
# does as a program (see there): the driver's cli takes them.
if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))

import psutil
import pytest
import torch

import helpers
import run_pretraining
from common.errors import InputError
from helpers import last_shard_of_first_epoch  # noqa: F401 (tests/test_supervisor.py imports it from here)
from training import checkpointing
from training.run_status import ExitStatus

THIS_FILE = Path(__file__).resolve()
KILL_ENV = "FAULT_KILL"
# Synthetic shards: 24 + 40 + 17 = 81 samples per epoch; shard boundaries (in any shard order) fall
# on sample 17, 24, 40, 41, 57 or 64, so the stops below at samples 12 and 16 are inside a shard.
SHARD_SIZES = (24, 40, 17)
EPOCH_SAMPLES = sum(SHARD_SIZES)
MICRO = 4


# ============================================================================ kill injection (child side)

def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_before(function, should_die):
    def wrapper(*args, **kwargs):
        if should_die():
            _die()
        return function(*args, **kwargs)
    return wrapper


def is_status_file(path) -> bool:
    """The run's status file (training/run_status.py), renamed into place outside any checkpoint save."""
    return str(path).endswith(".status.json")


def _kill_before_checkpoint_rename(function, should_die):
    """os.replace that kills at the chosen rename of a checkpoint's files; the status file's are not counted."""
    def wrapper(src, dst, *args, **kwargs):
        if not is_status_file(dst) and should_die():
            _die()
        return function(src, dst, *args, **kwargs)
    return wrapper


def _kill_after(function, should_die):
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        if should_die():
            _die()
        return result
    return wrapper


HOLD_LINE = "[fault injection] holding before this backward until killed"


def _hold_before(function, should_hold):
    """At the chosen call, say so on stdout and wait to be killed from outside (the latest moment an
    outside kill may land: the run cannot end before it)."""
    def wrapper(*args, **kwargs):
        if should_hold():
            # One write(2): a pipe takes a write of up to PIPE_BUF bytes whole, so the other rank's output, in
            # the same pipe, cannot split the line. (print() under `python -u` writes the text and its newline
            # apart unless the stream is line-buffered, as run_cli makes it; this line does not rely on that.)
            sys.stdout.flush()
            os.write(sys.stdout.fileno(), f"{HOLD_LINE}\n".encode())
            while True:
                time.sleep(3600)
        return function(*args, **kwargs)
    return wrapper


def _torn_save(function, should_die):
    """torch.save that, at the chosen call, leaves half a file behind before dying (a torn write)."""
    def wrapper(obj, f, *args, **kwargs):
        if not should_die():
            return function(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            function(obj, f, *args, **kwargs)
            os.truncate(f, os.path.getsize(f) // 2)
        else:
            f.write(b"torn")
            f.flush()
        _die()
    return wrapper


def _full_disk_save(function, should_fail):
    """torch.save that, at the chosen call, fails as on a full disk after writing a few bytes."""
    def wrapper(obj, f, *args, **kwargs):
        if not should_fail():
            return function(obj, f, *args, **kwargs)
        if not isinstance(f, (str, os.PathLike)):
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    return wrapper


def _sigterm_before(function, should_signal):
    """At the chosen call, SIGTERM this process first (a preemption's signal that reaches one rank while it
    starts up)."""
    def wrapper(*args, **kwargs):
        if should_signal():
            os.kill(os.getpid(), signal.SIGTERM)
        return function(*args, **kwargs)
    return wrapper


# event -> (module, attribute, how): where the process is killed (or, for torch_save_enospc, where
# one write fails as on a full disk; for sigterm_at_engine_set_up, where it gets a SIGTERM).
KILL_EVENTS = {
    "torch_save_enospc": ("torch", "save", _full_disk_save),
    "backward": ("deepspeed.runtime.engine", "DeepSpeedEngine.backward", _kill_before),  # mid step
    "step": ("deepspeed.runtime.engine", "DeepSpeedEngine.step", _kill_after),  # update done, not saved
    "torch_save": ("torch", "save", _torn_save),  # inside a checkpoint save: a file half written
    "replace": ("os", "replace", _kill_before_checkpoint_rename),  # a rank file, manifest or `latest` not renamed
    "hold": ("deepspeed.runtime.engine", "DeepSpeedEngine.backward", _hold_before),  # wait for an outside kill
    "sigterm_at_engine_set_up": ("deepspeed", "initialize", _sigterm_before),  # start-up, before any step
}


def install_kill(spec: str, rank: int) -> None:
    """spec = "<event>:<n>" or "<event>:<n>:<rank>": SIGKILL this process at the n-th event."""
    event, count, *target_rank = spec.split(":")
    if target_rank and int(target_rank[0]) != rank:
        return
    module_name, attribute, how = KILL_EVENTS[event]
    calls = [0]

    def should_die():
        calls[0] += 1
        return calls[0] == int(count)

    owner = __import__(module_name, fromlist=["_"])
    *path, name = attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, name, how(getattr(owner, name), should_die))


# ============================================================================ running the driver (test side)

def ds_config(tmp_path, stage, bf16, world, micro=MICRO, gas=1):
    return helpers.write_ds_config(tmp_path / f"ds_{stage}_{bf16}_{world}_{micro}_{gas}.json", stage=stage, bf16=bf16,
                                   micro=micro, gas=gas, world=world, clipping=1.0)


def driver_args(data_dir, out, config, json_path, max_steps, **flags):
    flags.setdefault("num_steps_per_checkpoint", 1000)
    return helpers.driver_argv(data_dir, out, config, json_summary=json_path, max_steps=max_steps, log_freq=1,
                               resume_from_checkpoint=True, **flags)


def start(argv, world, kill=None, **popen_kwargs) -> subprocess.Popen:
    """The driver (through this file's kill wrapper) in a new process group: `python` for one rank,
    the real `deepspeed` launcher for several."""
    env = helpers.launcher_env(PYTHONUNBUFFERED="1", **({KILL_ENV: kill} if kill else {}))
    if world == 1:
        command = [sys.executable, str(THIS_FILE), *map(str, argv)]
    else:
        command = [str(helpers.VENV_BIN / "deepspeed"), "--num_gpus", str(world), "--no_local_rank",
                   "--master_port", str(helpers.free_port()), str(THIS_FILE), *map(str, argv)]
    return subprocess.Popen(command, cwd=helpers.REPO_ROOT, env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen_kwargs)


def ranks_of(process: subprocess.Popen) -> list:
    """The ranks of a driver started by start(), by RANK: the processes `python [-u] <this file> ...` (the
    launchers are `deepspeed ...` and `python -u -m deepspeed.launcher.launch ...`)."""
    ranks = []
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return ranks
    for candidate in tree:
        try:
            if str(THIS_FILE) in candidate.cmdline()[1:3]:
                ranks.append((int(candidate.environ().get("RANK", "0")), candidate))
        except psutil.Error:  # ended meanwhile
            pass
    return sorted(ranks, key=lambda pair: pair[0])


def stop_hung(process: subprocess.Popen) -> str:
    """Ends a run that hangs, SIGKILL to its process group and its processes (helpers.kill_job), after each rank
    has printed its threads' stacks into the output (the wrapper below registers SIGUSR1 for faulthandler): a
    hang is rare and unreadable after the fact. One rank after the other: dumps written at the same time into
    the shared pipe interleave character by character. Returns the ranks in the order of their dumps, for the
    message."""
    ranks = ranks_of(process)
    for _, rank in ranks:
        with contextlib.suppress(psutil.Error):
            rank.send_signal(signal.SIGUSR1)
        time.sleep(2)
    helpers.kill_job(process)
    return ", ".join(f"rank {number} (pid {rank.pid})" for number, rank in ranks) or "no rank found"


def hang_failure(what: str, timeout: float, order: str, output: str):
    pytest.fail(f"driver did not {what} within {timeout} s; the thread stacks at the end are those of "
                f"{order}, in this order:\n{output[-16000:]}")


def finish(process: subprocess.Popen, timeout=300) -> tuple[int, str]:
    """The run's status and the rest of its output, once it has ended. One still running after `timeout` s
    fails the test with its ranks' stacks; one interrupted otherwise (pytest-timeout's failure, Ctrl-C) is
    killed with its processes (helpers.kill_job), so that no rank outlives the test."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        order = stop_hung(process)
        hang_failure("finish", timeout, order, process.communicate()[0])
    except BaseException:
        helpers.kill_job(process)
        raise
    return process.returncode, output


def output_until(process: subprocess.Popen, reached, timeout=300) -> str:
    """The run's output as far as it has come when reached(output so far) first holds, or to its end. A run
    that neither gets there nor ends within `timeout` s fails the test, with its ranks' stacks, instead of
    hanging it. It reads the pipe itself, as finish's communicate() does after it: reading through
    process.stdout would leave text read ahead in that object's buffer, which communicate() never sees."""
    stopped = []
    guard = threading.Timer(timeout, lambda: stopped.append(stop_hung(process)))
    guard.start()
    decoder, output = codecs.getincrementaldecoder("utf-8")(errors="replace"), ""
    try:
        # on past a character split between two reads: the decoder holds its first bytes
        while not reached(output) or decoder.getstate()[0]:
            chunk = os.read(process.stdout.fileno(), 65536)
            output += decoder.decode(chunk, final=not chunk)
            if not chunk:
                break
    finally:
        guard.cancel()
        guard.join()
    if stopped:
        hang_failure("get there (or end)", timeout, stopped[0], output + process.communicate()[0])
    return output


def run(argv, world, kill=None, expect=0) -> str:
    """Run to the end; a SIGKILL'd run must die by that kill (one rank: -9; launcher: non-zero)."""
    status, output = finish(start(argv, world, kill))
    if kill is None:
        assert status == expect, output[-4000:]
    else:
        assert status == -signal.SIGKILL if world == 1 else status != 0, output[-4000:]
    return output


STEP_LOSS = re.compile(r"Training Iteration: (\d+) .*?\bstep_loss : (\S+)")


def step_losses(*outputs) -> dict:
    """{global step: step_loss} from the rank-0 dllogger stdout lines of several runs (stdout, not the
    JSON file: a SIGKILL'd run loses its buffered JSON, while unbuffered stdout keeps every line).
    A step logged twice (re-done after a kill) must have the same loss both times."""
    losses = {}
    for output in outputs:
        for step, loss in STEP_LOSS.findall(output):
            assert losses.setdefault(int(step), float(loss)) == float(loss), f"step {step}: two losses"
    return losses


def tree_differences(a, b, where="") -> list:
    """Paths at which two loaded checkpoint objects differ (tensors bitwise, dtype and shape included)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for key in a for d in tree_differences(a[key], b[key], f"{where}/{key}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in tree_differences(x, y, f"{where}[{i}]")]
    if torch.is_tensor(a) and torch.is_tensor(b):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if type(a) is not type(b):
        return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
    if hasattr(a, "__dict__") and not isinstance(a, type):  # e.g. DeepSpeed's LossScaler: no __eq__
        return tree_differences(vars(a), vars(b), where)
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def checkpoint_differences(tag_dir_a: Path, tag_dir_b: Path) -> list:
    """Every .pt file of two checkpoint tags compared in full (our own files: full pickle is fine)."""
    names = sorted(p.name for p in tag_dir_a.glob("*.pt"))
    assert names == sorted(p.name for p in tag_dir_b.glob("*.pt"))
    assert any("model_states" in name for name in names) and any(name.startswith("state_") for name in names)
    return [f"{name}{d}" for name in names
            for d in tree_differences(torch.load(tag_dir_a / name, weights_only=False),
                                      torch.load(tag_dir_b / name, weights_only=False))]


def assert_same_training(reference, outputs, tag_dir, steps):
    """reference = (stdout, final tag dir) of the uninterrupted run."""
    expected = step_losses(reference[0])
    assert sorted(expected) == list(range(1, steps + 1))
    assert step_losses(*outputs) == expected
    assert checkpoint_differences(reference[1], tag_dir) == []


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    directory = tmp_path_factory.mktemp("resume_shards")
    helpers.write_synthetic_shards(directory, SHARD_SIZES)
    return directory


class References:
    """Uninterrupted runs, made once per (world, stage, bf16, steps) in the module."""

    def __init__(self, shards, root):
        self.shards, self.root, self.done = shards, root, {}

    def get(self, world, stage, bf16, steps):
        key = (world, stage, bf16, steps)
        if key not in self.done:
            directory = self.root / "_".join(map(str, key))
            directory.mkdir()
            config = ds_config(directory, stage, bf16, world)
            output = run(driver_args(self.shards, directory / "out", config, directory / "log.json", steps), world)
            self.done[key] = (output, directory / "out" / str(steps))
        return self.done[key]


@pytest.fixture(scope="module")
def references(shards, tmp_path_factory):
    return References(shards, tmp_path_factory.mktemp("references"))


# ============================================================================ in-process runs (default suite)

def main_in_process(argv) -> dict:
    return run_pretraining.main([str(arg) for arg in argv])


def json_losses(*json_paths) -> dict:
    losses = {}
    for path in json_paths:
        for record in helpers.step_records(path):
            assert losses.setdefault(record["step"][-1], record["data"]["step_loss"]) == record["data"]["step_loss"]
    return losses


# (ZeRO stage, bf16, gradient accumulation steps): each stage in both precisions, and accumulation once.
# Two settings in the default suite; the other four are slow, and CI's run leaves them to the marker extra.
SLOW_EXTRA = (pytest.mark.slow, pytest.mark.extra)
ONE_RANK = [pytest.param(stage, bf16, 1, id=f"zero{stage}-{'bf16' if bf16 else 'fp32'}",
                         marks=() if (stage, bf16) in ((0, False), (2, True)) else SLOW_EXTRA)
            for stage in (0, 1, 2) for bf16 in (False, True)] + [pytest.param(1, True, 2, id="zero1-bf16-gas2")]


@pytest.mark.parametrize("stage,bf16,gas", ONE_RANK)
def test_clean_stops_and_resumes_in_process(tmp_path, shards, stage, bf16, gas):
    """Micro-batch 8, `gas` micro-batches a step, dropout on (so the RNG states must be restored too). Stops at
    step 2 (sample 16 or 32, inside a shard) and 10 (sample 80 or 160: the next step straddles the end of an
    epoch), each resumed, against one uninterrupted run of 12 steps."""
    config, steps, batch = ds_config(tmp_path, stage, bf16, 1, micro=8, gas=gas), 12, 8 * gas
    main_in_process(driver_args(shards, tmp_path / "ref", config, tmp_path / "ref.json", steps))
    out, logs = tmp_path / "out", [tmp_path / f"run{i}.json" for i in range(3)]
    for log, steps_this_run in zip(logs, (2, 8, -1)):
        summary = main_in_process(driver_args(shards, out, config, log, steps, steps_this_run=steps_this_run))
    assert summary["global_step"] == steps
    assert sorted(json_losses(*logs)) == list(range(1, steps + 1))
    assert json_losses(*logs) == json_losses(tmp_path / "ref.json")
    assert checkpoint_differences(tmp_path / "ref" / str(steps), out / str(steps)) == []
    position = torch.load(out / str(steps) / "mp_rank_00_model_states.pt", weights_only=False)
    assert position["samples_consumed"] == steps * batch and position["epoch"] == steps * batch // EPOCH_SAMPLES


def test_resume_falls_back_past_a_checkpoint_missing_a_rank_file(tmp_path, shards):
    config, steps = ds_config(tmp_path, 1, True, 1), 10
    out = tmp_path / "out"
    main_in_process(driver_args(shards, out, config, tmp_path / "a.json", steps, steps_this_run=8,
                                num_steps_per_checkpoint=4))
    (out / "8" / "state_0.pt").unlink()
    with pytest.warns(checkpointing.CheckpointWarning, match=r"'8'.*state_0\.pt .*missing.*checkpoint '4'"):
        main_in_process(driver_args(shards, out, config, tmp_path / "b.json", steps))
    first, second = json_losses(tmp_path / "a.json"), json_losses(tmp_path / "b.json")
    assert sorted(second) == [5, 6, 7, 8, 9, 10]
    assert [second[step] for step in (5, 6, 7, 8)] == [first[step] for step in (5, 6, 7, 8)]


def test_resume_without_checkpoints_starts_fresh_and_says_so(tmp_path, shards, capsys):
    config = ds_config(tmp_path, 1, True, 1)
    summary = main_in_process(driver_args(shards, tmp_path / "out", config, tmp_path / "a.json", 1,
                                          skip_checkpoint=True))
    assert summary["global_step"] == 1
    assert "no checkpoint in" in capsys.readouterr().out


def test_relaunching_a_finished_job_trains_nothing_and_says_so(tmp_path, shards, capsys):
    """All launchers pass --resume_from_checkpoint: a relaunch after the last step must not log a loss or a
    throughput it did not measure."""
    config, out, log = ds_config(tmp_path, 1, True, 1), tmp_path / "out", tmp_path / "a.json"
    main_in_process(driver_args(shards, out, config, log, 2))
    log.unlink()
    capsys.readouterr()
    # not cli(): its exit-time destroy_process_group would spoil later in-process runs
    summary = main_in_process(driver_args(shards, out, config, log, 2))
    assert "final_loss" not in summary and "training_sequences_per_second" not in summary
    assert "checkpoint 2 is already at --max_steps 2: nothing to train" in capsys.readouterr().out
    logged = [r["data"] for r in helpers.read_dllogger(log) if r["type"] == "LOG"]
    assert not any("final_loss" in d or "step_loss" in d or "training_sequences_per_second" in d for d in logged)
    assert logged[-1]["global_step"] == 2 and logged[-1]["nothing_to_train"] is True


def test_resume_from_another_model_config_or_a_missing_step_is_one_error_line(tmp_path, shards, capsys):
    """A checkpoint of another model config is refused whether the resume takes the latest or names it with
    --resume_step (which used to go straight to DeepSpeed's load and end in its size-mismatch traceback); a
    --resume_step that is not there is one error line too. Nothing is trained or saved."""
    config, out = ds_config(tmp_path, 0, False, 1), tmp_path / "out"
    main_in_process(driver_args(shards, out, config, tmp_path / "a.json", 2))
    other = json.loads(helpers.TINY_MODEL_CONFIG.read_text())
    other["intermediate_size"] = 256
    (tmp_path / "other.json").write_text(json.dumps(other))
    another_config = f"error: checkpoint {out / '2'} is from another model config " \
                     "(intermediate_size: checkpoint 512 vs run 256)"
    missing_step = f"error: --resume_step 7: {out} holds no checkpoint 7 [no restart]"
    cases = [(-1, tmp_path / "other.json", another_config, ExitStatus.FAILED),
             (2, tmp_path / "other.json", another_config, ExitStatus.FAILED),
             (7, helpers.TINY_MODEL_CONFIG, missing_step, ExitStatus.NO_RESTART)]
    for step, model_config, expected, status in cases:
        argv = driver_args(shards, out, config, tmp_path / "b.json", 4, config_file=model_config, resume_step=step)
        assert run_pretraining.cli([str(arg) for arg in argv]) == status
        err = capsys.readouterr().err
        assert [line for line in err.splitlines() if line.startswith("error:")] == [expected], step
        assert "Traceback" not in err
    assert (out / "latest").read_text() == "2"
    assert not (out / "4").exists()


@pytest.mark.parametrize("changed,field", [({"data_memory_budget_mb": 0.02}, "window_size 313592 then, 24 now"),
                                           ({"seed": 7}, "seed 42 then, 7 now"),
                                           ({"disable_random_sampler": True}, "shuffle True then, False now")])
def test_resume_with_another_data_layout_is_one_error_line(tmp_path, shards, capsys, changed, field):
    """The saved position indexes a layout made from the seed, window size, shuffle flag and shards: a resume
    that changes any of them would repeat and skip samples, so it stops with the field named."""
    config, out = ds_config(tmp_path, 1, True, 1), tmp_path / "out"
    main_in_process(driver_args(shards, out, config, tmp_path / "a.json", 3, steps_this_run=1))
    argv = driver_args(shards, out, config, tmp_path / "b.json", 3, **changed)
    assert run_pretraining.cli([str(arg) for arg in argv]) == ExitStatus.NO_RESTART
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another data layout" in errors[0] and field in errors[0], errors
    assert "resume with the same data and settings" in errors[0]
    assert main_in_process(driver_args(shards, out, config, tmp_path / "b.json", 3))["global_step"] == 3


@pytest.mark.slow
def test_a_checkpoint_this_run_cannot_resume_is_refused_before_the_engine_is_built(tmp_path, shards):
    """What the checkpoint's manifest and client state tell: another model config (the newest checkpoint's, or
    --resume_step's), a --resume_step that is not there, another data layout, a --phase1_end_step other than
    the checkpoint's step. The error used to come only after the engine's set-up (22 s in the user's report);
    it now comes before DeepSpeed builds the engine, whose first line here is ZeRO's warning about LANS
    (engine.py), and before the run's log is started."""
    config, out = ds_config(tmp_path, 1, True, 1), tmp_path / "out"
    main_in_process(driver_args(shards, out, config, tmp_path / "a.json", 2))
    other = json.loads(helpers.TINY_MODEL_CONFIG.read_text())
    other["intermediate_size"] = 256
    (tmp_path / "other.json").write_text(json.dumps(other))
    another_config = "is from another model config (intermediate_size: checkpoint 512 vs run 256)"
    for flags, expected in (({"config_file": tmp_path / "other.json"}, another_config),
                            ({"config_file": tmp_path / "other.json", "resume_step": 2}, another_config),
                            ({"resume_step": 7}, f"--resume_step 7: {out} holds no checkpoint 7"),
                            ({"seed": 7}, "checkpoint 2 was saved with another data layout: seed 42 then, 7 now"),
                            ({"phase2": True, "phase1_end_step": 7}, "checkpoint 2 is at step 2, but --phase1_end_step "
                                                                     "is 7")):
        status, output = finish(start(driver_args(shards, out, config, tmp_path / "b.json", 4, **flags), 1))
        lines = output.splitlines()
        errors = [number for number, line in enumerate(lines) if line.startswith("error:")]
        assert status != ExitStatus.DONE and len(errors) == 1 and expected in lines[errors[0]], output
        assert not any("engine.py" in line for line in lines[:errors[0]]), output
        assert not (tmp_path / "b.json").exists()
    # the same check's control: a resume this run can make builds the engine, which says so (engine.py)
    status, output = finish(start(driver_args(shards, out, config, tmp_path / "c.json", 3), 1))
    assert status == 0 and "engine.py" in output, output


def test_read_only_output_dir_keeps_earlier_checkpoints(tmp_path, shards):
    config, out = ds_config(tmp_path, 1, True, 1), tmp_path / "out"
    main_in_process(driver_args(shards, out, config, tmp_path / "a.json", 8, steps_this_run=4))
    before = {p.name: p.read_bytes() for p in (out / "4").iterdir()}
    with helpers.read_only(out):  # found before the first step (a save that fails later: test_checkpointing.py)
        with pytest.raises(InputError, match=r"--output_dir .*out is not writable: (Read-only|Permission)"):
            main_in_process(driver_args(shards, out, config, tmp_path / "b.json", 8))
    assert (out / "latest").read_text() == "4"
    assert {p.name: p.read_bytes() for p in (out / "4").iterdir()} == before
    assert checkpointing.find_resume_tag(out) == "4"


# ============================================================================ kill + clean stop + resume

def kill_stop_resume(tmp_path, shards, references, world, stage, bf16):
    """Run 1 saves every C steps and is SIGKILLed mid-step two steps after a save (inside a shard);
    run 2 resumes and stops cleanly just before the epoch boundary (--steps_this_run); run 3 resumes
    across the boundary to the end."""
    global_batch = MICRO * world
    epoch_end_step = EPOCH_SAMPLES // global_batch  # the step after it straddles epochs 0 and 1
    # First checkpoint at sample 12 (1 rank) or 16 (2 ranks); 34 or 24 steps (24: as the preemption test).
    steps, every = epoch_end_step + 14, 3 if world == 1 else 2
    config = ds_config(tmp_path, stage, bf16, world)
    out, logs = tmp_path / "out", [tmp_path / f"run{i}.json" for i in range(3)]
    outputs = [run(driver_args(shards, out, config, logs[0], steps, num_steps_per_checkpoint=every), world,
                   kill=f"backward:{every + 2}:{world - 1}")]
    assert (out / "latest").read_text() == str(every)
    outputs.append(run(driver_args(shards, out, config, logs[1], steps, steps_this_run=epoch_end_step - every),
                       world))
    assert f"resumed from checkpoint {every}" in outputs[-1]
    outputs.append(run(driver_args(shards, out, config, logs[2], steps), world))
    assert f"resumed from checkpoint {epoch_end_step}: phase 1, step {epoch_end_step}" in outputs[-1]
    assert "epoch 0 ends inside the global micro-batch" in outputs[-1]
    assert_same_training(references.get(world, stage, bf16, steps), outputs, out / str(steps), steps)


@pytest.mark.slow
def test_kill_stop_resume_one_rank_zero1_bf16(tmp_path, shards, references):
    kill_stop_resume(tmp_path, shards, references, world=1, stage=1, bf16=True)


# Each ZeRO stage once, bf16 where the launchers use it: the in-process clean stops above already cover every
# stage in both precisions, so a kill on two ranks adds the partitioned files per stage, not per precision.
# CI's run kills ZeRO-2 (the most partitioned); ZeRO-0 and -1 are under the marker extra (ZeRO-1's two-rank
# checkpoint is resumed in CI by tests/test_world_size.py and killed on one rank above).
TWO_RANKS = [pytest.param(stage, bf16, id=f"zero{stage}-{'bf16' if bf16 else 'fp32'}",
                          marks=() if stage == 2 else pytest.mark.extra)
             for stage, bf16 in [(0, False), (1, True), (2, True)]]


@pytest.mark.slow
@pytest.mark.parametrize("stage,bf16", TWO_RANKS)
def test_kill_stop_resume_two_ranks(tmp_path, shards, references, stage, bf16):
    kill_stop_resume(tmp_path, shards, references, 2, stage, bf16)


# ============================================================================ preemption, world size (slow)

def child_pid(runner_pid: int, rank=None) -> int:
    """pid of rank `rank` under the `deepspeed` runner, or of the per-node launcher for rank None."""
    for child in psutil.Process(runner_pid).children(recursive=True):
        command = " ".join(child.cmdline())
        if rank is None and "deepspeed.launcher.launch" in command:
            return child.pid
        if rank is not None and str(THIS_FILE) in command and child.environ().get("RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no {'launcher' if rank is None else f'rank {rank}'} under {runner_pid}")


def send_sigterm(process: subprocess.Popen, target: str) -> None:
    if target == "process_group":  # a terminal's Ctrl-C or a batch scheduler: every process gets it
        os.killpg(process.pid, signal.SIGTERM)
    else:
        os.kill(child_pid(process.pid, None if target == "node_launcher" else 1), signal.SIGTERM)


# Exit status of the `deepspeed` runner. It installs no handler on one node, so SIGTERM to it kills
# only itself (the ranks still finish: they got the signal too). deepspeed.launcher.launch forwards
# SIGTERM to the ranks, waits for them, then exits 1 (deepspeed/launcher/launch.py, sigkill_handler).
# SIGTERM to a rank alone: the ranks stop and exit STOPPED, which the launcher and the runner pass on.
RUNNER_STATUS = {"process_group": -signal.SIGTERM, "node_launcher": 1, "rank1": ExitStatus.STOPPED}


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(RUNNER_STATUS))
def test_preemption_saves_and_resumes_exactly(tmp_path, shards, references, target):
    """SIGTERM after step 3 to every process of the job, to DeepSpeed's per-node launcher (which
    forwards it to the ranks) or to rank 1 only: all ranks finish the step, save a checkpoint and
    exit cleanly; the resumed run then matches the uninterrupted one."""
    world, stage, bf16, steps = 2, 1, True, 24
    config, out = ds_config(tmp_path, stage, bf16, world), tmp_path / "out"
    process = start(driver_args(shards, out, config, tmp_path / "a.json", steps), world)
    seen = output_until(process, lambda output: "Training Iteration: 3 " in output)
    send_sigterm(process, target)
    status, rest = finish(process)
    output = seen + rest
    stopped = re.search(r"stopping after step (\d+)", output)
    assert stopped and 3 <= int(stopped.group(1)) < steps, output[-3000:]
    stopped = int(stopped.group(1))
    assert f"saved checkpoint {stopped}" in output and "stopped_by_signal : True" in output
    assert "Traceback" not in output and status == RUNNER_STATUS[target], output[-3000:]
    assert (out / "latest").read_text() == str(stopped)
    resumed = run(driver_args(shards, out, config, tmp_path / "b.json", steps), world)
    assert f"resumed from checkpoint {stopped}" in resumed
    assert_same_training(references.get(world, stage, bf16, steps), [output, resumed], out / str(steps), steps)


@pytest.mark.slow
def test_sigterm_to_one_rank_during_start_up_stops_every_rank_before_the_first_step(tmp_path, shards):
    """Rank 1 alone gets a SIGTERM as it sets up its engine (after the process group is up, before any
    checkpoint load and step): both ranks finish start-up, agree to stop before the first step and exit
    STOPPED, and so does the launcher. No step is made and nothing is saved."""
    config, out = ds_config(tmp_path, 1, True, 2), tmp_path / "out"
    status, output = finish(start(driver_args(shards, out, config, tmp_path / "a.json", 8), 2,
                                  kill="sigterm_at_engine_set_up:1:1"))
    assert status == ExitStatus.STOPPED and "Traceback" not in output, output[-3000:]
    assert "stop requested (SIGTERM/SIGINT) during start-up: stopping before the first step, at step 0" in output
    assert "stopped_by_signal : True" in output and "Training Iteration" not in output
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.slow
def test_disk_full_on_one_rank_stops_every_rank_cleanly(tmp_path, shards):
    """Rank 1's optimizer partition (written inside DeepSpeed's save) fails with ENOSPC: both ranks
    report the error and exit 1 (no hang in DeepSpeed's barrier); checkpoint 4 stays as it was."""
    config, out = ds_config(tmp_path, 1, True, 2), tmp_path / "out"
    run(driver_args(shards, out, config, tmp_path / "a.json", 8, steps_this_run=4), 2)
    before = {p.name: p.read_bytes() for p in (out / "4").iterdir()}
    output = run(driver_args(shards, out, config, tmp_path / "b.json", 8), 2, kill="torch_save_enospc:1:1")
    assert re.search(r"error: cannot write checkpoint \S*8 on rank 1: \[Errno 28\] No space left on device", output)
    assert re.search(r"error: writing checkpoint \S*8: 1 other rank\(s\) failed", output), output[-3000:]
    assert (out / "latest").read_text() == "4" and not (out / "8").exists()
    assert {p.name: p.read_bytes() for p in (out / "4").iterdir()} == before
    assert not [p for p in out.rglob("*") if ".tmp." in p.name]


# The lines of faulthandler's dumps: a thread's header, a frame, or the empty line between threads.
STACK_LINE = re.compile(r'(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$'
                        r'|  File ".*", line \d+ in \S+$|$')


def test_a_run_interrupted_while_finish_waits_is_killed_with_its_process_group():
    """pytest-timeout's failure or Ctrl-C inside finish's wait: the run, a child of it included, is killed, not
    left running after the test (SIGINT here, which Python raises as KeyboardInterrupt in the main thread)."""
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\ntime.sleep(120)")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    time.sleep(2)  # its child has started
    members = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    interrupt = threading.Timer(1, signal.raise_signal, (signal.SIGINT,))
    interrupt.start()
    with pytest.raises(KeyboardInterrupt):
        finish(process, timeout=60)
    gone, alive = psutil.wait_procs(members, timeout=10)
    assert not alive and len(gone) == 2, alive


def test_output_read_up_to_a_line_and_then_to_the_end_loses_none():
    """output_until, then finish: every line once, also those that came in the same read as the awaited one
    (reading through process.stdout lost "b" and "c" here: its buffer had them, communicate() did not)."""
    code = "import sys, time\nsys.stdout.write('a\\nb\\nc\\n'); sys.stdout.flush(); time.sleep(1); print('d')"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                               start_new_session=True)
    seen = output_until(process, lambda output: "a\n" in output, timeout=60)
    status, rest = finish(process, timeout=60)
    assert status == 0 and (seen + rest).splitlines() == ["a", "b", "c", "d"], (seen, rest)


@pytest.mark.slow
def test_a_hung_run_shows_each_rank_stacks_whole(tmp_path, shards):
    """finish() on a two-rank run that does not end (both ranks hold before their first backward): the failure
    shows every rank's thread stacks, whole and one rank after the other (both dumps written at once into
    the shared pipe interleave character by character), in the order it names."""
    config = ds_config(tmp_path, 1, True, 2)
    process = start(driver_args(shards, tmp_path / "out", config, tmp_path / "a.json", 4), 2, kill="hold:1")
    output_until(process, lambda output: output.count(HOLD_LINE) == 2)
    with pytest.raises(pytest.fail.Exception) as failure:
        finish(process, timeout=1)
    message = str(failure.value)
    assert re.search(r"those of rank 0 \(pid \d+\), rank 1 \(pid \d+\), in this order", message), message[:500]
    dumps = message[message.index("Thread 0x"):].splitlines()
    assert [line for line in dumps if not STACK_LINE.match(line)] == [], message[-4000:]
    main_threads = [i for i, line in enumerate(dumps) if line.startswith("Current thread")]
    assert len(main_threads) == 2, message[-4000:]
    for start_line in main_threads:  # each main thread is holding in train_step (the wrapper of backward)
        frames = dumps[start_line + 1:start_line + 4]
        assert "in wrapper" in frames[0] and "in train_step" in frames[1], message[-4000:]


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # finish() asks for the stacks of a hung run
    if os.environ.get(KILL_ENV):
        install_kill(os.environ[KILL_ENV], int(os.environ.get("RANK", "0")))
    import s3_helpers
    s3_helpers.install_faults_from_env()  # S3_FAULTS: see tests/s3_helpers.py
    import run_pretraining

    sys.argv[0] = str(helpers.REPO_ROOT / "run_pretraining.py")
    sys.exit(run_pretraining.cli())
