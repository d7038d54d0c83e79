"""finetune/squad_metrics.py against hand-computed cases (normalisation, F1, gold answers, v2.0 no-answer scoring and
best thresholds) and its command line."""
import json
import subprocess
import sys

import pytest

from finetune import squad_metrics as m
from finetune_helpers import REPO_ROOT


@pytest.mark.parametrize("text, expected", [
    ("The Cat!", "cat"),
    ("  an   apple\tpie\n", "apple pie"),
    ("A.B.C.", "abc"),                     # punctuation goes first: not the article "a"
    ("state-of-the-art", "stateoftheart"),  # ... so an article glued by hyphens stays
    ("the theatre, an answer", "theatre answer"),  # articles only as whole words
    ("Their THE thE", "their"),
    ("«Élan»", "«élan»"),                  # only ASCII punctuation is removed, as in the official script
    ("the", ""),
    ("", ""),
])
def test_normalize_answer(text, expected):
    assert m.normalize_answer(text) == expected


def test_exact_match_and_f1_hand_computed():
    assert m.exact_match("The Eiffel Tower.", "eiffel tower") == 1.0
    assert m.exact_match("Eiffel", "eiffel tower") == 0.0
    # "quick brown fox" vs "quick fox jumps": 2 common tokens, P = R = 2/3
    assert m.f1_score("the quick brown fox", "a quick fox jumps") == pytest.approx(2 / 3)
    # tokens count with multiplicity: "very very good" vs "very good": common 2, P = 2/3, R = 1 -> 0.8
    assert m.f1_score("very very good", "very good") == pytest.approx(0.8)
    assert m.f1_score("very good", "very very good") == pytest.approx(0.8)
    assert m.f1_score("Darcy", "Elizabeth") == 0.0
    # an empty side scores only against another empty side (v2.0's rule)
    assert m.f1_score("", "") == 1.0 and m.f1_score("", "Darcy") == 0.0 and m.f1_score("the", "Darcy") == 0.0


def squad(qas, version="1.1", context="Mr. Darcy danced with Elizabeth at Netherfield."):
    return {"version": version, "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}


def qa(qid, *answers):
    return {"id": qid, "question": "?", "answers": [{"text": a, "answer_start": 0} for a in answers]}


def test_v1_max_over_gold_answers():
    dataset = squad([qa("1", "Darcy", "Mr. Darcy"), qa("2", "at Netherfield", "Netherfield"), qa("3", "Elizabeth")])
    predictions = {"1": "mr darcy", "2": "Netherfield ball", "3": "Jane"}
    # 1: exact against the second gold. 2: F1 vs "at netherfield" is 0.5 (P = R = 1/2), vs "netherfield"
    # 2/3 (P = 1/2, R = 1): the max, 2/3; not exact. 3: 0.
    result = m.evaluate(dataset, predictions)
    assert result == {"exact_match": pytest.approx(100 / 3), "f1": pytest.approx(100 * (1 + 2 / 3 + 0) / 3)}


def test_v1_missing_prediction_scores_zero():
    result = m.evaluate(squad([qa("1", "Darcy"), qa("2", "Elizabeth")]), {"1": "Darcy"})
    assert result == {"exact_match": 50.0, "f1": 50.0}


def v2_dataset():
    # A and C have answers; B is unanswerable (no gold); D's only gold "the" normalises to "", so only ""
    # is right there, but D counts as HasAns: the v2.0 script decides that from the raw answer list.
    return squad([qa("A", "Darcy"), {"id": "B", "question": "?", "answers": [], "is_impossible": True},
                  qa("C", "Elizabeth"), qa("D", "the")], version="v2.0")


def test_v2_no_answer_scoring_and_splits():
    predictions = {"A": "Darcy", "B": "", "C": "", "D": "Netherfield"}
    result = m.evaluate(v2_dataset(), predictions)
    # A right, B right (empty for unanswerable), C wrong (empty for answerable), D wrong (text where only ""
    # matches): HasAns = A, C, D (1 of 3 right), NoAns = B.
    assert result == {"exact": 50.0, "f1": 50.0, "total": 4, "HasAns_exact": pytest.approx(100 / 3),
                      "HasAns_f1": pytest.approx(100 / 3), "HasAns_total": 3, "NoAns_exact": 100.0,
                      "NoAns_f1": 100.0, "NoAns_total": 1}


def test_v2_best_threshold_hand_computed():
    predictions = {"A": "Darcy", "B": "x", "C": "Jane", "D": "y"}
    na_probs = {"A": 0.1, "B": 0.9, "C": 0.5, "D": 0.3}
    # Sweep from "all empty" (1 of 4 right: B): answer A (+1 -> 2, best, threshold 0.1), then D (HasAns,
    # wrong: +0), C (+0), B (answered "x": -1).
    result = m.evaluate(v2_dataset(), predictions, na_probs)
    assert result["best_exact"] == 50.0 and result["best_exact_thresh"] == 0.1
    assert result["best_f1"] == 50.0 and result["best_f1_thresh"] == 0.1
    assert result["exact"] == 25.0  # threshold 1.0: nobody is switched to ""
    # Threshold 0.4: B (0.9) and C (0.5) count as answered "": B becomes right, C stays wrong.
    assert m.evaluate(v2_dataset(), predictions, na_probs, na_prob_thresh=0.4)["exact"] == 50.0


def article_answers_dataset():
    # q1's only gold "the" normalises to "": HasAns (raw list not empty), right answer "".
    return squad([qa("q1", "the"), qa("q2", "Paris"), qa("q3"), qa("q4", "Rome"), qa("q5")], version="v2.0")


ARTICLE_PREDICTIONS = {"q1": "", "q2": "Paris", "q3": "London", "q4": "Rome city", "q5": ""}
# Raw scores: exact q1 1, q2 1, q3 0, q4 0, q5 1; F1 the same except q4: P 1/2, R 1 -> 2/3.


def test_v2_has_answer_comes_from_the_raw_answer_list():
    result = m.evaluate(article_answers_dataset(), ARTICLE_PREDICTIONS)
    assert result == {"exact": 60.0, "f1": pytest.approx(100 * (3 + 2 / 3) / 5), "total": 5,
                      "HasAns_exact": pytest.approx(200 / 3), "HasAns_f1": pytest.approx(100 * (2 + 2 / 3) / 3),
                      "HasAns_total": 3, "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2}
    # Threshold 0.4: q1, q3, q4, q5 count as answered "": q1 (HasAns) and q4 score 0, q3 and q5 1; q2 stays 1.
    na_probs = {"q3": 0.5, "q1": 0.5, "q2": 0.2, "q4": 0.5, "q5": 0.9}
    result = m.evaluate(article_answers_dataset(), ARTICLE_PREDICTIONS, na_probs, na_prob_thresh=0.4)
    assert (result["exact"], result["f1"], result["HasAns_exact"], result["NoAns_exact"]) == (
        60.0, 60.0, pytest.approx(100 / 3), 100.0)


@pytest.mark.parametrize("na_probs, expected", [
    # Probability order q2 (0.2), then the tie at 0.5 in the file's order q3, q1, q4, then q5 (0.9). Start: the
    # 2 NoAns right. exact: q2 +1 -> 3 (best, 0.2); q3 answered "London" -1 -> 2; q1 +1 -> 3; q4 +0; q5 +0.
    # F1: q2 -> 3 (0.2); q3 -> 2; q1 -> 3; q4 +2/3 -> 3 2/3 (best, 0.5); q5 +0.
    ({"q3": 0.5, "q1": 0.5, "q2": 0.2, "q4": 0.5, "q5": 0.9}, (60.0, 0.2, 100 * (3 + 2 / 3) / 5, 0.5)),
    # The same probabilities, the tie in the order q1, q4, q3: exact q2 -> 3 (0.2); q1 -> 4 (best, 0.5), q4 4,
    # q3 3, q5 3. F1: q2 3; q1 4; q4 4 2/3 (best, 0.5); q3 3 2/3; q5.
    ({"q1": 0.5, "q4": 0.5, "q3": 0.5, "q2": 0.2, "q5": 0.9}, (80.0, 0.5, 100 * (4 + 2 / 3) / 5, 0.5)),
])
def test_v2_best_thresholds_take_ties_in_the_probability_files_order(na_probs, expected):
    result = m.evaluate(article_answers_dataset(), ARTICLE_PREDICTIONS, na_probs)
    got = (result["best_exact"], result["best_exact_thresh"], result["best_f1"], result["best_f1_thresh"])
    assert got == pytest.approx(expected)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "finetune.squad_metrics", *map(str, args)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)


def test_cli_prints_official_dicts(tmp_path):
    data = tmp_path / "dev.json"
    data.write_text(json.dumps(v2_dataset()))
    (tmp_path / "pred.json").write_text(json.dumps({"A": "Darcy", "B": "x", "C": "Jane", "D": "y"}))
    (tmp_path / "odds.json").write_text(json.dumps({"A": 0.1, "B": 0.9, "C": 0.5, "D": 0.3}))
    result = run_cli(data, tmp_path / "pred.json", "--na-prob-file", tmp_path / "odds.json")
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["exact"] == 25.0 and printed["best_exact"] == 50.0 and printed["NoAns_total"] == 1


def test_cli_malformed_json_is_one_line(tmp_path):
    (tmp_path / "dev.json").write_text('{"data": [\n  {"paragraphs": ]\n}')
    (tmp_path / "pred.json").write_text("{}")
    result = run_cli(tmp_path / "dev.json", tmp_path / "pred.json")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "dev.json: malformed JSON at line 2 column" in result.stderr


def v2_file_without_unanswerable_questions():
    return {"version": "v2.0", "data": [{"paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "q1", "question": "Where?", "answers": [{"text": "France", "answer_start": 12}]},
        {"id": "q2", "question": "What?", "answers": [{"text": "Paris", "answer_start": 0}]}]}]}]}


def test_the_caller_chooses_the_rules_whatever_the_files_version():
    """A "v2.0" file whose questions all have answers: v2_rules=False gives the v1.1 keys, v2_rules=True the
    v2.0 ones. Hand-computed: q1 exact; q2 "in Paris" against "Paris": EM 0, F1 2*(1/2*1)/(1/2+1) = 2/3."""
    dataset, predictions = v2_file_without_unanswerable_questions(), {"q1": "France", "q2": "in Paris"}
    assert m.evaluate(dataset, predictions, v2_rules=False) == pytest.approx(
        {"exact_match": 50.0, "f1": 100.0 * (1 + 2 / 3) / 2})
    v2 = m.evaluate(dataset, predictions, v2_rules=True)
    assert v2["exact"] == 50.0 and v2["f1"] == pytest.approx(100.0 * (1 + 2 / 3) / 2) and v2["HasAns_total"] == 2
    assert "exact" in m.evaluate(dataset, predictions)  # left to the file: its "version" says v2.0


def test_run_squad_scores_under_the_flags_rules(tmp_path):
    """run_squad.py without --version_2_with_negative on that file: the keys it promises (exact_match, F1),
    not a KeyError after all the work."""
    import run_squad
    from finetune import squad
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(v2_file_without_unanswerable_questions()))
    result = squad.SquadPredictions({"q1": "France", "q2": "in Paris"}, {}, {})
    figures = run_squad.score(result, str(path), tmp_path, False, 0.0)
    assert figures == pytest.approx({"exact_match": 50.0, "F1": 100.0 * (1 + 2 / 3) / 2})
    assert json.loads((tmp_path / "eval_results.json").read_text()) == pytest.approx(
        {"exact_match": 50.0, "f1": 100.0 * (1 + 2 / 3) / 2})
