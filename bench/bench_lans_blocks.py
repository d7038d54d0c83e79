"""Cost of per-tensor LANS blocks under ZeRO: whole training steps (forward, backward, DeepSpeed's ZeRO
step with LANS) with --lans_blocks partition and tensor, alternating step by step on the same engine,
2 ranks (gloo, CPU), fp32 ZeRO-1 or ZeRO-2.

    torchrun --nproc_per_node 2 bench/bench_lans_blocks.py --model tiny
    torchrun --nproc_per_node 2 bench/bench_lans_blocks.py --model 1.5b --layers 2 --steps 6

--model 1.5b takes BERT-1.5B's widths (hidden 1600, 25 heads, FFN 6400, vocab) with --layers layers.
Both modes run on the same engine (LANS's segments are set or cleared between steps), so they see
the same weights, data and machine load; the first --warmup steps of each are not timed. Reports the
median step time of each mode, their ratio, and the median time of the optimizer step alone.
Asserts nothing. Export OMP_NUM_THREADS=1 (torchrun does) on a 2-core machine.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from modeling import BertConfig, BertForPreTraining, BertPretrainingCriterion
from optimization import build_optimizer, get_parameter_groups
from training import zero_partitions

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def model_config(args) -> BertConfig:
    name = {"tiny": "bert_tiny_config.json", "1.5b": "bert_1.5b_config.json"}[args.model]
    config = json.loads((SCRIPTS / name).read_text())
    if args.layers:
        config["num_hidden_layers"] = args.layers
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertConfig(**config)


def make_batch(config, micro, seq_len, max_pred, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, config.vocab_size, (micro, seq_len), generator=gen)
    labels = torch.full_like(ids, -1)
    labels[:, 1:1 + max_pred] = ids[:, 1:1 + max_pred]
    return ids, torch.zeros_like(ids), torch.ones_like(ids), labels, torch.randint(0, 2, (micro,), generator=gen)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "1.5b"), default="tiny")
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the config's)")
    parser.add_argument("--stage", type=int, choices=(1, 2), default=1)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    # The CPU, as the batches are and gloo is, also on a GPU server: there DeepSpeed would pick CUDA by itself
    # and put the model on cuda:LOCAL_RANK.
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import deepspeed.ops
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    config = model_config(args)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    optimizer = build_optimizer("lans", get_parameter_groups(model), 1e-4)
    ds_config = {"train_batch_size": args.micro * dist.get_world_size(), "train_micro_batch_size_per_gpu": args.micro,
                 "zero_optimization": {"stage": args.stage}, "gradient_clipping": 0.0,
                 "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    criterion = BertPretrainingCriterion()
    partitions = zero_partitions.group_partitions(engine.optimizer)
    segments = zero_partitions.tensor_segments(partitions)
    all_reduce_sum = zero_partitions.data_parallel_sum(engine.optimizer)
    timed_optimizer = engine.optimizer.optimizer
    original_step = timed_optimizer.step
    optimizer_times = []

    def step_with_timer(*a, **k):
        start = time.perf_counter()
        result = original_step(*a, **k)
        optimizer_times.append(time.perf_counter() - start)
        return result

    timed_optimizer.step = step_with_timer
    times = {"partition": [], "tensor": []}
    optimizer_share = {"partition": [], "tensor": []}
    for step in range(2 * (args.steps + args.warmup)):
        mode = ("partition", "tensor")[step % 2]
        timed_optimizer.set_tensor_segments(segments if mode == "tensor" else {}, all_reduce_sum)
        ids, types, mask, labels, nsp = make_batch(config, args.micro, args.seq_len, 20, seed=step)
        dist.barrier()
        optimizer_times.clear()
        start = time.perf_counter()
        scores, seq_rel = engine(ids, types, mask, masked_lm_labels=labels)
        engine.backward(criterion(scores, seq_rel, labels, nsp))
        engine.step()
        dist.barrier()
        if step // 2 >= args.warmup:
            times[mode].append(time.perf_counter() - start)
            optimizer_share[mode].append(sum(optimizer_times))
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        tensors = sum(len(part.params) for part in partitions)
        part_ms, tensor_ms = (1e3 * statistics.median(times[m]) for m in ("partition", "tensor"))
        opt_part, opt_tensor = (1e3 * statistics.median(optimizer_share[m]) for m in ("partition", "tensor"))
        print(f"model {args.model} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
              f"{params / 1e6:.1f} M parameters in {tensors} tensors), ZeRO-{args.stage}, "
              f"{dist.get_world_size()} ranks, micro {args.micro} x {args.seq_len}, {args.steps} steps per mode")
        print(f"step time, median: partition {part_ms:.1f} ms, tensor {tensor_ms:.1f} ms, "
              f"ratio tensor/partition {tensor_ms / part_ms:.4f}")
        print(f"optimizer step alone, median: partition {opt_part:.1f} ms, tensor {opt_tensor:.1f} ms")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
