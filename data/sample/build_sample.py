"""Rebuild data/sample/ from public registries (provenance of the committed sample corpus).

    pip download --no-deps --only-binary=:all: -d CACHE gensim==4.4.0
    (cd CACHE && apt-get download r-cran-janeaustenr)
    python data/sample/build_sample.py CACHE

Writes enwiki_sample.xml.bz2 (a few real articles and redirects cut from the enwiki dump
excerpt that gensim ships as test data) and books/*.txt.gz (two Jane Austen novels, in parts of 12 chapters, read
from the R data file of Debian's r-cran-janeaustenr). Nothing is installed or imported from either. The readers of
the wheel, the .deb and the R file are data/registry_corpus.py's, which builds the larger registry corpus from the
same packages.
"""
import bz2
import gzip
import re
import sys
import zipfile
from collections.abc import Collection
from pathlib import Path

from data.registry_corpus import DEBIAN_FILES, GENSIM_MEMBER, austen_novels, deb_member, split_into_parts

ARTICLES = ("AccessibleComputing", "Albedo", "Achilles", "Aristotle", "Actrius", "Alchemy",
            "Animal Farm", "Abacus", "Aardvark", "Atlantic Ocean", "AsciiArt")
BOOKS = ("Pride and Prejudice", "Persuasion")
CHAPTERS_PER_PART = 12  # a sample shard should hold several documents, or every NSP pair is "next"


def cut_wiki_dump(dump_xml: str, titles: Collection[str]) -> str:
    """Keep the dump's header, the pages with the given titles, and the closing tag."""
    header = dump_xml[:dump_xml.index("  <page>")]
    pages = re.findall(r"  <page>.*?</page>\n", dump_xml, re.S)
    kept = [p for p in pages if (title := re.search(r"<title>(.*?)</title>", p)) and title.group(1) in titles]
    return header + "".join(kept) + "</mediawiki>\n"


def main(cache: Path) -> None:
    out = Path(__file__).resolve().parent
    wheel = next(cache.glob("gensim-4.4.0-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        dump = bz2.decompress(z.read(GENSIM_MEMBER)).decode("utf-8")
    (out / "enwiki_sample.xml.bz2").write_bytes(bz2.compress(cut_wiki_dump(dump, ARTICLES).encode(), 9))

    deb = next(cache.glob("r-cran-janeaustenr_*.deb"))
    rdb = cache / "Rdata.rdb"
    rdb.write_bytes(deb_member(deb, DEBIAN_FILES["r-cran-janeaustenr=1.0.0-1"][0]))
    novels = austen_novels(rdb)
    (out / "books").mkdir(exist_ok=True)
    for title in BOOKS:
        for number, part in enumerate(split_into_parts(novels[title], CHAPTERS_PER_PART), 1):
            name = f"{title.lower().replace(' ', '_')}_part{number}.txt.gz"
            with gzip.GzipFile(out / "books" / name, "wb", mtime=0) as f:  # mtime 0: reproducible bytes
                f.write(("\n".join(part) + "\n").encode("utf-8"))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
