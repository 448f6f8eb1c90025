"""SourceRouter: a routing source on a model's MoE routers, as a rule (`vismmoe-kt rules show --routing`) or put
on a loaded model (`install_routing`, what the benchmarks and `vismmoe-kt trace record` do).

The source itself (routing_source.py) makes each request's tables; this operator hands it every router call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.context import LoadContext
from ..errors import InputError
from ..models import ModelAdapter
from .base import BaseInjectedModule
from .routing_source import RoutingSource, affinity_of, parse_spec


class SourceRouter(BaseInjectedModule):
    """A MoE layer's router whose choice a routing source replaces: benchmarks route random weights by the
    synthetic router or a recorded trace (every expert still computes on the real weights), and `model`
    keeps the router's own choice (with `record`, for `vismmoe-kt trace record`). Rule kwargs: `routing`
    (model | synthetic[:SEED] | trace:PATH) and `record`; every SourceRouter of a model shares one source,
    the load context's `routing`, which the expert operators read for a predictor calibrated on synthetic
    routing."""

    def __init__(self, key: str, gguf_loader: Any, config: Any, orig_module: nn.Module, prefill_device: str = "cuda",
                 generate_device: str = "cuda", routing: str = "synthetic", record: bool = False, **kwargs: Any):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        source = self.context.routing
        if source is None:
            source = self.context.routing = make_source(routing, self.adapter, config, self.context, record)
        elif (source.spec, source.record) != (routing, record):
            raise ValueError(f"every SourceRouter of a model must name the same routing, got {routing!r} (record="
                             f"{record}) beside {source.spec!r} (record={source.record})")
        self.source, self.index = source, source.moe_index(self.adapter.layer_of(key))

    def forward(self, hidden: torch.Tensor) -> Any:
        return self.source.route(self.index, self.orig_module, hidden)


def make_source(spec: str, adapter: ModelAdapter, config: Any, context: LoadContext, record: bool = False) -> RoutingSource:
    """The routing source `spec` names (`model`, `synthetic[:SEED]`, `trace:PATH`)."""
    mode, argument = parse_spec(spec)
    trace = None
    if mode == "trace":
        from ..routing import TraceFormatError, load_trace

        try:
            trace = load_trace(argument)
        except (TraceFormatError, OSError) as exc:
            raise InputError(f"--routing {spec}: {exc}") from None
    source = RoutingSource(mode, adapter, config, context, seed=argument if mode == "synthetic" else 0,
                           trace=trace, record=record, affinity=affinity_of(spec))
    source.spec = spec
    return source


def install_routing(model: Any, spec: str, record: bool = False) -> RoutingSource:
    """Put a routing source on a loaded model: each MoE router replaced by a SourceRouter, as a rule would
    (`vismmoe-kt rules show --routing`), the modality pre-hooks on the decoder layers where the family needs
    them."""
    info = model.vismmoe
    adapter, context = info.adapter, info.context
    if context.routing is not None:
        raise InputError("this model has a routing source already")
    context.routing = source = make_source(spec, adapter, model.config, context, record)
    layers = adapter.decoder_layers(model)
    names = {id(module): name for name, module in model.named_modules()}
    holder = _ContextHolder(context)
    for layer in source.moe_layers:
        router = adapter.router(layers[layer])
        name = names[id(router)]
        parent, _, child = name.rpartition(".")
        device = next(router.parameters()).device
        operator = SourceRouter(name, holder, model.config, router, str(device), str(device), spec, record)
        setattr(model.get_submodule(parent), child, operator)
    source.watch_modality(layers)
    return source


class _ContextHolder:
    """What an operator reads its load context from, for operators put on a model after its load."""

    def __init__(self, context: LoadContext):
        self.context = context
