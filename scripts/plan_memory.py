"""Predict the memory each device needs for a pretraining run, by part, and whether it fits a 32 GB
Gaudi, a 96 GB Gaudi2 and an 80 GB H100, or the one --device names (training/sizing.py does the arithmetic;
docs/memory-planner.md).

    python scripts/plan_memory.py --config scripts/bert_1.5b_config.json \
        --deepspeed_config scripts/deepspeed_config_bert_1.5b.json --world_size 8 [--device gaudi]
"""

import argparse
import json
import sys
from pathlib import Path

from common.deepspeed_config import batch_arithmetic, offload_sections
from modeling import BertConfig
from training import sizing

# Held for the whole run; the transient peak comes on top of them, and the lines printed add up to the total.
HELD_PARTS = (("parameters", "model weights (bf16, or fp32 without bf16)"),
              ("master_weights", "fp32 master weights (bf16 only; split under ZeRO-1/2)"),
              ("optimizer_states", "optimizer moments, fp32 (split under ZeRO-1/2)"),
              ("buffers", "ZeRO-1/2 gradient-reduction bucket"))
# Parts of the MLM head's backward moment, printed apart: the peak transient already holds them when that
# moment is the peak.
BACKWARD_PARTS = (("activations", "activations kept for backward (one micro-batch)"),
                  ("held_gradients", "gradients held between micro-batches (more than one per step)"))


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="model config JSON")
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON (micro-batch, bf16, ZeRO)")
    parser.add_argument("--world_size", type=int, required=True, help="data-parallel ranks (devices)")
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--max_predictions_per_seq", type=int, default=20)
    parser.add_argument("--checkpoint_activations", action="store_true")
    parser.add_argument("--checkpoint_activations_interval", type=int, default=1)
    parser.add_argument("--optimizer", default="lans", choices=sorted(sizing.OPTIMIZER_TEMPORARIES))
    parser.add_argument("--device", default=None, choices=list(sizing.DEVICES),
                        help="say whether the run fits this device only (default: every device listed)")
    return parser.parse_args(argv)


def plan(args) -> tuple:
    """(model config, sizing.TrainingSetup, device_memory parts); ValueError/OSError on bad input."""
    config = BertConfig.from_json_file(args.config)
    ds_config = json.loads(Path(args.deepspeed_config).read_text())
    if "train_micro_batch_size_per_gpu" not in ds_config:
        raise ValueError(f"{args.deepspeed_config}: train_micro_batch_size_per_gpu is not set")
    offloaded = offload_sections(ds_config.get("zero_optimization", {}))
    if offloaded:  # run_pretraining.py refuses it too
        raise ValueError(f"{args.deepspeed_config}: ZeRO offload ({', '.join(offloaded)}) is not supported by this "
                         "repository, so not planned")
    for name in ("world_size", "max_seq_length", "max_predictions_per_seq", "checkpoint_activations_interval"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    batch_arithmetic(ds_config, args.world_size, args.deepspeed_config)  # the driver's check of the global batch
    run = sizing.TrainingSetup.from_deepspeed_config(
        ds_config, args.world_size, args.max_seq_length, args.max_predictions_per_seq,
        args.checkpoint_activations_interval if args.checkpoint_activations else 0, args.optimizer)
    return config, run, sizing.device_memory(config, run)


def main(argv=None) -> int:
    args = parse_arguments(argv)
    try:
        config, run, parts = plan(args)
    except (OSError, ValueError, KeyError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"{args.config}: {sizing.parameter_count(config):,d} parameters; micro-batch {run.micro_batch} x "
          f"{run.seq_len}, {run.max_pred} predictions, {run.accumulation_steps} micro-batch(es) per step; "
          f"{'bf16' if run.bf16 else 'fp32'}, ZeRO-{run.zero_stage}, "
          f"{run.world_size} ranks, activation checkpointing "
          f"{'every ' + str(run.checkpoint_interval) + ' layer(s)' if run.checkpoint_interval else 'off'}")
    for key, text in HELD_PARTS:
        print(f"  {parts[key] / 2**30:>9.2f} GiB  {text}")
    print(f"  {parts['peak_transient'] / 2**30:>9.2f} GiB  transient, at the peak moment ({parts['peak_moment']})")
    print(f"  {parts['total'] / 2**30:>9.2f} GiB  per device at the peak (the five lines above added up)")
    print("  of the MLM head's backward moment" + (" (in the transient above):" if parts["peak_moment"].startswith(
        "backward") else " (not the peak):"))
    for key, text in BACKWARD_PARTS:
        print(f"  {parts[key] / 2**30:>9.2f} GiB  {text}")
    for device in [args.device] if args.device else sizing.DEVICES:
        print(f"  {fit_line(parts['total'], *sizing.DEVICES[device])}")
    return 0


def fit_line(total_bytes: float, label: str, gib: int) -> str:
    """What the run needs against what the device may give it, e.g. "Gaudi (32 GB)   needs 28.42 GiB; 90% of
    32 GiB is 28.80 GiB: fits"."""
    verdict = "fits" if sizing.fits(total_bytes, gib * 2**30) else "does not fit"
    return (f"{label:<15} needs {total_bytes / 2**30:.2f} GiB; {sizing.USABLE_FRACTION:.0%} of {gib} GiB is "
            f"{sizing.usable_bytes(gib * 2**30) / 2**30:.2f} GiB: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
