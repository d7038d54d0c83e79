"""Resume from a checkpoint (training/checkpointing.py's layout): load_checkpoint into a DeepSpeed engine, every
file read with torch.load(weights_only=True), and on another number of data-parallel ranks than the saving run's,
the ZeRO-1/2 optimizer state re-partitioned for this run."""

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from training.checkpointing import (
    BASE_STATE,
    FP32_PARTITIONS,
    CheckpointError,
    Manifest,
    check_compatible,
    load_partition_states,
    load_weights_only,
    param_offsets,
    rank_state_name,
    read_manifest,
    shadowed,
    zero_partition_files,
)
from training.zero_partitions import GroupPartition

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def check_resumable(output_dir: str | os.PathLike[str], tag: str, model_config: Mapping[str, Any] | None) -> None:
    """What load_checkpoint checks first, from the manifest alone (before an engine is built): CheckpointError
    when <output_dir>/<tag> is not a complete checkpoint or was saved with another model config."""
    tag_dir = Path(output_dir) / str(tag)
    check_compatible(tag_dir, _complete_manifest(tag_dir), model_config)


def _complete_manifest(tag_dir: Path) -> Manifest:
    """The manifest of checkpoint tag_dir; CheckpointError when it is not a complete checkpoint."""
    manifest, reason = read_manifest(tag_dir)
    if manifest is None:
        raise CheckpointError(f"cannot load checkpoint {tag_dir}: {reason}")
    return manifest


def saved_client_state(output_dir: str | os.PathLike[str], tag: str) -> dict[str, Any]:
    """The client_state that checkpoint <output_dir>/<tag> was saved with (the keys its manifest lists), read
    without an engine: DeepSpeed's model states file is mapped, and its weights are not read."""
    tag_dir = Path(output_dir) / str(tag)
    manifest = _complete_manifest(tag_dir)
    states = load_weights_only(tag_dir / "mp_rank_00_model_states.pt", mmap=True)
    return {key: states[key] for key in manifest["client_state_keys"]}


def load_checkpoint(engine: "DeepSpeedEngine", output_dir: str | os.PathLike[str], tag: str, global_rank: int,
                    world_size: int, *, model_config: Mapping[str, Any] | None = None,
                    say: Callable[[str], None] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Collective (DeepSpeed's load is). Loads everything checkpoint <output_dir>/<tag> holds into engine:
    weights, optimizer state, LR scheduler and DeepSpeed's step counters. Returns (client_state, rank_state).
    global_rank, world_size: this process's in the data-parallel process group (dist.get_rank(),
    dist.get_world_size()); a world size other than the manifest's means a resume on another world size.
    model_config: this run's (a dict), or None not to check it. A checkpoint saved with another one is
    refused with a CheckpointError naming the differing keys, before anything is loaded (DeepSpeed's own
    load would stop with a size-mismatch traceback, or load a same-shaped model of another config).

    Callers that want less than everything adjust afterwards: phase 2 from a phase-1 checkpoint loads it
    whole, then resets the step counters and the scheduler; --init_checkpoint does not come here (it reads
    the weights file alone).
    Another data-parallel world size than the saving run's: DeepSpeed loads the weights, scheduler and
    counters, and the ZeRO-1/2 optimizer state (fp32 master weights, moments, group steps) is
    re-partitioned here (see _repartition_optimizer_state; say(message) is told). rank_state is then
    None: the per-rank RNG states belong to ranks of the old world.
    client_state holds exactly the keys given to save_checkpoint."""
    tag_dir = Path(output_dir) / str(tag)
    manifest = _complete_manifest(tag_dir)
    check_compatible(tag_dir, manifest, model_config)
    other_world = manifest["world_size"] != world_size
    if other_world:
        _check_repartition_possible(tag_dir, manifest, engine, world_size)
    # DeepSpeed loads ZeRO-0 optimizer state (whole tensors) on any world size, ZeRO-1/2 partitions not.
    repartition = other_world and _is_partitioned(tag_dir)
    with _weights_only_loads(engine):
        load_path, ds_state = engine.load_checkpoint(str(output_dir), str(tag), load_module_strict=True,
                                                     load_optimizer_states=not repartition)
    if load_path is None:
        raise CheckpointError(f"DeepSpeed found no model states file in {tag_dir}")
    client_state = {key: ds_state[key] for key in manifest["client_state_keys"]}
    if other_world:
        if repartition:
            _repartition_optimizer_state(engine, tag_dir)
        if say is not None:
            say(f"checkpoint {tag_dir} was written by {manifest['world_size']} data-parallel ranks, this run has "
                f"{world_size}: " + ("re-partitioned its ZeRO optimizer state (fp32 weights, moments, steps); "
                                if repartition else "") + "per-rank RNG states not restored")
        return client_state, None
    rank_state = torch.load(tag_dir / rank_state_name(global_rank), map_location="cpu", weights_only=True)
    return client_state, rank_state


def _is_partitioned(tag_dir: Path) -> bool:
    """ZeRO-1/2 checkpoints hold the optimizer state in per-rank partition files; ZeRO-0 ones in
    DeepSpeed's model states file, which any world size loads as it is."""
    return bool(zero_partition_files(tag_dir))


def _check_repartition_possible(tag_dir: Path, manifest: Manifest, engine: "DeepSpeedEngine", world: int) -> None:
    """One clear error, before anything is loaded, when the optimizer state cannot move to this run."""
    from training import zero_partitions
    saved_partitioned = _is_partitioned(tag_dir)
    partitioned_now = zero_partitions.group_partitions(engine.optimizer) is not None
    if saved_partitioned != partitioned_now:
        saved_stage = manifest.get("optimizer_layout", {}).get("zero_stage", "1/2" if saved_partitioned else 0)
        raise CheckpointError(
            f"checkpoint {tag_dir} was written with ZeRO stage {saved_stage} by {manifest['world_size']} ranks; "
            f"this run has {world} ranks and ZeRO stage {engine.zero_optimization_stage()}: across world sizes "
            f"the optimizer state moves between ZeRO-1/2 layouts or between ZeRO-0 layouts only")


def _weights_only_loads(engine: "DeepSpeedEngine") -> contextlib.AbstractContextManager[None]:
    """DeepSpeed's TorchCheckpointEngine.load calls torch.load(weights_only=False), i.e. full pickle.
    Every checkpoint read of engine.load_checkpoint goes through engine.checkpoint_engine.load, so
    shadowing it makes those reads weights_only=True (see load_weights_only)."""
    return shadowed(engine, "load", load_weights_only)


def _read_flat_range(pieces: list[torch.Tensor], start: int, out: torch.Tensor) -> None:
    """Copy values start .. start + out.numel() of the concatenation of `pieces` into `out` (1-D),
    reading only the pieces that overlap them."""
    end, piece_start = start + out.numel(), 0
    for piece in pieces:
        piece_end = piece_start + piece.numel()
        low, high = max(start, piece_start), min(end, piece_end)
        if low < high:
            out.narrow(0, low - start, high - low).copy_(piece.reshape(-1).narrow(0, low - piece_start, high - low))
        piece_start = piece_end


@torch.no_grad()
def _repartition_optimizer_state(engine: "DeepSpeedEngine", tag_dir: Path) -> None:
    """Fill this rank's ZeRO-1/2 partitions from a checkpoint written by another number of ranks: each
    fragment of this run's partitions (DeepSpeed's own metadata, training/zero_partitions.py) of the fp32
    master weights and of every partitioned optimizer state tensor (LANS/Adam moments) is copied from the
    saved partitions that overlap it; per-group values (the step, hyperparameters) are copied. The files
    are mapped, not read whole: each rank reads only the slices it keeps (a restart of the 5B on fewer
    servers would otherwise hold every rank's state in every rank)."""
    from training import zero_partitions
    states = load_partition_states(zero_partition_files(tag_dir), mmap=True)
    param_shapes = load_weights_only(tag_dir / "mp_rank_00_model_states.pt", mmap=True)["param_shapes"]
    parts = zero_partitions.group_partitions(engine.optimizer)
    assert parts is not None  # _check_repartition_possible: this run partitions its optimizer state too
    client = engine.optimizer.optimizer
    if not all(isinstance(state[BASE_STATE], dict) for state in states):
        raise CheckpointError(f"{tag_dir}: optimizer state saved with zero_optimization.elastic_checkpoint; "
                              f"resume it on the world size that wrote it")
    if [[tuple(p.shape) for p in part.params] for part in parts] != \
            [[tuple(shape) for shape in shapes.values()] for shapes in param_shapes]:
        raise CheckpointError(f"{tag_dir}: the checkpoint's parameter groups differ from this run's")
    for group, (part, shapes) in enumerate(zip(parts, param_shapes)):
        saved = [state[BASE_STATE]["state"].get(group, {}) for state in states]
        target = client.state[part.flat]
        fp32_pieces = [state[FP32_PARTITIONS][group] for state in states]
        offsets = param_offsets(states, group, shapes, fp32_pieces)
        _fill_fragments(part, offsets, fp32_pieces, part.flat)
        for key, value in saved[0].items():
            # DeepSpeed saves the fp32 partitions without the last rank's end padding, the states with it.
            partitioned = all(torch.is_tensor(s[key]) and s[key].dim() == 1 and s[key].numel() ==
                              state[FP32_PARTITIONS][group].numel() + state["group_paddings"][group]
                              for s, state in zip(saved, states))
            if partitioned:
                target[key] = torch.zeros_like(part.flat)
                _fill_fragments(part, offsets, [s[key] for s in saved], target[key])
            else:
                target[key] = value.to(part.flat.device) if torch.is_tensor(value) else value
        saved_group = states[0][BASE_STATE]["param_groups"][group]
        client.param_groups[group].update({k: v for k, v in saved_group.items() if k != "params"})


def _fill_fragments(part: GroupPartition, offsets: list[int], pieces: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy the parts of the saved group (the concatenation of `pieces`, parameters at `offsets`) that
    this rank holds into `flat`, shaped like its partition."""
    for fragment in part.fragments:
        _read_flat_range(pieces, offsets[fragment.param_index] + fragment.param_start,
                         flat.narrow(0, fragment.partition_start, fragment.numel))
