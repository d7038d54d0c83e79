"""The command line of an entry point: its parser (one-line usage errors, defaults in --help), the checks that an
output is writable before any work, stop requests (SIGTERM/SIGINT), and `run_cli`: bad input is one error line,
and every way out an exit status of training/run_status.py's contract with the supervisor."""

import argparse
import dataclasses
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar

import torch.distributed as dist

from common.errors import NO_RESTART_MARK, HostInputError, InputError, InputErrorOnEveryRank, one_line
from common.storage import WRITE_PROBE_PREFIX
from training.distributed import Job
from training.run_status import ExitStatus, exit_status_of

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

Settings = TypeVar("Settings", bound="DataclassInstance")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line: with ~50 flags the usage block would bury the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(ExitStatus.NO_RESTART, f"error: {message} (see --help)\n")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help with every flag's default: '(default: X)' after its help, unless the help already says it in
    its own words ("(default: ..."), e.g. where None stands for "taken from elsewhere", or the flag is
required. Switches (store_true)
    are off unless given, which SWITCHES_EPILOG says once instead of "(default: False)" on each."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or "(default" in text
                or action.required or action.default is argparse.SUPPRESS or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)"


SWITCHES_EPILOG = "Flags without a value are switches: off unless given."


def settings_from_flags(settings_class: type[Settings], args: argparse.Namespace, **derived: object) -> Settings:
    """An entry point's frozen settings dataclass from its parsed flags: each field from the flag of its name,
    unless `derived` gives its value (a checked, converted or combined one, or what a file holds)."""
    return settings_class(**{field.name: getattr(args, field.name) for field in dataclasses.fields(settings_class)
                             if field.name not in derived}, **derived)


def check_writable_directory(path: str | os.PathLike[str], flag: str) -> None:
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


def check_writable_file(path: str | os.PathLike[str], flag: str) -> None:
    """The file `path` can be written: its directory is writable, and the file itself when it exists."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{flag} {path} is a directory, not a file")
    check_writable_directory(path.parent, f"{flag}'s directory")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{flag} {path} is not writable")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextmanager
def stop_requests() -> Iterator[threading.Event]:
    """SIGTERM/SIGINT set an event instead of killing the process; the loop checks it at step ends. A stop signal
    that an entry point blocked while it started (run_pretraining.py) and that came meanwhile sets it at once."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event  # signal handlers can only be installed from the main thread
        return
    previous = {sig: signal.signal(sig, lambda *_: event.set()) for sig in STOP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # a pending one is handled here
    try:
        yield event
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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


class EntryPoint(Protocol):
    """An entry point's main, as run_cli calls it; it returns its summary (training/run_status.exit_status_of)."""

    def __call__(self, argv: Sequence[str] | None, /, *, job: Job) -> object: ...


def run_cli(main: EntryPoint, argv: Sequence[str] | None, errors: tuple[type[BaseException], ...],
            final: tuple[type[BaseException], ...] = (),
            report: Callable[[ExitStatus, str | None], None] | None = None) -> int:
    """main(argv, job=job) with one clear error line instead of a traceback for `errors` (plus InputError), and an
    exit status of training/run_status.py's contract: STOPPED when main's summary says a stop request ended it,
    else DONE; NO_RESTART for an error of a `final` type (a restart would meet it again), but never for a
    HostInputError (another set of servers may not meet it); FAILED for the others. The ranks of one host
    meet the same bad input: its first local rank prints it, and on another host than rank 0's it names itself
    (a file missing on that host alone would otherwise fail silently there while rank 0 waits for it). A final
    error's line ends with NO_RESTART_MARK, for the reader. report(status, message), when given, hears how the
    process ends (message: the error line's text, None without one), also where it ends at once (os._exit).
    Whatever the process prints, it prints in whole lines (write_whole_lines). job: a new training/distributed.Job,
    which main passes to setup_device_and_distributed and where the job's hosts, timeout and peer watch then live."""
    write_whole_lines()
    job = Job(report)
    leave_together = False  # every rank ended the same way: they can meet at a barrier
    try:
        status, message = exit_status_of(main(argv, job=job)), None
        leave_together = True
    except BaseException as err:
        leave_together = isinstance(err, InputErrorOnEveryRank)
        # Leaving, for any reason: a connection that closes from now on is no peer's death (training/peer_watch.py)
        job.stop_watching_peers(goodbye=leave_together)
        if not isinstance(err, (InputError, *errors)):
            message = job.describe_collective_failure(err) if isinstance(err, (RuntimeError, dist.DistError)) else None
            if message is None:
                if isinstance(err, Exception):  # not argparse's SystemExit, nor a KeyboardInterrupt
                    job.report_exit(ExitStatus.FAILED, f"{type(err).__name__}: {one_line(err)}")
                raise
            job.leave_after_failure(message)
        rank, local_rank = os.environ.get("RANK", "0"), os.environ.get("LOCAL_RANK", "0")
        is_final = isinstance(err, final) and not isinstance(err, HostInputError)
        mark = NO_RESTART_MARK if is_final else ""
        if rank == "0" or not isinstance(err, InputError):
            print(f"error: {err}{mark}", file=sys.stderr, flush=True)
        elif local_rank == "0":
            print(f"error: rank {rank} on {socket.gethostname()}: {err}{mark}", file=sys.stderr, flush=True)
        status, message = (ExitStatus.NO_RESTART if is_final else ExitStatus.FAILED), str(err)
    # Before the barrier: once every rank has passed it one may exit, and its launcher then ends the others.
    job.report_exit(status, message)
    if dist.is_available() and dist.is_initialized() and leave_together:
        dist.barrier()  # else a rank may abort at exit (gloo teardown, DeepSpeed 0.19.8 on CPU)
        job.stop_watching_peers(goodbye=True)  # after the barrier: every rank got this far
        dist.destroy_process_group()
    return status
