"""The process group of a run and what a rank knows of the job: `setup_device_and_distributed` (device, backend,
DeepSpeed's CPU traps, the rendezvous and the watch on the other ranks, training/peer_watch.py), a stop during
the rendezvous, and one line for a collective that failed because a peer died or stalled.

A rank's knowledge of its job lives in a `Job` that run_cli (training/command_line.py) makes and hands to the entry
point's main, which passes it to setup_device_and_distributed: no module-global state. DeepSpeed is imported
lazily: it picks its accelerator on first import (training/device_setup.py)."""

import datetime
import os
import re
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist

from common.errors import InputError, one_line
from training import device_setup, hardware, peer_watch, sizing
from training.run_status import ExitStatus

# How gloo reports a peer that died (connection closed or reset, naming its address) or never answered.
_PEER_GONE = re.compile(r"(?:Connection closed by peer|Read error|Write error|Connection reset by peer)[^\[]*"
                        r"(?:\[([0-9A-Fa-f.:]+)\])?")
_TIMED_OUT = re.compile(r"Timed out|timed out|Timeout|timeout")


class Job:
    """What a rank knows of its job, for the message when a collective fails: the collective timeout and every
    rank's host (set once, by setup_device_and_distributed), and its peer watch; and `report(status, message)`,
    which hears how the process ends (run_cli's, also called where the process ends at once with os._exit)."""

    def __init__(self, report: Callable[[ExitStatus, str | None], None] | None = None):
        self.report = report
        self.timeout_s: float | None = None
        self.hosts: list[str] = []  # host_label() of every rank, by rank
        self.peer_watch: peer_watch.PeerWatch | None = None
        # One error line per process: the main thread's and the peer watch's (training/peer_watch.py) could race.
        self.error_line_lock = threading.RLock()

    def report_exit(self, status: ExitStatus, message: str | None) -> None:
        if self.report is not None:
            self.report(status, message)

    def leave_after_failure(self, message: str) -> None:
        """The process group is broken (a peer died or stalled): print the line and leave at once, since the
        group's teardown could wait on the dead peer. The first caller (main thread or peer watch) prints and exits
        holding the lock, so the other never prints nor cuts the line short."""
        with self.error_line_lock:
            print(f"error: {message}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            self.report_exit(ExitStatus.FAILED, message)
            os._exit(ExitStatus.FAILED)

    def leave_after_peer_died(self, what: str) -> None:
        """The peer watch's way out; none once the main thread has begun to leave (stop_watching_peers)."""
        with self.error_line_lock:
            if self.peer_watch is None:
                return
            rank = dist.get_rank()
            self.leave_after_failure(f"rank {rank} on {self.hosts[rank]}: {what}")

    def stop_watching_peers(self, goodbye: bool) -> None:
        """This process is leaving: stop the peer watch. goodbye: every rank leaves this way (a success, an error
        they all met), so the others must not take the closing connection for a death. run_cli calls it; an entry
        point calls it first where its own clean-up after an error takes long (a checkpoint copy to finish)."""
        with self.error_line_lock:
            watch, self.peer_watch = self.peer_watch, None
        if watch is not None:
            watch.leave(goodbye)

    def describe_collective_failure(self, err: Exception) -> str | None:
        """One line for a collective that failed because a peer died, stalled or became unreachable, or for a
        rendezvous that not every rank joined in time; None when `err` is something else."""
        text = " ".join(str(err).split())
        if not dist.is_available():
            return None
        if not dist.is_initialized():  # torch's store raises DistError when not every rank joined in time
            if not isinstance(err, dist.DistError):
                return None
            return (f"rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')}: not every rank "
                    f"joined the rendezvous at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                    f"within --collective_timeout_s {self.timeout_s:g} s: a server did not start its ranks, or "
                    f"cannot reach that address; the job stops ({one_line(err, 200)})")
        gone, timed_out = _PEER_GONE.search(text), _TIMED_OUT.search(text)
        if not (isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and (gone or timed_out)
                                                     and ("gloo" in text or "NCCL" in text or "HCCL" in text))):
            return None
        rank, hosts = dist.get_rank(), self.hosts
        me = f"rank {rank} on {hosts[rank] if rank < len(hosts) else host_label()}"
        if gone:
            address = gone.group(1)
            peers = [f"rank {r} on {h}" for r, h in enumerate(hosts) if address and f"({address})" in h]
            who = " or ".join(peers) or (f"the rank at {address}" if address else "another rank")
            return (f"{me}: the connection to {who} broke during a collective: that rank died; "
                    f"the job stops ({one_line(err, 200)})")
        others = ", ".join(f"rank {r} on {h}" for r, h in enumerate(hosts) if r != rank)
        return (f"{me}: a collective got no answer within --collective_timeout_s {self.timeout_s:g} s: another "
                f"rank died or stalled (the others: {others}); the job stops")


def setup_device_and_distributed(job: Job, use_hpu: bool, no_cuda: bool, local_rank: int = -1,
                                 collective_timeout_s: float = 1800,
                                 stop_event: threading.Event | None = None,
                                 ds_config: dict[str, Any] | None = None, watch_peers: bool = True) -> torch.device:
    """The only place that touches backends, environment variables and DeepSpeed's CPU traps. A collective
    that waits longer than collective_timeout_s (a rank died or stalled) raises instead of hanging. A stop
    (SIGINT/SIGTERM, or stop_event already set) while waiting for the other ranks ends the process within
    seconds (stop_ends_rendezvous). ds_config: the run's DeepSpeed settings (None: no training), whose bf16 a
    CUDA device must support; checked with the device set-up, before the rendezvous, on every rank.
    watch_peers: end this rank within seconds when another rank's process dies (training/peer_watch.py); run_cli
    stops the watch when the process leaves, so a caller with more than one rank must run under run_cli (else a
    rank still running 5 s after another ended takes that for a death). job: run_cli's, which learns the timeout,
    the ranks' hosts and the peer watch here."""
    if "RANK" not in os.environ:  # started without a launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", max(local_rank, 0)))
    cuda_available = torch.cuda.is_available()
    chosen = device_setup.device_type(use_hpu, no_cuda, cuda_available)
    if chosen == "hpu":
        try:
            import habana_frameworks.torch.core  # registers the hpu device
            import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers hccl)
        except ImportError as err:
            raise InputError(f"--use_hpu needs the SynapseAI PyTorch bridge (habana_frameworks): {err}") from err
        device_setup.check_accelerator_variable(os.environ.get("DS_ACCELERATOR"), True, no_cuda, cuda_available)
        device, backend = torch.device("hpu"), "hccl"
    elif chosen == "cuda":
        device_setup.check_cuda_devices(local_rank, device_setup.local_world_size(), torch.cuda.device_count())
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
        major, minor = torch.cuda.get_device_capability(device)
        hardware.check_bf16_support(ds_config is not None and sizing.bf16_enabled(ds_config),
                                    torch.cuda.is_bf16_supported(including_emulation=False),
                                    f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})")
    else:
        device, backend = torch.device("cpu"), "gloo"
        device_setup.share_cores_between_local_ranks()
        device_setup.keep_freed_memory_in_process()
    import deepspeed
    import deepspeed.ops
    if device.type == "cpu":
        # Trap 1: DeepSpeed JIT-compiles a shared-memory op (25-70 s, needs g++ and ninja) in
        # init_distributed on CPU; it only serves inference all-reduce.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    # DeepSpeed's ZeRO gathers with torch's all_gather_into_tensor, which torch deprecates: a line per run
    # the user can do nothing about (this exact message only)
    warnings.filterwarnings("ignore", message="`torch.distributed.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    _default_group_timeout(timeout)
    # The rendezvous: init_process_group, and the first collective (NCCL connects lazily, at the first one)
    job.timeout_s = collective_timeout_s
    with stop_ends_rendezvous(job, stop_event is not None and stop_event.is_set()):
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        job.hosts = gather_rank_hosts()
        if watch_peers:
            job.peer_watch = peer_watch.start(dist.get_rank(), dist.get_world_size(), job.hosts,
                                              os.environ["MASTER_ADDR"], _share_from_rank_0, collective_timeout_s,
                                              job.leave_after_peer_died)
    return device


def _share_from_rank_0(value: int) -> int:
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


# Seconds a rendezvous under way when a stop comes has to complete before the process leaves it.
RENDEZVOUS_STOP_GRACE_S = 3.0


@contextmanager
def stop_ends_rendezvous(job: Job, stop_requested: bool = False) -> Iterator[None]:
    """Trap: the rendezvous blocks in C++ (gloo, the TCP store, NCCL) until every rank has joined or the
    collective timeout has passed, and Python runs signal handlers only once it returns: a Ctrl-C to a rank
    whose peer never came waited out the whole --collective_timeout_s. Inside this block the C-level handler
    also writes the signal's number to a pipe (signal.set_wakeup_fd) that a thread reads; when SIGINT/SIGTERM
    comes (or stop_requested: it came before) and the rendezvous has not completed RENDEZVOUS_STOP_GRACE_S
    later, the thread prints one line and ends the process with ExitStatus.STOPPED, as a stop during start-up
    does (nothing trained, nothing to save; a supervisor restarts no stopped job). A rendezvous that completes
    in time goes on, and the entry point's own stop handling applies."""
    if threading.current_thread() is not threading.main_thread():  # set_wakeup_fd: the main thread only
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    completed = threading.Event()

    def leave_unless_completed(signal_name: str) -> None:
        if completed.wait(RENDEZVOUS_STOP_GRACE_S):
            return
        rank, world = os.environ.get("RANK", "0"), os.environ.get("WORLD_SIZE", "1")
        print(f"rank {rank} of {world}: stop requested ({signal_name}) while waiting for the other ranks to join "
              f"({os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}): stopping before the first step",
              flush=True)
        sys.stderr.flush()
        job.report_exit(ExitStatus.STOPPED, None)
        os._exit(ExitStatus.STOPPED)  # the main thread is inside C++ and would not return before the collective timeout

    def watch() -> None:
        if stop_requested:
            leave_unless_completed("SIGTERM/SIGINT")
        while not completed.is_set():
            received = os.read(read_fd, 1)
            if not received:  # the write end closed: the rendezvous completed
                return
            if received[0] in (signal.SIGINT, signal.SIGTERM):
                leave_unless_completed(signal.Signals(received[0]).name)
                return

    watcher = threading.Thread(target=watch, name="stop during rendezvous", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        completed.set()
        signal.set_wakeup_fd(previous_fd)
        os.close(write_fd)
        watcher.join()
        os.close(read_fd)


def _default_group_timeout(timeout: datetime.timedelta) -> None:
    """Trap: DeepSpeed makes its own process groups (ZeRO's data-parallel group is a clone of the world)
    with new_group() and no timeout; those take torch's module default (30 min), not the timeout given to
    init_process_group, so a dead peer hung ZeRO's all-reduce for 30 min (measured with gloo)."""
    import torch.distributed.distributed_c10d as c10d
    c10d.default_pg_timeout = timeout
    if hasattr(c10d, "default_pg_nccl_timeout"):
        c10d.default_pg_nccl_timeout = timeout


def host_label() -> str:
    """This host as the others can tell it: its name and the address it reaches the master from (names
    can repeat, e.g. containers)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            address = probe.getsockname()[0]
    except (OSError, KeyError, ValueError):
        address = "?"
    return f"{socket.gethostname()} ({address})"


def gather_rank_hosts() -> list[str]:
    """host_label() of every rank, by rank (one all_gather at start-up)."""
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_label())
    return cast(list[str], hosts)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
