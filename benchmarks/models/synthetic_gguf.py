"""A random-weight model written as a KTransformers user's checkpoint: an HF directory (config, tokenizer,
processor, the vision tower in safetensors) with the text weights in one GGUF file beside them.

    python -m benchmarks.models.synthetic_gguf DIR [--layers 48] [--qtype Q4_K] [--rest Q8_0]

The weights are `SyntheticReader`'s (benchmarks/models/synthetic.py: same seed, same values), so a model loaded
with `vismmoe_kt.load(DIR, rules, gguf_path=DIR)` is `load_synthetic`'s model up to the quantization:
benchmarks compare a GGUF load against the BF16 synthetic model on equal terms. The experts are
written in `qtype` (default Q4_K, the bulk of a Q4_K_M file), the other text matrices in `rest`
(default Q8_0), norms in F32, with llama.cpp's hyperparameters, the processor's vocabulary and chat
template. The vision tower is written twice: in the directory's safetensors (which the GGUF reader falls
back to) and as llama.cpp's mmproj file (`mmproj-model-F16.gguf`, with its clip.* keys), so the two GGUF
files alone are the whole model too (`--gguf_path FILE --mmproj_path FILE`, no `--model_path`).

Tensors are made on the GPU when there is one and quantized there (the store's torch quantizers),
one at a time, and streamed to the file (vismmoe_kt/demo/gguf_export.write_planned): Qwen3-VL-30B-A3B's 48
layers in Q4_K (about 17 GB) take a minute on a GPU host; on a CPU, quantizing takes far longer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from vismmoe_kt.core.loader import _build_on_meta
from vismmoe_kt.models import adapter_for
from vismmoe_kt.demo.gguf_export import (PlannedTensor, WRITABLE, export_mmproj, llama_metadata, tensor_type,
                                         write_planned)
from benchmarks.models.synthetic import SYNTHETIC_MODELS, SyntheticReader, synthetic_config
from vismmoe_kt.demo.tiny import TinySpec, build_processor

EXPERT_SUFFIXES = ("_exps.weight",)  # llama.cpp's stacked expert tensors: ffn_{gate,up,down}_exps


def write_synthetic_checkpoint(out_dir: str | Path, config: Any, processor: Any, qtype: str = "Q4_K",
                               rest: str = "Q8_0", seed: int = 0, name: str = "synthetic",
                               progress: bool = True, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Write `config`'s model with SyntheticReader's weights (`seed`, made in `dtype`: the values differ
    per dtype) to `out_dir`: config and processor,
    the tensors without a GGUF name (the vision tower) as `model.safetensors`, the text weights as
    `model-<qtype>.gguf`. Returns what was written: seconds, bytes, the GGUF's type per tensor."""
    from safetensors.torch import save_file

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError("writing GGUF needs the gguf package (pip install gguf==0.19.0; `make test` installs it)") from None
    for kind in (qtype, rest):
        if kind not in WRITABLE:
            raise ValueError(f"cannot write {kind}: the writable GGUF types are {', '.join(WRITABLE)}")
    start = time.perf_counter()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    adapter = adapter_for(config.model_type)
    meta = _build_on_meta(adapter, config)
    persistent = [n for n, _ in meta.named_parameters()] + [
        n for n, _ in meta.named_buffers() if n.rsplit(".", 1)[-1] not in _non_persistent(meta, n)]
    shapes = {n: t.shape for n, t in list(meta.named_parameters()) + list(meta.named_buffers())}
    del meta
    reader = SyntheticReader(shapes, dtype, seed, name)
    config.save_pretrained(str(out))
    processor.save_pretrained(str(out))

    beside = {n: reader.load_tensor(n, "cpu").contiguous() for n in persistent if not adapter.gguf_names(n)}
    save_file(beside, str(out / "model.safetensors"), metadata={"format": "pt"})

    planned: list[PlannedTensor] = []
    for model_name in persistent:
        gguf_names = adapter.gguf_names(model_name)
        if not gguf_names:
            continue
        shape = tuple(shapes[model_name])
        split = (*shape[:1], shape[1] // len(gguf_names), *shape[2:]) if len(gguf_names) > 1 else shape
        for i, gguf_name in enumerate(gguf_names):
            kind = qtype if gguf_name.endswith(EXPERT_SUFFIXES) else rest
            planned.append(PlannedTensor(gguf_name, split, tensor_type(gguf_name, split, kind),
                                         lambda n=model_name, i=i, k=len(gguf_names): _part(reader, n, i, k)))
    gguf_file = out / f"model-{qtype}.gguf"
    # llama.cpp's hyperparameters too, so llama-bench loads the same file (its routing: the random weights' own)
    arch, metadata = llama_metadata(adapter, config, processor)
    types = write_planned(planned, gguf_file, arch or "qwen3vlmoe", progress=progress, metadata=metadata)
    mmproj_file = out / "mmproj-model-F16.gguf"
    export_mmproj(beside, adapter, config, mmproj_file, "F16", processor=processor)
    info = {"seconds": time.perf_counter() - start, "gguf_file": str(gguf_file), "mmproj_file": str(mmproj_file),
            "gguf_bytes": gguf_file.stat().st_size,
            "safetensors_bytes": (out / "model.safetensors").stat().st_size, "qtype": qtype, "rest": rest,
            "seed": seed, "types": types}
    (out / "synthetic_gguf.json").write_text(json.dumps({k: v for k, v in info.items() if k != "types"}, indent=1))
    return info


def _non_persistent(meta: torch.nn.Module, name: str) -> set[str]:
    owner = meta.get_submodule(name.rsplit(".", 1)[0]) if "." in name else meta
    return owner._non_persistent_buffers_set


def _part(reader: SyntheticReader, name: str, index: int, parts: int) -> torch.Tensor:
    """Part `index` of `parts` of the model's tensor `name`, split along dim 1 where the model fuses
    several GGUF tensors (gate and up), as float on the device that made it."""
    tensor = reader.load_tensor(name, reader.make_on).float()
    return tensor.chunk(parts, dim=1)[index].contiguous() if parts > 1 else tensor


def write_synthetic_gguf(out_dir: str | Path, model: str = "qwen3-vl-30b-a3b", layers: int | None = None,
                         qtype: str = "Q4_K", rest: str = "Q8_0", seed: int = 0, progress: bool = True,
                         max_image_pixels: int = 1024 * 1024) -> dict[str, Any]:
    """`load_synthetic(model, layers=layers, seed=seed)`'s model written as a GGUF checkpoint."""
    processor = build_processor(TinySpec(1, 1, 1, 1, 1, max_image_pixels=max_image_pixels))
    config = synthetic_config(model, processor.tokenizer, layers)
    return write_synthetic_checkpoint(out_dir, config, processor, qtype, rest, seed, model, progress)


def main(argv: list[str] | None = None) -> None:
    from vismmoe_kt.apps.arguments import FlagParser

    parser = FlagParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="checkpoint directory to write (GGUF file, vision tower, config)")
    # the GGUF layout (llama.cpp's tensor names) is Qwen3-VL-MoE's only: its adapter is the one that maps them
    parser.add_argument("--model", default="qwen3-vl-30b-a3b",
                        choices=[n for n, m in SYNTHETIC_MODELS.items() if m["family"] == "qwen3_vl_moe"],
                        help="the synthetic model whose shapes are written (random weights)")
    parser.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (default: all)")
    parser.add_argument("--qtype", default="Q4_K", choices=WRITABLE, help="the experts' GGUF type")
    parser.add_argument("--rest", default="Q8_0", choices=WRITABLE, help="the other text matrices' type")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    info = write_synthetic_gguf(args.out_dir, args.model, args.layers, args.qtype, args.rest, args.seed)
    print(f"wrote {info['gguf_file']} ({info['gguf_bytes'] / 2**30:.2f} GiB, experts {args.qtype}, rest {args.rest}) "
          f"and the vision tower ({info['safetensors_bytes'] / 2**30:.2f} GiB) in {info['seconds']:.1f} s")


if __name__ == "__main__":
    main()
