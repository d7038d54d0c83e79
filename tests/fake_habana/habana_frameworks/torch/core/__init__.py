from habana_frameworks import record
from habana_frameworks.torch import hpu  # noqa: F401  (DeepSpeed's HPU accelerator reaches it through here)


def mark_step(device_str: str = "", sync: bool = False) -> None:
    record("mark_step")
