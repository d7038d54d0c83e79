"""bench/bench_convergence.py and bench/bench_finetune_real.py run at a tiny size, so that the study's tooling does
not rot (the study itself is a benchmark, docs/convergence.md): the real launcher and driver on shards made by the
real pipeline from data/sample's text, a table, a CSV and a plot; a second call reruns nothing. No figure is
asserted: at this size nothing is learnt."""

import csv
import gzip
import re
import shutil
import subprocess
import sys

import pytest

import helpers
from conftest import make_pipeline_shards

pytestmark = pytest.mark.slow

TINY = ["--num_layers", "1", "--hidden_size", "32", "--num_heads", "2", "--batch", "24", "--micro_batch", "4",
        "--samples", "384", "--eval_every", "192", "--num_eval_examples", "16", "--seeds", "1",
        "--recipes", "a", "d", "--master_port", "29571"]


def run_bench(script, *args):
    result = subprocess.run([sys.executable, str(helpers.REPO_ROOT / "bench" / script), *map(str, args)],
                            cwd=helpers.REPO_ROOT, env=helpers.launcher_env(), capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def study(tmp_path_factory, pipeline_shards, pipeline_held_out):
    """The tiny study: recipes a (and its phase 2) and d, one seed; returns (work_dir, stdout)."""
    phase1 = tmp_path_factory.mktemp("phase1")
    for shard in (*pipeline_shards.glob("*.hdf5"), *pipeline_held_out.glob("*.hdf5")):
        shutil.copy(shard, phase1)
    phase2 = tmp_path_factory.mktemp("phase2")
    make_pipeline_shards(phase2, "persuasion_part1.txt.gz", 300, "persuasion_training_0.hdf5", 512, 80)
    make_pipeline_shards(phase2, "persuasion_part2.txt.gz", 200, "persuasion_test_0.hdf5", 512, 80)
    work = tmp_path_factory.mktemp("study")
    stdout = run_bench("bench_convergence.py", "--work_dir", work, "--data_dir", phase1, "--phase2_data_dir", phase2,
                       *TINY)
    return work, stdout, (phase1, phase2)


def test_the_study_writes_its_table_csv_and_plot_and_reruns_nothing(study):
    work, stdout, (phase1, phase2) = study
    assert [line.split(":")[0] for line in stdout.splitlines() if line.startswith("== ")] == \
        ["== a_seed1", "== a_seed1_phase2", "== d_seed1"]
    # a and d: 16 steps of 24 (384 samples), held-out points at 192 and 384; phase 2: 384 // 9 // 8 = 5 steps of 8.
    for run, samples in (("a_seed1", 384), ("d_seed1", 384), ("a_seed1_phase2", 384 + 5 * 8)):
        assert re.search(rf"^\| {run} \| \w+ \| \d+ \| [0-9.e-]+ \| {samples} \| 0\.\d{{4}} \| \d+\.\d{{4}} \|",
                         stdout, re.M), stdout
    rows = list(csv.DictReader(open(work / "convergence.csv")))
    assert [int(r["samples"]) for r in rows if r["run"] == "d_seed1"] == [192, 384]
    assert (work / "convergence.png").stat().st_size > 0
    again = run_bench("bench_convergence.py", "--work_dir", work, "--data_dir", phase1, "--phase2_data_dir", phase2,
                      *TINY)
    assert [line for line in again.splitlines() if line.startswith("== ")] == \
        ["== a_seed1: done, kept", "== a_seed1_phase2: done, kept", "== d_seed1: done, kept"]


def test_fine_tuning_the_studys_model_and_its_random_init(study, tmp_path):
    """mr-vader's layout (sentence, label, rating) from real sentences; MiniLM (a download) and the bag of words
    (scikit-learn, not a project dependency) are left out here."""
    work, _, _ = study
    with gzip.open(helpers.REPO_ROOT / "data" / "sample" / "books" / "persuasion_part1.txt.gz", "rt") as book:
        sentences = [line.strip() for line in book if len(line.split()) > 5][:24]
    rows = "sentence\tlabel\trating\n" + "".join(f"{s}\t{i % 2}\t{i % 2 - 0.5}\n" for i, s in enumerate(sentences))
    data = tmp_path / "mr-vader"
    data.mkdir()
    for name in ("train.tsv", "dev.tsv", "test.tsv"):
        (data / name).write_text(rows)
    stdout = run_bench("bench_finetune_real.py", "--work_dir", tmp_path / "out", "--data_dir", data,
                       "--pretrained", work / "a_seed1_phase2", "--models", "pretrained", "random",
                       "--seeds", "1", "2", "--learning_rates", "1e-4", "--max_steps", "2",
                       "--train_batch_size", "8", "--max_seq_length", "32")
    for model in ("pretrained", "random"):
        assert re.search(rf"^\| {model} \| 0.0001 \| [01]\.\d{{4}} ± [0-9.]+ \(min [01]\.\d{{4}}\) \| "
                         rf"[01]\.\d{{4}} ± [0-9.]+ \(min [01]\.\d{{4}}\) \| 2 \|$", stdout, re.M), stdout
    log = (tmp_path / "out" / "pretrained" / "lr0.0001_seed1" / "run_glue.log").read_text()
    assert "from --init_checkpoint" in log, log[-2000:]
