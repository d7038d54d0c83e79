"""WordPiece ids of text lines, fast, for the shard writer (data/create_pretraining_data.py): BERT's tokenization
(data/tokenization.py) with the pieces of each distinct plain-ASCII word computed once and looked up."""
import itertools
import os
import re
from collections.abc import Sequence

import numpy as np

from data.tokenization import load_tokenizer

TOKENIZE_BATCH_LINES = 20_000  # bounds the size of the per-word lists and the tokenizer's Encoding objects
WORD_CACHE_LIMIT = 300_000  # distinct words whose pieces are kept (a few tens of MB)
# BERT's pre-tokenization of printable ASCII: runs of letters/digits, every other non-space character
# alone; a line end is a word of its own (row 0 of the piece table)
PLAIN_WORD = re.compile(r"[A-Za-z0-9]+|[^A-Za-z0-9 \n]|\n")


def ragged_gather(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The concatenation of values[start:start + length] for each (start, length), in order."""
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    return values[np.repeat(starts - (ends - lengths), lengths) + np.arange(total)]


class WordPieceEncoder:
    """WordPiece ids of text lines: BERT's BasicTokenizer + WordPiece through Hugging Face tokenizers.

    Most lines are printable ASCII once BERT's normaliser has run (lower-casing and accent stripping
    for an uncased vocab). Such a line splits into words exactly as BERT's pre-tokenizer splits it
    (runs of letters/digits, each other character alone), and WordPiece maps a word to the same
    pieces wherever it stands, so the pieces of each distinct word are computed once and looked up:
    a regex split and a dictionary lookup per word instead of Hugging Face's per-token objects. The
    other lines go through the full tokenizer.
    """

    def __init__(self, vocab_file: str | os.PathLike[str], do_lower_case: bool):
        self.full, self.vocab_size, self.special = load_tokenizer(vocab_file, do_lower_case)
        self.plain = load_tokenizer(vocab_file, do_lower_case, plain_ascii=True)[0]
        self.do_lower_case = do_lower_case
        self._clear_word_cache()

    def _clear_word_cache(self) -> None:
        # word -> row of the piece table; row 0 is the line end, with no pieces
        self.word_rows: dict[str, int] = {"\n": 0}
        self.piece_starts, self.piece_counts = np.zeros(1, np.int64), np.zeros(1, np.int64)
        self.pieces = np.zeros(0, np.int32)

    def _learn_words(self, new: list[str]) -> None:
        """Add the pieces of these distinct words, not yet in the table (one encoding of them all,
        space-separated: each is one pre-tokenizer word)."""
        encoding = self.plain.encode(" ".join(new), add_special_tokens=False)
        counts = np.bincount(np.array(encoding.word_ids, dtype=np.int64), minlength=len(new))
        self.word_rows.update(zip(new, range(len(self.piece_counts), len(self.piece_counts) + len(new))))
        self.piece_starts = np.concatenate([self.piece_starts, len(self.pieces) + np.cumsum(counts) - counts])
        self.piece_counts = np.concatenate([self.piece_counts, counts])
        self.pieces = np.concatenate([self.pieces, np.array(encoding.ids, dtype=np.int32)])

    def _word_rows(self, words: list[str]) -> np.ndarray:
        """Rows of the words in the piece table, learning the missing ones (the table is emptied first
        when it has grown too large)."""
        if len(self.word_rows) > WORD_CACHE_LIMIT:
            self._clear_word_cache()
        rows = np.fromiter(map(self.word_rows.get, words, itertools.repeat(-1)), np.int64, count=len(words))
        missing = np.flatnonzero(rows < 0).tolist()
        if missing:
            self._learn_words(list(set(map(words.__getitem__, missing))))
            rows[missing] = np.fromiter(map(self.word_rows.__getitem__, map(words.__getitem__, missing)),
                                        np.int64, count=len(missing))
        return rows

    def _encode_plain(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat ids, ids per line) of printable ASCII lines, by the word table."""
        text = "\n".join(lines) + "\n"
        words = PLAIN_WORD.findall(text.lower() if self.do_lower_case else text)
        rows = self._word_rows(words)
        counts = self.piece_counts[rows]
        line_ends = np.cumsum(counts)[rows == 0]
        return ragged_gather(self.pieces, self.piece_starts[rows], counts), np.diff(line_ends, prepend=0)

    def _encode_full(self, lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat ids, ids per line) through the full tokenizer."""
        ids = [encoding.ids for encoding in self.full.encode_batch_fast(lines, add_special_tokens=False)]
        flat = np.fromiter(itertools.chain.from_iterable(ids), np.int32)
        return flat, np.fromiter(map(len, ids), np.int64, count=len(ids))

    def encode_lines(self, lines: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat int32 ids of the lines in order, int64 number of ids of each line)."""
        texts, is_plain = list(lines), np.ones(len(lines), bool)
        for index in [i for i, line in enumerate(lines) if not (line.isascii() and line.isprintable())]:
            texts[index] = self.full.normalizer.normalize_str(lines[index])
            is_plain[index] = texts[index].isascii() and texts[index].isprintable()
        if is_plain.all():
            return self._encode_plain(texts)
        plain_ids, plain_counts = self._encode_plain([t for t, p in zip(texts, is_plain) if p])
        full_ids, full_counts = self._encode_full([line for line, p in zip(lines, is_plain) if not p])
        counts = np.zeros(len(lines), np.int64)
        counts[is_plain], counts[~is_plain] = plain_counts, full_counts
        source_starts = np.zeros(len(lines), np.int64)  # where each line's ids start in plain + full ids
        source_starts[is_plain] = np.cumsum(plain_counts) - plain_counts
        source_starts[~is_plain] = len(plain_ids) + np.cumsum(full_counts) - full_counts
        return ragged_gather(np.concatenate([plain_ids, full_ids]), source_starts, counts), counts


def tokenize_documents(encoder: WordPieceEncoder, documents: Sequence[list[str]]) -> tuple[np.ndarray, list[list[int]]]:
    """WordPiece ids of a block: (flat int32 array, per document the segment boundaries in it).

    Lines that tokenize to nothing are dropped, then documents left without segments.
    """
    lines = [line for document in documents for line in document]
    id_chunks, count_chunks = [], []
    for start in range(0, len(lines), TOKENIZE_BATCH_LINES):
        ids, counts = encoder.encode_lines(lines[start:start + TOKENIZE_BATCH_LINES])
        id_chunks.append(ids)
        count_chunks.append(counts)
    flat = np.concatenate(id_chunks) if id_chunks else np.zeros(0, np.int32)
    ends = np.cumsum(np.concatenate(count_chunks) if count_chunks else np.zeros(0, np.int64)).tolist()
    boundaries, line_index = [], 0
    for document in documents:
        bounds = [ends[line_index - 1] if line_index else 0]
        for end in ends[line_index:line_index + len(document)]:
            if end > bounds[-1]:
                bounds.append(end)
        line_index += len(document)
        if len(bounds) > 1:
            boundaries.append(bounds)
    return flat, boundaries


_ENCODERS: dict[tuple[str, bool], "WordPieceEncoder"] = {}


def cached_encoder(vocab_file: str, do_lower_case: bool) -> WordPieceEncoder:
    """The WordPieceEncoder of a vocab, loaded once per process (forked workers inherit it)."""
    key = (vocab_file, do_lower_case)
    if key not in _ENCODERS:
        _ENCODERS[key] = WordPieceEncoder(*key)
    return _ENCODERS[key]
