"""Rebuild data/sample/ from public registries (provenance of the committed sample corpus).

    pip download --no-deps --only-binary=:all: -d CACHE gensim==4.4.0
    (cd CACHE && apt-get download r-cran-janeaustenr)
    python data/sample/build_sample.py CACHE

Writes enwiki_sample.xml.bz2 (a few real articles and redirects cut from the enwiki dump
excerpt that gensim ships as test data) and books/*.txt.gz (two Jane Austen novels, in parts of 12 chapters, read
from the R data file of Debian's r-cran-janeaustenr). Nothing is installed or imported from either.
"""
import bz2
import gzip
import re
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Collection, Iterable
from pathlib import Path

GENSIM_MEMBER = ("gensim/test/test_data/"
                 "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2")
ARTICLES = ("AccessibleComputing", "Albedo", "Achilles", "Aristotle", "Actrius", "Alchemy",
            "Animal Farm", "Abacus", "Aardvark", "Atlantic Ocean", "AsciiArt")
# Order of the character vectors in janeaustenr's lazy-load database.
AUSTEN_TITLES = ("Emma", "Mansfield Park", "Northanger Abbey", "Persuasion",
                 "Pride and Prejudice", "Sense and Sensibility")
BOOKS = ("Pride and Prejudice", "Persuasion")
CHAPTERS_PER_PART = 12  # a sample shard should hold several documents, or every NSP pair is "next"


def cut_wiki_dump(dump_xml: str, titles: Collection[str]) -> str:
    """Keep the dump's header, the pages with the given titles, and the closing tag."""
    header = dump_xml[:dump_xml.index("  <page>")]
    pages = re.findall(r"  <page>.*?</page>\n", dump_xml, re.S)
    kept = [p for p in pages if (title := re.search(r"<title>(.*?)</title>", p)) and title.group(1) in titles]
    return header + "".join(kept) + "</mediawiki>\n"


def read_r_string_vectors(rdb_bytes: bytes) -> list[list[str]]:
    """Decode an R lazy-load database holding character vectors only.

    Each object is a 4-byte length, then a zlib stream of R's XDR serialisation:
    'X\\n', format version, writer/reader versions, (v3: native encoding name),
    the STRSXP header and its length, then per string flags + length + bytes.
    """
    vectors, pos = [], 0
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


def split_into_parts(lines: Iterable[str], chapters_per_part: int) -> list[list[str]]:
    """Group a novel's lines into parts of chapters_per_part chapters (title page in part 1)."""
    parts: list[list[str]] = []
    current: list[str] = []
    chapters = 0
    for line in lines:
        if re.fullmatch(r"(CHAPTER|Chapter) [0-9IVXL]+\.?", line.strip()):
            chapters += 1
            if chapters > 1 and chapters % chapters_per_part == 1 and current:
                parts.append(current)
                current = []
        current.append(line)
    return parts + [current]


def main(cache: Path) -> None:
    out = Path(__file__).resolve().parent
    wheel = next(cache.glob("gensim-4.4.0-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        dump = bz2.decompress(z.read(GENSIM_MEMBER)).decode("utf-8")
    (out / "enwiki_sample.xml.bz2").write_bytes(bz2.compress(cut_wiki_dump(dump, ARTICLES).encode(), 9))

    deb = next(cache.glob("r-cran-janeaustenr_*.deb"))
    subprocess.run(["dpkg-deb", "-x", str(deb), str(cache / "deb")], check=True)
    rdb = cache / "deb/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb"
    novels = dict(zip(AUSTEN_TITLES, read_r_string_vectors(rdb.read_bytes())))
    (out / "books").mkdir(exist_ok=True)
    for title in BOOKS:
        for number, part in enumerate(split_into_parts(novels[title], CHAPTERS_PER_PART), 1):
            name = f"{title.lower().replace(' ', '_')}_part{number}.txt.gz"
            with gzip.GzipFile(out / "books" / name, "wb", mtime=0) as f:  # mtime 0: reproducible bytes
                f.write(("\n".join(part) + "\n").encode("utf-8"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
