"""The dataset pipeline (data/create_datasets_from_start.sh, data/bert_prep.py, data/sharding.py,
data/verify_hdf5.py) on the committed sample corpus, offline."""
import bz2
import hashlib
import http.server
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest

import helpers
from data.sharding import ShardingError, assign_articles

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "data" / "sample"
PHASE_DIRS = {phase: f"hdf5_lower_case_1_seq_len_{s}_max_pred_{p}_masked_lm_prob_0.15_random_seed_12345_dupe_factor_2"
              for phase, (s, p) in {1: (128, 20), 2: (512, 80)}.items()}
SHARD_NAMES = [f"books_wiki_en_corpus_training_{i}" for i in range(3)] + ["books_wiki_en_corpus_test_0"]


def pipeline_env(work, **extra):
    env = dict(helpers.checkout_env(), PYTHON=sys.executable, BERT_PREP_WORKING_DIR=str(work), DUPE_FACTOR="2",
               N_TRAINING_SHARDS="3", N_TEST_SHARDS="1", N_PROCESSES="2")
    env.update(extra)
    return env


def prep(work, *args, **extra):
    return subprocess.run([sys.executable, str(REPO / "data" / "bert_prep.py"), *args], env=pipeline_env(work, **extra),
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    result = subprocess.run(["bash", str(REPO / "data" / "create_datasets_from_start.sh"), "sample"],
                            env=pipeline_env(work), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return work


def test_sample_pipeline_writes_both_phases_and_verify_accepts_them(sample_run):
    for phase, name in PHASE_DIRS.items():
        shard_dir = sample_run / name / "books_wiki_en_corpus"
        assert sorted(p.stem for p in shard_dir.glob("*.hdf5")) == sorted(SHARD_NAMES)
        assert json.loads((shard_dir / "sharding.json").read_text()) == {
            "n_training_shards": 3, "n_test_shards": 1, "fraction_test_set": 0.1}
        assert {p.name for p in shard_dir.iterdir()} == {f"{name}.hdf5" for name in SHARD_NAMES} | {"sharding.json"}
        with h5py.File(shard_dir / "books_wiki_en_corpus_training_0.hdf5", "r") as f:
            assert f["input_ids"].shape[1] == (128 if phase == 1 else 512)
        result = subprocess.run([sys.executable, str(REPO / "data" / "verify_hdf5.py"), str(shard_dir)],
                                capture_output=True, text=True, timeout=300, env=helpers.checkout_env())
        assert result.returncode == 0, result.stderr
        assert "total (4 good, 0 bad)" in result.stdout


def test_sample_text_went_through_every_stage(sample_run):
    formatted = sample_run / "formatted_one_article_per_line"
    articles = (formatted / "wikicorpus_en_one_article_per_line.txt").read_text().split("\n\n")[:-1]
    assert len(articles) == 9 and all("\n" not in a for a in articles)
    assert articles[0].startswith("Albedo")  # dump order; the redirects are gone
    assert "#REDIRECT" not in "".join(articles) and "{{" not in "".join(articles)
    books = (formatted / "bookscorpus_one_book_per_line.txt").read_text().split("\n\n")[:-1]
    assert len(books) == len(list((SAMPLE / "books").glob("*.txt.gz")))
    shard_dir = next(sample_run.glob("sharded_training_shards_3_test_shards_1_fraction_0.1")) / "books_wiki_en_corpus"
    sentences = {p.stem: [s for s in p.read_text().split("\n") if s] for p in shard_dir.iterdir()}
    total = sum(map(len, sentences.values()))
    assert 0.05 < len(sentences["books_wiki_en_corpus_test_0"]) / total < 0.15
    everything = "\n".join(line for lines in sentences.values() for line in lines)
    assert "It is a truth universally acknowledged, that a single man in possession of a good fortune, " \
           "must be in want of a wife." in everything
    assert "Albedo () or reflection coefficient" in everything


def test_rerun_skips_finished_outputs(sample_run):
    before = {p: p.stat().st_mtime_ns for p in sample_run.rglob("*") if p.is_file()}
    result = subprocess.run(["bash", str(REPO / "data" / "create_datasets_from_start.sh"), "sample"],
                            env=pipeline_env(sample_run), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert {p: p.stat().st_mtime_ns for p in sample_run.rglob("*") if p.is_file()} == before
    assert result.stderr.count("skipping") >= 6


def test_rerun_with_other_shard_counts_is_refused_instead_of_mixing_two_splits(sample_run, tmp_path):
    """3 training shards built, then a rerun with N_TRAINING_SHARDS=4: create_pretraining_data would keep
    training_0..2 of the 3-way split and add training_3 of the 4-way one (the review's case, 4 then 6)."""
    work = tmp_path / "work"
    shutil.copytree(sample_run, work)
    phase1 = work / PHASE_DIRS[1] / "books_wiki_en_corpus"
    before = {p.name: p.stat().st_mtime_ns for p in phase1.iterdir()}
    assert prep(work, "--action", "sharding", "--dataset", "books_wiki_en_corpus",
                N_TRAINING_SHARDS="4").returncode == 0
    result = prep(work, "--action", "create_hdf5_files", "--dataset", "books_wiki_en_corpus", "--phase", "1",
                  N_TRAINING_SHARDS="4")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"bert_prep.py --action create_hdf5_files: error: {phase1} holds shards made with other sharding settings: "
        f"N_TRAINING_SHARDS 3 (this run: 4); run with the recorded settings, or remove {phase1} to start over"]
    assert {p.name: p.stat().st_mtime_ns for p in phase1.iterdir()} == before
    # Shards from before the settings were recorded: unknown, so refused unless nothing would be added.
    (phase1 / "sharding.json").unlink()
    result = prep(work, "--action", "create_hdf5_files", "--dataset", "books_wiki_en_corpus", "--phase", "1",
                  N_TRAINING_SHARDS="4")
    assert result.returncode == 1 and "holds shards but no sharding.json" in result.stderr
    result = prep(work, "--action", "create_hdf5_files", "--dataset", "books_wiki_en_corpus", "--phase", "1")
    assert result.returncode == 0 and "skipping 4 existing shard(s)" in result.stderr, result.stderr
    assert {p.name: p.stat().st_mtime_ns for p in phase1.iterdir()} == {
        name: mtime for name, mtime in before.items() if name != "sharding.json"}


def test_assign_articles_balances_sentences():
    counts = np.random.default_rng(0).integers(1, 200, 3000)
    shard_of = assign_articles(counts, 8, 2, 0.1)
    filled = np.bincount(shard_of, weights=counts, minlength=10)
    assert abs(filled[8:].sum() / counts.sum() - 0.1) < 0.005
    assert filled[:8].max() - filled[:8].min() < 200 and filled[8:].max() - filled[8:].min() < 200
    assert sorted(np.unique(shard_of)) == list(range(10))


def test_assign_articles_terminates_on_skewed_input():
    counts = np.array([10**6] + [1] * 50 + [0] * 3)  # one giant article, tiny ones, empty ones
    shard_of = assign_articles(counts, 4, 1, 0.1)
    assert (shard_of == shard_of[0]).sum() == 1 and len(np.unique(shard_of)) == 5
    with pytest.raises(ShardingError, match="only 3 articles for 4 shards"):
        assign_articles(np.array([3, 2, 1]), 3, 1, 0.1)


def test_step_out_of_order_gives_one_error_line(tmp_path):
    result = prep(tmp_path, "--action", "sharding", "--dataset", "wikicorpus_en")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"bert_prep.py --action sharding: error: no formatted text {tmp_path}/formatted_one_article_per_line/"
        "wikicorpus_en_one_article_per_line.txt; run --action text_formatting first"]


def test_books_need_a_folder(tmp_path):
    result = prep(tmp_path, "--action", "download", "--dataset", "bookscorpus", BOOKS_DIR="")
    assert result.returncode == 1 and "BookCorpus is no longer distributed" in result.stderr


def test_truncated_dump_gives_one_error_line_and_no_output(tmp_path):
    dump = tmp_path / "download" / "wikicorpus_en" / "wikicorpus_en.xml.bz2"
    dump.parent.mkdir(parents=True)
    dump.write_bytes((SAMPLE / "enwiki_sample.xml.bz2").read_bytes()[:60000])
    result = prep(tmp_path, "--action", "text_formatting", "--dataset", "wikicorpus_en")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "WikiExtractor failed" in lines[0] and "EOFError" in lines[0]
    assert not (tmp_path / "extracted").exists() or not any((tmp_path / "extracted").iterdir())
    assert not (tmp_path / "formatted_one_article_per_line" / "wikicorpus_en_one_article_per_line.txt").exists()


class RangeHandler(http.server.BaseHTTPRequestHandler):
    """Serves ``files`` (name -> bytes) with HTTP Range support; records the Range headers seen."""
    files, ranges = {}, []

    def do_GET(self):
        body = self.files.get(self.path.lstrip("/"))
        if body is None:
            self.send_error(404)
            return
        start = 0
        if self.headers.get("Range"):
            self.ranges.append(self.headers["Range"])
            start = int(self.headers["Range"].split("=")[1].rstrip("-"))
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        self.wfile.write(body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture()
def dump_server():
    dump = (SAMPLE / "enwiki_sample.xml.bz2").read_bytes()
    RangeHandler.files = {"enwiki-latest-pages-articles.xml.bz2": dump}
    RangeHandler.ranges = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), RangeHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/enwiki-latest-pages-articles.xml.bz2", dump
    server.shutdown()


def test_download_resumes_and_verifies_the_published_sha1(tmp_path, dump_server):
    url, dump = dump_server
    RangeHandler.files["enwiki-latest-sha1sums.txt"] = (  # as on the mirror: dated names in "latest"
        f"{'1' * 40}  enwiki-20260101-pages-articles-multistream.xml.bz2\n"
        f"{hashlib.sha1(dump).hexdigest()}  enwiki-20260101-pages-articles.xml.bz2\n").encode()
    dest = tmp_path / "download" / "wikicorpus_en" / "wikicorpus_en.xml.bz2"
    dest.parent.mkdir(parents=True)
    Path(f"{dest}.part").write_bytes(dump[:5000])  # an interrupted earlier download
    result = prep(tmp_path, "--action", "download", "--dataset", "wikicorpus_en", WIKI_DUMP_URL=url)
    assert result.returncode == 0, result.stderr
    assert RangeHandler.ranges == ["bytes=5000-"] and "SHA-1" not in result.stderr
    assert dest.read_bytes() == dump and bz2.decompress(dest.read_bytes()).startswith(b"<mediawiki")


def test_a_local_dump_has_no_mirror_line_and_a_mirror_without_sums_still_warns(tmp_path, dump_server):
    local = prep(tmp_path / "local", "--action", "download", "--dataset", "wikicorpus_en",
                 WIKI_DUMP_URL=str(SAMPLE / "enwiki_sample.xml.bz2"))
    assert local.returncode == 0, local.stderr
    assert "SHA-1" not in local.stderr and "mirror" not in local.stderr
    url, _ = dump_server  # this server publishes no sha1sums file
    remote = prep(tmp_path / "remote", "--action", "download", "--dataset", "wikicorpus_en", WIKI_DUMP_URL=url)
    assert remote.returncode == 0 and "the mirror publishes no SHA-1" in remote.stderr
    wrong = prep(tmp_path / "wrong", "--action", "download", "--dataset", "wikicorpus_en",
                 WIKI_DUMP_URL=str(SAMPLE / "enwiki_sample.xml.bz2"), WIKI_DUMP_SHA1="0" * 40)
    assert wrong.returncode == 1 and "SHA-1 mismatch" in wrong.stderr


def test_download_with_wrong_checksum_fails(tmp_path, dump_server):
    url, _ = dump_server
    result = prep(tmp_path, "--action", "download", "--dataset", "wikicorpus_en", WIKI_DUMP_URL=url,
                  WIKI_DUMP_SHA1="0" * 40)
    assert result.returncode == 1 and "SHA-1 mismatch" in result.stderr
    assert not (tmp_path / "download" / "wikicorpus_en" / "wikicorpus_en.xml.bz2").exists()


CORRUPTIONS = {  # problem -> (dataset, index, new value)
    "no masked position": [("masked_lm_positions", 0, 0), ("masked_lm_ids", 0, 0)],
    "first token is not [CLS]": [("input_ids", (1, 0), 5)],
    "input_ids outside the vocabulary": [("input_ids", (2, 3), 40000)],
    "segment ids are not 0s then 1s": "padding_segment",
    "masked [SEP] position": "masked_sep",
}


def corrupt(f, problem):
    if problem == "masked [SEP] position":  # move the last masked slot onto the final [SEP]
        used = int((f["masked_lm_positions"][4] != 0).sum())
        positions = f["masked_lm_positions"][4]
        positions[used - 1] = max(int(f["input_mask"][4].sum()) - 1, positions[used - 2] + 1)
        f["masked_lm_positions"][4] = positions
        return
    if problem == "segment ids are not 0s then 1s":  # segment 1 on a padding position
        row = int(np.argmin(f["input_mask"][:].sum(axis=1)))
        f["segment_ids"][row, int(f["input_mask"][row].sum())] = 1
        return
    for key, index, value in CORRUPTIONS[problem]:
        f[key][index] = value


@pytest.mark.parametrize("problem", sorted(CORRUPTIONS))
def test_verify_reports_a_bad_shard(sample_run, tmp_path, problem):
    source = sample_run / PHASE_DIRS[1] / "books_wiki_en_corpus"
    shutil.copytree(source, tmp_path / "copy")
    with h5py.File(tmp_path / "copy" / "books_wiki_en_corpus_training_1.hdf5", "r+") as f:
        corrupt(f, problem)
    result = subprocess.run([sys.executable, str(REPO / "data" / "verify_hdf5.py"), str(tmp_path / "copy")],
                            capture_output=True, text=True, timeout=300, env=helpers.checkout_env())
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"BAD {tmp_path}/copy/books_wiki_en_corpus_training_1.hdf5: {problem} (in rows 0..{rows - 1})"
        for rows in [len(h5py.File(tmp_path / "copy" / "books_wiki_en_corpus_training_1.hdf5", "r")["input_ids"])]]
    assert "total (3 good, 1 bad)" in result.stdout


def test_download_refuses_a_dump_that_differs_from_the_published_sha1(tmp_path, dump_server):
    url, _ = dump_server
    RangeHandler.files["enwiki-latest-sha1sums.txt"] = f"{'2' * 40}  enwiki-20260101-pages-articles.xml.bz2\n".encode()
    result = prep(tmp_path, "--action", "download", "--dataset", "wikicorpus_en", WIKI_DUMP_URL=url)
    assert result.returncode == 1 and f"SHA-1 mismatch (expected {'2' * 40})" in result.stderr


def test_verify_reports_a_corrupt_compressed_chunk_and_checks_the_other_shards(sample_run, tmp_path):
    shutil.copytree(sample_run / PHASE_DIRS[1] / "books_wiki_en_corpus", tmp_path / "copy")
    bad = tmp_path / "copy" / "books_wiki_en_corpus_test_0.hdf5"
    with h5py.File(bad, "r") as f:
        chunk = f["input_ids"].id.get_chunk_info(0)
    with open(bad, "r+b") as raw:
        raw.seek(chunk.byte_offset + chunk.size // 2)
        raw.write(bytes(range(256)) * 4)
    result = subprocess.run([sys.executable, str(REPO / "data" / "verify_hdf5.py"), str(tmp_path / "copy")],
                            capture_output=True, text=True, timeout=300, env=helpers.checkout_env())
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"BAD {bad}: cannot read rows 0..")
    assert "total (3 good, 1 bad)" in result.stdout


def shard_sentences(shard_dir, split):
    """{sentence as the uncased tokenizer sees it} and [documents] of the text shards of one split."""
    documents = [block.split("\n") for path in sorted(shard_dir.glob(f"*_{split}_*.txt"))
                 for block in path.read_text(encoding="utf-8").split("\n\n") if block.strip()]
    return {" ".join(s.lower().split()) for document in documents for s in document}, documents


def test_test_shards_share_no_document_and_no_sentence_with_the_training_shards(sample_run):
    shard_dir = next(sample_run.glob("sharded_training_shards_3_test_shards_1_fraction_0.1")) / "books_wiki_en_corpus"
    training, training_documents = shard_sentences(shard_dir, "training")
    test, test_documents = shard_sentences(shard_dir, "test")
    assert test_documents and len(test) > 100
    assert not training & test
    assert not {tuple(d) for d in training_documents} & {tuple(d) for d in test_documents}


def test_the_built_registry_corpus_shares_no_document_and_no_sentence_between_its_splits():
    """The same check on the registry corpus where it has been built (`bash data/create_datasets_from_start.sh
    registry` into data/registry_work/, or REGISTRY_WORK_DIR): the tests do not download it."""
    import os

    work = Path(os.environ.get("REGISTRY_WORK_DIR", REPO / "data" / "registry_work"))
    shard_dirs = sorted(work.glob("sharded_*/registry_en_corpus"))
    if not shard_dirs:
        pytest.skip(f"no registry corpus built in {work}")
    for shard_dir in shard_dirs:
        training, training_documents = shard_sentences(shard_dir, "training")
        test, test_documents = shard_sentences(shard_dir, "test")
        assert test_documents and not training & test
        assert not {tuple(d) for d in training_documents} & {tuple(d) for d in test_documents}


def test_registry_corpus_that_cannot_be_fetched_is_one_error_line(tmp_path):
    """No index for pip (offline): one line that names the package and its registry. Then, with a wheel in place
    and no apt-get: one line for the Debian packages."""
    result = prep(tmp_path, "--action", "download", "--dataset", "registry_en_corpus", PIP_NO_INDEX="1",
                  PIP_FIND_LINKS=str(tmp_path))
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert result.returncode == 1 and len(errors) == 1, result.stderr
    assert errors[0].startswith("bert_prep.py --action download: error: cannot fetch gensim==4.4.0 from PyPI "
                                "(pip download: ERROR: "), errors[0]
    download_dir = tmp_path / "download" / "registry_en_corpus"
    (download_dir / "gensim-4.4.0-py3-none-any.whl").write_bytes(b"")  # found by name; read only after the debs
    result = prep(tmp_path, "--action", "download", "--dataset", "registry_en_corpus", PATH=str(tmp_path))
    assert result.returncode == 1 and result.stderr.splitlines()[-1] == (
        "bert_prep.py --action download: error: cannot fetch r-cran-janeaustenr=1.0.0-1 from Debian: no apt-get on "
        f"this machine; put its .deb in {download_dir} to build offline"), result.stderr


FOLDOC_EXCERPT = """00-database-short
     The Free On-line Dictionary of Computing (19 January 2023)

Actus

   <language> {Pascal} with parallel extensions, similar to the
   earlier {Glypnir}.  It has parallel constants and {index
   sets}.  Descendants include {Parallel Pascal}, {Vector C} and
   {CMU}'s language {PIE}.

   ["A Language for Array and Vector Processors," R.H. Perrott,
   ACM TOPLAS 1(2):177-195 (Oct 1979)].

   (1994-11-08)

ad

   <networking> The {country code} for Andorra.

   (1999-01-26)

"""


def test_foldoc_entries_become_documents_without_markup(tmp_path):
    """Two entries of FOLDOC (GFDL; data/README.md) as dict-foldoc stores them (dictzip, which gzip reads)."""
    import gzip

    from data.registry_corpus import documents

    with gzip.open(tmp_path / "foldoc.dict.dz", "wt", encoding="utf-8") as f:
        f.write(FOLDOC_EXCERPT)
    assert list(documents("foldoc", tmp_path)) == [
        "Pascal with parallel extensions, similar to the earlier Glypnir. It has parallel constants and index sets. "
        "Descendants include Parallel Pascal, Vector C and CMU's language PIE. [\"A Language for Array and Vector "
        "Processors,\" R.H. Perrott, ACM TOPLAS 1(2):177-195 (Oct 1979)].",
        "The country code for Andorra."]
