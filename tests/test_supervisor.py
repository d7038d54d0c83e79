"""training/supervisor.py: which hosts a restart uses, when it stops, what it reports, and its attempt loop.

The loop runs here against a stand-in `deepspeed` runner (a small script that plays a failure per attempt
and records the hostfile it was given), with the host checks given as data. The slow tests at the end run
the real thing across three namespace hosts (tests/multihost.py: sshd, pdsh, the `deepspeed` launcher).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import helpers
from common.errors import NO_RESTART_MARK
from test_multihost import SCRIPT_32X, launcher_env, make_job, wait_for
from test_resume import last_shard_of_first_epoch
from training import supervisor


def ds_config(tmp_path, micro=4, total=24):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": total, "train_micro_batch_size_per_gpu": micro}))
    return path


def test_usable_hosts_keep_the_global_batch_and_the_minimum(tmp_path):
    config = ds_config(tmp_path)  # 24 = 4 x accumulation x ranks: 1, 2, 3 or 6 ranks
    assert supervisor.usable_hosts(["a", "b", "c"], 1, config, 1) == ["a", "b", "c"]
    assert supervisor.usable_hosts(["a", "b", "c", "d", "e"], 1, config, 1) == ["a", "b", "c"]
    assert supervisor.usable_hosts(["a", "b", "c", "d", "e"], 2, config, 1) == ["a", "b", "c"]  # 6 ranks
    with pytest.raises(supervisor.SupervisorStop, match=r"^1 host\(s\) pass the checks, fewer than --min_hosts 2$"):
        supervisor.usable_hosts(["a"], 1, config, 2)
    with pytest.raises(supervisor.SupervisorStop, match=r"train_batch_size 24 is not a multiple of .* x world size 5: "
                                                        r"this global batch cannot be kept on 5 ranks, nor on fewer "
                                                        r"hosts down to --min_hosts 4$"):
        supervisor.usable_hosts(["a", "b", "c", "d", "e"], 1, config, 4)


def test_budget_counts_restarts_in_the_window_and_identical_failures():
    budget = supervisor.RestartBudget(max_restarts=2, window_s=100)
    lost = supervisor.Outcome(1, "rank 0: the connection to rank 1 broke", "10")
    assert budget.refusal(lost, now=0) is None
    assert budget.refusal(supervisor.Outcome(1, "rank 0: timed out", "20"), now=50) is None
    assert budget.refusal(supervisor.Outcome(1, "other", "30"), now=90) == (
        "2 restarts within the last 100 s (--max_restarts, --restart_window_s)")
    assert budget.refusal(supervisor.Outcome(1, "another", "40"), now=151) is None  # the restart at 0 left the window

    repeating = supervisor.RestartBudget(max_restarts=3, window_s=1e9)
    crash = supervisor.Outcome(1, "shard x is corrupt", "5")
    assert repeating.refusal(crash, now=0) is None and repeating.refusal(crash, now=1) is None
    assert repeating.refusal(crash, now=2) == "the job failed 3 times in a row the same way, from checkpoint 5"
    assert supervisor.resume_point(supervisor.Outcome(1)) == "the start (no checkpoint seen)"
    # The same error from a later checkpoint is progress, not a repeat; one restart allowed means one restart.
    again = supervisor.RestartBudget(max_restarts=3, window_s=1e9)
    assert again.refusal(crash, 0) is None and again.refusal(supervisor.Outcome(1, crash.reason, "6"), 1) is None
    assert supervisor.RestartBudget(1, 1e9).refusal(crash, 0) is None
    assert supervisor.RestartBudget(0, 1e9).refusal(crash, 0) == "restarts are off (--max_restarts 0)"


def test_output_watcher_takes_the_first_error_and_the_last_checkpoint():
    watcher = supervisor.OutputWatcher(checkpoint="3")
    for line in ["10.0.0.1: [run_pretraining] resumed from checkpoint 3: phase 1, step 3, 36 samples consumed",
                 "10.0.0.1: [run_pretraining] saved checkpoint 6",
                 "10.0.0.1: error: rank 0 on n1 (10.0.0.1): the connection to rank 1 on n2 (10.0.0.2) broke",
                 "10.0.0.3: error: rank 2 on n3 (10.0.0.3): the connection to rank 1 on n2 (10.0.0.2) broke",
                 "pdsh@n1: 10.0.0.2: ssh exited with exit code 255", "the terror: not an error line"]:
        watcher.note(line)
    assert watcher.reason == "rank 0 on n1 (10.0.0.1): the connection to rank 1 on n2 (10.0.0.2) broke"
    assert watcher.checkpoint == "6"
    assert supervisor.OutputWatcher().checkpoint is None
    watcher.note("10.0.0.2: error: rank 1 on n2: --steps_this_run must be -1 (no limit) or at least 1, got 0 "
                 "[no restart]")
    assert watcher.final == watcher.reason == ("rank 1 on n2: --steps_this_run must be -1 (no limit) or at least 1, "
                                               "got 0")


# DeepSpeed 0.19.8's per-node launcher (launch.py, sigkill_handler) and pdsh, as they print a rank's non-zero exit
LAUNCHER_EXIT = ("10.0.0.2: [2026-11-27 01:00:00,000] [ERROR] [launch.py:259:sigkill_handler] "
                 "['/venv/bin/python', '-u', './run_pretraining.py'] exits with return code = {}")
PDSH_EXIT = "pdsh@n1: 10.0.0.3: ssh exited with exit code {}"


def test_lines_of_ranks_printing_at_once_stay_whole_for_the_supervisor():
    """Two unbuffered processes (as the deepspeed launcher starts ranks) that have called
    runtime.write_whole_lines (run_cli does) each print the same final error line on stderr and a checkpoint
    line on stdout 10,000 times, from the same instant, into one pipe: every line is one of the two, whole,
    and the supervisor's watcher reads the error as final. (Without the call, plain print() under `python -u`:
    in a scratch run of two processes printing one line 20,000 times each into one pipe, 4,123 of the 40,000
    lines held two texts.)"""
    text = f"--input_dir /data: no shards{NO_RESTART_MARK}"
    start_at = time.time() + 10  # both have imported torch by then
    code = (f"import sys, time\nfrom training.runtime import write_whole_lines\nwrite_whole_lines()\n"
            f"while time.time() < {start_at}: pass\n"
            f"for _ in range(10000):\n"
            f"    print('error: ' + {text!r}, file=sys.stderr, flush=True)\n"
            f"    print('[run_pretraining] saved checkpoint 12', flush=True)")
    read_end, write_end = os.pipe()
    ranks = [subprocess.Popen([sys.executable, "-u", "-c", code], stdout=write_end, stderr=write_end,
                              env=helpers.checkout_env(), cwd=helpers.REPO_ROOT) for _ in range(2)]
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        lines = pipe.read().splitlines()
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    watcher = supervisor.OutputWatcher()
    for line in lines:
        watcher.note(line)
    assert watcher.final == text.removesuffix(NO_RESTART_MARK) and watcher.checkpoint == "12"
    expected = {f"error: {text}", "[run_pretraining] saved checkpoint 12"}
    broken = sorted(set(lines) - expected, key=len)
    assert not broken and len(lines) == 40000, (len(lines), broken[-1][:300] if broken else None)


def test_a_failed_rank_without_an_error_line_is_the_reason_and_an_error_line_wins():
    """Under NCCL a rank aborted by the watchdog prints NCCL's lines, not ours: the launcher's or pdsh's line
    about its exit is then the reason, without its time stamp (the same failure reads the same each time)."""
    assert supervisor.failure_sign(LAUNCHER_EXIT.format(-6)) == "a rank on 10.0.0.2 was killed by SIGABRT " \
                                                              "(DeepSpeed's launcher)"
    assert supervisor.failure_sign(LAUNCHER_EXIT.format(1)[len("10.0.0.2: "):]) == "a rank exited with status 1 " \
                                                                                  "(DeepSpeed's launcher)"
    assert supervisor.failure_sign(PDSH_EXIT.format(255)) == "the ssh to 10.0.0.3 exited with status 255 (pdsh)"
    for line in [LAUNCHER_EXIT.format(0), PDSH_EXIT.format(0), "10.0.0.1: [rank0]:[E ProcessGroupNCCL.cpp:616] "
                 "[Rank 0] Watchdog caught collective operation timeout", "10.0.0.2: exits with return code = 3"]:
        assert supervisor.failure_sign(line) is None, line
    watcher = supervisor.OutputWatcher()
    watcher.note("10.0.0.1: [rank0]:[E ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout")
    assert watcher.reason is None and watcher.failed_at is None
    watcher.note(LAUNCHER_EXIT.format(-6))
    watcher.note(PDSH_EXIT.format(255))
    assert watcher.reason == "a rank on 10.0.0.2 was killed by SIGABRT (DeepSpeed's launcher)"
    first_sign_at = watcher.failed_at
    assert first_sign_at is not None
    watcher.note("10.0.0.3: error: rank 2 on n3 (10.0.0.3): the connection to rank 1 on n2 (10.0.0.2) broke")
    assert watcher.reason == "rank 2 on n3 (10.0.0.3): the connection to rank 1 on n2 (10.0.0.2) broke"
    assert watcher.failed_at == first_sign_at  # the grace still counts from the first sign


# A stand-in for the `deepspeed` runner: attempt k (counted in a file) copies the hostfile it was given and
# its arguments, then plays PLAN[k]: "ok" (exit 0), "fail" (saves checkpoint 4k, prints a rank's error
# line and exits 1), "crash" (the same error from the same checkpoint every time), "hang" (an error line,
# then no exit), "abort" and "vanish" (no error line of ours: a rank's exit as DeepSpeed's launcher or
# pdsh reports it, then no exit, pdsh waiting for a server that vanished), "stopped" (saves checkpoint 4k
# and stops on purpose at step 4k, as run_pretraining's --max_bad_steps does), "bad_input" (rank 0 loses its
# peer, which met a bad setting: an error marked [no restart], after the first error line) or "host_input"
# (the same, but the peer's host lacks the data: not marked, the host check decides).
STUB_RUNNER = textwrap.dedent("""\
    import json, sys, time
    from pathlib import Path
    log, plan = Path(LOG), PLAN
    attempt = len(list(log.glob("args_*")))
    args = sys.argv[1:]
    (log / f"args_{attempt}").write_text(json.dumps(args))
    (log / f"hosts_{attempt}").write_text(Path(args[args.index("--hostfile") + 1]).read_text())
    step = plan[min(attempt, len(plan) - 1)]
    if step == "ok":
        sys.exit(0)
    if step == "crash":
        print("10.0.0.1: error: shard_1_training.hdf5 is corrupt", file=sys.stderr, flush=True)
        sys.exit(1)
    if step == "stopped":
        print(f"10.0.0.1: [run_pretraining] saved checkpoint {4 * (attempt + 1)}", flush=True)
        print(f"10.0.0.1: error: 3 consecutive steps had a non-finite loss (--max_bad_steps 3); stopped at step "
              f"{4 * (attempt + 1)} [no restart]", file=sys.stderr, flush=True)
        sys.exit(1)
    if step in ("bad_input", "host_input"):
        print("10.0.0.1: error: rank 0 on n1 (10.0.0.1): the connection to rank 1 on n2 (10.0.0.2) broke",
              file=sys.stderr, flush=True)
        print("10.0.0.2: error: rank 1 on n2: " + ("--steps_this_run must be -1 (no limit) or at least 1, got 0 "
              "[no restart]" if step == "bad_input" else "--input_dir /data does not exist or is not a directory"),
              file=sys.stderr, flush=True)
        sys.exit(1)
    if step in ("abort", "vanish"):
        print("10.0.0.2: [rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout",
              file=sys.stderr, flush=True)
        print(LAUNCHER_EXIT.format(-6) if step == "abort" else PDSH_EXIT.format(255), flush=True)
        time.sleep(HANG_S)
    print(f"10.0.0.1: [run_pretraining] saved checkpoint {4 * (attempt + 1)}", flush=True)
    print(f"10.0.0.1: error: rank 0 on n1 (10.0.0.1): attempt {attempt} lost a peer", file=sys.stderr, flush=True)
    if step == "hang":
        time.sleep(HANG_S)
    sys.exit(1)
    """)


HANG_S = 30  # a runner that "does not exit" exits after this: a supervisor that fails to end it is slow, not hung


class Recorder:
    """The host checks, played from a list: one {host: [problem lines]} per restart."""

    def __init__(self, results):
        self.results, self.calls = list(results), 0

    def __call__(self, hosts, data_dir, timeout):
        problems = {host.name: [] for host in hosts}
        problems.update(self.results[self.calls])
        self.calls += 1
        return problems


def run_supervisor(tmp_path, plan, checks, max_restarts=3, min_hosts=1, nodes=3, total=24, signalled=None,
                   ranks_found=0, stop_at_s=None, stop_on=None):
    """Runs the supervisor over the stand-in runner; `signalled`, a list, receives the arguments of each
    signal_ranks call (the stand-in has no remote ranks to signal), which returns `ranks_found`. A stop is
    requested (as by SIGTERM's handler) `stop_at_s` seconds after the start, or during the signal_ranks call
    for `stop_on` ("KILL": while the leftovers of the last attempt are ended, before a restart)."""
    signalled = [] if signalled is None else signalled

    def signal_ranks(*call):
        signalled.append(call)
        if call[3] == stop_on:
            job.request_stop(signal.SIGTERM, None)
        return ranks_found

    log = tmp_path / "log"
    log.mkdir(parents=True)
    runner = tmp_path / "deepspeed_stub.py"
    runner.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\nPLAN = {plan!r}\nLAUNCHER_EXIT = {LAUNCHER_EXIT!r}\n"
                      f"PDSH_EXIT = {PDSH_EXIT!r}\nHANG_S = {HANG_S}\n" + STUB_RUNNER)
    runner.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"10.0.0.{i + 1} slots=1\n" for i in range(nodes)) + "10.0.0.9 slots=1\n")
    settings = supervisor.SupervisorSettings(
        hostfile=hostfile, num_nodes=nodes, ngpu_per_node=1, master_port=29999,
        deepspeed_config=ds_config(tmp_path, total=total), data_dir=tmp_path, json_summary=tmp_path / "dllogger.json",
        max_restarts=max_restarts, restart_window_s=3600, min_hosts=min_hosts, ssh_timeout=5)
    job = supervisor.Supervisor(settings, [str(runner), "--no_python", "prog", "--flag"], tmp_path / "work",
                                check_hosts=Recorder(checks), signal_ranks=signal_ranks)
    (tmp_path / "work").mkdir()
    attempts = []
    if stop_at_s is not None:
        threading.Timer(stop_at_s, job.request_stop, (signal.SIGTERM, None)).start()
    status = job.run()
    for k in range(len(list(log.glob("args_*")))):
        attempts.append(((log / f"hosts_{k}").read_text().split("\n")[:-1],
                         json.loads((log / f"args_{k}").read_text())))
    events = [r["data"] for r in helpers.read_dllogger(settings.json_summary)] if settings.json_summary.exists() else []
    return status, attempts, events


def test_a_lost_host_is_left_out_then_taken_back(tmp_path, capsys):
    signalled = []
    status, attempts, events = run_supervisor(tmp_path, ["fail", "fail", "ok"], [
        {"10.0.0.2": ["host 10.0.0.2: ssh failed: Connection refused"]},  # after attempt 0
        {"10.0.0.3": ["host 10.0.0.3: no answer over ssh within 5 s"]},  # after attempt 1: 2 is back
    ], signalled=signalled)
    assert status == 0
    assert [hosts for hosts, _ in attempts] == [
        ["10.0.0.1 slots=1", "10.0.0.2 slots=1", "10.0.0.3 slots=1"],  # the job's hosts: not the spare 10.0.0.9
        ["10.0.0.1 slots=1", "10.0.0.3 slots=1"], ["10.0.0.1 slots=1", "10.0.0.2 slots=1"]]
    _, args = attempts[1]
    assert args[:8] == ["--num_nodes", "2", "--hostfile", args[3], "--master_addr", "10.0.0.1",
                        "--master_port", "29999"]
    assert args[8:] == ["--no_python", "prog", "--flag"]
    # Before each restart, leftover ranks on the next attempt's hosts are killed: found by the last attempt's
    # master address and the job's own port (scripts/signal_ranks.sh), not another job's.
    assert signalled == [(["10.0.0.1", "10.0.0.3"], "10.0.0.1", 29999, "KILL"),
                         (["10.0.0.1", "10.0.0.2"], "10.0.0.1", 29999, "KILL")]
    out = capsys.readouterr().out
    restarts = [line for line in out.splitlines() if line.startswith("supervisor: restart")]
    assert len(restarts) == 2
    assert "after: rank 0 on n1 (10.0.0.1): attempt 0 lost a peer; resuming from checkpoint 4 on 2 host(s) " \
           "10.0.0.1,10.0.0.3; left out: 10.0.0.2 (host 10.0.0.2: ssh failed: Connection refused); " \
           "back: none" in restarts[0]
    assert "resuming from checkpoint 8 on 2 host(s) 10.0.0.1,10.0.0.2; left out: 10.0.0.3 (host 10.0.0.3: no answer " \
           "over ssh within 5 s); back: 10.0.0.2" in restarts[1]
    assert [(e["event"], e["restart"], e["resume_from_checkpoint"], e["hosts"], list(e["hosts_left"]), e["hosts_back"])
            for e in events] == [("restart", 1, "4", ["10.0.0.1", "10.0.0.3"], ["10.0.0.2"], []),
                                 ("restart", 2, "8", ["10.0.0.1", "10.0.0.2"], ["10.0.0.3"], ["10.0.0.2"])]


def test_a_repeating_crash_stops_after_n_attempts_with_its_reason(tmp_path, capsys):
    status, attempts, events = run_supervisor(tmp_path, ["crash"], [{}, {}, {}], max_restarts=2)
    assert status == 1 and len(attempts) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("error: supervisor: not restarting: the job failed 2 times in a row the same way, from "
                       "the start (no checkpoint seen); the job's last error: shard_1_training.hdf5 is corrupt")
    assert events[-1]["event"] == "stop" and events[-1]["reason"] == "shard_1_training.hdf5 is corrupt"


@pytest.mark.parametrize("plan, last_error", [
    (["stopped", "ok"], "3 consecutive steps had a non-finite loss (--max_bad_steps 3); stopped at step 4"),
    (["bad_input", "ok"], "rank 1 on n2: --steps_this_run must be -1 (no limit) or at least 1, got 0")])
def test_a_deliberate_stop_or_bad_input_is_not_restarted(tmp_path, capsys, plan, last_error):
    """A run that stopped itself (--max_bad_steps) or met bad input would do so again: its error line ends
    with [no restart] (run_pretraining.py's cli). Before, the stop was restarted until the budget ran out: the
    step in its line differs at each attempt, so it never failed "the same way"."""
    status, attempts, events = run_supervisor(tmp_path, plan, [{}])
    assert status == 1 and len(attempts) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("error: supervisor: not restarting: the job's error is marked [no restart] (bad input, or a "
                       f"run that stopped itself): a restart would meet it again; the job's last error: {last_error}")
    assert [(event["event"], event["reason"]) for event in events] == [("stop", last_error)]


def test_a_host_without_the_data_is_left_out_not_marked_final(tmp_path, capsys):
    """A directory missing on one server is not marked [no restart] (run_pretraining's HostInputError): the
    host check finds the server without its data and the job restarts on the others."""
    status, attempts, events = run_supervisor(tmp_path, ["host_input", "ok"],
                                              [{"10.0.0.2": ["data directory /data does not exist"]}])
    assert status == 0 and len(attempts) == 2
    assert [hosts for hosts, _ in attempts] == [["10.0.0.1 slots=1", "10.0.0.2 slots=1", "10.0.0.3 slots=1"],
                                                ["10.0.0.1 slots=1", "10.0.0.3 slots=1"]]
    assert [event["event"] for event in events] == ["restart"]


def test_too_few_hosts_or_no_batch_split_stop_with_one_line(tmp_path, capsys):
    status, attempts, _ = run_supervisor(tmp_path / "few", ["fail"], [{"10.0.0.2": ["x"], "10.0.0.3": ["y"]}],
                                         min_hosts=2)
    assert status == 1 and len(attempts) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "error: supervisor: not restarting: 1 host(s) pass the checks, fewer than --min_hosts 2; the job's last error: "
        "rank 0 on n1 (10.0.0.1): attempt 0 lost a peer")
    # 4 hosts, global batch 16 = 4 x 1 x 4: 3 hosts cannot keep it, 2 can (accumulation 2)
    status, attempts, events = run_supervisor(tmp_path / "split", ["fail", "ok"], [{"10.0.0.4": ["gone"]}],
                                              nodes=4, total=16)
    assert status == 0 and [len(hosts) for hosts, _ in attempts] == [4, 2]
    assert events[0]["hosts_left"] == {"10.0.0.3": "passes, but the global batch needs fewer hosts",
                                       "10.0.0.4": "gone"}


def test_a_runner_that_does_not_exit_after_an_error_is_ended(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(supervisor, "EXIT_GRACE_S", 1.0)
    status, attempts, _ = run_supervisor(tmp_path, ["hang", "ok"], [{}])
    assert status == 0 and len(attempts) == 2
    assert "supervisor: the job has not ended 1 s after its error: ending the runner" in capsys.readouterr().out


def test_a_runner_that_does_not_exit_after_an_error_is_ended_after_a_stop_request_too(tmp_path, monkeypatch, capsys):
    """SIGTERM while pdsh waits for a server that vanished: the ranks were signalled (signal_ranks found
    some), the runner never ends by itself. The grace used to be off once a stop was requested: a hang."""
    monkeypatch.setattr(supervisor, "EXIT_GRACE_S", 1.0)
    signalled = []
    started = time.monotonic()
    status, attempts, events = run_supervisor(tmp_path, ["hang", "ok"], [{}], signalled=signalled, ranks_found=1,
                                              stop_at_s=0.3)
    assert time.monotonic() - started < HANG_S / 2
    assert status == -signal.SIGKILL and len(attempts) == 1 and events == []  # stopped: no restart
    assert [call[3] for call in signalled] == ["TERM"]
    assert "supervisor: the job has not ended 1 s after its error: ending the runner" in capsys.readouterr().out


def test_a_stop_while_a_restart_is_prepared_starts_no_attempt(tmp_path, capsys):
    """SIGTERM while the leftovers of the failed attempt are ended (after the host checks): no new attempt, no
    restart line or record. It used to say "restart 1" and start a runner that was SIGTERMed at once (-15)."""
    signalled = []
    status, attempts, events = run_supervisor(tmp_path, ["fail", "ok"], [{}], signalled=signalled, stop_on="KILL")
    assert status == 1 and len(attempts) == 1
    assert [call[3] for call in signalled] == ["KILL"]
    captured = capsys.readouterr()
    assert "supervisor: restart" not in captured.out
    assert captured.err.splitlines()[-1] == (
        "error: supervisor: not restarting: a stop was requested (SIGTERM/SIGINT) while the restart was prepared; "
        "the job's last error: rank 0 on n1 (10.0.0.1): attempt 0 lost a peer")
    assert [(event["event"], event["exit_status"]) for event in events] == [("stop", 1)]


def test_a_runner_that_does_not_exit_after_a_rank_failed_without_an_error_line_is_ended(tmp_path, monkeypatch,
                                                                                         capsys):
    """A rank aborted by NCCL's watchdog (SIGABRT) prints none of our error lines, and pdsh then waits for a
    server that vanished: the grace starts at the launcher's or pdsh's line, which is the restart's reason."""
    monkeypatch.setattr(supervisor, "EXIT_GRACE_S", 1.0)
    status, attempts, events = run_supervisor(tmp_path, ["abort", "vanish", "ok"], [{}, {}])
    assert status == 0 and len(attempts) == 3
    out = capsys.readouterr().out
    assert out.count("supervisor: the job has not ended 1 s after its error: ending the runner") == 2
    assert [event["reason"] for event in events] == [
        "a rank on 10.0.0.2 was killed by SIGABRT (DeepSpeed's launcher)",
        "the ssh to 10.0.0.3 exited with status 255 (pdsh)"]


def test_bad_arguments_are_one_line(tmp_path):
    base = [sys.executable, "-m", "training.supervisor", "--hostfile", str(tmp_path / "none"),
            "--num_nodes", "2", "--ngpu_per_node", "1", "--deepspeed_config", "x", "--data_dir", ".",
            "--json_summary", "j"]
    result = subprocess.run([*base, "--min_hosts", "3", "--", "deepspeed"], cwd=helpers.REPO_ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].endswith(
        "--min_hosts must be between 1 and --num_nodes 2, got 3")
    result = subprocess.run([*base, "--", "deepspeed"], capture_output=True, text=True)
    assert result.returncode == 1 and result.stderr.strip() == (
        f"error: supervisor: hostfile {tmp_path / 'none'}: No such file or directory")


def test_help_needs_no_deepspeed_command():
    """--help used to be refused for the missing '-- deepspeed ...' part; without --help that part is still
    required (after the flags' own errors)."""
    command = [sys.executable, "-m", "training.supervisor"]
    shown = subprocess.run([*command, "--help"], cwd=helpers.REPO_ROOT, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.startswith("usage: supervisor.py [options] -- deepspeed")
    assert "--max_restarts" in shown.stdout and not shown.stderr
    flags = ["--hostfile", "h", "--num_nodes", "2", "--ngpu_per_node", "1", "--deepspeed_config", "x",
             "--data_dir", ".", "--json_summary", "j"]
    refused = subprocess.run([*command, *flags], cwd=helpers.REPO_ROOT, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].endswith(
        "error: give the deepspeed command after '--'")


# ============================================================================ on namespace hosts (slow)
# Three test hosts with real sshd, pdsh and the `deepspeed` launcher (tests/multihost.py, root only), one rank
# each, through run_bert_1.5b_32x.sh as a user runs it on the first server.

TIMEOUT_S = 10  # --collective_timeout_s of these jobs


@pytest.fixture(scope="module")
def job3(tmp_path_factory, test_hosts):
    """test_multihost's job on 3 hosts, global batch 24 (micro-batch 4: accumulation 2 on 3 ranks, 3 on 2)."""
    return make_job(tmp_path_factory.mktemp("supervised_job"), test_hosts, hosts=3, gas=2)


def start_supervised(hosts, job, results, *extra, nodes=3, **overrides):
    env = launcher_env(hosts, job, results, nodes=nodes, **{"HL_MAX_STEPS": "60", "HL_NUM_STEPS_PER_CP": "5",
                                                            "HL_MAX_RESTARTS": "2", "HL_MIN_HOSTS": "2", **overrides})
    log = results.parent / f"{results.name}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(hosts.command_on(0, ["bash", SCRIPT_32X, "--max_predictions_per_seq=5",
                                                        f"--collective_timeout_s={TIMEOUT_S}",
                                                        f"--peak_tflops={helpers.TEST_PEAK_TFLOPS}", *extra]),
                                   env=env, stdout=out, stderr=subprocess.STDOUT)
    return process, log


def runs_of(dllogger_json) -> list:
    """{step: all-ranks loss} of each run in the stream (a run's records start with its PARAMETER records)."""
    runs = [{}]
    for record in helpers.read_dllogger(dllogger_json):
        if record.get("step") == "PARAMETER" and runs[-1]:
            runs.append({})
        elif record.get("type") == "LOG" and "step_loss" in record["data"]:
            runs[-1][record["step"][1]] = record["data"]["all_ranks_average_loss"]
    return runs


def latest(results) -> int:
    path = results / "checkpoints" / "latest"
    return int(path.read_text()) if path.exists() else 0


@pytest.mark.slow
def test_lost_hosts_are_left_out_and_taken_back_and_the_losses_match_a_resume_by_hand(test_hosts, job3):
    """(a) host 2 lost (every process in it killed, its ranks included) after a checkpoint: the job goes on
    with hosts 1 and 3; (c) host 2 comes back; (b) host 3's link is set down inside its namespace: detected
    within --collective_timeout_s, and the job finishes --max_steps on hosts 1 and 2. The losses after the
    first restart equal those of the same launcher resumed by hand from that checkpoint on hosts 1 and 3."""
    results = job3["root"] / "lost"
    process, log = start_supervised(test_hosts, job3, results)
    try:
        wait_for(lambda: latest(results) > 0, process)
        test_hosts.lose(1)                                              # (a)
        wait_for(lambda: "supervisor: restart 1 " in log.read_text(), process)
        first = latest(results)
        test_hosts.restart_sshd(1)                                      # (c)
        wait_for(lambda: latest(results) > first, process)
        errors_before = log.read_text().count("error: rank")
        test_hosts.set_link(2, up=False)                                # (b)
        down = time.monotonic()
        wait_for(lambda: log.read_text().count("error: rank") > errors_before, process, timeout=TIMEOUT_S + 30)
        detected = time.monotonic() - down
        status = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
        test_hosts.set_link(2, up=True)  # the hosts are the session's: leave them as they were
        if not test_hosts.pids(test_hosts.namespaces[1]):
            test_hosts.restart_sshd(1)
    output = log.read_text()
    print(f"the lost link was detected {detected:.1f} s after it went down")  # pytest -s
    assert status == 0, output[-4000:]
    assert detected < TIMEOUT_S + 5
    restarts = [line for line in output.splitlines() if line.startswith("supervisor: restart")]
    assert len(restarts) == 2, output[-4000:]
    assert (f"resuming from checkpoint {first} on 2 host(s) 10.200.0.1,10.200.0.3; left out: 10.200.0.2 "
            "(host 10.200.0.2: ssh failed" in restarts[0] and restarts[0].endswith("back: none"))
    assert ("on 2 host(s) 10.200.0.1,10.200.0.2; left out: 10.200.0.3 (host 10.200.0.3:" in restarts[1]
            and restarts[1].endswith("back: 10.200.0.2"))
    assert "a collective got no answer within --collective_timeout_s 10 s" in restarts[1]
    events = [r for r in helpers.read_dllogger(results / "dllogger.json") if r.get("step") == "SUPERVISOR"]
    assert [(e["data"]["resume_from_checkpoint"], e["data"]["hosts"], e["data"]["hosts_back"]) for e in events] == [
        (str(first), ["10.200.0.1", "10.200.0.3"], []), (events[1]["data"]["resume_from_checkpoint"],
                                                          ["10.200.0.1", "10.200.0.2"], ["10.200.0.2"])]
    runs = runs_of(results / "dllogger.json")
    assert len(runs) == 3 and max(runs[2]) == 60 and latest(results) == 60
    assert min(runs[1]) == first + 1 and min(runs[2]) == int(events[1]["data"]["resume_from_checkpoint"]) + 1

    # By hand: the checkpoint of the first restart, resumed by the same launcher on hosts 1 and 3.
    by_hand = job3["root"] / "by_hand"
    shutil.copytree(results / "checkpoints" / str(first), by_hand / "checkpoints" / str(first))
    (by_hand / "checkpoints" / "latest").write_text(str(first))
    two_hosts = job3["root"] / "hosts_1_3"
    two_hosts.write_text("10.200.0.1 slots=1\n10.200.0.3 slots=1\n")
    manual, manual_log = start_supervised(test_hosts, dict(job3, hostfile=two_hosts), by_hand, nodes=2)
    assert manual.wait(timeout=300) == 0, manual_log.read_text()[-4000:]
    [reference] = runs_of(by_hand / "dllogger.json")
    assert sorted(reference) == list(range(first + 1, 61))
    for run in runs[1:]:
        assert run == {step: reference[step] for step in run}  # exact: fp32, per-tensor LANS, world size 2
    assert not any(test_hosts.rank_pids(host) for host in range(3))


@pytest.mark.slow
def test_an_unreadable_shard_stops_the_job_after_n_attempts_with_its_reason(test_hosts, job3):
    """(d) A shard that cannot be read, met at the end of the first epoch, after a checkpoint: the job fails
    at the same step from the same checkpoint every time, and the supervisor stops after HL_MAX_RESTARTS=2
    attempts with the reason. (e), SIGTERM to the supervisor: test_multihost.py's SIGTERM test runs with
    restarts on."""
    data = job3["root"] / "bad_data"
    helpers.write_synthetic_shards(data, [24, 40, 17])
    bad = last_shard_of_first_epoch(data, seed=12439)  # the launchers' seed
    helpers.corrupt_first_chunk(bad)
    crash = job3["root"] / "crash"
    # A window of a few samples: the bad shard is met after some steps, not at start-up.
    process, log = start_supervised(test_hosts, dict(job3, data=data), crash, "--data_memory_budget_mb=0.01",
                                    HL_NUM_STEPS_PER_CP="2")
    status = process.wait(timeout=400)
    output = log.read_text()
    assert status != 0, output[-4000:]
    assert output.count("deepspeed --num_nodes") == 2 and output.count("supervisor: restart 1 ") == 1
    last = output.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: supervisor: not restarting: the job failed 2 times in a row the same way, from "
                        rf"checkpoint [1-9]\d*; the job's last error: {re.escape(str(bad))}: cannot read samples .*",
                        last)
    assert not any(test_hosts.rank_pids(host) for host in range(3))
