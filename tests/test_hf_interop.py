"""hf_interop.py against the real transformers: export -> BertForPreTraining.from_pretrained gives our logits;
a transformers save_pretrained directory read back gives transformers' logits; the pre-LN wiring is refused
by transformers and read back by us; the weight sources and their one-line errors."""

import json

import pytest
import torch

import hf_interop
from errors import InputError
from finetune_helpers import REPO_ROOT, book_sentences
from modeling import BertConfig, BertForPreTraining

transformers = pytest.importorskip("transformers")
VOCAB = REPO_ROOT / "data" / "vocab.txt"


def small_config(**overrides) -> BertConfig:
    values = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertConfig(**{**values, **overrides})


def perturbed_model(config, seed=0):
    """Random weights everywhere (biases and LayerNorms too), so that a wrong mapping cannot hide."""
    torch.manual_seed(seed)
    model = BertForPreTraining(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model


def save_state_dict_file(model, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(model.state_dict(), path)
    config_file = tmp_path / "config.json"
    model.config.to_json_file(config_file)
    return path, config_file


def real_pair_batch(tokenizer):
    """Two real sentence pairs through a Hugging Face tokenizer (padding to the longer)."""
    sentences = book_sentences()[:4]
    return tokenizer(sentences[0::2], sentences[1::2], padding=True, return_tensors="pt")


def test_export_loads_in_transformers_with_equal_logits_and_tokens(tmp_path):
    config = small_config()
    model = perturbed_model(config)
    weights, config_file = save_state_dict_file(model, tmp_path)
    out = tmp_path / "hf"
    assert hf_interop.main(["export", "--checkpoint", str(weights), "--config_file", str(config_file),
                            "--vocab_file", str(VOCAB), "--do_lower_case", "--output_dir", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "vocab.txt", "tokenizer.json",
                                               "tokenizer_config.json", "special_tokens_map.json"}
    hf_model = transformers.BertForPreTraining.from_pretrained(out).eval()
    assert hf_model.config.vocab_size == 30522  # the padding rows are not exported
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    batch = real_pair_batch(tokenizer)
    # The exported tokenizer gives our data pipeline's ids.
    from data.tokenization import load_tokenizer
    ours_tokenizer, _, _ = load_tokenizer(VOCAB, do_lower_case=True)
    sentence = book_sentences()[0]
    assert tokenizer(sentence)["input_ids"][1:-1] == ours_tokenizer.encode(sentence, add_special_tokens=False).ids
    with torch.no_grad():
        mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        theirs = hf_model(**batch)
    torch.testing.assert_close(mlm[..., :config.vocab_size], theirs.prediction_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(nsp, theirs.seq_relationship_logits, atol=1e-5, rtol=0)


def test_a_transformers_directory_reads_back_with_equal_logits(tmp_path):
    config = small_config()
    hf_model = transformers.BertForPreTraining(transformers.BertConfig(**hf_interop.to_transformers_config(
        config, vocab_size=config.vocab_size))).eval()
    with torch.no_grad():
        for parameter in hf_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    hf_model.save_pretrained(tmp_path / "hf")  # model.safetensors
    read_config, weights = hf_interop.read_pretrained_weights(tmp_path / "hf")
    assert read_config == config
    model = BertForPreTraining(read_config).eval()
    model.load_state_dict(weights)
    batch = real_pair_batch(transformers.BertTokenizerFast(vocab_file=str(VOCAB), do_lower_case=True))
    with torch.no_grad():
        mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        theirs = hf_model(**batch)
    torch.testing.assert_close(mlm[..., :config.vocab_size], theirs.prediction_logits, atol=1e-5, rtol=0)
    assert mlm[..., config.vocab_size:].abs().max() == 0  # padding rows: zero weights, zero bias
    torch.testing.assert_close(nsp, theirs.seq_relationship_logits, atol=1e-5, rtol=0)


def test_the_pre_ln_wiring_is_exported_in_our_format_that_transformers_refuses(tmp_path):
    config = small_config(layer_norm_large_model=True)
    model = perturbed_model(config)
    weights, config_file = save_state_dict_file(model, tmp_path)
    out = tmp_path / "ours"
    assert hf_interop.main(["export", "--checkpoint", str(weights), "--config_file", str(config_file),
                            "--vocab_file", str(VOCAB), "--do_lower_case", "--output_dir", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "bert_pre_ln"
    with pytest.raises(ValueError, match="bert_pre_ln"):
        transformers.AutoModelForPreTraining.from_pretrained(out)
    read_config, read_weights = hf_interop.read_pretrained_weights(out)
    assert read_config == config
    for key, value in model.state_dict().items():  # padding rows of the vocabulary are not exported
        rows = config.vocab_size if key in hf_interop.PADDED_ROWS + hf_interop.PADDED_BIAS else None
        assert torch.equal(read_weights[key][:rows], value[:rows]), key


def test_a_checkpoint_for_another_config_is_one_error(tmp_path):
    model = perturbed_model(small_config())
    save_state_dict_file(model, tmp_path)
    hf_dir = tmp_path / "hf"
    hf_interop.export_directory(model.state_dict(), model.config, VOCAB, True, hf_dir)
    other = tmp_path / "other.json"
    small_config(hidden_size=64).to_json_file(other)
    with pytest.raises(InputError, match=r"--init_checkpoint .*hf is for another model config: hidden_size 32 "
                                         r"there, 64 in --config_file$"):
        hf_interop.read_pretrained_weights(hf_dir, other)
    with pytest.raises(InputError, match="records no model config: pass --config_file"):
        hf_interop.read_pretrained_weights(tmp_path / "weights.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(InputError, match=r"--init_checkpoint: cannot read .*junk.pt"):
        hf_interop.read_pretrained_weights(tmp_path / "junk.pt", other)


def test_export_refuses_a_vocab_of_another_size(tmp_path, capsys):
    model = perturbed_model(small_config())
    weights, config_file = save_state_dict_file(model, tmp_path)
    short_vocab = tmp_path / "vocab.txt"
    short_vocab.write_text("\n".join(VOCAB.read_text().splitlines()[:1000]) + "\n")
    assert hf_interop.main(["export", "--checkpoint", str(weights), "--config_file", str(config_file),
                            "--vocab_file", str(short_vocab), "--output_dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --vocab_file {short_vocab} has 1000 tokens, the model config 30522"]
    assert not (tmp_path / "out").exists()
