#!/usr/bin/env python
"""Hugging Face interoperability: the BertConfig <-> transformers config mapping, state-dict key fix-ups,
reading a Hugging Face BERT directory, and exporting one.

Export (post-LN wiring): a directory that `transformers.BertForPreTraining.from_pretrained` loads with the
same logits: config.json, model.safetensors, vocab.txt, tokenizer.json, tokenizer_config.json,
special_tokens_map.json. The embedding and decoder rows padded to a multiple of 8 are dropped, so the
directory has the vocabulary's size, as Hugging Face's own BERT checkpoints do.

The pre-LN wiring (layer_norm_large_model, the 1.5B/5B recipe) has no transformers class: its directory
also holds hf_modeling_pre_ln.py, this repository's pre-LN model for transformers, named in config.json's
auto_map, so `transformers.AutoModelForPreTraining.from_pretrained(dir, trust_remote_code=True)` (and
AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, AutoModelForQuestionAnswering) loads it
with the same logits. Its config.json has model_type "bert", so that AutoTokenizer and AutoConfig read it
without remote code, and its weights are the "pre_ln" variant (model.pre_ln.safetensors), which only those
classes ask for: a plain `transformers.BertForPreTraining.from_pretrained(dir)` finds no weights file and raises
instead of loading the post-LN wiring. The fine-tuning scripts read it back.

    python -m finetune.hf_interop export --checkpoint results/bert_tiny/checkpoints --output_dir results/bert_tiny/hf \\
        --vocab_file data/vocab.txt [--config_file scripts/bert_tiny_config.json] [--do_lower_case]

--checkpoint: a run_pretraining.py output directory or tag directory (any ZeRO stage and world size),
the file of `python -m training.checkpointing export`, or a Hugging Face directory.
transformers is never imported here; safetensors and tokenizers are.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from common.atomic_write import atomic_path, write_text_atomically
from common.errors import InputError, one_line
from modeling import LAYER_NORM_EPS, TRANSFORMERS_ONLY_KEYS, BertConfig
from training import checkpoint_export

if TYPE_CHECKING:
    from tokenizers import Tokenizer

StateDict: TypeAlias = dict[str, torch.Tensor]

# The pre-LN export's weights, transformers' name for the variant "pre_ln" (hf_modeling_pre_ln.WEIGHTS_VARIANT).
PRE_LN_WEIGHT_FILE = "model.pre_ln.safetensors"
HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", PRE_LN_WEIGHT_FILE)
# A sharded save: the index maps every key to the file (in the same directory) that holds it.
HF_INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors.index.pre_ln.json")
# The model_type of pre-LN exports written before the export took "bert" with the pre_ln weights variant.
OLD_PRE_LN_MODEL_TYPE = "bert_pre_ln"
PRE_LN_MODELING_FILE = Path(__file__).with_name("hf_modeling_pre_ln.py")  # transformers' remote code for it
PRE_LN_AUTO_MAP = {"AutoConfig": "BertPreLNConfig", "AutoModel": "BertPreLNModel",
                   "AutoModelForPreTraining": "BertPreLNForPreTraining", "AutoModelForMaskedLM": "BertPreLNForMaskedLM",
                   "AutoModelForSequenceClassification": "BertPreLNForSequenceClassification",
                   "AutoModelForQuestionAnswering": "BertPreLNForQuestionAnswering"}
PADDED_ROWS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")
PADDED_BIAS = ("cls.predictions.bias", "cls.predictions.decoder.bias")
# Names of old (TF-ported) checkpoints -> modeling_bert.py names.
LEGACY_NAME_PARTS = ((".gamma", ".weight"), (".beta", ".bias"))


# ============================================================================ config mapping

def to_transformers_config(config: BertConfig, vocab_size: int | None = None) -> dict[str, Any]:
    """The transformers.BertConfig keyword arguments (and config.json keys) of a post-LN BertConfig (vocab_size: the
    rows the weights have; default the padded size, as our modules have)."""
    if config.layer_norm_large_model:
        raise InputError("the pre-LN wiring (layer_norm_large_model) has no transformers class")
    return {"vocab_size": vocab_size or config.padded_vocab_size, "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
            "intermediate_size": config.intermediate_size, "hidden_act": config.hidden_act,
            "hidden_dropout_prob": config.hidden_dropout_prob,
            "attention_probs_dropout_prob": config.attention_probs_dropout_prob,
            "max_position_embeddings": config.max_position_embeddings, "type_vocab_size": config.type_vocab_size,
            "initializer_range": config.initializer_range, "layer_norm_eps": LAYER_NORM_EPS,
            "position_embedding_type": "absolute", "pad_token_id": 0}


def from_transformers_config(values: object, where: str | os.PathLike[str]) -> BertConfig:
    """A BertConfig from a Hugging Face config.json (model_type "bert"), our pre-LN export's among them."""
    if not isinstance(values, dict):
        raise InputError(f"{where}: a model config must be a JSON object")
    if "model_type" not in values:
        raise InputError(f"{where}: no 'model_type' key (a Hugging Face BERT config.json has \"model_type\": "
                         f"\"bert\")")
    if values.get("layer_norm_eps", LAYER_NORM_EPS) != LAYER_NORM_EPS:
        raise InputError(f"{where}: layer_norm_eps {values['layer_norm_eps']} (this model uses {LAYER_NORM_EPS})")
    if values.get("layer_norm_large_model") and values["model_type"] in ("bert", OLD_PRE_LN_MODEL_TYPE):
        # Our pre-LN export; transformers' save_pretrained adds keys of its own (transformers_version, dtype,
        # pad_token_id, layer_norm_eps, ...): BertConfig's fields are what describes the model.
        fields = {field.name for field in dataclasses.fields(BertConfig)}
        return BertConfig.from_dict({key: value for key, value in values.items() if key in fields})
    if values["model_type"] != "bert":
        raise InputError(f"{where}: model_type {values['model_type']!r}, not a BERT model")
    if values.get("position_embedding_type", "absolute") != "absolute":
        raise InputError(f"{where}: position_embedding_type {values['position_embedding_type']!r} is not supported")
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
            "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
            "type_vocab_size", "initializer_range")
    return BertConfig.from_dict({key: values[key] for key in keys if key in values})


# ============================================================================ key fix-ups

def fix_state_dict(state: StateDict, config: BertConfig) -> StateDict:
    """Hugging Face names and shapes -> ours: legacy gamma/beta names, a bare BertModel's keys without
    "bert.", the duplicated decoder bias and older transformers' position_ids buffer dropped, the tied decoder
    weight restored, vocabulary rows padded to config.padded_vocab_size."""
    fixed = {}
    for key, value in state.items():
        for old, new in LEGACY_NAME_PARTS:
            if key.endswith(old) and "LayerNorm" in key:
                key = key[: -len(old)] + new
        if key.startswith(("embeddings.", "encoder.", "pooler.")):
            key = f"bert.{key}"
        fixed[key] = value
    for key in TRANSFORMERS_ONLY_KEYS:
        fixed.pop(key, None)
    if "cls.predictions.bias" in fixed and "cls.predictions.decoder.weight" not in fixed:
        # transformers' save_pretrained stores the tied decoder weight once, as the word embedding
        fixed["cls.predictions.decoder.weight"] = fixed["bert.embeddings.word_embeddings.weight"]
    for key in PADDED_ROWS + PADDED_BIAS:
        rows = fixed.get(key)
        if rows is not None and rows.shape[0] == config.vocab_size < config.padded_vocab_size:
            padding = rows.new_zeros((config.padded_vocab_size - rows.shape[0],) + tuple(rows.shape[1:]))
            fixed[key] = torch.cat([rows, padding])
    return fixed


def unpadded_state_dict(state: StateDict, config: BertConfig) -> StateDict:
    """Ours -> Hugging Face's shapes: vocabulary rows cut to config.vocab_size; the decoder's weight and
    bias written under both names, as transformers saves them (safetensors keeps no shared tensors)."""
    out = {key: value.detach().float().contiguous() for key, value in state.items()}
    for key in PADDED_ROWS + PADDED_BIAS[:1]:
        if key in out:
            out[key] = out[key][: config.vocab_size].clone()
    if "cls.predictions.bias" in out:
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()
    return out


# ============================================================================ reading

def is_hf_directory(path: str | os.PathLike[str]) -> bool:
    path = Path(path)
    return (path / "config.json").is_file() and any((path / name).is_file()
                                                    for name in HF_WEIGHT_FILES + HF_INDEX_FILES)


def read_hf_directory(path: str | os.PathLike[str]) -> tuple[BertConfig, StateDict]:
    """(BertConfig, state dict in our names and shapes) of a Hugging Face BERT directory (or of our own
    pre-LN export)."""
    path = Path(path)
    try:
        values = json.loads((path / "config.json").read_text())
        config = from_transformers_config(values, path / "config.json")
    except InputError:  # its line names the file already
        raise
    except (OSError, ValueError) as err:
        raise InputError(f"{path / 'config.json'}: {one_line(err)}") from err
    file = next(path / name for name in HF_WEIGHT_FILES + HF_INDEX_FILES if (path / name).is_file())
    state = read_sharded_state_dict(file, "--init_checkpoint") if file.name in HF_INDEX_FILES \
        else read_state_dict_file(file, "--init_checkpoint")
    return config, fix_state_dict(state, config)


def read_sharded_state_dict(index: Path, flag: str) -> StateDict:
    """The state dict of a sharded Hugging Face save: index's weight_map {key: shard file name}, every key
    read from the shard it names."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError("weight_map is not an object of file names")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InputError(f"{flag}: {index}: {one_line(err) if not isinstance(err, KeyError) else 'no weight_map'}") \
            from err
    state: StateDict = {}
    absent: list[str] = []
    for name in sorted(set(weight_map.values())):
        shard = index.parent / name
        if Path(name).name != name or not shard.is_file():
            raise InputError(f"{flag}: {index} names the shard {name!r}, which is not a file in {index.parent}")
        part = read_state_dict_file(shard, flag)
        absent += [key for key, named in weight_map.items() if named == name and key not in part]
        state.update(part)
    if absent:
        raise InputError(f"{flag}: {index}: {len(absent)} key(s) not in the shard named for them (first: "
                         f"{absent[0]} in {weight_map[absent[0]]})")
    return state


# ============================================================================ export

def export_directory(state: StateDict, config: BertConfig, vocab_file: str | os.PathLike[str], do_lower_case: bool,
                     output_dir: str | os.PathLike[str]) -> bool:
    """Write the directory (atomically: it appears complete or not at all). Returns True when transformers
    can load it with its own BertForPreTraining (post-LN), False for the pre-LN format (remote code)."""
    from safetensors.torch import save_file

    from data.tokenization import load_tokenizer

    tokenizer, vocab_size, _ = load_tokenizer(vocab_file, do_lower_case)
    if vocab_size != config.vocab_size:
        raise InputError(f"--vocab_file {vocab_file} has {vocab_size} tokens, the model config {config.vocab_size}")
    output_dir = Path(output_dir)
    if output_dir.exists():
        raise InputError(f"--output_dir {output_dir} exists; choose a new directory")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(output_dir) as tmp:
        tmp.mkdir()
        if config.layer_norm_large_model:
            model_config = pre_ln_transformers_config(config)
            shutil.copyfile(PRE_LN_MODELING_FILE, tmp / PRE_LN_MODELING_FILE.name)
        else:
            model_config = {"model_type": "bert", "architectures": ["BertForPreTraining"],
                            **to_transformers_config(config, vocab_size=config.vocab_size)}
        write_text_atomically(tmp / "config.json", json.dumps(model_config, indent=2) + "\n")
        weights = tmp / (PRE_LN_WEIGHT_FILE if config.layer_norm_large_model else "model.safetensors")
        save_file(unpadded_state_dict(state, config), str(weights), metadata={"format": "pt"})
        # safetensors creates its file 0600; give it the mode (from the umask) of the files written here.
        weights.chmod((tmp / "config.json").stat().st_mode & 0o777)
        write_tokenizer_files(tokenizer, vocab_file, do_lower_case, config, tmp)
    return not config.layer_norm_large_model


def pre_ln_transformers_config(config: BertConfig) -> dict[str, Any]:
    """config.json of a pre-LN export: our BertConfig, plus what transformers needs to build
    hf_modeling_pre_ln.py's classes."""
    module = PRE_LN_MODELING_FILE.stem
    return {"model_type": "bert", "architectures": ["BertPreLNForPreTraining"],
            "auto_map": {auto: f"{module}.{name}" for auto, name in PRE_LN_AUTO_MAP.items()}, **config.to_dict()}


def write_tokenizer_files(tokenizer: "Tokenizer", vocab_file: str | os.PathLike[str], do_lower_case: bool,
                          config: BertConfig, directory: Path) -> None:
    from tokenizers import decoders, processors

    from data.tokenization import special_token_id

    shutil.copyfile(vocab_file, directory / "vocab.txt")
    cls_id, sep_id = special_token_id(tokenizer, "[CLS]"), special_token_id(tokenizer, "[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.save(str(directory / "tokenizer.json"))
    special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
               "mask_token": "[MASK]"}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    tokenizer_config = {"tokenizer_class": "BertTokenizer", "do_lower_case": do_lower_case,
                        "strip_accents": None, "tokenize_chinese_chars": True,
                        "model_max_length": config.max_position_embeddings, **special}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# ============================================================================ any weight source

ARCHITECTURE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                     "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_large_model")


def read_pretrained_weights(source: str | os.PathLike[str], config_file: str | os.PathLike[str] | None = None,
                            flag: str = "--init_checkpoint") -> tuple[BertConfig, StateDict]:
    """(BertConfig, weights in our names and shapes) from a run_pretraining.py output or tag directory (any
    ZeRO stage and world size, consolidated), a Hugging Face directory, or a state-dict file (the export of
    training/checkpoint_export.py; it records no config, so config_file is needed). With config_file, the model is that
    config (its dropout may differ) and the source must have its architecture."""
    from training import checkpointing

    source = Path(source)
    recorded: BertConfig | None = None
    if not source.exists():
        raise InputError(f"{flag} {source} does not exist")
    if is_hf_directory(source):
        recorded, weights = read_hf_directory(source)
    elif source.is_dir():
        output_dir, tag = (source.parent, source.name) if (source / checkpointing.MANIFEST_NAME).exists() \
            else (source, None)
        try:
            model_config, weights = checkpoint_export.consolidated_checkpoint(output_dir, tag)
        except checkpointing.CheckpointError as err:
            raise InputError(f"{flag} {source}: {err}") from err
        recorded = BertConfig.from_dict(model_config)
    else:
        weights = read_state_dict_file(source, flag)
    config = recorded if config_file is None else read_config_file(config_file)
    if config is None:
        raise InputError(f"{flag} {source} records no model config: pass --config_file")
    if recorded is not None:
        differences = [f"{key} {getattr(recorded, key)} there, {getattr(config, key)} in --config_file"
                       for key in ARCHITECTURE_KEYS if getattr(recorded, key) != getattr(config, key)]
        if differences:
            raise InputError(f"{flag} {source} is for another model config: {'; '.join(differences)}")
    return config, fix_state_dict(weights, config)


def read_config_file(path: str | os.PathLike[str]) -> BertConfig:
    try:
        return BertConfig.from_json_file(path)
    except (OSError, ValueError) as err:
        raise InputError(f"--config_file {path}: {one_line(err)}") from err


def read_state_dict_file(path: Path, flag: str) -> StateDict:
    loaded: object  # checked below
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            loaded = load_file(str(path))
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors raises its own SafetensorError, torch several kinds
        raise InputError(f"{flag}: cannot read {path} ({one_line(err)})") from err
    state = loaded.get("module", loaded) if isinstance(loaded, dict) else loaded
    if not isinstance(state, dict) or not all(torch.is_tensor(value) for value in state.values()):
        raise InputError(f"{flag}: {path} holds no state dict")
    return state


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export BERT weights as a Hugging Face directory.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="checkpoint -> config.json, model.safetensors, tokenizer files")
    export.add_argument("--checkpoint", required=True, help="run_pretraining.py output or tag directory, "
                        "a `python -m training.checkpointing export` file, or a Hugging Face directory")
    export.add_argument("--config_file", default=None, help="model config JSON (needed unless the checkpoint "
                        "records it: DeepSpeed checkpoints and Hugging Face directories do)")
    export.add_argument("--vocab_file", default="data/vocab.txt", help="vocab.txt of the model")
    export.add_argument("--do_lower_case", action="store_true", help="the vocab is uncased")
    export.add_argument("--output_dir", required=True, help="new directory to write")
    args = parser.parse_args(argv)
    checkpoint_export.read_on_the_cpu()
    try:
        config, weights = read_pretrained_weights(args.checkpoint, args.config_file, flag="--checkpoint")
        loadable = export_directory(weights, config, args.vocab_file, args.do_lower_case, args.output_dir)
    except (InputError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if loadable:
        print(f"wrote {args.output_dir}: transformers.BertForPreTraining.from_pretrained loads it")
    else:
        print(f"wrote {args.output_dir}: pre-LN wiring; transformers loads the model with trust_remote_code=True "
              "(AutoModelForPreTraining, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification, "
              "AutoModelForQuestionAnswering, pipeline) and the tokenizer with AutoTokenizer; run_glue.py / "
              "run_squad.py (--init_checkpoint) read it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
