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
import sys
from abc import ABC, abstractmethod
from datetime import UTC, datetime

__all__ = ["Backend", "DLLLoggerAlreadyInitialized", "DLLoggerNotInitialized", "JSONStreamBackend",
           "Logger", "StdOutBackend", "Verbosity", "default_metric_format", "default_prefix_format",
           "default_step_format", "flush", "init", "log", "metadata"]


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

    def __init__(self, verbosity):
        self._verbosity = verbosity

    @property
    def verbosity(self):
        return self._verbosity

    @abstractmethod
    def log(self, timestamp, elapsedtime, step, data):
        """timestamp: aware datetime; elapsedtime: seconds since the logger started (float)."""

    @abstractmethod
    def metadata(self, timestamp, elapsedtime, metric, metadata):
        """Describe ``metric`` (e.g. {"unit": "s", "format": ":.3f"})."""

    @abstractmethod
    def flush(self):
        """Push buffered output to its destination."""


def default_step_format(step):
    return str(step)


def default_metric_format(metric, metadata, value):
    """'name : value unit', with the value formatted by metadata['format'] (e.g. ':.4f') if given."""
    fmt = metadata.get("format")
    text = ("{" + fmt + "}").format(value) if fmt else str(value)
    unit = metadata.get("unit")
    return f"{metric} : {text} {unit}" if unit else f"{metric} : {text}"


def default_prefix_format(timestamp):
    return f"DLL {timestamp} - "


class StdOutBackend(Backend):
    """Prints one line per record: 'DLL <datetime> - <step> <metric> : <value> <unit> ...'."""

    def __init__(self, verbosity, step_format=default_step_format,
                 metric_format=default_metric_format, prefix_format=default_prefix_format):
        super().__init__(verbosity)
        self._metadata = {}
        self.step_format = step_format
        self.metric_format = metric_format
        self.prefix_format = prefix_format

    def log(self, timestamp, elapsedtime, step, data):
        metrics = " ".join(self.metric_format(name, self._metadata.get(name, {}), value)
                           for name, value in data.items())
        print(f"{self.prefix_format(timestamp)}{self.step_format(step)} {metrics}")

    def metadata(self, timestamp, elapsedtime, metric, metadata):
        self._metadata[metric] = dict(metadata)

    def flush(self):
        sys.stdout.flush()


def _json_value(value):
    """JSON fallback for what json cannot write: tensors/numpy values -> numbers or lists, else str."""
    if callable(getattr(value, "tolist", None)):
        return value.tolist()
    return str(value)


class JSONStreamBackend(Backend):
    """Appends 'DLLL {json}' lines to ``filename`` (truncated first unless ``append``)."""

    def __init__(self, verbosity, filename, append=False):
        super().__init__(verbosity)
        self.filename = filename
        self._file = open(filename, "a" if append else "w", encoding="utf-8")

    def _write(self, timestamp, elapsedtime, record):
        header = {"timestamp": str(timestamp.timestamp()), "datetime": str(timestamp),
                  "elapsedtime": str(elapsedtime)}
        self._file.write("DLLL " + json.dumps({**header, **record}, default=_json_value) + "\n")

    def log(self, timestamp, elapsedtime, step, data):
        self._write(timestamp, elapsedtime, {"type": "LOG", "step": step, "data": data})

    def metadata(self, timestamp, elapsedtime, metric, metadata):
        self._write(timestamp, elapsedtime, {"type": "METADATA", "metric": metric, "metadata": metadata})

    def flush(self):
        self._file.flush()


class Logger:
    """Sends each record to its backends; flushes them at interpreter exit."""

    def __init__(self, backends):
        self.backends = list(backends)
        self.start_time = datetime.now(UTC)
        atexit.register(self.flush)

    def _now(self):
        timestamp = datetime.now(UTC)
        return timestamp, (timestamp - self.start_time).total_seconds()

    def log(self, step, data, verbosity=Verbosity.DEFAULT):
        timestamp, elapsed = self._now()
        for backend in self.backends:
            if backend.verbosity >= verbosity:
                backend.log(timestamp, elapsed, step, data)

    def metadata(self, metric, metadata):
        timestamp, elapsed = self._now()
        for backend in self.backends:
            if backend.verbosity != Verbosity.OFF:
                backend.metadata(timestamp, elapsed, metric, metadata)

    def flush(self):
        for backend in self.backends:
            backend.flush()


# The module-level API uses one process-wide logger, as dllogger does.
_logger = None


def init(backends):
    global _logger
    if _logger is not None:
        raise DLLLoggerAlreadyInitialized("dllogger.init() was already called in this process")
    _logger = Logger(backends)


def _initialized_logger():
    if _logger is None:
        raise DLLoggerNotInitialized("call dllogger.init(backends=[...]) first")
    return _logger


def log(step, data, verbosity=Verbosity.DEFAULT):
    _initialized_logger().log(step, data, verbosity)


def metadata(metric, metadata):
    _initialized_logger().metadata(metric, metadata)


def flush():
    _initialized_logger().flush()
