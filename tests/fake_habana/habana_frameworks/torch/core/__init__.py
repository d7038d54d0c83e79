from habana_frameworks import record


def mark_step(device_str: str = "", sync: bool = False) -> None:
    record("mark_step")
