"""The README's main command, scripts/run_bert_tiny_cpu.sh, end to end: the offline data pipeline on the
committed sample corpus, then 2 CPU ranks through the real `deepspeed` launcher (ZeRO-1, bf16, LANS)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers
from data.shard_format import read_shard_header

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_tiny_cpu_demo_builds_data_trains_and_checkpoints(tmp_path):
    results = tmp_path / "results"
    env = dict(os.environ, VENV=sys.prefix, RESULTS_DIR=str(results), MAX_STEPS="40",
               MASTER_PORT=str(helpers.free_port()))
    run = subprocess.run(["bash", str(REPO / "scripts" / "run_bert_tiny_cpu.sh")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    # The shards came out of the whole pipeline (WikiExtractor, sharding, create_pretraining_data).
    shards = sorted(results.rglob("books_wiki_en_corpus_training_*.hdf5"))
    assert shards and all(read_shard_header(path)[1:] == (128, 20) for path in shards)
    assert (results / "data" / "extracted").is_dir()

    records = [json.loads(line[5:]) for line in (results / "dllogger.json").read_text().splitlines()
               if line.startswith("DLLL ")]
    windows = [r["data"]["average_loss"] for r in records if r["type"] == "LOG" and "average_loss" in r["data"]]
    summary = [r["data"] for r in records if r["type"] == "LOG" and r["step"] == []][-1]
    # Training learns: the loss starts near ln(30522) + ln(2) ~ 11 (MLM + NSP) and falls clearly.
    assert windows[0] > 10.0
    assert windows[-1] < windows[0] - 1.0
    assert summary["global_step"] == 40
    for key in ("e2e_train_time", "training_sequences_per_second", "raw_train_time", "final_loss"):
        assert key in summary
    assert (results / "checkpoints" / "latest").read_text().strip() == "40"
    assert "final_loss" in run.stdout
