"""LANS: layer-wise adaptive moments with normalised gradients and Nesterov-style update.

Zheng et al. 2020, "Accelerated Large Batch Optimization of BERT Pretraining in 54 minutes"
(arXiv:2006.13484), Algorithm 2, as the Habana deepspeed-bert reference implements it.

One ``step()`` does, for every parameter group with at least one gradient:

    step   <- step + 1                                     (group['step'], an int)
    k      =  step - 1 if (adjust_step and step > 1) else step
    bc1    =  1 - beta1**k,  bc2 = 1 - beta2**k            (both 1 when bias_correction=False)
    beta3  =  1 - beta1 if grad_averaging else 1

and for every tensor ("block") w of the group whose gradient g is not None:

    g_hat  =  g / (||g|| + eps)       if ||g|| != 0 else g     gradient normalisation
    m      <- beta1 * m + beta3 * g_hat                        state['exp_avg']
    v      <- beta2 * v + (1 - beta2) * g_hat**2               state['exp_avg_sq']
    den    =  sqrt(v / bc2) + eps
    r      =  (m / bc1) / den + wd * w                         Adam direction with decoupled decay
    c      =  g_hat / den + wd * w                             current-gradient direction with decay
    phi_r  =  ||w|| / ||r||   if ||w|| != 0 and ||r|| != 0 else 1
    phi_c  =  ||w|| / ||c||   if ||w|| != 0 and ||c|| != 0 else 1
    w      <- w - lr * beta1 * phi_r * r - lr * beta3 * phi_c * c

||.|| is the L2 norm over the whole tensor. The trust ratios are not clamped and are applied to
no-decay groups too (unlike NVLAMB). Before all this, when ``max_grad_norm > 0``, every gradient is
divided by ``max(G / max_grad_norm, 1)`` where G is the L2 norm over all gradients of all groups
(the gradients themselves are not modified; the division is on a copy).

Blocks: with plain PyTorch (or DeepSpeed ZeRO stage 0) a block is one parameter tensor, as in the
paper. Under DeepSpeed ZeRO stage 1/2 the optimizer only ever sees one flat fp32 partition per
parameter group per rank, so the "blocks" (and all the norms above) are those partitions, exactly as
in the reference. LANS does nothing special for that case; it works on whatever tensors it holds.
DeepSpeed 0.19.8's ZeRO-1/2 also call ``step()`` once per group with ``param_groups`` narrowed to
that group, so ``max_grad_norm`` then clips per group and per rank; use DeepSpeed's
``gradient_clipping`` for a true global clip (the reference sets ``max_grad_norm=0`` and does so).
Unlike the reference, the per-block diagnostics (weight/adam/c norms) are not kept in the state.

Precision: the moments and all the arithmetic are float32 for bf16/fp16 parameters (float64 for
float64 ones); the result is written back to the parameter in its own dtype.
"""

import torch


def bias_corrections(step, betas, bias_correction, adjust_step):
    """Return (bc1, bc2) for group step ``step`` (1-based).

    ``adjust_step`` lowers the exponent by one after the first step: DeepSpeed versions that take a
    zero-gradient step at initialisation make real step k the optimizer's step k+1.
    """
    if not bias_correction:
        return 1.0, 1.0
    exponent = step - 1 if (adjust_step and step > 1) else step
    beta1, beta2 = betas
    return 1.0 - beta1**exponent, 1.0 - beta2**exponent


def update_moments(exp_avgs, exp_avg_sqs, inputs, betas, input_weight):
    """In place: m <- beta1 m + input_weight x;  v <- beta2 v + (1 - beta2) x**2."""
    beta1, beta2 = betas
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, inputs, alpha=input_weight)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, inputs, inputs, value=1.0 - beta2)


def adam_directions(exp_avgs, exp_avg_sqs, bc1, bc2, eps):
    """Return (m_hat / den, den) with den = sqrt(v / bc2) + eps, as new tensor lists."""
    denominators = torch._foreach_div(exp_avg_sqs, bc2)
    torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, eps)
    directions = torch._foreach_div(exp_avgs, bc1)
    torch._foreach_div_(directions, denominators)
    return directions, denominators


def trust_ratios(weight_norms, update_norms):
    """||w|| / ||u|| per block, or 1 where either norm is 0 (0-dim tensors, no host sync)."""
    return [
        torch.where((w > 0) & (u > 0), w / u, torch.ones_like(w))
        for w, u in zip(weight_norms, update_norms)
    ]


def _compute_dtype(param):
    """float32 for half-precision parameters, the parameter's own dtype otherwise."""
    return torch.promote_types(param.dtype, torch.float32)


class GroupTensors:
    """The tensors of one parameter group that take part in a step (params with a gradient).

    ``weights`` and ``grads`` are in the compute dtype: for float32 parameters they ARE the
    parameter and its gradient (updating ``weights`` in place updates the parameter); for bf16
    parameters they are float32 copies and :meth:`write_back` copies the result back.
    """

    def __init__(self, params, optimizer_state):
        self.params = params
        # .to() returns the tensor itself when the dtype already matches (step runs under no_grad).
        self.weights = [p.to(_compute_dtype(p)) for p in params]
        self.grads = [p.grad.to(_compute_dtype(p)) for p in params]
        states = [optimizer_state[p] for p in params]
        for state, weight in zip(states, self.weights):
            if not state:
                state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
        self.exp_avgs = [state["exp_avg"] for state in states]
        self.exp_avg_sqs = [state["exp_avg_sq"] for state in states]

    def write_back(self):
        for param, weight in zip(self.params, self.weights):
            if weight is not param:
                param.copy_(weight)


class AdaptiveMomentOptimizer(torch.optim.Optimizer):
    """Shared machinery of LANS and NVLAMB: Adam moments in (at least) float32, an int ``group['step']``,
    optional global gradient-norm clipping, and ``zero_grad`` honouring ``set_grad_none``.

    Subclasses implement :meth:`update_group` (the per-group math, after ``group['step']`` has been
    incremented and the gradients clipped).
    """

    def __init__(self, params, defaults):
        if defaults["lr"] < 0.0:
            raise ValueError(f"invalid learning rate {defaults['lr']}: must be >= 0")
        if defaults["eps"] <= 0.0:
            raise ValueError(f"invalid eps {defaults['eps']}: must be > 0")
        if not all(0.0 <= beta < 1.0 for beta in defaults["betas"]):
            raise ValueError(f"invalid betas {defaults['betas']}: each must be in [0, 1)")
        if defaults["weight_decay"] < 0.0:
            raise ValueError(f"invalid weight_decay {defaults['weight_decay']}: must be >= 0")
        if defaults["max_grad_norm"] < 0.0:
            raise ValueError(f"invalid max_grad_norm {defaults['max_grad_norm']}: "
                             "must be >= 0 (0 disables)")
        super().__init__(params, {**defaults, "step": 0})

    def update_group(self, group, tensors):
        raise NotImplementedError

    def zero_grad(self, set_to_none=None):
        if set_to_none is None:
            set_to_none = self.defaults["set_grad_none"]
        super().zero_grad(set_to_none=set_to_none)

    def _clip_by_global_norm(self, all_tensors):
        """Divide every gradient by max(G / max_grad_norm, 1), G = norm over all groups."""
        max_norm = self.defaults["max_grad_norm"]
        grads = [grad for tensors in all_tensors for grad in tensors.grads]
        if max_norm <= 0.0 or not grads:
            return
        global_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        divisor = torch.clamp(global_norm / max_norm, min=1.0)
        for tensors in all_tensors:
            # Out of place: for fp32 params tensors.grads alias param.grad, which stays untouched.
            tensors.grads = torch._foreach_div(tensors.grads, divisor)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                active.append((group, GroupTensors(params, self.state)))
        self._clip_by_global_norm([tensors for _, tensors in active])
        for group, tensors in active:
            group["step"] += 1
            self.update_group(group, tensors)
            tensors.write_back()
        return loss

    def load_state_dict(self, state_dict):
        """As torch's, but keep the moments in the compute dtype.

        torch casts every floating state tensor to its parameter's dtype on load, which would turn the
        float32 moments of bf16 parameters into bf16; put the saved float32 values back.
        """
        super().load_state_dict(state_dict)
        saved_ids = [pid for group in state_dict["param_groups"] for pid in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, param in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value) and value.is_floating_point():
                    self.state[param][key] = value.to(device=param.device, dtype=_compute_dtype(param))


class LANS(AdaptiveMomentOptimizer):
    """LANS optimizer (see the module docstring for the update, equation by equation).

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate eta.
        bias_correction: divide the moments by (1 - beta**k).
        betas: (beta1, beta2) for the first and second moments.
        eps: added to ||g|| in the gradient normalisation and to sqrt(v_hat) in the denominator.
        weight_decay: decoupled decay wd, added inside both directions before their norms.
        grad_averaging: weight the gradient terms by 1 - beta1 (True) or 1 (False).
        set_grad_none: default of ``zero_grad(set_to_none=...)``.
        max_grad_norm: clip all gradients by their global L2 norm first; 0 disables.
        adjust_step: bias-correction exponent step-1 after the first step (see bias_corrections).
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6,
                 weight_decay=0.01, grad_averaging=True, set_grad_none=True, max_grad_norm=0.0,
                 adjust_step=False):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        set_grad_none=set_grad_none, max_grad_norm=max_grad_norm,
                        adjust_step=adjust_step)
        super().__init__(params, defaults)

    def update_group(self, group, tensors):
        beta1 = group["betas"][0]
        eps, lr, decay = group["eps"], group["lr"], group["weight_decay"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        bc1, bc2 = bias_corrections(group["step"], group["betas"], group["bias_correction"],
                                    group["adjust_step"])
        weights = tensors.weights

        # g_hat = g / (||g|| + eps), or g itself when ||g|| = 0
        grad_norms = torch._foreach_norm(tensors.grads)
        grad_scales = [torch.where(n > 0, 1.0 / (n + eps), torch.ones_like(n)) for n in grad_norms]
        normalised = torch._foreach_mul(tensors.grads, grad_scales)

        update_moments(tensors.exp_avgs, tensors.exp_avg_sqs, normalised, group["betas"], beta3)

        # r = m_hat / den + wd w;  c = g_hat / den + wd w;  den = sqrt(v_hat) + eps
        adam_dirs, denominators = adam_directions(tensors.exp_avgs, tensors.exp_avg_sqs, bc1, bc2, eps)
        grad_dirs = normalised
        torch._foreach_div_(grad_dirs, denominators)
        if decay != 0.0:
            torch._foreach_add_(adam_dirs, weights, alpha=decay)
            torch._foreach_add_(grad_dirs, weights, alpha=decay)

        # w <- w - lr beta1 phi_r r - lr beta3 phi_c c
        weight_norms = torch._foreach_norm(weights)
        adam_ratios = trust_ratios(weight_norms, torch._foreach_norm(adam_dirs))
        grad_ratios = trust_ratios(weight_norms, torch._foreach_norm(grad_dirs))
        torch._foreach_mul_(adam_dirs, [ratio * (-lr * beta1) for ratio in adam_ratios])
        torch._foreach_mul_(grad_dirs, [ratio * (-lr * beta3) for ratio in grad_ratios])
        torch._foreach_add_(weights, adam_dirs)
        torch._foreach_add_(weights, grad_dirs)
