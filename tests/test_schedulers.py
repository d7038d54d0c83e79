"""Schedulers against closed formulas written here, and the step-index rule: the LR used by
optimizer step k (1-based) is base_lr * f(k)."""

import math

import pytest
import torch

from lans import LANS
from schedulers import (
    ConstantWarmUpScheduler,
    CosineWarmUpScheduler,
    LinearWarmUpScheduler,
    PolyWarmUpScheduler,
    constant_warmup_factor,
    cosine_warmup_factor,
    linear_warmup_factor,
    poly_warmup_factor,
)


def expected_poly(t, T, warmup, constant, degree):
    p = t / T
    if p < warmup:
        return p / warmup
    if p < warmup + constant:
        return 1.0
    return max(1.0 - p, 0.0) ** degree / (1.0 - warmup - constant) ** degree


def expected_linear(t, T, warmup):
    p = t / T
    return p / warmup if p < warmup else max((p - 1.0) / (warmup - 1.0), 0.0)


def expected_constant(t, T, warmup):
    p = t / T
    return p / warmup if p < warmup else (1.0 if p <= 1.0 else 0.0)


def expected_cosine(t, T, warmup):
    p = t / T
    if p < warmup:
        return p / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(p - warmup, 1.0 - warmup) / (1.0 - warmup)))


POLY_CONFIGS = [(100, 0.1, 0.2, 1.0), (100, 0.1, 0.2, 2.0), (200, 0.05, 0.0, 0.5), (40, 0.25, 0.5, 1.0),
                (1000, 0.0, 0.3, 1.0)]


def check_points(T, warmup, constant=0.0):
    """0, inside warm-up, both phase boundaries (and one step either side), inside decay, T, past T."""
    ends = [round(warmup * T), round((warmup + constant) * T)]
    points = {0, max(ends[0] // 2, 1), T // 2 + 1, T - 1, T, T + 1, 2 * T}
    points |= {e + d for e in ends for d in (-1, 0, 1) if e + d >= 0}
    return sorted(points)


@pytest.mark.parametrize("T,warmup,constant,degree", POLY_CONFIGS)
def test_poly_factor_matches_closed_formula(T, warmup, constant, degree):
    for t in check_points(T, warmup, constant):
        assert poly_warmup_factor(t, T, warmup, constant, degree) == pytest.approx(
            expected_poly(t, T, warmup, constant, degree), abs=1e-12), t


def test_poly_factor_hand_computed_values():
    # T=100, warm-up 10 steps, plateau to step 30, then ((1 - p) / 0.7)**2
    values = {0: 0.0, 5: 0.5, 10: 1.0, 20: 1.0, 30: 1.0, 65: 0.25, 100: 0.0, 101: 0.0, 250: 0.0}
    for t, value in values.items():
        assert poly_warmup_factor(t, 100, 0.1, 0.2, 2.0) == pytest.approx(value, abs=1e-12), t


@pytest.mark.parametrize("T,warmup", [(100, 0.1), (50, 0.3), (10, 0.0)])
def test_linear_constant_cosine_factors_match_closed_formulas(T, warmup):
    for t in check_points(T, warmup):
        assert linear_warmup_factor(t, T, warmup) == pytest.approx(expected_linear(t, T, warmup), abs=1e-12)
        assert constant_warmup_factor(t, T, warmup) == pytest.approx(expected_constant(t, T, warmup), abs=1e-12)
        assert cosine_warmup_factor(t, T, warmup) == pytest.approx(expected_cosine(t, T, warmup), abs=1e-12)


def test_cosine_decays_from_one_to_zero_after_warmup():
    # warm-up 20 of 100 steps: half-way through the decay (t=60) the factor is 0.5
    assert cosine_warmup_factor(20, 100, 0.2) == pytest.approx(1.0)
    assert cosine_warmup_factor(60, 100, 0.2) == pytest.approx(0.5)
    assert cosine_warmup_factor(100, 100, 0.2) == pytest.approx(0.0, abs=1e-15)
    values = [cosine_warmup_factor(t, 100, 0.2) for t in range(20, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def make_optimizer(lrs=(0.1, 0.03)):
    params = [torch.nn.Parameter(torch.randn(3, 2)) for _ in lrs]
    optimizer = LANS([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])
    return params, optimizer


SCHEDULERS = {
    "poly": (lambda opt: PolyWarmUpScheduler(opt, 0.2, 10, degree=2.0, constant=0.3),
             lambda t: expected_poly(t, 10, 0.2, 0.3, 2.0)),
    "linear": (lambda opt: LinearWarmUpScheduler(opt, 0.2, 10), lambda t: expected_linear(t, 10, 0.2)),
    "constant": (lambda opt: ConstantWarmUpScheduler(opt, 0.2, 10), lambda t: expected_constant(t, 10, 0.2)),
    "cosine": (lambda opt: CosineWarmUpScheduler(opt, 0.2, 10), lambda t: expected_cosine(t, 10, 0.2)),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_optimizer_step_k_uses_f_of_k_in_every_group(name):
    build, expected = SCHEDULERS[name]
    params, optimizer = make_optimizer()
    scheduler = build(optimizer)
    for k in range(1, 14):  # runs past T = 10
        used = [group["lr"] for group in optimizer.param_groups]
        assert used == pytest.approx([0.1 * expected(k), 0.03 * expected(k)], abs=1e-15), k
        assert scheduler.get_last_lr() == used
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    assert all(group["step"] == 13 for group in optimizer.param_groups)


def test_torch_adamw_without_group_counter_also_uses_f_of_k():
    param = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW([param], lr=0.2)
    scheduler = PolyWarmUpScheduler(optimizer, 0.25, 8)
    for k in range(1, 11):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2 * expected_poly(k, 8, 0.25, 0, 1)), k
        param.grad = torch.randn(4)
        optimizer.step()
        scheduler.step()


def test_state_dict_round_trip_into_fresh_scheduler(tmp_path):
    params, optimizer = make_optimizer()
    scheduler = PolyWarmUpScheduler(optimizer, 0.2, 10, degree=2.0, constant=0.3)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer.step()
        scheduler.step()
    torch.save(scheduler.state_dict(), tmp_path / "scheduler.pt")
    saved = torch.load(tmp_path / "scheduler.pt", weights_only=True)

    # A fresh optimizer and scheduler built with other settings take everything from the file.
    _, fresh_optimizer = make_optimizer(lrs=(1.0, 2.0))
    fresh_optimizer.load_state_dict(optimizer.state_dict())
    fresh = PolyWarmUpScheduler(fresh_optimizer, 0.5, 99)
    fresh.load_state_dict(saved)
    assert fresh is not scheduler and fresh.state_dict() == scheduler.state_dict()
    fresh.step()
    scheduler.step()
    assert fresh.get_last_lr() == scheduler.get_last_lr()
    assert fresh.get_last_lr() == pytest.approx([0.1 * expected_poly(4, 10, 0.2, 0.3, 2.0),
                                                 0.03 * expected_poly(4, 10, 0.2, 0.3, 2.0)])


def test_load_state_dict_rejects_a_foreign_state():
    _, optimizer = make_optimizer()
    scheduler = LinearWarmUpScheduler(optimizer, 0.1, 10)
    poly_state = PolyWarmUpScheduler(make_optimizer()[1], 0.1, 10).state_dict()
    with pytest.raises(ValueError, match="keys"):
        scheduler.load_state_dict(poly_state)


@pytest.mark.parametrize("kwargs,match", [
    ({"warmup": 0.1, "total_steps": 0}, "total_steps"),
    ({"warmup": 1.5, "total_steps": 10}, "warmup"),
    ({"warmup": 0.5, "total_steps": 10, "constant": 0.6}, "constant"),
    ({"warmup": 0.1, "total_steps": 10, "degree": 0.0}, "degree"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PolyWarmUpScheduler(make_optimizer()[1], **kwargs)


def hugging_face_linear(step, warmup_steps, total_steps):
    """transformers' get_linear_schedule_with_warmup factor, written out."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def test_adamw_with_poly_degree_1_is_hugging_face_linear_schedule_one_step_on():
    """Recipe d of bench/bench_convergence.py (--optimizer adamw --use_lr_scheduler --scheduler_degree 1): the
    weights equal torch's AdamW under a LambdaLR of Hugging Face's linear warm-up and decay, read one step on
    (PolyWarmUp's step k uses f(k); LambdaLR's uses f(k - 1), so Hugging Face's first step has LR 0)."""
    torch.manual_seed(0)
    start = torch.randn(6)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    total, warmup = 10, 0.2
    ours_opt = torch.optim.AdamW([ours], lr=0.1, weight_decay=0.01)
    theirs_opt = torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.01)
    ours_sched = PolyWarmUpScheduler(ours_opt, warmup, total, degree=1.0)
    theirs_sched = torch.optim.lr_scheduler.LambdaLR(
        theirs_opt, lambda step: hugging_face_linear(step + 1, int(warmup * total), total))
    for _ in range(total + 2):
        grad = torch.randn(6)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        ours_opt.step()
        theirs_opt.step()
        ours_sched.step()
        theirs_sched.step()
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=0, atol=1e-7)
