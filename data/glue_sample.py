#!/usr/bin/env python
"""A GLUE-format demo task from the real sentences of data/sample/books, for the offline demo and the tests.

The rule: label 1 when a sentence has the word "her", else 0 (half of each), in SST-2's layout (header;
sentence, label). A tiny pretrained model learns it in a minute on a CPU, so the whole path pretrain ->
fine-tune -> evaluate can be tried without downloading GLUE. The dev set shares no sentence with train.

    python data/glue_sample.py --output_dir results/glue_sample [--train 2200 --dev 400]
"""

import argparse
import gzip
import os
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path

BOOKS = Path(__file__).resolve().parent / "sample" / "books"
RULE_WORD = re.compile(r"\bher\b", re.IGNORECASE)


def book_sentences(min_words: int = 6, max_words: int = 30) -> list[str]:
    """Sentences of the sample novels (paragraphs joined, split after . ! ?), deduplicated, in book order."""
    sentences: list[str] = []
    seen: set[str] = set()
    for path in sorted(BOOKS.glob("*.txt.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as file:
            paragraphs = re.split(r"\n\s*\n", file.read())
        for paragraph in paragraphs:
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                if min_words <= len(sentence.split()) <= max_words and "\t" not in sentence and sentence not in seen:
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences


def rule_labelled_sentences(count: int, seed: int = 0) -> list[tuple[str, int]]:
    """`count` (sentence, label) pairs, half of each class: label 1 when the sentence has the word "her"."""
    rng = random.Random(seed)
    sentences = book_sentences()
    rng.shuffle(sentences)
    positive = [s for s in sentences if RULE_WORD.search(s)][: count // 2]
    negative = [s for s in sentences if not RULE_WORD.search(s)][: count - len(positive)]
    if len(positive) + len(negative) != count:
        raise ValueError(f"the sample books have {len(positive)} sentences with the word, fewer than {count // 2}")
    pairs = [(s, 1) for s in positive] + [(s, 0) for s in negative]
    rng.shuffle(pairs)
    return pairs


def write_sst2_rule_task(directory: str | os.PathLike[str], n_train: int, n_dev: int,
                         shuffle_train_labels: bool = False, seed: int = 0) -> Path:
    """train.tsv and dev.tsv in SST-2's layout. shuffle_train_labels: the negative control of the tests,
    the same sentences with their training labels permuted."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pairs = rule_labelled_sentences(n_train + n_dev, seed)
    train, dev = pairs[:n_train], pairs[n_train:]
    if shuffle_train_labels:
        labels = [label for _, label in train]
        random.Random(seed + 1).shuffle(labels)
        train = [(sentence, label) for (sentence, _), label in zip(train, labels)]
    for name, rows in (("train.tsv", train), ("dev.tsv", dev)):
        (directory / name).write_text("sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in rows))
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the sample 'her' task in SST-2's TSV layout.")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train", type=int, default=2200, help="training examples")
    parser.add_argument("--dev", type=int, default=400, help="dev examples")
    args = parser.parse_args(argv)
    try:
        write_sst2_rule_task(args.output_dir, args.train, args.dev)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_dir}/train.tsv ({args.train}) and dev.tsv ({args.dev}); run_glue.py --task_name sst-2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
