"""How a run tells training/supervisor.py how it ended: its exit status, and a status file kept by rank 0.

The supervisor decides from these two alone, never from the wording of what the ranks print: a reworded
message must not change whether a job is restarted (tests/test_supervisor.py checks it).

Exit statuses (ExitStatus), the same on every rank:
- 0 DONE: the run reached its end (or had nothing left to train).
- 1 FAILED: a failure that a restart may get past: a lost server, a failed collective, a storage error, bad
  input that may be one server's alone (common/errors.py HostInputError). Python's own status for an
  uncaught exception.
- 2 NO_RESTART: bad input, or a run that stopped itself on purpose (run_pretraining.py --max_bad_steps, after
  saving a checkpoint): a restart would meet it again. argparse's status for a bad command line.
- 3 STOPPED: stopped on request (SIGTERM/SIGINT) after saving a checkpoint of its last step (none with
  --skip_checkpoint, or when the request came before the first step); resuming goes on from there.
Any other status (a rank killed by a signal, ssh's 255) is a failure that may be restarted.

How a rank's status reaches the supervisor (DeepSpeed 0.19.8, deepspeed/launcher/):
- launch.py, the launcher on each server, polls its ranks once a second: at the first rank it finds ended with
  a non-zero status it terminates the others and exits with that status (256 - N for a rank killed by signal
  N); it exits 0 once every rank exited 0.
- runner.py, the `deepspeed` command: on one server it runs launch.py and exits with its status; on several
  it runs launch.py on each over `pdsh -S`, which exits with the largest of their statuses (255 when ssh
  failed), and exits with that.
Where the servers end differently the largest status arrives, so the order of the statuses is their
priority: a stop (3) over bad input (2) over a failure (1), since one server's bad input or stop makes the
others' ranks fail when they lose it.

The status file (read_status, StatusFile), JSON beside the run's dllogger stream (status_path): the last
checkpoint saved or resumed from ("checkpoint"), and once the run ends, how ("ended": an ExitStatus name,
"exit_status", "message": the error line's text). "written" differs at each write, so that the supervisor can
tell a file this attempt wrote from one left by an earlier attempt.
"""

import json
import os
from datetime import UTC, datetime
from enum import IntEnum
from pathlib import Path
from typing import TypedDict, cast

from common.atomic_write import write_text_atomically


class ExitStatus(IntEnum):
    DONE = 0
    FAILED = 1
    NO_RESTART = 2
    STOPPED = 3


class RunStatus(TypedDict):
    """The status file's content (StatusFile._write)."""
    checkpoint: str | None
    ended: str | None  # an ExitStatus name; None while the run goes on
    exit_status: int | None
    message: str | None
    written: str  # ISO 8601, UTC


def exit_status_of(summary: object) -> ExitStatus:
    """The exit status of an entry point whose main returned `summary` (its final record)."""
    return ExitStatus.STOPPED if isinstance(summary, dict) and summary.get("stopped_by_signal") else ExitStatus.DONE


def status_path(json_summary: str | os.PathLike[str]) -> Path:
    """The status file of the run whose dllogger stream is `json_summary`: results/dllogger.json's is
    results/dllogger.status.json."""
    summary_path = Path(json_summary)
    return summary_path.with_name(f"{summary_path.stem}.status.json")


def read_status(path: str | os.PathLike[str]) -> RunStatus | None:
    """The status file's content; None when there is none (or it cannot be read: no rank 0 wrote it)."""
    try:
        return cast(RunStatus, json.loads(Path(path).read_text()))
    except (OSError, ValueError):
        return None


class StatusFile:
    """Rank 0's status file. It writes nothing until place() has given it its path (once the flags are read),
    and nothing on another rank."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.checkpoint: str | None = None

    def place(self, json_summary: str | os.PathLike[str]) -> None:
        if os.environ.get("RANK", "0") == "0":
            self.path = status_path(json_summary)

    def saved(self, tag: str | None) -> None:
        """The run saved checkpoint `tag` (complete), or resumed from it (None: started without one)."""
        self.checkpoint = tag
        self._write(None, None)

    def ended(self, status: ExitStatus, message: str | None) -> None:
        try:
            self._write(status, message)
        except OSError:
            pass  # on the way out (a full disk?): the exit status still says how the run ended

    def _write(self, status: ExitStatus | None, message: str | None) -> None:
        if self.path is None:
            return
        content: RunStatus = {"checkpoint": self.checkpoint, "ended": None if status is None else status.name,
                              "exit_status": None if status is None else int(status), "message": message,
                              "written": datetime.now(UTC).isoformat()}
        write_text_atomically(self.path, json.dumps(content) + "\n")
