"""What the device a rank runs on can do: its matrix-multiply peak (for MFU), its memory (for the memory
check) and whether it has bf16 (check_bf16_support). Knows torch and the device, nothing of the model.

Peak: --peak_tflops when given; else, for a bf16 run on a known Gaudi or NVIDIA device, the vendor's
datasheet dense bf16 figure; else (the CPU, an unknown device, or a run that is not bf16) a short
matrix-multiply measurement on the device in the run's dtype, reported as measured.
"""

import functools
import gc
import os
import time
from collections.abc import Callable, Collection, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Literal, Protocol, Self, TypeAlias

import torch
from torch.profiler import profile

from common.errors import InputError
from training import gaudi

if TYPE_CHECKING:
    from torch._C._profiler import _ProfilerEvent

# Dense bf16 TFLOP/s from the vendors' datasheets, matched against the device name, most specific first.
DATASHEET_BF16_TFLOPS = (
    ("gaudi3", 1835.0),  # Intel Gaudi 3 AI accelerator product brief / white paper: 1835 TFLOPS BF16 (matrix)
    ("gaudi2", 432.0),   # Intel Gaudi 2 product table (Habana developer site): 432 TFLOPS BF16
    ("gaudi", 60.0),     # first-generation Gaudi (HL-205), same table: 60 TFLOPS BF16
    # NVIDIA H100 datasheet table, PCIe column (as reprinted at archive-lib.hpctech.co.jp/gpuproduct/nvidia-h100.html):
    # 1513 TFLOPS BF16 with sparsity, 756 dense. Before "h100": the PCIe card's name, "NVIDIA H100 PCIe", contains it.
    ("h100pcie", 756.0),
    # The H100 NVL (a PCIe card, name "NVIDIA H100 NVL") has its own, lower column in NVIDIA's datasheet, which
    # we could not read to cite: its peak is measured, not the SXM's 989 that "h100" would give it.
    ("h100nvl", None),
    ("h100", 989.0),     # NVIDIA H100 SXM datasheet: 1979 TFLOPS BF16 with sparsity, 989 dense
    ("a100", 312.0),     # NVIDIA A100 datasheet: 312 TFLOPS BF16 dense (624 with sparsity)
)  # No H200: we found no NVIDIA datasheet to cite for it (only third-party pages); it gets the measured peak.
DEVICE_MEMORY_GIB_BY_NAME = (("gaudi3", 128), ("gaudi2", 96), ("gaudi", 32))  # HPUs; CUDA reports its own
# The products timed on the CPU: BERT-1.5B's linear layers for 1024 tokens (micro-batch 8 x 128), as
# nn.Linear computes them (x @ W^T, bf16 in bf16 out): FFN up, FFN down, attention output (m x k x n).
# The peak is the fastest of them, so that MFU is measured against the best case of the model's own shapes.
MEASURED_SHAPES = ((1024, 1600, 6400), (1024, 6400, 1600), (1024, 1600, 1600))
MIN_REPEATS = 3  # a short burst of load must not stand for the peak: at least this many timed products
# Products per timing on CUDA. One of these products is tens of microseconds on a current GPU (2 x 1024 x 1600
# x 6400 FLOPs, 21 GFLOP: 21 us at 1000 TFLOP/s), about what the launch and torch.cuda.synchronize add to a
# timing, so one product per timing would count that overhead as the product's and report a peak too low (an
# MFU too high). A burst of them between two waits spreads it thin. Not on a Gaudi: in lazy mode the products
# of one graph are the same operation on the same inputs, which the graph compiler may run once.
CUDA_PRODUCTS_PER_TIMING = 32


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "hpu":
        return str(torch.hpu.get_device_name())  # type: ignore[attr-defined]  # torch.hpu: the Habana bridge's
    return "cpu"


def check_bf16_support(bf16: bool, supported: bool, device: str) -> None:
    """A bf16 run (the DeepSpeed JSON's bf16.enabled) on a device without native bf16 arithmetic (supported:
    torch's answer without emulation, False below compute capability 8.0, e.g. a V100 or T4; DeepSpeed itself
    would accept the emulation) is an InputError, before the engine is built. `device` names it
    in the message."""
    if bf16 and not supported:
        raise InputError(f"bf16.enabled is true in the --deepspeed_config JSON, but {device} has no native bf16 "
                         "(torch would emulate it, far slower)")


def datasheet_tflops(name: str) -> float | None:
    """The datasheet bf16 peak for a device name, or None (not in the table, or in it without a figure, or a MIG
    slice of a GPU, e.g. "NVIDIA A100-SXM4-40GB MIG 3g.20gb": a fraction of the GPU's units, whose datasheet
    figure is the whole GPU's)."""
    if "mig" in name.lower().split():
        return None
    lowered = name.lower().replace(" ", "")
    return next((tflops for key, tflops in DATASHEET_BF16_TFLOPS if key in lowered), None)


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, seconds: float = 0.4,
                          shape: tuple[int, int, int] = MEASURED_SHAPES[0]) -> float:
    """Best TFLOP/s of repeated (m x k) @ (n x k)^T products over about `seconds` (at least MIN_REPEATS
    timings, after one warm-up); each timing is products_per_timing(device) products and one wait."""
    m, k, n = shape
    # Its own generator: the measurement must not move the global random state that the model's
    # initial weights are drawn from (else --peak_tflops, or a peak measured earlier in the process,
    # would change them).
    generator = torch.Generator(device=device).manual_seed(0)
    inputs = torch.randn(m, k, device=device, dtype=dtype, generator=generator)
    weight = torch.randn(n, k, device=device, dtype=dtype, generator=generator)
    wait, burst = wait_for(device), products_per_timing(device)
    torch.nn.functional.linear(inputs, weight)
    wait()
    best, repeats, deadline = float("inf"), 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline or repeats < MIN_REPEATS:
        start = time.perf_counter()
        for _ in range(burst):
            torch.nn.functional.linear(inputs, weight)
        wait()
        best, repeats = min(best, (time.perf_counter() - start) / burst), repeats + 1
    return 2.0 * m * k * n / best / 1e12


def products_per_timing(device: torch.device) -> int:
    """Products between the two clock readings of one timing: CUDA_PRODUCTS_PER_TIMING on CUDA, else 1 (the
    CPU runs a product in milliseconds, before it returns; a Gaudi: see CUDA_PRODUCTS_PER_TIMING)."""
    return CUDA_PRODUCTS_PER_TIMING if device.type == "cuda" else 1


def wait_for(device: torch.device) -> Callable[[], None]:
    """A function that returns once `device` has run what was queued: accelerators run ops asynchronously,
    so a timing must end with it. The CPU runs them before returning."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "hpu":
        return gaudi.wait_for_device
    return lambda: None


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> tuple[float, str]:
    """(TFLOP/s, where the figure comes from) for MFU."""
    if override is not None:
        return override, "--peak_tflops"
    name = device_name(device)
    tflops = datasheet_tflops(name) if dtype == torch.bfloat16 else None
    if tflops is not None:
        return tflops, f"datasheet bf16 peak of {name}"
    tflops, best = measured_peak(device, dtype, torch.get_num_threads())
    return tflops, (f"measured at start-up: the fastest {dtype} x @ W^T of "
                    f"{', '.join('x'.join(map(str, shape)) for shape in MEASURED_SHAPES)} (m x k x n) on {name}, "
                    f"{torch.get_num_threads()} threads, was {'x'.join(map(str, best))}")


@functools.cache  # once per process (tests run the driver many times in one process)
def measured_peak(device: torch.device, dtype: torch.dtype, threads: int) -> tuple[float, tuple[int, int, int]]:
    """(TFLOP/s, shape) of the fastest of MEASURED_SHAPES with `threads` torch threads."""
    measured = {shape: measure_matmul_tflops(device, dtype, shape=shape) for shape in MEASURED_SHAPES}
    best = max(measured, key=measured.__getitem__)
    return measured[best], best


def device_memory_bytes(device: torch.device) -> tuple[float | None, str]:
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


class PeakMemoryStats(Protocol):
    """The peak-memory counters of a device's allocator (torch.cuda, habana_frameworks.torch.hpu)."""

    def reset_peak_memory_stats(self) -> None: ...

    def max_memory_allocated(self) -> int: ...


class PeakAllocated:
    """Peak bytes of tensors allocated on `device` while the block runs (`with PeakAllocated(device) as
    peak: ...; peak.bytes`), what sizing.device_memory predicts. CUDA and Gaudi: the allocator's own peak.
    CPU: the running sum of the torch profiler's allocation and free events (every tensor the CPU allocator
    hands out, not the interpreter, the libraries or cached pages, which resident memory would mix in).

    The profiler follows only the threads it runs in: a block whose last reference another thread drops has
    no free event. The gradient bucket goes through a gloo all-reduce, whose worker thread holds it too; most
    likely that thread let go last when the scheduler ran it late (CI measured 1.96 GiB for a run that peaked
    at 1.03 GiB, one 1e9-byte bucket more). On the CPU, `lost_bytes` are the blocks that have no free event
    yet are held by no tensor the interpreter sees at the end (a tensor held only from C++ counts as lost);
    `low_bytes` is the peak with them left out, `bytes` with them counted to the end: the true peak lies
    between. An address handed out again frees, in the count, the block it held."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bytes: int | None = None
        self.low_bytes: int | None = None
        self.lost_bytes = 0
        self._profiler: profile | None = None

    def _allocator(self) -> PeakMemoryStats:
        if self.device.type == "hpu":
            import habana_frameworks.torch.hpu as hpu
            return hpu
        return torch.cuda

    def __enter__(self) -> Self:
        if self.device.type == "cpu":
            from torch.profiler import ProfilerActivity
            # Kineto, the profiler's library, prints `USDT: ... profiler_start` and `profiler_stop` (trace markers
            # for tools) at every start and stop unless its log level, read once per process at its first start,
            # is above its highest, USDT (5). Its error lines (4) go too; the profiler's exceptions still come.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._profiler.__enter__()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        else:
            self._allocator().reset_peak_memory_stats()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> Literal[False]:
        if self._profiler is None:
            self.bytes = self.low_bytes = self._allocator().max_memory_allocated()
            return False
        self._profiler.__exit__(exc_type, exc, traceback)  # type: ignore[no-untyped-call]  # as __enter__
        results = self._profiler.profiler.kineto_results if self._profiler.profiler is not None else None
        assert results is not None  # the profiler has stopped
        # In one nanosecond a free sorts before an allocation: an address freed and handed out again.
        events = sorted(cpu_allocation_events(results.experimental_event_tree()))
        unfreed = unfreed_blocks(events)
        lost = set(unfreed) - live_tensor_pointers()
        self.lost_bytes = sum(unfreed[ptr] for ptr in lost)
        self.bytes = running_peak(events, ())
        self.low_bytes = running_peak(events, lost)
        return False


# (time ns, bytes (negative: a free), address) of an allocation event.
AllocationEvent: TypeAlias = tuple[int, int, int]


def cpu_allocation_events(roots: Iterable["_ProfilerEvent"]) -> list[AllocationEvent]:
    """(time ns, bytes (negative: a free), address) of each CPU allocation event in a profiler event tree."""
    found: list[AllocationEvent] = []
    stack = list(roots)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        fields = event.extra_fields
        if isinstance(fields, torch._C._profiler._ExtraFields_Allocation) and fields.device.type == "cpu":
            found.append((event.start_time_ns, fields.alloc_size, fields.ptr))
    return found


def unfreed_blocks(events: list[AllocationEvent]) -> dict[int, int]:
    """{address: bytes} of the blocks allocated in `events` (in time order) that have no free event after."""
    live: dict[int, int] = {}
    for _, change, ptr in events:
        if change > 0:
            live[ptr] = change  # an address handed out again: the block it held before was freed unseen
        else:
            live.pop(ptr, None)
    return live


def running_peak(events: list[AllocationEvent], left_out: Collection[int]) -> int:
    """Peak of the running sum of `events` (in time order), leaving out the blocks at the addresses in
    `left_out` (unfreed: their allocation is the last event at that address)."""
    last_allocation = {ptr: index for index, (_, change, ptr) in enumerate(events) if change > 0}
    live: dict[int, int] = {}
    current = peak = 0
    for index, (_, change, ptr) in enumerate(events):
        if change > 0:
            current -= live.pop(ptr, 0)  # the block this address held, if its free went unseen
            if ptr in left_out and last_allocation[ptr] == index:
                continue
            current += change
            live[ptr] = change
        else:
            current += change
            live.pop(ptr, None)
        peak = max(peak, current)
    return peak


def live_tensor_pointers() -> set[int]:
    """Addresses of the storages of every tensor the interpreter holds now (gc sees every tensor object)."""
    pointers: set[int] = set()
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):  # not isinstance: it would read each object's __class__
            try:
                pointers.add(obj.untyped_storage().data_ptr())
            except Exception:  # a tensor without storage (functional wrappers) or a subclass that refuses
                continue
    return pointers
