"""The cost of held-out evaluation (run_pretraining.py --eval_dir): one driver run on synthetic shards, one rank,
CPU, evaluating every --eval_interval steps; prints the seconds of one evaluation, the training step time (which
the driver logs without the evaluations) and the evaluation's share of the step time at that interval.

    python bench/bench_evaluation.py                                  # tiny model, bf16, ZeRO-1
    python bench/bench_evaluation.py --config bench/bert_1.5b_widths_2_layers.json --micro 8 \
        --num_eval_examples 256 --eval_batch_size 8 --steps 6 --eval_interval 3

share = (seconds of one evaluation) / (eval_interval x seconds of one training step): what evaluating costs a
run at that interval. The evaluation is a forward pass of every held-out sample, so the share scales with
num_eval_examples / (eval_interval x global batch). Asserts nothing.
"""

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

import run_pretraining
from bench_driver import MODEL_CONFIG, synthetic_arrays
from data.shard_format import write_shard


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval_interval", type=int, default=10)
    parser.add_argument("--num_eval_examples", type=int, default=1024)
    parser.add_argument("--eval_batch_size", type=int, default=32)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--fp32", action="store_true", help="fp32 instead of bf16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--config", default=str(MODEL_CONFIG), help="model config JSON (default: the tiny one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    vocab_size = json.loads(Path(args.config).read_text())["vocab_size"]
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with tempfile.TemporaryDirectory(prefix="bench-evaluation-") as tmp:
        work = Path(tmp)
        (work / "train").mkdir()
        (work / "held_out").mkdir()
        write_shard(work / "train" / "shard_training_0.hdf5",
                    synthetic_arrays(args.micro * (args.steps + 1), 128, 20, vocab_size))
        write_shard(work / "held_out" / "held_out_test_0.hdf5", synthetic_arrays(args.num_eval_examples, 128, 20,
                                                                             vocab_size, seed=1))
        (work / "ds.json").write_text(json.dumps({
            "train_batch_size": args.micro, "train_micro_batch_size_per_gpu": args.micro,
            "gradient_accumulation_steps": 1, "bf16": {"enabled": not args.fp32}, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": args.stage}, "zero_allow_untested_optimizer": True,
            "steps_per_print": 10 ** 9}))
        log = work / "dllogger.json"
        summary = run_pretraining.main([
            "--input_dir", str(work / "train"), "--output_dir", str(work / "out"), "--config_file", args.config,
            "--json-summary", str(log), "--optimizer", "lans", "--use_lr_scheduler", "--learning_rate", "0.001",
            "--max_steps", str(args.steps), "--max_predictions_per_seq", "20", "--skip_checkpoint",
            "--disable_progress_bar", "--no_cuda", "--peak_tflops", "1", "--deepspeed", "--deepspeed_config",
            str(work / "ds.json"), "--log_freq", str(args.steps), "--eval_dir", str(work / "held_out"),
            "--eval_interval", str(args.eval_interval), "--num_eval_examples", str(args.num_eval_examples),
            "--eval_batch_size", str(args.eval_batch_size)])
        records = [json.loads(line[5:]) for line in log.read_text().splitlines() if line.startswith("DLLL ")]
        eval_seconds = [r["data"]["eval_time"] for r in records if "eval_time" in r.get("data", {})]
    step_seconds = summary["raw_train_time"] / summary["global_step"]  # without the evaluations
    one_eval = statistics.median(eval_seconds)
    print(f"config {Path(args.config).name}, micro-batch {args.micro}, {'fp32' if args.fp32 else 'bf16'}, "
          f"ZeRO-{args.stage}, {args.threads} thread(s)")
    print(f"training step: {step_seconds:.3f} s ({summary['global_step']} steps)")
    print(f"one evaluation of {args.num_eval_examples} samples (batch {args.eval_batch_size}): {one_eval:.3f} s "
          f"(median of {len(eval_seconds)})")
    per_sample = one_eval / args.num_eval_examples, step_seconds / args.micro
    print(f"seconds per sample: evaluation {per_sample[0]:.2e}, training {per_sample[1]:.2e} "
          f"(ratio {per_sample[0] / per_sample[1]:.3f})")
    print(f"share of the step time at --eval_interval {args.eval_interval}: "
          f"{one_eval / (args.eval_interval * step_seconds):.1%}")


if __name__ == "__main__":
    main()
