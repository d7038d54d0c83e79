"""optimization.py: NVLAMB against its own float64 re-derivation (the reference's `lamb.py`, Model-References
1.9.0 deepspeed-bert), the no-decay grouping rule on a small module with LayerNorm, biases and tied weights, and
the optimizer factory."""

import math

import pytest
import torch
from torch import nn

from lans import LANS
from optim_helpers import assert_weights_close, make_problem, norm, run_optimizer
from optimization import NVLAMB, OPTIMIZERS, build_optimizer, get_parameter_groups


def nvlamb_reference(groups, grad_steps, lr, betas=(0.9, 0.999), eps=1e-6, bias_correction=True,
                     max_grad_norm=1.0, use_nvlamb=False, adjust_step=False, trust_ratio=True):
    """float64 NVLAMB. groups: [(weights, weight_decay)]; grad_steps: per step, per group, per
    tensor gradients. trust_ratio=False is a mutant that never applies the ratio."""
    weights = [[w.double().clone() for w in ws] for ws, _ in groups]
    moments = [[(torch.zeros_like(w), torch.zeros_like(w)) for w in ws] for ws in weights]
    beta1, beta2 = betas
    for step, grads in enumerate(grad_steps, start=1):
        grads = [[g.double() for g in gs] for gs in grads]
        total = math.sqrt(sum(norm(g) ** 2 for gs in grads for g in gs))
        clip = total / max_grad_norm if (max_grad_norm > 0 and total > max_grad_norm) else 1.0
        k = step - 1 if (adjust_step and step > 1) else step
        bc1, bc2 = (1 - beta1**k, 1 - beta2**k) if bias_correction else (1.0, 1.0)
        for gi, (_, decay) in enumerate(groups):
            for ti, g in enumerate(grads[gi]):
                g = g / clip
                w = weights[gi][ti]
                m, v = moments[gi][ti]
                m = beta1 * m + (1 - beta1) * g
                v = beta2 * v + (1 - beta2) * g * g
                moments[gi][ti] = (m, v)
                u = (m / bc1) / (torch.sqrt(v / bc2) + eps) + decay * w
                ratio = 1.0
                if trust_ratio and (decay != 0 or use_nvlamb) and norm(w) != 0 and norm(u) != 0:
                    ratio = norm(w) / norm(u)
                weights[gi][ti] = w - lr * ratio * u
    return weights


CASES = {
    "defaults_clip_active": {},
    "no_clipping": {"max_grad_norm": 0.0},
    "clip_not_reached": {"max_grad_norm": 1e3},
    "use_nvlamb": {"use_nvlamb": True},
    "adjust_step": {"adjust_step": True},
    "bias_correction_off": {"bias_correction": False},
    "betas_eps": {"betas": (0.8, 0.99), "eps": 1e-3},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_nvlamb_matches_float64_reference(name):
    options = CASES[name]
    groups, grad_steps = make_problem(seed=1)
    params, optimizer = run_optimizer(lambda g: NVLAMB(g, lr=0.05, **options), groups, grad_steps)
    assert_weights_close(params, nvlamb_reference(groups, grad_steps, 0.05, **options))
    assert [g["step"] for g in optimizer.param_groups] == [4, 4]


def test_nvlamb_zero_gradient_tensor_with_use_nvlamb():
    groups, grad_steps = make_problem(seed=1, zero_grad_tensor=(1, 1))
    params, _ = run_optimizer(lambda g: NVLAMB(g, lr=0.05, use_nvlamb=True), groups, grad_steps)
    expected = nvlamb_reference(groups, grad_steps, 0.05, use_nvlamb=True)
    torch.testing.assert_close(params[1][1].detach().double(), expected[1][1], rtol=0, atol=0)
    assert_weights_close(params, expected)


@pytest.mark.parametrize("options,zero_weight_tensor", [({}, 0), ({"use_nvlamb": True}, 1)])
def test_nvlamb_zero_weight_tensor_gets_ratio_one(options, zero_weight_tensor):
    """||w|| = 0 (a zero-initialised bias; a decayed weight): ratio 1, so the tensor moves off zero."""
    groups, grad_steps = make_problem(seed=1, zero_weight_tensor=zero_weight_tensor)
    params, _ = run_optimizer(lambda g: NVLAMB(g, lr=0.05, **options), groups, grad_steps)
    assert_weights_close(params, nvlamb_reference(groups, grad_steps, 0.05, **options))


def test_nvlamb_reference_mutant_without_trust_ratio_disagrees():
    groups, grad_steps = make_problem(seed=1)
    params, _ = run_optimizer(lambda g: NVLAMB(g, lr=0.05), groups, grad_steps)
    mutant = nvlamb_reference(groups, grad_steps, 0.05, trust_ratio=False)
    assert (params[0][0].detach().double() - mutant[0][0]).abs().max() > 1e-3


class TinyTiedModel(nn.Module):
    """Embedding tied to a decoder, a LayerNorm, a Linear with bias, TF-style gamma/beta, a frozen
    parameter: every case of the grouping rule."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(10, 4)
        self.LayerNorm = nn.LayerNorm(4)
        self.dense = nn.Linear(4, 4)
        self.decoder = nn.Linear(4, 10, bias=False)
        self.decoder.weight = self.word_embeddings.weight
        self.bias = nn.Parameter(torch.zeros(10))
        self.gamma = nn.Parameter(torch.ones(4))
        self.beta = nn.Parameter(torch.zeros(4))
        self.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)


def test_parameter_groups_split_by_name_and_list_tied_weights_once():
    model = TinyTiedModel()
    decay_group, no_decay_group = get_parameter_groups(model, weight_decay=0.05)
    assert decay_group["weight_decay"] == 0.05 and no_decay_group["weight_decay"] == 0.0
    expected_decay = [model.word_embeddings.weight, model.dense.weight]
    expected_no_decay = [model.LayerNorm.weight, model.LayerNorm.bias, model.dense.bias, model.bias,
                         model.gamma, model.beta]
    assert [id(p) for p in decay_group["params"]] == [id(p) for p in expected_decay]
    assert sorted(id(p) for p in no_decay_group["params"]) == sorted(id(p) for p in expected_no_decay)
    # Usable as is: torch rejects a parameter listed twice across groups.
    LANS(get_parameter_groups(model))


def test_build_optimizer_instantiates_as_the_reference():
    model = TinyTiedModel()
    lans = build_optimizer("lans", get_parameter_groups(model), lr=0.0015, betas=(0.8, 0.95),
                           adjust_step=True)
    assert isinstance(lans, LANS)
    assert lans.defaults["eps"] == 1e-6 and lans.defaults["max_grad_norm"] == 0.0
    assert lans.defaults["adjust_step"] is True and lans.defaults["betas"] == (0.8, 0.95)
    assert [g["weight_decay"] for g in lans.param_groups] == [0.01, 0.0]
    assert [g["lr"] for g in lans.param_groups] == [0.0015, 0.0015]

    nvlamb = build_optimizer("nvlamb", get_parameter_groups(model), lr=0.001)
    assert isinstance(nvlamb, NVLAMB)
    assert nvlamb.defaults["max_grad_norm"] == 1.0 and nvlamb.defaults["eps"] == 1e-6
    assert nvlamb.defaults["betas"] == (0.9, 0.999) and nvlamb.defaults["adjust_step"] is False

    adam = build_optimizer("adam", get_parameter_groups(model), lr=0.002, betas=(0.7, 0.9))
    adamw = build_optimizer("adamw", get_parameter_groups(model), lr=0.002)
    assert type(adam) is torch.optim.Adam and adam.defaults["betas"] == (0.7, 0.9)
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["lr"] == 0.002
    assert OPTIMIZERS == ("lans", "nvlamb", "adam", "adamw")


def test_unknown_optimizer_names_the_choices():
    with pytest.raises(ValueError) as error:
        build_optimizer("sgd", get_parameter_groups(TinyTiedModel()), lr=0.1)
    message = str(error.value)
    assert "sgd" in message and all(name in message for name in OPTIMIZERS)
