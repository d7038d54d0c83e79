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
from training import run_status, supervisor
from training.run_status import ExitStatus


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


def test_lines_of_ranks_printing_at_once_stay_whole():
    """Two unbuffered processes (as the deepspeed launcher starts ranks) that have called
    command_line.write_whole_lines (run_cli does) each print the same final error line on stderr and a checkpoint
    line on stdout 10,000 times, from the same instant, into one pipe: every line is one of the two, whole.
    (Without the call, plain print() under `python -u`:
    in a scratch run of two processes printing one line 20,000 times each into one pipe, 4,123 of the 40,000
    lines held two texts.)"""
    text = f"--input_dir /data: no shards{NO_RESTART_MARK}"
    start_at = time.time() + 10  # both have imported torch by then
    code = (f"import sys, time\nfrom training.command_line import write_whole_lines\nwrite_whole_lines()\n"
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
    expected = {f"error: {text}", "[run_pretraining] saved checkpoint 12"}
    broken = sorted(set(lines) - expected, key=len)
    assert not broken and len(lines) == 40000, (len(lines), broken[-1][:300] if broken else None)


# A stand-in for the `deepspeed` runner that plays the job's rank 0 with the real status file
# (training/run_status.py StatusFile). Attempt k (counted in a file) copies the hostfile it was given and its
# arguments, prints what the driver's ranks print (the driver's words, or with REWORD the same words in reverse
# order, its status message included), then plays PLAN[k] and exits with the status the job's would reach the
# supervisor with: "ok" (DONE), "fail" (saves checkpoint 4(k+1), rank 0 loses a peer: FAILED), "crash" (the
# same error from the same checkpoint every time), "hang" (rank 0 reports its end, then the runner does not
# exit), "vanish" (rank 0 reports nothing, its server lost; one of two connections of a stand-in pdsh ends, the
# other never), "stopped" (saves checkpoint 4(k+1) and stops on purpose at that step, as run_pretraining's
# --max_bad_steps does: NO_RESTART), "preempted" (saves checkpoint 4(k+1) and stops on request: STOPPED),
# "bad_input" (rank 0 loses its peer, which met a bad setting: rank 0 says FAILED, the peer's server
# NO_RESTART, and pdsh passes on the larger) or "host_input" (the same, but the peer's host lacks the data:
# FAILED on both).
STUB_RUNNER = textwrap.dedent("""\
    import json, subprocess, sys, time
    from pathlib import Path
    from training.run_status import ExitStatus, StatusFile
    log, plan = Path(LOG), PLAN
    attempt = len(list(log.glob("args_*")))
    args = sys.argv[1:]
    (log / f"args_{attempt}").write_text(json.dumps(args))
    (log / f"hosts_{attempt}").write_text(Path(args[args.index("--hostfile") + 1]).read_text())
    step = plan[min(attempt, len(plan) - 1)]
    checkpoint = str(4 * (attempt + 1))
    rank0 = StatusFile()
    rank0.place(JSON_SUMMARY)

    def words(text):
        return " ".join(reversed(text.split(" "))) if REWORD else text

    def say(*lines):
        for line in lines:
            print(words(line), file=sys.stderr, flush=True)

    def end(status, message=None, saved=None):
        rank0.saved(saved)
        if saved:
            say(f"10.0.0.1: [run_pretraining] saved checkpoint {saved}")
        if message:
            say(f"10.0.0.1: error: {message}{' [no restart]' if status == ExitStatus.NO_RESTART else ''}")
        rank0.ended(status, message and words(message))

    lost_peer = "rank 0 on n1 (10.0.0.1): the connection to rank 1 on n2 (10.0.0.2) broke"
    if step == "ok":
        end(ExitStatus.DONE)
        sys.exit(ExitStatus.DONE)
    if step == "crash":
        end(ExitStatus.FAILED, "shard_1_training.hdf5 is corrupt")
        sys.exit(ExitStatus.FAILED)
    if step == "stopped":
        end(ExitStatus.NO_RESTART, f"3 consecutive steps had a non-finite loss (--max_bad_steps 3); stopped at step "
            f"{checkpoint}", saved=checkpoint)
        sys.exit(ExitStatus.NO_RESTART)
    if step == "preempted":
        say(f"10.0.0.1: [run_pretraining] stop requested (SIGTERM/SIGINT): stopping after step {checkpoint}")
        end(ExitStatus.STOPPED, saved=checkpoint)
        sys.exit(ExitStatus.STOPPED)
    if step in ("bad_input", "host_input"):
        end(ExitStatus.FAILED, lost_peer)
        if step == "bad_input":
            say("10.0.0.2: error: rank 1 on n2: --steps_this_run must be -1 (no limit) or at least 1, got 0 "
                "[no restart]")
            sys.exit(ExitStatus.NO_RESTART)
        say("10.0.0.2: error: rank 1 on n2: --input_dir /data does not exist or is not a directory")
        sys.exit(ExitStatus.FAILED)
    if step == "vanish":
        say("10.0.0.2: [rank1]:[E ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout")
        subprocess.run([str(log.parent / "pdsh")])
        sys.exit(ExitStatus.FAILED)
    end(ExitStatus.FAILED, f"rank 0 on n1 (10.0.0.1): attempt {attempt} lost a peer", saved=checkpoint)
    if step == "hang":
        time.sleep(HANG_S)
    sys.exit(ExitStatus.FAILED)
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
                   ranks_found=0, stop_at_s=None, stop_on=None, reword=False):
    """Runs the supervisor over the stand-in runner; `signalled`, a list, receives the arguments of each
    signal_ranks call (the stand-in has no remote ranks to signal), which returns `ranks_found`. A stop is
    requested (as by SIGTERM's handler) `stop_at_s` seconds after the start, or during the signal_ranks call
    for `stop_on` ("KILL": while the leftovers of the last attempt are ended, before a restart). reword: the
    stand-in rewords all that the driver says."""
    signalled = [] if signalled is None else signalled

    def signal_ranks(*call):
        signalled.append(call)
        if call[3] == stop_on:
            job.request_stop(signal.SIGTERM, None)
        return ranks_found

    log = tmp_path / "log"
    log.mkdir(parents=True)
    runner = tmp_path / "deepspeed_stub.py"
    json_summary = tmp_path / "dllogger.json"
    runner.write_text(f"#!{sys.executable}\nLOG = {str(log)!r}\nPLAN = {plan!r}\nJSON_SUMMARY = {str(json_summary)!r}\n"
                      f"REWORD = {reword}\nHANG_S = {HANG_S}\n" + STUB_RUNNER)
    runner.chmod(0o755)
    # pdsh holding two ssh connections: one ends at once, the other (to a server that vanished) never
    (tmp_path / "pdsh").write_text(f"#!/bin/bash\nsleep 0.5 &\nsleep {HANG_S} &\nwait\n")
    (tmp_path / "pdsh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"10.0.0.{i + 1} slots=1\n" for i in range(nodes)) + "10.0.0.9 slots=1\n")
    settings = supervisor.SupervisorSettings(
        hostfile=hostfile, num_nodes=nodes, ngpu_per_node=1, master_port=29999,
        deepspeed_config=ds_config(tmp_path, total=total), data_dir=tmp_path, json_summary=json_summary,
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
    (["bad_input", "ok"], "rank 0 on n1 (10.0.0.1): the connection to rank 1 on n2 (10.0.0.2) broke")])
def test_a_deliberate_stop_or_bad_input_is_not_restarted(tmp_path, capsys, plan, last_error):
    """A run that stopped itself (--max_bad_steps) or met bad input would do so again: it exits NO_RESTART
    (run_pretraining.py's cli), also where only another server's ranks met it (pdsh passes on the largest
    status). The reason is rank 0's error, the status file's. Before, the stop was restarted until the budget
    ran out: the step in its line differs at each attempt, so it never failed "the same way"."""
    status, attempts, events = run_supervisor(tmp_path, plan, [{}])
    assert status == ExitStatus.NO_RESTART and len(attempts) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == ("error: supervisor: not restarting: the job exited with status 2 (NO_RESTART): bad input, or "
                       f"a run that stopped itself; a restart would meet it again; the job's last error: {last_error}")
    assert [(event["event"], event["reason"]) for event in events] == [("stop", last_error)]


def test_a_job_stopped_on_request_is_not_restarted(tmp_path, capsys):
    """Ranks that someone else stopped (a scheduler's SIGTERM to them): STOPPED, passed on, without a line."""
    status, attempts, events = run_supervisor(tmp_path, ["preempted", "ok"], [{}])
    assert status == ExitStatus.STOPPED and len(attempts) == 1 and events == []
    assert "supervisor" not in capsys.readouterr().err


def test_a_host_without_the_data_is_left_out_not_marked_final(tmp_path, capsys):
    """A directory missing on one server is not final (run_pretraining's HostInputError exits FAILED): the host
    check finds the server without its data and the job restarts on the others."""
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


GRACE_LINE = ("supervisor: the job has not ended 1 s after it began to (rank 0's end, or a server's connection): "
              "ending the runner")


def test_a_runner_that_does_not_exit_after_an_error_is_ended(tmp_path, monkeypatch, capsys):
    """Rank 0 reported its end in the status file, but the runner does not exit (pdsh waits for a server)."""
    monkeypatch.setattr(supervisor, "EXIT_GRACE_S", 1.0)
    status, attempts, _ = run_supervisor(tmp_path, ["hang", "ok"], [{}])
    assert status == 0 and len(attempts) == 2
    assert GRACE_LINE in capsys.readouterr().out


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
    assert GRACE_LINE in capsys.readouterr().out


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


def test_a_runner_that_does_not_exit_after_a_server_vanished_is_ended(tmp_path, monkeypatch, capsys):
    """Rank 0's server vanished (rank 0 reports nothing); the other servers' ranks ended, and with them their
    ssh connections, while pdsh waits for the lost one: the grace starts when the first connection ends. The
    reason is then the runner's status (the supervisor's SIGKILL)."""
    monkeypatch.setattr(supervisor, "EXIT_GRACE_S", 1.0)
    started = time.monotonic()
    status, attempts, events = run_supervisor(tmp_path, ["vanish", "ok"], [{}])
    assert time.monotonic() - started < HANG_S / 2
    assert status == 0 and len(attempts) == 2
    assert capsys.readouterr().out.count(GRACE_LINE) == 1
    assert [event["reason"] for event in events] == ["the job was killed by SIGKILL"]


# What the driver may say, against what the supervisor decides. Each scenario: the stand-in's plan, the host
# checks after each failed attempt, and the decisions: the supervisor's status, each attempt's hosts, and each
# restart or stop (event, the job's status, the checkpoint it resumes from or stopped at).
H1, H2, H3 = "10.0.0.1 slots=1", "10.0.0.2 slots=1", "10.0.0.3 slots=1"
DECISIONS = {
    "lost host": (["fail", "fail", "ok"], [{"10.0.0.2": ["gone"]}, {}],
                  (0, [[H1, H2, H3], [H1, H3], [H1, H2, H3]], [("restart", 1, "4"), ("restart", 1, "8")])),
    "stopped itself": (["stopped", "ok"], [{}], (2, [[H1, H2, H3]], [("stop", 2, "4")])),
    "bad input elsewhere": (["bad_input", "ok"], [{}], (2, [[H1, H2, H3]], [("stop", 2, None)])),
    "data missing on a host": (["host_input", "ok"], [{"10.0.0.2": ["no data"]}],
                               (0, [[H1, H2, H3], [H1, H3]], [("restart", 1, None)])),
    "preempted": (["preempted", "ok"], [{}], (3, [[H1, H2, H3]], [])),
    "repeating crash": (["crash"], [{}, {}], (1, [[H1, H2, H3]] * 3,
                                              [("restart", 1, None), ("restart", 1, None), ("stop", 1, None)])),
}


@pytest.mark.parametrize("reword", [False, True], ids=["as_printed", "reworded"])
def test_the_decisions_rest_on_exit_statuses_not_on_the_wording_of_any_message(tmp_path, reword):
    """Every line the driver's ranks print, and rank 0's message in the status file, reworded (each line's
    words in reverse order: "error: x [no restart]" becomes "restart] [no x error:", "saved checkpoint 4"
    becomes "4 checkpoint saved"): the supervisor restarts, stops and resumes exactly as with the driver's
    words. Only the exit statuses and the status file's checkpoint decide."""
    made = {}
    for name, (plan, checks, _) in DECISIONS.items():
        status, attempts, events = run_supervisor(tmp_path / name.replace(" ", "_"), plan, checks, reword=reword)
        made[name] = (status, [hosts for hosts, _ in attempts], [
            (event["event"], event["exit_status"], event.get("resume_from_checkpoint", event.get("checkpoint")))
            for event in events])
    assert made == {name: decisions for name, (_, _, decisions) in DECISIONS.items()}


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


# ============================================================================ the real driver, reworded (slow)
# The supervisor over the real `deepspeed` runner and 2 CPU ranks of run_pretraining.py on this machine (a
# hostfile of one host, so no ssh), every line the ranks print reworded (tests/reworded_rank.py). The host
# checks are given as data (none fails).

REWORDED_RANK = helpers.REPO_ROOT / "tests" / "reworded_rank.py"
# scenario: (driver flags, fault injection (tests/test_resume.py), the decisions as in DECISIONS). In "input one
# server may lack" both ranks meet a missing --init_checkpoint; the first to exit makes the per-node launcher
# SIGTERM the other, which reports the same error all the same (tests/test_driver.py: a SIGTERM while the rank
# imports torch).
REAL_DECISIONS = {
    "bad input": ({"steps_this_run": 0}, None, (2, 1, [("stop", 2, None)])),
    "input one server may lack": ({"init_checkpoint": "/nonexistent/checkpoint.pt"}, None,
                                  (1, 2, [("restart", 1, None), ("stop", 1, None)])),
    "stopped on request": ({}, "sigterm_at_engine_set_up:1:1", (3, 1, [])),
    "done": ({}, None, (0, 1, [])),
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", sorted(REAL_DECISIONS))
def test_the_real_driver_reworded_gets_the_same_decisions(tmp_path, tiny_shards, monkeypatch, capfd, scenario):
    flags, fault, (expected_status, expected_attempts, expected_events) = REAL_DECISIONS[scenario]
    for name, value in helpers.launcher_env(PYTHONUNBUFFERED="1", **({"FAULT_KILL": fault} if fault else {})).items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(helpers.REPO_ROOT)
    config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=False, micro=4, world=2)
    json_summary = tmp_path / "results" / "dllogger.json"
    json_summary.parent.mkdir()  # as the launchers make it
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    argv = helpers.driver_argv(tiny_shards, tmp_path / "checkpoints", config, json_summary=json_summary, max_steps=2,
                               resume_from_checkpoint=True, **flags)
    settings = supervisor.SupervisorSettings(
        hostfile=hostfile, num_nodes=1, ngpu_per_node=2, master_port=helpers.free_port(), deepspeed_config=config,
        data_dir=tiny_shards, json_summary=json_summary, max_restarts=2, restart_window_s=3600, min_hosts=1,
        ssh_timeout=5)
    (tmp_path / "work").mkdir()
    job = supervisor.Supervisor(settings, [str(helpers.VENV_BIN / "deepspeed"), "--no_ssh_check", "--num_gpus", "2",
                                           "--no_local_rank", str(REWORDED_RANK), *map(str, argv)],
                                tmp_path / "work", check_hosts=Recorder([{}] * 3), signal_ranks=lambda *call: 0)
    status = job.run()
    output = capfd.readouterr()
    events = [record["data"] for record in helpers.read_dllogger(json_summary) if record.get("step") == "SUPERVISOR"]
    assert (status, output.out.count("deepspeed --num_nodes 1"),
            [(event["event"], event["exit_status"], event.get("resume_from_checkpoint", event.get("checkpoint")))
             for event in events]) == (expected_status, expected_attempts, expected_events), output.err[-3000:]
    # The ranks' lines were reworded (no line of the driver's own words is left) and rank 0's status file was
    # written all the same.
    assert [line for line in output.err.splitlines() if line.startswith("error:")
            and not line.startswith("error: supervisor:")] == [] and "[no restart]" not in output.err
    assert run_status.read_status(run_status.status_path(json_summary))["exit_status"] == expected_status
