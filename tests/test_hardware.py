"""training/hardware.py: the datasheet table by device name, the measured matmul peak and the device waits that end its
timings, the CPU memory share."""

import time

import pytest
import torch

from training import hardware


@pytest.mark.parametrize("name,tflops", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                         ("NVIDIA H200", None),  # no datasheet figure found to cite: measured
                                         ("NVIDIA A100-SXM4-80GB", 312.0), ("GAUDI", 60.0), ("GAUDI2", 432.0),
                                         ("Gaudi 3", 1835.0), ("Tesla V100-SXM2-32GB", None), ("cpu", None)])
def test_datasheet_peak_by_device_name(name, tflops):
    assert hardware.datasheet_tflops(name) == tflops


def test_cpu_peak_is_measured_and_close_to_a_separately_timed_product():
    """The measured figure is the best of its repeats: at least the rate of one product timed here."""
    cpu = torch.device("cpu")
    tflops, source = hardware.peak_tflops(cpu, torch.float32)
    assert source.startswith("measured at start-up") and tflops > 0
    left, right = torch.randn(256, 512), torch.randn(512, 1024)
    start = time.perf_counter()
    torch.matmul(left, right)
    once = 2 * 256 * 512 * 1024 / (time.perf_counter() - start) / 1e12
    assert hardware.measure_matmul_tflops(cpu, torch.float32, 0.2, (256, 512, 1024)) >= 0.5 * once
    assert hardware.peak_tflops(cpu, torch.bfloat16, override=123.0) == (123.0, "--peak_tflops")


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


def test_the_wait_is_the_accelerators_own(monkeypatch):
    """CUDA waits with torch.cuda.synchronize on the run's device; the CPU has nothing to wait for."""
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synchronized.append(device))
    hardware.wait_for(torch.device("cuda", 1))()
    hardware.wait_for(torch.device("cpu"))()
    assert synchronized == [torch.device("cuda", 1)]
