"""GLUE tasks: the TSV layout of each file, its label set, and the features a BERT classifier reads.

Layouts are those of the files that GLUE's download script unpacks (one directory per task). Each split
names its file, whether its first line is a header, and the 0-based columns of sentence A, sentence B
(None: a single-sentence task) and the label (None: GLUE's test files, which have no label; -1: the last
column). Reading is strict: a row with too few columns, or a label outside the task's set, is an
InputError that names the file and the line, because a silently skipped or mislabelled row would change
the scores.

    task = TASKS["mrpc"]
    examples = read_examples(task, data_dir, "train")              # or an evaluation set / test set name
    features = convert_examples_to_features(examples, task, tokenizer, max_seq_length=128)
"""

import csv
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.errors import InputError
from data.tokenization import special_token_id

if TYPE_CHECKING:
    from tokenizers import Tokenizer


@dataclass(frozen=True)
class Split:
    file: str
    header: bool
    text_a: int
    text_b: int | None
    label: int | None  # None: no label (test files); -1: the last column


@dataclass(frozen=True)
class Task:
    name: str
    labels: tuple[str, ...] | None  # None: regression (a float label)
    metrics: tuple[str, ...]        # glue_metrics names
    train: Split
    dev: dict[str, Split]           # evaluation set name -> Split (MNLI: matched and mismatched)
    test: dict[str, Split]          # test set name -> Split

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    def splits(self) -> dict[str, Split]:
        return {"train": self.train, **self.dev, **{f"test_{name}": split for name, split in self.test.items()}}


def _pair_task(name: str, labels: tuple[str, ...] | None, metrics: tuple[str, ...], columns: tuple[int, int],
               test_columns: tuple[int, int], label: int = -1, header: bool = True) -> Task:
    a, b = columns
    return Task(name, labels, metrics, Split("train.tsv", header, a, b, label),
                {name: Split("dev.tsv", header, a, b, label)},
                {name: Split("test.tsv", True, *test_columns, None)})


BINARY = ("0", "1")
ENTAILMENT = ("entailment", "not_entailment")
TASKS = {
    # CoLA train/dev: no header; source, label, original label, sentence. Test: header; index, sentence.
    "cola": Task("cola", BINARY, ("mcc",), Split("train.tsv", False, 3, None, 1),
                 {"cola": Split("dev.tsv", False, 3, None, 1)}, {"cola": Split("test.tsv", True, 1, None, None)}),
    # SST-2: header; sentence, label. Test: index, sentence.
    "sst-2": Task("sst-2", BINARY, ("acc",), Split("train.tsv", True, 0, None, 1),
                  {"sst-2": Split("dev.tsv", True, 0, None, 1)}, {"sst-2": Split("test.tsv", True, 1, None, None)}),
    # mr-vader (data/vader_movie_reviews.py): header; sentence, label, mean rating. Its test split is labelled too.
    "mr-vader": Task("mr-vader", BINARY, ("acc",), Split("train.tsv", True, 0, None, 1),
                     {"mr-vader": Split("dev.tsv", True, 0, None, 1)},
                     {"mr-vader": Split("test.tsv", True, 0, None, 1)}),
    # MRPC: Quality, #1 ID, #2 ID, #1 String, #2 String. Test: index first instead of Quality.
    "mrpc": _pair_task("mrpc", BINARY, ("acc", "f1"), (3, 4), (3, 4), label=0),
    # STS-B: index, genre, filename, year, old_index, source1, source2, sentence1, sentence2, score.
    "sts-b": _pair_task("sts-b", None, ("pearson", "spearmanr"), (7, 8), (7, 8)),
    # QQP: id, qid1, qid2, question1, question2, is_duplicate. Test: id, question1, question2.
    "qqp": _pair_task("qqp", BINARY, ("acc", "f1"), (3, 4), (1, 2)),
    # QNLI: index, question, sentence, label. RTE and WNLI: index, sentence1, sentence2, label.
    "qnli": _pair_task("qnli", ENTAILMENT, ("acc",), (1, 2), (1, 2)),
    "rte": _pair_task("rte", ENTAILMENT, ("acc",), (1, 2), (1, 2)),
    "wnli": _pair_task("wnli", BINARY, ("acc",), (1, 2), (1, 2)),
    # MNLI: index, promptID, pairID, genre, 4 parses, sentence1, sentence2, annotator labels..., gold_label.
    "mnli": Task("mnli", ("contradiction", "entailment", "neutral"), ("acc",), Split("train.tsv", True, 8, 9, -1),
                 {"mnli": Split("dev_matched.tsv", True, 8, 9, -1),
                  "mnli-mm": Split("dev_mismatched.tsv", True, 8, 9, -1)},
                 {"mnli": Split("test_matched.tsv", True, 8, 9, None),
                  "mnli-mm": Split("test_mismatched.tsv", True, 8, 9, None)}),
}


@dataclass(frozen=True)
class Example:
    guid: str
    text_a: str
    text_b: str | None
    label: int | float | None  # the label's index (classification), its float value (regression), None (test)


def read_examples(task: Task, data_dir: str | os.PathLike[str], split_name: str) -> list[Example]:
    """The examples of one split ("train", an evaluation set name of task.dev, or "test_<name>")."""
    split = task.splits()[split_name]
    path = Path(data_dir) / split.file
    if not path.is_file():
        raise InputError(f"{path}: no such file ({task.name} {split_name} split)")
    needed = max(column for column in (split.text_a, split.text_b, split.label) if column is not None) + 1
    examples = []
    csv.field_size_limit(sys.maxsize)
    try:
        with open(path, encoding="utf-8", newline="") as file:
            for line_number, row in enumerate(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE), 1):
                if line_number == 1 and split.header:
                    continue
                if len(row) < needed:
                    raise InputError(f"{path}:{line_number}: {len(row)} tab-separated column(s), {task.name} "
                                     f"needs at least {needed}")
                label = None if split.label is None else parse_label(task, row[split.label], path, line_number)
                examples.append(Example(f"{split_name}-{line_number}", row[split.text_a],
                                        None if split.text_b is None else row[split.text_b], label))
    except UnicodeDecodeError as err:
        raise InputError(f"{path}: not UTF-8 text ({err.reason})") from err
    if not examples:
        raise InputError(f"{path}: no examples")
    return examples


def parse_label(task: Task, text: str, path: Path, line_number: int) -> int | float:
    if task.labels is None:
        try:
            return float(text)
        except ValueError:
            raise InputError(f"{path}:{line_number}: label {text!r} is not a number ({task.name} is a "
                             "regression task)") from None
    if text not in task.labels:
        raise InputError(f"{path}:{line_number}: label {text!r} is not one of {task.name}'s labels "
                         f"{', '.join(task.labels)}")
    return task.labels.index(text)


def convert_examples_to_features(examples: list[Example], task: Task, tokenizer: "Tokenizer",
                                 max_seq_length: int) -> dict[str, torch.Tensor]:
    """[CLS] A [SEP] (B [SEP]) as BERT: the longer side is cut first until the pair fits; segment 0 for
    [CLS] A [SEP], 1 for B [SEP]; zero padding. Returns int64 tensors input_ids, token_type_ids,
    attention_mask [N, max_seq_length] and labels [N] (float32 for regression; absent for test sets)."""
    cls_id, sep_id = special_token_id(tokenizer, "[CLS]"), special_token_id(tokenizer, "[SEP]")

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    tokens_a = encode([example.text_a for example in examples])
    tokens_b = encode([example.text_b or "" for example in examples])
    input_ids = np.zeros((len(examples), max_seq_length), dtype=np.int64)
    token_type_ids, attention_mask = np.zeros_like(input_ids), np.zeros_like(input_ids)
    for row, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        a, b = truncate_pair(a, b, max_seq_length - (3 if b else 2))
        ids = [cls_id, *a, sep_id] + ([*b, sep_id] if b else [])
        input_ids[row, :len(ids)] = ids
        token_type_ids[row, len(a) + 2:len(ids)] = 1
        attention_mask[row, :len(ids)] = 1
    features = {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_type_ids),
                "attention_mask": torch.from_numpy(attention_mask)}
    if examples and examples[0].label is not None:
        dtype = torch.float32 if task.labels is None else torch.int64
        features["labels"] = torch.tensor([example.label for example in examples], dtype=dtype)
    return features


def truncate_pair(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the end of the longer sequence (B on ties, as BERT) until len(a) + len(b) <= budget."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        (a if len(a) > len(b) else b).pop()
    return a, b
