"""Does the recipe train a BERT that learns English? The convergence study of issue 31: the real driver
(run_pretraining.py through the `deepspeed` launcher) on the registry corpus, a small pre-LN BERT, four recipes at
the same samples, data and seeds; one table and one plot of held-out MLM accuracy and loss against samples seen.

    bash data/create_datasets_from_start.sh registry                  # the corpus, once (~1 min, cached)
    python bench/bench_convergence.py --work_dir results/convergence   # the study (see docs/convergence.md)

Recipes (R = --batch, S = --samples; LR rule: the square-root rule, lr x sqrt(R / published batch)):
  a  LANS + PolyWarmUp, the 1.5B launcher's phase 1 (scripts/launch_common.sh): lr 0.0015 at batch 12288,
     warm-up 0.05, plateau 0.25, degree 1; then phase 2 at sequence 512 from its last checkpoint: lr 0.001 at
     batch 4096, warm-up 0.128, batch R / 3 (12288 -> 4096), S / 9 samples (the launcher's 1/9).
  b  a at 8 x R, S / (8 R) steps, its LR x sqrt(8) (the same rule).
  c  NVLAMB with NVIDIA's BERT phase-1 schedule: lr 6e-3 at batch 65536, warm-up 0.2843, degree 0.5.
  d  AdamW (weight decay 0.01), linear warm-up 0.01 then linear decay to 0 (PolyWarmUp, degree 1: Hugging Face's
     get_linear_schedule_with_warmup), lr 1e-4 at batch 256 (the BERT paper's).
Each run evaluates --num_eval_examples held-out samples every --eval_every samples (the same points for every
recipe) and at its end. Seeds: --seeds for a and d, the first of them for b and c.

Resumable: each run writes <work_dir>/<run>/done after the driver exits 0 and is not run again; a run without
`done` (interrupted) is removed and started afresh. Writes <work_dir>/convergence.md, .csv and .png.
"""

import argparse
import csv
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REGISTRY_HDF5 = REPO / "data" / "registry_work" / ("hdf5_lower_case_1_seq_len_{seq}_max_pred_{pred}_masked_lm_prob"
                                                  "_0.15_random_seed_12345_dupe_factor_5") / "registry_en_corpus"
PHASE2_SHARE = 9  # phase 2 sees 1/9 of phase 1's samples, at a third of its batch (the 1.5B launchers)


@dataclass(frozen=True)
class Recipe:
    optimizer: str
    lr: float             # at published_batch
    published_batch: int
    warmup: float
    constant: float
    degree: float
    batch_factor: int = 1  # x --batch


RECIPES = {
    "a": Recipe("lans", 0.0015, 12288, 0.05, 0.25, 1.0),
    "b": Recipe("lans", 0.0015, 12288, 0.05, 0.25, 1.0, batch_factor=8),
    "c": Recipe("nvlamb", 6e-3, 65536, 0.2843, 0.0, 0.5),
    "d": Recipe("adamw", 1e-4, 256, 0.01, 0.0, 1.0),
}
PHASE2 = Recipe("lans", 0.001, 4096, 0.128, 0.0, 1.0)


def scaled_lr(recipe: Recipe, batch: int) -> float:
    """The square-root rule: the LR of a batch B is lr x sqrt(B / published batch)."""
    return recipe.lr * math.sqrt(batch / recipe.published_batch)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--work_dir", default=str(REPO / "results" / "convergence"))
    parser.add_argument("--data_dir", default=str(REGISTRY_HDF5).format(seq=128, pred=20),
                        help="phase-1 shards (training and *_test_* held-out ones)")
    parser.add_argument("--phase2_data_dir", default=str(REGISTRY_HDF5).format(seq=512, pred=80))
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=192, help="global batch of a, c, d (b: 8x)")
    parser.add_argument("--micro_batch", type=int, default=32, help="per rank and micro-step")
    parser.add_argument("--samples", type=int, default=192 * 8 * 6, help="phase-1 samples of every recipe")
    parser.add_argument("--eval_every", type=int, default=192 * 8 * 2, help="samples between evaluations (a "
                        "multiple of 8 x --batch)")
    parser.add_argument("--num_eval_examples", type=int, default=512)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=sorted(RECIPES))
    parser.add_argument("--no_phase2", action="store_true", help="skip a's phase-2 continuation")
    parser.add_argument("--ranks", type=int, default=2, help="processes (CPU ranks or devices)")
    parser.add_argument("--device", choices=("cpu", "cuda", "hpu"), default="cpu")
    parser.add_argument("--master_port", type=int, default=29560)
    parser.add_argument("--lr_factor", type=float, default=1.0, help="every run's learning rate (the published one "
                        "scaled by the square-root rule) times this: a diagnostic of the rule at a small budget, "
                        "not the recipes as published")
    args = parser.parse_args(argv)
    if args.eval_every % (8 * args.batch) or args.samples % args.eval_every:
        parser.error("--eval_every must be a multiple of 8 x --batch and divide --samples")
    if args.batch % 3 and not args.no_phase2:
        parser.error("--batch must be a multiple of 3 (phase 2 runs at --batch / 3), or pass --no_phase2")
    return args


def model_config(args) -> dict:
    """The 1.5B's wiring (pre-LN, scripts/bert_1.5b_config.json) at the study's size."""
    config = json.loads((REPO / "scripts" / "bert_1.5b_config.json").read_text())
    config.update(num_hidden_layers=args.num_layers, hidden_size=args.hidden_size,
                  num_attention_heads=args.num_heads, intermediate_size=4 * args.hidden_size)
    return config


def planned_runs(args) -> list[dict]:
    runs = []
    for name in args.recipes:
        recipe = RECIPES[name]
        for seed in (args.seeds if name in ("a", "d") else args.seeds[:1]):
            batch = args.batch * recipe.batch_factor
            runs.append(dict(name=f"{name}_seed{seed}", recipe=name, seed=seed, recipe_spec=recipe, batch=batch,
                             steps=args.samples // batch, lr=scaled_lr(recipe, batch) * args.lr_factor, phase=1,
                             data_dir=args.data_dir, max_pred=20, samples_before=0))
            if name == "a" and not args.no_phase2:
                batch2 = args.batch // 3
                runs.append(dict(name=f"a_seed{seed}_phase2", recipe="a2", seed=seed, recipe_spec=PHASE2,
                                 batch=batch2, steps=args.samples // PHASE2_SHARE // batch2,
                                 lr=scaled_lr(PHASE2, batch2) * args.lr_factor, phase=2,
                                 data_dir=args.phase2_data_dir, max_pred=80,
                                 samples_before=args.samples, phase1=f"a_seed{seed}"))
    return runs


def driver_command(args, run: dict, run_dir: Path) -> list[str]:
    spec = run["recipe_spec"]
    micro = min(args.micro_batch, run["batch"] // args.ranks)
    ds_config = {"train_batch_size": run["batch"], "train_micro_batch_size_per_gpu": micro,
                 "steps_per_print": 10 ** 9, "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                 "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    (run_dir / "deepspeed_config.json").write_text(json.dumps(ds_config, indent=1))
    (run_dir / "bert_config.json").write_text(json.dumps(model_config(args), indent=1))
    # Phase 1: the same sample counts for every recipe; phase 2 (a held-out pass at sequence 512 costs about 9
    # phase-1 ones): halfway and at the end.
    eval_interval = args.eval_every // run["batch"] if run["phase"] == 1 else max(1, run["steps"] // 2)
    launcher = ["deepspeed", "--log_level=warning", "--num_gpus", str(args.ranks), "--no_local_rank",
                "--master_port", str(args.master_port)]
    command = [*launcher, str(REPO / "run_pretraining.py"), "--disable_progress_bar",
               "--optimizer", spec.optimizer, "--use_lr_scheduler", "--learning_rate", repr(run["lr"]),
               "--warmup_proportion", str(spec.warmup), "--constant_proportion", str(spec.constant),
               "--scheduler_degree", str(spec.degree), "--max_steps", str(run["steps"]),
               "--max_predictions_per_seq", str(run["max_pred"]), "--seed", str(run["seed"]),
               "--config_file", str(run_dir / "bert_config.json"), "--deepspeed",
               "--deepspeed_config", str(run_dir / "deepspeed_config.json"),
               "--input_dir", run["data_dir"], "--eval_dir", run["data_dir"],
               "--eval_interval", str(eval_interval), "--num_eval_examples", str(args.num_eval_examples),
               "--output_dir", str(run_dir / "checkpoints"), "--json-summary", str(run_dir / "dllogger.json"),
               "--log_freq", str(eval_interval)]
    # Only a's phase-1 checkpoint is needed (phase 2 and fine-tuning start from it).
    command += ["--num_steps_per_checkpoint", str(run["steps"])] if run["recipe"] in ("a", "a2") \
        else ["--skip_checkpoint"]
    if args.device == "cpu":
        command.append("--no_cuda")
    elif args.device == "hpu":
        command.append("--use_hpu")
    if run["phase"] == 2:
        command += ["--phase2", "--phase1_end_step", str(run["phase1_steps"]), "--resume_from_checkpoint"]
    return command


def start_phase2_from(phase1_dir: Path, run_dir: Path) -> int:
    """Phase 2 resumes a copy of phase 1's last checkpoint (as scripts/run_bert_tiny_cpu.sh does)."""
    source = phase1_dir / "checkpoints"
    tag = (source / "latest").read_text().strip()
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / tag, run_dir / "checkpoints" / tag)
    shutil.copy(source / "latest", run_dir / "checkpoints" / "latest")
    return int(tag)


def run_one(args, run: dict, work: Path) -> None:
    run_dir = work / run["name"]
    if (run_dir / "done").exists():
        print(f"== {run['name']}: done, kept", flush=True)
        return
    if run_dir.exists():
        print(f"== {run['name']}: unfinished, started afresh", flush=True)
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    if run["phase"] == 2:
        run["phase1_steps"] = start_phase2_from(work / run["phase1"], run_dir)
    command = driver_command(args, run, run_dir)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    if args.device == "cpu":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    print(f"== {run['name']}: {run['steps']} steps of {run['batch']}, lr {run['lr']:.3g}", flush=True)
    with open(run_dir / "driver.log", "w") as log:
        status = subprocess.run(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if status != 0:
        sys.exit(f"error: {run['name']} failed (exit {status}); its log: {run_dir / 'driver.log'}")
    (run_dir / "done").write_text(json.dumps({k: v for k, v in run.items() if k != "recipe_spec"}) + "\n")


def held_out_curve(run: dict, work: Path) -> list[dict]:
    """The held-out records of a run's dllogger stream: samples seen, MLM accuracy and loss, NSP accuracy."""
    points = {}
    for line in (work / run["name"] / "dllogger.json").read_text().splitlines():
        if not line.startswith("DLLL "):
            continue
        record = json.loads(line[5:])
        data, step = record.get("data", {}), record.get("step")
        if "eval_mlm_accuracy" in data and isinstance(step, list) and len(step) == 2:
            points[step[1]] = {"samples": run["samples_before"] + step[1] * run["batch"],
                               "mlm_accuracy": data["eval_mlm_accuracy"], "mlm_loss": data["eval_mlm_loss"],
                               "nsp_accuracy": data["eval_nsp_accuracy"]}
    return [points[step] for step in sorted(points)]


def write_report(runs: list[dict], work: Path, args) -> None:
    curves = {run["name"]: held_out_curve(run, work) for run in runs if (work / run["name"] / "done").exists()}
    with open(work / "convergence.csv", "w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["run", "samples", "eval_mlm_accuracy", "eval_mlm_loss", "eval_nsp_accuracy"])
        for name, points in curves.items():
            for p in points:
                writer.writerow([name, p["samples"], p["mlm_accuracy"], p["mlm_loss"], p["nsp_accuracy"]])
    lines = [f"Model: {args.num_layers} layers, hidden {args.hidden_size}, pre-LN; {args.samples} phase-1 samples; "
             f"{args.num_eval_examples} held-out samples.", "",
             "| run | optimizer | batch | lr | samples | held-out MLM accuracy | MLM loss | NSP accuracy |",
             "|---|---|---|---|---|---|---|---|"]
    for run in runs:
        points = curves.get(run["name"])
        if not points:
            lines.append(f"| {run['name']} | {run['recipe_spec'].optimizer} | {run['batch']} | {run['lr']:.3g} "
                         "| not run | | | |")
            continue
        last = points[-1]
        lines.append(f"| {run['name']} | {run['recipe_spec'].optimizer} | {run['batch']} | {run['lr']:.3g} | "
                     f"{last['samples']} | {last['mlm_accuracy']:.4f} | {last['mlm_loss']:.4f} | "
                     f"{last['nsp_accuracy']:.4f} |")
    (work / "convergence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(curves, work / "convergence.png")


def plot(curves: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (accuracy, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in curves.items():
        samples = [p["samples"] for p in points]
        style = "--" if "phase2" in name else "-"
        accuracy.plot(samples, [p["mlm_accuracy"] for p in points], style, marker=".", label=name)
        loss.plot(samples, [p["mlm_loss"] for p in points], style, marker=".", label=name)
    accuracy.set(xlabel="samples seen", ylabel="held-out MLM accuracy")
    loss.set(xlabel="samples seen", ylabel="held-out MLM loss")
    accuracy.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    for directory in {args.data_dir} | ({args.phase2_data_dir} if "a" in args.recipes and not args.no_phase2
                                         else set()):
        if not Path(directory).is_dir():
            sys.exit(f"error: {directory} is not a directory: bash data/create_datasets_from_start.sh registry")
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    runs = planned_runs(args)
    for run in runs:
        run_one(args, run, work)
    write_report(runs, work, args)


if __name__ == "__main__":
    main()
