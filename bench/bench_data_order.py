"""How local the training order is: where the rows of each prep block land in the sample stream.

    python bench/bench_data_order.py [--text_chars 32e6] [--global_batch 12288] [--rank_rows_per_step 1536]

The prep (data/create_pretraining_data.py) shuffles instances only inside a block of --block_chars
characters, and a block holds all --dupe_factor masked copies of its text; the reader (data/dataset.py)
shuffles only inside a window of --data_memory_budget_mb. This builds one training shard from the sample
corpus taken through the real pipeline and repeated to --text_chars characters, at the default prep flags
(phase 1, dupe factor 5), counts its rows per block, lays it out as the reader does (seed 12439, the 1.5B
launchers'), and prints the optimizer steps of --global_batch in which each block's rows are trained, and
how many blocks each step draws from.

For the reference, which gives each rank whole files and shuffles a file's rows with a RandomSampler, a
file's rows (its texts' masked copies among them) spread over the steps the rank takes to read it: the
rows of one training shard of BERT's corpus (--corpus_words, --shards, --test_fraction; rows per word as
measured here) over --rank_rows_per_step (micro-batch 32 x 48 accumulation steps in the 8-device recipe).
"""
import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench_data import prepare_text_shards
from data import create_pretraining_data
from data.dataset import SampleStream, ShardInfo, window_size_for_budget

REPO = Path(__file__).resolve().parent.parent


def build_shard(text_dir, out_dir, dupe_factor):
    """Run the prep on text_dir's one training file; return (rows per block, words of its text)."""
    rows_per_block = []
    write_block = create_pretraining_data.write_block

    def counting(writer, flat, specs, *rest):  # create_shard writes one block per call
        rows_per_block.append(len(specs))
        return write_block(writer, flat, specs, *rest)

    text, = text_dir.glob("*training*.txt")
    settings = create_pretraining_data.parse_arguments([
        "--input_file", str(text), "--output_file", str(out_dir), "--vocab_file", str(REPO / "data" / "vocab.txt"),
        "--dupe_factor", str(dupe_factor), "--n_processes", "1"])
    create_pretraining_data.write_block = counting
    try:
        create_pretraining_data.run(settings)
    finally:
        create_pretraining_data.write_block = write_block
    return rows_per_block, len(text.read_text(encoding="utf-8").split())


def stream_rows(num_rows, seed, window_size):
    """Shard row trained at each position of epoch 0 (one shard), as data/dataset.py lays it out."""
    stream = SampleStream([ShardInfo("shard_training_0.hdf5", num_rows)], seed, window_size)
    parts = []
    for window in range((num_rows + window_size - 1) // window_size):
        (_, first, end), = stream.window_pieces(0, window)
        parts.append(first + stream.window_permutation(0, window, end - first))
    return np.concatenate(parts)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text_chars", type=float, default=32e6, help="size of the repeated sample text")
    parser.add_argument("--dupe_factor", type=int, default=5)
    parser.add_argument("--data_memory_budget_mb", type=float, default=256)
    parser.add_argument("--seed", type=int, default=12439)
    parser.add_argument("--global_batch", type=int, default=12288)
    parser.add_argument("--rank_rows_per_step", type=int, default=32 * 48)
    parser.add_argument("--corpus_words", type=float, default=3.3e9)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--test_fraction", type=float, default=0.1)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_arguments(argv)
    with tempfile.TemporaryDirectory(prefix="bench-data-order-") as work:
        work = Path(work)
        one_copy = prepare_text_shards(work, 1, 1)
        size = sum(path.stat().st_size for path in one_copy.glob("*.txt"))
        text_dir = prepare_text_shards(work, 1, max(1, round(args.text_chars / size)))
        rows_per_block, words = build_shard(text_dir, work / "hdf5", args.dupe_factor)
    num_rows = sum(rows_per_block)
    block_of_row = np.repeat(np.arange(len(rows_per_block)), rows_per_block)
    window = window_size_for_budget(int(args.data_memory_budget_mb * 2 ** 20), 128, 20)
    step_of_position = np.arange(num_rows) // args.global_batch
    blocks_in_order = block_of_row[stream_rows(num_rows, args.seed, window)]
    print(f"{words} words, {num_rows} rows in {len(rows_per_block)} blocks; window {window} rows; "
          f"global batch {args.global_batch}")
    for block, rows in enumerate(rows_per_block):
        steps = step_of_position[blocks_in_order == block]
        print(f"block {block}: {rows} rows ({args.dupe_factor} masked copies of its text) trained in optimizer "
              f"steps {steps.min()}..{steps.max()}")
    whole_steps = num_rows // args.global_batch
    per_step = [len(set(blocks_in_order[s * args.global_batch:(s + 1) * args.global_batch]))
                for s in range(whole_steps)]
    print(f"blocks per optimizer step (whole steps): {per_step}")
    rows_per_shard = args.corpus_words * (1 - args.test_fraction) / args.shards * num_rows / words
    print(f"reference: a training shard of {args.corpus_words:.3g} words / {args.shards} shards holds about "
          f"{rows_per_shard:,.0f} rows ({num_rows / words:.4f} rows per word here), read by one rank in about "
          f"{rows_per_shard / args.rank_rows_per_step:.0f} optimizer steps of {args.rank_rows_per_step} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
