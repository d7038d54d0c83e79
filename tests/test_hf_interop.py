"""finetune/hf_interop.py against the real transformers: export -> BertForPreTraining.from_pretrained gives our logits;
a transformers save_pretrained directory read back gives transformers' logits; a pre-LN export loads in
transformers through its remote code (hf_modeling_pre_ln.py) with equal logits, is refused by transformers'
own BERT and is read back by us; the weight sources and their one-line errors."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from common.errors import InputError
from finetune import hf_interop
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


def test_an_encoder_only_transformers_save_loads_for_classification_with_a_fresh_head(tmp_path):
    """all-MiniLM-L6-v2's layout (docs/fine-tuning.md, mr-vader): a transformers.BertModel save (keys without
    "bert.", a pooler, no pretraining head) gives BertForSequenceClassification every weight but the classifier,
    and its encoder and pooler give transformers' outputs."""
    from finetune.finetuning import load_pretrained
    from modeling import BertForSequenceClassification

    config = small_config()
    hf_model = transformers.BertModel(transformers.BertConfig(**hf_interop.to_transformers_config(
        config, vocab_size=config.vocab_size))).eval()
    with torch.no_grad():
        for parameter in hf_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    hf_model.save_pretrained(tmp_path / "hf")
    read_config, weights = load_pretrained(tmp_path / "hf", None)
    assert read_config == config
    model = BertForSequenceClassification(read_config, 2).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert unexpected == [] and sorted(missing) == ["classifier.bias", "classifier.weight"]
    batch = real_pair_batch(transformers.BertTokenizerFast(vocab_file=str(VOCAB), do_lower_case=True))
    with torch.no_grad():
        sequence, pooled = model.bert(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        theirs = hf_model(**batch)
    torch.testing.assert_close(sequence, theirs.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, theirs.pooler_output, atol=1e-5, rtol=0)


def export_model(tmp_path, pre_ln=True):
    """(our model with random weights, the directory `python -m finetune.hf_interop export` wrote of it)."""
    config = small_config(layer_norm_large_model=pre_ln)
    model = perturbed_model(config)
    weights, config_file = save_state_dict_file(model, tmp_path)
    out = tmp_path / ("pre_ln" if pre_ln else "post_ln")
    assert hf_interop.main(["export", "--checkpoint", str(weights), "--config_file", str(config_file),
                            "--vocab_file", str(VOCAB), "--do_lower_case", "--output_dir", str(out)]) == 0
    return model, out


def test_a_pre_ln_export_loads_in_transformers_as_remote_code_with_equal_logits(tmp_path):
    model, out = export_model(tmp_path)
    config = model.config
    assert (out / "hf_modeling_pre_ln.py").read_bytes() == hf_interop.PRE_LN_MODELING_FILE.read_bytes()
    batch = real_pair_batch(transformers.AutoTokenizer.from_pretrained(out))
    with torch.no_grad():
        mlm, nsp = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        sequence_output, pooled = model.bert(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        theirs = transformers.AutoModelForPreTraining.from_pretrained(out, trust_remote_code=True).eval()(**batch)
        base = transformers.AutoModel.from_pretrained(out, trust_remote_code=True).eval()(**batch)
    assert mlm[..., :config.vocab_size].std() > 0.1  # logits that differ between the wirings
    torch.testing.assert_close(mlm[..., :config.vocab_size], theirs.prediction_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(nsp, theirs.seq_relationship_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(sequence_output, base.last_hidden_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled, base.pooler_output, atol=1e-5, rtol=0)
    # The masked-LM class (the fill-mask pipeline's): the same token logits, and the loss of transformers' BERT
    # (cross-entropy over the labelled positions, -100 ignored).
    labels = torch.full_like(batch["input_ids"], -100)
    labels[:, 2:4] = batch["input_ids"][:, 2:4]
    with torch.no_grad():
        masked_lm = transformers.AutoModelForMaskedLM.from_pretrained(out, trust_remote_code=True).eval()(
            **batch, labels=labels)
    torch.testing.assert_close(mlm[..., :config.vocab_size], masked_lm.logits, atol=1e-5, rtol=0)
    expected_loss = torch.nn.functional.cross_entropy(mlm[:, 2:4, :config.vocab_size].reshape(-1, config.vocab_size),
                                                      labels[:, 2:4].reshape(-1))
    torch.testing.assert_close(masked_lm.loss, expected_loss, atol=1e-5, rtol=0)
    # The fine-tuning heads: the encoder's weights load, the new head is reported and trains.
    for auto, head_output in ((transformers.AutoModelForSequenceClassification, "logits"),
                              (transformers.AutoModelForQuestionAnswering, "start_logits")):
        head_model, info = auto.from_pretrained(out, trust_remote_code=True, num_labels=3, output_loading_info=True)
        assert all(key.startswith(("cls.", "bert.pooler.")) for key in info["unexpected_keys"]), info
        assert all(not key.startswith("bert.") for key in info["missing_keys"]), info["missing_keys"]
        labels = ({"labels": torch.tensor([0, 2])} if head_output == "logits"
                  else {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])})
        output = head_model.train()(**batch, **labels)
        output.loss.backward()
        assert torch.isfinite(output.loss) and getattr(output, head_output).shape[0] == 2


def test_a_pre_ln_export_is_refused_by_transformers_post_ln_bert_and_read_back_by_us(tmp_path):
    model, out = export_model(tmp_path)
    config = model.config
    values = json.loads((out / "config.json").read_text())
    assert values["model_type"] == "bert" and values["layer_norm_large_model"] is True
    assert (out / hf_interop.PRE_LN_WEIGHT_FILE).is_file() and not (out / "model.safetensors").exists()
    # The weights are the "pre_ln" variant: transformers' own classes, and the Auto classes and the pipeline
    # without remote code, look for model.safetensors and raise before building the post-LN wiring on them.
    loaders = [(cls.from_pretrained, OSError) for cls in (transformers.BertForPreTraining, transformers.BertModel,
                                                          transformers.BertForMaskedLM,
                                                          transformers.AutoModelForPreTraining)]
    # the pipeline raises a ValueError that quotes the OSError
    for load, error in loaders + [(lambda path: transformers.pipeline("fill-mask", model=path), ValueError)]:
        with pytest.raises(error, match="no file named model.safetensors"):
            load(out)
    read_config, read_weights = hf_interop.read_pretrained_weights(out)
    assert read_config == config
    for key, value in model.state_dict().items():  # padding rows of the vocabulary are not exported
        rows = config.vocab_size if key in hf_interop.PADDED_ROWS + hf_interop.PADDED_BIAS else None
        assert torch.equal(read_weights[key][:rows], value[:rows]), key


def test_a_pre_ln_export_of_the_earlier_format_reads_back(tmp_path):
    """Exports written before the weights variant: model_type "bert_pre_ln", layer_types, model.safetensors."""
    model, out = export_model(tmp_path)
    values = json.loads((out / "config.json").read_text())
    values.update(model_type=hf_interop.OLD_PRE_LN_MODEL_TYPE, layer_types=["pre_ln"] * model.config.num_hidden_layers)
    (out / "config.json").write_text(json.dumps(values))
    (out / hf_interop.PRE_LN_WEIGHT_FILE).rename(out / "model.safetensors")
    read_config, read_weights = hf_interop.read_pretrained_weights(out)
    assert read_config == model.config
    assert torch.equal(read_weights["bert.encoder.layer.1.output.dense.weight"],
                       model.state_dict()["bert.encoder.layer.1.output.dense.weight"])


def docs_block(heading: str, language: str, containing: str) -> str:
    """The first ```language block of docs/fine-tuning.md's section `heading` that contains `containing`."""
    section = (REPO_ROOT / "docs" / "fine-tuning.md").read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ")[0]
    return next(block.split("\n", 1)[1] for block in section.split("```")[1::2]
                if block.startswith(language + "\n") and containing in block)


LOAD_REPORT_ROW = re.compile(r"^(\S+)\s*\|\s*(UNEXPECTED|MISSING|MISMATCH)\b", re.MULTILINE)


def test_the_docs_tokenizer_and_fill_mask_pipeline_work_on_both_exports(tmp_path):
    """The docs' snippet, as a user runs it (a fresh interpreter, the docs' flags), on a post-LN and a pre-LN
    export: the tokenizer gives our data pipeline's ids, the pipeline's top tokens and scores are our model's
    softmax at the masked position, and transformers says nothing but the post-LN load report of the four keys
    BertForMaskedLM has no place for."""
    from data.tokenization import load_tokenizer

    snippet = docs_block("Hugging Face export", "python", 'pipeline("fill-mask"')
    assert 'D = "results/bert_tiny/hf"\n' in snippet
    exports = {"post-LN": export_model(tmp_path, pre_ln=False), "pre-LN": export_model(tmp_path, pre_ln=True)}
    script = ["import json, sys"]
    for name, (_, out) in exports.items():
        script += [f"print('=== {name}', file=sys.stderr, flush=True)",
                   snippet.replace('D = "results/bert_tiny/hf"', f"D = {str(out)!r}"),
                   f"print('RESULT', json.dumps([{name!r}, [[r['token'], r['score']] for r in "
                   "fill_mask('The capital of France is [MASK].')]]))"]
    result = subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=tmp_path, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    ours, _, special = load_tokenizer(VOCAB, do_lower_case=True)

    def ids(text):
        return ours.encode(text, add_special_tokens=False).ids

    printed = result.stdout.splitlines()
    tokenized = [json.loads(line) for line in printed if line.startswith("[") and not line.startswith("[{")]
    assert tokenized == [[special["[CLS]"], *ids("The capital of France is Paris."), special["[SEP]"]]] * 2
    masked = [special["[CLS]"], *ids("The capital of France is"), special["[MASK]"], *ids("."), special["[SEP]"]]
    filled = dict(json.loads(line.split(" ", 1)[1]) for line in printed if line.startswith("RESULT "))
    for name, (model, _) in exports.items():
        with torch.no_grad():
            mlm, _ = model(torch.tensor([masked]), torch.zeros(1, len(masked), dtype=torch.long),
                           torch.ones(1, len(masked), dtype=torch.long))
        probabilities = mlm[0, masked.index(special["[MASK]"]), :model.config.vocab_size].softmax(-1)
        tokens, scores = zip(*filled[name])
        assert len(tokens) == 5, name
        torch.testing.assert_close(probabilities[list(tokens)], torch.tensor(scores), atol=1e-6, rtol=1e-4)
        assert min(scores) >= probabilities.topk(5).values[-1].item() - 1e-6, name  # the five most likely
    said = dict(part.split("\n", 1) for part in result.stderr.split("=== ")[1:])
    assert set(said) == set(exports)
    assert not re.search(r"Traceback|warning|custom code|model of type|layer_types", result.stderr, re.IGNORECASE), \
        result.stderr
    assert sorted(LOAD_REPORT_ROW.findall(said["post-LN"])) == [
        (key, "UNEXPECTED") for key in ("bert.pooler.dense.bias", "bert.pooler.dense.weight",
                                        "cls.seq_relationship.bias", "cls.seq_relationship.weight")]
    assert "LOAD REPORT" not in said["pre-LN"], said["pre-LN"]


def test_the_docs_install_the_transformers_that_the_tests_pin():
    pinned = next(line for line in (REPO_ROOT / "requirements-dev.txt").read_text().splitlines()
                  if line.startswith("transformers=="))
    assert f"python -m pip install {pinned}\n" in docs_block("Hugging Face export", "bash", "pip install")


def test_exported_files_share_one_mode(tmp_path):
    _, out = export_model(tmp_path)
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert len(set(modes.values())) == 1, modes
    assert modes[hf_interop.PRE_LN_WEIGHT_FILE] & 0o044 == 0o044, modes  # readable by others, as the umask allows


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


def test_a_pre_ln_export_resaved_by_transformers_reads_back(tmp_path):
    """save_pretrained adds keys of its own (transformers_version, dtype, pad_token_id, layer_norm_eps, ...) to
    the pre-LN config.json: only BertConfig's fields are taken, and the weights are the exported model's."""
    model, out = export_model(tmp_path)
    config = model.config
    transformers.AutoModelForPreTraining.from_pretrained(out, trust_remote_code=True).save_pretrained(
        tmp_path / "resaved")
    values = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert {"transformers_version", "layer_norm_eps"} <= set(values) and values["model_type"] == "bert"
    assert (tmp_path / "resaved" / hf_interop.PRE_LN_WEIGHT_FILE).is_file()  # the variant survives a re-save
    with pytest.raises(OSError, match="no file named model.safetensors"):
        transformers.BertForPreTraining.from_pretrained(tmp_path / "resaved")
    remote_model = transformers.AutoModelForPreTraining.from_pretrained(out, trust_remote_code=True)
    remote_model.save_pretrained(tmp_path / "sharded", max_shard_size="1MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.pre_ln.json").is_file()
    for resaved in ("resaved", "sharded"):
        read_config, read_weights = hf_interop.read_pretrained_weights(tmp_path / resaved)
        assert read_config == config
        for key, value in model.state_dict().items():
            rows = config.vocab_size if key in hf_interop.PADDED_ROWS + hf_interop.PADDED_BIAS else None
            assert torch.equal(read_weights[key][:rows], value[:rows]), (resaved, key)
    # A layer_norm_eps our model would not use is refused, as for a post-LN directory.
    values["layer_norm_eps"] = 1e-5
    (tmp_path / "resaved" / "config.json").write_text(json.dumps(values))
    with pytest.raises(InputError) as caught:
        hf_interop.read_pretrained_weights(tmp_path / "resaved")
    assert str(caught.value) == (f"{tmp_path / 'resaved' / 'config.json'}: layer_norm_eps 1e-05 "
                                 f"(this model uses 1e-12)")


# ============================================================================ transformers' task checkpoints

def fine_tuning_model(make_model, source, fine_tune, said=None, config_file=None):
    """finetuning.build_model of run_squad.py / run_glue.py on the weights of `source` (--init_checkpoint)."""
    import types

    from finetune import finetuning
    config, weights = finetuning.load_pretrained(source, config_file)
    session = types.SimpleNamespace(rank=0, config=types.SimpleNamespace(seed=1),
                                    say=(said.append if said is not None else lambda text: None))
    return finetuning.build_model(make_model, config, weights, session, fine_tune=fine_tune)


def transformers_model(cls, config, path, seed=0):
    """A transformers model of `config` with random weights everywhere, saved in `path`."""
    torch.manual_seed(seed)
    hf_model = cls(transformers.BertConfig(**hf_interop.to_transformers_config(config, config.vocab_size))).eval()
    with torch.no_grad():
        for parameter in hf_model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    hf_model.save_pretrained(path)
    return hf_model


def test_a_transformers_question_answering_save_evaluates_with_its_logits(tmp_path):
    """A BertForQuestionAnswering save has no pooler (SQuAD never reads it): it starts fresh, with a note, and
    evaluation without training gives transformers' own start and end logits."""
    from modeling import BertForQuestionAnswering, BertForSequenceClassification
    config = small_config()
    hf_model = transformers_model(transformers.BertForQuestionAnswering, config, tmp_path / "qa")
    assert not any("pooler" in key for key in hf_model.state_dict())
    said = []
    model = fine_tuning_model(BertForQuestionAnswering, tmp_path / "qa", fine_tune=False, said=said).eval()
    assert said[-1].endswith("; fresh: bert.pooler"), said
    batch = real_pair_batch(transformers.BertTokenizerFast(vocab_file=str(VOCAB), do_lower_case=True))
    with torch.no_grad():
        start, end = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        theirs = hf_model(**batch)
    torch.testing.assert_close(start, theirs.start_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(end, theirs.end_logits, atol=1e-5, rtol=0)
    # A classifier reads the pooler: fine-tuning starts both fresh; evaluation alone is refused.
    fine_tuning_model(lambda c: BertForSequenceClassification(c, 2), tmp_path / "qa", fine_tune=True)
    with pytest.raises(InputError) as caught:
        fine_tuning_model(lambda c: BertForSequenceClassification(c, 2), tmp_path / "qa", fine_tune=False)
    assert str(caught.value).startswith("--init_checkpoint has no task head (bert.pooler.dense.bias, "
                                        "bert.pooler.dense.weight, classifier.bias, classifier.weight)")


def test_older_transformers_position_ids_buffer_is_dropped(tmp_path):
    """pytorch_model.bin of older transformers holds bert.embeddings.position_ids: the weights read as the same
    save without it; a key the model does not have is named as such."""
    from modeling import BertForQuestionAnswering
    config = small_config()
    hf_model = transformers_model(transformers.BertForPreTraining, config, tmp_path / "new")
    state = dict(hf_model.state_dict(), **{"bert.embeddings.position_ids": torch.arange(64)[None]})
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    torch.save(state, tmp_path / "old" / "pytorch_model.bin")
    _, old_weights = hf_interop.read_pretrained_weights(tmp_path / "old")
    _, new_weights = hf_interop.read_pretrained_weights(tmp_path / "new")
    assert old_weights.keys() == new_weights.keys()
    assert all(torch.equal(old_weights[key], new_weights[key]) for key in new_weights)
    fine_tuning_model(BertForQuestionAnswering, tmp_path / "old", fine_tune=True)
    torch.save(dict(state, **{"bert.encoder.extra": torch.zeros(1)}), tmp_path / "old" / "pytorch_model.bin")
    with pytest.raises(InputError) as caught:
        fine_tuning_model(BertForQuestionAnswering, tmp_path / "old", fine_tune=True)
    assert str(caught.value) == ("--init_checkpoint does not hold this model's encoder: missing keys [], "
                                 "unexpected keys ['bert.encoder.extra']")


def tensorflow_layer_norm_names(state: dict) -> dict:
    """`state` under the LayerNorm names of older TensorFlow-ported BERT checkpoints (gamma, beta)."""
    renamed = {}
    for key, value in state.items():
        if ".LayerNorm." in key:
            key = key.replace(".LayerNorm.weight", ".LayerNorm.gamma").replace(".LayerNorm.bias", ".LayerNorm.beta")
        renamed[key] = value
    return renamed


@pytest.mark.parametrize("source", ["pytorch_model.bin with config.json", "state-dict file with --config_file"])
def test_tensorflow_layer_norm_names_load_as_the_weights_they_hold(tmp_path, source):
    """A checkpoint whose LayerNorms are named gamma/beta (older TensorFlow-ported BERT) loads through
    --init_checkpoint's path with its own values in every encoder weight, its LayerNorms included."""
    from modeling import BertForQuestionAnswering
    config = small_config()
    hf_model = transformers_model(transformers.BertForPreTraining, config, tmp_path / "hf")
    expected = hf_model.state_dict()
    legacy = tensorflow_layer_norm_names(expected)
    layer_norms = 2 * config.num_hidden_layers + 2  # two per layer, the embeddings', the MLM head's
    assert sum(key.endswith((".LayerNorm.gamma", ".LayerNorm.beta")) for key in legacy) == 2 * layer_norms
    if source == "state-dict file with --config_file":
        init_checkpoint, config_file = tmp_path / "bert_tf_ported.bin", tmp_path / "bert_config.json"
        config.to_json_file(config_file)
        torch.save(legacy, init_checkpoint)
    else:
        init_checkpoint, config_file = tmp_path / "legacy", None
        init_checkpoint.mkdir()
        (init_checkpoint / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        torch.save(legacy, init_checkpoint / "pytorch_model.bin")
    model = fine_tuning_model(BertForQuestionAnswering, init_checkpoint, fine_tune=True, config_file=config_file)
    loaded = model.state_dict()
    encoder = [key for key in loaded if key.startswith("bert.")]
    assert sum(".LayerNorm." in key for key in encoder) == 2 * (layer_norms - 1)  # all but the MLM head's
    for key in encoder:
        rows = config.vocab_size if key in hf_interop.PADDED_ROWS else None
        assert torch.equal(loaded[key][:rows], expected[key][:rows]), key


@pytest.mark.parametrize("edit, message", [
    (lambda values: {key: value for key, value in values.items() if key != "model_type"},
     "no 'model_type' key (a Hugging Face BERT config.json has \"model_type\": \"bert\")"),
    (lambda values: [values], "a model config must be a JSON object"),
])
def test_a_config_json_without_model_type_is_one_error_naming_the_file(tmp_path, capsys, edit, message):
    transformers_model(transformers.BertForPreTraining, small_config(), tmp_path / "hf")
    config_json = tmp_path / "hf" / "config.json"
    config_json.write_text(json.dumps(edit(json.loads(config_json.read_text()))))
    capsys.readouterr()  # save_pretrained's progress bar
    assert hf_interop.main(["export", "--checkpoint", str(tmp_path / "hf"), "--vocab_file", str(VOCAB),
                            "--output_dir", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {config_json}: {message}"]


def test_a_sharded_transformers_save_reads_as_the_unsharded_one(tmp_path):
    """save_pretrained(max_shard_size=...) writes model.safetensors.index.json and shards: the weights read are
    those of the same model saved in one file; a shard that is gone is one error naming it."""
    config = small_config()
    hf_model = transformers_model(transformers.BertForPreTraining, config, tmp_path / "whole")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="1MB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (tmp_path / "sharded" / "model.safetensors").exists()
    read_config, sharded = hf_interop.read_pretrained_weights(tmp_path / "sharded")
    _, whole = hf_interop.read_pretrained_weights(tmp_path / "whole")
    assert read_config == config and sharded.keys() == whole.keys()
    assert all(torch.equal(sharded[key], whole[key]) for key in whole)
    # An index that names the wrong shard for a key.
    key = next(key for key, name in index["weight_map"].items() if name == shards[0])
    index_file = tmp_path / "sharded" / "model.safetensors.index.json"
    index_file.write_text(json.dumps({"weight_map": dict(index["weight_map"], **{key: shards[-1]})}))
    with pytest.raises(InputError) as caught:
        hf_interop.read_pretrained_weights(tmp_path / "sharded")
    assert str(caught.value) == (f"--init_checkpoint: {index_file}: 1 key(s) not in the shard named for them "
                                 f"(first: {key} in {shards[-1]})")
    index_file.write_text(json.dumps(index))
    (tmp_path / "sharded" / shards[-1]).unlink()
    with pytest.raises(InputError) as caught:
        hf_interop.read_pretrained_weights(tmp_path / "sharded")
    assert str(caught.value) == (f"--init_checkpoint: {tmp_path / 'sharded' / 'model.safetensors.index.json'} "
                                 f"names the shard {shards[-1]!r}, which is not a file in {tmp_path / 'sharded'}")
