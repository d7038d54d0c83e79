"""The HDF5 shard schema shared by the data pipeline and the training-side reader.

The keys, ranks and dtypes are those of the shards written by Google's and NVIDIA's
``create_pretraining_data.py``, so shards made by either side are interchangeable.
"""
import os
import tempfile
from pathlib import Path

import h5py
import numpy as np

# key -> (dtype written by write_shard, rank, name of the second dimension)
SHARD_KEYS = {
    "input_ids": ("i4", 2, "seq_len"),
    "input_mask": ("i1", 2, "seq_len"),
    "segment_ids": ("i1", 2, "seq_len"),
    "masked_lm_positions": ("i4", 2, "max_pred"),
    "masked_lm_ids": ("i4", 2, "max_pred"),
    "next_sentence_labels": ("i1", 1, None),
}
GZIP_LEVEL = 4  # level 4 is nearly as small as 9 and several times faster to write


class ShardError(ValueError):
    """A shard file is missing, unreadable or does not follow the schema."""


def _check_arrays(where, arrays):
    """Validate ranks, integer dtypes and consistent sizes; return (N, seq_len, max_pred)."""
    missing = [key for key in SHARD_KEYS if key not in arrays]
    if missing:
        raise ShardError(f"{where}: missing key(s) {', '.join(missing)}")
    dims = {}
    num_samples = None
    for key, (_, rank, dim_name) in SHARD_KEYS.items():
        shape, dtype = arrays[key].shape, arrays[key].dtype
        if len(shape) != rank:
            raise ShardError(f"{where}: '{key}' has rank {len(shape)}, expected {rank}")
        if not np.issubdtype(dtype, np.integer):
            raise ShardError(f"{where}: '{key}' has dtype {dtype}, expected an integer dtype")
        if num_samples is None:
            num_samples = shape[0]
        elif shape[0] != num_samples:
            raise ShardError(f"{where}: '{key}' has {shape[0]} rows, 'input_ids' has {num_samples}")
        if dim_name is not None:
            if dims.setdefault(dim_name, shape[1]) != shape[1]:
                raise ShardError(f"{where}: '{key}' has {dim_name} {shape[1]}, expected {dims[dim_name]}")
    return num_samples, dims["seq_len"], dims["max_pred"]


def write_shard(path, arrays):
    """Write ``arrays`` (SHARD_KEYS -> numpy array) as a gzip HDF5 file, atomically.

    The data go to a temporary file in the destination directory, which is renamed over
    ``path`` only once complete: a killed writer never leaves a half-written shard.
    """
    path = Path(path)
    _check_arrays(str(path), arrays)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; shards are meant to be shared
    try:
        with h5py.File(tmp_name, "w") as f:
            for key, (dtype, _, _) in SHARD_KEYS.items():
                f.create_dataset(key, data=np.asarray(arrays[key], dtype=dtype),
                                 compression="gzip", compression_opts=GZIP_LEVEL)
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)


def read_shard_header(path):
    """Return (num_samples, seq_len, max_pred) of a shard after validating its schema."""
    try:
        with h5py.File(path, "r") as f:
            datasets = {key: f[key] for key in SHARD_KEYS if key in f}
            return _check_arrays(str(path), datasets)
    except OSError as err:
        raise ShardError(f"{path}: cannot read as HDF5 ({err})") from err
