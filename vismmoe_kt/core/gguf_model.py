"""A model from GGUF files alone (`--gguf_path FILE --mmproj_path FILE`, no `--model_path`): the config,
tokenizer, chat template and image processor that a Hugging Face directory would hold, rebuilt from the
files' metadata, as llama.cpp loads such a pair.

- the family: the text file's `general.architecture`, llama.cpp's name (`ModelAdapter.llama_cpp_arch`);
- the config: the family's adapter inverts what it writes (`ModelAdapter.config_from_gguf`: the
  `<arch>.*` hyperparameters, the mmproj's `clip.*` keys, and what only the tensors' shapes say);
- the tokenizer: `tokenizer.ggml.*` (llama.cpp's `gpt2` model: a byte-level BPE vocabulary with its
  merges, the control tokens special), rebuilt as transformers' Qwen2Tokenizer, the class every
  byte-level BPE of these families loads as; the chat template: `tokenizer.chat_template`;
- the image processor: the mmproj's `clip.*` keys (`ModelAdapter.processor_from_gguf`);
- the generation config's end tokens: llama.cpp's end-of-generation set (the eos, eot and eom ids and
  the control tokens it always treats as ends, `<|endoftext|>`, `<|im_end|>`, ...).

These are written once as an ordinary directory in the cache (keyed by the files' paths, sizes and
times; named as the model file, which serve calls the model), which the loader then reads as it reads
`--model_path` (the weights from the GGUF files), so serve, eval and the placements see a model
directory as ever. A file without what a piece needs is a
LoadError that names the key or tensor missing and the family; a family whose pair cannot be its model
(`ModelAdapter.llama_cpp_gap`: ERNIE-4.5-VL, DeepSeek-OCR-2) one that says what llama.cpp, or
this project, lacks for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import LoadError
from ..models import REGISTRY, ModelAdapter, adapter_for
from ..models.llama_cpp_keys import LLAMA_CPP_END_TEXTS, LLAMA_CPP_FIM_ENDING
from .gguf_checkpoint import gguf_files

FORMAT_VERSION = 3  # bump when what is rebuilt changes, so cached directories are rebuilt


@dataclass
class GgufMetadata:
    """One GGUF file's key-value metadata and tensor shapes (numpy order, outermost first)."""
    path: Path
    values: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def need(self, key: str, family: str) -> Any:
        """The value of `key`; a LoadError naming the family and the key where the file lacks it."""
        if key not in self.values:
            raise LoadError(f"{self.path}: {family}: the GGUF has no {key} key, which its config needs")
        return self.values[key]

    def shape(self, name: str, family: str) -> tuple[int, ...]:
        if name not in self.shapes:
            raise LoadError(f"{self.path}: {family}: the GGUF has no tensor {name}, whose shape its config needs")
        return self.shapes[name]


def read_metadata(path: Path) -> GgufMetadata:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path), "r")
    except Exception as exc:  # the gguf package raises ValueError/struct errors on bad or short files
        raise LoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    values = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    return GgufMetadata(path, values, shapes)


@dataclass
class GgufPair:
    """The text file(s) of a model (a split's tensors merged, its first file's keys) and its mmproj file."""
    text: GgufMetadata
    mmproj: GgufMetadata | None


def read_pair(gguf_path: str | Path, mmproj_path: str | Path | None) -> GgufPair:
    files = gguf_files(gguf_path)
    text = read_metadata(files[0])
    for other in files[1:]:
        text.shapes.update(read_metadata(other).shapes)
    mmproj = None
    if mmproj_path is not None:
        if not Path(mmproj_path).is_file():
            raise LoadError(f"--mmproj_path {mmproj_path}: no such file")
        mmproj = read_metadata(Path(mmproj_path))
    return GgufPair(text, mmproj)


def adapter_for_arch(pair: GgufPair) -> ModelAdapter:
    """The family whose llama.cpp architecture the text file names."""
    arch = pair.text.get("general.architecture")
    known = {}
    for model_type in REGISTRY:
        adapter = adapter_for(model_type)
        if adapter.llama_cpp_arch:
            known[adapter.llama_cpp_arch] = adapter
    if arch not in known:
        raise LoadError(f"{pair.text.path}: general.architecture = {arch!r} is none of the families this loader "
                        f"rebuilds from GGUF alone ({', '.join(sorted(known))}); pass --model_path DIR with its "
                        f"config, tokenizer and processor")
    return known[arch]


def tokenizer_from_gguf(meta: GgufMetadata, family: str) -> Any:
    """`tokenizer.ggml.*` as a Qwen2Tokenizer: the tokens in id order, the merges, the control tokens special
    (the bos/eos/pad/unk ones by name), the user-defined ones added as plain tokens."""
    from gguf import TokenType
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    model, pre = meta.need("tokenizer.ggml.model", family), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre != "qwen2":
        raise LoadError(f"{meta.path}: {family}: the GGUF's tokenizer is tokenizer.ggml.model = {model!r} with "
                        f"pre = {pre!r}; this loader rebuilds byte-level BPE with Qwen2's pre-tokenizer "
                        f"(model 'gpt2', pre 'qwen2') only: pass --model_path DIR for the tokenizer")
    tokens = list(meta.need("tokenizer.ggml.tokens", family))
    types = list(meta.get("tokenizer.ggml.token_type", [int(TokenType.NORMAL)] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.need("tokenizer.ggml.merges", family)]
    used = [i for i, kind in enumerate(types) if kind != TokenType.UNUSED]
    vocab = {tokens[i]: i for i in used if types[i] not in (TokenType.CONTROL, TokenType.USER_DEFINED)}
    added = [i for i in used if types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)]
    if added != list(range(len(vocab), len(vocab) + len(added))):
        raise LoadError(f"{meta.path}: {family}: the added tokens' ids {added[:5]}... do not follow the "
                        f"{len(vocab)} ordinary ones; this loader rebuilds vocabularies whose added tokens come last")
    vocab.update({tokens[i]: i for i in added})
    named = {}
    for name, key in (("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
                      ("unk_token", "unknown_token_id"), ("bos_token", "bos_token_id")):
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None:
            named[name] = tokens[int(index)]
    specials = [tokens[i] for i in added if types[i] == TokenType.CONTROL and tokens[i] not in named.values()]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, **{"bos_token": None, **named},
                               additional_special_tokens=specials)
    plain = [AddedToken(tokens[i], special=False, normalized=False) for i in added if types[i] == TokenType.USER_DEFINED]
    if plain:
        tokenizer.add_tokens(plain)
    return tokenizer


def end_token_ids(meta: GgufMetadata, tokenizer: Any) -> list[int]:
    """llama.cpp's end-of-generation tokens: the eos, eot and eom ids, its end texts, and the fill-in-the-middle
    pad, repository and separator tokens (each its key's id, else its text in the vocabulary: a vocabulary has one)."""
    ids = [int(meta.get(key)) for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                                          "tokenizer.ggml.eom_token_id") if meta.get(key) is not None]
    vocab = tokenizer.get_vocab()
    ids += [vocab[token] for token in LLAMA_CPP_END_TEXTS if token in vocab]
    for key, texts in LLAMA_CPP_FIM_ENDING.items():
        keyed = meta.get(key)
        ids += [int(keyed)] if keyed is not None else [vocab[text] for text in texts if text in vocab][:1]
    return list(dict.fromkeys(ids))


def _cache_dir(pair: GgufPair) -> Path:
    files = [pair.text.path, *([pair.mmproj.path] if pair.mmproj else [])]
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files] + [FORMAT_VERSION])
    root = Path(os.environ.get("VISMMOE_KT_CACHE") or Path.home() / ".cache" / "vismmoe-kt")
    # the directory is named as the model file (serve names the model after it), in a folder of its own
    return root / "gguf-models" / hashlib.sha256(stamp.encode()).hexdigest()[:16] / pair.text.path.stem


def model_dir_from_gguf(gguf_path: str | Path, mmproj_path: str | Path | None) -> Path:
    """The model directory (config, tokenizer, chat template, processor, generation config; no weights) that
    the GGUF pair describes, rebuilt once into the cache; `load(dir, gguf_path=..., mmproj_path=...)` reads it."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise LoadError("--gguf_path needs the gguf package (pip install gguf==0.19.0)") from None
    pair = read_pair(gguf_path, mmproj_path)
    adapter = adapter_for_arch(pair)
    family = f"{'/'.join(adapter.model_types)} (llama.cpp's {adapter.llama_cpp_arch})"
    if adapter.llama_cpp_gap:  # a family whose pair cannot be its model: say what llama.cpp or we lack
        raise LoadError(f"--gguf_path {gguf_path} without --model_path: general.architecture = "
                        f"{adapter.llama_cpp_arch!r} stands for {'/'.join(adapter.model_types)} here; "
                        f"{adapter.llama_cpp_gap}")
    if pair.mmproj is None:
        raise LoadError(f"--gguf_path {gguf_path} without --model_path: {family} needs its vision tower's file "
                        f"too (--mmproj_path FILE, llama.cpp's mmproj GGUF), whose clip.* keys give the vision config")
    target = _cache_dir(pair)
    if (target / ".complete").exists():
        return target
    tokenizer = tokenizer_from_gguf(pair.text, family)
    config = adapter.config_from_gguf(pair.text, pair.mmproj, tokenizer)
    template = pair.text.get("tokenizer.chat_template")
    if template is None:
        raise LoadError(f"{pair.text.path}: {family}: the GGUF has no tokenizer.chat_template key; chat needs one")
    processor = adapter.processor_from_gguf(pair.mmproj, tokenizer, template, family)
    from transformers import GenerationConfig

    import shutil

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.staging-", dir=target.parent))
    except OSError as exc:
        raise LoadError(f"cannot write the model's rebuilt directory under {target.parent} ({exc.strerror or exc}); "
                        f"set VISMMOE_KT_CACHE to a writable folder") from None
    config.save_pretrained(str(staging))
    processor.save_pretrained(str(staging))
    pad = pair.text.get("tokenizer.ggml.padding_token_id")
    GenerationConfig(eos_token_id=end_token_ids(pair.text, tokenizer),
                     pad_token_id=int(pad) if pad is not None else None).save_pretrained(str(staging))
    (staging / ".complete").write_text("ok\n")
    if target.exists() and not (target / ".complete").exists():  # an interrupted earlier build
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.replace(staging, target)  # atomic: readers never see a half-written directory
    except OSError:  # another process finished the same directory first: theirs is as good
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / ".complete").exists():
            raise LoadError(f"cannot write the model's rebuilt directory {target}") from None
    return target
