"""S3 for training shards and checkpoints: the one module that talks to S3 (boto3, imported lazily).

Locations are ``s3://bucket/prefix``. S3Store lists, downloads (verified), uploads and deletes the
objects under one prefix; ShardCache keeps local copies of shards in a directory of bounded size and
downloads the next shard while the current one is read; RangeFile reads an object by ranged GETs, for
the few header bytes h5py needs, without downloading a whole shard.

Verification: a download lands under a temporary name and is renamed into place only when its size
and ETag match the object's. S3's ETag is the MD5 of the content for a single-part upload and, for a
multipart upload, the MD5 of the parts' binary MD5s followed by "-<parts>"; the part sizes are read
with HEAD ?partNumber=N. Objects encrypted with SSE-KMS or SSE-C have ETags that are not MD5s: they are
checked by size only. Uploads carry botocore's default CRC32 checksum, which S3 checks on receipt.

Credentials come from boto3's standard chain only (environment, ~/.aws files, container or instance
role); nothing here reads or prints them. Error messages are built from the operation, the s3:// name,
S3's error code and the HTTP status, never from request headers, server messages (a
SignatureDoesNotMatch message echoes the access key id) or signed URLs. A custom endpoint (MinIO, Ceph,
a local test server) comes from the caller or the AWS_ENDPOINT_URL variable. Transient errors (5xx,
SlowDown, throttling, connection resets) are retried by botocore's "standard" retry mode (exponential
backoff with jitter); AWS_RETRY_MODE and AWS_MAX_ATTEMPTS override it.
"""

import collections
import fcntl
import glob
import hashlib
import io
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

S3_SCHEME = "s3://"
DEFAULT_MAX_ATTEMPTS = 8
TRANSFER_CHUNK = 64 << 20  # multipart part size of uploads
DOWNLOAD_RANGE = 64 << 20  # downloads: ranged GETs of this size, DOWNLOAD_THREADS at a time
DOWNLOAD_THREADS = 8
RANGE_BLOCK = 1 << 20  # RangeFile reads whole blocks of this size
_ETAG_SUFFIX = ".etag"  # a cached file's verified ETag lives beside it, in .<name>.etag
_PARTIAL = ".partial"
_LOCK = ".lock"
_HEAD = ".head"
_SPACE_LOCK = ".space.lock"
# check_access(write=True) puts and deletes <prefix>/.write_probe.<host>.<pid>: a name of its own per process,
# which a check that the prefix is empty (run on other ranks meanwhile) must not count. The probe file of a
# local directory (training/command_line.check_writable_directory) has the same prefix, for the same reason.
WRITE_PROBE_PREFIX = ".write_probe."
ROOM_POLL_S = 0.1  # how often a download waiting for room in the shard cache looks again


class StorageError(RuntimeError):
    """An S3 operation failed (after retries) or a download did not verify; one line, no credentials."""


@dataclass(frozen=True)
class RemoteObject:
    name: str   # key relative to the store's prefix
    size: int
    etag: str   # without quotes


def is_s3_url(location: object) -> bool:
    return str(location).startswith(S3_SCHEME)


def split_s3_url(url: str) -> tuple[str, str]:
    """'s3://bucket/a/b/' -> ('bucket', 'a/b'); raises StorageError for a URL without a bucket."""
    bucket, _, prefix = str(url)[len(S3_SCHEME):].partition("/")
    if not is_s3_url(url) or not bucket:
        raise StorageError(f"{url}: not an s3://bucket/prefix URL")
    return bucket, prefix.strip("/")


def endpoint_url(explicit: str | None = None) -> str | None:
    """The endpoint to use: the explicit one, else AWS_ENDPOINT_URL, else None (AWS itself)."""
    return explicit or os.environ.get("AWS_ENDPOINT_URL") or None


def _safe_endpoint(url: str | None) -> str:
    """An endpoint URL for messages: scheme, host and port only (no user:password@)."""
    if not url:
        return "AWS S3"
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


def make_client(endpoint: str | None = None) -> Any:
    """A boto3 S3 client from the default session (credentials: boto3's standard chain)."""
    import boto3
    from botocore.config import Config

    retries = {"mode": os.environ.get("AWS_RETRY_MODE", "standard"),
               "total_max_attempts": int(os.environ.get("AWS_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS))}
    config = Config(retries=retries, connect_timeout=20, read_timeout=120, max_pool_connections=32)
    client = boto3.client("s3", endpoint_url=endpoint_url(endpoint), config=config)
    _own_retry_jitter(client)
    return client


def _own_retry_jitter(client: Any) -> None:
    """botocore's standard retry mode draws its backoff jitter from Python's global `random`, whose
    state training records in every checkpoint: a retry in a background download would make a resumed
    run's checkpoints differ from an uninterrupted run's. Give the backoff a generator of its own.
    (Reaches into botocore's retry handler; other retry modes are left as they are.)"""
    import random
    jitter = random.Random()
    for handler in client.meta.events._emitter._handlers.prefix_search("needs-retry.s3"):
        backoff = getattr(getattr(getattr(handler, "__self__", None), "_retry_policy", None), "_retry_backoff", None)
        if backoff is not None and hasattr(backoff, "_random"):
            backoff._random = jitter.random


def _transfer_config() -> Any:
    from boto3.s3.transfer import TransferConfig
    return TransferConfig(multipart_threshold=TRANSFER_CHUNK, multipart_chunksize=TRANSFER_CHUNK, max_concurrency=8)


class S3Store:
    """The objects under s3://bucket/prefix. Every method raises StorageError on failure."""

    def __init__(self, url: str, endpoint: str | None = None, client: Any = None):
        self.bucket, self.prefix = split_s3_url(url)
        self.endpoint = endpoint_url(endpoint)
        self.client = client or make_client(self.endpoint)

    def url(self, name: str = "") -> str:
        return f"{S3_SCHEME}{self.bucket}/" + "/".join(p for p in (self.prefix, name) if p)

    def key(self, name: str) -> str:
        return "/".join(p for p in (self.prefix, name) if p)

    def child(self, name: str) -> "S3Store":
        """The store of a sub-prefix, sharing this one's client."""
        return S3Store(self.url(name), self.endpoint, self.client)

    def _error(self, err: Exception, what: str) -> StorageError:
        return StorageError(describe_error(err, what, self.bucket, self.endpoint))

    def _call(self, what: str, method: str, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return getattr(self.client, method)(**kwargs)
        except (ClientError, BotoCoreError) as err:
            raise self._error(err, what) from None

    def check_access(self, write: bool = False) -> None:
        """Before any step: the bucket exists, is reachable in this region and lists; with write, an
        object can be put and deleted under the prefix. Raises one-line StorageError otherwise."""
        self._call(f"cannot open {self.url()}", "head_bucket", Bucket=self.bucket)
        self._call(f"cannot list {self.url()}", "list_objects_v2", Bucket=self.bucket,
                   Prefix=self.key("") + "/" if self.prefix else "", MaxKeys=1)
        if write:
            probe = f"{WRITE_PROBE_PREFIX}{socket.gethostname()}.{os.getpid()}"
            self.put_bytes(probe, b"ok")
            self.delete([probe])

    def list_objects(self, recursive: bool = False) -> list[RemoteObject]:
        """Objects under the prefix, sorted by name; only the direct children unless recursive."""
        prefix = self.key("") + "/" if self.prefix else ""
        kwargs = {"Bucket": self.bucket, "Prefix": prefix, **({} if recursive else {"Delimiter": "/"})}
        objects, token = [], None
        while True:
            page = self._call(f"cannot list {self.url()}", "list_objects_v2",
                              **kwargs, **({"ContinuationToken": token} if token else {}))
            objects += [RemoteObject(item["Key"][len(prefix):], item["Size"], item["ETag"].strip('"'))
                        for item in page.get("Contents", ())]
            token = page.get("NextContinuationToken")
            if not token:
                return sorted(objects, key=lambda o: o.name)

    def head(self, name: str, part: int | None = None) -> dict[str, Any]:
        extra = {"PartNumber": part} if part else {}
        return self._call(f"cannot read {self.url(name)}", "head_object", Bucket=self.bucket, Key=self.key(name),
                          **extra)

    def exists(self, name: str) -> bool:
        from botocore.exceptions import ClientError
        try:
            self.client.head_object(Bucket=self.bucket, Key=self.key(name))
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise self._error(err, f"cannot read {self.url(name)}") from None
        return True

    def get_bytes(self, name: str, byte_range: tuple[int, int] | None = None) -> bytes:
        """The object (or bytes [start, end) of it)."""
        buffer = bytearray()

        def write(offset: int, chunk: bytes) -> None:
            buffer[offset:offset + len(chunk)] = chunk

        self._stream(name, byte_range, None, write)
        return bytes(buffer)

    def _stream(self, name: str, byte_range: tuple[int, int] | None, etag: str | None,
                write: Callable[[int, bytes], object], attempts: int = 3) -> None:
        """GET the object (or bytes [start, end) of it; only while its ETag is `etag`, if given), handing
        write(offset in the range, chunk) each piece as it arrives. botocore retries the request; a
        connection that breaks while the body streams is retried here, from the start of the range."""
        from botocore.exceptions import BotoCoreError
        extra = {"Range": f"bytes={byte_range[0]}-{byte_range[1] - 1}"} if byte_range else {}
        extra.update({"IfMatch": f'"{etag}"'} if etag else {})
        for attempt in range(attempts):
            response = self._call(f"cannot read {self.url(name)}", "get_object", Bucket=self.bucket,
                                  Key=self.key(name), **extra)
            try:
                offset = 0
                for chunk in response["Body"].iter_chunks(1 << 20):
                    write(offset, chunk)
                    offset += len(chunk)
                return
            except (BotoCoreError, OSError) as err:
                if attempt == attempts - 1:
                    raise self._error(err, f"cannot read {self.url(name)}") from None

    def put_bytes(self, name: str, data: bytes) -> None:
        self._call(f"cannot write {self.url(name)}", "put_object", Bucket=self.bucket, Key=self.key(name), Body=data)

    def upload(self, local: Path, name: str) -> None:
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            self.client.upload_file(str(local), self.bucket, self.key(name), Config=_transfer_config())
        except (S3UploadFailedError, ClientError, BotoCoreError) as err:
            # boto3 wraps the ClientError in a text that quotes the server's message: describe the original
            original = (err.__cause__ or err.__context__ or err) if isinstance(err, S3UploadFailedError) else err
            raise self._error(original, f"cannot upload {local} to {self.url(name)}") from None

    def download(self, name: str, destination: Path, expected: RemoteObject | None = None) -> RemoteObject:
        """Download to `destination` (atomically: a temporary name, verified, then renamed); returns the
        object as verified. `expected`: the listed object, which must not have changed since."""
        head = self.head(name)
        remote = RemoteObject(name, head["ContentLength"], head["ETag"].strip('"'))
        if expected is not None and (expected.size, expected.etag) != (remote.size, remote.etag):
            raise StorageError(f"{self.url(name)} changed since it was listed (size or ETag differs)")
        destination = Path(destination)
        partial = destination.with_name(f".{destination.name}{_PARTIAL}")
        try:
            self._get_to_file(remote, partial)
            self._verify(partial, remote, head)
            os.replace(partial, destination)
        finally:
            partial.unlink(missing_ok=True)
        return remote

    def _get_to_file(self, remote: RemoteObject, path: Path) -> None:
        """The object into `path` by ranged GETs, several at a time. (Not boto3's download_file: its
        temporary names come from Python's global `random`, which training checkpoints record.)"""
        with open(path, "ab") as f:  # not "wb": a shard cache counts the partial file's size as claimed room
            f.truncate(remote.size)
        ranges = [(start, min(start + DOWNLOAD_RANGE, remote.size)) for start in range(0, remote.size, DOWNLOAD_RANGE)]

        def fetch(byte_range: tuple[int, int]) -> None:
            with open(path, "r+b") as f:
                def write(offset: int, chunk: bytes) -> None:
                    f.seek(byte_range[0] + offset)
                    f.write(chunk)

                self._stream(remote.name, byte_range, remote.etag, write)

        with ThreadPoolExecutor(max(1, min(DOWNLOAD_THREADS, len(ranges))), thread_name_prefix="s3-range") as pool:
            for _ in pool.map(fetch, ranges):
                pass

    def _verify(self, path: Path, remote: RemoteObject, head: dict[str, Any]) -> None:
        size = path.stat().st_size
        if size != remote.size:
            raise StorageError(f"download of {self.url(remote.name)} has {size} bytes, S3 says {remote.size}")
        if head.get("ServerSideEncryption") == "aws:kms" or head.get("SSECustomerAlgorithm"):
            return  # such ETags are not MD5s of the content: size only
        if "-" not in remote.etag:
            matches = file_etag(path, [remote.size], multipart=False) == remote.etag
        else:  # parts of equal size but the last (boto3, the AWS CLI) need one HEAD; others one per part
            parts = int(remote.etag.split("-")[1])
            first = self.head(remote.name, part=1)["ContentLength"]
            sizes = [first] * (parts - 1) + [remote.size - first * (parts - 1)]
            matches = file_etag(path, sizes, multipart=True) == remote.etag
            if not matches and parts > 2:
                exact = [self.head(remote.name, part=n)["ContentLength"] for n in range(1, parts + 1)]
                matches = exact != sizes and file_etag(path, exact, multipart=True) == remote.etag
        if not matches:
            raise StorageError(f"download of {self.url(remote.name)} does not match its ETag {remote.etag} "
                               f"(corrupted in transit or on disk)")

    def delete(self, names: Iterable[str]) -> None:
        names = list(names)
        for start in range(0, len(names), 1000):  # DeleteObjects takes at most 1000 keys
            batch = names[start:start + 1000]
            response = self._call(f"cannot delete under {self.url()}", "delete_objects", Bucket=self.bucket,
                                  Delete={"Objects": [{"Key": self.key(n)} for n in batch], "Quiet": True})
            if response.get("Errors"):
                first = response["Errors"][0]
                raise StorageError(f"cannot delete {S3_SCHEME}{self.bucket}/{first['Key']}: "  # Key: the whole key
                                   f"{first.get('Code')} ({len(response['Errors'])} object(s) not deleted)")


def file_etag(path: Path, part_sizes: list[int], multipart: bool) -> str:
    """S3's ETag of a file uploaded in parts of the given sizes (a single-part upload: the MD5)."""
    digests = []
    with open(path, "rb") as f:
        for size in part_sizes:
            digest = hashlib.md5(usedforsecurity=False)
            remaining = size
            while remaining:
                block = f.read(min(remaining, 8 << 20))
                if not block:
                    break
                digest.update(block)
                remaining -= len(block)
            digests.append(digest)
    if not multipart:
        return digests[0].hexdigest()
    return hashlib.md5(b"".join(d.digest() for d in digests), usedforsecurity=False).hexdigest() + f"-{len(digests)}"


def describe_error(err: Exception, what: str, bucket: str, endpoint: str | None) -> str:
    """One line for a botocore error, from safe parts only (see the module docstring)."""
    from botocore.exceptions import ClientError, EndpointConnectionError, HTTPClientError, NoCredentialsError

    if isinstance(err, NoCredentialsError):
        return f"{what}: no AWS credentials found (boto3's chain: environment, ~/.aws, instance or container role)"
    if isinstance(err, (EndpointConnectionError, HTTPClientError)):
        return f"{what}: cannot reach {_safe_endpoint(endpoint)} ({type(err).__name__}, after retries)"
    if not isinstance(err, ClientError):
        return f"{what}: {type(err).__name__}"
    code = str(err.response.get("Error", {}).get("Code", "?"))
    meta = err.response.get("ResponseMetadata", {})
    status = meta.get("HTTPStatusCode")
    region = meta.get("HTTPHeaders", {}).get("x-amz-bucket-region")
    retries = meta.get("RetryAttempts", 0)
    if code == "NoSuchBucket" or (code == "404" and err.operation_name in ("HeadBucket", "ListObjectsV2")):
        return f"{what}: bucket {bucket!r} does not exist at {_safe_endpoint(endpoint)}"
    if code in ("404", "NoSuchKey", "NotFound"):
        return f"{what}: no such object"
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AllAccessDisabled"):
        return (f"{what}: access denied ({code}); the credentials of boto3's chain need the permissions "
                f"listed in docs/s3.md (Bucket policy)")
    if code in ("PermanentRedirect", "301", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"):
        where = f"region {region}" if region else "another region"
        return f"{what}: bucket {bucket!r} is in {where}; set AWS_REGION (or AWS_DEFAULT_REGION) to it"
    after = f" after {retries + 1} attempts" if retries else ""
    return f"{what}: {code} (HTTP {status}){after}"


class RangeFile(io.RawIOBase):
    """A read-only, seekable file over one S3 object, read by ranged GETs of RANGE_BLOCK bytes (a few
    blocks are kept). For h5py to read a shard's header without downloading the shard."""

    def __init__(self, store: S3Store, remote: RemoteObject, keep_blocks: int = 8,
                 fetch: Callable[[RemoteObject, int, int], bytes] | None = None):
        """fetch(remote, start, end) -> bytes [start, end) of the object (default: a ranged GET)."""
        super().__init__()
        self.store, self.remote, self.position = store, remote, 0
        self._fetch = fetch or (lambda remote, start, end: store.get_bytes(remote.name, (start, end)))
        self._blocks: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._keep = keep_blocks

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.remote.size}[whence]
        self.position = max(0, base + offset)
        return self.position

    def _block(self, index: int) -> bytes:
        if index not in self._blocks:
            start = index * RANGE_BLOCK
            self._blocks[index] = self._fetch(self.remote, start, min(start + RANGE_BLOCK, self.remote.size))
            if len(self._blocks) > self._keep:
                self._blocks.popitem(last=False)
        self._blocks.move_to_end(index)
        return self._blocks[index]

    def readinto(self, buffer: "WriteableBuffer") -> int:
        view, done = memoryview(buffer).cast("B"), 0
        while done < len(view) and self.position < self.remote.size:
            block = self._block(self.position // RANGE_BLOCK)
            offset = self.position % RANGE_BLOCK
            piece = block[offset:offset + len(view) - done]
            view[done:done + len(piece)] = piece
            done += len(piece)
            self.position += len(piece)
        return done


def server_cache_dir(s3_cache_dir: str | os.PathLike[str]) -> Path:
    """The shard cache of this server, shared by its local ranks: <s3_cache_dir>/shards/<host name>. One
    directory per host, so that an --s3_cache_dir on a filesystem that servers share still gives one cache
    per server, and each cache's locks are only ever taken on one host."""
    return Path(s3_cache_dir) / "shards" / socket.gethostname()


class ShardCache:
    """Local copies of the objects directly under one S3 prefix, in `cache_dir`, shared by the processes of
    one server (its local ranks), at most `capacity` bytes together (downloads under way included).

    local_path(url) gives the local copy of an object, downloading it unless a local process already has,
    and evicting the least recently used copies that no local process holds; prefetch(url) downloads one in
    the background if it fits now. A copy left by an earlier run is used when its size and recorded ETag
    still match the object's. The same methods as data.dataset.LocalShardFiles, so the reader takes either.

    The processes coordinate through flock(2) locks, which the kernel drops when a process dies: a rank
    killed at any point leaves no stale lock.
    - `.<name>.lock`, one per object: a download holds it exclusively; a reader holds it shared from
      local_path() until it releases it, asks for another object or closes, so a copy is never evicted
      while a local rank reads it. (The reader releases it as soon as it has read its rows: a rank that
      kept a copy while idle could be waiting, through a collective, for a rank that waits for its room.)
      Eviction takes it exclusively without waiting, and passes over a copy it cannot get.
      (Chosen over per-rank hard links, which would keep an evicted file's blocks on disk past the bound.)
    - `.space.lock`: held while the bytes in use are added up and a download claims its room (its partial
      file, made full size at once), so two ranks never both count the same free bytes.
    A download lands under `.<name>.partial` and is renamed only once verified; `.<name>.etag` is written
    after the rename, so a copy without it (a kill between the two) is fetched again, and nothing half
    written is ever read. A partial file whose lock nobody holds was left by a killed rank: it is deleted.
    Header reads (ranged GETs) are shared too: each block fetched is kept in `.<name>.<etag>.<offset>.head`
    until the whole object is downloaded (a few MiB per object, outside the bound).
    """

    def __init__(self, store: S3Store, cache_dir: str | os.PathLike[str], capacity: int):
        self.store, self.cache_dir, self.capacity = store, Path(cache_dir), int(capacity)
        self.objects = {store.url(o.name): o for o in store.list_objects()}
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # (url, open lock file) of the object being read, locked shared
        self._held: tuple[str, io.BufferedRandom] | None = None
        self._lock = threading.Lock()
        self._prefetching: set[str] = set()    # urls handed to the prefetch thread and not done
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="s3-prefetch")
        self.downloaded_bytes = 0              # by this process

    def _file(self, url: str, suffix: str = "") -> Path:
        name = self.objects[url].name
        return self.cache_dir / (f".{name}{suffix}" if suffix else name)

    def _lock_file(self, url: str, suffix: str = _LOCK) -> io.BufferedRandom:
        return open(self._file(url, suffix), "a+b")

    def _is_present(self, url: str) -> bool:
        remote = self.objects[url]
        try:
            return (self._file(url).stat().st_size == remote.size
                    and self._file(url, _ETAG_SUFFIX).read_text() == remote.etag)
        except FileNotFoundError:
            return False

    def list_files(self) -> list[str]:
        return sorted(self.objects)

    def check_capacity(self, urls: Iterable[str]) -> None:
        """One clear error when an object that will be read cannot fit in the cache at all."""
        largest = max(urls, key=lambda url: self.objects[url].size)
        size = self.objects[largest].size
        if size > self.capacity:
            raise StorageError(f"the S3 cache holds {self.capacity / 2 ** 30:.3g} GiB, less than the shard "
                               f"{largest} ({size / 2 ** 30:.3g} GiB): raise --s3_cache_gb")

    def header_file(self, url: str) -> io.BufferedReader:
        """Something h5py can open to read the object's header: the local copy (opened under the lock, so an
        eviction cannot take it away), or ranged reads shared by the local ranks."""
        with self._lock_file(url) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if self._is_present(url):
                return open(self._file(url), "rb")
        return io.BufferedReader(RangeFile(self.store, self.objects[url], fetch=self._header_block),
                                 buffer_size=RANGE_BLOCK)

    def _header_block(self, remote: RemoteObject, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object, fetched once per server: the first local rank to ask GETs them
        and keeps them; the others wait on the object's header lock (never its copy's lock, which a rank
        that already trains may hold for long) and read them."""
        url = self.store.url(remote.name)
        kept = self._file(url, f".{remote.etag}.{start}{_HEAD}")
        with self._lock_file(url, _HEAD + _LOCK) as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if kept.is_file():
                return kept.read_bytes()
            data = self.store.get_bytes(remote.name, (start, end))
            partial = kept.with_name(kept.name + _PARTIAL)
            partial.write_bytes(data)
            os.replace(partial, kept)
            return data

    def local_path(self, url: str) -> Path:
        """The local copy of `url`, downloaded if needed; no local rank evicts it until this process
        releases it, asks for another one or closes."""
        self.release()  # first: a rank waiting for room may need the copy this one held
        lock = self._lock_file(url)
        try:
            while True:
                fcntl.flock(lock, fcntl.LOCK_SH)
                if self._is_present(url):
                    break
                fcntl.flock(lock, fcntl.LOCK_EX)  # drops the shared lock, then waits for a download under way
                if not self._is_present(url):
                    self._claim_room(url, wait=True)
                    self._download(url)
                # back to shared (not atomic: an eviction may come between, hence the loop)
        except BaseException:
            lock.close()
            raise
        os.utime(self._file(url))  # recently used: the eviction order of every local rank
        self._held = (url, lock)
        return self._file(url)

    def release(self) -> None:
        """The copy that local_path gave last is no longer read (local ranks may evict it)."""
        if self._held is not None:
            self._held[1].close()
            self._held = None

    def prefetch(self, url: str) -> None:
        """Download `url` in the background if it fits now (evicting only copies no local rank holds) and no
        local rank is downloading it."""
        with self._lock:
            if url in self._prefetching:
                return
            self._prefetching.add(url)
        self._pool.submit(self._prefetch, url)

    def _prefetch(self, url: str) -> None:
        try:
            with self._lock_file(url) as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # a local rank is downloading or reading it
                if not self._is_present(url) and self._claim_room(url, wait=False):
                    self._download(url)
        except StorageError:
            pass  # local_path will try again, and report
        finally:
            with self._lock:
                self._prefetching.discard(url)

    def _claim_room(self, url: str, wait: bool) -> bool:
        """With the object's lock held exclusively: make room for it and claim it, as its partial file at
        full size. Without `wait`, False when there is no room now; with it, wait for local ranks to release
        copies (a reader holds a copy only while it reads rows of it, and releases it before it waits for
        another, so this ends)."""
        size = self.objects[url].size
        self.check_capacity([url])
        while True:
            with open(self.cache_dir / _SPACE_LOCK, "a+b") as space:
                fcntl.flock(space, fcntl.LOCK_EX)
                if self._make_room(size):
                    with open(self._file(url, _PARTIAL), "wb") as f:
                        f.truncate(size)
                    return True
            if not wait:
                return False
            time.sleep(ROOM_POLL_S)

    def _make_room(self, size: int) -> bool:
        """Under the space lock: delete partial files of killed ranks, then the least recently used copies
        that no local process holds, until `size` more bytes fit."""
        def on_disk(url: str) -> int:
            return sum(path.stat().st_size for path in (self._file(url), self._file(url, _PARTIAL))
                       if path.exists())

        used = {url: on_disk(url) for url in self.objects}
        stale = [url for url in self.objects if self._file(url, _PARTIAL).exists()]
        copies = sorted((url for url in self.objects if self._file(url).exists()),
                        key=lambda url: self._file(url).stat().st_mtime)
        for url, partial_only in [(url, True) for url in stale] + [(url, False) for url in copies]:
            if sum(used.values()) + size <= self.capacity:
                break
            if self._remove_unheld(url, partial_only):
                used[url] = on_disk(url)
        return sum(used.values()) + size <= self.capacity

    def _remove_unheld(self, url: str, partial_only: bool) -> bool:
        """Delete the object's files if no local process holds its lock (a reader, a download)."""
        with self._lock_file(url) as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            for path in [self._file(url, _PARTIAL)] + ([] if partial_only else
                                                      [self._file(url, _ETAG_SUFFIX), self._file(url)]):
                path.unlink(missing_ok=True)
            return True

    def _download(self, url: str) -> None:
        """With the object's lock held exclusively and its room claimed."""
        self._file(url, _ETAG_SUFFIX).unlink(missing_ok=True)
        remote = self.store.download(self.objects[url].name, self._file(url), expected=self.objects[url])
        self._file(url, _ETAG_SUFFIX).write_text(remote.etag)
        with self._lock:
            self.downloaded_bytes += remote.size
        with self._lock_file(url, _HEAD + _LOCK) as lock:  # the copy serves headers from now on
            fcntl.flock(lock, fcntl.LOCK_EX)
            for kept in self.cache_dir.glob(glob.escape(f".{remote.name}.") + f"*{_HEAD}"):
                kept.unlink()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.release()
