"""What a pretraining run reads and writes, checked before its first step: the output directory (or S3 prefix)
and the log, the training and held-out shards' headers (DataInfo), the same shards on every rank, and whether
the run fits the device's memory. Each refusal is one InputError line."""

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common import storage
from common.errors import HostInputError, InputError, InputErrorOnEveryRank
from data.dataset import LocalShardFiles, ShardInfo, scan_shards
from data.shard_format import ShardError
from training import checkpoint_s3, command_line, sizing
from training.pretraining_config import Config


@dataclass
class DataInfo:
    shards: list[ShardInfo]
    seq_len: int
    max_pred: int
    num_samples: int
    shard_files: LocalShardFiles | storage.ShardCache  # the cache for an s3:// --input_dir


def open_inputs(config: Config) -> tuple[DataInfo, DataInfo | None, checkpoint_s3.CheckpointUploader | None]:
    """Every check of the files and stores the run reads and writes that needs no device: returns the
    training data, the held-out data (None without --eval_dir) and the checkpoint copies to S3 (None for a
    local --output_dir); raises InputError."""
    try:
        copies = (open_s3_output(config.output_dir, config.s3_endpoint_url, Path(config.s3_cache_dir),
                                 config.keep_last_n_checkpoints, resuming=config.resume_from_checkpoint)
                  if storage.is_s3_url(config.output_dir) else None)
    except storage.StorageError as err:
        raise HostInputError(str(err)) from err
    output_dir = Path(config.output_dir)
    # Another rank's write probe (below) may be there for a moment: it does not count.
    if (copies is None and output_dir.is_dir() and not config.resume_from_checkpoint
            and any(not p.name.startswith(storage.WRITE_PROBE_PREFIX) for p in output_dir.iterdir())):
        raise InputError(f"--output_dir {output_dir} is not empty: pass --resume_from_checkpoint "
                         "or use an empty directory")
    if copies is None:
        command_line.check_writable_directory(output_dir, "--output_dir")
    else:  # checkpoints are written there before they are copied to S3
        command_line.check_writable_directory(copies.local_dir, "--s3_cache_dir")
    command_line.check_writable_file(config.json_summary, "--json-summary")
    if config.init_checkpoint is not None and not Path(config.init_checkpoint).exists():
        raise HostInputError(f"--init_checkpoint {config.init_checkpoint} does not exist")
    try:
        shard_files = open_shard_files(config.input_dir, config.s3_endpoint_url, config.s3_cache_dir,
                                       config.s3_cache_gb)
    except storage.StorageError as err:
        raise HostInputError(str(err)) from err
    data = inspect_data(config.input_dir, shard_files, config.max_predictions_per_seq,
                        config.ds_config["train_micro_batch_size_per_gpu"] * config.world_size)
    model_config = config.model_config
    if data.seq_len > model_config.max_position_embeddings:
        raise InputError(f"the shards' sequences have {data.seq_len} tokens, more than max_position_embeddings "
                         f"{model_config.max_position_embeddings} of --config_file {config.config_file}")
    return data, open_held_out(config, data), copies


def open_held_out(config: Config, data: DataInfo) -> DataInfo | None:
    """The headers of --eval_dir's shards, checked (their values are checked when the held-out samples are read,
    also before the first step); None without --eval_dir."""
    if config.eval_dir is None:
        return None
    held_out = inspect_data(config.eval_dir, open_shard_files(config.eval_dir, None, "", 0, flag="--eval_dir"),
                            config.max_predictions_per_seq, config.num_eval_examples, held_out=True)
    if held_out.seq_len != data.seq_len:
        raise InputError(f"--eval_dir {config.eval_dir} holds sequences of {held_out.seq_len} tokens, the training "
                         f"shards of --input_dir {config.input_dir} of {data.seq_len}: held-out shards must be made "
                         "like the training shards")
    return held_out


def open_s3_output(url: str, endpoint_url: str | None, cache_dir: Path, keep_last_n: int, *,
                   resuming: bool) -> checkpoint_s3.CheckpointUploader:
    """Checkpoint copies for an s3:// --output_dir `url`: the prefix must be writable (checked by rank 0) and
    empty unless resuming; checkpoints are staged in <cache_dir (--s3_cache_dir)>/checkpoints."""
    store = storage.S3Store(url, endpoint_url)
    store.check_access(write=os.environ.get("RANK", "0") == "0")
    # Rank 0's write probe may be there for a moment while another rank looks: it does not count.
    if not resuming and any(not remote.name.startswith(storage.WRITE_PROBE_PREFIX)
                            for remote in store.list_objects(recursive=True)):
        raise InputError(f"--output_dir {url} is not empty: pass --resume_from_checkpoint or use an empty prefix")
    return checkpoint_s3.CheckpointUploader(store, cache_dir / "checkpoints", keep_last_n)


def open_shard_files(input_dir: str, endpoint_url: str | None, cache_dir: str, cache_gb: float,
                     flag: str = "--input_dir") -> LocalShardFiles | storage.ShardCache:
    """Where the shards are read from: the directory, or for an s3:// input_dir this server's download
    cache in cache_dir (--s3_cache_dir), bounded by cache_gb (--s3_cache_gb). flag: what messages call it."""
    if not storage.is_s3_url(input_dir):
        if not Path(input_dir).is_dir():
            raise HostInputError(f"{flag} {input_dir} does not exist or is not a directory")
        return LocalShardFiles(input_dir)
    if not cache_gb > 0:
        raise InputError(f"--s3_cache_gb must be positive, got {cache_gb}")
    store = storage.S3Store(input_dir, endpoint_url)
    store.check_access()
    return storage.ShardCache(store, storage.server_cache_dir(cache_dir), int(cache_gb * 2 ** 30))


def inspect_data(input_dir: str, shard_files: LocalShardFiles | storage.ShardCache, max_predictions_per_seq: int,
                 min_samples: int, *, held_out: bool = False) -> DataInfo:
    """Check the header of every training shard (the values, ids and labels, are checked later, per window
    read). min_samples: one global micro-batch. held_out: input_dir is --eval_dir, its held-out shards are
    checked, and min_samples is --num_eval_examples."""
    flag, needed = (("--eval_dir", f"--num_eval_examples {min_samples}") if held_out
                    else ("--input_dir", f"one global micro-batch ({min_samples})"))
    try:
        shards, seq_len, max_pred = scan_shards(input_dir, shard_files, held_out=held_out)
        if isinstance(shard_files, storage.ShardCache):
            shard_files.check_capacity([str(shard.path) for shard in shards])
    except (ShardError, storage.StorageError) as err:  # this server's copy, or its way to the storage
        raise HostInputError(str(err)) from err
    if max_pred > max_predictions_per_seq:
        raise InputError(f"the shards of {flag} {input_dir} hold {max_pred} masked positions per sequence, more than "
                         f"--max_predictions_per_seq {max_predictions_per_seq}")
    num_samples = sum(s.num_samples for s in shards)
    if num_samples < min_samples:
        raise InputError(f"{flag} {input_dir} holds {num_samples} samples, fewer than {needed}")
    return DataInfo(shards, seq_len, max_pred, num_samples, shard_files)


def check_same_shards_on_every_rank(data: DataInfo, input_dir: str, hosts: list[str]) -> None:
    """Each rank lists --input_dir itself, and the ranks cut one stream from their listings: a server whose
    copy lacks a shard (an unfinished copy) or holds another version of one would make the ranks train other
    samples than planned, silently. One all-gather of a digest; the listings themselves only when they differ.
    hosts: every rank's host (training/distributed.Job.hosts), for the message."""
    listing = {"shards": shard_listing(data.shards), "seq_len": data.seq_len, "max_pred": data.max_pred}
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, hashlib.sha256(json.dumps(listing).encode()).hexdigest())
    if len(set(digests)) == 1:
        return
    listings: list[Any] = [None] * len(digests)  # every rank's `listing`
    dist.all_gather_object(listings, listing)
    other = next(rank for rank, digest in enumerate(digests) if digest != digests[0])
    first, second = ({name: size for name, size in listings[r]["shards"]} for r in (0, other))
    differences = [f"{name} only on rank 0" for name in sorted(first.keys() - second.keys())]
    differences += [f"{name} only on rank {other}" for name in sorted(second.keys() - first.keys())]
    differences += [f"{name} has {first[name]} samples on rank 0, {second[name]} on rank {other}"
                    for name in sorted(first.keys() & second.keys()) if first[name] != second[name]]
    differences += [f"{key} {listings[0][key]} on rank 0, {listings[other][key]} on rank {other}"
                    for key in ("seq_len", "max_pred") if listings[0][key] != listings[other][key]]
    shown = "; ".join(differences[:3]) + (f"; and {len(differences) - 3} more" if len(differences) > 3 else "")
    raise InputErrorOnEveryRank(f"--input_dir {input_dir} holds other training shards on rank {other} "
                                f"({hosts[other]}) than on rank 0 ({hosts[0]}): {shown}. Every server must hold "
                                "the same shards")


def shard_listing(shards: list[ShardInfo]) -> list[list[Any]]:
    """What identifies the training shards, wherever they live: sorted [name, samples] pairs."""
    return sorted([shard.name, shard.num_samples] for shard in shards)


def check_memory(device: torch.device, config: Config, data: DataInfo, say: Callable[[str], None], *,
                 device_memory: Callable[[torch.device], tuple[float | None, str]]) -> None:
    """Refuse, before the model is built, a run the memory planner says cannot fit this device."""
    # the DeepSpeed JSON's own optimizer: planned as LANS, the one with the most temporaries
    optimizer = config.optimizer if config.optimizer in sizing.OPTIMIZER_TEMPORARIES else "lans"
    setup = sizing.TrainingSetup.from_deepspeed_config(config.ds_config, dist.get_world_size(), data.seq_len,
                                                       data.max_pred, config.activation_checkpoint_interval, optimizer,
                                                       on_cpu=device.type == "cpu")
    predicted = sizing.device_memory(config.model_config, setup)["total"]
    available, description = device_memory(device)
    if available is None:
        say(f"memory check skipped: the memory of {description} is unknown")
        return
    if sizing.fits(predicted, available):
        return
    message = (f"the memory planner predicts {predicted / 2**30:.2f} GiB per device at the peak, more than "
               f"{sizing.USABLE_FRACTION:.0%} of {available / 2**30:.1f} GiB ({description}); lower "
               "train_micro_batch_size_per_gpu, add --checkpoint_activations, or use more ranks or a higher "
               "ZeRO stage (scripts/plan_memory.py shows the parts)")
    if not config.skip_memory_check:
        raise InputError(message + "; --skip_memory_check trains anyway")
    say(f"warning: {message}; training anyway (--skip_memory_check)")
