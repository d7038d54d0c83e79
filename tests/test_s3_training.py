"""S3 end to end, against a real S3 server (moto_server on 127.0.0.1): the data tool reading text from
and writing shards to S3, and the driver training from S3 shards and checkpointing to S3."""

import gzip
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import helpers  # noqa: E402  (puts the repo root on sys.path)
import s3_helpers  # noqa: E402
import storage  # noqa: E402
from data.shard_format import SHARD_KEYS  # noqa: E402

DATA_TOOL = helpers.REPO_ROOT / "data" / "create_pretraining_data.py"


def book_text(name: str, lines: int = 400) -> str:
    with gzip.open(helpers.REPO_ROOT / "data" / "sample" / "books" / name, "rt", encoding="utf-8") as f:
        return "".join(f.readlines()[:lines])


def run_data_tool(*args, env=None):
    return subprocess.run([sys.executable, str(DATA_TOOL), "--vocab_file", str(helpers.REPO_ROOT / "data" / "vocab.txt"),
                           "--max_seq_length", "64", "--max_predictions_per_seq", "10", "--dupe_factor", "1",
                           "--n_processes", "1", *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=env or os.environ)


def test_data_tool_reads_text_from_and_writes_shards_to_s3(tmp_path, s3):
    """The same shards as a local run of the same text; a second run skips what is already on S3."""
    _, bucket, client = s3
    text = tmp_path / "text"
    text.mkdir()
    for name in ("persuasion_part1", "pride_and_prejudice_part1"):
        (text / f"{name}.txt").write_text(book_text(f"{name}.txt.gz"))
        client.upload_file(str(text / f"{name}.txt"), bucket, f"text/{name}.txt")
    local = run_data_tool("--input_file", text, "--output_file", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    remote = run_data_tool("--input_file", f"s3://{bucket}/text", "--output_file", f"s3://{bucket}/shards")
    assert remote.returncode == 0, remote.stderr
    store = storage.S3Store(f"s3://{bucket}/shards")
    names = [o.name for o in store.list_objects()]
    assert names == ["persuasion_part1.hdf5", "pride_and_prejudice_part1.hdf5"]
    for name in names:
        store.download(name, tmp_path / name)
        with h5py.File(tmp_path / name) as got, h5py.File(tmp_path / "local" / name) as expected:
            assert all(np.array_equal(got[key][:], expected[key][:]) for key in SHARD_KEYS)
    again = run_data_tool("--input_file", f"s3://{bucket}/text", "--output_file", f"s3://{bucket}/shards")
    assert again.returncode == 0 and "skipping 2 existing shard(s)" in again.stderr


def test_data_tool_with_a_missing_bucket_is_one_line(tmp_path, s3):
    (tmp_path / "a.txt").write_text(book_text("persuasion_part1.txt.gz", 50))
    result = run_data_tool("--input_file", tmp_path / "a.txt", "--output_file", "s3://no-such-bucket-i12/shards")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "create_pretraining_data.py: error: cannot open s3://no-such-bucket-i12/shards: bucket 'no-such-bucket-i12' "
        f"does not exist at {s3[0].url}")
    assert s3_helpers.SECRET_KEY not in result.stderr + result.stdout
