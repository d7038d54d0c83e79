"""Runs run_pretraining.py's main() and writes this rank's peak of allocated CPU tensor bytes
(hardware.PeakAllocated: the profiler's allocation events, not resident memory; low and high, which differ
when a block was freed on a thread the profiler does not follow) to $MEMORY_PEAK_DIR/peak_<rank>.json. That
is what sizing.device_memory predicts. Used by tests/test_sizing.py,
alone or under the deepspeed launcher.
"""

import json
import os
import sys
from pathlib import Path

import torch

import run_pretraining
from training import command_line, hardware


def main(argv, job):
    with hardware.PeakAllocated(torch.device("cpu")) as peak:
        run_pretraining.main(argv, job=job)
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ["MEMORY_PEAK_DIR"]) / f"peak_{rank}.json"
    out.write_text(json.dumps({"rank": rank, "low_bytes": peak.low_bytes, "peak_bytes": peak.bytes}))


if __name__ == "__main__":  # under run_cli, as the driver: the ranks leave together (training/peer_watch.py)
    sys.exit(command_line.run_cli(main, sys.argv[1:], ()))
