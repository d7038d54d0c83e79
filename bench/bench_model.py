"""Time forward + backward of our BertForPreTraining against transformers.BertForPreTraining.

Ours runs the pretraining path (sparse MLM head: transform and decoder only at the masked positions, fed
masked_lm_labels with ~15% of the positions masked, at most 20 per sequence); transformers runs its full head
over every position, as the reference does. Same config, same weights, same batch, both in training mode,
in float32 and under bfloat16 autocast. Prints ms per step and the ratio HF / ours. No assertions.
transformers only has the post-LN wiring: with a pre-LN config the cost is comparable, the function is not.

    python bench/bench_model.py                       # BERT-Large shapes, 2 layers, batch 4 x 128
    python bench/bench_model.py --config scripts/bert_tiny_config.json --batch 32 --steps 10
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from modeling import BertConfig, BertForPreTraining, BertPretrainingCriterion  # noqa: E402

# BERT-Large widths with only 2 layers, so a step takes seconds on a shared 2-core CPU.
DEFAULT_CONFIG = dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=2, num_attention_heads=16,
                      intermediate_size=4096, layer_norm_large_model=False)


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="model config JSON (default: BERT-Large shapes with 2 layers)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--max_pred", type=int, default=20, help="masked positions per sequence, at most")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and mode")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model and mode first")
    return parser.parse_args(argv)


def make_batch(config, batch, seq_len, max_pred):
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(1, config.vocab_size, (batch, seq_len), generator=generator)
    token_type_ids = (torch.arange(seq_len) >= seq_len // 2).long().expand(batch, seq_len).contiguous()
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    labels = torch.full((batch, seq_len), -1)
    masked_per_row = min(max_pred, max(1, round(0.15 * seq_len)))
    for row in range(batch):
        positions = torch.randperm(seq_len - 1, generator=generator)[:masked_per_row] + 1  # never [CLS]
        labels[row, positions] = input_ids[row, positions]
    next_sentence_labels = torch.randint(0, 2, (batch,), generator=generator)
    return input_ids, token_type_ids, attention_mask, labels, next_sentence_labels


def build_hf_model(config, state_dict):
    import transformers
    hf_config = transformers.BertConfig(
        vocab_size=config.padded_vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        intermediate_size=config.intermediate_size, hidden_act="gelu", layer_norm_eps=1e-12,
        hidden_dropout_prob=config.hidden_dropout_prob,
        attention_probs_dropout_prob=config.attention_probs_dropout_prob,
        max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size)
    model = transformers.BertForPreTraining(hf_config)
    model.load_state_dict(state_dict, strict=False)  # only the tied decoder bias is absent from ours
    return model.train()


def ours_step(model, batch):
    input_ids, token_type_ids, attention_mask, labels, next_sentence_labels = batch
    scores, nsp = model(input_ids, token_type_ids, attention_mask, masked_lm_labels=labels)
    return BertPretrainingCriterion()(scores, nsp, labels, next_sentence_labels)


def hf_step(model, batch):
    input_ids, token_type_ids, attention_mask, labels, next_sentence_labels = batch
    output = model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                   labels=labels.masked_fill(labels == -1, -100), next_sentence_label=next_sentence_labels)
    return output.loss


def time_step(step_fn, model, batch, autocast):
    """Milliseconds of one forward + backward."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = step_fn(model, batch)
    loss.backward()
    return (time.perf_counter() - start) * 1000.0


def time_both(ours, theirs, batch, autocast, steps, warmup):
    """Median ms per step of each model. Steps alternate between the two models so that load from other
    processes on a shared machine hits both alike."""
    timings = {"ours": [], "hf": []}
    for index in range(warmup + steps):
        ours_ms = time_step(ours_step, ours, batch, autocast)
        hf_ms = time_step(hf_step, theirs, batch, autocast)
        if index >= warmup:
            timings["ours"].append(ours_ms)
            timings["hf"].append(hf_ms)
    return statistics.median(timings["ours"]), statistics.median(timings["hf"])


def main(argv=None):
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = BertConfig.from_json_file(args.config) if args.config else BertConfig(**DEFAULT_CONFIG)
    torch.manual_seed(0)
    ours = BertForPreTraining(config).train()
    theirs = build_hf_model(config, ours.state_dict())
    batch = make_batch(config, args.batch, args.seq_len, args.max_pred)
    print(f"config: hidden {config.hidden_size}, layers {config.num_hidden_layers}, heads "
          f"{config.num_attention_heads}, intermediate {config.intermediate_size}, vocab "
          f"{config.padded_vocab_size}, pre-LN {config.layer_norm_large_model}; batch {args.batch} x "
          f"{args.seq_len}, {int((batch[3] != -1).sum())} masked tokens; torch threads "
          f"{torch.get_num_threads()}; transformers attention {theirs.config._attn_implementation}")
    print(f"{'mode':<16} {'ours ms/step':>13} {'HF ms/step':>11} {'HF/ours':>8}")
    for mode, autocast in (("fp32", False), ("bf16 autocast", True)):
        ours_ms, hf_ms = time_both(ours, theirs, batch, autocast, args.steps, args.warmup)
        print(f"{mode:<16} {ours_ms:>13.1f} {hf_ms:>11.1f} {hf_ms / ours_ms:>8.2f}")


if __name__ == "__main__":
    main()
