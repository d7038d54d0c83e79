import os


def device_count() -> int:
    return int(os.environ.get("STUB_HPU_COUNT", "8"))


def is_available() -> bool:
    return device_count() > 0


class Event:
    """Named (as a type) by DeepSpeed's modules at import; never used here."""


class Stream(Event):
    """Named (as a type) by DeepSpeed's modules at import; never used here."""
