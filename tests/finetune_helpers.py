"""Fine-tuning test data written from the real sentences of data/sample/books (no download): see
data/glue_sample.py, which the demo path of docs/fine-tuning.md uses too."""

import json
from pathlib import Path

import pytest
import torch

import helpers
from data.glue_sample import RULE_WORD, book_sentences, rule_labelled_sentences, write_sst2_rule_task  # noqa: F401
from training import checkpoint_export

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO_ROOT / "scripts" / "bert_tiny_config.json"


def dropout_free_config(path, base=TINY_CONFIG):
    """The tiny config without dropout, so that runs on different rank counts draw no different masks."""
    values = json.loads(Path(base).read_text())
    values.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    Path(path).write_text(json.dumps(values))
    return Path(path)


def run_on_one_and_two_ranks(tmp_path, script, argv_for, outputs) -> dict:
    """fp32, ZeRO-1: `script` through the real `deepspeed` launcher on 1 rank x micro 8 x 2 accumulation steps
    and on 2 ranks x micro 8 (the same 16 samples per step). argv_for(output_dir, ds_config) -> argv;
    outputs(output_dir) -> the run's predictions. Returns {ranks: {"losses", "weights", "outputs"}}."""
    results = {}
    for ranks in (1, 2):
        ds_config = helpers.write_ds_config(tmp_path / f"ds{ranks}.json", stage=1, bf16=False, micro=8,
                                            gas=2 // ranks, world=ranks)
        out = tmp_path / f"out{ranks}"
        result = helpers.launch(argv_for(out, ds_config), num_ranks=ranks, script=script, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        records = helpers.read_dllogger(out / "dllogger.json")
        results[ranks] = {"losses": [r["data"]["step_loss"] for r in records if "step_loss" in r["data"]],
                          "weights": checkpoint_export.consolidated_state_dict(out / "checkpoints"),
                          "outputs": outputs(out)}
    return results


def assert_same_training(results, steps):
    """The per-step losses and the final weights of run_on_one_and_two_ranks agree within float tolerance."""
    assert len(results[1]["losses"]) == steps
    assert results[2]["losses"] == pytest.approx(results[1]["losses"], rel=1e-4, abs=1e-5)
    for key, value in results[1]["weights"].items():
        torch.testing.assert_close(results[2]["weights"][key], value, rtol=1e-4, atol=1e-5, msg=key)
