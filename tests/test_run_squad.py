"""run_squad.py: bad input is one error line and exit 1 before any work; a short real run writes the
official output files and the dllogger keys."""
import json

import pytest

import run_squad
from squad_helpers import REPO_ROOT, sample_sentences, word_questions, write_squad

VOCAB = REPO_ROOT / "data" / "vocab.txt"
TINY_CONFIG = REPO_ROOT / "scripts" / "bert_tiny_config.json"


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
    argv = []
    for name, value in options.items():
        if value is not False and value is not None:
            argv += [f"--{name}"] + ([] if value is True else [str(value)])
    return argv


def one_error_line(capfd, status):
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert status == 1 and len(lines) == 1, err
    return lines[0]


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


def test_eval_needs_answers(tmp_path, capfd):
    unanswered = write_squad(tmp_path / "test.json", [{"context": "Anne smiled.", "qas": [{"id": "1", "question": "?"}]}])
    status = run_squad.cli(squad_argv(tmp_path / "out", predict_file=unanswered, do_eval=True, do_train=True,
                                      train_file=unanswered))
    assert "has no 'answers'" in one_error_line(capfd, status)


def test_short_run_writes_official_files(tmp_path, squad_files):
    """Two training steps, then prediction and evaluation on a v2.0 file: the files have the official shapes
    and eval_results.json is what squad_metrics.py says about predictions.json + null_odds.json."""
    import squad_metrics
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
