#!/usr/bin/env python
"""Plot the loss and the learning rate of a run from its dllogger JSON stream, to a PNG.

    python scripts/plot_dllogger.py results/bert_tiny/dllogger.json -o loss.png

Reads the per-step records (`step` = [epoch, global step]) of run_pretraining.py's --json-summary and draws
`average_loss` (and `all_ranks_average_loss` when the run had several ranks) above `learning_rate`, both
against the global step. A resumed run appends to the same file; a step logged twice (re-done after a
kill) is drawn with its last value.
"""

import argparse
import json
import sys
from pathlib import Path

LOSS_KEYS = ("average_loss", "all_ranks_average_loss")
LR_KEY = "learning_rate"


class PlotError(ValueError):
    """The input cannot be plotted (missing, unreadable, or no per-step record)."""


def read_curves(path) -> dict:
    """{key: (steps, values)} for the loss keys and the learning rate, sorted by global step."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise PlotError(f"cannot read {path}: {err}") from err
    by_step = {key: {} for key in (*LOSS_KEYS, LR_KEY)}
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
    """A figure with the loss curve(s) on top and the learning rate below; returns the figure."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    figure, (loss_axes, lr_axes) = plt.subplots(2, 1, sharex=True, figsize=(8, 6), height_ratios=(2, 1))
    for key in LOSS_KEYS:
        # One rank: all_ranks_average_loss equals average_loss, so only different curves are drawn twice.
        if key in curves and (key == "average_loss" or curves[key] != curves["average_loss"]):
            loss_axes.plot(*curves[key], label=key)
    loss_axes.set_ylabel("loss (MLM + NSP)")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    if LR_KEY in curves:
        lr_axes.plot(*curves[LR_KEY], color="tab:green", label=LR_KEY)
    lr_axes.set_ylabel(LR_KEY)
    lr_axes.set_xlabel("global step")
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
