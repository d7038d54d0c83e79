"""Tests of modeling.py against independent references.

- transformers.BertForPreTraining (another implementation) for the post-LN wiring and the state_dict keys;
- a float64 forward written here from the equations of the reference's pre-LN wiring (`modeling.py`,
  Model-References 1.9.0 deepspeed-bert);
- the explicit softmax formula for attention, a hand-written cross-entropy for the criterion;
- a closed parameter-count formula worked out from the reference's `modeling.py`, and the values of its
  `scripts/bert_1.5b_config.json` and `scripts/bert_5b_config.json`.
"""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

import modeling
from modeling import BertConfig, BertForPreTraining, BertPretrainingCriterion

REPO = Path(__file__).resolve().parent.parent


def small_config(**overrides) -> BertConfig:
    values = dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48,
                  max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    values.update(overrides)
    return BertConfig(**values)


def make_batch(config, batch=3, seq_len=16, seed=0):
    """Random ids, token types, a mask with padding at the end of two rows, ~25% masked-LM labels."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, config.vocab_size, (batch, seq_len), generator=generator)
    token_type_ids = (torch.arange(seq_len) >= seq_len // 2).long().expand(batch, seq_len).clone()
    attention_mask = torch.ones(batch, seq_len, dtype=torch.long)
    attention_mask[1, -5:] = 0
    attention_mask[-1, -2:] = 0
    labels = torch.full((batch, seq_len), -1)
    chosen = torch.rand(batch, seq_len, generator=generator) < 0.25
    chosen[:, 1] = True  # at least one masked token per row
    labels[chosen] = torch.randint(0, config.vocab_size, (int(chosen.sum()),), generator=generator)
    next_sentence_labels = torch.randint(0, 2, (batch,), generator=generator)
    return input_ids, token_type_ids, attention_mask, labels, next_sentence_labels


def perturbed_model(config, seed=0):
    """A model whose biases and LayerNorm parameters are not at their 0/1 init, so that every term counts."""
    torch.manual_seed(seed)
    model = BertForPreTraining(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model.eval()


class ReplayedDropout:
    """Stands in for nn.Dropout.forward: one keep mask per module name, drawn on the module's first call and
    reused by any other model with a module of that name, so two implementations see the same masks."""

    def __init__(self, *models):
        self.names = {id(module): name for model in models for name, module in model.named_modules()}
        self.masks, self.calls = {}, []
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self, module, x):
        if not module.training or module.p == 0.0:
            return x
        name = self.names[id(module)]
        self.calls.append(name)
        if name not in self.masks:
            self.masks[name] = (torch.rand(x.shape, generator=self.generator) >= module.p).to(x.dtype)
        return x * self.masks[name] / (1.0 - module.p)


def hidden_dropout_names(config):
    """The reference's `modeling.py`: embeddings output, attention-output projection and FFN output of every layer."""
    return ["bert.embeddings.dropout"] + [f"bert.encoder.layer.{i}.{part}.dropout"
                                          for i in range(config.num_hidden_layers)
                                          for part in ("attention.output", "output")]


# ----------------------------------------------------------------------------------------------------------
# External reference: Hugging Face transformers (post-LN)


def transformers_model(transformers, config):
    """transformers.BertForPreTraining with the shape and dropout of `config` (randomly initialised)."""
    from finetune.hf_interop import to_transformers_config
    return transformers.BertForPreTraining(transformers.BertConfig(**to_transformers_config(config)))


def test_post_ln_matches_transformers_logits_and_keys():
    transformers = pytest.importorskip("transformers")
    config = small_config()
    model = perturbed_model(config)
    hf_model = transformers_model(transformers, config).eval()

    ours, theirs = set(model.state_dict()), set(hf_model.state_dict())
    assert ours <= theirs, f"keys unknown to transformers: {sorted(ours - theirs)}"
    # transformers also lists the decoder bias, tied to cls.predictions.bias.
    assert theirs - ours <= {"cls.predictions.decoder.bias"}
    result = hf_model.load_state_dict(model.state_dict(), strict=False)
    assert not result.unexpected_keys and set(result.missing_keys) <= {"cls.predictions.decoder.bias"}
    assert hf_model.cls.predictions.decoder.bias is hf_model.cls.predictions.bias

    input_ids, token_type_ids, attention_mask, labels, _ = make_batch(config)
    with torch.no_grad():
        mlm, nsp = model(input_ids, token_type_ids, attention_mask)
        sparse_mlm, _ = model(input_ids, token_type_ids, attention_mask, masked_lm_labels=labels)
        # transformers takes the mask before the token types: pass both by name.
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert mlm.shape == (3, 16, config.padded_vocab_size)
    torch.testing.assert_close(mlm, expected.prediction_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(nsp, expected.seq_relationship_logits, atol=1e-5, rtol=0)
    # The sparse head gives the same rows, in row-major (batch, position) order.
    torch.testing.assert_close(sparse_mlm, expected.prediction_logits[labels != -1], atol=1e-5, rtol=0)


def test_post_ln_dropout_placement_matches_transformers_with_the_same_masks(monkeypatch):
    """Training mode, hidden dropout 0.5: both models run each dropout once and, given the same masks, agree."""
    transformers = pytest.importorskip("transformers")
    config = small_config(hidden_dropout_prob=0.5)
    model = perturbed_model(config).train()
    hf_model = transformers_model(transformers, config).train()
    hf_model.load_state_dict(model.state_dict(), strict=False)
    replay = ReplayedDropout(model, hf_model)
    monkeypatch.setattr(torch.nn.Dropout, "forward", lambda module, x: replay(module, x))
    input_ids, token_type_ids, attention_mask, _, _ = make_batch(config)
    with torch.no_grad():
        mlm, nsp = model(input_ids, token_type_ids, attention_mask)
        assert replay.calls == hidden_dropout_names(config)
        replay.calls.clear()
        expected = hf_model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
    assert replay.calls == hidden_dropout_names(config)
    torch.testing.assert_close(mlm, expected.prediction_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(nsp, expected.seq_relationship_logits, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------------------------------
# Independent float64 forward of the reference's pre-LN wiring (`modeling.py`, Model-References 1.9.0
# deepspeed-bert)


def reference_layer_norm(x, weight, bias):
    mean = x.mean(-1, keepdim=True)
    variance = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(variance + 1e-12) * weight + bias


def reference_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def reference_attention(q, k, v, additive_mask):
    """q, k, v [B, H, S, d]; additive_mask broadcastable to [B, H, S, S]."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + additive_mask
    return torch.softmax(scores, dim=-1) @ v


def reference_pre_ln_forward(p, config, input_ids, token_type_ids, attention_mask, dropout_masks=None):
    """The reference's equations, written from scratch on the state_dict tensors `p`.

    dropout_masks: {module name: keep mask} for a training-mode forward, applied where the reference's
    `modeling.py` puts hidden dropout (embeddings after their LayerNorm, attention and FFN outputs before the
    residual add).
    """
    def dropout(x, name):
        if dropout_masks is None:
            return x
        return x * dropout_masks[name] / (1.0 - config.hidden_dropout_prob)

    def linear(x, name):
        return x @ p[name + ".weight"].T + p[name + ".bias"]

    def layer_norm(x, name):
        return reference_layer_norm(x, p[name + ".weight"], p[name + ".bias"])

    batch, seq_len = input_ids.shape
    heads = config.num_attention_heads
    embedded = (p["bert.embeddings.word_embeddings.weight"][input_ids]
                + p["bert.embeddings.position_embeddings.weight"][:seq_len]
                + p["bert.embeddings.token_type_embeddings.weight"][token_type_ids])
    x = dropout(layer_norm(embedded, "bert.embeddings.LayerNorm"), "bert.embeddings.dropout")
    additive_mask = (1.0 - attention_mask[:, None, None, :].double()) * -10000.0
    r = 0.0  # the residual stream starts at zero
    for index in range(config.num_hidden_layers):
        prefix = f"bert.encoder.layer.{index}."
        q, k, v = (linear(x, prefix + "attention.self." + n).view(batch, seq_len, heads, -1).transpose(1, 2)
                   for n in ("query", "key", "value"))
        context = reference_attention(q, k, v, additive_mask).transpose(1, 2).reshape(batch, seq_len, -1)
        a = r + dropout(linear(context, prefix + "attention.output.dense"), prefix + "attention.output.dropout")
        u = layer_norm(a, prefix + "attention.output.LayerNorm")
        ffn = linear(reference_gelu(linear(u, prefix + "intermediate.dense")), prefix + "output.dense")
        r = a + dropout(ffn, prefix + "output.dropout")
        x = layer_norm(r, prefix + "output.LayerNorm")
    pooled = torch.tanh(linear(x[:, 0], "bert.pooler.dense"))
    transformed = layer_norm(reference_gelu(linear(x, "cls.predictions.transform.dense")),
                             "cls.predictions.transform.LayerNorm")
    mlm = transformed @ p["bert.embeddings.word_embeddings.weight"].T + p["cls.predictions.bias"]
    return mlm, linear(pooled, "cls.seq_relationship")


def test_pre_ln_matches_independent_float64_forward():
    config = small_config(layer_norm_large_model=True)
    model = perturbed_model(config).double()
    input_ids, token_type_ids, attention_mask, _, _ = make_batch(config)
    with torch.no_grad():
        mlm, nsp = model(input_ids, token_type_ids, attention_mask)
        expected_mlm, expected_nsp = reference_pre_ln_forward(
            model.state_dict(), config, input_ids, token_type_ids, attention_mask)
    torch.testing.assert_close(mlm, expected_mlm, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(nsp, expected_nsp, atol=1e-10, rtol=1e-10)


def test_pre_ln_dropout_placement_matches_float64_forward_with_the_same_masks(monkeypatch):
    """Training mode, hidden dropout 0.5: each dropout runs once, on the tensor the reference's `modeling.py` drops."""
    config = small_config(layer_norm_large_model=True, hidden_dropout_prob=0.5)
    model = perturbed_model(config).double().train()
    replay = ReplayedDropout(model)
    monkeypatch.setattr(torch.nn.Dropout, "forward", lambda module, x: replay(module, x))
    input_ids, token_type_ids, attention_mask, _, _ = make_batch(config)
    with torch.no_grad():
        mlm, nsp = model(input_ids, token_type_ids, attention_mask)
        expected_mlm, expected_nsp = reference_pre_ln_forward(
            model.state_dict(), config, input_ids, token_type_ids, attention_mask, dropout_masks=replay.masks)
        without_dropout, _ = reference_pre_ln_forward(
            model.state_dict(), config, input_ids, token_type_ids, attention_mask)
    assert replay.calls == hidden_dropout_names(config)
    torch.testing.assert_close(mlm, expected_mlm, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(nsp, expected_nsp, atol=1e-10, rtol=1e-10)
    assert (mlm - without_dropout).abs().max() > 1e-2  # the masks do change the result


def test_pre_ln_differs_from_post_ln_with_the_same_weights():
    """Negative control: the wiring flag changes the function (so the two tests above test different things)."""
    pre_ln = perturbed_model(small_config(layer_norm_large_model=True))
    post_ln = BertForPreTraining(small_config()).eval()
    post_ln.load_state_dict(pre_ln.state_dict())
    input_ids, token_type_ids, attention_mask, _, _ = make_batch(pre_ln.config)
    with torch.no_grad():
        difference = (pre_ln(input_ids, token_type_ids, attention_mask)[0]
                      - post_ln(input_ids, token_type_ids, attention_mask)[0]).abs().max()
    assert difference > 1e-2


# ----------------------------------------------------------------------------------------------------------
# Attention


def test_sdpa_attention_matches_explicit_softmax_formula():
    config = small_config(attention_probs_dropout_prob=0.3)
    torch.manual_seed(0)
    attention = modeling.BertSelfAttention(config).double().eval()  # eval: no dropout
    hidden = torch.randn(2, 7, config.hidden_size, dtype=torch.float64)
    mask = torch.ones(2, 7)
    mask[1, 4:] = 0
    additive_mask = ((1.0 - mask[:, None, None, :]) * -10000.0).double()

    def heads(linear):
        return (hidden @ linear.weight.T + linear.bias).view(2, 7, 4, 8).transpose(1, 2)

    expected = reference_attention(heads(attention.query), heads(attention.key), heads(attention.value),
                                   additive_mask).transpose(1, 2).reshape(2, 7, -1)
    with torch.no_grad():
        torch.testing.assert_close(attention(hidden, additive_mask), expected, atol=1e-12, rtol=1e-12)
        attention.train()  # dropout on the probabilities only in training
        assert not torch.allclose(attention(hidden, additive_mask), expected)


def test_attention_dropout_acts_on_the_probabilities():
    """As the reference's `modeling.py`: dropout on P = softmax(scores), before P V. With V_j = e_j + e_last
    per head, each context row reads back its dropped probabilities (every entry 0 or P / (1 - p)) and, in the
    last slot, their sum; dropout anywhere else (scores, context) breaks one of the two."""
    config = small_config(attention_probs_dropout_prob=0.5)  # hidden 32, 4 heads of d = 8
    batch, seq_len, heads, head_dim = 2, 7, 4, 8
    torch.manual_seed(0)
    attention = modeling.BertSelfAttention(config).double().train()
    hidden = torch.randn(batch, seq_len, config.hidden_size, dtype=torch.float64)
    hidden[:, :, :seq_len] = torch.eye(seq_len, dtype=torch.float64)  # position j carries e_j
    with torch.no_grad():
        attention.value.weight.zero_()
        attention.value.bias.zero_()
        for head in range(heads):
            rows = slice(head * head_dim, head * head_dim + seq_len)
            attention.value.weight[rows, :seq_len] = torch.eye(seq_len, dtype=torch.float64)
            attention.value.bias[head * head_dim + seq_len] = 1.0
        context = attention(hidden, None).view(batch, seq_len, heads, head_dim).transpose(1, 2)

    def project(linear):
        return (hidden @ linear.weight.T + linear.bias).view(batch, seq_len, heads, head_dim).transpose(1, 2)

    scores = project(attention.query) @ project(attention.key).transpose(-1, -2) / math.sqrt(head_dim)
    scaled_probabilities = torch.softmax(scores, dim=-1) / (1.0 - 0.5)
    dropped, row_sums = context[..., :seq_len], context[..., seq_len]
    kept = dropped != 0
    assert kept.any() and not kept.all()
    torch.testing.assert_close(dropped[kept], scaled_probabilities[kept], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(row_sums, dropped.sum(-1), atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------------------------------------
# Sparse MLM head and criterion


def reference_cross_entropy(logits, targets):
    """Mean of -log softmax(logits)[target], in float64, written out by hand."""
    logits = logits.double()
    log_norm = logits.max(-1).values + torch.log(torch.exp(logits - logits.max(-1, keepdim=True).values).sum(-1))
    return (log_norm - logits.gather(-1, targets[:, None]).squeeze(-1)).mean()


def test_criterion_matches_hand_written_cross_entropy():
    torch.manual_seed(0)
    dense = torch.randn(2, 5, 12)
    labels = torch.tensor([[-1, 3, -1, -1, 11], [0, -1, -1, 7, -1]])
    nsp_logits, nsp_labels = torch.randn(2, 2), torch.tensor([1, 0])
    masked = labels != -1
    expected = reference_cross_entropy(dense[masked], labels[masked]) + reference_cross_entropy(nsp_logits, nsp_labels)
    criterion = BertPretrainingCriterion()
    dense_loss = criterion(dense, nsp_logits, labels, nsp_labels)
    sparse_loss = criterion(dense[masked], nsp_logits, labels, nsp_labels)
    assert dense_loss.dtype == torch.float32
    torch.testing.assert_close(dense_loss.double(), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(sparse_loss.double(), expected, atol=1e-6, rtol=0)
    # bf16 logits are upcast: the loss is float32 and equals the loss of the same (rounded) values in float64.
    bf16_loss = criterion(dense.bfloat16(), nsp_logits.bfloat16(), labels, nsp_labels)
    expected_bf16 = (reference_cross_entropy(dense.bfloat16()[masked], labels[masked])
                     + reference_cross_entropy(nsp_logits.bfloat16(), nsp_labels))
    assert bf16_loss.dtype == torch.float32
    torch.testing.assert_close(bf16_loss.double(), expected_bf16, atol=1e-6, rtol=0)


@pytest.mark.parametrize("pre_ln", [False, True])
def test_sparse_mlm_loss_and_gradients_equal_the_dense_ones(pre_ln):
    config = small_config(layer_norm_large_model=pre_ln)
    model = perturbed_model(config)
    input_ids, token_type_ids, attention_mask, labels, nsp_labels = make_batch(config)
    criterion = BertPretrainingCriterion()
    losses, grads = [], []
    for sparse_labels in (None, labels):
        model.zero_grad()
        scores, nsp = model(input_ids, token_type_ids, attention_mask, masked_lm_labels=sparse_labels)
        loss = criterion(scores, nsp, labels, nsp_labels)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert scores.shape == (int((labels != -1).sum()), config.padded_vocab_size)
    torch.testing.assert_close(losses[1], losses[0], atol=1e-6, rtol=0)
    for sparse_grad, dense_grad in zip(grads[1], grads[0]):
        torch.testing.assert_close(sparse_grad, dense_grad, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------
# Activation checkpointing


def loss_and_grads(model, batch, seed):
    input_ids, token_type_ids, attention_mask, labels, nsp_labels = batch
    model.zero_grad()
    torch.manual_seed(seed)
    scores, nsp = model(input_ids, token_type_ids, attention_mask, masked_lm_labels=labels)
    loss = BertPretrainingCriterion()(scores, nsp, labels, nsp_labels)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("pre_ln,dropout,interval", [(True, 0.0, 1), (True, 0.0, 2), (False, 0.0, 2),
                                                     (True, 0.1, 2)])
def test_activation_checkpointing_gives_the_same_gradients(pre_ln, dropout, interval):
    """torch's checkpoint restores the RNG state on recomputation, so equality holds with dropout too."""
    config = small_config(layer_norm_large_model=pre_ln, hidden_dropout_prob=dropout,
                          attention_probs_dropout_prob=dropout)
    model = perturbed_model(config).train()
    batch = make_batch(config)
    plain_loss, plain_grads = loss_and_grads(model, batch, seed=1)
    calls = []

    def counting_checkpoint(function, *args):
        calls.append(1)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    model.checkpoint_activations(True, interval, counting_checkpoint)
    checkpointed_loss, checkpointed_grads = loss_and_grads(model, batch, seed=1)
    assert len(calls) == math.ceil(config.num_hidden_layers / interval)
    torch.testing.assert_close(checkpointed_loss, plain_loss, atol=0, rtol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, atol=1e-7, rtol=1e-6, msg=name)
    model.checkpoint_activations(False)
    calls.clear()
    loss_and_grads(model, batch, seed=1)
    assert not calls


@pytest.mark.parametrize("pre_ln", [False, True])
def test_deepspeed_checkpoint_function_gives_the_same_gradients(pre_ln):
    """The driver passes DeepSpeed's checkpoint; the chunk carries (x, r) through it, with r = x in post-LN."""
    deepspeed = pytest.importorskip("deepspeed")
    config = small_config(layer_norm_large_model=pre_ln, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = perturbed_model(config).train()
    batch = make_batch(config)
    plain_loss, plain_grads = loss_and_grads(model, batch, seed=3)
    model.checkpoint_activations(True, 2, deepspeed.checkpointing.checkpoint)
    checkpointed_loss, checkpointed_grads = loss_and_grads(model, batch, seed=3)
    torch.testing.assert_close(checkpointed_loss, plain_loss, atol=0, rtol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, atol=1e-7, rtol=1e-6, msg=name)


def test_default_checkpoint_function_and_bad_interval():
    config = small_config(layer_norm_large_model=True)
    model = perturbed_model(config).train()
    batch = make_batch(config)
    _, plain_grads = loss_and_grads(model, batch, seed=0)
    model.checkpoint_activations(True)
    _, checkpointed_grads = loss_and_grads(model, batch, seed=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(checkpointed_grads[name], grad, atol=1e-7, rtol=1e-6, msg=name)
    with pytest.raises(ValueError, match="interval"):
        model.checkpoint_activations(True, 0)


# ----------------------------------------------------------------------------------------------------------
# Parameter counts, meta device, configs


def closed_form_count(h, layers, intermediate, vocab):
    """Worked out from the reference's `modeling.py`: per layer 4h^2 + 2hi + 9h + i; embeddings
    Vh + 512h + 2h + 2h; heads h^2+h, h^2+3h, V, 2h+2."""
    padded = -(-vocab // 8) * 8
    embeddings = padded * h + 512 * h + 2 * h + 2 * h
    encoder = layers * (4 * h * h + 2 * h * intermediate + 9 * h + intermediate)
    heads = (h * h + h) + (h * h + 3 * h) + padded + (2 * h + 2)
    return {"embeddings": embeddings, "encoder": encoder, "heads": heads, "total": embeddings + encoder + heads}


@pytest.mark.parametrize("name,h,layers,intermediate,vocab,approx_total", [
    ("bert_1.5b_config.json", 1600, 48, 6400, 30522, 1.530e9),
    ("bert_5b_config.json", 2560, 63, 10240, 512035, 6.28e9),
])
def test_count_parameters_matches_closed_formula(name, h, layers, intermediate, vocab, approx_total):
    counts = modeling.count_parameters(BertConfig.from_json_file(REPO / "scripts" / name))
    assert counts == closed_form_count(h, layers, intermediate, vocab)
    assert counts["total"] == pytest.approx(approx_total, rel=1e-3)


def test_meta_device_build_allocates_nothing():
    config = BertConfig.from_json_file(REPO / "scripts" / "bert_5b_config.json")
    with torch.device("meta"):
        model = BertForPreTraining(config)
    assert all(p.is_meta for p in model.parameters())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_count_command_prints_total_and_breakdown(capsys):
    assert modeling.main(["--count", str(REPO / "scripts" / "bert_1.5b_config.json")]) == 0
    out = capsys.readouterr().out
    assert "1,530,388,930" in out and all(part in out for part in ("embeddings", "encoder", "heads", "total"))


def test_count_command_rejects_a_bad_config_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"vocab_size": 10, "hiden_size": 64}))
    assert modeling.main(["--count", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hiden_size" in err


REFERENCE_VALUES = {  # the reference's scripts/bert_1.5b_config.json and bert_5b_config.json
    "bert_1.5b_config.json": dict(hidden_size=1600, num_hidden_layers=48, num_attention_heads=25,
                                  intermediate_size=6400, vocab_size=30522, layer_norm_large_model=True),
    "bert_5b_config.json": dict(hidden_size=2560, num_hidden_layers=63, num_attention_heads=40,
                                intermediate_size=10240, vocab_size=512035, layer_norm_large_model=True),
    "bert_large_config.json": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                   intermediate_size=4096, vocab_size=30522, layer_norm_large_model=False),
    "bert_tiny_config.json": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=512, vocab_size=30522, layer_norm_large_model=True),
}


@pytest.mark.parametrize("name", sorted(REFERENCE_VALUES))
def test_shipped_configs_have_the_reference_values(name):
    config = BertConfig.from_json_file(REPO / "scripts" / name)
    common = dict(hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                  max_position_embeddings=512, type_vocab_size=2, initializer_range=0.02)
    assert config.to_dict() == {**common, **REFERENCE_VALUES[name]}


def test_config_round_trip_and_padded_vocab(tmp_path):
    config = BertConfig(vocab_size=30522, hidden_size=64, num_attention_heads=2, layer_norm_large_model=True)
    config.to_json_file(tmp_path / "config.json")
    assert BertConfig.from_json_file(tmp_path / "config.json") == config
    assert [BertConfig(vocab_size=v).padded_vocab_size for v in (30522, 512035, 8, 1)] == [30528, 512040, 8, 8]


@pytest.mark.parametrize("change,key", [
    ({"vocab_sise": 5}, "vocab_sise"),
    ({"hidden_size": 100, "num_attention_heads": 3}, "hidden_size"),
    ({"hidden_size": -64}, "hidden_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"intermediate_size": 2.5}, "intermediate_size"),
    ({"hidden_act": "gelu_fast"}, "hidden_act"),
    ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob"),
    ({"num_attention_heads": True}, "num_attention_heads"),
    ({"layer_norm_large_model": "yes"}, "layer_norm_large_model"),
    ({"initializer_range": 0}, "initializer_range"),
])
def test_config_rejects_unknown_keys_and_impossible_values(change, key):
    values = {"vocab_size": 100, "hidden_size": 64, "num_attention_heads": 4, **change}
    with pytest.raises(ValueError, match=key):
        BertConfig.from_dict(values)


# ----------------------------------------------------------------------------------------------------------
# Initialisation, embeddings, dtype


def test_initialisation_and_embedding_details():
    config = small_config(hidden_size=128, num_attention_heads=4, intermediate_size=512, vocab_size=1000)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    for name, parameter in model.named_parameters():
        if name.endswith("LayerNorm.weight"):
            assert torch.all(parameter == 1), name
        elif name.endswith("bias"):
            assert torch.all(parameter == 0), name
        else:  # every Linear and Embedding weight, the FFN/pooler/transform ones included: N(0, 0.02)
            assert parameter.std().item() == pytest.approx(0.02, rel=0.15), name
            assert parameter.mean().abs().item() < 0.005, name
    assert model.bert.embeddings.word_embeddings.weight.shape == (1000, 128)
    assert model.bert.embeddings.word_embeddings.padding_idx == 0
    input_ids, token_type_ids, attention_mask, _, _ = make_batch(config)
    input_ids[:, -1] = 0
    # Through the encoder only: the tied decoder does (rightly) give row 0 a gradient as an output class.
    model.bert(input_ids, token_type_ids, attention_mask)[0].pow(2).sum().backward()
    word_grad = model.bert.embeddings.word_embeddings.weight.grad
    assert torch.all(word_grad[0] == 0) and word_grad[1:].abs().sum() > 0  # padding row 0 gets no gradient


def test_model_cast_to_bfloat16_runs_forward_and_backward():
    config = small_config(layer_norm_large_model=True, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    model = perturbed_model(config).train().bfloat16()  # what DeepSpeed's bf16 mode does to the module
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    input_ids, token_type_ids, attention_mask, labels, nsp_labels = make_batch(config)
    model.checkpoint_activations(True, 2)
    scores, nsp = model(input_ids, token_type_ids, attention_mask, masked_lm_labels=labels)
    assert scores.dtype == torch.bfloat16
    loss = BertPretrainingCriterion()(scores, nsp, labels, nsp_labels)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


# ----------------------------------------------------------------------------------------------------------
# Fine-tuning heads: shapes, and losses against the hand-written cross-entropy


def test_fine_tuning_heads():
    config = small_config()
    input_ids, token_type_ids, attention_mask, _, _ = make_batch(config, batch=2, seq_len=8)
    torch.manual_seed(0)
    labels = torch.tensor([1, 2])

    classifier = modeling.BertForSequenceClassification(config, num_labels=3)
    loss, logits = classifier(input_ids, token_type_ids, attention_mask, labels=labels)
    assert logits.shape == (2, 3)
    torch.testing.assert_close(loss.double(), reference_cross_entropy(logits, labels))

    tagger = modeling.BertForTokenClassification(config, num_labels=4)
    tags = torch.randint(0, 4, (2, 8))
    loss, logits = tagger(input_ids, token_type_ids, attention_mask, labels=tags)
    assert logits.shape == (2, 8, 4)
    active = attention_mask == 1
    torch.testing.assert_close(loss.double(), reference_cross_entropy(logits[active], tags[active]))

    chooser = modeling.BertForMultipleChoice(config)
    loss, logits = chooser(*(tensor[:, None].expand(2, 3, 8) for tensor in (input_ids, token_type_ids,
                                                                            attention_mask)), labels=labels)
    assert logits.shape == (2, 3)
    torch.testing.assert_close(loss.double(), reference_cross_entropy(logits, labels))

    reader = modeling.BertForQuestionAnswering(config)
    start_logits, end_logits = reader(input_ids, token_type_ids, attention_mask)
    assert start_logits.shape == end_logits.shape == (2, 8)
    loss, _, _ = reader(input_ids, token_type_ids, attention_mask, start_positions=torch.tensor([1, 3]),
                        end_positions=torch.tensor([2, 5]))
    expected = (reference_cross_entropy(start_logits, torch.tensor([1, 3]))
                + reference_cross_entropy(end_logits, torch.tensor([2, 5]))) / 2
    torch.testing.assert_close(loss.double(), expected)
