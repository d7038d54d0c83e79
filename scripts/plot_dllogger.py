#!/usr/bin/env python
"""Plot the loss and the learning rate of a run from its dllogger JSON stream, to a PNG.

    python scripts/plot_dllogger.py results/bert_tiny/dllogger.json -o loss.png

Reads the per-step records (`step` = [epoch, global step]) of run_pretraining.py's --json-summary and draws
`average_loss` (and `all_ranks_average_loss` when the run had several ranks) above `learning_rate`, both
against the global step. A run with held-out evaluation (--eval_dir) adds its `eval_loss` to the losses
and a panel of its `eval_mlm_accuracy` and `eval_nsp_accuracy`. A resumed run appends to the same file; a
step logged twice (re-done after a kill) is drawn with its last value.
"""

import argparse
import json
import sys
from pathlib import Path

LOSS_KEYS = ("average_loss", "all_ranks_average_loss")
LR_KEY = "learning_rate"
EVAL_LOSS_KEY = "eval_loss"  # held-out MLM + NSP loss (training/evaluation.py)
EVAL_ACCURACY_KEYS = ("eval_mlm_accuracy", "eval_nsp_accuracy")


class PlotError(ValueError):
    """The input cannot be plotted (missing, unreadable, or no per-step record)."""


def read_curves(path) -> dict:
    """{key: (steps, values)} for the loss keys and the learning rate, sorted by global step."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PlotError(f"cannot read {path}: {err}") from err
    by_step = {key: {} for key in (*LOSS_KEYS, LR_KEY, EVAL_LOSS_KEY, *EVAL_ACCURACY_KEYS)}
    for number, line in enumerate(lines, 1):
        if not line.startswith("DLLL "):
            continue
        try:
            record = json.loads(line[len("DLLL "):])
        except ValueError as err:
            raise PlotError(f"{path}:{number}: not a dllogger record ({err})") from err
        step = record.get("step")
        if record.get("type") != "LOG" or not (isinstance(step, list) and len(step) == 2):
            continue
        for key, values in by_step.items():
            if key in record.get("data", {}):
                values[int(step[1])] = float(record["data"][key])
    if not by_step["average_loss"]:
        raise PlotError(f"{path} holds no per-step average_loss record: a run of fewer steps than its --log_freq "
                        "logs none, and a file other than run_pretraining.py's --json-summary has none")
    return {key: (sorted(values), [values[s] for s in sorted(values)]) for key, values in by_step.items() if values}


def plot(curves: dict, title: str):
    """A figure with the loss curve(s) on top, the learning rate below and, with held-out evaluation, its
    accuracies at the bottom; returns the figure."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    held_out = EVAL_LOSS_KEY in curves
    figure, axes = plt.subplots(3 if held_out else 2, 1, sharex=True, figsize=(8, 8 if held_out else 6),
                                height_ratios=(2, 1, 1) if held_out else (2, 1))
    loss_axes, lr_axes = axes[:2]
    for key in LOSS_KEYS:
        # One rank: all_ranks_average_loss equals average_loss, so only different curves are drawn twice.
        if key in curves and (key == "average_loss" or curves[key] != curves["average_loss"]):
            loss_axes.plot(*curves[key], label=key)
    if held_out:
        loss_axes.plot(*curves[EVAL_LOSS_KEY], "o-", label=f"{EVAL_LOSS_KEY} (held-out)")
        for key in EVAL_ACCURACY_KEYS:
            axes[2].plot(*curves[key], "o-", label=key)
        axes[2].set_ylabel("held-out accuracy")
        axes[2].legend()
        axes[2].grid(alpha=0.3)
    loss_axes.set_ylabel("loss (MLM + NSP)")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    if LR_KEY in curves:
        lr_axes.plot(*curves[LR_KEY], color="tab:green", label=LR_KEY)
    lr_axes.set_ylabel(LR_KEY)
    axes[-1].set_xlabel("global step")
    lr_axes.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    return figure


def main(argv=None):
    """Write the PNG; returns the figure (tests read its lines back)."""
    parser = argparse.ArgumentParser(description="Plot average_loss and learning_rate of a dllogger JSON to a PNG.")
    parser.add_argument("json_summary", help="the dllogger JSON stream (run_pretraining.py --json-summary)")
    parser.add_argument("-o", "--output", default="loss.png", help="PNG to write (default loss.png)")
    args = parser.parse_args(argv)
    figure = plot(read_curves(args.json_summary), title=str(args.json_summary))
    try:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(args.output, dpi=100)
    except OSError as err:
        raise PlotError(f"cannot write {args.output}: {err}") from err
    print(f"wrote {args.output}")
    return figure


if __name__ == "__main__":
    try:
        main()
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
