"""BaseInjectedModule: the constructor contract and attribute forwarding every operator shares.

An operator replaces one submodule of a Hugging Face model. It keeps the module it replaced as the
registered child `orig_module` (so rules may keep injecting into that module's children, as in
KTransformers), and it knows its checkpoint key, its loader, the model config and its devices.

Attribute forwarding is explicit. HF code reads a few attributes of the modules it calls (e.g. the
multimodal model reads `language_model.embed_tokens`, the vision path reads `visual.dtype`); each
class lists the names it forwards to `orig_module` in `forwarded_attributes`, and anything else is an
AttributeError that says what is forwarded. (Upstream forwards every unknown name through bare
excepts, which turns typos into silent reads of the wrong module.)

If upstream KTransformers' framework is importable, our base class derives from its
BaseInjectedModule and calls its `__init__`, so its `inject`/`load_weights` accept our operators and
call their `load()`; without it, the same constructor signature and `load()` contract hold (a test
drives our operators through a copy of upstream's loop).

Operators are thin: each turns its rule kwargs into a settings dataclass (`settings_from`, checks in
`__post_init__`) and calls the runtime, engine or balancing code that does the work.
"""

from __future__ import annotations

import functools
from dataclasses import fields
from typing import Any, TypeVar

import torch
from cpu_kernels import ggml_types
from torch import nn

from ..core.context import context_of
from ..models import ModelAdapter, adapter_for


def _upstream_base() -> type | None:
    try:  # present only where the upstream framework (archive/ of ktransformers) is installed
        from ktransformers.operators.base_operator import BaseInjectedModule as Upstream
    except Exception:
        return None
    return Upstream


UPSTREAM = _upstream_base()
T = TypeVar("T")


def stored_gguf_experts(loader: Any, key: str, names: tuple[str, str]) -> tuple | None:
    """(gate, up, down) of a GGUF's quantized experts as stored ((bytes, ggml type) each) for a CPU
    backend that computes them so (kt-kernel's llamafile kernels); None when the loader is not
    reading GGUF, the experts are not all there, or they are not quantized."""
    raw = getattr(loader, "raw_tensors", None)
    if raw is None:
        return None
    gate_up, down = raw(f"{key}.{names[0]}"), raw(f"{key}.{names[1]}")
    if not gate_up or not down or len(gate_up) != 2 or len(down) != 1:
        return None
    if all(kind in ggml_types.UNQUANTIZED for _, kind in gate_up + down):  # nothing to gain
        return None
    return gate_up[0], gate_up[1], down[0]


def gguf_expert_format(loader: Any, key: str, names: tuple[str, str]) -> str | None:
    """The host store format (runtime/store.py) a GGUF's experts under `key` are in, where the store can
    keep them as stored (gate and up of one type among q8_0, q4_0, q4_k, q5_k); None otherwise, or
    when the loader is not reading GGUF. Reads the file's header only."""
    gguf_names, tensor_type = getattr(loader, "gguf_names", None), getattr(loader, "tensor_type", None)
    if gguf_names is None or tensor_type is None:
        return None
    sources = gguf_names(f"{key}.{names[0]}")
    try:
        kinds = {tensor_type(name).lower() for name in sources or ()}
    except KeyError:  # not in the file: read from elsewhere
        return None
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind if kind in ggml_types.STORE_FORMATS else None


def gguf_down_formats(loader: Any, adapter: ModelAdapter, layers: list[int]) -> dict[int, str]:
    """The store format (ggml_types.PART_FORMATS) of each of `layers`' down experts in a GGUF, from the
    file's header (a Q4_K_M file keeps some layers' in Q6_K); empty when the loader is not reading GGUF
    or the family cannot name its expert tensors."""
    gguf_names, tensor_type = getattr(loader, "gguf_names", None), getattr(loader, "tensor_type", None)
    if gguf_names is None or tensor_type is None:
        return {}
    formats = {}
    for layer in layers:
        key = adapter.experts_key(layer)
        names = gguf_names(f"{key}.{adapter.expert_tensors[1]}") if key is not None else None
        try:
            kinds = {tensor_type(name).lower() for name in names or ()}
        except KeyError:  # not in the file
            continue
        if len(kinds) == 1 and (kind := kinds.pop()) in ggml_types.PART_FORMATS:
            formats[layer] = kind
    return formats


def settings_from(cls: type[T], kwargs: dict[str, Any], operator: str) -> T:
    """An operator's settings dataclass from its rule kwargs: `cls(**kwargs)`, whose `__post_init__`
    checks the values; an unknown kwarg is named beside the known ones (a ValueError the rule engine
    reports with the rule's file and index)."""
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ValueError(f"{operator} has no kwarg {', '.join(map(repr, unknown))}; its kwargs: {', '.join(known)}")
    return cls(**kwargs)


# Names Hugging Face modelling code reads on modules it calls, by the kind of module replaced:
# text model (embed_tokens, layers, norm, rotary_emb, get_input_embeddings, which the multimodal
# model calls on its language model), vision tower (dtype, spatial_merge_size,
# deepstack_visual_indexes), attention (layer_idx, head_dim, is_causal), decoder layer
# (attention_type), MoE block/experts/router (num_experts, top_k, hidden_dim, intermediate_dim).
HF_READ_ATTRIBUTES = (
    "embed_tokens", "layers", "norm", "rotary_emb", "has_sliding_layers",
    "get_input_embeddings", "set_input_embeddings",
    "dtype", "spatial_merge_size", "deepstack_visual_indexes", "patch_size",
    "layer_idx", "head_dim", "is_causal", "num_key_value_groups", "scaling",
    "attention_type", "num_experts", "top_k", "hidden_dim", "intermediate_dim",
)


class BaseInjectedModule(UPSTREAM or nn.Module):
    """Pass-through operator: runs `orig_module` unchanged. Subclasses override `forward`.

    `self.context` is the load's LoadContext (made on the loader when it has none: KTransformers'
    loaders work too) and `self.adapter` the model family's adapter."""

    forwarded_attributes: tuple[str, ...] = HF_READ_ATTRIBUTES
    is_injected_operator = True  # duck-typed marker for the weight loader (avoids an import cycle)

    def __init__(
        self,
        key: str,
        gguf_loader: Any,
        config: Any,
        orig_module: nn.Module,
        prefill_device: str = "cuda",
        generate_device: str = "cuda",
        **kwargs: Any,
    ):
        if kwargs:
            raise TypeError(f"unexpected kwargs {sorted(kwargs)}")
        if UPSTREAM is not None:  # its own bookkeeping (key, devices, orig_module as a child)
            UPSTREAM.__init__(self, key, gguf_loader, config, orig_module, prefill_device, generate_device)
        else:
            nn.Module.__init__(self)
        self.orig_module = orig_module
        self.key = key
        self.gguf_loader = gguf_loader
        self.config = config
        self.prefill_device = str(prefill_device)
        self.generate_device = str(generate_device)
        self.context = context_of(gguf_loader)

    # nn.Module.__getattr__ runs only when normal lookup failed; we add the explicit forwarding.
    def __getattr__(self, name: str) -> Any:
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            pass
        if name in type(self).forwarded_attributes:
            return getattr(nn.Module.__getattr__(self, "orig_module"), name)
        raise AttributeError(
            f"{type(self).__name__} (replacing {self.__dict__.get('key', '?')!r}) has no attribute {name!r}; "
            f"it forwards only {', '.join(type(self).forwarded_attributes)} to the module it replaced"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        nn.Module.__setattr__(self, name, value)

    @functools.cached_property
    def adapter(self) -> ModelAdapter:
        """The model family's adapter (looked up when first needed: pass-through operators need none)."""
        return adapter_for(getattr(self.config, "model_type", None), where=f"operator {self.key!r}")

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype the model computes in: the loader's conversion where one was asked for, else the
        config's, else torch's default. Not the replaced module's parameters: rules inject into a model
        built on the meta device, whose parameters have torch's default dtype (float32) whatever the
        checkpoint's (a BF16 model's layerwise prefill once built its bank in float32 that way)."""
        text = self.adapter.text_config(self.config)
        dtype = getattr(self.gguf_loader, "dtype", None) or getattr(text, "dtype", None) \
            or getattr(self.config, "dtype", None) or torch.float32
        return getattr(torch, dtype) if isinstance(dtype, str) else dtype

    @property
    def weights_device(self) -> torch.device:
        """Where this operator's weights live; operators that keep them elsewhere override it."""
        return torch.device(self.generate_device)

    def load(self) -> None:
        """Fill this operator's weights from `gguf_loader` (ours, or upstream's safetensors loader)."""
        from ..core.weights import load_module_tree

        load_module_tree(self, self.gguf_loader, self.key, self.weights_device, operator_root=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.orig_module(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"key={self.key!r}, prefill_device={self.prefill_device}, generate_device={self.generate_device}"
