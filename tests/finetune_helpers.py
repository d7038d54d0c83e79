"""Fine-tuning test data written from the real sentences of data/sample/books (no download)."""

import gzip
import random
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BOOKS = REPO_ROOT / "data" / "sample" / "books"
RULE_WORD = re.compile(r"\bher\b", re.IGNORECASE)


def book_sentences(min_words=6, max_words=30) -> list:
    """Sentences of the sample novels (paragraphs joined, split after . ! ?), deduplicated, in book order."""
    sentences, seen = [], set()
    for path in sorted(BOOKS.glob("*.txt.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as file:
            paragraphs = re.split(r"\n\s*\n", file.read())
        for paragraph in paragraphs:
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                if min_words <= len(sentence.split()) <= max_words and "\t" not in sentence and sentence not in seen:
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences


def rule_labelled_sentences(count: int, seed: int = 0) -> list:
    """`count` (sentence, label) pairs, half of each class: label 1 when the sentence has the word "her"."""
    rng = random.Random(seed)
    sentences = book_sentences()
    rng.shuffle(sentences)
    positive = [s for s in sentences if RULE_WORD.search(s)][: count // 2]
    negative = [s for s in sentences if not RULE_WORD.search(s)][: count - len(positive)]
    assert len(positive) + len(negative) == count, "not enough sample sentences"
    pairs = [(s, 1) for s in positive] + [(s, 0) for s in negative]
    rng.shuffle(pairs)
    return pairs


def write_sst2_rule_task(directory, n_train: int, n_dev: int, shuffle_train_labels=False, seed: int = 0) -> Path:
    """An SST-2-format task (header; sentence, label) from the rule; dev never shares a sentence with train.
    shuffle_train_labels: the negative control, the same sentences with their labels permuted."""
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
