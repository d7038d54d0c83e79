"""training/hardware.py: the datasheet table by device name, the measured matmul peak and the device waits that end its
timings, the CPU memory share."""

import time
import types

import pytest
import torch

from training import hardware


@pytest.mark.parametrize("name,tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                         ("NVIDIA H100 NVL", None),  # not the SXM's 989: measured
                                         ("NVIDIA H200", None),  # no datasheet figure found to cite: measured
                                         ("NVIDIA A100-SXM4-80GB", 312.0), ("GAUDI", 60.0), ("GAUDI2", 432.0),
                                         ("Gaudi 3", 1835.0), ("Tesla V100-SXM2-32GB", None), ("cpu", None),
                                         # a MIG slice: a fraction of the GPU, not its datasheet figure
                                         ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", None),
                                         ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None)])
def test_datasheet_peak_by_device_name(name, tflops):
    assert hardware.datasheet_tflops(name) == tflops


def test_cpu_peak_is_measured_at_start_up():
    tflops, source = hardware.peak_tflops(torch.device("cpu"), torch.float32)
    assert source.startswith("measured at start-up") and tflops > 0
    assert hardware.peak_tflops(torch.device("cpu"), torch.bfloat16, override=123.0) == (123.0, "--peak_tflops")


def test_the_measured_rate_is_that_of_the_fastest_timed_product(monkeypatch):
    """A stand-in clock that each product advances by a scripted time (the wait after it moves it): the rate
    is 2mkn over the shortest of them, and the products go on until the time asked for has passed. On the
    real clock this cannot be checked against a product timed apart: load that starts between the two
    timings (the other pytest-xdist worker launching its ranks) made every timed product slower than that
    one, on the same machine."""
    durations = [0.5, 0.125, 0.25, 0.0625, 0.5, 0.25, 0.25]  # the warm-up's, then each timed product's
    clock = [0.0]
    monkeypatch.setattr(hardware, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(hardware, "wait_for", lambda device: lambda: clock.__setitem__(0, clock[0] + durations.pop(0)))
    shape = (8, 16, 32)
    # The deadline is 1 s after the warm-up ends (at 1.5 s): the 5th timed product is the first to end past it.
    tflops = hardware.measure_matmul_tflops(torch.device("cpu"), torch.float32, 1.0, shape)
    assert tflops == 2 * 8 * 16 * 32 / 0.0625 / 1e12
    assert durations == [0.25]


def test_peak_measurement_leaves_the_global_random_state_alone():
    """The model's initial weights are drawn after the peak is measured (or not, with --peak_tflops)."""
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    hardware.measure_matmul_tflops(torch.device("cpu"), torch.float32, 0.0, (8, 8, 8))
    assert torch.equal(torch.rand(4), expected)


def test_cpu_memory_is_shared_by_the_local_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_SIZE", "1")
    whole, _ = hardware.device_memory_bytes(torch.device("cpu"))
    monkeypatch.setenv("LOCAL_SIZE", "4")
    quarter, description = hardware.device_memory_bytes(torch.device("cpu"))
    assert quarter == pytest.approx(whole / 4) and "4 local rank(s)" in description


def test_every_timed_product_ends_with_the_devices_wait(monkeypatch):
    """On an accelerator a product returns before the device has run it: the timing must include the wait
    (hardware.wait_for; on an HPU gaudi.wait_for_device, tested in test_gaudi_lazy.py). A stand-in wait of
    20 ms on the CPU bounds every timed product below by 20 ms, so the rate by 2mkn / 20 ms."""
    waits = []

    def slow_wait():
        time.sleep(0.02)
        waits.append(time.perf_counter())

    monkeypatch.setattr(hardware, "wait_for", lambda device: slow_wait)
    shape = (8, 8, 8)
    tflops = hardware.measure_matmul_tflops(torch.device("cpu"), torch.float32, 0.0, shape)
    assert tflops <= 2 * 8 * 8 * 8 / 0.02 / 1e12
    assert len(waits) == hardware.MIN_REPEATS + 1  # the warm-up's and each timed product's


def test_a_cuda_timing_spans_a_burst_of_products_and_the_cpus_one_product():
    """On CUDA the launch and the synchronize cost about as much as one product of the measured shapes: a
    timing spans CUDA_PRODUCTS_PER_TIMING products (the decision only: no GPU here)."""
    assert hardware.products_per_timing(torch.device("cuda", 3)) == hardware.CUDA_PRODUCTS_PER_TIMING >= 16
    assert hardware.products_per_timing(torch.device("cpu")) == 1
    assert hardware.products_per_timing(torch.device("hpu")) == 1


def test_a_timing_of_several_products_counts_each_once(monkeypatch):
    """A timing of n products that the stand-in wait makes last n x 0.25 s gives the rate of one 0.25 s product."""
    clock = [0.0]
    monkeypatch.setattr(hardware, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(hardware, "products_per_timing", lambda device: 4)
    monkeypatch.setattr(hardware, "wait_for", lambda device: lambda: clock.__setitem__(0, clock[0] + 4 * 0.25))
    shape = (8, 16, 32)
    assert hardware.measure_matmul_tflops(torch.device("cpu"), torch.float32, 0.0, shape) == \
        2 * 8 * 16 * 32 / 0.25 / 1e12


def test_the_wait_is_the_accelerators_own(monkeypatch):
    """CUDA waits with torch.cuda.synchronize on the run's device; the CPU has nothing to wait for."""
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    hardware.wait_for(torch.device("cuda", 1))()
    hardware.wait_for(torch.device("cpu"))()
    assert synchronized == [torch.device("cuda", 1)]


def test_cpu_peak_with_a_block_freed_on_another_thread_is_a_range_around_the_true_peak():
    """The profiler records a free only on the threads it follows. Here a 64 MB tensor's last reference is
    dropped on a plain thread (as gloo's worker drops a gradient bucket it all-reduced): no free event. The
    figures against the sizes allocated: the true peak, 72 MB (8 held + 64), lies between low_bytes (the lost
    block left out: 8 MB + 4 KB) and bytes (counted to the end: 8 MB + 64 MB + 4 KB), and lost_bytes names the
    64 MB. The running sum alone said 72 MB + 4 KB and nothing else (CI: 1.96 GiB for a run that peaked at
    1.03). 64 MB is above glibc's largest mmap threshold and 4 KB far below it: the small tensor cannot take
    the lost block's address (an address handed out again counts as the free of the block it held)."""
    import queue
    import threading
    to_worker, done, main_let_go = queue.Queue(), queue.Queue(), threading.Event()

    def drop_what_it_is_given():
        while (item := to_worker.get()) is not None:
            main_let_go.wait(timeout=60)  # the main thread's reference goes first: this one is the last
            del item
            done.put(True)

    worker = threading.Thread(target=drop_what_it_is_given)
    worker.start()
    megabyte = 250_000  # float32 elements
    try:
        with hardware.PeakAllocated(torch.device("cpu")) as peak:
            freed_here = torch.empty(4 * megabyte)
            del freed_here
            held = torch.empty(8 * megabyte)
            freed_there = torch.empty(64 * megabyte)
            to_worker.put(freed_there)
            del freed_there
            main_let_go.set()
            done.get(timeout=60)
            after = torch.empty(1024)
            del after
    finally:
        to_worker.put(None)
        worker.join(timeout=60)
    assert (peak.low_bytes, peak.bytes, peak.lost_bytes) == (8_004_096, 72_004_096, 64_000_000)
    assert held.numel() == 8 * megabyte  # held to the end: not lost


def test_cpu_peak_without_lost_frees_is_one_figure():
    """Every free seen: low_bytes == bytes == the true peak, nothing lost."""
    megabyte = 250_000
    with hardware.PeakAllocated(torch.device("cpu")) as peak:
        first = torch.empty(4 * megabyte)
        second = torch.empty(8 * megabyte)
        del first, second
        third = torch.empty(2 * megabyte)
        del third
    assert (peak.low_bytes, peak.bytes, peak.lost_bytes) == (12_000_000, 12_000_000, 0)


P, Q = 0x1000, 0x2000  # two addresses


@pytest.mark.parametrize("events,left_out,peak", [
    ([(1, 100, P), (2, -100, P), (3, 50, Q)], (), 100),  # every free seen
    ([(1, 100, P), (2, 10, P), (3, 50, Q)], (), 100),  # P handed out again: its 100 were freed unseen before
    ([(1, 100, P), (2, 10, P), (3, 50, Q)], (P,), 100),  # the lost 10 left out; the 100 before them still count
    ([(1, 100, P), (2, 50, Q), (3, 10, P)], (P,), 150),  # 100 at P and 50 at Q together, then P reused
    ([(1, 10, P), (2, 100, Q)], (P,), 100),  # the lost block never counts
    ([(1, -30, P), (2, 40, Q)], (), 10)])  # a free of a block from before the window lowers the sum
def test_running_peak_counts_each_address_once(events, left_out, peak):
    """running_peak over hand-made events (time, bytes, address), against peaks worked out by hand. An
    address allocated again without a free between counts as freed there; a left-out (lost) block is its
    address's last allocation; leaving it out never drops the block that address held before."""
    assert hardware.running_peak(events, left_out) == peak


def test_unfreed_blocks_are_the_last_allocation_at_each_address_without_a_free():
    events = [(1, 100, P), (2, 10, P), (3, 50, Q), (4, -50, Q)]
    assert hardware.unfreed_blocks(events) == {P: 10}
