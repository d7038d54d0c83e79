"""Benchmark data/create_pretraining_data.py against NVIDIA's create_pretraining_data.py.

    python bench/bench_data.py --nvidia_dir PATH [--phases 128:20,512:80] [--runs 2] [--repeat 8]

PATH is a checkout of NVIDIA's DeepLearningExamples (or its PyTorch/LanguageModeling/BERT folder, or
any folder holding its create_pretraining_data.py with its tokenization.py and file_utils.py); the
benchmark fetches nothing. Measured with DeepLearningExamples @729963dd:

    git clone https://github.com/NVIDIA/DeepLearningExamples && git -C DeepLearningExamples checkout 729963dd

Both tools run on the same text shards (the committed sample corpus taken through the real pipeline
up to sharding, ``--repeat`` times over) with the same settings, one process each, alternating
``--runs`` times per phase, each under /usr/bin/time -v. Reported: sequences per CPU-second
(user + system time, so extra processes cannot raise it; robust on a shared machine), wall time and
peak resident memory, and ours over NVIDIA's per alternating pair. A last run of ours on a
``--memory_repeat`` times larger input shows that its peak memory does not grow with the input.
Without --nvidia_dir only our tool is measured.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = REPO / "data" / "vocab.txt"
NVIDIA_SCRIPT = "create_pretraining_data.py"
NVIDIA_SUBDIR = Path("PyTorch/LanguageModeling/BERT")


def find_nvidia_script(path):
    """NVIDIA's create_pretraining_data.py in a checkout, its BERT folder, or a folder holding it."""
    for folder in (Path(path), Path(path) / NVIDIA_SUBDIR):
        if (folder / NVIDIA_SCRIPT).is_file() and (folder / "tokenization.py").is_file():
            return folder / NVIDIA_SCRIPT
    raise SystemExit(f"bench_data.py: error: no {NVIDIA_SCRIPT} with tokenization.py in {path} or "
                     f"{Path(path) / NVIDIA_SUBDIR}")


def prepare_text_shards(work, n_shards, repeat):
    """Sample corpus -> formatted -> sentence-split text shards (the real pipeline), repeated ``repeat`` times."""
    env = dict(os.environ, BERT_PREP_WORKING_DIR=str(work),
               WIKI_DUMP_URL=str(REPO / "data/sample/enwiki_sample.xml.bz2"), BOOKS_DIR=str(REPO / "data/sample/books"),
               N_TRAINING_SHARDS=str(n_shards), N_TEST_SHARDS="0", FRACTION_TEST_SET="0", N_PROCESSES="2")
    if not any(work.glob("sharded_*")):
        steps = [("bookscorpus", "download"), ("bookscorpus", "text_formatting"), ("wikicorpus_en", "download"),
                 ("wikicorpus_en", "text_formatting"), ("books_wiki_en_corpus", "sharding")]
        for dataset, action in steps:
            subprocess.run([sys.executable, str(REPO / "data/bert_prep.py"), "--action", action, "--dataset", dataset],
                           env=env, check=True, capture_output=True)
    shards = next(work.glob("sharded_*")) / "books_wiki_en_corpus"
    repeated = work / f"text_x{repeat}"
    repeated.mkdir(exist_ok=True)
    for path in shards.glob("*.txt"):
        text = path.read_text(encoding="utf-8")
        (repeated / path.name).write_text(text * repeat, encoding="utf-8")
    return repeated


def timed(command):
    """Run under /usr/bin/time -v; return (stdout+stderr, wall s, CPU s, peak RSS MiB of the largest process)."""
    result = subprocess.run(["/usr/bin/time", "-v", *command], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"bench_data.py: error: {' '.join(command[:2])} failed:\n{result.stderr[-2000:]}")
    report = result.stderr

    def field(name):
        return re.search(rf"{re.escape(name)}: (.+)", report).group(1).strip()

    wall = sum(float(x) * 60 ** i for i, x in enumerate(reversed(field("Elapsed (wall clock) time (h:mm:ss or m:ss)")
                                                                  .split(":"))))
    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    return result.stdout + report, wall, cpu, int(field("Maximum resident set size (kbytes)")) / 1024


def settings_flags(args, seq_len, max_pred):
    return ["--max_seq_length", str(seq_len), "--max_predictions_per_seq", str(max_pred),
            "--masked_lm_prob", str(args.masked_lm_prob), "--dupe_factor", str(args.dupe_factor),
            "--short_seq_prob", str(args.short_seq_prob), "--random_seed", str(args.random_seed)]


def measure_ours(args, phase, text_dir, out_dir):
    output, wall, cpu, rss = timed([sys.executable, str(REPO / "data/create_pretraining_data.py"),
                                    "--input_file", str(text_dir), "--output_file", str(out_dir), "--overwrite",
                                    "--vocab_file", str(VOCAB), "--n_processes", str(args.n_processes),
                                    *settings_flags(args, *phase)])
    return int(re.search(r"wrote \d+ shard\(s\), (\d+) instances", output).group(1)), wall, cpu, rss


def measure_nvidia(args, phase, text_dir, out_file):
    """NVIDIA's script on every *.txt of text_dir, into one HDF5 file (its way)."""
    import h5py

    _, wall, cpu, rss = timed([sys.executable, str(args.nvidia_script), "--input_file", str(text_dir),
                               "--output_file", str(out_file), "--vocab_file", str(VOCAB), "--do_lower_case",
                               *settings_flags(args, *phase)])
    with h5py.File(out_file, "r") as f:
        return f["input_ids"].shape[0], wall, cpu, rss


def report(name, sequences, wall, cpu, rss):
    print(f"{name:<40} {sequences:>10} {wall:>8.1f} {cpu:>8.1f} {sequences / cpu:>12.0f} {rss:>10.0f}", flush=True)
    return sequences / cpu


def bench_phase(args, phase, text, work):
    """Alternating runs of NVIDIA's script and ours on one phase; returns ours / NVIDIA per pair."""
    ratios = []
    for run in range(args.runs):
        nvidia = None
        if args.nvidia_script:
            nvidia = report(f"NVIDIA's, {phase[0]}/{phase[1]}, run {run + 1}",
                            *measure_nvidia(args, phase, text, work / f"nvidia_{phase[0]}.hdf5"))
        ours = report(f"ours ({args.n_processes} proc), {phase[0]}/{phase[1]}, run {run + 1}",
                      *measure_ours(args, phase, text, work / f"ours_{phase[0]}"))
        if nvidia:
            ratios.append(ours / nvidia)
    if ratios:
        print(f"phase {phase[0]}/{phase[1]}: ours / NVIDIA's sequences per CPU-second: "
              + ", ".join(f"{r:.1f}x" for r in ratios), flush=True)
    return ratios


def parse_phases(text):
    try:
        phases = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        phases = []
    if not phases or any(len(phase) != 2 for phase in phases):
        raise argparse.ArgumentTypeError(f"expected SEQ:PRED[,SEQ:PRED...], got {text!r}")
    return phases


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvidia_dir", help="DeepLearningExamples checkout (or the folder of NVIDIA's script)")
    parser.add_argument("--phases", type=parse_phases, default=[(128, 20), (512, 80)],
                        help="max_seq_length:max_predictions_per_seq pairs (default 128:20,512:80)")
    parser.add_argument("--runs", type=int, default=2, help="alternating runs per phase")
    parser.add_argument("--masked_lm_prob", type=float, default=0.15)
    parser.add_argument("--dupe_factor", type=int, default=5)
    parser.add_argument("--short_seq_prob", type=float, default=0.1)
    parser.add_argument("--random_seed", type=int, default=12345)
    parser.add_argument("--n_shards", type=int, default=1, help="text shards the sample corpus is cut into")
    parser.add_argument("--n_processes", type=int, default=1, help="workers for ours (CPU time is what counts)")
    parser.add_argument("--repeat", type=int, default=8,
                        help="repeat the sample text this many times (8: ~11 MiB; real shards are larger)")
    parser.add_argument("--memory_repeat", type=int, default=4, help="input size multiple for the memory run")
    args = parser.parse_args(argv)
    args.nvidia_script = find_nvidia_script(args.nvidia_dir) if args.nvidia_dir else None
    return args


def main(argv=None):
    args = parse_arguments(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        text = prepare_text_shards(work, args.n_shards, args.repeat)
        size = sum(p.stat().st_size for p in text.glob("*.txt")) / 2 ** 20
        print(f"input: {size:.1f} MiB of sentence-split text in {args.n_shards} shard(s), dupe_factor "
              f"{args.dupe_factor}; NVIDIA's script: {args.nvidia_script or 'not given (--nvidia_dir)'}; "
              f"{time.strftime('%H:%M:%S')}")
        print(f"{'run':<40} {'sequences':>10} {'wall s':>8} {'CPU s':>8} {'seq/CPU-s':>12} {'peak MiB':>10}")
        for phase in args.phases:
            bench_phase(args, phase, text, work)
        big = prepare_text_shards(work, args.n_shards, args.repeat * args.memory_repeat)
        big_size = sum(p.stat().st_size for p in big.glob("*.txt")) / 2 ** 20
        for phase in args.phases:
            report(f"ours on {big_size:.0f} MiB, {phase[0]}/{phase[1]}", *measure_ours(args, phase, big, work / "big"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
