"""First run on a new server: does this machine train BERT-1.5B as it should? Run it first on a fresh Gaudi
or GPU machine, from the repository root, in the project's environment:

    python bench/first_run.py --use_hpu      # a Gaudi, lazy mode: the eager pass
    PT_HPU_LAZY_MODE=0 python bench/first_run.py --use_hpu   # a Gaudi, compile mode: the compile pass
    python bench/first_run.py                # an NVIDIA GPU (or, without one, the CPU)
    python bench/first_run.py --tiny --no_cuda --modes eager   # the tiny config on the CPU (what CI runs)

It builds the sample data (data/create_datasets_from_start.sh sample, phase 1: seq 128, 20 predictions),
then runs the real driver (run_pretraining.py's main, one device, bf16, ZeRO-1, LANS) for --steps steps at
BERT-1.5B widths with 2 layers, then with the full BERT-1.5B config, in eager mode and, where the driver
has --enable_torch_compile, in compile mode, each run in a process of its own (as a launcher starts it).
On a Gaudi the bridge's mode is fixed for the process by PT_HPU_LAZY_MODE, so one command runs one of the
two as the launchers do: lazy mode (1, or unset) the eager pass, 0 the compile pass; the other is reported
as SKIP with the command that runs it. For each run it prints
- sequences/s and MFU: the median over the steps after the first (the first one warms up or compiles),
  from the driver's own per-step records; MFU is against the device's datasheet bf16 peak
  (hardware.DATASHEET_BF16_TFLOPS), or, on the CPU or a device without a datasheet figure there (an H200,
  for one), the peak the driver measures at start-up: the verdict line says which, and the figure;
- the peak of allocated tensor bytes of the run (hardware.PeakAllocated) against the memory planner's
  prediction (sizing.device_memory, which scripts/plan_memory.py prints); on the CPU that count comes from
  the torch profiler, which slows the run: there the sequences/s are not the driver's speed, and a block
  freed on a thread the profiler does not follow makes the figure a range (PeakAllocated), which passes
  when it meets the expected range;
- one verdict line per check, PASS or FAIL against the expected range printed with it.
The expected ranges are our expectations, not measurements: we have measured none of this on a GPU or a
Gaudi. A run the planner says does not fit the device is reported as SKIP; one still going after --run_timeout_s
is stopped and reported as FAIL. Exit status 1 if a check fails.
"""

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import run_pretraining
from modeling import BertConfig
from training import gaudi, hardware, sizing

REPO_ROOT = Path(__file__).resolve().parent.parent

SEQ_LEN, MAX_PRED = 128, 20  # phase 1 of the sample data
DATASET = ("hdf5_lower_case_1_seq_len_128_max_pred_20_masked_lm_prob_0.15_random_seed_12345_dupe_factor_5/"
           "books_wiki_en_corpus")
# (name, model config, micro-batch on an accelerator, micro-batch on the CPU)
FULL_RUNS = (("BERT-1.5B widths, 2 layers", REPO_ROOT / "bench" / "bert_1.5b_widths_2_layers.json", 32, 8),
             ("BERT-1.5B", REPO_ROOT / "scripts" / "bert_1.5b_config.json", 32, 8))
TINY_RUNS = (("tiny", REPO_ROOT / "scripts" / "bert_tiny_config.json", 8, 8),)
# Expected ranges (inclusive). MFU: a BERT-1.5B step is large matrix products, so on an accelerator we
# expect at least a fifth of the datasheet peak; the CPU's peak is measured on the model's own shapes.
# The tiny model's products are too small for any MFU figure to mean much: only that it is positive.
MFU_RANGE = {"accelerator": (0.20, 1.0), "cpu": (0.10, 1.0), "tiny": (1e-6, 1.0)}
# The 2-layer run's step is small on an accelerator (about 1.8 TFLOP at micro-batch 32, under 2 ms of an H100's
# datasheet peak), so LANS's memory-bound update and the per-step overheads weigh as much as its products:
# its floor only catches a run far off (the CPU, or fp32 products, stay under it).
ACCELERATOR_MFU_RANGE_BY_RUN = {"BERT-1.5B widths, 2 layers": (0.05, 1.0)}
# Measured peak / planned peak: tests/test_sizing.py holds the planner to 15 % on the CPU; on an accelerator
# fused attention may keep less than the planned S x S probabilities.
MEMORY_RATIO_RANGE = {"accelerator": (0.6, 1.15), "cpu": (0.85, 1.15)}
MODES = ("eager", "compile")
RESULT_FILE = "first_run_result.json"  # in each run's directory: what the run's own process measured


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(prog="first_run.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--use_hpu", action="store_true", help="Run on a Gaudi (as run_pretraining.py).")
    parser.add_argument("--no_cuda", action="store_true", help="Run on the CPU even if CUDA is available.")
    parser.add_argument("--tiny", action="store_true", help="The tiny config only (CI, with --no_cuda).")
    parser.add_argument("--modes", default="eager,compile", help="eager, compile or both (compile only where the "
                        "driver has --enable_torch_compile).")
    parser.add_argument("--steps", type=int, default=5, help="Optimizer steps per run (at least 2).")
    parser.add_argument("--run_timeout_s", type=float, default=3600, help="Seconds each run may take, start-up "
                        "and compilation included; a run still going then is stopped and its verdict is FAIL "
                        "(0: no limit).")
    parser.add_argument("--work_dir", default=None, help="Sample data and run outputs (default: a temporary "
                        "directory, removed at the end).")
    parser.add_argument("--one_run", default=None, help=argparse.SUPPRESS)  # INDEX:MODE, in the child (run_in_child)
    args = parser.parse_args(argv)
    unknown = [mode for mode in args.modes.split(",") if mode not in MODES]
    if unknown:
        parser.error(f"--modes takes {', '.join(MODES)} or both, comma-separated; got {args.modes!r}")
    if args.work_dir and Path(args.work_dir).exists() and not Path(args.work_dir).is_dir():
        parser.error(f"--work_dir {args.work_dir} exists and is not a directory")
    if args.run_timeout_s < 0:
        parser.error(f"--run_timeout_s must be 0 (no limit) or positive, got {args.run_timeout_s}")
    if args.steps < 2:
        parser.error(f"--steps must be at least 2 (the first step is left out of the figures), got {args.steps}")
    return args


def sample_data_dir(work_dir: Path) -> Path:
    """Where build_sample_data leaves the shards the runs read."""
    return work_dir / "data" / DATASET


def build_sample_data(work_dir: Path) -> None:
    subprocess.run(["bash", str(REPO_ROOT / "data" / "create_datasets_from_start.sh"), "sample"], check=True,
                   env=dict(os.environ, BERT_PREP_WORKING_DIR=str(work_dir / "data"), PHASES="1",
                            PYTHON=sys.executable), stdout=subprocess.DEVNULL)


def driver_accepts(flag: str) -> bool:
    return any(flag in action.option_strings for action in run_pretraining.build_parser()._actions)


def dllogger_records(json_summary: Path) -> list:
    return [json.loads(line.split(" ", 1)[1]) for line in json_summary.read_text().splitlines()
            if line.startswith("DLLL ")]


def step_records(json_summary: Path) -> list:
    """The driver's per-step dllogger records (one per step with --log_freq 1), in order."""
    records = []
    for record in dllogger_records(json_summary):
        data = record.get("data", {})
        if isinstance(record.get("step"), list) and len(record["step"]) == 2 and "average_perf_per_step" in data \
                and "final_loss" not in data:
            records.append(data)
    return records


def mfu_peak(json_summary: Path) -> tuple:
    """(TFLOP/s, where it comes from) of the peak the driver's MFU is against: its PARAMETER record. The
    source's first clause only: "datasheet bf16 peak of NVIDIA H100 80GB HBM3", "measured at start-up" (a
    device without a datasheet figure, an H200 for one, or the CPU) or "--peak_tflops"."""
    data = next(record["data"] for record in dllogger_records(json_summary) if "peak_tflops" in record.get("data", {}))
    return data["peak_tflops"], data["peak_tflops_source"].split(":")[0]


def run_directory(work_dir: Path, name: str, mode: str) -> Path:
    return work_dir / f"{name.replace(' ', '_').replace(',', '')}_{mode}"


class TimedOut(float):
    """run_in_child's result for a run stopped after --run_timeout_s (the value, in seconds)."""


def run_in_child(args, work_dir: Path, index: int, mode: str, device_type: str):
    """Run `index` of the list in `mode` in a process of its own; returns run_once's result, a SKIP line, the
    child's exit status (an int) when it failed, or TimedOut when it ran past --run_timeout_s (a hang, say in a
    collective or a compilation, must not hang the check: the child is killed). Its own process, because the
    driver's DeepSpeed engine outlives run_pretraining.main (its hooks keep it alive): in one process every run
    would start with the models and optimizer states of the runs before it on the device, which the allocator's
    peak counts, and the full config could run out of memory on what the 2-layer runs left."""
    name = (TINY_RUNS if args.tiny else FULL_RUNS)[index][0]
    result_file = run_directory(work_dir, name, mode) / RESULT_FILE
    result_file.unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--one_run", f"{index}:{mode}", "--steps", str(args.steps),
            "--work_dir", str(work_dir)]
    argv += ["--tiny"] * args.tiny + ["--use_hpu"] * args.use_hpu + ["--no_cuda"] * (device_type == "cpu")
    try:
        status = subprocess.run(argv, timeout=args.run_timeout_s or None).returncode
    except subprocess.TimeoutExpired:  # subprocess.run has killed the child and waited for it
        return TimedOut(args.run_timeout_s)
    if status != 0 or not result_file.exists():
        return status or 1
    result = json.loads(result_file.read_text())
    return result["skip"] if "skip" in result else tuple(result["figures"])


def one_run(args, device_type: str) -> int:
    """The child of run_in_child: runs one run, writes its result to its run directory."""
    index, mode = args.one_run.split(":")
    name, config, accelerator_micro, cpu_micro = (TINY_RUNS if args.tiny else FULL_RUNS)[int(index)]
    work_dir = Path(args.work_dir)
    try:
        result = run_once(args, work_dir, sample_data_dir(work_dir), name, config,
                          cpu_micro if device_type == "cpu" else accelerator_micro, mode, device_type)
    except run_pretraining.InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    (run_directory(work_dir, name, mode) / RESULT_FILE).write_text(
        json.dumps({"skip": result} if isinstance(result, str) else {"figures": result}))
    return 0


def run_once(args, work_dir: Path, data_dir: Path, name: str, config: Path, micro: int, mode: str, device_type: str):
    """One driver run; returns (sequences/s, MFU, measured peak bytes (low, high: PeakAllocated), planned peak
    bytes, final loss, the MFU's peak in TFLOP/s, where that peak comes from), or a SKIP line when the planner
    says it does not fit."""
    run_dir = run_directory(work_dir, name, mode)
    ds_config = run_dir / "ds.json"
    run_dir.mkdir(parents=True, exist_ok=True)
    ds = {"train_batch_size": micro, "train_micro_batch_size_per_gpu": micro, "bf16": {"enabled": True},
          "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10 ** 9}
    ds_config.write_text(json.dumps(ds))
    plan = sizing.TrainingSetup.from_deepspeed_config(dict(ds, gradient_accumulation_steps=1), 1, SEQ_LEN, MAX_PRED,
                                                      0, "lans", on_cpu=device_type == "cpu")
    planned = sizing.device_memory(BertConfig.from_json_file(config), plan)["total"]
    argv = ["--input_dir", str(data_dir), "--output_dir", str(run_dir / "checkpoints"), "--config_file", str(config),
            "--json-summary", str(run_dir / "dllogger.json"), "--optimizer", "lans", "--use_lr_scheduler",
            "--learning_rate", "0.0015", "--warmup_proportion", "0.05", "--max_steps", "1000",
            "--steps_this_run", str(args.steps), "--max_predictions_per_seq", str(MAX_PRED), "--log_freq", "1",
            "--skip_checkpoint", "--disable_progress_bar", "--deepspeed", "--deepspeed_config", str(ds_config)]
    argv += (["--use_hpu"] * args.use_hpu + ["--no_cuda"] * (device_type == "cpu")
             + ["--enable_torch_compile"] * (mode == "compile"))
    try:
        with hardware.PeakAllocated(torch.device(device_type)) as measured:
            summary = run_pretraining.main(argv)
    except run_pretraining.InputError as err:
        if "memory planner" in str(err):
            return f"SKIP {name}, {mode}: {err}"
        raise
    later = step_records(run_dir / "dllogger.json")[1:]
    return (statistics.median(r["average_perf_per_step"] for r in later), statistics.median(r["mfu"] for r in later),
            (measured.low_bytes, measured.bytes), planned, summary["final_loss"],
            *mfu_peak(run_dir / "dllogger.json"))


def planned_modes(wanted: list, device_type: str, driver_compiles: bool, environ=os.environ) -> tuple:
    """(the modes to run, SKIP lines for the wanted ones left out). On a Gaudi, PT_HPU_LAZY_MODE fixes the
    bridge's mode for the whole process: the eager pass belongs to lazy mode (the launchers' default) and the
    compile pass to PT_HPU_LAZY_MODE=0 (the driver refuses compile mode under lazy mode); run in the other mode,
    the eager pass would be Habana's op-by-op eager mode, which no launcher runs."""
    modes, skipped = [mode for mode in MODES if mode in wanted], []
    if "compile" in modes and not driver_compiles:
        modes.remove("compile")
        skipped.append("SKIP compile mode: this driver has no --enable_torch_compile")
    if device_type == "hpu":
        lazy = gaudi.lazy_mode_requested(environ)
        left_out, run_it = (("compile", "PT_HPU_LAZY_MODE=0 python bench/first_run.py --use_hpu") if lazy else
                            ("eager", "PT_HPU_LAZY_MODE=1 python bench/first_run.py --use_hpu"))
        if left_out in modes:
            modes.remove(left_out)
            now = "lazy mode (PT_HPU_LAZY_MODE=1 or unset)" if lazy else "compile mode (PT_HPU_LAZY_MODE=0)"
            skipped.append(f"SKIP {left_out} mode: this process runs Gaudi's {now}, where the {left_out} pass does not "
                           f"belong; run it with: {run_it}")
    return modes, skipped


def verdict(check: str, ok: bool, text: str, expected: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {check}: {text} (expected {expected})")
    return ok


def main(argv=None) -> int:
    args = parse_arguments(argv)
    device_type = "hpu" if args.use_hpu else "cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu"
    kind = "tiny" if args.tiny else "cpu" if device_type == "cpu" else "accelerator"
    runs = TINY_RUNS if args.tiny else FULL_RUNS
    if args.one_run:
        return one_run(args, device_type)
    modes, skipped = planned_modes(args.modes.split(","), device_type, driver_accepts("--enable_torch_compile"))
    if modes and args.use_hpu and importlib.util.find_spec("habana_frameworks") is None:  # finds, imports nothing
        print("first_run.py: error: --use_hpu needs Habana's PyTorch bridge (habana_frameworks), which this "
              "Python cannot import: run it in the Gaudi software's environment", file=sys.stderr)
        return 2
    results = []
    if modes:
        with tempfile.TemporaryDirectory() as scratch:
            work_dir = Path(args.work_dir or scratch)
            print(f"== building the sample data in {work_dir / 'data'}", flush=True)  # before the builder's output
            try:
                build_sample_data(work_dir)
            except subprocess.CalledProcessError as err:
                print(f"first_run.py: error: building the sample data failed: data/create_datasets_from_start.sh "
                      f"sample exited with status {err.returncode} (its error is above)", file=sys.stderr)
                return 1
            for index, (name, _, accelerator_micro, cpu_micro) in enumerate(runs):
                micro = cpu_micro if device_type == "cpu" else accelerator_micro
                for mode in modes:
                    print(f"== {name}, micro-batch {micro}, {mode} mode, {args.steps} steps on {device_type}",
                          flush=True)  # before the child's output
                    results.append((name, mode, run_in_child(args, work_dir, index, mode, device_type)))
    print(f"== verdicts ({device_type}; figures: median of steps 2 to {args.steps})")
    for line in skipped:
        print(line)
    return 0 if report(results, device_type, kind) else 1


def report(results: list, device_type: str, kind: str) -> bool:
    """Prints the verdicts of each run's result (run_in_child's); True when none fails."""
    ok = True
    for name, mode, result in results:
        label = f"{name}, {mode}"
        if isinstance(result, str):
            print(result)
            continue
        if isinstance(result, TimedOut):
            print(f"FAIL {label}: the run did not end within --run_timeout_s {result:g} s and was stopped")
            ok = False
            continue
        if isinstance(result, int):
            print(f"FAIL {label}: the run exited with status {result} (its error is above)")
            ok = False
            continue
        sequences, mfu, measured, planned, loss, peak, peak_source = result
        ok &= verdict(f"{label}: finite loss", math.isfinite(loss), f"final loss {loss:.4f}", "a finite loss")
        low, high = (ACCELERATOR_MFU_RANGE_BY_RUN.get(name, MFU_RANGE[kind]) if kind == "accelerator"
                     else MFU_RANGE[kind])  # printed in percent, as the MFU is
        ok &= verdict(f"{label}: MFU", low <= mfu <= high, f"{sequences:.1f} sequences/s, MFU {mfu:.1%} of "
                      f"{peak:.4g} TFLOP/s ({peak_source})", f"{low * 100:.4g}% to {high * 100:.4g}%")
        low, high = MEMORY_RATIO_RANGE["cpu" if device_type == "cpu" else "accelerator"]
        least, most = measured
        least_ratio, most_ratio = least / planned, most / planned
        text = (f"measured {least / 2**30:.2f} GiB, planned {planned / 2**30:.2f} GiB, ratio {least_ratio:.2f}"
                if least == most else
                f"measured {least / 2**30:.2f} to {most / 2**30:.2f} GiB (blocks freed on a thread the profiler "
                f"does not follow), planned {planned / 2**30:.2f} GiB, ratio {least_ratio:.2f} to {most_ratio:.2f}")
        ok &= verdict(f"{label}: peak memory / planned", least_ratio <= high and most_ratio >= low, text,
                      f"{low:g} to {high:g}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
