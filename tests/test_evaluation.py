"""Held-out evaluation (run_pretraining.py --eval_dir, training/evaluation.py): its figures against an independent
float64 computation on held-out shards of the committed sample; the same figures at any world size, ZeRO stage
and accumulation, and after a resume; training unchanged by it; bad held-out input refused before the first step."""

import copy
import json
import re
import threading
import time

import h5py
import numpy as np
import pytest
import torch

import helpers
import run_pretraining as rp
from common.errors import NO_RESTART_MARK
from data.dataset import LocalShardFiles, WindowReader, fixed_chunks, scan_shards
from modeling import BertConfig, BertForPreTraining
from training import checkpoint_export, evaluation
from training.run_status import ExitStatus

HELD_OUT = 40   # samples of the held-out list (pipeline_held_out holds more)
CHUNK = 16      # --eval_batch_size: 3 chunks, the last one shorter


def independent_figures(model, held_out_dir, count) -> dict:
    """The figures in float64 from the first `count` samples of the shards (h5py, name order), one dense forward
    over all of them: mean masked-LM cross-entropy over the masked tokens, accuracy of the argmax there, the same
    for the next-sentence head."""
    arrays = {}
    for path in sorted(held_out_dir.glob("*.hdf5")):
        with h5py.File(path, "r") as f:
            for key in f:
                arrays.setdefault(key, []).append(f[key][...])
    arrays = {key: np.concatenate(parts)[:count].astype(np.int64) for key, parts in arrays.items()}
    ids = torch.from_numpy(arrays["input_ids"])
    with torch.no_grad():
        scores, nsp_scores = model.eval()(ids, torch.from_numpy(arrays["segment_ids"]),
                                          torch.from_numpy(arrays["input_mask"]))
    log_probs, nsp_log_probs = scores.double().log_softmax(-1), nsp_scores.double().log_softmax(-1)
    losses, correct = [], 0
    for row, (positions, targets) in enumerate(zip(arrays["masked_lm_positions"], arrays["masked_lm_ids"])):
        for position, target in zip(positions, targets):
            if position == 0:  # padding of the masked positions
                break
            losses.append(-float(log_probs[row, position, target]))
            correct += int(log_probs[row, position].argmax()) == target
    nsp = torch.from_numpy(arrays["next_sentence_labels"])
    nsp_losses = -nsp_log_probs.gather(1, nsp[:, None]).squeeze(1)
    return {"eval_mlm_loss": float(np.mean(losses)), "eval_mlm_accuracy": correct / len(losses),
            "eval_nsp_loss": float(nsp_losses.mean()),
            "eval_nsp_accuracy": float((nsp_log_probs.argmax(-1) == nsp).double().mean())}


def eval_records(log) -> dict:
    """{global step: eval record data} of a dllogger stream."""
    return {r["step"][1]: r["data"] for r in helpers.read_dllogger(log)
            if r.get("type") == "LOG" and len(r.get("step", [])) == 2 and "eval_mlm_loss" in r["data"]}


def figures_of(data: dict) -> dict:
    return {key: data[key] for key in evaluation.EVAL_KEYS}


def test_held_out_figures_of_a_run_equal_an_independent_computation(tmp_path, pipeline_shards, pipeline_held_out,
                                                                    monkeypatch):
    """CI's held-out evaluation on the committed sample: a 2-step fp32 run evaluating every step. Its records at
    both steps, the final record and the DeepSpeed monitor (CSV) hold the figures, and those of step 2 equal a
    float64 computation on the saved checkpoint's weights. The run's clock jumps 1000 s in each evaluation: the
    step times and the training time leave that out, eval_time and total_eval_time hold it."""
    jumps = []
    real_evaluate = evaluation.evaluate

    def evaluate_for_1000_s(*args, **kwargs):
        jumps.append(1000.0)
        return real_evaluate(*args, **kwargs)
    monkeypatch.setattr(evaluation, "evaluate", evaluate_for_1000_s)
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=False, micro=8, csv_monitor={
        "enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "tiny"})
    summary = rp.main(helpers.driver_argv(pipeline_shards, tmp_path / "out", ds_config, max_steps=2, log_freq=1,
                                          num_steps_per_checkpoint=2, eval_dir=pipeline_held_out, eval_interval=1,
                                          num_eval_examples=HELD_OUT, eval_batch_size=CHUNK),
                      clock=lambda: time.perf_counter() + sum(jumps))
    records = eval_records(tmp_path / "dllogger.json")
    assert sorted(records) == [1, 2]  # no second evaluation at the end: step 2 was evaluated
    assert records[1] != records[2]
    assert all(1000 <= record["eval_time"] < 1100 for record in records.values())
    assert 2000 <= summary["total_eval_time"] < 2200 and summary["raw_train_time"] < 1000
    assert all(r["data"]["average_training_time_step"] < 1000 for r in helpers.step_records(tmp_path / "dllogger.json"))
    assert figures_of(summary) == figures_of(records[2])
    rows = {key: [line.split(",") for line in next((tmp_path / "csv").rglob(f"*{key}*")).read_text().splitlines()[1:]]
            for key in evaluation.EVAL_KEYS}
    for key, key_rows in rows.items():
        assert [int(step) for step, _ in key_rows] == [1, 2], key
        assert [float(value) for _, value in key_rows] == pytest.approx([records[1][key], records[2][key]]), key

    model = BertForPreTraining(BertConfig.from_json_file(helpers.TINY_MODEL_CONFIG))
    model.load_state_dict(checkpoint_export.consolidated_state_dict(tmp_path / "out", "2"))
    expected = independent_figures(model, pipeline_held_out, HELD_OUT)
    for key, value in expected.items():
        assert records[2][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert records[2]["eval_loss"] == pytest.approx(expected["eval_mlm_loss"] + expected["eval_nsp_loss"], rel=1e-5)


def evaluate_on_ranks(model, held_out_dir, world_size) -> list:
    """training.evaluation.evaluate on `world_size` ranks played by threads (each with its own copy of the model
    and its own chunks, data.dataset.fixed_chunks), exchanging their sums as all_gather_object does; returns
    every rank's figures, after checking that every copy is back in train mode."""
    shards, _, _ = scan_shards(held_out_dir, held_out=True)
    barrier, slots, results = threading.Barrier(world_size), [None] * world_size, [None] * world_size
    models = [copy.deepcopy(model) for _ in range(world_size)]

    def rank(r):
        reader = WindowReader(shards, 0, 64, 30522, shuffle=False, shard_files=LocalShardFiles(held_out_dir))
        held_out = evaluation.HeldOutSet(chunks=fixed_chunks(reader, HELD_OUT, CHUNK, r, world_size),
                                         num_chunks=-(-HELD_OUT // CHUNK), num_samples=HELD_OUT)

        def all_gather_object(output, own):
            slots[r] = own
            barrier.wait()
            output[:] = slots
            barrier.wait()
        results[r] = evaluation.evaluate(models[r], held_out, torch.device("cpu"), all_gather_object, world_size)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(m.training for m in models)
    return results


def test_the_figures_do_not_depend_on_the_number_of_ranks(pipeline_held_out):
    """1 to 4 ranks (3 chunks: a rank without a chunk at 4) give bitwise the same figures on every rank, and
    the model is back in train mode afterwards."""
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_json_file(helpers.TINY_MODEL_CONFIG)).train()
    one_rank = evaluate_on_ranks(model, pipeline_held_out, 1)[0]
    assert one_rank["eval_mlm_loss"] > 5 and 0 < one_rank["eval_nsp_accuracy"] < 1  # an untrained model
    for world_size in (2, 3, 4):
        assert evaluate_on_ranks(model, pipeline_held_out, world_size) == [one_rank] * world_size, world_size


# ============================================================================ bad held-out input

def other_seq_len(held_out_dir, tmp_path):
    helpers.write_synthetic_shards(held_out_dir, [12], seq_len=64, name="held_out_test_{i}.hdf5")


def id_beyond_vocab(held_out_dir, tmp_path):
    helpers.write_synthetic_shards(held_out_dir, [12], vocab_size=40000, name="held_out_test_{i}.hdf5")
    with h5py.File(held_out_dir / "held_out_test_0.hdf5", "a") as f:
        ids = f["input_ids"][...]
        ids[7, 3] = 35000
        f["input_ids"][...] = ids


def with_training_shards(held_out_dir, tmp_path):
    helpers.write_synthetic_shards(held_out_dir, [12], name="held_out_test_{i}.hdf5", seed=1)
    helpers.write_synthetic_shards(held_out_dir, [20], name="held_out_training_{i}.hdf5", seed=2)


BAD_HELD_OUT = {
    "missing_eval_dir": (None, {"eval_dir": "/nonexistent/held_out"},
                         r"^error: --eval_dir /nonexistent/held_out does not exist or is not a directory$"),
    "empty_eval_dir": ("empty", {}, r"^error: .*held_out: no held-out shards \(\.hdf5 or \.h5 files whose name "
                       r"contains 'test' and not 'training'\)$"),
    "other_sequence_length": (other_seq_len, {}, r"^error: --eval_dir .*held_out holds sequences of 64 tokens, the "
                              r"training shards of --input_dir .* of 32: held-out shards must be made like"),
    "token_beyond_the_models_vocabulary": (id_beyond_vocab, {}, r"^error: --eval_dir: .*held_out_test_0\.hdf5: "
                                           r"sample 7: token id 35000 outside \[0, 30522\) \[no restart\]$"),
    # the training shards beside the held-out one do not count
    "fewer_samples_than_asked": (with_training_shards, {"num_eval_examples": 13}, r"^error: --eval_dir .*held_out "
                                 r"holds 12 samples, fewer than --num_eval_examples 13 \[no restart\]$"),
    "zero_interval": (None, {"eval_interval": 0}, r"^error: --eval_interval must be at least 1, got 0"),
    "skip_train_without_eval_dir": (None, {"eval_dir": None, "skip_train": True},
                                    r"^error: --skip_train needs --eval_dir"),
    "s3_eval_dir": (None, {"eval_dir": "s3://bucket/held_out"}, r"^error: --eval_dir s3://bucket/held_out: held-out "
                    "shards are read from a local directory only"),
}


# Met by every rank alike (common.errors.InputErrorOnEveryRank): the ranks leave together.
EVERY_RANK_ERRORS = {"token_beyond_the_models_vocabulary"}


@pytest.mark.parametrize("case", sorted(BAD_HELD_OUT))
def test_bad_held_out_input_gives_one_error_line_before_the_first_step(tmp_path, capsys, case):
    prepare, flags, message = BAD_HELD_OUT[case]
    helpers.write_synthetic_shards(tmp_path / "shards", [12, 8])
    held_out_dir = tmp_path / "held_out"
    held_out_dir.mkdir()
    if prepare is None:
        helpers.write_synthetic_shards(held_out_dir, [12], name="held_out_test_{i}.hdf5", seed=1)
    elif callable(prepare):
        prepare(held_out_dir, tmp_path)
    argv = helpers.driver_argv(tmp_path / "shards", tmp_path / "out", helpers.write_ds_config(tmp_path / "ds.json"),
                               **{"eval_dir": held_out_dir, "num_eval_examples": 12, **flags})
    if case in EVERY_RANK_ERRORS:  # run_cli ends the process group after it: not in the suite's process
        result = helpers.run_single_process(argv)
        status, stderr = result.returncode, result.stderr
    else:
        status, stderr = rp.cli(argv), capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(message, errors[0]), errors
    assert status == (ExitStatus.NO_RESTART if errors[0].endswith(NO_RESTART_MARK) else ExitStatus.FAILED)
    assert not (tmp_path / "dllogger.json").exists() or not helpers.step_records(tmp_path / "dllogger.json")


# ============================================================================ training undisturbed, resume, ranks

@pytest.mark.slow
def test_evaluation_leaves_training_and_its_resume_bitwise_unchanged(tmp_path, tiny_shards):
    """The tiny config trains with dropout (0.1), in bf16 with ZeRO-1. A run evaluating every step has the losses
    of a run without evaluation, bitwise; so has its resume from step 2, whose held-out figures at steps 3 and 4
    are those of the uninterrupted run. The held-out shard is the 5-sample *_test shard beside the training
    shards: --eval_dir is --input_dir."""
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=1, bf16=True)
    evaluating = {"eval_dir": tiny_shards, "eval_interval": 1, "num_eval_examples": 5, "eval_batch_size": 2}

    def run(name, **flags):
        log = tmp_path / f"{name}.json"
        rp.main(helpers.driver_argv(tiny_shards, tmp_path / flags.pop("out", name), ds_config, json_summary=log,
                                    max_steps=4, log_freq=1, **flags))
        return {r["step"][1]: r["data"]["step_loss"] for r in helpers.step_records(log)}, eval_records(log)

    without, none = run("without")
    with_eval, figures = run("with", num_steps_per_checkpoint=2, **evaluating)
    resumed, resumed_figures = run("resumed", out="with", resume_from_checkpoint=True, resume_step=2, **evaluating)
    assert none == {} and sorted(figures) == [1, 2, 3, 4]
    assert with_eval == without
    assert resumed == {3: without[3], 4: without[4]}
    assert resumed_figures == {step: {**figures[step], "eval_time": resumed_figures[step]["eval_time"]}
                               for step in (3, 4)}


@pytest.mark.slow
def test_a_checkpoint_gives_the_same_figures_at_any_world_size_stage_and_accumulation(tmp_path, tiny_shards):
    """A 1-rank fp32 ZeRO-1 run with 2 accumulation steps evaluates at its step 2 and saves it (fp32: the saved
    module weights are the trained ones exactly). --skip_train on that checkpoint gives the same figures, bitwise:
    from --init_checkpoint on 1 rank without ZeRO and on 3 ranks with ZeRO-2 (the deepspeed launcher), and
    resumed on 2 ranks with ZeRO-1."""
    held_out_dir = tmp_path / "held_out"
    helpers.write_synthetic_shards(held_out_dir, [9, 7], name="held_out_test_{i}.hdf5", seed=5)
    evaluating = {"eval_dir": held_out_dir, "num_eval_examples": 16, "eval_batch_size": 3}

    def figures_of_run(name, ranks, stage, gas, **flags):
        ds_config = helpers.write_ds_config(tmp_path / f"{name}.json", stage=stage, bf16=False, micro=2, gas=gas,
                                            world=ranks)
        argv = helpers.driver_argv(tiny_shards, flags.pop("out", tmp_path / name), ds_config, max_steps=2,
                                   json_summary=tmp_path / f"{name}.log", **evaluating, **flags)
        if ranks == 1:
            rp.main(argv)
        else:
            result = helpers.launch(argv, num_ranks=ranks, timeout=600)
            assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
        return [r["data"] for r in helpers.read_dllogger(tmp_path / f"{name}.log")
                if r.get("type") == "LOG" and "eval_mlm_loss" in r.get("data", {})]

    at_step_2, summary = figures_of_run("trained", 1, 1, 2, eval_interval=2, num_steps_per_checkpoint=2)
    reference = figures_of(at_step_2)
    assert figures_of(summary) == reference
    checkpoint = tmp_path / "trained" / "2"
    (one_rank,) = figures_of_run("one_rank", 1, 0, 1, skip_train=True, init_checkpoint=checkpoint)
    (three_ranks,) = figures_of_run("three_ranks", 3, 2, 1, skip_train=True, init_checkpoint=checkpoint)
    (resumed,) = figures_of_run("resumed", 2, 1, 2, skip_train=True, out=tmp_path / "trained",
                                resume_from_checkpoint=True)
    assert one_rank["global_step"] == 0 and resumed["global_step"] == 2
    for name, got in (("one rank", one_rank), ("three ranks", three_ranks), ("resumed", resumed)):
        assert figures_of(got) == reference, (name, json.dumps(figures_of(got)), json.dumps(reference))
