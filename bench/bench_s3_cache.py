"""Throughput of storage.ShardCache: shards downloaded from S3 and verified (size + ETag) into the cache.

    python bench/bench_s3_cache.py [--shards 4] [--shard_mb 128] [--repeat 2]

Starts moto_server (the S3-compatible test server from requirements-dev.txt) on 127.0.0.1, uploads
--shards objects of --shard_mb MiB (random bytes: the cache does not look inside), then times, --repeat
times each, alternating: the cache filling itself shard by shard through local_path() (download with
ranged GETs of 64 MiB, multipart ETag check, rename), and the same bytes read by a plain boto3
get_object loop (no file, no check) as a reference, and the ratio of the two rates round by round (the
figure to quote). Figures are against a server on this machine, so they measure the client side (and moto),
not a network.
"""

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from pathlib import Path

from common import storage

REPO = Path(__file__).resolve().parent.parent


def load_s3_helpers():
    """tests/s3_helpers.py, the suite's moto_server code, loaded from its file (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("s3_helpers", REPO / "tests" / "s3_helpers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


s3_helpers = load_s3_helpers()


def fill(store, cache_dir: Path) -> tuple[float, int]:
    cache = storage.ShardCache(store, cache_dir, capacity=1 << 40)
    started = time.perf_counter()
    for url in cache.list_files():
        cache.local_path(url)
    elapsed = time.perf_counter() - started
    cache.close()
    return elapsed, cache.downloaded_bytes


def plain_gets(store) -> tuple[float, int]:
    started, total = time.perf_counter(), 0
    for remote in store.list_objects():
        body = store.client.get_object(Bucket=store.bucket, Key=store.key(remote.name))["Body"]
        while chunk := body.read(8 << 20):
            total += len(chunk)
    return time.perf_counter() - started, total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard_mb", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-s3-") as work:
        work = Path(work)
        server = s3_helpers.MotoServer(work / "moto.log")
        try:
            os.environ.update(s3_helpers.s3_env(server, work))
            s3_helpers.make_bucket(server, "bench-bucket")
            store = storage.S3Store("s3://bench-bucket/shards")
            source = work / "source.bin"
            for index in range(args.shards):
                source.write_bytes(os.urandom(args.shard_mb << 20))
                store.upload(source, f"shard_{index}_training.hdf5")
            source.unlink()
            results = {"ShardCache fill": [], "plain get_object": []}
            for round_ in range(args.repeat):  # alternating, so that machine noise hits both
                results["ShardCache fill"].append(fill(store, work / f"cache{round_}"))
                results["plain get_object"].append(plain_gets(store))
        finally:
            server.stop()
    print(f"{args.shards} objects x {args.shard_mb} MiB, moto_server on 127.0.0.1, {args.repeat} rounds")
    report(results)


def report(results: dict) -> None:
    """The rates of each side per round, and the figure to quote: their ratio, round by round (the two sides
    of a round ran one after the other, so load on the machine hits both alike)."""
    rates = {name: [total / elapsed / 2 ** 20 for elapsed, total in runs] for name, runs in results.items()}
    for name, values in rates.items():
        print(f"{name:22s} {' '.join(f'{r:7.1f}' for r in values)} MiB/s  (best {max(values):.1f})")
    ratios = [fill / plain for fill, plain in zip(rates["ShardCache fill"], rates["plain get_object"])]
    median = statistics.median(ratios)
    print(f"{'fill / plain':22s} {' '.join(f'{r:7.3f}' for r in ratios)}        (median {median:.3f})")


if __name__ == "__main__":
    main()
