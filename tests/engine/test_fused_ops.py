"""The decode step's fused ops (engine/fused_ops.py): the RMSNorm kernel against transformers' RMSNorm
formula (fp32 statistics, the weight applied in the input dtype), in Triton's interpreter and compiled
for Hopper; modules keep their own forward where the kernel does not serve them."""

import pytest
import torch

from vismmoe_kt.engine.fused_ops import fuse_norms, rms_norm

from conftest import UNDER_INTERPRETER, compile_for_hopper, run_in_triton_interpreter

SCRIPT = r"""
import torch
from vismmoe_kt.engine.fused_ops import _rms_norm_triton

torch.manual_seed(0)
# bfloat16 is not here: the interpreter converts it approximately (numpy has none); gpu_check.py checks it
for dtype in (torch.float32, torch.float16):
    for shape in ((3, 2048), (2, 5, 4, 128), (1, 100)):   # a hidden row, per-head rows, a width off the power of 2
        x = (torch.randn(shape) * 3).to(dtype)
        weight = (torch.rand(shape[-1]) + 0.5).to(dtype)
        hf = x.float()
        hf = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
        got = _rms_norm_triton(weight, 1e-6, x)
        assert got.dtype == hf.dtype and got.shape == hf.shape
        torch.testing.assert_close(got, hf, rtol=1e-6, atol=1e-6)
print("OK")
"""


def test_the_rms_norm_kernel_matches_transformers_formula_in_the_interpreter():
    run_in_triton_interpreter(SCRIPT)


@pytest.mark.skipif(UNDER_INTERPRETER, reason="the interpreter replaces the compiler")
def test_the_rms_norm_kernel_compiles_for_hopper():
    triton = pytest.importorskip("triton")
    from vismmoe_kt.engine import fused_ops

    for width, dtype in ((2048, "*bf16"), (128, "*bf16"), (128, "*fp32")):
        compile_for_hopper(fused_ops._rms_norm_kernel,
                           {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "row_stride": "i32", "eps": "fp32",
                            "N": "constexpr", "BLOCK": "constexpr"},
                           {"N": width, "BLOCK": triton.next_power_of_2(width)})


def test_on_the_cpu_norms_keep_their_own_forward_and_the_torch_path_matches():
    norm = torch.nn.RMSNorm(16, eps=1e-6)
    assert fuse_norms([norm], lambda n: (n.weight, n.eps)) == 0 and "forward" not in vars(norm)
    x = torch.randn(4, 16)
    torch.testing.assert_close(rms_norm(norm.weight, 1e-6, x), norm(x), rtol=1e-5, atol=1e-5)


def test_every_norm_a_prompt_runs_is_one_the_gpu_fuses(monkeypatch):
    """A prompt's layers are transformers' modules: each layer's input and post-attention RMSNorms, its
    attention's query and key ones and the final one are listed for the fused forward, and each is an
    RMSNorm the adapter gives parameters for (so on a GPU every one becomes one kernel). Forced as on a
    GPU here, a prompt's output is the unfused one's."""
    from vismmoe_kt.demo.tiny import SPECS, build_tiny_model
    from vismmoe_kt.engine import fused_ops
    from vismmoe_kt.engine.decoding import text_norms
    from vismmoe_kt.models import adapter_for

    spec = SPECS["tiny-4x16"]
    model, _ = build_tiny_model(spec, seed=0)
    adapter = adapter_for(model.config.model_type)
    text = model.model.language_model
    norms = list(text_norms(adapter, text))
    assert len(norms) == 4 * spec.layers + 1 and len({id(n) for n in norms}) == len(norms)
    assert all(adapter.rms_norm_params(n) is not None for n in norms)
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        before = text(input_ids=ids).last_hidden_state
        monkeypatch.setattr(fused_ops, "tl", object())  # as where Triton runs: every norm takes the fused forward
        monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
        monkeypatch.setattr(fused_ops, "_rms_norm_triton", lambda w, eps, x: w * torch.nn.functional.rms_norm(
            x.float(), (x.shape[-1],), eps=eps).to(x.dtype))
        assert fuse_norms(norms, adapter.rms_norm_params) == len(norms)
        monkeypatch.undo()
        after = text(input_ids=ids).last_hidden_state
    assert all("forward" in vars(n) for n in norms)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_the_fused_router_forward_returns_what_transformers_router_does():
    """A prompt's routers on the GPU (fuse_routers): the GEMM and the route kernel, whose torch twin runs here;
    the module's (logits, weights, ids) with the same values, and the CPU keeps the module's own forward."""
    from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

    from vismmoe_kt.engine.fused_ops import fuse_routers, routed_output
    from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter

    torch.manual_seed(0)
    router = Qwen3VLMoeTextTopKRouter(Qwen3VLMoeTextConfig(hidden_size=32, num_experts=24, num_experts_per_tok=6))
    torch.nn.init.normal_(router.weight)
    adapter = Qwen3VLMoeAdapter()
    weight, top_k = adapter.fused_router(router)
    assert weight is router.weight
    hidden = torch.randn(1, 9, 32)
    with torch.no_grad():
        want_logits, want_weights, want_ids = router(hidden)
        got_logits, got_weights, got_ids = routed_output(adapter, router, top_k, hidden)
    assert routed_output(adapter, router, top_k, hidden)[1].grad_fn is not None  # gradients: the module's own
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    assert torch.equal(got_ids, want_ids) and got_ids.dtype == want_ids.dtype
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=1e-7)
    assert got_weights.dtype == want_weights.dtype and torch.allclose(got_weights.sum(-1), torch.ones(9))
    assert fuse_routers([router, None], adapter) == 0 and "forward" not in vars(router)  # CPU weights
