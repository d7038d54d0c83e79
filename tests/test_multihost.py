"""Jobs across hosts: real ssh, pdsh and `deepspeed --hostfile` between test hosts (tests/multihost.py).

Each host is a network namespace with its own sshd; the launcher runs on the first host, as a user runs it
on the first server. What a remote rank needs reaches it as it would on a cluster: the launchers run the
virtual environment's python by its absolute path, and `~/.deepspeed_env` (HOME is a test directory here)
carries OMP_NUM_THREADS and GLOO_SOCKET_IFNAME. Slow (~20-40 s per launch) and root only: without root,
`ip` or sshd the test_hosts fixture skips them with the reason.
"""

import os
import signal
import subprocess
import time

import pytest

import helpers
import multihost
from training.run_status import ExitStatus

pytestmark = pytest.mark.slow

SCRIPT_32X = helpers.REPO_ROOT / "scripts" / "run_bert_1.5b_32x.sh"
# What each remote rank needs that DeepSpeed's runner does not pass on by itself (it exports only
# PYTHON*, NCCL*, MV2*, UCX*, MLFLOW* variables and .deepspeed_env).
DEEPSPEED_ENV = f"OMP_NUM_THREADS=1\nGLOO_SOCKET_IFNAME={multihost.INTERFACE}\n"


@pytest.fixture(scope="module")
def job(tmp_path_factory, test_hosts):
    """Shards, a 2-rank DeepSpeed config (fp32, ZeRO-1), the 2-host hostfile and a HOME with .deepspeed_env."""
    return make_job(tmp_path_factory.mktemp("multihost_job"), test_hosts, hosts=2)


def make_job(root, test_hosts, hosts, gas=1):
    """A job on the first `hosts` test hosts, one rank each (global batch 4 x gas x hosts)."""
    helpers.write_synthetic_shards(root / "data", [24, 40, 17])
    home = root / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text(DEEPSPEED_ENV)
    return {"root": root, "data": root / "data", "home": home,
            "ds_config": helpers.write_ds_config(root / "ds.json", stage=1, bf16=False, micro=4, gas=gas, world=hosts),
            "hostfile": test_hosts.hostfile(root / "hostfile", hosts=hosts, slots=1)}


def launcher_env(hosts, job, results, nodes=2, ranks_per_node=1, **overrides):
    """The 32x launcher's overrides for a tiny CPU job, plus the test hosts' ssh."""
    variables = dict(HOME=str(job["home"]), HL_HOSTSFILE=str(job["hostfile"]), HL_NUM_NODES=str(nodes),
                     HL_NGPU_PER_NODE=str(ranks_per_node), HL_DEVICE="cpu", HL_DATA_DIR=str(job["data"]),
                     HL_MODEL_CONFIG=str(helpers.TINY_MODEL_CONFIG), HL_DS_CONFIG=str(job["ds_config"]),
                     HL_RESULTS_DIR=str(results), HL_LOG_FREQ="1", HL_MASTER_PORT=str(hosts.master_port))
    return hosts.env(helpers.launcher_env(**{**variables, **overrides}))


def run_launcher(hosts, env, *extra, host=0, timeout=300):
    command = hosts.command_on(host, ["bash", SCRIPT_32X, "--max_predictions_per_seq=5",
                                      f"--peak_tflops={helpers.TEST_PEAK_TFLOPS}", *extra])
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def losses(dllogger_json) -> dict:
    """{step: all_ranks_average_loss} of every run logged in the file (resumed runs append)."""
    return {r["step"][1]: r["data"]["all_ranks_average_loss"] for r in helpers.step_records(dllogger_json)}


def steps_of_each_run(dllogger_json) -> list:
    """The steps each run logged, one list per run (a run's records start with its PARAMETER records)."""
    runs = [[]]
    for record in helpers.read_dllogger(dllogger_json):
        if record.get("step") == "PARAMETER" and runs[-1]:
            runs.append([])
        elif record.get("type") == "LOG" and "step_loss" in record["data"]:
            runs[-1].append(record["step"][1])
    return runs


def test_two_hosts_through_the_32x_launcher_equal_one_host_and_resume(test_hosts, job):
    """2 hosts x 1 rank (pdsh/ssh, gloo over the hosts' network) against 1 host x 2 ranks of the same
    launcher and settings: the same per-step losses; the 2-host job stops at step 3 with a checkpoint and
    the same command continues it to step 6."""
    one_host = job["root"] / "one_host"
    run_launcher(test_hosts, launcher_env(test_hosts, job, one_host, nodes=1, ranks_per_node=2, HL_MAX_STEPS="6"),
                 host=2)  # a host of its own: the single-node launch uses the same master port
    expected = losses(one_host / "dllogger.json")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    two_hosts = job["root"] / "two_hosts"
    env = launcher_env(test_hosts, job, two_hosts, HL_MAX_STEPS="6", HL_RUN_STEPS="3")
    first = run_launcher(test_hosts, env)
    assert "preflight: 2 hosts answer over ssh" in first.stdout
    assert {"10.200.0.1:", "10.200.0.2:"} <= {line.split()[0] for line in first.stdout.splitlines() if line}
    assert (two_hosts / "checkpoints" / "latest").read_text().strip() == "3"
    run_launcher(test_hosts, env)  # the same command resumes
    assert steps_of_each_run(two_hosts / "dllogger.json") == [[1, 2, 3], [4, 5, 6]]
    assert losses(two_hosts / "dllogger.json") == expected
    assert (two_hosts / "checkpoints" / "latest").read_text().strip() == "6"


def test_plain_deepspeed_hostfile_equals_one_host_and_resumes(test_hosts, job, tmp_path):
    """`deepspeed --hostfile H --master_addr A run_pretraining.py ...`, as the reference's users launch."""
    flags = dict(max_steps=6, steps_this_run=3, log_freq=1, max_predictions_per_seq=5, resume_from_checkpoint=True)
    one = helpers.launch(helpers.driver_argv(job["data"], tmp_path / "one" / "out", job["ds_config"],
                                             json_summary=tmp_path / "one.json", **{**flags, "steps_this_run": -1}))
    assert one.returncode == 0, one.stderr[-4000:]
    argv = helpers.driver_argv(job["data"], tmp_path / "two" / "out", job["ds_config"],
                               json_summary=tmp_path / "two.json", **flags)
    command = test_hosts.command_on(0, [helpers.VENV_BIN / "deepspeed", "--hostfile", job["hostfile"],
                                        "--master_addr", test_hosts.addresses[0], "--master_port", "29610",
                                        "--no_local_rank", helpers.REPO_ROOT / "run_pretraining.py", *argv])
    env = test_hosts.env(helpers.launcher_env(HOME=str(job["home"])))
    for _ in range(2):  # the second, identical command resumes from the first one's checkpoint
        result = subprocess.run(command, env=env, cwd=helpers.REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert steps_of_each_run(tmp_path / "two.json") == [[1, 2, 3], [4, 5, 6]]
    assert losses(tmp_path / "two.json") == losses(tmp_path / "one.json")


def start_long_job(hosts, job, results, *extra, max_restarts=0):
    # HL_MAX_RESTARTS=0 by default: the job ends at the first failure, as the failure tests below expect
    # (restarts: tests/test_supervisor.py)
    env = launcher_env(hosts, job, results, HL_MAX_STEPS="60", HL_NUM_STEPS_PER_CP="5",
                       HL_MAX_RESTARTS=str(max_restarts))
    command = hosts.command_on(0, ["bash", SCRIPT_32X, "--max_predictions_per_seq=5",
                                   f"--peak_tflops={helpers.TEST_PEAK_TFLOPS}", *extra])
    log = open(results.parent / f"{results.name}.log", "w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return process, env, command


def steps_logged(dllogger_json) -> int:
    """Per-step records written so far (the file is being written: count, do not parse)."""
    return dllogger_json.read_text().count('"step_loss"') if dllogger_json.exists() else 0


def wait_for(condition, process, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, "the job ended early"
        assert time.monotonic() < deadline, "timed out waiting for the job"
        time.sleep(0.2)


def test_a_dead_rank_ends_the_job_in_time_and_a_resume_completes(test_hosts, job):
    """SIGKILL of the rank on host 2 mid-run: the rank on host 1 names it and the job ends with a non-zero
    status well within --collective_timeout_s; the same command then resumes from the last checkpoint."""
    results, timeout_s = job["root"] / "dead_rank", 30
    process, env, command = start_long_job(test_hosts, job, results, f"--collective_timeout_s={timeout_s}")
    try:
        wait_for(lambda: (results / "checkpoints" / "latest").exists(), process)
        [rank] = test_hosts.rank_pids(1)
        os.kill(rank, signal.SIGKILL)
        killed = time.monotonic()
        status = process.wait(timeout=timeout_s + 30)  # the assertion below is the real limit
        elapsed = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
    output = (results.parent / "dead_rank.log").read_text()
    print(f"the job ended {elapsed:.1f} s after the kill, status {status}")  # docs/results.md's figure (pytest -s)
    assert status != 0 and elapsed < timeout_s, (status, elapsed, output[-3000:])
    errors = [line for line in output.splitlines() if "error: rank 0 on" in line]
    assert len(errors) == 1 and "(10.200.0.1): the connection to rank 1 on" in errors[0] and "(10.200.0.2)" in errors[0]
    saved = int((results / "checkpoints" / "latest").read_text())
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert f"resumed from checkpoint {saved}:" in result.stdout
    assert steps_of_each_run(results / "dllogger.json")[-1] == list(range(saved + 1, 61))
    assert (results / "checkpoints" / "latest").read_text().strip() == "60"


def test_a_stalled_rank_is_reported_within_the_collective_timeout(test_hosts, job):
    """SIGSTOP of the rank on host 2 (it neither answers nor dies): the rank on host 1 gives up after
    --collective_timeout_s, in DeepSpeed's own process groups too (they ignored the timeout: 30 min), with
    the line naming the others. The frozen process itself must be ended from outside (docs/several-servers.md):
    SIGKILL.

    The timeout runs from the moment rank 0 starts waiting in the collective that gets no answer, which may
    come before the SIGSTOP: rank 0 may already be waiting for a rank 1 that lags (a busy CPU). Its last step
    record came before that wait, so the report comes at least the timeout after that record was written
    (the file's modification time), and at most the timeout and some slack after the SIGSTOP."""
    results, timeout_s = job["root"] / "stalled_rank", 10
    dllogger_json = results / "dllogger.json"
    process, _, _ = start_long_job(test_hosts, job, results, f"--collective_timeout_s={timeout_s}")
    log = results.parent / "stalled_rank.log"
    last_step = {"count": 0, "written": None}

    def reported() -> bool:
        """Whether rank 0 reported the stall; notes when its latest step record was written."""
        count = steps_logged(dllogger_json)
        if count > last_step["count"]:  # rank 0 writes each step record, flushed, before its next collective
            last_step.update(count=count, written=dllogger_json.stat().st_mtime)
        return "a collective got no answer" in log.read_text()

    try:
        wait_for(lambda: steps_logged(dllogger_json) >= 2, process)
        [rank] = test_hosts.rank_pids(1)
        os.kill(rank, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_for(reported, process, timeout=timeout_s + 30)
        elapsed, since_last_step = time.monotonic() - stopped, time.time() - last_step["written"]
        os.kill(rank, signal.SIGKILL)
        status = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    print(f"the stall was reported {elapsed:.1f} s after SIGSTOP, {since_last_step:.1f} s after the last step record")
    line = next(line for line in log.read_text().splitlines() if "a collective got no answer" in line)
    assert "error: rank 0 on" in line and f"within --collective_timeout_s {timeout_s} s" in line and "rank 1 on" in line
    assert since_last_step >= timeout_s and elapsed < timeout_s + 15 and status != 0, (since_last_step, elapsed)


def test_sigterm_to_the_launcher_stops_every_rank_on_every_host_with_a_checkpoint(test_hosts, job):
    """SIGTERM to the launcher on host 1 (training/supervisor.py, restarts on): it signals the ranks on both hosts
    over pdsh; they agree to stop after the same step, save it and exit STOPPED, and so does the launcher (no
    30 s SIGKILL, no lost save), without a restart."""
    results = job["root"] / "sigterm"
    process, _, _ = start_long_job(test_hosts, job, results, max_restarts=2)
    try:
        wait_for(lambda: steps_logged(results / "dllogger.json") >= 2, process)
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    output = (results.parent / "sigterm.log").read_text()
    assert status == ExitStatus.STOPPED, output[-3000:]
    assert output.count("deepspeed --num_nodes") == 1  # one attempt
    assert not any(line.startswith(("supervisor:", "error: supervisor:")) for line in output.splitlines())
    last = max(losses(results / "dllogger.json"))
    assert last < 60 and (results / "checkpoints" / "latest").read_text().strip() == str(last)
    assert {p.name for p in (results / "checkpoints" / str(last)).glob("state_*.pt")} == {"state_0.pt", "state_1.pt"}
    summary = [r["data"] for r in helpers.read_dllogger(results / "dllogger.json") if r.get("step") == []][-1]
    assert summary["stopped_by_signal"] is True
    assert not test_hosts.rank_pids(0) and not test_hosts.rank_pids(1)
