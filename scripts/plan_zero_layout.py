"""Print DeepSpeed's ZeRO-1/2 partition layout of a BERT pretraining run on N devices, its checkpoint size and
LANS's norm all-reduces per step, without running it (docs/several-servers.md#128-devices-on-paper).

    python scripts/plan_zero_layout.py --config scripts/bert_5b_config.json \
        --deepspeed_config scripts/deepspeed_config_bert_5b.json --world_size 128

The layout is training/zero_partitions.planned_layout over the param groups run_pretraining.py builds
(optimization.get_parameter_groups, on a model built on the meta device: nothing is allocated).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from modeling import BertConfig, BertForPreTraining
from optimization import get_parameter_groups
from training import sizing
from training.zero_partitions import planned_layout

FP32_BYTES = 4
# LANS with tensor blocks (--lans_blocks tensor) all-reduces per group and step: the gradient norms of the
# group's tensors, then their weight and two direction norms (lans.AdaptiveMomentOptimizer.norms_from_squares).
LANS_REDUCED_NORMS = (1, 3)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="model config JSON")
    parser.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON (bf16, ZeRO stage)")
    parser.add_argument("--world_size", type=int, required=True, help="data-parallel ranks (devices)")
    return parser.parse_args(argv)


def named_groups(config: BertConfig) -> list[list[tuple[str, int]]]:
    """(name, values) of every parameter of each param group, in the order run_pretraining.py gives them."""
    with torch.device("meta"):
        model = BertForPreTraining(config)
    names = {id(param): name for name, param in model.named_parameters()}
    return [[(names[id(param)], param.numel()) for param in group["params"]] for group in get_parameter_groups(model)]


def group_figures(group: list[tuple[str, int]], world_size: int) -> dict:
    """The layout figures of one param group (see report)."""
    layout = planned_layout([numel for _, numel in group], world_size)
    whole = [sum(f.numel == layout.numels[f.param_index] for f in fragments) for fragments in layout.ranks]
    spans = [sum(any(f.param_index == index for f in fragments) for fragments in layout.ranks)
             for index in range(len(group))]
    widest = max(range(len(group)), key=spans.__getitem__)
    return {"tensors": len(group), "values": sum(layout.numels), "padding": layout.padding,
            "partition_size": layout.partition_size,
            "tensors_touched": [len(fragments) for fragments in layout.ranks],
            "ranks_without_a_whole_tensor": sum(count == 0 for count in whole),
            "tensors_split": sum(ranks > 1 for ranks in spans),
            "widest_tensor": {"name": group[widest][0], "ranks": spans[widest]}}


def layout_figures(groups: list[list[tuple[str, int]]], world_size: int, element_bytes: int) -> dict:
    """The figures printed, as a dict (see report). groups: named_groups(); element_bytes: of the model weights."""
    figures = [group_figures(group, world_size) for group in groups]
    partition_values = sum(group["partition_size"] for group in figures)
    optimizer_file = (FP32_BYTES + sizing.MOMENT_BYTES) * partition_values
    # The model weights are views of DeepSpeed's flat groups, whose storages torch.save writes whole
    model_file = element_bytes * world_size * partition_values
    return {
        "world_size": world_size,
        "groups": figures,
        # fp32 master weights + two moments per partition value (padding included: DeepSpeed saves views of the
        # padded partitions, and torch.save writes a view's whole storage); the model weights once, on rank 0
        "checkpoint_bytes": {"optimizer_file_per_rank": optimizer_file, "model_file_rank0": model_file,
                             "total": world_size * optimizer_file + model_file},
        "lans_all_reduces_per_step": [{"group": g, "values": reduced * group["tensors"]}
                                      for g, group in enumerate(figures) for reduced in LANS_REDUCED_NORMS],
    }


def gigabytes(count: int) -> str:
    return f"{count / 1e9:.2f} GB"


def report(figures: dict) -> list[str]:
    lines = [f"ZeRO-1/2 layout over {figures['world_size']} data-parallel ranks "
             "(DeepSpeed 0.19.8: each param group end to end, padded, cut into equal partitions)"]
    for g, group in enumerate(figures["groups"]):
        touched, widest = group["tensors_touched"], group["widest_tensor"]
        lines += [f"  group {g}: {group['tensors']} tensors, {group['values']:,} values + {group['padding']} padding; "
                  f"partition {group['partition_size']:,} values per rank",
                  f"    tensors a rank's partition touches: {min(touched)} to {max(touched)}; "
                  f"partitions holding no whole tensor: {group['ranks_without_a_whole_tensor']}",
                  f"    tensors split between ranks: {group['tensors_split']}; the widest, {widest['name']}, "
                  f"spans {widest['ranks']} ranks"]
    sizes = figures["checkpoint_bytes"]
    lines += ["checkpoint (the bytes of its tensors; each file adds some KB of pickle)",
              f"  per rank: {gigabytes(sizes['optimizer_file_per_rank'])} "
              "(zero_pp_rank_<r>_mp_rank_00_optim_states.pt: fp32 master weights + 2 fp32 moments)",
              f"  rank 0 also: {gigabytes(sizes['model_file_rank0'])} (mp_rank_00_model_states.pt: model weights)",
              f"  total: {gigabytes(sizes['total'])}"]
    reduces = figures["lans_all_reduces_per_step"]
    lines.append(f"LANS norm all-reduces per optimizer step (--lans_blocks tensor): {len(reduces)}, fp32 values: "
                 + ", ".join(f"{r['values']:,} (group {r['group']})" for r in reduces))
    return lines


def main(argv=None) -> int:
    args = parse_arguments(argv)
    try:
        if args.world_size < 1:
            raise ValueError(f"--world_size must be at least 1, got {args.world_size}")
        config = BertConfig.from_json_file(args.config)
        ds_config = json.loads(Path(args.deepspeed_config).read_text())
        if ds_config.get("zero_optimization", {}).get("stage", 0) not in (1, 2):
            raise ValueError(f"{args.deepspeed_config}: not ZeRO stage 1 or 2, so nothing is partitioned")
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    element_bytes = 2 if ds_config.get("bf16", {}).get("enabled") else FP32_BYTES
    print("\n".join(report(layout_figures(named_groups(config), args.world_size, element_bytes))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
