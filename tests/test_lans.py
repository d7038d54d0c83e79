"""LANS against an independent float64 re-derivation of the reference's update (`lans.py`, Model-References
1.9.0 deepspeed-bert).

The reference below is written out scalar-by-scalar from the equations; it shares no code with
lans.py. A mutant of it (beta weights swapped) must disagree, so the comparison can fail.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from helpers import free_port
from lans import LANS, TensorSegments
from optim_helpers import apply_steps, assert_weights_close, make_problem, norm, run_optimizer

REPO = Path(__file__).resolve().parent.parent


def lans_reference(groups, grad_steps, lrs, betas=(0.9, 0.999), eps=1e-6, bias_correction=True,
                   grad_averaging=True, max_grad_norm=0.0, adjust_step=False, swap_betas=False,
                   round_to=None):
    """float64 LANS. groups: [(list of weight tensors, weight_decay)]; grad_steps: per step, per
    group, per tensor a gradient or None; lrs: the LR of each step. round_to: dtype the weights are
    rounded to after every step (bf16 parameters). Returns the weights after all steps."""
    weights = [[w.double().clone() for w in ws] for ws, _ in groups]
    moments = [[(torch.zeros_like(w), torch.zeros_like(w)) for w in ws] for ws in weights]
    steps = [0] * len(groups)
    beta1, beta2 = betas
    beta3 = 1 - beta1 if grad_averaging else 1.0
    for grads, lr in zip(grad_steps, lrs):
        grads = [[None if g is None else g.double() for g in gs] for gs in grads]
        clip = 1.0
        if max_grad_norm > 0:
            total = math.sqrt(sum(norm(g) ** 2 for gs in grads for g in gs if g is not None))
            clip = max(total / max_grad_norm, 1.0)
        for gi, (_, decay) in enumerate(groups):
            if all(g is None for g in grads[gi]):
                continue
            steps[gi] += 1
            k = steps[gi] - 1 if (adjust_step and steps[gi] > 1) else steps[gi]
            bc1, bc2 = (1 - beta1**k, 1 - beta2**k) if bias_correction else (1.0, 1.0)
            for ti, g in enumerate(grads[gi]):
                if g is None:
                    continue
                w = weights[gi][ti]
                g = g / clip
                g_norm = norm(g)
                g_hat = g / (g_norm + eps) if g_norm != 0 else g
                m, v = moments[gi][ti]
                m = beta1 * m + beta3 * g_hat
                v = beta2 * v + (1 - beta2) * g_hat * g_hat
                moments[gi][ti] = (m, v)
                den = torch.sqrt(v / bc2) + eps
                r = (m / bc1) / den + decay * w
                c = g_hat / den + decay * w
                w_norm, r_norm, c_norm = norm(w), norm(r), norm(c)
                phi_r = w_norm / r_norm if (w_norm != 0 and r_norm != 0) else 1.0
                phi_c = w_norm / c_norm if (w_norm != 0 and c_norm != 0) else 1.0
                weight_r, weight_c = (beta3, beta1) if swap_betas else (beta1, beta3)
                w = w - lr * weight_r * phi_r * r - lr * weight_c * phi_c * c
                if round_to is not None:
                    w = w.to(round_to).double()
                weights[gi][ti] = w
    return weights


def run_lans(groups, grad_steps, lrs, **kwargs):
    return run_optimizer(lambda param_groups: LANS(param_groups, lr=lrs[0], **kwargs), groups, grad_steps, lrs)


LRS = [0.05, 0.1, 0.02, 0.08]

CASES = {
    "defaults": ({}, {}),
    "no_weight_decay": ({"weight_decay": "zero"}, {}),
    "zero_gradient_tensor": ({}, {"zero_grad_tensor": (1, 0)}),
    "bias_correction_off": ({"bias_correction": False}, {}),
    "adjust_step": ({"adjust_step": True}, {}),
    "grad_averaging_off": ({"grad_averaging": False}, {}),
    # A large eps makes g_hat depend on the gradient's scale, so clipping is visible in the result.
    "max_grad_norm": ({"max_grad_norm": 0.5, "eps": 0.1}, {}),
    "max_grad_norm_not_reached": ({"max_grad_norm": 100.0, "eps": 0.1}, {}),
    "betas": ({"betas": (0.8, 0.95)}, {}),
    "flat_partition": ({}, {"shapes": ((4096,), (96,))}),
    # ||w|| = 0 (zero-initialised biases and LayerNorm biases): both trust ratios are 1, not 0, or the
    # tensor would never move.
    "zero_weight_no_decay_bias": ({}, {"zero_weight_tensor": 1}),
    "zero_weight_decayed": ({}, {"zero_weight_tensor": 0}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_lans_matches_float64_reference(name):
    options, problem = dict(CASES[name][0]), CASES[name][1]
    groups, grad_steps = make_problem(**problem)
    if options.pop("weight_decay", None) == "zero":
        groups = [(ws, 0.0) for ws, _ in groups]
    params, optimizer = run_lans(groups, grad_steps, LRS, **options)
    assert_weights_close(params, lans_reference(groups, grad_steps, LRS, **options))
    assert [g["step"] for g in optimizer.param_groups] == [len(LRS)] * len(groups)
    assert all(type(g["step"]) is int for g in optimizer.param_groups)


@pytest.mark.parametrize("chunk_elements", [1, 4, 7, 29, 2 ** 62])
@pytest.mark.parametrize("name", ["defaults", "flat_partition", "zero_gradient_tensor", "zero_weight_no_decay_bias"])
def test_lans_cut_into_small_chunks_matches_float64_reference(monkeypatch, name, chunk_elements):
    """The sweeps over pieces (tensors cut at any point, small ones sharing a chunk; 2**62: whole tensors in
    one chunk, as on an accelerator) give the per-tensor update."""
    import lans
    monkeypatch.setattr(lans, "CHUNK_ELEMENTS", chunk_elements)
    options, problem = dict(CASES[name][0]), CASES[name][1]
    groups, grad_steps = make_problem(**problem)
    params, _ = run_lans(groups, grad_steps, LRS, **options)
    assert_weights_close(params, lans_reference(groups, grad_steps, LRS, **options))


@pytest.fixture
def compiled_from_scratch():
    """Compiled sweeps compiled anew for the test, and an error instead of eager mode when torch.compile gives
    up (the cases of this module specialise more graphs than one training run does)."""
    import torch._dynamo
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield torch._dynamo.utils.counters
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["defaults", "no_weight_decay", "zero_gradient_tensor", "max_grad_norm",
                                  "adjust_step", "flat_partition", "zero_weight_no_decay_bias"])
def test_compiled_update_matches_float64_reference(compiled_from_scratch, name):
    """compile_update=True: the sweeps run as inductor-compiled code, a whole block per call."""
    options, problem = dict(CASES[name][0]), CASES[name][1]
    groups, grad_steps = make_problem(**problem)
    if options.pop("weight_decay", None) == "zero":
        groups = [(ws, 0.0) for ws, _ in groups]
    params, _ = run_lans(groups, grad_steps, LRS, compile_update=True, **options)
    assert_weights_close(params, lans_reference(groups, grad_steps, LRS, **options))
    assert compiled_from_scratch["stats"]["unique_graphs"] >= 2  # both sweeps compiled, not run eagerly


def test_compiled_update_of_bf16_parameters_with_non_contiguous_gradients(compiled_from_scratch):
    groups, grad_steps = make_problem(dtype=torch.bfloat16)
    grad_steps = [[[g.t().contiguous().t() if g.dim() == 2 else g for g in gs] for gs in step] for step in grad_steps]
    params, _ = run_lans(groups, grad_steps, LRS, compile_update=True)
    expected = lans_reference(groups, grad_steps, LRS, round_to=torch.bfloat16)
    for ps, ws in zip(params, expected):
        for p, w in zip(ps, ws):
            torch.testing.assert_close(p.detach().double(), w, rtol=2**-7, atol=1e-3)


def test_pieces_are_cache_sized_on_the_cpu_only():
    import lans
    assert lans.chunk_elements(torch.device("cpu")) == lans.CHUNK_ELEMENTS
    assert lans.chunk_elements(torch.device("cuda", 0)) >= 2 ** 62


def test_non_contiguous_gradients_match_float64_reference(monkeypatch):
    """A block with a transposed (non-contiguous) gradient is updated whole, not cut into pieces."""
    import lans
    monkeypatch.setattr(lans, "CHUNK_ELEMENTS", 4)
    groups, grad_steps = make_problem()
    params = [[torch.nn.Parameter(w.clone()) for w in ws] for ws, _ in groups]
    optimizer = LANS([{"params": ps, "weight_decay": decay} for ps, (_, decay) in zip(params, groups)], lr=LRS[0])
    for step, grads in enumerate(grad_steps):
        for ps, gs in zip(params, grads):
            for p, g in zip(ps, gs):
                p.grad = g.t().contiguous().t() if g.dim() == 2 else g.clone()
        assert not params[0][0].grad.is_contiguous()
        for group in optimizer.param_groups:
            group["lr"] = LRS[step]
        optimizer.step()
    assert_weights_close(params, lans_reference(groups, grad_steps, LRS))


def test_reference_mutant_with_swapped_beta_weights_disagrees():
    groups, grad_steps = make_problem()
    params, _ = run_lans(groups, grad_steps, LRS)
    mutant = lans_reference(groups, grad_steps, LRS, swap_betas=True)
    difference = max((p.detach().double() - w).abs().max().item()
                     for ps, ws in zip(params, mutant) for p, w in zip(ps, ws))
    assert difference > 1e-3


def test_none_gradient_is_skipped_and_empty_group_keeps_its_step():
    # Step 1: tensor 0 of group 1 has no gradient; group 0's only tensor has none on step 2.
    groups, grad_steps = make_problem(steps=3, none_grad=(1, 0, 0))
    grad_steps[0][1][0] = None
    params, optimizer = run_lans(groups, grad_steps, LRS[:3])
    assert_weights_close(params, lans_reference(groups, grad_steps, LRS[:3]))
    assert [g["step"] for g in optimizer.param_groups] == [2, 3]


def test_bf16_parameters_keep_float32_moments_and_match_reference():
    groups, grad_steps = make_problem(dtype=torch.bfloat16)
    params, optimizer = run_lans(groups, grad_steps, LRS)
    expected = lans_reference(groups, grad_steps, LRS, round_to=torch.bfloat16)
    for ps, ws in zip(params, expected):
        for p, w in zip(ps, ws):
            assert p.dtype == torch.bfloat16
            # one bf16 rounding step (2**-8 relative) may differ: fp32 vs float64 arithmetic
            torch.testing.assert_close(p.detach().double(), w, rtol=2**-7, atol=1e-3)
    for state in optimizer.state.values():
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(tmp_path, dtype):
    groups, grad_steps = make_problem(dtype=dtype)
    uninterrupted, _ = run_lans(groups, grad_steps, LRS)

    first, optimizer = run_lans(groups, grad_steps[:2], LRS[:2])
    torch.save(optimizer.state_dict(), tmp_path / "lans.pt")
    # A fresh optimizer over different tensors: it must take everything from the file.
    resumed = [[torch.nn.Parameter(p.detach().clone()) for p in ps] for ps in first]
    fresh = LANS([{"params": ps} for ps in resumed], lr=1.0, weight_decay=0.5)
    fresh.load_state_dict(torch.load(tmp_path / "lans.pt", weights_only=True))
    assert fresh.param_groups[0]["weight_decay"] == 0.01 and fresh.param_groups[0]["step"] == 2
    for state in fresh.state.values():
        assert state["exp_avg"].dtype == torch.float32
    apply_steps(fresh, resumed, grad_steps[2:], LRS[2:])
    for ps, qs in zip(uninterrupted, resumed):
        for p, q in zip(ps, qs):
            assert p is not q and torch.equal(p, q)


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad_honours_set_grad_none(set_grad_none):
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = LANS([param], set_grad_none=set_grad_none)
    param.grad = torch.ones(3)
    optimizer.zero_grad()
    if set_grad_none:
        assert param.grad is None
    else:
        assert torch.equal(param.grad, torch.zeros(3))


def test_gradients_are_not_modified_by_clipping():
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 3.0)
    LANS([param], max_grad_norm=1.0).step()
    assert torch.equal(param.grad, torch.full((4,), 3.0))


# ---------------------------------------------------------------------------------------------
# Under DeepSpeed ZeRO-1 LANS sees one flat fp32 partition per group. Run in a subprocess so the
# process group and DeepSpeed's globals do not leak into other tests.

DEEPSPEED_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch, deepspeed, deepspeed.ops
    from lans import LANS
    from schedulers import PolyWarmUpScheduler

    class RecordingLANS(LANS):
        # Records what DeepSpeed hands the optimizer before each step.
        records = []
        def step(self, closure=None):
            self.records.append({
                "weights": [[p.detach().tolist() for p in g["params"]] for g in self.param_groups],
                "grads": [[p.grad.tolist() for p in g["params"]] for g in self.param_groups],
                "lrs": [g["lr"] for g in self.param_groups]})
            return super().step(closure)

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))
    decay = [model[0].weight, model[2].weight]
    no_decay = [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    optimizer = RecordingLANS([{"params": decay, "weight_decay": 0.01},
                               {"params": no_decay, "weight_decay": 0.0}], lr=0.05)
    scheduler = PolyWarmUpScheduler(optimizer, warmup=0.25, total_steps=8)
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4,
              "zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=config)
    steps_after_init = [g["step"] for g in optimizer.param_groups]
    for _ in range(3):
        loss = engine(torch.randn(4, 6)).square().mean()
        engine.backward(loss)
        engine.step()
    print("RESULT " + json.dumps({
        "records": RecordingLANS.records, "steps_after_init": steps_after_init,
        "final": [[p.detach().tolist() for p in g["params"]] for g in optimizer.param_groups],
        "steps": [g["step"] for g in optimizer.param_groups]}))
    torch.distributed.destroy_process_group()  # not left to the interpreter's exit (gloo could abort there)
""")


def test_lans_with_poly_scheduler_under_deepspeed_zero1(tmp_path):
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_SCRIPT], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # DeepSpeedZeroOptimizer calls step() once per group, showing the optimizer only that group.
    calls = result["records"]
    assert result["steps_after_init"] == [0, 0]  # no dummy step with ZeRO-1 in this DeepSpeed
    assert len(calls) == 6 and result["steps"] == [3, 3]
    assert all(len(call["lrs"]) == 1 for call in calls)
    records = [{key: calls[i][key] + calls[i + 1][key] for key in calls[i]} for i in (0, 2, 4)]
    # One flat tensor per group: 6*8 + 8*3 = 72 decayed weights; 8 + 8 + 8 + 3 = 27 others, which
    # DeepSpeed pads with one zero to an aligned length (zeros add nothing to the norms).
    assert [[len(t) for t in g] for g in records[0]["weights"]] == [[72], [28]]
    assert records[0]["weights"][1][0][27] == 0.0 and records[0]["grads"][1][0][27] == 0.0

    # Step k uses 0.05 * f(k), f = linear warm-up over 2 steps, then linear decay to 0 at 8.
    for k, record in enumerate(records, start=1):
        expected_lr = 0.05 * (k / 2 if k < 2 else (8 - k) / 6)
        assert record["lrs"] == pytest.approx([expected_lr, expected_lr], rel=1e-12)
    # LANS on the flat partitions, from the first weights and the gradients DeepSpeed supplied.
    groups = [([torch.tensor(t, dtype=torch.float64) for t in g], decay)
              for g, decay in zip(records[0]["weights"], (0.01, 0.0))]
    grad_steps = [[[torch.tensor(t, dtype=torch.float64) for t in g] for g in r["grads"]] for r in records]
    lrs = [r["lrs"][0] for r in records]
    expected = lans_reference(groups, grad_steps, lrs)
    for final, ws in zip(result["final"], expected):
        torch.testing.assert_close(torch.tensor(final[0], dtype=torch.float64), ws[0], rtol=2e-6, atol=2e-6)
    # The weights seen at step 3 are step 2's result (no hidden extra update in between).
    after_two = lans_reference(groups, grad_steps[:2], lrs[:2])
    for seen, ws in zip(records[2]["weights"], after_two):
        torch.testing.assert_close(torch.tensor(seen[0], dtype=torch.float64), ws[0], rtol=2e-6, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# Tensor segments: each simulated rank holds one contiguous slice of every group's flat, padded
# concatenation (as ZeRO-1/2 do), runs in its own thread, and sums its partial norms with the
# others through a barrier-synchronised fake all-reduce. The per-tensor result must be the
# float64 reference's whatever the number of ranks; without segments it must not be.


def split_like_zero(tensors, world, alignment=2):
    """Flat concatenation padded to a multiple of alignment * world, cut into world equal slices.
    Returns (slices, per rank a TensorSegments, (offset, numel) of every tensor in the flat)."""
    places, offset = [], 0
    for t in tensors:
        places.append((offset, t.numel()))
        offset += t.numel()
    padded = -(-offset // (alignment * world)) * alignment * world
    flat = torch.cat([t.reshape(-1) for t in tensors] + [torch.zeros(padded - offset, dtype=tensors[0].dtype)])
    size = padded // world
    layouts = []
    for rank in range(world):
        lo, hi = rank * size, (rank + 1) * size
        segments = tuple((max(start, lo) - lo, min(start + n, hi) - max(start, lo), tid)
                         for tid, (start, n) in enumerate(places) if max(start, lo) < min(start + n, hi))
        layouts.append(TensorSegments(len(tensors), segments))
    return list(flat.split(size)), layouts, places


class FakeAllReduce:
    """Sums a tensor over `world` threads in place: each adds its copy, all wait, all read the sum;
    the last to finish reading clears the sum for the next call (a barrier action). A rank that makes fewer
    calls than the others leaves them waiting: after 120 s their wait raises BrokenBarrierError (a test
    failure, not a hang: the ranks' calls come seconds apart at most, compilation included)."""

    def __init__(self, world):
        import threading
        self.lock, self.total, self.calls = threading.Lock(), None, 0
        self.added = threading.Barrier(world, timeout=120)
        self.read = threading.Barrier(world, action=self._clear, timeout=120)

    def _clear(self):
        self.total = None

    def __call__(self, tensor):
        with self.lock:
            self.total = tensor.clone() if self.total is None else self.total + tensor
            self.calls += 1
        self.added.wait()
        tensor.copy_(self.total)
        self.read.wait()


def run_partitioned_lans(groups, grad_steps, lrs, world, segmented=True, **options):
    """LANS on `world` simulated ranks; returns the per-tensor weights reassembled from the slices,
    and how many all-reduce calls each rank made."""
    import threading
    split_weights = [split_like_zero(ws, world) for ws, _ in groups]
    split_grads = [[split_like_zero([torch.zeros_like(w) if g is None else g for g, w in zip(gs, ws)], world)[0]
                    for gs, (ws, _) in zip(step, groups)] for step in grad_steps]
    reduce = FakeAllReduce(world)
    finals, errors = [None] * world, []

    def rank_main(rank):
        try:
            params = [torch.nn.Parameter(slices[rank].clone()) for slices, _, _ in split_weights]
            optimizer = LANS([{"params": [p], "weight_decay": decay} for p, (_, decay) in zip(params, groups)],
                             lr=lrs[0], **options)
            if segmented:
                optimizer.set_tensor_segments({p: layouts[rank] for p, (_, layouts, _) in zip(params, split_weights)},
                                              reduce)
            apply_steps(optimizer, [[p] for p in params], [[[g[rank]] for g in step] for step in split_grads], lrs)
            finals[rank] = [p.detach() for p in params]
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)
            reduce.added.abort()
            reduce.read.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    result = []
    for gi, (ws, _) in enumerate(groups):
        flat = torch.cat([finals[r][gi] for r in range(world)])
        result.append([flat[start:start + n].view(w.shape) for w, (start, n) in zip(ws, split_weights[gi][2])])
    return result, reduce.calls // world


def check_tensor_segments_over_simulated_partitions(name, world, compile_update=False):
    options, problem = dict(CASES[name][0]), CASES[name][1]
    # Uneven sizes: with 2-4 ranks some tensors straddle one or more partition boundaries.
    groups, grad_steps = make_problem(**problem, shapes=((7, 5), (13,), (3,), (22,)))
    weights, reduce_calls = run_partitioned_lans(groups, grad_steps, LRS, world, compile_update=compile_update,
                                                 **options)
    assert_weights_close([[torch.nn.Parameter(w) for w in ws] for ws in weights],
                         lans_reference(groups, grad_steps, LRS, **options))
    # Per group and step: the gradient and weight norms, then the two direction norms; per step one
    # more for the global clip (here step() sees both groups at once).
    assert reduce_calls == len(LRS) * (2 * len(groups) + (1 if options.get("max_grad_norm") else 0))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("name", ["defaults", "max_grad_norm", "zero_weight_no_decay_bias", "zero_gradient_tensor"])
@pytest.mark.parametrize("chunk_elements", [3, 1 << 18])
def test_tensor_segments_over_simulated_partitions_match_per_tensor_reference(monkeypatch, name, world,
                                                                              chunk_elements):
    import lans
    monkeypatch.setattr(lans, "CHUNK_ELEMENTS", chunk_elements)
    check_tensor_segments_over_simulated_partitions(name, world)


@pytest.mark.parametrize("world", [1, 3])
def test_compiled_update_over_simulated_partitions_matches_per_tensor_reference(compiled_from_scratch, world):
    """Segment blocks (views into a flat partition at any offset, one of a single value) through the compiled
    sweeps."""
    check_tensor_segments_over_simulated_partitions("defaults", world, compile_update=True)


def test_partition_blocks_differ_from_per_tensor_reference_on_several_ranks():
    """Negative control: without segments each rank's slice is one block (the reference's ZeRO
    behaviour), which must be distinguishable from the per-tensor update."""
    groups, grad_steps = make_problem(shapes=((7, 5), (13,), (3,), (22,)))
    weights, reduce_calls = run_partitioned_lans(groups, grad_steps, LRS, 2, segmented=False)
    expected = lans_reference(groups, grad_steps, LRS)
    difference = max((w.double() - e).abs().max().item() for ws, es in zip(weights, expected) for w, e in zip(ws, es))
    assert difference > 1e-3 and reduce_calls == 0


def test_rank_holding_only_padding_still_takes_part_in_the_reductions():
    # 3 values padded to 8 over 4 ranks: ranks 2 and 3 hold padding only.
    groups = [([torch.tensor([0.5, -1.0, 2.0])], 0.01)]
    grad_steps = [[[torch.tensor([0.1, 0.2, -0.3])]], [[torch.tensor([-0.2, 0.4, 0.1])]]]
    weights, _ = run_partitioned_lans(groups, grad_steps, LRS[:2], 4)
    torch.testing.assert_close(weights[0][0].double(), lans_reference(groups, grad_steps, LRS[:2])[0][0])


def test_bad_tensor_segments_are_refused():
    param = torch.nn.Parameter(torch.zeros(10))
    optimizer = LANS([param])
    with pytest.raises(ValueError, match="overlaps"):
        optimizer.set_tensor_segments({param: TensorSegments(2, ((0, 6, 0), (5, 5, 1)))})
    with pytest.raises(ValueError, match="outside"):
        optimizer.set_tensor_segments({param: TensorSegments(2, ((0, 11, 0),))})
    with pytest.raises(ValueError, match="not a parameter"):
        optimizer.set_tensor_segments({torch.nn.Parameter(torch.zeros(3)): TensorSegments(1, ((0, 3, 0),))})
