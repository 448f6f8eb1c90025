"""The tiny models' tokenizer: byte-level BPE with no merges, so every family's tiny model reads any text
offline (one token per byte) with its family's special tokens on top."""

from __future__ import annotations


def byte_level_tokenizer(special_tokens: tuple[str, ...] | list[str], *, eos: str, pad: str, bos: str | None = None,
                         named: int = 1):
    """A `Qwen2Tokenizer` over the 256 byte characters then `special_tokens` (ids 256, 257, ...);
    `special_tokens[named:]` become its additional special tokens (the first `named` are the eos/bos/pad
    ones, registered by name), `pad` doubles as the unknown token."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()  # byte -> printable char, the byte-level BPE alphabet
    vocab = {byte_chars[b]: b for b in range(256)}
    for token in special_tokens:
        vocab[token] = len(vocab)
    names = {"bos_token": bos} if bos is not None else {}
    return Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=eos, pad_token=pad, unk_token=pad, **names,
                          additional_special_tokens=list(special_tokens[named:]))
