"""run_pretraining.py on one CPU rank, in-process (main(argv) / cli(argv)) with the real DeepSpeed.

Multi-rank runs through the real launcher are in test_driver_multirank.py (slow).
"""

import gc
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import h5py
import pytest
import torch

import helpers
import run_pretraining as rp
from common.errors import NO_RESTART_MARK, HostInputError
from finetune.hf_interop import to_transformers_config
from modeling import BertConfig, BertForSequenceClassification, BertPretrainingCriterion
from training import (
    checkpoint_export,
    checkpointing,
    deepspeed_engine,
    distributed,
    gaudi,
    init_weights,
    pretraining_config,
    pretraining_step,
    run_status,
)
from training.run_status import ExitStatus

STEP_KEYS = {"average_loss", "step_loss", "learning_rate", "average_training_time_step", "average_perf_per_step",
             "tokens_per_second", "all_ranks_average_loss", "skipped_steps", "model_tflops", "mfu"}
FINAL_KEYS = {"final_loss", "average_training_time_step", "average_perf_per_step", "model_tflops", "mfu"}
SUMMARY_KEYS = {"e2e_train_time", "training_sequences_per_second", "raw_train_time", "final_loss",
                "training_tokens_per_second", "model_tflops", "mfu"}
PARAMETER_KEYS = {"Config", "SEED", "train_start", "batch_size_per_pu", "learning_rate"}


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    # --use_hpu sets DS_ACCELERATOR only when unset: keep the test session on CPU.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def run(tmp_path, shards, stage=1, bf16=True, micro=4, gas=1, clock=time.perf_counter, criterion=None, **flags):
    """main(argv) for a tiny run in tmp_path; returns (summary, dllogger path, checkpoint dir)."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=stage, bf16=bf16, micro=micro, gas=gas)
    json_summary, output_dir = tmp_path / "dllogger.json", tmp_path / "checkpoints"
    summary = rp.main(helpers.driver_argv(shards, output_dir, ds_config, json_summary=json_summary, **flags),
                      clock=clock, criterion=criterion)
    return summary, json_summary, output_dir


class PoisonedCriterion(BertPretrainingCriterion):
    """The real criterion, but calls number `bad_calls` (1-based) return NaN; `on_call` hooks a call."""

    def __init__(self, bad_calls=(), on_call=None):
        super().__init__()
        self.calls, self.bad_calls, self.on_call = 0, set(bad_calls), on_call

    def forward(self, *args):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        loss = super().forward(*args)
        return loss * float("nan") if self.calls in self.bad_calls else loss


def saved_lans_state(output_dir, tag) -> dict:
    """LANS's state dict in checkpoint <output_dir>/<tag> (under ZeRO-1/2, rank 0's, inside DeepSpeed's)."""
    state = checkpoint_export.saved_optimizer_states(output_dir, tag)[0]
    return state.get("base_optimizer_state", state)


def saved_lans_steps(output_dir, tag) -> list:
    return [group["step"] for group in saved_lans_state(output_dir, tag)["param_groups"]]


# ============================================================================ runs complete

@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_run_completes_and_logs_every_key(tmp_path, tiny_shards, stage, bf16):
    summary, json_summary, output_dir = run(tmp_path, tiny_shards, stage=stage, bf16=bf16, gas=2, max_steps=3)
    assert summary["global_step"] == 3 and math.isfinite(summary["final_loss"])
    assert (output_dir / "latest").read_text().strip() == "3"
    records = helpers.read_dllogger(json_summary)
    logs = [r for r in records if r["type"] == "LOG"]
    parameter = next(r["data"] for r in logs if r["step"] == "PARAMETER")
    steps = [r for r in logs if "step_loss" in r["data"]]
    final = next(r["data"] for r in logs if "final_loss" in r["data"] and r["step"] != [])
    assert PARAMETER_KEYS <= set(parameter)
    # step counts as whole numbers, though the reference's parser reads these two as floats
    assert "'max_steps': 3," in parameter["Config"] and "'log_freq': 1," in parameter["Config"]
    assert [r["step"] for r in steps] == [[0, 1], [0, 2], [0, 3]]
    assert all(STEP_KEYS <= set(r["data"]) for r in steps)
    assert FINAL_KEYS <= set(final)
    assert SUMMARY_KEYS <= set(logs[-1]["data"]) and logs[-1]["step"] == []
    # Losses start near ln(vocab) for a fresh model.
    assert abs(steps[0]["data"]["average_loss"] - math.log(30522)) < 1.5


def test_trains_on_shards_made_by_the_data_pipeline(tmp_path, pipeline_shards):
    summary, json_summary, _ = run(tmp_path, pipeline_shards, micro=8, max_steps=3, log_freq=1, skip_checkpoint=True)
    losses = [r["data"]["step_loss"] for r in helpers.step_records(json_summary)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert summary["training_tokens_per_second"] == pytest.approx(summary["training_sequences_per_second"] * 128)


def test_reference_metrics_are_computed_as_the_reference_does(tmp_path, tiny_shards):
    """log_freq 2, GAS 2: average_loss is the mean of the window's per-step mean losses (the per-step losses
    are logged one by one by a log_freq=1 run on the same seed); step_loss the last micro-batch's loss;
    perf = micro x GAS / time per step (checked with the logged time)."""
    common = dict(stage=0, bf16=False, micro=4, gas=2, max_steps=4, skip_checkpoint=True)
    run(tmp_path / "each", tiny_shards, log_freq=1, **common)
    each = [r["data"] for r in helpers.step_records(tmp_path / "each" / "dllogger.json")]
    summary, json_summary, _ = run(tmp_path / "window", tiny_shards, log_freq=2, **common)
    steps = helpers.step_records(json_summary)
    assert [r["step"] for r in steps] == [[0, 2], [0, 4]]
    for index, record in enumerate(steps):
        data, pair = record["data"], each[2 * index:2 * index + 2]
        expected = (pair[0]["average_loss"] + pair[1]["average_loss"]) / 2
        assert data["average_loss"] == pytest.approx(expected, rel=1e-6)
        assert data["all_ranks_average_loss"] == pytest.approx(expected, rel=1e-6)  # one rank
        assert data["step_loss"] == pytest.approx(pair[1]["step_loss"], rel=1e-6)
        assert data["average_perf_per_step"] == pytest.approx(4 * 2 / data["average_training_time_step"])
        assert data["tokens_per_second"] == pytest.approx(4 * 2 * 32 / data["average_training_time_step"])
    assert summary["final_loss"] == pytest.approx(steps[-1]["data"]["average_loss"])


def test_final_metrics_do_not_include_the_final_checkpoint_save(tmp_path, tiny_shards):
    """The driver's clock is 1000 s ahead once the run's only checkpoint, the final one, is saved (a fake
    clock: no real waiting): raw_train_time, the throughput and the final record's time per step must not
    see it, the end-to-end time must."""
    def clock():
        return time.perf_counter() + (1000.0 if (tmp_path / "checkpoints" / "latest").exists() else 0.0)

    summary, json_summary, output_dir = run(tmp_path, tiny_shards, clock=clock, max_steps=2, log_freq=2)
    assert (output_dir / "latest").read_text().strip() == "2" and not (output_dir / "1").exists()
    final = next(r["data"] for r in helpers.read_dllogger(json_summary)
                 if r["type"] == "LOG" and "final_loss" in r["data"] and r["step"] != [])
    assert summary["e2e_train_time"] > 1000
    assert summary["raw_train_time"] < 1000 and summary["training_sequences_per_second"] > 8 / 1000
    assert final["average_training_time_step"] < 500


def test_export_for_fine_tuning(tmp_path, tiny_shards):
    """`python -m training.checkpointing export` on a ZeRO-2 bf16 BERT checkpoint (tied decoder weight): the
    fp32 master weights, equal to DeepSpeed's own zero_to_fp32, load into a fine-tuning model."""
    _, _, out = run(tmp_path, tiny_shards, stage=2, bf16=True, max_steps=2)
    result = subprocess.run([sys.executable, "-m", "training.checkpointing", "export", "--output_dir",
                             str(out), "--out", str(tmp_path / "bert.pt")], capture_output=True, text=True,
                            env=helpers.launcher_env(), cwd=helpers.REPO_ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    weights = torch.load(tmp_path / "bert.pt", weights_only=True)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    expected = get_fp32_state_dict_from_zero_checkpoint(str(out), tag="2")
    assert weights.keys() >= expected.keys()
    assert all(torch.equal(weights[k], v.detach()) for k, v in expected.items())
    model_config = BertConfig.from_json_file(helpers.TINY_MODEL_CONFIG)
    classifier = BertForSequenceClassification(model_config, num_labels=3)
    missing, unexpected = classifier.load_state_dict(weights, strict=False)
    assert missing and all(k.startswith("classifier.") for k in missing)
    assert unexpected and all(k.startswith("cls.") for k in unexpected)
    embeddings = classifier.bert.embeddings.word_embeddings.weight
    assert torch.equal(embeddings.detach(), weights["bert.embeddings.word_embeddings.weight"])


# ============================================================================ DeepSpeed traps

def test_bf16_zero0_dummy_step_does_not_reach_the_optimizer(tmp_path, tiny_shards, monkeypatch):
    """bf16 + ZeRO-0: DeepSpeed's FP16_UnfusedOptimizer steps once with zero gradients at initialize.
    The driver's guard keeps LANS's step counter at 0 and the fp32 master weights equal to the bf16
    model weights they were copied from; without the guard both change (negative control)."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=0, bf16=True)
    argv = helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config)
    config = pretraining_config.build_config(rp.parse_arguments(argv), 1)
    ds_dict, model_config = config.ds_config, config.model_config
    distributed.setup_device_and_distributed(distributed.Job(), config.use_hpu, config.no_cuda, config.local_rank)

    def masters_and_steps():
        engine, optimizer = rp.build_engine(
            rp.build_model(model_config, None, 0), dict(ds_dict), optimizer_name="lans", learning_rate=0.01,
            betas=None, lr_schedule={"warmup": 0.25, "total_steps": 4, "degree": 1.0, "constant": 0.0},
            lans_blocks="tensor", torch_compile=None)
        masters = [m for group in engine.optimizer.fp32_groups for m in group]
        weights = [p.float() for group in engine.optimizer.fp16_groups for p in group]
        unchanged = all(torch.equal(m, w) for m, w in zip(masters, weights))
        return unchanged, [g["step"] for g in optimizer.param_groups], len(optimizer.state)

    assert masters_and_steps() == (True, [0, 0], 0)
    monkeypatch.setattr(deepspeed_engine, "optimizer_step_suppressed", lambda optimizer: nullcontext())
    unchanged, steps, _ = masters_and_steps()
    assert not unchanged and steps == [1, 1]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_step_k_applies_the_learning_rate_of_step_k(tmp_path, tiny_shards, stage):
    """PolyWarmUp with T=4, warm-up 0.5, base 0.01, by hand: f(k) = k/2 for k <= 2, then (1 - k/4) / 0.5.
    bf16 + ZeRO-0 is the configuration whose zero-gradient step at initialize would shift this by one."""
    run(tmp_path, tiny_shards, stage=stage, bf16=True, max_steps=4, warmup_proportion=0.5, log_freq=1,
        skip_checkpoint=True)
    logged = [r["data"]["learning_rate"] for r in helpers.step_records(tmp_path / "dllogger.json")]
    assert logged == pytest.approx([0.005, 0.01, 0.005, 0.0])


def test_shm_op_is_disabled_before_init_distributed(tmp_path, tiny_shards):
    import deepspeed.ops
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    args = rp.parse_arguments(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config))
    distributed.setup_device_and_distributed(distributed.Job(), args.use_hpu, args.no_cuda, args.local_rank)
    assert deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] is False


# Allocates, fills and frees a 64 MiB tensor 20 times; prints the page faults of the last 10 (glibc may
# take a few rounds to settle its heap).
PAGE_FAULT_PROBE = """
import resource, sys, torch
from training import device_setup
if sys.argv[1] == "kept":
    assert device_setup.keep_freed_memory_in_process()
for _ in range(10):
    torch.empty(2 ** 24).fill_(1.0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(2 ** 24).fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_freed_memory_stays_in_the_process_on_cpu():
    """With glibc's defaults each new 64 MiB tensor is page-faulted in again (16,384 faults of 4 KiB each):
    the setting the CPU path applies (keep_freed_memory_in_process) reuses the freed memory instead."""
    import subprocess
    import sys
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_") and key != "GLIBC_TUNABLES"}
    faults = {setting: int(subprocess.run([sys.executable, "-c", PAGE_FAULT_PROBE, setting], cwd=helpers.REPO_ROOT,
                                          env=env, capture_output=True, text=True, check=True).stdout)
              for setting in ("kept", "default")}
    one_tensor = 2 ** 26 // 4096
    assert faults["default"] > 8 * one_tensor and faults["kept"] < one_tensor, faults

# ============================================================================ resume
# Whether a resume continues the uninterrupted run, and what it refuses: tests/test_resume.py. Here: state of the
# driver's own features that a checkpoint carries (the log window; the bad-step streak below).

def saved_tags(capsys) -> list:
    return [int(tag) for tag in re.findall(r"saved checkpoint (\d+)", capsys.readouterr().out)]


def test_a_resumed_run_saves_the_checkpoints_of_the_uninterrupted_run(tmp_path, tiny_shards, capsys):
    """--num_steps_per_checkpoint 3: saves at the multiples of 3 of the global step, and at the end. A run
    stopped after step 4 and resumed saved 7 (3 steps after the resume), not 6; in phase 2 the steps count on
    from --phase1_end_step 7, so phase 2's steps 2 and 5 are the multiples (tags 9 and 12)."""
    common = dict(max_steps=7, num_steps_per_checkpoint=3, log_freq=7)
    run(tmp_path / "whole", tiny_shards, **common)
    assert saved_tags(capsys) == [3, 6, 7]
    run(tmp_path / "split", tiny_shards, steps_this_run=4, **common)
    assert saved_tags(capsys) == [3, 4]  # 4: the end of this run
    run(tmp_path / "split", tiny_shards, resume_from_checkpoint=True, **common)
    assert saved_tags(capsys) == [6, 7]
    run(tmp_path / "split", tiny_shards, max_steps=5, num_steps_per_checkpoint=3, log_freq=5, phase2=True,
        phase1_end_step=7, resume_from_checkpoint=True)
    assert saved_tags(capsys) == [9, 12]  # counted from phase 2's start, 10 and 12


def test_a_resume_inside_a_log_window_logs_the_averages_of_the_whole_run(tmp_path, tiny_shards):
    """--log_freq 4: stopped after step 3 and resumed, the record of step 4 averages steps 1-4, as the whole
    run's does (the window's losses are in the checkpoint), and so does step 8's (a window of the resumed run
    alone). The expected averages are the means of a --log_freq 1 run's per-step losses."""
    common = dict(max_steps=8)
    run(tmp_path / "each", tiny_shards, log_freq=1, skip_checkpoint=True, **common)
    each = [r["data"]["average_loss"] for r in helpers.step_records(tmp_path / "each" / "dllogger.json")]
    run(tmp_path / "split", tiny_shards, log_freq=4, steps_this_run=3, **common)
    run(tmp_path / "split", tiny_shards, log_freq=4, resume_from_checkpoint=True, **common)
    logged = {r["step"][1]: r["data"] for r in helpers.step_records(tmp_path / "split" / "dllogger.json")}
    assert sorted(logged) == [4, 8]
    for step in (4, 8):
        expected = sum(each[step - 4:step]) / 4
        assert logged[step]["average_loss"] == pytest.approx(expected, rel=1e-6), step
        assert logged[step]["all_ranks_average_loss"] == pytest.approx(expected, rel=1e-6), step


# ============================================================================ non-finite loss, signals

@pytest.mark.parametrize("stage,bf16", [(0, False), (1, True)], ids=["zero0_fp32", "zero1_bf16"])
def test_non_finite_steps_are_skipped_and_counted(tmp_path, tiny_shards, stage, bf16):
    summary, json_summary, output_dir = run(tmp_path, tiny_shards, stage=stage, bf16=bf16, max_steps=5, log_freq=1,
                                            criterion=PoisonedCriterion(bad_calls={2, 3}))
    assert summary["skipped_steps"] == 2 and summary["global_step"] == 5
    assert [r["data"]["skipped_steps"] for r in helpers.step_records(json_summary)] == [0, 1, 2, 2, 2]
    # Only the 3 good steps reached LANS, and no NaN reached the weights (the final checkpoint's).
    assert saved_lans_steps(output_dir, "5") == [3, 3]
    assert all(torch.isfinite(w).all() for w in checkpoint_export.consolidated_state_dict(output_dir, "5").values())


def test_skipped_steps_do_not_count_as_loss_zero_in_the_averages(tmp_path, tiny_shards):
    """Steps 2 and 3 of 4 are non-finite: a log_freq=4 window averages the losses of steps 1 and 4 only, as
    logged one by one by a log_freq=1 run on the same seed; a window of only skipped steps logs NaN."""
    run(tmp_path / "each", tiny_shards, stage=0, bf16=False, max_steps=4, log_freq=1, skip_checkpoint=True,
        criterion=PoisonedCriterion(bad_calls={2, 3}))
    each = [r["data"] for r in helpers.step_records(tmp_path / "each" / "dllogger.json")]
    assert all(math.isnan(each[i]["average_loss"]) and math.isnan(each[i]["all_ranks_average_loss"]) for i in (1, 2))
    expected = (each[0]["step_loss"] + each[3]["step_loss"]) / 2  # one micro-batch per step: step_loss = its loss
    summary, json_summary, _ = run(tmp_path / "window", tiny_shards, stage=0, bf16=False, max_steps=4, log_freq=4,
                                   skip_checkpoint=True, criterion=PoisonedCriterion(bad_calls={2, 3}))
    (window,) = [r["data"] for r in helpers.step_records(json_summary)]
    assert window["average_loss"] == pytest.approx(expected, rel=1e-6)
    assert window["all_ranks_average_loss"] == pytest.approx(expected, rel=1e-6)
    assert summary["final_loss"] == pytest.approx(expected, rel=1e-6)


def test_too_many_bad_steps_stop_with_a_checkpoint(tmp_path, tiny_shards):
    with pytest.raises(rp.TrainingStopped, match="^3 consecutive steps had a non-finite loss"):
        run(tmp_path, tiny_shards, max_steps=10, max_bad_steps=3, criterion=PoisonedCriterion(bad_calls=range(2, 100)))
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "4"


def test_a_resume_in_a_streak_of_bad_steps_stops_where_the_whole_run_stops(tmp_path, tiny_shards):
    """Every step from step 2 on has a non-finite loss; --max_bad_steps 3. The run in one go stops at step 4.
    Stopped after step 3 (a streak of 2) and resumed, it must stop at step 4 too: the streak is in the
    checkpoint. A checkpoint saved without the streak (before it was saved) still resumes, from a streak of 0."""
    common = dict(max_steps=10, max_bad_steps=3)

    def stop_step(directory, first_bad_call, **flags) -> int:
        with pytest.raises(rp.TrainingStopped) as stopped:
            run(directory, tiny_shards, criterion=PoisonedCriterion(bad_calls=range(first_bad_call, 100)),
                **common, **flags)
        return int(re.search(r"stopped at step (\d+)$", str(stopped.value)).group(1))

    whole_stop = stop_step(tmp_path / "whole", first_bad_call=2)
    assert whole_stop == 4
    _, _, output_dir = run(tmp_path / "split", tiny_shards, steps_this_run=3,
                           criterion=PoisonedCriterion(bad_calls=range(2, 100)), **common)
    assert (output_dir / "latest").read_text().strip() == "3"
    shutil.copytree(tmp_path / "split", tmp_path / "old_style")
    # The resumed run's criterion counts its calls from 1: all of them are bad.
    assert stop_step(tmp_path / "split", first_bad_call=1, resume_from_checkpoint=True) == whole_stop
    # An older checkpoint: the streak's key left out of the manifest, which lists the keys a resume reads.
    manifest_path = tmp_path / "old_style" / "checkpoints" / "3" / checkpointing.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["client_state_keys"].remove("bad_steps_in_a_row")
    manifest_path.write_text(json.dumps(manifest))
    assert stop_step(tmp_path / "old_style", first_bad_call=1, resume_from_checkpoint=True) == 3 + 3


def test_sigterm_finishes_the_step_saves_and_returns(tmp_path, tiny_shards):
    def terminate_on_second_call(call):
        if call == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)  # tests/conftest.py's
    summary, _, output_dir = run(tmp_path, tiny_shards, max_steps=6,
                                 criterion=PoisonedCriterion(on_call=terminate_on_second_call))
    assert summary["stopped_by_signal"] and summary["global_step"] == 2
    assert (output_dir / "latest").read_text().strip() == "2"
    assert signal.getsignal(signal.SIGTERM) is before  # the driver's handler is removed again


@pytest.mark.parametrize("ending", ["normal", "nothing_to_train"])
def test_the_engine_and_model_are_freed_when_main_returns(tmp_path, tiny_shards, monkeypatch, ending):
    """bf16 + ZeRO-1: DeepSpeed's gradient hooks hold the engine, the model and the optimizer states until
    engine.destroy(); without it each in-process run (the suite, a sweep, a notebook) kept them (135 MiB after
    one tiny run). Checked independently of the driver: a weak reference to each model it built must be dead
    after a garbage collection."""
    built = []

    def build_model_recorded(*args, **kwargs):
        model = build_model(*args, **kwargs)
        built.append(weakref.ref(model))
        return model

    build_model = rp.build_model
    monkeypatch.setattr(rp, "build_model", build_model_recorded)
    if ending == "nothing_to_train":
        run(tmp_path, tiny_shards, max_steps=1)
        run(tmp_path, tiny_shards, max_steps=1, resume_from_checkpoint=True)
    else:
        run(tmp_path, tiny_shards, max_steps=1, skip_checkpoint=True)
    gc.collect()
    assert built and all(model() is None for model in built), "the driver's model outlives main"


def listening_on(pid: int, port: int) -> bool:
    import psutil
    return any(conn.laddr.port == port and conn.status == psutil.CONN_LISTEN
               for conn in psutil.Process(pid).net_connections(kind="tcp"))


def lone_rank_zero_of_two(tmp_path, tiny_shards, collective_timeout_s):
    """(command, environment, rendezvous port) of rank 0 of a 2-rank job whose rank 1 never starts."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=True, world=2)
    port = helpers.free_port()
    env = helpers.launcher_env(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                               MASTER_PORT=str(port))
    argv = helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, collective_timeout_s=collective_timeout_s)
    return [sys.executable, str(helpers.REPO_ROOT / "run_pretraining.py"), *map(str, argv)], env, port


@pytest.mark.parametrize("sent", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_a_stop_while_waiting_for_a_rank_that_never_comes_ends_the_rank_within_seconds(tmp_path, tiny_shards,
                                                                                        sent):
    """Rank 0 of a 2-rank job started alone: it waits in the rendezvous (torch.distributed's TCP store, which it
    hosts) for rank 1. A Ctrl-C there used to wait out --collective_timeout_s (the rendezvous blocks in C++,
    where Python's handler cannot run); now the rank leaves within seconds with one line, exit STOPPED as for
    any stop during start-up. Timed by this test's clock, from the signal to the process's end."""
    command, env, port = lone_rank_zero_of_two(tmp_path, tiny_shards, collective_timeout_s=60)
    process = subprocess.Popen(command, cwd=helpers.REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        deadline = time.monotonic() + 120
        while not listening_on(process.pid, port):  # the store is up: the rank is in the rendezvous
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()  # a rank that hangs before the rendezvous would never end by itself
                pytest.fail(f"the rank did not get to the rendezvous: {process.communicate(timeout=30)}")
            time.sleep(0.2)
        time.sleep(1.0)
        process.send_signal(sent)
        signalled = time.monotonic()
        out, err = process.communicate(timeout=90)
        elapsed = time.monotonic() - signalled
    finally:
        process.kill()
    line = (f"rank 0 of 2: stop requested ({sent.name}) while waiting for the other ranks to join "
            f"(127.0.0.1:{port}): stopping before the first step")
    assert elapsed < distributed.RENDEZVOUS_STOP_GRACE_S + 5, (elapsed, out[-2000:], err[-2000:])
    assert process.returncode == ExitStatus.STOPPED and line in out.splitlines(), (process.returncode, out[-2000:],
                                                                                   err[-2000:])
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_rank_that_never_comes_is_one_error_line_at_the_collective_timeout(tmp_path, tiny_shards):
    """Rank 0 of a 2-rank job started alone, --collective_timeout_s 5: torch's store gives up waiting for rank 1
    (a DistStoreError). The rank ends with one error line that names the rendezvous and the timeout, exit 1
    (not marked [no restart]: another attempt may find every server up); it was a traceback."""
    command, env, port = lone_rank_zero_of_two(tmp_path, tiny_shards, collective_timeout_s=5)
    result = subprocess.run(command, cwd=helpers.REPO_ROOT, env=env, capture_output=True, text=True, timeout=180)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:") or "Traceback" in line]
    assert result.returncode == 1 and len(errors) == 1, (result.returncode, result.stderr[-3000:])
    assert errors[0].startswith(f"error: rank 0 of 2: not every rank joined the rendezvous at 127.0.0.1:{port} "
                                f"within --collective_timeout_s 5 s: a server did not start its ranks, or cannot "
                                f"reach that address; the job stops ("), errors[0]
    assert not errors[0].endswith(NO_RESTART_MARK)


def mapped_files(pid: int) -> str:
    """The files process `pid` has mapped (/proc/PID/maps): the shared libraries of the modules it imported."""
    return Path(f"/proc/{pid}/maps").read_text()


def blocks_sigterm(pid: int) -> bool:
    """Whether process `pid`'s main thread blocks SIGTERM (/proc/PID/status, SigBlk: a hexadecimal mask, bit n-1
    for signal n)."""
    mask = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("SigBlk:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def test_a_sigterm_while_the_rank_imports_torch_still_gets_its_error_line_and_status_file(tmp_path, tiny_shards):
    """DeepSpeed's per-node launcher sends SIGTERM to every rank once one exits with an error: a rank still
    importing torch (seconds on a loaded server) is then told to stop. It used to die at once, so rank 0's
    report of the input error that the other rank met first was missing, and the supervisor read two attempts
    that failed alike as two different failures (it restarted once more). The driver blocks stop signals while
    it imports and takes them in main: the run meets the same bad input, prints its one line and writes its
    status file. The signal is sent once the driver blocks it, while torch's library is not yet loaded."""
    summary = tmp_path / "results" / "dllogger.json"
    summary.parent.mkdir()
    argv = helpers.driver_argv(tiny_shards, tmp_path / "out", helpers.write_ds_config(tmp_path / "ds.json"),
                               json_summary=summary, init_checkpoint="/nonexistent/checkpoint.pt")
    process = subprocess.Popen([sys.executable, str(helpers.REPO_ROOT / "run_pretraining.py"), *map(str, argv)],
                               cwd=helpers.REPO_ROOT, env=helpers.launcher_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not blocks_sigterm(process.pid):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate(timeout=30)
            time.sleep(0.001)
        maps = mapped_files(process.pid)
        process.send_signal(signal.SIGTERM)
        assert "libtorch" not in maps  # the signal came during the imports
        out, err = process.communicate(timeout=180)
    finally:
        process.kill()
    message = "--init_checkpoint /nonexistent/checkpoint.pt does not exist"
    assert (process.returncode, err.strip().splitlines()[-1:]) == (ExitStatus.FAILED, [f"error: {message}"]), err
    status = run_status.read_status(run_status.status_path(summary))
    assert (status["exit_status"], status["message"]) == (ExitStatus.FAILED, message)


class EndedBySigterm(Exception):
    """What SIGTERM's default action (the end of the process) stands as in an in-process run."""


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_sigterm_during_start_up_stops_before_the_first_step(tmp_path, tiny_shards, resumed):
    """A real SIGTERM while the run starts: sent from its memory check, once the process group is up, before the
    model and engine are built and the checkpoint is loaded. The run finishes start-up, makes no step, changes
    no checkpoint and returns its summary (the command line then exits STOPPED). The handler the test puts in place
    before the run, which raises, stands for the default action, which ended the ranks before."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=True, micro=4, gas=1)
    output_dir, json_summary = tmp_path / "checkpoints", tmp_path / "dllogger.json"
    if resumed:
        rp.main(helpers.driver_argv(tiny_shards, output_dir, ds_config, json_summary=json_summary, max_steps=2))
    saved = sorted(p.name for p in output_dir.iterdir()) if resumed else []
    step_records = len(helpers.step_records(json_summary)) if resumed else 0

    def sigterm_during_start_up(device):
        os.kill(os.getpid(), signal.SIGTERM)
        return None, "a device whose memory this test does not give"

    def default_action(*_):
        raise EndedBySigterm("SIGTERM's default action, outside the driver's stop handler")

    before = signal.signal(signal.SIGTERM, default_action)
    try:
        summary = rp.main(helpers.driver_argv(tiny_shards, output_dir, ds_config, json_summary=json_summary,
                                              max_steps=6, resume_from_checkpoint=resumed),
                          device_memory=sigterm_during_start_up)
        assert signal.getsignal(signal.SIGTERM) is default_action  # the driver's handler is removed again
    finally:
        signal.signal(signal.SIGTERM, before)
    assert summary["stopped_by_signal"] and summary["global_step"] == (2 if resumed else 0)
    assert len(helpers.step_records(json_summary)) == step_records  # no step
    assert sorted(p.name for p in output_dir.iterdir()) == saved  # no checkpoint saved or changed


# ============================================================================ bad input

def corrupt_key(paths):
    with h5py.File(paths[0], "a") as f:
        del f["masked_lm_ids"]


def mismatched_rows(paths):
    with h5py.File(paths[0], "a") as f:
        del f["next_sentence_labels"]
        f["next_sentence_labels"] = [0, 1]


def id_beyond_vocab(paths):
    with h5py.File(paths[0], "a") as f:
        ids = f["input_ids"][...]
        ids[3, 5] = 40000
        f["input_ids"][...] = ids


def segment_id_beyond_types(paths):
    with h5py.File(paths[0], "a") as f:
        segments = f["segment_ids"][...]
        segments[3, 5] = 2
        f["segment_ids"][...] = segments


def sequences_beyond_positions(paths):
    helpers.write_synthetic_shards(paths[0].parent, [12, 8], seq_len=520)


BAD_INPUTS = {
    "missing_input_dir": (None, {"input_dir": "/nonexistent/shards"}, "does not exist or is not a directory"),
    "empty_input_dir": ("empty", {}, "no training shards"),
    "shard_missing_key": (corrupt_key, {}, "missing key.*masked_lm_ids"),
    "shard_wrong_shape": (mismatched_rows, {}, "'next_sentence_labels' has 2 rows"),
    "token_id_beyond_vocab": (id_beyond_vocab, {"disable_random_sampler": True},
                              "sample 3: token id 40000 outside \\[0, 30522\\)"),
    "segment_id_beyond_type_vocab": (segment_id_beyond_types, {"disable_random_sampler": True},
                                     "sample 3: segment id 2 outside \\[0, 2\\)"),
    "seq_len_beyond_max_position": (sequences_beyond_positions, {}, "the shards' sequences have 520 tokens, more "
                                    "than max_position_embeddings 512 of --config_file"),
    "batch_arithmetic": (None, {"ds": {"train_batch_size": 10}},
                         "train_batch_size 10 is not a multiple of train_micro_batch_size_per_gpu 4 x world size 1: "
                         "this global batch cannot be kept"),
    "output_dir_not_empty": ("occupied", {}, "is not empty: pass --resume_from_checkpoint"),
    "output_dir_is_a_file": ("file_in_the_way", {"output_dir": "in_the_way"}, "--output_dir .*in_the_way exists and "
                             "is not a directory"),
    "json_summary_under_a_file": ("file_in_the_way", {"json-summary": "in_the_way/log.json"},
                                  "--json-summary's directory .*in_the_way exists and is not a directory"),
    "json_summary_is_a_directory": (None, {"json-summary": "."}, "--json-summary .* is a directory, not a file"),
    "unknown_optimizer": (None, {"optimizer": "sgd"}, "unknown --optimizer 'sgd': choose one of lans"),
    "zero_offload": (None, {"ds": {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}},
                     "ds.json: ZeRO offload is not supported by this repository"),
    "dataset_smaller_than_a_batch": (None, {"ds": {"train_batch_size": 128, "train_micro_batch_size_per_gpu": 128,
                                                   "gradient_accumulation_steps": 1}},
                                     "holds 20 samples, fewer than one global micro-batch \\(128\\)"),
    "unknown_profile": (None, {"profile": "nsys"}, "unknown --profile 'nsys'"),
    "hltv_without_hpu": (None, {"profile": "hltv"}, "needs --use_hpu"),
    "use_hpu_without_habana": (None, {"use_hpu": True, "no_cuda": False}, "--use_hpu needs the SynapseAI"),
    "too_many_predictions": (None, {"max_predictions_per_seq": 3}, "5 masked positions per sequence, more than"),
    "impossible_schedule": (None, {"warmup_proportion": 1.5}, "optimizer / LR schedule: warmup must be"),
    "fractional_log_freq": (None, {"log_freq": 0.5}, "--log_freq must be at least 1"),
    # the reference's parser reads these step counts as floats: messages and the logged Config give whole numbers
    "zero_max_steps": (None, {"max_steps": 0}, r"^error: --max_steps must be at least 1, got 0( |$)"),
    "fractional_max_steps": (None, {"max_steps": 2.5}, "--max_steps must be a whole number of steps, got 2.5"),
    "negative_seed": (None, {"seed": -1}, "--seed must be 0 or more, got -1"),
    "negative_keep_last_n": (None, {"keep_last_n_checkpoints": -2}, "--keep_last_n_checkpoints must be 0 or more"),
    "zero_memory_budget": (None, {"data_memory_budget_mb": 0}, "--data_memory_budget_mb must be positive, got 0"),
    "negative_memory_budget": (None, {"data_memory_budget_mb": -5}, "--data_memory_budget_mb must be positive"),
    # 0 and -2 used to train silently to --max_steps (only -1 means no limit)
    "zero_steps_this_run": (None, {"steps_this_run": 0},
                            r"^error: --steps_this_run must be -1 \(no limit\) or at least 1, got 0 \[no restart\]$"),
    "negative_steps_this_run": (None, {"steps_this_run": -2},
                                r"^error: --steps_this_run must be -1 \(no limit\) or at least 1, got -2 "
                                r"\[no restart\]$"),
    # -5 used to resume from the latest checkpoint, and a step without --resume_from_checkpoint to start afresh
    "negative_resume_step": (None, {"resume_step": -5, "resume_from_checkpoint": True},
                             r"^error: --resume_step must be -1 \(the latest\) or a checkpoint's step, got -5 "
                             r"\[no restart\]$"),
    "resume_step_without_resume": (None, {"resume_step": 4},
                                   r"^error: --resume_step 4 needs --resume_from_checkpoint \[no restart\]$"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gives_one_error_line_and_its_exit_status(tmp_path, capsys, case):
    """One error line; the status NO_RESTART where the line says [no restart] (a setting wrong for every
    server), else FAILED (input one server may lack: the supervisor's host check decides)."""
    prepare, flags, message = BAD_INPUTS[case]
    flags = dict(flags)
    data_dir = tmp_path / "shards"
    paths = helpers.write_synthetic_shards(data_dir, [12, 8])
    if callable(prepare):
        prepare(paths)
    elif prepare == "empty":
        for path in paths:
            path.unlink()
    elif prepare == "occupied":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "old_run.txt").write_text("x")
    elif prepare == "file_in_the_way":
        (tmp_path / "in_the_way").write_text("a file where a directory should be")
    for flag in ("output_dir", "json-summary"):  # relative to tmp_path
        if flag in flags:
            flags[flag] = tmp_path / flags[flag]
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    config = json.loads(ds_config.read_text())
    config.update(flags.pop("ds", {}))
    ds_config.write_text(json.dumps(config))
    argv = helpers.driver_argv(data_dir, flags.pop("output_dir", tmp_path / "out"), ds_config,
                               json_summary=flags.pop("json-summary", tmp_path / "log.json"),
                               **{"input_dir": data_dir, **flags})
    status = rp.cli(argv)
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert re.search(message, errors[0]), errors[0]
    assert status == (ExitStatus.NO_RESTART if errors[0].endswith(NO_RESTART_MARK) else ExitStatus.FAILED)


def test_segment_ids_are_checked_against_the_models_type_vocab_size(tmp_path, capsys):
    """The reader's segment limit is the model's type_vocab_size, not BERT's 2: with a config of 1 segment
    type, the shards' segment B (id 1) is refused, where the first step would fail with an IndexError."""
    helpers.write_synthetic_shards(tmp_path / "shards", [12, 8])
    config = tmp_path / "one_segment_type.json"
    config.write_text(json.dumps({**json.loads(helpers.TINY_MODEL_CONFIG.read_text()), "type_vocab_size": 1}))
    argv = helpers.driver_argv(tmp_path / "shards", tmp_path / "out", helpers.write_ds_config(tmp_path / "ds.json"),
                               config_file=config, disable_random_sampler=True)
    assert rp.cli(argv) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(r"sample 0: segment id 1 outside \[0, 1\)", errors[0]), errors


@pytest.mark.parametrize("where", ["output_dir", "json_summary_dir"])
def test_read_only_output_is_one_error_line_before_any_step(tmp_path, tiny_shards, capsys, where):
    """A read-only --output_dir (or --json-summary's directory) used to fail only at the first checkpoint save."""
    locked = tmp_path / "locked"
    locked.mkdir()
    out, log = ((locked / "out", tmp_path / "log.json") if where == "output_dir"
                else (tmp_path / "out", locked / "log.json"))
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    with helpers.read_only(locked):
        assert rp.cli(helpers.driver_argv(tiny_shards, out, ds_config, json_summary=log)) == ExitStatus.NO_RESTART
    flag = "--output_dir" if where == "output_dir" else "--json-summary's directory"
    path = out if where == "output_dir" else locked
    out, err = capsys.readouterr()
    (error,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert re.fullmatch(rf"error: {re.escape(flag)} {re.escape(str(path))} is not writable: (Read-only file system|"
                        r"Permission denied) \[no restart\]", error), error
    assert "[run_pretraining]" not in out  # refused while checking the flags: no device, model or step yet


@pytest.mark.parametrize("rank, local_rank, printed", [("0", "0", "error: "), ("1", "0", "error: rank 1 on {host}: "),
                                                      ("9", "1", None)])
def test_bad_input_is_printed_once_per_host_naming_a_host_other_than_rank_0s(tmp_path, capsys, monkeypatch,
                                                                              rank, local_rank, printed):
    """An --input_dir missing on one server alone used to fail its ranks without a word (only rank 0 printed)
    while rank 0 waited for them: now each server's first local rank says it, naming the server."""
    import socket
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    missing = tmp_path / "not_on_this_host"
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    assert rp.cli(helpers.driver_argv(missing, tmp_path / "out", ds_config, json_summary=tmp_path / "log.json")) == 1
    lines = capsys.readouterr().err.splitlines()
    if printed is None:
        assert lines == []
    else:
        (line,) = lines
        prefix = printed.format(host=socket.gethostname())
        assert line.startswith(prefix) and str(missing) in line[len(prefix):], line


@pytest.mark.parametrize("raised, marked", [
    (rp.TrainingStopped("3 consecutive steps had a non-finite loss (--max_bad_steps 3); stopped at step 4"), True),
    (rp.InputError("--steps_this_run must be -1 (no limit) or at least 1, got 0"), True),
    (HostInputError("--input_dir /data does not exist or is not a directory"), False),  # maybe one server's
    (rp.ShardError("shard_1.hdf5: cannot read samples 0..15"), False),       # a copy may be good on a restart
    (checkpointing.CheckpointError("cannot write checkpoint 8 on rank 1"), False)])
def test_bad_input_and_a_deliberate_stop_say_no_restart(monkeypatch, capsys, raised, marked):
    """training/supervisor.py restarts a failed job, but a restart would meet bad input or a --max_bad_steps stop
    again: they exit NO_RESTART, which the supervisor does not restart, and their line ends with [no restart].
    Input that may be one server's alone (a HostInputError) is left to the supervisor's host check."""
    monkeypatch.delenv("RANK", raising=False)

    def main(argv, status_file, job):
        raise raised

    monkeypatch.setattr(rp, "main", main)
    assert rp.cli([]) == (ExitStatus.NO_RESTART if marked else ExitStatus.FAILED)
    assert capsys.readouterr().err == f"error: {raised}{' [no restart]' if marked else ''}\n"


@pytest.mark.parametrize("input_dir, ds_micro, marked", [
    ("/nonexistent/shards", 4, False),       # maybe missing on this server only: the supervisor's host check decides
    (None, 1000, True)])                     # fewer samples than one global micro-batch: the same on every server
def test_which_start_up_errors_say_no_restart(tmp_path, tiny_shards, capsys, input_dir, ds_micro, marked):
    """The driver's own classification, end to end: a directory (or S3 store, or shard copy) one server may lack is
    not marked [no restart]; a setting that is wrong for every server is."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", micro=ds_micro)
    argv = helpers.driver_argv(input_dir or tiny_shards, tmp_path / "out", ds_config)
    assert rp.cli(argv) == (ExitStatus.NO_RESTART if marked else ExitStatus.FAILED)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --input_dir ") and line.endswith(" [no restart]") == marked, line


def test_bad_input_from_the_command_line_writes_nothing(tmp_path, tiny_shards):
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    argv = helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, json_summary=tmp_path / "log.json",
                               optimizer="sgd")
    result = helpers.run_single_process(argv, timeout=120)
    assert result.returncode == ExitStatus.NO_RESTART
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown --optimizer 'sgd'")
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "log.json").exists()


def test_truncated_shard_is_named_before_training(tmp_path, capsys):
    """A truncated HDF5 file cannot even be opened: the start-up header scan names it in one error line, before
    any step and whatever --skip_bad_shards says (it skips shards that fail while training)."""
    data = tmp_path / "data"
    bad = helpers.write_synthetic_shards(data, [24, 40, 17])[1]
    os.truncate(bad, bad.stat().st_size // 2)
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=False)
    assert rp.cli(helpers.driver_argv(data, tmp_path / "out", ds_config, skip_bad_shards=True)) == ExitStatus.FAILED
    (error,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert re.match(rf"error: {re.escape(str(bad))}: cannot read as HDF5 .*truncated", error), error
    assert not (tmp_path / "out" / "latest").exists()


def test_corrupt_shard_met_mid_epoch_stops_naming_it_or_is_skipped_and_counted(tmp_path, capsys):
    """The last shard of epoch 0 has a header that validates and samples that cannot be read; a window of about
    12 samples reaches it only after some steps. The run stops there with one error line naming it; with
    --skip_bad_shards it skips the shard, counts it and trains to the end."""
    data = tmp_path / "data"
    helpers.write_synthetic_shards(data, [24, 40, 17])
    bad = helpers.last_shard_of_first_epoch(data)
    helpers.corrupt_first_chunk(bad)
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=False)
    argv = helpers.driver_argv(data, tmp_path / "out", ds_config, max_steps=24, log_freq=1, skip_checkpoint=True,
                               data_memory_budget_mb=0.01)
    assert rp.cli(argv) == ExitStatus.FAILED
    out, err = capsys.readouterr()
    (error,) = [line for line in err.splitlines() if line.startswith("error:")]
    assert re.match(rf"error: {re.escape(str(bad))}: cannot read samples \d+\.\.\d+", error), error
    assert "Training Iteration: 10 " in out  # the error came mid-epoch
    summary = rp.main(argv + ["--skip_bad_shards"])
    assert summary["skipped_shards"] == 1 and summary["global_step"] == 24


@pytest.mark.parametrize("bad", [["--bogus"], ["--max_steps", "abc"], []])
def test_unknown_flag_or_bad_value_is_one_error_line(capsys, bad):
    required = [] if not bad else ["--input_dir", "x", "--config_file", "y", "--output_dir", "z"]
    with pytest.raises(SystemExit) as exit_info:
        rp.parse_arguments(required + bad)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and err[0].endswith("(see --help)")


def test_help_says_which_flags_do_nothing(capsys):
    with pytest.raises(SystemExit):
        rp.parse_arguments(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the group's description
    assert "these do nothing" in text
    for flag in ("--bert_model", "--num_train_epochs", "--do_train", "--loss_scale"):
        assert flag in text


def test_tensorboard_without_its_package_is_a_clear_error(tmp_path, tiny_shards, capsys, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",  # as on a machine without the package
                        lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a))
    ds_config = helpers.write_ds_config(tmp_path / "ds.json",
                                        tensorboard={"enabled": True, "output_path": str(tmp_path)})
    assert rp.cli(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config)) == ExitStatus.NO_RESTART
    assert "enables TensorBoard but the tensorboard package is not installed" in capsys.readouterr().err


def test_deepspeed_monitor_receives_the_logged_metrics(tmp_path, tiny_shards):
    """The DeepSpeed JSON's monitors (TensorBoard, CSV, ...) get every logged metric; CSV needs no package."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", csv_monitor={
        "enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "tiny"})
    rp.main(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, max_steps=2, log_freq=1,
                                skip_checkpoint=True))
    assert next((tmp_path / "csv").rglob("*mfu*")) and next((tmp_path / "csv").rglob("*model_tflops*"))
    loss_file = next((tmp_path / "csv").rglob("*average_loss*"))
    logged = [r["data"]["average_loss"] for r in helpers.step_records(tmp_path / "dllogger.json")]
    rows = [line.split(",") for line in loss_file.read_text().splitlines()[1:]]
    assert [int(step) for step, _ in rows] == [1, 2]
    assert [float(value) for _, value in rows] == pytest.approx(logged)


def test_tensorboard_monitor_writes_event_files(tmp_path, tiny_shards):
    """The reference's 1.5B JSON enables TensorBoard: the metrics reach real event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", tensorboard={
        "enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "tiny"})
    rp.main(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, max_steps=2, log_freq=1,
                                skip_checkpoint=True))
    event_dir = next((tmp_path / "tb").rglob("events.out.tfevents.*")).parent
    events = EventAccumulator(str(event_dir))
    events.Reload()
    loss_tag = next(tag for tag in events.Tags()["scalars"] if tag.endswith("average_loss"))
    logged = [r["data"]["average_loss"] for r in helpers.step_records(tmp_path / "dllogger.json")]
    assert [e.step for e in events.Scalars(loss_tag)] == [1, 2]
    assert [e.value for e in events.Scalars(loss_tag)] == pytest.approx(logged, rel=1e-6)


# ============================================================================ phase 2, init checkpoint, profiler

def test_phase2_resets_step_counters_and_schedule_but_keeps_moments(tmp_path, tiny_shards):
    """One phase-2 step after a 3-step phase 1, seen in the checkpoints and the log."""
    _, _, output_dir = run(tmp_path, tiny_shards, max_steps=3)
    (tmp_path / "dllogger.json").unlink()
    phase2_shards = tmp_path / "phase2_shards"  # other data (the real phase 2: seq 512): no data layout check
    helpers.write_synthetic_shards(phase2_shards, [30])
    summary, json_summary, _ = run(tmp_path, phase2_shards, max_steps=4, steps_this_run=1, warmup_proportion=0.5,
                                   learning_rate=0.004, phase2=True, phase1_end_step=3, resume_from_checkpoint=True,
                                   log_freq=1)
    assert summary["global_step"] == 1
    assert (output_dir / "latest").read_text().strip() == "4"  # phase-2 tags continue after phase 1's
    # Phase 2's own schedule restarts: step 1 of 4 with warm-up 0.5 -> lr = 0.004 * (1/4) / 0.5.
    assert [r["data"]["learning_rate"] for r in helpers.step_records(json_summary)] == pytest.approx([0.002])
    assert saved_lans_steps(output_dir, "3") == [3, 3] and saved_lans_steps(output_dir, "4") == [1, 1]
    # The moments carry on: one step of v <- beta2 v + (1 - beta2) g^2 keeps v >= beta2 v everywhere; moments
    # reset to zero would leave (1 - beta2) g^2 alone, below beta2 v wherever g^2 < v / (1 - beta2) * beta2.
    beta2 = 0.999  # LANS's default
    before, after = (saved_lans_state(output_dir, tag)["state"] for tag in ("3", "4"))
    assert before.keys() == after.keys() and all(before[key]["exp_avg_sq"].sum() > 0 for key in before)
    assert all(bool((after[key]["exp_avg_sq"] >= beta2 * before[key]["exp_avg_sq"] * (1 - 1e-6)).all())
               for key in before)


def test_phase2_from_the_wrong_step_is_an_error(tmp_path, tiny_shards, capsys):
    run(tmp_path, tiny_shards, max_steps=2)
    ds_config = tmp_path / "ds.json"
    argv = helpers.driver_argv(tiny_shards, tmp_path / "checkpoints", ds_config, phase2=True, phase1_end_step=7,
                               resume_from_checkpoint=True)
    assert rp.cli(argv) == ExitStatus.NO_RESTART
    assert "checkpoint 2 is at step 2, but --phase1_end_step is 7" in capsys.readouterr().err


def test_init_checkpoint_loads_weights_with_a_fresh_optimizer(tmp_path, tiny_shards):
    _, _, first_dir = run(tmp_path / "first", tiny_shards, max_steps=2)
    saved = torch.load(first_dir / "2" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    # The model main builds holds the checkpoint's weights (bf16 there, cast to fp32 here).
    weights = rp.build_model(rp.BertConfig.from_json_file(helpers.TINY_MODEL_CONFIG), first_dir / "2", 0).state_dict()
    assert set(saved) == set(weights)
    assert all(torch.equal(weights[k], saved[k].float()) for k in saved)
    # ... and the run starts at step 0 with a fresh optimizer.
    summary, _, second_dir = run(tmp_path / "second", tiny_shards, max_steps=1, init_checkpoint=first_dir / "2")
    assert summary["global_step"] == 1
    assert saved_lans_steps(second_dir, "1") == [1, 1]


@pytest.mark.parametrize("problem", ["corrupt", "other_config", "not_a_state_dict"])
def test_bad_init_checkpoint_is_one_error_line(tmp_path, tiny_shards, capsys, problem):
    weights = tmp_path / "weights.pt"
    if problem == "corrupt":
        weights.write_bytes(b"\x00not a checkpoint" * 10)
    elif problem == "other_config":
        other = rp.BertConfig.from_dict(dict(json.loads(Path(helpers.TINY_MODEL_CONFIG).read_text()), hidden_size=64))
        torch.save(rp.BertForPreTraining(other).state_dict(), weights)
    else:
        torch.save([1, 2, 3], weights)
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    status = rp.cli(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, init_checkpoint=weights))
    assert status == ExitStatus.NO_RESTART
    err = capsys.readouterr().err.strip().splitlines()
    expected = {"corrupt": "cannot read",
                "other_config": "does not fit the model config (hidden 128, 2 layers, padded vocab 30528): the "
                                "checkpoint has hidden 64, 2 layers",
                "not_a_state_dict": "holds no state dict"}[problem]
    assert len(err) == 1 and err[0].startswith("error: --init_checkpoint") and expected in err[0]
    assert not (tmp_path / "dllogger.json").exists()  # refused before the run's log is started


# A layer of the tiny config: Q, K, V and the attention output (weight and bias each), the attention's LayerNorm,
# the intermediate and output dense layers, the output LayerNorm.
TENSORS_PER_LAYER = 4 * 2 + 2 + 2 * 2 + 2


@pytest.mark.parametrize("change,expected", [
    ({"hidden_size": 64}, "the checkpoint has hidden 64, 2 layers, 30528 vocabulary rows; {reshaped} tensors of "
     "another shape (first bert.embeddings.word_embeddings.weight: [30528, 64] in the checkpoint, [30528, 128] in "
     "the model)"),
    ({"num_hidden_layers": 3}, f"the checkpoint has hidden 128, 3 layers, 30528 vocabulary rows; {TENSORS_PER_LAYER} "
     "unexpected keys (first bert.encoder.layer.2.attention.self.query.weight)"),
    ({"num_hidden_layers": 1}, f"the checkpoint has hidden 128, 1 layer, 30528 vocabulary rows; {TENSORS_PER_LAYER} "
     "missing keys (first bert.encoder.layer.1.attention.self.query.weight)"),
], ids=["hidden", "more_layers", "fewer_layers"])
def test_init_checkpoint_of_another_config_names_what_does_not_fit(tmp_path, change, expected):
    """The error says what the checkpoint's config is and which tensor differs first, with both shapes, so
    that a user can tell which config is wrong. The count of reshaped tensors is counted here over the two
    state dicts; the layer's tensor count is the tiny config's, by hand."""
    tiny = json.loads(Path(helpers.TINY_MODEL_CONFIG).read_text())
    saved = rp.BertForPreTraining(rp.BertConfig.from_dict(dict(tiny, **change))).state_dict()
    torch.save(saved, tmp_path / "other.pt")
    model = rp.BertForPreTraining(rp.BertConfig.from_dict(tiny))
    own = model.state_dict()
    reshaped = sum(saved[key].shape != own[key].shape for key in own.keys() & saved.keys())
    with pytest.raises(rp.InputError) as caught:
        init_weights.load_init_weights(model, tmp_path / "other.pt")
    assert str(caught.value) == (f"--init_checkpoint {tmp_path / 'other.pt'} does not fit the model config (hidden "
                                 f"128, 2 layers, padded vocab 30528): {expected.format(reshaped=reshaped)}")


def unreadable_weight_files(directory) -> list:
    """Files torch.load(weights_only=True) cannot read: text starting with every letter, digit and some
    punctuation (its unpickler fails in many ways: IndexError 'pop from empty list', KeyError, struct.error,
    EOFError...), random bytes, an empty file, a torn zip, a pickled object, non-tensor values, a directory
    that is not a checkpoint tag."""
    import pickle
    import random
    import string
    directory.mkdir()
    files = []
    for char in string.ascii_letters + string.digits + "(.)]}#-":
        files.append(directory / f"text_{ord(char)}.txt")
        files[-1].write_text(f"{char}xyz: the notes of a run\n")
    rng = random.Random(0)
    for index in range(20):
        files.append(directory / f"random_{index}.bin")
        files[-1].write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
    for name, content in (("empty.pt", b""), ("torn_zip.pt", b"PK\x03\x04" + b"\x00" * 40),
                          ("object.pt", pickle.dumps({"weights": object}))):
        files.append(directory / name)
        files[-1].write_bytes(content)
    files.append(directory / "numbers.pt")
    torch.save({"bert.embeddings.word_embeddings.weight": 1}, files[-1])
    files.append(directory / "not_a_tag")
    files[-1].mkdir()
    return files


def test_unreadable_init_checkpoint_says_what_it_should_be(tmp_path):
    """One line of our own (what the file should be) with torch's reason after it, for any unreadable file;
    never a traceback, never torch's advice to load with weights_only=False."""
    from modeling import BertConfig, BertForPreTraining
    model = BertForPreTraining(BertConfig.from_json_file(helpers.TINY_MODEL_CONFIG))
    reasons = set()
    for path in unreadable_weight_files(tmp_path / "files"):
        with pytest.raises(rp.InputError) as caught:
            init_weights.load_init_weights(model, path)
        message = str(caught.value)
        assert "\n" not in message and len(message) < 700, message
        assert message.startswith(f"--init_checkpoint {path}: ") and "weights_only" not in message, message
        assert ("it should be a checkpoint tag directory (holding mp_rank_00_model_states.pt) or a state-dict file "
                "written by torch.save") in message, message
        reason = re.search(r"\(torch: (\w+)", message)
        reasons.add(reason.group(1) if reason else "no tensors")
    assert {"IndexError", "UnpicklingError", "EOFError", "no tensors"} <= reasons, reasons


def test_text_file_as_init_checkpoint_is_one_error_line(tmp_path, tiny_shards, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("abc: the weights are in the other directory\n")  # 'a': IndexError in torch's unpickler
    ds_config = helpers.write_ds_config(tmp_path / "ds.json")
    status = rp.cli(helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, init_checkpoint=notes))
    assert status == ExitStatus.NO_RESTART
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --init_checkpoint {notes}: cannot read {notes} as weights; it should be a checkpoint tag "
                   "directory (holding mp_rank_00_model_states.pt) or a state-dict file written by torch.save (ours, "
                   "`python -m training.checkpointing export`'s, or transformers' BertForPreTraining) "
                   "(torch: IndexError: pop from "
                   "empty list) [no restart]"]


@pytest.mark.parametrize("older_save", [False, True], ids=["current", "with_position_ids"])
def test_init_checkpoint_accepts_a_hugging_face_state_dict(tmp_path, older_save):
    """Interoperability: a transformers.BertForPreTraining (post-LN) state dict starts a run as it is, also one
    saved by transformers before 4.31, which holds the bert.embeddings.position_ids buffer."""
    transformers = pytest.importorskip("transformers")
    tiny = json.loads(Path(helpers.TINY_MODEL_CONFIG).read_text())
    config_file = tmp_path / "post_ln.json"
    config_file.write_text(json.dumps(dict(tiny, layer_norm_large_model=False)))
    config = rp.BertConfig.from_json_file(config_file)
    hf_model = transformers.BertForPreTraining(transformers.BertConfig(**to_transformers_config(config)))
    hf_weights = hf_model.state_dict()
    position_ids = {"bert.embeddings.position_ids": torch.arange(config.max_position_embeddings)[None]}
    torch.save(dict(hf_weights, **position_ids) if older_save else hf_weights, tmp_path / "hf.pt")
    ours = rp.build_model(config, tmp_path / "hf.pt", 0).state_dict()
    assert all(torch.equal(ours[key], hf_weights[key]) for key in ours)


def test_profiler_writes_a_trace_of_the_chosen_steps(tmp_path, tiny_shards):
    run(tmp_path, tiny_shards, max_steps=3, profile="pt", profile_steps="1,1", skip_checkpoint=True)
    traces = list((tmp_path / "profile").glob("*.pt.trace.json*"))
    assert len(traces) == 1


# ============================================================================ the cross-rank agreement of a step

class RecordingCriterion(BertPretrainingCriterion):
    def __init__(self):
        super().__init__()
        self.losses = []

    def forward(self, *args):
        loss = super().forward(*args)
        self.losses.append(float(loss.detach()))
        return loss


@pytest.mark.parametrize("other_rank", [(0.0, 0.0, 0.0, 2.5), (1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 9.0),
                                       (0.0, 0.0, 1.0, 2.5)],
                         ids=["finite", "other_rank_non_finite", "other_rank_stop_request",
                              "other_rank_skipped_a_shard"])
def test_a_step_averages_the_loss_over_two_ranks(tmp_path, tiny_shards, other_rank):
    """train_step as rank 0 of a world of 2: the all-reduce adds what a second rank sends ([non-finite flag,
    stop flag, shard-skipped flag, its mean loss]); the step's mean loss must be (this rank's mean + the
    other's) / 2, a non-finite loss on the other rank must skip the update here, its stop request must stop
    this rank, and a shard it dropped must be reported for the ranks to agree on."""
    import deepspeed

    from data.dataset import RankBatches, WindowReader, scan_shards
    from modeling import BertConfig, BertForPreTraining

    helpers.init_single_process_group()
    config = BertConfig.from_json_file(helpers.TINY_MODEL_CONFIG)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        config={"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                "steps_per_print": 10 ** 9})
    shards, _, _ = scan_shards(tiny_shards)
    batches = RankBatches(WindowReader(shards, 7, 16, config.vocab_size), 0, 2, 4, 0)
    reduced = []

    def all_reduce_with_a_second_rank(tensor, *args, **kwargs):
        reduced.append(tensor.clone())
        tensor += torch.tensor(other_rank, dtype=tensor.dtype)

    criterion = RecordingCriterion()
    run = SimpleNamespace(engine=engine, optimizer=optimizer, criterion=criterion, device=torch.device("cpu"),
                          say=print, graph_breaks=gaudi.NoGraphBreaks(), all_reduce=all_reduce_with_a_second_rank)
    settings = SimpleNamespace(gas=2, world=2)
    before = [p.detach().clone() for p in engine.module.parameters()]
    try:
        result = pretraining_step.train_step(run, settings, batches, SimpleNamespace(is_set=lambda: False), None)
    finally:
        batches.close()
    local = sum(criterion.losses) / 2
    assert len(reduced) == 1 and reduced[0].tolist() == pytest.approx([0.0, 0.0, 0.0, local], rel=1e-6)
    assert result.local_loss == pytest.approx(local, rel=1e-6)
    assert result.mean_loss == pytest.approx((local + other_rank[3]) / 2, rel=1e-6)
    assert result.finite == (other_rank[0] == 0)
    assert result.stop_requested == (other_rank[1] == 1)
    assert result.shards_newly_skipped == (other_rank[2] == 1)
    updated = any(not torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert updated == result.finite


# ============================================================================ resuming with other flags

def test_a_resume_continues_the_deepspeed_json_scheduler(tmp_path, tiny_shards):
    """Without --use_lr_scheduler the DeepSpeed JSON's scheduler runs (WarmupLR here). Its state holds none of
    PolyWarmUp's schedule keys and its parameters come from the JSON at every start: a resumed run (2 + 2
    steps) applies the LRs of an uninterrupted 4-step run. It used to end the resume with KeyError 'total_steps'."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}})

    def lrs(name, **flags):
        argv = helpers.driver_argv(tiny_shards, tmp_path / name, ds_config, json_summary=tmp_path / f"{name}.json",
                                   use_lr_scheduler=False, log_freq=1, **flags)
        rp.main(argv)
        return [r["data"]["learning_rate"] for r in helpers.step_records(tmp_path / f"{name}.json")]

    uninterrupted = lrs("whole", max_steps=4, skip_checkpoint=True)
    assert uninterrupted[2:] != uninterrupted[:2]  # a schedule restarted at step 0 would show
    assert lrs("resumed", max_steps=2) == pytest.approx(uninterrupted[:2])
    # the resumed run appends its records to the first run's
    assert lrs("resumed", max_steps=4, resume_from_checkpoint=True) == pytest.approx(uninterrupted)


def poly_lr(base_lr, t, total_steps, warmup):
    """PolyWarmUp with degree 1 and no constant part, written out: the LR optimizer step t uses."""
    p = t / total_steps
    return base_lr * (p / warmup if p < warmup else max(0.0, (1 - p) / (1 - warmup)))


@pytest.mark.parametrize("first_max,saved_at,resume_flags", [(4, 4, {"max_steps": 8}), (8, 4, {"max_steps": 6}),
                                                             (8, 4, {"max_steps": 8, "learning_rate": 0.02})],
                         ids=["longer", "shorter", "other_learning_rate"])
def test_resume_with_another_schedule_follows_the_new_flags(tmp_path, tiny_shards, capsys, first_max, saved_at,
                                                            resume_flags):
    """Extending a finished run used to train at LR 0 (the restored schedule ended at the old --max_steps).
    The resumed steps follow the schedule of the new flags from the step reached on, and the log says so;
    the resumed run appends to the same dllogger JSON."""
    common = dict(stage=1, bf16=True, log_freq=1, warmup_proportion=0.25)
    run(tmp_path, tiny_shards, max_steps=first_max, steps_this_run=saved_at, num_steps_per_checkpoint=saved_at,
        **common)
    capsys.readouterr()
    run(tmp_path, tiny_shards, resume_from_checkpoint=True, **common, **resume_flags)
    said = capsys.readouterr().out
    new_max, new_lr = resume_flags["max_steps"], resume_flags.get("learning_rate", 0.01)
    changed = [f"--max_steps {first_max} -> {new_max}"] if new_max != first_max else []
    changed += ["--learning_rate 0.01 -> 0.02"] if new_lr != 0.01 else []
    assert re.search(rf"the LR schedule changed since the checkpoint \({', '.join(changed)}\): "
                     rf"from step {saved_at + 1} on, the LR follows the new flags .*the LR curve bends there",
                     said), said
    records = helpers.step_records(tmp_path / "dllogger.json")
    assert [r["step"][1] for r in records] == list(range(1, new_max + 1))  # both runs, in one file
    logged = {r["step"][1]: r["data"]["learning_rate"] for r in records}
    expected = {t: poly_lr(0.01, t, first_max, 0.25) for t in range(1, saved_at + 1)}
    expected.update({t: poly_lr(new_lr, t, new_max, 0.25) for t in range(saved_at + 1, new_max + 1)})
    assert logged == pytest.approx(expected, rel=1e-6)
    assert all(logged[t] > 0 for t in range(saved_at + 1, new_max))


def test_resume_with_the_same_flags_says_nothing_about_the_schedule(tmp_path, tiny_shards, capsys):
    common = dict(stage=0, bf16=False, log_freq=1, max_steps=4)
    run(tmp_path, tiny_shards, steps_this_run=2, num_steps_per_checkpoint=2, **common)
    run(tmp_path, tiny_shards, resume_from_checkpoint=True, **common)
    assert "LR schedule changed" not in capsys.readouterr().out
    assert [r["step"][1] for r in helpers.step_records(tmp_path / "dllogger.json")] == [1, 2, 3, 4]


def test_a_fresh_run_replaces_the_dllogger_json(tmp_path, tiny_shards):
    (tmp_path / "dllogger.json").write_text('DLLL {"type": "LOG", "step": [0, 7], "data": {"step_loss": 1}}\n')
    run(tmp_path, tiny_shards, stage=0, bf16=False, log_freq=1, max_steps=2, skip_checkpoint=True)
    assert [r["step"][1] for r in helpers.step_records(tmp_path / "dllogger.json")] == [1, 2]


# ============================================================================ MFU and the memory check

# The tiny model's training FLOPs per sequence at seq 32 with 5 predictions, by the model-FLOPs formula
# written out: 3 x (L S 24 h^2 + L S 4 S h + 2 P (h^2 + h V) + 2 (h^2 + 2h)); h 128, L 2, V 30528.
TINY_FLOPS_PER_SEQUENCE = 3 * (2 * 32 * 24 * 128**2 + 2 * 32 * 4 * 32 * 128 + 2 * 5 * (128**2 + 128 * 30528)
                               + 2 * (128**2 + 2 * 128))


def test_model_tflops_and_mfu_are_logged_with_the_given_peak(tmp_path, tiny_shards):
    summary, json_summary, _ = run(tmp_path, tiny_shards, micro=4, gas=2, max_steps=2, log_freq=1,
                                   skip_checkpoint=True, peak_tflops=0.5)
    logs = [r for r in helpers.read_dllogger(json_summary) if r["type"] == "LOG"]
    assert {"peak_tflops": 0.5, "peak_tflops_source": "--peak_tflops"}.items() <= next(
        r["data"] for r in logs if r["step"] == "PARAMETER" and "peak_tflops" in r["data"]).items()
    for record in helpers.step_records(json_summary):
        data = record["data"]
        assert data["model_tflops"] == pytest.approx(data["average_perf_per_step"] * TINY_FLOPS_PER_SEQUENCE / 1e12)
        assert data["mfu"] == pytest.approx(data["model_tflops"] / 0.5)
    assert summary["model_tflops"] == pytest.approx(
        summary["training_sequences_per_second"] * TINY_FLOPS_PER_SEQUENCE / 1e12)
    assert summary["mfu"] == pytest.approx(summary["model_tflops"] / 0.5)


def test_cpu_peak_is_measured_and_said_so(tmp_path, tiny_shards, capsys):
    run(tmp_path, tiny_shards, max_steps=1, skip_checkpoint=True, peak_tflops=None)
    parameter = next(r["data"] for r in helpers.read_dllogger(tmp_path / "dllogger.json")
                     if r["step"] == "PARAMETER" and "peak_tflops" in r["data"])
    assert parameter["peak_tflops"] > 0 and parameter["peak_tflops_source"].startswith("measured at start-up")
    assert "MFU is model FLOPs / " in capsys.readouterr().out


@pytest.mark.parametrize("skip", [False, True])
def test_a_run_predicted_not_to_fit_is_refused_before_any_step(tmp_path, tiny_shards, capsys, skip):
    """The tiny run with ZeRO-1's default 5e8-element bucket needs about 1.1 GiB; the 'device' has 512 MiB."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=True, micro=4)
    argv = helpers.driver_argv(tiny_shards, tmp_path / "out", ds_config, max_steps=1, skip_checkpoint=True,
                               skip_memory_check=skip)

    def small_device(device):
        return 512 * 2**20, "a 512 MiB test device"

    if not skip:
        with pytest.raises(rp.InputError, match="the memory planner predicts .*512 MiB test device"):
            rp.main(argv, device_memory=small_device)
        assert not (tmp_path / "dllogger.json").exists()  # refused before the run's log is started
    else:
        assert rp.main(argv, device_memory=small_device)["global_step"] == 1
        assert "training anyway (--skip_memory_check)" in capsys.readouterr().out
