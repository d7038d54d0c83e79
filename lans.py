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
paper. Under DeepSpeed ZeRO stage 1/2 the optimizer only holds one flat fp32 partition per parameter
group per rank, a slice of the concatenated tensors of the group. Left alone, LANS then takes that
partition as one block (the reference's behaviour, ``--lans_blocks partition``). With
:meth:`~AdaptiveMomentOptimizer.set_tensor_segments` the caller says where the original tensors lie
in each flat parameter (``TensorSegments``); every such piece is then a block, and the four norms of
a tensor cut between ranks are combined from every rank's partial sum of squares, all blocks of one
round in one ``all_reduce_sum`` call: two per group and step (the gradient norms; then the weight
and the two direction norms, which need the first). The segments come from a wiring module (training/zero_partitions.py)
that reads DeepSpeed's partition metadata; this module imports no DeepSpeed.
DeepSpeed 0.19.8's ZeRO-1/2 call ``step()`` once per group with ``param_groups`` narrowed to
that group, so ``max_grad_norm`` then clips per group (over all ranks with segments, per rank without);
use DeepSpeed's ``gradient_clipping`` for a true global clip (the reference sets ``max_grad_norm=0``).
Unlike the reference, the per-block diagnostics (weight/adam/c norms) are not kept in the state.

Speed: the update is memory-bound, so LANS makes three sweeps over the tensors instead of one full-size
pass per operation: the gradient norms; then, piece by piece (``CHUNK_ELEMENTS`` values, gathered into
``Chunk``s), the moments, both directions and the sums of squares of w, r and c; then, piece by piece
again, the directions recomputed from the same values and applied. The temporaries of a piece stay in the
CPU's cache and no full-size temporary is allocated. The arithmetic is the same operations as written above.
On an accelerator the pieces are whole tensors (one Chunk per group): cache-sized pieces there would only
multiply the kernel launches (``chunk_elements``). Eager, each operation of a sweep is still its own loop
over the piece; with ``compile_update=True`` torch.compile fuses each sweep into one loop and the sweeps go
a whole block at a time: one pass over memory per sweep, measured 2.5 and 4.4 times faster in two runs at
BERT-1.5B widths on a 2-core CPU (``bench/bench_optimizer.py --compile_update``), at the price of a
compilation in the first step.
Same operations, but the compiled loop may round differently (fused multiply-adds, another summation order).

Precision: the moments and all the arithmetic are float32 for bf16/fp16 parameters (float64 for
float64 ones); the result is written back to the parameter in its own dtype.
"""

import functools
import itertools
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias, overload

import torch
from torch.optim.optimizer import ParamsT

# Tensors as torch's _foreach_* functions take them (and return them: as tuples).
TensorList: TypeAlias = list[torch.Tensor] | tuple[torch.Tensor, ...]
# Parallel lists of blocks (or pieces of them): weights, gradients, first and second moments.
Pieces: TypeAlias = tuple[TensorList, TensorList, TensorList, TensorList]
# A bias correction: a Python float, or a 0-dim tensor in the compiled sweeps (see LANS.update_group).
Scalar: TypeAlias = float | torch.Tensor

# Values per piece of the chunked sweeps (see "Speed" above): 1 MiB of float32, so that a piece's inputs
# and temporaries fit in the cache (128 Ki to 512 Ki values measured alike).
CHUNK_ELEMENTS = 1 << 18


def chunk_elements(device: torch.device) -> int:
    """Values per piece of the sweeps: cache-sized on the CPU; unbounded elsewhere (whole tensors, one
    Chunk), where each piece costs kernel launches and the device's memory bandwidth needs no cache trick."""
    return CHUNK_ELEMENTS if device.type == "cpu" else 2 ** 62


def bias_corrections(step: int, betas: tuple[float, float], bias_correction: bool,
                     adjust_step: bool) -> tuple[float, float]:
    """Return (bc1, bc2) for group step ``step`` (1-based).

    ``adjust_step`` lowers the exponent by one after the first step: DeepSpeed versions that take a
    zero-gradient step at initialisation make real step k the optimizer's step k+1.
    """
    if not bias_correction:
        return 1.0, 1.0
    exponent = step - 1 if (adjust_step and step > 1) else step
    beta1, beta2 = betas
    return 1.0 - beta1**exponent, 1.0 - beta2**exponent


def update_moments(exp_avgs: TensorList, exp_avg_sqs: TensorList, inputs: TensorList,
                   betas: tuple[float, float], input_weight: float) -> None:
    """In place: m <- beta1 m + input_weight x;  v <- beta2 v + (1 - beta2) x**2."""
    beta1, beta2 = betas
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, inputs, alpha=input_weight)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, inputs, inputs, value=1.0 - beta2)


def adam_directions(exp_avgs: TensorList, exp_avg_sqs: TensorList, bc1: Scalar, bc2: Scalar,
                    eps: float) -> tuple[TensorList, TensorList]:
    """Return (m_hat / den, den) with den = sqrt(v / bc2) + eps, as new tensor lists."""
    denominators = torch._foreach_div(exp_avg_sqs, bc2)
    torch._foreach_sqrt_(denominators)
    torch._foreach_add_(denominators, eps)
    directions = torch._foreach_div(exp_avgs, bc1)
    torch._foreach_div_(directions, denominators)
    return directions, denominators


def lans_directions(pieces: Pieces, normalised: TensorList, bc1: Scalar, bc2: Scalar, eps: float,
                    decay: float) -> tuple[TensorList, TensorList]:
    """r = m_hat / den + wd w;  c = g_hat / den + wd w;  den = sqrt(v_hat) + eps. c is computed in
    ``normalised`` (g_hat), in place. pieces: (weights, grads, exp_avgs, exp_avg_sqs) lists."""
    weights, _, exp_avgs, exp_avg_sqs = pieces
    adam_dirs, denominators = adam_directions(exp_avgs, exp_avg_sqs, bc1, bc2, eps)
    torch._foreach_div_(normalised, denominators)
    if decay != 0.0:
        torch._foreach_add_(adam_dirs, weights, alpha=decay)
        torch._foreach_add_(normalised, weights, alpha=decay)
    return adam_dirs, normalised


def lans_moments_sweep(pieces: Pieces, grad_scales: TensorList, betas: tuple[float, float], beta3: float,
                       bc1: Scalar, bc2: Scalar, eps: float, decay: float) -> torch.Tensor:
    """Sweep 2 over pieces (see "Speed"): g_hat = g * grad_scale; the moments in place; returns the sums
    of squares of w, r and c of every piece, [3, pieces]."""
    weights, grads, exp_avgs, exp_avg_sqs = pieces
    normalised = torch._foreach_mul(grads, grad_scales)
    update_moments(exp_avgs, exp_avg_sqs, normalised, betas, beta3)
    directions = lans_directions(pieces, normalised, bc1, bc2, eps, decay)
    if torch.compiler.is_compiling():  # inductor fuses these sums into the sweep; torch._foreach_norm it does not
        return torch.stack([torch.stack([t.square().sum() for t in p]) for p in (weights, *directions)])
    return torch.stack([_norms(p) for p in (weights, *directions)]).square()


def lans_update_sweep(pieces: Pieces, grad_scales: TensorList, adam_scales: TensorList, grad_dir_scales: TensorList,
                      bc1: Scalar, bc2: Scalar, eps: float, decay: float) -> None:
    """Sweep 3 over pieces: w <- w + adam_scale r + grad_dir_scale c, r and c recomputed as in sweep 2."""
    normalised = torch._foreach_mul(pieces[1], grad_scales)
    adam_dirs, grad_dirs = lans_directions(pieces, normalised, bc1, bc2, eps, decay)
    torch._foreach_mul_(adam_dirs, adam_scales)
    torch._foreach_mul_(grad_dirs, grad_dir_scales)
    torch._foreach_add_(pieces[0], adam_dirs)
    torch._foreach_add_(pieces[0], grad_dirs)


@functools.cache
def compiled_sweeps() -> tuple[Callable[..., torch.Tensor], Callable[..., None]]:
    """The two sweeps, torch.compiled once per process for any block size (dynamic shapes): each becomes one
    fused loop, one pass over memory per block instead of an operation at a time."""
    return (torch.compile(lans_moments_sweep, dynamic=True), torch.compile(lans_update_sweep, dynamic=True))


def trust_ratios(weight_norms: torch.Tensor, update_norms: torch.Tensor) -> torch.Tensor:
    """||w|| / ||u|| per block (1-D tensors of norms), or 1 where either norm is 0 (no host sync)."""
    return torch.where((weight_norms > 0) & (update_norms > 0), weight_norms / update_norms,
                       torch.ones_like(weight_norms))


def scaled(ratios: torch.Tensor, factor: float) -> list[torch.Tensor]:
    """The 0-dim per-block multipliers ratio * factor, as the tensor list torch._foreach_mul_ takes."""
    return list((ratios * factor).unbind())


def _norms(blocks: TensorList) -> torch.Tensor:
    return torch.stack(torch._foreach_norm(blocks))


class TensorSegments(NamedTuple):
    """Where whole tensors lie in one flat parameter holding a slice of them (a ZeRO partition).

    segments: ``(start, length, tensor_id)`` per piece, offsets into the flat parameter; elements in
    no piece (alignment padding) are left alone. num_tensors: how many tensors the complete flat group
    holds over all ranks; tensor_id < num_tensors numbers them the same way on every rank.
    """
    num_tensors: int
    segments: tuple[tuple[int, int, int], ...]


class Chunk(NamedTuple):
    """Pieces of blocks, about CHUNK_ELEMENTS values in all: parallel lists of equally shaped views of
    the weights, gradients and moments, the block of each piece (``blocks``) and the same as a tensor."""
    weights: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    blocks: list[int]
    block_index: torch.Tensor

    @property
    def tensors(self) -> Pieces:
        """(weights, grads, exp_avgs, exp_avg_sqs): the pieces the sweeps take."""
        return self.weights, self.grads, self.exp_avgs, self.exp_avg_sqs


def _compute_dtype(param: torch.Tensor) -> torch.dtype:
    """float32 for half-precision parameters, the parameter's own dtype otherwise."""
    return torch.promote_types(param.dtype, torch.float32)


class GroupTensors:
    """The blocks of one parameter group that take part in a step (params with a gradient).

    ``weights``, ``grads``, ``exp_avgs`` and ``exp_avg_sqs`` are parallel lists of blocks in the
    compute dtype: whole tensors, or views of a flat parameter's segments (see TensorSegments). For
    float32 parameters the weight blocks share the parameter's memory, so updating them in place
    updates it; for bf16 parameters they are views of float32 copies and :meth:`write_back` copies
    the result back. ``slots[i]`` is the reduction slot of segment block ``segment_blocks[i]``
    (``num_slots`` slots in all: each segmented flat parameter numbers its tensors from its own offset).
    """

    def __init__(self, params: list[torch.Tensor], optimizer_state: defaultdict[torch.Tensor, dict[str, Any]],
                 tensor_segments: Mapping[torch.Tensor, TensorSegments]):
        self.params = params
        # .to() returns the tensor itself when the dtype already matches. Detached: torch.compile refuses
        # in-place updates of views that no_grad mode cut from a tensor requiring grad (compile_update).
        self.full_weights = [p.detach().to(_compute_dtype(p)) for p in params]
        self.weights: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        segment_blocks: list[int] = []
        slots: list[int] = []
        self.num_slots = 0
        for param, weight in zip(params, self.full_weights):
            state = optimizer_state[param]
            if not state:
                state["exp_avg"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(weight, memory_format=torch.preserve_format)
            assert param.grad is not None  # step() passes the parameters that have a gradient
            tensors = (weight, param.grad.to(weight.dtype), state["exp_avg"], state["exp_avg_sq"])
            layout = tensor_segments.get(param)
            # A flat parameter holding only padding here stays one (all-zero, unchanged) block.
            pieces = layout.segments if layout is not None and layout.segments else [(None, None, None)]
            for start, length, tensor_id in pieces:
                if tensor_id is not None:
                    segment_blocks.append(len(self.weights))
                    slots.append(self.num_slots + tensor_id)
                for blocks, tensor in zip((self.weights, self.grads, self.exp_avgs, self.exp_avg_sqs), tensors):
                    blocks.append(tensor if start is None else tensor.view(-1).narrow(0, start, length))
            if layout is not None:
                self.num_slots += layout.num_tensors
        device = params[0].device
        self.segment_blocks = torch.tensor(segment_blocks, dtype=torch.long, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)

    def chunks(self, size: int | None) -> list[Chunk]:
        """The blocks cut into pieces of at most ``size`` values, gathered into Chunks of about ``size``
        values (small blocks share one). A block whose tensors are not all contiguous stays one piece.
        size None: one Chunk per (non-empty) block, its pieces the whole tensors (the compiled sweeps')."""
        chunks: list[list[tuple[int, list[torch.Tensor]]]] = []
        pending: list[tuple[int, list[torch.Tensor]]] = []
        pending_size = 0
        for block, tensors in enumerate(zip(self.weights, self.grads, self.exp_avgs, self.exp_avg_sqs)):
            numel = tensors[0].numel()
            piece_size = size or max(numel, 1)
            if all(tensor.is_contiguous() for tensor in tensors):
                flat = [tensor.view(-1) for tensor in tensors]
                pieces = [[t.narrow(0, start, min(piece_size, numel - start)) for t in flat]
                          for start in range(0, numel, piece_size)]
            else:
                pieces = [list(tensors)]
            for piece in pieces:
                pending.append((block, piece))
                pending_size += piece[0].numel()
                if pending_size >= (size or 1):
                    chunks.append(pending)
                    pending, pending_size = [], 0
        if pending:
            chunks.append(pending)
        # Every chunk's block index in one host-to-device copy: on CUDA each copy from pageable memory
        # waits for the queued kernels, and there is a chunk per block in the compiled sweeps.
        blocks = [[block for block, _ in pieces] for pieces in chunks]
        all_blocks = torch.tensor(list(itertools.chain.from_iterable(blocks)), dtype=torch.long,
                                  device=self.weights[0].device)
        indices = torch.split(all_blocks, [len(chunk_blocks) for chunk_blocks in blocks])
        result = []
        for chunk, chunk_blocks, index in zip(chunks, blocks, indices):
            weights, grads, exp_avgs, exp_avg_sqs = (list(column) for column in zip(*(tensors for _, tensors in chunk)))
            result.append(Chunk(weights, grads, exp_avgs, exp_avg_sqs, chunk_blocks, index))
        return result

    def write_back(self) -> None:
        for param, weight in zip(self.params, self.full_weights):
            if weight.dtype != param.dtype:
                param.copy_(weight)


class AdaptiveMomentOptimizer(torch.optim.Optimizer):
    """Shared machinery of LANS and NVLAMB: Adam moments in (at least) float32, an int ``group['step']``,
    optional global gradient-norm clipping, and ``zero_grad`` honouring ``set_grad_none``.

    Subclasses implement :meth:`update_group` (the per-group math, after ``group['step']`` has been
    incremented and the gradients clipped).
    """

    def __init__(self, params: ParamsT, defaults: dict[str, Any]):
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
        self._tensor_segments: dict[torch.Tensor, TensorSegments] = {}
        self._all_reduce_sum: Callable[[torch.Tensor], None] | None = None

    def set_tensor_segments(self, tensor_segments: Mapping[torch.Tensor, TensorSegments],
                            all_reduce_sum: Callable[[torch.Tensor], None] | None = None) -> None:
        """Compute the norms per original tensor in the listed flat parameters (see the module docstring).

        tensor_segments: {flat parameter of this optimizer: TensorSegments}. all_reduce_sum(t): sums
        a tensor (compute dtype, on the parameters' device) in place over every holder of a piece of
        these tensors (the data-parallel ranks), each calling it with the same shape. None: one
        holder, nothing to combine.
        """
        own = {id(p) for group in self.param_groups for p in group["params"]}
        for param, layout in tensor_segments.items():
            if id(param) not in own:
                raise ValueError("tensor segments given for a tensor that is not a parameter of this optimizer")
            end = 0
            for start, length, tensor_id in sorted(layout.segments):
                if not (0 <= tensor_id < layout.num_tensors and length > 0 and start >= end
                        and start + length <= param.numel()):
                    raise ValueError(f"segment ({start}, {length}, {tensor_id}) is outside a flat parameter of "
                                     f"{param.numel()} values / {layout.num_tensors} tensors, or overlaps another")
                end = start + length
            if len({tensor_id for _, _, tensor_id in layout.segments}) != len(layout.segments):
                raise ValueError("a tensor appears in two segments of one flat parameter")
        self._tensor_segments, self._all_reduce_sum = dict(tensor_segments), all_reduce_sum

    def block_norms(self, tensors: GroupTensors, *block_lists: TensorList) -> list[torch.Tensor]:
        """L2 norm of every block of each list, one 1-D tensor per list. A segment block gets the norm
        of its whole tensor: the partial sums of squares of all lists go through one all_reduce_sum."""
        norms = [_norms(blocks) for blocks in block_lists]
        if not tensors.num_slots:
            return norms
        return self.norms_from_squares(tensors, torch.stack(norms).square())

    def norms_from_squares(self, tensors: GroupTensors, squares: torch.Tensor) -> list[torch.Tensor]:
        """Norms from the sums of squares of every block, [lists, blocks] -> one 1-D tensor per list;
        segment blocks get their whole tensor's, summed over the holders by one all_reduce_sum."""
        if not tensors.num_slots:
            return list(squares.sqrt().unbind())
        sums = squares.new_zeros(len(squares), tensors.num_slots)
        sums.index_add_(1, tensors.slots, squares[:, tensors.segment_blocks])
        if self._all_reduce_sum is not None:
            self._all_reduce_sum(sums)
        squares[:, tensors.segment_blocks] = sums[:, tensors.slots]
        return list(squares.sqrt().unbind())

    def update_group(self, group: dict[str, Any], tensors: GroupTensors) -> None:
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        if set_to_none is None:
            set_to_none = self.defaults["set_grad_none"]
        super().zero_grad(set_to_none=set_to_none)

    def _clip_by_global_norm(self, all_tensors: list[GroupTensors]) -> None:
        """Divide every gradient by max(G / max_grad_norm, 1), G = norm over all groups (and, for
        segmented flat parameters, over all their holders)."""
        max_norm = self.defaults["max_grad_norm"]
        if max_norm <= 0.0 or not all_tensors:
            return
        grads = all_tensors[0].grads[0]
        squares = torch.zeros(2, dtype=grads.dtype, device=grads.device)  # [whole tensors, segment blocks]
        for tensors in all_tensors:
            block_squares = _norms(tensors.grads).square()
            segment_squares = block_squares[tensors.segment_blocks].sum()
            squares += torch.stack([block_squares.sum() - segment_squares, segment_squares])
        if any(tensors.num_slots for tensors in all_tensors) and self._all_reduce_sum is not None:
            self._all_reduce_sum(squares[1:])
        global_norm = squares.sum().sqrt()
        divisor = torch.clamp(global_norm / max_norm, min=1.0)
        for tensors in all_tensors:
            # Out of place: for fp32 params tensors.grads alias param.grad, which stays untouched.
            tensors.grads = list(torch._foreach_div(tensors.grads, divisor))

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active: list[tuple[dict[str, Any], GroupTensors]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                active.append((group, GroupTensors(params, self.state, self._tensor_segments)))
        self._clip_by_global_norm([tensors for _, tensors in active])
        for group, tensors in active:
            group["step"] += 1
            self.update_group(group, tensors)
            tensors.write_back()
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
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
        compile_update: run sweeps 2 and 3 torch.compiled (inductor by default), a whole block per call
            (see "Speed"); the first step then includes the compilation. Needs what torch.compile needs
            (a C++ compiler on the CPU).
    """

    def __init__(self, params: ParamsT, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 grad_averaging: bool = True, set_grad_none: bool = True, max_grad_norm: float = 0.0,
                 adjust_step: bool = False, compile_update: bool = False):
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging,
                        set_grad_none=set_grad_none, max_grad_norm=max_grad_norm,
                        adjust_step=adjust_step)
        super().__init__(params, defaults)
        self.compile_update = compile_update

    def update_group(self, group: dict[str, Any], tensors: GroupTensors) -> None:
        beta1 = group["betas"][0]
        eps, lr, decay = group["eps"], group["lr"], group["weight_decay"]
        beta3 = 1.0 - beta1 if group["grad_averaging"] else 1.0
        bc1: Scalar
        bc2: Scalar
        bc1, bc2 = bias_corrections(group["step"], group["betas"], group["bias_correction"],
                                    group["adjust_step"])

        # Sweep 1: g_hat = g / (||g|| + eps), or g itself when ||g|| = 0.
        (grad_norms,) = self.block_norms(tensors, tensors.grads)
        grad_scales = torch.where(grad_norms > 0, 1.0 / (grad_norms + eps), torch.ones_like(grad_norms)).unbind()
        if self.compile_update:
            # 0-dim tensors: a Python float that changes every step would recompile the sweeps every step.
            bc1, bc2 = (torch.tensor(bc, dtype=grad_norms.dtype, device=grad_norms.device) for bc in (bc1, bc2))
            chunks = tensors.chunks(None)
            moments_sweep, update_sweep = compiled_sweeps()
        else:
            chunks = tensors.chunks(chunk_elements(grad_norms.device))
            moments_sweep, update_sweep = lans_moments_sweep, lans_update_sweep
        constants = dict(bc1=bc1, bc2=bc2, eps=eps, decay=decay)

        # Sweep 2: the moments, and ||w||^2, ||r||^2, ||c||^2 summed per block (w changes only in sweep 3).
        squares = torch.zeros(3, len(tensors.weights), dtype=grad_norms.dtype, device=grad_norms.device)
        for chunk in chunks:
            chunk_squares = moments_sweep(chunk.tensors, [grad_scales[block] for block in chunk.blocks],
                                          group["betas"], beta3, **constants)
            squares.index_add_(1, chunk.block_index, chunk_squares)
        weight_norms, adam_norms, grad_dir_norms = self.norms_from_squares(tensors, squares)

        # Sweep 3: w <- w - lr beta1 phi_r r - lr beta3 phi_c c, r and c recomputed as in sweep 2.
        adam_scales = scaled(trust_ratios(weight_norms, adam_norms), -lr * beta1)
        grad_dir_scales = scaled(trust_ratios(weight_norms, grad_dir_norms), -lr * beta3)
        for chunk in chunks:
            update_sweep(chunk.tensors, *([scales[block] for block in chunk.blocks]
                                          for scales in (grad_scales, adam_scales, grad_dir_scales)), **constants)
