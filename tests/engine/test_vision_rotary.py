"""The vision encoder's rotary embedding (engine/vision_rotary.py): the torch form equals transformers'
apply_rotary_pos_emb_vision to the bit; the kernel equals the torch form in Triton's interpreter (head dims whose
halves are and are not powers of two, the projection's strided view) and compiles for Hopper."""

import pytest
import torch
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import apply_rotary_pos_emb_vision

from vismmoe_kt.engine.vision_rotary import rotate, rotate_torch

from conftest import UNDER_INTERPRETER, compile_for_hopper, run_in_triton_interpreter


def projection(patches, heads, head_dim, dtype, seed=0):
    torch.manual_seed(seed)
    qkv = (torch.randn(patches, 3 * heads * head_dim) * 2).to(dtype).reshape(patches, 3, heads, head_dim)
    angles = torch.rand(patches, head_dim // 2) * 20
    emb = torch.cat([angles, angles], -1)
    return qkv, emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_torch_form_equals_transformers_rotary_to_the_bit(dtype):
    qkv, cos, sin = projection(12, 4, 72, dtype)
    want_q, want_k = apply_rotary_pos_emb_vision(qkv[:, 0], qkv[:, 1], cos, sin)
    got = rotate(qkv, cos, sin)  # on the CPU: the torch form
    assert got.shape == (2, 12, 4, 72) and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got[0], want_q, rtol=0, atol=0)
    torch.testing.assert_close(got[1], want_k, rtol=0, atol=0)


SCRIPT = r"""
import torch
from vismmoe_kt.engine.vision_rotary import _rotate_triton, rotate_torch

# bfloat16 is not here: the interpreter converts it approximately (numpy has none); gpu_check.py checks it
for dtype in (torch.float32, torch.float16):
    for patches, heads, head_dim in ((7, 16, 72), (5, 4, 16), (3, 3, 8)):   # Qwen3-VL's 72: halves of 36
        torch.manual_seed(patches)
        qkv = (torch.randn(patches, 3 * heads * head_dim) * 2).to(dtype).reshape(patches, 3, heads, head_dim)
        angles = torch.rand(patches, head_dim // 2) * 20
        emb = torch.cat([angles, angles + 1], -1)   # halves unlike: each half's cos and sin read where they are
        cos, sin = emb.cos(), emb.sin()
        got = _rotate_triton(qkv, cos, sin)
        want = rotate_torch(qkv, cos, sin)
        assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert not torch.equal(got[0], got[1])   # the query and the key each from its own rows
print("OK")
"""


def test_the_rotary_kernel_equals_the_torch_form_in_the_interpreter():
    run_in_triton_interpreter(SCRIPT)


@pytest.mark.skipif(UNDER_INTERPRETER, reason="the interpreter replaces the compiler")
def test_the_rotary_kernel_compiles_for_hopper():
    from vismmoe_kt.engine import vision_rotary

    for dtype in ("*bf16", "*fp16"):
        compile_for_hopper(vision_rotary._rotary_kernel,
                           {"x_ptr": dtype, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": dtype, "row_stride": "i32",
                            "which_stride": "i32", "head_stride": "i32", "cos_stride": "i32", "sin_stride": "i32",
                            "S": "i32", "H": "constexpr", "HALF": "constexpr", "BLOCK_H": "constexpr",
                            "BLOCK_HALF": "constexpr"},
                           {"H": 16, "HALF": 36, "BLOCK_H": 16, "BLOCK_HALF": 64}, enable_fp_fusion=False)
