"""Our operators under KTransformers' own loading loop, not ours.

Below is a faithful copy of upstream's `optimize_and_load_gguf` path for a safetensors directory
(archive/ktransformers: optimize/optimize.py `gen_optimize_config` + `inject` + `del_meta`,
util/utils.py `load_weights` + `load_cur_state_dict` + `set_module`, util/custom_loader.py
`SafeTensorLoader`), minus its prints and its NPU/GGUF branches. Its loader has no `context`: the
operators must make their shared state themselves. The model loaded this way must answer like the
reference model and like our own loader.
"""

import copy
import itertools
import os
import re

import pytest
import torch
import yaml
from safetensors import safe_open
from torch import nn

from vismmoe_kt import load
from vismmoe_kt.core.context import LoadContext


class SafeTensorLoader:  # upstream util/custom_loader.py, the parts the loop uses
    def __init__(self, file_path):
        self.file_handle_map, self.tensor_file_map, self.tensor_device_map = {}, {}, {}
        for root, _, files in os.walk(file_path):
            for file in sorted(files):
                if file.endswith(".safetensors"):
                    handle = safe_open(os.path.join(root, file), framework="pt")
                    self.file_handle_map[file] = handle
                    for key in handle.keys():
                        self.tensor_file_map[key] = file

    def has_tensor(self, key):
        return key in self.tensor_file_map

    def load_tensor(self, key, device="cpu"):
        if key not in self.tensor_file_map:
            raise KeyError(f"Key {key} not found in Safetensor files")
        return self.file_handle_map[self.tensor_file_map[key]].get_tensor(key).to(device)

    load_dequantized_tensor = load_tensor


def set_module(model, submodule_key, module):  # upstream util/utils.py
    tokens = submodule_key.split(".")
    cur_mod = model
    for s in tokens[:-1]:
        cur_mod = getattr(cur_mod, s) if hasattr(cur_mod, s) else cur_mod[int(s)]
    if hasattr(cur_mod, tokens[-1]):
        setattr(cur_mod, tokens[-1], module)
    else:
        cur_mod[int(tokens[-1])] = module


def get_device(key, device_map):
    return device_map[key]["generate_device"] if key in device_map else "cuda"


def load_cur_state_dict(module, loader, prefix="", device="cuda"):
    prefix = prefix.replace("orig_module.", "")
    persistent = {k: v for k, v in module._buffers.items() if k not in module._non_persistent_buffers_set}
    local_state = {k: v for k, v in itertools.chain(module._parameters.items(), persistent.items()) if v is not None}
    for name, param in local_state.items():
        key = prefix + name
        if not loader.has_tensor(key):
            raise Exception(f"can't find {key} in GGUF file!")
        device = get_device(key[:key.rfind(".")], loader.tensor_device_map)
        weights = loader.load_dequantized_tensor(key, device=device).to(dtype=torch.get_default_dtype())
        module.register_parameter(name, nn.Parameter(weights, requires_grad=False))


def load_weights(module, loader, prefix="", device="cuda"):
    from vismmoe_kt.operators.base import BaseInjectedModule  # upstream: base_operator.BaseInjectedModule

    if not isinstance(module, BaseInjectedModule):
        load_cur_state_dict(module, loader, prefix, device=device)
        for name, child in module._modules.items():
            load_weights(child, loader, prefix + name + ".", device=device)
    else:
        module.load()


def inject(module, local_optimization_dict, model_config, gguf_loader, prefix=""):  # upstream optimize.py
    for name, child in module._modules.items():
        if child is None:
            continue
        child_prefix = prefix + name
        if child_prefix in local_optimization_dict:
            meta = local_optimization_dict[child_prefix]
            gguf_loader.tensor_device_map[meta["key"]] = meta["kwargs"] if "kwargs" in meta else dict()
            if meta["class"] != "default":
                path = meta["class"].split(".")
                module_cls = getattr(__import__(".".join(path[:-1]), fromlist=[""]), path[-1])
                inject_module = module_cls(key=meta["key"], gguf_loader=gguf_loader, config=model_config,
                                           orig_module=child, **meta["kwargs"])
                set_module(module, name, inject_module)
            child_prefix += "."
            child_dict = {k: v for k, v in local_optimization_dict.items() if k.startswith(child_prefix)}
            inject(child, child_dict, model_config, gguf_loader, child_prefix)


def del_meta(module):
    persistent = {k: v for k, v in module._buffers.items() if k not in module._non_persistent_buffers_set}
    local_state = {k: v for k, v in itertools.chain(module._parameters.items(), persistent.items()) if v is not None}
    for name, param in local_state.items():
        if param.device == torch.device("meta"):
            module.__delattr__(name)
    for child in module._modules.values():
        del_meta(child)


def gen_optimize_config(module, out_data, rule_list, prefix="", default_device="cuda:0"):
    module_name = prefix[:-1]
    recursive = True
    for rule in rule_list:
        match_meta = rule["match"]
        if "class" in match_meta:
            path = match_meta["class"].split(".")
            if not isinstance(module, getattr(__import__(".".join(path[:-1]), fromlist=[""]), path[-1])):
                continue
        if "name" in match_meta and re.search(match_meta["name"], module_name) is None:
            continue
        replace_meta = rule["replace"]
        if module_name not in out_data:
            out_data[module_name] = {"key": module_name, "class": replace_meta.get("class", "default"),
                                     "kwargs": copy.deepcopy(replace_meta.get("kwargs", {}))}
        else:
            if out_data[module_name]["class"] == "default":
                out_data[module_name]["class"] = replace_meta.get("class", "default")
            out_data[module_name]["kwargs"].update(copy.deepcopy(replace_meta.get("kwargs", {})))
        if "recursive" in rule:
            recursive = bool(rule["recursive"])
        break
    if module_name not in out_data:
        out_data[module_name] = {"class": "default", "key": module_name,
                                 "kwargs": {"generate_device": default_device, "prefill_device": default_device}}
    if recursive:
        for name, child in module._modules.items():
            if child is not None:
                gen_optimize_config(child, out_data, rule_list, prefix + name + ".", default_device=default_device)


def optimize_and_load(module, rule_list, path, model_config, default_device):
    optimize_config = {}
    gen_optimize_config(module, optimize_config, rule_list, default_device=default_device)
    weights_loader = SafeTensorLoader(path)
    with torch.device("meta"):
        inject(module, optimize_config, model_config, weights_loader)
    load_weights(module.lm_head, weights_loader, "lm_head.", device=default_device)
    load_weights(module, weights_loader, device=default_device)
    module.gguf_loader = weights_loader
    del_meta(module)


@pytest.mark.parametrize("rule_file,overrides", [
    ("optimize_rules/qwen3vl-offload.yaml", ""), ("optimize_rules/qwen3vl-kt-cpu.yaml", ""),
    ("optimize_rules/qwen3vl-realb.yaml", ""), ("optimize_rules/qwen3vl-realb.yaml", "eplb"),
    ("optimize_rules/qwen3vl.yaml", "")])
def test_operators_load_and_run_under_upstream_loop(rule_file, overrides, tiny_dir, reference, image_inputs):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, Qwen3VLMoeForConditionalGeneration

    from vismmoe_kt.engine.generation import generate

    text = open(rule_file).read().replace('"cuda:0"', '"cpu"')
    if overrides == "eplb":  # the replication baseline builds its placement at construction
        text = text.replace("mode: realb", "mode: eplb")
    text = text.replace('expert_budget: "16GiB"', "expert_budget: 1179648")  # 1 pinned layer + 1 of slabs: offloaded layers
    rules = yaml.safe_load(text)
    config = AutoConfig.from_pretrained(tiny_dir, local_files_only=True)
    with init_empty_weights(include_buffers=False):  # rotary frequencies are computed, not stored
        model = Qwen3VLMoeForConditionalGeneration._from_config(config)
    model.tie_weights()
    optimize_and_load(model, rules, str(tiny_dir), config, "cpu")
    model.eval()
    context = model.gguf_loader.context  # the operators made it on upstream's loader
    assert isinstance(context, LoadContext)
    ours, _ = load(tiny_dir, rules, generate_device="cpu", prefill_device="cpu", progress=False)
    ref_model, _ = reference
    with torch.no_grad():
        upstream_logits = model(**image_inputs).logits
        ours_logits = ours(**image_inputs).logits
        ref_logits = ref_model(**image_inputs).logits
    assert (upstream_logits - ours_logits).abs().max().item() <= 1e-6
    if "realb" not in rule_file and rule_file != "optimize_rules/qwen3vl.yaml":  # FP4 switching, token pruning
        assert (upstream_logits - ref_logits).abs().max().item() <= 1e-5
    with torch.no_grad():  # the engine finds the context on upstream's loader too
        tokens = generate(model, image_inputs, 4)
        expected = generate(ours, image_inputs, 4)
    assert torch.equal(tokens, expected)
    if context.text_model is not None:
        assert context.decode_state is not None and context.decode_state.stats()["steps"] == 3
