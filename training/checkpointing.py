"""Crash-safe training checkpoints around DeepSpeed's engine.save_checkpoint / load_checkpoint.

Layout of one checkpoint (``<output_dir>/<tag>/``)::

    mp_rank_00_model_states.pt                 DeepSpeed: weights, LR scheduler, counters, client_state
    *zero_pp_rank_<r>_mp_rank_00_optim_states.pt   DeepSpeed (ZeRO 1/2): optimizer partition of rank r
    state_<r>.pt                               ours: per-rank state (RNG states), one per global rank
    complete.json                              ours: manifest, written last

``<output_dir>/latest`` holds the tag of the newest complete checkpoint (same format as DeepSpeed's,
so DeepSpeed's ``zero_to_fp32.py``, which ZeRO saves copy into ``<output_dir>``, and
``engine.load_checkpoint(dir)`` still find it).

Commit protocol: a checkpoint exists only once its manifest exists. The manifest is written by rank 0
(commit_checkpoint) after a barrier that follows every rank's writes, and ``latest`` is replaced only after
the manifest. Both are written to a temporary name and renamed (``os.replace`` is atomic on POSIX), so a kill
at any moment leaves ``latest`` naming a complete checkpoint, or leaves the previous ``latest`` untouched.

S3: with an s3:// output directory, checkpoints are written locally as above and then copied by
CheckpointUploader (files, manifest, then `latest`: the order is the commit there); resume and export
fetch the checkpoint they need (see the section "copies on S3").

Export for fine-tuning: consolidated_state_dict(output_dir, tag) gives the fp32 module weights
(ZeRO-1/2: re-assembled from the per-rank optimizer partitions); from the shell:
``python -m training.checkpointing export --output_dir D [--tag T] --out model.pt`` (D may be s3://bucket/prefix).

Reading a checkpoint without an engine (tests, tools): read_manifest(tag_dir) and
saved_optimizer_states(output_dir, tag).

Trust: DeepSpeed 0.19.8 reads its own ``*_states.pt`` files with ``torch.load(weights_only=False)``
(``TorchCheckpointEngine.load``), i.e. with full pickle, which can run arbitrary code. Load only
checkpoints you (or someone you trust) wrote. load_checkpoint and consolidated_state_dict route
every read through torch.load(weights_only=True) instead, allowing only DeepSpeed's three plain
classes (see _deepspeed_checkpoint_classes).
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common import storage
from common.atomic_write import fsync_path, write_atomically, write_text_atomically

MANIFEST_NAME = "complete.json"
LATEST_NAME = "latest"
MANIFEST_FORMAT_VERSION = 1
_MANIFEST_KEYS = {"format_version", "tag", "world_size", "model_config", "model_config_sha256",
                  "client_state_keys", "files", "saved_at_unix"}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or none of the checkpoints present can be resumed from."""


class CheckpointWarning(UserWarning):
    """Resume falls back to an older checkpoint, or ignores an unfinished one."""


def rank_state_name(global_rank: int) -> str:
    return f"state_{global_rank}.pt"


def model_config_hash(model_config: dict) -> str:
    """sha256 of the config's canonical JSON (sorted keys), so key order does not matter."""
    return hashlib.sha256(json.dumps(model_config, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- distributed helpers

def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _raise_if_any_rank_failed(error: str | None, what: str, device) -> None:
    """Collective: every rank calls it. Acts as a barrier and turns one rank's failure into an
    error on all ranks (a rank that raised alone would leave the others hanging in the next barrier).
    device: where the backend can reduce (the engine's device: nccl and hccl need device tensors)."""
    _, world = _rank_and_world()
    failed = int(error is not None)
    if world > 1:
        flag = torch.tensor([failed], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        failed = int(flag.item())
    if error is not None:
        raise CheckpointError(error)
    if failed:
        raise CheckpointError(f"{what}: {failed} other rank(s) failed (see their error message)")


# --------------------------------------------------------------------------- RNG state

def capture_rng_state(device=None) -> dict:
    """Every RNG state of this process as ints, lists and tensors only, so that the file can be read
    back with torch.load(weights_only=True). device: the run's (torch.device; None: the CPU). A CUDA run
    saves its own device's generator (the only one its ranks draw from: each uses cuda:LOCAL_RANK of the
    devices the launcher shows to every local rank); a CPU run saves none, also where CUDA is available, so
    that a CPU checkpoint resumes on a machine without CUDA (and no CUDA context is created for it)."""
    _, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": {"keys": np_keys.tolist(), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch_cpu": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    hpu_random = _hpu_random_module()
    if hpu_random is not None:
        state["hpu"] = hpu_random.get_rng_state()
    return state


def own_cuda_rng_state(saved, device_index: int):
    """The CUDA generator state a rank on cuda:device_index restores from a checkpoint's "cuda" entry: the
    entry itself (one device's, capture_rng_state), or, in checkpoints written before 2026-11-27 (the states of
    every device the rank could see, torch.cuda.get_rng_state_all), the one of its own device index."""
    if torch.is_tensor(saved):
        return saved
    if device_index >= len(saved):
        raise CheckpointError(f"checkpoint holds the CUDA RNG states of {len(saved)} devices, none for this rank's "
                              f"cuda:{device_index}: resume with as many devices per server as the run that saved it")
    return saved[device_index]


def restore_rng_state(state: dict, device=None) -> None:
    """Inverse of capture_rng_state (device: the run's, as there). A device RNG state saved on another device
    type is an error, since resuming would silently change the random stream."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    np.random.set_state(("MT19937", np.asarray(np_state["keys"], dtype=np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["cached_gaussian"]))
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state:
        if device is None or device.type != "cuda":
            raise CheckpointError("checkpoint holds a CUDA RNG state but this run is not on CUDA")
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_rng_state(own_cuda_rng_state(state["cuda"], index), device)
    if "hpu" in state:
        hpu_random = _hpu_random_module()
        if hpu_random is None:
            raise CheckpointError("checkpoint holds an HPU RNG state but habana_frameworks is not loaded")
        hpu_random.set_rng_state(state["hpu"])


def _hpu_random_module():
    # Only when the driver has already imported the Habana bridge (--use_hpu); never import it here.
    if "habana_frameworks.torch" not in sys.modules:
        return None
    import habana_frameworks.torch.hpu.random as hpu_random
    return hpu_random


# --------------------------------------------------------------------------- save

def save_checkpoint(engine, output_dir, tag: str, client_state: dict, rank_state: dict) -> None:
    """Collective: every rank calls it with the same tag and client_state.

    client_state must hold "model_config" (a dict); it goes into DeepSpeed's model_states file.
    rank_state (this rank's RNG states etc.) goes into <tag>/state_<global_rank>.pt.
    Raises CheckpointError (on every rank) when the checkpoint cannot be written; the previous
    checkpoints and `latest` are then untouched."""
    if "model_config" not in client_state:
        raise CheckpointError("client_state has no 'model_config': resume could not check the model")
    output_dir, tag = Path(output_dir), str(tag)
    rank, world = _rank_and_world()
    tag_dir = output_dir / tag
    _raise_if_any_rank_failed(_prepare_tag_dir(output_dir, tag) if rank == 0 else None,
                              f"preparing checkpoint {tag_dir}", engine.device)
    error, deepspeed_write_errors = None, []
    try:
        # save_latest=False: DeepSpeed would write `latest` non-atomically and before our manifest.
        with _file_object_saves(engine, deepspeed_write_errors):
            engine.save_checkpoint(str(output_dir), tag, client_state=client_state, save_latest=False)
        if deepspeed_write_errors:
            raise deepspeed_write_errors[0]
        # Every file of the tag goes through write_atomically, which fsyncs it and the directory;
        # no further fsync is needed (see commit_checkpoint for checkpoint engines that write on their own).
        write_atomically(tag_dir / rank_state_name(rank), lambda f: torch.save(rank_state, f))
    except OSError as exc:
        error = f"cannot write checkpoint {tag_dir} on rank {rank}: {exc}"
    try:
        _raise_if_any_rank_failed(error, f"writing checkpoint {tag_dir}", engine.device)
    except CheckpointError:
        if rank == 0:  # free the space of the half-written tag (it has no manifest, so is never used)
            shutil.rmtree(tag_dir, ignore_errors=True)
        raise
    error = None
    if rank == 0:
        try:
            commit_checkpoint(output_dir, tag, world, client_state, fsync_files=not _is_plain_torch_engine(engine),
                              layout=_optimizer_layout(engine))
        except OSError as exc:
            error = f"cannot commit checkpoint {tag_dir}: {exc}"
    _raise_if_any_rank_failed(error, f"committing checkpoint {tag_dir}", engine.device)


@contextlib.contextmanager
def _shadowed(engine, method: str, replacement):
    """Replace engine.checkpoint_engine.<method> on the instance for the duration, if it is DeepSpeed's
    plain TorchCheckpointEngine (other checkpoint engines have their own I/O and are left alone)."""
    checkpoint_engine = engine.checkpoint_engine
    if not _is_plain_torch_engine(engine):
        yield
        return
    setattr(checkpoint_engine, method, replacement)
    try:
        yield
    finally:
        delattr(checkpoint_engine, method)


def _is_plain_torch_engine(engine) -> bool:
    """DeepSpeed's plain TorchCheckpointEngine, whose save and load we shadow, so that its files are
    written by _file_object_saves (atomically, fsynced). Other checkpoint engines do their own I/O."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    return isinstance(engine.checkpoint_engine, TorchCheckpointEngine)


def _file_object_saves(engine, errors: list):
    """DeepSpeed's TorchCheckpointEngine.save calls torch.save(obj, path). On a full disk, torch's
    zip writer then raises a RuntimeError ("unexpected pos ...") and leaves a torn file. Writing
    through a file object instead gives OSError(ENOSPC), and the temporary name + rename leaves
    each file whole or absent. The OSError is appended to `errors`, not raised: DeepSpeed's save
    ends with a barrier, which a rank raising here would skip while the other ranks wait in it."""
    zipfile = getattr(engine.checkpoint_engine, "zipfile_serialization", True)

    def save(state_dict, path):
        try:
            write_atomically(Path(path), lambda f: torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile))
        except OSError as exc:
            errors.append(exc)

    return _shadowed(engine, "save", save)


def _prepare_tag_dir(output_dir: Path, tag: str) -> str | None:
    """Rank 0: make an empty <tag> directory. Returns an error message instead of raising, so that
    every rank can learn of the failure. A directory left by an earlier save of the same tag (killed
    or not) is removed, manifest first, so that it is never seen as complete while half deleted."""
    tag_dir = output_dir / tag
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():
            _delete_tag_dir(tag_dir)
        tag_dir.mkdir()
        # Probe: a read-only or full disk must fail here, before DeepSpeed writes anything.
        write_text_atomically(tag_dir / ".write_probe", "ok")
        (tag_dir / ".write_probe").unlink()
    except OSError as exc:
        return f"cannot write checkpoint {tag_dir}: {exc}"
    return None


def _delete_tag_dir(tag_dir: Path) -> None:
    (tag_dir / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(tag_dir)


def _optimizer_layout(engine) -> dict:
    """What resuming on another world size needs to know of how the optimizer state is cut up."""
    from training import zero_partitions
    return {"zero_stage": int(engine.zero_optimization_stage()),
            "optimizer_wrapper": type(engine.optimizer).__name__,
            "partitioned": zero_partitions.group_partitions(engine.optimizer) is not None,
            "bf16": bool(engine.bfloat16_enabled())}


def commit_checkpoint(output_dir, tag: str, world_size: int, client_state: dict, *, fsync_files: bool,
                      layout: dict) -> None:
    """Make <output_dir>/<tag> a checkpoint: write its manifest (every file of the tag with its size,
    the world size, the model config, client_state's keys, the optimizer layout), then point `latest`
    at it. Until the manifest exists the tag is not a checkpoint (see "Commit protocol" above).

    save_checkpoint calls it on rank 0 after every rank finished writing; it can also commit a tag
    directory written by other means (tests, tools), which must hold state_<r>.pt for every rank r of
    world_size (OSError otherwise). client_state must hold "model_config". layout: how the optimizer
    state is cut up (zero_stage, optimizer_wrapper, partitioned, bf16; resume on another world size
    reads it). fsync_files: fsync the tag's files first (a checkpoint engine of DeepSpeed's own wrote
    them, without fsync), so that a power loss cannot leave a manifest naming empty files. Done here,
    once, after the barrier: every rank's temporary file has then been renamed to its final name."""
    import deepspeed  # the version goes into the manifest; imported here to keep import time low

    output_dir, tag = Path(output_dir), str(tag)
    tag_dir = output_dir / tag
    files = {}
    for path in sorted(tag_dir.rglob("*")):
        if path.is_file():
            files[path.relative_to(tag_dir).as_posix()] = path.stat().st_size
    missing = [rank_state_name(r) for r in range(world_size) if rank_state_name(r) not in files]
    if missing:
        raise OSError(f"rank files missing after the barrier: {missing}")
    if fsync_files:
        for name in files:
            fsync_path(tag_dir / name)
        fsync_path(tag_dir)
    manifest = {
        "format_version": MANIFEST_FORMAT_VERSION,
        "tag": tag,
        "world_size": world_size,
        "optimizer_layout": layout,
        "model_config": client_state["model_config"],
        "model_config_sha256": model_config_hash(client_state["model_config"]),
        "client_state_keys": sorted(client_state),
        "files": files,
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "saved_at_unix": time.time(),
    }
    write_text_atomically(tag_dir / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True))
    write_text_atomically(output_dir / LATEST_NAME, tag)


# --------------------------------------------------------------------------- validation and resume

def read_manifest(tag_dir: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) when <tag_dir> is a complete checkpoint: manifest readable and every file it
    lists present with the recorded size. Otherwise (None, reason)."""
    if not tag_dir.is_dir():
        return None, "the directory does not exist"
    try:
        text = (tag_dir / MANIFEST_NAME).read_text()
    except FileNotFoundError:
        return None, f"no {MANIFEST_NAME} (its save was interrupted)"
    except OSError as exc:
        return None, f"unreadable {MANIFEST_NAME}: {exc}"
    sizes = {p.relative_to(tag_dir).as_posix(): p.stat().st_size for p in tag_dir.rglob("*") if p.is_file()}
    return _check_manifest(text, sizes)


def _check_manifest(text: str, sizes: dict) -> tuple[dict | None, str | None]:
    """(manifest, None) when the manifest `text` parses and every file it lists is in `sizes`
    ({relative name: bytes}, what the tag directory or prefix holds) with its recorded size."""
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        return None, f"unreadable {MANIFEST_NAME}: {exc}"
    if not isinstance(manifest, dict) or manifest.get("format_version") != MANIFEST_FORMAT_VERSION \
            or not _MANIFEST_KEYS <= set(manifest):
        return None, f"{MANIFEST_NAME} is not a format-{MANIFEST_FORMAT_VERSION} manifest"
    for name, size in manifest["files"].items():
        if name not in sizes:
            return None, f"file {name} listed in {MANIFEST_NAME} is missing"
        if sizes[name] != size:
            return None, f"file {name} has {sizes[name]} bytes, {MANIFEST_NAME} says {size}"
    return manifest, None


def _check_compatible(tag_dir: Path, manifest: dict, model_config: dict | None) -> None:
    """Raise CheckpointError when this run cannot resume from a complete checkpoint."""
    if model_config is not None and model_config_hash(model_config) != manifest["model_config_sha256"]:
        saved = manifest["model_config"]
        differing = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
        details = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {model_config.get(k)!r}"
                            for k in differing)
        raise CheckpointError(f"checkpoint {tag_dir} is from another model config ({details})")


def _tag_order_key(tag: str, manifest: dict) -> tuple:
    # Tags are global steps (phase 2 adds phase1_end_step), so numeric order is training order;
    # other tags come before numeric ones, ordered by save time.
    if tag.isdigit():
        return (1, int(tag), 0.0)
    return (0, 0, manifest["saved_at_unix"])


def _scan(output_dir: Path) -> tuple[list[tuple[str, dict]], dict[str, str]]:
    """Complete checkpoints, newest first, and {tag: reason} for checkpoint-like directories that
    are not complete (any directory holding a DeepSpeed states file, a state_<r>.pt or a manifest)."""
    complete, broken = [], {}
    for tag_dir in sorted(p for p in output_dir.iterdir() if p.is_dir()):
        manifest, reason = read_manifest(tag_dir)
        if manifest is not None:
            complete.append((tag_dir.name, manifest))
        elif any(tag_dir.glob("*_states.pt")) or any(tag_dir.glob("state_*.pt")) \
                or (tag_dir / MANIFEST_NAME).exists():
            broken[tag_dir.name] = reason
    complete.sort(key=lambda item: _tag_order_key(*item), reverse=True)
    return complete, broken


def _read_latest(output_dir: Path) -> str | None:
    try:
        return (output_dir / LATEST_NAME).read_text().strip()
    except FileNotFoundError:
        return None


def find_resume_tag(output_dir, model_config: dict | None = None) -> str | None:
    """Tag to resume from (any rank may call it; it only reads).

    - None when output_dir holds no checkpoint: no `latest` and no complete checkpoint
      (directories of interrupted first saves are ignored with a CheckpointWarning).
    - The tag named by `latest` when that checkpoint is complete.
    - Otherwise the newest complete checkpoint, with a CheckpointWarning saying why.
    Raises CheckpointError when `latest` exists but no complete checkpoint does, and when the chosen
    checkpoint was saved (if model_config is given) with another model config. Another world size is
    fine: load_checkpoint re-partitions the ZeRO optimizer state."""
    chosen = _choose_tag(Path(output_dir))
    if chosen is not None:
        tag, manifest = chosen
        _check_compatible(Path(output_dir) / tag, manifest, model_config)
        return tag
    return None


def _choose_tag(output_dir: Path) -> tuple[str, dict] | None:
    """(tag, manifest) by the rules of find_resume_tag, before its compatibility checks."""
    if not output_dir.is_dir():
        return None
    complete, broken = _scan(output_dir)
    latest = _read_latest(output_dir)
    if latest is not None and latest not in broken and latest not in dict(complete):
        broken[latest] = read_manifest(output_dir / latest)[1]
    return _choose_among(output_dir, complete, broken, latest)


def _choose_among(output_dir, complete: list, broken: dict, latest: str | None) -> tuple[str, dict] | None:
    """The rules of find_resume_tag over a scan (complete newest first, {tag: reason} of the others,
    the content of `latest`) of a local directory or an S3 prefix."""
    by_tag = dict(complete)
    if latest is not None and latest in by_tag:
        return latest, by_tag[latest]
    if latest is not None:
        reason = broken[latest]
        if not complete:
            raise CheckpointError(f"no usable checkpoint in {output_dir}: `latest` names {latest!r}, "
                                  f"which is not usable ({reason}), and no other checkpoint is complete")
        warnings.warn(f"{output_dir}: `latest` names checkpoint {latest!r}, which is not usable "
                      f"({reason}); resuming from the newest complete checkpoint {complete[0][0]!r}",
                      CheckpointWarning, stacklevel=4)
        return complete[0]
    if complete:
        warnings.warn(f"{output_dir}: no `latest` file; resuming from the newest complete "
                      f"checkpoint {complete[0][0]!r}", CheckpointWarning, stacklevel=4)
        return complete[0]
    if broken:
        warnings.warn(f"{output_dir}: ignoring unfinished checkpoint(s) {broken} "
                      f"(no checkpoint was ever completed)", CheckpointWarning, stacklevel=4)
    return None


def load_checkpoint(engine, output_dir, tag: str, global_rank: int, world_size: int, *,
                    model_config: dict | None = None, say=None) -> tuple[dict, dict | None]:
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
    manifest, reason = read_manifest(tag_dir)
    if manifest is None:
        raise CheckpointError(f"cannot load checkpoint {tag_dir}: {reason}")
    _check_compatible(tag_dir, manifest, model_config)
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


# --------------------------------------------------------------------------- another world size

def _partition_files(tag_dir: Path) -> list:
    return sorted(tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                  key=lambda p: int(re.search(r"zero_pp_rank_(\d+)_", p.name).group(1)))


def _is_partitioned(tag_dir: Path) -> bool:
    """ZeRO-1/2 checkpoints hold the optimizer state in per-rank partition files; ZeRO-0 ones in
    DeepSpeed's model states file, which any world size loads as it is."""
    return bool(_partition_files(tag_dir))


def _check_repartition_possible(tag_dir: Path, manifest: dict, engine, world: int) -> None:
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
def _deepspeed_checkpoint_classes() -> list:
    """The only non-tensor classes DeepSpeed 0.19.8 pickles into its ZeRO-1/2 optimizer files
    (found with torch.serialization.get_unsafe_globals_in_checkpoint); plain data holders."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def _load_weights_only(path, map_location="cpu", mmap: bool = False):
    """torch.load(weights_only=True) with DeepSpeed's three classes allowed. A file needing anything
    else is refused with the names of the classes it wants. mmap: tensors map the file, and only the
    pages a reader touches are read (and shared with the host's other ranks through the page cache)."""
    with torch.serialization.safe_globals(_deepspeed_checkpoint_classes()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            wanted = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            raise CheckpointError(f"{path}: refusing to unpickle {wanted} (only tensors, plain data and "
                                  f"DeepSpeed's known checkpoint classes are loaded)") from exc


def _weights_only_loads(engine):
    """DeepSpeed's TorchCheckpointEngine.load calls torch.load(weights_only=False), i.e. full pickle.
    Every checkpoint read of engine.load_checkpoint goes through engine.checkpoint_engine.load, so
    shadowing it makes those reads weights_only=True (see _load_weights_only)."""
    return _shadowed(engine, "load", _load_weights_only)


def prune_checkpoints(output_dir, keep_last_n: int | None) -> list[str]:
    """Rank 0 (other ranks return at once): delete all but the newest keep_last_n complete
    checkpoints, never the one `latest` names. None or 0 keeps everything. Unfinished directories
    are left alone (a later save of the same tag replaces them). Returns the deleted tags."""
    if keep_last_n is not None and keep_last_n < 0:
        raise ValueError(f"keep_last_n must be >= 0 (0 keeps all), got {keep_last_n}")
    output_dir = Path(output_dir)
    if not keep_last_n or _rank_and_world()[0] != 0 or not output_dir.is_dir():
        return []
    latest = _read_latest(output_dir)
    complete, _ = _scan(output_dir)
    doomed = [tag for tag, _ in complete[keep_last_n:] if tag != latest]
    for tag in doomed:
        _delete_tag_dir(output_dir / tag)
    return doomed


# --------------------------------------------------------------------------- copies on S3 (common/storage.py)
#
# With an s3:// output directory a checkpoint is saved locally as above (into a staging directory),
# then copied: every file of the tag, then its manifest, then `latest`. S3 cannot rename, so this order
# is the commit: `latest` on S3 names a tag only once that tag's files and manifest are all there.

def _remote_scan(store) -> tuple[list, dict, str | None]:
    """(complete checkpoints newest first, {tag: reason} of the others, `latest`) under an S3 prefix."""
    sizes = {}
    for remote in store.list_objects(recursive=True):
        tag, _, name = remote.name.partition("/")
        if name:
            sizes.setdefault(tag, {})[name] = remote.size
    complete, broken = [], {}
    for tag, files in sorted(sizes.items()):
        if MANIFEST_NAME in files:
            manifest, reason = _check_manifest(store.get_bytes(f"{tag}/{MANIFEST_NAME}").decode(), files)
        else:
            manifest, reason = None, f"no {MANIFEST_NAME} (its upload was interrupted)"
        if manifest is not None:
            complete.append((tag, manifest))
        elif any(name.endswith(".pt") for name in files):
            broken[tag] = reason
    complete.sort(key=lambda item: _tag_order_key(*item), reverse=True)
    latest = store.get_bytes(LATEST_NAME).decode().strip() if store.exists(LATEST_NAME) else None
    if latest is not None and latest not in broken and latest not in dict(complete):
        broken[latest] = "nothing under that tag"
    return complete, broken, latest


def fetch_checkpoint(store, local_dir, tag: str | None = None) -> str | None:
    """Download a complete checkpoint from an S3 prefix into local_dir, every file verified, the
    manifest and then `latest` last; returns its tag. tag None: the one resume would use (the rules
    of find_resume_tag), or None when the prefix holds no checkpoint."""
    complete, broken, latest = _remote_scan(store)
    if tag is None:
        chosen = _choose_among(store.url(), complete, broken, latest)
    elif tag in dict(complete):
        chosen = tag, dict(complete)[tag]
    else:
        raise CheckpointError(f"no complete checkpoint {tag!r} in {store.url()}: {broken.get(tag, 'no such tag')}")
    if chosen is None:
        return None
    tag, manifest = chosen
    tag_dir = Path(local_dir) / tag
    for name in [*manifest["files"], MANIFEST_NAME]:
        (tag_dir / name).parent.mkdir(parents=True, exist_ok=True)
        store.download(f"{tag}/{name}", tag_dir / name)
    write_text_atomically(Path(local_dir) / LATEST_NAME, tag)
    return tag


def upload_checkpoint(store, local_dir, tag: str) -> None:
    """Copy a complete local checkpoint to S3 in commit order (see above). An earlier upload of the
    same tag loses its manifest first, so that its old and new files are never taken as complete."""
    tag_dir = Path(local_dir) / tag
    manifest = json.loads((tag_dir / MANIFEST_NAME).read_text())
    store.delete([f"{tag}/{MANIFEST_NAME}"])
    for name in sorted(manifest["files"]):
        store.upload(tag_dir / name, f"{tag}/{name}")
    store.upload(tag_dir / MANIFEST_NAME, f"{tag}/{MANIFEST_NAME}")
    store.put_bytes(LATEST_NAME, tag.encode())


def prune_remote_checkpoints(store, keep_last_n: int) -> list[str]:
    """prune_checkpoints for an S3 prefix: each doomed tag loses its manifest first, then its files."""
    complete, _, latest = _remote_scan(store)
    doomed = [tag for tag, _ in complete[keep_last_n:] if tag != latest]
    for tag in doomed:
        store.delete([f"{tag}/{MANIFEST_NAME}"])
        store.delete([f"{tag}/{remote.name}" for remote in store.child(tag).list_objects(recursive=True)])
    return doomed


STAGING_PREFIX_NAME = ".s3_prefix"  # in the staging directory: the s3:// prefix its checkpoints are copies for


class CheckpointUploader:
    """Copies each checkpoint saved into local_dir to S3, on rank 0, in a background thread: training
    goes on meanwhile. finish() (collective) waits for the copy and raises CheckpointError on every
    rank if it failed; call it before the next save and before the end of the run. After a copy, the
    staging directory keeps only the newest checkpoint; on S3, keep_last_n applies (0 keeps all)."""

    def __init__(self, store, local_dir, keep_last_n: int = 0):
        self.store, self.local_dir, self.keep_last_n = store, Path(local_dir), keep_last_n
        self._thread, self._error = None, None

    def prepare(self, device, resume: bool, tag: str | None = None, say=None) -> None:
        """Collective, before resume: rank 0 empties the staging directory and, when resuming, fetches
        into it the checkpoint that resume would use (or `tag`). Except when the staging directory holds
        a complete checkpoint that a run on this prefix saved but did not finish copying (a preemption's
        last save, its upload cut short) and that resume should use (`tag`, or newer than S3's newest):
        that one is uploaded first and kept (say(message) is told), not thrown away."""
        error, unfinished = None, None
        if _rank_and_world()[0] == 0:
            try:
                unfinished = self._unfinished_upload(tag) if resume else None
                if unfinished is None:
                    shutil.rmtree(self.local_dir, ignore_errors=True)
                    self.local_dir.mkdir(parents=True)
                    write_text_atomically(self.local_dir / STAGING_PREFIX_NAME, self.store.url())
                    if resume:
                        fetch_checkpoint(self.store, self.local_dir, tag)
                else:
                    if say is not None:
                        say(f"checkpoint {unfinished} in {self.local_dir} is complete but its copy to "
                            f"{self.store.url()} was cut short: uploading it now, then resuming from it")
                    self._keep_only(unfinished)
                    upload_checkpoint(self.store, self.local_dir, unfinished)
                    if self.keep_last_n:
                        prune_remote_checkpoints(self.store, self.keep_last_n)
            except (storage.StorageError, OSError) as exc:
                doing = "fetch a checkpoint from" if unfinished is None else f"copy checkpoint {unfinished} to"
                error = f"cannot {doing} {self.store.url()}: {exc}"
            except CheckpointError as exc:
                error = str(exc)
        _raise_if_any_rank_failed(error, "fetching a checkpoint from S3", device)

    def _unfinished_upload(self, tag: str | None) -> str | None:
        """The tag of a complete checkpoint in the staging directory, staged for this prefix (a staging
        directory may have served another prefix before), that S3 lacks and resume should use: `tag`,
        or, with tag None, one newer than the newest complete checkpoint on S3. None otherwise."""
        try:
            if (self.local_dir / STAGING_PREFIX_NAME).read_text() != self.store.url():
                return None
        except OSError:  # no staging directory, or one of a run before the prefix was recorded
            return None
        staged, _ = _scan(self.local_dir)
        if not staged:
            return None
        on_s3, _, _ = _remote_scan(self.store)
        if tag is not None:
            return tag if tag in dict(staged) and tag not in dict(on_s3) else None
        if on_s3 and _tag_order_key(*on_s3[0]) >= _tag_order_key(*staged[0]):
            return None
        return staged[0][0]

    def _keep_only(self, tag: str) -> None:
        """The staging directory as a fetch of `tag` leaves it: that checkpoint, `latest` naming it."""
        for entry in self.local_dir.iterdir():
            if entry.is_dir() and entry.name != tag:
                _delete_tag_dir(entry)
        write_text_atomically(self.local_dir / LATEST_NAME, tag)

    def start(self, tag: str) -> None:
        if _rank_and_world()[0] != 0:
            return
        self.wait()
        self._thread = threading.Thread(target=self._copy, args=(str(tag),), name="checkpoint-upload", daemon=True)
        self._thread.start()

    def _copy(self, tag: str) -> None:
        try:
            upload_checkpoint(self.store, self.local_dir, tag)
            if self.keep_last_n:
                prune_remote_checkpoints(self.store, self.keep_last_n)
        except (storage.StorageError, OSError) as exc:
            self._error = f"checkpoint {tag} was not copied to {self.store.url()}: {exc}"
            return
        for old in self.local_dir.iterdir():
            if old.is_dir() and old.name != tag and (old / MANIFEST_NAME).is_file():
                _delete_tag_dir(old)

    def wait(self) -> str | None:
        """Wait for the copy under way (this rank only); its error message, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        return error

    def finish(self, device) -> None:
        _raise_if_any_rank_failed(self.wait(), "copying a checkpoint to S3", device)


# --------------------------------------------------------------------------- export for fine-tuning

def consolidated_state_dict(output_dir, tag=None) -> dict:
    """fp32 module weights of a complete checkpoint, keyed as modeling.py's state_dict, for
    fine-tuning or export; no engine or process group needed, every file read with weights_only=True.

    tag None picks the checkpoint find_resume_tag would (any world size). ZeRO-1/2: the fp32 master
    weights, re-assembled from every rank's optimizer partition. ZeRO-0: the module file's weights
    (in a bf16 run these are the bf16 values, upcast)."""
    return consolidated_checkpoint(output_dir, tag)[1]


def consolidated_checkpoint(output_dir, tag=None) -> tuple[dict, dict]:
    """(the model config recorded in the manifest, consolidated_state_dict(output_dir, tag))."""
    output_dir = Path(output_dir)
    if tag is None:
        chosen = _choose_tag(output_dir)
        if chosen is None:
            raise CheckpointError(f"no checkpoint in {output_dir}")
        tag = chosen[0]
    tag_dir = output_dir / str(tag)
    manifest, reason = read_manifest(tag_dir)
    if manifest is None:
        raise CheckpointError(f"cannot export checkpoint {tag_dir}: {reason}")
    model_states = _load_weights_only(tag_dir / "mp_rank_00_model_states.pt")
    module = model_states["module"]
    partition_files = _partition_files(tag_dir)
    if not partition_files:
        return manifest["model_config"], {name: value.detach().float() if value.is_floating_point()
                                          else value.detach() for name, value in module.items()}
    states = _load_partition_states(partition_files)
    weights = {}
    for group, shapes in enumerate(model_states["param_shapes"]):
        weights.update(_split_group(states, group, shapes, [state[_FP32_PARTITIONS][group] for state in states]))
    for name, source in (model_states.get("shared_params") or {}).items():
        weights[name] = weights[source]  # tied weights are stored once (e.g. the MLM decoder)
    for name in module.keys() - weights.keys():
        weights[name] = module[name].detach()  # buffers
    return manifest["model_config"], {name: weights[name] for name in module}


def saved_optimizer_states(output_dir, tag: str) -> list[dict]:
    """The optimizer state of checkpoint <output_dir>/<tag> as saved, read without an engine: ZeRO-1/2,
    every rank's state dict in rank order (the client optimizer's own under "base_optimizer_state");
    ZeRO-0, the one state dict of the model states file."""
    tag_dir = Path(output_dir) / str(tag)
    partition_files = _partition_files(tag_dir)
    if partition_files:
        return _load_partition_states(partition_files)
    return [_load_weights_only(tag_dir / "mp_rank_00_model_states.pt")["optimizer"]]


# Keys of DeepSpeed 0.19.8's ZeRO-1/2 optimizer state dicts (DeepSpeedZeroOptimizer and BF16_Optimizer).
_FP32_PARTITIONS = "single_partition_of_fp32_groups"
_BASE_STATE = "base_optimizer_state"


def _load_partition_states(partition_files: list, mmap: bool = False) -> list:
    """Every rank's ZeRO-1/2 optimizer state dict, in rank order, checked to be all of them."""
    states = [_load_weights_only(path, mmap=mmap)["optimizer_state_dict"] for path in partition_files]
    counts = states[0]["partition_count"]
    if max(counts if isinstance(counts, list) else [counts]) != len(states):
        raise CheckpointError(f"{partition_files[0].parent}: {len(states)} optimizer partition files, "
                              f"the checkpoint was partitioned {counts} ways")
    return states


def _param_offsets(states: list, group: int, shapes: dict, pieces: list) -> list:
    """ZeRO-1/2 layout: a param group is one flat vector cut in contiguous per-rank pieces
    (`pieces`, in rank order); parameters lie in it in param_shapes order, each followed by
    its alignment padding (if any). Returns where each parameter starts in that vector."""
    paddings = states[0].get("param_alignment_paddings")
    offsets, offset = [], 0
    for index, shape in enumerate(shapes.values()):
        offsets.append(offset)
        offset += math.prod(shape) + (paddings[group][index] if paddings else 0)
    held = sum(piece.numel() for piece in pieces)
    if offset > held:
        raise CheckpointError(f"group {group} of the checkpoint needs {offset} values, its partitions hold {held}")
    return offsets


def _split_group(states: list, group: int, shapes: dict, pieces: list) -> dict:
    """{name: full tensor} of a param group (see _param_offsets): every parameter, for an export."""
    flat = torch.cat(pieces)
    return {name: flat[offset:offset + math.prod(shape)].view(shape).clone()
            for offset, (name, shape) in zip(_param_offsets(states, group, shapes, pieces), shapes.items())}


def _read_flat_range(pieces: list, start: int, out: torch.Tensor) -> None:
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
def _repartition_optimizer_state(engine, tag_dir: Path) -> None:
    """Fill this rank's ZeRO-1/2 partitions from a checkpoint written by another number of ranks: each
    fragment of this run's partitions (DeepSpeed's own metadata, training/zero_partitions.py) of the fp32
    master weights and of every partitioned optimizer state tensor (LANS/Adam moments) is copied from the
    saved partitions that overlap it; per-group values (the step, hyperparameters) are copied. The files
    are mapped, not read whole: each rank reads only the slices it keeps (a restart of the 5B on fewer
    servers would otherwise hold every rank's state in every rank)."""
    from training import zero_partitions
    states = _load_partition_states(_partition_files(tag_dir), mmap=True)
    param_shapes = _load_weights_only(tag_dir / "mp_rank_00_model_states.pt", mmap=True)["param_shapes"]
    parts = zero_partitions.group_partitions(engine.optimizer)
    client = engine.optimizer.optimizer
    if not all(isinstance(state[_BASE_STATE], dict) for state in states):
        raise CheckpointError(f"{tag_dir}: optimizer state saved with zero_optimization.elastic_checkpoint; "
                              f"resume it on the world size that wrote it")
    if [[tuple(p.shape) for p in part.params] for part in parts] != \
            [[tuple(shape) for shape in shapes.values()] for shapes in param_shapes]:
        raise CheckpointError(f"{tag_dir}: the checkpoint's parameter groups differ from this run's")
    for group, (part, shapes) in enumerate(zip(parts, param_shapes)):
        saved = [state[_BASE_STATE]["state"].get(group, {}) for state in states]
        target = client.state[part.flat]
        fp32_pieces = [state[_FP32_PARTITIONS][group] for state in states]
        offsets = _param_offsets(states, group, shapes, fp32_pieces)
        _fill_fragments(part, offsets, fp32_pieces, part.flat)
        for key, value in saved[0].items():
            # DeepSpeed saves the fp32 partitions without the last rank's end padding, the states with it.
            partitioned = all(torch.is_tensor(s[key]) and s[key].dim() == 1 and s[key].numel() ==
                              state[_FP32_PARTITIONS][group].numel() + state["group_paddings"][group]
                              for s, state in zip(saved, states))
            if partitioned:
                target[key] = torch.zeros_like(part.flat)
                _fill_fragments(part, offsets, [s[key] for s in saved], target[key])
            else:
                target[key] = value.to(part.flat.device) if torch.is_tensor(value) else value
        saved_group = states[0][_BASE_STATE]["param_groups"][group]
        client.param_groups[group].update({k: v for k, v in saved_group.items() if k != "params"})


def _fill_fragments(part, offsets: list, pieces: list, flat: torch.Tensor) -> None:
    """Copy the parts of the saved group (the concatenation of `pieces`, parameters at `offsets`) that
    this rank holds into `flat`, shaped like its partition."""
    for fragment in part.fragments:
        _read_flat_range(pieces, offsets[fragment.index] + fragment.param_start,
                         flat.narrow(0, fragment.partition_start, fragment.numel))


def read_on_the_cpu() -> None:
    """For a process that only reads checkpoints (the exports; call it before DeepSpeed's first import): DeepSpeed,
    imported for the classes its files name (_deepspeed_checkpoint_classes), takes the CPU accelerator, with no
    'Setting accelerator to CPU' warning where none was chosen. A DS_ACCELERATOR already set is kept."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def export_main(argv=None) -> int:
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


def _export_from_s3(url: str, tag: str | None, endpoint: str | None) -> dict:
    """consolidated_state_dict of a checkpoint on S3, downloaded into a temporary directory."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="checkpoint-export-") as local:
        tag = fetch_checkpoint(storage.S3Store(url, endpoint), local, tag)
        if tag is None:
            raise CheckpointError(f"no checkpoint in {url}")
        return consolidated_state_dict(local, tag)


if __name__ == "__main__":
    sys.exit(export_main())
