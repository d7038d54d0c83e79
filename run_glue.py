#!/usr/bin/env python
"""Fine-tune and evaluate BERT on a GLUE task (CoLA, SST-2, MRPC, STS-B, QQP, MNLI, QNLI, RTE, WNLI) or on mr-vader
(real movie-review sentiment in SST-2's layout, data/vader_movie_reviews.py).

Flags follow NVIDIA's run_glue.py (plus DeepSpeed's --deepspeed --deepspeed_config and the shared
fine-tuning flags of finetune/flags.py); its flags that mean nothing here (--bert_model, --loss_scale,
--server_ip, --server_port) are accepted and do nothing, and --fp16/--amp are refused (bf16 is the DeepSpeed
JSON's). One process per device, or one process:

    python run_glue.py --task_name sst-2 --data_dir glue/SST-2 --init_checkpoint results/bert_tiny/checkpoints \\
        --vocab_file data/vocab.txt --do_lower_case --output_dir results/glue_sst2 --do_train --do_eval
    deepspeed --num_gpus 2 --no_local_rank run_glue.py ... --deepspeed --deepspeed_config ds.json

Outputs in --output_dir: eval_results.json ({evaluation set: {metric: value}}), predictions_<set>.json
({example id: predicted label}, for --do_eval), test_results_<set>.tsv (GLUE submission format, for
--do_predict; a labelled test set, mr-vader's, is also scored in eval_results.json as test_<set>), checkpoints/
(the fine-tuned weights, unless --skip_checkpoint) and dllogger.json.
"""

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import torch
import torch.nn.functional as F

from common.errors import InputError
from finetune import finetuning, flags, glue_metrics
from finetune.glue import TASKS, Example, Task, convert_examples_to_features, read_examples
from modeling import BertConfig, BertForSequenceClassification
from training import distributed

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from tokenizers import Tokenizer

# split name -> (its examples, their features)
TaskData: TypeAlias = dict[str, tuple[list[Example], finetuning.Features]]


def build_parser() -> argparse.ArgumentParser:
    parser, groups = flags.build_parser(
        "Fine-tune BERT on a GLUE task (NVIDIA run_glue.py flags) with DeepSpeed.",
        "%(prog)s --task_name TASK --data_dir DIR --vocab_file TXT --output_dir DIR --do_train|--do_eval|"
        "--do_predict [flags]")
    add = groups["data"].add_argument
    add("--task_name", required=True, type=str.lower, choices=sorted(TASKS), help="GLUE task.")
    add("--data_dir", required=True, help="The task's directory of TSV files.")
    add("--max_seq_length", type=int, default=128, help="Tokens per example after WordPiece (longer pairs are "
        "cut, shorter ones padded).")
    groups["prediction"].add_argument("--eval_batch_size", type=int, default=8, help="Batch per device for "
                                      "evaluation and prediction.")
    for flag in ("--server_ip", "--server_port"):
        groups["ignored"].add_argument(flag, default="", help="Ignored: NVIDIA's remote debugger (default: empty).")
    return parser


@dataclass(frozen=True, kw_only=True)
class GlueConfig(flags.Config):
    """The run's settings: the common fine-tuning ones and GLUE's."""
    task_name: str
    data_dir: str
    max_seq_length: int
    eval_batch_size: int


def check_flags(config: GlueConfig, model_config: BertConfig) -> None:
    if not 3 <= config.max_seq_length <= model_config.max_position_embeddings:
        raise InputError(f"--max_seq_length must be in [3, {model_config.max_position_embeddings}] (the model's "
                         f"max_position_embeddings), got {config.max_seq_length}")
    if config.eval_batch_size < 1:
        raise InputError(f"--eval_batch_size must be at least 1, got {config.eval_batch_size}")
    if not Path(config.data_dir).is_dir():
        raise InputError(f"--data_dir {config.data_dir} is not a directory")


def split_names(task: Task, train: bool, evaluate: bool, predict: bool) -> list[str]:
    """The splits a run reads: "train", the task's dev sets (--do_eval), "test_<name>" of its test sets
    (--do_predict)."""
    return (["train"] if train else []) + (list(task.dev) if evaluate else []) \
        + ([f"test_{name}" for name in task.test] if predict else [])


def read_task_data(task: Task, data_dir: str, names: list[str], tokenizer: "Tokenizer",
                   max_seq_length: int) -> TaskData:
    """{split name: (examples, features)} of the splits `names` in data_dir: read before any work."""
    data: TaskData = {}
    for name in names:
        examples = read_examples(task, data_dir, name)
        data[name] = examples, convert_examples_to_features(examples, task, tokenizer, max_seq_length)
    return data


def logits_of(model: torch.nn.Module, batch: finetuning.Features) -> torch.Tensor:
    return model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])[0]


def loss_function(task: Task) -> finetuning.LossFn:
    def loss(model: "DeepSpeedEngine", batch: finetuning.Features) -> torch.Tensor:
        logits = logits_of(model, batch).float()
        if task.labels is None:
            return F.mse_loss(logits.squeeze(-1), batch["labels"])
        return F.cross_entropy(logits, batch["labels"])
    return loss


def predictions_from(task: Task, logits: torch.Tensor) -> np.ndarray:
    return logits.squeeze(-1).numpy() if task.labels is None else logits.argmax(-1).numpy()


def label_text(task: Task, prediction: float) -> str:
    return f"{float(prediction):.3f}" if task.labels is None else task.labels[int(prediction)]


def evaluate(session: finetuning.Session, model: BertForSequenceClassification, task: Task, data: TaskData,
             batch_size: int) -> dict[str, Any]:
    """Metrics and predictions of every evaluation/test set in `data`, batch_size (--eval_batch_size) rows per
    device at a time; rank 0 writes the files in the session's output directory."""
    output_dir, results, timing = session.output_dir, {}, {"time": 0.0, "rows": 0}
    for name, (examples, features) in data.items():
        if name == "train":
            continue
        started = time.perf_counter()
        (logits,) = finetuning.predict(session, model, features, batch_size, logits_of)
        timing["time"] += time.perf_counter() - started
        timing["rows"] += len(examples)
        predictions = predictions_from(task, logits)
        if session.rank != 0:
            continue
        if name.startswith("test_"):
            rows = [f"{index}\t{label_text(task, p)}" for index, p in enumerate(predictions)]
            (output_dir / f"test_results_{name[5:]}.tsv").write_text("index\tprediction\n" + "\n".join(rows) + "\n")
            if "labels" not in features:  # GLUE's test sets have no labels; mr-vader's has
                continue
        results[name] = glue_metrics.compute(task.metrics, predictions, features["labels"].numpy())
        by_id = {example.guid: label_text(task, p) for example, p in zip(examples, predictions)}
        (output_dir / f"predictions_{name}.json").write_text(json.dumps(by_id, indent=1) + "\n")
    if results:
        (output_dir / "eval_results.json").write_text(json.dumps(results, indent=2) + "\n")
        for name, metrics in results.items():
            session.say(f"{name}: " + ", ".join(f"{key} {value:.4f}" for key, value in metrics.items()))
    summary = {f"{name}:{key}" if len(results) > 1 else key: value
               for name, metrics in results.items() for key, value in metrics.items()}
    if timing["rows"]:
        summary.update(e2e_inference_time=timing["time"],
                       inference_sequences_per_second=timing["rows"] / timing["time"])
    return summary


def main(argv: Sequence[str] | None = None, *, make_loss: Callable[[Task], finetuning.LossFn] = loss_function,
         job: distributed.Job | None = None) -> dict[str, Any]:
    """Fine-tune and/or evaluate; returns the summary (also logged). make_loss(task) -> loss(model, batch)
    (default loss_function) is there for tests: a loss that sends SIGTERM during a chosen step. job: run_cli's
    (training/distributed.py; default: a new one)."""
    config = flags.build_config(flags.parse_arguments(build_parser(), argv), GlueConfig)
    task = TASKS[config.task_name]
    model_config, weights = finetuning.load_pretrained(config.init_checkpoint, config.config_file)
    tokenizer = finetuning.load_tokenizer(config.vocab_file, config.do_lower_case, model_config)
    check_flags(config, model_config)
    data = read_task_data(task, config.data_dir, split_names(task, config.do_train, config.do_eval,
                                                             config.do_predict), tokenizer, config.max_seq_length)
    def make_model(model_config: BertConfig) -> BertForSequenceClassification:
        return BertForSequenceClassification(model_config, task.num_labels)

    finetuning.check_weights(make_model, model_config, weights, fine_tune=config.do_train)
    finetuning.check_training_data(config.ds_config, len(data["train"][0]) if config.do_train else None)
    session = finetuning.start(config, "run_glue", job)  # from here on, the run writes its outputs
    model = finetuning.build_model(make_model, model_config, weights, session, fine_tune=config.do_train)
    return finetuning.train_then_evaluate(
        session, model, data["train"][1] if config.do_train else None, make_loss(task),
        (lambda: evaluate(session, model, task, data, config.eval_batch_size))
        if config.do_eval or config.do_predict else None)


def cli(argv: Sequence[str] | None = None) -> int:
    return finetuning.run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
