"""One rank of two for tests/test_peer_watch.py, under runtime.run_cli as the entry points run: it sets up the
process group (with or without the peer watch, argv[0] "watch" / "no-watch", collective timeout argv[1] s), then
one broadcast of 64 MB from rank 0, more than the sockets between two ranks buffer. Rank 1 posts its receive
and prints "ready"; rank 0 prints "ready" and starts sending when it reads a line on stdin (the test stops rank 1
first, so the send stays under way). Started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

import sys
import time

import torch
import torch.distributed as dist

from training import runtime


def main(argv):
    runtime.setup_device_and_distributed(use_hpu=False, no_cuda=True, collective_timeout_s=float(argv[1]),
                                         watch_peers=argv[0] == "watch")
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
    sys.exit(runtime.run_cli(main, sys.argv[1:], ()))
