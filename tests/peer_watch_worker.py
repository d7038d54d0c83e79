"""One rank of two for tests/test_peer_watch.py, under runtime.run_cli as the entry points run: it sets up the
process group (with or without the peer watch, argv[1] "watch" / "no-watch", collective timeout argv[2] s),
prints "ready", then broadcasts a 64 MB tensor from rank 0 over and over, more than the sockets' buffers hold,
so rank 0 is in the middle of a send whenever rank 1 stops reading. Started with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set.
"""

import sys

import torch
import torch.distributed as dist

from training import runtime


def main(argv):
    runtime.setup_device_and_distributed(use_hpu=False, no_cuda=True, collective_timeout_s=float(argv[1]),
                                         watch_peers=argv[0] == "watch")
    payload = torch.ones(16 * 2 ** 20)
    print("ready", flush=True)
    while True:
        dist.broadcast(payload, src=0)


if __name__ == "__main__":
    sys.exit(runtime.run_cli(main, sys.argv[1:], ()))
