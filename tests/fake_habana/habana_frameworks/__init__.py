"""A stand-in for Habana's PyTorch bridge (habana_frameworks), for tests on machines without a Gaudi.

It models only what the lazy-mode code of training/gaudi.py touches, and records every use in `CALLS` (and, when
FAKE_HABANA_LOG names a file, one line per use there, for tests that run a subprocess):
- importing the package: "import";
- `habana_frameworks.torch.core.mark_step()`: "mark_step" (the real one compiles and launches the ops
  accumulated since the last call; this one does nothing else);
- `habana_frameworks.torch.utils.internal.is_lazy()`: PT_HPU_LAZY_MODE == "1", as the bridge decides it
  from that variable at import (unset: "1" here; the real default depends on the release, lazy up to
  the 1.1x releases and eager/compile in recent ones; the launchers always set it).
- torch.compile's backend `hpu_backend` (an entry point of the `torch_dynamo_backends` group): "hpu_backend"
  for each graph it is given, which it runs as it is (the real one compiles it for the device);
- `habana_frameworks.torch.hpu.device_count()` / `is_available()`: STUB_HPU_COUNT (8) devices, for the
  launchers' device check;
- `habana_frameworks.torch.hpu.synchronize()`: "synchronize" (the real one waits for the device).
It provides no hpu device and no hccl backend: a run with --use_hpu cannot get past the process group's
start with it.
"""

import os

CALLS = []


def record(event: str) -> None:
    CALLS.append(event)
    log = os.environ.get("FAKE_HABANA_LOG")
    if log:
        with open(log, "a") as f:
            f.write(event + "\n")


record("import")
