"""Unit tests of the checkpoints (training/checkpointing.py, checkpoint_resume.py, checkpoint_export.py) on a real
DeepSpeed engine (CPU, gloo, one process).

The engine wraps a tiny MLP, so each test costs about a second; the model and the data are made here.
Round trips cannot pass by accident: the engine that loads starts from other weights (another seed)
and has taken a step of its own, and the check is that it then continues exactly like the engine
that saved (the same loss and weights after one more step), not only that state dicts compare equal.
"""

import contextlib
import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import helpers
from helpers import init_single_process_group, read_only
from training import checkpoint_export, checkpoint_resume, checkpointing
from training.checkpointing import CheckpointError, CheckpointWarning

deepspeed = pytest.importorskip("deepspeed")

MODEL_CONFIG = {"hidden_size": 16, "num_hidden_layers": 1, "vocab_size": 32}
CONFIGS = [(0, False), (1, False), (2, False), (0, True), (1, True), (2, True)]  # (ZeRO stage, bf16)


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    """One gloo process group of world size 1 (helpers.init_single_process_group)."""
    init_single_process_group()
    yield


class TinyNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.drop = torch.nn.Dropout(0.1)  # dropout makes the next step depend on the torch RNG too
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        pred = self.out(self.drop(self.norm(torch.nn.functional.gelu(self.inp(x)))))
        return torch.nn.functional.mse_loss(pred.float(), y)


def make_engine(seed: int, stage: int = 0, bf16: bool = False):
    torch.manual_seed(seed)
    model = TinyNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16},
              "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    warmup = torch.optim.lr_scheduler.LambdaLR
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                           lr_scheduler=lambda opt: warmup(opt, lambda s: min(1.0, (s + 1) / 5)))
    return engine


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(4, 8, generator=gen)
    return x, torch.randn(4, 4, generator=gen)


def train(engine, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = batch(step)
        x = x.to(next(engine.module.parameters()).dtype)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def client_state(step: int, config=MODEL_CONFIG) -> dict:
    return {"global_step": step, "samples_consumed": 4 * step, "epoch": 0, "phase": 1,
            "model_config": dict(config)}


def save(engine, out, step, config=MODEL_CONFIG):
    checkpointing.save_checkpoint(engine, out, str(step), client_state(step, config),
                                  checkpointing.capture_rng_state())


def weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def assert_tensors_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# --------------------------------------------------------------------------- round trip

@pytest.mark.parametrize("stage,bf16", CONFIGS, ids=[f"zero{s}-{'bf16' if b else 'fp32'}" for s, b in CONFIGS])
def test_round_trip_continues_exactly(tmp_path, stage, bf16):
    saver = make_engine(seed=0, stage=stage, bf16=bf16)
    train(saver, 3)
    save(saver, tmp_path, 3)
    saved_weights, saved_sched = weights(saver), saver.lr_scheduler.state_dict()
    torch.manual_seed(77)  # the dropout mask of step 4 comes from the RNG state saved above...
    checkpointing.restore_rng_state(torch.load(tmp_path / "3" / "state_0.pt", weights_only=True))
    expected_loss = train(saver, 1, first=3)
    expected_weights = weights(saver)

    loader = make_engine(seed=1, stage=stage, bf16=bf16)
    train(loader, 1, first=50)  # its own optimizer moments and scheduler position, all different
    assert not torch.equal(weights(loader)["inp.weight"], saved_weights["inp.weight"])
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    state, rank_state = checkpoint_resume.load_checkpoint(loader, tmp_path, "3", global_rank=0, world_size=1)

    assert state == client_state(3)
    assert_tensors_equal(weights(loader), saved_weights)
    assert loader.module.inp.weight.data_ptr() != saver.module.inp.weight.data_ptr()
    assert loader.lr_scheduler.state_dict() == saved_sched
    assert loader.global_steps == 3
    checkpointing.restore_rng_state(rank_state)
    # ...so after restoring it the loader takes the very same step: same loss, same weights.
    assert train(loader, 1, first=3) == expected_loss
    assert_tensors_equal(weights(loader), expected_weights)
    # (python and numpy RNG streams: test_rng_state_round_trip_through_weights_only_load)


def test_rng_state_round_trip_through_weights_only_load(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    np.random.standard_normal()  # leaves a cached gaussian in numpy's legacy state
    state = checkpointing.capture_rng_state()
    torch.save(state, tmp_path / "rng.pt")
    expected = ([random.random() for _ in range(3)], np.random.standard_normal(3), torch.rand(3))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    checkpointing.restore_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert [random.random() for _ in range(3)] == expected[0]
    assert np.array_equal(np.random.standard_normal(3), expected[1])
    assert torch.equal(torch.rand(3), expected[2])


def test_a_cuda_rank_restores_its_own_devices_rng_state():
    """A rank draws from cuda:LOCAL_RANK only. Checkpoints from before 2026-11-27 hold a state per visible device
    (torch.cuda.get_rng_state_all): the rank takes its own index's, not the first one's; newer ones hold one."""
    states = [torch.tensor([index] * 4, dtype=torch.uint8) for index in range(8)]  # stand-ins, byte tensors
    assert torch.equal(checkpointing.own_cuda_rng_state(states, 5), states[5])
    assert checkpointing.own_cuda_rng_state(states[2], 5) is states[2]
    with pytest.raises(checkpointing.CheckpointError, match="RNG states of 4 devices, none for this rank's cuda:5"):
        checkpointing.own_cuda_rng_state(states[:4], 5)


def test_a_cuda_rng_state_does_not_resume_on_another_device_type():
    state = checkpointing.capture_rng_state(torch.device("cpu"))
    assert "cuda" not in state
    with pytest.raises(checkpointing.CheckpointError, match="CUDA RNG state but this run is not on CUDA"):
        checkpointing.restore_rng_state(dict(state, cuda=torch.zeros(16, dtype=torch.uint8)), torch.device("cpu"))


# --------------------------------------------------------------------------- layout, latest, manifest

@pytest.fixture
def two_checkpoints(tmp_path):
    """tmp_path with complete checkpoints 2 and 4 (ZeRO-1, fp32) and `latest` = 4."""
    engine = make_engine(seed=0, stage=1)
    train(engine, 2)
    save(engine, tmp_path, 2)
    train(engine, 2, first=2)
    save(engine, tmp_path, 4)
    return tmp_path


def test_latest_and_manifest(two_checkpoints):
    out = two_checkpoints
    assert (out / "latest").read_text() == "4"
    assert checkpointing.find_resume_tag(out, MODEL_CONFIG) == "4"
    manifest = json.loads((out / "4" / "complete.json").read_text())
    assert manifest["world_size"] == 1 and manifest["tag"] == "4"
    assert manifest["optimizer_layout"] == {"zero_stage": 1, "optimizer_wrapper": "DeepSpeedZeroOptimizer",
                                            "partitioned": True, "bf16": False}
    assert manifest["model_config"] == MODEL_CONFIG
    assert manifest["deepspeed_version"] == deepspeed.__version__
    on_disk = {p.name: p.stat().st_size for p in (out / "4").iterdir() if p.name != "complete.json"}
    assert manifest["files"] == on_disk
    assert {"mp_rank_00_model_states.pt", "state_0.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"} \
        <= set(on_disk)  # the ZeRO file is named bf16_zero_pp_rank_... in bf16
    assert not [p for p in out.rglob("*") if ".tmp." in p.name]


def test_deepspeed_reads_our_latest(two_checkpoints):
    # `latest` keeps DeepSpeed's format: engine.load_checkpoint(dir) without a tag loads step 4.
    engine = make_engine(seed=3, stage=1)
    path, state = engine.load_checkpoint(str(two_checkpoints))
    assert path.endswith(os.path.join("4", "mp_rank_00_model_states.pt"))
    assert state["global_step"] == 4


def test_resave_replaces_leftover_directory(tmp_path):
    stale = tmp_path / "3"
    stale.mkdir()
    (stale / "mp_rank_00_model_states.pt").write_bytes(b"half written")
    (stale / "junk.bin").write_bytes(b"x")
    engine = make_engine(seed=0)
    train(engine, 3)
    save(engine, tmp_path, 3)
    assert not (stale / "junk.bin").exists()
    assert checkpointing.find_resume_tag(tmp_path) == "3"
    checkpoint_resume.load_checkpoint(make_engine(seed=1), tmp_path, "3", 0, 1)


def record_fsyncs(monkeypatch) -> list:
    """Names of the regular files os.fsync is called on, in order (the name at the time of the call)."""
    names, real_fsync = [], os.fsync

    def fsync(fd):
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if target.is_file():
            names.append(target.name)
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return names


def test_each_file_is_fsynced_once_before_its_rename(tmp_path, monkeypatch):
    # Re-opening final files after the save (as a tree fsync on every rank did) raced with the other
    # ranks' renames; each file must be fsynced once, under its temporary name, and never re-opened.
    engine = make_engine(seed=0, stage=1)
    train(engine, 1)
    fsynced = record_fsyncs(monkeypatch)
    save(engine, tmp_path, 1)
    final = sorted(p.name for p in (tmp_path / "1").iterdir()) + ["latest", ".write_probe"]
    assert sorted(fsynced) == sorted(f".{name}.tmp.{os.getpid()}" for name in final)


class UnsyncedCheckpointEngine(deepspeed.runtime.checkpoint_engine.checkpoint_engine.CheckpointEngine):
    """A checkpoint engine other than DeepSpeed's TorchCheckpointEngine (DeepSpeed's interface): it writes
    DeepSpeed's files itself, with plain torch.save and no fsync."""

    def create(self, info):
        pass

    def save(self, state_dict, path: str):
        torch.save(state_dict, path)

    def load(self, path: str, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info):
        return True


def test_files_of_other_checkpoint_engines_are_fsynced_by_rank0(tmp_path, monkeypatch):
    engine = make_engine(seed=0, stage=1)
    train(engine, 1)
    engine.checkpoint_engine = UnsyncedCheckpointEngine()
    fsynced = record_fsyncs(monkeypatch)
    save(engine, tmp_path, 1)
    deepspeed_files = {p.name for p in (tmp_path / "1").glob("*_states.pt")}
    assert len(deepspeed_files) == 2 and deepspeed_files <= set(fsynced)
    assert checkpointing.find_resume_tag(tmp_path, MODEL_CONFIG) == "1"


# --------------------------------------------------------------------------- fallback and errors

def resume_with_warning(out, match):
    with pytest.warns(CheckpointWarning, match=match):
        return checkpointing.find_resume_tag(out, MODEL_CONFIG)


def test_interrupted_save_is_ignored_while_latest_is_complete(two_checkpoints):
    partial = two_checkpoints / "6"
    partial.mkdir()
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"partial")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checkpointing.find_resume_tag(two_checkpoints, MODEL_CONFIG) == "4"


def test_latest_naming_incomplete_tag_falls_back(two_checkpoints):
    (two_checkpoints / "4" / "complete.json").unlink()
    assert resume_with_warning(two_checkpoints, r"'4'.*no complete\.json.*newest complete checkpoint '2'") == "2"


def test_latest_naming_missing_tag_falls_back(two_checkpoints):
    (two_checkpoints / "latest").write_text("8")
    assert resume_with_warning(two_checkpoints, r"'8'.*does not exist.*'4'") == "4"


def test_missing_rank_file_falls_back(two_checkpoints):
    (two_checkpoints / "4" / "state_0.pt").unlink()
    assert resume_with_warning(two_checkpoints, r"state_0\.pt listed in complete\.json is missing") == "2"
    with pytest.raises(CheckpointError, match="state_0.pt"):
        checkpoint_resume.load_checkpoint(make_engine(seed=1, stage=1), two_checkpoints, "4", 0, 1)


def test_truncated_file_falls_back(two_checkpoints):
    path = two_checkpoints / "4" / "mp_rank_00_model_states.pt"
    os.truncate(path, path.stat().st_size // 2)
    assert resume_with_warning(two_checkpoints, r"mp_rank_00_model_states\.pt has \d+ bytes") == "2"


def test_no_latest_file_uses_newest_complete(two_checkpoints):
    (two_checkpoints / "latest").unlink()
    assert resume_with_warning(two_checkpoints, "no `latest` file") == "4"


def test_other_model_config_is_an_error(two_checkpoints):
    other = dict(MODEL_CONFIG, hidden_size=32)
    with pytest.raises(CheckpointError, match=r"another model config \(hidden_size: checkpoint 16 vs run 32\)"):
        checkpointing.find_resume_tag(two_checkpoints, other)


def test_another_world_size_needs_the_same_kind_of_optimizer_layout(two_checkpoints):
    """A ZeRO-1 checkpoint of 1 rank resumed by rank 0 of 2 with ZeRO-0: one error before anything loads.
    (Re-partitioning itself runs on real ranks: tests/test_world_size.py.)"""
    assert checkpointing.find_resume_tag(two_checkpoints, MODEL_CONFIG) == "4"  # any world size may resume
    engine = make_engine(seed=1, stage=0)
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(CheckpointError, match=r"written with ZeRO stage 1 by 1 ranks; this run has 2 ranks and "
                                              r"ZeRO stage 0: .*between ZeRO-1/2 layouts or between ZeRO-0"):
        checkpoint_resume.load_checkpoint(engine, two_checkpoints, "4", global_rank=0, world_size=2)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))


def test_none_usable_is_an_error(two_checkpoints):
    for tag in ("2", "4"):
        (two_checkpoints / tag / "state_0.pt").unlink()
    with pytest.raises(CheckpointError, match=r"`latest` names '4'.*state_0\.pt.*no other checkpoint is complete"):
        checkpointing.find_resume_tag(two_checkpoints, MODEL_CONFIG)


def test_no_checkpoint_means_fresh_start(tmp_path):
    assert checkpointing.find_resume_tag(tmp_path / "absent") is None
    (tmp_path / "dllogger.json").write_text("")
    assert checkpointing.find_resume_tag(tmp_path) is None
    first = tmp_path / "2"
    first.mkdir()
    (first / "mp_rank_00_model_states.pt").write_bytes(b"killed during the first save")
    assert resume_with_warning(tmp_path, r"ignoring unfinished checkpoint.*'2'") is None


# --------------------------------------------------------------------------- prune

def test_prune_keeps_newest_and_latest(tmp_path):
    engine = make_engine(seed=0)
    for step in (1, 2, 3, 4):
        train(engine, 1, first=step)
        save(engine, tmp_path, step)
    partial = tmp_path / "0"
    partial.mkdir()
    (partial / "state_0.pt").write_bytes(b"x")
    assert checkpointing.prune_checkpoints(tmp_path, None) == []
    (tmp_path / "latest").write_text("1")  # e.g. after a fallback: `latest` must survive pruning
    assert sorted(checkpointing.prune_checkpoints(tmp_path, 2)) == ["2"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["0", "1", "3", "4"]
    with pytest.raises(ValueError, match="keep_last_n"):
        checkpointing.prune_checkpoints(tmp_path, -1)


# --------------------------------------------------------------------------- write errors

def assert_previous_intact(out):
    assert (out / "latest").read_text() == "4"
    assert checkpointing.find_resume_tag(out, MODEL_CONFIG) == "4"
    assert not [p for p in out.rglob("*") if ".tmp." in p.name]
    state, _ = checkpoint_resume.load_checkpoint(make_engine(seed=1, stage=1), out, "4", 0, 1)
    assert state["global_step"] == 4


@contextlib.contextmanager
def tmpfs(directory: Path, size: str):
    """A small RAM file system on `directory` (needs root and mount permission, else the test skips)."""
    directory.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                           capture_output=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill up: {mount.stderr!r}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_disk_full_during_save(tmp_path):
    out = tmp_path / "small_disk"
    engine = make_engine(seed=0, stage=1)
    with tmpfs(out, "1m"):
        train(engine, 4)
        save(engine, out, 4)
        used = sum(p.stat().st_size for p in (out / "4").iterdir())
        free = os.statvfs(out).f_bavail * os.statvfs(out).f_frsize
        (out / "filler").write_bytes(b"\0" * (free - used // 2))  # room for half a checkpoint
        with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*6.*No space left on device"):
            save(engine, out, 6)
        assert not (out / "6").exists()
        (out / "filler").unlink()
        assert_previous_intact(out)


def test_disk_full_inside_deepspeed_write(two_checkpoints, monkeypatch):
    """Without root: torch.save fails with ENOSPC after a partial write of the ZeRO optimizer file."""
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):
        if "optim_states" in getattr(f, "name", str(f)):
            f.write(b"first bytes")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    engine = make_engine(seed=0, stage=1)
    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*6.*No space left on device"):
        save(engine, two_checkpoints, 6)
    monkeypatch.undo()
    assert not (two_checkpoints / "6").exists()
    assert_previous_intact(two_checkpoints)


def save_with_a_failing_rename(out, monkeypatch, fails) -> list:
    """Save checkpoint 6 into `out` while os.replace raises ENOSPC where fails(destination name, commit
    renames so far) is true; returns the names of the commit renames (manifest, `latest`) in call order."""
    real_replace, commit_renames = os.replace, []

    def replace(src, dst):
        name = Path(dst).name
        if name in (checkpointing.MANIFEST_NAME, checkpointing.LATEST_NAME):
            commit_renames.append(name)
        if fails(name, commit_renames):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    engine = make_engine(seed=0, stage=1)
    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CheckpointError, match="cannot commit checkpoint .*No space left on device"):
        save(engine, out, 6)
    monkeypatch.undo()
    return commit_renames


def test_failed_latest_update_leaves_no_temp_file(two_checkpoints, monkeypatch):
    save_with_a_failing_rename(two_checkpoints, monkeypatch, lambda name, _: name == checkpointing.LATEST_NAME)
    assert_previous_intact(two_checkpoints)


def test_failure_between_the_commit_renames_keeps_the_previous_checkpoint(two_checkpoints, monkeypatch):
    """The commit renames the manifest and `latest` into place. Whichever of the two comes second fails
    here: the previous checkpoint must stay what `latest` names, so `latest` has to move last."""
    commit_renames = save_with_a_failing_rename(two_checkpoints, monkeypatch,
                                                lambda name, renames: name in renames and len(renames) == 2)
    assert_previous_intact(two_checkpoints)
    assert commit_renames == [checkpointing.MANIFEST_NAME, checkpointing.LATEST_NAME]


def test_read_only_output_dir(two_checkpoints):
    engine = make_engine(seed=0, stage=1)
    with read_only(two_checkpoints):
        with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*6.*(Read-only|Permission denied)"):
            save(engine, two_checkpoints, 6)
    assert_previous_intact(two_checkpoints)


# --------------------------------------------------------------------------- trust

class RunsCodeWhenUnpickled:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def test_pickled_code_in_checkpoint_is_refused(two_checkpoints, tmp_path):
    # A tampered checkpoint (manifest sizes updated too) must not run code on load, although
    # DeepSpeed itself would read it with torch.load(weights_only=False).
    marker = tmp_path / "code_ran"
    path = two_checkpoints / "4" / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["payload"] = RunsCodeWhenUnpickled(marker)
    torch.save(state, path)
    manifest_path = two_checkpoints / "4" / "complete.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][path.name] = path.stat().st_size
    manifest_path.write_text(json.dumps(manifest))
    assert checkpointing.find_resume_tag(two_checkpoints, MODEL_CONFIG) == "4"
    with pytest.raises(CheckpointError, match=r"refusing to unpickle .*getattr"):
        checkpoint_resume.load_checkpoint(make_engine(seed=1, stage=1), two_checkpoints, "4", 0, 1)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # negative control: plain pickle does run it
    assert marker.exists()


# --------------------------------------------------------------------------- export

@pytest.mark.parametrize("stage,bf16", CONFIGS, ids=[f"zero{s}-{'bf16' if b else 'fp32'}" for s, b in CONFIGS])
def test_consolidated_state_dict(tmp_path, stage, bf16):
    engine = make_engine(seed=0, stage=stage, bf16=bf16)
    train(engine, 2)
    save(engine, tmp_path, 2)
    weights = checkpoint_export.consolidated_state_dict(tmp_path)
    module = {k: v.detach() for k, v in engine.module.state_dict().items()}
    assert weights.keys() == module.keys()
    assert all(v.dtype == torch.float32 for v in weights.values())
    if stage == 0:  # the module file: fp32 weights, or the bf16 weights upcast
        assert_tensors_equal(weights, {k: v.float() for k, v in module.items()})
        return
    # Independent reference: DeepSpeed's own zero_to_fp32 (full-pickle reader, our own file here).
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    expected = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="2")
    assert_tensors_equal(weights, {k: v.detach() for k, v in expected.items()})
    dtype = torch.bfloat16 if bf16 else torch.float32
    assert_tensors_equal({k: v.to(dtype) for k, v in weights.items()}, module)


def test_export_cli_errors_in_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "training.checkpointing", "export", "--output_dir",
                             str(tmp_path / "none"), "--out", str(tmp_path / "w.pt")], capture_output=True, text=True,
                            cwd=helpers.REPO_ROOT)
    assert result.returncode == 1
    assert result.stderr.strip() == f"error: no checkpoint in {tmp_path / 'none'}"
    assert not (tmp_path / "w.pt").exists()


def test_a_flat_range_is_read_from_the_pieces_that_overlap_it():
    """_read_flat_range (the re-partitioning's reader) against slicing the whole concatenation, for every
    range of random piece lengths (some empty, as a rank holding padding only), including ranges that
    cross several pieces."""
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 0, 1, 7, 3, 0, 4]
    pieces = [torch.randn(n, generator=generator) for n in lengths]
    whole = torch.cat(pieces)
    for start in range(whole.numel()):
        for end in range(start, whole.numel() + 1):
            out = torch.full((end - start,), float("nan"))
            checkpoint_resume._read_flat_range(pieces, start, out)
            assert torch.equal(out, whole[start:end]), (start, end)
