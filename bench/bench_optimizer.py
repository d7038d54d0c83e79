"""Time the optimizer step alone: LANS (this repository's lans.py) against torch.optim.AdamW, against
another version of lans.py (--baseline_lans FILE), or compiled against eager (--compile_update), on the
parameters of bench_model.py's shapes.

Same parameters, same random gradients, steps alternating between the two; prints the median ms per step,
the ratio and the largest weight difference to the baseline at the end (useful against another lans.py).

    python bench/bench_optimizer.py                     # LANS vs AdamW at the three shapes
    git show 09ba398:lans.py > /tmp/lans_before.py
    python bench/bench_optimizer.py --baseline_lans /tmp/lans_before.py
    python bench/bench_optimizer.py --compile_update     # LANS(compile_update=True) vs eager LANS

With --compile_update the warm-up steps include the compilation (inductor), outside the timed steps.

Each shape's line ends with LANS's memory floor. The update is memory-bound: per parameter its three sweeps
read at least 9 float32 values and write 3 (sweep 1 reads g; sweep 2 reads w, g, m, v and writes m, v;
sweep 3 reads the four again and writes w). The floor is the time of that traffic on this machine, from a
read (the norm of the parameters flattened) and a copy (a read and a write) timed in the same run:
9 reads + 3 writes = 6 reads + 3 copies. LANS's step near its floor can only get faster with fewer passes.
"""

import argparse
import importlib.util
import statistics
import time

import torch

from bench_model import SHAPES, bench_configs
from modeling import BertForPreTraining
from optimization import build_optimizer, get_parameter_groups

# LANS's least memory traffic per parameter (see above): 9 float32 reads + 3 writes = 6 reads + 3 copies.
FLOOR_READS, FLOOR_COPIES = 6, 3


def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="repeatable (default: all three)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--baseline_lans", help="a lans.py file to compare with, instead of torch's AdamW")
    parser.add_argument("--compile_update", action="store_true",
                        help="time LANS(compile_update=True) against eager LANS, instead of LANS against AdamW")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    args.config = None
    return args


def baseline_optimizer(args, model):
    if args.compile_update:
        return "eager LANS", build_optimizer("lans", get_parameter_groups(model), 1e-3)
    if not args.baseline_lans:
        return "AdamW", torch.optim.AdamW(model.parameters(), lr=1e-3)
    spec = importlib.util.spec_from_file_location("baseline_lans", args.baseline_lans)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return f"LANS of {args.baseline_lans}", module.LANS(get_parameter_groups(model), lr=1e-3, eps=1e-6)


def run_shape(name, config, args):
    torch.manual_seed(0)
    ours, theirs = BertForPreTraining(config), BertForPreTraining(config)
    theirs.load_state_dict(ours.state_dict())
    generator = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=generator) * 1e-3 for p in ours.parameters()]
    baseline_name, baseline = baseline_optimizer(args, theirs)
    ours_optimizer = build_optimizer("lans", get_parameter_groups(ours), 1e-3, compile_update=args.compile_update)
    contenders = [(ours, ours_optimizer), (theirs, baseline)]
    times = [[], []]
    for index in range(args.warmup + args.steps):
        for (model, optimizer), record in zip(contenders, times):
            for param, grad in zip(model.parameters(), grads):
                param.grad = grad.clone()
            start = time.perf_counter()
            optimizer.step()
            if index >= args.warmup:
                record.append((time.perf_counter() - start) * 1000.0)
    ours_ms, baseline_ms = map(statistics.median, times)
    difference = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), theirs.parameters()))
    ours_name = "compiled LANS" if args.compile_update else "LANS"
    numel = sum(p.numel() for p in ours.parameters())
    read_ms, copy_ms = memory_pass_ms(numel, args.warmup + args.steps)
    floor_ms = FLOOR_READS * read_ms + FLOOR_COPIES * copy_ms
    print(f"{name}: {numel:,} parameters; {ours_name} {ours_ms:.1f} ms, "
          f"{baseline_name} {baseline_ms:.1f} ms, baseline/{ours_name} {baseline_ms / ours_ms:.2f}; "
          f"max |weight difference| after {args.warmup + args.steps} steps {difference:.2e}; memory floor "
          f"{floor_ms:.1f} ms (a read of the parameters {read_ms:.1f} ms, a copy {copy_ms:.1f} ms), "
          f"{ours_name}/floor {ours_ms / floor_ms:.2f}")


def memory_pass_ms(numel, repeats):
    """Median ms of reading `numel` float32 values once (their norm) and of copying them (a read and a
    write), alternating, after one untimed round."""
    source, target = torch.rand(numel), torch.empty(numel)
    passes = (lambda: torch.linalg.vector_norm(source), lambda: target.copy_(source))
    times = [[], []]
    for index in range(repeats + 1):
        for memory_pass, record in zip(passes, times):
            start = time.perf_counter()
            memory_pass()
            if index:
                record.append((time.perf_counter() - start) * 1000.0)
    return tuple(map(statistics.median, times))


def main(argv=None):
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.steps} alternating "
          f"steps after {args.warmup} warm-up")
    for name, config, _ in bench_configs(args):
        run_shape(name, config, args)


if __name__ == "__main__":
    main()
