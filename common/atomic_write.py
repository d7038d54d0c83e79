"""Atomic file and directory writes: a temporary name next to the target, fsync, rename, fsync the parent.

A reader (or a resumed run) sees either the old content or the whole new one, never a half-written file,
even after a kill or a power loss. A leaf module: the root modules and the data/ scripts import it.
"""

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

TMP_MARKER = ".tmp."


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file, or a directory (which makes the renames done inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AtomicPath:
    """`tmp` is a hidden name in the target's directory; commit() makes it `path`, discard() deletes it."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}{TMP_MARKER}{os.getpid()}")

    def commit(self) -> None:
        if self.tmp.is_dir():  # a directory: its files and sub-directories first
            for root, _, files in os.walk(self.tmp, topdown=False):
                for name in files:
                    fsync_path(os.path.join(root, name))
                fsync_path(root)
        else:
            fsync_path(self.tmp)
        os.replace(self.tmp, self.path)
        fsync_path(self.path.parent)

    def discard(self) -> None:
        self.discard_path(self.tmp)

    @staticmethod
    def discard_path(tmp: Path) -> None:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


@contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """`with atomic_path(target) as tmp:` write a file or build a directory at `tmp`; it replaces `target`
    when the block ends normally and is deleted when the block raises."""
    atomic = AtomicPath(path)
    try:
        yield atomic.tmp
        atomic.commit()
    except BaseException:
        atomic.discard()
        raise


def write_atomically(path: str | os.PathLike[str], write_fn: Callable[[IO[Any]], object], text: bool = False) -> None:
    """write_fn(file_object) writes the content; `path` keeps its old content if anything fails."""
    with atomic_path(path) as tmp:
        with open(tmp, "w" if text else "wb", encoding="utf-8" if text else None) as file:
            write_fn(file)
            file.flush()


def write_text_atomically(path: str | os.PathLike[str], text: str) -> None:
    write_atomically(path, lambda file: file.write(text), text=True)


def remove_stale_temporaries(path: str | os.PathLike[str]) -> None:
    """Delete the temporaries that killed writers of `path` left; only when no other process writes it."""
    target = Path(path)
    for stale in target.parent.glob(f".{target.name}{TMP_MARKER}*"):
        AtomicPath.discard_path(stale)
