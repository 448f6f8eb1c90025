"""A small hand-made module tree for rule-engine tests, and operators to inject into it."""

from torch import nn

from vismmoe_kt.operators.base import BaseInjectedModule


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


class Toy(nn.Module):
    """root: embed, layers.{0..11} (Block: attn, mlp.{0,1,2}), head"""

    def __init__(self, n_layers: int = 12):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer.mlp(layer.attn(h))
        return self.head(h)


class Scaled(BaseInjectedModule):
    """Multiplies the wrapped module's output: injection is visible in the result."""

    def __init__(self, key, gguf_loader, config, orig_module, prefill_device="cpu", generate_device="cpu",
                 factor: float = 2.0, tags=None, **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        self.factor = factor
        self.tags = tags

    def forward(self, x):
        return self.orig_module(x) * self.factor


class Exploding(BaseInjectedModule):
    def __init__(self, key, gguf_loader, config, orig_module, **kwargs):
        raise ValueError("this operator refuses every module")
