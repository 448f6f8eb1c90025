"""BaseInjectedModule: constructor contract, explicit attribute forwarding, upstream compatibility."""

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from vismmoe_kt.operators.base import HF_READ_ATTRIBUTES, BaseInjectedModule


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(5, 3)
        self.layer_idx = 7
        self.secret = "not forwarded"

    def forward(self, x):
        return self.embed_tokens(x)


def make(**kwargs):
    return BaseInjectedModule("model.part", None, None, Wrapped(), "cpu", "cpu", **kwargs)


def test_pass_through_forward_and_registered_original():
    op = make()
    x = torch.tensor([1, 2])
    assert torch.equal(op(x), op.orig_module(x))
    assert dict(op.named_children())["orig_module"] is op.orig_module
    assert {n for n, _ in op.named_parameters()} == {"orig_module.embed_tokens.weight"}


def test_listed_attributes_are_forwarded_to_the_original():
    op = make()
    assert "embed_tokens" in HF_READ_ATTRIBUTES and "layer_idx" in HF_READ_ATTRIBUTES
    assert op.embed_tokens is op.orig_module.embed_tokens
    assert op.layer_idx == 7


def test_unlisted_attributes_raise_a_clear_attribute_error():
    op = make()
    with pytest.raises(AttributeError, match=r"BaseInjectedModule \(replacing 'model.part'\) has no attribute 'secret'; it forwards only"):
        op.secret
    assert not hasattr(op, "secret")


def test_setting_an_attribute_sets_it_on_the_operator_only():
    op = make()
    op.layer_idx = 3
    assert op.layer_idx == 3 and op.orig_module.layer_idx == 7


def test_unknown_kwargs_are_rejected():
    with pytest.raises(TypeError, match=r"unexpected kwargs \['colour'\]"):
        make(colour="red")


def test_devices_and_key_are_kept():
    op = make()
    assert (op.key, op.prefill_device, op.generate_device, op.weights_device) == ("model.part", "cpu", "cpu", torch.device("cpu"))


@pytest.mark.slow
def test_operators_derive_from_upstream_base_when_upstream_is_importable(tmp_path):
    """With the upstream framework importable, its optimize_and_load_gguf accepts our operators."""
    fake = tmp_path / "ktransformers" / "operators"
    fake.mkdir(parents=True)
    (tmp_path / "ktransformers" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "base_operator.py").write_text(textwrap.dedent("""
        # upstream's constructor and bookkeeping (archive/ktransformers/operators/base_operator.py)
        from torch import nn
        class BaseInjectedModule(nn.Module):
            def __init__(self, key, gguf_loader, config, orig_module, prefill_device="cuda",
                         generate_device="cuda", **kwargs):
                nn.Module.__init__(self)
                nn.Module.__setattr__(self, "orig_module", orig_module)
                object.__setattr__(self, "key", key)
                object.__setattr__(self, "gguf_loader", gguf_loader)
                object.__setattr__(self, "config", config)
                object.__setattr__(self, "prefill_device", prefill_device)
                object.__setattr__(self, "generate_device", generate_device)
                object.__setattr__(self, "device", generate_device)
    """))
    script = textwrap.dedent("""
        import torch
        from ktransformers.operators.base_operator import BaseInjectedModule as Upstream
        from vismmoe_kt.operators.vis_experts import VisExperts
        from vismmoe_kt.operators.base import BaseInjectedModule
        assert issubclass(VisExperts, Upstream) and issubclass(BaseInjectedModule, Upstream)
        op = BaseInjectedModule("k", None, None, torch.nn.Linear(2, 2), "cpu", "cpu")
        assert op(torch.ones(1, 2)).shape == (1, 2) and op.device == "cpu"  # upstream's __init__ ran
        print("ok")
    """)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


class UpstreamStyleLoader:
    """Only what KTransformers' safetensors loader offers: load_tensor(key, device)."""

    def __init__(self, tensors):
        self.tensors, self.asked = tensors, []

    def load_tensor(self, key, device="cpu"):
        self.asked.append(key)
        return self.tensors[key].to(device)


def test_load_works_with_an_upstream_style_loader():
    source = Wrapped()
    tensors = {"model.part.embed_tokens.weight": source.embed_tokens.weight.detach().clone()}
    loader = UpstreamStyleLoader(tensors)
    with torch.device("meta"):
        target = Wrapped()
    op = BaseInjectedModule("model.part", loader, None, target, "cpu", "cpu")
    op.load()  # what upstream's load_weights calls on injected modules
    assert loader.asked == ["model.part.embed_tokens.weight"]  # no orig_module segment in the key
    assert torch.equal(op.orig_module.embed_tokens.weight, tensors["model.part.embed_tokens.weight"])
