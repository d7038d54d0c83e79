"""Check every pretraining shard in a directory and print a summary table.

    python data/verify_hdf5.py DIR [--vocab_file data/vocab.txt]

Per shard: the schema (keys, ranks, integer dtypes, equal row counts), ids inside the vocabulary,
[CLS] first and [SEP] closing both segments, an input mask of leading ones, segment ids 0 then 1
(0 on padding), padding ids, masked positions sorted, unique, inside the real tokens and never on
[CLS]/[SEP], labels that are ordinary tokens with zero padding, NSP labels in {0, 1}.
Exit status 1 if any shard is bad (each reported on one line), 0 otherwise.
"""
import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import h5py
import numpy as np
import numpy.typing as npt

from data.shard_format import SHARD_KEYS, Rows, ShardError, is_shard_name, read_shard_header

ROWS_PER_READ = 8192
SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")


def load_special_ids(vocab_file: str | os.PathLike[str]) -> tuple[int, dict[str, int]]:
    with open(vocab_file, encoding="utf-8") as f:
        vocab = {line.rstrip("\n"): index for index, line in enumerate(f)}
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ShardError(f"{vocab_file}: vocabulary lacks {', '.join(missing)}")
    return len(vocab), {t: vocab[t] for t in SPECIAL_TOKENS}


def first_problem(checks: Iterable[tuple[str, npt.ArrayLike]]) -> str | None:
    """Name of the first failing check, or None."""
    return next((name for name, ok in checks if not np.all(ok)), None)


def check_rows(rows: Rows, vocab_size: int, special: dict[str, int]) -> tuple[str | None, dict[str, int]]:
    """Check a batch of rows; return (problem or None, statistics dict)."""
    ids, mask, segments = rows["input_ids"], rows["input_mask"], rows["segment_ids"]
    positions, labels, nsp = rows["masked_lm_positions"], rows["masked_lm_ids"], rows["next_sentence_labels"]
    n, seq_len = ids.shape
    column = np.arange(seq_len)[None, :]
    length = mask.sum(axis=1)[:, None]
    real = column < length
    first_b = np.where(segments.any(axis=1), np.argmax(segments, axis=1), -1)[:, None]
    used = np.cumprod(positions != 0, axis=1).astype(bool)  # slots before the first 0 (0 is [CLS])
    safe = np.where(used & (positions > 0) & (positions < seq_len), positions, 0)  # for indexing only
    row = np.arange(n)[:, None]
    problem = first_problem([
        ("input_ids outside the vocabulary", (ids >= 0) & (ids < vocab_size)),
        ("input_mask is not 1s then 0s", mask == real),
        ("sequence shorter than [CLS] A [SEP] B [SEP]", length >= 5),
        ("padding is not [PAD]", (ids == special["[PAD]"]) | real),
        ("first token is not [CLS]", ids[:, 0] == special["[CLS]"]),
        ("no segment B", first_b >= 3),
        ("segment ids are not 0s then 1s", segments == ((column >= first_b) & real)),
        ("segment A does not end with [SEP]", ids[row, first_b - 1] == special["[SEP]"]),
        ("segment B does not end with [SEP]", ids[row, length - 1] == special["[SEP]"]),
        ("masked positions not sorted and unique", ~used[:, 1:] | (positions[:, 1:] > positions[:, :-1])),
        ("masked position outside the real tokens", ~used | (positions < length)),
        ("masked [SEP] position", ~used | ((positions != first_b - 1) & (positions != length - 1))),
        ("masked_lm_ids outside the vocabulary or on a special token",
         ~used | ((labels >= 0) & (labels < vocab_size) & ~np.isin(labels, list(special.values())))),
        ("padding of masked_lm_positions/ids is not 0", used | ((positions == 0) & (labels == 0))),
        ("no masked position", used[:, 0]),
        ("next_sentence_labels not in {0, 1}", (nsp == 0) | (nsp == 1)),
    ])
    maskable = int((length - 3).sum())
    stats = {"sequences": n, "tokens": int(length.sum()), "maskable": maskable, "masked": int(used.sum()),
             "as_mask": int((ids[row, safe] == special["[MASK]"])[used].sum()),
             "kept": int((ids[row, safe] == labels)[used].sum()), "random_next": int((nsp == 1).sum())}
    return problem, stats


def verify_shard(path: str | os.PathLike[str], vocab_size: int, special: dict[str, int]) -> dict[str, int]:
    """Statistics of a good shard; raises ShardError naming the first problem."""
    num_samples, _, _ = read_shard_header(path)
    totals: dict[str, int] = {}
    with h5py.File(path, "r") as f:
        for start in range(0, num_samples, ROWS_PER_READ):
            try:
                rows = {key: f[key][start:start + ROWS_PER_READ].astype(np.int64) for key in SHARD_KEYS}
            except OSError as err:  # e.g. a corrupt compressed chunk
                raise ShardError(f"{path}: cannot read rows {start}..{min(start + ROWS_PER_READ, num_samples) - 1} "
                                 f"({err})") from err
            problem, stats = check_rows(rows, vocab_size, special)
            if problem:
                raise ShardError(f"{path}: {problem} (in rows {start}..{start + len(rows['input_ids']) - 1})")
            for key, value in stats.items():
                totals[key] = totals.get(key, 0) + value
    return totals


def format_row(name: str, s: dict[str, int]) -> str:
    masked = max(s.get("masked", 0), 1)
    return (f"{name:<60} {s.get('sequences', 0):>10} {s.get('tokens', 0):>12} "
            f"{s.get('masked', 0) / max(s.get('maskable', 0), 1):>8.4f} {s.get('as_mask', 0) / masked:>7.3f} "
            f"{s.get('kept', 0) / masked:>6.3f} {s.get('random_next', 0) / max(s.get('sequences', 0), 1):>8.3f}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--vocab_file", type=Path, default=Path(__file__).resolve().parent / "vocab.txt")
    args = parser.parse_args(argv)
    shards = sorted(p for p in args.directory.rglob("*") if p.is_file() and is_shard_name(p.name))
    try:
        if not shards:
            raise ShardError(f"{args.directory}: no *.hdf5 / *.h5 files")
        vocab_size, special = load_special_ids(args.vocab_file)
    except (ShardError, OSError) as err:
        print(f"verify_hdf5.py: error: {err}", file=sys.stderr)
        return 1
    print(f"{'shard':<60} {'sequences':>10} {'tokens':>12} {'masked':>8} {'[MASK]':>7} {'kept':>6} {'NSP rnd':>8}")
    totals: dict[str, int] = {}
    bad = 0
    for path in shards:
        try:
            stats = verify_shard(path, vocab_size, special)
        except ShardError as err:
            print(f"BAD {err}", file=sys.stderr)
            bad += 1
            continue
        print(format_row(str(path.relative_to(args.directory)), stats))
        for key, value in stats.items():
            totals[key] = totals.get(key, 0) + value
    print(format_row(f"total ({len(shards) - bad} good, {bad} bad)", totals))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
