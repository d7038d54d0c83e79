"""Turn sentence-per-line text into masked-LM / next-sentence-prediction HDF5 shards.

Input: one sentence (or paragraph) per line, a blank line between documents. Algorithm: Google's
BERT ``create_pretraining_data.py`` (documents shuffled, ``dupe_factor`` passes, sentence-pair
chunks of a target length, 50% random-next B with the unused segments put back, truncation of the
longer side at a random end, ``[CLS] A [SEP] B [SEP]``, 80/10/10 masking capped at
``max_predictions_per_seq``, instances shuffled). Output: the shard schema of data/shard_format.py.

What differs from the reference, and why:
- Memory is bounded: documents are read in blocks of about ``--block_chars`` characters (and at
  least two documents) and each block is processed on its own; a document longer than that (and
  than a million characters) is cut between lines into parts of that size, each taken as a
  document. The random-next document, the document shuffle and the instance shuffle are therefore
  drawn within a block (thousands of Wikipedia articles at the default size) instead of within the
  whole shard; otherwise the reference keeps every instance of a shard in RAM.
- Each shard gets its own seed, derived from ``--random_seed`` and the shard's file name.
- Truncation draws the number of tokens cut from the front of each side binomially, which has the
  same distribution as the reference's token-by-token coin flips; masking is vectorised over
  batches of instances with numpy (masked positions by Floyd's sampling algorithm: every subset
  equally likely, as the reference's shuffle of the candidates).
- WordPiece comes from Hugging Face ``tokenizers`` (same tokens as BERT's BasicTokenizer + WordPiece),
  looked up per distinct word (data/wordpiece_encoder.py).

A directory (or comma-separated list) of inputs with ``--output_file`` naming a directory gives
one ``<stem>.hdf5`` per input, made in parallel by ``--n_processes`` workers; an ``--output_file``
ending in .hdf5/.h5 gets every input in one shard. Existing outputs are skipped (``--overwrite``).

S3 (common/storage.py): an ``--input_file`` of s3://bucket/prefix (its *.txt objects) or s3://bucket/x.txt is
downloaded first, verified, into a temporary directory; an ``--output_file`` of s3://bucket/prefix gets
one shard per input, each uploaded as soon as it is written and then removed locally (shards already
under the prefix are skipped unless ``--overwrite``).
"""
import argparse
import bisect
import hashlib
import itertools
import multiprocessing
import os
import random
import sys
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TypeAlias

if __name__ == "__main__":  # run as a tool: it uses no BLAS, and OpenBLAS's thread pool costs CPU at start-up
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np
from tqdm import tqdm

from common import atomic_write, storage
from common.errors import InputError
from data.shard_format import SHARD_SUFFIXES, ShardError, ShardWriter
from data.wordpiece_encoder import cached_encoder, tokenize_documents

READ_CHARS = 1 << 22  # characters read at a time
MAX_LINE_CHARS = 1 << 22  # a longer line is an error (a line is tokenized at once: memory)
MIN_DOCUMENT_CUT_CHARS = 1 << 20  # documents are cut at --block_chars characters, but not shorter than this
MASK_BATCH_ROWS = 4096  # instances assembled and masked per numpy batch
# One shard to make: (input text files, output shard).
Job: TypeAlias = tuple[list[Path], Path]


def derive_seed(random_seed: int, shard_name: str) -> int:
    """A 64-bit seed per shard, so that shards built with the same --random_seed differ."""
    digest = hashlib.sha256(f"{random_seed}/{shard_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def read_documents(path: str | os.PathLike[str], max_document_chars: int) -> Iterator[list[str]]:
    """Yield the documents (lists of stripped non-empty lines) of a text file; a document reaching
    max_document_chars is cut there (between lines), so that memory stays bounded.

    Reads large chunks and groups lines with C-level helpers (a per-line Python loop was a tenth
    of the run time). Raises InputError for binary or non-UTF-8 input or a line of more than
    MAX_LINE_CHARS characters.
    """
    with open(path, "rb") as f:
        if b"\0" in f.read(1 << 16):
            raise InputError(f"{path}: binary data (NUL bytes), not text")
    current: list[str] = []
    size = 0
    try:
        with open(path, encoding="utf-8", errors="strict") as f:
            tail = ""
            while True:
                chunk = f.read(READ_CHARS)
                if "\0" in chunk:
                    raise InputError(f"{path}: binary data (NUL bytes), not text")
                lines = (tail + chunk).split("\n")
                tail = lines.pop() if chunk else ""  # the last piece may be an incomplete line
                if len(tail) > MAX_LINE_CHARS or max(map(len, lines), default=0) > MAX_LINE_CHARS:
                    raise InputError(f"{path}: a line of more than {MAX_LINE_CHARS} characters; expected "
                                     "one sentence or paragraph per line")
                for has_text, group in itertools.groupby((line.strip() for line in lines), key=bool):
                    if has_text:
                        texts = list(group)
                        current.extend(texts)
                        size += sum(map(len, texts))
                        while size >= max_document_chars:  # cut where the document reaches the limit
                            totals = itertools.accumulate(map(len, current))
                            cut = next(i for i, total in enumerate(totals, 1) if total >= max_document_chars)
                            yield current[:cut]
                            current = current[cut:]
                            size = sum(map(len, current))
                    elif current:  # a blank line ends the current document
                        yield current
                        current, size = [], 0
                if not chunk:
                    break
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason})") from err
    if current:
        yield current


def read_document_blocks(path: str | os.PathLike[str], block_chars: int) -> Iterator[list[list[str]]]:
    """Yield lists of documents of about block_chars characters, each with at least two documents
    when the file has two (random-next sentences must come from another document of the block).

    Raises InputError for binary, non-UTF-8 or text-free input.
    """
    held: list[list[str]] | None = None
    documents: list[list[str]] = []
    size = 0
    for document in read_documents(path, max(block_chars, MIN_DOCUMENT_CUT_CHARS)):
        documents.append(document)
        size += sum(map(len, document))
        if size >= block_chars and len(documents) >= 2:
            if held is not None:
                yield held
            held, documents, size = documents, [], 0
    if held is not None and len(documents) < 2:  # a one-document tail joins the previous block
        held, documents = held + documents, []
    for block in (held, documents):
        if block:
            yield block
    if held is None and not documents:
        raise InputError(f"{path}: no text (empty input)")


def document_instances(doc_index: int, boundaries: list[list[int]], max_num_tokens: int, short_seq_prob: float,
                       rng: random.Random, out: list[tuple[int, int, int, int, int]]) -> None:
    """Append (a_start, a_len, b_start, b_len, is_random_next) for one document to ``out``.

    Google's create_instances_from_document on segment boundaries (flat token offsets) instead
    of token lists: segments are contiguous in the block's token array, so A and B are ranges,
    and the segment where a chunk (or B) reaches its target length is found by bisection.
    """
    uniform = rng.random

    def uniform_int(low: int, high: int) -> int:  # rng.randint(low, high), at a fraction of its cost
        return low + int(uniform() * (high - low + 1))

    bounds = boundaries[doc_index]
    num_segments = len(bounds) - 1
    target = uniform_int(2, max_num_tokens) if uniform() < short_seq_prob else max_num_tokens
    chunk_start = 0
    while chunk_start < num_segments:
        # first segment end at which the chunk reaches the target length, or the document's end
        i = bisect.bisect_left(bounds, bounds[chunk_start] + target, chunk_start + 1, num_segments)
        chunk_segments = i - chunk_start
        a_end = chunk_start + (uniform_int(1, chunk_segments - 1) if chunk_segments >= 2 else 1)
        a_start, a_len = bounds[chunk_start], bounds[a_end] - bounds[chunk_start]
        if chunk_segments == 1 or uniform() < 0.5:
            random_index = doc_index
            for _ in range(10):
                random_index = uniform_int(0, len(boundaries) - 1)
                if random_index != doc_index:
                    break
            other = boundaries[random_index]
            first = uniform_int(0, len(other) - 2)
            last = bisect.bisect_left(other, other[first] + target - a_len, first + 1, len(other) - 1)
            out.append((a_start, a_len, other[first], other[last] - other[first], int(random_index != doc_index)))
            i = a_end  # put the unused segments back
        else:
            out.append((a_start, a_len, bounds[a_end], bounds[i] - bounds[a_end], 0))
        chunk_start = i


def truncate_pairs(specs: np.ndarray, max_num_tokens: int, np_rng: np.random.Generator) -> None:
    """Cut A and B to at most max_num_tokens together, in place on the int64 spec array.

    The reference removes one token at a time from the longer side (B on ties), from the front
    or back with probability 1/2. Which side loses how many tokens is deterministic, so this
    computes the counts in closed form and draws the front/back split binomially.
    """
    a_len, b_len = specs[:, 1], specs[:, 3]
    excess = np.maximum(a_len + b_len - max_num_tokens, 0)
    # While A > B only A is cut, until A == B; then the cuts alternate B, A, B, ...
    # While B >= A only B is cut, until B == A - 1; then they alternate A, B, A, ...
    a_longer = a_len > b_len
    first_a = np.where(a_longer, np.minimum(excess, a_len - b_len), 0)
    first_b = np.where(a_longer, 0, np.minimum(excess, b_len - a_len + 1))
    rest = excess - first_a - first_b
    cut_a = first_a + np.where(a_longer, rest // 2, (rest + 1) // 2)
    cut_b = first_b + np.where(a_longer, (rest + 1) // 2, rest // 2)
    front_a = np_rng.binomial(cut_a, 0.5)
    front_b = np_rng.binomial(cut_b, 0.5)
    specs[:, 0] += front_a
    specs[:, 1] -= cut_a
    specs[:, 2] += front_b
    specs[:, 3] -= cut_b


def assemble_batch(flat: np.ndarray, specs: np.ndarray, seq_len: int,
                   special: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Token matrix [CLS] A [SEP] B [SEP] + padding, segment ids, input mask, and sequence lengths.

    The real tokens of all rows are gathered in one pass (A with one neighbour on each side, B with
    the token after it, then [CLS]/[SEP] written over the neighbours) and scattered into the matrix.
    """
    a_start, a_len, b_start, b_len = (specs[:, k].astype(np.int32) for k in range(4))  # int32: less memory traffic
    seq_length = a_len + b_len + 3
    starts = np.stack([a_start - 1, b_start], axis=1).ravel()
    lengths = np.stack([a_len + 2, b_len + 1], axis=1).ravel()
    ends = np.cumsum(lengths, dtype=np.int32)
    # mode="clip": the neighbours of a range at either end of the block are clipped inside it
    tokens = flat.take(np.repeat(starts - (ends - lengths), lengths) + np.arange(ends[-1], dtype=np.int32),
                       mode="clip")
    column = np.arange(seq_len)[None, :]
    real = column < seq_length[:, None]
    input_ids = np.zeros((len(specs), seq_len), dtype=np.int32)
    input_ids[real] = tokens
    rows = np.arange(len(specs))
    input_ids[:, 0] = special["[CLS]"]
    input_ids[rows, a_len + 1] = special["[SEP]"]
    input_ids[rows, seq_length - 1] = special["[SEP]"]
    segment_ids = (real & (column >= (a_len + 2)[:, None])).view(np.int8)
    return input_ids, segment_ids, real.view(np.int8), seq_length


def choose_candidates(num_candidates: np.ndarray, num_to_predict: np.ndarray,
                      np_rng: np.random.Generator) -> np.ndarray:
    """Per row a uniformly random set of num_to_predict of the candidate indices 0..num_candidates-1:
    Floyd's algorithm, one step for all rows at a time. Returns (rows, max count) sorted indices,
    unused slots (rows choosing fewer) last and equal to num_candidates.max()."""
    rows, most = len(num_candidates), int(num_to_predict.max())
    width = int(num_candidates.max()) + 1
    # rows in the order they join: a row choosing k candidates takes part in the last k steps
    order = np.argsort(-num_to_predict, kind="stable")
    joined = np.searchsorted(-num_to_predict[order], -(most - np.arange(most)), side="right")
    last_candidate = num_candidates[order] - most - 1  # j of step 0
    taken = np.zeros(rows * width, dtype=bool)
    row_base = np.arange(rows) * width
    chosen = np.full((most, rows), width - 1)
    uniform = np_rng.random((most, rows))
    for step in range(most):
        # Floyd: for j = n - k .. n - 1, draw t in [0, j]; take t, or j if t is already taken
        active = int(joined[step])
        j = last_candidate[:active] + step + 1
        t = (uniform[step, :active] * (j + 1)).astype(np.int64)
        pick = np.where(taken[row_base[:active] + t], j, t)
        taken[row_base[:active] + pick] = True
        chosen[step, :active] = pick
    result = np.empty((rows, most), dtype=np.int64)
    result[order] = chosen.T
    return np.sort(result, axis=1)


def mask_batch(input_ids: np.ndarray, a_len: np.ndarray, seq_length: np.ndarray, settings: argparse.Namespace,
               vocab_size: int, special: dict[str, int], np_rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Google's masking, vectorised: returns (masked_lm_positions, masked_lm_ids); edits input_ids.

    Candidates are all real tokens but [CLS] and the two [SEP]s. A row masks
    min(max_pred, max(1, round(len * masked_lm_prob))) of them, chosen uniformly; each becomes
    [MASK] (80%), stays (10%) or a token drawn from the whole vocab (10%).
    """
    rows = len(input_ids)
    max_pred = settings.max_predictions_per_seq
    num_candidates = seq_length - 3
    num_to_predict = np.minimum(max_pred, np.maximum(1, np.round(seq_length * settings.masked_lm_prob)))
    num_to_predict = np.minimum(num_to_predict, num_candidates).astype(np.int64)
    chosen = choose_candidates(num_candidates, num_to_predict, np_rng)
    used = np.arange(chosen.shape[1])[None, :] < num_to_predict[:, None]
    positions = np.zeros((rows, max_pred), dtype=np.int64)
    # candidate c is column c + 1 in A, c + 2 in B (after the first [SEP])
    positions[:, :chosen.shape[1]] = np.where(used, chosen + 1 + (chosen >= a_len[:, None]), 0)
    used = np.pad(used, ((0, 0), (0, max_pred - used.shape[1])))
    row_index = np.broadcast_to(np.arange(rows)[:, None], positions.shape)
    labels = np.where(used, input_ids[row_index, positions], 0).astype(np.int32)
    choice = np_rng.random((rows, max_pred))  # [MASK] below 0.8, kept from 0.8 to 0.9, random above
    replacement = np.where(choice < 0.8, special["[MASK]"], labels)
    random_token = used & (choice >= 0.9)
    replacement[random_token] = np_rng.integers(0, vocab_size, int(random_token.sum()))
    input_ids[row_index[used], positions[used]] = replacement[used]
    return positions.astype(np.int32), labels


def block_instance_specs(boundaries: list[list[int]], settings: argparse.Namespace, rng: random.Random,
                         np_rng: np.random.Generator) -> np.ndarray:
    """Instance specs of one block: documents shuffled, dupe_factor passes, instances shuffled."""
    max_num_tokens = settings.max_seq_length - 3
    rng.shuffle(boundaries)
    specs: list[tuple[int, int, int, int, int]] = []
    for _ in range(settings.dupe_factor):
        for doc_index in range(len(boundaries)):
            document_instances(doc_index, boundaries, max_num_tokens, settings.short_seq_prob, rng, specs)
    return np_rng.permutation(np.array(specs, dtype=np.int64).reshape(-1, 5))


def write_block(writer: ShardWriter, flat: np.ndarray, specs: np.ndarray, settings: argparse.Namespace, vocab_size: int,
                special: dict[str, int], np_rng: np.random.Generator) -> None:
    """Truncate, assemble, mask and append a block's instances in batches."""
    truncate_pairs(specs, settings.max_seq_length - 3, np_rng)
    for start in range(0, len(specs), MASK_BATCH_ROWS):
        batch = specs[start:start + MASK_BATCH_ROWS]
        input_ids, segment_ids, input_mask, seq_length = assemble_batch(flat, batch, settings.max_seq_length, special)
        positions, labels = mask_batch(input_ids, batch[:, 1], seq_length, settings, vocab_size, special, np_rng)
        writer.append({"input_ids": input_ids, "input_mask": input_mask, "segment_ids": segment_ids,
                       "masked_lm_positions": positions, "masked_lm_ids": labels,
                       "next_sentence_labels": batch[:, 4].astype(np.int8)})


def create_shard(input_paths: Sequence[str | os.PathLike[str]], output_path: str | os.PathLike[str],
                 settings: argparse.Namespace, show_progress: bool = False) -> int:
    """Build one shard from input text files; returns the number of instances written."""
    encoder = cached_encoder(settings.vocab_file, settings.do_lower_case)
    seed = derive_seed(settings.random_seed, Path(output_path).stem)
    rng, np_rng = random.Random(seed), np.random.default_rng(seed)
    total_chars = sum(os.path.getsize(path) for path in input_paths)
    with ShardWriter(output_path, settings.max_seq_length, settings.max_predictions_per_seq) as writer, \
            tqdm(total=total_chars, unit="B", unit_scale=True, desc=Path(output_path).name,
                 disable=None if show_progress else True, mininterval=1.0) as progress:
        for path in input_paths:
            for documents in read_document_blocks(path, settings.block_chars):
                flat, boundaries = tokenize_documents(encoder, documents)
                if boundaries:
                    specs = block_instance_specs(boundaries, settings, rng, np_rng)
                    write_block(writer, flat, specs, settings, encoder.vocab_size, encoder.special, np_rng)
                progress.update(sum(len(line) + 1 for document in documents for line in document))
        if writer.num_samples == 0:
            raise InputError(f"{', '.join(map(str, input_paths))}: no tokens after WordPiece")
    return writer.num_samples


def str_to_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input_file", required=True,
                        help="text file, directory of *.txt files, or comma-separated list of files")
    parser.add_argument("--output_file", required=True,
                        help="shard path (.hdf5/.h5: all inputs in one shard) or directory (one shard per input, "
                        "named after it: INPUT_STEM.hdf5, so two inputs may not share a file name)")
    parser.add_argument("--vocab_file", required=True, help="BERT vocab.txt")
    parser.add_argument("--do_lower_case", type=str_to_bool, nargs="?", const=True, default=True,
                        help="lower-case and strip accents (default; for an uncased vocab)")
    parser.add_argument("--no_lower_case", dest="do_lower_case", action="store_false",
                        help="keep case and accents (for a cased vocab)")
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--max_predictions_per_seq", type=int, default=20)
    parser.add_argument("--masked_lm_prob", type=float, default=0.15)
    parser.add_argument("--random_seed", type=int, default=12345)
    parser.add_argument("--dupe_factor", type=int, default=10)
    parser.add_argument("--short_seq_prob", type=float, default=0.1)
    parser.add_argument("--n_processes", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--block_chars", type=int, default=16_000_000,
                        help="characters of text processed at a time (bounds memory; random-next "
                             "documents and the shuffles are drawn within such a block; a longer document, "
                             "and longer than 1 M characters, is cut)")
    parser.add_argument("--overwrite", action="store_true", help="rebuild shards that already exist")
    parser.add_argument("--s3_endpoint_url", default=None, help="S3-compatible endpoint for s3:// inputs or "
                        "outputs (default: AWS_ENDPOINT_URL, else AWS)")
    parser.add_argument("--bert_model", help=argparse.SUPPRESS)  # accepted and unused, as in the reference
    settings = parser.parse_args(argv)
    if not 0 < settings.max_predictions_per_seq < settings.max_seq_length - 2:
        parser.error("need 0 < --max_predictions_per_seq < --max_seq_length - 2")
    if settings.max_seq_length < 5 or settings.dupe_factor < 1 or settings.n_processes < 1:
        parser.error("need --max_seq_length >= 5, --dupe_factor >= 1 and --n_processes >= 1")
    if not (0 < settings.masked_lm_prob <= 1 and 0 <= settings.short_seq_prob <= 1):
        parser.error("--masked_lm_prob must be in (0, 1] and --short_seq_prob in [0, 1]")
    return settings


def list_inputs(spec: str) -> list[Path]:
    """Input text files of --input_file (a file, a directory of *.txt, or a comma-separated list)."""
    paths = []
    for item in spec.split(","):
        path = Path(item)
        if path.is_dir():
            found = sorted(path.glob("*.txt"))
            if not found:
                raise InputError(f"{path}: directory has no *.txt files")
            paths.extend(found)
        elif path.is_file():
            paths.append(path)
        else:
            raise InputError(f"input not found: {path}")
    return paths


def plan_jobs(settings: argparse.Namespace) -> list[Job]:
    """[(input paths, output path)]: one shard for all inputs, or one per input in a directory."""
    inputs = list_inputs(settings.input_file)
    output = Path(settings.output_file)
    if output.suffix in SHARD_SUFFIXES:
        if output.is_dir():
            raise InputError(f"--output_file {output} is an existing directory, not a shard file")
        jobs = [(inputs, output)]
    else:
        if output.exists() and not output.is_dir():
            raise InputError(f"--output_file {output} is an existing file, not a directory")
        jobs = [([path], output / f"{path.stem}.hdf5") for path in inputs]
        first_input: dict[Path, Path] = {}
        for (path,), shard in jobs:  # two inputs named alike would write, and count, one shard
            if first_input.setdefault(shard, path) != path:
                raise InputError(f"inputs {first_input[shard]} and {path} would both be written to {shard}: "
                                 "give them different names")
    for _, path in jobs:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK):
            raise InputError(f"output directory not writable: {path.parent}")
    return jobs


def remove_stale_temporaries(jobs: Iterable[tuple[object, Path]]) -> None:
    """Delete temporary files of these outputs left by a killed or failed run."""
    for _, path in jobs:
        atomic_write.remove_stale_temporaries(path)


def _run_job(job_and_settings: tuple[Job, argparse.Namespace, bool]) -> tuple[Path, int, str | None]:
    """(output, instances, error message or None): a bad shard must not kill its siblings mid-write."""
    (inputs, output), settings, show_progress = job_and_settings
    try:
        return output, create_shard(inputs, output, settings, show_progress), None
    except (InputError, OSError, ShardError) as err:
        return output, 0, str(err)


def run(settings: argparse.Namespace, existing: Collection[str] = (),
        on_shard_done: Callable[[Path], None] | None = None) -> int:
    """existing: names of shards that exist elsewhere (S3) and count as done; on_shard_done(path) is
    called in this process for each shard written."""
    cached_encoder(settings.vocab_file, settings.do_lower_case)  # fail early on a bad vocab
    jobs = plan_jobs(settings)
    todo = [job for job in jobs if settings.overwrite or not (job[1].exists() or job[1].name in existing)]
    if len(todo) < len(jobs):
        print(f"skipping {len(jobs) - len(todo)} existing shard(s)", file=sys.stderr)
    workers = min(settings.n_processes, len(todo))
    if workers > 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker process
    tasks = [(job, settings, workers <= 1) for job in todo]
    total, errors = 0, []
    remove_stale_temporaries(todo)
    try:
        # disable=None: progress bars on terminals only, not in logs
        with tqdm(total=len(tasks), unit="shard", desc="shards", disable=None if len(tasks) > 1 else True) as bar:
            with multiprocessing.get_context("fork").Pool(workers) if workers > 1 else nullcontext() as pool:
                for output, count, error in (pool.imap_unordered(_run_job, tasks) if pool else map(_run_job, tasks)):
                    total += count
                    errors += [error] if error else []
                    if on_shard_done is not None and not error:
                        on_shard_done(output)
                    bar.update()
    finally:  # an interrupted pool kills its workers mid-write
        remove_stale_temporaries(todo)
    if errors:
        more = f" (and {len(errors) - 1} more failed shard(s))" if len(errors) > 1 else ""
        raise InputError(errors[0] + more)
    print(f"wrote {len(todo)} shard(s), {total} instances", file=sys.stderr)
    return total


def run_with_s3(settings: argparse.Namespace) -> int:
    """run() with s3:// inputs downloaded first and shards for an s3:// output uploaded one by one."""
    endpoint = settings.s3_endpoint_url
    with tempfile.TemporaryDirectory(prefix="bert-data-s3-") as staging:
        local = argparse.Namespace(**vars(settings))
        existing: Collection[str] = ()
        on_shard_done: Callable[[Path], None] | None = None
        if storage.is_s3_url(settings.input_file):
            local.input_file = str(download_text(settings.input_file, endpoint, Path(staging) / "text"))
        if storage.is_s3_url(settings.output_file):
            if Path(settings.output_file).suffix in SHARD_SUFFIXES:
                raise InputError("an s3:// --output_file is a prefix (one shard per input), not a shard file")
            output = storage.S3Store(settings.output_file, endpoint)
            output.check_access(write=True)
            existing = {remote.name for remote in output.list_objects()}
            local.output_file = str(Path(staging) / "shards")

            def upload(path: Path) -> None:
                output.upload(path, path.name)
                path.unlink()

            on_shard_done = upload
        return run(local, existing, on_shard_done)


def download_text(url: str, endpoint: str | None, directory: Path) -> Path:
    """The *.txt objects directly under an s3:// prefix (or the one object a .txt URL names), verified,
    in `directory`; returns what to use as --input_file."""
    directory.mkdir(parents=True)
    if url.endswith(".txt"):
        parent, _, name = url.rpartition("/")
        storage.S3Store(parent, endpoint).download(name, directory / name)
        return directory / name
    store = storage.S3Store(url, endpoint)
    names = [remote.name for remote in store.list_objects() if remote.name.endswith(".txt")]
    if not names:
        raise InputError(f"{url}: no *.txt objects under this prefix")
    for name in tqdm(names, desc="download", unit="file", disable=None):
        store.download(name, directory / name)
    return directory


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_arguments(argv)
    try:
        if storage.is_s3_url(settings.input_file) or storage.is_s3_url(settings.output_file):
            run_with_s3(settings)
        else:
            run(settings)
    except (InputError, OSError, storage.StorageError) as err:
        print(f"create_pretraining_data.py: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
