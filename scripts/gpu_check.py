"""GPU check of the foundation on a CUDA machine, in one go (used with the device tool).

For every rule file under optimize_rules/, load a saved tiny model of its family (Qwen3-VL-MoE,
GLM-4.5V, DeepSeek-OCR-2, Kimi K2.5, ERNIE-4.5-VL, Llama 4) with its default (CUDA) devices and compare logits and greedy tokens with
the all-on-GPU reference (fp32, TF32 off).
Prints one line per rule file with the max logit difference, token equality, where the weights
went and what the operators did; exits non-zero if any rule file disagrees. Generation goes through
`vismmoe_kt.engine.generate`, so rule files with a VisDecoder exercise the lean decode path and its
CUDA graphs (a capture error or a graphed step that differs from the eager one counts as a failure, and so
does a vision tower replay that failed to capture or differed). Before them: the fused kernels against their
twins, Qwen3-VL-30B-A3B's vision tower replayed per picture size against its own forward (with timings), and
the default rules' prune of a picture prompt under CUDA's sync debug mode (any read back from the device fails).
The expert-parallel rule files (qwen3vl-ep.yaml, glm4v-ep.yaml, deepseek-ocr2-ep.yaml, kimi-k25-ep.yaml,
ernie45vl-ep.yaml, llama4-ep.yaml) are left out:
they need a torchrun launch.

`--stores`: instead, the host store in each quantized format (Q8_0, Q4_0, Q4_K, Q5_K) read by the
GPU's Triton kernels against the CPU's torch twins (which the CPU tests hold to the `gguf` package's
dequantization): a tiny fp32 model offloaded at its smallest budget, so decode misses read the store;
then the same with quantized slabs (`slab_format: quantized`, slabs for 40 of the 64 offloaded experts); then
in BF16 the streamed prefill on quantized slabs computed in place by the expert-major kernels, against the same
prompt on dequantized slabs; and at full size the Q4_K GEMVs' dp4a form against its twin and the prompt's
expert-major kernels in each tile form (the tokens or the weights first) against the fp32 reference.

`--gpu-prefill`: instead, the KTransformers-style rule's layerwise GPU prefill (gpu_prefill_tokens): a tiny fp32
model's prompt with each layer's experts copied from a host copy (model dtype, Q8_0, Q4_K) a layer ahead and
run on the GPU, all of them, half, or the automatic share with the CPU (torch backend) computing the rest,
against the same rule on the CPU (whose twin dequantizes the same copy); two prompts, so the second finds its
first layer staged.

    PYTHONPATH=. python3 scripts/gpu_check.py [--out DIR] [--stores] [--gpu-prefill] [--only PREFIX]
"""

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from vismmoe_kt import load
from vismmoe_kt.engine.generation import generate
from vismmoe_kt.core.stats import collect_stats
from vismmoe_kt.demo.tiny import SPECS, save_tiny_model
from vismmoe_kt.engine.inputs import build_inputs, user_turn
from vismmoe_kt.runtime.store import ExpertStore
from vismmoe_kt.apps.arguments import FlagParser


def main() -> int:
    parser = FlagParser()
    parser.add_argument("--out", help="write results as JSON here")
    parser.add_argument("--stores", action="store_true", help="the quantized host stores, GPU kernels vs CPU twins")
    parser.add_argument("--gpu-prefill", action="store_true", help="the kt-cpu rule's layerwise GPU prefill vs its CPU twin")
    parser.add_argument("--fp8", action="store_true", help="only ReaLB's FP8 experts and quantization kernels")
    parser.add_argument("--only", metavar="PREFIX", help="only the rule files whose names start with PREFIX (e.g. kimi-k25)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this check is for the GPU machine", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.stores:
        return check_stores(args.out)
    if args.gpu_prefill:
        return check_gpu_prefill(args.out)
    fused = check_fused_norm()
    print(json.dumps(fused))
    fused_step = check_fused_step_kernels()
    print(json.dumps(fused_step))
    prompt_attention = check_prompt_attention()
    print(json.dumps(prompt_attention))
    prompt_router = check_prompt_router()
    print(json.dumps(prompt_router))
    vision_ops = check_vision_ops()
    print(json.dumps(vision_ops))
    vision = check_vision_graph()
    print(json.dumps(vision))
    fp8 = check_fp8_grouped()
    print(json.dumps(fp8))
    if args.fp8:
        return 0 if fp8["ok"] else 1
    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "tiny-6x64", "tiny-6x64", seed=0)
    prune = check_prune_reads(model_dir)
    print(json.dumps(prune))
    reservations = check_reservations(model_dir)
    print(json.dumps(reservations))
    rules = sorted(r for r in Path("optimize_rules").glob("qwen3vl*.yaml") if r.name != "qwen3vl-ep.yaml")  # ep: torchrun
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8))

    def run(rule_file, model_dir=model_dir, **overrides):
        model, processor = load(model_dir, rule_file, progress=False, **overrides)
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], "cuda:0")
        with torch.inference_mode():
            logits = model(**inputs).logits.float().cpu()
            start = time.perf_counter()
            tokens = generate(model, inputs, 8).cpu()  # the lean decode path where the rules have a VisDecoder
            seconds = time.perf_counter() - start
        return logits, tokens, seconds, collect_stats(model)

    qwen_logits, qwen_tokens, _, _ = run("optimize_rules/qwen3vl-gpu.yaml")
    # the offload runtimes again at their smallest budgets, so that every step copies and evicts
    spec = SPECS["tiny-6x64"]
    layer = spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4  # one layer of fp32 experts
    cases = [(str(r), {}) for r in rules] + [("optimize_rules/qwen3vl-offload.yaml", {"expert_budget": 2 * layer}),
                                            ("optimize_rules/qwen3vl-lru.yaml", {"expert_budget": layer}),
                                            # every expert resident: the whole decode step is one CUDA graph
                                            ("optimize_rules/qwen3vl-offload.yaml", {"expert_budget": "1GiB",
                                                                                     "graphs": "cuda"})]
    # the other families' tiny models: each one's rule files (but -ep) against the same all-on-GPU placement
    # of the stock modules, and offloaded at the smallest budget. GLM-4.5V (M-RoPE, sigmoid grouped router,
    # partial rotary), DeepSeek-OCR-2 (1-D RoPE, softmax top-k router without renormalisation), Kimi K2.5
    # (MLA attention over a cache of compressed latents, sigmoid grouped router, 1-D RoPE), ERNIE-4.5-VL
    # (separate text and vision experts chosen per token by modality, M-RoPE), Llama 4 (dense and MoE layers
    # interleaved, one input-scaled expert per token, complex rotary packed as (cos, sin))
    refs, names = {}, {}
    for spec_name, prefix in (("tiny-glm-4x16", "glm4v"), ("tiny-dsocr2-4x16", "deepseek-ocr2"),
                              ("tiny-kimi-4x16", "kimi-k25"), ("tiny-ernie-4x16", "ernie45vl"),
                              ("tiny-llama4-6x16", "llama4")):
        if args.only and not (prefix.startswith(args.only) or args.only.startswith(prefix)):
            continue
        family = SPECS[spec_name]
        family_dir = save_tiny_model(Path(tempfile.mkdtemp()) / spec_name, family, seed=0)
        refs[family_dir], names[family_dir] = run("optimize_rules/qwen3vl-gpu.yaml", model_dir=family_dir)[:2], spec_name
        cases += [(str(r), {"model_dir": family_dir}) for r in sorted(Path("optimize_rules").glob(f"{prefix}*.yaml"))
                  if not r.name.endswith("-ep.yaml")]
        family_layer = family.experts * 3 * family.moe_intermediate * family.hidden * 4
        cases += [(f"optimize_rules/{prefix}-offload.yaml", {"model_dir": family_dir, "expert_budget": 2 * family_layer})]
    if args.only:
        cases = [case for case in cases if Path(case[0]).name.startswith(args.only)]
    results, ok = [], True
    for rule_file, overrides in cases:
        logits, tokens, seconds, stats = run(rule_file, **overrides)
        family_dir = overrides.get("model_dir")
        ref_logits, ref_tokens = refs[family_dir] if family_dir is not None else (qwen_logits, qwen_tokens)
        overrides = {k: v for k, v in overrides.items() if k != "model_dir"}
        rule_file = Path(rule_file)
        diff = (logits - ref_logits).abs().max().item()
        same = torch.equal(tokens, ref_tokens)
        lean = stats["operators"].get("VisDecoder", {})
        graphs_ok = all(lean.get(f"decode_{counter}", 0) == 0 for counter in (
            "capture_failures", "check_failures", "vision_graph_capture_failures", "vision_graph_check_failures"))
        # kt-kernel computes the CPU's experts in BF16 (its AMX/AVX-512 kernels), whatever the model's dtype:
        # its logits may differ by BF16 rounding; every other path matches the fp32 reference
        bf16_experts = str(stats["operators"].get("CpuExperts", {}).get("cpu_backend", "")).startswith("kt-kernel")
        tolerance = 1e-2 * ref_logits.abs().max().item() if bf16_experts else 1e-5
        ok &= diff <= tolerance and same and graphs_ok
        row = {"rules": rule_file.name, "model": names.get(family_dir, "tiny-6x64"),
               "overrides": overrides, "max_abs_logit_diff": diff, "tolerance": tolerance,
               "greedy_tokens_equal": same,
               "generate_8_tokens_s": round(seconds, 3), "weights_by_device": stats.get("weights_by_device"),
               "operators": stats["operators"]}
        results.append(row)
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                              "results": results}, indent=2))
    ok &= fused["ok"] and fp8["ok"] and fused_step["ok"] and prompt_attention["ok"] and prompt_router["ok"] and vision["ok"] and vision_ops["ok"]
    ok &= prune["ok"]
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def check_fused_norm() -> dict:
    """The lean step's RMSNorm kernel in BF16 on the GPU against transformers' formula: at most one BF16
    rounding step apart (the interpreter on the CPU cannot check BF16)."""
    from vismmoe_kt.engine.fused_ops import rms_norm

    torch.manual_seed(0)
    worst = 0.0
    for shape in ((8, 2048), (8, 32, 128), (3, 100)):
        x = (torch.randn(shape, device="cuda") * 3).to(torch.bfloat16)
        weight = (torch.rand(shape[-1], device="cuda") + 0.5).to(torch.bfloat16)
        want = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        got = rms_norm(weight, 1e-6, x)
        worst = max(worst, ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item())
    return {"check": "fused RMSNorm, BF16", "max_relative_diff": worst, "ok": worst <= 2 ** -7}


def check_prompt_attention() -> dict:
    """A prompt's attention as installed on the GPU (engine/prompt_attention.py: the heads kernel, sdpa, the
    projections) against transformers' module in BF16, each writing its own slot cache: a prompt into an
    empty slot, then its continuation under the causal mask over what is cached. Within 2^-7 normwise (the
    stacked projection and the kernel round as the module's ops do; sdpa may pick another kernel)."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (Qwen3VLMoeTextAttention,
                                                                        Qwen3VLMoeTextRotaryEmbedding)

    from vismmoe_kt.engine.prompt_attention import install
    from vismmoe_kt.engine.slot_cache import SlotKVCache
    from vismmoe_kt.engine.text_forward import causal_mask
    from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter

    torch.manual_seed(0)
    bf16 = torch.bfloat16
    config = Qwen3VLMoeTextConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                  num_hidden_layers=2, rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20]})
    config._attn_implementation = "sdpa"
    modules = []
    for _ in range(2):  # the module, and the same weights with the prompt forward
        torch.manual_seed(0)
        attn = Qwen3VLMoeTextAttention(config, layer_idx=1).to("cuda", bf16).eval()
        with torch.no_grad():
            for norm in (attn.q_norm, attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
        modules.append(attn)

    class OneLayer(Qwen3VLMoeAdapter):
        def layers_of(self, text):
            return [text]

        def attention(self, layer):
            return layer
    installed = install(OneLayer(), modules[1])
    rotary = Qwen3VLMoeTextRotaryEmbedding(config).to("cuda")
    caches = [SlotKVCache(2, 3, 2, 128, 1024, bf16, "cuda") for _ in range(2)]
    worst = 0.0
    with torch.no_grad():
        for start, rows in ((0, 236), (236, 100)):
            hidden = torch.randn(1, rows, 512, device="cuda").to(bf16)
            positions = torch.arange(start, start + rows, device="cuda").view(1, 1, -1).expand(3, 1, -1)
            embeddings = rotary(hidden, positions)
            mask = causal_mask(rows, start, bf16, hidden.device, implicit_causal=True)
            outs = [attn(hidden_states=hidden, position_embeddings=embeddings, attention_mask=mask,
                         past_key_values=cache.slot_view(2))[0] for attn, cache in zip(modules, caches)]
            worst = max(worst, ((outs[1].float() - outs[0].float()).norm() / outs[0].float().norm()).item())
    for a, b in zip((caches[0].keys[1], caches[0].values[1]), (caches[1].keys[1], caches[1].values[1])):
        worst = max(worst, ((b.float() - a.float()).norm() / a.float().norm()).item())
    served = getattr(modules[1].forward, "served", 0)
    return {"check": "prompt attention (installed) vs the module, BF16", "installed": installed, "served": served,
            "max_relative_diff": worst, "lengths_equal": caches[1].host_lengths == caches[0].host_lengths,
            "ok": installed == 1 and served == 2 and worst <= 2 ** -7 and caches[1].host_lengths == caches[0].host_lengths}


def full_vision_tower():
    """(model, adapter, tower, config): Qwen3-VL-30B-A3B's vision tower (27 blocks, hidden 1152, random weights, BF16)
    on the GPU, inside a model where the adapter looks for it."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter

    config = Qwen3VLMoeVisionConfig(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=2048,
                                    patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304,
                                    deepstack_visual_indexes=[8, 16, 24])
    config._attn_implementation = "sdpa"

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.visual = Qwen3VLMoeVisionModel(config).to("cuda", torch.bfloat16).eval()

    model = Model()
    return model, Qwen3VLMoeAdapter(), model.model.visual, config


def check_vision_ops() -> dict:
    """The vision tower's rotary kernel (engine/vision_rotary.py) in BF16 on the GPU equal to its torch form and to
    transformers' apply_rotary_pos_emb_vision to the bit, at Qwen3-VL-30B-A3B's shapes (784 patches, 16 heads of 72);
    the patch embedding as a GEMM (engine/vision_patches.py) within BF16 rounding of the Conv3d; and a 448 px
    picture through the whole 27-block tower with both, against the tower's stock modules, within a few units
    of BF16's rounding at the output's scale."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

    from vismmoe_kt.engine.vision_attention import install as fuse_vision_attention
    from vismmoe_kt.engine.vision_patches import install as project_patches
    from vismmoe_kt.engine.vision_rotary import rotate, rotate_torch

    torch.manual_seed(0)
    qkv = (torch.randn(784, 3, 16, 72, device="cuda") * 2).to(torch.bfloat16)
    angles = torch.rand(784, 36, device="cuda") * 30
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos(), emb.sin()
    got = rotate(qkv, cos, sin)
    want_q, want_k = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    rotary_equal = torch.equal(got, rotate_torch(qkv, cos, sin)) and torch.equal(got[0], want_q) \
        and torch.equal(got[1], want_k)
    model, adapter, tower, _ = full_vision_tower()
    pixels = torch.randn(784, 3 * 2 * 16 * 16, device="cuda").to(torch.bfloat16)
    grid = torch.tensor([[1, 28, 28]], device="cuda")
    with torch.inference_mode():
        stock_patches = tower.patch_embed(pixels)
        stock = _leaves(tower(pixels, grid_thw=grid, return_dict=True))
        installed = fuse_vision_attention(adapter, model), project_patches(adapter, model)
        patches = tower.patch_embed(pixels)
        fused = _leaves(tower(pixels, grid_thw=grid, return_dict=True))
    eps = torch.finfo(torch.bfloat16).eps
    patch_scale = stock_patches.float().abs().max().item()
    patch_difference = (patches.float() - stock_patches.float()).abs().max().item()
    worst, ok = 0.0, installed == (27, 1) and len(fused) == len(stock)
    for f, s in zip(fused, stock):
        scale = s.float().abs().max().clamp(min=1.0).item()
        worst = max(worst, (f.float() - s.float()).abs().max().item() / scale)
    ok &= rotary_equal and patch_difference <= 2 * eps * patch_scale and worst <= 16 * eps
    return {"check": "vision tower's rotary kernel, patch GEMM, and the tower with both vs stock, BF16",
            "rotary_bit_equal": rotary_equal, "installed": list(installed),
            "patch_max_difference_at_scale": patch_difference / patch_scale, "tower_max_difference_at_scale": worst,
            "ok": bool(ok)}


def check_vision_graph() -> dict:
    """Qwen3-VL-30B-A3B's vision tower (27 blocks, hidden 1152, random weights, BF16) replayed as a CUDA graph per
    picture size (engine/vision_graph.py) against its own forward: 448 px pictures (784 patches), two of one
    size, one of another and one of the first again; every output of every picture within a few units of BF16's
    rounding (the self-check's tolerance), one capture per size. Also how long a picture takes each way. The
    saliency recorder hooks the last attention throughout (as while compression asks for saliency): each
    picture's saliency from the replay within 1% of the eager tower's."""
    from vismmoe_kt.engine.vision_attention import install as fuse_vision_attention
    from vismmoe_kt.engine.vision_graph import install
    from vismmoe_kt.engine.vision_patches import install as project_patches
    from vismmoe_kt.vision.saliency import SaliencyRecorder

    torch.manual_seed(0)
    model, adapter, tower, config = full_vision_tower()
    fuse_vision_attention(adapter, model)
    project_patches(adapter, model)
    own = tower.forward
    replayed = install(adapter, model, "cuda")
    recorder = SaliencyRecorder(tower.blocks[-1].attn, config.spatial_merge_size, adapter.attention_received)
    recorder.enabled = True
    worst, worst_saliency, ok, seconds = 0.0, 0.0, replayed is not None, {"eager": [], "graphed": []}
    with torch.inference_mode():
        for seed, side in enumerate((28, 28, 20, 28)):  # patches per side: 448 px, 320 px
            generator = torch.Generator(device="cuda").manual_seed(seed)
            pixels = torch.randn(side * side, 3 * 2 * 16 * 16, device="cuda", generator=generator).to(torch.bfloat16)
            grid = torch.tensor([[1, side, side]], device="cuda")
            runs, saliency = {}, {}
            for name, forward in (("eager", own), ("graphed", tower)):
                _scribble()  # a replay reading memory it does not hold would read this
                torch.cuda.synchronize()
                start = time.perf_counter()
                runs[name] = forward(pixels, grid_thw=grid, return_dict=True)
                torch.cuda.synchronize()
                seconds[name].append(time.perf_counter() - start)
                saliency[name] = recorder.take()
            if saliency["eager"] is None or saliency["graphed"] is None:
                ok = False
            else:
                difference = (saliency["graphed"] - saliency["eager"]).abs().max().item()
                worst_saliency = max(worst_saliency, difference / saliency["eager"].abs().max().item())
                ok &= difference <= 1e-2 * saliency["eager"].abs().max().item()
            for g, e in zip(_leaves(runs["graphed"]), _leaves(runs["eager"])):
                scale = e.float().abs().max().clamp(min=1.0).item()
                difference = (g.float() - e.float()).abs().max().item()
                worst = max(worst, difference / scale)
                ok &= difference <= 8 * torch.finfo(torch.bfloat16).eps * scale
    stats = replayed.stats() if replayed is not None else {}
    ok &= stats.get("captures") == 2 and stats.get("replays") == 2 and stats.get("check_failures") == 0
    return {"check": "vision tower replayed per picture size vs its own forward, BF16", **stats,
            "max_difference_at_scale": worst, "saliency_max_relative_difference": worst_saliency, "eager_ms": [round(s * 1e3, 2) for s in seconds["eager"]],
            "graphed_ms": [round(s * 1e3, 2) for s in seconds["graphed"]], "ok": bool(ok)}


def _scribble() -> None:
    """Device memory of many small sizes taken from the allocator, filled with garbage and given back: a graph
    that reads tensors it does not hold (freed after its capture) then reads garbage, which the check sees."""
    junk = [torch.full((n,), -7, dtype=torch.int64, device="cuda") for n in (4, 64, 1024, 16384) for _ in range(64)]
    del junk


def _leaves(output) -> list:
    from torch.utils import _pytree

    return _pytree.tree_flatten(output)[0]


def check_prompt_router() -> dict:
    """A prompt's fused router (fuse_routers) against transformers' Qwen3-VL-MoE router in BF16 at Qwen3-VL-30B-A3B's
    shapes (2048 hidden, 128 experts, top 8), 824 tokens: the same logits, the same experts wherever the k-th and
    (k+1)-th logits differ, the weights within one BF16 step of each other."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

    from vismmoe_kt.engine.fused_ops import fuse_routers
    from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter

    torch.manual_seed(0)
    config = Qwen3VLMoeTextConfig(hidden_size=2048, num_experts=128, num_experts_per_tok=8)
    routers = [Qwen3VLMoeTextTopKRouter(config).to("cuda", torch.bfloat16).eval() for _ in range(2)]
    with torch.no_grad():
        routers[0].weight.normal_(0, 0.02)
        routers[1].weight.copy_(routers[0].weight)
    fused = fuse_routers([routers[1]], Qwen3VLMoeAdapter())
    hidden = torch.randn(824, 2048, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        (want_logits, want_weights, want_ids), (logits, weights, ids) = routers[0](hidden), routers[1](hidden)
    top = torch.topk(want_logits.float(), 9, dim=-1).values
    clear = top[:, 7] > top[:, 8]  # rows whose choice no tie decides
    same_experts = bool((ids.sort(-1).values == want_ids.sort(-1).values).all(-1)[clear].all())
    order = ids.argsort(-1), want_ids.argsort(-1)
    step = (weights.gather(-1, order[0]).float() - want_weights.gather(-1, order[1]).float()).abs() \
        / want_weights.float().abs().clamp_min(1e-30)
    worst = float(step[clear].max())
    return {"check": "prompt router (fused) vs the module, BF16", "fused": fused, "logits_equal": torch.equal(logits, want_logits),
            "same_experts": same_experts, "rows_decided_by_ties": int((~clear).sum()), "max_relative_weight_diff": worst,
            "ok": fused == 1 and torch.equal(logits, want_logits) and same_experts and worst <= 2 ** -7}


def check_fused_step_kernels() -> dict:
    """The decode step's other fused kernels in BF16 on the GPU against their torch twins at
    Qwen3-VL-30B-A3B's shapes: the attention's heads kernel (norms, rotary, the cache write; rows in
    slot order and gathered, and a prompt's rows), the residual add + RMSNorm, the router's top-k softmax (the same experts).
    The twins reduce in another order, so a value may round one BF16 step apart: within 2^-8 normwise."""
    from types import SimpleNamespace

    from vismmoe_kt.engine.fused_attention import heads_torch, heads_triton
    from vismmoe_kt.engine.fused_ops import add_rms_norm, rms_norm, route
    from vismmoe_kt.engine.slot_cache import SlotKVCache

    torch.manual_seed(0)
    bf16, worst, same_experts, counters_reset = torch.bfloat16, 0.0, True, True

    def relative(got, want):  # normwise: an element-wise ratio would blow up where the rotary's two terms cancel
        return ((got.float() - want.float()).norm() / want.float().norm()).item()

    heads, kv, d = 32, 4, 128

    def step_inputs(rows):  # a decode step's stacked projection output and its rotary, random, BF16
        qkv = torch.randn(rows, (heads + 2 * kv) * d, device="cuda").to(bf16)
        angles = torch.rand(rows, d // 2, device="cuda") * 6
        return qkv, torch.cat([angles.cos()] * 2, -1).to(bf16), torch.cat([angles.sin()] * 2, -1).to(bf16)
    p = SimpleNamespace(heads=heads, kv_heads=kv, head_dim=d, layer_index=0,
                        query_norm=((torch.rand(d, device="cuda") + 0.5).to(bf16), 1e-6),
                        key_norm=((torch.rand(d, device="cuda") + 0.5).to(bf16), 1e-6))
    for slots in ([0, 1, 2, 3], [3, 1]):
        cache = SlotKVCache(1, 4, kv, d, 64, bf16, "cuda")
        for slot in range(4):
            cache.slot_view(slot).update(torch.randn(1, kv, 3 + slot, d, device="cuda").to(bf16),
                                         torch.randn(1, kv, 3 + slot, d, device="cuda").to(bf16), 0)
        cache.begin_decode(slots)
        rows = len(slots)
        qkv, cos, sin = step_inputs(rows)
        query, key, value = heads_torch(qkv, cos, sin, p)
        got = heads_triton(qkv, cos, sin, p, cache)
        at = torch.tensor([3 + s for s in slots], device="cuda")
        index = torch.tensor(slots, device="cuda")
        worst = max(worst, relative(got, query), relative(cache.keys[0][index, :, at], key),
                    relative(cache.values[0][index, :, at], value))
    # the heads kernel over a prompt's rows (engine/prompt_attention.py): a prompt into an empty slot, then its
    # continuation, the query in sdpa's layout and the keys and values at the slot's next positions
    from vismmoe_kt.engine.fused_attention import prompt_heads_triton
    cache = SlotKVCache(1, 4, kv, d, 1024, bf16, "cuda")
    for start, rows in ((0, 236), (236, 100)):
        qkv, cos, sin = step_inputs(rows)
        query, key, value = heads_torch(qkv, cos, sin, p)
        got = prompt_heads_triton(qkv, cos, sin, p, cache.keys[0][2], cache.values[0][2], start)
        written = slice(start, start + rows)
        worst = max(worst, relative(got[0], query.transpose(0, 1)),
                    relative(cache.keys[0][2, :, written], key.transpose(0, 1)),
                    relative(cache.values[0][2, :, written], value.transpose(0, 1)))
    # heads + attention in one kernel (split over the context, merged by the last program), against the
    # heads twin + SDPA: contexts of 0 to 824 positions, rows in slot order and gathered, twice (the
    # counters must be back to zero for the second launch), the split count chosen and one split
    from vismmoe_kt.engine.split_attention import attend_triton, workspace
    p.scaling = d ** -0.5
    for slots in ([0, 1, 2, 3], [3, 1]):
        for splits in (None, 1):
            cache = SlotKVCache(1, 4, kv, d, 1024, bf16, "cuda")
            for slot, n in enumerate((3, 300, 824, 0)):
                if n:
                    cache.slot_view(slot).update(torch.randn(1, kv, n, d, device="cuda").to(bf16),
                                                 torch.randn(1, kv, n, d, device="cuda").to(bf16), 0)
            space = workspace(cache, heads, kv, d)
            for _ in range(2):
                cache.begin_decode(slots)
                rows = len(slots)
                qkv, cos, sin = step_inputs(rows)
                query, key, value = heads_torch(qkv, cos, sin, p)
                twin = SlotKVCache(1, 4, kv, d, 1024, bf16, "cuda")
                twin.keys[0].copy_(cache.keys[0]), twin.values[0].copy_(cache.values[0]), twin.lengths.copy_(cache.lengths)
                twin.host_lengths = [list(cache.host_lengths[0])]
                twin.begin_decode(slots)
                keys, values = twin.update(key[:, :, None], value[:, :, None], 0)
                want = torch.nn.functional.scaled_dot_product_attention(
                    query.view(rows, kv, heads // kv, d), keys, values, attn_mask=twin.decode_masks(bf16)[0],
                    scale=p.scaling).reshape(rows, -1)
                got = attend_triton(qkv, cos, sin, p, cache, space, splits=splits)
                worst = max(worst, relative(got, want), relative(cache.keys[0], twin.keys[0]),
                            relative(cache.values[0], twin.values[0]))
                counters_reset &= int(space.counters.abs().sum()) == 0
                cache.advance()
    x, r = torch.randn(8, 2048, device="cuda").to(bf16), torch.randn(8, 2048, device="cuda").to(bf16)
    w = (torch.rand(2048, device="cuda") + 0.5).to(bf16)
    total, normed = add_rms_norm(w, 1e-6, x, r)
    worst = max(worst, relative(total, x + r), relative(normed, rms_norm(w, 1e-6, x + r)))
    hidden, gate = torch.randn(8, 2048, device="cuda").to(bf16), (torch.randn(128, 2048, device="cuda") / 40).to(bf16)
    weights, chosen, every = route(gate, 8, hidden, probabilities=True)
    logits = torch.nn.functional.linear(hidden, gate)
    top, ids = torch.topk(logits, 8, dim=-1)
    same_experts = bool(torch.equal(chosen.sort(-1).values, ids.sort(-1).values))
    worst = max(worst, relative(weights, torch.softmax(top, -1, dtype=torch.float).to(bf16)),
                relative(every, torch.softmax(logits, -1, dtype=torch.float)))
    return {"check": "fused decode-step kernels (attention heads, heads + split attention, add + RMSNorm, router), BF16",
            "normwise_relative_diff": worst, "same_experts": same_experts, "counters_reset": counters_reset,
            "ok": worst <= 2 ** -8 and same_experts and counters_reset}


def check_fp8_grouped() -> dict:
    """ReaLB's fp8 backend (lb/fp8_experts.py) at Qwen3-VL-30B-A3B's expert shapes in BF16: the switched
    pairs through torch's FP8 grouped GEMM against the per-expert function (precision.py), which
    quantizes the same weights the same way, and both against the experts in float32; on Hopper the
    grouped GEMM must have run."""
    from vismmoe_kt.lb.fp8_experts import Fp8Experts
    from vismmoe_kt.lb.fp8_quant import quantize_rows, silu_mul_quantize
    from vismmoe_kt.lb.precision import expert_mlp_fn, fp8_rows

    torch.manual_seed(0)
    experts, hidden, inter, pairs = 16, 2048, 768, 300
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / 40).to(torch.bfloat16)
    down = (torch.randn(experts, hidden, inter, device="cuda") / 30).to(torch.bfloat16)
    x = torch.randn(pairs, hidden, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, experts, (pairs,), device="cuda")
    ids[:40] = 3  # one expert with many rows, some with none
    act = torch.nn.functional.silu
    fp8 = Fp8Experts(gate_up, down)
    got = fp8(x, ids, act).float()
    per_expert, want, exact = expert_mlp_fn("fp8"), torch.zeros_like(got), torch.zeros_like(got)
    for e in ids.unique().tolist():
        rows = ids == e
        want[rows] = per_expert(x[rows], gate_up[e], down[e], act).float()
        gate, up = (x[rows].float() @ gate_up[e].float().t()).chunk(2, dim=-1)
        exact[rows] = (act(gate) * up) @ down[e].float().t()
    error = ((got - want).norm() / want.norm()).item()
    # the grouped GEMM accumulates fast (fp8_experts.py): it may differ from the per-expert function by
    # more than rounding, but must be about as close to the unquantized experts
    error_exact = ((got - exact).norm() / exact.norm()).item()
    error_exact_per_expert = ((want - exact).norm() / exact.norm()).item()
    hopper = torch.cuda.get_device_capability()[0] == 9
    # the one-pass quantization kernels (fp8_quant.py) against the torch formula they replace: the same
    # scales, and values apart in at most a few last-bit cases (one E4M3 step)
    quant = {}
    gate_up_rows = torch.randn(pairs, 2 * inter, device="cuda").to(torch.bfloat16)
    gate, up = gate_up_rows.chunk(2, dim=-1)
    for name, (q, s), (wq, ws) in (("quantize_rows", quantize_rows(x), fp8_rows(x)),
                                   ("silu_mul_quantize", silu_mul_quantize(gate_up_rows, act), fp8_rows(act(gate) * up))):
        step = (q.float() - wq.float()).abs() / wq.float().abs().clamp(min=2 ** -6)
        quant[name] = {"scales_max_relative": float(((s - ws.squeeze(-1)).abs() / ws.squeeze(-1)).max()),
                       "values_differing": float((q.float() != wq.float()).float().mean()),
                       "largest_difference_in_steps": float(step.max() * 8)}
    quant_ok = all(v["scales_max_relative"] <= 1e-5 and v["values_differing"] <= 1e-3
                   and v["largest_difference_in_steps"] <= 1.01 for v in quant.values())
    return {"check": "ReaLB fp8 grouped GEMM, BF16", "relative_error_vs_per_expert": error,
            "relative_error_vs_fp32": error_exact, "per_expert_relative_error_vs_fp32": error_exact_per_expert,
            **fp8.stats(), "quantization_kernels": quant,
            "ok": error <= 3e-2 and error_exact <= 1.1 * error_exact_per_expert + 1e-3 and (fp8.grouped or not hopper)
            and quant_ok}


def check_stores(out: str | None) -> int:
    spec = SPECS["tiny-3x32"]
    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "tiny-3x32", spec, seed=0)
    layer = spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4  # one layer of fp32 experts
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8))
    results, ok = [], True
    for fmt, slabs in [(f, s) for s in ("dequantized", "quantized") for f in ("q8_0", "q4_0", "q4_k", "q5_k")]:
        runs = {}
        for device in ("cpu", "cuda:0"):
            # quantized slabs: one pinned layer (its blocks), slabs for 40 of the other layers' 64 experts (at least
            # one layer's)
            block = ExpertStore(spec.experts, spec.hidden, spec.moe_intermediate, torch.float32, False, fmt=fmt).block_bytes
            budget = 2 * layer if slabs == "dequantized" else (spec.experts + 40) * block
            model, processor = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", progress=False, store_dtype=fmt,
                                    slab_format=slabs, expert_budget=budget, pinned_layers=1, generate_device=device,
                                    prefill_device=device)
            inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], device)
            with torch.inference_mode():
                logits = model(**inputs).logits.float().cpu()
                tokens = generate(model, inputs, 8).cpu()
            runtime = model.vismmoe.context.offload_runtime
            runs[device] = logits, tokens, runtime.summary(), collect_stats(model)["operators"].get("VisDecoder", {})
        (cpu_logits, cpu_tokens, _, _), (logits, tokens, summary, lean) = runs["cpu"], runs["cuda:0"]
        error = ((logits - cpu_logits).norm() / cpu_logits.norm()).item()
        same = torch.equal(tokens, cpu_tokens)
        misses = summary["bytes_copied_decode"] + summary["bytes_host_reads_decode"]
        good = error <= 1e-4 and same and misses > 0 and lean.get("decode_capture_failures", 0) == 0 \
            and lean.get("decode_check_failures", 0) == 0
        ok &= good
        row = {"store": fmt, "slabs": slabs, "relative_logit_error_vs_cpu": error, "greedy_tokens_equal": same,
               "decode_store_bytes": misses, "lean": {k: v for k, v in lean.items() if k.startswith("decode_")}}
        results.append(row)
        print(json.dumps(row), flush=True)
    ok &= check_settled(model_dir, spec, layer, image, results)
    ok &= check_streamed(model_dir, spec, layer, image, results)
    for row in (check_dp4a(), check_major_forms()):
        results.append(row)
        print(json.dumps(row), flush=True)
        ok &= row["ok"]
    return finish(results, ok, out)


def check_major_forms(device: str = "cuda:0", hidden: int = 2048, inter: int = 768, experts: int = 16,
                      tokens: int = 32, top_k: int = 8) -> dict:
    """A prompt's quantized expert-major kernels (Q4_K slabs) in each tile form, whole super-blocks and quarter
    steps with the tokens first and quarter steps with the weights first, prefetching or not (tile_form), at
    Qwen3-VL-30B-A3B's shapes against the fp32 reference on the CPU (the store's dequantized weights through the
    kernels' torch twin, expert_major.experts_by_block). The GPU rounds the activations, the weights and h to
    BF16, which leaves about 5e-3 of the outputs' norm (prefill_kernel_bench's error column); a wrong block,
    scale or nibble moves them by tens of percents, so the bound is 2e-2."""
    from vismmoe_kt.runtime.kernels import expert_major, quantized_major

    gen = torch.Generator().manual_seed(0)
    store = ExpertStore(experts, hidden, inter, torch.float32, False, fmt="q4_k")
    store.fill_layer(0, torch.randn(experts, 2 * inter, hidden, generator=gen) / 50,
                     torch.randn(experts, hidden, inter, generator=gen) / 50)
    gate_up, down = store.dequantized(store.layers[0], 0)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    pairs = ids.reshape(-1)
    # the fp32 reference: the kernels' torch twin, block by block on the dequantized bank
    want = expert_major.experts_by_block(x, top_k, *expert_major.expert_blocks(pairs, experts), gate_up, down,
                                         torch.nn.SiLU())
    pool = store.layers[0].to(device)  # slab e holds expert e
    slots = pairs.to(device)
    land = torch.full_like(slots, -1)
    forms = {"tokens first, whole super-blocks": ((64, 4, 1), (128, 4, 1), 32),
             "tokens first, quarter steps": ((64, 4, 2, 64), (128, 4, 2, 64), 32),
             "weights first, block M 16": ((128, 4, 1, 64, "weights"), (128, 4, 1, 64, "weights"), 16),
             "weights first, block M 32": ((128, 4, 1, 64, "weights"), (128, 4, 1, 64, "weights"), 32),
             "weights ahead, block M 32": ((128, 4, 1, 64, "weights-ahead"), (128, 4, 1, 64, "weights-ahead"), 32)}
    errors = {}
    for name, (gate_up_tiles, down_tiles, block_m) in forms.items():
        got = quantized_major.experts_quantized_major(
            x.to(device, torch.bfloat16), ids.to(device), slots, land, pool, pool, "q4_k", "q4_k", inter, experts,
            gate_up_tiles, down_tiles, block_m=block_m).cpu()
        errors[name] = ((got - want).norm() / want.norm()).item()
    return {"check": "q4_k expert-major kernels' tile forms vs the fp32 reference", "relative_errors": errors,
            "ok": all(error <= 2e-2 for error in errors.values())}


def check_dp4a(device: str = "cuda:0", hidden: int = 2048, inter: int = 768, experts: int = 16,
               top_k: int = 8) -> dict:
    """The Q4_K GEMVs' dp4a form (int8 inputs, the inline `dp4a`) at Qwen3-VL-30B-A3B's shapes against its twin
    on the CPU (the inputs rounded the same way, the dequantized weights in fp32), directly and through a table
    row, and, for scale, against the exact fp32 reference. Its inputs' rounding is the twin's, so the two differ
    by fp32 sums in another order, and by an int8 value off by one where the GPU's division rounds a tie the
    other way: the bound (1e-3 of the outputs' norm) is far below what a wrong byte or scale moves (percents)."""
    from vismmoe_kt.runtime.kernels import q4k_dp4a, quantized_gemv

    gen = torch.Generator().manual_seed(0)
    store = ExpertStore(experts, hidden, inter, torch.float32, False, fmt="q4_k")
    store.fill_layer(0, torch.randn(experts, 2 * inter, hidden, generator=gen) / 50,
                     torch.randn(experts, hidden, inter, generator=gen) / 50)
    pool = store.layers[0].to(device)  # slab e holds expert e
    x = torch.randn(2, hidden, generator=gen)
    ids = torch.randperm(experts, generator=gen)[:2 * top_k]  # two tokens, top_k distinct experts each
    dequantize = lambda e: store.dequantized(store.layers[0][e], 0)  # noqa: E731
    twin = q4k_dp4a.dp4a_reference(x, ids, dequantize, top_k, torch.nn.functional.silu)
    exact = q4k_dp4a.dp4a_reference(x, ids, dequantize, top_k, torch.nn.functional.silu, gate_up_int8=False,
                                    down_int8=False)  # nothing rounded: the fp32 reference
    relative = lambda got, want: ((got - want).norm() / want.norm()).item()  # noqa: E731
    config = (4, 1, "dp4a")
    direct = quantized_gemv.quantized_experts(x.to(device), ids.to(device), pool, "q4_k", "q4_k", inter, hidden, top_k,
                                              config).cpu()
    table_row = torch.arange(experts - 1, -1, -1, device=device)  # slab experts - 1 - e holds expert e
    by_table = quantized_gemv.quantized_experts(x.to(device), ids.to(device), pool.flip(0).contiguous(), "q4_k", "q4_k",
                                                inter, hidden, top_k, config, table_row=table_row).cpu()
    row = {"check": "q4_k dp4a GEMVs vs their twin", "config": list(config),
           "relative_error_vs_twin": relative(direct, twin), "through_a_table_row": relative(by_table, twin),
           "twin_vs_exact": relative(twin, exact), "kernel_vs_exact": relative(direct, exact)}
    row["ok"] = row["relative_error_vs_twin"] <= 1e-3 and row["through_a_table_row"] <= 1e-3
    return row


def check_prune_reads(model_dir: Path) -> dict:
    """The default rules' prune of a picture prompt's visual tokens, from its host facts, under CUDA's sync debug
    mode set to error from the prune's start to the first pruned layer: any read back from the device there raises
    (the CPU's test sees the ops it dispatches; this sees what only CUDA makes wait: pageable copies, sorts, scalar
    reads inside ops). The prompt runs twice (its first picture of this size runs the tower eagerly)."""
    from vismmoe_kt.engine.decoding import decode_engine

    spec = SPECS["tiny-6x64"]
    layer = spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4
    model, processor = load(model_dir, "optimize_rules/qwen3vl.yaml", progress=False, expert_budget=2 * layer,
                            miss_policy="wait")
    forward = model.vismmoe.context.text_forward
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (224, 224, 3), dtype=np.uint8))
    inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], "cuda:0")
    keep_for_real, watched, errors = forward._keep, [], []

    def keep(visual, prefix, host):
        watched.append(host is not None)
        torch.cuda.set_sync_debug_mode("error")  # until the first pruned layer starts
        return keep_for_real(visual, prefix, host)

    forward._keep = keep
    hook = forward.layers[forward._prune_at()].register_forward_pre_hook(
        lambda *_: torch.cuda.set_sync_debug_mode("default"))
    try:
        with torch.inference_mode():
            for _ in range(2):
                try:
                    generate(model, inputs, 2)
                except RuntimeError as exc:  # where in the package it waited: the error alone does not say
                    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "vismmoe_kt" in f.filename]
                    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
                    errors.append(str(exc).splitlines()[0][:200] + where)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                decode_engine(model).forget()  # the prompt again, whole
    finally:
        hook.remove()
        forward._keep = keep_for_real
    pruned = forward.counters.pruned_prefills
    return {"check": "the default rules' prune from a picture prompt's host facts, CUDA sync debug mode: error",
            "prompts": len(watched), "from_host_facts": watched, "pruned_prefills": pruned, "errors": errors,
            "ok": not errors and watched == [True, True] and pruned == 2}


def check_reservations(model_dir: Path, tokens: int = 40, device: str = "cuda:0") -> dict:
    """Table decode's landing reservations on the GPU, graphed, at two layers' budget (every step misses somewhere):
    before-step, ahead, and `auto`'s trial changing ways between the steps of one decode (two timed steps a way,
    then the faster for good), then `eviction: auto`'s trial keeping lru on a fake clock (the steps recaptured
    without the router's averages), the same greedy tokens from each; both trials decided; each decode, stopped, leaves
    the cache whole (no reservation left, every pair counted once). How many steps were launched ahead of the
    host's read is reported (the engine chains table steps). `device` cpu: a dry run."""
    from vismmoe_kt.engine.decoding import decode_engine
    from vismmoe_kt.runtime.eviction import EvictionTrial
    from vismmoe_kt.runtime.reservations import ReservationsTrial

    class LruFaster:
        """The eviction trial's clock, read at each step's start: the step before took 20 ms under lru, 30 under
        VisMMOE's ranking (the arm still current when it is read)."""
        def __init__(self):
            self.now, self.trial = 0.0, None

        def __call__(self) -> float:
            self.now += 0.020 if self.trial.current.name == "lru" else 0.030
            return self.now

    spec = SPECS["tiny-6x64"]
    layer = spec.experts * 3 * spec.moe_intermediate * spec.hidden * 4
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (224, 224, 3), dtype=np.uint8))
    runs = {}
    for way in ("before-step", "ahead", "auto"):
        model, processor = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", progress=False, expert_budget=2 * layer,
                                reservations="before-step" if way == "auto" else way,
                                graphs="cuda" if device != "cpu" else "replay", generate_device=device,
                                prefill_device=device)
        runtime = model.vismmoe.context.offload_runtime
        if way == "auto":  # what `auto` plans on a GPU, with a short trial so that it decides within the decode
            runtime.boundary.reservations = ReservationsTrial(samples=2)
            # and the default rules' eviction trial after it, on a clock that makes lru faster: once lru is kept the
            # steps stop averaging the router and are captured anew (graph_variant) in the middle of the decode
            clock = LruFaster()
            eviction = clock.trial = runtime.boundary.eviction = EvictionTrial(samples=2, clock=clock)
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], device)
        with torch.inference_mode():
            out = generate(model, inputs, tokens, min_new_tokens=tokens).cpu()  # no EOS cuts a trial short
        summary, variant = runtime.summary(), runtime.graph_variant()
        counters = runtime.counters["decode"].values()
        offloaded = len(runtime.offloaded_layers())
        with runtime.lock:  # the decode stops here: its reservations go back, the cache must be whole
            runtime.boundary.leave()
        runtime.cache.check_invariants()
        sound = not [key for key in runtime.cache.where if key[1] < 0] and \
            sum(c.hits + c.misses + c.late for c in counters) == sum(c.calls for c in counters) * spec.top_k and \
            sum(c.calls for c in counters) % offloaded == 0
        runs[way] = (out, runtime.plan.reservations, summary["reservations"], sum(c.misses for c in counters), sound,
                     decode_engine(model).stats()["steps_ahead"])
    same = all(torch.equal(runs[way][0], runs["before-step"][0]) for way in runs)
    decided = "auto: kept" in runs["auto"][2] and not eviction.reads_usage and variant == " without router averages"
    return {"check": "table decode's reservations before-step, ahead and auto's trial changing ways mid-decode, then "
                     "eviction auto keeping lru, graphed",
            "tokens_equal": same, "plans": [runs[way][1] for way in runs], "auto": runs["auto"][2],
            "eviction": eviction.describe(), "variant_after": variant,
            "decode_misses": [runs[way][3] for way in runs], "cache_sound": [runs[way][4] for way in runs],
            "steps_launched_ahead": [runs[way][5] for way in runs],
            "ok": same and decided and runs["ahead"][1] == "ahead" and min(r[3] for r in runs.values()) > 0
            and all(r[4] for r in runs.values())}


def check_streamed(model_dir: Path, spec, layer: int, image, results: list[dict]) -> bool:
    """BF16, Q4_K slabs for 40 of the two offloaded layers' 64 experts: the prompt streams each next offloaded
    layer in while the one before computes (the first, whole, while the pinned layer computes: computed from its
    slabs unread; the second, which the slabs cannot hold beside the first, placed after its routing's read),
    each offloaded layer computed from the slabs in place (the quantized expert-major kernels, no bank decoded);
    its logits against the same prompt on the GPU with dequantized slabs (the same Q4_K weights in BF16 slabs:
    what the kernels compute, by other kernels), and, for scale, against the CPU twin's. A BF16 forward of this tiny
    model moves its logits by percents: 3.8% between the H100's kernels and the CPU twin (2026-12-05), 1.8%
    between quantized and dequantized slabs on the CPU alone; a wrong expert or slab moves them by their own
    size. So the bound (5%) catches the kernels reading wrong blocks; their rounding is held by the kernel tests
    and prefill_kernel_bench's error against the dequantized weights (5.3e-3 at full size)."""
    block = ExpertStore(spec.experts, spec.hidden, spec.moe_intermediate, torch.float32, False, fmt="q4_k").block_bytes
    runs = {}
    for device, slabs in (("cpu", "quantized"), ("cuda:0", "dequantized"), ("cuda:0", "quantized")):
        model, processor = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", progress=False, dtype="bfloat16",
                                store_dtype="q4_k", slab_format=slabs,
                                # quantized: one layer pinned as its blocks; dequantized: nothing pinned (lru: a
                                # pinned bank would hold the unquantized weights), 64 BF16 slabs
                                expert_budget=(spec.experts + 40) * block if slabs == "quantized" else layer,
                                **(dict(pinned_layers=1) if slabs == "quantized" else dict(policy="lru")),
                                generate_device=device, prefill_device=device)
        runtime = model.vismmoe.context.offload_runtime
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], device)
        with torch.inference_mode():
            logits = model(**inputs).logits.float().cpu()
        summary = runtime.summary()
        runs[device, slabs] = logits, runtime.plan, summary["prefill_prefetches"], summary["prefill_fetches"], \
            runtime.host_reads
        del model
    (cpu_logits, *_), (bank_logits, *_) = runs["cpu", "quantized"], runs["cuda:0", "dequantized"]
    logits, plan, prefetches, misses, reads = runs["cuda:0", "quantized"]
    error = ((logits - bank_logits).norm() / bank_logits.norm()).item()
    row = {"store": "q4_k", "slabs": "quantized, 40 of 64 (streamed prefill, BF16)", "prefill": plan.prefill,
           "prefill_kernels": plan.prefill_kernels, "relative_logit_error_vs_gpu_banks": error,
           "relative_logit_error_vs_cpu": ((logits - cpu_logits).norm() / cpu_logits.norm()).item(),
           "gpu_banks_vs_cpu": ((bank_logits - cpu_logits).norm() / cpu_logits.norm()).item(),
           "prefill_prefetches": prefetches, "prefill_fetches": misses, "prefill_host_reads": reads}
    results.append(row)
    print(json.dumps(row), flush=True)
    return plan.prefill == "streamed" and plan.prefill_kernels and error <= 5e-2 and prefetches > 0 and reads == 1


def check_settled(model_dir: Path, spec, layer: int, image, results: list[dict]) -> bool:
    """Q4_K slabs for every offloaded expert, filled as the first prompt starts: its offloaded layers read
    their experts through the row maps (the expert-major kernels; no routing read back), decode is settled
    (its steps read the slabs straight from the table, the GEMVs looking each pair's slab up themselves);
    greedy tokens equal the CPU twin's, nothing read from the host in the second answer."""
    block = ExpertStore(spec.experts, spec.hidden, spec.moe_intermediate, torch.float32, False, fmt="q4_k").block_bytes
    runs = {}
    for device in ("cpu", "cuda:0"):
        model, processor = load(model_dir, "optimize_rules/qwen3vl-offload.yaml", progress=False, store_dtype="q4_k",
                                slab_format="quantized", expert_budget=(3 * spec.experts + 2) * block,
                                pinned_layers=1, generate_device=device, prefill_device=device)
        runtime = model.vismmoe.context.offload_runtime
        inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], device)
        assert runtime.plan.fill_slabs  # the budget holds every offloaded expert: the first decode start fills them
        with torch.inference_mode():
            generate(model, inputs, 8)
            reads = runtime.summary()["bytes_host_reads_decode"]
            tokens = generate(model, inputs, 8).cpu()
        runs[device] = (tokens, runtime.table.settled, runtime.summary()["bytes_host_reads_decode"] - reads,
                        runtime.plan.prefill, runtime.summary()["host_reads"])
    (cpu_tokens, *_), (tokens, settled, reads, prefill, routing_reads) = runs["cpu"], runs["cuda:0"]
    # the prompts' offloaded layers on the filled slabs: the expert-major kernels here, the torch twin on the CPU
    row = {"store": "q4_k", "slabs": "quantized, every offloaded expert (settled)", "settled": settled,
           "greedy_tokens_equal": torch.equal(tokens, cpu_tokens), "decode_host_read_bytes": reads,
           "prefill": prefill, "routing_reads": routing_reads}
    results.append(row)
    print(json.dumps(row), flush=True)
    return settled and row["greedy_tokens_equal"] and reads == 0 and prefill == "filled-slabs" and routing_reads == 0


def finish(results: list[dict], ok: bool, out: str | None) -> int:
    """Write the rows (with the device's name) to `out`, say OK or MISMATCH, and return the exit status."""
    if out:
        Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "results": results}, indent=2))
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def check_gpu_prefill(out: str | None) -> int:
    spec = SPECS["tiny-3x32"]
    model_dir = save_tiny_model(Path(tempfile.mkdtemp()) / "tiny-3x32", spec, seed=0)
    images = [Image.fromarray(np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8))
              for seed in (0, 1)]
    results, ok = [], True
    for fmt, share in [(f, s) for f in ("model", "q8_0", "q4_k") for s in (1.0, 0.5, "auto")]:
        runs = {}
        for device in ("cpu", "cuda:0"):
            model, processor = load(model_dir, "optimize_rules/qwen3vl-kt-cpu.yaml", progress=False, cpu_backend="torch",
                                    gpu_prefill_tokens=2, gpu_prefill_format=fmt, gpu_prefill_share=share,
                                    generate_device=device, prefill_device=device)
            logits, tokens = [], []
            for image in images:  # the second prompt finds its first layer staged after the first's last
                inputs = build_inputs(processor, [user_turn("Describe the image.", 1)], [image], device)
                with torch.inference_mode():
                    logits.append(model(**inputs).logits.float().cpu())
                    tokens.append(generate(model, inputs, 6).cpu())
            runs[device] = logits, tokens, collect_stats(model)["operators"]["CpuExperts"]
        (cpu_logits, cpu_tokens, _), (logits, tokens, stats) = runs["cpu"], runs["cuda:0"]
        error = max(((a - b).norm() / b.norm()).item() for a, b in zip(logits, cpu_logits))
        same = all(torch.equal(a, b) for a, b in zip(tokens, cpu_tokens))
        # a fixed split is the twin's arithmetic (Q4_K's dequantizing kernel differs from torch's in rounding:
        # 1.3e-4 on the H200). An automatic share follows the measured rates, which the twin has not: its split
        # differs from the twin's, so with a quantized copy some experts are exact on one side and quantized on
        # the other (1e-2 to 5e-2 on the H200, 2026-12-01); the greedy tokens must still agree
        tolerance = 3e-4 if share != "auto" or fmt == "model" else 0.1
        good = error <= tolerance and same and stats["gpu_prefill_layers"] == 4 * spec.layers
        ok &= good
        row = {"format": fmt, "share": share, "relative_logit_error_vs_cpu": error, "tolerance": tolerance,
               "greedy_tokens_equal": same,
               **{k: v for k, v in stats.items() if k.startswith("gpu_prefill")}}
        results.append(row)
        print(json.dumps(row), flush=True)
    return finish(results, ok, out)


if __name__ == "__main__":
    sys.exit(main())
