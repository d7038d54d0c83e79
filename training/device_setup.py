"""The device a rank runs on, and the process settings it needs there: `choose_accelerator` before DeepSpeed's
first import, the checks of the device against the environment (a DS_ACCELERATOR that names another device,
more processes on a server than CUDA devices), the CPU's threads and memory, and the seeds."""

import ctypes
import os
import random
import sys

import numpy as np
import torch

from common.errors import HostInputError, InputError


def device_type(use_hpu: bool, no_cuda: bool, cuda_available: bool) -> str:
    """The device setup_device_and_distributed uses: hpu with --use_hpu, else cuda when CUDA is available and
    not --no_cuda, else cpu."""
    if use_hpu:
        return "hpu"
    return "cuda" if cuda_available and not no_cuda else "cpu"


def check_accelerator_variable(value: str | None, use_hpu: bool, no_cuda: bool, cuda_available: bool) -> None:
    """A DS_ACCELERATOR (value; None: unset) that names another device than the run's is an InputError:
    DeepSpeed takes it at its first import and puts the engine there, and the run would fail deep inside
    (torch.cuda.set_device on a machine without CUDA, DeepSpeed's import without Habana's bridge)."""
    device = device_type(use_hpu, no_cuda, cuda_available)
    if value is None or value == device:
        return
    why = {"hpu": "--use_hpu", "cuda": "CUDA is available here",
           "cpu": "--no_cuda" if no_cuda else "no CUDA device here"}[device]
    flag = "--use_hpu" if value == "hpu" else "--no_cuda" if value == "cpu" and device == "cuda" else None
    instead = f", or pass {flag} to run on {value}" if flag else ""
    raise InputError(f"DS_ACCELERATOR={value} names another device than this run's, {device} ({why}): unset "
                     f"DS_ACCELERATOR (the entry point sets it) or set it to {device}{instead}")


def choose_accelerator(use_hpu: bool, no_cuda: bool) -> None:
    """DeepSpeed picks its accelerator when first imported: call this before that. The choice is
    setup_device_and_distributed's, so DeepSpeed agrees with the device we use and has no fallback to warn
    about ('Setting accelerator to CPU' above --help); a user's DS_ACCELERATOR that names another device is
    an InputError. With --use_hpu, setup_device_and_distributed checks it once Habana's bridge is imported:
    without the bridge the run stops there anyway (and the tests take --use_hpu's earlier checks on the CPU,
    with DS_ACCELERATOR=cpu)."""
    if use_hpu:
        os.environ.setdefault("DS_ACCELERATOR", "hpu")
        return
    cuda_available = torch.cuda.is_available()
    check_accelerator_variable(os.environ.get("DS_ACCELERATOR"), False, no_cuda, cuda_available)
    if device_type(False, no_cuda, cuda_available) == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def local_world_size() -> int:
    """The processes on this server, as the deepspeed launcher (LOCAL_SIZE) or torchrun (LOCAL_WORLD_SIZE) set
    it; 1 without a launcher."""
    return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", "1")))


def check_cuda_devices(local_rank: int, local_ranks: int, device_count: int) -> None:
    """Each process takes the CUDA device of its LOCAL_RANK, and torch.cuda.set_device raised for one beyond
    the server's devices (e.g. torchrun --nproc_per_node above the GPU count): a HostInputError instead, the
    server's own fault where the others have their GPUs (one failed or hidden), so training/supervisor.py's
    host check decides, not a final error. It is found from the local process count on every rank of the
    server, so that its local rank 0 prints it (run_cli). Where no launcher gave that count only the rank
    itself finds it, and exits 1 without the line (run_cli prints a server's InputError from its local rank
    0 alone)."""
    if local_ranks > device_count:
        what = f"{local_ranks} processes on this server, one per CUDA device, but {device_count} visible"
    elif local_rank >= device_count:
        what = f"LOCAL_RANK {local_rank} takes CUDA device {local_rank}, but this server has {device_count} visible"
    else:
        return
    raise HostInputError(f"{what} CUDA device(s): start at most {device_count} processes per server "
                         "(torchrun --nproc_per_node, deepspeed --num_gpus)")


def share_cores_between_local_ranks() -> None:
    """Trap: the deepspeed launcher does not set OMP_NUM_THREADS, so N ranks on one machine would each
    use every core (measured 20-30x slower steps with 2 ranks on 2 cores). Respect a user's setting."""
    local_ranks = local_world_size()
    if "OMP_NUM_THREADS" not in os.environ and local_ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))


# glibc's mallopt parameters (malloc.h) and the user settings that replace ours.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory_in_process() -> bool:
    """Trap: glibc gives every freed block above its mmap threshold (32 MiB at most) back to the kernel,
    so the large tensors of each step (bf16 and fp32 copies of the flat parameters and gradients, the
    activations) are page-faulted in again at every step: 1.5 s of system time per step was measured at
    BERT-1.5B widths with 2 layers, a third of the step. Raise both thresholds so that freed memory stays
    in the process for the next step (measured there: steps 1.9x faster, peak RSS 6% higher). glibc only;
    a user's MALLOC_* or GLIBC_TUNABLES malloc setting wins. Returns whether the setting was applied."""
    if (not sys.platform.startswith("linux") or any(name in os.environ for name in _MALLOC_SETTINGS)
            or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "")):
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc (e.g. musl)
        return False
    largest = ctypes.c_int(2 ** 31 - 1)
    return bool(mallopt(_M_TRIM_THRESHOLD, largest)) and bool(mallopt(_M_MMAP_THRESHOLD, largest))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
