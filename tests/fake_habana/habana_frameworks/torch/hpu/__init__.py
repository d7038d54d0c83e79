import os

from habana_frameworks import record


def device_count() -> int:
    return int(os.environ.get("STUB_HPU_COUNT", "8"))


def is_available() -> bool:
    return device_count() > 0


def synchronize() -> None:
    record("synchronize")


class Event:
    """Named (as a type) by DeepSpeed's modules at import; never used here."""


class Stream(Event):
    """Named (as a type) by DeepSpeed's modules at import; never used here."""
