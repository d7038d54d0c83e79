"""run_squad.py: bad input is one error line and exit 2 (NO_RESTART) before any work; a short real run writes the
official output files and the dllogger keys."""
import json
import random

import pytest

import helpers
import run_squad
from common.errors import NO_RESTART_MARK
from data.squad_sample import sample_sentences, word_questions, write_squad
from finetune_helpers import REPO_ROOT, TINY_CONFIG, assert_same_training, dropout_free_config, run_on_one_and_two_ranks
from training.run_status import ExitStatus

VOCAB = REPO_ROOT / "data" / "vocab.txt"


@pytest.fixture(autouse=True)
def cpu_accelerator(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="module")
def squad_files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("squad")
    sentences = sample_sentences()
    train = write_squad(directory / "train.json", word_questions(sentences[:40], 2, seed=0))
    dev = word_questions(sentences[40:60], 1, seed=1, id_prefix="d")
    for paragraph in dev[::3]:
        for qa in paragraph["qas"]:
            qa.update(answers=[], is_impossible=True)
    return train, write_squad(directory / "dev-v2.json", dev, version="v2.0")


def squad_argv(output_dir, **flags):
    options = {"config_file": TINY_CONFIG, "vocab_file": VOCAB, "do_lower_case": True, "output_dir": output_dir,
               "max_seq_length": 64, "max_query_length": 16, "train_batch_size": 8, "max_steps": 2,
               "learning_rate": 1e-3, "no_cuda": True, "disable-progress-bar": True}
    options.update(flags)
    return helpers.flags_to_argv(options)


def one_error_line(capfd, status):
    """The one error line, without the NO_RESTART_MARK that ends it (bad input is final)."""
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == ExitStatus.NO_RESTART and len(lines) == 1 and lines[0].endswith(NO_RESTART_MARK), err
    return lines[0].removesuffix(NO_RESTART_MARK)


def test_malformed_json_is_one_line(tmp_path, capfd):
    bad = tmp_path / "train.json"
    bad.write_text('{"version": "1.1", "data": [\n  {"paragraphs": [{"context": "x", "qas": [}]}\n]}')
    status = run_squad.cli(squad_argv(tmp_path / "out", train_file=bad, do_train=True))
    line = one_error_line(capfd, status)
    assert f"{bad}: malformed JSON at line 2 column" in line
    assert not (tmp_path / "out").exists()  # nothing was started


def test_v2_file_without_the_flag_is_refused(tmp_path, capfd, squad_files):
    _, dev = squad_files
    status = run_squad.cli(squad_argv(tmp_path / "out", predict_file=dev, do_predict=True,
                                      init_checkpoint=None, do_train=True, train_file=dev))
    assert "needs --version_2_with_negative" in one_error_line(capfd, status)


def test_vocab_that_does_not_match_the_model(tmp_path, capfd, squad_files):
    small_vocab = tmp_path / "vocab.txt"
    small_vocab.write_text("".join(line + "\n" for line in VOCAB.read_text().splitlines()[:2000]))
    status = run_squad.cli(squad_argv(tmp_path / "out", vocab_file=small_vocab, train_file=squad_files[0],
                                      do_train=True))
    line = one_error_line(capfd, status)
    assert "2000 tokens" in line and "vocab_size 30522" in line


@pytest.mark.parametrize("flags, message", [
    ({"do_train": True}, "--do_train needs --train_file"),
    ({"do_train": True, "train_file": "TRAIN", "do_predict": True}, "need --predict_file"),
    ({"do_train": True, "train_file": "TRAIN", "max_seq_length": 600}, "--max_seq_length must be in"),
    ({"do_train": True, "train_file": "TRAIN", "doc_stride": 0}, "--doc_stride must be at least 1"),
    ({"do_train": True, "train_file": "missing.json"}, "SQuAD file not found: missing.json"),
])
def test_flag_errors(tmp_path, capfd, squad_files, flags, message):
    flags = {key: squad_files[0] if value == "TRAIN" else value for key, value in flags.items()}
    status = run_squad.cli(squad_argv(tmp_path / "out", **flags))
    assert message in one_error_line(capfd, status)


def test_eval_needs_answers(tmp_path, capfd, squad_files):
    unanswered = write_squad(tmp_path / "test.json",
                             [{"context": "Anne smiled.", "qas": [{"id": "1", "question": "?"}]}])
    status = run_squad.cli(squad_argv(tmp_path / "out", predict_file=unanswered, do_eval=True, do_train=True,
                                      train_file=unanswered))
    assert "has no 'answers'" in one_error_line(capfd, status)
    # Training data that has answers: the file to score is the one refused (--do_predict alone would take it).
    status = run_squad.cli(squad_argv(tmp_path / "out", predict_file=unanswered, do_eval=True, do_train=True,
                                      train_file=squad_files[0]))
    assert one_error_line(capfd, status) == (f"error: --do_eval: {unanswered} has no answers for 1 question(s) "
                                             f"(first: id 1); use --do_predict alone for unanswered files")


def test_short_run_writes_official_files(tmp_path, squad_files):
    """Two training steps, then prediction and evaluation on a v2.0 file: the files have the official shapes
    and eval_results.json is what finetune/squad_metrics.py says about predictions.json + null_odds.json."""
    from finetune import squad_metrics
    train, dev = squad_files
    out = tmp_path / "out"
    summary = run_squad.main(squad_argv(out, train_file=train, predict_file=dev, do_train=True, do_predict=True,
                                        do_eval=True, version_2_with_negative=True))
    questions = {qa["id"] for p in json.loads(dev.read_text())["data"][0]["paragraphs"] for qa in p["qas"]}
    predictions = json.loads((out / "predictions.json").read_text())
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    null_odds = json.loads((out / "null_odds.json").read_text())
    assert set(predictions) == set(nbest) == set(null_odds) == questions
    assert all(isinstance(text, str) for text in predictions.values())
    assert all(set(entry) == {"text", "probability", "start_logit", "end_logit"} for entries in nbest.values()
               for entry in entries)
    assert all((predictions[q] == "") == (null_odds[q] > 0.0) for q in questions)
    expected = squad_metrics.evaluate(json.loads(dev.read_text()), predictions, null_odds, 0.0)
    assert json.loads((out / "eval_results.json").read_text()) == pytest.approx(expected)
    assert summary["exact_match"] == pytest.approx(expected["exact"]) and summary["F1"] == pytest.approx(expected["f1"])
    for key in ("HasAns_exact", "NoAns_exact", "best_f1", "e2e_train_time", "training_sequences_per_second",
                "final_loss"):
        assert key in summary
    logged = [json.loads(line[5:]) for line in (out / "dllogger.json").read_text().splitlines()
              if line.startswith("DLLL ")]
    assert logged[-1]["step"] == [] and logged[-1]["data"]["exact_match"] == pytest.approx(summary["exact_match"])


def run_launcher(tmp_path, **env):
    """scripts/run_squad.sh with a stub `deepspeed` first on PATH that records its arguments."""
    import os
    import subprocess
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "deepspeed").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {tmp_path / "args"}\n')
    (bin_dir / "deepspeed").chmod(0o755)
    own = ("INIT_CHECKPOINT", "SQUAD_VERSION", "SQUAD_DIR", "HL_DEVICE", "HL_NUM_NODES", "HL_DS_CONFIG")
    full_env = {key: value for key, value in os.environ.items() if key not in own}
    full_env.update(PATH=os.pathsep.join([str(bin_dir), str(helpers.VENV_BIN), os.environ["PATH"]]),
                    HL_RESULTS_DIR=str(tmp_path / "results"), **env)
    return subprocess.run(["bash", str(REPO_ROOT / "scripts" / "run_squad.sh"), "--max_steps", "5"],
                          env=full_env, capture_output=True, text=True, timeout=60)


def test_launcher_command_line(tmp_path):
    squad_dir = tmp_path / "squad"
    for split in ("train", "dev"):
        write_squad(squad_dir / f"{split}-v2.0.json", [], version="v2.0")
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    result = run_launcher(tmp_path, INIT_CHECKPOINT=str(checkpoint), SQUAD_VERSION="v2.0", SQUAD_DIR=str(squad_dir),
                          HL_DEVICE="cpu", HL_NGPU_PER_NODE="2")
    assert result.returncode == 0, result.stderr
    args = (tmp_path / "args").read_text().splitlines()
    # the ranks run the launcher's python by its absolute path (ssh's PATH on another server differs)
    assert args[:10] == ["--log_level=warning", "--num_nodes", "1", "--num_gpus", "2", "--no_local_rank", "--no_python",
                         "--master_port", "29500", str(helpers.VENV_BIN / "python")]
    assert args[11] == "./run_squad.py" and "--no_cuda" in args and "--version_2_with_negative" in args
    assert args[args.index("--train_file") + 1] == str(squad_dir / "train-v2.0.json")
    assert args[args.index("--init_checkpoint") + 1] == str(checkpoint)
    assert args[-2:] == ["--max_steps", "5"]  # extra arguments are passed on
    # every flag the launcher passes is one run_squad.py knows
    known = {option for action in run_squad.build_parser()._actions for option in action.option_strings}
    assert {arg for arg in args[11:] if arg.startswith("--")} - {"--deepspeed", "--deepspeed_config"} <= known


@pytest.mark.parametrize("env, message", [
    ({}, "set INIT_CHECKPOINT"),
    ({"INIT_CHECKPOINT": "/nonexistent"}, "INIT_CHECKPOINT /nonexistent does not exist"),
    ({"INIT_CHECKPOINT": "/", "SQUAD_DIR": "/nonexistent"}, "python data/squad_download.py fetches it"),
    ({"INIT_CHECKPOINT": "/", "SQUAD_VERSION": "v3"}, "SQUAD_VERSION must be v1.1 or v2.0"),
])
def test_launcher_stops_early_with_one_line(tmp_path, env, message):
    result = run_launcher(tmp_path, **env)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tmp_path / "args").exists()


# ----------------------------------------------------------------------------------------------------------
# Learning check (slow): fine-tuning the pretrained tiny post-LN checkpoint on "Where is the word W?" questions
# about real sentences. The pre-LN wiring of the demo does not learn this task in the same budget: its
# residual stream starts at 0, not at the embeddings (as in the reference), so a position keeps its own token
# only through attention; measured 9-12% exact match after 375-500 steps where post-LN reached about 50% in the
# same budget (9c09366, 2026-11-23).
# The loss first sits at the answer-position prior (about 2.5) and then drops once attention learns to match
# the named token; when that happens is sensitive to noise. With dropout (the pretraining's 0.1) it came
# anywhere from step 390 to about 1,180 depending on LR, seed and checkpoint (17-91% EM at 936 steps);
# without dropout, at LR 1e-3, at steps 250-410 in the runs measured (88.7-98.3% EM over three seeds and
# two versions of the pretraining shards; docs/results.md).


def learning_run(tmp_path, checkpoint, config, shuffled):
    sentences = sample_sentences()
    random.Random(0).shuffle(sentences)
    train = write_squad(tmp_path / "train.json", word_questions(sentences[:3334], 3, seed=0, shuffled=shuffled))
    dev = write_squad(tmp_path / "dev.json", word_questions(sentences[-300:], 1, seed=1, id_prefix="d"))
    config = dropout_free_config(tmp_path / "config.json", base=config)
    return run_squad.main(squad_argv(tmp_path / "out", init_checkpoint=checkpoint, config_file=config,
                                     train_file=train, predict_file=dev, do_train=True, do_predict=True,
                                     do_eval=True, train_batch_size=32, max_steps=None, num_train_epochs=3,
                                     learning_rate=1e-3, skip_checkpoint=True))


@pytest.mark.slow
@pytest.mark.usefixtures("every_cpu_thread")
def test_fine_tuning_learns_to_point_at_the_named_word(tmp_path, pretrained_tiny_post_ln):
    summary = learning_run(tmp_path, *pretrained_tiny_post_ln, shuffled=False)
    assert summary["exact_match"] >= 80, summary


# The negative control of the check above (its data, not the code, teaches the task): under the marker extra, for
# a change to the check or its data; CI's run leaves it out.
@pytest.mark.slow
@pytest.mark.extra
@pytest.mark.usefixtures("every_cpu_thread")
def test_with_shuffled_answers_the_same_run_stays_low(tmp_path, pretrained_tiny_post_ln):
    summary = learning_run(tmp_path, *pretrained_tiny_post_ln, shuffled=True)
    assert summary["exact_match"] < 30, summary


@pytest.mark.slow
def test_two_ranks_with_zero1_equal_one_rank(tmp_path, pretrained_tiny_checkpoint, squad_files):
    """fp32, ZeRO-1, no dropout: 2 ranks x micro 8 through the real launcher against 1 rank x micro 8 x 2
    accumulation steps (the same samples per step): same losses, weights, logits and scores."""
    train, dev = squad_files
    config = dropout_free_config(tmp_path / "config.json")

    def argv_for(out, ds_config):
        return squad_argv(out, init_checkpoint=pretrained_tiny_checkpoint, config_file=config, train_file=train,
                          predict_file=dev, do_train=True, do_predict=True, do_eval=True,
                          version_2_with_negative=True, max_steps=6, train_batch_size=None, deepspeed=True,
                          deepspeed_config=ds_config, log_freq=1)

    def outputs(out):
        return {name: json.loads((out / name).read_text())
                for name in ("predictions.json", "nbest_predictions.json", "null_odds.json", "eval_results.json")}

    results = run_on_one_and_two_ranks(tmp_path, "run_squad.py", argv_for, outputs)
    assert_same_training(results, steps=6)
    one, two = results[1]["outputs"], results[2]["outputs"]
    assert two["predictions.json"] == one["predictions.json"]
    assert two["null_odds.json"] == pytest.approx(one["null_odds.json"], rel=1e-4, abs=1e-4)
    assert two["eval_results.json"] == pytest.approx(one["eval_results.json"], rel=1e-4, abs=1e-4)
    for qid, entries in one["nbest_predictions.json"].items():
        assert [e["text"] for e in two["nbest_predictions.json"][qid]] == [e["text"] for e in entries]
        assert [e["start_logit"] for e in two["nbest_predictions.json"][qid]] == pytest.approx(
            [e["start_logit"] for e in entries], rel=1e-4, abs=1e-4)


def test_squad_help_says_do_eval_and_do_predict_both_read_predict_file():
    helps = {action.option_strings[0]: action.help for action in run_squad.build_parser()._actions}
    assert "--predict_file" in helps["--do_eval"] and "--predict_file" in helps["--do_predict"]
    assert "run_squad.py of --predict_file" in helps["--do_predict"]


# ============================================================================ the task head

def test_a_training_set_smaller_than_one_global_batch_is_refused_before_any_output(tmp_path, capfd):
    """Two short paragraphs: one window per question (counted here in the JSON), fewer than --train_batch_size 8
    on one rank. Refused before anything is written."""
    paragraphs = word_questions(sample_sentences()[:2], 1, seed=0)
    questions = sum(len(paragraph["qas"]) for paragraph in paragraphs)
    assert 0 < questions < 8
    train = write_squad(tmp_path / "train.json", paragraphs)
    status = run_squad.cli(squad_argv(tmp_path / "out", train_file=train, do_train=True))
    assert one_error_line(capfd, status) == (
        f"error: {questions} training windows (features of --train_file's questions), fewer than one global batch "
        "of 8 (micro-batch 8 x 1 accumulation steps x 1 ranks): lower --train_batch_size")
    assert not (tmp_path / "out").exists()


def pretraining_state_file(tmp_path, drop=()):
    """A BertForPreTraining state dict of the tiny config (no qa_outputs), saved as the export file is; the keys
    starting with an entry of `drop` left out."""
    import torch

    from modeling import BertConfig, BertForPreTraining
    state = BertForPreTraining(BertConfig.from_json_file(TINY_CONFIG)).state_dict()
    path = tmp_path / "pretrained.pt"
    torch.save({key: value for key, value in state.items() if not key.startswith(drop)}, path)
    return path


def test_evaluation_without_training_refuses_a_checkpoint_without_the_head(tmp_path, capfd, squad_files):
    _, dev = squad_files
    status = run_squad.cli(squad_argv(tmp_path / "out", init_checkpoint=pretraining_state_file(tmp_path),
                                      predict_file=dev, do_predict=True, do_eval=True, version_2_with_negative=True))
    assert one_error_line(capfd, status) == (
        "error: --init_checkpoint has no task head (qa_outputs.bias, qa_outputs.weight): evaluation without "
        "--do_train needs fine-tuned weights, e.g. <output_dir>/checkpoints of a --do_train run")
    assert not (tmp_path / "out").exists()  # refused before the output directory and dllogger.json are made


@pytest.mark.parametrize("rank", [0, 1, 3])
def test_a_fresh_head_is_built_under_the_seed_on_every_rank_then_seed_plus_rank(tmp_path, rank):
    """The head equals one built directly after torch.manual_seed(seed), whatever the rank; afterwards the
    global generator is where torch.manual_seed(seed + rank) puts it."""
    import types

    import torch

    from finetune import finetuning
    from finetune.hf_interop import read_state_dict_file
    from modeling import BertConfig, BertForQuestionAnswering
    config = BertConfig.from_json_file(TINY_CONFIG)
    weights = read_state_dict_file(pretraining_state_file(tmp_path), "--init_checkpoint")
    session = types.SimpleNamespace(rank=rank, config=types.SimpleNamespace(seed=7), say=lambda text: None)
    torch.manual_seed(1000 + rank)  # what start() left: another state on every rank
    model = finetuning.build_model(BertForQuestionAnswering, config, weights, session, fine_tune=True)
    after = torch.rand(4)
    torch.manual_seed(7)
    expected = BertForQuestionAnswering(config).qa_outputs
    torch.testing.assert_close(model.qa_outputs.weight, expected.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.qa_outputs.bias, expected.bias, rtol=0, atol=0)
    torch.testing.assert_close(after, torch.rand(4, generator=torch.Generator().manual_seed(7 + rank)))


# ============================================================================ NVIDIA's flags

NVIDIA_SQUAD_ONLY = ["--bert_model", "bert-large-uncased", "--eval_script", "evaluate.py", "--verbose_logging",
                     "--use_env", "--skip_cache", "--cache_dir", "cache", "--loss_scale", "0"]


def test_nvidias_flags_that_mean_nothing_here_are_accepted_and_change_nothing(tmp_path):
    """NVIDIA's run_squad.sh command line (its --bert_model, --eval_script, ...) parses, and every flag of ours
    has the value it has without them."""
    from finetune import flags
    ours = ["--init_checkpoint", "I", "--do_train", "--train_file", "T", "--train_batch_size", "32", "--do_predict",
            "--predict_file", "P", "--predict_batch_size", "8", "--do_eval", "--do_lower_case", "--seed", "1",
            "--learning_rate", "3e-5", "--num_train_epochs", "2", "--max_seq_length", "384", "--doc_stride", "128",
            "--output_dir", "O", "--vocab_file", "V", "--config_file", "C", "--max_steps", "-1",
            "--json-summary", "J"]
    with_nvidia = vars(flags.parse_arguments(run_squad.build_parser(), ours + NVIDIA_SQUAD_ONLY))
    without = vars(flags.parse_arguments(run_squad.build_parser(), ours))
    ignored = {"bert_model", "eval_script", "verbose_logging", "use_env", "skip_cache", "cache_dir", "loss_scale"}
    assert {key: value for key, value in with_nvidia.items() if key not in ignored} == \
        {key: value for key, value in without.items() if key not in ignored}
    assert with_nvidia["bert_model"] == "bert-large-uncased"
    helps = {action.option_strings[0]: action.help for action in run_squad.build_parser()._actions
             if action.option_strings}
    assert all(helps[flag].startswith("Ignored") for flag in NVIDIA_SQUAD_ONLY if flag.startswith("--"))


@pytest.mark.parametrize("flag", ["--fp16", "--amp"])
def test_nvidias_fp16_is_refused_with_one_line(tmp_path, capfd, flag):
    status = run_squad.cli(["--vocab_file", str(VOCAB), "--output_dir", str(tmp_path / "out"), "--do_train",
                            "--bert_model", "bert-large-uncased", flag])
    assert one_error_line(capfd, status) == (f"error: {flag} (NVIDIA's apex fp16) is not supported: for mixed "
                                             f"precision set \"bf16\": {{\"enabled\": true}} in the "
                                             f"--deepspeed_config JSON")
