"""data/create_pretraining_data.py, checked against the HDF5 files and the input text read back.

Independent references: transformers' pure-Python BERT tokenizer (BasicTokenizer + WordPiece),
a literal token-by-token truncation loop, and Python's round() for the number of predictions.
"""
import collections
import gzip
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import blingfire
import h5py
import numpy as np
import pytest

import helpers
from data.create_pretraining_data import choose_candidates, document_instances, truncate_pairs
from data.shard_format import SHARD_KEYS
from data.wordpiece_encoder import WordPieceEncoder

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "data" / "create_pretraining_data.py"
VOCAB = REPO / "data" / "vocab.txt"
BOOKS = REPO / "data" / "sample" / "books"
SEQ_LEN, MAX_PRED = 128, 20


def legacy_tokenizer(lower_case=True):
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    return BertTokenizerLegacy(str(VOCAB), do_lower_case=lower_case)


def book_documents(names):
    """Documents of sentence lines from sample book parts (one document per part)."""
    documents = []
    for name in names:
        text = gzip.open(BOOKS / name, "rt", encoding="utf-8").read()
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
        documents.append([s for p in paragraphs for s in blingfire.text_to_sentences(p).split("\n") if s.strip()])
    return documents


def write_corpus(path, documents):
    path.write_text("".join("\n".join(doc) + "\n\n" for doc in documents), encoding="utf-8")


def run_script(*args, check=True):
    result = subprocess.run([sys.executable, str(SCRIPT), "--vocab_file", str(VOCAB), *map(str, args)],
                            capture_output=True, text=True, timeout=300, env=helpers.checkout_env())
    if check:
        assert result.returncode == 0, result.stderr
    return result


def read_shard(path):
    with h5py.File(path, "r") as f:
        return {key: f[key][:] for key in SHARD_KEYS}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    documents = book_documents(["persuasion_part1.txt.gz", "pride_and_prejudice_part1.txt.gz",
                                "pride_and_prejudice_part6.txt.gz"])
    documents.append(["A very short document.", "It has two sentences."])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    write_corpus(path, documents)
    return path, documents


@pytest.fixture(scope="module")
def shard(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "shard_a.hdf5"
    run_script("--input_file", corpus[0], "--output_file", out, "--dupe_factor", 3, "--n_processes", 1)
    return read_shard(out)


@pytest.mark.parametrize("word_cache_limit", [300_000, 50])
def test_tokenization_matches_bert_basic_and_wordpiece(corpus, monkeypatch, word_cache_limit):
    """Line by line against the pure-Python tokenizer; the same encoder twice (its word table filled, or
    emptied and refilled when a small limit is passed), in batches mixing ASCII and other lines."""
    from data import wordpiece_encoder

    monkeypatch.setattr(wordpiece_encoder, "WORD_CACHE_LIMIT", word_cache_limit)
    lines = [line for doc in corpus[1] for line in doc][:1500]
    lines += ["Naïve CAFÉ in 東京 costs ½ €; e-mail: a.b@c.org", "x" * 150 + " ok",
              "\u00adsoft\u200b zero-width\x07", "", "!!", "a\u00a0b – “quoted” ﬁne Ⅻ"]
    lines += ["Tab\tseparated WORDS", "ÀÉÎÕÜ àéîõü", "plain ASCII, with (punctuation) & 123,456.78!",
              "Crème brûlée at the café, naïvely", "under_score ~tilde~ `back` {brace} [x] a|b \\ ^"]
    for lower_case in (True, False):
        reference = legacy_tokenizer(lower_case)
        expected = [reference.convert_tokens_to_ids(reference.tokenize(line)) for line in lines]
        encoder = WordPieceEncoder(VOCAB, lower_case)
        for order in (slice(None), slice(None, None, -1), slice(-7, None)):
            ids, counts = encoder.encode_lines(lines[order])
            assert ids.dtype == np.int32 and counts.sum() == len(ids)
            assert [a.tolist() for a in np.split(ids, np.cumsum(counts)[:-1])] == expected[order]


def test_truncation_matches_the_token_by_token_loop():
    rng = np.random.default_rng(1)
    cases = [(a, b, m) for a in range(1, 25) for b in range(1, 25) for m in (3, 9, 20, 30)]
    specs = np.array([(0, a, 0, b, 0) for a, b, _ in cases], dtype=np.int64)
    for (a, b, max_tokens), spec in zip(cases, specs):
        one = spec[None, :].copy()
        truncate_pairs(one, max_tokens, rng)
        while a + b > max_tokens:
            if a > b:
                a -= 1
            else:
                b -= 1
        assert (one[0, 1], one[0, 3]) == (a, b)
        assert 0 <= one[0, 0] <= (spec[1] - a) and 0 <= one[0, 2] <= (spec[3] - b)


def toy_documents(count=40, seed=3):
    """Segment boundaries (flat token offsets) of documents of 1-12 segments of 1-40 tokens."""
    rng = np.random.default_rng(seed)
    documents, offset = [], 0
    for _ in range(count):
        lengths = rng.integers(1, 41, rng.integers(1, 13))
        documents.append([offset] + (offset + np.cumsum(lengths)).tolist())
        offset = documents[-1][-1]
    return documents


def test_a_and_real_next_b_tile_each_document_once_in_order():
    """Unused segments of a random-next chunk are put back: A ranges and real-next B ranges
    cover each document exactly once, in order (one pass, no truncation needed at 509 tokens)."""
    documents = toy_documents()
    rng = random.Random(5)
    random_next = 0
    for doc_index, bounds in enumerate(documents):
        specs = []
        document_instances(doc_index, documents, 509, 0.0, rng, specs)
        position = bounds[0]
        for a_start, a_len, b_start, b_len, label in specs:
            assert a_start == position
            position += a_len
            if label == 0:
                assert b_start == position
                position += b_len
            else:
                assert not bounds[0] <= b_start < bounds[-1]  # B from another document
                random_next += 1
        assert position == bounds[-1]
    assert random_next > 20


def test_short_seq_prob_shortens_the_target_length():
    documents = toy_documents(200)
    mean_length = {}
    for short_seq_prob in (0.0, 1.0):
        specs = []
        rng = random.Random(7)
        for doc_index in range(len(documents)):
            document_instances(doc_index, documents, 125, short_seq_prob, rng, specs)
        lengths = np.array([a_len + b_len for _, a_len, _, b_len, _ in specs])
        mean_length[short_seq_prob] = np.minimum(lengths, 125).mean()
    # targets uniform in [2, 125] instead of 125: chunks stop earlier, pairs are much shorter
    assert mean_length[1.0] < 0.75 * mean_length[0.0]


def google_instance_count(segment_lengths, max_num_tokens, short_seq_prob, rng):
    """Instances Google's create_instances_from_document makes of one document, its loop written out
    literally on segment lengths (the random document and B's tokens do not change the count)."""
    target = rng.randint(2, max_num_tokens) if rng.random() < short_seq_prob else max_num_tokens
    count, chunk, length, i = 0, [], 0, 0
    while i < len(segment_lengths):
        chunk.append(segment_lengths[i])
        length += segment_lengths[i]
        if i == len(segment_lengths) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            if len(chunk) == 1 or rng.random() < 0.5:
                i -= len(chunk) - a_end  # random next: put the unused segments back
            count += 1
            chunk, length = [], 0
        i += 1
    return count


@pytest.mark.parametrize("max_num_tokens, short_seq_prob", [(125, 0.1), (509, 0.1), (40, 0.5)])
def test_instances_per_document_match_googles_loop(max_num_tokens, short_seq_prob):
    """The same yield as the reference: mean instances per document over many seeds, ours against the
    literal loop, within four standard errors (different random streams, so only in distribution)."""
    documents = toy_documents(60, seed=11)
    documents += [[0] + np.cumsum(np.full(300, 25)).tolist()]  # one long document, as a book
    ours, google = [], []
    for seed in range(300):
        specs, rng = [], random.Random(seed)
        for doc_index in range(len(documents)):
            document_instances(doc_index, documents, max_num_tokens, short_seq_prob, rng, specs)
        ours.append(len(specs))
        rng = random.Random(10_000 + seed)
        google.append(sum(google_instance_count(np.diff(bounds).tolist(), max_num_tokens, short_seq_prob, rng)
                          for bounds in documents))
    error = np.sqrt((np.var(ours) + np.var(google)) / len(ours))
    assert abs(np.mean(ours) - np.mean(google)) < 4 * error, (np.mean(ours), np.mean(google), error)


def test_truncation_cuts_front_and_back_equally_often():
    specs = np.tile(np.array([[1000, 100, 5000, 100, 0]], dtype=np.int64), (4000, 1))
    truncate_pairs(specs, 100, np.random.default_rng(11))
    assert (specs[:, 1] == 50).all() and (specs[:, 3] == 50).all()
    front_a, front_b = specs[:, 0] - 1000, specs[:, 2] - 5000  # tokens cut from the front of A and B
    for front in (front_a, front_b):
        assert abs(front.mean() - 25) < 0.5 and front.std() > 2.5  # binomial(50, 1/2): mean 25, sd 3.5
        assert 0 <= front.min() and front.max() <= 50


def restore_originals(data):
    """input_ids with the masked positions set back to their labels."""
    ids = data["input_ids"].astype(np.int64).copy()
    used = data["masked_lm_positions"] != 0
    rows = np.nonzero(used)[0]
    ids[rows, data["masked_lm_positions"][used]] = data["masked_lm_ids"][used]
    return ids, used


def test_masking_counts_shares_and_special_tokens(shard):
    ids, used = restore_originals(shard)
    length = shard["input_mask"].sum(axis=1)
    expected_count = [min(MAX_PRED, max(1, round(n * 0.15))) for n in length.tolist()]
    assert used.sum(axis=1).tolist() == expected_count
    assert 0.14 < used.sum() / (length - 3).sum() < 0.16
    for row in range(len(ids)):
        sep = np.nonzero(ids[row] == 102)[0]
        boundary = np.argmax(shard["segment_ids"][row])
        assert sep.tolist() == [boundary - 1, length[row] - 1]  # [SEP] exactly where the segments end
        assert ids[row, 0] == 101 and 101 not in ids[row, 1:] and not ids[row, length[row]:].any()
        assert shard["segment_ids"][row].tolist() == [0] * boundary + [1] * (length[row] - boundary) + \
            [0] * (SEQ_LEN - length[row])
        positions = shard["masked_lm_positions"][row][used[row]]
        assert list(positions) == sorted(set(positions.tolist()))
        assert not set(positions.tolist()) & {0, boundary - 1, length[row] - 1}
        assert positions.max() < length[row]
    shown = shard["input_ids"][np.nonzero(used)[0], shard["masked_lm_positions"][used]]
    labels = shard["masked_lm_ids"][used]
    as_mask, kept = np.mean(shown == 103), np.mean(shown == labels)
    assert abs(as_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.02
    random_ids = shown[(shown != 103) & (shown != labels)]
    assert abs(len(random_ids) / len(shown) - 0.1) < 0.02
    assert (random_ids < 999).any()  # drawn from the whole vocabulary, [unused*] included


def token_streams(documents):
    reference = legacy_tokenizer()
    streams = []
    for doc in documents:
        ids = [i for line in doc for i in reference.convert_tokens_to_ids(reference.tokenize(line))]
        streams.append(np.array(ids, dtype=np.int32).tobytes())
    return streams


def find_tokens(streams, tokens):
    """{document index: token offsets} where ``tokens`` occurs contiguously."""
    needle = np.array(tokens, dtype=np.int32).tobytes()
    found = {}
    for index, stream in enumerate(streams):
        start = stream.find(needle)
        while start != -1:
            if start % 4 == 0:
                found.setdefault(index, []).append(start // 4)
            start = stream.find(needle, start + 1)
    return found


def follows(a_at, b_at, a_len):
    """B starts after A ends, at most the truncated tokens later, in the same document."""
    return any(0 <= q - (p + a_len) <= SEQ_LEN for doc in a_at.keys() & b_at.keys()
               for p in a_at[doc] for q in b_at[doc])


def test_masked_positions_are_a_uniformly_random_subset():
    """Every k-subset of the candidates equally likely (chi-square against the uniform counts), for
    rows of different sizes in one call; a row never repeats a candidate and unused slots come last."""
    import itertools

    rng = np.random.default_rng(7)
    sizes = [(5, 2), (6, 3), (4, 1), (7, 7)]
    rows = 12_000
    num_candidates = np.array([n for n, _ in sizes] * rows)
    num_to_predict = np.array([k for _, k in sizes] * rows)
    chosen = choose_candidates(num_candidates, num_to_predict, rng)
    assert chosen.shape == (len(num_candidates), 7)
    for index, (n, k) in enumerate(sizes):
        picks = chosen[index::len(sizes)]
        assert (picks[:, k:] == 7).all() and (np.diff(picks[:, :k], axis=1) > 0).all() and picks[:, :k].max() < n
        subsets = list(itertools.combinations(range(n), k))
        counts = collections.Counter(map(tuple, picks[:, :k].tolist()))
        assert set(counts) <= set(subsets)
        expected = rows / len(subsets)
        chi2 = sum((counts[subset] - expected) ** 2 / expected for subset in subsets)
        assert chi2 <= max(1.0, 3 * len(subsets)), (n, k, chi2)  # df = subsets - 1; a bias of a few % fails


def test_sentence_pairs_come_from_the_text(shard, corpus):
    streams = token_streams(corpus[1])
    ids, _ = restore_originals(shard)
    labels = shard["next_sentence_labels"]
    assert 0.45 < labels.mean() < 0.6
    checked = {0: 0, 1: 0}
    for row in range(0, len(ids), 5):
        length = shard["input_mask"][row].sum()
        boundary = np.argmax(shard["segment_ids"][row])
        a, b = ids[row, 1:boundary - 1].tolist(), ids[row, boundary:length - 1].tolist()
        a_at, b_at = find_tokens(streams, a), find_tokens(streams, b)
        assert a_at and b_at
        if min(len(a), len(b)) >= 8:  # long enough to be unique in the corpus
            assert follows(a_at, b_at, len(a)) == (labels[row] == 0)
            assert (a_at.keys() == b_at.keys()) == (labels[row] == 0)
            checked[int(labels[row])] += 1
    assert min(checked.values()) >= 20


def test_same_seed_same_arrays_other_shard_other_masks(corpus, shard, tmp_path):
    run_script("--input_file", corpus[0], "--output_file", tmp_path / "shard_a.hdf5", "--dupe_factor", 3)
    again = read_shard(tmp_path / "shard_a.hdf5")
    for key in SHARD_KEYS:
        np.testing.assert_array_equal(again[key], shard[key])
    run_script("--input_file", corpus[0], "--output_file", tmp_path / "shard_b.hdf5", "--dupe_factor", 3)
    other = read_shard(tmp_path / "shard_b.hdf5")
    assert not np.array_equal(other["masked_lm_positions"][:50], shard["masked_lm_positions"][:50])


def test_directory_input_gives_one_shard_per_file_and_rerun_skips(corpus, tmp_path):
    text_dir = tmp_path / "text"
    text_dir.mkdir()
    documents = corpus[1]
    write_corpus(text_dir / "c_training_0.txt", documents[:2])
    write_corpus(text_dir / "c_training_1.txt", documents[2:])
    out = tmp_path / "hdf5"
    run_script("--input_file", text_dir, "--output_file", out, "--dupe_factor", 1, "--n_processes", 2)
    assert sorted(p.name for p in out.iterdir()) == ["c_training_0.hdf5", "c_training_1.hdf5"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    result = run_script("--input_file", text_dir, "--output_file", out, "--dupe_factor", 1)
    assert "skipping 2 existing shard(s)" in result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_sigkill_while_writing_then_rerun_equals_uninterrupted_run(tmp_path):
    documents = book_documents(sorted(p.name for p in BOOKS.glob("*.txt.gz")))
    write_corpus(tmp_path / "big.txt", documents)
    args = ["--input_file", tmp_path / "big.txt", "--dupe_factor", 5, "--block_chars", 20000]
    killed_dir, clean_dir = tmp_path / "killed", tmp_path / "clean"
    killed_dir.mkdir()
    process = subprocess.Popen([sys.executable, str(SCRIPT), "--vocab_file", str(VOCAB), *map(str, args),
                                "--output_file", str(killed_dir / "s.hdf5")], stderr=subprocess.DEVNULL,
                               env=helpers.checkout_env())
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size > 100_000 for p in killed_dir.glob(".s.hdf5.tmp.*")):
        assert process.poll() is None and time.monotonic() < deadline, "writer finished before it was killed"
        time.sleep(0.005)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert not (killed_dir / "s.hdf5").exists()
    run_script(*args, "--output_file", killed_dir / "s.hdf5")
    run_script(*args, "--output_file", clean_dir / "s.hdf5")
    assert [p.name for p in killed_dir.iterdir()] == ["s.hdf5"]  # the stale temporary file is gone
    rerun, clean = read_shard(killed_dir / "s.hdf5"), read_shard(clean_dir / "s.hdf5")
    for key in SHARD_KEYS:
        np.testing.assert_array_equal(rerun[key], clean[key])


@pytest.mark.parametrize("name, content, vocab, message", [
    ("missing vocab", b"Some text.\n", "missing", "vocab file not found"),
    ("empty input", b"\n\n  \n", None, "no text (empty input)"),
    ("binary input", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", None, "binary data (NUL bytes)"),
    ("non-UTF-8 input", "Café au lait.\n".encode("latin-1"), None, "not UTF-8 text"),
    ("unwritable output", b"Some text.\n", None, "error:"),
    ("missing input", None, None, "input not found"),
])
def test_bad_input_one_error_line_nonzero_exit_no_shard(tmp_path, name, content, vocab, message):
    source = tmp_path / "in.txt"
    if content is not None:
        source.write_bytes(content)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "s.hdf5"
    if name == "unwritable output":
        (out_dir / "file").write_text("")
        output = out_dir / "file" / "s.hdf5"  # a path below a regular file
    command = [sys.executable, str(SCRIPT), "--input_file", str(source), "--output_file", str(output),
               "--vocab_file", str(tmp_path / "missing.txt" if vocab else VOCAB)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=helpers.checkout_env())
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("create_pretraining_data.py: error:") and message in lines[0]
    assert not [p for p in out_dir.rglob("*") if p.name != "file"]


def test_no_lower_case_keeps_case(tmp_path):
    text = "Hello World.\nAnother Line Here.\n\nSecond Document.\nMore Text.\n"
    (tmp_path / "in.txt").write_text(text)
    seen = {}
    for flag in ("--do_lower_case", "--no_lower_case"):
        run_script("--input_file", tmp_path / "in.txt", "--output_file", tmp_path / f"{flag}.hdf5", flag,
                   "--dupe_factor", 1, "--max_seq_length", 16, "--max_predictions_per_seq", 2)
        ids, _ = restore_originals(read_shard(tmp_path / f"{flag}.hdf5"))
        seen[flag] = set(ids.ravel().tolist()) - {0, 101, 102}
    lower, cased = (set(legacy_tokenizer(lower).convert_tokens_to_ids(legacy_tokenizer(lower).tokenize(text)))
                    for lower in (True, False))
    assert seen["--do_lower_case"] <= lower and seen["--no_lower_case"] <= cased
    assert 100 in seen["--no_lower_case"] and 100 not in seen["--do_lower_case"]  # capitals: [UNK] in this vocab


def test_flags_are_validated():
    result = run_script("--input_file", "x", "--output_file", "y.hdf5", "--max_predictions_per_seq", 200, check=False)
    assert result.returncode == 2 and re.search(r"max_predictions_per_seq", result.stderr)


def test_documents_are_read_across_chunk_boundaries(monkeypatch, tmp_path):
    from data import create_pretraining_data

    text = "First line.\r\n  second line  \n\n\n \t \nDoc two.\n\nDoc three, no final newline"
    (tmp_path / "in.txt").write_bytes(text.encode("utf-8"))
    expected = [[line.strip() for line in doc.strip().splitlines()]
                for doc in re.split(r"\n\s*\n", text.replace("\r", ""))]
    for read_chars in (1, 3, 7, 1 << 22):
        monkeypatch.setattr(create_pretraining_data, "READ_CHARS", read_chars)
        blocks = list(create_pretraining_data.read_document_blocks(tmp_path / "in.txt", block_chars=15))
        assert [doc for block in blocks for doc in block] == expected


@pytest.mark.parametrize("sizes, block_chars, expected_blocks", [
    ([30, 5, 5, 40, 5], 20, [2, 3]),  # a one-document tail joins the previous block
    ([30, 5, 5, 40, 5, 5], 20, [2, 2, 2]),
    ([100], 20, [1]),  # a single document cannot be helped
    ([5, 5, 5], 1000, [3]),
])
def test_blocks_hold_at_least_two_documents(tmp_path, sizes, block_chars, expected_blocks):
    from data.create_pretraining_data import read_document_blocks

    documents = [[f"d{i} " + "x" * (size - 3)] for i, size in enumerate(sizes)]
    write_corpus(tmp_path / "in.txt", documents)
    blocks = list(read_document_blocks(tmp_path / "in.txt", block_chars))
    assert [len(block) for block in blocks] == expected_blocks
    assert [doc for block in blocks for doc in block] == documents


def test_a_long_document_is_cut_and_an_endless_line_refused(monkeypatch, tmp_path):
    """Memory stays bounded whatever the input: a document is cut between lines once it reaches
    block_chars, and a line longer than MAX_LINE_CHARS is one clear error."""
    from common.errors import InputError
    from data import create_pretraining_data

    lines = [f"line {i} " + "x" * 20 for i in range(40)]  # 40 lines of 27 or 28 characters, one document
    write_corpus(tmp_path / "in.txt", [lines])
    for read_chars in (5, 1 << 22):
        monkeypatch.setattr(create_pretraining_data, "READ_CHARS", read_chars)
        documents = list(create_pretraining_data.read_documents(tmp_path / "in.txt", 100))
        assert [line for document in documents for line in document] == lines
        assert [len(document) for document in documents] == [4] * 10  # cut as soon as 100 characters are reached
    monkeypatch.setattr(create_pretraining_data, "MAX_LINE_CHARS", 50)
    (tmp_path / "long.txt").write_text("short line\n" + "y" * 60 + " no end", encoding="utf-8")
    monkeypatch.setattr(create_pretraining_data, "READ_CHARS", 16)
    with pytest.raises(InputError, match="a line of more than 50 characters"):
        list(create_pretraining_data.read_documents(tmp_path / "long.txt", 1000))
    # A long line that ends inside one read (the review's 6,000,000-character line in a 4 M read was accepted).
    (tmp_path / "complete.txt").write_text("short line\n" + "z" * 60 + "\nanother short line\n", encoding="utf-8")
    for read_chars in (16, 1 << 22):
        monkeypatch.setattr(create_pretraining_data, "READ_CHARS", read_chars)
        with pytest.raises(InputError, match="a line of more than 50 characters"):
            list(create_pretraining_data.read_documents(tmp_path / "complete.txt", 1000))
    (tmp_path / "fits.txt").write_text("x" * 50 + "\n", encoding="utf-8")
    assert list(create_pretraining_data.read_documents(tmp_path / "fits.txt", 1000)) == [["x" * 50]]


def test_small_blocks_still_give_half_random_next(corpus, tmp_path):
    run_script("--input_file", corpus[0], "--output_file", tmp_path / "s.hdf5", "--block_chars", 1,
               "--dupe_factor", 3)
    assert 0.4 < read_shard(tmp_path / "s.hdf5")["next_sentence_labels"].mean() < 0.65


def test_a_failing_shard_leaves_its_siblings_complete_and_no_temporary_files(corpus, tmp_path):
    text_dir, out = tmp_path / "text", tmp_path / "out"
    text_dir.mkdir()
    (text_dir / "a.txt").write_text(corpus[0].read_text())
    (text_dir / "b.txt").write_text("")
    result = run_script("--input_file", text_dir, "--output_file", out, "--n_processes", 2, "--dupe_factor", 1,
                        check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [f"create_pretraining_data.py: error: {text_dir}/b.txt: no text "
                                                  "(empty input)"]
    assert [p.name for p in out.iterdir()] == ["a.hdf5"]
    assert read_shard(out / "a.hdf5")["input_ids"].shape[0] > 100


def test_two_inputs_with_one_file_name_are_refused_before_any_shard(tmp_path):
    """a/part_training_0.txt and b/part_training_0.txt both map to OUT/part_training_0.hdf5: one shard used to
    overwrite the other while the count said 2."""
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_corpus(tmp_path / folder / "part_training_0.txt", [["One sentence.", "Another sentence."]] * 3)
    first, second = tmp_path / "a" / "part_training_0.txt", tmp_path / "b" / "part_training_0.txt"
    result = run_script("--input_file", f"{first},{second}", "--output_file", tmp_path / "out", check=False)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"create_pretraining_data.py: error: inputs {first} and {second} would both be written to "
        f"{tmp_path / 'out' / 'part_training_0.hdf5'}: give them different names"]
    assert not list((tmp_path / "out").glob("*"))


def test_output_file_naming_an_existing_directory_is_an_error(corpus, tmp_path):
    (tmp_path / "x.hdf5").mkdir()
    result = run_script("--input_file", corpus[0], "--output_file", tmp_path / "x.hdf5", check=False)
    assert result.returncode == 1
    assert "is an existing directory, not a shard file" in result.stderr
    assert list((tmp_path / "x.hdf5").iterdir()) == []
