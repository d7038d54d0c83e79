"""The floor of a single-sentence task: a bag-of-words logistic regression (scikit-learn), on mr-vader by default.

    python data/vader_movie_reviews.py --output_dir results/mr-vader
    python bench/bench_bow_baseline.py --data_dir results/mr-vader [--task_name mr-vader]

Features: word counts (scikit-learn's CountVectorizer: lower-cased words of two or more letters or digits, every
word of the training split, no stop list), binary (present or not). Model: L2-regularised logistic regression
(lbfgs). Its one setting, the inverse regularisation strength C, is chosen on the dev split from C_GRID; the test
split is scored once, with that C. The splits are read by finetune/glue.py's reader, as run_glue.py reads them.
Prints one JSON line: the chosen C, the dev accuracy of every C, dev and test accuracy, split sizes.

Needs scikit-learn, which the project does not: bench/requirements-bow-baseline.txt (pinned, installs into the
project's environment beside its numpy).
"""

import argparse
import json
import sys

import numpy as np

from common.errors import InputError
from finetune.glue import TASKS, read_examples

C_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


def split_arrays(task, data_dir, name):
    examples = read_examples(task, data_dir, name)
    return [e.text_a for e in examples], np.array([e.label for e in examples])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True, help="the task's TSV files (train, dev, labelled test)")
    parser.add_argument("--task_name", default="mr-vader", choices=sorted(
        name for name, task in TASKS.items() if task.train.text_b is None and task.labels is not None))
    args = parser.parse_args(argv)
    try:
        from sklearn.feature_extraction.text import CountVectorizer
        from sklearn.linear_model import LogisticRegression
    except ImportError:
        print("error: scikit-learn is not installed: pip install -r bench/requirements-bow-baseline.txt",
              file=sys.stderr)
        return 1
    task = TASKS[args.task_name]
    (dev_name,), (test_name,) = task.dev, task.test
    try:
        splits = {name: split_arrays(task, args.data_dir, name)
                  for name in ("train", dev_name, f"test_{test_name}")}
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if any(labels.dtype == object for _, labels in splits.values()):
        print(f"error: {args.data_dir}: the test split has no labels (GLUE's); this benchmark needs a labelled one",
              file=sys.stderr)
        return 1
    vectorizer = CountVectorizer(lowercase=True, binary=True)
    features = {name: (vectorizer.fit_transform(texts) if name == "train" else vectorizer.transform(texts), labels)
                for name, (texts, labels) in splits.items()}

    def fitted(c):
        return LogisticRegression(C=c, max_iter=5000).fit(*features["train"])

    def accuracy(model, name):
        x, y = features[name]
        return float((model.predict(x) == y).mean())

    dev_by_c = {c: accuracy(fitted(c), dev_name) for c in C_GRID}
    best = max(C_GRID, key=lambda c: (dev_by_c[c], -c))  # ties: the stronger regularisation
    model = fitted(best)
    print(json.dumps({"task": args.task_name, "C": best, "dev_acc_by_C": dev_by_c,
                      "dev_acc": accuracy(model, dev_name), "test_acc": accuracy(model, f"test_{test_name}"),
                      "vocabulary": len(vectorizer.vocabulary_),
                      "sizes": {name: len(labels) for name, (_, labels) in splits.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
