"""Loading a local model directory with injection rules: `load(model_path, rules) -> (model, processor)`.

Order of work, so that no full copy of the checkpoint is ever materialised:
  1. read the config, pick the family's adapter (an unsupported architecture is a clear error);
  2. build the HF model on the meta device (parameters only; computed buffers such as rotary
     frequencies stay real, they are not in checkpoints);
  3. plan the rules and swap operators in (operators allocate nothing yet);
  4. read each tensor through safetensors mmap straight onto the device its module wants.
Nothing is downloaded: the directory must hold config, checkpoint and processor files.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .checkpoint import CheckpointReader
from .gguf_checkpoint import GgufCheckpointReader
from .context import DecodeOptions, LoadContext, context_of
from ..errors import LoadError
from .inject import check_override_keys, inject, read_rules
from ..models import ModelAdapter, adapter_for
from .weights import load_module_tree, meta_tensor_names

ENGINE_KEYS = ("decode", "graphs")  # options of the decode engine, accepted beside the rule overrides
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadInfo:
    """What `load` decided; kept on the model as `model.vismmoe` for `--stats`, the engine and the apps."""

    model_dir: Path | str
    rules: str | None
    adapter: ModelAdapter
    plan: dict[str, dict]
    default_device: str
    context: LoadContext
    load_seconds: float = 0.0
    bytes_by_device: dict[str, int] = field(default_factory=dict)


def pick_default_device() -> str:
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if value not in DTYPES:
        raise LoadError(f"unknown dtype {value!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[value]


def read_model_config(model_dir: Path) -> tuple[Any, ModelAdapter]:
    if not model_dir.exists():
        raise LoadError(f"model path {model_dir} does not exist")
    if not model_dir.is_dir():
        raise LoadError(f"model path {model_dir} is not a directory")
    config_file = model_dir / "config.json"
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoadError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)") from None
    except (OSError, ValueError) as exc:
        raise LoadError(f"{config_file}: unreadable ({exc})") from None
    adapter = adapter_for(raw.get("model_type"), where=config_file)
    for key in ("dtype", "torch_dtype"):  # transformers' name and its older one
        _check_config_dtype(raw.get(key), config_file)
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True,
                                            trust_remote_code=adapter.trust_remote_code)
    except (OSError, ValueError, TypeError) as exc:
        raise LoadError(f"{config_file}: invalid config ({exc})") from None
    return config, adapter


def _check_config_dtype(value: Any, config_file: Path) -> None:
    """The model is built in the config's dtype: a non-float one fails deep inside transformers or torch."""
    if value is None:
        return
    dtype = getattr(torch, value, None) if isinstance(value, str) else None
    if not isinstance(dtype, torch.dtype):
        raise LoadError(f"{config_file}: dtype {value!r} is not a torch dtype")
    if not dtype.is_floating_point:
        raise LoadError(f"{config_file}: dtype {str(dtype).removeprefix('torch.')} is not a floating-point type; "
                        f"vismmoe-kt loads float models (float32, bfloat16, float16), not quantized ones")


def _build_on_meta(adapter: ModelAdapter, config: Any) -> nn.Module:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = adapter.build(config)
    # Tie now (e.g. lm_head to the embeddings) so a tied tensor is one Parameter, read from the
    # checkpoint once; HF would tie only after loading, and tied checkpoints omit the second name.
    model.tie_weights()
    return model


def _check_devices(plan: dict[str, dict], rules: Any) -> None:
    if torch.cuda.is_available():
        return
    wanted = sorted({str(v) for entry in plan.values() for k, v in entry["kwargs"].items()
                     if k.endswith("device") and str(v).startswith("cuda")})
    if wanted:
        raise LoadError(f"{rules or 'the plan'} places modules on {', '.join(wanted)} but this machine has no CUDA "
                        f"device; pass --generate_device cpu --prefill_device cpu (or load(..., generate_device='cpu', "
                        f"prefill_device='cpu'))")


def _bytes_by_device(model: nn.Module) -> dict[str, int]:
    totals: dict[str, int] = {}
    seen: set[int] = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        totals[str(tensor.device)] = totals.get(str(tensor.device), 0) + tensor.numel() * tensor.element_size()
    return totals


def load(
    model_path: str | Path,
    optimize_config_path: str | Path | list | None = None,
    *,
    dtype: str | torch.dtype | None = None,
    default_device: str | None = None,
    progress: bool = True,
    gguf_path: str | Path | None = None,
    mmproj_path: str | Path | None = None,
    **overrides: Any,
) -> tuple[nn.Module, Any]:
    """Load a model directory, inject the rule file's operators, return `(model, processor)`.

    `overrides` apply on top of the rules: `generate_device`/`prefill_device` set every module's
    devices, `decode` (lean | hf) and `graphs` (auto | cuda | replay | off) are the engine's options,
    `cpu_infer` the CPU experts' worker count (default physical cores - 2), any other key replaces that kwarg in every rule that has it. `dtype` converts floating tensors
    while loading (default: keep the checkpoint's dtype). `gguf_path` (a .gguf file or a directory of
    them) reads the weights from GGUF instead, config and processor still from `model_path`
    (core/gguf_checkpoint.py; tensors are dequantized to `dtype`, by default float32 for a file written
    all in F32, else bfloat16). `mmproj_path`
    (with `gguf_path`): the vision tower from llama.cpp's mmproj GGUF instead of the directory.
    """
    start = time.perf_counter()
    model_dir = Path(model_path)
    config, adapter = read_model_config(model_dir)
    layout_fix = lambda name, tensor, shape: adapter.to_model_layout(name, tensor, shape, config)  # noqa: E731
    device = default_device or overrides.get("generate_device") or pick_default_device()
    if mmproj_path is not None and gguf_path is None:
        raise LoadError("--mmproj_path holds the vision tower of a GGUF model: give --gguf_path too")
    if gguf_path is not None:
        reader = GgufCheckpointReader(model_dir, gguf_path, adapter.gguf_names, dtype=parse_dtype(dtype),
                                      layout_fix=layout_fix, default_device=device,
                                      mmproj_path=mmproj_path,
                                      mmproj_source=lambda name: adapter.mmproj_source(name, config),
                                      from_gguf=lambda name, parts: adapter.from_gguf(name, parts, config))
    else:
        reader = CheckpointReader(model_dir, dtype=parse_dtype(dtype), layout_fix=layout_fix,
                                  default_device=device,
                                  sources=lambda name: adapter.checkpoint_sources(name, config),
                                  renames=lambda name: adapter.checkpoint_name(name, config))
    model = assemble(config, adapter, reader, optimize_config_path, device, progress, overrides)
    generation_config = model_dir / "generation_config.json"
    if generation_config.exists():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True)
    processor = adapter.load_processor(model_dir)
    model.vismmoe.load_seconds = time.perf_counter() - start
    return model, processor


def check_overrides(rules: Any, overrides: dict[str, Any]) -> None:
    """What `load` would refuse in `overrides` for the rules they go with, refused before anything is built
    (a benchmark checks all its configurations before it runs the first): an engine option's value, or a key
    that is neither a load option nor a kwarg some rule sets (the RuleError inject gives)."""
    try:
        DecodeOptions(**{key: overrides[key] for key in ENGINE_KEYS if key in overrides})
    except ValueError as exc:
        raise LoadError(str(exc)) from None
    check_override_keys([rule.kwargs for rule in read_rules(rules if rules is not None else [])],
                        [key for key in overrides if key not in (*ENGINE_KEYS, "cpu_infer")])


def assemble(config: Any, adapter: ModelAdapter, reader: Any, rules: Any, device: str, progress: bool,
             overrides: dict[str, Any]) -> nn.Module:
    """Meta model -> injected operators -> weights from `reader` (a checkpoint, or synthetic weights).

    `decode` and `graphs` among the overrides are engine options (DecodeOptions), not rule kwargs;
    `cpu_infer` is the CPU experts' worker count (LoadContext.cpu_threads)."""
    overrides = dict(overrides)
    engine = {key: overrides.pop(key) for key in ENGINE_KEYS if key in overrides}
    cpu_threads = overrides.pop("cpu_infer", None)
    if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1):
        raise LoadError(f"cpu_infer must be a whole number of threads >= 1, got {cpu_threads!r}")
    model = _build_on_meta(adapter, config)
    context = context_of(reader)
    context.cpu_threads, context.model_device = cpu_threads, str(device)
    plan = inject(model, rules if rules is not None else [], config, loader=reader, default_device=device,
                  overrides=overrides)
    if engine:  # explicit options win over the deprecated rule kwargs an old rule file may carry
        try:
            context.decode = DecodeOptions(**{**asdict(context.decode), **engine})
        except ValueError as exc:
            raise LoadError(str(exc)) from None
    adapter.install_hooks(model)
    context.check()
    _check_devices(plan, rules)
    _load_weights(model, reader, device, progress)
    model.eval()
    model.vismmoe = LoadInfo(reader.model_dir, str(rules) if rules else None, adapter, plan, device, context)
    model.vismmoe.bytes_by_device = _bytes_by_device(model)
    return model


def _load_weights(model: nn.Module, reader: CheckpointReader, device: str, progress: bool) -> None:
    from tqdm import tqdm

    todo = meta_tensor_names(model)
    bar = tqdm(total=len(todo), desc="Loading weights", unit="tensor", disable=not progress, leave=False)
    reader.on_tensor = lambda name, nbytes: bar.update(1)
    try:
        load_module_tree(model, reader, "", reader.planned_device("", device))
    finally:
        bar.close()
        reader.close()
        reader.on_tensor = None
    left = meta_tensor_names(model)
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise LoadError(f"{reader.model_dir}: checkpoint lacks tensors the model needs: {shown}")
