"""A tokenizer and chat template as a GGUF's `tokenizer.*` keys, the way llama.cpp's converter writes a
byte-level BPE vocabulary (its `gpt2` tokenizer model): every token in id order, each token's type
(normal, control for the special tokens, user-defined for the other added ones, unused for the ids past
the tokenizer that the embedding still has), the merges as "left right" strings, the bos/eos/pad/unk
ids, and `tokenizer.chat_template`.

The tiny models' byte tokenizer (demo/byte_tokenizer.py) has no merges: its `tokenizer.ggml.merges` is
an empty array, which llama.cpp's BPE loader accepts (it requires the key, not entries).
core/gguf_model.py reads these keys back into the same tokenizer.
"""

from __future__ import annotations

import json
from typing import Any

from ..models.llama_cpp_keys import ALWAYS_ENDING

PRE_TOKENIZER = "qwen2"  # llama.cpp's name for the byte-level pre-tokenizer regex Qwen2Tokenizer applies




def vocabulary_keys(tokenizer: Any, vocab_size: int, chat_template: str | None,
                    end_ids: list[int] | None = None) -> dict[str, Any]:
    """`tokenizer.*` keys for a byte-level BPE tokenizer (a transformers tokenizer over a `tokenizers`
    BPE model) padded to `vocab_size` ids; a ValueError naming the tokenizer where it is another kind.
    `end_ids` (the generation config's end tokens): those llama.cpp would not stop at by itself (not
    the eos, not in ALWAYS_ENDING) are written as its eot and eom ids, the two more it reads."""
    from gguf import Keys, TokenType

    backend = json.loads(tokenizer.backend_tokenizer.to_str()) if hasattr(tokenizer, "backend_tokenizer") else {}
    model = backend.get("model") or {}
    if model.get("type") != "BPE":
        raise ValueError(f"{type(tokenizer).__name__}: only byte-level BPE tokenizers are written as a GGUF "
                         f"vocabulary (its model is {model.get('type', 'not a tokenizers one')})")
    if _split_pattern(backend.get("pre_tokenizer")) != _qwen2_pattern():
        raise ValueError(f"{type(tokenizer).__name__}: its pre-tokenizer is not Qwen2's byte-level split, the one "
                         f"this writer names ({PRE_TOKENIZER!r}); llama.cpp names the others by their own tables")
    added = tokenizer.added_tokens_decoder
    if len(tokenizer) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, more than the model's vocab_size {vocab_size}")
    tokens, types = [], []
    for index in range(vocab_size):
        token = tokenizer.convert_ids_to_tokens(index) if index < len(tokenizer) else None
        if token is None:
            tokens.append(f"[PAD{index}]")  # llama.cpp's converter's name for ids the tokenizer does not have
            types.append(int(TokenType.UNUSED))
        else:
            tokens.append(token)
            types.append(int(TokenType.NORMAL if index not in added else
                              TokenType.CONTROL if added[index].special else TokenType.USER_DEFINED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {Keys.Tokenizer.BOS_ID: tokenizer.bos_token_id, Keys.Tokenizer.EOS_ID: tokenizer.eos_token_id,
           Keys.Tokenizer.PAD_ID: tokenizer.pad_token_id, Keys.Tokenizer.UNK_ID: tokenizer.unk_token_id}
    extra = [i for i in (end_ids or []) if i != tokenizer.eos_token_id
             and tokenizer.convert_ids_to_tokens(i) not in ALWAYS_ENDING]
    if len(extra) > 2:
        raise ValueError(f"end tokens {extra}: llama.cpp's GGUF keys name two besides the eos (eot, eom)")
    ids.update(zip((Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID), extra))
    keys = {Keys.Tokenizer.MODEL: "gpt2", Keys.Tokenizer.PRE: PRE_TOKENIZER, Keys.Tokenizer.LIST: tokens,
            Keys.Tokenizer.TOKEN_TYPE: types, Keys.Tokenizer.MERGES: merges,
            **{key: int(value) for key, value in ids.items() if value is not None},
            Keys.Tokenizer.ADD_BOS: bool(getattr(tokenizer, "add_bos_token", False))}
    if chat_template:
        keys[Keys.Tokenizer.CHAT_TEMPLATE] = chat_template
    return keys


def _split_pattern(pre: dict | None) -> str | None:
    """The regex of a `tokenizers` pre-tokenizer's Split step (a Sequence's first such step)."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    for step in steps:
        if step and step.get("type") == "Split":
            return (step.get("pattern") or {}).get("Regex")
    return None


def _qwen2_pattern() -> str:
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return PRETOKENIZE_REGEX
