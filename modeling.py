"""BERT for pretraining and fine-tuning: the model of the BERT-1.5B/5B DeepSpeed recipe.

One file, torch and the standard library only. Module and parameter names follow Hugging Face's
`modeling_bert.py`, so `BertForPreTraining.state_dict()` has the keys of `transformers.BertForPreTraining`
but one: transformers also lists `cls.predictions.decoder.bias`, the same tensor as `cls.predictions.bias`,
which ours lists once (TRANSFORMERS_ONLY_KEYS; finetune/hf_interop.py adds or drops the alias;
tests/test_modeling.py checks the keys). State_dict keys are a public interface: checkpoints and the HF
cross-check rely on them.

Two layer wirings, chosen by `BertConfig.layer_norm_large_model`:
- False: classic post-LN BERT, `x = LN(x + sublayer(x))`.
- True: the reference's large-model pre-LN wiring. Layers carry the normalised activation `x` and a separate
  residual stream `r` that starts at 0 (the embeddings only enter through layer 1's attention):
      a = r + Dropout(attention(x));  u = LN_attn(a);  r = a + Dropout(ffn(u));  x = LN_out(r)
  so each layer's output LayerNorm is the next layer's pre-LN, the embedding LayerNorm is layer 1's pre-LN,
  and the last layer's output LayerNorm acts as the final LayerNorm.

Shapes: B batch, S sequence length, h hidden size, H heads, d = h / H, V padded vocabulary size.

Parameter counts without allocating anything:  python modeling.py --count scripts/bert_1.5b_config.json
"""

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from common.atomic_write import write_text_atomically

logger = logging.getLogger(__name__)

# The reference's configs use "gelu", which is the exact erf form (F.gelu's default), not the tanh approximation.
ACT2FN: dict[str, Callable[[Tensor], Tensor]] = {"gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh, "swish": F.silu}
LAYER_NORM_EPS = 1e-12
MASK_VALUE = -10000.0  # additive attention mask, as the reference and original BERT
VOCAB_PAD_MULTIPLE = 8  # the embedding and decoder rows are padded for tensor-core/TPC friendly shapes
MLM_IGNORE_INDEX = -1  # label of unmasked positions in the reference's HDF5 shards
# Keys of transformers' BertForPreTraining saves that this model does not have: the alias of cls.predictions.bias,
# and the position_ids buffer (0, 1, 2, ...) that transformers before 4.31 saved. Readers of such saves drop them.
TRANSFORMERS_ONLY_KEYS = ("cls.predictions.decoder.bias", "bert.embeddings.position_ids")
# Activation checkpointing's default: torch's, non-reentrant (BertPreTrainedModel.checkpoint_activations).
NON_REENTRANT_CHECKPOINT = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


# ----------------------------------------------------------------------------------------------------------
# Configuration


@dataclasses.dataclass
class BertConfig:
    """Model hyper-parameters, with the reference's JSON keys. Invalid values raise ValueError naming the key."""

    vocab_size: int
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_large_model: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            # bool is an int subclass: `true` in a JSON file must not pass as 1.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"BertConfig.{name} must be a positive integer, got {value!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            value = getattr(self, name)
            if not _is_real(value) or not 0.0 <= value < 1.0:
                raise ValueError(f"BertConfig.{name} must be a probability in [0, 1), got {value!r}")
        if not _is_real(self.initializer_range) or self.initializer_range <= 0:
            raise ValueError(f"BertConfig.initializer_range must be positive, got {self.initializer_range!r}")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"BertConfig.hidden_act must be one of {sorted(ACT2FN)}, got {self.hidden_act!r}")
        if not isinstance(self.layer_norm_large_model, bool):
            raise ValueError(f"BertConfig.layer_norm_large_model must be true or false, "
                             f"got {self.layer_norm_large_model!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"BertConfig.hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_attention_heads ({self.num_attention_heads})")

    @property
    def padded_vocab_size(self) -> int:
        """vocab_size rounded up to a multiple of 8 (the size of the embedding and of the decoder output)."""
        return -(-self.vocab_size // VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "BertConfig":
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown BertConfig key(s) {unknown}; known keys are {sorted(known)}")
        if "vocab_size" not in values:
            raise ValueError("BertConfig key 'vocab_size' is required")
        return cls(**values)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike[str]) -> "BertConfig":
        with open(path, encoding="utf-8") as file:
            values = json.load(file)
        if not isinstance(values, dict):
            raise ValueError(f"{path}: a model config must be a JSON object")
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json_file(self, path: str | os.PathLike[str]) -> None:
        """Atomically (common/atomic_write.py): never a half-written config."""
        write_text_atomically(path, json.dumps(self.to_dict(), indent=2) + "\n")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ----------------------------------------------------------------------------------------------------------
# Encoder


class BertEmbeddings(nn.Module):
    """Word + position + token-type embeddings, then LayerNorm (layer 1's pre-LN in the pre-LN wiring)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        logger.info("vocab_size %d padded to %d (a multiple of %d)",
                    config.vocab_size, config.padded_vocab_size, VOCAB_PAD_MULTIPLE)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        embeddings = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                      + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """Multi-head attention: softmax(Q K^T / sqrt(d) + mask) V, with dropout on the probabilities."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_prob = config.attention_probs_dropout_prob

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
        """hidden_states [B, S, h]; attention_mask additive [B, 1, 1, S] or None -> context [B, S, h]."""
        batch, seq_len, hidden = hidden_states.shape

        def split_heads(projection: nn.Linear) -> Tensor:
            return projection(hidden_states).view(batch, seq_len, self.num_heads, -1).transpose(1, 2)

        context = F.scaled_dot_product_attention(
            split_heads(self.query), split_heads(self.key), split_heads(self.value), attn_mask=attention_mask,
            dropout_p=self.dropout_prob if self.training else 0.0)
        return context.transpose(1, 2).reshape(batch, seq_len, hidden)


class BertResidualOutput(nn.Module):
    """Linear(in_features, h), dropout, added to the residual; returns (sum, LayerNorm(sum)).

    The sub-layer output of both halves of a layer; HF's names for them are the two subclasses below.
    """

    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, sublayer_output: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        summed = residual + self.dropout(self.dense(sublayer_output))
        return summed, self.LayerNorm(summed)


class BertSelfOutput(BertResidualOutput):
    """Attention output projection (h -> h): `layer.N.attention.output`."""

    def __init__(self, config: BertConfig):
        super().__init__(config, config.hidden_size)


class BertOutput(BertResidualOutput):
    """FFN down-projection (intermediate_size -> h): `layer.N.output`."""

    def __init__(self, config: BertConfig):
        super().__init__(config, config.intermediate_size)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states: Tensor, residual: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        return self.output(self.self(hidden_states, attention_mask), residual)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.act(self.dense(hidden_states))


class BertLayer(nn.Module):
    """One transformer layer mapping (x, r) -> (x, r); see the module docstring for both wirings.

    Post-LN has no separate residual stream: r is x on input and output.
    """

    def __init__(self, config: BertConfig):
        super().__init__()
        self.pre_layer_norm = config.layer_norm_large_model
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states: Tensor, residual: Tensor, attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        summed, normed = self.attention(hidden_states, residual, attention_mask)  # a = r + attn(x); u = LN(a)
        # Pre-LN keeps the raw sum as its residual stream; post-LN continues from the normalised sum.
        residual = summed if self.pre_layer_norm else normed
        summed, normed = self.output(self.intermediate(normed), residual)  # r = a + ffn(u); x = LN(r)
        return normed, (summed if self.pre_layer_norm else normed)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.pre_layer_norm = config.layer_norm_large_model
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.checkpoint_interval = 0  # 0 = activation checkpointing off
        self.checkpoint_fn: Callable[..., Any] = NON_REENTRANT_CHECKPOINT

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None) -> Tensor:
        """hidden_states [B, S, h] (embedding output) -> last layer's output [B, S, h]."""
        # The pre-LN residual stream starts at 0, not at the embeddings, as in the reference's `modeling.py`
        # (Model-References 1.9.0 deepspeed-bert).
        residual = hidden_states.new_zeros(()) if self.pre_layer_norm else hidden_states
        step = self.checkpoint_interval or len(self.layer)
        use_checkpoint = self.checkpoint_interval > 0 and torch.is_grad_enabled()
        for start in range(0, len(self.layer), step):
            run_chunk = functools.partial(self._run_layers, start, start + step)
            if use_checkpoint:
                hidden_states, residual = self.checkpoint_fn(run_chunk, hidden_states, residual, attention_mask)
            else:
                hidden_states, residual = run_chunk(hidden_states, residual, attention_mask)
        return hidden_states

    def _run_layers(self, start: int, end: int, hidden_states: Tensor, residual: Tensor,
                    attention_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        for layer in self.layer[start:end]:
            hidden_states, residual = layer(hidden_states, residual, attention_mask)
        return hidden_states, residual


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, sequence_output: Tensor) -> Tensor:
        return torch.tanh(self.dense(sequence_output[:, 0]))


# ----------------------------------------------------------------------------------------------------------
# Pretraining heads


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACT2FN[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.LayerNorm(self.act(self.dense(hidden_states)))


class BertLMPredictionHead(nn.Module):
    """Transform, then the decoder, whose weight IS the word-embedding Parameter, plus its own bias."""

    def __init__(self, config: BertConfig, word_embedding_weight: Tensor):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        # Built on meta so the untied [V, h] weight (5 GB for the 5B config) is never allocated.
        self.decoder = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False, device="meta")
        self.decoder.weight = word_embedding_weight
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))

    def forward(self, hidden_states: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden_states)) + self.bias


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig, word_embedding_weight: Tensor):
        super().__init__()
        self.predictions = BertLMPredictionHead(config, word_embedding_weight)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, sequence_output: Tensor, pooled_output: Tensor) -> tuple[Tensor, Tensor]:
        return self.predictions(sequence_output), self.seq_relationship(pooled_output)


# ----------------------------------------------------------------------------------------------------------
# Models


class BertPreTrainedModel(nn.Module):
    """Weight initialisation and activation checkpointing, shared by every model below."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config

    def init_weights(self) -> None:
        """Every Linear/Embedding weight ~ N(0, initializer_range), biases 0, LayerNorm 1 and 0.

        The reference leaves its fused LinearActivation layers (FFN up-projection, pooler, MLM transform) at
        PyTorch's Kaiming-uniform default only because that class is not an nn.Linear; we treat that as an
        accident, not a design, and use the BERT initialisation everywhere.
        """
        drawn: set[int] = set()  # ids of weights already drawn: the tied decoder weight is the word embedding's
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in drawn:
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
                drawn.add(id(module.weight))
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            if isinstance(module, BertLMPredictionHead):
                nn.init.zeros_(module.bias)

    def checkpoint_activations(self, enabled: bool, interval: int = 1,
                               checkpoint_fn: Callable[..., Any] | None = None) -> None:
        """Recompute the encoder's activations in backward, in chunks of `interval` layers.

        checkpoint_fn(function, *args) defaults to torch.utils.checkpoint (non-reentrant); the driver passes
        deepspeed.checkpointing.checkpoint.
        """
        if enabled and (not isinstance(interval, int) or interval <= 0):
            raise ValueError(f"checkpoint interval must be a positive integer, got {interval!r}")
        for module in self.modules():
            if isinstance(module, BertEncoder):
                module.checkpoint_interval = interval if enabled else 0
                module.checkpoint_fn = checkpoint_fn or NON_REENTRANT_CHECKPOINT


class BertModel(BertPreTrainedModel):
    def __init__(self, config: BertConfig, init_weights: bool = True):
        """init_weights=False when a head model wraps it and initialises everything once itself."""
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)
        if init_weights:
            self.init_weights()

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """input_ids, token_type_ids, attention_mask [B, S] (mask: 1 = attend, 0 = padding).

        Returns (sequence_output [B, S, h], pooled_output [B, h]).
        """
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.embeddings(input_ids, token_type_ids)
        additive_mask = None
        if attention_mask is not None:
            # Cast to the model's dtype (bf16 when DeepSpeed casts the whole module) as the reference does.
            additive_mask = (1.0 - attention_mask[:, None, None, :].to(embeddings.dtype)) * MASK_VALUE
        sequence_output = self.encoder(embeddings, additive_mask)
        return sequence_output, self.pooler(sequence_output)


class BertForPreTraining(BertPreTrainedModel):
    """BERT with the masked-LM and next-sentence heads; the decoder weight is the word-embedding matrix."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, init_weights=False)
        self.cls = BertPreTrainingHeads(config, self.bert.embeddings.word_embeddings.weight)
        self.init_weights()

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                masked_lm_labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Returns (prediction_scores, seq_relationship_score [B, 2]).

        Without masked_lm_labels, prediction_scores is [B, S, V]. With masked_lm_labels [B, S] (-1 = not
        masked) it is [n_masked, V] for the positions where labels != -1, in row-major (batch, position)
        order: the MLM transform and decoder then run only there (~20 of 128 positions), which gives the
        same loss for a fraction of the head's cost.
        """
        sequence_output, pooled_output = self.bert(input_ids, token_type_ids, attention_mask)
        if masked_lm_labels is not None:
            sequence_output = sequence_output[masked_lm_labels != MLM_IGNORE_INDEX]
        return self.cls(sequence_output, pooled_output)


class BertPretrainingCriterion(nn.Module):
    """Mean cross-entropy over masked tokens + mean cross-entropy of NSP, equal weights, in float32.

    prediction_scores may be dense [B, S, V] or sparse [n_masked, V] (rows in the order of
    masked_lm_labels[masked_lm_labels != -1]); masked_lm_labels [B, S]; next_sentence_labels [B].
    """

    def forward(self, prediction_scores: Tensor, seq_relationship_score: Tensor, masked_lm_labels: Tensor,
                next_sentence_labels: Tensor) -> Tensor:
        scores, targets = self.masked_lm_scores_and_targets(prediction_scores, masked_lm_labels)
        masked_lm_loss = F.cross_entropy(scores, targets, ignore_index=MLM_IGNORE_INDEX)
        next_sentence_loss = F.cross_entropy(seq_relationship_score.float(), next_sentence_labels.reshape(-1).long())
        return masked_lm_loss + next_sentence_loss

    @staticmethod
    def masked_lm_scores_and_targets(prediction_scores: Tensor, masked_lm_labels: Tensor) -> tuple[Tensor, Tensor]:
        """(float32 scores [n, V], int64 targets [n]); dense scores keep every position, their targets
        MLM_IGNORE_INDEX where nothing is masked."""
        if prediction_scores.dim() == 2:
            targets = masked_lm_labels[masked_lm_labels != MLM_IGNORE_INDEX]
        else:
            targets = masked_lm_labels.reshape(-1)
            prediction_scores = prediction_scores.reshape(targets.numel(), -1)
        return prediction_scores.float(), targets.long()

    @staticmethod
    def sums(prediction_scores: Tensor, seq_relationship_score: Tensor, masked_lm_labels: Tensor,
             next_sentence_labels: Tensor) -> dict[str, float | int]:
        """The parts of forward's two means, as sums and counts (with the correct predictions), for means over
        many batches (held-out evaluation): Python floats and ints, the losses summed in float64."""
        scores, targets = BertPretrainingCriterion.masked_lm_scores_and_targets(prediction_scores, masked_lm_labels)
        masked = targets != MLM_IGNORE_INDEX
        scores, targets = scores[masked], targets[masked]
        nsp_scores, nsp_targets = seq_relationship_score.float(), next_sentence_labels.reshape(-1).long()
        mlm_losses = F.cross_entropy(scores, targets, reduction="none")
        nsp_losses = F.cross_entropy(nsp_scores, nsp_targets, reduction="none")
        return {"mlm_loss_sum": float(mlm_losses.cpu().double().sum()),
                "mlm_correct": int((scores.argmax(-1) == targets).sum()), "mlm_count": int(targets.numel()),
                "nsp_loss_sum": float(nsp_losses.cpu().double().sum()),
                "nsp_correct": int((nsp_scores.argmax(-1) == nsp_targets).sum()), "nsp_count": int(nsp_targets.numel())}


# ----------------------------------------------------------------------------------------------------------
# Fine-tuning heads. Each returns a tuple of logits, preceded by the loss when labels are given.


class BertWithClassifier(BertPreTrainedModel):
    """The encoder plus dropout and one Linear(h, num_outputs): the body the classification heads share."""

    def __init__(self, config: BertConfig, num_outputs: int):
        super().__init__(config)
        self.bert = BertModel(config, init_weights=False)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_outputs)
        self.init_weights()


class BertForSequenceClassification(BertWithClassifier):
    """Dropout + Linear(h, num_labels) on the pooled output; cross-entropy loss."""

    def __init__(self, config: BertConfig, num_labels: int):
        super().__init__(config, num_outputs=num_labels)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> tuple[Tensor, ...]:
        _, pooled_output = self.bert(input_ids, token_type_ids, attention_mask)
        logits = self.classifier(self.dropout(pooled_output))  # [B, num_labels]
        if labels is None:
            return (logits,)
        return F.cross_entropy(logits.float(), labels), logits


class BertForMultipleChoice(BertWithClassifier):
    """Inputs [B, num_choices, S]; one score per choice from the pooled output; cross-entropy over choices."""

    def __init__(self, config: BertConfig):
        super().__init__(config, num_outputs=1)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> tuple[Tensor, ...]:
        batch, num_choices, seq_len = input_ids.shape

        def flatten(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor.reshape(batch * num_choices, seq_len)

        _, pooled_output = self.bert(flatten(input_ids), flatten(token_type_ids), flatten(attention_mask))
        logits = self.classifier(self.dropout(pooled_output)).view(batch, num_choices)
        if labels is None:
            return (logits,)
        return F.cross_entropy(logits.float(), labels), logits


class BertForTokenClassification(BertWithClassifier):
    """Dropout + Linear(h, num_labels) on every token; loss over tokens with attention_mask == 1."""

    def __init__(self, config: BertConfig, num_labels: int):
        super().__init__(config, num_outputs=num_labels)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> tuple[Tensor, ...]:
        sequence_output, _ = self.bert(input_ids, token_type_ids, attention_mask)
        logits = self.classifier(self.dropout(sequence_output))  # [B, S, num_labels]
        if labels is None:
            return (logits,)
        active = torch.ones_like(labels, dtype=torch.bool) if attention_mask is None else attention_mask == 1
        return F.cross_entropy(logits[active].float(), labels[active]), logits


class BertForQuestionAnswering(BertPreTrainedModel):
    """Linear(h, 2) on every token -> start and end logits [B, S]; loss = mean of the two cross-entropies."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, init_weights=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                start_positions: Tensor | None = None, end_positions: Tensor | None = None) -> tuple[Tensor, ...]:
        sequence_output, _ = self.bert(input_ids, token_type_ids, attention_mask)
        start_logits, end_logits = self.qa_outputs(sequence_output).unbind(dim=-1)
        if start_positions is None or end_positions is None:
            return start_logits, end_logits
        # Answers truncated away (position outside the sequence) are ignored, as in the original SQuAD code.
        seq_len = input_ids.shape[1]
        start_loss = F.cross_entropy(start_logits.float(), start_positions.clamp(0, seq_len), ignore_index=seq_len)
        end_loss = F.cross_entropy(end_logits.float(), end_positions.clamp(0, seq_len), ignore_index=seq_len)
        return (start_loss + end_loss) / 2, start_logits, end_logits


# ----------------------------------------------------------------------------------------------------------
# Parameter counting


def count_parameters(config: BertConfig) -> dict[str, int]:
    """Parameter counts of BertForPreTraining, built on the meta device (nothing is allocated).

    Returns {"embeddings", "encoder", "heads", "total"}; the tied decoder weight is counted once (in
    embeddings), and "heads" is the pooler plus the MLM and NSP heads.
    """
    with torch.device("meta"):
        model = BertForPreTraining(config)
    counts = {"embeddings": 0, "encoder": 0, "heads": 0}
    for name, parameter in model.named_parameters():  # yields a shared Parameter once
        if name.startswith("bert.embeddings."):
            counts["embeddings"] += parameter.numel()
        elif name.startswith("bert.encoder."):
            counts["encoder"] += parameter.numel()
        else:
            counts["heads"] += parameter.numel()
    counts["total"] = sum(counts.values())
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print the parameter counts of a BERT model config.")
    parser.add_argument("--count", metavar="CONFIG", required=True, help="model config JSON file")
    args = parser.parse_args(argv)
    try:
        config = BertConfig.from_json_file(args.count)
    except (OSError, ValueError) as error:  # json.JSONDecodeError is a ValueError
        print(f"error: {args.count}: {error}", file=sys.stderr)
        return 1
    counts = count_parameters(config)
    print(f"{args.count}: vocab {config.vocab_size} (padded {config.padded_vocab_size}), hidden "
          f"{config.hidden_size}, layers {config.num_hidden_layers}")
    for part, count in counts.items():
        print(f"  {part:<10} {count:>14,d}  ({count:.3e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
