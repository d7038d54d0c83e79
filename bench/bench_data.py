"""Benchmark data/create_pretraining_data.py against a plain single-process pure-Python baseline.

    python bench/bench_data.py [--dupe_factor 5] [--max_seq_length 128] [--repeat 8] [--memory_repeat 4]

Both run on the same text shards (the committed sample corpus taken through the real pipeline up to
sharding, optionally repeated) with the same settings, each in its own subprocess under
/usr/bin/time -v. Reported: sequences per CPU-second (= per core, robust on a shared machine),
wall time, and the peak resident memory of the largest process. A last run of ours on a
``--memory_repeat`` times larger input shows that its peak memory does not grow with the input.

The baseline is the reference's way: python BasicTokenizer + WordPiece (transformers'
BertTokenizerLegacy, the same code as the reference's tokenization.py), lists of token strings,
one random.Random, every instance of a shard held in memory, then one h5py write.
"""
import argparse
import collections
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = REPO / "data" / "vocab.txt"
Instance = collections.namedtuple("Instance", "tokens segment_ids is_random_next positions labels")


# ---------------------------------------------------------------- baseline (pure Python, one process)
def baseline_documents(path, tokenizer):
    documents = [[]]
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                documents.append([])
                continue
            tokens = tokenizer.tokenize(line)
            if tokens:
                documents[-1].append(tokens)
    return [d for d in documents if d]


def baseline_truncate(tokens_a, tokens_b, max_num_tokens, rng):
    while len(tokens_a) + len(tokens_b) > max_num_tokens:
        longer = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def baseline_mask(tokens, args, vocab_words, rng):
    candidates = [i for i, t in enumerate(tokens) if t not in ("[CLS]", "[SEP]")]
    rng.shuffle(candidates)
    count = min(args.max_predictions_per_seq, max(1, int(round(len(tokens) * args.masked_lm_prob))))
    output, chosen = list(tokens), sorted(candidates[:count])
    for index in candidates[:count]:
        if rng.random() < 0.8:
            output[index] = "[MASK]"
        elif rng.random() >= 0.5:
            output[index] = vocab_words[rng.randint(0, len(vocab_words) - 1)]
    return output, chosen, [tokens[i] for i in chosen]


def baseline_pair(document, chunk_start, i, documents, doc_index, target, rng):
    """Tokens A and B of the chunk document[chunk_start:i]; returns (a, b, is_random_next, next i)."""
    chunk = document[chunk_start:i]
    a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
    tokens_a = [t for segment in chunk[:a_end] for t in segment]
    if len(chunk) == 1 or rng.random() < 0.5:
        for _ in range(10):
            other = rng.randint(0, len(documents) - 1)
            if other != doc_index:
                break
        tokens_b, start = [], rng.randint(0, len(documents[other]) - 1)
        for segment in documents[other][start:]:
            tokens_b.extend(segment)
            if len(tokens_b) >= target - len(tokens_a):
                break
        return tokens_a, tokens_b, other != doc_index, chunk_start + a_end
    return tokens_a, [t for segment in chunk[a_end:] for t in segment], False, i


def baseline_instances(documents, doc_index, args, vocab_words, rng):
    max_num_tokens = args.max_seq_length - 3
    document = documents[doc_index]
    target = rng.randint(2, max_num_tokens) if rng.random() < args.short_seq_prob else max_num_tokens
    instances, chunk_start, length, i = [], 0, 0, 0
    while i < len(document):
        length += len(document[i])
        i += 1
        if i < len(document) and length < target:
            continue
        tokens_a, tokens_b, is_random, i = baseline_pair(document, chunk_start, i, documents, doc_index, target, rng)
        baseline_truncate(tokens_a, tokens_b, max_num_tokens, rng)
        tokens = ["[CLS]"] + tokens_a + ["[SEP]"] + tokens_b + ["[SEP]"]
        segments = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
        masked, positions, labels = baseline_mask(tokens, args, vocab_words, rng)
        instances.append(Instance(masked, segments, is_random, positions, labels))
        chunk_start, length = i, 0
    return instances


def baseline_write(path, instances, tokenizer, args):
    import h5py
    import numpy as np

    n, seq, pred = len(instances), args.max_seq_length, args.max_predictions_per_seq
    arrays = {"input_ids": np.zeros((n, seq), "i4"), "input_mask": np.zeros((n, seq), "i1"),
              "segment_ids": np.zeros((n, seq), "i1"), "masked_lm_positions": np.zeros((n, pred), "i4"),
              "masked_lm_ids": np.zeros((n, pred), "i4"), "next_sentence_labels": np.zeros(n, "i1")}
    for row, inst in enumerate(instances):
        ids = tokenizer.convert_tokens_to_ids(inst.tokens)
        arrays["input_ids"][row, :len(ids)] = ids
        arrays["input_mask"][row, :len(ids)] = 1
        arrays["segment_ids"][row, :len(ids)] = inst.segment_ids
        arrays["masked_lm_positions"][row, :len(inst.positions)] = inst.positions
        arrays["masked_lm_ids"][row, :len(inst.labels)] = tokenizer.convert_tokens_to_ids(inst.labels)
        arrays["next_sentence_labels"][row] = int(inst.is_random_next)
    with h5py.File(path, "w") as f:
        for key, value in arrays.items():
            f.create_dataset(key, data=value, compression="gzip")


def run_baseline(args):
    """Entry point of the baseline subprocess: every input shard, one after the other."""
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    tokenizer = BertTokenizerLegacy(str(VOCAB), do_lower_case=True)
    vocab_words = list(tokenizer.vocab.keys())
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    total = 0
    for path in sorted(Path(args.input_dir).glob("*.txt")):
        rng = random.Random(args.random_seed)
        documents = baseline_documents(path, tokenizer)
        rng.shuffle(documents)
        instances = [inst for _ in range(args.dupe_factor) for doc_index in range(len(documents))
                     for inst in baseline_instances(documents, doc_index, args, vocab_words, rng)]
        rng.shuffle(instances)
        baseline_write(Path(args.output_dir) / f"{path.stem}.hdf5", instances, tokenizer, args)
        total += len(instances)
    print(f"SEQUENCES {total}")


# ---------------------------------------------------------------- measurement
def prepare_text_shards(work, n_shards, repeat):
    """Sample corpus -> formatted -> sentence-split text shards (the real pipeline), repeated ``repeat`` times."""
    env = dict(os.environ, BERT_PREP_WORKING_DIR=str(work),
               WIKI_DUMP_URL=str(REPO / "data/sample/enwiki_sample.xml.bz2"), BOOKS_DIR=str(REPO / "data/sample/books"),
               N_TRAINING_SHARDS=str(n_shards), N_TEST_SHARDS="0", FRACTION_TEST_SET="0", N_PROCESSES="2")
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
        raise RuntimeError(f"{command} failed:\n{result.stderr[-2000:]}")
    report = result.stderr

    def field(name):
        return re.search(rf"{re.escape(name)}: (.+)", report).group(1).strip()

    wall = sum(float(x) * 60 ** i for i, x in enumerate(reversed(field("Elapsed (wall clock) time (h:mm:ss or m:ss)")
                                                                  .split(":"))))
    cpu = float(field("User time (seconds)")) + float(field("System time (seconds)"))
    return result.stdout + report, wall, cpu, int(field("Maximum resident set size (kbytes)")) / 1024


def settings_flags(args):
    return ["--max_seq_length", str(args.max_seq_length),
            "--max_predictions_per_seq", str(args.max_predictions_per_seq), "--masked_lm_prob", str(args.masked_lm_prob),
            "--dupe_factor", str(args.dupe_factor),
            "--short_seq_prob", str(args.short_seq_prob), "--random_seed", str(args.random_seed)]


def measure_ours(args, text_dir, out_dir):
    output, wall, cpu, rss = timed([sys.executable, str(REPO / "data/create_pretraining_data.py"),
                                    "--input_file", str(text_dir), "--output_file", str(out_dir),
                                    "--vocab_file", str(VOCAB), "--n_processes", str(args.n_processes),
                                    *settings_flags(args)])
    return int(re.search(r"wrote \d+ shard\(s\), (\d+) instances", output).group(1)), wall, cpu, rss


def measure_baseline(args, text_dir, out_dir):
    output, wall, cpu, rss = timed([sys.executable, __file__, "--run_baseline", "--input_dir", str(text_dir),
                                    "--output_dir", str(out_dir), *settings_flags(args)])
    return int(re.search(r"SEQUENCES (\d+)", output).group(1)), wall, cpu, rss


def report(name, sequences, wall, cpu, rss):
    print(f"{name:<44} {sequences:>10} {wall:>8.1f} {cpu:>8.1f} {sequences / cpu:>12.0f} {rss:>10.0f}")
    return sequences / cpu


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max_seq_length", type=int, default=128)
    parser.add_argument("--max_predictions_per_seq", type=int, default=20)
    parser.add_argument("--masked_lm_prob", type=float, default=0.15)
    parser.add_argument("--dupe_factor", type=int, default=5)
    parser.add_argument("--short_seq_prob", type=float, default=0.1)
    parser.add_argument("--random_seed", type=int, default=12345)
    parser.add_argument("--n_shards", type=int, default=2, help="text shards the sample corpus is cut into")
    parser.add_argument("--n_processes", type=int, default=os.cpu_count() or 1, help="workers for ours")
    parser.add_argument("--repeat", type=int, default=8,
                        help="repeat the sample text this many times (8: ~11 MiB; real shards are larger)")
    parser.add_argument("--memory_repeat", type=int, default=4, help="input size multiple for the memory run")
    parser.add_argument("--run_baseline", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--input_dir", help=argparse.SUPPRESS)
    parser.add_argument("--output_dir", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_arguments(argv)
    if args.run_baseline:
        return run_baseline(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        text = prepare_text_shards(work, args.n_shards, args.repeat)
        size = sum(p.stat().st_size for p in text.glob("*.txt")) / 2 ** 20
        print(f"input: {size:.1f} MiB of sentence-split text in {args.n_shards} shards; seq {args.max_seq_length}, "
              f"dupe_factor {args.dupe_factor}; ours with {args.n_processes} processes; {time.strftime('%H:%M:%S')}")
        print(f"{'implementation':<44} {'sequences':>10} {'wall s':>8} {'CPU s':>8} {'seq/CPU-s':>12} {'peak MiB':>10}")
        base = report("baseline (pure Python, 1 process)", *measure_baseline(args, text, work / "base"))
        ours = report(f"data/create_pretraining_data.py ({args.n_processes} proc)",
                      *measure_ours(args, text, work / "ours"))
        print(f"speed-up per core: {ours / base:.1f}x")
        big = prepare_text_shards(work, args.n_shards, args.repeat * args.memory_repeat)
        big_size = sum(p.stat().st_size for p in big.glob("*.txt")) / 2 ** 20
        report(f"ours on {big_size:.0f} MiB ({args.memory_repeat}x the input)", *measure_ours(args, big, work / "big"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
