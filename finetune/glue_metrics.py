"""GLUE metrics, numpy only: accuracy, F1 of the positive class, Matthews correlation, Pearson and
Spearman correlation (ties get their average rank). `compute(names, predictions, labels)` -> {name: value}.

The names are those of NVIDIA's and Hugging Face's GLUE scripts: acc, f1, mcc, pearson, spearmanr."""

import numpy as np


def accuracy(predictions, labels) -> float:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    return float((predictions == labels).mean())


def f1(predictions, labels, positive=1) -> float:
    """F1 of class `positive`; 0 when it is never predicted nor present."""
    predictions, labels = np.asarray(predictions) == positive, np.asarray(labels) == positive
    true_positives = float(np.sum(predictions & labels))
    predicted, actual = float(predictions.sum()), float(labels.sum())
    return 2 * true_positives / (predicted + actual) if predicted + actual else 0.0


def matthews_corrcoef(predictions, labels) -> float:
    """Binary or multi-class MCC from the confusion matrix; 0 when a marginal is constant."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    classes = np.union1d(predictions, labels)
    confusion = (labels[:, None] == classes[None, :]).T.astype(float) @ (predictions[:, None] == classes[None, :])
    total, correct = confusion.sum(), np.trace(confusion)
    true_counts, predicted_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    covariance = correct * total - true_counts @ predicted_counts
    norm = np.sqrt((total ** 2 - predicted_counts @ predicted_counts) * (total ** 2 - true_counts @ true_counts))
    return float(covariance / norm) if norm else 0.0


def pearson(predictions, labels) -> float:
    x, y = np.asarray(predictions, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    norm = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / norm) if norm else 0.0


def average_ranks(values) -> np.ndarray:
    """1-based ranks; tied values share the mean of their ranks."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values))
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2  # mean of ranks start+1 .. end
    return ranks


def spearman(predictions, labels) -> float:
    return pearson(average_ranks(predictions), average_ranks(labels))


METRICS = {"acc": accuracy, "f1": f1, "mcc": matthews_corrcoef, "pearson": pearson, "spearmanr": spearman}


def compute(names, predictions, labels) -> dict:
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    return {name: METRICS[name](predictions, labels) for name in names}
