"""Benchmark our run_glue.py against transformers' examples/pytorch/text-classification/run_glue.py (the Trainer).

    python bench/bench_glue.py --hf_run_glue PATH/run_glue.py --hf_python ANCHOR_VENV/bin/python \\
        --init_checkpoint RUN/checkpoints [--pairs 3] [--work_dir DIR]

Both fine-tune and evaluate the same Hugging Face export of --init_checkpoint (written once with
`python -m finetune.hf_interop export`) on the same TSV files (the offline sample task of data/glue_sample.py,
or --data_dir), with the same settings: max_seq_length, train and eval batch, learning rate, epochs, seed,
warm-up 0.1, weight decay 0.01, Adam epsilon 1e-6, gradient clipping 1.0, the last partial batch dropped;
fp32 on the CPU, one process, OMP_NUM_THREADS=--threads for both. Each side keeps its own AdamW implementation (ours
torch.optim.AdamW, the Trainer's default adamw_torch_fused). transformers' script reads JSON Lines written
from the TSVs by finetune/glue.py's reader, so both read the same sentences and labels; before the runs the
benchmark checks that transformers' tokenizer (the export's tokenizer.json) gives the token ids of ours.

The runs alternate, ours then theirs, --pairs times; pair i uses seed --seed + i on both sides, so the
spread of the accuracy over pairs shows the noise of the seed. The figures come from each program's own
logs:
- ours: training_sequences_per_second and inference_sequences_per_second in its dllogger JSON (the training
  time includes DeepSpeed's engine set-up; inference is the forward passes over the dev set), acc in
  eval_results.json;
- theirs: all_results.json's train_runtime and eval_samples_per_second (the evaluation loop with its data
  loader and metric), eval_accuracy; training examples/s is optimizer steps x batch / train_runtime, the
  definition of ours (the Trainer's own train_samples_per_second counts the dropped partial batches too).

transformers' script runs through bench/hf_run_glue_compat.py, which lets the version of it we have
(transformers' commit 242e7fc) run unmodified under transformers 5, offline. The anchor's environment:
bench/requirements-glue-anchor.txt. Nothing of transformers' script is part of this repository.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMPAT = Path(__file__).resolve().parent / "hf_run_glue_compat.py"
PAIR_KEYS = ("sentence1", "sentence2")  # the column names transformers' script takes as a sentence pair


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hf_run_glue", required=True, help="transformers' examples/pytorch/text-classification/"
                        "run_glue.py")
    parser.add_argument("--hf_python", required=True, help="python of the anchor's virtual environment "
                        "(bench/requirements-glue-anchor.txt)")
    parser.add_argument("--init_checkpoint", required=True, help="a run_pretraining.py output directory (exported "
                        "once to <work_dir>/hf) or a Hugging Face directory")
    parser.add_argument("--work_dir", default="results/bench_glue", help="export, data and the runs' outputs")
    parser.add_argument("--task_name", default="sst-2", help="a GLUE classification task with one dev set")
    parser.add_argument("--data_dir", default=None, help="the task's TSV directory (default: the sample task of "
                        "data/glue_sample.py, SST-2's layout)")
    parser.add_argument("--pairs", type=int, default=3, help="alternating pairs (ours, theirs)")
    parser.add_argument("--max_seq_length", type=int, default=48)
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--eval_batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=5e-4)
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of both")
    args = parser.parse_args(argv)
    from finetune.glue import TASKS
    task = TASKS.get(args.task_name.lower())
    if task is None or task.labels is None or len(task.dev) != 1:
        parser.error(f"--task_name must be a classification task with one dev set, not '{args.task_name}'")
    for path, flag in ((args.hf_run_glue, "--hf_run_glue"), (args.hf_python, "--hf_python")):
        if not Path(path).is_file():
            parser.error(f"{flag} {path} is not a file")
    if not Path(args.init_checkpoint).exists():
        parser.error(f"--init_checkpoint {args.init_checkpoint} does not exist")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    return args, task


# ============================================================================ preparation (once)

def run(command, env, log: Path):
    with open(log, "w") as out:
        result = subprocess.run(command, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode:
        raise SystemExit(f"bench_glue.py: error: {' '.join(command[1:3])} exited {result.returncode}; see {log}")


def export(args, work: Path, env) -> Path:
    from finetune.hf_interop import is_hf_directory
    if is_hf_directory(args.init_checkpoint):
        return Path(args.init_checkpoint).resolve()
    hf_dir = work / "hf"
    if not hf_dir.exists():
        run([sys.executable, "-m", "finetune.hf_interop", "export",
             "--checkpoint", str(Path(args.init_checkpoint).resolve()), "--vocab_file", "data/vocab.txt",
             "--do_lower_case", "--output_dir", str(hf_dir)], env, work / "export.log")
    return hf_dir


def task_data(args, work: Path, env) -> Path:
    if args.data_dir:
        return Path(args.data_dir).resolve()
    data_dir = work / "glue_sample"
    if not (data_dir / "dev.tsv").is_file():
        run([sys.executable, "data/glue_sample.py", "--output_dir", str(data_dir)], env, work / "glue_sample.log")
    return data_dir


def write_json_lines(task, data_dir: Path, work: Path) -> dict:
    """{split: JSON Lines file} for transformers' script: each example's sentence(s) and its label index, as
    finetune/glue.py reads them from the TSV."""
    from finetune.glue import read_examples
    files = {}
    for split, name in (("train", "train"), ("validation", next(iter(task.dev)))):
        path = work / f"{split}.json"
        with open(path, "w", encoding="utf-8") as out:
            for example in read_examples(task, data_dir, name):
                row = ({"sentence": example.text_a} if example.text_b is None
                       else {PAIR_KEYS[0]: example.text_a, PAIR_KEYS[1]: example.text_b})
                out.write(json.dumps({**row, "label": example.label}) + "\n")
        files[split] = path
    return files


def check_same_inputs(task, data_dir: Path, hf_dir: Path, max_seq_length: int) -> int:
    """Token ids, token types and masks of the dev set: ours against transformers' tokenizer of the export.
    Returns the number of examples compared; exits when one differs."""
    from transformers import AutoTokenizer

    from data.tokenization import load_tokenizer
    from finetune.glue import convert_examples_to_features, read_examples

    examples = read_examples(task, data_dir, next(iter(task.dev)))
    ours = convert_examples_to_features(examples, task, load_tokenizer(str(hf_dir / "vocab.txt"), True)[0],
                                        max_seq_length)
    texts = [[e.text_a for e in examples]] + ([[e.text_b for e in examples]] if examples[0].text_b else [])
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=needs_remote_code(hf_dir))
    theirs = tokenizer(*texts, padding="max_length", max_length=max_seq_length, truncation=True)
    for name in ("input_ids", "token_type_ids", "attention_mask"):
        if ours[name].tolist() != theirs[name]:
            raise SystemExit(f"bench_glue.py: error: {name} of the dev set differ between our features and "
                             f"transformers' tokenizer of {hf_dir}")
    return len(examples)


def needs_remote_code(hf_dir: Path) -> bool:
    """The pre-LN export: transformers builds it from our finetune/hf_modeling_pre_ln.py, which config.json names."""
    return bool(json.loads((hf_dir / "config.json").read_text()).get("auto_map"))


# ============================================================================ the runs

def run_ours(args, task, data_dir, hf_dir, out: Path, seed: int, env) -> dict:
    run([sys.executable, "run_glue.py", "--task_name", task.name, "--data_dir", str(data_dir),
         "--init_checkpoint", str(hf_dir), "--vocab_file", str(hf_dir / "vocab.txt"), "--do_lower_case",
         "--output_dir", str(out), "--do_train", "--do_eval", "--no_cuda", "--skip_checkpoint",
         "--disable-progress-bar", "--max_seq_length", str(args.max_seq_length),
         "--train_batch_size", str(args.train_batch_size), "--eval_batch_size", str(args.eval_batch_size),
         "--learning_rate", str(args.learning_rate), "--num_train_epochs", str(args.epochs),
         "--warmup_proportion", "0.1", "--seed", str(seed)], env, out.with_suffix(".log"))
    records = [json.loads(line[5:]) for line in open(out / "dllogger.json") if line.startswith("DLLL ")]
    summary = [r["data"] for r in records if r.get("type") == "LOG" and r.get("step") == []][-1]
    accuracy = json.loads((out / "eval_results.json").read_text())[task.name]["acc"]
    return {"train": summary["training_sequences_per_second"], "eval": summary["inference_sequences_per_second"],
            "accuracy": accuracy, "steps": summary["global_step"]}


def run_theirs(args, files, hf_dir, out: Path, seed: int, env) -> dict:
    command = [args.hf_python, str(COMPAT), str(Path(args.hf_run_glue).resolve()),
               "--model_name_or_path", str(hf_dir), "--train_file", str(files["train"]),
               "--validation_file", str(files["validation"]), "--output_dir", str(out), "--do_train", "--do_eval",
               "--max_seq_length", str(args.max_seq_length),
               "--per_device_train_batch_size", str(args.train_batch_size),
               "--per_device_eval_batch_size", str(args.eval_batch_size), "--learning_rate", str(args.learning_rate),
               "--num_train_epochs", str(args.epochs), "--warmup_steps", "0.1", "--weight_decay", "0.01",
               "--adam_epsilon", "1e-6", "--max_grad_norm", "1.0", "--dataloader_drop_last", "true",
               "--seed", str(seed), "--use_cpu", "true", "--save_strategy", "no", "--report_to", "none",
               "--disable_tqdm", "true", "--logging_steps", "1000000"]
    if needs_remote_code(hf_dir):
        command.append("--trust_remote_code")
    run(command, env, out.with_suffix(".log"))
    results = json.loads((out / "all_results.json").read_text())
    steps = json.loads((out / "trainer_state.json").read_text())["global_step"]
    return {"train": steps * args.train_batch_size / results["train_runtime"],
            "eval": results["eval_samples_per_second"], "accuracy": results["eval_accuracy"], "steps": steps,
            "train_as_logged": results["train_samples_per_second"]}


def environment(args, work: Path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(work / "datasets_cache"),
                TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu")


# ============================================================================ report

def report(rows: list) -> None:
    print("\nexamples/s and dev accuracy, each pair run side by side (ours, then theirs):")
    print(f"{'pair':>4} {'seed':>5} | {'train ours':>10} {'theirs':>8} {'ratio':>6} | {'eval ours':>9} {'theirs':>8} "
          f"{'ratio':>6} | {'acc ours':>8} {'theirs':>7}")
    for i, (seed, ours, theirs) in enumerate(rows, 1):
        print(f"{i:>4} {seed:>5} | {ours['train']:>10.1f} {theirs['train']:>8.1f}"
              f" {ours['train'] / theirs['train']:>6.2f}"
              f" | {ours['eval']:>9.1f} {theirs['eval']:>8.1f} {ours['eval'] / theirs['eval']:>6.2f}"
              f" | {ours['accuracy']:>8.4f} {theirs['accuracy']:>7.4f}")
    print(f"\n{'':<24} {'min':>9} {'median':>9}   (the ratio: of the pairs' ratios)")
    for key, name in (("train", "train examples/s"), ("eval", "eval examples/s"), ("accuracy", "dev accuracy")):
        for side in (1, 2):
            values = [row[side][key] for row in rows]
            label = f"{name} {'ours' if side == 1 else 'theirs'}"
            print(f"{label:<24} {min(values):>9.4g} {statistics.median(values):>9.4g}")
        if key != "accuracy":
            ratios = [row[1][key] / row[2][key] for row in rows]
            print(f"{name + ' ours/theirs':<24} {min(ratios):>9.3f} {statistics.median(ratios):>9.3f}")
    print(f"\noptimizer steps per run: ours {rows[0][1]['steps']}, theirs {rows[0][2]['steps']}; the Trainer's own "
          f"train_samples_per_second (counts the dropped partial batches): "
          f"{', '.join(format(row[2]['train_as_logged'], '.1f') for row in rows)}")
    print("Sources: ours, dllogger.json (training_sequences_per_second, inference_sequences_per_second) and "
          "eval_results.json; theirs, all_results.json (train_runtime, eval_samples_per_second, eval_accuracy) "
          "and trainer_state.json (global_step).")


def main(argv=None) -> int:
    args, task = parse_arguments(argv)
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = environment(args, work)
    hf_dir = export(args, work, env)
    data_dir = task_data(args, work, env)
    files = write_json_lines(task, data_dir, work)
    compared = check_same_inputs(task, data_dir, hf_dir, args.max_seq_length)
    loadavg = os.getloadavg()[0]
    print(f"export {hf_dir}; data {data_dir} (JSON Lines for transformers' script in {work}); the token ids of the "
          f"{compared} dev examples are the same on both sides; {args.threads} thread(s); load average {loadavg:.2f}")
    runs = work / f"runs_{time.strftime('%Y%m%d_%H%M%S')}"
    runs.mkdir()
    rows = []
    for pair in range(args.pairs):
        seed = args.seed + pair
        ours = run_ours(args, task, data_dir, hf_dir, runs / f"ours_{pair}", seed, env)
        theirs = run_theirs(args, files, hf_dir, runs / f"theirs_{pair}", seed, env)
        print(f"pair {pair + 1}/{args.pairs}: ours train {ours['train']:.1f} eval {ours['eval']:.1f} "
              f"acc {ours['accuracy']:.4f}; theirs train {theirs['train']:.1f} eval {theirs['eval']:.1f} "
              f"acc {theirs['accuracy']:.4f}", flush=True)
        rows.append((seed, ours, theirs))
    report(rows)
    print(f"load average now {os.getloadavg()[0]:.2f} (at the start {loadavg:.2f}); runs in {runs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
