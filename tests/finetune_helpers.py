"""Fine-tuning test data written from the real sentences of data/sample/books (no download)."""

import gzip
import json
import random
import re
from pathlib import Path

import pytest
import torch

import checkpointing
import helpers

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO_ROOT / "scripts" / "bert_tiny_config.json"
BOOKS = REPO_ROOT / "data" / "sample" / "books"
RULE_WORD = re.compile(r"\bher\b", re.IGNORECASE)


def book_sentences(min_words=6, max_words=30) -> list:
    """Sentences of the sample novels (paragraphs joined, split after . ! ?), deduplicated, in book order."""
    sentences, seen = [], set()
    for path in sorted(BOOKS.glob("*.txt.gz")):
        with gzip.open(path, "rt", encoding="utf-8") as file:
            paragraphs = re.split(r"\n\s*\n", file.read())
        for paragraph in paragraphs:
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(paragraph.split())):
                if min_words <= len(sentence.split()) <= max_words and "\t" not in sentence and sentence not in seen:
                    seen.add(sentence)
                    sentences.append(sentence)
    return sentences


def rule_labelled_sentences(count: int, seed: int = 0) -> list:
    """`count` (sentence, label) pairs, half of each class: label 1 when the sentence has the word "her"."""
    rng = random.Random(seed)
    sentences = book_sentences()
    rng.shuffle(sentences)
    positive = [s for s in sentences if RULE_WORD.search(s)][: count // 2]
    negative = [s for s in sentences if not RULE_WORD.search(s)][: count - len(positive)]
    assert len(positive) + len(negative) == count, "not enough sample sentences"
    pairs = [(s, 1) for s in positive] + [(s, 0) for s in negative]
    rng.shuffle(pairs)
    return pairs


def write_sst2_rule_task(directory, n_train: int, n_dev: int, shuffle_train_labels=False, seed: int = 0) -> Path:
    """An SST-2-format task (header; sentence, label) from the rule; dev never shares a sentence with train.
    shuffle_train_labels: the negative control, the same sentences with their labels permuted."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    pairs = rule_labelled_sentences(n_train + n_dev, seed)
    train, dev = pairs[:n_train], pairs[n_train:]
    if shuffle_train_labels:
        labels = [label for _, label in train]
        random.Random(seed + 1).shuffle(labels)
        train = [(sentence, label) for (sentence, _), label in zip(train, labels)]
    for name, rows in (("train.tsv", train), ("dev.tsv", dev)):
        (directory / name).write_text("sentence\tlabel\n" + "".join(f"{s}\t{label}\n" for s, label in rows))
    return directory


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
                          "weights": checkpointing.consolidated_state_dict(out / "checkpoints"),
                          "outputs": outputs(out)}
    return results


def assert_same_training(results, steps):
    """The per-step losses and the final weights of run_on_one_and_two_ranks agree within float tolerance."""
    assert len(results[1]["losses"]) == steps
    assert results[2]["losses"] == pytest.approx(results[1]["losses"], rel=1e-4, abs=1e-5)
    for key, value in results[1]["weights"].items():
        torch.testing.assert_close(results[2]["weights"][key], value, rtol=1e-4, atol=1e-5, msg=key)
