#!/usr/bin/env python
"""Runs a pretraining job across servers under DeepSpeed's `deepspeed` launcher, and restarts it on the
servers that remain when it fails.

    python -m training.supervisor --hostfile scripts/hostsfile --num_nodes 4 --ngpu_per_node 8 --master_port 29500 \
        --deepspeed_config DS.json --data_dir DATA --json_summary results/dllogger.json \
        --max_restarts 3 --restart_window_s 21600 --min_hosts 2 \
        -- deepspeed --num_gpus 8 --no_local_rank --no_python /venv/bin/python -u ./run_pretraining.py ...

The launchers for several servers run it (scripts/launch_common.sh, HL_MAX_RESTARTS etc.). It runs on the
launching server only. Each attempt is the command after `--` with `--num_nodes K --hostfile F
--master_addr A --master_port P` put after `deepspeed`: F lists the attempt's K hosts, A is the first of them.
It decides from the attempt's exit status and the run's status file alone, never from the wording of what
the ranks print, which it passes through (training/run_status.py: the statuses, and how a rank's reaches it).
When an attempt exits with another status than DONE or STOPPED (a rank died, a collective timed out, a host
became unreachable):
- every host of the job (the first --num_nodes of the hostfile) is checked with the preflight's checks
  (training/hosts.py: ssh, the same code, Python and pinned packages, the data directory);
- the next attempt runs on the hosts that pass, as many of them as keep the DeepSpeed config's global batch
  (the accumulation steps adapt), resuming from the last checkpoint; a host that passes again is back;
- it stops, with one `error: supervisor:` line, when the status is NO_RESTART (bad input, or a run that
  stopped itself), when fewer than --min_hosts hosts can be used, when --max_restarts restarts were made
  within --restart_window_s seconds, or when the job failed --max_restarts times in a row the same way (the
  same status and rank 0's same error, from the same checkpoint).
The status file names the last checkpoint and rank 0's error, for the reports. Each restart is one
`supervisor:` line on stdout and a record (step "SUPERVISOR") in the dllogger stream.
SIGTERM/SIGINT: the ranks on every host of the attempt are signalled (scripts/signal_ranks.sh over pdsh):
they save a checkpoint and exit STOPPED, and so does the supervisor; nothing is restarted. Between two
attempts (the last one failed) it starts none: one `error: supervisor:` line, and the failed attempt's status.
"""

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import TypeAlias

from common.deepspeed_config import DeepSpeedConfigError, read_batch_arithmetic
from common.errors import InputError
from training.hosts import REPO_ROOT, Host, hosts_for_job, parse_hostfile, problems_by_host
from training.run_status import ExitStatus, RunStatus, read_status, status_path

try:
    import dllogger
except ImportError:  # NVIDIA's package is not on PyPI; the fallback has the same API subset
    from training import dllogger_fallback as dllogger

# After the first sign that an attempt ends (rank 0 reported its end, or a server's connection ended), the time
# the runner has to exit before it is ended: pdsh waits for every ssh connection, and one to a server that
# vanished may never end (without ServerAliveInterval in ssh's config).
EXIT_GRACE_S = 60.0
POLL_S = 0.2


# problems_by_host's signature: (the job's hosts, data directory, ssh timeout) -> {host name: its problems}
CheckHosts: TypeAlias = Callable[[list[Host], str | os.PathLike[str], float], dict[str, list[str]]]
# signal_ranks's signature: (host names, master address, master port, signal name) -> ranks signalled
SignalRanks: TypeAlias = Callable[[list[str], str, int, str], int]


class SupervisorStop(Exception):
    """The supervisor gives up; its text is the one line saying why."""


@dataclass
class Outcome:
    """How an attempt ended: its exit status, and what the run's status file says of it."""
    status: int
    reason: str | None = None       # rank 0's error (the status file's message), when this attempt wrote one
    checkpoint: str | None = None   # the last checkpoint the run saved or resumed from, in this or an earlier attempt


def exit_status_text(status: int) -> str:
    if status < 0:
        try:
            return f"was killed by {signal.Signals(-status).name}"
        except ValueError:
            pass
    try:
        return f"exited with status {status} ({ExitStatus(status).name})"
    except ValueError:
        return f"exited with status {status}"


def pdsh_connections(pid: int) -> set[int]:
    """The processes that a pdsh below process `pid` runs: its ssh connections, one per server (Linux /proc)."""
    children: dict[int, list[tuple[int, str]]] = collections.defaultdict(list)  # parent pid -> [(pid, name)]
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process has ended
            continue
        name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        children[int(fields[1])].append((int(stat.parent.name), name))
    connections: set[int] = set()
    below = [pid]
    while below:
        for child, name in children[below.pop()]:
            below.append(child)
            if name == "pdsh":
                connections.update(grandchild for grandchild, _ in children[child])
    return connections


class EndWatch:
    """When an attempt began to end, read without its output: rank 0 wrote its end into the status file (after
    `before`, the file's content when the attempt started), or one of pdsh's connections ended."""

    def __init__(self, status_file: Path, before: RunStatus | None) -> None:
        self.status_file, self.before = status_file, before
        self.connections: set[int] = set()
        self.started_to_end: float | None = None

    def status(self) -> RunStatus | None:
        """The status file as this attempt wrote it; None when it has not (yet)."""
        status = read_status(self.status_file)
        return status if status is not None and status != self.before else None

    def check(self, runner_pid: int) -> None:
        if self.started_to_end is not None:
            return
        now = pdsh_connections(runner_pid)
        status = self.status()
        if (status is not None and status["ended"] is not None) or self.connections - now:
            self.started_to_end = time.monotonic()
        self.connections |= now


class RestartBudget:
    """At most max_restarts restarts within window_s seconds, and no restart after max_restarts identical
    failures in a row (the same error from the same checkpoint: bad data or a bug, not a lost server)."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts, self.window_s = max_restarts, window_s
        self.restart_times: collections.deque[float] = collections.deque()
        self.last_failure: tuple[int, str | None, str | None] | None = None  # (status, reason, checkpoint)
        self.repeats = 0

    def refusal(self, outcome: Outcome, now: float) -> str | None:
        """Why the job must not be restarted after `outcome` (None: restart), counting it as a failure."""
        failure = (outcome.status, outcome.reason, outcome.checkpoint)
        self.repeats = self.repeats + 1 if failure == self.last_failure else 1
        self.last_failure = failure
        if self.max_restarts == 0:
            return "restarts are off (--max_restarts 0)"
        if self.repeats >= max(2, self.max_restarts):
            return f"the job failed {self.repeats} times in a row the same way, from {resume_point(outcome)}"
        while self.restart_times and now - self.restart_times[0] > self.window_s:
            self.restart_times.popleft()
        if len(self.restart_times) >= self.max_restarts:
            return (f"{len(self.restart_times)} restarts within the last {self.window_s:g} s "
                    "(--max_restarts, --restart_window_s)")
        self.restart_times.append(now)
        return None


def resume_point(outcome: Outcome) -> str:
    return f"checkpoint {outcome.checkpoint}" if outcome.checkpoint else "the start (no checkpoint seen)"


def usable_hosts(passing: list[str], ngpu_per_node: int, ds_config: str | os.PathLike[str],
                 min_hosts: int) -> list[str]:
    """The first K of the hosts that passed, K the most (at least min_hosts) that keep the global batch."""
    if len(passing) < min_hosts:
        raise SupervisorStop(f"{len(passing)} host(s) pass the checks, fewer than --min_hosts {min_hosts}")
    first_error = None
    for count in range(len(passing), min_hosts - 1, -1):
        try:
            read_batch_arithmetic(ds_config, count * ngpu_per_node)
            return passing[:count]
        except DeepSpeedConfigError as err:
            first_error = first_error or err
    raise SupervisorStop(f"{first_error}, nor on fewer hosts down to --min_hosts {min_hosts}")


def signal_ranks(hosts: list[str], master_addr: str, master_port: int, signal_name: str) -> int:
    """Send a signal to a job's ranks (found by master address and port) on `hosts`; returns how many were
    signalled."""
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "signal_ranks.sh"), "--hosts", ",".join(hosts),
                             master_addr, str(master_port), signal_name], capture_output=True, text=True)
    return int(result.stdout.strip() or 0)


@dataclass(frozen=True, kw_only=True)
class SupervisorSettings:
    """What the supervisor follows: the values of its flags (main builds it from the command line)."""
    hostfile: str | Path          # the job's hosts are its first num_nodes
    num_nodes: int
    ngpu_per_node: int            # ranks per host
    master_port: int              # the rendezvous port on each attempt's first host
    deepspeed_config: str | Path  # its global batch decides the usable host counts
    data_dir: str | Path          # checked on every host before a restart
    json_summary: str | Path      # the job's dllogger stream; restart and stop events are added to it
    max_restarts: int             # 0: no restart
    restart_window_s: float
    min_hosts: int
    ssh_timeout: float            # seconds each host has to answer the checks


class Supervisor:
    def __init__(self, settings: SupervisorSettings, command: list[str], workdir: str | os.PathLike[str],
                 check_hosts: CheckHosts = problems_by_host, signal_ranks: SignalRanks = signal_ranks) -> None:
        self.settings, self.command, self.workdir = settings, command, Path(workdir)
        self.check_hosts, self.signal_ranks = check_hosts, signal_ranks  # seams: the tests give stand-ins
        self.job_hosts = hosts_for_job(parse_hostfile(settings.hostfile), settings.num_nodes, settings.ngpu_per_node,
                                       settings.hostfile)
        self.budget = RestartBudget(settings.max_restarts, settings.restart_window_s)
        self.status_file = status_path(settings.json_summary)
        self.stop_requests = self.stops_forwarded = 0

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requests += 1  # acted on by the loop in run_attempt (no subprocess inside a handler)

    # ---------------------------------------------------------------- main loop
    def run(self) -> int:
        hosts = [host.name for host in self.job_hosts]
        checkpoint: str | None = None
        restarts = 0
        while True:
            outcome = self.run_attempt(hosts, restarts, checkpoint)
            checkpoint = outcome.checkpoint
            if outcome.status in (ExitStatus.DONE, ExitStatus.STOPPED) or self.stop_requests:
                return outcome.status
            try:
                if outcome.status == ExitStatus.NO_RESTART:
                    raise SupervisorStop(f"the job {exit_status_text(outcome.status)}: bad input, or a run that "
                                         "stopped itself; a restart would meet it again")
                refusal = self.budget.refusal(outcome, time.monotonic())
                if refusal:
                    raise SupervisorStop(refusal)
                problems = self.check_hosts(self.job_hosts, self.settings.data_dir, self.settings.ssh_timeout)
                if self.stop_requests:
                    raise SupervisorStop("a stop was requested (SIGTERM/SIGINT) while the hosts were checked")
                passing = [host.name for host in self.job_hosts if not problems[host.name]]
                chosen = usable_hosts(passing, self.settings.ngpu_per_node, self.settings.deepspeed_config,
                                      self.settings.min_hosts)
                self.end_leftovers(chosen, hosts[0])
                # Last look before the next attempt starts (a stop during it would reach a runner without ranks).
                if self.stop_requests:
                    raise SupervisorStop("a stop was requested (SIGTERM/SIGINT) while the restart was prepared")
            except SupervisorStop as stop:
                if self.settings.max_restarts:
                    self.stop_line(stop, outcome)
                return outcome.status  # the failed attempt's: a stop between attempts saves nothing
            restarts += 1
            self.restart_line(restarts, outcome, hosts, chosen, problems)
            hosts = chosen

    def run_attempt(self, hosts: list[str], attempt: int, checkpoint: str | None) -> Outcome:
        hostfile = self.workdir / f"hostfile_{attempt}"
        hostfile.write_text("".join(f"{name} slots={self.settings.ngpu_per_node}\n" for name in hosts))
        command = [self.command[0], "--num_nodes", str(len(hosts)), "--hostfile", str(hostfile), "--master_addr",
                   hosts[0], "--master_port", str(self.settings.master_port), *self.command[1:]]
        print(" ".join(command), flush=True)
        watch = EndWatch(self.status_file, read_status(self.status_file))
        # A session of its own: a Ctrl-C at the terminal reaches the supervisor only, which stops the ranks. Its
        # output goes straight to ours: the supervisor reads none of it.
        runner = subprocess.Popen(command, start_new_session=True)
        ended = False
        while runner.poll() is None:
            if self.stop_requests > self.stops_forwarded:
                self.stops_forwarded = self.stop_requests
                if self.signal_ranks(hosts, hosts[0], self.settings.master_port, "TERM") == 0:
                    runner.send_signal(signal.SIGTERM)  # start-up, no rank yet: the runner stops its pdsh
            # After a stop request too: a failed rank cannot take part in the stop's checkpoint (every rank
            # saves its part, then rank 0 the manifest), so the runner has nothing left to wait for but pdsh.
            elif not ended:
                watch.check(runner.pid)
                if watch.started_to_end is not None and time.monotonic() - watch.started_to_end > EXIT_GRACE_S:
                    print(f"supervisor: the job has not ended {EXIT_GRACE_S:g} s after it began to (rank 0's end, or "
                          "a server's connection): ending the runner", flush=True)
                    os.killpg(runner.pid, signal.SIGKILL)  # the runner, pdsh and its ssh clients
                    ended = True
            time.sleep(POLL_S)
        status = watch.status()
        if status is None:  # rank 0 wrote nothing in this attempt: it did not get far, or was killed
            return Outcome(runner.returncode, None, checkpoint)
        return Outcome(runner.returncode, status["message"], status["checkpoint"])

    # ---------------------------------------------------------------- hosts
    def end_leftovers(self, hosts: list[str], previous_master: str) -> None:
        """Ranks of the last attempt still alive on the hosts of the next (a host back from a network cut
        keeps its ranks until their collectives time out) would hold memory and devices: SIGKILL them."""
        self.signal_ranks(hosts, previous_master, self.settings.master_port, "KILL")

    # ---------------------------------------------------------------- reports
    def restart_line(self, restarts: int, outcome: Outcome, previous: list[str], chosen: list[str],
                     problems: dict[str, list[str]]) -> None:
        left = [name for name in previous if name not in chosen]
        back = [name for name in chosen if name not in previous]
        why_left = {name: problems[name][0] if problems.get(name) else "passes, but the global batch needs fewer hosts"
                    for name in left}
        reason = outcome.reason or f"the job {exit_status_text(outcome.status)}"
        print(f"supervisor: restart {restarts} "
              f"(at most {self.settings.max_restarts} within {self.settings.restart_window_s:g} s) "
              f"at {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC after: {reason}; "
              f"resuming from {resume_point(outcome)} on "
              f"{len(chosen)} host(s) {','.join(chosen)}; left out: "
              f"{'; '.join(f'{name} ({why})' for name, why in why_left.items()) or 'none'}; "
              f"back: {','.join(back) or 'none'}", flush=True)
        self.log_event({"event": "restart", "restart": restarts, "reason": reason, "exit_status": outcome.status,
                        "resume_from_checkpoint": outcome.checkpoint, "hosts": chosen, "hosts_left": why_left,
                        "hosts_back": back})

    def stop_line(self, stop: SupervisorStop, outcome: Outcome) -> None:
        reason = outcome.reason or f"the job {exit_status_text(outcome.status)}"
        print(f"error: supervisor: not restarting: {stop}; the job's last error: {reason}", file=sys.stderr,
              flush=True)
        self.log_event({"event": "stop", "why": str(stop), "reason": reason, "exit_status": outcome.status,
                        "checkpoint": outcome.checkpoint})

    def log_event(self, data: dict[str, object]) -> None:
        """One record in the job's dllogger stream (no rank writes it between two attempts)."""
        logger = dllogger.Logger(backends=[dllogger.JSONStreamBackend(dllogger.Verbosity.VERBOSE,
                                                                      str(self.settings.json_summary), append=True)])
        logger.log(step="SUPERVISOR", data=data)
        logger.flush()


# ============================================================================ command line

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] -- deepspeed [its options] program ...")
    add = parser.add_argument
    add("--hostfile", required=True, help="DeepSpeed hostfile; the job's hosts are its first --num_nodes.")
    add("--num_nodes", type=int, required=True, help="Hosts of the job.")
    add("--ngpu_per_node", type=int, required=True, help="Ranks per host.")
    add("--master_port", type=int, default=29500, help="Port of the rendezvous on the attempt's first host.")
    add("--deepspeed_config", required=True, help="DeepSpeed JSON (its global batch decides the usable host counts).")
    add("--data_dir", required=True, help="Shard directory, checked on every host before a restart.")
    add("--json_summary", required=True, help="The job's dllogger stream; restart events are added to it.")
    add("--max_restarts", type=int, default=3, help="Restarts within --restart_window_s (0: none).")
    add("--restart_window_s", type=float, default=21600, help="Window of the restart budget, in seconds.")
    add("--min_hosts", type=int, default=1, help="Fewest hosts to go on with.")
    add("--ssh_timeout", type=float, default=15.0, help="Seconds each host has to answer the checks.")
    return parser


def parse_arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = build_parser()
    if "--" not in argv:
        parser.parse_args(argv)  # --help first, and the flags' own errors
        parser.error("give the deepspeed command after '--'")
    split = argv.index("--")
    args, command = parser.parse_args(argv[:split]), argv[split + 1:]
    if not command:
        parser.error("give the deepspeed command after '--'")
    if args.max_restarts < 0 or args.restart_window_s <= 0 or args.ssh_timeout <= 0:
        parser.error("--max_restarts must be >= 0, --restart_window_s and --ssh_timeout positive")
    if not 1 <= args.min_hosts <= args.num_nodes:
        parser.error(f"--min_hosts must be between 1 and --num_nodes {args.num_nodes}, got {args.min_hosts}")
    return args, command


def main(argv: list[str] | None = None) -> int:
    args, command = parse_arguments(sys.argv[1:] if argv is None else argv)
    settings = SupervisorSettings(
        hostfile=args.hostfile, num_nodes=args.num_nodes, ngpu_per_node=args.ngpu_per_node,
        master_port=args.master_port, deepspeed_config=args.deepspeed_config, data_dir=args.data_dir,
        json_summary=args.json_summary, max_restarts=args.max_restarts, restart_window_s=args.restart_window_s,
        min_hosts=args.min_hosts, ssh_timeout=args.ssh_timeout)
    with tempfile.TemporaryDirectory(prefix="supervisor_") as workdir:  # the attempts' hostfiles
        try:
            supervisor = Supervisor(settings, command, workdir)
        except InputError as err:  # the hostfile's PreflightError, the DeepSpeed JSON's DeepSpeedConfigError
            print(f"error: supervisor: {err}", file=sys.stderr)
            return 1
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, supervisor.request_stop)
        return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
