"""Materialising a meta-device module tree from a checkpoint, module by module.

Every parameter and persistent buffer that is still on the meta device is read from the reader by
its checkpoint name (the dotted module path without the `orig_module` segments operators add), and
so is a persistent buffer built real (in its own dtype) where the reader holds it (`load_buffer`), each
placed on the device of its module: the plan's `generate_device` for that module if it has one, else
its parent's. An operator decides for its own subtree through its `load()` (by default: its
`weights_device`). Tied parameters (one Parameter object under two names) are read once.

The reader needs only `load_tensor(name, device)`, the method KTransformers' safetensors loader has,
so operators loaded by upstream's `load_weights` work too (and `load_gguf_tensor`, its GGUFLoader's,
where an operator passes its adapter's GGUF names to `read_tensor`); our CheckpointReader adds the
plan's devices (`planned_device`) and the family's checkpoint layout (`layout_fix`, `sources`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import LoadError

ORIG = "orig_module"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def load_module_tree(
    module: nn.Module,
    reader,
    key: str,
    device: torch.device | str,
    *,
    operator_root: bool = False,
    loaded: dict[int, torch.Tensor] | None = None,
) -> None:
    """Load `module` (checkpoint prefix `key`) and its children onto `device` unless the plan says otherwise."""
    if getattr(module, "is_injected_operator", False) and not operator_root:
        module.load()
        return
    loaded = {} if loaded is None else loaded
    device = torch.device(device)
    _load_own_tensors(module, reader, key, device, loaded)
    for name, child in module._modules.items():
        if child is None:
            continue
        if name == ORIG:  # the replaced module shares its operator's key and device
            load_module_tree(child, reader, key, device, loaded=loaded)
        else:
            child_key = _join(key, name)
            planned = getattr(reader, "planned_device", None)
            child_device = planned(child_key, device) if planned else device
            load_module_tree(child, reader, child_key, child_device, loaded=loaded)


def read_tensor(reader, name: str, device: torch.device, shape: torch.Size, gguf_names=None) -> torch.Tensor:
    """Read `name` and bring it to `shape` with the reader's layout fix; a mismatch is a LoadError.
    `gguf_names` (the adapter's): how to find the tensor in KTransformers' own GGUFLoader, which
    reads by GGUF name (`load_gguf_tensor`) and has no `load_tensor`."""
    if not hasattr(reader, "load_tensor") and hasattr(reader, "load_gguf_tensor"):
        tensor = _from_upstream_gguf(reader, name, device, gguf_names)
    else:
        tensor = reader.load_tensor(name, device)
    if tensor.shape != shape:
        fix = getattr(reader, "layout_fix", None)
        tensor = fix(name, tensor, shape) if fix else tensor
    if tensor.shape != shape:
        where = reader.describe(name) if hasattr(reader, "describe") else f"tensor {name!r}"
        raise LoadError(f"{where} has shape {tuple(tensor.shape)}, the model config wants {tuple(shape)}")
    return tensor


def _from_upstream_gguf(reader, name: str, device: torch.device, gguf_names) -> torch.Tensor:
    """The model's tensor `name` through KTransformers' GGUFLoader: its safetensors loader where it
    wraps one, else its GGUF tensors (concatenated along dim 1 where the model fuses them)."""
    inner = getattr(reader, "safetensor_loader", None)
    if inner is not None:
        return inner.load_tensor(name, device)
    names = gguf_names(name) if gguf_names is not None else None
    if not names:
        raise LoadError(f"tensor {name!r}: no GGUF name is known for it, so KTransformers' GGUFLoader cannot read it")
    parts = [reader.load_gguf_tensor(gguf_name, device=str(device)) for gguf_name in names]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _load_own_tensors(module: nn.Module, reader, key: str, device: torch.device, loaded: dict) -> None:
    for name, param in list(module._parameters.items()):
        if param is None:
            continue
        if id(param) in loaded:  # tied to a parameter loaded earlier
            module._parameters[name] = loaded[id(param)]
            continue
        if param.is_meta:
            data = read_tensor(reader, _join(key, name), device, param.shape)
        else:
            data = param.data.to(device)
        new = nn.Parameter(data, requires_grad=False)
        loaded[id(param)] = new
        module._parameters[name] = new
    for name, buf in list(module._buffers.items()):
        if buf is None:
            continue
        if buf.is_meta:
            if name in module._non_persistent_buffers_set:
                raise LoadError(f"buffer {_join(key, name)!r} is not stored in checkpoints and was built on the meta device")
            module._buffers[name] = read_tensor(reader, _join(key, name), device, buf.shape)
        elif name not in module._non_persistent_buffers_set and _stored(reader, _join(key, name)):
            # a persistent buffer is model state (e.g. GLM's router correction bias): the checkpoint's value,
            # in the buffer's own dtype (transformers keeps such buffers in fp32)
            module._buffers[name] = _read_buffer(reader, _join(key, name), device, buf)
        else:
            module._buffers[name] = buf.to(device)


def _stored(reader, name: str) -> bool:
    """Whether the reader can read `name` (readers without a membership test: no)."""
    try:
        return hasattr(reader, "load_buffer") and name in reader
    except TypeError:
        return False


def _read_buffer(reader, name: str, device: torch.device, buf: torch.Tensor) -> torch.Tensor:
    tensor = reader.load_buffer(name, device, buf.dtype)
    if tensor.shape != buf.shape:
        raise LoadError(f"{reader.describe(name)} has shape {tuple(tensor.shape)}, the model config wants {tuple(buf.shape)}")
    return tensor


def meta_tensor_names(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    return names + [n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta]
