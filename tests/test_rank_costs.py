"""training/rank_costs.py: each rank's milestones, checkpoint times and memory, and their summary (the RANK_COSTS
record that bench/bench_scale_cost.py reads)."""

import mmap
import subprocess
import sys
import time

import psutil
import pytest

from training import rank_costs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_process_start_is_when_the_parent_spawned_the_process():
    """A child's own start (/proc, 10 ms ticks) lies between the parent's clock just before and just after it
    spawned the child; the child's imports end after that."""
    before = time.time()
    child = subprocess.Popen([sys.executable, "-c", "from training import rank_costs; "
                              "costs = rank_costs.RankCosts.from_start(); "
                              "print(costs.wall['process_start'], costs.wall['imports_done'])"],
                             stdout=subprocess.PIPE, text=True)
    spawned = time.time()
    started, imports_done = map(float, child.communicate()[0].split())
    assert before - 0.02 < started < spawned + 0.02 < imports_done + 0.02, (before, started, spawned, imports_done)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_private_memory_grows_by_an_allocation_that_is_touched():
    """smaps_rollup's private pages against psutil's unique set size, and against 64 MiB written."""
    assert rank_costs.private_memory_mb() == pytest.approx(psutil.Process().memory_full_info().uss / 2 ** 20, rel=0.05)
    before = rank_costs.private_memory_mb()
    # A fresh anonymous mapping, not the allocator: an earlier test in this process may have set glibc to keep
    # freed memory (training/device_setup.py), which a bytearray of the same size would reuse without growing.
    block = mmap.mmap(-1, 64 * 2 ** 20)
    block[::4096] = b"x" * len(block[::4096])
    assert 60 < rank_costs.private_memory_mb() - before < 72
    assert rank_costs.peak_resident_mb() >= rank_costs.private_memory_mb()
    block.close()


def test_the_summary_takes_the_first_start_the_last_milestones_and_the_slowest_checkpoint():
    def rank(offset, cpu, loads, saves, resident, private):
        wall = {m: 1000.0 + offset + i for i, m in enumerate(rank_costs.MILESTONES)}
        return {"wall": wall, "cpu": {m: cpu * i for i, m in enumerate(rank_costs.MILESTONES)},
                "private_at": {m: private - 10 * i for i, m in enumerate(rank_costs.MILESTONES[1:])},
                "checkpoint_s": {"load": loads, "save": saves}, "peak_resident_mb": resident, "private_mb": private}

    summary = rank_costs.summarize([rank(0.0, 1.0, [0.5], [1.0, 2.0], 600, 480),
                                    rank(3.0, 3.0, [1.5], [4.0, 0.5], 500, 520)])
    assert summary["ranks"] == 2 and summary["process_start_unix_first"] == 1000.0
    assert summary["rendezvous_done_unix_last"] == 1005.0 and summary["training_done_unix_last"] == 1007.0
    assert summary["engine_ready_cpu_s_mean"] == 6.0  # (3 x 1 + 3 x 3) / 2
    assert summary["checkpoint_load_s_slowest"] == [1.5] and summary["checkpoint_save_s_slowest"] == [4.0, 2.0]
    assert (summary["peak_resident_mb_max"], summary["peak_resident_mb_mean"]) == (600, 550)
    assert (summary["private_mb_max"], summary["private_mb_mean"]) == (520, 500)
    assert summary["imports_done_private_mb_mean"] == 500 and summary["training_done_private_mb_mean"] == 470
    assert "process_start_private_mb_mean" not in summary


def test_a_rank_notes_its_milestones_in_order_and_times_its_checkpoints():
    costs = rank_costs.RankCosts.from_start()
    costs.mark("rendezvous_done")
    with costs.checkpoint_io("load"):
        time.sleep(0.05)
    costs.mark("engine_ready")
    with costs.checkpoint_io("save"):
        time.sleep(0.02)
    logged = []

    class Logger:
        def log(self, step, data):
            logged.append((step, data))

    def gather(into, mine):  # one rank
        into[0] = mine

    summary = costs.log_gathered(Logger(), gather, world=1)
    assert logged == [("RANK_COSTS", summary)]
    walls = [summary[f"{m}_unix_last"] for m in rank_costs.MILESTONES]
    assert walls == sorted(walls)
    assert summary["checkpoint_load_s_slowest"][0] >= 0.05 and 0.02 <= summary["checkpoint_save_s_slowest"][0] < 0.05
