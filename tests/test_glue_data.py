"""finetune/glue.py and finetune/glue_metrics.py: each task's TSV layout read back, strict errors, BERT features,
and the metrics against hand-computed values (and numpy's own Pearson as a second reference)."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from common.errors import InputError
from data.tokenization import load_tokenizer
from finetune import glue_metrics
from finetune.glue import TASKS, convert_examples_to_features, read_examples, truncate_pair
from finetune_helpers import REPO_ROOT, book_sentences

VOCAB = REPO_ROOT / "data" / "vocab.txt"
SENTENCES = book_sentences()[:40]


# ============================================================================ metrics

def test_accuracy_and_f1_by_hand():
    predictions, labels = [1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]
    # TP 2, FP 1, FN 1: precision 2/3, recall 2/3, F1 2/3; 4 of 6 right.
    assert glue_metrics.accuracy(predictions, labels) == pytest.approx(4 / 6)
    assert glue_metrics.f1(predictions, labels) == pytest.approx(2 / 3)
    assert glue_metrics.f1([0, 0], [0, 0]) == 0.0


def test_matthews_correlation_by_hand():
    predictions, labels = [1, 1, 0, 0, 1, 0], [1, 0, 0, 1, 1, 0]
    # TP 2, TN 2, FP 1, FN 1: (2*2 - 1*1) / sqrt(3*3*3*3) = 3/9
    assert glue_metrics.matthews_corrcoef(predictions, labels) == pytest.approx(1 / 3)
    assert glue_metrics.matthews_corrcoef([1, 0, 1], [1, 0, 1]) == pytest.approx(1.0)
    assert glue_metrics.matthews_corrcoef([0, 1, 0], [1, 0, 1]) == pytest.approx(-1.0)
    assert glue_metrics.matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0  # constant prediction
    # Three classes, the Gorodkin form: c=3, s=5, t=(2,2,1), p=(2,1,2): (15-2*2-2*1-1*2)/sqrt((25-9)(25-9))
    assert glue_metrics.matthews_corrcoef([0, 0, 1, 2, 2], [0, 1, 1, 2, 0]) == pytest.approx(7 / 16)


def test_pearson_and_spearman_by_hand_and_against_numpy():
    x, y = [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 4.0]
    # centred x = (-1.5,-.5,.5,1.5), y = (-1.5,.5,-.5,1.5): x.y = 4, |x|^2 = |y|^2 = 5
    assert glue_metrics.pearson(x, y) == pytest.approx(0.8)
    assert glue_metrics.spearman(x, y) == pytest.approx(0.8)  # already ranks
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=50), rng.normal(size=50)
    assert glue_metrics.pearson(a, b) == pytest.approx(np.corrcoef(a, b)[0, 1])
    # Spearman is Pearson of the ranks; ties share their mean rank: ranks of (10, 20, 20, 30) = 1, 2.5, 2.5, 4
    np.testing.assert_allclose(glue_metrics.average_ranks([10, 20, 20, 30]), [1, 2.5, 2.5, 4])
    assert glue_metrics.spearman([1, 2, 3, 4], [1, 4, 9, 16]) == pytest.approx(1.0)  # monotone, not linear
    assert glue_metrics.pearson([1, 2, 3, 4], [1, 4, 9, 16]) < 0.99


# ============================================================================ TSV layouts

def write_task(directory, task_name, rows_by_file):
    directory.mkdir(parents=True, exist_ok=True)
    for name, lines in rows_by_file.items():
        (directory / name).write_text("".join("\t".join(line) + "\n" for line in lines))
    return directory


def layout_rows(task_name, n=4):
    """Rows of (train/dev, test) files in each task's real column layout, from real sentences."""
    s = SENTENCES
    if task_name == "cola":
        labelled = [["gj04", str(i % 2), "" if i % 2 else "*", s[i]] for i in range(n)]
        return {"train.tsv": labelled, "dev.tsv": labelled,
                "test.tsv": [["index", "sentence"]] + [[str(i), s[i]] for i in range(n)]}
    if task_name == "sst-2":
        return {"train.tsv": [["sentence", "label"]] + [[s[i], str(i % 2)] for i in range(n)],
                "dev.tsv": [["sentence", "label"]] + [[s[i], str(i % 2)] for i in range(n)],
                "test.tsv": [["index", "sentence"]] + [[str(i), s[i]] for i in range(n)]}
    if task_name == "mr-vader":  # data/vader_movie_reviews.py: sentence, label, rating; its test split is labelled
        rows = [["sentence", "label", "rating"]] + [[s[i], str(i % 2), str(i % 2 - 0.5)] for i in range(n)]
        return {"train.tsv": rows, "dev.tsv": rows, "test.tsv": rows}
    if task_name == "mrpc":
        head = ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"]
        labelled = [head] + [[str(i % 2), "1", "2", s[i], s[i + 1]] for i in range(n)]
        return {"train.tsv": labelled, "dev.tsv": labelled,
                "test.tsv": [["index"] + head[1:]] + [[str(i), "1", "2", s[i], s[i + 1]] for i in range(n)]}
    if task_name == "sts-b":
        head = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2"]
        labelled = [head + ["score"]] + [[str(i), "g", "f", "y", "0", "a", "b", s[i], s[i + 1], f"{i * 1.25}"]
                                         for i in range(n)]
        return {"train.tsv": labelled, "dev.tsv": labelled,
                "test.tsv": [head] + [[str(i), "g", "f", "y", "0", "a", "b", s[i], s[i + 1]] for i in range(n)]}
    if task_name == "qqp":
        labelled = [["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]] + \
            [[str(i), "1", "2", s[i], s[i + 1], str(i % 2)] for i in range(n)]
        return {"train.tsv": labelled, "dev.tsv": labelled,
                "test.tsv": [["id", "question1", "question2"]] + [[str(i), s[i], s[i + 1]] for i in range(n)]}
    if task_name == "mnli":
        head = ["index", "promptID", "pairID", "genre", "p1", "p2", "p3", "p4", "sentence1", "sentence2"]
        labels = TASKS["mnli"].labels
        train = [head + ["label1", "gold_label"]] + \
            [[str(i), "1", "2", "fiction", "", "", "", "", s[i], s[i + 1], "x", labels[i % 3]] for i in range(n)]
        dev = [head + ["label1", "label2", "label3", "label4", "label5", "gold_label"]] + \
            [[str(i), "1", "2", "fiction", "", "", "", "", s[i], s[i + 1], "x", "x", "x", "x", "x", labels[i % 3]]
             for i in range(n)]
        test = [head] + [[str(i), "1", "2", "fiction", "", "", "", "", s[i], s[i + 1]] for i in range(n)]
        return {"train.tsv": train, "dev_matched.tsv": dev, "dev_mismatched.tsv": dev,
                "test_matched.tsv": test, "test_mismatched.tsv": test}
    labels = TASKS[task_name].labels  # qnli, rte, wnli: index, sentence1, sentence2, label
    labelled = [["index", "sentence1", "sentence2", "label"]] + [[str(i), s[i], s[i + 1], labels[i % 2]]
                                                                 for i in range(n)]
    return {"train.tsv": labelled, "dev.tsv": labelled,
            "test.tsv": [["index", "sentence1", "sentence2"]] + [[str(i), s[i], s[i + 1]] for i in range(n)]}


@pytest.mark.parametrize("task_name", sorted(TASKS))
def test_every_split_of_every_task_reads_its_columns(tmp_path, task_name):
    task = TASKS[task_name]
    directory = write_task(tmp_path, task_name, layout_rows(task_name))
    for split_name in task.splits():
        examples = read_examples(task, directory, split_name)
        assert [e.text_a for e in examples] == SENTENCES[:4]
        if task.train.text_b is not None:
            assert [e.text_b for e in examples] == SENTENCES[1:5]
        else:
            assert all(e.text_b is None for e in examples)
        if task.splits()[split_name].label is None:
            assert split_name.startswith("test_") and all(e.label is None for e in examples)
        elif task.labels is None:
            assert [e.label for e in examples] == [0.0, 1.25, 2.5, 3.75]
        else:
            assert [e.label for e in examples] == [i % min(task.num_labels, 3 if task_name == "mnli" else 2)
                                                   for i in range(4)]


def test_a_short_row_names_the_file_and_line(tmp_path):
    rows = layout_rows("mrpc")
    rows["train.tsv"][3] = rows["train.tsv"][3][:3]  # line 4 lost its two sentences
    directory = write_task(tmp_path, "mrpc", rows)
    with pytest.raises(InputError) as err:
        read_examples(TASKS["mrpc"], directory, "train")
    assert str(err.value) == f"{directory / 'train.tsv'}:4: 3 tab-separated column(s), mrpc needs at least 5"


def test_a_label_outside_the_task_set_names_the_file_and_line(tmp_path):
    rows = layout_rows("rte")
    rows["dev.tsv"][2][3] = "contradiction"  # an MNLI label in RTE
    directory = write_task(tmp_path, "rte", rows)
    with pytest.raises(InputError, match=r"dev.tsv:3: label 'contradiction' is not one of rte's labels "
                                         r"entailment, not_entailment$"):
        read_examples(TASKS["rte"], directory, "rte")
    rows = layout_rows("sts-b")
    rows["train.tsv"][1][-1] = "high"
    with pytest.raises(InputError, match=r"train.tsv:2: label 'high' is not a number"):
        read_examples(TASKS["sts-b"], write_task(tmp_path / "stsb", "sts-b", rows), "train")


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(InputError, match=r"dev_mismatched.tsv: no such file \(mnli mnli-mm split\)"):
        read_examples(TASKS["mnli"], tmp_path, "mnli-mm")


# ============================================================================ features

def test_pair_features_are_cls_a_sep_b_sep_with_segments_and_padding(tmp_path):
    tokenizer, _, _ = load_tokenizer(VOCAB, do_lower_case=True)
    directory = write_task(tmp_path, "rte", layout_rows("rte", n=2))
    examples = read_examples(TASKS["rte"], directory, "train")
    features = convert_examples_to_features(examples, TASKS["rte"], tokenizer, max_seq_length=96)
    a = tokenizer.encode(SENTENCES[0], add_special_tokens=False).ids
    b = tokenizer.encode(SENTENCES[1], add_special_tokens=False).ids
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    expected = [cls, *a, sep, *b, sep]
    assert len(expected) <= 96
    assert features["input_ids"][0, :len(expected)].tolist() == expected
    assert features["input_ids"][0, len(expected):].eq(0).all()
    assert features["token_type_ids"][0].tolist() == ([0] * (len(a) + 2) + [1] * (len(b) + 1)
                                                      + [0] * (96 - len(expected)))
    assert features["attention_mask"][0].tolist() == [1] * len(expected) + [0] * (96 - len(expected))
    assert features["labels"].tolist() == [0, 1] and features["labels"].dtype == torch.int64
    short = convert_examples_to_features(examples, TASKS["rte"], tokenizer, max_seq_length=16)
    assert short["input_ids"].shape == (2, 16) and short["attention_mask"][0].all()
    assert short["input_ids"][0].tolist().count(sep) == 2


def test_truncation_cuts_the_longer_side_first():
    assert truncate_pair([1, 2, 3, 4, 5], [6, 7], 5) == ([1, 2, 3], [6, 7])
    assert truncate_pair([1, 2], [3, 4, 5], 4) == ([1, 2], [3, 4])
    assert truncate_pair([1, 2, 3], [4, 5, 6], 4) == ([1, 2], [4, 5])  # ties: B first, then A, as BERT
    assert math.isclose(len(truncate_pair(list(range(50)), [], 10)[0]), 10)


def test_regression_labels_are_float(tmp_path):
    tokenizer, _, _ = load_tokenizer(VOCAB, do_lower_case=True)
    directory = write_task(tmp_path, "sts-b", layout_rows("sts-b"))
    features = convert_examples_to_features(read_examples(TASKS["sts-b"], directory, "sts-b"), TASKS["sts-b"],
                                            tokenizer, 64)
    assert features["labels"].dtype == torch.float32 and features["labels"].tolist() == [0.0, 1.25, 2.5, 3.75]
    test = convert_examples_to_features(read_examples(TASKS["sts-b"], directory, "test_sts-b"), TASKS["sts-b"],
                                        tokenizer, 64)
    assert "labels" not in test


# ============================================================================ mr-vader (data/vader_movie_reviews.py)

# Rows of movieReviewSnippets_GroundTruth.txt (vaderSentiment 3.3.2, MIT, C.J. Hutto) as the file has them: id, mean
# rating, sentence, CRLF. Two are near neutral; one sentence comes twice (its ids 10324 and 10341).
GROUND_TRUTH_ROWS = (
    "3\t-0.6\tEffective but too tepid biopic\r\n"
    "4\t1.46666666667\tIf you sometimes like to go to the movies to have fun, Wasabi is a good place to start.\r\n"
    "28\t-0.333333333333\tAt about 95 minutes, Treasure Planet maintains a brisk pace as it races through the "
    "familiar story. However, it lacks grandeur and that epic quality often associated with Stevenson's tale as well "
    "as with earlier Disney efforts.\r\n"
    "32\t0.466666666667\tLight, cute and forgettable.\r\n"
    "5402\t-0.764705882353\tAlthough it tries to be much more, it's really just another Major League.\r\n"
    "10324\t1.85\t'Stock up on silver bullets for director Neil Marshall's intense freight train of a film.'\r\n"
    "10341\t1.5\t'Stock up on silver bullets for director Neil Marshall's intense freight train of a film.'\r\n")


def expected_split(sentence):
    """The documented rule, computed here: SHA-256 of the lower-cased sentence, first 8 bytes mod 10."""
    import hashlib
    bucket = int(hashlib.sha256(" ".join(sentence.lower().split()).encode()).hexdigest()[:16], 16) % 10
    return "test" if bucket == 0 else "dev" if bucket == 1 else "train"


def test_mr_vader_labels_by_sign_leaves_out_near_neutral_and_duplicates():
    from data.vader_movie_reviews import labelled_splits, parse_ground_truth

    rows = parse_ground_truth(GROUND_TRUTH_ROWS)
    splits = labelled_splits(rows)
    got = {sentence: (label, rating, name) for name, split in splits.items() for sentence, label, rating in split}
    kept = {sentence: rating for _, rating, sentence in reversed(rows) if abs(rating) >= 0.5}  # a duplicate's first
    assert len(got) == sum(map(len, splits.values())) == 4 == len(kept)
    for sentence, (label, rating, name) in got.items():
        assert rating == kept[sentence] and label == (1 if rating > 0 else 0) and name == expected_split(sentence)
    assert got["'Stock up on silver bullets for director Neil Marshall's intense freight train of a film.'"][1] == 1.85


def test_mr_vader_task_from_the_real_sdist(tmp_path):
    """The whole set, when its sdist is at hand (the tests do not download): set MR_VADER_SDIST to
    vaderSentiment-3.3.2.tar.gz (`pip download --no-deps --no-binary=:all: vaderSentiment==3.3.2`)."""
    import os
    import subprocess
    import sys

    from data.vader_movie_reviews import parse_ground_truth, read_ground_truth

    sdist = os.environ.get("MR_VADER_SDIST")
    if not sdist:
        pytest.skip("MR_VADER_SDIST is not set")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "data" / "vader_movie_reviews.py"), "--output_dir",
                             str(tmp_path), "--sdist", sdist], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    source = read_ground_truth(Path(sdist))
    assert len(source) == 10605
    ratings = {sentence: rating for _, rating, sentence in reversed(source)}  # the first rating of a duplicate
    task = TASKS["mr-vader"]
    splits = {name: read_examples(task, tmp_path, name) for name in ("train", "mr-vader", "test_mr-vader")}
    assert {name: len(examples) for name, examples in splits.items()} == {
        "train": 8008, "mr-vader": 1001, "test_mr-vader": 1061}
    sentences = [example.text_a for examples in splits.values() for example in examples]
    assert len(set(sentences)) == len(sentences) == sum(abs(r) >= 0.5 for r in ratings.values())
    for name, examples in splits.items():
        for example in examples:
            assert example.label == (ratings[example.text_a] > 0) and abs(ratings[example.text_a]) >= 0.5
            assert expected_split(example.text_a) == {"mr-vader": "dev", "test_mr-vader": "test"}.get(name, name)
    assert parse_ground_truth(GROUND_TRUTH_ROWS)[1] in source  # the excerpt above is the file's
