"""Export for fine-tuning: a checkpoint's fp32 module weights as one plain state dict (ZeRO-1/2: re-assembled from
the per-rank optimizer partitions), read without an engine or process group; and its command,
`python -m training.checkpointing export --output_dir D [--tag T] --out model.pt` (D may be s3://bucket/prefix)."""

import argparse
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from common import storage
from common.atomic_write import write_atomically
from training import checkpoint_s3
from training.checkpointing import (
    FP32_PARTITIONS,
    CheckpointError,
    choose_tag,
    load_partition_states,
    load_weights_only,
    param_offsets,
    read_manifest,
    zero_partition_files,
)


def consolidated_state_dict(output_dir: str | os.PathLike[str], tag: str | None = None) -> dict[str, torch.Tensor]:
    """fp32 module weights of a complete checkpoint, keyed as modeling.py's state_dict, for
    fine-tuning or export; no engine or process group needed, every file read with weights_only=True.

    tag None picks the checkpoint find_resume_tag would (any world size). ZeRO-1/2: the fp32 master
    weights, re-assembled from every rank's optimizer partition. ZeRO-0: the module file's weights
    (in a bf16 run these are the bf16 values, upcast)."""
    return consolidated_checkpoint(output_dir, tag)[1]


def consolidated_checkpoint(output_dir: str | os.PathLike[str],
                            tag: str | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(the model config recorded in the manifest, consolidated_state_dict(output_dir, tag))."""
    output_path = Path(output_dir)
    if tag is None:
        chosen = choose_tag(output_path)
        if chosen is None:
            raise CheckpointError(f"no checkpoint in {output_path}")
        tag = chosen[0]
    tag_dir = output_path / str(tag)
    manifest, reason = read_manifest(tag_dir)
    if manifest is None:
        raise CheckpointError(f"cannot export checkpoint {tag_dir}: {reason}")
    model_states = load_weights_only(tag_dir / "mp_rank_00_model_states.pt")
    module = model_states["module"]
    partition_files = zero_partition_files(tag_dir)
    if not partition_files:
        return manifest["model_config"], {name: value.detach().float() if value.is_floating_point()
                                          else value.detach() for name, value in module.items()}
    states = load_partition_states(partition_files)
    weights: dict[str, torch.Tensor] = {}
    for group, shapes in enumerate(model_states["param_shapes"]):
        weights.update(_split_group(states, group, shapes, [state[FP32_PARTITIONS][group] for state in states]))
    for name, source in (model_states.get("shared_params") or {}).items():
        weights[name] = weights[source]  # tied weights are stored once (e.g. the MLM decoder)
    for name in module.keys() - weights.keys():
        weights[name] = module[name].detach()  # buffers
    return manifest["model_config"], {name: weights[name] for name in module}


def saved_optimizer_states(output_dir: str | os.PathLike[str], tag: str) -> list[dict[str, Any]]:
    """The optimizer state of checkpoint <output_dir>/<tag> as saved, read without an engine: ZeRO-1/2,
    every rank's state dict in rank order (the client optimizer's own under "base_optimizer_state");
    ZeRO-0, the one state dict of the model states file."""
    tag_dir = Path(output_dir) / str(tag)
    partition_files = zero_partition_files(tag_dir)
    if partition_files:
        return load_partition_states(partition_files)
    return [load_weights_only(tag_dir / "mp_rank_00_model_states.pt")["optimizer"]]


def _split_group(states: list[dict[str, Any]], group: int, shapes: Mapping[str, torch.Size],
                 pieces: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: full tensor} of a param group (see param_offsets): every parameter, for an export."""
    flat = torch.cat(pieces)
    return {name: flat[offset:offset + math.prod(shape)].view(shape).clone()
            for offset, (name, shape) in zip(param_offsets(states, group, shapes, pieces), shapes.items())}


def read_on_the_cpu() -> None:
    """For a process that only reads checkpoints (the exports; call it before DeepSpeed's first import): DeepSpeed,
    imported for the classes its files name (checkpointing.deepspeed_checkpoint_classes), takes the CPU accelerator,
    with no 'Setting accelerator to CPU' warning where none was chosen. A DS_ACCELERATOR already set is kept."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def export_main(argv: list[str] | None = None) -> int:
    """`python -m training.checkpointing export --output_dir D [--tag T] --out model.pt`: one clear error
    line and exit status 1 on failure."""
    parser = argparse.ArgumentParser(description="Write a checkpoint's fp32 weights as a plain state dict.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="consolidated fp32 module weights -> torch.save file")
    export.add_argument("--output_dir", required=True, help="the training run's --output_dir")
    export.add_argument("--tag", default=None, help="checkpoint tag (default: the one resume would use)")
    export.add_argument("--out", required=True, help="file to write (loadable with weights_only=True)")
    export.add_argument("--s3_endpoint_url", default=None, help="S3-compatible endpoint for an s3:// "
                        "--output_dir (default: AWS_ENDPOINT_URL, else AWS)")
    args = parser.parse_args(argv)
    read_on_the_cpu()
    try:
        if storage.is_s3_url(args.output_dir):
            weights = _export_from_s3(args.output_dir, args.tag, args.s3_endpoint_url)
        else:
            weights = consolidated_state_dict(args.output_dir, args.tag)
        write_atomically(Path(args.out).resolve(), lambda f: torch.save(weights, f))
    except (CheckpointError, OSError, storage.StorageError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {len(weights)} tensors to {args.out}")
    return 0


def _export_from_s3(url: str, tag: str | None, endpoint: str | None) -> dict[str, torch.Tensor]:
    """consolidated_state_dict of a checkpoint on S3, downloaded into a temporary directory."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="checkpoint-export-") as local:
        tag = checkpoint_s3.fetch_checkpoint(storage.S3Store(url, endpoint), local, tag)
        if tag is None:
            raise CheckpointError(f"no checkpoint in {url}")
        return consolidated_state_dict(local, tag)
