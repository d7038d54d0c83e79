"""GLUE metrics, numpy only: accuracy, F1 of the positive class, Matthews correlation, Pearson and
Spearman correlation (ties get their average rank). `compute(names, predictions, labels)` -> {name: value}.

The names are those of NVIDIA's and Hugging Face's GLUE scripts: acc, f1, mcc, pearson, spearmanr."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def accuracy(predictions: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    return float((np.asarray(predictions) == np.asarray(labels)).mean())


def f1(predictions: npt.ArrayLike, labels: npt.ArrayLike, positive: int = 1) -> float:
    """F1 of class `positive`; 0 when it is never predicted nor present."""
    predicted_positive, positive_label = np.asarray(predictions) == positive, np.asarray(labels) == positive
    true_positives = float(np.sum(predicted_positive & positive_label))
    predicted, actual = float(predicted_positive.sum()), float(positive_label.sum())
    return 2 * true_positives / (predicted + actual) if predicted + actual else 0.0


def matthews_corrcoef(predictions: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    """Binary or multi-class MCC from the confusion matrix; 0 when a marginal is constant."""
    predicted, actual = np.asarray(predictions), np.asarray(labels)
    classes = np.union1d(predicted, actual)
    confusion = (actual[:, None] == classes[None, :]).T.astype(float) @ (predicted[:, None] == classes[None, :])
    total, correct = confusion.sum(), np.trace(confusion)
    true_counts, predicted_counts = confusion.sum(axis=1), confusion.sum(axis=0)
    covariance = correct * total - true_counts @ predicted_counts
    norm = np.sqrt((total ** 2 - predicted_counts @ predicted_counts) * (total ** 2 - true_counts @ true_counts))
    return float(covariance / norm) if norm else 0.0


def pearson(predictions: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    x, y = np.asarray(predictions, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    norm = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / norm) if norm else 0.0


def average_ranks(values: npt.ArrayLike) -> npt.NDArray[np.float64]:
    """1-based ranks; tied values share the mean of their ranks."""
    numbers = np.asarray(values, dtype=np.float64)
    order = np.argsort(numbers, kind="stable")
    sorted_values = numbers[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(numbers)]
    ranks = np.empty(len(numbers))
    for start, end in zip(starts, ends):
        ranks[order[start:end]] = (start + end + 1) / 2  # mean of ranks start+1 .. end
    return ranks


def spearman(predictions: npt.ArrayLike, labels: npt.ArrayLike) -> float:
    return pearson(average_ranks(predictions), average_ranks(labels))


METRICS = {"acc": accuracy, "f1": f1, "mcc": matthews_corrcoef, "pearson": pearson, "spearmanr": spearman}


def compute(names: Sequence[str], predictions: Sequence[float] | npt.NDArray[np.generic],
            labels: Sequence[float] | npt.NDArray[np.generic]) -> dict[str, float]:
    if len(predictions) != len(labels):
        raise ValueError(f"{len(predictions)} predictions for {len(labels)} labels")
    return {name: METRICS[name](predictions, labels) for name in names}
