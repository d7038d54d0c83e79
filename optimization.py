"""Parameter groups and the optimizer factory behind ``--optimizer``; NVLAMB.

``build_optimizer`` instantiates the optimizers as the Habana deepspeed-bert reference does:
- ``lans``:   LANS(eps=1e-6, max_grad_norm=0.0); clipping, if any, is DeepSpeed's
  ``gradient_clipping``.
- ``nvlamb``: NVLAMB below (its own global-norm clipping at 1.0, eps=1e-6).
- ``adam`` / ``adamw``: torch.optim.Adam / AdamW with torch's defaults apart from lr and betas.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import ParamsT

from lans import (
    LANS,
    AdaptiveMomentOptimizer,
    GroupTensors,
    adam_directions,
    bias_corrections,
    scaled,
    trust_ratios,
    update_moments,
)

OPTIMIZERS = ("lans", "nvlamb", "adam", "adamw")

# A parameter whose name contains one of these gets no weight decay (the reference's rule; gamma/beta
# are the LayerNorm names of old TF-ported checkpoints).
NO_DECAY_NAME_PARTS = ("bias", "gamma", "beta", "LayerNorm")


def get_parameter_groups(model: nn.Module, weight_decay: float = 0.01) -> list[dict[str, Any]]:
    """Two groups: [{'params': decayed, 'weight_decay': weight_decay}, {'params': rest, 0.0}].

    ``named_parameters()`` lists a tied parameter once (under its first name), so the word
    embedding shared with the MLM decoder appears once, in the decay group. Parameters with
    ``requires_grad=False`` are left out.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if any(part in name for part in NO_DECAY_NAME_PARTS):
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(name: str, param_groups: list[dict[str, Any]], lr: float, betas: Sequence[float] | None = None,
                    adjust_step: bool = False, compile_update: bool = False) -> torch.optim.Optimizer:
    """Optimizer ``name`` (one of OPTIMIZERS) over ``param_groups`` with base LR ``lr``.

    ``betas=None`` keeps each optimizer's default (0.9, 0.999). ``adjust_step`` only concerns
    LANS/NVLAMB (see lans.bias_corrections), ``compile_update`` only LANS (see lans.LANS).
    Unknown name -> ValueError naming the choices.
    """
    kwargs: dict[str, Any] = {"lr": lr}
    if betas is not None:
        kwargs["betas"] = tuple(betas)
    if name == "lans":
        return LANS(param_groups, eps=1e-6, max_grad_norm=0.0, adjust_step=adjust_step,
                    compile_update=compile_update, **kwargs)
    if name == "nvlamb":
        return NVLAMB(param_groups, adjust_step=adjust_step, **kwargs)
    if name == "adam":
        return torch.optim.Adam(param_groups, **kwargs)
    if name == "adamw":
        return torch.optim.AdamW(param_groups, **kwargs)
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


class NVLAMB(AdaptiveMomentOptimizer):
    """LAMB as NVIDIA's NVLAMB (the reference's ``lamb.py``), per group after ``step += 1``:

        g      <- g / max(G / max_grad_norm, 1)     G = L2 norm over all gradients; skipped if 0
        m      <- beta1 * m + (1 - beta1) * g
        v      <- beta2 * v + (1 - beta2) * g**2
        u      =  (m / bc1) / (sqrt(v / bc2) + eps) + wd * w
        ratio  =  ||w|| / ||u|| (1 if either is 0)  when wd != 0 or use_nvlamb, else 1
        w      <- w - lr * ratio * u

    bc1, bc2 follow the same ``bias_correction``/``adjust_step`` rule as LANS, and so do the blocks:
    tensors, flat ZeRO-1/2 partitions, or tensor segments of them (see lans.py; under ZeRO G is per
    group, because DeepSpeed steps the optimizer one group at a time).
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 adjust_step: bool = False):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, set_grad_none=set_grad_none,
                        max_grad_norm=max_grad_norm, use_nvlamb=use_nvlamb, adjust_step=adjust_step)
        super().__init__(params, defaults)

    def update_group(self, group: dict[str, Any], tensors: GroupTensors) -> None:
        beta1 = group["betas"][0]
        eps, lr, decay = group["eps"], group["lr"], group["weight_decay"]
        bc1, bc2 = bias_corrections(group["step"], group["betas"], group["bias_correction"],
                                    group["adjust_step"])
        weights = tensors.weights

        update_moments(tensors.exp_avgs, tensors.exp_avg_sqs, tensors.grads, group["betas"], 1.0 - beta1)
        updates, _ = adam_directions(tensors.exp_avgs, tensors.exp_avg_sqs, bc1, bc2, eps)
        if decay != 0.0:
            torch._foreach_add_(updates, weights, alpha=decay)

        if decay != 0.0 or group["use_nvlamb"]:
            weight_norms, update_norms = self.block_norms(tensors, weights, updates)
            torch._foreach_mul_(updates, scaled(trust_ratios(weight_norms, update_norms), -lr))
        else:
            torch._foreach_mul_(updates, -lr)
        torch._foreach_add_(weights, updates)
