"""The project's error type for bad input: the entry points print its message as one line and exit non-zero."""


class InputError(ValueError):
    """Bad command line, configuration or data, found before the work that it would spoil starts."""


class HostInputError(InputError):
    """Bad input that may be one server's alone: a directory or file missing there, storage it cannot reach,
    its copy of a shard. It is not final (no NO_RESTART_MARK, exit status FAILED): the supervisor's host check
    decides whether the job goes on without that server."""


class InputErrorOnEveryRank(InputError):
    """Bad input that every rank finds at the same point, from a collective's result: the ranks can leave
    together, through a barrier (see training/command_line.run_cli)."""


# The end of the error line of a failure that a restart would meet again: bad input, or a run that stopped
# itself on purpose (run_pretraining.py's --max_bad_steps). It tells the reader; training/supervisor.py reads
# the exit status instead (training/run_status.py NO_RESTART), never the line.
NO_RESTART_MARK = " [no restart]"


def one_line(err: Exception | str, limit: int = 400) -> str:
    """A (torch) multi-line error text folded into one bounded line, for the one-line CLI error."""
    return " ".join(str(err).split())[:limit]
