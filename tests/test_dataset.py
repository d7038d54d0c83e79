"""data/dataset.py: the global sample stream, rank slicing, window reads, prefetch, bad shards.

Samples are identified by the number written into input_ids[:, 1] (tests/helpers.py), so coverage is
checked on what the batches contain, independently of the stream's own bookkeeping.
"""

import shutil
from collections import Counter

import h5py
import numpy as np
import pytest

import helpers
from data import dataset, verify_hdf5
from data.dataset import RankBatches, WindowReader, masked_lm_labels, scan_shards
from data.shard_format import SHARD_KEYS, ShardError, ShardWriter, is_shard_name, is_training_shard_name

VOCAB = 30522


def make_readers(directory, world, window_size, seed=7, **kwargs):
    shards, _, _ = scan_shards(directory)
    return [WindowReader(shards, seed, window_size, VOCAB, **kwargs) for _ in range(world)]


def collect(directory, world, micro, global_batches, window_size=7, start=0, seed=7):
    """uids seen by each rank over `global_batches` global micro-batches, in stream order."""
    readers = make_readers(directory, world, window_size, seed)
    iterators = [RankBatches(readers[r], r, world, micro, start) for r in range(world)]
    per_rank = [[] for _ in range(world)]
    stream = []
    try:
        for _ in range(global_batches):
            for rank, iterator in enumerate(iterators):
                uids = helpers.sample_uid(next(iterator).tensors[0])
                per_rank[rank].append(uids)
                stream.extend(uids)
    finally:
        for iterator in iterators:
            iterator.close()
    return per_rank, stream


@pytest.mark.parametrize("sizes", [[11, 30, 7], [11, 30, 7, 19]], ids=["3_shards", "4_shards"])
@pytest.mark.parametrize("world", [1, 2])
def test_every_sample_once_per_epoch(tmp_path, sizes, world):
    helpers.write_synthetic_shards(tmp_path, sizes)
    total, micro = sum(sizes), 3
    global_batch = micro * world
    num_batches = -(-3 * total // global_batch)  # three epochs and a bit: batches straddle epoch ends
    per_rank, stream = collect(tmp_path, world, micro, num_batches)
    # Both ranks take the same number of micro-batches, each of the full size.
    assert all(len(batches) == num_batches for batches in per_rank)
    assert all(len(b) == micro for batches in per_rank for b in batches)
    # Cut the stream every `total` samples: each cut is one epoch and holds every sample exactly once.
    for epoch in range(3):
        assert Counter(stream[epoch * total:(epoch + 1) * total]) == Counter(range(total))
    # Epochs are shuffled differently (a fixed order would make this equal).
    assert stream[:total] != stream[total:2 * total]


def test_ranks_take_disjoint_consecutive_slices(tmp_path):
    helpers.write_synthetic_shards(tmp_path, [13, 20])
    _, one_rank = collect(tmp_path, world=1, micro=4, global_batches=10)
    per_rank, _ = collect(tmp_path, world=2, micro=2, global_batches=10)
    # Global micro-batch g of 2 ranks x 2 = rank 0's 2 samples then rank 1's = 1 rank x 4.
    interleaved = [uid for g in range(10) for rank in range(2) for uid in per_rank[rank][g]]
    assert interleaved == one_rank


def test_same_seed_same_stream_other_seed_other_stream(tmp_path):
    helpers.write_synthetic_shards(tmp_path, [9, 14])
    _, first = collect(tmp_path, 1, 4, 6, seed=3)
    _, again = collect(tmp_path, 1, 4, 6, seed=3)
    _, other = collect(tmp_path, 1, 4, 6, seed=4)
    assert first == again
    assert first != other


def test_start_position_resumes_at_the_next_sample(tmp_path):
    helpers.write_synthetic_shards(tmp_path, [10, 25, 6])
    _, whole = collect(tmp_path, 2, 3, 20)
    _, resumed = collect(tmp_path, 2, 3, 12, start=8 * 6)  # after 8 global micro-batches of 6
    assert resumed == whole[8 * 6:]


def test_window_reads_are_bounded(tmp_path, monkeypatch):
    """No read is larger than one window, also for a shard much larger than the window."""
    helpers.write_synthetic_shards(tmp_path, [50, 3])
    rows_read = []
    original = dataset._read_piece

    def counting(shard, local_path, first, end, *limits):
        rows_read.append(end - first)
        return original(shard, local_path, first, end, *limits)

    monkeypatch.setattr(dataset, "_read_piece", counting)
    _, stream = collect(tmp_path, 1, 2, 27, window_size=5)
    assert Counter(stream) == Counter(range(53)) + Counter(stream[53:])  # one epoch fully covered
    assert max(rows_read) <= 5
    # A window spans a shard boundary (5 does not divide 50 + 3 at every shard order), read as pieces.
    assert sum(rows_read) >= 53


def test_window_size_follows_the_memory_budget():
    # seq 128, 20 predictions: (3*128 + 2*20 + 1) int64 values = 3400 bytes per sample.
    assert dataset.window_size_for_budget(3400 * 1000, 128, 20) == 1000
    assert dataset.window_size_for_budget(10, 128, 20) == 1


def test_masked_lm_labels_stop_at_the_first_zero_position():
    positions = np.array([[1, 3, 0, 2], [2, 4, 5, 6]])
    ids = np.array([[11, 33, 99, 22], [12, 14, 15, 16]])
    expected = np.full((2, 8), -1)
    expected[0, 1], expected[0, 3] = 11, 33          # position 2 comes after the 0 sentinel: ignored
    expected[1, [2, 4, 5, 6]] = [12, 14, 15, 16]
    np.testing.assert_array_equal(masked_lm_labels(positions, ids, 8), expected)


def test_batch_layout_matches_the_reference(tiny_shards):
    reader = make_readers(tiny_shards, 1, 8)[0]
    iterator = RankBatches(reader, 0, 1, 4, 0)
    try:
        input_ids, segment_ids, input_mask, labels, nsp = next(iterator).tensors
    finally:
        iterator.close()
    assert [t.shape for t in (input_ids, segment_ids, input_mask, labels)] == [(4, 32)] * 4
    assert nsp.shape == (4,)
    assert segment_ids[:, -1].tolist() == [1] * 4 and input_mask.sum().item() == 4 * 32
    # Labels are the input tokens at exactly 5 masked positions per row (the synthetic shards' rule).
    masked = labels != -1
    assert masked.sum(dim=1).tolist() == [5] * 4
    assert (labels[masked] == input_ids[masked]).all()


def test_files_without_training_in_the_name_are_ignored(tiny_shards):
    shards, seq_len, max_pred = scan_shards(tiny_shards)
    assert [s.num_samples for s in shards] == [24, 40, 17]
    assert (seq_len, max_pred) == (32, 5)


def test_a_killed_writers_temporary_and_files_that_are_not_shards_are_ignored(tmp_path):
    """A prep killed while writing shard 1 leaves `.shard_1_training.hdf5.tmp.<pid>`; it, a hidden copy of
    a shard and a text file named 'training' are not training shards: only the one finished shard is."""
    good, = helpers.write_synthetic_shards(tmp_path, [6])
    writer = ShardWriter(tmp_path / "shard_1_training.hdf5", 32, 5).__enter__()
    with h5py.File(good, "r") as f:
        writer.append({key: f[key][...] for key in SHARD_KEYS})
    writer._file.close()  # killed: the temporary stays, never renamed
    assert [p.name for p in tmp_path.glob(".shard_1_training.hdf5.tmp.*")]
    shutil.copy(good, tmp_path / ".shard_2_training.hdf5")
    (tmp_path / "notes_training.txt").write_text("not a shard\n")
    shards, _, _ = scan_shards(tmp_path)
    assert [s.path for s in shards] == [good]


@pytest.mark.parametrize("name, shard, training", [
    ("books_wiki_en_corpus_training_0.hdf5", True, True), ("x_training_0.h5", True, True),
    ("books_wiki_en_corpus_test_0.hdf5", True, False), (".x_training_0.hdf5", False, False),
    (".x_training_0.hdf5.tmp.4242", False, False), ("x_training_0.hdf5.part", False, False),
    ("x_training_0.txt", False, False)])
def test_one_rule_names_the_shards_for_the_reader_and_verify_hdf5(name, shard, training):
    assert (is_shard_name(name), is_training_shard_name(name)) == (shard, training)


def test_verify_hdf5_skips_hidden_files(tmp_path, capsys):
    helpers.write_synthetic_shards(tmp_path, [3], name=".shard_{i}_training.hdf5")
    assert verify_hdf5.main([str(tmp_path)]) == 1
    assert "no *.hdf5 / *.h5 files" in capsys.readouterr().err


def test_token_id_beyond_vocab_names_file_and_sample(tmp_path):
    paths = helpers.write_synthetic_shards(tmp_path, [6, 6])
    with h5py.File(paths[1], "a") as f:
        ids = f["input_ids"][...]
        ids[4, 7] = VOCAB
        f["input_ids"][...] = ids
    reader = make_readers(tmp_path, 1, 100, shuffle=False)[0]
    iterator = RankBatches(reader, 0, 1, 12, 0)
    with pytest.raises(ShardError, match=rf"{paths[1].name}: sample 4: token id {VOCAB} outside"):
        next(iterator)
    iterator.close()


@pytest.mark.parametrize("key, row, value, message", [
    ("segment_ids", 2, 2, "sample 2: segment id 2 outside \\[0, 2\\)"),
    ("next_sentence_labels", 4, 2, "sample 4: next-sentence label 2 outside \\[0, 2\\)"),
    ("next_sentence_labels", 1, -1, "sample 1: next-sentence label -1 outside \\[0, 2\\)"),
    ("input_mask", 5, 3, "sample 5: input mask value 3 outside \\[0, 2\\)")])
def test_values_the_model_cannot_take_name_file_and_sample(tmp_path, key, row, value, message):
    """Values that would fail the first step (an embedding or loss index) are bad rows, like a token id."""
    paths = helpers.write_synthetic_shards(tmp_path, [6, 6])
    with h5py.File(paths[1], "a") as f:
        values = f[key][...]
        values[(row, 7) if values.ndim == 2 else row] = value
        f[key][...] = values
    reader = make_readers(tmp_path, 1, 100, shuffle=False)[0]
    with pytest.raises(ShardError, match=rf"{paths[1].name}: {message}"):
        reader.read(0, 12)


def test_segment_limit_is_the_type_vocab_size_given(tmp_path):
    helpers.write_synthetic_shards(tmp_path, [6])  # segment ids 0 and 1
    shards, _, _ = scan_shards(tmp_path)
    assert len(WindowReader(shards, 7, 6, VOCAB, type_vocab_size=2).read(0, 6)["segment_ids"]) == 6
    with pytest.raises(ShardError, match=r"sample 0: segment id 1 outside \[0, 1\)"):
        WindowReader(shards, 7, 6, VOCAB, shuffle=False, type_vocab_size=1).read(0, 6)


def test_skip_bad_shards_drops_a_shard_with_a_bad_segment_id(tmp_path):
    paths = helpers.write_synthetic_shards(tmp_path, [8, 8])
    with h5py.File(paths[0], "a") as f:
        segments = f["segment_ids"][...]
        segments[3, 9] = 5
        f["segment_ids"][...] = segments
    reader = make_readers(tmp_path, 1, 16, skip_bad_shards=True)[0]
    uids = helpers.sample_uid(reader.read(0, 8)["input_ids"])
    assert sorted(uids) == list(range(8, 16)) and reader.skipped_shards == [paths[0].name]


def test_corrupt_shard_mid_epoch_is_an_error_naming_it(tmp_path):
    paths = helpers.write_synthetic_shards(tmp_path, [8, 8, 8])
    helpers.corrupt_first_chunk(paths[2])
    scan_shards(tmp_path)  # the header is fine: the damage is only found when the rows are read
    reader = make_readers(tmp_path, 1, 4, shuffle=False)[0]
    iterator = RankBatches(reader, 0, 1, 4, 0)
    next(iterator), next(iterator), next(iterator), next(iterator)  # shards 0 and 1
    with pytest.raises(ShardError, match=rf"{paths[2].name}: cannot read samples 0..3"):
        next(iterator)
    iterator.close()


def test_skip_bad_shards_drops_and_counts_the_shard(tmp_path):
    paths = helpers.write_synthetic_shards(tmp_path, [8, 8, 8])
    helpers.corrupt_first_chunk(paths[1])
    reader = make_readers(tmp_path, 1, 4, skip_bad_shards=True)[0]
    iterator = RankBatches(reader, 0, 1, 4, 0)
    uids = []
    for _ in range(8):  # 32 samples: more than the 16 left, so every good sample appears
        batch = next(iterator)
        uids.extend(helpers.sample_uid(batch.tensors[0]))
    iterator.close()
    assert batch.skipped_shards == (paths[1].name,)
    assert set(uids) == set(range(8)) | set(range(16, 24))


def test_restart_goes_on_from_a_position_without_the_agreed_shards(tiny_shards):
    """RankBatches.restart (every rank drops the shards some rank could not read): the batches after it are
    those of a fresh reader built without those shards, started at that position; nothing prepared before
    the restart (the queue is full by then) comes out. A checkpoint's list may name a shard by its path."""
    shards, _, _ = scan_shards(tiny_shards)
    dropped = shards[1]
    iterator = RankBatches(make_readers(tiny_shards, 2, 7)[1], 1, 2, 4, 0)
    next(iterator), next(iterator)
    for _ in range(100):  # let the background thread fill its queue with batches of the old layout
        if iterator._queue.full():
            break
        iterator._thread.join(timeout=0.05)
    assert iterator._queue.full()
    iterator.restart(24, [dropped.name])
    restarted = [helpers.sample_uid(next(iterator).tensors[0]) for _ in range(6)]
    iterator.close()
    fresh_reader = make_readers(tiny_shards, 1, 7, skipped_shards=[str(dropped.path)])[0]
    fresh = RankBatches(fresh_reader, 1, 2, 4, 24)
    expected = [helpers.sample_uid(next(fresh).tensors[0]) for _ in range(6)]
    fresh.close()
    assert restarted == expected
    assert not set(range(24, 64)) & set(sum(restarted, []))  # shard 1 holds samples 24..63


def test_prefetcher_stays_ahead_and_stops(tiny_shards):
    reader = make_readers(tiny_shards, 1, 8)[0]
    iterator = RankBatches(reader, 0, 1, 4, 0, prefetch=3)
    first = next(iterator)
    # The background thread fills the queue without being asked.
    for _ in range(100):
        if iterator._queue.full():
            break
        iterator._thread.join(timeout=0.05)
    assert iterator._queue.full()
    assert [first.position, next(iterator).position] == [0, 4]
    iterator.close()
    assert not iterator._thread.is_alive()


def test_global_micro_batch_larger_than_an_epoch_wraps_into_the_next(tmp_path):
    """The driver refuses such a dataset (one error line); the stream itself stays well defined: 5 samples in
    order, 2 ranks x 4 -> positions 0..7 are samples 0-4 then 0-2 of the next epoch."""
    helpers.write_synthetic_shards(tmp_path, [3, 2])
    readers = make_readers(tmp_path, 2, 8, shuffle=False)
    iterators = [RankBatches(readers[rank], rank, 2, 4, 0) for rank in range(2)]
    try:
        batches = [next(iterator) for iterator in iterators]
    finally:
        for iterator in iterators:
            iterator.close()
    assert [helpers.sample_uid(b.tensors[0]) for b in batches] == [[0, 1, 2, 3], [4, 0, 1, 2]]
    assert all(b.crosses_epoch and b.next_position == 8 for b in batches)


def test_shard_order_and_window_contents_change_between_epochs(tmp_path):
    """Each epoch draws its own shard order, so window w of epoch e holds other samples than window w of
    epoch e + 1; an order seeded by the seed alone would repeat every epoch, shuffled only inside windows."""
    sizes = [6, 9, 4, 7, 5]
    helpers.write_synthetic_shards(tmp_path, sizes)
    first_uid = np.cumsum([0] + sizes[:-1])
    shard_of = {uid: shard for shard, (start, n) in enumerate(zip(first_uid, sizes)) for uid in range(start, start + n)}
    total, epochs = sum(sizes), 4
    # Window size 1 leaves every sample in layout order: the stream shows each epoch's shard order.
    _, stream = collect(tmp_path, 1, 1, epochs * total, window_size=1)
    orders = [list(dict.fromkeys(shard_of[uid] for uid in stream[e * total:(e + 1) * total])) for e in range(epochs)]
    assert all(sorted(order) == list(range(len(sizes))) for order in orders)
    assert len({tuple(order) for order in orders}) > 1, f"the same shard order in every epoch: {orders}"
    # With windows of 8, the set of samples per window differs from one epoch to the next.
    _, stream = collect(tmp_path, 1, 1, epochs * total, window_size=8)
    windows = [[frozenset(stream[e * total + w:e * total + min(w + 8, total)]) for w in range(0, total, 8)]
               for e in range(epochs)]
    assert all(windows[e] != windows[e + 1] for e in range(epochs - 1))
