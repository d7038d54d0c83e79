"""What a run cost each rank: when it passed each stage of its start-up, its checkpoint loads and saves, and its
memory. Gathered to rank 0 at the end of the run and logged as one dllogger record (step "RANK_COSTS", just
before the summary), which bench/bench_scale_cost.py reads.

At each milestone a rank notes the wall clock (Unix seconds: comparable across ranks as far as their servers'
clocks agree) and its own CPU seconds (all its threads). Per CPU second a stage that does the same work on
every rank costs the same at any world size; one whose CPU seconds grow with the world size does work per
other rank. Memory: the peak resident set (getrusage; it counts the shared libraries too) and the private
memory (Linux /proc/self/smaps_rollup: pages no other process shares, which is what limits the ranks a
server can hold), the largest seen at the milestones and after each checkpoint load and save.
"""

import contextlib
import math
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# In the order a rank passes them. process_start: its process began; imports_done: run_pretraining's imports
# (torch, DeepSpeed) are done and main begins; rendezvous_done: the process group is up; engine_ready: model,
# DeepSpeed engine and (when resuming) the checkpoint loaded, just before the first step; training_done: the
# last step and its checkpoint are done.
MILESTONES = ("process_start", "imports_done", "rendezvous_done", "engine_ready", "training_done")


def process_start_unix() -> float:
    """When this process began, in Unix seconds (Linux: /proc/self/stat's start tick after boot, placed by
    /proc/uptime, both 10 ms resolution); NaN where /proc does not tell."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started_after_boot = int(stat[stat.rindex(")") + 2:].split()[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return math.nan
    return time.time() - uptime + started_after_boot


def private_memory_mb(pid: int | str = "self") -> float:
    """A process's private memory now (MiB; this process's by default): the Private_Clean and Private_Dirty of
    /proc/PID/smaps_rollup; NaN where there is none (not Linux, or the process has ended)."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return math.nan
    return sum(int(line.split()[1]) for line in lines if line.startswith(("Private_Clean:", "Private_Dirty:"))) / 1024


def peak_resident_mb() -> float:
    """The peak resident set of this process (MiB; ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class RankCosts:
    wall: dict[str, float] = field(default_factory=dict)  # milestone -> Unix seconds
    cpu: dict[str, float] = field(default_factory=dict)   # milestone -> this process's CPU seconds
    checkpoint_s: dict[str, list[float]] = field(default_factory=lambda: {"load": [], "save": []})  # wall s of each
    private_at: dict[str, float] = field(default_factory=dict)  # milestone -> private MiB then
    private_mb: float = 0.0                   # the most seen so far

    @classmethod
    def from_start(cls) -> "RankCosts":
        """Made as main begins: the process start, and the imports done."""
        costs = cls(wall={"process_start": process_start_unix()}, cpu={"process_start": 0.0})
        costs.mark("imports_done")
        return costs

    def mark(self, milestone: str) -> None:
        self.wall[milestone], self.cpu[milestone] = time.time(), time.process_time()
        self.private_at[milestone] = self.note_memory()

    def note_memory(self) -> float:
        now = private_memory_mb()
        self.private_mb = max(self.private_mb, now)
        return now

    @contextlib.contextmanager
    def checkpoint_io(self, kind: str) -> Iterator[None]:
        """Times a checkpoint "load" or "save" (the collective as this rank sees it: its files and the waits)."""
        started = time.perf_counter()
        yield
        self.checkpoint_s[kind].append(time.perf_counter() - started)
        self.note_memory()

    def log_gathered(self, logger: Any, all_gather_object: Callable[[list[Any], object], object],
                     world: int) -> dict[str, Any]:
        """Collective, at the end of a run: marks training_done, gathers every rank's costs and logs their
        summary (the logger writes on rank 0 only); returns it."""
        self.mark("training_done")
        mine = {"wall": self.wall, "cpu": self.cpu, "checkpoint_s": self.checkpoint_s, "private_at": self.private_at,
                "peak_resident_mb": peak_resident_mb(), "private_mb": self.private_mb}
        ranks: list[Any] = [None] * world
        all_gather_object(ranks, mine)
        summary = summarize(ranks)
        logger.log(step="RANK_COSTS", data=summary)
        return summary


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's costs (RankCosts.log_gathered's dicts) in a few figures: when the first rank's process
    began and the last rank passed each milestone (Unix seconds), the mean CPU seconds per rank up to each,
    the mean private memory at each (after the start), the slowest rank's time of each checkpoint load and save,
    and the largest and mean memory of a rank."""
    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    summary: dict[str, Any] = {"ranks": len(ranks),
                               "process_start_unix_first": min(r["wall"]["process_start"] for r in ranks)}
    for milestone in MILESTONES:
        summary[f"{milestone}_unix_last"] = max(r["wall"][milestone] for r in ranks)
        summary[f"{milestone}_cpu_s_mean"] = mean([r["cpu"][milestone] for r in ranks])
        if milestone != "process_start":
            summary[f"{milestone}_private_mb_mean"] = mean([r["private_at"][milestone] for r in ranks])
    for kind in ("load", "save"):
        each_rank = [r["checkpoint_s"][kind] for r in ranks]
        summary[f"checkpoint_{kind}_s_slowest"] = [max(times) for times in zip(*each_rank)]
    for memory in ("peak_resident_mb", "private_mb"):
        summary[f"{memory}_max"] = max(r[memory] for r in ranks)
        summary[f"{memory}_mean"] = mean([r[memory] for r in ranks])
    return summary
