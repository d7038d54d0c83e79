"""Checkpoint copies on S3 (training/checkpoint_s3.py) against a real S3 server (moto_server).

Checkpoints here are small directories committed by checkpointing.commit_checkpoint (manifest and
`latest` as a real save writes them); the end-to-end runs of the driver are in test_s3_training.py."""

from pathlib import Path

import pytest
import torch

import s3_helpers
from common import storage
from training import checkpoint_export, checkpoint_s3, checkpointing


def save_local(output_dir: Path, tag: str, world: int = 2, size: int = 1000) -> None:
    """A complete checkpoint <output_dir>/<tag> of world-size `world`, committed like a real save."""
    tag_dir = output_dir / tag
    tag_dir.mkdir(parents=True)
    torch.save({"module": {"w": torch.full((size,), float(tag))}}, tag_dir / "mp_rank_00_model_states.pt")
    for rank in range(world):
        torch.save({"rank": rank, "tag": tag}, tag_dir / checkpointing.rank_state_name(rank))
    checkpointing.commit_checkpoint(output_dir, tag, world, {"model_config": {"hidden_size": 8}}, fsync_files=False,
                                    layout={"zero_stage": 0, "optimizer_wrapper": "LANS", "partitioned": False,
                                            "bf16": False})


@pytest.fixture
def remote(s3):
    _, bucket, _ = s3
    return storage.S3Store(f"s3://{bucket}/run1")


class RequestLog:
    """Observes (never answers) the S3 requests: (operation, key) in the order they were sent."""

    def __init__(self):
        self.requests = []

    def __call__(self, request, event_name, **_):
        operation = event_name.rsplit(".", 1)[-1]
        self.requests.append((operation, request.url.split("?")[0].split("/", 4)[-1]))


def test_upload_commits_files_then_manifest_then_latest(tmp_path, remote):
    save_local(tmp_path / "local", "4")
    log = RequestLog()
    remote.client.meta.events.register("before-send.s3", log)
    checkpoint_s3.upload_checkpoint(remote, tmp_path / "local", "4")
    writes = [key for operation, key in log.requests if operation in ("PutObject", "CreateMultipartUpload")]
    assert writes[-2:] == ["run1/4/complete.json", "run1/latest"]
    assert sorted(writes[:-2]) == ["run1/4/mp_rank_00_model_states.pt", "run1/4/state_0.pt", "run1/4/state_1.pt"]
    assert remote.get_bytes("latest") == b"4"


def test_fetch_downloads_what_latest_names(tmp_path, remote):
    for tag in ("2", "4"):
        save_local(tmp_path / "local", tag)
        checkpoint_s3.upload_checkpoint(remote, tmp_path / "local", tag)
    assert checkpoint_s3.fetch_checkpoint(remote, tmp_path / "fetched") == "4"
    assert checkpointing.find_resume_tag(tmp_path / "fetched") == "4"
    assert sorted(p.name for p in (tmp_path / "fetched" / "4").iterdir()) == \
        sorted(p.name for p in (tmp_path / "local" / "4").iterdir())
    assert not (tmp_path / "fetched" / "2").exists()  # only what resume needs


@pytest.mark.parametrize("damage", ["no_manifest", "missing_file", "short_file"])
def test_fetch_falls_back_to_the_newest_complete_checkpoint(tmp_path, remote, damage):
    for tag in ("2", "4", "6"):
        save_local(tmp_path / "local", tag)
        checkpoint_s3.upload_checkpoint(remote, tmp_path / "local", tag)
    if damage == "no_manifest":
        remote.delete(["6/complete.json"])
    elif damage == "missing_file":
        remote.delete(["6/state_1.pt"])
    else:
        remote.put_bytes("6/state_1.pt", b"short")
    with pytest.warns(checkpointing.CheckpointWarning, match=r"`latest` names checkpoint '6'.*newest complete "
                                                              r"checkpoint '4'"):
        assert checkpoint_s3.fetch_checkpoint(remote, tmp_path / "fetched") == "4"


def test_fetch_of_an_empty_prefix_is_none_and_of_a_missing_tag_an_error(tmp_path, remote):
    assert checkpoint_s3.fetch_checkpoint(remote, tmp_path / "fetched") is None
    with pytest.raises(checkpointing.CheckpointError, match=r"no complete checkpoint '8' in s3://.*/run1"):
        checkpoint_s3.fetch_checkpoint(remote, tmp_path / "fetched", tag="8")


def test_prune_deletes_on_s3_and_keeps_latest(tmp_path, remote):
    for tag in ("2", "4", "6", "8"):
        save_local(tmp_path / "local", tag)
        checkpoint_s3.upload_checkpoint(remote, tmp_path / "local", tag)
    remote.put_bytes("latest", b"2")  # as after a resume from 2: latest is never pruned
    assert checkpoint_s3.prune_remote_checkpoints(remote, 2) == ["4"]
    assert sorted({o.name.split("/")[0] for o in remote.list_objects(recursive=True)}) == ["2", "6", "8", "latest"]


def test_uploader_runs_in_the_background_and_keeps_the_newest_local_copy(tmp_path, remote):
    uploader = checkpoint_s3.CheckpointUploader(remote, tmp_path / "local", keep_last_n=2)
    for tag in ("2", "4", "6"):
        save_local(tmp_path / "local", tag)
        uploader.start(tag)
        uploader.finish("cpu")
    assert sorted(p.name for p in (tmp_path / "local").iterdir()) == ["6", "latest"]
    assert sorted({o.name.split("/")[0] for o in remote.list_objects(recursive=True)}) == ["4", "6", "latest"]


def test_failed_upload_stops_with_one_line_and_latest_names_a_complete_checkpoint(tmp_path, remote):
    """The server answers 503 SlowDown from the second write of checkpoint 4 on, for good."""
    uploader = checkpoint_s3.CheckpointUploader(remote, tmp_path / "local")
    save_local(tmp_path / "local", "2")
    uploader.start("2")
    uploader.finish("cpu")
    save_local(tmp_path / "local", "4", size=10)
    injector = s3_helpers.install_faults("slowdown:2:1000000:PutObject", remote.client)
    try:
        uploader.start("4")
        with pytest.raises(checkpointing.CheckpointError) as info:
            uploader.finish("cpu")
    finally:
        s3_helpers.remove_faults(injector)
    assert str(info.value).startswith(f"checkpoint 4 was not copied to {remote.url()}: cannot upload ")
    assert "SlowDown (HTTP 503) after 4 attempts" in str(info.value) and "\n" not in str(info.value)
    assert remote.get_bytes("latest") == b"2"
    assert checkpoint_s3.fetch_checkpoint(remote, tmp_path / "fetched") == "2"
    assert (tmp_path / "local" / "4").is_dir()  # the local copy stays (the copy failed)


def staged_run_cut_short(remote, staging: Path) -> None:
    """A run on `remote` staging in `staging`: checkpoint 10 copied to S3, then checkpoint 20 saved complete
    but its copy cut short after one file (a preemption's last save, then SIGKILL)."""
    run = checkpoint_s3.CheckpointUploader(remote, staging)
    run.prepare("cpu", resume=False)
    save_local(staging, "10")
    run.start("10")
    run.finish("cpu")
    save_local(staging, "20")
    remote.upload(staging / "20" / "state_0.pt", "20/state_0.pt")


def test_resume_copies_a_complete_staged_checkpoint_that_s3_lacks_and_resumes_from_it(tmp_path, remote):
    staging = tmp_path / "staging"
    staged_run_cut_short(remote, staging)
    staged_files = {p.name: p.read_bytes() for p in (staging / "20").iterdir()}
    said = []
    checkpoint_s3.CheckpointUploader(remote, staging).prepare("cpu", resume=True, say=said.append)
    assert said == [f"checkpoint 20 in {staging} is complete but its copy to {remote.url()} was cut short: "
                    "uploading it now, then resuming from it"]
    assert sorted(p.name for p in staging.iterdir()) == [checkpoint_s3.STAGING_PREFIX_NAME, "20", "latest"]
    assert checkpointing.find_resume_tag(staging) == "20"
    assert {p.name: p.read_bytes() for p in (staging / "20").iterdir()} == staged_files
    assert checkpoint_s3.fetch_checkpoint(remote, tmp_path / "fetched") == "20"  # complete on S3, `latest` too
    assert {p.name: p.read_bytes() for p in (tmp_path / "fetched" / "20").iterdir()} == staged_files


@pytest.mark.parametrize("case", ["s3_has_newer", "other_prefix", "not_resuming", "no_prefix_recorded"])
def test_a_staged_checkpoint_is_not_copied_when_resume_should_not_use_it(tmp_path, remote, case):
    """S3's newer checkpoint wins; a staging directory last used for another prefix (or by a run before the
    prefix was recorded) is not this run's; a fresh run starts from an empty staging directory."""
    staging = tmp_path / "staging"
    other_prefix = storage.S3Store(remote.url() + "-other")
    staged_run_cut_short(other_prefix if case == "other_prefix" else remote, staging)
    if case == "other_prefix":
        save_local(tmp_path / "elsewhere", "10")
        checkpoint_s3.upload_checkpoint(remote, tmp_path / "elsewhere", "10")
    if case == "s3_has_newer":
        save_local(tmp_path / "elsewhere", "30")
        checkpoint_s3.upload_checkpoint(remote, tmp_path / "elsewhere", "30")
    if case == "no_prefix_recorded":
        (staging / checkpoint_s3.STAGING_PREFIX_NAME).unlink()
    said = []
    checkpoint_s3.CheckpointUploader(remote, staging).prepare("cpu", resume=case != "not_resuming", say=said.append)
    expected = {"s3_has_newer": "30", "not_resuming": None}.get(case, "10")
    assert said == []
    assert sorted(p.name for p in staging.iterdir()) == \
        [checkpoint_s3.STAGING_PREFIX_NAME] + ([expected, "latest"] if expected else [])
    assert not remote.exists(f"20/{checkpointing.MANIFEST_NAME}")


def test_export_reads_from_s3(tmp_path, remote, monkeypatch):
    save_local(tmp_path / "local", "2", world=1)
    checkpoint_s3.upload_checkpoint(remote, tmp_path / "local", "2")
    assert checkpoint_export.export_main(["export", "--output_dir", remote.url(), "--out", str(tmp_path / "w.pt")]) == 0
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["w"], torch.full((1000,), 2.0))
    status = checkpoint_export.export_main(["export", "--output_dir", remote.url("nothing"), "--out",
                                        str(tmp_path / "x.pt")])
    assert status == 1 and not (tmp_path / "x.pt").exists()

