"""data/vocab.txt is Google's bert-base-uncased vocabulary; data/shard_format.py keeps the reference's (NVIDIA's)
HDF5 schema."""
import hashlib
import re
from pathlib import Path

import h5py
import numpy as np
import pytest

from data.shard_format import SHARD_KEYS, ShardError, ShardWriter, read_shard_header, write_shard

VOCAB = Path(__file__).resolve().parent.parent / "data" / "vocab.txt"


def test_vocab_is_byte_identical_to_bert_base_uncased():
    data = VOCAB.read_bytes()
    assert hashlib.md5(data).hexdigest() == "64800d5d8528ce344256daf115d4965e"
    tokens = data.decode("utf-8").split("\n")[:-1]
    assert len(tokens) == 30522
    assert [tokens[i] for i in (0, 100, 101, 102, 103, 1996)] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the"]


def arrays(n=3, seq_len=8, max_pred=2, dtype=np.int64):
    rng = np.random.default_rng(0)
    shapes = {"input_ids": (n, seq_len), "input_mask": (n, seq_len), "segment_ids": (n, seq_len),
              "masked_lm_positions": (n, max_pred), "masked_lm_ids": (n, max_pred), "next_sentence_labels": (n,)}
    return {key: rng.integers(0, 2, shape).astype(dtype) for key, shape in shapes.items()}


def test_write_shard_uses_the_reference_dtypes_and_gzip(tmp_path):
    data = arrays()
    write_shard(tmp_path / "s.hdf5", data)
    expected = {"input_ids": "int32", "input_mask": "int8", "segment_ids": "int8",
                "masked_lm_positions": "int32", "masked_lm_ids": "int32", "next_sentence_labels": "int8"}
    with h5py.File(tmp_path / "s.hdf5", "r") as f:
        assert {key: str(f[key].dtype) for key in f} == expected
        assert all(f[key].compression == "gzip" for key in f)
        for key in SHARD_KEYS:
            np.testing.assert_array_equal(f[key][:], data[key])
    assert read_shard_header(tmp_path / "s.hdf5") == (3, 8, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["s.hdf5"]


def test_read_shard_header_accepts_other_integer_dtypes(tmp_path):
    with h5py.File(tmp_path / "google.hdf5", "w") as f:  # e.g. int64 everywhere
        for key, value in arrays(n=5, seq_len=16, max_pred=3).items():
            f.create_dataset(key, data=value)
    assert read_shard_header(tmp_path / "google.hdf5") == (5, 16, 3)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("masked_lm_ids"), "missing key(s) masked_lm_ids"),
    (lambda d: d.update(input_mask=d["input_mask"][:2]), "'input_mask' has 2 rows"),
    (lambda d: d.update(segment_ids=d["segment_ids"][:, :4]), "'segment_ids' has seq_len 4, expected 8"),
    (lambda d: d.update(input_ids=d["input_ids"].astype(np.float32)), "'input_ids' has dtype float32"),
    (lambda d: d.update(next_sentence_labels=d["input_mask"]), "'next_sentence_labels' has rank 2, expected 1"),
])
def test_bad_schema_is_refused_by_writer_and_reader(tmp_path, change, message):
    data = arrays()
    change(data)
    with pytest.raises(ShardError, match=re.escape(message)):
        write_shard(tmp_path / "w.hdf5", data)
    with h5py.File(tmp_path / "r.hdf5", "w") as f:
        for key, value in data.items():
            f.create_dataset(key, data=value)
    with pytest.raises(ShardError, match=re.escape(message)):
        read_shard_header(tmp_path / "r.hdf5")
    assert not (tmp_path / "w.hdf5").exists()


def test_non_hdf5_file_gives_shard_error(tmp_path):
    (tmp_path / "x.hdf5").write_text("not hdf5")
    with pytest.raises(ShardError, match="cannot read as HDF5"):
        read_shard_header(tmp_path / "x.hdf5")


def test_failed_writer_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "s.hdf5", 8, 2) as writer:
            writer.append(arrays())
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_writer_appends_in_order(tmp_path):
    first, second = arrays(n=3), arrays(n=4)
    with ShardWriter(tmp_path / "s.hdf5", 8, 2) as writer:
        writer.append(first)
        writer.append(second)
    with h5py.File(tmp_path / "s.hdf5", "r") as f:
        for key in SHARD_KEYS:
            np.testing.assert_array_equal(f[key][:], np.concatenate([first[key], second[key]]))


def test_writer_cleans_up_when_the_last_flush_fails(tmp_path, monkeypatch):
    def failing_flush(self, whole_chunks_only):
        raise OSError("disk full")

    writer = ShardWriter(tmp_path / "s.hdf5", 8, 2)
    with pytest.raises(OSError, match="disk full"):
        with writer:
            writer.append(arrays(n=1))
            monkeypatch.setattr(ShardWriter, "_flush", failing_flush)
    assert list(tmp_path.iterdir()) == [] and not writer._file.id.valid  # closed and deleted


def test_writer_cleans_up_when_opening_fails(tmp_path, monkeypatch):
    def failing_open(*args, **kwargs):
        raise OSError("cannot create")

    monkeypatch.setattr(h5py, "File", failing_open)
    with pytest.raises(OSError, match="cannot create"):
        with ShardWriter(tmp_path / "s.hdf5", 8, 2):
            pass
    assert list(tmp_path.iterdir()) == []


def test_writer_with_no_rows_writes_an_empty_shard(tmp_path):
    with ShardWriter(tmp_path / "s.hdf5", 8, 2):
        pass
    assert read_shard_header(tmp_path / "s.hdf5") == (0, 8, 2)


def test_chunks_compressed_by_the_writer_decode_through_hdf5s_own_filters(tmp_path):
    """The writer shuffles and deflates chunks itself; HDF5's shuffle + gzip filters must read back every
    value, over many chunks, a partial last chunk and the full int32 range of token ids."""
    rng = np.random.default_rng(1)
    rows, seq_len, max_pred = 5000, 128, 20
    widths = {"seq_len": (seq_len,), "max_pred": (max_pred,), None: ()}
    data = {}
    for key, (dtype, _, dim_name) in SHARD_KEYS.items():
        info = np.iinfo(dtype)
        data[key] = rng.integers(info.min, info.max, (rows,) + widths[dim_name], endpoint=True, dtype=dtype)
    with ShardWriter(tmp_path / "s.hdf5", seq_len, max_pred) as writer:
        for start in range(0, rows, 777):
            writer.append({key: value[start:start + 777] for key, value in data.items()})
    with h5py.File(tmp_path / "s.hdf5", "r") as f:
        assert f["input_ids"].chunks[0] < rows and rows % f["input_ids"].chunks[0]  # several chunks, a partial last
        assert all(f[key].compression == "gzip" and f[key].shuffle for key in SHARD_KEYS)
        for key in SHARD_KEYS:
            np.testing.assert_array_equal(f[key][:], data[key])
