#!/usr/bin/env python
"""A SQuAD v1.1 and v2.0 sample from the real sentences of data/sample/books, for the offline demo and the
tests (data/squad_download.py fetches the real data set).

Each context is a sentence of the sample novels. An answerable question names one of its words, "Where is
the word W?", and the answer is that word, at its character offset in the sentence. v2.0 adds unanswerable
questions: they name a word of another sentence that this one does not contain. A tiny BERT can learn to
point at the named word; the shuffled variant of the tests (the answer is another word of the sentence, at
random) cannot be learned and is their negative control. The dev set shares no sentence with train.

    python data/squad_sample.py --output_dir results/squad_sample [--train 1000 --dev 200]

writes v1.1/train-v1.1.json, v1.1/dev-v1.1.json, v2.0/train-v2.0.json and v2.0/dev-v2.0.json in the official
SQuAD JSON format: the layout that scripts/run_squad.sh reads with SQUAD_DIR=<output_dir>/<version>.
"""

import argparse
import json
import os
import random
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from data.glue_sample import book_sentences

TEMPLATE_WORDS = {"where", "the", "word"}  # never asked for (and "the" normalises away)
VERSIONS = {"v1.1": "1.1", "v2.0": "v2.0"}  # directory and file names -> the official files' "version"


def sample_sentences() -> list[str]:
    """Sentences of 8 to 30 words of the sample novels, in book order."""
    return book_sentences(min_words=8, max_words=30)


def candidate_words(sentence: str) -> dict[str, int]:
    """Words of 3+ letters that occur once in the sentence (case-insensitive), except the question template's
    words, with their character offsets."""
    words = {}
    for match in re.finditer(r"[A-Za-z]{3,}", sentence):
        word = match.group()
        if (word.lower() not in TEMPLATE_WORDS and word not in words
                and len(re.findall(rf"\b{word}\b", sentence, re.IGNORECASE)) == 1):
            words[word] = match.start()
    return words


def word_questions(sentences: Sequence[str], per_sentence: int, seed: int, id_prefix: str = "q",
                   shuffled: bool = False) -> list[dict[str, Any]]:
    """SQuAD paragraphs: per sentence, up to per_sentence questions 'Where is the word W?' about candidate
    words W; the answer is W. shuffled=True (the tests' negative control): the answer is another candidate
    word of the sentence, drawn at random, so the question does not determine it."""
    rng = random.Random(seed)
    paragraphs = []
    for s, sentence in enumerate(sentences):
        words = candidate_words(sentence)
        if len(words) < 2:
            continue
        qas = []
        for word in rng.sample(sorted(words), min(per_sentence, len(words))):
            answer = rng.choice([w for w in sorted(words) if w != word]) if shuffled else word
            qas.append({"id": f"{id_prefix}{s}-{word}", "question": f"Where is the word {word}?",
                        "answers": [{"text": answer, "answer_start": words[answer]}]})
        paragraphs.append({"context": sentence, "qas": qas})
    return paragraphs


def add_unanswerable(paragraphs: list[dict[str, Any]], every: int, seed: int,
                     id_prefix: str = "n") -> list[dict[str, Any]]:
    """SQuAD v2.0: to every `every`-th paragraph, one question about a word of another paragraph that its
    context does not contain (case-insensitive), with no answer and is_impossible true. Returns paragraphs."""
    rng = random.Random(seed)
    pool = sorted({word for paragraph in paragraphs for word in candidate_words(paragraph["context"])})
    for p, paragraph in enumerate(paragraphs[::every]):
        while True:
            word = rng.choice(pool)
            if not re.search(rf"\b{word}\b", paragraph["context"], re.IGNORECASE):
                break
        paragraph["qas"].append({"id": f"{id_prefix}{p}-{word}", "question": f"Where is the word {word}?",
                                 "answers": [], "is_impossible": True})
    return paragraphs


def write_squad(path: str | os.PathLike[str], paragraphs: list[dict[str, Any]], version: str = "1.1",
                title: str = "sample") -> Path:
    """A SQuAD JSON file with one article holding `paragraphs`; returns its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": version, "data": [{"title": title, "paragraphs": paragraphs}]}))
    return path


def write_sample(directory: str | os.PathLike[str], n_train: int, n_dev: int,
                 seed: int = 0) -> dict[str, tuple[Path, Path]]:
    """The four files of the sample under `directory` (from n_train and n_dev sentences, two questions per
    training sentence, one per dev sentence; v2.0 adds an unanswerable question to every third one).
    Returns {version: (train path, dev path)}."""
    sentences = sample_sentences()
    rng = random.Random(seed)
    rng.shuffle(sentences)
    if n_train + n_dev > len(sentences):
        raise ValueError(f"the sample books have {len(sentences)} sentences of 8 to 30 words, "
                         f"fewer than --train {n_train} + --dev {n_dev}")
    train_sentences, dev_sentences = sentences[:n_train], sentences[n_train:n_train + n_dev]
    written = {}
    for version, version_field in VERSIONS.items():
        train = word_questions(train_sentences, 2, seed, id_prefix="t")
        dev = word_questions(dev_sentences, 1, seed + 1, id_prefix="d")
        if version == "v2.0":
            train = add_unanswerable(train, 3, seed + 2, id_prefix="tn")
            dev = add_unanswerable(dev, 3, seed + 3, id_prefix="dn")
        out = Path(directory) / version
        written[version] = (write_squad(out / f"train-{version}.json", train, version_field),
                            write_squad(out / f"dev-{version}.json", dev, version_field))
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write a SQuAD v1.1 and v2.0 sample from the sentences of data/sample/books.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--output_dir", required=True, help="gets v1.1/ and v2.0/, as SQUAD_DIR's parent")
    parser.add_argument("--train", type=int, default=1000, help="training sentences (two questions each)")
    parser.add_argument("--dev", type=int, default=200, help="dev sentences (one question each)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        written = write_sample(args.output_dir, args.train, args.dev, args.seed)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for paths in written.values():
        counts = [sum(len(p["qas"]) for p in json.loads(path.read_text())["data"][0]["paragraphs"]) for path in paths]
        print(f"wrote {paths[0]} ({counts[0]} questions) and {paths[1].name} ({counts[1]})")
    print(f"run_squad.sh: SQUAD_DIR={args.output_dir}/v1.1, or SQUAD_VERSION=v2.0 SQUAD_DIR={args.output_dir}/v2.0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
