"""Initial weights (--init_checkpoint, fine-tuning's --init_checkpoint): loading a checkpoint tag directory or a
state-dict file into a model, with one error line when they are unreadable or do not fit it."""

import pickle
import re
import struct
from pathlib import Path

import torch

from common.errors import InputError, one_line
from modeling import TRANSFORMERS_ONLY_KEYS, BertPreTrainedModel

INIT_WEIGHT_SOURCES = ("it should be a checkpoint tag directory (holding mp_rank_00_model_states.pt) or a "
                       "state-dict file written by torch.save (ours, `python -m training.checkpointing export`'s, "
                       "or transformers' BertForPreTraining)")
# torch.load(weights_only=True) meets a file that is no torch file (text, random bytes) with whatever its
# parser trips on: besides its own errors, an IndexError ("pop from empty list"), KeyError, struct.error...
UNREADABLE_TORCH_FILE = (OSError, EOFError, RuntimeError, pickle.UnpicklingError, IndexError, KeyError, ValueError,
                         TypeError, AttributeError, struct.error)


def torch_load_reason(err: Exception) -> str:
    """torch.load's error as one short line, without its advice to load with weights_only=False (which
    runs arbitrary code) or to allow-list globals."""
    text = str(err)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation of torch.load", 1)[0]
        text = text.split("Please use `torch.serialization", 1)[0]
    text = one_line(text, limit=200)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def load_init_weights(model: BertPreTrainedModel, path: str | Path, flag: str = "--init_checkpoint") -> None:
    """Module weights from a DeepSpeed checkpoint tag directory, or from a state-dict file (ours, the
    export of training/checkpoint_export.py, or Hugging Face's BertForPreTraining for a post-LN config)."""
    path = Path(path)
    file = path / "mp_rank_00_model_states.pt" if path.is_dir() else path
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except UNREADABLE_TORCH_FILE as err:
        raise InputError(f"{flag} {path}: cannot read {file} as weights; {INIT_WEIGHT_SOURCES} "
                         f"(torch: {torch_load_reason(err)})") from err
    state = state.get("module", state) if isinstance(state, dict) else state
    if not isinstance(state, dict) or not all(torch.is_tensor(value) for value in state.values()):
        raise InputError(f"{flag} {path}: {file} holds no state dict of tensors; {INIT_WEIGHT_SOURCES}")
    for key in TRANSFORMERS_ONLY_KEYS:
        state.pop(key, None)
    config = model.config
    fits = (f"{flag} {file} does not fit the model config (hidden {config.hidden_size}, "
            f"{config.num_hidden_layers} layers, padded vocab {config.padded_vocab_size})")
    misfit = describe_misfit(model.state_dict(), state)
    if misfit:
        raise InputError(f"{fits}: {misfit}")
    try:
        model.load_state_dict({key: value.float() for key, value in state.items()})
    except RuntimeError as err:  # what describe_misfit does not look at
        raise InputError(f"{fits}: {one_line(err)}") from err


ENCODER_LAYER_KEY = re.compile(r"^bert\.encoder\.layer\.(\d+)\.")
WORD_EMBEDDINGS_KEY = "bert.embeddings.word_embeddings.weight"


def describe_misfit(own: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> str:
    """How the tensors `saved` differ from a model's state dict `own` ("" when they fit), in one line that
    says which config they are for: the checkpoint's hidden size (from its word embeddings) and layer
    count, then the tensors of another shape, the missing and the unexpected keys, each with its count and
    the first one (own's order, then saved's)."""
    other_shape = [key for key in own if key in saved and tuple(saved[key].shape) != tuple(own[key].shape)]
    missing = [key for key in own if key not in saved]
    unexpected = [key for key in saved if key not in own]
    if not (other_shape or missing or unexpected):
        return ""
    parts = []
    if WORD_EMBEDDINGS_KEY in saved and saved[WORD_EMBEDDINGS_KEY].dim() == 2:
        layers = len({int(match.group(1)) for match in map(ENCODER_LAYER_KEY.match, saved) if match})
        parts.append(f"the checkpoint has hidden {saved[WORD_EMBEDDINGS_KEY].shape[1]}, {layers} "
                     f"layer{'' if layers == 1 else 's'}, "
                     f"{saved[WORD_EMBEDDINGS_KEY].shape[0]} vocabulary rows")
    if other_shape:
        first = other_shape[0]
        parts.append(f"{len(other_shape)} tensors of another shape (first {first}: "
                     f"{list(saved[first].shape)} in the checkpoint, {list(own[first].shape)} in the model)")
    if missing:
        parts.append(f"{len(missing)} missing keys (first {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected keys (first {unexpected[0]})")
    return "; ".join(parts)
