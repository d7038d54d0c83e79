"""common/atomic_write.py: the target holds the old content or the whole new one, never a part; no temporary left."""

import os

import pytest

from common.atomic_write import atomic_path, remove_stale_temporaries, write_atomically, write_text_atomically


def test_a_file_is_replaced_whole_and_fsynced(tmp_path, monkeypatch):
    target = tmp_path / "config.json"
    target.write_text("old")
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real_fsync(fd))
    write_text_atomically(target, "new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["config.json"]
    assert synced == [str(tmp_path / f".config.json.tmp.{os.getpid()}"), str(tmp_path)]  # the file, then its directory


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "shard.bin"
    target.write_bytes(b"old")

    def write_half_then_fail(file):
        file.write(b"ne")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, write_half_then_fail)
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["shard.bin"]


def test_a_directory_appears_only_when_complete(tmp_path):
    target = tmp_path / "sharded"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.mkdir()
            (tmp / "a.txt").write_text("a")
            raise RuntimeError("killed halfway")
    assert os.listdir(tmp_path) == []
    with atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "a.txt").write_text("a")
    assert os.listdir(tmp_path) == ["sharded"] and (target / "a.txt").read_text() == "a"


def test_stale_temporaries_of_killed_writers_are_removed(tmp_path):
    (tmp_path / ".s.hdf5.tmp.123").write_text("partial")
    (tmp_path / ".out.tmp.9").mkdir()
    (tmp_path / ".other.hdf5.tmp.5").write_text("someone else's")
    remove_stale_temporaries(tmp_path / "s.hdf5")
    remove_stale_temporaries(tmp_path / "out")
    assert os.listdir(tmp_path) == [".other.hdf5.tmp.5"]
