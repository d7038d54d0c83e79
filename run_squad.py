#!/usr/bin/env python
"""Fine-tune and evaluate BERT on SQuAD v1.1 / v2.0.

Flags follow NVIDIA's run_squad.py (plus DeepSpeed's --deepspeed --deepspeed_config and the shared
fine-tuning flags of finetune/flags.py); its flags that mean nothing here (--bert_model, --eval_script,
--loss_scale, ...) are accepted and do nothing, and --fp16/--amp are refused (bf16 is the DeepSpeed JSON's).
One process per device, or one process:

    python run_squad.py --init_checkpoint results/bert_tiny/checkpoints --vocab_file data/vocab.txt \\
        --do_lower_case --train_file train-v1.1.json --predict_file dev-v1.1.json --do_train --do_predict \\
        --do_eval --output_dir results/squad
    deepspeed --num_gpus 2 --no_local_rank run_squad.py ... --deepspeed --deepspeed_config ds.json

Outputs in --output_dir (--do_predict / --do_eval): predictions.json ({question id: answer text}),
nbest_predictions.json ({id: [{text, probability, start_logit, end_logit}]}), for v2.0 null_odds.json ({id:
null score minus best answer score}); with --do_eval eval_results.json (the official scripts' figures, see
finetune/squad_metrics.py) and the dllogger keys exact_match and F1 (v2.0: also HasAns_*, NoAns_*, best_*);
checkpoints/ (the fine-tuned weights, unless --skip_checkpoint) and dllogger.json.
"""

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from common.atomic_write import write_text_atomically
from common.errors import InputError
from finetune import finetuning, flags, squad, squad_metrics
from modeling import BertConfig, BertForQuestionAnswering
from training import distributed

if TYPE_CHECKING:
    import torch
    from deepspeed import DeepSpeedEngine
    from tokenizers import Tokenizer

# "train" / "predict" -> (its examples, their features)
TaskData: TypeAlias = dict[str, tuple[list[squad.SquadExample], squad.SquadFeatures]]


def build_parser() -> argparse.ArgumentParser:
    parser, groups = flags.build_parser(
        "Fine-tune BERT on SQuAD v1.1/v2.0 (NVIDIA run_squad.py flags) with DeepSpeed.",
        "%(prog)s --vocab_file TXT --output_dir DIR --do_train|--do_eval|--do_predict [flags]")
    add = groups["data"].add_argument
    add("--train_file", default=None, help="SQuAD JSON for training, e.g. train-v1.1.json (default: none; "
        "needed by --do_train).")
    add("--predict_file", default=None, help="SQuAD JSON to predict (and, with --do_eval, to score), "
        "e.g. dev-v1.1.json (default: none; needed by --do_predict and --do_eval).")
    add("--version_2_with_negative", action="store_true", help="SQuAD v2.0: questions may have no answer.")
    add("--max_seq_length", type=int, default=384, help="Tokens per window: [CLS] question [SEP] context [SEP].")
    add("--doc_stride", type=int, default=128, help="Tokens between the starts of a context's windows.")
    add("--max_query_length", type=int, default=64, help="Question tokens kept.")
    add = groups["prediction"].add_argument
    add("--predict_batch_size", type=int, default=8, help="Batch per device for prediction.")
    add("--n_best_size", type=int, default=20, help="Answers kept per question in nbest_predictions.json "
        "(and best starts x best ends searched).")
    add("--max_answer_length", type=int, default=30, help="Longest answer, in tokens.")
    add("--null_score_diff_threshold", type=float, default=0.0, help="v2.0: answer '' when the null score "
        "minus the best answer's score exceeds this.")
    add = groups["ignored"].add_argument
    add("--eval_script", default=None, help="Ignored: --do_eval scores with finetune/squad_metrics.py, the "
        "official rules (default: none).")
    add("--verbose_logging", action="store_true", help="Ignored.")
    add("--use_env", action="store_true", help="Ignored: LOCAL_RANK is read from the environment anyway.")
    add("--skip_cache", action="store_true", help="Ignored: training features are not cached.")
    add("--cache_dir", default=None, help="Ignored: training features are not cached (default: none).")
    return parser


@dataclass(frozen=True, kw_only=True)
class SquadConfig(flags.Config):
    """The run's settings: the common fine-tuning ones and SQuAD's."""
    train_file: str | None
    predict_file: str | None
    version_2_with_negative: bool
    max_seq_length: int
    doc_stride: int
    max_query_length: int
    predict_batch_size: int
    n_best_size: int
    max_answer_length: int
    null_score_diff_threshold: float


def check_flags(config: SquadConfig, model_config: BertConfig) -> None:
    if config.do_train and not config.train_file:
        raise InputError("--do_train needs --train_file")
    if (config.do_predict or config.do_eval) and not config.predict_file:
        raise InputError("--do_predict and --do_eval need --predict_file")
    if not config.max_query_length + 3 < config.max_seq_length <= model_config.max_position_embeddings:
        raise InputError(f"--max_seq_length must be in ({config.max_query_length} + 3, "
                         f"{model_config.max_position_embeddings}] (--max_query_length + 3, the model's "
                         f"max_position_embeddings), got {config.max_seq_length}")
    for name in ("doc_stride", "max_query_length", "predict_batch_size", "n_best_size", "max_answer_length"):
        if getattr(config, name) < 1:
            raise InputError(f"--{name} must be at least 1, got {getattr(config, name)}")


def read_task_data(tokenizer: "Tokenizer", train_file: str | None, predict_file: str | None, *, scored: bool,
                   version_2_with_negative: bool, max_seq_length: int, doc_stride: int,
                   max_query_length: int) -> TaskData:
    """{"train"/"predict": (examples, features)} of what this run needs: read before any work. train_file /
    predict_file: None when the run does not train / predict. scored (--do_eval): every question of
    predict_file must have answers. The windows: --max_seq_length, --doc_stride, --max_query_length."""
    squad_tokenizer = squad.SquadTokenizer(tokenizer)
    data: TaskData = {}
    for name, path in (("train", train_file), ("predict", predict_file)):
        if path is None:
            continue
        examples = squad.read_squad(path, is_training=name == "train", version_2_with_negative=version_2_with_negative)
        if name == "predict" and scored:
            unscored = [e.qas_id for e in examples if not e.gold_answers and not e.is_impossible]
            if unscored:
                raise InputError(f"--do_eval: {path} has no answers for {len(unscored)} question(s) "
                                 f"(first: id {unscored[0]}); use --do_predict alone for unanswered files")
        features = squad.convert_examples_to_features(examples, squad_tokenizer, max_seq_length, doc_stride,
                                                      max_query_length, is_training=name == "train")
        data[name] = examples, features
    return data


def tensors(features: squad.SquadFeatures, training: bool) -> finetuning.Features:
    import torch
    names = ["input_ids", "token_type_ids", "attention_mask"] + (["start_positions", "end_positions"] if training
                                                                  else [])
    return {name: torch.from_numpy(getattr(features, name)) for name in names}


def span_loss(model: "DeepSpeedEngine", batch: finetuning.Features) -> "torch.Tensor":
    return model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], batch["start_positions"],
                 batch["end_positions"])[0]


def span_logits(model: "torch.nn.Module", batch: finetuning.Features) -> tuple["torch.Tensor", "torch.Tensor"]:
    return model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])


def write_json(path: Path, value: object) -> None:
    write_text_atomically(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def predict_and_evaluate(session: finetuning.Session, model: BertForQuestionAnswering,
                         examples: list[squad.SquadExample], features: squad.SquadFeatures, *, batch_size: int,
                         n_best_size: int, max_answer_length: int, version_2_with_negative: bool,
                         null_score_diff_threshold: float, answers_file: str | None) -> dict[str, Any]:
    """Predictions of --predict_file's examples and features (rank 0 writes the files in the session's output
    directory) and, when answers_file is given (--do_eval: --predict_file), their scores against its answers.
    batch_size: --predict_batch_size; the others are the SQuAD flags of the same names."""
    output_dir = session.output_dir
    started = time.perf_counter()
    start_logits, end_logits = finetuning.predict(session, model, tensors(features, training=False), batch_size,
                                                  span_logits)
    inference_time = time.perf_counter() - started
    summary = {"e2e_inference_time": inference_time, "inference_sequences_per_second": len(features) / inference_time}
    if session.rank != 0:
        return summary
    result = squad.decode_predictions(examples, features, start_logits.numpy(), end_logits.numpy(), n_best_size,
                                      max_answer_length, version_2_with_negative, null_score_diff_threshold)
    write_json(output_dir / "predictions.json", result.answers)
    write_json(output_dir / "nbest_predictions.json", result.nbest)
    if version_2_with_negative:
        write_json(output_dir / "null_odds.json", result.null_odds)
    session.say(f"wrote predictions.json and nbest_predictions.json{' and null_odds.json' * bool(result.null_odds)}"
                f" for {len(examples)} questions in {output_dir}")
    if answers_file is not None:
        summary.update(score(result, answers_file, output_dir, version_2_with_negative, null_score_diff_threshold))
        session.say(f"exact_match {summary['exact_match']:.2f}, F1 {summary['F1']:.2f}")
    return summary


def score(result: squad.SquadPredictions, predict_file: str, output_dir: Path, version_2_with_negative: bool,
          null_score_diff_threshold: float) -> dict[str, float]:
    """The official scripts' figures (eval_results.json in output_dir) of result's answers to predict_file, and
    NVIDIA's dllogger names for the main two."""
    dataset = squad.load_json(predict_file)
    # The rules (and keys) are those the flag chose, whatever the file's "version" says: a "v2.0" file without
    # unanswerable questions is read as v1.1 without --version_2_with_negative.
    if version_2_with_negative:  # a question counts as unanswered exactly when its prediction is ""
        figures = squad_metrics.evaluate(dataset, result.answers, result.null_odds, null_score_diff_threshold,
                                         v2_rules=True)
    else:
        figures = squad_metrics.evaluate(dataset, result.answers, v2_rules=False)
    write_json(output_dir / "eval_results.json", figures)
    exact = figures.pop("exact" if version_2_with_negative else "exact_match")
    return {"exact_match": exact, "F1": figures.pop("f1"), **figures}


def main(argv: Sequence[str] | None = None, *, job: distributed.Job | None = None) -> dict[str, Any]:
    """Fine-tune and/or predict; returns the summary (also logged). job: run_cli's (training/distributed.py;
    default: a new one)."""
    config = flags.build_config(flags.parse_arguments(build_parser(), argv), SquadConfig)
    model_config, weights = finetuning.load_pretrained(config.init_checkpoint, config.config_file)
    tokenizer = finetuning.load_tokenizer(config.vocab_file, config.do_lower_case, model_config)
    check_flags(config, model_config)
    data = read_task_data(tokenizer, config.train_file if config.do_train else None,
                          config.predict_file if config.do_predict or config.do_eval else None,
                          scored=config.do_eval, version_2_with_negative=config.version_2_with_negative,
                          max_seq_length=config.max_seq_length, doc_stride=config.doc_stride,
                          max_query_length=config.max_query_length)
    finetuning.check_weights(BertForQuestionAnswering, model_config, weights, fine_tune=config.do_train)
    finetuning.check_training_data(config.ds_config, len(data["train"][1]) if "train" in data else None,
                                   "training windows (features of --train_file's questions)")
    session = finetuning.start(config, "run_squad", job)  # from here on, the run writes its outputs
    model = finetuning.build_model(BertForQuestionAnswering, model_config, weights, session,
                                   fine_tune=config.do_train)
    predict = None
    if "predict" in data:
        predict = functools.partial(
            predict_and_evaluate, session, model, *data["predict"], batch_size=config.predict_batch_size,
            n_best_size=config.n_best_size, max_answer_length=config.max_answer_length,
            version_2_with_negative=config.version_2_with_negative,
            null_score_diff_threshold=config.null_score_diff_threshold,
            answers_file=config.predict_file if config.do_eval else None)
    return finetuning.train_then_evaluate(
        session, model, tensors(data["train"][1], training=True) if "train" in data else None, span_loss, predict)


def cli(argv: Sequence[str] | None = None) -> int:
    return finetuning.run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
