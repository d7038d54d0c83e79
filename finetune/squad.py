"""SQuAD v1.1 / v2.0 JSON -> examples -> BERT features, and model logits -> answer texts.

Features follow BERT's recipe: WordPiece (the project's tokenizer and vocab), ``[CLS] question [SEP]
context-window [SEP]`` with the question cut to ``max_query_length`` tokens and the context cut into
windows of ``max_seq_length - len(question) - 3`` tokens that start ``doc_stride`` tokens apart. A training
answer is a character span of the context; it becomes the span of the tokens it overlaps (so spaces and
punctuation next to the answer do not matter). A window that does not hold the whole answer, and every
window of an unanswerable v2.0 question, points at [CLS] (position 0).

Where BERT keeps a token -> whitespace-word map and re-aligns the predicted words with the original text,
we keep each context token's character offsets in the original context (the tokenizer reports them), so
a predicted token span is written back as the exact original characters it covers.
"""
import json
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self, TypeAlias, TypedDict

import numpy as np

from common.errors import InputError
from data.tokenization import load_tokenizer, special_token_id

if TYPE_CHECKING:
    from tokenizers import Tokenizer

CLS_POSITION = 0


@dataclass
class SquadExample:
    qas_id: str
    question: str
    context: str
    gold_answers: list[str] = field(default_factory=list)  # every gold answer text (for evaluation)
    answer_start: int = -1  # character offset of the training answer in context; -1: none
    answer_text: str = ""
    is_impossible: bool = False


@dataclass
class SquadFeatures:
    """One row per window. context_offsets[i, p] = (first char, end char) in the example's context of the
    token at position p, (-1, -1) outside the context; max_context[i, p]: this window gives the token its
    most context (BERT's rule), so a span starting there may be predicted from this window."""
    input_ids: np.ndarray
    attention_mask: np.ndarray
    token_type_ids: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray
    example_index: np.ndarray
    context_offsets: np.ndarray
    max_context: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


# One window of one example, before stacking: (example index, question ids, context ids, their character
# offsets, their max-context flags, (start, end) answer positions).
WindowRow: TypeAlias = tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]
# A span: (score, start logit, end logit, char start, char end); the null answer's chars are None.
Candidate: TypeAlias = tuple[float, float, float, int | None, int | None]


class NbestEntry(TypedDict):
    """One answer of nbest_predictions.json."""
    text: str
    probability: float
    start_logit: float
    end_logit: float


# ----------------------------------------------------------------------------------------------------------
# Reading


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str, path: Path) -> Any:
    """obj[key], which must be of `kind` (a type or a tuple of types); otherwise one InputError naming the file
    and the place."""
    if not isinstance(obj, dict) or key not in obj:
        raise InputError(f"{path}: {where} has no '{key}' field")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (int in kinds and isinstance(value, bool)):  # JSON true is no number
        raise InputError(f"{path}: {where}.{key} is a {type(value).__name__}, not "
                         f"{' or '.join(k.__name__ for k in kinds)}")
    return value


def load_json(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON of a file; InputError naming the file and the line/column for malformed JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as err:
        raise InputError(f"SQuAD file not found: {path}") from err
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason})") from err
    except json.JSONDecodeError as err:
        raise InputError(f"{path}: malformed JSON at line {err.lineno} column {err.colno}: {err.msg}") from err


def _training_answer(qa: Any, where: str, path: Path, context: str) -> tuple[int, str] | None:
    """(answer_start, text) of the first gold answer, or None when the context does not read the answer
    there (up to whitespace): BERT skips such questions with a warning, and so do we."""
    answers = _get(qa, "answers", list, where, path)
    if not answers:
        raise InputError(f"{path}: {where} has no answer and is not marked is_impossible")
    text = _get(answers[0], "text", str, f"{where}.answers[0]", path)
    start = _get(answers[0], "answer_start", int, f"{where}.answers[0]", path)
    found = context[start:start + len(text)]
    if found != text and " ".join(found.split()) != " ".join(text.split()):
        return None
    return start, text


def read_squad(path: str | os.PathLike[str], is_training: bool, version_2_with_negative: bool) -> list[SquadExample]:
    """The examples of a SQuAD JSON file. Training needs an answer per question (v2.0: or is_impossible);
    prediction reads answers when present (for evaluation) and does not need them."""
    path = Path(path)
    dataset = _get(load_json(path), "data", list, "the top level", path)
    examples: list[SquadExample] = []
    mismatched: list[str] = []  # where each skipped question is
    for a, article in enumerate(dataset):
        for p, paragraph in enumerate(_get(article, "paragraphs", list, f"data[{a}]", path)):
            where_p = f"data[{a}].paragraphs[{p}]"
            context = _get(paragraph, "context", str, where_p, path)
            for q, qa in enumerate(_get(paragraph, "qas", list, where_p, path)):
                example = _read_question(qa, f"{where_p}.qas[{q}]", path, context, is_training,
                                         version_2_with_negative)
                if example is None:
                    mismatched.append(f"{where_p}.qas[{q}]")
                else:
                    examples.append(example)
    if mismatched:
        print(f"warning: {path}: {len(mismatched)} training question(s) skipped: the context does not read the "
              f"answer at its answer_start (first: {mismatched[0]})", file=sys.stderr)
    if not examples:
        raise InputError(f"{path}: holds no questions")
    return examples


def _read_question(qa: Any, where: str, path: Path, context: str, is_training: bool,
                   version_2_with_negative: bool) -> SquadExample | None:
    qas_id = str(_get(qa, "id", (str, int), where, path))
    example = SquadExample(qas_id, _get(qa, "question", str, where, path), context)
    example.is_impossible = bool(qa.get("is_impossible", False))
    if example.is_impossible and not version_2_with_negative:
        raise InputError(f"{path}: {where} (id {qas_id}) is unanswerable (is_impossible): a SQuAD v2.0 file "
                         "needs --version_2_with_negative")
    if "answers" in qa:
        answers = _get(qa, "answers", list, where, path)
        example.gold_answers = [_get(answer, "text", str, f"{where}.answers[{i}]", path)
                                for i, answer in enumerate(answers)]
    if is_training and not example.is_impossible:
        answer = _training_answer(qa, where, path, context)
        if answer is None:
            return None
        example.answer_start, example.answer_text = answer
    return example


# ----------------------------------------------------------------------------------------------------------
# Features


class SquadTokenizer:
    """A BERT WordPiece `tokenizers.Tokenizer` (the project's, from a vocab.txt) with the ids a SQuAD
    feature needs."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self.tokenizer = tokenizer
        self.cls_id, self.sep_id = special_token_id(tokenizer, "[CLS]"), special_token_id(tokenizer, "[SEP]")
        pad_id = tokenizer.token_to_id("[PAD]")
        self.pad_id = 0 if pad_id is None else pad_id

    @classmethod
    def from_vocab(cls, vocab_file: str | os.PathLike[str], do_lower_case: bool = True) -> Self:
        return cls(load_tokenizer(vocab_file, do_lower_case)[0])

    def encode(self, texts: Iterable[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """[(ids array, (n, 2) character offsets array)] per text, without special tokens."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [(np.asarray(e.ids, dtype=np.int64), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2))
                for e in encodings]


def answer_token_span(offsets: np.ndarray, char_start: int, char_end: int) -> tuple[int, int] | None:
    """(first, last) index of the tokens that overlap characters [char_start, char_end), or None when no
    token does (the answer is only whitespace or characters the tokenizer drops)."""
    first = int(np.searchsorted(offsets[:, 1], char_start, side="right"))
    last = int(np.searchsorted(offsets[:, 0], char_end, side="left")) - 1
    return (first, last) if first <= last else None


def window_starts(num_tokens: int, window: int, doc_stride: int) -> list[int]:
    """Start of each context window: every doc_stride tokens until one reaches the end (BERT's rule)."""
    starts = [0]
    while starts[-1] + window < num_tokens:
        starts.append(starts[-1] + min(window, doc_stride))
    return starts


def max_context_mask(num_tokens: int, starts: list[int], window: int) -> np.ndarray:
    """[windows, num_tokens] bool: the window where each token has the most context, scored as
    min(tokens left, tokens right) + 0.01 * window length; the first such window wins ties."""
    scores = np.full((len(starts), num_tokens), -np.inf)
    for w, start in enumerate(starts):
        length = min(window, num_tokens - start)
        position = np.arange(length)
        scores[w, start:start + length] = np.minimum(position, length - 1 - position) + 0.01 * length
    best = scores.argmax(axis=0)
    return best[None, :] == np.arange(len(starts))[:, None]


def convert_examples_to_features(examples: list[SquadExample], tokenizer: SquadTokenizer, max_seq_length: int = 384,
                                 doc_stride: int = 128, max_query_length: int = 64,
                                 is_training: bool = False) -> SquadFeatures:
    """SquadFeatures of every window of every example (see the module docstring)."""
    if max_seq_length <= max_query_length + 3:
        raise InputError(f"--max_seq_length ({max_seq_length}) must be greater than --max_query_length "
                         f"({max_query_length}) + 3, to leave room for the context")
    if doc_stride < 1:
        raise InputError(f"--doc_stride must be at least 1, not {doc_stride}")
    rows: list[WindowRow] = []
    contexts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # context text -> its (ids, offsets)
    questions = tokenizer.encode(example.question for example in examples)
    for index, example in enumerate(examples):
        if example.context not in contexts:
            contexts[example.context] = tokenizer.encode([example.context])[0]
        question_ids = questions[index][0][:max_query_length]
        rows.extend(_example_windows(index, example, question_ids, contexts[example.context], max_seq_length,
                                     doc_stride, is_training))
    return _stack_rows(rows, max_seq_length, tokenizer)


def _example_windows(index: int, example: SquadExample, question_ids: np.ndarray,
                     context: tuple[np.ndarray, np.ndarray], max_seq_length: int, doc_stride: int,
                     is_training: bool) -> Iterator[WindowRow]:
    """One row tuple per window of one example."""
    context_ids, offsets = context
    window = max_seq_length - len(question_ids) - 3
    starts = window_starts(len(context_ids), window, doc_stride)
    max_context = max_context_mask(len(context_ids), starts, window)
    span = None
    if is_training and not example.is_impossible:
        span = answer_token_span(offsets, example.answer_start, example.answer_start + len(example.answer_text))
    first_context_position = len(question_ids) + 2
    for w, start in enumerate(starts):
        end = min(start + window, len(context_ids))
        answer = (CLS_POSITION, CLS_POSITION)
        if span is not None and start <= span[0] and span[1] < end:
            answer = (span[0] - start + first_context_position, span[1] - start + first_context_position)
        yield (index, question_ids, context_ids[start:end], offsets[start:end], max_context[w, start:end], answer)


def _stack_rows(rows: list[WindowRow], max_seq_length: int, tokenizer: SquadTokenizer) -> SquadFeatures:
    n = len(rows)
    features = SquadFeatures(
        input_ids=np.full((n, max_seq_length), tokenizer.pad_id, dtype=np.int64),
        attention_mask=np.zeros((n, max_seq_length), dtype=np.int64),
        token_type_ids=np.zeros((n, max_seq_length), dtype=np.int64),
        start_positions=np.zeros(n, dtype=np.int64), end_positions=np.zeros(n, dtype=np.int64),
        example_index=np.zeros(n, dtype=np.int64),
        context_offsets=np.full((n, max_seq_length, 2), -1, dtype=np.int32),
        max_context=np.zeros((n, max_seq_length), dtype=bool))
    for i, (index, question_ids, context_ids, offsets, max_context, answer) in enumerate(rows):
        first = len(question_ids) + 2
        last = first + len(context_ids)
        features.input_ids[i, :last + 1] = np.concatenate(
            [[tokenizer.cls_id], question_ids, [tokenizer.sep_id], context_ids, [tokenizer.sep_id]])
        features.attention_mask[i, :last + 1] = 1
        features.token_type_ids[i, first:last + 1] = 1
        features.context_offsets[i, first:last] = offsets
        features.max_context[i, first:last] = max_context
        features.example_index[i] = index
        features.start_positions[i], features.end_positions[i] = answer
    return features


# ----------------------------------------------------------------------------------------------------------
# Decoding: logits -> answer texts


@dataclass
class SquadPredictions:
    """What the official formats hold: predictions.json {id: text}, nbest_predictions.json
    {id: [{text, probability, start_logit, end_logit}]} and, for v2.0, null_odds.json {id: null score minus
    the best non-null score} (larger = more likely unanswerable)."""
    answers: dict[str, str]
    nbest: dict[str, list[NbestEntry]]
    null_odds: dict[str, float]


def _feature_candidates(features: SquadFeatures, f: int, start_logits: np.ndarray, end_logits: np.ndarray,
                        n_best_size: int, max_answer_length: int) -> list[Candidate]:
    """(score, start logit, end logit, char start, char end) of the valid spans among the n_best_size best
    starts x ends of one window: both in the context, start where the window has max context, end >= start,
    at most max_answer_length tokens."""
    starts = np.argsort(-start_logits, kind="stable")[:n_best_size]
    ends = np.argsort(-end_logits, kind="stable")[:n_best_size]
    offsets = features.context_offsets[f]
    s, e = np.meshgrid(starts, ends, indexing="ij")
    valid = ((offsets[s, 0] >= 0) & (offsets[e, 0] >= 0) & features.max_context[f][s]
             & (e >= s) & (e - s + 1 <= max_answer_length))
    return [(float(start_logits[i] + end_logits[j]), float(start_logits[i]), float(end_logits[j]),
             int(offsets[i, 0]), int(offsets[j, 1])) for i, j in zip(s[valid], e[valid])]


def _nbest_entries(example: SquadExample, candidates: list[Candidate], null_logits: tuple[float, float] | None,
                   n_best_size: int) -> list[NbestEntry]:
    """The n-best list of one example: candidates by score, one entry per distinct text; for v2.0
    (null_logits given) the empty answer competes with its score. As in BERT, a list without a non-empty
    text gets an 'empty' entry with zero logits."""
    if null_logits is not None:
        candidates = candidates + [(null_logits[0] + null_logits[1], *null_logits, None, None)]
    entries: list[dict[str, Any]] = []
    seen = set()
    for _, start_logit, end_logit, char_start, char_end in sorted(candidates, key=lambda c: -c[0]):
        text = "" if char_start is None else example.context[char_start:char_end]
        if text in seen:
            continue
        seen.add(text)
        entries.append({"text": text, "start_logit": start_logit, "end_logit": end_logit})
        if len(entries) == n_best_size:
            break
    if not any(entry["text"] for entry in entries):
        entries.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0})
    scores = np.array([entry["start_logit"] + entry["end_logit"] for entry in entries])
    probabilities = np.exp(scores - scores.max())
    probabilities /= probabilities.sum()
    return [{"text": entry["text"], "probability": float(probability), "start_logit": entry["start_logit"],
             "end_logit": entry["end_logit"]} for entry, probability in zip(entries, probabilities)]


def decode_predictions(examples: list[SquadExample], features: SquadFeatures, start_logits: np.ndarray,
                       end_logits: np.ndarray, n_best_size: int = 20, max_answer_length: int = 30,
                       version_2_with_negative: bool = False,
                       null_score_diff_threshold: float = 0.0) -> SquadPredictions:
    """SquadPredictions from the [features, seq] start/end logits (BERT's n-best and null-score rules).

    v2.0: the null score of a question is the smallest start[CLS] + end[CLS] over its windows; the answer
    is empty when null score - best non-null score > null_score_diff_threshold."""
    windows: list[list[int]] = [[] for _ in examples]
    for f, index in enumerate(features.example_index):
        windows[index].append(f)
    result = SquadPredictions({}, {}, {})
    for index, example in enumerate(examples):
        candidates = []
        for f in windows[index]:
            candidates += _feature_candidates(features, f, start_logits[f], end_logits[f], n_best_size,
                                              max_answer_length)
        null_logits = None
        if version_2_with_negative:  # the window's of the smallest null score, the first of equal ones
            null_logits = min(((float(start_logits[f][CLS_POSITION]), float(end_logits[f][CLS_POSITION]))
                               for f in windows[index]), key=sum)
        nbest = _nbest_entries(example, candidates, null_logits, n_best_size)
        best = next(entry for entry in nbest if entry["text"])
        result.nbest[example.qas_id] = nbest
        result.answers[example.qas_id] = best["text"]
        if null_logits is not None:
            odds = sum(null_logits) - best["start_logit"] - best["end_logit"]
            result.null_odds[example.qas_id] = odds
            if odds > null_score_diff_threshold:
                result.answers[example.qas_id] = ""
    return result
