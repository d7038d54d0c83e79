"""Runs run_pretraining.py's main() under the torch profiler with memory recording and writes this rank's
peak of allocated CPU tensor bytes to $MEMORY_PEAK_DIR/peak_<rank>.json.

The peak is the running sum of the profiler's allocation and free events (every tensor the CPU allocator
hands out, from the model's creation to the end of training), so it counts tensors only: not the Python
interpreter, the libraries or the allocator's cached pages, which RSS would mix in. That is what
sizing.device_memory predicts. Used by tests/test_sizing.py, alone or under the deepspeed launcher.
"""

import json
import os
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import run_pretraining  # noqa: E402


def peak_allocated_bytes(prof) -> int:
    events = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events()
                    if event.name() == "[memory]" and str(event.device_type()).endswith("CPU"))
    current = peak = 0
    for _, change in events:
        current += change
        peak = max(peak, current)
    return peak


def main():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_pretraining.main(sys.argv[1:])
    rank = int(os.environ.get("RANK", "0"))
    out = Path(os.environ["MEMORY_PEAK_DIR"]) / f"peak_{rank}.json"
    out.write_text(json.dumps({"rank": rank, "peak_bytes": peak_allocated_bytes(prof)}))


if __name__ == "__main__":
    main()
