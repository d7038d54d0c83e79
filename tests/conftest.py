"""Session fixtures shared by the test files: tiny shards made inside the session (no network)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import helpers  # noqa: E402


@pytest.fixture(scope="session")
def tiny_shards(tmp_path_factory):
    """Three training shards of unequal sizes (24 + 40 + 17 = 81 samples, seq_len 32, 5 masked
    positions each) plus a file without 'training' in its name, which must be ignored."""
    directory = tmp_path_factory.mktemp("tiny_shards")
    helpers.write_synthetic_shards(directory, [24, 40, 17])
    helpers.write_synthetic_shards(directory, [5], name="held_out_{i}_test.hdf5", seed=1)
    return directory


@pytest.fixture(scope="session")
def pipeline_shards(tmp_path_factory):
    """Phase-1 shards (seq 128, 20 predictions) made by the real data/create_pretraining_data.py from the
    first chapters of a novel in data/sample/ (paragraphs become documents, lines sentences)."""
    import gzip
    import subprocess

    directory = tmp_path_factory.mktemp("pipeline_shards")
    with gzip.open(helpers.REPO_ROOT / "data" / "sample" / "books" / "persuasion_part1.txt.gz", "rt") as f:
        text = "".join(f.readlines()[:1200])
    # Blank-line runs separate documents; single lines are the "sentences".
    documents = ["\n".join(line.strip() for line in block.splitlines() if line.strip())
                 for block in text.split("\n\n") if block.strip()]
    source = directory / "persuasion.txt"
    source.write_text("\n\n".join(documents) + "\n")
    subprocess.run([sys.executable, str(helpers.REPO_ROOT / "data" / "create_pretraining_data.py"),
                    "--input_file", str(source), "--output_file", str(directory / "persuasion_training_0.hdf5"),
                    "--vocab_file", str(helpers.REPO_ROOT / "data" / "vocab.txt"), "--max_seq_length", "128",
                    "--max_predictions_per_seq", "20", "--dupe_factor", "1", "--n_processes", "1"],
                   check=True, capture_output=True, timeout=300)
    source.unlink()
    return directory
