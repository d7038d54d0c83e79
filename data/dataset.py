"""Training-side reading of HDF5 shards as one deterministic global sample stream.

The stream. Epoch e lays the training shards (the .hdf5/.h5 files of --input_dir whose name contains
"training", dot-files aside: shard_format.is_training_shard_name)
end to end, in an order shuffled by a generator seeded with (seed, e). That concatenation is cut into
fixed windows of K samples, and the rows inside window w are permuted by a generator seeded with
(seed, e, w). The stream is epoch 0's order, then epoch 1's, and so on. A stream *position* is the
number of samples consumed since the start of training: the whole data position is one integer.

Ranks. With micro-batch m and world size W, global micro-batch g covers positions [g*B, (g+1)*B),
B = m*W, and rank r takes [g*B + r*m, g*B + (r+1)*m). So every sample is used exactly once per epoch,
every rank takes the same number of micro-batches, and the micro-batch that straddles the end of an
epoch simply takes the first samples of the next epoch. Resuming costs O(1): start at the position.

Memory. Only one window (K samples, K from a memory budget) is held per reader; a window is read from
HDF5 as contiguous row ranges, so a shard larger than the budget is never read whole. Every rank reads
every window (it needs 1/W of it); this keeps the reader simple and costs W times the decompression,
the same I/O the reference spends by visiting each file W times per epoch. A background thread
prepares the next micro-batches while the current one trains.

Where shards live. The reader asks a shard-files object for each shard's local path just before it
reads rows of it, releases it once the window's rows are in memory, and names the next shard in layout
order. LocalShardFiles (below) is a plain directory; the driver may pass another object with the same
methods instead (storage.ShardCache: S3, downloaded into a bounded local cache, next shard prefetched).

Batches are tuples of int64 tensors in the reference's order: input_ids, segment_ids, input_mask,
masked_lm_labels (-1 except at masked positions), next_sentence_labels.
"""

import os
import queue
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol, Self, TypeVar

import h5py
import numpy as np
import torch

from data.shard_format import (
    SHARD_KEYS,
    Rows,
    ShardError,
    is_held_out_shard_name,
    is_training_shard_name,
    read_shard_header,
)

BATCH_FIELDS = ("input_ids", "segment_ids", "input_mask", "masked_lm_labels", "next_sentence_labels")
# Upper bound of the in-memory size of one sample: every field as int64 (3 x seq_len + 2 x max_pred + 1).
_BYTES_PER_ELEMENT = 8


class BadShardRows(ShardError):
    """Rows of one shard cannot be read or hold out-of-range values; `shard` is the ShardInfo."""

    def __init__(self, shard: "ShardInfo", message: str):
        super().__init__(f"{shard.path}: {message}")
        self.shard = shard


@dataclass(frozen=True)
class ShardInfo:
    path: Path | str  # a local path, or whatever names the shard in its shard-files object (an s3:// URL)
    num_samples: int

    @property
    def name(self) -> str:
        return str(self.path).rsplit("/", 1)[-1]


# How a shard-files object names its shards: a local Path (LocalShardFiles), an s3:// URL (storage.ShardCache).
Name = TypeVar("Name")


class ShardFiles(Protocol[Name]):
    """Where shards live: the methods of LocalShardFiles (the reader calls them in the order described there)."""

    def list_files(self) -> list[Name]: ...
    def header_file(self, path: Name) -> Path | IO[bytes]: ...
    def local_path(self, path: Name) -> Path: ...
    def release(self) -> None: ...
    def prefetch(self, path: Name) -> None: ...
    def close(self) -> None: ...


class LocalShardFiles:
    """Shards in a local directory. The interface the reader needs from where shards live."""

    def __init__(self, input_dir: str | os.PathLike[str]):
        self.input_dir = Path(input_dir)

    def list_files(self) -> list[Path]:
        return sorted(p for p in self.input_dir.iterdir() if p.is_file())

    def header_file(self, path: Path) -> Path:
        """What h5py opens to read the header (a path or a file object)."""
        return path

    def local_path(self, path: Path) -> Path:
        """The local file to read rows of `path` from (called just before each read)."""
        return Path(path)

    def release(self) -> None:
        """The reader has the rows it needs in memory: the shard it read last may go (e.g. be evicted)."""

    def prefetch(self, path: Path) -> None:
        """`path` is the next shard in layout order."""

    def close(self) -> None:
        """Stop background work (the reader is done)."""


def find_shards(shard_files: ShardFiles[Name], held_out: bool = False) -> list[Name]:
    """Sorted training shards (shard_format.is_training_shard_name): the reference takes any file whose name
    contains 'training', which would take a killed writer's hidden temporary for a shard. held_out: the
    held-out shards instead (shard_format.is_held_out_shard_name), which may share the directory."""
    select = is_held_out_shard_name if held_out else is_training_shard_name
    return [p for p in shard_files.list_files() if select(str(p).rsplit("/", 1)[-1])]


def scan_shards(input_dir: str | os.PathLike[str],
                shard_files: ShardFiles[Any] | None = None,
                held_out: bool = False) -> tuple[list[ShardInfo], int, int]:
    """Validate the header of every training shard (held-out shard, with held_out); return (shards, seq_len,
    max_pred).

    shard_files: where the shards live (default: LocalShardFiles(input_dir)).
    Raises ShardError when there is no shard, when a header is invalid, or when the shards disagree
    on seq_len / max_pred. Empty shards are valid and contribute nothing.
    """
    shard_files = shard_files or LocalShardFiles(input_dir)
    paths = find_shards(shard_files, held_out)
    if not paths:
        kind = ("held-out shards (.hdf5 or .h5 files whose name contains 'test' and not 'training')" if held_out
                else "training shards (.hdf5 or .h5 files whose name contains 'training')")
        raise ShardError(f"{input_dir}: no {kind}")
    shards = []
    shapes: dict[tuple[int, int], object] = {}
    for path in paths:
        num_samples, seq_len, max_pred = read_shard_header(path, shard_files.header_file(path))
        shapes.setdefault((seq_len, max_pred), path)
        if len(shapes) > 1:
            (first, first_path), (second, _) = list(shapes.items())[:2]
            raise ShardError(f"{path}: (seq_len, max_pred) = {second}, but {first_path} has {first}")
        shards.append(ShardInfo(path, num_samples))
    (seq_len, max_pred), = shapes
    return shards, seq_len, max_pred


def window_size_for_budget(budget_bytes: int, seq_len: int, max_pred: int) -> int:
    """Samples per window so that one window of int64 arrays fits in budget_bytes (at least 1)."""
    per_sample = (3 * seq_len + 2 * max_pred + 1) * _BYTES_PER_ELEMENT
    return max(1, budget_bytes // per_sample)


class SampleStream:
    """Pure mapping from stream positions to (shard, row); no file access, no global RNG."""

    def __init__(self, shards: Iterable[ShardInfo], seed: int, window_size: int, shuffle: bool = True):
        self.shards = [s for s in shards if s.num_samples > 0]
        if not self.shards:
            raise ShardError("every training shard is empty (or was skipped)")
        self.seed, self.window_size, self.shuffle = seed, window_size, shuffle
        self.epoch_size = sum(s.num_samples for s in self.shards)

    def epoch_of(self, position: int) -> int:
        return position // self.epoch_size

    def shard_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.shards)))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)).tolist()

    def window_pieces(self, epoch: int, window: int) -> list[tuple[ShardInfo, int, int]]:
        """(shard, first_row, end_row) ranges that make up window `window` of `epoch`, in layout order."""
        start = window * self.window_size
        end = min(start + self.window_size, self.epoch_size)
        pieces, offset = [], 0
        for index in self.shard_order(epoch):
            shard = self.shards[index]
            lo, hi = max(start, offset), min(end, offset + shard.num_samples)
            if lo < hi:
                pieces.append((shard, lo - offset, hi - offset))
            offset += shard.num_samples
        return pieces

    def shard_after(self, epoch: int, window: int) -> ShardInfo:
        """The shard read after window `window` of `epoch` (the next epoch's first one at the end)."""
        last = self.window_pieces(epoch, window)[-1][0]
        order = [self.shards[i] for i in self.shard_order(epoch)]
        position = order.index(last)
        return order[position + 1] if position + 1 < len(order) else self.shards[self.shard_order(epoch + 1)[0]]

    def window_permutation(self, epoch: int, window: int, length: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(length)
        return np.random.default_rng([self.seed, epoch, window]).permutation(length)


def masked_lm_labels(positions: np.ndarray, ids: np.ndarray, seq_len: int) -> np.ndarray:
    """[N, seq_len] int64 labels, -1 except labels[i, positions[i, j]] = ids[i, j] for the valid j.

    As the reference: the valid predictions of a row end at the first position 0 (position 0 is [CLS],
    never masked, so it is the padding sentinel)."""
    labels = np.full((positions.shape[0], seq_len), -1, dtype=np.int64)
    valid = np.cumprod(positions != 0, axis=1).astype(bool)
    rows = np.broadcast_to(np.arange(positions.shape[0])[:, None], positions.shape)
    labels[rows[valid], positions[valid]] = ids[valid]
    return labels


def _read_piece(shard: ShardInfo, local_path: str | os.PathLike[str], first: int, end: int, vocab_size: int,
                type_vocab_size: int) -> Rows:
    """Rows [first, end) of one shard as numpy arrays, with every value the model indexes by checked: a value
    out of range would otherwise fail in the first step's embedding or loss (an IndexError, not a shard)."""
    try:
        with h5py.File(local_path, "r") as f:
            arrays = {key: f[key][first:end] for key in SHARD_KEYS}
    except (OSError, KeyError) as err:
        raise BadShardRows(shard, f"cannot read samples {first}..{end - 1}: {err}") from err
    seq_len = arrays["input_ids"].shape[1]
    checks = (("input_ids", vocab_size, "token id"), ("masked_lm_ids", vocab_size, "masked token id"),
              ("masked_lm_positions", seq_len, "masked position"), ("segment_ids", type_vocab_size, "segment id"),
              ("input_mask", 2, "input mask value"), ("next_sentence_labels", 2, "next-sentence label"))
    for key, limit, what in checks:
        bad = np.argwhere((arrays[key] < 0) | (arrays[key] >= limit))
        if len(bad):
            index = tuple(bad[0])
            raise BadShardRows(shard, f"sample {first + index[0]}: {what} {arrays[key][index]} "
                                           f"outside [0, {limit})")
    return arrays


class WindowReader:
    """Reads the samples at given stream positions, one window in memory at a time.

    With skip_bad_shards, a shard that fails to read or validate is dropped from the stream (the
    layout is recomputed without it from that point on, so that epoch may repeat or miss samples);
    the names of the dropped shards are in `skipped_shards` and must be passed back on resume. Names, not
    paths: every host drops the same shards wherever its copy of the data lives. (Checkpoints from before
    held paths; their last component is the name.)
    shard_files: where the shards live (default: local files, see LocalShardFiles).
    vocab_size, type_vocab_size: the model's; a token id or segment id at or above them is a bad row.
    """

    def __init__(self, shards: Iterable[ShardInfo], seed: int, window_size: int, vocab_size: int, shuffle: bool = True,
                 skip_bad_shards: bool = False, skipped_shards: Iterable[str | Path] = (),
                 shard_files: ShardFiles[Any] | None = None, type_vocab_size: int = 2):
        self.all_shards, self.seed, self.window_size = list(shards), seed, window_size
        self.shard_files: ShardFiles[Any] = shard_files or LocalShardFiles(".")
        self.vocab_size, self.type_vocab_size = vocab_size, type_vocab_size
        self.shuffle, self.skip_bad_shards = shuffle, skip_bad_shards
        self.skip_shards(skipped_shards)

    def skip_shards(self, names: Iterable[str | Path]) -> None:
        """Drop these shards (names or paths) from the stream: its layout is recomputed without them."""
        self.skipped_shards = [str(name).rsplit("/", 1)[-1] for name in names]
        kept = [s for s in self.all_shards if s.name not in self.skipped_shards]
        self.stream = SampleStream(kept, self.seed, self.window_size, self.shuffle)
        self._window: tuple[tuple[int, int], Rows] | None = None  # ((epoch, window), its rows)

    def _load_window(self, epoch: int, window: int) -> Rows:
        try:
            pieces = [_read_piece(shard, self.shard_files.local_path(shard.path), first, end, self.vocab_size,
                                  self.type_vocab_size)
                      for shard, first, end in self.stream.window_pieces(epoch, window)]
        finally:
            # The window is in memory: hold no shard while its batches are used. A rank that kept one could
            # wait (queue full, then a collective) for a rank that waits for room in the cache for another.
            self.shard_files.release()
        self.shard_files.prefetch(self.stream.shard_after(epoch, window).path)
        arrays = {key: np.concatenate([p[key] for p in pieces]) for key in SHARD_KEYS}
        order = self.stream.window_permutation(epoch, window, len(arrays["input_ids"]))
        return {key: value[order] for key, value in arrays.items()}

    def _window_for(self, position: int) -> tuple[Rows, int]:
        """(window arrays, index of `position` inside them), loading the window when needed."""
        epoch, in_epoch = divmod(position, self.stream.epoch_size)
        window, index = divmod(in_epoch, self.window_size)
        if self._window is None or self._window[0] != (epoch, window):
            self._window = (epoch, window), self._load_window(epoch, window)
        return self._window[1], index

    def read(self, start: int, count: int) -> Rows:
        """Numpy arrays (SHARD_KEYS) of the samples at positions [start, start + count)."""
        while True:
            try:
                return self._read_positions(start, count)
            except BadShardRows as err:
                if not self.skip_bad_shards:
                    raise
                self.skip_shards([*self.skipped_shards, err.shard.name])

    def _read_positions(self, start: int, count: int) -> Rows:
        parts, position, end = [], start, start + count
        while position < end:
            window, index = self._window_for(position)
            take = min(end - position, len(window["input_ids"]) - index)
            parts.append({key: value[index:index + take] for key, value in window.items()})
            position += take
        return {key: np.concatenate([p[key] for p in parts]) for key in SHARD_KEYS}


def fixed_chunks(reader: WindowReader, count: int, chunk_size: int, rank: int,
                 world_size: int) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    """This rank's share of the first `count` samples of the reader's stream (held-out evaluation: a reader
    without shuffling) cut into chunks of chunk_size samples, the last one shorter: chunks rank, rank +
    world_size, ... as [(chunk index, batch tensors)]. Every chunk is the same at any world size. Every rank
    reads (and so checks) all `count` samples: a bad one fails every rank alike, not only the one that owns it."""
    chunks = []
    for index in range(-(-count // chunk_size)):
        arrays = reader.read(index * chunk_size, min(chunk_size, count - index * chunk_size))
        if index % world_size == rank:
            chunks.append((index, to_batch(arrays)))
    return chunks


def to_batch(arrays: Rows) -> tuple[torch.Tensor, ...]:
    """Numpy shard rows -> the reference's tuple of int64 tensors (see BATCH_FIELDS)."""
    seq_len = arrays["input_ids"].shape[1]
    labels = masked_lm_labels(arrays["masked_lm_positions"], arrays["masked_lm_ids"], seq_len)
    fields = (arrays["input_ids"], arrays["segment_ids"], arrays["input_mask"], labels,
              arrays["next_sentence_labels"])
    return tuple(torch.from_numpy(np.ascontiguousarray(f, dtype=np.int64)) for f in fields)


@dataclass
class MicroBatch:
    tensors: tuple[torch.Tensor, ...]  # see BATCH_FIELDS
    position: int           # stream position of the first sample of this global micro-batch
    next_position: int      # position after this global micro-batch (= samples consumed after it)
    epoch: int              # epoch of the first sample
    crosses_epoch: bool     # the global micro-batch ends in the next epoch
    skipped_shards: tuple[str, ...]  # shards dropped so far (--skip_bad_shards)


class RankBatches:
    """Iterator over this rank's micro-batches from `start_position`, prepared by a background thread.

    Every rank builds one with the same arguments except `rank`. Call close() when done.
    """

    def __init__(self, reader: WindowReader, rank: int, world_size: int, micro_batch: int,
                 start_position: int, prefetch: int = 4):
        self.reader, self.rank, self.micro_batch = reader, rank, micro_batch
        self.global_batch = micro_batch * world_size  # may exceed an epoch: it then wraps into the next ones
        self._queue: queue.Queue[MicroBatch | Exception] = queue.Queue(maxsize=prefetch)
        self._start(start_position)

    def _start(self, position: int) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(position,), daemon=True, name="batch-prefetch")
        self._thread.start()

    def _make(self, position: int) -> MicroBatch:
        arrays = self.reader.read(position + self.rank * self.micro_batch, self.micro_batch)
        stream = self.reader.stream
        last = position + self.global_batch - 1
        return MicroBatch(to_batch(arrays), position, position + self.global_batch,
                          stream.epoch_of(position), stream.epoch_of(last) != stream.epoch_of(position),
                          tuple(self.reader.skipped_shards))

    def restart(self, position: int, skipped_shards: Iterable[str | Path]) -> None:
        """Discard the micro-batches prepared so far and go on from `position` with the reader's stream
        without `skipped_shards` (the shards every rank has agreed to drop)."""
        self._stop.set()
        self._thread.join()  # no timeout: a thread still reading could change the reader's stream after this
        while not self._queue.empty():
            self._queue.get_nowait()
        self.reader.skip_shards(skipped_shards)
        self._start(position)

    def _produce(self, position: int) -> None:
        while not self._stop.is_set():
            try:
                item: MicroBatch | Exception = self._make(position)
            except Exception as err:  # handed to the consumer thread, which re-raises it
                item = err
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return
            position += self.global_batch

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> MicroBatch:
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
