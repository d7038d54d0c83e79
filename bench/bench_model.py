"""Time a full training step of our BertForPreTraining + LANS against transformers.BertForPreTraining + AdamW.

A step is zero_grad, forward, loss, backward and the optimizer step. Ours runs the pretraining path (sparse
MLM head: transform and decoder only at the masked positions) with LANS built as the driver builds it
(optimization.build_optimizer over the decay/no-decay groups); transformers runs its full head over every
position with `torch.optim.AdamW(model.parameters())`, the standard user setup. Same config (post-LN, the
wiring transformers has), same initial weights, same batch, both in training mode. Steps alternate between the
two so that load from other processes on a shared machine hits both alike; the figure is the median over
`--steps` steps after `--warmup`. Prints ms per step, the split into forward / backward / optimizer, and
the ratio HF / ours. No assertions.

Modes:
- fp32: everything in float32.
- bf16 autocast: both under torch.autocast(bfloat16) with float32 weights (the standard mixed-precision setup).

`--compile` adds a third contender: our model and LANS's update compiled as `--enable_torch_compile` compiles
them (inductor, the module in place, dropout from torch's generator; `compile_update=True`), same weights;
its compilation falls in the warm-up steps.

    python bench/bench_model.py                           # the three shapes of issue 11, fp32 and bf16 autocast
    python bench/bench_model.py --shape 1.5b --modes bf16 --profile    # plus a torch.profiler table per model
    python bench/bench_model.py --config scripts/bert_large_config.json --batch 4 --layers 2
    python bench/bench_model.py --modes bf16 --compile    # plus our model compiled, side by side
"""

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from modeling import BertConfig, BertForPreTraining, BertPretrainingCriterion
from optimization import build_optimizer, get_parameter_groups

# Issue 11's shapes: two layers of each width, so that a step takes about a second on a shared 2-core CPU.
SHAPES = {
    "tiny": dict(hidden_size=128, num_attention_heads=2, intermediate_size=512, batch=32),
    "base": dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, batch=16),
    "1.5b": dict(hidden_size=1600, num_attention_heads=25, intermediate_size=6400, batch=8),
}
MODES = {"fp32": False, "bf16": True}
LEARNING_RATE = 1e-4


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES),
                        help="shape to run, repeatable (default: all three)")
    parser.add_argument("--config", help="a model config JSON instead of --shape (made post-LN)")
    parser.add_argument("--batch", type=int, help="batch size with --config")
    parser.add_argument("--layers", type=int, default=2, help="encoder layers (default 2)")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--max_pred", type=int, default=20, help="masked positions per sequence, at most")
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per model and mode")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model and mode first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    parser.add_argument("--compile", action="store_true",
                        help="also time our model under torch.compile (inductor), as --enable_torch_compile runs it")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, profile one step of each model and print the top operators")
    args = parser.parse_args(argv)
    if args.config and (args.shape or not args.batch):
        parser.error("--config takes --batch and no --shape")
    return args


def bench_configs(args):
    """[(name, BertConfig, batch)] to run, post-LN (the wiring transformers has)."""
    if args.config:
        values = {**BertConfig.from_json_file(args.config).to_dict(), "num_hidden_layers": args.layers,
                  "layer_norm_large_model": False}
        return [(Path(args.config).stem, BertConfig(**values), args.batch)]
    configs = []
    for name in args.shape or list(SHAPES):
        shape = dict(SHAPES[name])
        batch = shape.pop("batch")
        configs.append((name, BertConfig(vocab_size=30522, num_hidden_layers=args.layers, **shape), batch))
    return configs


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


def ours_loss(model, batch):
    input_ids, token_type_ids, attention_mask, labels, next_sentence_labels = batch
    scores, nsp = model(input_ids, token_type_ids, attention_mask, masked_lm_labels=labels)
    return BertPretrainingCriterion()(scores, nsp, labels, next_sentence_labels)


def hf_loss(model, batch):
    input_ids, token_type_ids, attention_mask, labels, next_sentence_labels = batch
    output = model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                   labels=labels.masked_fill(labels == -1, -100), next_sentence_label=next_sentence_labels)
    return output.loss


@dataclasses.dataclass
class Contender:
    """A model with its loss function and optimizer; `phases` collects ms per step of each part."""
    name: str
    model: torch.nn.Module
    loss_fn: object
    optimizer: torch.optim.Optimizer
    phases: dict = dataclasses.field(default_factory=lambda: {"forward": [], "backward": [], "optimizer": []})

    def step(self, batch, autocast):
        """One training step; returns ms of (forward incl. loss, backward, optimizer step incl. zero_grad)."""
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = self.loss_fn(self.model, batch)
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        end = time.perf_counter()
        return [(b - a) * 1000.0 for a, b in ((start, forward_end), (forward_end, backward_end), (backward_end, end))]


def time_alternating(contenders, batch, autocast, steps, warmup):
    """Median ms per phase of each contender, steps alternating between them."""
    for contender in contenders:
        contender.phases = {phase: [] for phase in contender.phases}
    for index in range(warmup + steps):
        for contender in contenders:
            times = contender.step(batch, autocast)
            if index >= warmup:
                for phase, ms in zip(contender.phases, times):
                    contender.phases[phase].append(ms)
    return [{phase: statistics.median(values) for phase, values in contender.phases.items()}
            | {"step": statistics.median(map(sum, zip(*contender.phases.values())))}
            for contender in contenders]


def print_profile(contender, batch, autocast, rows=25):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        contender.step(batch, autocast)
    print(f"--- profile of one step: {contender.name}")
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def run_shape(name, config, batch_size, args):
    torch.manual_seed(0)
    ours_model = BertForPreTraining(config).train()
    hf_model = build_hf_model(config, ours_model.state_dict())
    contenders = [
        Contender("ours", ours_model, ours_loss,
                  build_optimizer("lans", get_parameter_groups(ours_model), LEARNING_RATE)),
        Contender("HF", hf_model, hf_loss, torch.optim.AdamW(hf_model.parameters(), lr=LEARNING_RATE)),
    ]
    if args.compile:
        from torch._inductor import config as inductor_config
        inductor_config.fallback_random = True  # as compile_mode.compile_model sets it
        compiled_model = BertForPreTraining(config).train()
        compiled_model.load_state_dict(ours_model.state_dict())
        compiled_model.compile(backend="inductor")
        contenders.append(Contender("compiled", compiled_model, ours_loss,
                                    build_optimizer("lans", get_parameter_groups(compiled_model), LEARNING_RATE,
                                                    compile_update=True)))
    batch = make_batch(config, batch_size, args.seq_len, args.max_pred)
    print(f"\n{name}: hidden {config.hidden_size}, layers {config.num_hidden_layers}, heads "
          f"{config.num_attention_heads}, intermediate {config.intermediate_size}, vocab "
          f"{config.padded_vocab_size}; batch {batch_size} x {args.seq_len}, {int((batch[3] != -1).sum())} "
          f"masked tokens; transformers attention {hf_model.config._attn_implementation}")
    print(f"{'mode':<6} {'model':<8} {'step ms':>9} {'forward':>9} {'backward':>9} {'optimizer':>9} "
          f"{'HF/this':>8} {'ours/this':>9}")
    for mode in args.modes:
        results = time_alternating(contenders, batch, MODES[mode], args.steps, args.warmup)
        ours, theirs = results[0], results[1]
        for contender, times in zip(contenders, results):
            ratios = ("" if contender.name == "HF"
                      else f"{theirs['step'] / times['step']:>8.2f} {ours['step'] / times['step']:>9.2f}")
            print(f"{mode:<6} {contender.name:<8} {times['step']:>9.1f} {times['forward']:>9.1f} "
                  f"{times['backward']:>9.1f} {times['optimizer']:>9.1f} {ratios}")
        if args.profile:
            for contender in contenders:
                print_profile(contender, batch, MODES[mode])


def main(argv=None):
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; seq {args.seq_len}, at most "
          f"{args.max_pred} predictions; median of {args.steps} alternating steps after {args.warmup} warm-up")
    for name, config, batch_size in bench_configs(args):
        run_shape(name, config, batch_size, args)


if __name__ == "__main__":
    main()
