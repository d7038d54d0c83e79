"""Shared test helpers: tiny shards, DeepSpeed configs, the driver in-process or under the real launcher.

Used by the driver's and the checkpoint worker's tests. Nothing here touches the network or files
outside the directories passed in.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import psutil
import pytest

from data.dataset import SampleStream, scan_shards
from data.shard_format import write_shard
from training.distributed import free_port  # also for the tests that start processes

REPO_ROOT = Path(__file__).resolve().parent.parent

VENV_BIN = Path(sys.executable).parent
# A recording stand-in for Habana's bridge (habana_frameworks); see its docstring for what it models.
FAKE_HABANA = REPO_ROOT / "tests" / "fake_habana"
TINY_MODEL_CONFIG = REPO_ROOT / "scripts" / "bert_tiny_config.json"
# A failure that says nothing about the program, worth one retry: the free port was taken by another process
# between free_port() and the launch.
RETRY_MARKERS = ("Address already in use", "EADDRINUSE")


def write_synthetic_shards(directory, sizes, seq_len=32, max_pred=5, vocab_size=30522, seed=0,
                           name="shard_{i}_training.hdf5"):
    """One shard per entry of `sizes` (samples per shard); returns the shard paths.

    Sample k (counting across shards in file order) has input_ids[:, 1] == 1000 + k, so tests can tell
    samples apart. Every sample has exactly max_pred masked positions, so each sample weighs the same
    in the MLM loss (what data-parallel equivalence needs); masked ids are the original tokens, so a
    model can learn them.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths, uid = [], 1000
    for i, n in enumerate(sizes):
        ids = rng.integers(1000, min(vocab_size, 3000), (n, seq_len)).astype(np.int32)
        ids[:, 1] = np.arange(uid, uid + n)
        uid += n
        positions = np.stack([np.sort(rng.choice(np.arange(2, seq_len), max_pred, replace=False))
                              for _ in range(n)]).astype(np.int32) if n else np.zeros((0, max_pred), np.int32)
        segments = np.zeros((n, seq_len), np.int8)
        segments[:, seq_len // 2:] = 1
        arrays = {"input_ids": ids, "input_mask": np.ones((n, seq_len), np.int8), "segment_ids": segments,
                  "masked_lm_positions": positions, "masked_lm_ids": np.take_along_axis(ids, positions, 1),
                  "next_sentence_labels": rng.integers(0, 2, n).astype(np.int8)}
        path = directory / name.format(i=i)
        write_shard(path, arrays)
        paths.append(path)
    return paths


def corrupt_first_chunk(path, key="input_ids"):
    """Overwrite the first compressed chunk of `key` with garbage: the header stays valid, reading fails."""
    import h5py
    with h5py.File(path, "r") as f:
        info = f[key].id.get_chunk_info(0)
    with open(path, "r+b") as raw:
        raw.seek(info.byte_offset)
        raw.write(b"\xff" * info.size)


def last_shard_of_first_epoch(data_dir, seed=42) -> Path:
    """The shard that the driver's sample stream (window size 1) reads last in epoch 0, under `seed`."""
    shards, _, _ = scan_shards(data_dir)
    return shards[SampleStream(shards, seed, window_size=1).shard_order(0)[-1]].path


@contextlib.contextmanager
def read_only(directory: Path):
    """Make `directory` read-only for this process: chmod for ordinary users; root ignores modes,
    so for root a read-only bind mount of the directory onto itself (needs CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        modes = {p: p.stat().st_mode for p in [directory, *directory.rglob("*")] if p.is_dir()}
        for path in modes:
            path.chmod(0o555)
        try:
            yield
        finally:
            for path, mode in modes.items():
                path.chmod(mode)
        return
    bind = subprocess.run(["mount", "--bind", str(directory), str(directory)], capture_output=True)
    if bind.returncode != 0:
        pytest.skip(f"root without mount permission cannot make a read-only directory: {bind.stderr!r}")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(directory)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def sample_uid(input_ids) -> list:
    """The sample numbers written by write_synthetic_shards, from a batch's input_ids."""
    return [int(x) - 1000 for x in input_ids[:, 1]]


def write_ds_config(path, stage=1, bf16=True, micro=4, gas=1, world=1, clipping=1.0, **extra):
    """A DeepSpeed JSON for the tiny CPU runs; returns its path."""
    config = {"train_batch_size": micro * gas * world, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": gas, "bf16": {"enabled": bf16}, "gradient_clipping": clipping,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, **extra}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(config, indent=1))
    return Path(path)


TEST_PEAK_TFLOPS = 1.0  # an arbitrary matmul peak for the tests' MFU figures (see driver_argv)


def driver_argv(data_dir, output_dir, ds_config, json_summary=None, **flags):
    """run_pretraining.py arguments for a tiny CPU run; flags=value pairs override (True = bare flag).

    The peak for MFU is given (TEST_PEAK_TFLOPS): measuring it takes each run 1-3 s at start-up, and the suite
    starts the driver many times. The tests of the measurement pass peak_tflops=None."""
    options = {"input_dir": data_dir, "output_dir": output_dir, "config_file": TINY_MODEL_CONFIG,
               "optimizer": "lans", "learning_rate": 0.01, "max_steps": 4, "warmup_proportion": 0.25,
               "max_predictions_per_seq": 20, "json-summary": json_summary or Path(output_dir).parent / "dllogger.json",
               "num_steps_per_checkpoint": 1000, "use_lr_scheduler": True, "disable_progress_bar": True,
               "no_cuda": True, "deepspeed": True, "deepspeed_config": ds_config, "peak_tflops": TEST_PEAK_TFLOPS}
    options.update(flags)
    return flags_to_argv(options)


def flags_to_argv(options: dict) -> list:
    """{flag name: value} -> ["--name", "value", ...]; True = a bare flag, False/None = left out."""
    argv = []
    for name, value in options.items():
        if value is False or value is None:
            continue
        argv.append(f"--{name}")
        if value is not True:
            argv.append(str(value))
    return argv


def init_single_process_group():
    """A gloo process group of world size 1 in this process, once. DeepSpeed's shm op is turned off: on a
    CPU it would be compiled at start-up (the driver does the same)."""
    import deepspeed
    import deepspeed.ops
    import torch.distributed as dist
    if dist.is_initialized():
        return
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu"}.items():
        os.environ.setdefault(key, value)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")


def environ_without_rank() -> dict:
    """os.environ less the rank variables that init_single_process_group leaves behind in this process: a
    child would otherwise inherit its MASTER_PORT, which this process's process group still holds."""
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE"):
        env.pop(key, None)
    return env


def checkout_env(env=None) -> dict:
    """`env` (default os.environ) with PYTHONPATH at this checkout: a script run by its path in a child process
    then imports the project as it would from an editable install, which the suite itself does not need
    (pytest.ini's pythonpath)."""
    return {**(os.environ if env is None else env), "PYTHONPATH": str(REPO_ROOT)}


def kill_job(process: subprocess.Popen) -> None:
    """SIGKILL to a process started with start_new_session=True, its process group and every process under it:
    the launchers start the deepspeed runner in a session of its own (scripts/launch_common.sh,
    run_forwarding_signals), which a SIGKILL to the launcher's process group does not reach."""
    try:
        tree = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for child in tree:
        with contextlib.suppress(psutil.Error):
            child.kill()


def launcher_env(**extra) -> dict:
    env = checkout_env(environ_without_rank())
    env.update(PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1",
               DS_ACCELERATOR="cpu")
    env.update(extra)
    return env


def start_launch_ranks(program: str, results_dir, **env) -> subprocess.Popen:
    """scripts/launch_common.sh's launch_ranks as the launchers run it (set -euo pipefail, the real deepspeed
    runner, HL_DEVICE=cpu, 2 ranks), with `python -u -c program` as the ranks' program; in a session of its own,
    stdout and stderr together in one pipe."""
    environment = dict(launcher_env(), HL_DEVICE="cpu", NUM_NODES="1", NGPU_PER_NODE="2", HL_NGPU_PER_NODE="2",
                       RESULTS_DIR=str(results_dir), HL_MASTER_PORT=str(free_port()), **env)
    script = ('set -euo pipefail; source scripts/launch_common.sh; device_args; find_launcher_and_python; '
              'rendezvous_args; launch_ranks -c "$0"')
    return subprocess.Popen(["bash", "-c", script, program], cwd=REPO_ROOT, env=environment, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def run_launch_ranks(program: str, results_dir, once_up=None, timeout: float = 120) -> tuple:
    """start_launch_ranks(program) to its end, where each rank of `program` writes the line `rank up` first:
    (status, output lines, the processes under the launcher when both ranks were up that are still alive 60 s
    after it ended). once_up(process), if given, is called once both lines have come out. A launch still going
    after `timeout` s is killed, with those processes."""
    process, tree = start_launch_ranks(program, results_dir), []

    def end():
        kill_job(process)
        for child in tree:  # those a launcher that died first left behind
            with contextlib.suppress(psutil.Error):
                child.kill()

    guard = threading.Timer(timeout, end)
    guard.start()
    try:
        lines = []
        for line in process.stdout:  # read through the same object to the end: nothing read ahead is lost
            lines.append(line.rstrip("\n"))
            if lines.count("rank up") == 2 and not tree:
                tree = psutil.Process(process.pid).children(recursive=True)
                if once_up:
                    once_up(process)
        status = process.wait()
        return status, lines, psutil.wait_procs(tree, timeout=60)[1]
    finally:
        guard.cancel()
        end()


def launch(argv, num_ranks=2, timeout=300, env=None, script="run_pretraining.py", retry=True):
    """Run `deepspeed --num_gpus N --no_local_rank <script> argv` on this machine; returns CompletedProcess.

    Retries once when the failure is one of RETRY_MARKERS.
    """
    command = [str(VENV_BIN / "deepspeed"), "--num_gpus", str(num_ranks), "--no_local_rank",
               "--master_port", str(free_port()), str(REPO_ROOT / script), *map(str, argv)]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env or launcher_env(), capture_output=True, text=True,
                            timeout=timeout)
    output = result.stdout + result.stderr
    if result.returncode != 0 and retry and any(marker in output for marker in RETRY_MARKERS):
        return launch(argv, num_ranks, timeout, env, script, retry=False)
    return result


def run_single_process(argv, timeout=300, env=None):
    """`python run_pretraining.py argv` in a fresh process (no launcher); returns CompletedProcess."""
    command = [sys.executable, str(REPO_ROOT / "run_pretraining.py"), *map(str, argv)]
    return subprocess.run(command, cwd=REPO_ROOT, env=env or launcher_env(), capture_output=True, text=True,
                          timeout=timeout)


def read_dllogger(path) -> list:
    """The records of a dllogger JSON stream (lines 'DLLL {json}'), in order."""
    records = []
    for line in Path(path).read_text().splitlines():
        match = re.match(r"^DLLL (.*)$", line)
        if match:
            records.append(json.loads(match.group(1)))
    return records


def step_records(path) -> list:
    """Per-step LOG records (step = [epoch, global_step]) that carry a step_loss."""
    return [r for r in read_dllogger(path) if r.get("type") == "LOG" and "step_loss" in r["data"]]
