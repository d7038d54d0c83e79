"""Driver overhead: steps/s of run_pretraining.py (DeepSpeed, data pipeline, logging) against a plain
PyTorch loop with the same model, LANS and PolyWarmUp on in-memory batches, one rank, CPU.

    python bench/bench_driver.py                       # fp32, ZeRO-0
    python bench/bench_driver.py --bf16 --stage 1      # driver bf16 ZeRO-1 vs plain loop on a bf16 model
    python bench/bench_driver.py --bf16 --stage 1 --config bench/bert_1.5b_widths_2_layers.json --micro 8 \
        --steps 5 --threads 2 --driver_only [--gas 8] [--layers 12]   # BERT-1.5B widths: the driver's MFU
    python bench/bench_driver.py ... --driver_only --compile   # the driver eager and with --enable_torch_compile

With --compile the driver also runs with --enable_torch_compile, interleaved with the eager runs; its first
step includes the compilation, so compare the steps after the first.

The driver's forward, backward and optimizer step (DeepSpeedEngine's methods) are timed separately over the
optimizer steps after the first; `rest` is the driver's time outside them (data, loss, logging).

Each loop runs --repeats times, interleaved, and the best is reported (the machine may be shared); CPU
seconds per step (process time, all threads) are reported too, being far less sensitive to other load.
Both sides time the same steps (the first one included, as the driver's raw_train_time does); model
init, DeepSpeed initialize and shard writing are outside the timed window. Prints a table; asserts nothing.
"""

import argparse
import gc
import json
import os
import resource
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import run_pretraining
from data.shard_format import write_shard
from modeling import BertConfig, BertForPreTraining, BertPretrainingCriterion
from optimization import build_optimizer, get_parameter_groups
from schedulers import PolyWarmUpScheduler

MODEL_CONFIG = Path(__file__).resolve().parent.parent / "scripts" / "bert_tiny_config.json"


def synthetic_arrays(num_samples, seq_len, max_pred, vocab_size, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, vocab_size, (num_samples, seq_len)).astype(np.int32)
    positions = np.sort(np.stack([rng.choice(np.arange(1, seq_len), max_pred, replace=False)
                                  for _ in range(num_samples)]), axis=1).astype(np.int32)
    return {"input_ids": ids, "input_mask": np.ones_like(ids, dtype=np.int8),
            "segment_ids": np.zeros_like(ids, dtype=np.int8), "masked_lm_positions": positions,
            "masked_lm_ids": np.take_along_axis(ids, positions, 1),
            "next_sentence_labels": rng.integers(0, 2, num_samples).astype(np.int8)}


def time_driver(args, work: Path, compiled: bool = False) -> tuple:
    """(steps/s from run_pretraining's raw_train_time, CPU seconds per step of the training loop, summary,
    breakdown of the optimizer steps after the first: seconds per step in forward, backward, step, the rest)."""
    ds_config = work / "ds.json"
    ds_config.write_text(json.dumps({
        "train_batch_size": args.micro * args.gas, "train_micro_batch_size_per_gpu": args.micro,
        "bf16": {"enabled": args.bf16}, "gradient_clipping": 0.0, "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}))
    common = ["--input_dir", str(work / "shards"), "--config_file", str(args.model_config), "--optimizer", "lans",
              "--use_lr_scheduler", "--learning_rate", "0.001", "--max_predictions_per_seq", str(args.max_pred),
              "--skip_checkpoint", "--disable_progress_bar", "--no_cuda", "--deepspeed",
              "--deepspeed_config", str(ds_config), "--max_steps", str(args.steps)]
    common += ["--enable_torch_compile"] if compiled else []
    # The previous run's engine lives on in DeepSpeed's reference cycles: free it now, not when the collector
    # next runs, which may be inside this run's compilation (its finalizer is slow under fake tensors).
    gc.collect()
    cpu, train = {}, run_pretraining.train

    def timed_train(*train_args):
        start = time.process_time()  # every thread of the process, the prefetcher included
        result = train(*train_args)
        cpu["seconds"] = time.process_time() - start
        return result

    run_pretraining.train = timed_train
    try:
        with engine_phase_timers(args.gas) as step_ends:
            summary = run_pretraining.main(common + ["--output_dir", str(work / "out"), "--log_freq", str(args.steps),
                                                     "--json-summary", str(work / "driver.json")])
    finally:
        run_pretraining.train = train
    (first_end, first), (last_end, last) = step_ends[0], step_ends[-1]
    steps = len(step_ends) - 1
    breakdown = {phase: (last[phase] - first[phase]) / steps for phase in PHASES}
    breakdown["rest"] = (last_end - first_end) / steps - sum(breakdown.values())
    return args.steps / summary["raw_train_time"], cpu["seconds"] / args.steps, summary, breakdown


PHASES = ("forward", "backward", "step")  # DeepSpeedEngine's methods the driver calls per micro-batch


@contextmanager
def engine_phase_timers(gas: int):
    """Times DeepSpeedEngine.forward/backward/step; yields a list that gets, at each optimizer step's end,
    (time, seconds spent so far in each phase)."""
    import deepspeed
    spent, step_ends, originals = dict.fromkeys(PHASES, 0.0), [], {}
    micro_steps = [0]

    def timed(phase):
        def method(engine, *method_args, **kwargs):
            start = time.perf_counter()
            result = originals[phase](engine, *method_args, **kwargs)
            spent[phase] += time.perf_counter() - start
            if phase == "step":
                micro_steps[0] += 1
                if micro_steps[0] % gas == 0:
                    step_ends.append((time.perf_counter(), dict(spent)))
            return result
        return method

    for phase in PHASES:
        originals[phase] = getattr(deepspeed.DeepSpeedEngine, phase)
        setattr(deepspeed.DeepSpeedEngine, phase, timed(phase))
    try:
        yield step_ends
    finally:
        for phase in PHASES:
            setattr(deepspeed.DeepSpeedEngine, phase, originals[phase])


def time_plain_loop(args, arrays) -> tuple:
    """(steps/s, CPU seconds per step) of forward + loss + backward (--gas micro-batches) + LANS + scheduler
    on in-memory batches."""
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_json_file(args.model_config))
    if args.bf16:
        model = model.to(torch.bfloat16)
    optimizer = build_optimizer("lans", get_parameter_groups(model), 0.001)
    scheduler = PolyWarmUpScheduler(optimizer, warmup=0.01, total_steps=args.steps)
    criterion = BertPretrainingCriterion()
    batches = []
    for micro_step in range(args.steps * args.gas):
        rows = {k: v[micro_step * args.micro:(micro_step + 1) * args.micro] for k, v in arrays.items()}
        labels = np.full(rows["input_ids"].shape, -1, dtype=np.int64)
        np.put_along_axis(labels, rows["masked_lm_positions"], rows["masked_lm_ids"], 1)
        batches.append([torch.from_numpy(np.asarray(x, dtype=np.int64)) for x in
                        (rows["input_ids"], rows["segment_ids"], rows["input_mask"], labels,
                         rows["next_sentence_labels"])])
    start, cpu_start = time.perf_counter(), time.process_time()
    for micro_step, (input_ids, segment_ids, input_mask, labels, nsp) in enumerate(batches):
        scores, nsp_scores = model(input_ids, segment_ids, input_mask, masked_lm_labels=labels)
        loss = criterion(scores, nsp_scores, labels, nsp)
        (loss / args.gas).backward()
        if (micro_step + 1) % args.gas:
            continue
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        float(loss.detach())  # the driver synchronises on the loss once per step too
    return args.steps / (time.perf_counter() - start), (time.process_time() - cpu_start) / args.steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--micro", type=int, default=32)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--max_pred", type=int, default=20)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each loop (best is reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least disturbed by other load)")
    parser.add_argument("--config", default=str(MODEL_CONFIG), help="model config JSON (default: the tiny one)")
    parser.add_argument("--layers", type=int, default=None, help="override the config's num_hidden_layers")
    parser.add_argument("--gas", type=int, default=1, help="gradient accumulation: micro-batches per optimizer step")
    parser.add_argument("--driver_only", action="store_true", help="time the driver only (no plain loop)")
    parser.add_argument("--compile", action="store_true", help="also time the driver with --enable_torch_compile")
    args = parser.parse_args()
    # Both sides run on the CPU (the driver with --no_cuda), also on a GPU server; DeepSpeed picks its
    # accelerator at its first import, which engine_phase_timers makes before the driver can choose it.
    os.environ["DS_ACCELERATOR"] = "cpu"
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    arrays = synthetic_arrays(args.micro * args.gas * args.steps, args.seq_len, args.max_pred, 30522)
    driver_runs, compiled_runs, plain_runs = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        model_config = json.loads(Path(args.config).read_text())
        model_config["num_hidden_layers"] = args.layers or model_config["num_hidden_layers"]
        args.model_config = Path(tmp) / "model_config.json"
        args.model_config.write_text(json.dumps(model_config))
        (Path(tmp) / "shards").mkdir()
        write_shard(Path(tmp) / "shards" / "bench_training_0.hdf5", arrays)
        for repeat in range(args.repeats):  # interleaved, best of each: the machine's load varies
            work = Path(tmp) / f"run{repeat}"
            work.mkdir()
            (work / "shards").symlink_to(Path(tmp) / "shards")
            driver_runs.append(time_driver(args, work))
            if args.compile:
                (work / "compiled").mkdir()
                (work / "compiled" / "shards").symlink_to(Path(tmp) / "shards")
                compiled_runs.append(time_driver(args, work / "compiled", compiled=True))
            if not args.driver_only:
                plain_runs.append(time_plain_loop(args, arrays))
    report(args, load_before, driver_runs, compiled_runs, plain_runs)


def report(args, load_before, driver_runs, compiled_runs, plain_runs):
    precision = "bf16" if args.bf16 else "fp32"
    print(f"threads={torch.get_num_threads()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')} "
          f"micro={args.micro} gas={args.gas} seq_len={args.seq_len} steps={args.steps} {precision} "
          f"ZeRO-{args.stage} layers={args.layers or 'as in --config'}")
    print(f"{'loop':<36}{'steps/s (best)':>16}{'CPU s/step (best)':>20}   all runs (steps/s, CPU s/step)")
    loops = [("run_pretraining.py (DeepSpeed)", driver_runs)]
    loops += [("run_pretraining.py --enable_torch_compile", compiled_runs)] if compiled_runs else []
    loops += [("plain PyTorch loop (no DeepSpeed)", plain_runs)] if plain_runs else []
    for name, runs in loops:
        listed = ", ".join(f"({r:.3f}, {c:.2f})" for r, c, *_ in runs)
        print(f"{name:<36}{max(r[0] for r in runs):>16.3f}{min(r[1] for r in runs):>20.3f}   {listed}")
    print(f"load average before: {tuple(round(x, 2) for x in load_before)}, "
          f"after: {tuple(round(x, 2) for x in os.getloadavg())}; "
          f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    if plain_runs:
        print(f"steps/s ratio driver / plain = {max(r[0] for r in driver_runs) / max(r[0] for r in plain_runs):.3f}; "
              f"CPU time per step ratio driver / plain = "
              f"{min(r[1] for r in driver_runs) / min(r[1] for r in plain_runs):.3f}")
    eager_step = report_mfu(args, "driver", driver_runs)
    if compiled_runs:
        compiled_step = report_mfu(args, "driver --enable_torch_compile", compiled_runs)
        per_repeat = ", ".join(f"{sum(e[3].values()) / sum(c[3].values()):.3f}"
                               for e, c in zip(driver_runs, compiled_runs))
        print(f"steps after the first, eager / compiled step time = {eager_step / compiled_step:.3f} "
              f"(best runs; per repeat: {per_repeat})")


def report_mfu(args, name, runs) -> float:
    """Prints the best run's MFU, all steps and steady; returns its seconds per step after the first."""
    _, _, summary, breakdown = max(runs, key=lambda run: run[2]["mfu"])
    peak = summary["model_tflops"] / summary["mfu"]
    print(f"{name} (best run): {summary['training_sequences_per_second']:.3f} sequences/s, "
          f"{summary['model_tflops']:.4f} model TFLOP/s, MFU {summary['mfu']:.1%} of the {peak:.3f} TFLOP/s peak the "
          f"driver measured at start-up (its log says which product); all steps, the first included")
    step_time = sum(breakdown.values())
    steady_tflops = (args.micro * args.gas / step_time * summary["model_tflops"]
                     / summary["training_sequences_per_second"])
    print(f"{name}, steps after the first: {step_time:.3f} s per optimizer step, MFU {steady_tflops / peak:.1%}; "
          + ", ".join(f"{phase} {seconds:.3f} s ({seconds / step_time:.1%})" for phase, seconds in breakdown.items())
          + " (rest: the driver outside DeepSpeed's forward/backward/step: data, loss, logging)")
    return step_time


if __name__ == "__main__":
    main()
