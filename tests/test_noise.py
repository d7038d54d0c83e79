"""Lines a user should not have to read past (issue 19 defect 7, issue 34 items 4 and 7), while real errors still
show."""
import contextlib
import io
import os
import re
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

import helpers
from data.glue_sample import write_sst2_rule_task
from helpers import REPO_ROOT
from training import progress_display

ENTRY_POINTS = ["run_pretraining.py", "run_squad.py", "run_glue.py"]


def run_entry_point(script, *args):
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}  # as a user's shell has it
    return subprocess.run([sys.executable, str(REPO_ROOT / script), *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_and_errors_have_no_deepspeed_accelerator_line(script):
    shown = run_entry_point(script, "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage:"), shown.stderr
    assert "Setting accelerator" not in shown.stdout + shown.stderr
    failed = run_entry_point(script)  # the required flags are missing: that error is all stderr says
    assert failed.returncode == 2
    assert failed.stderr.splitlines() == [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert "the following arguments are required" in failed.stderr


# For helpers.run_launch_ranks: rank 0 fails once both ranks' first lines are out (GO_FILE exists), so that its last
# words are the launch's; each line one write(2), which a pipe keeps whole (print may write the text and its newline
# apart, e.g. under PYTHONUNBUFFERED).
RANK_0_FAILS = """
import os, signal, sys, time
os.write(1, b"rank up\\n")
if os.environ["RANK"] == "0":
    while not os.path.exists({go!r}):
        time.sleep(0.05)
    {failure}
time.sleep(120)
"""
SAYS_WHY = 'os.write(2, b"error: the reason, in our words\\n"); sys.exit(1)'
IS_KILLED = "os.kill(os.getpid(), signal.SIGKILL)"


def failing_launch(tmp_path, failure: str) -> tuple:
    """helpers.run_launch_ranks with RANK_0_FAILS: (status, output lines)."""
    go = tmp_path / "go"
    status, lines, _ = helpers.run_launch_ranks(RANK_0_FAILS.format(go=str(go), failure=failure), tmp_path,
                                                lambda process: go.touch())
    return status, lines


def test_a_failing_launch_ends_with_the_ranks_error_line_and_shows_no_runner_info_line(tmp_path):
    """The user's last line is the rank's own error line. DeepSpeed's per-node launcher followed it with
    `[ERROR] [launch.py:259:sigkill_handler] [<the rank's whole command line>] exits with return code = 1`
    (scripts/launch_common.sh, runner_output_filter, takes it out). And none of the runner's INFO lines shows
    (its commands, each with the rank's whole command line; on a CPU 'Setting CUDA_VISIBLE_DEVICES=0,1')."""
    status, lines = failing_launch(tmp_path, SAYS_WHY)
    assert status == 1 and lines.count("rank up") == 2, lines
    assert lines[-1] == "error: the reason, in our words", lines
    assert not [line for line in lines if "[INFO]" in line or "CUDA_VISIBLE_DEVICES" in line or "launch.py" in line]


def test_a_rank_killed_without_a_word_is_one_short_line(tmp_path):
    """A rank that could not say why it ended (killed by a signal: -9 is the out-of-memory killer's) gets one
    short line in place of the launcher's long one; the launch's status is the rank's."""
    status, lines = failing_launch(tmp_path, IS_KILLED)
    assert status == (-signal.SIGKILL) % 256 and lines.count("rank up") == 2, lines
    assert lines[-1] == "error: a rank was killed by signal 9 (DeepSpeed's launcher)", lines
    assert "exits with return code" not in "\n".join(lines)


def runner_output_filter(text: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", "source scripts/launch_common.sh; runner_output_filter"], input=text,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)


def test_the_filter_keeps_every_other_line_and_shortens_each_kind_of_rank_exit():
    """runner_output_filter on the line of deepspeed.launcher.launch (0.19.8, sigkill_handler) for each kind of
    status: 1, 2 and 3 (training/run_status.py: the rank printed why, or its stop line) go, other statuses and signals
    become one short line on stderr. Every other line passes as it is, a last line without a newline too."""
    exit_line = ("[2026-11-28 19:44:50,123] [ERROR] [launch.py:259:sigkill_handler] ['/venv/bin/python', '-u', "
                 "'./run_pretraining.py', '--max_steps=-1'] exits with return code = {}\n")
    other = "error: ours\nTraining Iteration: 3 exits with return code = 1\n"
    for status, shown in (("1", ""), ("2", ""), ("3", ""),
                          ("4", "error: a rank exited with status 4 (DeepSpeed's launcher)\n"),
                          ("-9", "error: a rank was killed by signal 9 (DeepSpeed's launcher)\n")):
        result = runner_output_filter(other + exit_line.format(status) + "partial")
        assert (result.returncode, result.stdout, result.stderr) == (0, other + "partial", shown), status


def test_deepspeeds_gather_shows_no_deprecation_line_and_other_warnings_still_show(tmp_path):
    script = ("import warnings, torch\nfrom training import distributed\n"
              "distributed.setup_device_and_distributed(distributed.Job(), use_hpu=False, no_cuda=True)\n"
              "out = torch.zeros(2)\n"
              "torch.distributed.all_gather_into_tensor(out, torch.ones(2))  # as DeepSpeed's comm falls through to\n"
              "warnings.warn('another deprecation', FutureWarning)\n"
              "print(out.tolist())\n"
              "torch.distributed.destroy_process_group()\n")  # not left to the exit, where gloo can abort
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(REPO_ROOT))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        env.pop(key, None)
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[1.0, 1.0]"  # the gather ran (a world of one)
    assert "all_gather_into_tensor` is deprecated" not in result.stderr
    assert "FutureWarning: another deprecation" in result.stderr


# ============================================================================ progress: tqdm's bar on a terminal only

PROGRESS_LINE = re.compile(r"(?P<desc>[a-z -]+): (?P<n>\d+)/(?P<total>\d+) \((?P<percent>\d+)%\), "
                           r"\d+\.\d s, \d+\.\d\d/s")


def progress_lines(text: str, desc: str) -> list:
    """(n, total, percent) of each ProgressLines line of `desc` in `text`."""
    return [(int(m["n"]), int(m["total"]), int(m["percent"])) for m in map(PROGRESS_LINE.fullmatch, text.splitlines())
            if m and m["desc"] == desc]


def test_progress_is_tqdms_bar_on_a_terminal_and_plain_lines_elsewhere():
    """On a terminal, tqdm's bar. In a file or a pipe, one line every `every` steps, at the last and at a stop in
    between (close); the first count is the resumed step's. Hidden: a disabled bar."""
    from tqdm import tqdm
    main_fd, terminal_fd = os.openpty()
    with os.fdopen(terminal_fd, "w") as terminal:
        bar = progress_display.progress_bar(True, 12, 2, "steps", 5, terminal)
        assert isinstance(bar, tqdm) and not bar.disable
        bar.close()
    os.close(main_fd)
    for steps, expected in ((9, [(5, 12, 42), (10, 12, 83), (11, 12, 92)]),  # a stop at 11
                            (10, [(5, 12, 42), (10, 12, 83), (12, 12, 100)])):
        log = io.StringIO()
        progress = progress_display.progress_bar(True, 12, 2, "steps", 5, log)
        for _ in range(steps):
            progress.update(1)
        progress.close()
        assert progress_lines(log.getvalue(), "steps") == expected
        assert len(log.getvalue().splitlines()) == len(expected)
    hidden = progress_display.progress_bar(False, 12, 2, "steps", 5, io.StringIO())
    assert isinstance(hidden, tqdm) and hidden.disable


@pytest.fixture(scope="module")
def pretraining_run(tmp_path_factory):
    """A 4-step tiny pretraining in this process, progress bar on (no --disable_progress_bar), logging every 2
    steps, stderr to a file as `python run_pretraining.py ... 2> log` gives it; (checkpoints directory, stderr)."""
    import run_pretraining
    work = tmp_path_factory.mktemp("noise_pretraining")
    helpers.write_synthetic_shards(work / "shards", [64])
    ds_config = helpers.write_ds_config(work / "ds.json")
    argv = helpers.driver_argv(work / "shards", work / "checkpoints", ds_config, max_steps=4, log_freq=2,
                               num_steps_per_checkpoint=4, disable_progress_bar=False)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the entry point's cli sets it
    with tempfile.TemporaryFile("w+") as log, contextlib.redirect_stderr(log):
        run_pretraining.main(argv)
        log.seek(0)
        return work / "checkpoints", log.read()


def test_pretraining_shows_progress_lines_in_a_file(pretraining_run):
    _, stderr = pretraining_run
    assert progress_lines(stderr, "steps") == [(2, 4, 50), (4, 4, 100)]
    assert "\r" not in stderr


def test_fine_tuning_shows_progress_lines_in_a_file(tmp_path, capsys, monkeypatch):
    """run_glue.py on 40 examples (2 whole batches of 16 an epoch, 3 epochs: 6 steps), logging every 2 steps, its
    stderr captured (not a terminal): lines for the training steps and the predictions, no bar."""
    import run_glue
    from modeling import BertConfig, BertForPreTraining
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    torch.save(BertForPreTraining(BertConfig.from_json_file(helpers.TINY_MODEL_CONFIG)).state_dict(),
               tmp_path / "weights.pt")
    argv = helpers.flags_to_argv({
        "task_name": "sst-2", "data_dir": data, "vocab_file": REPO_ROOT / "data" / "vocab.txt", "do_lower_case": True,
        "init_checkpoint": tmp_path / "weights.pt", "config_file": helpers.TINY_MODEL_CONFIG,
        "output_dir": tmp_path / "out", "do_train": True, "do_eval": True, "max_seq_length": 48,
        "train_batch_size": 16, "num_train_epochs": 3, "eval_batch_size": 4, "log_freq": 2, "no_cuda": True})
    run_glue.main(argv)  # not cli(): its exit-time destroy_process_group would spoil later in-process runs
    stderr = capsys.readouterr().err
    assert progress_lines(stderr, "fine-tuning steps") == [(2, 6, 33), (4, 6, 67), (6, 6, 100)]
    assert progress_lines(stderr, "predicting")[-1] == (3, 3, 100)  # 10 dev examples, batches of 4
    assert "\r" not in stderr


# ============================================================================ libraries' lines

def user_environment() -> dict:
    """The environment of a user's shell: no rank variables, no DS_ACCELERATOR, no KINETO_LOG_LEVEL."""
    env = helpers.checkout_env(helpers.environ_without_rank())
    for key in ("DS_ACCELERATOR", "KINETO_LOG_LEVEL"):
        env.pop(key, None)
    return env


def test_the_exports_show_no_deepspeed_accelerator_line(pretraining_run, tmp_path):
    """Both exports of a DeepSpeed checkpoint print their one `wrote ...` line and nothing else: DeepSpeed, imported
    for the checkpoint's classes, printed 'Setting accelerator to CPU. If you have GPU or other accelerator, we
    were unable to detect it.' (training/checkpoint_export.py, read_on_the_cpu)."""
    checkpoints, _ = pretraining_run
    for command in (["-m", "training.checkpointing", "export", "--output_dir", checkpoints, "--out", tmp_path / "w.pt"],
                    ["-m", "finetune.hf_interop", "export", "--checkpoint", checkpoints, "--vocab_file",
                     REPO_ROOT / "data" / "vocab.txt", "--do_lower_case", "--output_dir", tmp_path / "hf"]):
        result = subprocess.run([sys.executable, *map(str, command)], cwd=tmp_path, env=user_environment(),
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        assert result.stderr == "" and len(result.stdout.splitlines()) == 1, result.stdout + result.stderr
        assert result.stdout.startswith("wrote ")


def test_the_cpu_memory_peak_shows_no_profiler_lines():
    """bench/first_run.py's CPU memory peak (hardware.PeakAllocated, the torch profiler) printed kineto's
    `USDT: ... profiler_start` and `profiler_stop` lines."""
    script = ("import torch\nfrom training import hardware\n"
              "with hardware.PeakAllocated(torch.device('cpu')) as peak:\n    block = torch.ones(1000)\n"
              "print(peak.bytes)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=user_environment(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 4000  # the block was counted: the profiler ran
    assert "USDT" not in result.stderr and "profiler_st" not in result.stderr, result.stderr
