"""The load context is typed (core/context.py): no field is `Any`, and each object a field holds
satisfies the protocol the field names (core/expert_runtime.py, core/context_parts.py), member by member
with compatible signatures (structural: the implementations do not import the protocols)."""

import dataclasses
import inspect
import re
import typing

import pytest
from torch import nn

from vismmoe_kt.core.context import LoadContext
from vismmoe_kt.core.context_parts import DecodeState, PrefillForward, RoutingTable, SaliencySource
from vismmoe_kt.core.expert_runtime import ExpertRuntime
from vismmoe_kt.engine.decoding import Decoding
from vismmoe_kt.operators.routing_source import RoutingSource
from vismmoe_kt.engine.text_forward import TextForward
from cpu_kernels.base import CpuExpertBackend
from vismmoe_kt.runtime.layerwise_prefill import LayerwisePrefill
from vismmoe_kt.runtime.offload import OffloadRuntime
from vismmoe_kt.vision.saliency import SaliencyRecorder

# the names core/context.py imports for type checking only (runtime/ classes, not imported at run time)
CHECKING_ONLY = {"OffloadRuntime": OffloadRuntime, "CpuExpertBackend": CpuExpertBackend,
                 "LayerwisePrefill": LayerwisePrefill}


def mentions_any(hint) -> bool:
    return hint is typing.Any or any(mentions_any(arg) for arg in typing.get_args(hint))


def test_no_field_of_the_load_context_is_any():
    written = {f.name: f.type for f in dataclasses.fields(LoadContext)}
    assert len(written) == 21
    assert not [name for name, text in written.items() if "Any" in re.findall(r"\w+", str(text))]
    bare = [name for name, text in written.items() if re.fullmatch(r"(list|dict|tuple|set|object)", str(text))]
    assert not bare, f"containers without their element types: {bare}"
    hints = typing.get_type_hints(LoadContext, localns=CHECKING_ONLY)  # every name resolves
    assert set(hints) == set(written)
    assert not [name for name, hint in hints.items() if mentions_any(hint)]


def test_the_context_fields_name_the_protocols():
    hints = typing.get_type_hints(LoadContext, localns=CHECKING_ONLY)
    assert hints["offload_runtime"] == ExpertRuntime | None
    assert hints["saliency"] == SaliencySource | None and hints["text_forward"] == PrefillForward | None
    assert hints["decode_state"] == DecodeState | None and hints["routing"] == RoutingTable | None


def protocol_members(protocol: type) -> dict[str, object]:
    """The protocol's own members: methods, properties and data annotations (no typing internals)."""
    members = {name: value for name, value in vars(protocol).items()
               if (not name.startswith("_") or name == "__call__") and (callable(value) or isinstance(value, property))}
    members.update({name: None for name in vars(protocol).get("__annotations__", {})})
    return members


def incompatibilities(protocol: type, implementation: type, instance: object = None) -> list[str]:
    """What keeps `implementation` from satisfying `protocol`: a missing member, or a method whose
    parameters do not take every call the protocol allows (names, kinds, defaults; extra parameters
    need defaults)."""
    wrong = []
    for name, wanted in protocol_members(protocol).items():
        if wanted is None:  # a data member: on the class, or set on an instance
            if not hasattr(implementation, name) and not hasattr(instance, name):
                wrong.append(f"{name}: missing")
            continue
        if not hasattr(implementation, name):
            wrong.append(f"{name}: missing")
            continue
        have = inspect.getattr_static(implementation, name)
        if isinstance(wanted, property):
            if not isinstance(have, property):
                wrong.append(f"{name}: a property in the protocol, a {type(have).__name__} here")
            continue
        if not callable(have) or isinstance(have, property):
            wrong.append(f"{name}: a method in the protocol, not here")
            continue
        want_params = list(inspect.signature(wanted).parameters.values())[1:]  # without self
        have_params = {p.name: p for p in list(inspect.signature(have).parameters.values())[1:]}
        variadic = {p.kind for p in have_params.values() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        for p in want_params:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                if p.kind not in variadic:
                    wrong.append(f"{name}: takes no {p}")
                continue
            q = have_params.get(p.name)
            if q is None or q.kind != p.kind:
                wrong.append(f"{name}: parameter {p} is {q}")
            elif p.default is not p.empty and q.default is q.empty:
                wrong.append(f"{name}: parameter {p.name} needs a default")
        names = {p.name for p in want_params}
        extra = [q for q in have_params.values() if q.name not in names and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
                 and q.default is q.empty]
        if extra:
            wrong.append(f"{name}: extra parameters without defaults {[q.name for q in extra]}")
    return wrong


@pytest.mark.parametrize("protocol,implementation", [
    (ExpertRuntime, OffloadRuntime),  # context.offload_runtime, and every expert_set_runtimes entry (ERNIE's vision set)
    (PrefillForward, TextForward), (DecodeState, Decoding), (RoutingTable, RoutingSource)],
    ids=lambda item: item.__name__)
def test_each_implementation_satisfies_its_protocol(protocol, implementation):
    assert protocol_members(protocol)
    assert incompatibilities(protocol, implementation) == []


def test_the_saliency_recorder_satisfies_its_protocol():
    recorder = SaliencyRecorder(nn.Linear(2, 2), 1, lambda *args: None)
    assert incompatibilities(SaliencySource, SaliencyRecorder, recorder) == []


def test_the_check_sees_what_an_implementation_lacks():
    """The check itself can fail: a missing member, a renamed parameter, a lost default, an extra one."""
    class Broken:
        def begin_step(self, rows, extra): ...
        def prepare_steps(self, rows): ...
        def end_step(self, rows=1, *, strict): ...
        router_sink = property(lambda self: None)

    wrong = incompatibilities(ExpertRuntime, Broken)
    assert "graph_variant: missing" in wrong and "router_sink: a method in the protocol, not here" in wrong
    assert any(w.startswith("prepare_steps: parameter max_rows") for w in wrong)
    assert "begin_step: extra parameters without defaults ['extra']" in wrong

    class InitOnly:  # a data member set in __init__ only: seen on an instance, not on the class
        def __init__(self):
            self.enabled = False

        def take(self): ...

    assert incompatibilities(SaliencySource, InitOnly) == ["enabled: missing"]
    assert incompatibilities(SaliencySource, InitOnly, InitOnly()) == []
