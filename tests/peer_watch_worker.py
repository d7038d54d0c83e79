"""One rank of two for tests/test_peer_watch.py, under command_line.run_cli as the entry points run. It sets up the
process group (with or without the peer watch, argv[0] "watch" / "no-watch", collective timeout argv[1] s), then
does argv[2]:
- "send": one broadcast of 64 MB from rank 0, more than the sockets between two ranks buffer. Rank 1 posts its
  receive and prints "ready"; rank 0 prints "ready" and starts sending when it reads a line on stdin (the test
  stops rank 1 first, so the send stays under way).
- "slow-clean-up", "slow-clean-up-watching": every rank meets the same bad input; rank 0's clean-up then takes
  longer than the watch's grace, as run_pretraining.py's wait for a checkpoint copy may. The first stops the
  watch before it (training/distributed.Job.stop_watching_peers), as run_pretraining.py does; the second does not.
Started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

import sys
import time

import torch
import torch.distributed as dist

from common.errors import InputError
from training import command_line, distributed, peer_watch


def main(argv, job):
    distributed.setup_device_and_distributed(job, use_hpu=False, no_cuda=True, collective_timeout_s=float(argv[1]),
                                             watch_peers=argv[0] == "watch")
    if argv[2].startswith("slow-clean-up"):
        try:
            raise InputError("the same bad input on every rank")
        except InputError:
            if argv[2] == "slow-clean-up":
                job.stop_watching_peers(goodbye=False)
            if dist.get_rank() == 0:
                time.sleep(peer_watch.GRACE_S + 2)
            raise
    payload = torch.ones(16 * 2 ** 20)
    if dist.get_rank() == 1:
        dist.broadcast(payload, src=0, async_op=True)
        time.sleep(1.0)  # gloo's worker thread posts the receive
        print("ready", flush=True)
        time.sleep(3600)  # the test kills this rank
    print("ready", flush=True)
    sys.stdin.readline()
    dist.broadcast(payload, src=0)


if __name__ == "__main__":
    sys.exit(command_line.run_cli(main, sys.argv[1:], ()))
