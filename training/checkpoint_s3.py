"""Checkpoint copies on S3 (common/storage.py): with an s3:// output directory a checkpoint is saved locally as
training/checkpointing.py lays it out (into a staging directory), then copied: every file of the tag, then its
manifest, then `latest`. S3 cannot rename, so this order is the commit: `latest` on S3 names a tag only once that
tag's files and manifest are all there. Resume and export fetch the checkpoint they need."""

import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from common import storage
from common.atomic_write import write_text_atomically
from training.checkpointing import (
    LATEST_NAME,
    MANIFEST_NAME,
    CheckpointError,
    Manifest,
    check_manifest,
    choose_among,
    delete_tag_dir,
    raise_if_any_rank_failed,
    rank_and_world,
    scan_checkpoints,
    tag_order_key,
)


def _remote_scan(store: storage.S3Store) -> tuple[list[tuple[str, Manifest]], dict[str, str], str | None]:
    """(complete checkpoints newest first, {tag: reason} of the others, `latest`) under an S3 prefix."""
    sizes: dict[str, dict[str, int]] = {}  # {tag: {name in the tag: bytes}}
    for remote in store.list_objects(recursive=True):
        tag, _, name = remote.name.partition("/")
        if name:
            sizes.setdefault(tag, {})[name] = remote.size
    complete: list[tuple[str, Manifest]] = []
    broken: dict[str, str] = {}
    for tag, files in sorted(sizes.items()):
        if MANIFEST_NAME in files:
            found = check_manifest(store.get_bytes(f"{tag}/{MANIFEST_NAME}").decode(), files)
        else:
            found = None, f"no {MANIFEST_NAME} (its upload was interrupted)"
        if found[0] is not None:
            complete.append((tag, found[0]))
        elif any(name.endswith(".pt") for name in files):
            broken[tag] = found[1]
    complete.sort(key=lambda item: tag_order_key(*item), reverse=True)
    latest = store.get_bytes(LATEST_NAME).decode().strip() if store.exists(LATEST_NAME) else None
    if latest is not None and latest not in broken and latest not in dict(complete):
        broken[latest] = "nothing under that tag"
    return complete, broken, latest


def fetch_checkpoint(store: storage.S3Store, local_dir: str | os.PathLike[str], tag: str | None = None) -> str | None:
    """Download a complete checkpoint from an S3 prefix into local_dir, every file verified, the
    manifest and then `latest` last; returns its tag. tag None: the one resume would use (the rules
    of find_resume_tag), or None when the prefix holds no checkpoint."""
    complete, broken, latest = _remote_scan(store)
    chosen: tuple[str, Manifest] | None
    if tag is None:
        chosen = choose_among(store.url(), complete, broken, latest)
    elif tag in dict(complete):
        chosen = tag, dict(complete)[tag]
    else:
        raise CheckpointError(f"no complete checkpoint {tag!r} in {store.url()}: {broken.get(tag, 'no such tag')}")
    if chosen is None:
        return None
    tag, manifest = chosen
    tag_dir = Path(local_dir) / tag
    for name in [*manifest["files"], MANIFEST_NAME]:
        (tag_dir / name).parent.mkdir(parents=True, exist_ok=True)
        store.download(f"{tag}/{name}", tag_dir / name)
    write_text_atomically(Path(local_dir) / LATEST_NAME, tag)
    return tag


def upload_checkpoint(store: storage.S3Store, local_dir: str | os.PathLike[str], tag: str) -> None:
    """Copy a complete local checkpoint to S3 in commit order (see above). An earlier upload of the
    same tag loses its manifest first, so that its old and new files are never taken as complete."""
    tag_dir = Path(local_dir) / tag
    manifest: Manifest = json.loads((tag_dir / MANIFEST_NAME).read_text())
    store.delete([f"{tag}/{MANIFEST_NAME}"])
    for name in sorted(manifest["files"]):
        store.upload(tag_dir / name, f"{tag}/{name}")
    store.upload(tag_dir / MANIFEST_NAME, f"{tag}/{MANIFEST_NAME}")
    store.put_bytes(LATEST_NAME, tag.encode())


def prune_remote_checkpoints(store: storage.S3Store, keep_last_n: int) -> list[str]:
    """prune_checkpoints for an S3 prefix: each doomed tag loses its manifest first, then its files."""
    complete, _, latest = _remote_scan(store)
    doomed = [tag for tag, _ in complete[keep_last_n:] if tag != latest]
    for tag in doomed:
        store.delete([f"{tag}/{MANIFEST_NAME}"])
        store.delete([f"{tag}/{remote.name}" for remote in store.child(tag).list_objects(recursive=True)])
    return doomed


STAGING_PREFIX_NAME = ".s3_prefix"  # in the staging directory: the s3:// prefix its checkpoints are copies for


class CheckpointUploader:
    """Copies each checkpoint saved into local_dir to S3, on rank 0, in a background thread: training
    goes on meanwhile. finish() (collective) waits for the copy and raises CheckpointError on every
    rank if it failed; call it before the next save and before the end of the run. After a copy, the
    staging directory keeps only the newest checkpoint; on S3, keep_last_n applies (0 keeps all)."""

    def __init__(self, store: storage.S3Store, local_dir: str | os.PathLike[str], keep_last_n: int = 0) -> None:
        self.store, self.local_dir, self.keep_last_n = store, Path(local_dir), keep_last_n
        self._thread: threading.Thread | None = None
        self._error: str | None = None

    def prepare(self, device: torch.device, resume: bool, tag: str | None = None,
                say: Callable[[str], None] | None = None) -> None:
        """Collective, before resume: rank 0 empties the staging directory and, when resuming, fetches
        into it the checkpoint that resume would use (or `tag`). Except when the staging directory holds
        a complete checkpoint that a run on this prefix saved but did not finish copying (a preemption's
        last save, its upload cut short) and that resume should use (`tag`, or newer than S3's newest):
        that one is uploaded first and kept (say(message) is told), not thrown away."""
        error: str | None = None
        unfinished: str | None = None
        if rank_and_world()[0] == 0:
            try:
                unfinished = self._unfinished_upload(tag) if resume else None
                if unfinished is None:
                    shutil.rmtree(self.local_dir, ignore_errors=True)
                    self.local_dir.mkdir(parents=True)
                    write_text_atomically(self.local_dir / STAGING_PREFIX_NAME, self.store.url())
                    if resume:
                        fetch_checkpoint(self.store, self.local_dir, tag)
                else:
                    if say is not None:
                        say(f"checkpoint {unfinished} in {self.local_dir} is complete but its copy to "
                            f"{self.store.url()} was cut short: uploading it now, then resuming from it")
                    self._keep_only(unfinished)
                    upload_checkpoint(self.store, self.local_dir, unfinished)
                    if self.keep_last_n:
                        prune_remote_checkpoints(self.store, self.keep_last_n)
            except (storage.StorageError, OSError) as exc:
                doing = "fetch a checkpoint from" if unfinished is None else f"copy checkpoint {unfinished} to"
                error = f"cannot {doing} {self.store.url()}: {exc}"
            except CheckpointError as exc:
                error = str(exc)
        raise_if_any_rank_failed(error, "fetching a checkpoint from S3", device)

    def _unfinished_upload(self, tag: str | None) -> str | None:
        """The tag of a complete checkpoint in the staging directory, staged for this prefix (a staging
        directory may have served another prefix before), that S3 lacks and resume should use: `tag`,
        or, with tag None, one newer than the newest complete checkpoint on S3. None otherwise."""
        try:
            if (self.local_dir / STAGING_PREFIX_NAME).read_text() != self.store.url():
                return None
        except OSError:  # no staging directory, or one of a run before the prefix was recorded
            return None
        staged, _ = scan_checkpoints(self.local_dir)
        if not staged:
            return None
        on_s3, _, _ = _remote_scan(self.store)
        if tag is not None:
            return tag if tag in dict(staged) and tag not in dict(on_s3) else None
        if on_s3 and tag_order_key(*on_s3[0]) >= tag_order_key(*staged[0]):
            return None
        return staged[0][0]

    def _keep_only(self, tag: str) -> None:
        """The staging directory as a fetch of `tag` leaves it: that checkpoint, `latest` naming it."""
        for entry in self.local_dir.iterdir():
            if entry.is_dir() and entry.name != tag:
                delete_tag_dir(entry)
        write_text_atomically(self.local_dir / LATEST_NAME, tag)

    def start(self, tag: str) -> None:
        if rank_and_world()[0] != 0:
            return
        self.wait()
        self._thread = threading.Thread(target=self._copy, args=(str(tag),), name="checkpoint-upload", daemon=True)
        self._thread.start()

    def _copy(self, tag: str) -> None:
        try:
            upload_checkpoint(self.store, self.local_dir, tag)
            if self.keep_last_n:
                prune_remote_checkpoints(self.store, self.keep_last_n)
        except (storage.StorageError, OSError) as exc:
            self._error = f"checkpoint {tag} was not copied to {self.store.url()}: {exc}"
            return
        for old in self.local_dir.iterdir():
            if old.is_dir() and old.name != tag and (old / MANIFEST_NAME).is_file():
                delete_tag_dir(old)

    def wait(self) -> str | None:
        """Wait for the copy under way (this rank only); its error message, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error

    def finish(self, device: torch.device) -> None:
        raise_if_any_rank_failed(self.wait(), "copying a checkpoint to S3", device)
