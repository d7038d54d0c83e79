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
