"""Pre-LN BERT (the BERT-1.5B/5B wiring) for transformers, as remote code that travels with an export.

`python -m finetune.hf_interop export` copies this file into a pre-LN export directory and names its classes in
config.json's `auto_map`, so that transformers loads the export with this wiring:

    transformers.AutoModelForPreTraining.from_pretrained(directory, trust_remote_code=True)

(also AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification,
AutoModelForQuestionAnswering, and pipeline("fill-mask", ..., trust_remote_code=True)). The state dict has the
names of transformers' BertForPreTraining; the wiring is modeling.py's pre-LN one:

    x = LN_emb(embeddings); r = 0
    per layer: a = r + attention(x); u = LN_attn(a); r = a + ffn(u); x = LN_out(r)

config.json's model_type is "bert", so that transformers reads it without this code where the wiring does not
matter (AutoTokenizer, AutoConfig); the weights are the "pre_ln" variant (model.pre_ln.safetensors), which
only these classes ask for: transformers' own post-LN BERT classes find no weights file and raise instead of
loading these weights into the other wiring.

Self-contained (torch and transformers only): it runs inside transformers' dynamic-module loader, away from
this repository.
"""

from collections.abc import Callable
from typing import Any, Self

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import (
    BaseModelOutputWithPooling,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
)
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "relu": F.relu, "tanh": torch.tanh, "swish": F.silu}
MASK_VALUE = -10000.0  # additive attention mask, as modeling.py
WEIGHTS_VARIANT = "pre_ln"  # the weights file is model.pre_ln.safetensors: transformers' BERT classes skip it


@strict(accept_kwargs=True)
class BertPreLNConfig(PreTrainedConfig):
    model_type = "bert"  # as config.json's, which transformers' tokenizer loading reads without this code

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float | int = 0.1
    attention_probs_dropout_prob: float | int = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    classifier_dropout: float | int | None = None
    layer_norm_large_model: bool = True  # modeling.BertConfig's name for the pre-LN wiring


class BertPreLNEmbeddings(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        # a Module: transformers' set_input_embeddings may put any module here
        self.word_embeddings: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size,
                                                       padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        summed = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
                  + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(summed))


class BertPreLNSelfAttention(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_prob = config.attention_probs_dropout_prob

    def forward(self, hidden_states: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, width = hidden_states.shape
        q, k, v = (projection(hidden_states).view(batch, length, self.num_heads, -1).transpose(1, 2)
                   for projection in (self.query, self.key, self.value))
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask,
                                                 dropout_p=self.dropout_prob if self.training else 0.0)
        return context.transpose(1, 2).reshape(batch, length, width)


class BertPreLNResidualOutput(nn.Module):
    """dense -> dropout -> + residual; returns (the sum, its LayerNorm). HF's `attention.output` and `output`."""

    def __init__(self, config: BertPreLNConfig, in_features: int) -> None:
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, sublayer_output: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = residual + self.dropout(self.dense(sublayer_output))
        return summed, self.LayerNorm(summed)


class BertPreLNAttention(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.self = BertPreLNSelfAttention(config)
        self.output = BertPreLNResidualOutput(config, config.hidden_size)


class BertPreLNIntermediate(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]


class BertPreLNLayer(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.attention = BertPreLNAttention(config)
        self.intermediate = BertPreLNIntermediate(config)
        self.output = BertPreLNResidualOutput(config, config.intermediate_size)

    def forward(self, normed: torch.Tensor, residual: torch.Tensor,
                additive_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        attended, attended_normed = self.attention.output(self.attention.self(normed, additive_mask), residual)
        ffn = self.intermediate.act(self.intermediate.dense(attended_normed))
        return self.output(ffn, attended)  # (new residual stream, its LayerNorm = next layer's input)


class BertPreLNEncoder(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertPreLNLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, normed: torch.Tensor, additive_mask: torch.Tensor | None) -> torch.Tensor:
        residual = normed.new_zeros(())  # the residual stream starts at 0: embeddings enter via attention
        for layer in self.layer:
            residual, normed = layer(normed, residual, additive_mask)
        return normed


class BertPreLNPreTrainedModel(PreTrainedModel):
    config_class = BertPreLNConfig
    base_model_prefix = "bert"

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Self:
        kwargs.setdefault("variant", WEIGHTS_VARIANT)
        return super().from_pretrained(*args, **kwargs)

    def save_pretrained(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("variant", WEIGHTS_VARIANT)
        super().save_pretrained(*args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear/Embedding ~ N(0, initializer_range), LayerNorm 1/0
        if isinstance(module, BertPreLNLMPredictionHead):
            init.zeros_(module.bias)


class BertPreLNModel(BertPreLNPreTrainedModel):
    def __init__(self, config: BertPreLNConfig, add_pooling_layer: bool = True) -> None:
        super().__init__(config)
        self.embeddings = BertPreLNEmbeddings(config)
        self.encoder = BertPreLNEncoder(config)
        self.pooler = BertPreLNPooler(config) if add_pooling_layer else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embeddings.word_embeddings = value

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, return_dict: bool | None = None,
                **kwargs: Any) -> BaseModelOutputWithPooling:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embedded = self.embeddings(input_ids, token_type_ids)
        additive_mask = None
        if attention_mask is not None:
            additive_mask = (1.0 - attention_mask[:, None, None, :].to(embedded.dtype)) * MASK_VALUE
        sequence_output = self.encoder(embedded, additive_mask)
        pooled = self.pooler(sequence_output) if self.pooler is not None else None
        return BaseModelOutputWithPooling(last_hidden_state=sequence_output, pooler_output=pooled)


class BertPreLNPooler(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, sequence_output: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(sequence_output[:, 0]))


class BertPreLNPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(hidden_states)))


class BertPreLNLMPredictionHead(nn.Module):
    """transform -> decoder (weight tied to the word embeddings; its bias is `bias`)."""

    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.transform = BertPreLNPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden_states))


class BertPreLNPreTrainingHeads(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.predictions = BertPreLNLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertPreLNForPreTraining(BertPreLNPreTrainedModel):
    """Returns prediction_logits [B, S, V] and seq_relationship_logits [B, 2]."""

    _tied_weights_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                          "cls.predictions.decoder.bias": "cls.predictions.bias"}

    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__(config)
        self.bert = BertPreLNModel(config)
        self.cls = BertPreLNPreTrainingHeads(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, **kwargs: Any) -> BertForPreTrainingOutput:
        encoded = self.bert(input_ids, attention_mask, token_type_ids)
        return BertForPreTrainingOutput(
            prediction_logits=self.cls.predictions(encoded.last_hidden_state),
            seq_relationship_logits=self.cls.seq_relationship(encoded.pooler_output))


class BertPreLNOnlyMLMHead(nn.Module):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__()
        self.predictions = BertPreLNLMPredictionHead(config)


class BertPreLNForMaskedLM(BertPreLNPreTrainedModel):
    """Returns logits [B, S, V] (transformers' fill-mask pipeline reads them)."""

    _tied_weights_keys = BertPreLNForPreTraining._tied_weights_keys
    # An export is BertPreLNForPreTraining's: its pooler and next-sentence head are not this model's.
    _keys_to_ignore_on_load_unexpected = [r"^bert\.pooler\.", r"^cls\.seq_relationship\."]

    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__(config)
        self.bert = BertPreLNModel(config, add_pooling_layer=False)
        self.cls = BertPreLNOnlyMLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> MaskedLMOutput:
        logits = self.cls.predictions(self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state)
        loss = None if labels is None else F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return MaskedLMOutput(loss=loss, logits=logits)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor | None, num_labels: int) -> torch.Tensor | None:
    if labels is None:
        return None
    if num_labels == 1:  # regression (STS-B)
        return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype))
    return F.cross_entropy(logits, labels)


class BertPreLNForSequenceClassification(BertPreLNPreTrainedModel):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__(config)
        if config.num_labels is None:  # transformers' configs have 2 labels unless id2label says otherwise
            raise ValueError("BertPreLNForSequenceClassification needs labels: set the config's num_labels")
        self.num_labels = config.num_labels
        self.bert = BertPreLNModel(config)
        dropout = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if dropout is None else dropout)
        self.classifier = nn.Linear(config.hidden_size, self.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        pooled = self.bert(input_ids, attention_mask, token_type_ids).pooler_output
        logits = self.classifier(self.dropout(pooled))
        return SequenceClassifierOutput(loss=classification_loss(logits, labels, self.num_labels), logits=logits)


class BertPreLNForQuestionAnswering(BertPreLNPreTrainedModel):
    def __init__(self, config: BertPreLNConfig) -> None:
        super().__init__(config)
        self.bert = BertPreLNModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, start_positions: torch.Tensor | None = None,
                end_positions: torch.Tensor | None = None, **kwargs: Any) -> QuestionAnsweringModelOutput:
        encoded = self.bert(input_ids, attention_mask, token_type_ids).last_hidden_state
        start_logits, end_logits = (logits.squeeze(-1) for logits in self.qa_outputs(encoded).split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            # Positions outside the sequence (answers cut off) are ignored, as transformers' BERT does.
            length = start_logits.shape[1]
            loss = (F.cross_entropy(start_logits, start_positions.clamp(0, length), ignore_index=length)
                    + F.cross_entropy(end_logits, end_positions.clamp(0, length), ignore_index=length)) / 2
        return QuestionAnsweringModelOutput(loss=loss, start_logits=start_logits, end_logits=end_logits)


# config.json's auto_map: which Auto class builds which class of this file.
AUTO_MAP = {"AutoConfig": BertPreLNConfig, "AutoModel": BertPreLNModel,
            "AutoModelForPreTraining": BertPreLNForPreTraining, "AutoModelForMaskedLM": BertPreLNForMaskedLM,
            "AutoModelForSequenceClassification": BertPreLNForSequenceClassification,
            "AutoModelForQuestionAnswering": BertPreLNForQuestionAnswering}
