"""Split articles into sentences and spread them over N training and M test text shards.

Input: text files with one article per line (blank lines ignored). Output: <dataset>_training_<i>.txt
and <dataset>_test_<i>.txt, one sentence per line and a blank line after each article (the input
format of create_pretraining_data.py).

Sentence splitter: blingfire's text_to_sentences. NLTK's punkt (the reference's choice) needs a
data download that machines without internet access cannot make; blingfire ships its model inside
the wheel (MIT), was the fastest splitter measured here (~12 MB/s vs 7 MB/s for an untrained
punkt) and handles abbreviations such as "Dr." and "D.C.". Its bundled library exists for x86-64
Linux, Windows and macOS only.

Balancing: the test set receives ``fraction_test`` of all sentences. Articles are assigned
largest first to the shard that is least full relative to its target (longest-processing-time
greedy), one pass over the articles, so it always terminates (the reference could loop forever).
Held out by document and by sentence: an article goes to one shard, and a test shard leaves out every sentence
that a training shard also has (compared lower-cased, white space collapsed: as the uncased tokenizer sees them),
so that a held-out evaluation never scores text the model was trained on. The training shards' sentences are kept
as 8-byte hashes while the shards are written (8 bytes per training sentence).

Memory: sentences go to a scratch file in a first pass; only per-article offsets and counts stay
in memory; the second pass copies each shard's articles out of the scratch file.
"""
import hashlib
import heapq
import multiprocessing
import os
import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from multiprocessing.pool import Pool
from pathlib import Path

import numpy as np
from tqdm import tqdm

from common.atomic_write import atomic_path, remove_stale_temporaries

ARTICLES_PER_TASK = 256


class ShardingError(ValueError):
    """Impossible shard counts or no usable text."""


def split_sentences(articles: Iterable[str]) -> list[list[str]]:
    """Sentences (one list per article) of a batch of articles, with blingfire."""
    import blingfire

    return [[s for s in (x.strip() for x in blingfire.text_to_sentences(article).split("\n")) if s]
            for article in articles]


def read_article_batches(input_files: Iterable[str | os.PathLike[str]]) -> Iterator[list[str]]:
    batch: list[str] = []
    for path in input_files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    batch.append(line.strip())
                    if len(batch) == ARTICLES_PER_TASK:
                        yield batch
                        batch = []
    if batch:
        yield batch


def split_in_windows(pool: Pool, batches: Iterable[list[str]], window: int) -> Iterator[list[str]]:
    """Sentences of each article, in order; at most ``window`` batches in flight (Pool.imap would
    read the whole input ahead of the workers)."""
    pending: list[list[str]] = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == window:
            yield from (article for result in pool.map(split_sentences, pending) for article in result)
            pending = []
    yield from (article for result in pool.map(split_sentences, pending) for article in result)


def split_to_scratch(input_files: Sequence[str | os.PathLike[str]], scratch: Path,
                     n_processes: int) -> tuple[np.ndarray, np.ndarray]:
    """Write every article's sentences to ``scratch``; return (byte offsets, sentence counts)."""
    offsets, counts = array("q"), array("q")
    total_bytes = sum(os.path.getsize(p) for p in input_files)
    with open(scratch, "wb") as out, multiprocessing.get_context("fork").Pool(n_processes) as pool, \
            tqdm(total=total_bytes, unit="B", unit_scale=True, desc="sentence split", mininterval=1.0,
                 disable=None) as bar:  # disable=None: bars on terminals only
        for sentences in split_in_windows(pool, read_article_batches(input_files), n_processes * 4):
            if not sentences:
                continue
            offsets.append(out.tell())
            counts.append(len(sentences))
            text = "\n".join(sentences) + "\n\n"
            out.write(text.encode("utf-8"))
            bar.update(len(text))
    return np.frombuffer(offsets, dtype=np.int64), np.frombuffer(counts, dtype=np.int64)


def check_shard_counts(n_training: int, n_test: int, fraction_test: float) -> None:
    if n_training < 1 or n_test < 0 or (n_test > 0) != (fraction_test > 0) or not 0 <= fraction_test < 1:
        raise ShardingError("need >= 1 training shard, and test shards exactly when 0 < fraction_test_set < 1")


def assign_articles(counts: np.ndarray, n_training: int, n_test: int, fraction_test: float) -> np.ndarray:
    """Shard index of each article (training shards 0..N-1, test shards N..N+M-1), balanced greedily."""
    check_shard_counts(n_training, n_test, fraction_test)
    if len(counts) < n_training + n_test:
        raise ShardingError(f"only {len(counts)} articles for {n_training + n_test} shards; "
                            "lower the number of shards")
    total = float(counts.sum())
    targets = [total * (1 - fraction_test) / n_training] * n_training
    targets += [total * fraction_test / max(n_test, 1)] * n_test
    # Heap of (fill ratio, shard); ties go to the lower index, so every shard gets an article early.
    heap = [(0.0, shard) for shard in range(len(targets))]
    filled = [0] * len(targets)
    shard_of = np.empty(len(counts), dtype=np.int64)
    for article in np.argsort(-counts, kind="stable"):
        _, shard = heapq.heappop(heap)
        shard_of[article] = shard
        filled[shard] += int(counts[article])
        heapq.heappush(heap, (filled[shard] / targets[shard], shard))
    return shard_of


def sentence_keys(sentences: Sequence[str]) -> np.ndarray:
    """A 64-bit hash of each sentence as the uncased tokenizer sees it (lower case, white space collapsed)."""
    return np.array([int.from_bytes(hashlib.blake2b(" ".join(s.lower().split()).encode(), digest_size=8).digest(),
                                    "little", signed=True) for s in sentences], dtype=np.int64)


def write_shards(scratch: Path, offsets: np.ndarray, shard_of: np.ndarray, names: Sequence[str],
                 out_dir: Path, n_training: int) -> int:
    """Copy each shard's articles (in input order) from the scratch file into out_dir/<name>: the n_training
    training shards first, then the test shards without the sentences that a training shard has. Returns the
    number of sentences so left out."""
    ends = np.append(offsets[1:], os.path.getsize(scratch))
    order = np.lexsort((offsets, shard_of))
    boundaries = np.searchsorted(shard_of[order], np.arange(len(names) + 1))
    held_out = len(names) > n_training
    training_keys, left_out = array("q"), 0
    with open(scratch, "rb") as src:
        for shard, name in enumerate(tqdm(names, desc="write shards", unit="shard", disable=None)):
            if shard == n_training:
                trained = np.unique(np.frombuffer(training_keys, dtype=np.int64))
            with open(out_dir / name, "wb") as out:
                for article in order[boundaries[shard]:boundaries[shard + 1]]:
                    src.seek(offsets[article])
                    text = src.read(ends[article] - offsets[article])
                    if not held_out:
                        out.write(text)
                        continue
                    sentences = text.decode("utf-8").split("\n")[:-2]  # the article ends in "\n\n"
                    keys = sentence_keys(sentences)
                    if shard < n_training:
                        training_keys.extend(keys)
                        out.write(text)
                        continue
                    found = np.minimum(np.searchsorted(trained, keys), max(len(trained) - 1, 0))
                    shared = trained[found] == keys if len(trained) else np.zeros(len(keys), dtype=bool)
                    kept = [s for s, drop in zip(sentences, shared, strict=True) if not drop]
                    left_out += len(sentences) - len(kept)
                    if kept:
                        out.write(("\n".join(kept) + "\n\n").encode("utf-8"))
    return left_out


def shard_corpus(input_files: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike[str], dataset: str,
                 n_training: int, n_test: int, fraction_test: float, n_processes: int) -> bool:
    """Build out_dir atomically (a temporary directory renamed at the end); skip if it exists."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        return False
    check_shard_counts(n_training, n_test, fraction_test)  # before the long sentence-splitting pass
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out_dir)
    with atomic_path(out_dir) as tmp:
        tmp.mkdir()
        scratch = tmp / "sentences.scratch"
        offsets, counts = split_to_scratch(input_files, scratch, n_processes)
        shard_of = assign_articles(counts, n_training, n_test, fraction_test)
        names = [f"{dataset}_training_{i}.txt" for i in range(n_training)]
        names += [f"{dataset}_test_{i}.txt" for i in range(n_test)]
        left_out = write_shards(scratch, offsets, shard_of, names, tmp, n_training)
        scratch.unlink()
    if n_test:
        print(f"sharding: {left_out} of the test documents' sentences are also in a training shard and were left "
              "out of the test shards", file=sys.stderr)
    return True
