"""The families beyond Qwen3-VL-MoE that the shared tests (test_families.py, test_family_operators.py) run
over: each one's tiny model, rule files, and the prompts its cases use. A new family is a row here
(plus its own test file for what only it has: structure, checkpoint layout, processor)."""

from dataclasses import dataclass

import torch

from conftest import tiny_case

CPU = {"generate_device": "cpu", "prefill_device": "cpu", "progress": False}
TOKENS = 8


@dataclass(frozen=True)
class Family:
    spec: str                  # the tiny model (vismmoe_kt.demo.tiny.SPECS)
    rules: str                 # optimize_rules/<rules>.yaml, <rules>-offload.yaml, -realb, -ep, -kt-cpu
    image: tuple[int, int]     # the decode cases' picture (width, height)
    heavy_image: tuple[int, int]  # the operator cases': mostly visual tokens, so a small LB gate opens
    vision_saliency: str | None = None  # the vision tower's module name, where the adapter reads its attention
    moe_layers: int = 3        # of 4: layer 0 is dense in every tiny model here
    dense_layers: tuple[int, ...] = (0,)  # the others are MoE layers
    text_model: str = "model.language_model"  # the text model's module name
    router: str = "gate"       # the router's name beside the experts
    shared: str = "mlp.shared_experts"  # the shared experts' name in an MoE layer
    realb_in_decode: bool = True  # the ReaLB rule's operator runs in decode (ERNIE's is on the vision experts)
    ep_sees_image_rows: bool = True  # image tokens reach the experts the -ep rule spreads (ERNIE's: text experts only)
    kt_kernel_inter: int = 64  # the experts' width in the kt-kernel case (multiples of 32 for every expert set)


FAMILIES = {
    "glm4v": Family("tiny-glm-4x16", "glm4v", (160, 128), (448, 448), vision_saliency="^model\\.visual$"),
    # wider than a tile (192 px): a global view and local tiles
    "deepseek-ocr2": Family("tiny-dsocr2-4x16", "deepseek-ocr2", (320, 256), (320, 256)),
    "kimi-k25": Family("tiny-kimi-4x16", "kimi-k25", (160, 128), (224, 224)),
    # modality-separated experts: image tokens route to each layer's vision experts (VisionExperts, their own
    # runtime; ReaLB's rule puts its operator there only)
    "ernie45vl": Family("tiny-ernie-4x16", "ernie45vl", (160, 128), (448, 448), vision_saliency="^model\\.vision_tower$",
                        realb_in_decode=False, ep_sees_image_rows=False, kt_kernel_inter=96),
    # MoE layers interleaved with dense ones (1, 3 and 5); one expert per token, whose input the router's weight
    # scales (the adapter's pre-hook on the operators); complex rotary packed as (cos, sin); tiles of 112 px
    # (a global view beside the local tiles)
    "llama4": Family("tiny-llama4-6x16", "llama4", (160, 128), (224, 224), vision_saliency="^vision_model$",
                     dense_layers=(0, 2, 4), text_model="language_model.model", router="router",
                     shared="feed_forward.shared_expert", kt_kernel_inter=96),  # 64 = hidden: a layout the adapter refuses
}


def family_case(tmp_path_factory, family: Family, seed: int, question: str, image: tuple[int, int], image_seed: int,
                tokens: int = TOKENS):
    """(model dir, reference model, inputs, (reference logits, reference greedy tokens)) for one family."""
    model_dir, ref, inputs = tiny_case(tmp_path_factory, family.spec, seed, question, image, image_seed)
    with torch.no_grad():
        expected = (ref(**inputs).logits, ref.generate(**inputs, max_new_tokens=tokens, do_sample=False))
    return model_dir, ref, inputs, expected
