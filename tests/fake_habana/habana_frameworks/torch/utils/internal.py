import os


def is_lazy() -> bool:
    return os.environ.get("PT_HPU_LAZY_MODE", "1") == "1"
