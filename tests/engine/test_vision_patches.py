"""A picture's patch embedding as one matrix product (engine/vision_patches.py): the Conv3d's values to fp32
rounding, installed only for convolutions that read whole patches, the module's own forward where gradients are
asked for; on a tiny Qwen3-VL model the tower's output is the convolution's."""

import torch
from torch import nn
from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import Qwen3VLMoeVisionConfig
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionPatchEmbed

from vismmoe_kt.engine.vision_patches import PatchProjection, install, is_patch_projection
from vismmoe_kt.models.qwen3_vl_moe import Qwen3VLMoeAdapter


def patch_embed(seed=0):
    config = Qwen3VLMoeVisionConfig(hidden_size=48, patch_size=4, temporal_patch_size=2, in_channels=3)
    torch.manual_seed(seed)
    return Qwen3VLMoeVisionPatchEmbed(config).eval()


def test_the_product_equals_the_convolution():
    module = patch_embed()
    pixels = torch.randn(10, 3 * 2 * 4 * 4)
    with torch.no_grad():
        want = module(pixels)
        projection = PatchProjection(module, Qwen3VLMoeAdapter().vision_patch_projection(module))
        got = projection(pixels)
    assert got.shape == want.shape == (10, 48) and projection.served == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    module.to(torch.bfloat16)
    with torch.no_grad():  # the input cast to the weights' dtype, as the module does
        got, want = projection(pixels), module(pixels)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_installed_on_the_patch_embedding_only_and_gradients_keep_the_module():
    module, other = patch_embed(), nn.Sequential(nn.Conv3d(3, 8, kernel_size=(2, 4, 4), stride=(1, 2, 2)))
    holder = nn.ModuleDict({"patches": module, "other": other})
    assert install(Qwen3VLMoeAdapter(), holder) == 1
    assert isinstance(vars(module)["forward"], PatchProjection) and "forward" not in vars(other[0])
    assert install(Qwen3VLMoeAdapter(), holder) == 0  # a replaced forward is left alone
    assert not is_patch_projection(other[0]) and not is_patch_projection(nn.Linear(4, 4))
    pixels = torch.randn(4, 96, requires_grad=True)
    module(pixels).sum().backward()  # with gradients: the module's own convolution
    assert module.forward.served == 0 and pixels.grad is not None


def test_a_tiny_qwen3_vl_tower_gives_the_convolutions_output():
    from vismmoe_kt.demo.tiny import SPECS, build_tiny_model

    model, processor = build_tiny_model(SPECS["tiny-2x8"], seed=0)
    model.eval()
    adapter = Qwen3VLMoeAdapter()
    tower = adapter.vision_tower(model)
    torch.manual_seed(0)
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, tower.patch_embed.proj.weight[0].numel())
    with torch.no_grad():
        want = tower(pixels, grid_thw=grid, return_dict=True).pooler_output
        assert install(adapter, model) == 1
        got = tower(pixels, grid_thw=grid, return_dict=True).pooler_output
    assert tower.patch_embed.forward.served == 1
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
