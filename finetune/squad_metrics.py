"""SQuAD evaluation with the official rules (v1.1 and v2.0), written for this repository.

    python -m finetune.squad_metrics dev-v2.0.json predictions.json [--na-prob-file null_odds.json] \
        [--na-prob-thresh 1.0]

Answers are compared after normalisation: lower case, punctuation removed, the articles a/an/the removed,
whitespace collapsed. Exact match is 1 when the normalised prediction equals a normalised gold answer;
F1 is the harmonic mean of token precision and recall (tokens counted with multiplicity); both take the
maximum over the gold answers. v2.0 files (their "version", or a question without answers, says so) follow
the v2.0 script: a question with no gold answer that survives normalisation has the single gold answer "",
so only the empty prediction scores there; but whether a question counts as HasAns or NoAns depends on its
raw answer list, as the v2.0 script decides it: gold answers "the" or "." make a HasAns question whose only
right prediction is "", and which scores 0 when its no-answer probability exceeds the threshold. v1.1 files
follow the v1.1 script, where F1 against an empty side is 0. A question missing from the predictions
scores 0 (the official script skips it in the totals and fails on the HasAns/NoAns splits).

v1.1 files print {"exact_match", "f1"} like the official v1.1 script; v2.0 files print the official v2.0
script's dict: exact, f1, total, the HasAns_/NoAns_ splits and, with a no-answer probability file, the best
thresholds (best_exact, best_exact_thresh, best_f1, best_f1_thresh: the official sweep, ties in no-answer
probability taken one question at a time in the probability file's order). A question whose no-answer probability
exceeds --na-prob-thresh counts as answered "" (null_odds.json from run_squad.py serves as that file).
"""
import argparse
import collections
import json
import re
import string
import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

# A parsed SQuAD file or one of its question dicts: JSON, as json.load gives it.
SquadJson: TypeAlias = dict[str, Any]

PUNCTUATION = frozenset(string.punctuation)
ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str, v2_rules: bool = True) -> float:
    """Token F1. v2.0: an empty side scores 1 against another empty side, else 0; v1.1: always 0."""
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not predicted or not expected:
        return float(v2_rules and predicted == expected)
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def gold_answers(qa: SquadJson) -> list[str]:
    """The gold texts of a question; [""] when it has none that survives normalisation (unanswerable)."""
    texts = [answer["text"] for answer in qa.get("answers", []) if normalize_answer(answer["text"])]
    return texts or [""]


def all_questions(dataset_json: SquadJson) -> list[SquadJson]:
    """The question dicts of a parsed SQuAD file, in file order."""
    return [qa for article in dataset_json["data"] for paragraph in article["paragraphs"] for qa in paragraph["qas"]]


def read_questions(dataset_json: SquadJson, v2_rules: bool = True) -> dict[str, list[str]]:
    """{question id: gold answer texts} of a parsed SQuAD file, in file order (v1.1: every gold text)."""
    return {str(qa["id"]): gold_answers(qa) if v2_rules else [answer["text"] for answer in qa["answers"]]
            for qa in all_questions(dataset_json)}


def has_answers(dataset_json: SquadJson) -> dict[str, bool]:
    """{question id: HasAns}, from the raw answer list as the v2.0 script decides it (not after normalisation)."""
    return {str(qa["id"]): bool(qa.get("answers")) for qa in all_questions(dataset_json)}


def is_version_2(dataset_json: SquadJson) -> bool:
    """A v2.0 file says so in "version" or has unanswerable questions."""
    return str(dataset_json.get("version", "")).lstrip("v").startswith("2") or any(
        qa.get("is_impossible") or not qa.get("answers") for qa in all_questions(dataset_json))


def raw_scores(questions: dict[str, list[str]], predictions: dict[str, str],
               v2_rules: bool = True) -> tuple[dict[str, float], dict[str, float]]:
    """{id: exact}, {id: f1}: the best over each question's gold answers (0 for a missing prediction)."""
    exact: dict[str, float] = {}
    f1: dict[str, float] = {}
    for qid, golds in questions.items():
        prediction = predictions.get(qid)
        if prediction is None:
            exact[qid] = f1[qid] = 0.0
            continue
        exact[qid] = max(exact_match(prediction, gold) for gold in golds)
        f1[qid] = max(f1_score(prediction, gold, v2_rules) for gold in golds)
    return exact, f1


def apply_no_answer_threshold(scores: dict[str, float], na_probs: dict[str, float], has_answer: dict[str, bool],
                              threshold: float) -> dict[str, float]:
    """A question whose no-answer probability exceeds threshold counts as answered "": right only when it
    has no answer."""
    return {qid: float(not has_answer[qid]) if na_probs.get(qid, 0.0) > threshold else score
            for qid, score in scores.items()}


def best_threshold(predictions: dict[str, str], scores: dict[str, float], na_probs: dict[str, float],
                   has_answer: dict[str, bool]) -> tuple[float, float]:
    """(best score in %, its threshold) when every question whose no-answer probability exceeds the threshold
    is answered "": the v2.0 script's sweep by rising probability from "all answered empty". Like it, this
    takes only the questions of the probability file, equal probabilities one at a time in that file's order
    (a stable sort), and keeps a new best after any question, also inside a run of equal probabilities."""
    score = best = float(sum(not has for has in has_answer.values()))
    threshold = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            score += scores[qid]
        elif predictions.get(qid):
            score -= 1
        if score > best:
            best, threshold = score, na_probs.get(qid, 0.0)
    return 100.0 * best / len(scores), threshold


def _summary(exact: dict[str, float], f1: dict[str, float], qids: Sequence[str], prefix: str = "") -> dict[str, float]:
    total = len(qids)
    return {f"{prefix}exact": 100.0 * sum(exact[q] for q in qids) / total,
            f"{prefix}f1": 100.0 * sum(f1[q] for q in qids) / total, f"{prefix}total": total}


def evaluate(dataset_json: SquadJson, predictions: dict[str, str], na_probs: dict[str, float] | None = None,
             na_prob_thresh: float = 1.0, v2_rules: bool | None = None) -> dict[str, float]:
    """The official scripts' figures (see the module docstring) for a parsed dataset and {id: text}. v2_rules:
    which script's rules (and keys) apply; None: as the file says (its "version", or a question without
    answers) or as na_probs implies. run_squad.py passes its --version_2_with_negative."""
    if v2_rules is None:
        v2_rules = na_probs is not None or is_version_2(dataset_json)
    questions = read_questions(dataset_json, v2_rules)
    exact, f1 = raw_scores(questions, predictions, v2_rules)
    if not v2_rules:
        return {"exact_match": 100.0 * sum(exact.values()) / len(exact), "f1": 100.0 * sum(f1.values()) / len(f1)}
    has_answer = has_answers(dataset_json)
    probs = na_probs or {}
    exact_after = apply_no_answer_threshold(exact, probs, has_answer, na_prob_thresh)
    f1_after = apply_no_answer_threshold(f1, probs, has_answer, na_prob_thresh)
    result = _summary(exact_after, f1_after, list(questions))
    for prefix, wanted in (("HasAns_", True), ("NoAns_", False)):
        qids = [qid for qid, has in has_answer.items() if has == wanted]
        if qids:
            result.update(_summary(exact_after, f1_after, qids, prefix))
    if na_probs is not None:
        result["best_exact"], result["best_exact_thresh"] = best_threshold(predictions, exact, probs, has_answer)
        result["best_f1"], result["best_f1_thresh"] = best_threshold(predictions, f1, probs, has_answer)
    return result


def _read_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as err:
        raise ValueError(f"cannot read {what} {path}: {err.strerror}") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: malformed JSON at line {err.lineno} column {err.colno}: {err.msg}") from err


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SQuAD v1.1/v2.0 evaluation (official rules).")
    parser.add_argument("data_file", help="the SQuAD JSON with the gold answers")
    parser.add_argument("pred_file", help="predictions.json: {question id: answer text}")
    parser.add_argument("--na-prob-file", help="v2.0: {question id: no-answer probability or score}")
    parser.add_argument("--na-prob-thresh", type=float, default=1.0,
                        help="answer '' where the no-answer probability exceeds this (default 1.0)")
    args = parser.parse_args(argv)
    try:
        dataset = _read_json(args.data_file, "dataset")
        predictions = _read_json(args.pred_file, "predictions")
        na_probs = _read_json(args.na_prob_file, "no-answer probabilities") if args.na_prob_file else None
        result = evaluate(dataset, predictions, na_probs, args.na_prob_thresh)
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        print(f"squad_metrics.py: error: {err if isinstance(err, ValueError) else f'bad SQuAD file: {err!r}'}",
              file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
