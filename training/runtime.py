"""What every DeepSpeed entry point (run_pretraining.py, run_glue.py, run_squad.py) needs, in one place.

- `choose_accelerator` before DeepSpeed's first import, then `setup_device_and_distributed`: device,
  backend, DeepSpeed's CPU traps and the watch on the other ranks (training/peer_watch.py); a DS_ACCELERATOR
  that names another device is an InputError (`check_accelerator_variable`), as are more processes on a server
  than CUDA devices (`check_cuda_devices`) and bf16 on a CUDA device without it (`hardware.check_bf16_support`);
  `seed_everything` (callers pass seed + global rank);
- `initialize_engine`: deepspeed.initialize (the JSON is read and checked by common/deepspeed_config.py)
  with a client optimizer and scheduler (and the guard against its zero-gradient step);
- `add_compile_arguments`, `compile_backend`, `compile_model`, `log_first_step`: the reference's torch.compile mode;
- `load_init_weights`, `build_logger` (dllogger), `stop_requests` (SIGTERM/SIGINT), `build_profiler`;
- `check_writable_directory`, `check_writable_file`: an unwritable output is an error before any work;
- `InputError` (common/errors.py) and `run_cli`: bad input is one error line, and every way out an exit status
  of training/run_status.py's contract with the supervisor.

Functions take explicit values, not an argparse namespace. DeepSpeed is imported lazily: it picks its
accelerator on first import.
"""

import argparse
import ctypes
import datetime
import os
import pickle
import random
import re
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.errors import NO_RESTART_MARK, HostInputError, InputError, InputErrorOnEveryRank, one_line
from common.storage import WRITE_PROBE_PREFIX
from modeling import TRANSFORMERS_ONLY_KEYS
from training import gaudi, hardware, peer_watch, sizing
from training.run_status import ExitStatus, exit_status_of

try:
    import dllogger
except ImportError:  # NVIDIA's package is not on PyPI; the fallback has the same API subset
    from training import dllogger_fallback as dllogger

# re-exported: entry points take the error types from here
__all__ = ["HostInputError", "InputError", "InputErrorOnEveryRank", "one_line"]

PROFILERS = ("pt", "pt-full", "hltv")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line: with ~50 flags the usage block would bury the message."""

    def error(self, message):
        self.exit(ExitStatus.NO_RESTART, f"error: {message} (see --help)\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every flag's default: '(default: X)' after its help, unless the help already says it in
    its own words ("(default: ..."), e.g. where None stands for "taken from elsewhere", or the flag is
required. Switches (store_true)
    are off unless given, which SWITCHES_EPILOG says once instead of "(default: False)" on each."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or "(default" in text
                or action.required or action.default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


SWITCHES_EPILOG = "Flags without a value are switches: off unless given."


# ============================================================================ device, backend, DeepSpeed traps

def device_type(use_hpu: bool, no_cuda: bool, cuda_available: bool) -> str:
    """The device setup_device_and_distributed uses: hpu with --use_hpu, else cuda when CUDA is available and
    not --no_cuda, else cpu."""
    if use_hpu:
        return "hpu"
    return "cuda" if cuda_available and not no_cuda else "cpu"


def check_accelerator_variable(value: str | None, use_hpu: bool, no_cuda: bool, cuda_available: bool) -> None:
    """A DS_ACCELERATOR (value; None: unset) that names another device than the run's is an InputError:
    DeepSpeed takes it at its first import and puts the engine there, and the run would fail deep inside
    (torch.cuda.set_device on a machine without CUDA, DeepSpeed's import without Habana's bridge)."""
    device = device_type(use_hpu, no_cuda, cuda_available)
    if value is None or value == device:
        return
    why = {"hpu": "--use_hpu", "cuda": "CUDA is available here",
           "cpu": "--no_cuda" if no_cuda else "no CUDA device here"}[device]
    flag = "--use_hpu" if value == "hpu" else "--no_cuda" if value == "cpu" and device == "cuda" else None
    instead = f", or pass {flag} to run on {value}" if flag else ""
    raise InputError(f"DS_ACCELERATOR={value} names another device than this run's, {device} ({why}): unset "
                     f"DS_ACCELERATOR (the entry point sets it) or set it to {device}{instead}")


def choose_accelerator(use_hpu: bool, no_cuda: bool) -> None:
    """DeepSpeed picks its accelerator when first imported: call this before that. The choice is
    setup_device_and_distributed's, so DeepSpeed agrees with the device we use and has no fallback to warn
    about ('Setting accelerator to CPU' above --help); a user's DS_ACCELERATOR that names another device is
    an InputError. With --use_hpu, setup_device_and_distributed checks it once Habana's bridge is imported:
    without the bridge the run stops there anyway (and the tests take --use_hpu's earlier checks on the CPU,
    with DS_ACCELERATOR=cpu)."""
    if use_hpu:
        os.environ.setdefault("DS_ACCELERATOR", "hpu")
        return
    cuda_available = torch.cuda.is_available()
    check_accelerator_variable(os.environ.get("DS_ACCELERATOR"), False, no_cuda, cuda_available)
    if device_type(False, no_cuda, cuda_available) == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def setup_device_and_distributed(use_hpu: bool, no_cuda: bool, local_rank: int = -1,
                                 collective_timeout_s: float = 1800,
                                 stop_event: threading.Event | None = None,
                                 ds_config: dict | None = None, watch_peers: bool = True) -> torch.device:
    """The only place that touches backends, environment variables and DeepSpeed's CPU traps. A collective
    that waits longer than collective_timeout_s (a rank died or stalled) raises instead of hanging. A stop
    (SIGINT/SIGTERM, or stop_event already set) while waiting for the other ranks ends the process within
    seconds (stop_ends_rendezvous). ds_config: the run's DeepSpeed settings (None: no training), whose bf16 a
    CUDA device must support; checked with the device set-up, before the rendezvous, on every rank.
    watch_peers: end this rank within seconds when another rank's process dies (training/peer_watch.py); run_cli
    stops the watch when the process leaves, so a caller with more than one rank must run under run_cli (else a
    rank still running 5 s after another ended takes that for a death)."""
    if "RANK" not in os.environ:  # started without a launcher: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", max(local_rank, 0)))
    cuda_available = torch.cuda.is_available()
    chosen = device_type(use_hpu, no_cuda, cuda_available)
    if chosen == "hpu":
        try:
            import habana_frameworks.torch.core  # registers the hpu device
            import habana_frameworks.torch.distributed.hccl  # noqa: F401  (registers hccl)
        except ImportError as err:
            raise InputError(f"--use_hpu needs the SynapseAI PyTorch bridge (habana_frameworks): {err}") from err
        check_accelerator_variable(os.environ.get("DS_ACCELERATOR"), True, no_cuda, cuda_available)
        device, backend = torch.device("hpu"), "hccl"
    elif chosen == "cuda":
        check_cuda_devices(local_rank, local_world_size(), torch.cuda.device_count())
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
        major, minor = torch.cuda.get_device_capability(device)
        hardware.check_bf16_support(ds_config is not None and sizing.bf16_enabled(ds_config),
                                    torch.cuda.is_bf16_supported(including_emulation=False),
                                    f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})")
    else:
        device, backend = torch.device("cpu"), "gloo"
        _share_cores_between_local_ranks()
        keep_freed_memory_in_process()
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
    _JOB["timeout_s"] = collective_timeout_s
    with stop_ends_rendezvous(stop_event is not None and stop_event.is_set()):
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        _JOB["hosts"] = gather_rank_hosts()
        if watch_peers:
            _JOB["peer_watch"] = peer_watch.start(dist.get_rank(), dist.get_world_size(), _JOB["hosts"],
                                                  os.environ["MASTER_ADDR"], _share_from_rank_0, collective_timeout_s,
                                                  _leave_after_peer_died)
    return device


def _share_from_rank_0(value):
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


# One error line per process: the main thread's and the peer watch's (training/peer_watch.py) could race.
_ERROR_LINE_LOCK = threading.RLock()


def _leave_after_failure(message: str) -> None:
    """The process group is broken (a peer died or stalled): print the line and leave at once, since the group's
    teardown could wait on the dead peer. The first caller (main thread or peer watch) prints and exits holding
    the lock, so the other never prints nor cuts the line short."""
    with _ERROR_LINE_LOCK:
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        _report_exit(ExitStatus.FAILED, message)
        os._exit(ExitStatus.FAILED)


def _leave_after_peer_died(what: str) -> None:
    """The peer watch's way out; none once the main thread has begun to leave (stop_watching_peers)."""
    with _ERROR_LINE_LOCK:
        if _JOB["peer_watch"] is None:
            return
        rank = dist.get_rank()
        _leave_after_failure(f"rank {rank} on {_JOB['hosts'][rank]}: {what}")


def stop_watching_peers(goodbye: bool) -> None:
    """This process is leaving: stop the peer watch. goodbye: every rank leaves this way (a success, an error
    they all met), so the others must not take the closing connection for a death. run_cli calls it; an entry
    point calls it first where its own clean-up after an error takes long (a checkpoint copy to finish)."""
    with _ERROR_LINE_LOCK:
        watch, _JOB["peer_watch"] = _JOB["peer_watch"], None
    if watch is not None:
        watch.leave(goodbye)


# Seconds a rendezvous under way when a stop comes has to complete before the process leaves it.
RENDEZVOUS_STOP_GRACE_S = 3.0


@contextmanager
def stop_ends_rendezvous(stop_requested: bool = False):
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
        _report_exit(ExitStatus.STOPPED, None)
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


# What a rank knows of the job for the message when a collective fails (set once, at initialisation), and
# run_cli's `report`, which the ways out that end the process at once (os._exit) call too.
_JOB = {"timeout_s": None, "hosts": [], "peer_watch": None, "report": None}


def _report_exit(status: ExitStatus, message: str | None) -> None:
    if _JOB["report"] is not None:
        _JOB["report"](status, message)


def job_hosts() -> list:
    """host_label() of every rank, by rank, as gathered at initialisation (setup_device_and_distributed)."""
    return list(_JOB["hosts"])
# How gloo reports a peer that died (connection closed or reset, naming its address) or never answered.
_PEER_GONE = re.compile(r"(?:Connection closed by peer|Read error|Write error|Connection reset by peer)[^\[]*"
                        r"(?:\[([0-9A-Fa-f.:]+)\])?")
_TIMED_OUT = re.compile(r"Timed out|timed out|Timeout|timeout")


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


def gather_rank_hosts() -> list:
    """host_label() of every rank, by rank (one all_gather at start-up)."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host_label())
    return hosts


def describe_collective_failure(err: Exception):
    """One line for a collective that failed because a peer died, stalled or became unreachable, or for a
    rendezvous that not every rank joined in time; None when `err` is something else."""
    text = " ".join(str(err).split())
    if not dist.is_available():
        return None
    if not dist.is_initialized():  # torch's store raises DistError when not every rank joined in time
        if not isinstance(err, dist.DistError):
            return None
        return (f"rank {os.environ.get('RANK', '0')} of {os.environ.get('WORLD_SIZE', '1')}: not every rank joined "
                f"the rendezvous at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} within "
                f"--collective_timeout_s {_JOB['timeout_s']:g} s: a server did not start its ranks, or cannot reach "
                f"that address; the job stops ({one_line(err, 200)})")
    gone, timed_out = _PEER_GONE.search(text), _TIMED_OUT.search(text)
    if not (isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and (gone or timed_out)
                                                 and ("gloo" in text or "NCCL" in text or "HCCL" in text))):
        return None
    rank, hosts = dist.get_rank(), _JOB["hosts"]
    me = f"rank {rank} on {hosts[rank] if rank < len(hosts) else host_label()}"
    if gone:
        address = gone.group(1)
        peers = [f"rank {r} on {h}" for r, h in enumerate(hosts) if address and f"({address})" in h]
        who = " or ".join(peers) or (f"the rank at {address}" if address else "another rank")
        return (f"{me}: the connection to {who} broke during a collective: that rank died; "
                f"the job stops ({one_line(err, 200)})")
    others = ", ".join(f"rank {r} on {h}" for r, h in enumerate(hosts) if r != rank)
    return (f"{me}: a collective got no answer within --collective_timeout_s {_JOB['timeout_s']:g} s: another "
            f"rank died or stalled (the others: {others}); the job stops")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_world_size() -> int:
    """The processes on this server, as the deepspeed launcher (LOCAL_SIZE) or torchrun (LOCAL_WORLD_SIZE) set
    it; 1 without a launcher."""
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))


def check_cuda_devices(local_rank: int, local_ranks: int, device_count: int) -> None:
    """Each process takes the CUDA device of its LOCAL_RANK, and torch.cuda.set_device raised for one beyond
    the server's devices (e.g. torchrun --nproc_per_node above the GPU count): a HostInputError instead, the
    server's own fault where the others have their GPUs (one failed or hidden), so training/supervisor.py's
    host check decides, not a final error. It is found from the local process count on every rank of the
    server, so that its local rank 0 prints it (run_cli). Where no launcher gave that count only the rank
    itself finds it, and exits 1 without the line (run_cli prints a server's InputError from its local rank
    0 alone)."""
    if local_ranks > device_count:
        what = f"{local_ranks} processes on this server, one per CUDA device, but {device_count} visible"
    elif local_rank >= device_count:
        what = f"LOCAL_RANK {local_rank} takes CUDA device {local_rank}, but this server has {device_count} visible"
    else:
        return
    raise HostInputError(f"{what} CUDA device(s): start at most {device_count} processes per server "
                         "(torchrun --nproc_per_node, deepspeed --num_gpus)")


def _share_cores_between_local_ranks():
    """Trap: the deepspeed launcher does not set OMP_NUM_THREADS, so N ranks on one machine would each
    use every core (measured 20-30x slower steps with 2 ranks on 2 cores). Respect a user's setting."""
    local_ranks = local_world_size()
    if "OMP_NUM_THREADS" not in os.environ and local_ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


# glibc's mallopt parameters (malloc.h) and the user settings that replace ours.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory_in_process() -> bool:
    """Trap: glibc gives every freed block above its mmap threshold (32 MiB at most) back to the kernel,
    so the large tensors of each step (bf16 and fp32 copies of the flat parameters and gradients, the
    activations) are page-faulted in again at every step: 1.5 s of system time per step was measured at
    BERT-1.5B widths with 2 layers, a third of the step. Raise both thresholds so that freed memory stays
    in the process for the next step (measured there: steps 1.9x faster, peak RSS 6% higher). glibc only;
    a user's MALLOC_* or GLIBC_TUNABLES malloc setting wins. Returns whether the setting was applied."""
    if (not sys.platform.startswith("linux") or any(name in os.environ for name in _MALLOC_SETTINGS)
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc (e.g. musl)
        return False
    largest = ctypes.c_int(2 ** 31 - 1)
    return bool(mallopt(_M_TRIM_THRESHOLD, largest)) and bool(mallopt(_M_MMAP_THRESHOLD, largest))


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


# ============================================================================ DeepSpeed config and engine

@contextmanager
def optimizer_step_suppressed(optimizer):
    """Within this block optimizer.step() does nothing (weights, moments and step counters untouched).

    Used (a) around deepspeed.initialize, where bf16 + ZeRO-0 wraps the optimizer in
    FP16_UnfusedOptimizer, which takes one zero-gradient step (it would apply weight decay and
    shift LANS's step count, and with it the LR schedule); (b) around engine.step() for a step whose
    loss is not finite, so that DeepSpeed's bookkeeping runs but the update does not."""
    if optimizer is None:
        yield
        return
    optimizer.step = lambda closure=None: None
    try:
        yield
    finally:
        del optimizer.step


def initialize_engine(model, ds_config: dict, optimizer=None, scheduler=None, parameter_groups=None):
    """deepspeed.initialize with a client optimizer and scheduler (None: the JSON's, over
    parameter_groups); returns (engine, the optimizer that steps: the client's or DeepSpeed's)."""
    import deepspeed
    with optimizer_step_suppressed(optimizer):
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               model_parameters=None if optimizer else parameter_groups,
                                               config=ds_config)
    return engine, optimizer or engine.optimizer


@contextmanager
def destroyed_on_exit(engine):
    """engine.destroy() when the block ends without an error. Trap: under bf16 or ZeRO-1/2, DeepSpeed's
    optimizer registers gradient-accumulation hooks on the parameters that refer back to it; until destroy()
    removes them the engine, the model and the optimizer states stay reachable after the caller returns
    (tens of MiB per tiny run in one process, measured with gc). Not after an error: ZeRO's destroy() synchronizes
    the device, which after a failed collective on a GPU can wait on it, and a failed run's process ends."""
    yield engine
    engine.destroy()


def add_compile_arguments(group, compiles_lans: bool = False) -> None:
    """The compile-mode flags, on a parser or argument group (the same in every entry point). compiles_lans:
    the entry point's LANS update is compiled too (run_pretraining.py's; fine-tuning's AdamW is not)."""
    lans = " and, with inductor, the LANS update" if compiles_lans else ""
    group.add_argument("--enable_torch_compile", action="store_true", help="torch.compile the model (the "
                       f"reference's compile mode; on Gaudi with PT_HPU_LAZY_MODE=0){lans}. Checkpoints are the "
                       "same as in eager mode, so either mode resumes the other's.")
    group.add_argument("--torch_compile_backend", default=None, help="torch.compile backend with "
                       "--enable_torch_compile (default: the DeepSpeed accelerator's: hpu_backend on Gaudi, "
                       "inductor elsewhere).")
    group.add_argument("--torch_compile_mode", default=None, help="torch.compile mode with --enable_torch_compile, "
                       "e.g. max-autotune-no-cudagraphs (default: the backend's default).")


def check_compile_flags(enabled: bool, backend: str | None, mode: str | None, use_hpu: bool = False) -> None:
    """Before any work: the backend and mode flags need compile mode, and the mode must be one of inductor's;
    on Gaudi, compile mode needs lazy mode off (PT_HPU_LAZY_MODE=0): under lazy mode torch.compile would run
    beside the bridge's own lazy graphs and the driver's mark_step cuts, which is no mode of the reference's.
    The backend name is checked in compile_model: Gaudi's registers only once its bridge is imported."""
    if not enabled and (backend or mode):
        raise InputError("--torch_compile_backend and --torch_compile_mode need --enable_torch_compile")
    if enabled and use_hpu and gaudi.lazy_mode_requested():
        value = os.environ.get("PT_HPU_LAZY_MODE")
        now = "unset, read as lazy mode" if value is None else repr(value)
        raise InputError(f"--enable_torch_compile with --use_hpu needs Gaudi's compile mode, PT_HPU_LAZY_MODE=0 "
                         f"(here PT_HPU_LAZY_MODE is {now})")
    if mode is not None:
        import torch._inductor
        modes = sorted(torch._inductor.list_mode_options())
        if mode not in modes:
            raise InputError(f"--torch_compile_mode must be one of {', '.join(modes)}, got {mode!r}")


def compile_backend(backend: str | None) -> str:
    """The torch.compile backend of compile mode: --torch_compile_backend, else the DeepSpeed accelerator's;
    InputError when torch knows no such backend."""
    import torch._dynamo
    from deepspeed.accelerator import get_accelerator
    backend = backend or get_accelerator().get_compile_backend()
    try:
        torch._dynamo.lookup_backend(backend)
    except Exception as err:  # torch raises InvalidBackend, naming the registered ones
        raise InputError(f"--torch_compile_backend: {one_line(err)}") from err
    return backend


def compile_model(engine, backend: str | None, mode: str | None) -> str:
    """torch.compile the engine's model in place (DeepSpeedEngine.compile calls nn.Module.compile): the
    module keeps its class and parameter names, so state_dict keys and checkpoints are those of eager mode
    (no `_orig_mod.` prefix). Compilation itself happens in the first forward and backward. Returns the
    backend used."""
    backend = compile_backend(backend)
    if backend == "inductor":
        # Dropout from torch's own generator, not inductor's: the same masks as eager mode, so losses match
        # and a checkpoint's RNG state resumes the same stream in either mode.
        import torch._inductor.config
        torch._inductor.config.fallback_random = True
    engine.compile(backend=backend, compile_kwargs={"mode": mode} if mode else {})
    return backend


def log_first_step(logger, say, seconds: float) -> None:
    """In compile mode the first step includes the compilation: its time goes to the log."""
    say(f"first step, compilation included: {seconds:.1f} s")
    logger.log(step="PARAMETER", data={"first_step_time_s": seconds})


INIT_WEIGHT_SOURCES = ("it should be a checkpoint tag directory (holding mp_rank_00_model_states.pt) or a "
                       "state-dict file written by torch.save (ours, `python -m training.checkpointing export`'s, "
                       "or transformers' BertForPreTraining)")
# torch.load(weights_only=True) meets a file that is no torch file (text, random bytes) with whatever its
# parser trips on: besides its own errors, an IndexError ("pop from empty list"), KeyError, struct.error...
UNREADABLE_TORCH_FILE = (OSError, EOFError, RuntimeError, pickle.UnpicklingError, IndexError, KeyError, ValueError,
                         TypeError, AttributeError, struct.error)


def torch_load_reason(err: Exception) -> str:
    """torch.load's error as one short line, without its advice to load with weights_only=False (which
    runs arbitrary code) or to allow-list globals."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation of torch.load", 1)[0]
        text = text.split("Please use `torch.serialization", 1)[0]
    text = one_line(text, limit=200)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def load_init_weights(model, path, flag: str = "--init_checkpoint") -> None:
    """Module weights from a DeepSpeed checkpoint tag directory, or from a state-dict file (ours, the
    export of training/checkpointing.py, or Hugging Face's BertForPreTraining for a post-LN config)."""
    path = Path(path)
    file = path / "mp_rank_00_model_states.pt" if path.is_dir() else path
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except UNREADABLE_TORCH_FILE as err:
        raise InputError(f"{flag} {path}: cannot read {file} as weights; {INIT_WEIGHT_SOURCES} "
                         f"(torch: {torch_load_reason(err)})") from err
    state = state.get("module", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(torch.is_tensor(value) for value in state.values()):
        raise InputError(f"{flag} {path}: {file} holds no state dict of tensors; {INIT_WEIGHT_SOURCES}")
    for key in TRANSFORMERS_ONLY_KEYS:
        state.pop(key, None)
    config = model.config
    fits = (f"{flag} {file} does not fit the model config (hidden {config.hidden_size}, "
            f"{config.num_hidden_layers} layers, padded vocab {config.padded_vocab_size})")
    misfit = describe_misfit(model.state_dict(), state)
    if misfit:
        raise InputError(f"{fits}: {misfit}")
    try:
        model.load_state_dict({key: value.float() for key, value in state.items()})
    except RuntimeError as err:  # what describe_misfit does not look at
        raise InputError(f"{fits}: {one_line(err)}") from err


ENCODER_LAYER_KEY = re.compile(r"^bert\.encoder\.layer\.(\d+)\.")
WORD_EMBEDDINGS_KEY = "bert.embeddings.word_embeddings.weight"


def describe_misfit(own: dict, saved: dict) -> str:
    """How the tensors `saved` differ from a model's state dict `own` ("" when they fit), in one line that
    says which config they are for: the checkpoint's hidden size (from its word embeddings) and layer
    count, then the tensors of another shape, the missing and the unexpected keys, each with its count and
    the first one (own's order, then saved's)."""
    other_shape = [key for key in own if key in saved and tuple(saved[key].shape) != tuple(own[key].shape)]
    missing = [key for key in own if key not in saved]
    unexpected = [key for key in saved if key not in own]
    if not (other_shape or missing or unexpected):
        return ""
    parts = []
    if WORD_EMBEDDINGS_KEY in saved and saved[WORD_EMBEDDINGS_KEY].dim() == 2:
        layers = len({int(match.group(1)) for match in map(ENCODER_LAYER_KEY.match, saved) if match})
        parts.append(f"the checkpoint has hidden {saved[WORD_EMBEDDINGS_KEY].shape[1]}, {layers} "
                     f"layer{'' if layers == 1 else 's'}, "
                     f"{saved[WORD_EMBEDDINGS_KEY].shape[0]} vocabulary rows")
    if other_shape:
        first = other_shape[0]
        parts.append(f"{len(other_shape)} tensors of another shape (first {first}: "
                     f"{list(saved[first].shape)} in the checkpoint, {list(own[first].shape)} in the model)")
    if missing:
        parts.append(f"{len(missing)} missing keys (first {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (first {unexpected[0]})")
    return "; ".join(parts)


def check_writable_directory(path, flag: str) -> None:
    """Create `path` if needed and write a probe file in it, so that a read-only place or a file in the
    way is one error line before any work, not a failure at the first save hours later."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=WRITE_PROBE_PREFIX):
            pass
    except OSError as err:
        raise InputError(f"{flag} {path} is not writable: {err.strerror or err}") from err


def check_writable_file(path, flag: str) -> None:
    """The file `path` can be written: its directory is writable, and the file itself when it exists."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path} is a directory, not a file")
    check_writable_directory(path.parent, f"{flag}'s directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{flag} {path} is not writable")


# ============================================================================ logging, stop requests, profiler

def step_format(step) -> str:
    if isinstance(step, tuple) and len(step) == 2:
        return f"Training Epoch: {step[0]} Training Iteration: {step[1]}"
    return str(step)


def build_logger(json_summary, rank: int, append: bool = False):
    """Rank 0: JSON stream (--json-summary) + stdout; other ranks: a logger without backends.
    append: add to an existing stream (a resumed run) instead of replacing it."""
    if rank != 0:
        return dllogger.Logger(backends=[])
    Path(json_summary).parent.mkdir(parents=True, exist_ok=True)
    return dllogger.Logger(backends=[
        dllogger.JSONStreamBackend(dllogger.Verbosity.VERBOSE, str(json_summary), append=append),
        dllogger.StdOutBackend(dllogger.Verbosity.VERBOSE, step_format=step_format)])


def progress_bar(show: bool, total: int, initial: int, desc: str, every: int, stream=None):
    """The progress display of a loop of `total` steps from `initial` (update(n), close()), on stderr (stream): tqdm's
    bar on a terminal; elsewhere (a log file, a pipe) ProgressLines, one line every `every` steps, where the
    bar would fill the file with its redrawings; nothing when show is False."""
    from tqdm import tqdm
    stream = sys.stderr if stream is None else stream
    if show and not stream.isatty():
        return ProgressLines(total, initial, desc, every, stream)
    return tqdm(total=total, initial=initial, desc=desc, disable=not show, dynamic_ncols=True, file=stream)


class ProgressLines:
    """Progress for output that is read afterwards: `DESC: N/TOTAL (P%), S s, R/s` when N is a multiple of
    `every`, reaches `total`, or stops elsewhere (close). The time and rate are this process's own (a resumed
    loop starts at `initial`)."""

    def __init__(self, total: int, initial: int, desc: str, every: int, stream):
        self.total, self.n, self.desc, self.every, self.stream = total, initial, desc, max(1, every), stream
        self.started, self.initial, self.shown = time.perf_counter(), initial, initial

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n % self.every == 0 or self.n == self.total:
            self._line()

    def close(self) -> None:
        if self.n != self.shown:
            self._line()

    def _line(self) -> None:
        elapsed = time.perf_counter() - self.started
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        percent = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        print(f"{self.desc}: {self.n}/{self.total}{percent}, {elapsed:.1f} s, {rate:.2f}/s", file=self.stream,
              flush=True)
        self.shown = self.n


@contextmanager
def stop_requests():
    """SIGTERM/SIGINT set an event instead of killing the process; the loop checks it at step ends."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event  # signal handlers can only be installed from the main thread
        return
    previous = {sig: signal.signal(sig, lambda *_: event.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield event
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def parse_profile_steps(text: str) -> tuple:
    try:
        start, end = (int(x) for x in text.split(","))
    except ValueError as err:
        raise InputError(f"--profile_steps must be 'start,end' (integers), got {text!r}") from err
    if not 0 <= start <= end:
        raise InputError(f"--profile_steps needs 0 <= start <= end, got {text!r}")
    return start, end


def check_profiler(kind: str | None, steps: str, use_hpu: bool) -> None:
    if kind is not None and kind not in PROFILERS:
        raise InputError(f"unknown --profile {kind!r}: choose one of {', '.join(PROFILERS)}")
    if kind == "hltv" and not use_hpu:
        raise InputError("--profile hltv is the Habana profiler: it needs --use_hpu (use pt or pt-full elsewhere)")
    parse_profile_steps(steps)


def build_profiler(kind: str | None, steps: str, results_dir: Path, use_hpu: bool, no_cuda: bool):
    """torch profiler over the micro-steps `steps` ("start,end", inclusive), or None when kind is None."""
    if kind is None:
        return None
    start, end = parse_profile_steps(steps)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if use_hpu and hasattr(torch.profiler.ProfilerActivity, "HPU"):  # Habana's torch build
        activities.append(torch.profiler.ProfilerActivity.HPU)
    elif torch.cuda.is_available() and not no_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_dir = Path(results_dir) / "profile"
    return torch.profiler.profile(
        # One warm-up step before the traced ones when there is one (the reference uses none).
        activities=activities, schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=min(start, 1),
                                                                active=end - start + 1, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(str(trace_dir)), with_stack=kind == "pt-full")


# ============================================================================ command line

def write_whole_lines() -> None:
    """Every line this process prints leaves it in one write. The deepspeed launcher runs its ranks unbuffered
    (`python -u`), where print() writes a text and its newline apart; the ranks and the launcher share one
    pipe, so another process's output could land inside a line and cut it (the error line a user reads, the
    lines the launch scripts filter). Line buffering still sends each line at its newline. Only the process's
    own streams (sys.__stdout__, sys.__stderr__): an object a caller has put in their place (pytest's capture)
    keeps its settings."""
    for stream in (sys.__stdout__, sys.__stderr__):
        if stream is not None:  # None: a process started without them
            stream.reconfigure(line_buffering=True, write_through=False)


def run_cli(main, argv, errors: tuple, final: tuple = (), report=None) -> int:
    """main(argv) with one clear error line instead of a traceback for `errors` (plus InputError), and an exit
    status of training/run_status.py's contract: STOPPED when main's summary says a stop request ended it,
    else DONE; NO_RESTART for an error of a `final` type (a restart would meet it again), but never for a
    HostInputError (another set of servers may not meet it); FAILED for the others. The ranks of one host
    meet the same bad input: its first local rank prints it, and on another host than rank 0's it names itself
    (a file missing on that host alone would otherwise fail silently there while rank 0 waits for it). A final
    error's line ends with NO_RESTART_MARK, for the reader. report(status, message), when given, hears how the
    process ends (message: the error line's text, None without one), also where it ends at once (os._exit).
    Whatever the process prints, it prints in whole lines (write_whole_lines)."""
    write_whole_lines()
    _JOB["report"] = report
    leave_together = False  # every rank ended the same way: they can meet at a barrier
    try:
        status, message = exit_status_of(main(argv)), None
        leave_together = True
    except BaseException as err:
        leave_together = isinstance(err, InputErrorOnEveryRank)
        # Leaving, for any reason: a connection that closes from now on is no peer's death (training/peer_watch.py)
        stop_watching_peers(goodbye=leave_together)
        if not isinstance(err, (InputError, *errors)):
            message = describe_collective_failure(err) if isinstance(err, (RuntimeError, dist.DistError)) else None
            if message is None:
                if isinstance(err, Exception):  # not argparse's SystemExit, nor a KeyboardInterrupt
                    _report_exit(ExitStatus.FAILED, f"{type(err).__name__}: {one_line(err)}")
                raise
            _leave_after_failure(message)
        rank, local_rank = os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0")
        is_final = isinstance(err, final) and not isinstance(err, HostInputError)
        mark = NO_RESTART_MARK if is_final else ""
        if rank == "0" or not isinstance(err, InputError):
            print(f"error: {err}{mark}", file=sys.stderr, flush=True)
        elif local_rank == "0":
            print(f"error: rank {rank} on {socket.gethostname()}: {err}{mark}", file=sys.stderr, flush=True)
        status, message = (ExitStatus.NO_RESTART if is_final else ExitStatus.FAILED), str(err)
    # Before the barrier: once every rank has passed it one may exit, and its launcher then ends the others.
    _report_exit(status, message)
    if dist.is_available() and dist.is_initialized() and leave_together:
        dist.barrier()  # else a rank may abort at exit (gloo teardown, DeepSpeed 0.19.8 on CPU)
        stop_watching_peers(goodbye=True)  # after the barrier: every rank got this far
        dist.destroy_process_group()
    return status
