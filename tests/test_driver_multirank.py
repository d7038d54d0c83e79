"""run_pretraining.py on 2 CPU ranks through the real `deepspeed` launcher (gloo). Slow: ~20-40 s per launch."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys

import pytest

import helpers
import run_pretraining as rp
from test_resume import finish
from training.run_status import ExitStatus

pytestmark = pytest.mark.slow


def no_dropout_config(path):
    """The tiny model without dropout: runs that split a batch differently can then agree."""
    config = json.loads(helpers.TINY_MODEL_CONFIG.read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    path.write_text(json.dumps(config))
    return path


def launch_ok(argv):
    result = helpers.launch(argv, num_ranks=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.mark.parametrize("stage", [1, 2])
def test_two_ranks_bf16_complete(tmp_path, tiny_shards, stage):
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=stage, bf16=True, micro=4, gas=2, world=2)
    argv = helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, json_summary=tmp_path / "log.json",
                               max_steps=3, num_steps_per_checkpoint=2)
    launch_ok(argv)
    steps = helpers.step_records(tmp_path / "log.json")
    assert [r["step"] for r in steps] == [[0, 1], [0, 2], [0, 3]]
    assert all(math.isfinite(r["data"]["all_ranks_average_loss"]) for r in steps)
    assert (tmp_path / "out" / "latest").read_text().strip() == "3"
    for tag in ("2", "3"):
        assert {p.name for p in (tmp_path / "out" / tag).glob("state_*.pt")} == {"state_0.pt", "state_1.pt"}


@pytest.mark.parametrize("stage,optimizer", [(0, "lans"), (1, "adamw")])
def test_data_parallel_equivalence(tmp_path, tiny_shards, stage, optimizer):
    """2 ranks x micro 4 and 1 rank x micro 8 see the same 8 samples per step (the stream gives rank r the
    r-th slice of each global micro-batch) and must follow the same loss trajectory (fp32, within 1e-5);
    steps 2-4 see the weights updated by the earlier steps, so the updates must agree too (measured: 9.5e-7).

    ZeRO-1 uses AdamW here; LANS under ZeRO-1/2 (per-tensor blocks across ranks) is tests/test_world_size.py."""
    model_config = no_dropout_config(tmp_path / "model.json")
    flags = dict(config_file=model_config, optimizer=optimizer, max_steps=4, log_freq=1, skip_checkpoint=True)
    one = helpers.write_ds_config(tmp_path / "one.json", stage=stage, bf16=False, micro=8, world=1)
    two = helpers.write_ds_config(tmp_path / "two.json", stage=stage, bf16=False, micro=4, world=2)
    rp.main(helpers.driver_argv(tiny_shards, tmp_path / "out1", one, json_summary=tmp_path / "one.log", **flags))
    launch_ok(helpers.driver_argv(tiny_shards, tmp_path / "out2", two, json_summary=tmp_path / "two.log", **flags))
    single = [r["data"]["all_ranks_average_loss"] for r in helpers.step_records(tmp_path / "one.log")]
    double = [r["data"]["all_ranks_average_loss"] for r in helpers.step_records(tmp_path / "two.log")]
    assert len(single) == len(double) == 4
    assert max(abs(a - b) for a, b in zip(single, double)) < 1e-5, (single, double)


def run_ranks_with_own_argv(argvs, timeout=300, expect_status=0) -> list:
    """One `python run_pretraining.py argv` per rank, with the rank variables the launcher would set: unlike
    the launcher, this lets each rank have its own flags (here, its own copy of the data). Returns the ranks'
    outputs (stdout and stderr together), once each has exited with expect_status. A rank still running after
    `timeout` s fails the test with its output (test_resume's finish), and every rank is killed."""
    port, procs = helpers.free_port(), []
    for rank, argv in enumerate(argvs):
        env = helpers.launcher_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(argvs)),
                                   LOCAL_SIZE=str(len(argvs)), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, str(helpers.REPO_ROOT / "run_pretraining.py"),
                                       *map(str, argv)], cwd=helpers.REPO_ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True))
    try:
        outputs = [finish(proc, timeout)[1] for proc in procs]
    finally:
        for proc in procs:  # the ranks after the one that did not finish, with any process of theirs
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc, output in zip(procs, outputs):
        assert proc.returncode == expect_status, output[-3000:]
    return outputs


def test_a_shard_bad_on_one_host_only_is_dropped_by_every_rank(tmp_path):
    """--skip_bad_shards when only rank 1's copy of a shard is corrupt (as when one server's disk or download
    went bad): every rank must drop it after that step, or the ranks slice different streams and rank 0's
    checkpoint forgets the shard. Checked by resuming from a checkpoint after the failure with both copies
    intact: the resumed steps must equal the uninterrupted run's, which only holds when both ranks of the
    uninterrupted run read the stream without that shard, and the checkpoint says so."""
    import shutil

    from data.dataset import SampleStream, scan_shards
    clean, bad_copy = tmp_path / "host0", tmp_path / "host1"
    helpers.write_synthetic_shards(clean, [24, 40, 17])
    helpers.write_synthetic_shards(bad_copy, [24, 40, 17])
    shards, _, _ = scan_shards(clean)
    last_of_epoch_0 = shards[SampleStream(shards, 42, window_size=1).shard_order(0)[-1]].name
    helpers.corrupt_first_chunk(bad_copy / last_of_epoch_0)  # read near the end of epoch 0 (~ step 8 of 10)
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=False, micro=4, world=2)
    model_config = no_dropout_config(tmp_path / "model.json")

    def argv(data, out, log, **flags):
        return helpers.driver_argv(data, out, ds_config, json_summary=log, config_file=model_config, seed=42,
                                   max_steps=14, log_freq=1, data_memory_budget_mb=0.01, skip_bad_shards=True,
                                   resume_from_checkpoint=True, **flags)

    outputs = run_ranks_with_own_argv([argv(clean, tmp_path / "a", tmp_path / "a.json", num_steps_per_checkpoint=1),
                                       argv(bad_copy, tmp_path / "a", tmp_path / "a.json",
                                            num_steps_per_checkpoint=1)])
    assert re.search(rf"shard {last_of_epoch_0} could not be read on rank\(s\) 1 \(--skip_bad_shards\): every rank "
                     r"drops it from sample \d+ on", outputs[0]), outputs[0][-3000:]
    summary = helpers.read_dllogger(tmp_path / "a.json")[-1]["data"]
    assert summary["skipped_shards"] == 1 and summary["global_step"] == 14
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "11", tmp_path / "b" / "11")
    (tmp_path / "b" / "latest").write_text("11")
    run_ranks_with_own_argv([argv(clean, tmp_path / "b", tmp_path / "b.json", skip_checkpoint=True)] * 2)
    uninterrupted, resumed = ({r["step"][1]: r["data"]["all_ranks_average_loss"] for r in helpers.step_records(log)}
                              for log in (tmp_path / "a.json", tmp_path / "b.json"))
    assert sorted(resumed) == [12, 13, 14]
    assert all(resumed[step] == uninterrupted[step] for step in resumed), (uninterrupted, resumed)


def test_ranks_whose_copies_of_the_data_differ_stop_before_training(tmp_path):
    """Each rank lists --input_dir itself. Rank 1's copy lacks a shard (an unfinished copy to that server): the
    ranks would cut different streams. The run must stop at start-up with one line on rank 0 naming the rank,
    its host and the missing shard, exit NO_RESTART (bad input), and write no checkpoint."""
    full, partial = tmp_path / "host0", tmp_path / "host1"
    names = [path.name for path in helpers.write_synthetic_shards(full, [24, 40, 17])]
    helpers.write_synthetic_shards(partial, [24, 40, 17])
    (partial / names[2]).unlink()
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=False, micro=4, world=2)
    outputs = run_ranks_with_own_argv(
        [helpers.driver_argv(data, tmp_path / "out", ds_config, max_steps=2) for data in (full, partial)],
        expect_status=ExitStatus.NO_RESTART)
    errors = [line for line in outputs[0].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in outputs[0], outputs[0][-3000:]
    assert re.fullmatch(rf"error: --input_dir {re.escape(str(full))} holds other training shards on rank 1 \(.+\) "
                        rf"than on rank 0 \(.+\): {names[2]} only on rank 0\. Every server must hold the same shards "
                        r"\[no restart\]",
                        errors[0]), errors[0]
    assert not list((tmp_path / "out").glob("*/state_*.pt"))
