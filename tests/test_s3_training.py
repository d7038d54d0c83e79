"""S3 end to end, against a real S3 server (moto_server on 127.0.0.1): the data tool reading text from
and writing shards to S3, and the driver training from S3 shards and checkpointing to S3."""

import gzip
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

import helpers
import run_pretraining
import s3_helpers
import test_resume  # (the driver under its kill wrapper, losses and checkpoint comparisons)
from common import storage
from data.shard_format import SHARD_KEYS
from finetune import finetuning
from training import checkpoint_export, checkpoint_s3, pretraining_inputs

DATA_TOOL = helpers.REPO_ROOT / "data" / "create_pretraining_data.py"


def book_text(name: str, lines: int = 400) -> str:
    with gzip.open(helpers.REPO_ROOT / "data" / "sample" / "books" / name, "rt", encoding="utf-8") as f:
        return "".join(f.readlines()[:lines])


def run_data_tool(*args, env=None):
    return subprocess.run([sys.executable, str(DATA_TOOL),
                           "--vocab_file", str(helpers.REPO_ROOT / "data" / "vocab.txt"),
                           "--max_seq_length", "64", "--max_predictions_per_seq", "10", "--dupe_factor", "1",
                           "--n_processes", "1", *map(str, args)], capture_output=True, text=True, timeout=300,
                          env=helpers.checkout_env(env))


def test_data_tool_reads_text_from_and_writes_shards_to_s3(tmp_path, s3):
    """The same shards as a local run of the same text; a second run skips what is already on S3."""
    _, bucket, client = s3
    text = tmp_path / "text"
    text.mkdir()
    for name in ("persuasion_part1", "pride_and_prejudice_part1"):
        (text / f"{name}.txt").write_text(book_text(f"{name}.txt.gz"))
        client.upload_file(str(text / f"{name}.txt"), bucket, f"text/{name}.txt")
    local = run_data_tool("--input_file", text, "--output_file", tmp_path / "local")
    assert local.returncode == 0, local.stderr
    remote = run_data_tool("--input_file", f"s3://{bucket}/text", "--output_file", f"s3://{bucket}/shards")
    assert remote.returncode == 0, remote.stderr
    store = storage.S3Store(f"s3://{bucket}/shards")
    names = [o.name for o in store.list_objects()]
    assert names == ["persuasion_part1.hdf5", "pride_and_prejudice_part1.hdf5"]
    for name in names:
        store.download(name, tmp_path / name)
        with h5py.File(tmp_path / name) as got, h5py.File(tmp_path / "local" / name) as expected:
            assert all(np.array_equal(got[key][:], expected[key][:]) for key in SHARD_KEYS)
    again = run_data_tool("--input_file", f"s3://{bucket}/text", "--output_file", f"s3://{bucket}/shards")
    assert again.returncode == 0 and "skipping 2 existing shard(s)" in again.stderr


def test_data_tool_with_a_missing_bucket_is_one_line(tmp_path, s3):
    (tmp_path / "a.txt").write_text(book_text("persuasion_part1.txt.gz", 50))
    result = run_data_tool("--input_file", tmp_path / "a.txt", "--output_file", "s3://no-such-bucket-i12/shards")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        "create_pretraining_data.py: error: cannot open s3://no-such-bucket-i12/shards: bucket 'no-such-bucket-i12' "
        f"does not exist at {s3[0].url}")
    assert s3_helpers.SECRET_KEY not in result.stderr + result.stdout


# ============================================================================ the driver

SHARD_SIZES = test_resume.SHARD_SIZES


@pytest.fixture
def shards_on_s3(tmp_path, s3):
    """The resume tests' shards, on disk and uploaded under s3://<bucket>/shards; returns
    (local dir, s3 URL of the shards, s3 URL for the output)."""
    _, bucket, client = s3
    local = tmp_path / "shards"
    helpers.write_synthetic_shards(local, SHARD_SIZES)
    for path in local.iterdir():
        client.upload_file(str(path), bucket, f"shards/{path.name}")
    return local, f"s3://{bucket}/shards", f"s3://{bucket}/run"


def s3_args(tmp_path, input_dir, output_dir, config, log, steps, **flags):
    flags.setdefault("s3_cache_dir", tmp_path / "s3_cache")
    return test_resume.driver_args(input_dir, output_dir, config, log, steps, **flags)


def fetched(output_url: str, tmp_path: Path, tag=None) -> Path:
    """The checkpoint on S3 that resume would use (or `tag`), downloaded; returns its directory."""
    local = tmp_path / f"fetched_{tag}"
    got = checkpoint_s3.fetch_checkpoint(storage.S3Store(output_url), local, tag)
    return local / got


def test_training_from_s3_with_retried_faults_and_a_small_cache_matches_local(tmp_path, shards_on_s3, capsys):
    """24 steps (more than an epoch of 81 samples) from S3 shards through a cache that holds the
    largest shard but no two, checkpoints to S3 every 8 steps (keeping 1), while the server 'answers'
    some requests with 503 SlowDown or a connection reset: the same losses and the same final
    checkpoint, bit for bit, as a run on the same shards on disk."""
    local, shards_url, output_url = shards_on_s3
    config, steps = test_resume.ds_config(tmp_path, 1, True, 1), 24
    test_resume.main_in_process(test_resume.driver_args(local, tmp_path / "ref", config, tmp_path / "ref.json", steps))
    largest = max(p.stat().st_size for p in local.iterdir())
    injectors = [s3_helpers.install_faults("slowdown:3:2"), s3_helpers.install_faults("reset:9:2:GetObject"),
                 s3_helpers.install_faults("slowdown:2:1:PutObject")]
    try:
        summary = test_resume.main_in_process(s3_args(
            tmp_path, shards_url, output_url, config, tmp_path / "s3.json", steps, num_steps_per_checkpoint=8,
            keep_last_n_checkpoints=1, s3_cache_gb=1.3 * largest / 2 ** 30))
    finally:
        for injector in injectors:
            s3_helpers.remove_faults(injector)
    assert [injector.injected for injector in injectors] == [2, 2, 1]
    assert summary["global_step"] == steps
    assert test_resume.json_losses(tmp_path / "s3.json") == test_resume.json_losses(tmp_path / "ref.json")
    assert test_resume.checkpoint_differences(tmp_path / "ref" / str(steps), fetched(output_url, tmp_path)) == []
    remote_tags = {o.name.split("/")[0] for o in storage.S3Store(output_url).list_objects(recursive=True)}
    assert remote_tags == {"24", "latest"}  # 8 and 16 pruned on S3 too
    cache = storage.server_cache_dir(tmp_path / "s3_cache")
    assert sum(p.stat().st_size for p in cache.iterdir()) <= 1.3 * largest
    # Fine-tuning reads the S3 output (a run's prefix, or one tag of it) as it reads a local one.
    _, expected = checkpoint_export.consolidated_checkpoint(tmp_path / "ref", str(steps))
    for url in (output_url, f"{output_url}/{steps}"):
        _, weights = finetuning.load_pretrained(url, None)
        assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in expected)
    output = capsys.readouterr()
    assert s3_helpers.SECRET_KEY not in output.out + output.err and s3_helpers.ACCESS_KEY not in output.out + output.err


def test_cache_smaller_than_a_shard_is_one_error_before_training(tmp_path, shards_on_s3):
    local, shards_url, output_url = shards_on_s3
    config = test_resume.ds_config(tmp_path, 1, True, 1)
    largest = max(local.iterdir(), key=lambda p: p.stat().st_size)
    with pytest.raises(run_pretraining.InputError, match=rf"less than the shard {shards_url}/{largest.name} "):
        test_resume.main_in_process(s3_args(tmp_path, shards_url, output_url, config, tmp_path / "a.json", 4,
                                            s3_cache_gb=0.5 * largest.stat().st_size / 2 ** 30))
    assert not (tmp_path / "a.json").exists()  # no step, not even a log


@pytest.mark.parametrize("which", ["input_dir", "output_dir"])
def test_missing_bucket_is_one_error_before_training(tmp_path, shards_on_s3, which):
    local, shards_url, output_url = shards_on_s3
    urls = {"input_dir": shards_url, "output_dir": output_url, which: "s3://no-such-bucket-i12/x"}
    config = test_resume.ds_config(tmp_path, 1, True, 1)
    with pytest.raises(run_pretraining.InputError, match=r"^cannot open s3://no-such-bucket-i12/x: bucket "
                                                         r"'no-such-bucket-i12' does not exist"):
        test_resume.main_in_process(s3_args(tmp_path, urls["input_dir"], urls["output_dir"], config,
                                            tmp_path / "a.json", 4))


def test_output_prefix_that_is_not_empty_needs_resume(tmp_path, shards_on_s3):
    local, shards_url, output_url = shards_on_s3
    storage.S3Store(output_url).put_bytes("something", b"x")
    config = test_resume.ds_config(tmp_path, 1, True, 1)
    argv = [arg for arg in s3_args(tmp_path, shards_url, output_url, config, tmp_path / "a.json", 4)
            if arg != "--resume_from_checkpoint"]
    with pytest.raises(run_pretraining.InputError, match=rf"--output_dir {output_url} is not empty"):
        test_resume.main_in_process(argv)


def test_a_rank_that_checks_the_prefix_while_rank_0_probes_it_starts(tmp_path, s3, monkeypatch):
    """A fresh run: rank 1 checks that the output prefix is empty at the moment rank 0's write probe is on
    S3 (between its put and its delete). The probe does not count: both ranks start, and nothing stays."""
    _, bucket, _ = s3
    output_url = f"s3://{bucket}/runs/fresh"
    seen_by_rank_1 = []
    delete = storage.S3Store.delete

    def rank_1_checks_before_the_probe_goes(store, names):
        if os.environ["RANK"] == "0":
            monkeypatch.setenv("RANK", "1")
            seen_by_rank_1.append([remote.name for remote in store.list_objects(recursive=True)])
            pretraining_inputs.open_s3_output(output_url, None, tmp_path / "rank1", 0, resuming=False)
            monkeypatch.setenv("RANK", "0")
        delete(store, names)

    monkeypatch.setattr(storage.S3Store, "delete", rank_1_checks_before_the_probe_goes)
    monkeypatch.setenv("RANK", "0")
    pretraining_inputs.open_s3_output(output_url, None, tmp_path / "rank0", 0, resuming=False)
    assert len(seen_by_rank_1) == 1 and len(seen_by_rank_1[0]) == 1
    assert seen_by_rank_1[0][0].startswith(storage.WRITE_PROBE_PREFIX)  # the probe was there
    assert storage.S3Store(output_url).list_objects(recursive=True) == []


class EndedBySigterm(Exception):
    """What SIGTERM's default action (the end of the process) stands as in an in-process run."""


def test_a_second_sigterm_while_the_run_waits_for_its_last_copy_does_not_cut_it(tmp_path, shards_on_s3, monkeypatch):
    """A SIGTERM in step 1 stops the run after it; checkpoint 1 is saved and copied to S3 in the background, and a
    second SIGTERM comes while the run waits for that copy (a preemption that insists). The copy completes and
    the run returns. The handler the test puts in place before the run, which raises, stands for the default
    action: a driver that put it back before the copy was done would end there."""
    import boto3

    from modeling import BertPretrainingCriterion

    local, _, output_url = shards_on_s3
    config = test_resume.ds_config(tmp_path, 1, True, 1)
    run_waits_for_a_copy, second_sigterms = threading.Event(), []
    finish = checkpoint_s3.CheckpointUploader.finish

    def finish_noting_a_wait(uploader, device):
        if any(thread.name == "checkpoint-upload" for thread in threading.enumerate()):
            run_waits_for_a_copy.set()
        finish(uploader, device)

    def second_sigterm_during_the_copy(request, event_name, **_):
        if threading.current_thread().name == "checkpoint-upload" and not second_sigterms:
            second_sigterms.append(run_waits_for_a_copy.wait(timeout=120))
            os.kill(os.getpid(), signal.SIGTERM)

    class SigtermInStep1(BertPretrainingCriterion):
        def forward(self, *args):
            os.kill(os.getpid(), signal.SIGTERM)
            return super().forward(*args)

    def default_action(*_):
        raise EndedBySigterm("SIGTERM's default action, outside the driver's stop handler")

    monkeypatch.setattr(checkpoint_s3.CheckpointUploader, "finish", finish_noting_a_wait)
    boto3.DEFAULT_SESSION.events.register("before-send.s3", second_sigterm_during_the_copy)
    before = signal.signal(signal.SIGTERM, default_action)
    try:
        summary = run_pretraining.main([str(arg) for arg in s3_args(tmp_path, local, output_url, config,
                                                                    tmp_path / "a.json", 4)],
                                       criterion=SigtermInStep1())
    finally:
        signal.signal(signal.SIGTERM, before)
        boto3.DEFAULT_SESSION.events.unregister("before-send.s3", second_sigterm_during_the_copy)
    assert second_sigterms == [True]  # sent while the run waited for the copy
    assert summary["stopped_by_signal"] and summary["global_step"] == 1
    assert storage.S3Store(output_url).get_bytes("latest") == b"1"
    assert checkpoint_s3.fetch_checkpoint(storage.S3Store(output_url), tmp_path / "fetched") == "1"


def assert_no_credentials(*outputs):
    for output in outputs:
        assert s3_helpers.ACCESS_KEY not in output and s3_helpers.SECRET_KEY not in output


@pytest.mark.slow
def test_kill_during_upload_then_resume_from_s3_two_ranks(tmp_path, shards_on_s3, monkeypatch):
    """Two ranks read S3 shards (through their server's cache) and checkpoint to S3 every 3 steps. The
    process is SIGKILLed in the middle of checkpoint 6's upload: `latest` on S3 still names 3, which
    is complete, and the staging directory holds 6, complete. The resumed run copies 6 to S3 first and
    resumes from it (not from 3: the steps after 3 are not lost), and then matches an uninterrupted run on
    local files: the same losses, and the final checkpoint on S3 bit for bit. No output shows the
    credentials."""
    local, shards_url, output_url = shards_on_s3
    world, steps = 2, 12
    config = test_resume.ds_config(tmp_path, 1, True, world)
    reference = test_resume.run(test_resume.driver_args(local, tmp_path / "ref", config, tmp_path / "ref.json",
                                                        steps), world)
    monkeypatch.setenv(s3_helpers.FAULTS_ENV, "kill:2:1:PutObject:/run/6/")
    status, killed = test_resume.finish(test_resume.start(
        s3_args(tmp_path, shards_url, output_url, config, tmp_path / "a.json", steps, num_steps_per_checkpoint=3),
        world))
    assert status != 0 and "saved checkpoint 6" in killed, killed[-3000:]
    monkeypatch.delenv(s3_helpers.FAULTS_ENV)
    remote = storage.S3Store(output_url)
    assert remote.get_bytes("latest") == b"3"
    assert any(o.name.startswith("6/") for o in remote.list_objects(recursive=True))  # 6 was half uploaded
    assert fetched(output_url, tmp_path).name == "3"
    resumed = test_resume.run(s3_args(tmp_path, shards_url, output_url, config, tmp_path / "b.json", steps,
                                      num_steps_per_checkpoint=3), world)
    assert f"checkpoint 6 in {tmp_path / 's3_cache' / 'checkpoints'} is complete but its copy to {output_url} " \
        "was cut short: uploading it now, then resuming from it" in resumed, resumed[-3000:]
    assert "resumed from checkpoint 6" in resumed
    test_resume.assert_same_training((reference, tmp_path / "ref" / str(steps)), [killed, resumed],
                                     fetched(output_url, tmp_path), steps)
    assert list((tmp_path / "s3_cache" / "shards").iterdir()) == [storage.server_cache_dir(tmp_path / "s3_cache")]
    assert_no_credentials(reference, killed, resumed)


def test_persistent_upload_fault_stops_the_run_with_one_line(tmp_path, shards_on_s3, monkeypatch):
    """Every write of checkpoint 4 is answered 503 SlowDown: the run stops with one error line (at the
    next save), and `latest` on S3 names checkpoint 2, complete."""
    local, shards_url, output_url = shards_on_s3
    config = test_resume.ds_config(tmp_path, 1, True, 1)
    monkeypatch.setenv(s3_helpers.FAULTS_ENV, "slowdown:1:1000000:PutObject:/run/4/")
    output = test_resume.run(s3_args(tmp_path, shards_url, output_url, config, tmp_path / "a.json", 8,
                                     num_steps_per_checkpoint=2), 1, expect=1)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert errors[0].startswith(f"error: checkpoint 4 was not copied to {output_url}: cannot upload ")
    assert errors[0].endswith("SlowDown (HTTP 503) after 4 attempts")
    assert storage.S3Store(output_url).get_bytes("latest") == b"2"
    assert fetched(output_url, tmp_path).name == "2"
    assert_no_credentials(output)
