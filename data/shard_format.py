"""The HDF5 shard schema shared by the data pipeline and the training-side reader.

The keys, ranks and dtypes are those of the HDF5 shards written by NVIDIA's ``create_pretraining_data.py``
(the reference's data prep), so shards made by either side are interchangeable. Google's original tool writes
TFRecord files, which this schema is not.
"""
import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal, Self, TypeAlias

import h5py
import numpy as np
from isal import isal_zlib

from common.atomic_write import AtomicPath

# key -> (dtype written by write_shard, rank, name of the second dimension)
SHARD_KEYS: dict[str, tuple[str, int, str | None]] = {
    "input_ids": ("i4", 2, "seq_len"),
    "input_mask": ("i1", 2, "seq_len"),
    "segment_ids": ("i1", 2, "seq_len"),
    "masked_lm_positions": ("i4", 2, "max_pred"),
    "masked_lm_ids": ("i4", 2, "max_pred"),
    "next_sentence_labels": ("i1", 1, None),
}
# gzip level 1 after HDF5's byte-shuffle filter: smaller files than the reference's plain gzip level 4;
# both filters are built into every HDF5/h5py, so any reader decodes the shards. The writer applies
# the two filters itself (ISA-L's deflate is about 5x faster than the zlib inside HDF5, same format).
GZIP_LEVEL = 1
COMPRESSION = {"compression": "gzip", "compression_opts": GZIP_LEVEL, "shuffle": True}
CHUNK_BYTES = 1 << 18  # input_ids chunk of ~256 KiB: cheap to decompress for a reader wanting a few rows
SHARD_SUFFIXES = (".hdf5", ".h5")
TRAINING_MARKER = "training"
HELD_OUT_MARKER = "test"  # NVIDIA's prep and the registry corpus name their held-out shards *_test_*
# Rows of a shard: SHARD_KEYS key -> numpy array, one row per sample.
Rows: TypeAlias = dict[str, np.ndarray]


def is_shard_name(name: str) -> bool:
    """A shard file's name: ends in .hdf5 or .h5 and is not hidden. A writer's temporary
    (`.<name>.tmp.<pid>`, common/atomic_write.py) is neither, so a killed or running prep's partial
    shard is never taken for one."""
    return name.endswith(SHARD_SUFFIXES) and not name.startswith(".")


def is_training_shard_name(name: str) -> bool:
    """A training shard: a shard whose name contains 'training' (the reference's rule, limited to shards)."""
    return is_shard_name(name) and TRAINING_MARKER in name


def is_held_out_shard_name(name: str) -> bool:
    """A held-out shard (--eval_dir): a shard whose name contains 'test' and not 'training'."""
    return is_shard_name(name) and HELD_OUT_MARKER in name and TRAINING_MARKER not in name


class ShardError(ValueError):
    """A shard file is missing, unreadable or does not follow the schema."""


def _check_arrays(where: str, arrays: Mapping[str, Any]) -> tuple[int, int, int]:
    """Validate ranks, integer dtypes and consistent sizes; return (N, seq_len, max_pred)."""
    missing = [key for key in SHARD_KEYS if key not in arrays]
    if missing:
        raise ShardError(f"{where}: missing key(s) {', '.join(missing)}")
    dims: dict[str, int] = {}
    num_samples = -1
    for key, (_, rank, dim_name) in SHARD_KEYS.items():
        shape, dtype = arrays[key].shape, arrays[key].dtype
        if len(shape) != rank:
            raise ShardError(f"{where}: '{key}' has rank {len(shape)}, expected {rank}")
        if not np.issubdtype(dtype, np.integer):
            raise ShardError(f"{where}: '{key}' has dtype {dtype}, expected an integer dtype")
        if num_samples < 0:
            num_samples = shape[0]
        elif shape[0] != num_samples:
            raise ShardError(f"{where}: '{key}' has {shape[0]} rows, 'input_ids' has {num_samples}")
        if dim_name is not None:
            if dims.setdefault(dim_name, shape[1]) != shape[1]:
                raise ShardError(f"{where}: '{key}' has {dim_name} {shape[1]}, expected {dims[dim_name]}")
    return num_samples, dims["seq_len"], dims["max_pred"]


class ShardWriter:
    """Append batches of samples to a new shard; the file appears under ``path`` only when complete.

    Rows go to a temporary file in the destination directory (datasets resizable along the
    sample axis), which is renamed over ``path`` when the ``with`` block exits normally and
    deleted when it exits with an exception: a killed or failing writer leaves no partial shard.
    Rows are buffered and written in whole HDF5 chunks, so no chunk is compressed twice; each chunk
    is shuffled and deflated here and stored as it is (``write_direct_chunk``).
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int, max_pred: int):
        self.path = Path(path)
        self.widths = {"seq_len": seq_len, "max_pred": max_pred}
        self.chunk_rows = 1 << max(0, (CHUNK_BYTES // (4 * seq_len)).bit_length() - 1)  # a power of two
        self.num_samples = 0
        self._pending: list[Rows] = []
        self._target = AtomicPath(self.path)
        self._file: Any = None  # the h5py.File, while open

    def __enter__(self) -> Self:
        try:
            self._file = h5py.File(self._target.tmp, "w")
            for key, (dtype, _, dim_name) in SHARD_KEYS.items():
                tail = () if dim_name is None else (self.widths[dim_name],)
                self._file.create_dataset(key, shape=(0,) + tail, maxshape=(None,) + tail, dtype=dtype,
                                          chunks=(self.chunk_rows,) + tail, **COMPRESSION)
        except BaseException:
            self._discard()
            raise
        return self

    def _discard(self) -> None:
        """Close and delete the temporary file (idempotent)."""
        if self._file is not None:
            self._file.close()
        self._target.discard()

    def append(self, arrays: Mapping[str, Any]) -> None:
        """Append rows; ``arrays`` maps every SHARD_KEYS key to an array with the same row count."""
        count, seq_len, max_pred = _check_arrays(str(self.path), arrays)
        if (seq_len, max_pred) != (self.widths["seq_len"], self.widths["max_pred"]):
            raise ShardError(f"{self.path}: appending ({seq_len}, {max_pred}) rows to a "
                             f"({self.widths['seq_len']}, {self.widths['max_pred']}) shard")
        self._pending.append({key: np.asarray(arrays[key], dtype=SHARD_KEYS[key][0]) for key in SHARD_KEYS})
        self.num_samples += count
        if sum(len(p["input_ids"]) for p in self._pending) >= self.chunk_rows:
            self._flush(whole_chunks_only=True)

    def _flush(self, whole_chunks_only: bool) -> None:
        if not self._pending:
            return
        merged = {key: np.concatenate([p[key] for p in self._pending]) for key in SHARD_KEYS}
        rows = len(merged["input_ids"])
        if whole_chunks_only:
            rows -= rows % self.chunk_rows
        start = self._file["input_ids"].shape[0]  # a whole number of chunks until the last flush
        for key in SHARD_KEYS:
            dataset = self._file[key]
            dataset.resize(start + rows, axis=0)
            for offset in range(0, rows, self.chunk_rows):
                chunk = merged[key][offset:offset + self.chunk_rows]
                origin = (start + offset,) + (0,) * (chunk.ndim - 1)
                dataset.id.write_direct_chunk(origin, self._encode_chunk(chunk))
        self._pending = [{key: merged[key][rows:] for key in SHARD_KEYS}]

    def _encode_chunk(self, chunk: np.ndarray) -> bytes:
        """HDF5's shuffle then deflate filters, on a chunk padded to full size (as HDF5 stores edge chunks)."""
        if len(chunk) < self.chunk_rows:
            chunk = np.concatenate([chunk, np.zeros((self.chunk_rows - len(chunk),) + chunk.shape[1:], chunk.dtype)])
        shuffled = np.ascontiguousarray(chunk).view(np.uint8).reshape(-1, chunk.itemsize).T
        return isal_zlib.compress(np.ascontiguousarray(shuffled), GZIP_LEVEL)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        try:
            if exc_type is None:
                self._flush(whole_chunks_only=False)
                self._file.close()
                self._target.commit()
        finally:
            self._discard()
        return False


def write_shard(path: str | os.PathLike[str], arrays: Mapping[str, Any]) -> None:
    """Write ``arrays`` (SHARD_KEYS -> numpy array) as a gzip HDF5 file, atomically (see ShardWriter)."""
    _, seq_len, max_pred = _check_arrays(str(path), arrays)
    with ShardWriter(path, seq_len, max_pred) as writer:
        writer.append(arrays)


def read_shard_header(path: str | os.PathLike[str],
                      source: str | os.PathLike[str] | IO[bytes] | None = None) -> tuple[int, int, int]:
    """Return (num_samples, seq_len, max_pred) of a shard after validating its schema.

    source: what h5py opens instead of `path` (a file object, e.g. ranged reads of a remote shard);
    `path` then only names the shard in errors."""
    try:
        with h5py.File(path if source is None else source, "r") as f:
            datasets = {key: f[key] for key in SHARD_KEYS if key in f}
            return _check_arrays(str(path), datasets)
    except OSError as err:
        raise ShardError(f"{path}: cannot read as HDF5 ({err})") from err
