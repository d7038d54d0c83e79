"""run_glue.py end to end with the real DeepSpeed: one-line errors, the learning check from the pretrained
tiny checkpoint (and its negative control), SIGTERM -> checkpoint -> exact resume, 2 ranks through the real
`deepspeed` launcher equal to 1 rank, and the weight sources of finetune/finetuning.py."""

import gc
import json
import signal
import weakref

import pytest
import torch

import helpers
import run_glue
from common.errors import NO_RESTART_MARK, InputError
from finetune import flags, hf_interop
from finetune_helpers import (
    REPO_ROOT,
    TINY_CONFIG,
    assert_same_training,
    dropout_free_config,
    run_on_one_and_two_ranks,
    write_sst2_rule_task,
)
from modeling import BertConfig
from training import checkpoint_export, checkpointing, deepspeed_engine, run_status
from training.run_status import ExitStatus

VOCAB = REPO_ROOT / "data" / "vocab.txt"


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


def glue_argv(data_dir, output_dir, **flags):
    options = {"task_name": "sst-2", "data_dir": data_dir, "vocab_file": VOCAB, "do_lower_case": True,
               "output_dir": output_dir, "do_train": True, "do_eval": True, "max_seq_length": 48,
               "train_batch_size": 16, "learning_rate": 5e-4, "eval_batch_size": 64, "no_cuda": True,
               "disable-progress-bar": True, "log_freq": 5}
    options.update(flags)
    return helpers.flags_to_argv(options)


def one_error_line(capsys) -> str:
    """The one line on stderr, without the NO_RESTART_MARK that ends it (bad input is final)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(NO_RESTART_MARK), lines
    return lines[0].removesuffix(NO_RESTART_MARK)


# ============================================================================ bad input: one line, exit 2 (NO_RESTART)

def test_a_vocab_of_another_size_is_one_error(tmp_path, capsys):
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    short_vocab = tmp_path / "vocab.txt"
    short_vocab.write_text("\n".join(VOCAB.read_text().splitlines()[:2000]) + "\n")
    argv = glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, vocab_file=short_vocab)
    assert run_glue.cli(argv) == ExitStatus.NO_RESTART
    assert one_error_line(capsys) == (f"error: --vocab_file {short_vocab} has 2000 tokens, but the model has "
                                      "vocab_size 30522: use the pretrained model's vocab")


def test_a_malformed_tsv_is_one_error_naming_file_and_line(tmp_path, capsys):
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    lines = (data / "dev.tsv").read_text().splitlines()
    lines[5] = lines[5].split("\t")[0]  # the label column is gone
    (data / "dev.tsv").write_text("\n".join(lines) + "\n")
    assert run_glue.cli(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG)) == ExitStatus.NO_RESTART
    assert one_error_line(capsys) == f"error: {data / 'dev.tsv'}:6: 1 tab-separated column(s), sst-2 needs at least 2"


def test_a_label_outside_the_set_is_one_error(tmp_path, capsys):
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    (data / "train.tsv").write_text((data / "train.tsv").read_text().replace("\t1\n", "\tpositive\n", 1))
    assert run_glue.cli(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG)) == ExitStatus.NO_RESTART
    assert "label 'positive' is not one of sst-2's labels 0, 1" in one_error_line(capsys)


def test_a_checkpoint_for_another_model_config_is_one_error(tmp_path, capsys):
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    other = BertConfig.from_dict(dict(json.loads(TINY_CONFIG.read_text()), hidden_size=64))
    from modeling import BertForPreTraining, BertForSequenceClassification
    torch.save(BertForPreTraining(other).state_dict(), tmp_path / "other.pt")
    assert run_glue.cli(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG,
                                  init_checkpoint=tmp_path / "other.pt")) == ExitStatus.NO_RESTART
    # The encoder's tensors of another shape, counted here over the two state dicts; the first in the model's order.
    own = BertForSequenceClassification(BertConfig.from_json_file(TINY_CONFIG), 2).state_dict()
    saved = BertForPreTraining(other).state_dict()
    reshaped = sum(saved[key].shape != own[key].shape for key in own if key.startswith("bert.") and key in saved)
    assert one_error_line(capsys) == (
        "error: --init_checkpoint does not fit the model config (hidden 128, 2 layers): the checkpoint has hidden "
        f"64, 2 layers, 30528 vocabulary rows; {reshaped} tensors of another shape (first "
        "bert.embeddings.word_embeddings.weight: [30528, 64] in the checkpoint, [30528, 128] in the model)")
    assert not (tmp_path / "out").exists()  # refused before the output directory and dllogger.json are made
    hf_interop.export_directory(BertForPreTraining(other).state_dict(), other, VOCAB, True, tmp_path / "hf")
    assert run_glue.cli(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG,
                                  init_checkpoint=tmp_path / "hf")) == ExitStatus.NO_RESTART
    assert one_error_line(capsys).endswith("is for another model config: hidden_size 64 there, 128 in --config_file")


def test_a_checkpoint_whose_head_has_another_number_of_labels_is_one_error_naming_it(tmp_path, capsys):
    """A 3-label (MNLI-style) classifier's weights for the 2-label SST-2, to train or to evaluate: the line
    names the head's tensor and both shapes (it said the encoder's config did not fit, and then nothing)."""
    from modeling import BertForSequenceClassification
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    config = BertConfig.from_json_file(TINY_CONFIG)
    torch.save(BertForSequenceClassification(config, 3).state_dict(), tmp_path / "three_labels.pt")
    hidden = config.hidden_size
    for do_train in (True, False):
        assert run_glue.cli(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, do_train=do_train,
                                      init_checkpoint=tmp_path / "three_labels.pt")) == ExitStatus.NO_RESTART
        assert one_error_line(capsys) == (
            f"error: --init_checkpoint's task head does not fit this task's: classifier.weight [3, {hidden}] in the "
            f"checkpoint, [2, {hidden}] in the model (a head for another number of labels or outputs)")
        assert not (tmp_path / "out").exists()


def test_evaluation_of_a_checkpoint_without_the_head_is_refused_before_any_output(tmp_path, capsys):
    """--do_eval alone on pretrained weights (no classifier): one error line naming the head's keys (those the
    classification model has and the pretraining model has not), and neither the output directory nor the
    dllogger file elsewhere (--json-summary) is made."""
    from modeling import BertForPreTraining, BertForSequenceClassification
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    config = BertConfig.from_json_file(TINY_CONFIG)
    torch.save(BertForPreTraining(config).state_dict(), tmp_path / "pretrained.pt")
    head = sorted(BertForSequenceClassification(config, 2).state_dict().keys()
                  - BertForPreTraining(config).state_dict().keys())
    argv = glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, init_checkpoint=tmp_path / "pretrained.pt",
                     do_train=False, **{"json-summary": tmp_path / "logs" / "dllogger.json"})
    assert run_glue.cli(argv) == ExitStatus.NO_RESTART
    assert one_error_line(capsys).startswith(f"error: --init_checkpoint has no task head ({', '.join(head)}): "
                                             "evaluation without --do_train needs fine-tuned weights")
    assert not (tmp_path / "out").exists() and not (tmp_path / "logs").exists()


def test_a_training_set_smaller_than_one_global_batch_is_refused_before_any_output(tmp_path, capsys):
    """40 training examples; --train_batch_size 64 with 2 accumulation steps on one rank: micro-batches of 32,
    a global batch of 64 (NVIDIA's meaning, worked out here by hand). Refused before anything is written."""
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    argv = glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, train_batch_size=64,
                     gradient_accumulation_steps=2)
    assert run_glue.cli(argv) == ExitStatus.NO_RESTART
    assert one_error_line(capsys) == ("error: 40 training examples, fewer than one global batch of 64 (micro-batch 32 "
                                      "x 2 accumulation steps x 1 ranks): lower --train_batch_size")
    assert not (tmp_path / "out").exists()


# ============================================================================ --train_batch_size, as NVIDIA's

def batch_settings(train_batch_size, accumulation, world_size=1, deepspeed_config=None):
    config = flags.deepspeed_settings(deepspeed_config, train_batch_size, accumulation, world_size)
    return config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"], config["train_batch_size"]


def test_train_batch_size_is_a_process_batch_per_optimizer_step(tmp_path):
    """NVIDIA's run_glue.py and run_squad.py divide --train_batch_size by --gradient_accumulation_steps for
    the micro-batch of each process: (micro, accumulation, global batch) for 1 and 2 processes."""
    assert batch_settings(32, None) == (32, 1, 32)
    assert batch_settings(32, 4) == (8, 4, 32)
    assert batch_settings(32, 4, world_size=2) == (8, 4, 64)
    assert batch_settings(None, 4) == (8, 4, 32)  # NVIDIA's default, 32
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4}))
    assert batch_settings(None, None, deepspeed_config=ds) == (8, 4, 32)
    assert batch_settings(32, None, deepspeed_config=ds) == (8, 4, 32)
    with pytest.raises(InputError, match=r"--train_batch_size 16 = micro-batch 4 x 4 accumulation steps "
                                         r"contradicts train_micro_batch_size_per_gpu 8 in .*ds.json"):
        batch_settings(16, None, deepspeed_config=ds)
    with pytest.raises(InputError, match=r"--train_batch_size 30 .* not a multiple of gradient_accumulation_steps 4"):
        batch_settings(30, 4)


# The batch keys of scripts/deepspeed_config_bert_tiny_cpu.json
RECIPE_JSON = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 32}


@pytest.mark.parametrize("json_batch, train_batch_size, accumulation, world_size, expected", [
    # (micro, accumulation, global batch), worked out by hand: global = micro x accumulation x processes
    (RECIPE_JSON, None, None, 1, (32, 2, 64)),  # DeepSpeed's reading: 64 / (32 x 1)
    (RECIPE_JSON, None, None, 2, (32, 1, 64)),
    (RECIPE_JSON, None, 2, 1, (32, 2, 64)),
    (RECIPE_JSON, 64, None, 1, (32, 2, 64)),  # 64 per process = 32 x 2
    (RECIPE_JSON, 32, None, 2, (32, 1, 64)),
    ({"train_batch_size": 256}, 64, None, 4, (64, 1, 256)),
    ({"train_batch_size": 256}, None, 4, 2, (32, 4, 256)),  # 256 / (4 x 2) sequences per micro-step
    ({"train_micro_batch_size_per_gpu": 8}, 32, None, 1, (8, 4, 32)),
    ({"bf16": {"enabled": True}}, 32, None, 2, (32, 1, 64)),  # the batch keys left out: the flags decide
])
def test_consistent_flags_and_json_give_the_batch_they_name(tmp_path, json_batch, train_batch_size, accumulation,
                                                             world_size, expected):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(json_batch))
    assert batch_settings(train_batch_size, accumulation, world_size, deepspeed_config=ds) == expected


@pytest.mark.parametrize("json_batch, train_batch_size, accumulation, world_size, message", [
    # The reviewer's cases, once silently trained at another batch: each names the JSON's value and the flags'.
    (RECIPE_JSON, None, 4, 1, "train_batch_size 64 in {ds} contradicts micro-batch 32 (train_micro_batch_size_per_gpu "
     "in {ds}) x 4 accumulation step(s) (--gradient_accumulation_steps) x 1 process(es) = 128 sequences per "
     "optimizer step: make them agree, or leave train_batch_size out of {ds}"),
    (RECIPE_JSON, None, 1, 1, "train_batch_size 64 in {ds} contradicts micro-batch 32 (train_micro_batch_size_per_gpu "
     "in {ds}) x 1 accumulation step(s) (--gradient_accumulation_steps) x 1 process(es) = 32 sequences per "
     "optimizer step: make them agree, or leave train_batch_size out of {ds}"),
    ({"train_batch_size": 256}, 64, None, 1, "train_batch_size 256 in {ds} contradicts --train_batch_size 64 x 1 "
     "process(es) = 64 sequences per optimizer step: make them agree, or leave train_batch_size out of {ds}"),
    ({"train_batch_size": 256}, 64, None, 2, "train_batch_size 256 in {ds} contradicts --train_batch_size 64 x 2 "
     "process(es) = 128 sequences per optimizer step: make them agree, or leave train_batch_size out of {ds}"),
    (RECIPE_JSON, 32, None, 1, "train_batch_size 64 in {ds} contradicts --train_batch_size 32 x 1 process(es) = 32 "
     "sequences per optimizer step: make them agree, or leave train_batch_size out of {ds}"),
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1}, None, None, 1,
     "train_batch_size 16 in {ds} contradicts micro-batch 8 (train_micro_batch_size_per_gpu in {ds}) x 1 "
     "accumulation step(s) (gradient_accumulation_steps in {ds}) x 1 process(es) = 8 sequences per optimizer "
     "step: make them agree, or leave train_batch_size out of {ds}"),
    ({"train_micro_batch_size_per_gpu": 8}, 30, None, 1, "--train_batch_size 30 (sequences per process and "
     "optimizer step) is not a multiple of train_micro_batch_size_per_gpu 8 in {ds}"),
    ({"train_batch_size": "64"}, 32, None, 1, "train_batch_size in {ds} must be a positive integer, got '64'"),
])
def test_a_json_batch_that_disagrees_with_the_flags_is_one_error(tmp_path, json_batch, train_batch_size,
                                                                 accumulation, world_size, message):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(json_batch))
    with pytest.raises(InputError) as raised:
        batch_settings(train_batch_size, accumulation, world_size, deepspeed_config=ds)
    assert str(raised.value) == message.format(ds=ds)


def test_a_contradicting_json_batch_stops_the_cli_before_training(tmp_path, capsys):
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(RECIPE_JSON))
    argv = glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, train_batch_size=None,
                     gradient_accumulation_steps=4, deepspeed=True, deepspeed_config=ds)
    assert run_glue.cli(argv) == ExitStatus.NO_RESTART
    assert one_error_line(capsys) == (
        f"error: train_batch_size 64 in {ds} contradicts micro-batch 32 (train_micro_batch_size_per_gpu in {ds}) x 4 "
        f"accumulation step(s) (--gradient_accumulation_steps) x 1 process(es) = 128 sequences per optimizer step: "
        f"make them agree, or leave train_batch_size out of {ds}")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_run_takes_train_batch_size_sequences_per_step_with_accumulation(tmp_path):
    """40 examples, one epoch, --train_batch_size 8 with 2 accumulation steps: 5 optimizer steps of 8 (a
    micro-batch of 8 would make 2 steps of 16)."""
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    summary = run_glue.main(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, do_eval=False,
                                      train_batch_size=8, gradient_accumulation_steps=2, num_train_epochs=1,
                                      skip_checkpoint=True))
    assert summary["global_step"] == 5, summary


def test_the_engine_is_freed_when_main_returns(tmp_path, monkeypatch):
    """bf16 + ZeRO-1: DeepSpeed's gradient hooks keep the engine (and with it the model and the optimizer states)
    alive until engine.destroy(); without it each in-process run kept them (59 MiB per tiny run, measured with
    gc). Checked independently of the code under test: a weak reference to the engine is dead after a garbage
    collection."""
    engines, initialize_engine = [], deepspeed_engine.initialize_engine

    def initialize_engine_recorded(*args, **kwargs):
        engine, optimizer = initialize_engine(*args, **kwargs)
        engines.append(weakref.ref(engine))
        return engine, optimizer

    monkeypatch.setattr(deepspeed_engine, "initialize_engine", initialize_engine_recorded)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                              "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}))
    data = write_sst2_rule_task(tmp_path / "data", 40, 10)
    run_glue.main(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, max_steps=2, skip_checkpoint=True,
                            train_batch_size=None, deepspeed=True, deepspeed_config=ds))
    gc.collect()
    assert engines and all(engine() is None for engine in engines), "the engine outlives main"


# ============================================================================ learning check

def fine_tune(tmp_path, checkpoint, shuffle_train_labels=False):
    data = write_sst2_rule_task(tmp_path / "data", 2200, 400, shuffle_train_labels=shuffle_train_labels)
    summary = run_glue.main(glue_argv(data, tmp_path / "out", init_checkpoint=checkpoint, num_train_epochs=3,
                                      train_batch_size=32, skip_checkpoint=True))
    return summary, json.loads((tmp_path / "out" / "eval_results.json").read_text())["sst-2"]["acc"]


@pytest.mark.slow
@pytest.mark.usefixtures("every_cpu_thread")
def test_fine_tuning_the_pretrained_checkpoint_learns_the_rule(tmp_path, pretrained_tiny_checkpoint):
    """Label 1 when a real sentence has the word "her": the classifier, its loss, the pretrained weights
    (ZeRO-1 checkpoint, consolidated) and the evaluation are wired right only if dev accuracy is high."""
    summary, accuracy = fine_tune(tmp_path, pretrained_tiny_checkpoint)
    assert accuracy >= 0.95, summary
    assert {"e2e_train_time", "training_sequences_per_second", "final_loss", "acc", "e2e_inference_time",
            "inference_sequences_per_second"} <= summary.keys()
    predictions = json.loads((tmp_path / "out" / "predictions_sst-2.json").read_text())
    assert len(predictions) == 400 and set(predictions.values()) == {"0", "1"}
    final = [r for r in helpers.read_dllogger(tmp_path / "out" / "dllogger.json") if r["step"] == []][-1]["data"]
    assert final["acc"] == accuracy


@pytest.mark.slow
@pytest.mark.usefixtures("every_cpu_thread")
def test_with_shuffled_labels_the_same_run_stays_at_chance(tmp_path, pretrained_tiny_checkpoint):
    """Negative control: the same sentences with their training labels permuted teach nothing."""
    _, accuracy = fine_tune(tmp_path, pretrained_tiny_checkpoint, shuffle_train_labels=True)
    assert 0.35 <= accuracy <= 0.65


# ============================================================================ stop and resume

def test_sigterm_saves_a_checkpoint_and_the_resumed_run_equals_an_uninterrupted_one(tmp_path, capsys):
    """Stopped by SIGTERM in step 3 (exit status 3, STOPPED, after saving checkpoint 3), then resumed: the same
    final weights as the uninterrupted run, and its dllogger file holds the same step records (the resumed run
    adds to it)."""
    data = write_sst2_rule_task(tmp_path / "data", 96, 32)
    common = dict(config_file=TINY_CONFIG, max_steps=6, do_eval=False, max_seq_length=32, log_freq=1)
    run_glue.main(glue_argv(data, tmp_path / "straight", **common))

    def loss_function_with_sigterm(task):
        loss, calls = run_glue.loss_function(task), []

        def loss_then_sigterm(model, batch):
            calls.append(1)
            if len(calls) == 3:  # during step 3: the run finishes the step, saves and stops
                signal.raise_signal(signal.SIGTERM)
            return loss(model, batch)
        return loss_then_sigterm

    # main, not cli(): cli's exit-time destroy_process_group would spoil later in-process runs. cli's status is
    # exit_status_of(main's summary) (training/command_line.run_cli).
    stopped = run_glue.main(glue_argv(data, tmp_path / "resumed", **common), make_loss=loss_function_with_sigterm)
    assert stopped["stopped_by_signal"] and stopped["global_step"] == 3
    assert run_status.exit_status_of(stopped) == ExitStatus.STOPPED
    assert checkpointing.find_resume_tag(tmp_path / "resumed" / "checkpoints") == "3"
    capsys.readouterr()
    resumed = run_glue.main(glue_argv(data, tmp_path / "resumed", resume_from_checkpoint=True, **common))
    assert resumed["global_step"] == 6 and not resumed["stopped_by_signal"]
    # It continued from step 3: a run started again from step 0 would end with the same weights too.
    assert "6 steps, resumed at step 3" in capsys.readouterr().out
    straight = checkpoint_export.consolidated_state_dict(tmp_path / "straight" / "checkpoints")
    after_resume = checkpoint_export.consolidated_state_dict(tmp_path / "resumed" / "checkpoints")
    for key, value in straight.items():
        torch.testing.assert_close(after_resume[key], value, rtol=0, atol=0, msg=key)
    straight_steps, resumed_steps = (helpers.step_records(tmp_path / name / "dllogger.json")
                                     for name in ("straight", "resumed"))
    assert [r["step"][1] for r in straight_steps] == [1, 2, 3, 4, 5, 6]
    assert [(r["step"], r["data"]) for r in resumed_steps] == [(r["step"], r["data"]) for r in straight_steps]


def test_a_resume_with_another_training_setup_is_one_error_line(tmp_path, capsys):
    """A checkpoint of 3 steps; a resume that would take other samples from there (another seed, batch or
    training file) is refused, naming the value then and now and the flag; the same flags resume (and find
    nothing left to train). A checkpoint saved without the setup (before it was saved) still resumes."""
    data = write_sst2_rule_task(tmp_path / "data", 96, 32)
    other_data = write_sst2_rule_task(tmp_path / "other_data", 96, 32)
    lines = (other_data / "train.tsv").read_text().splitlines()
    lines[1] = lines[1].rsplit("\t", 1)[0] + ("\t0" if lines[1].endswith("\t1") else "\t1")  # one label flipped
    (other_data / "train.tsv").write_text("\n".join(lines) + "\n")
    common = dict(config_file=TINY_CONFIG, max_steps=3, do_eval=False, max_seq_length=32)
    run_glue.main(glue_argv(data, tmp_path / "out", **common))
    capsys.readouterr()
    refusals = [({"seed": 7}, "seed 42 then, 7 now (set by --seed)"),
                ({"train_batch_size": 8}, "micro_batch 16 then, 8 now (set by --train_batch_size"),
                ({"data_dir": other_data}, "data_sha256 '")]
    for changed, expected in refusals:
        flags = {**common, **changed}
        argv = glue_argv(flags.pop("data_dir", data), tmp_path / "out", resume_from_checkpoint=True, **flags)
        assert run_glue.cli(argv) == ExitStatus.NO_RESTART, changed
        line = one_error_line(capsys)
        assert line.startswith(f"error: checkpoint 3 in {tmp_path / 'out' / 'checkpoints'} was saved with another "
                               "training setup: ") and expected in line, (changed, line)
    assert run_glue.main(glue_argv(data, tmp_path / "out", resume_from_checkpoint=True, **common))["global_step"] == 3
    # An older checkpoint: the setup's key left out of the manifest, which lists the keys a resume reads.
    manifest_path = tmp_path / "out" / "checkpoints" / "3" / checkpointing.MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["client_state_keys"].remove("training_setup")
    manifest_path.write_text(json.dumps(manifest))
    argv = glue_argv(data, tmp_path / "out", resume_from_checkpoint=True, **{**common, "seed": 7})
    assert run_glue.main(argv)["global_step"] == 3


@pytest.mark.parametrize("changed,said", [
    ({"max_steps": 6}, "the steps of --max_steps/--num_train_epochs 3 -> 6"),
    ({"max_steps": 6, "learning_rate": 1e-3}, "the steps of --max_steps/--num_train_epochs 3 -> 6, "
                                              "--learning_rate 0.0005 -> 0.001")])
def test_a_resume_with_other_schedule_flags_follows_the_new_flags(tmp_path, capsys, changed, said):
    """As in pretraining (training/schedule_resume.py): a 3-step run resumed with --max_steps 6 (and another
    LR) trains steps 4-6 at the LRs of a 6-step run with the new flags from the start, and says what changed.
    The restored schedule would have ended at step 3 (LR 0 from there)."""
    data = write_sst2_rule_task(tmp_path / "data", 96, 32)
    common = dict(config_file=TINY_CONFIG, do_eval=False, max_seq_length=32, log_freq=1)
    run_glue.main(glue_argv(data, tmp_path / "whole", **common, **changed))
    run_glue.main(glue_argv(data, tmp_path / "resumed", **common, max_steps=3))
    capsys.readouterr()
    resumed = run_glue.main(glue_argv(data, tmp_path / "resumed", resume_from_checkpoint=True, **common, **changed))
    assert resumed["global_step"] == 6
    whole, split = ({r["step"][1]: r["data"]["learning_rate"]
                     for r in helpers.step_records(tmp_path / name / "dllogger.json")} for name in ("whole", "resumed"))
    assert sorted(split) == [1, 2, 3, 4, 5, 6]
    assert [split[step] for step in (4, 5, 6)] == pytest.approx([whole[step] for step in (4, 5, 6)], rel=1e-6)
    assert split[4] > 0
    assert f"the LR schedule changed since the checkpoint ({said}): from step 4 on" in capsys.readouterr().out


# ============================================================================ 2 ranks == 1 rank

@pytest.mark.slow
def test_two_ranks_with_zero1_equal_one_rank(tmp_path, pretrained_tiny_checkpoint):
    """fp32, ZeRO-1, no dropout: 2 ranks x micro 8 through the real launcher against 1 rank x micro 8 x 2
    accumulation steps (the same 16 samples per step): same losses, weights and dev predictions."""
    data = write_sst2_rule_task(tmp_path / "data", 160, 64)
    config = dropout_free_config(tmp_path / "config.json")
    results = run_on_one_and_two_ranks(
        tmp_path, "run_glue.py",
        lambda out, ds_config: glue_argv(data, out, init_checkpoint=pretrained_tiny_checkpoint, config_file=config,
                                         max_steps=8, train_batch_size=None, deepspeed=True,
                                         deepspeed_config=ds_config, log_freq=1),
        lambda out: json.loads((out / "predictions_sst-2.json").read_text()))
    assert_same_training(results, steps=8)
    assert results[2]["outputs"] == results[1]["outputs"]


# ============================================================================ weight sources

@pytest.mark.slow
def test_every_weight_source_gives_the_same_encoder(tmp_path, pretrained_tiny_checkpoint):
    """The ZeRO-1 checkpoint directory, its tag directory, `python -m training.checkpointing export`'s file
    (+ --config_file) and our pre-LN `python -m finetune.hf_interop export` directory all give the same weights."""
    from finetune.finetuning import load_pretrained

    assert checkpoint_export.export_main(["export", "--output_dir", str(pretrained_tiny_checkpoint),
                                      "--out", str(tmp_path / "model.pt")]) == 0
    assert hf_interop.main(["export", "--checkpoint", str(pretrained_tiny_checkpoint), "--vocab_file", str(VOCAB),
                            "--do_lower_case", "--output_dir", str(tmp_path / "hf")]) == 0
    sources = {"run directory": (pretrained_tiny_checkpoint, None), "tag": (pretrained_tiny_checkpoint / "40", None),
               "export file": (tmp_path / "model.pt", TINY_CONFIG), "hf_interop": (tmp_path / "hf", None)}
    loaded = {name: load_pretrained(path, config)
              for name, (path, config) in sources.items()}
    reference_config, reference = loaded.pop("run directory")
    assert reference_config == BertConfig.from_json_file(TINY_CONFIG)
    for name, (config, weights) in loaded.items():
        assert config == reference_config, name
        for key, value in reference.items():  # hf_interop exports no vocabulary padding rows
            rows = config.vocab_size if key in hf_interop.PADDED_ROWS + hf_interop.PADDED_BIAS else None
            torch.testing.assert_close(weights[key][:rows], value[:rows], rtol=0, atol=0, msg=f"{name}: {key}")


# ============================================================================ ZeRO stages, bf16, evaluation later

@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_with_each_zero_stage_trains_and_saves(tmp_path, stage):
    data = write_sst2_rule_task(tmp_path / "data", 64, 16)
    ds_config = helpers.write_ds_config(tmp_path / "ds.json", stage=stage, bf16=True, micro=8, gas=2)
    summary = run_glue.main(glue_argv(data, tmp_path / "out", config_file=TINY_CONFIG, max_steps=3, max_seq_length=32,
                                      train_batch_size=None, deepspeed=True, deepspeed_config=ds_config))
    assert summary["global_step"] == 3 and 0 < summary["final_loss"] < 5 and 0 <= summary["acc"] <= 1
    weights = checkpoint_export.consolidated_state_dict(tmp_path / "out" / "checkpoints")
    assert weights["classifier.weight"].shape == (2, 128) and weights["classifier.weight"].dtype == torch.float32


def test_a_fine_tuned_checkpoint_evaluates_and_predicts_later(tmp_path):
    """--do_eval/--do_predict without --do_train from <output_dir>/checkpoints: the classifier comes along
    (the same dev predictions as at the end of training); the test set gets GLUE's submission format."""
    data = write_sst2_rule_task(tmp_path / "data", 64, 16)
    (data / "test.tsv").write_text("index\tsentence\n" + "".join(
        f"{i}\t{line.split(chr(9))[0]}\n" for i, line in enumerate((data / "dev.tsv").read_text().splitlines()[1:])))
    run_glue.main(glue_argv(data, tmp_path / "train", config_file=TINY_CONFIG, max_steps=4, max_seq_length=32))
    run_glue.main(glue_argv(data, tmp_path / "later", init_checkpoint=tmp_path / "train" / "checkpoints",
                            do_train=False, do_predict=True, max_seq_length=32))
    at_training = json.loads((tmp_path / "train" / "predictions_sst-2.json").read_text())
    assert json.loads((tmp_path / "later" / "predictions_sst-2.json").read_text()) == at_training
    rows = (tmp_path / "later" / "test_results_sst-2.tsv").read_text().splitlines()
    assert rows[0] == "index\tprediction" and len(rows) == 17
    assert [row.split("\t")[1] for row in rows[1:]] == list(at_training.values())


def test_a_labelled_test_set_is_scored_with_its_predictions(tmp_path):
    """mr-vader's test split has labels: --do_predict writes its predictions and scores them; the accuracy is
    recomputed here from the predictions file and the labels."""
    data, mr = write_sst2_rule_task(tmp_path / "data", 64, 32), tmp_path / "mr"
    mr.mkdir()
    for name, source in (("train.tsv", "train.tsv"), ("dev.tsv", "dev.tsv"), ("test.tsv", "dev.tsv")):
        rows = (data / source).read_text().splitlines()[1:]
        (mr / name).write_text("sentence\tlabel\trating\n" + "".join(
            f"{row}\t{2.5 if row.endswith('1') else -2.5}\n" for row in rows))
    summary = run_glue.main(glue_argv(mr, tmp_path / "out", task_name="mr-vader", config_file=TINY_CONFIG,
                                      max_steps=2, max_seq_length=32, do_predict=True))
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    labels = [row.split("\t")[1] for row in (mr / "test.tsv").read_text().splitlines()[1:]]
    predicted = [row.split("\t")[1] for row in (tmp_path / "out" / "test_results_mr-vader.tsv").read_text()
                 .splitlines()[1:]]
    assert len(predicted) == len(labels) == 32
    accuracy = sum(p == label for p, label in zip(predicted, labels, strict=True)) / len(labels)
    assert results["test_mr-vader"] == {"acc": accuracy} and summary["test_mr-vader:acc"] == accuracy
    assert results["mr-vader"]["acc"] == accuracy  # the same sentences as dev


# ============================================================================ NVIDIA's flags

def test_nvidias_glue_flags_that_mean_nothing_here_are_accepted_and_fp16_is_refused(tmp_path, capsys):
    ours = ["--task_name", "mrpc", "--data_dir", "D", "--vocab_file", "V", "--output_dir", "O", "--do_train"]
    nvidia = ["--bert_model", "bert-large-uncased", "--server_ip", "", "--server_port", "", "--loss_scale", "0"]
    with_nvidia = vars(flags.parse_arguments(run_glue.build_parser(), ours + nvidia))
    without = vars(flags.parse_arguments(run_glue.build_parser(), ours))
    ignored = {"bert_model", "server_ip", "server_port", "loss_scale"}
    assert {k: v for k, v in with_nvidia.items() if k not in ignored} == \
        {k: v for k, v in without.items() if k not in ignored}
    fp16 = ours[:-3] + ["--output_dir", str(tmp_path / "out"), "--do_train", "--fp16"] + nvidia
    assert run_glue.cli(fp16) == ExitStatus.NO_RESTART
    assert one_error_line(capsys) == ("error: --fp16 (NVIDIA's apex fp16) is not supported: for mixed precision set "
                                      "\"bf16\": {\"enabled\": true} in the --deepspeed_config JSON")
