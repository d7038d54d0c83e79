"""A stand-in for NVIDIA's ``dllogger`` with the subset of its API this project uses.

NVIDIA's package is only on NVIDIA's own index, so ``run_pretraining.py`` does
``try: import dllogger except ImportError: import dllogger_fallback as dllogger``. Written from the
public API description; the JSON lines have NVIDIA's layout so tools that read their logs read ours:

    DLLL {"timestamp": "<unix seconds>", "datetime": "<ISO date, UTC>", "elapsedtime": "<seconds>",
          "type": "LOG", "step": <step>, "data": {<metric>: <value>, ...}}
    DLLL {"timestamp": ..., "datetime": ..., "elapsedtime": ..., "type": "METADATA",
          "metric": "<name>", "metadata": {"unit": ..., "format": ...}}

``step`` is whatever was logged: an int, a string such as "PARAMETER", or a tuple such as
(epoch, step) or () which JSON writes as a list. Tensors and numpy values are written as numbers
(or lists); anything else json cannot write is written as its str().

A backend records a ``log`` call when ``backend.verbosity >= verbosity``; metadata goes to every
backend that is not ``Verbosity.OFF``.
"""

import atexit
import json
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import TypeAlias

__all__ = ["Backend", "DLLLoggerAlreadyInitialized", "DLLoggerNotInitialized", "JSONStreamBackend",
           "Logger", "StdOutBackend", "Verbosity", "default_metric_format", "default_prefix_format",
           "default_step_format", "flush", "init", "log", "metadata"]


Step: TypeAlias = int | str | tuple[object, ...]  # what a record is of: a step, "PARAMETER", (epoch, step), ()
Data: TypeAlias = Mapping[str, object]  # {metric: value}
Metadata: TypeAlias = Mapping[str, str]  # {"unit": ..., "format": ...}


class Verbosity:
    OFF = -1
    DEFAULT = 0
    VERBOSE = 1


class DLLLoggerAlreadyInitialized(Exception):
    """``init`` was called twice (the name keeps dllogger's spelling)."""


class DLLoggerNotInitialized(Exception):
    """``log``/``metadata``/``flush`` was called before ``init``."""


class Backend(ABC):
    """Receives every record the logger lets through; subclasses decide where it goes."""

    def __init__(self, verbosity: int) -> None:
        self._verbosity = verbosity

    @property
    def verbosity(self) -> int:
        return self._verbosity

    @abstractmethod
    def log(self, timestamp: datetime, elapsedtime: float, step: Step, data: Data) -> None:
        """timestamp: aware datetime; elapsedtime: seconds since the logger started (float)."""

    @abstractmethod
    def metadata(self, timestamp: datetime, elapsedtime: float, metric: str, metadata: Metadata) -> None:
        """Describe ``metric`` (e.g. {"unit": "s", "format": ":.3f"})."""

    @abstractmethod
    def flush(self) -> None:
        """Push buffered output to its destination."""


def default_step_format(step: Step) -> str:
    return str(step)


def default_metric_format(metric: str, metadata: Metadata, value: object) -> str:
    """'name : value unit', with the value formatted by metadata['format'] (e.g. ':.4f') if given."""
    fmt = metadata.get("format")
    text = ("{" + fmt + "}").format(value) if fmt else str(value)
    unit = metadata.get("unit")
    return f"{metric} : {text} {unit}" if unit else f"{metric} : {text}"


def default_prefix_format(timestamp: datetime) -> str:
    return f"DLL {timestamp} - "


class StdOutBackend(Backend):
    """Prints one line per record: 'DLL <datetime> - <step> <metric> : <value> <unit> ...'."""

    def __init__(self, verbosity: int, step_format: Callable[[Step], str] = default_step_format,
                 metric_format: Callable[[str, Metadata, object], str] = default_metric_format,
                 prefix_format: Callable[[datetime], str] = default_prefix_format) -> None:
        super().__init__(verbosity)
        self._metadata: dict[str, dict[str, str]] = {}
        self.step_format = step_format
        self.metric_format = metric_format
        self.prefix_format = prefix_format

    def log(self, timestamp: datetime, elapsedtime: float, step: Step, data: Data) -> None:
        metrics = " ".join(self.metric_format(name, self._metadata.get(name, {}), value)
                           for name, value in data.items())
        print(f"{self.prefix_format(timestamp)}{self.step_format(step)} {metrics}")

    def metadata(self, timestamp: datetime, elapsedtime: float, metric: str, metadata: Metadata) -> None:
        self._metadata[metric] = dict(metadata)

    def flush(self) -> None:
        sys.stdout.flush()


def _json_value(value: object) -> object:
    """JSON fallback for what json cannot write: tensors/numpy values -> numbers or lists, else str."""
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return tolist()
    return str(value)


class JSONStreamBackend(Backend):
    """Appends 'DLLL {json}' lines to ``filename`` (truncated first unless ``append``)."""

    def __init__(self, verbosity: int, filename: str | os.PathLike[str], append: bool = False) -> None:
        super().__init__(verbosity)
        self.filename = filename
        self._file = open(filename, "a" if append else "w", encoding="utf-8")

    def _write(self, timestamp: datetime, elapsedtime: float, record: Mapping[str, object]) -> None:
        header = {"timestamp": str(timestamp.timestamp()), "datetime": str(timestamp),
                  "elapsedtime": str(elapsedtime)}
        self._file.write("DLLL " + json.dumps({**header, **record}, default=_json_value) + "\n")

    def log(self, timestamp: datetime, elapsedtime: float, step: Step, data: Data) -> None:
        self._write(timestamp, elapsedtime, {"type": "LOG", "step": step, "data": data})

    def metadata(self, timestamp: datetime, elapsedtime: float, metric: str, metadata: Metadata) -> None:
        self._write(timestamp, elapsedtime, {"type": "METADATA", "metric": metric, "metadata": metadata})

    def flush(self) -> None:
        self._file.flush()


class Logger:
    """Sends each record to its backends; flushes them at interpreter exit."""

    def __init__(self, backends: Iterable[Backend]) -> None:
        self.backends = list(backends)
        self.start_time = datetime.now(UTC)
        atexit.register(self.flush)

    def _now(self) -> tuple[datetime, float]:
        timestamp = datetime.now(UTC)
        return timestamp, (timestamp - self.start_time).total_seconds()

    def log(self, step: Step, data: Data, verbosity: int = Verbosity.DEFAULT) -> None:
        timestamp, elapsed = self._now()
        for backend in self.backends:
            if backend.verbosity >= verbosity:
                backend.log(timestamp, elapsed, step, data)

    def metadata(self, metric: str, metadata: Metadata) -> None:
        timestamp, elapsed = self._now()
        for backend in self.backends:
            if backend.verbosity != Verbosity.OFF:
                backend.metadata(timestamp, elapsed, metric, metadata)

    def flush(self) -> None:
        for backend in self.backends:
            backend.flush()


# The module-level API uses one process-wide logger, as dllogger does.
_logger: Logger | None = None


def init(backends: Iterable[Backend]) -> None:
    global _logger
    if _logger is not None:
        raise DLLLoggerAlreadyInitialized("dllogger.init() was already called in this process")
    _logger = Logger(backends)


def _initialized_logger() -> Logger:
    if _logger is None:
        raise DLLoggerNotInitialized("call dllogger.init(backends=[...]) first")
    return _logger


def log(step: Step, data: Data, verbosity: int = Verbosity.DEFAULT) -> None:
    _initialized_logger().log(step, data, verbosity)


def metadata(metric: str, metadata: Metadata) -> None:
    _initialized_logger().metadata(metric, metadata)


def flush() -> None:
    _initialized_logger().flush()
