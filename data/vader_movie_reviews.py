#!/usr/bin/env python
"""The mr-vader fine-tuning task: Rotten Tomatoes sentences rated by people, from the sdist of vaderSentiment.

Source: `movieReviewSnippets_GroundTruth.txt` in `additional_resources/hutto_ICWSM_2014.tar.gz` of the PyPI source
distribution vaderSentiment==3.3.2 (MIT, C.J. Hutto): 10,605 sentences, each with the mean of at least 20 people's
ratings from -4 (most negative) to +4 (most positive). Hutto and Gilbert, "VADER: A Parsimonious Rule-based Model
for Sentiment Analysis of Social Media Text", ICWSM 2014.

The task (SST-2's layout, plus the rating as a third column): label 1 when the rating is positive, 0 when
negative; sentences rated within MIN_STRENGTH of neutral are left out, and a sentence that occurs more than once
is kept once (its first rating). The split is fixed by a hash of the sentence (lower-cased, white space
collapsed): SHA-256's first 8 bytes modulo 10 give test (0), dev (1) or train (2-9), so a sentence and its
duplicates can only be in one split, and the split does not depend on the file's order. Within a split the rows
are in the order of that hash (the source file lists its positive sentences first; a slice of a split should not).

    python data/vader_movie_reviews.py --output_dir results/mr-vader [--sdist vaderSentiment-3.3.2.tar.gz]
    python run_glue.py --task_name mr-vader --data_dir results/mr-vader ...

Without --sdist, `pip download` fetches the sdist from PyPI into <output_dir>/download/ (once).
"""

import argparse
import hashlib
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

from common.errors import InputError
from data.package_files import pip_download, sha256_checked, tar_member

VADER = "vaderSentiment==3.3.2"
SDIST_NAME = "vaderSentiment-3.3.2.tar.gz"
SDIST_SHA256 = "5d7c06e027fc8b99238edb0d53d970cf97066ef97654009890b83703849632f9"
INNER_ARCHIVE = "vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz"
GROUND_TRUTH = "hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt"
MIN_STRENGTH = 0.5  # |mean rating| below this: too close to neutral for a binary label
SPLITS = ("test", "dev") + ("train",) * 8  # by hash modulo 10


def fetch_sdist(download_dir: Path) -> Path:
    return pip_download(VADER, download_dir, SDIST_NAME, ("--no-binary=:all:",), "source distribution, 2.5 MB")


Row = tuple[str, float, str]  # id, mean rating, sentence
Labelled = tuple[str, int, float]  # sentence, label, mean rating


def read_ground_truth(sdist: Path) -> list[Row]:
    """(id, mean rating, sentence) rows of movieReviewSnippets_GroundTruth.txt inside the sdist."""
    data = sha256_checked(sdist.read_bytes(), SDIST_SHA256, f"{sdist} ({VADER}'s sdist)")
    inner = tar_member(data, INNER_ARCHIVE, sdist)
    return parse_ground_truth(tar_member(inner, GROUND_TRUTH, sdist).decode("utf-8"))


def parse_ground_truth(text: str) -> list[Row]:
    rows = []
    for line in text.splitlines():
        if line.strip():
            identifier, rating, sentence = line.split("\t")
            rows.append((identifier, float(rating), sentence.strip()))
    return rows


def sentence_key(sentence: str) -> str:
    return " ".join(sentence.lower().split())


def sentence_hash(sentence: str) -> int:
    return int.from_bytes(hashlib.sha256(sentence_key(sentence).encode("utf-8")).digest()[:8], "big")


def labelled_splits(rows: Iterable[Row]) -> dict[str, list[Labelled]]:
    """{"train"|"dev"|"test": [(sentence, label, rating)]}, each in hash order (see the module docstring)."""
    splits: dict[str, list[tuple[int, str, int, float]]] = {name: [] for name in ("train", "dev", "test")}
    seen = set()
    for _, rating, sentence in rows:
        key = sentence_key(sentence)
        if abs(rating) < MIN_STRENGTH or key in seen:
            continue
        seen.add(key)
        hashed = sentence_hash(sentence)
        splits[SPLITS[hashed % len(SPLITS)]].append((hashed, sentence, int(rating > 0), rating))
    return {name: [row[1:] for row in sorted(rows)] for name, rows in splits.items()}


def write_task(splits: dict[str, list[Labelled]], output_dir: Path) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        lines = "".join(f"{sentence}\t{label}\t{rating}\n" for sentence, label, rating in rows)
        (output_dir / f"{name}.tsv").write_text("sentence\tlabel\trating\n" + lines, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the mr-vader task (train/dev/test.tsv) from vaderSentiment's "
                                     "movie-review sentences.")
    parser.add_argument("--output_dir", required=True, type=Path)
    parser.add_argument("--sdist", type=Path, help=f"a local {SDIST_NAME} (default: pip download into "
                        "<output_dir>/download/)")
    args = parser.parse_args(argv)
    try:
        splits = labelled_splits(read_ground_truth(args.sdist or fetch_sdist(args.output_dir / "download")))
    except (InputError, OSError, tarfile.TarError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_task(splits, args.output_dir)
    sizes = ", ".join(f"{name}.tsv ({len(rows)})" for name, rows in splits.items())
    print(f"wrote {sizes} in {args.output_dir}; run_glue.py --task_name mr-vader")
    return 0


if __name__ == "__main__":
    sys.exit(main())
