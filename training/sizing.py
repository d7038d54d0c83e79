"""Sizes of a BERT pretraining run, computed from the model config alone: parameters, model FLOPs per
sequence, and the bytes each device holds under DeepSpeed (bf16 or fp32, ZeRO stage 0/1/2).

Imports modeling only; nothing is allocated (parameter counts come from a model built on the meta device).
The driver uses it for its MFU figure and its memory check, scripts/plan_memory.py prints it.

Notation: Psi parameters, N data-parallel ranks, B micro-batch, S sequence length, P masked predictions
per sequence, h hidden, I intermediate, H heads, L layers, V padded vocabulary, e bytes per model element
(2 for bf16, 4 for fp32).
"""

import dataclasses
from typing import Any, TypedDict

from modeling import BertConfig, count_parameters

# Bytes of the tensors autograd saves for the backward pass, per layer and micro-batch, for the layers of
# modeling.py with PyTorch's CPU attention path (the "math" path, which keeps the S x S probabilities):
#     e * PER_TOKEN_ELEMENTS * BSh + PER_TOKEN_FIXED_BYTES * BSh + ATTENTION_BYTES * B H S^2
# Counted with torch.autograd.graph.saved_tensors_hooks (tests/test_sizing.py recounts them at another
# shape, bf16 and fp32). Fused attention kernels (flash attention on GPUs, Habana's fused SDPA) keep no
# S x S tensor, so there the estimate is on the safe side.
PER_TOKEN_ELEMENTS = 15  # layer input, q, k, v, context, 2 LayerNorm inputs, LN output, GELU in/out (4 wide)
PER_TOKEN_FIXED_BYTES = 12  # dropout masks and float32 statistics, whatever the model's dtype
ATTENTION_BYTES = 12  # per attention score: float32 probabilities, dropout mask and their product
EMBEDDING_ELEMENTS = 3.64  # embeddings, their LayerNorm and dropout, and the MLM head's masked rows, per BSh
LOSS_BYTES_PER_LOGIT = 4  # the float32 log-softmax the MLM cross-entropy keeps, per masked row and vocab entry
# Float32 tensors the size of one flat optimizer partition that an optimizer step creates on top of its
# states (lans.py: the normalised gradient, the denominators and the Adam direction).
OPTIMIZER_TEMPORARIES = {"lans": 3, "nvlamb": 3, "adam": 2, "adamw": 2}
# On the CPU lans.py sweeps cache-sized pieces (lans.chunk_elements): no partition-sized temporaries there.
CPU_CHUNKED_OPTIMIZERS = ("lans",)
MOMENT_BYTES = 8  # two float32 moments per parameter (LANS, NVLAMB and AdamW alike)
DEFAULT_REDUCE_BUCKET_SIZE = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default


def parameter_count(config: BertConfig) -> int:
    """Parameters of BertForPreTraining (the tied decoder weight counted once)."""
    return count_parameters(config)["total"]


def model_flops_per_sequence(config: BertConfig, seq_len: int, max_pred: int) -> float:
    """Matmul FLOPs of one training sequence (forward + backward = 3 x forward), MLM head on the P masked
    rows only: the "model FLOPs" of MFU (activation recomputation is not counted)."""
    h, inner, vocab = config.hidden_size, config.intermediate_size, config.padded_vocab_size
    per_layer = 2 * seq_len * (4 * h * h + 2 * h * inner) + 4 * seq_len * seq_len * h  # projections + QK^T, AV
    heads = 2 * max_pred * (h * h + h * vocab) + 2 * (h * h + 2 * h)  # MLM transform + decoder; pooler + NSP
    return 3.0 * (config.num_hidden_layers * per_layer + heads)


def layer_activation_bytes(config: BertConfig, micro_batch: int, seq_len: int, element_bytes: int) -> float:
    """Bytes one encoder layer keeps for its backward pass (see the coefficients above)."""
    tokens = micro_batch * seq_len * config.hidden_size
    scores = micro_batch * config.num_attention_heads * seq_len * seq_len
    return (element_bytes * PER_TOKEN_ELEMENTS + PER_TOKEN_FIXED_BYTES) * tokens + ATTENTION_BYTES * scores


def activation_bytes(config: BertConfig, micro_batch: int, seq_len: int, max_pred: int, element_bytes: int,
                     checkpoint_interval: int = 0) -> float:
    """Bytes saved for backward by one micro-batch's forward, the loss included.

    checkpoint_interval > 0: only each chunk's inputs are kept, and one chunk's activations exist again
    while it is recomputed in the backward pass.
    """
    layers = config.num_hidden_layers
    tokens = micro_batch * seq_len * config.hidden_size
    masked_rows = micro_batch * max_pred
    outside_encoder = (EMBEDDING_ELEMENTS * element_bytes * tokens
                       + LOSS_BYTES_PER_LOGIT * masked_rows * config.padded_vocab_size)
    per_layer = layer_activation_bytes(config, micro_batch, seq_len, element_bytes)
    if checkpoint_interval <= 0:
        return outside_encoder + layers * per_layer
    chunks = -(-layers // checkpoint_interval)
    # Each chunk keeps its input x; pre-LN also its residual stream r, which is still 0 at the first chunk.
    chunk_inputs = chunks + (chunks - 1 if config.layer_norm_large_model else 0)
    return outside_encoder + chunk_inputs * element_bytes * tokens + min(checkpoint_interval, layers) * per_layer


def bf16_enabled(ds_config: dict[str, Any]) -> bool:
    return bool((ds_config.get("bf16") or {}).get("enabled", False))


@dataclasses.dataclass
class TrainingSetup:
    """What besides the model config decides the memory of one device: the training setup."""
    micro_batch: int
    seq_len: int
    max_pred: int
    world_size: int = 1
    zero_stage: int = 1
    bf16: bool = True
    checkpoint_interval: int = 0  # 0: activation checkpointing off
    optimizer: str = "lans"
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE
    contiguous_gradients: bool = True
    overlap_comm: bool = False
    on_cpu: bool = False
    accumulation_steps: int = 1  # micro-batches per optimizer step

    @staticmethod
    def accumulation_from_deepspeed_config(ds_config: dict[str, Any], world_size: int) -> int:
        """Micro-batches per step as pretraining reads the JSON (common/deepspeed_config.check): from the
        global batch when it is set, else the JSON's gradient_accumulation_steps, else 1."""
        micro, total = int(ds_config["train_micro_batch_size_per_gpu"]), ds_config.get("train_batch_size")
        if total:
            return max(1, int(total) // (micro * world_size))
        return int(ds_config.get("gradient_accumulation_steps") or 1)

    @classmethod
    def from_deepspeed_config(cls, ds_config: dict[str, Any], world_size: int, seq_len: int, max_pred: int,
                              checkpoint_interval: int = 0, optimizer: str = "lans",
                              on_cpu: bool = False) -> "TrainingSetup":
        zero = ds_config.get("zero_optimization", {}) or {}
        return cls(micro_batch=int(ds_config["train_micro_batch_size_per_gpu"]), seq_len=seq_len,
                   max_pred=max_pred, world_size=world_size, zero_stage=int(zero.get("stage", 0)),
                   bf16=bf16_enabled(ds_config),
                   checkpoint_interval=checkpoint_interval, optimizer=optimizer,
                   reduce_bucket_size=int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET_SIZE)),
                   contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
                   overlap_comm=bool(zero.get("overlap_comm", False)), on_cpu=on_cpu,
                   accumulation_steps=cls.accumulation_from_deepspeed_config(ds_config, world_size))


class MemoryPlan(TypedDict):
    """device_memory's prediction: bytes per device, by part (see there)."""
    parameters: float
    master_weights: float
    optimizer_states: float
    buffers: float
    activations: float
    held_gradients: float
    gradients: float
    peak_transient: float
    peak_moment: str  # which moment of a step the peak is at
    total: float


def device_memory(config: BertConfig, setup: TrainingSetup) -> MemoryPlan:
    """Predicted bytes per device, by part, and the peak ("total").

    Held all the time: the model's weights (bf16, or fp32 without bf16), the fp32 master weights (bf16
    only) and the two fp32 moments, both split over the N ranks under ZeRO-1/2 (DeepSpeed 0.19's bf16
    ZeRO-0 keeps them whole on every rank), and ZeRO-1/2's gradient-reduction bucket ("buffers").
    The peak is the larger of two moments of a step:
    - backward of the MLM head: the saved activations, the float32 logits' gradient and the (tied) word
      embedding's gradient; with more than one micro-batch per step also the model-dtype gradients held from
      the earlier micro-batches ("held_gradients"): DeepSpeed 0.19.8 reduces ZeRO-0/1 gradients only at the
      step's last micro-batch, so every rank keeps every parameter's gradient (ZeRO-0's bf16 wrapper, like
      plain torch, accumulates in param.grad; ZeRO-1 in its own buffers), while ZeRO-2 reduces each
      micro-batch and keeps this rank's partition;
    - the optimizer step: the model-dtype gradients (ZeRO-2: this rank's partition), DeepSpeed's fp32 copy
      of this rank's gradient partition, and the optimizer's temporaries (none of partition size for LANS on the CPU).
    """
    if setup.zero_stage not in (0, 1, 2):
        raise ValueError(f"ZeRO stage {setup.zero_stage}: the planner knows stages 0, 1 and 2")
    if setup.optimizer not in OPTIMIZER_TEMPORARIES:
        raise ValueError(f"optimizer {setup.optimizer!r}: the planner knows {sorted(OPTIMIZER_TEMPORARIES)}")
    params = parameter_count(config)
    element = 2 if setup.bf16 else 4
    shards = setup.world_size if setup.zero_stage >= 1 else 1
    partition = params / shards
    weights, master_weights = element * params, 4 * partition if setup.bf16 else 0
    optimizer_states = MOMENT_BYTES * partition
    buffers = 0
    if setup.zero_stage >= 1 and setup.contiguous_gradients:
        buffers = element * setup.reduce_bucket_size * (2 if setup.overlap_comm else 1)
    activations = activation_bytes(config, setup.micro_batch, setup.seq_len, setup.max_pred, element,
                                   setup.checkpoint_interval)
    masked_rows = setup.micro_batch * setup.max_pred
    gradients = element * (partition if setup.zero_stage == 2 else params)
    held_gradients = gradients if setup.accumulation_steps > 1 else 0
    head_backward = (activations + (element + LOSS_BYTES_PER_LOGIT) * masked_rows * config.padded_vocab_size
                     + element * config.padded_vocab_size * config.hidden_size + held_gradients)
    fp32_gradients = 4 * partition if (setup.bf16 or setup.zero_stage >= 1) else 0
    chunked = setup.on_cpu and setup.optimizer in CPU_CHUNKED_OPTIMIZERS
    optimizer_step = (gradients + fp32_gradients
                      + (0 if chunked else OPTIMIZER_TEMPORARIES[setup.optimizer] * 4 * partition))
    peak_transient = max(head_backward, optimizer_step)
    return {"parameters": weights, "master_weights": master_weights,
            "optimizer_states": optimizer_states, "buffers": buffers, "activations": activations,
            "held_gradients": held_gradients, "gradients": gradients, "peak_transient": peak_transient,
            "peak_moment": "backward (MLM head)" if head_backward >= optimizer_step else "optimizer step",
            "total": weights + master_weights + optimizer_states + buffers + peak_transient}


# The devices the planner knows, by the name scripts/plan_memory.py's --device takes: (label, memory of one
# device in GiB from the vendor's datasheet). A plan may use USABLE_FRACTION of it; the rest is left to the
# runtime and communication libraries and to the allocator's fragmentation.
DEVICES = {"gaudi": ("Gaudi (32 GB)", 32), "gaudi2": ("Gaudi2 (96 GB)", 96), "h100": ("H100 (80 GB)", 80)}
USABLE_FRACTION = 0.9


def usable_bytes(device_bytes: float) -> float:
    """The most a plan may use of a device with this memory."""
    return USABLE_FRACTION * device_bytes


def fits(total_bytes: float, device_bytes: float) -> bool:
    return total_bytes <= usable_bytes(device_bytes)
