"""common/storage.py against a real S3 server (moto_server on 127.0.0.1, started by conftest's moto_server).

ETags are checked against hashlib computed here and against the server's own; faults are answered
for the server by botocore's before-send hook (s3_helpers.FaultInjector)."""

import collections
import fcntl
import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import h5py
import pytest

import helpers
import s3_helpers
from common import storage
from data.dataset import LocalShardFiles, WindowReader, scan_shards

MIB = 1 << 20


@pytest.fixture
def small_parts(monkeypatch):
    """Multipart uploads in 5 MiB parts (S3's smallest) and downloads in 3 MiB ranges, to test them
    with small files."""
    monkeypatch.setattr(storage, "TRANSFER_CHUNK", 5 * MIB)
    monkeypatch.setattr(storage, "DOWNLOAD_RANGE", 3 * MIB)


def store_of(s3, prefix="data"):
    _, bucket, _ = s3
    return storage.S3Store(f"s3://{bucket}/{prefix}")


def test_split_s3_url():
    assert storage.split_s3_url("s3://bkt/a/b/") == ("bkt", "a/b")
    assert storage.split_s3_url("s3://bkt") == ("bkt", "")
    with pytest.raises(storage.StorageError, match="not an s3://bucket/prefix URL"):
        storage.split_s3_url("s3:///x")


@pytest.mark.parametrize("size", [0, 3 * MIB + 7, 12 * MIB + 5], ids=["empty", "single-part", "multipart"])
def test_upload_download_round_trip_verifies_the_etag(tmp_path, s3, small_parts, size):
    data = os.urandom(size)
    (tmp_path / "x.bin").write_bytes(data)
    store = store_of(s3)
    store.upload(tmp_path / "x.bin", "x.bin")
    [listed] = store.list_objects()
    parts = [data[i:i + 5 * MIB] for i in range(0, size, 5 * MIB)]
    expected = hashlib.md5(data).hexdigest() if len(parts) <= 1 else \
        hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + f"-{len(parts)}"
    assert (listed.name, listed.size, listed.etag) == ("x.bin", size, expected)
    got = store.download("x.bin", tmp_path / "y.bin", expected=listed)
    assert got == listed and (tmp_path / "y.bin").read_bytes() == data
    assert not list(tmp_path.glob(".*partial"))


def test_multipart_object_with_unequal_parts_verifies(tmp_path, s3):
    """Parts of 5, 6 and 1 MiB (another uploader's layout): the part sizes come from HEAD ?partNumber."""
    _, bucket, client = s3
    parts = [os.urandom(5 * MIB), os.urandom(6 * MIB), os.urandom(MIB)]
    upload = client.create_multipart_upload(Bucket=bucket, Key="data/odd.bin")
    etags = [client.upload_part(Bucket=bucket, Key="data/odd.bin", UploadId=upload["UploadId"], PartNumber=n + 1,
                                Body=part)["ETag"] for n, part in enumerate(parts)]
    client.complete_multipart_upload(Bucket=bucket, Key="data/odd.bin", UploadId=upload["UploadId"], MultipartUpload={
        "Parts": [{"ETag": etag, "PartNumber": n + 1} for n, etag in enumerate(etags)]})
    store_of(s3).download("odd.bin", tmp_path / "odd.bin")
    assert (tmp_path / "odd.bin").read_bytes() == b"".join(parts)


def test_download_that_does_not_match_is_refused_and_leaves_nothing(tmp_path, s3, small_parts):
    """The real download runs; a byte flipped in the file it wrote (as by a faulty disk or transfer)
    must fail the ETag check, and no file appears under the destination name."""
    (tmp_path / "x.bin").write_bytes(os.urandom(6 * MIB))
    store = store_of(s3)
    store.upload(tmp_path / "x.bin", "x.bin")
    real_download = store._get_to_file

    def download_then_flip_a_byte(remote, filename):
        real_download(remote, filename)
        with open(filename, "r+b") as f:
            f.seek(12345)
            byte = f.read(1)
            f.seek(12345)
            f.write(bytes([byte[0] ^ 1]))

    store._get_to_file = download_then_flip_a_byte
    with pytest.raises(storage.StorageError, match=r"x\.bin does not match its ETag .*-2 \(corrupted"):
        store.download("x.bin", tmp_path / "y.bin")
    assert not (tmp_path / "y.bin").exists() and not list(tmp_path.glob(".y.bin*"))


def test_object_changed_since_listing_is_refused(tmp_path, s3):
    store = store_of(s3)
    store.put_bytes("x.bin", b"first")
    [listed] = store.list_objects()
    store.put_bytes("x.bin", b"second")
    with pytest.raises(storage.StorageError, match="changed since it was listed"):
        store.download("x.bin", tmp_path / "y.bin", expected=listed)


def test_list_put_get_delete(s3):
    store = store_of(s3)
    for name in ("b", "a", "sub/c"):
        store.put_bytes(name, name.encode())
    assert [o.name for o in store.list_objects()] == ["a", "b"]
    assert [o.name for o in store.list_objects(recursive=True)] == ["a", "b", "sub/c"]
    assert store.child("sub").get_bytes("c") == b"sub/c"
    assert store.get_bytes("b", (0, 1)) == b"b" and store.exists("a") and not store.exists("zz")
    store.delete(["a", "sub/c"])
    assert [o.name for o in store.list_objects(recursive=True)] == ["b"]


@pytest.mark.parametrize("prefix", ["runs", ""])
def test_an_object_that_cannot_be_deleted_is_named_in_full(s3, prefix):
    """DeleteObjects answers 200 with a per-key error (as S3 does for a key the policy protects): the error
    names the object's whole s3:// URL, also for a store at the bucket's root."""
    from botocore.awsrequest import AWSResponse

    _, bucket, _ = s3
    store = storage.S3Store(f"s3://{bucket}/{prefix}")
    store.put_bytes("latest", b"4")

    def access_denied_per_key(request, event_name, **_):
        if event_name.endswith(".DeleteObjects"):
            body = ('<?xml version="1.0" encoding="UTF-8"?><DeleteResult><Error><Key>' + store.key("latest")
                    + "</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error></DeleteResult>")
            return AWSResponse(request.url, 200, {"Content-Type": "application/xml"}, s3_helpers._Body(body.encode()))
        return None

    store.client.meta.events.register("before-send.s3", access_denied_per_key)
    with pytest.raises(storage.StorageError) as info:
        store.delete(["latest"])
    expected = f"s3://{bucket}/runs/latest" if prefix else f"s3://{bucket}/latest"
    assert str(info.value) == f"cannot delete {expected}: AccessDenied (1 object(s) not deleted)"


def test_missing_bucket_is_one_line(s3):
    server, _, _ = s3
    with pytest.raises(storage.StorageError) as info:
        storage.S3Store("s3://no-such-bucket-i12/x").check_access()
    assert str(info.value) == (f"cannot open s3://no-such-bucket-i12/x: bucket 'no-such-bucket-i12' does not "
                               f"exist at {server.url}")


def test_denied_access_is_one_line_without_credentials(tmp_path, monkeypatch):
    """A second server that enforces authentication: the test's access key is unknown to it."""
    server = s3_helpers.MotoServer(tmp_path / "auth.log", env={"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    try:
        for key, value in s3_helpers.s3_env(server, tmp_path).items():
            monkeypatch.setenv(key, value)
        import boto3
        boto3.setup_default_session()
        with pytest.raises(storage.StorageError) as info:
            storage.S3Store("s3://some-bucket/x").check_access()
    finally:
        server.stop()
    message = str(info.value)
    assert message.startswith("cannot open s3://some-bucket/x: access denied (403)") and "\n" not in message
    assert s3_helpers.ACCESS_KEY not in message and s3_helpers.SECRET_KEY not in message


def test_no_credentials_is_one_line(s3, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    import boto3
    boto3.setup_default_session()
    with pytest.raises(storage.StorageError, match=r"no AWS credentials found \(boto3's chain"):
        store_of(s3).check_access()


def test_wrong_region_is_one_line(s3):
    """What S3 answers a request signed for another region (moto does not check regions, so the hook
    answers for it)."""
    import boto3
    from botocore.awsrequest import AWSResponse
    body = b"<Error><Code>PermanentRedirect</Code><Message>m</Message></Error>"

    def redirect(request, **_):
        return AWSResponse(request.url, 301, {"x-amz-bucket-region": "eu-west-3"}, s3_helpers._Body(body))

    boto3.setup_default_session()
    boto3.DEFAULT_SESSION.events.register("before-send.s3", redirect)
    try:
        with pytest.raises(storage.StorageError, match=r"bucket '.*' is in region eu-west-3; set AWS_REGION"):
            store_of(s3).check_access()
    finally:
        boto3.DEFAULT_SESSION.events.unregister("before-send.s3", redirect)


@pytest.mark.parametrize("kind", ["slowdown", "reset"])
def test_transient_faults_are_retried(tmp_path, s3, small_parts, kind):
    """Every third request fails for a while (uploads of parts, HEADs, ranged GETs): all still succeed."""
    data = os.urandom(11 * MIB)
    (tmp_path / "x.bin").write_bytes(data)
    injector = s3_helpers.install_faults(f"{kind}:2:2")
    try:
        store = store_of(s3)
        store.upload(tmp_path / "x.bin", "x.bin")
        store.download("x.bin", tmp_path / "y.bin")
    finally:
        s3_helpers.remove_faults(injector)
    assert injector.injected == 2 and (tmp_path / "y.bin").read_bytes() == data


@pytest.mark.parametrize("kind,expected", [("slowdown", r"SlowDown \(HTTP 503\) after 4 attempts"),
                                           ("reset", r"cannot reach http://127\.0\.0\.1:\d+ \(ConnectionClosedError")])
def test_persistent_fault_is_one_line(tmp_path, s3, kind, expected):
    injector = s3_helpers.install_faults(f"{kind}:1:1000000")
    try:
        with pytest.raises(storage.StorageError, match=rf"^cannot write s3://.*/data/x: {expected}") as info:
            store_of(s3).put_bytes("x", b"x")
    finally:
        s3_helpers.remove_faults(injector)
    assert injector.injected == 4  # AWS_MAX_ATTEMPTS of s3_env
    assert s3_helpers.ACCESS_KEY not in str(info.value) and "Signature" not in str(info.value)


def test_range_file_reads_an_hdf5_header(tmp_path, s3):
    [path] = helpers.write_synthetic_shards(tmp_path / "shards", [30])
    store = store_of(s3)
    store.upload(path, path.name)
    [remote] = store.list_objects()
    with h5py.File(storage.RangeFile(store, remote), "r") as remote_file, h5py.File(path, "r") as local_file:
        assert remote_file["input_ids"].shape == local_file["input_ids"].shape
        assert (remote_file["input_ids"][:] == local_file["input_ids"][:]).all()


# ============================================================================ the shard cache

@pytest.fixture
def remote_shards(tmp_path, s3):
    """Three shards (~25-45 KiB each) uploaded under s3://<bucket>/shards; returns (store, local dir)."""
    local = tmp_path / "local"
    helpers.write_synthetic_shards(local, [24, 40, 17], seq_len=128)
    helpers.write_synthetic_shards(local, [5], name="held_out_{i}_test.hdf5", seed=1)
    store = store_of(s3, "shards")
    for path in sorted(local.iterdir()):
        store.upload(path, path.name)
    return store, local


def read_everything(shard_files, input_dir, epochs=2):
    shards, _, _ = scan_shards(input_dir, shard_files)
    reader = WindowReader(shards, seed=3, window_size=7, vocab_size=30522, shard_files=shard_files)
    total = reader.stream.epoch_size * epochs
    return reader.read(0, total)


def assert_reads_like_local_files(cache, local):
    """Two epochs through the cache give the samples that the same shards on disk give."""
    try:
        remote = read_everything(cache, cache.store.url())
    finally:
        cache.close()
    expected = read_everything(LocalShardFiles(local), local)
    assert all((remote[key] == expected[key]).all() for key in expected)


def test_cache_gives_the_same_samples_as_local_files(tmp_path, remote_shards):
    store, local = remote_shards
    largest = max(p.stat().st_size for p in local.iterdir())
    cache = storage.ShardCache(store, tmp_path / "cache", capacity=10 * largest)
    assert_reads_like_local_files(cache, local)
    # Every training shard downloaded once (they all fit), the test shard never.
    training = sum(p.stat().st_size for p in local.glob("*training*"))
    assert cache.downloaded_bytes == training
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.startswith(".")) == \
        sorted(p.name for p in local.glob("*training*"))


def test_cache_smaller_than_two_shards_evicts_and_still_reads_everything(tmp_path, remote_shards):
    store, local = remote_shards
    sizes = sorted(p.stat().st_size for p in local.glob("*training*"))
    capacity = sizes[-1] + sizes[0] // 2  # the largest shard fits, no two shards do
    cache = storage.ShardCache(store, tmp_path / "cache", capacity=capacity)
    seen_on_disk = []
    real_local_path = cache.local_path

    def watching(url):
        path = real_local_path(url)
        seen_on_disk.append(sum(p.stat().st_size for p in (tmp_path / "cache").iterdir()
                                if not p.name.endswith((".etag", ".head"))))  # partial downloads count; header
        # blocks are outside the bound (here they are whole shards, as the shards are smaller than a block)
        return path

    cache.local_path = watching
    assert_reads_like_local_files(cache, local)
    assert max(seen_on_disk) <= capacity
    assert cache.downloaded_bytes > sum(sizes)  # shards were evicted and fetched again in epoch 1


def test_cache_prefetches_the_next_shard(tmp_path, remote_shards):
    store, local = remote_shards
    cache = storage.ShardCache(store, tmp_path / "cache", capacity=1 << 30)
    shards, _, _ = scan_shards(store.url(), cache)
    reader = WindowReader(shards, seed=3, window_size=7, vocab_size=30522, shard_files=cache)
    try:
        reader.read(0, 1)
        first = reader.stream.window_pieces(0, 0)[0][0]
        following = reader.stream.shard_after(0, 0)
        assert following != first
        cache._pool.shutdown(wait=True)  # let the prefetch finish
        assert (tmp_path / "cache" / following.name).is_file()
    finally:
        cache.close()


def test_cache_smaller_than_one_shard_is_one_error(tmp_path, remote_shards):
    store, local = remote_shards
    largest = max(local.glob("*training*"), key=lambda p: p.stat().st_size)
    cache = storage.ShardCache(store, tmp_path / "cache", capacity=largest.stat().st_size - 1)
    try:
        with pytest.raises(storage.StorageError, match=rf"less than the shard s3://.*/shards/{largest.name} .*"
                                                       r"raise --s3_cache_gb"):
            cache.check_capacity([url for url in cache.list_files() if "training" in url])
    finally:
        cache.close()


def test_cache_reuses_verified_copies_of_an_earlier_run(tmp_path, remote_shards):
    store, local = remote_shards
    cache = storage.ShardCache(store, tmp_path / "cache", capacity=1 << 30)
    read_everything(cache, store.url(), epochs=1)
    cache.close()
    assert cache.downloaded_bytes > 0
    victim = sorted((tmp_path / "cache").glob("shard_*training*"))[0]
    victim.write_bytes(victim.read_bytes()[:-1])  # a copy that no longer matches is fetched again
    again = storage.ShardCache(store, tmp_path / "cache", capacity=1 << 30)
    read_everything(again, store.url(), epochs=1)
    again.close()
    assert again.downloaded_bytes == (local / victim.name).stat().st_size


def test_storage_imports_no_torch_and_no_boto3_at_import():
    code = "import sys; from common import storage; print('torch' in sys.modules, 'boto3' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=helpers.REPO_ROOT, capture_output=True, text=True)
    assert result.stdout.split() == ["False", "False"], result.stderr


# ============================================================================ one cache per server

CACHE_READER = """
import hashlib, sys
import s3_helpers
from common import storage
from data.dataset import WindowReader, scan_shards
s3_helpers.install_faults_from_env()
storage.DOWNLOAD_RANGE, storage.DOWNLOAD_THREADS = int(sys.argv[3]), 1
cache = storage.ShardCache(storage.S3Store(sys.argv[1]), storage.server_cache_dir(sys.argv[2]), int(sys.argv[4]))
shards, _, _ = scan_shards(sys.argv[1], cache)
reader = WindowReader(shards, seed=3, window_size=7, vocab_size=30522, shard_files=cache)
arrays = reader.read(0, reader.stream.epoch_size)
cache.close()
print(hashlib.sha256(b"".join(arrays[key].tobytes() for key in sorted(arrays))).hexdigest())
"""


def local_digest(local) -> str:
    """What CACHE_READER prints, from the same shards on disk."""
    shards, _, _ = scan_shards(local)
    reader = WindowReader(shards, seed=3, window_size=7, vocab_size=30522)
    arrays = reader.read(0, reader.stream.epoch_size)
    return hashlib.sha256(b"".join(arrays[key].tobytes() for key in sorted(arrays))).hexdigest()


def start_local_ranks(count, store, s3_cache_dir, download_range, faults="", capacity=1 << 30):
    """`count` processes of one server reading one epoch at once, through the shard cache under
    `s3_cache_dir` (as the driver's --s3_cache_dir), in ranged GETs of `download_range` bytes."""
    env = {**os.environ, s3_helpers.FAULTS_ENV: faults,
           "PYTHONPATH": os.pathsep.join([str(helpers.REPO_ROOT), str(helpers.REPO_ROOT / "tests")])}
    command = [sys.executable, "-c", CACHE_READER, store.url(), str(s3_cache_dir), str(download_range), str(capacity)]
    return [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(count)]


def shard_gets(server, bucket) -> collections.Counter:
    """GET requests for the shards that the S3 server logged, by object name (counted at the server)."""
    marker = f"GET /{bucket}/shards/"
    return collections.Counter(line.split(marker)[1].split()[0] for line in server.log_path.read_text().splitlines()
                               if marker in line)


def finished(ranks):
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    return [rank.returncode for rank in ranks], outputs


@pytest.mark.parametrize("local_ranks", [1, 2])
def test_local_ranks_share_one_cache_so_each_shard_is_fetched_once_per_server(tmp_path, s3, remote_shards, local_ranks):
    """Every local rank reads every shard (one epoch, the trainer's reader); the S3 server sees, for each
    training shard, one GET for its header and one for its copy, whatever the number of local ranks."""
    server, bucket, _ = s3
    store, local = remote_shards
    ranks = start_local_ranks(local_ranks, store, tmp_path / "s3_cache", 1 << 20)
    codes, outputs = finished(ranks)
    assert codes == [0] * local_ranks, [err[-2000:] for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {local_digest(local)}
    training = sorted(p.name for p in local.glob("*training*"))
    assert shard_gets(server, bucket) == {name: 2 for name in training}


def test_local_rank_killed_during_a_download_leaves_a_cache_the_next_run_uses(tmp_path, s3, remote_shards):
    """A rank is SIGKILLed in the middle of its second shard's download (16 KiB ranged GETs): the next run,
    two local ranks, reads the right samples, GETs nothing of the shard completed before the kill, and
    fetches the others once for the server."""
    server, bucket, _ = s3
    store, local = remote_shards
    cache_dir, piece = storage.server_cache_dir(tmp_path / "s3_cache"), 16 << 10
    shards, _, _ = scan_shards(local)
    order = [shards[i].name for i in WindowReader(shards, 3, 7, 30522).stream.shard_order(0)]
    pieces = {name: -(-(local / name).stat().st_size // piece) for name in order}
    kill_at = len(order) + pieces[order[0]] + 2  # the headers, the first shard, then 2 GETs into the second
    [killed] = start_local_ranks(1, store, tmp_path / "s3_cache", piece, faults=f"kill:{kill_at}:1:GetObject:/shards/")
    codes, _ = finished([killed])
    assert codes == [-signal.SIGKILL]
    assert (cache_dir / f".{order[1]}.partial").is_file()  # killed mid-download
    before = shard_gets(server, bucket)
    assert before == collections.Counter(order) + collections.Counter({order[0]: pieces[order[0]], order[1]: 1})
    codes, outputs = finished(start_local_ranks(2, store, tmp_path / "s3_cache", piece))
    assert codes == [0, 0], [err[-2000:] for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {local_digest(local)}  # no half-written file was read
    assert shard_gets(server, bucket) - before == {name: pieces[name] for name in order[1:]}
    assert not list(cache_dir.glob("*.partial"))


def test_local_ranks_with_a_cache_of_one_shard_evict_only_what_no_rank_reads(tmp_path, s3, remote_shards):
    """Two local ranks and a cache that holds the largest shard but no two: they take turns, evicting
    only a shard that neither reads, and both read the right samples."""
    store, local = remote_shards
    sizes = sorted(p.stat().st_size for p in local.glob("*training*"))
    codes, outputs = finished(start_local_ranks(2, store, tmp_path / "s3_cache", 16 << 10,
                                                capacity=sizes[-1] + sizes[0] // 2))
    assert codes == [0] * 2, [err[-2000:] for _, err in outputs]
    assert {out.strip() for out, _ in outputs} == {local_digest(local)}


def test_a_rank_ahead_holds_no_copy_that_a_rank_behind_needs_room_for(tmp_path, remote_shards):
    """Two local ranks (two caches on one directory: flock locks belong to open files, so they exclude each
    other as two processes would), a cache that holds the largest shard but no two. The rank ahead has loaded
    a window of one shard and reads nothing more for now (in training: its queue of batches is full and it
    waits for the rank behind at the next collective). The rank behind then needs another shard: it must get
    it, not wait forever for room that the idle rank ahead keeps."""
    store, local = remote_shards
    sizes = sorted(p.stat().st_size for p in local.glob("*training*"))
    capacity = sizes[-1] + sizes[0] // 2  # the largest shard fits, no two shards do
    ahead, behind = (storage.ShardCache(store, tmp_path / "cache", capacity=capacity) for _ in range(2))
    shards, _, _ = scan_shards(store.url(), ahead)
    readers = [WindowReader(shards, seed=3, window_size=7, vocab_size=30522, shard_files=cache)
               for cache in (ahead, behind)]
    stream = readers[0].stream
    first = stream.window_pieces(0, 0)[0][0]
    later = next(w for w in range(stream.epoch_size // 7) if first not in [p[0] for p in stream.window_pieces(0, w)])
    readers[0].read(later * 7, 1)  # the rank ahead: a window of other shards than the first, in memory
    got = {}
    behind_reads = threading.Thread(target=lambda: got.update(rows=readers[1].read(0, 7)), daemon=True)
    behind_reads.start()
    behind_reads.join(timeout=30)
    stuck = behind_reads.is_alive()
    ahead.close()  # (lets a stuck rank behind go on, so that the failure below leaves no thread behind)
    behind_reads.join(timeout=30)
    behind.close()
    assert not stuck, "the rank behind waited for room that the idle rank ahead kept"
    expected = WindowReader(scan_shards(local)[0], seed=3, window_size=7, vocab_size=30522).read(0, 7)
    assert all((got["rows"][key] == expected[key]).all() for key in expected)


def exclusive_lock_waiters(path) -> int:
    """How many requests for an exclusive flock(2) lock on `path` wait, as the kernel lists them in /proc/locks
    ("N: -> FLOCK ADVISORY WRITE <pid> <major>:<minor>:<inode> ...")."""
    status = os.stat(path)
    file_id = f"{os.major(status.st_dev):02x}:{os.minor(status.st_dev):02x}:{status.st_ino}"
    with open("/proc/locks") as locks:
        return sum(fields[1:4] == ["->", "FLOCK", "ADVISORY"] and fields[4] == "WRITE" and file_id in fields
                   for fields in map(str.split, locks))


def test_a_rank_that_waited_for_another_ranks_download_does_not_fetch_the_shard_again(tmp_path, s3, remote_shards):
    """Two local ranks (two caches on one directory, as in the test above) both find a shard absent, then both
    ask for its exclusive lock: one downloads it while the other waits. The one that waited uses that copy:
    the S3 server sees one GET of the shard, and both ranks read the same file.

    To get there every time, the test holds the shard's lock shared, as a rank does between its presence check
    and its request for the exclusive lock, until the kernel lists both ranks waiting for the exclusive lock.
    (A rank that comes while the other downloads waits for the shared lock instead, and then finds the copy
    present at its first check.)"""
    server, bucket, _ = s3
    store, local = remote_shards
    name = sorted(path.name for path in local.glob("*training*"))[0]
    ranks = [storage.ShardCache(store, tmp_path / "cache", capacity=1 << 30) for _ in range(2)]
    url, lock_file = store.url(name), tmp_path / "cache" / f".{name}.lock"
    paths, finished_ranks = {}, queue.Queue()

    def read(rank):
        try:
            paths[rank] = ranks[rank].local_path(url)
        finally:
            finished_ranks.put(rank)

    threads = [threading.Thread(target=read, args=(rank,), daemon=True) for rank in range(2)]
    try:
        with open(lock_file, "a+b") as held:
            fcntl.flock(held, fcntl.LOCK_SH)
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + 60  # against a hang only: this takes milliseconds
            while exclusive_lock_waiters(lock_file) < 2:
                assert time.monotonic() < deadline and finished_ranks.empty(), \
                    "the two ranks did not both wait for the shard's exclusive lock"
                time.sleep(0.01)
        first = finished_ranks.get(timeout=60)  # downloaded; the other waits until it releases the copy
        ranks[first].release()
        second = finished_ranks.get(timeout=60)
        assert paths.keys() == {first, second}
    finally:
        for cache in ranks:
            cache.close()
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(timeout=60)
    assert shard_gets(server, bucket) == {name: 1}
    assert paths[0] == paths[1] and paths[0].read_bytes() == (local / name).read_bytes()
