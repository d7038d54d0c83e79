"""What the device a rank runs on can do: its matrix-multiply peak (for MFU) and its memory (for the
memory check). Knows torch and the device, nothing of the model.

Peak: --peak_tflops when given; else the vendor's datasheet dense bf16 figure for a known Gaudi or NVIDIA
device; else (CPU, or an unknown device) a short matrix-multiply measurement, reported as measured.
"""

import os
import time

import torch

# Dense bf16 TFLOP/s from the vendors' datasheets (NVIDIA H100/H200 SXM and A100; Intel's Gaudi product
# table: Gaudi 60, Gaudi2 432, Gaudi3 1835). Matched against the device name, most specific first.
DATASHEET_BF16_TFLOPS = (("gaudi3", 1835.0), ("gaudi2", 432.0), ("gaudi", 60.0),
                         ("h200", 989.0), ("h100", 989.0), ("a100", 312.0))
DEVICE_MEMORY_GIB_BY_NAME = (("gaudi3", 128), ("gaudi2", 96), ("gaudi", 32))  # HPUs; CUDA reports its own
# The matrix product timed on the CPU: BERT-1.5B's FFN up-projection for 2048 tokens (2048x1600 @ 1600x6400).
MEASURED_SHAPE = (2048, 1600, 6400)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "hpu":
        return str(torch.hpu.get_device_name())
    return "cpu"


def datasheet_tflops(name: str):
    """The datasheet bf16 peak for a device name, or None."""
    lowered = name.lower().replace(" ", "")
    return next((tflops for key, tflops in DATASHEET_BF16_TFLOPS if key in lowered), None)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 1.0,
                          shape: tuple = MEASURED_SHAPE) -> float:
    """Best TFLOP/s of repeated (m x k) @ (k x n) products over about `seconds` (after one warm-up)."""
    m, k, n = shape
    left = torch.randn(m, k, device=device, dtype=dtype)
    right = torch.randn(k, n, device=device, dtype=dtype)
    torch.matmul(left, right)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.matmul(left, right)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best / 1e12


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> tuple:
    """(TFLOP/s, where the figure comes from) for MFU."""
    if override is not None:
        return override, "--peak_tflops"
    name = device_name(device)
    tflops = datasheet_tflops(name) if dtype == torch.bfloat16 else None
    if tflops is not None:
        return tflops, f"datasheet bf16 peak of {name}"
    return measure_matmul_tflops(device, dtype), (f"measured at start-up: {dtype} matmul "
                                                  f"{MEASURED_SHAPE[0]}x{MEASURED_SHAPE[1]}x{MEASURED_SHAPE[2]} "
                                                  f"on {name}, {torch.get_num_threads()} threads")


def device_memory_bytes(device: torch.device) -> tuple:
    """(bytes one rank may use, description). On the CPU: the machine's memory shared by its local ranks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device)
    if device.type == "hpu":
        name = device_name(device)
        lowered = name.lower().replace(" ", "")
        gib = next((size for key, size in DEVICE_MEMORY_GIB_BY_NAME if key in lowered), None)
        return (None if gib is None else gib * 2**30), name
    import psutil
    local_ranks = int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))
    total = psutil.virtual_memory().total
    return total / local_ranks, f"CPU memory {total / 2**30:.1f} GiB shared by {local_ranks} local rank(s)"
