"""BERT WordPiece tokenization of a vocab.txt with Hugging Face `tokenizers`: one definition for the
pretraining data tool and the fine-tuning readers (finetune/glue.py, finetune/squad.py)."""
import os
from pathlib import Path
from typing import TYPE_CHECKING

from common.errors import InputError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

SPECIAL_TOKENS = ("[CLS]", "[SEP]", "[MASK]")


def load_tokenizer(vocab_file: str | os.PathLike[str], do_lower_case: bool,
                   plain_ascii: bool = False) -> tuple["Tokenizer", int, dict[str, int]]:
    """Return (tokenizer, vocab_size, {special token: id}) for a BERT vocab.txt.

    plain_ascii: a faster tokenizer without normalizer, for printable ASCII text that the caller
    has lower-cased (if do_lower_case): on such text the rest of BERT's normalisation (control
    characters, whitespace, accents, CJK spacing) is a no-op, so the tokens are the full one's.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordPiece

    if not Path(vocab_file).is_file():
        raise InputError(f"vocab file not found: {vocab_file}")
    try:
        vocab = WordPiece.read_file(str(vocab_file))
    except Exception as err:  # tokenizers raises a bare Exception on an unreadable vocab
        raise InputError(f"cannot read vocab file {vocab_file}: {err}") from err
    if "[UNK]" not in vocab:
        raise InputError(f"vocab file {vocab_file} lacks [UNK]")
    # BERT's BasicTokenizer (clean, CJK split, lower-case + strip accents, punctuation split) + WordPiece.
    tokenizer = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    if not plain_ascii:
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=do_lower_case, strip_accents=do_lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    special = {token: token_id for token, token_id in ids.items() if token_id is not None}
    missing = [token for token in SPECIAL_TOKENS if token not in special]
    if missing:
        raise InputError(f"vocab file {vocab_file} lacks {', '.join(missing)}")
    return tokenizer, tokenizer.get_vocab_size(), special


def special_token_id(tokenizer: "Tokenizer", token: str) -> int:
    """The id of a special token (one of SPECIAL_TOKENS, which load_tokenizer checks the vocab has)."""
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise InputError(f"the vocab lacks {token}")
    return token_id
