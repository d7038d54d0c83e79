"""Test helpers shared by tests/test_lans.py and tests/test_optimization.py: small optimisation problems,
a driver that steps an optimizer through them, and the float64 norm the reference re-derivations use."""

import math

import torch


def norm(x):
    """L2 norm over the whole tensor, as a Python float (float64 arithmetic)."""
    return math.sqrt(float((x * x).sum()))


def make_problem(seed=0, shapes=((6, 5), (5,), (7,)), steps=4, zero_grad_tensor=None,
                 none_grad=None, dtype=torch.float32, grad_scale=1.0, zero_weight_tensor=None):
    """Weights of two groups (decay 0.01: shapes[0]; decay 0: the rest) and random gradients.

    Returns (groups, grad_steps): groups = [(weights, weight_decay)]; grad_steps[step][group][tensor].
    zero_grad_tensor=(group, tensor): that gradient is all zeros on every step.
    none_grad=(step, group, tensor): that gradient is None on that step.
    zero_weight_tensor=index into shapes: that weight starts at zero, like a freshly initialised bias."""
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    if zero_weight_tensor is not None:
        tensors[zero_weight_tensor].zero_()
    groups = [(tensors[:1], 0.01), (tensors[1:], 0.0)]
    grad_steps = []
    for step in range(steps):
        per_group = []
        for gi, (ws, _) in enumerate(groups):
            gs = []
            for ti, w in enumerate(ws):
                g = (grad_scale * torch.randn(w.shape, generator=gen)).to(dtype)
                if zero_grad_tensor == (gi, ti):
                    g = torch.zeros_like(g)
                if none_grad == (step, gi, ti):
                    g = None
                gs.append(g)
            per_group.append(gs)
        grad_steps.append(per_group)
    return groups, grad_steps


def apply_steps(optimizer, params, grad_steps, lrs=None):
    """One optimizer.step() per entry of grad_steps, with those gradients (None: no gradient) and, when
    lrs is given, that step's LR in every group."""
    for step, grads in enumerate(grad_steps):
        for ps, gs in zip(params, grads):
            for p, g in zip(ps, gs):
                p.grad = None if g is None else g.clone()
        if lrs is not None:
            for group in optimizer.param_groups:
                group["lr"] = lrs[step]
        optimizer.step()


def run_optimizer(make, groups, grad_steps, lrs=None):
    """Fresh Parameters copied from groups, optimizer = make(param-group dicts), then apply_steps.
    Returns (params, optimizer)."""
    params = [[torch.nn.Parameter(w.clone()) for w in ws] for ws, _ in groups]
    optimizer = make([{"params": ps, "weight_decay": decay} for ps, (_, decay) in zip(params, groups)])
    apply_steps(optimizer, params, grad_steps, lrs)
    return params, optimizer


def assert_weights_close(params, expected, rtol=2e-6, atol=2e-6):
    """Every parameter (nested like groups) against its float64 expectation."""
    for ps, ws in zip(params, expected):
        for p, w in zip(ps, ws):
            torch.testing.assert_close(p.detach().double(), w, rtol=rtol, atol=atol)
