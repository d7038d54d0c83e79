"""The layout of a training checkpoint and its commit protocol: crash-safe saves around DeepSpeed's
engine.save_checkpoint, the manifest, `latest`, which checkpoint a resume takes, and pruning.

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

The other parts of the checkpoints: resume and resume on another number of ranks
(training/checkpoint_resume.py), copies on S3 (training/checkpoint_s3.py), export for fine-tuning
(training/checkpoint_export.py; from the shell ``python -m training.checkpointing export --output_dir D [--tag T]
--out model.pt``, the command's name kept). This module reads the files for them: read_manifest(tag_dir),
load_weights_only, the ZeRO-1/2 partition files.

Trust: DeepSpeed 0.19.8 reads its own ``*_states.pt`` files with ``torch.load(weights_only=False)``
(``TorchCheckpointEngine.load``), i.e. with full pickle, which can run arbitrary code. Load only
checkpoints you (or someone you trust) wrote. Resume and export route
every read through torch.load(weights_only=True) instead, allowing only DeepSpeed's three plain
classes (see deepspeed_checkpoint_classes).
"""

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
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

import numpy as np
import torch
import torch.distributed as dist

from common.atomic_write import fsync_path, write_atomically, write_text_atomically

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

MANIFEST_NAME = "complete.json"
LATEST_NAME = "latest"
MANIFEST_FORMAT_VERSION = 1
_MANIFEST_KEYS = {"format_version", "tag", "world_size", "model_config", "model_config_sha256",
                  "client_state_keys", "files", "saved_at_unix"}


class OptimizerLayout(TypedDict):
    """How a checkpoint's optimizer state is cut up (the manifest's "optimizer_layout")."""
    zero_stage: int
    optimizer_wrapper: str  # the class name of the engine's optimizer
    partitioned: bool       # ZeRO-1/2 partition files (training/zero_partitions.py)
    bf16: bool


class Manifest(TypedDict):
    """A checkpoint's complete.json (commit_checkpoint writes it; check_manifest requires _MANIFEST_KEYS)."""
    format_version: int
    tag: str
    world_size: int
    optimizer_layout: NotRequired[OptimizerLayout]
    model_config: dict[str, Any]
    model_config_sha256: str
    client_state_keys: list[str]
    files: dict[str, int]  # {name relative to the tag directory: bytes}
    deepspeed_version: NotRequired[str]
    torch_version: NotRequired[str]
    saved_at_unix: float


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written, or none of the checkpoints present can be resumed from."""


class CheckpointWarning(UserWarning):
    """Resume falls back to an older checkpoint, or ignores an unfinished one."""


def rank_state_name(global_rank: int) -> str:
    return f"state_{global_rank}.pt"


def model_config_hash(model_config: Mapping[str, Any]) -> str:
    """sha256 of the config's canonical JSON (sorted keys), so key order does not matter."""
    return hashlib.sha256(json.dumps(model_config, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------- distributed helpers

def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def raise_if_any_rank_failed(error: str | None, what: str, device: torch.device | str | None) -> None:
    """Collective: every rank calls it. Acts as a barrier and turns one rank's failure into an
    error on all ranks (a rank that raised alone would leave the others hanging in the next barrier).
    device: where the backend can reduce (the engine's device: nccl and hccl need device tensors)."""
    _, world = rank_and_world()
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

def capture_rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Every RNG state of this process as ints, lists and tensors only, so that the file can be read
    back with torch.load(weights_only=True). device: the run's (torch.device; None: the CPU). A CUDA run
    saves its own device's generator (the only one its ranks draw from: each uses cuda:LOCAL_RANK of the
    devices the launcher shows to every local rank); a CPU run saves none, also where CUDA is available, so
    that a CPU checkpoint resumes on a machine without CUDA (and no CUDA context is created for it)."""
    legacy_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))  # not the dict form
    _, np_keys, np_pos, np_has_gauss, np_gauss = legacy_state
    state: dict[str, Any] = {
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


def own_cuda_rng_state(saved: torch.Tensor | list[torch.Tensor], device_index: int) -> torch.Tensor:
    """The CUDA generator state a rank on cuda:device_index restores from a checkpoint's "cuda" entry: the
    entry itself (one device's, capture_rng_state), or, in checkpoints written before 2026-11-27 (the states of
    every device the rank could see, torch.cuda.get_rng_state_all), the one of its own device index."""
    if torch.is_tensor(saved):
        return saved
    if device_index >= len(saved):
        raise CheckpointError(f"checkpoint holds the CUDA RNG states of {len(saved)} devices, none for this rank's "
                              f"cuda:{device_index}: resume with as many devices per server as the run that saved it")
    return saved[device_index]


def restore_rng_state(state: Mapping[str, Any], device: torch.device | None = None) -> None:
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


def _hpu_random_module() -> ModuleType | None:
    # Only when the driver has already imported the Habana bridge (--use_hpu); never import it here.
    if "habana_frameworks.torch" not in sys.modules:
        return None
    import habana_frameworks.torch.hpu.random as hpu_random
    return hpu_random


# --------------------------------------------------------------------------- save

def save_checkpoint(engine: "DeepSpeedEngine", output_dir: str | os.PathLike[str], tag: str,
                    client_state: dict[str, Any], rank_state: dict[str, Any]) -> None:
    """Collective: every rank calls it with the same tag and client_state.

    client_state must hold "model_config" (a dict); it goes into DeepSpeed's model_states file.
    rank_state (this rank's RNG states etc.) goes into <tag>/state_<global_rank>.pt.
    Raises CheckpointError (on every rank) when the checkpoint cannot be written; the previous
    checkpoints and `latest` are then untouched."""
    if "model_config" not in client_state:
        raise CheckpointError("client_state has no 'model_config': resume could not check the model")
    output_path, tag = Path(output_dir), str(tag)
    rank, world = rank_and_world()
    tag_dir = output_path / tag
    raise_if_any_rank_failed(_prepare_tag_dir(output_path, tag) if rank == 0 else None,
                              f"preparing checkpoint {tag_dir}", engine.device)
    error: str | None = None
    deepspeed_write_errors: list[OSError] = []
    try:
        # save_latest=False: DeepSpeed would write `latest` non-atomically and before our manifest.
        with _file_object_saves(engine, deepspeed_write_errors):
            engine.save_checkpoint(str(output_path), tag, client_state=client_state, save_latest=False)
        if deepspeed_write_errors:
            raise deepspeed_write_errors[0]
        # Every file of the tag goes through write_atomically, which fsyncs it and the directory;
        # no further fsync is needed (see commit_checkpoint for checkpoint engines that write on their own).
        write_atomically(tag_dir / rank_state_name(rank), lambda f: torch.save(rank_state, f))
    except OSError as exc:
        error = f"cannot write checkpoint {tag_dir} on rank {rank}: {exc}"
    try:
        raise_if_any_rank_failed(error, f"writing checkpoint {tag_dir}", engine.device)
    except CheckpointError:
        if rank == 0:  # free the space of the half-written tag (it has no manifest, so is never used)
            shutil.rmtree(tag_dir, ignore_errors=True)
        raise
    error = None
    if rank == 0:
        try:
            commit_checkpoint(output_path, tag, world, client_state, fsync_files=not _is_plain_torch_engine(engine),
                              layout=_optimizer_layout(engine))
        except OSError as exc:
            error = f"cannot commit checkpoint {tag_dir}: {exc}"
    raise_if_any_rank_failed(error, f"committing checkpoint {tag_dir}", engine.device)


@contextlib.contextmanager
def shadowed(engine: "DeepSpeedEngine", method: str, replacement: Callable[..., object]) -> Iterator[None]:
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


def _is_plain_torch_engine(engine: "DeepSpeedEngine") -> bool:
    """DeepSpeed's plain TorchCheckpointEngine, whose save and load we shadow, so that its files are
    written by _file_object_saves (atomically, fsynced). Other checkpoint engines do their own I/O."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    return isinstance(engine.checkpoint_engine, TorchCheckpointEngine)


def _file_object_saves(engine: "DeepSpeedEngine", errors: list[OSError]) -> contextlib.AbstractContextManager[None]:
    """DeepSpeed's TorchCheckpointEngine.save calls torch.save(obj, path). On a full disk, torch's
    zip writer then raises a RuntimeError ("unexpected pos ...") and leaves a torn file. Writing
    through a file object instead gives OSError(ENOSPC), and the temporary name + rename leaves
    each file whole or absent. The OSError is appended to `errors`, not raised: DeepSpeed's save
    ends with a barrier, which a rank raising here would skip while the other ranks wait in it."""
    zipfile = getattr(engine.checkpoint_engine, "zipfile_serialization", True)

    def save(state_dict: object, path: str | os.PathLike[str]) -> None:
        try:
            write_atomically(Path(path), lambda f: torch.save(state_dict, f, _use_new_zipfile_serialization=zipfile))
        except OSError as exc:
            errors.append(exc)

    return shadowed(engine, "save", save)


def _prepare_tag_dir(output_dir: Path, tag: str) -> str | None:
    """Rank 0: make an empty <tag> directory. Returns an error message instead of raising, so that
    every rank can learn of the failure. A directory left by an earlier save of the same tag (killed
    or not) is removed, manifest first, so that it is never seen as complete while half deleted."""
    tag_dir = output_dir / tag
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists():
            delete_tag_dir(tag_dir)
        tag_dir.mkdir()
        # Probe: a read-only or full disk must fail here, before DeepSpeed writes anything.
        write_text_atomically(tag_dir / ".write_probe", "ok")
        (tag_dir / ".write_probe").unlink()
    except OSError as exc:
        return f"cannot write checkpoint {tag_dir}: {exc}"
    return None


def delete_tag_dir(tag_dir: Path) -> None:
    (tag_dir / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(tag_dir)


def _optimizer_layout(engine: "DeepSpeedEngine") -> OptimizerLayout:
    """What resuming on another world size needs to know of how the optimizer state is cut up."""
    from training import zero_partitions
    return {"zero_stage": int(engine.zero_optimization_stage()),
            "optimizer_wrapper": type(engine.optimizer).__name__,
            "partitioned": zero_partitions.group_partitions(engine.optimizer) is not None,
            "bf16": bool(engine.bfloat16_enabled())}


def commit_checkpoint(output_dir: str | os.PathLike[str], tag: str, world_size: int, client_state: Mapping[str, Any],
                      *, fsync_files: bool, layout: OptimizerLayout) -> None:
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

    output_path, tag = Path(output_dir), str(tag)
    tag_dir = output_path / tag
    files: dict[str, int] = {}
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
    manifest: Manifest = {
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
    write_text_atomically(output_path / LATEST_NAME, tag)


# --------------------------------------------------------------------------- validation and resume

def read_manifest(tag_dir: Path) -> tuple[Manifest, None] | tuple[None, str]:
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
    return check_manifest(text, sizes)


def check_manifest(text: str, sizes: Mapping[str, int]) -> tuple[Manifest, None] | tuple[None, str]:
    """(manifest, None) when the manifest `text` parses and every file it lists is in `sizes`
    ({relative name: bytes}, what the tag directory or prefix holds) with its recorded size."""
    try:
        parsed = json.loads(text)
    except ValueError as exc:
        return None, f"unreadable {MANIFEST_NAME}: {exc}"
    if not isinstance(parsed, dict) or parsed.get("format_version") != MANIFEST_FORMAT_VERSION \
            or not _MANIFEST_KEYS <= set(parsed):
        return None, f"{MANIFEST_NAME} is not a format-{MANIFEST_FORMAT_VERSION} manifest"
    manifest = cast(Manifest, parsed)
    for name, size in manifest["files"].items():
        if name not in sizes:
            return None, f"file {name} listed in {MANIFEST_NAME} is missing"
        if sizes[name] != size:
            return None, f"file {name} has {sizes[name]} bytes, {MANIFEST_NAME} says {size}"
    return manifest, None


def check_compatible(tag_dir: Path, manifest: Manifest, model_config: Mapping[str, Any] | None) -> None:
    """Raise CheckpointError when this run cannot resume from a complete checkpoint."""
    if model_config is not None and model_config_hash(model_config) != manifest["model_config_sha256"]:
        saved = manifest["model_config"]
        differing = sorted(k for k in set(saved) | set(model_config) if saved.get(k) != model_config.get(k))
        details = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs run {model_config.get(k)!r}"
                            for k in differing)
        raise CheckpointError(f"checkpoint {tag_dir} is from another model config ({details})")


def tag_order_key(tag: str, manifest: Manifest) -> tuple[int, int, float]:
    # Tags are global steps (phase 2 adds phase1_end_step), so numeric order is training order;
    # other tags come before numeric ones, ordered by save time.
    if tag.isdigit():
        return (1, int(tag), 0.0)
    return (0, 0, manifest["saved_at_unix"])


def scan_checkpoints(output_dir: Path) -> tuple[list[tuple[str, Manifest]], dict[str, str]]:
    """Complete checkpoints, newest first, and {tag: reason} for checkpoint-like directories that
    are not complete (any directory holding a DeepSpeed states file, a state_<r>.pt or a manifest)."""
    complete: list[tuple[str, Manifest]] = []
    broken: dict[str, str] = {}
    for tag_dir in sorted(p for p in output_dir.iterdir() if p.is_dir()):
        found = read_manifest(tag_dir)
        if found[0] is not None:
            complete.append((tag_dir.name, found[0]))
        elif any(tag_dir.glob("*_states.pt")) or any(tag_dir.glob("state_*.pt")) \
                or (tag_dir / MANIFEST_NAME).exists():
            broken[tag_dir.name] = found[1]
    complete.sort(key=lambda item: tag_order_key(*item), reverse=True)
    return complete, broken


def _read_latest(output_dir: Path) -> str | None:
    try:
        return (output_dir / LATEST_NAME).read_text().strip()
    except FileNotFoundError:
        return None


def find_resume_tag(output_dir: str | os.PathLike[str], model_config: Mapping[str, Any] | None = None) -> str | None:
    """Tag to resume from (any rank may call it; it only reads).

    - None when output_dir holds no checkpoint: no `latest` and no complete checkpoint
      (directories of interrupted first saves are ignored with a CheckpointWarning).
    - The tag named by `latest` when that checkpoint is complete.
    - Otherwise the newest complete checkpoint, with a CheckpointWarning saying why.
    Raises CheckpointError when `latest` exists but no complete checkpoint does, and when the chosen
    checkpoint was saved (if model_config is given) with another model config. Another world size is
    fine: load_checkpoint re-partitions the ZeRO optimizer state."""
    chosen = choose_tag(Path(output_dir))
    if chosen is not None:
        tag, manifest = chosen
        check_compatible(Path(output_dir) / tag, manifest, model_config)
        return tag
    return None


def choose_tag(output_dir: Path) -> tuple[str, Manifest] | None:
    """(tag, manifest) by the rules of find_resume_tag, before its compatibility checks."""
    if not output_dir.is_dir():
        return None
    complete, not_complete = scan_checkpoints(output_dir)
    broken: dict[str, str | None] = dict(not_complete)  # None: `latest`'s checkpoint was completed after the scan
    latest = _read_latest(output_dir)
    if latest is not None and latest not in broken and latest not in dict(complete):
        broken[latest] = read_manifest(output_dir / latest)[1]
    return choose_among(output_dir, complete, broken, latest)


def choose_among(output_dir: str | os.PathLike[str], complete: list[tuple[str, Manifest]],
                 broken: Mapping[str, str | None], latest: str | None) -> tuple[str, Manifest] | None:
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


# --------------------------------------------------------------------------- prune

def prune_checkpoints(output_dir: str | os.PathLike[str], keep_last_n: int | None) -> list[str]:
    """Rank 0 (other ranks return at once): delete all but the newest keep_last_n complete
    checkpoints, never the one `latest` names. None or 0 keeps everything. Unfinished directories
    are left alone (a later save of the same tag replaces them). Returns the deleted tags."""
    if keep_last_n is not None and keep_last_n < 0:
        raise ValueError(f"keep_last_n must be >= 0 (0 keeps all), got {keep_last_n}")
    output_path = Path(output_dir)
    if not keep_last_n or rank_and_world()[0] != 0 or not output_path.is_dir():
        return []
    latest = _read_latest(output_path)
    complete, _ = scan_checkpoints(output_path)
    doomed = [tag for tag, _ in complete[keep_last_n:] if tag != latest]
    for tag in doomed:
        delete_tag_dir(output_path / tag)
    return doomed


# --------------------------------------------------------------------------- reading the files (resume, export)

def deepspeed_checkpoint_classes() -> list[type]:
    """The only non-tensor classes DeepSpeed 0.19.8 pickles into its ZeRO-1/2 optimizer files
    (found with torch.serialization.get_unsafe_globals_in_checkpoint); plain data holders."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, ZeroStageEnum, fragment_address]


def load_weights_only(path: str | os.PathLike[str], map_location: str | torch.device = "cpu",
                      mmap: bool = False) -> Any:
    """torch.load(weights_only=True) with DeepSpeed's three classes allowed. A file needing anything
    else is refused with the names of the classes it wants. mmap: tensors map the file, and only the
    pages a reader touches are read (and shared with the host's other ranks through the page cache)."""
    with torch.serialization.safe_globals(list(deepspeed_checkpoint_classes())):
        try:
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except pickle.UnpicklingError as exc:
            wanted = torch.serialization.get_unsafe_globals_in_checkpoint(path)
            raise CheckpointError(f"{path}: refusing to unpickle {wanted} (only tensors, plain data and "
                                  f"DeepSpeed's known checkpoint classes are loaded)") from exc


def zero_partition_files(tag_dir: Path) -> list[Path]:
    return sorted(tag_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_partition_rank)


def _partition_rank(partition_file: Path) -> int:
    found = re.search(r"zero_pp_rank_(\d+)_", partition_file.name)
    assert found is not None  # the glob of zero_partition_files matched it
    return int(found.group(1))


# Keys of DeepSpeed 0.19.8's ZeRO-1/2 optimizer state dicts (DeepSpeedZeroOptimizer and BF16_Optimizer).
FP32_PARTITIONS = "single_partition_of_fp32_groups"
BASE_STATE = "base_optimizer_state"


def load_partition_states(partition_files: list[Path], mmap: bool = False) -> list[dict[str, Any]]:
    """Every rank's ZeRO-1/2 optimizer state dict, in rank order, checked to be all of them."""
    states = [load_weights_only(path, mmap=mmap)["optimizer_state_dict"] for path in partition_files]
    counts = states[0]["partition_count"]
    if max(counts if isinstance(counts, list) else [counts]) != len(states):
        raise CheckpointError(f"{partition_files[0].parent}: {len(states)} optimizer partition files, "
                              f"the checkpoint was partitioned {counts} ways")
    return states


def param_offsets(states: list[dict[str, Any]], group: int, shapes: Mapping[str, torch.Size],
                  pieces: list[torch.Tensor]) -> list[int]:
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


if __name__ == "__main__":  # the command keeps its name: `python -m training.checkpointing export`
    from training.checkpoint_export import export_main
    sys.exit(export_main())
