"""The run's log: dllogger (NVIDIA's, or training/dllogger_fallback.py) with a JSON stream and stdout on rank 0."""

from pathlib import Path
from typing import Any

try:
    import dllogger
except ImportError:  # NVIDIA's package is not on PyPI; the fallback has the same API subset
    from training import dllogger_fallback as dllogger


def step_format(step: object) -> str:
    if isinstance(step, tuple) and len(step) == 2:
        return f"Training Epoch: {step[0]} Training Iteration: {step[1]}"
    return str(step)


def build_logger(json_summary: str | Path, rank: int, append: bool = False) -> Any:
    """Rank 0: JSON stream (--json-summary) + stdout; other ranks: a logger without backends.
    append: add to an existing stream (a resumed run) instead of replacing it."""
    if rank != 0:
        return dllogger.Logger(backends=[])
    Path(json_summary).parent.mkdir(parents=True, exist_ok=True)
    return dllogger.Logger(backends=[
        dllogger.JSONStreamBackend(dllogger.Verbosity.VERBOSE, str(json_summary), append=append),
        dllogger.StdOutBackend(dllogger.Verbosity.VERBOSE, step_format=step_format)])
