"""The engine imports no runtime and probes none: it reads `context.offload_runtime` only through
core/expert_runtime.py's ExpertRuntime protocol (which tests/core/test_context_types.py checks
OffloadRuntime against), never with hasattr/getattr or by reaching past the protocol to its fields."""

import ast
from pathlib import Path

from vismmoe_kt.core.expert_runtime import ExpertRuntime

ENGINE = Path(__file__).resolve().parents[2] / "vismmoe_kt" / "engine"
MEMBERS = {name for name in vars(ExpertRuntime) if not name.startswith("_")}


def is_runtime(node: ast.AST) -> bool:
    """`runtime`, `self.runtime`, `context.offload_runtime`, ...: an expression naming the expert runtime. A name in
    the plural (`context.expert_set_runtimes`) is a mapping of them: its own methods are the dict's, and each runtime
    taken from it is a name again (`for runtime in ...`), checked as one."""
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return "runtime" in name and not name.endswith("runtimes")


def engine_trees():
    return [(path.name, ast.parse(path.read_text(encoding="utf-8"))) for path in sorted(ENGINE.glob("*.py"))]


def test_the_engine_never_probes_the_runtime():
    probes = [f"engine/{name}:{node.lineno} {ast.unparse(node)}" for name, tree in engine_trees() for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
              and node.args and any(is_runtime(part) for part in ast.walk(node.args[0]))]
    assert not probes, "the engine probes the expert runtime (ask it through ExpertRuntime instead):\n" + "\n".join(probes)


def test_the_engine_uses_the_runtime_only_through_the_protocol():
    uses = [(name, node) for name, tree in engine_trees() for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and is_runtime(node.value)]
    assert len(uses) >= 6  # the decode step (prepare, begin and end, exact rows, router sink), prefill: it does talk to it
    outside = [f"engine/{name}:{node.lineno} .{node.attr}" for name, node in uses if node.attr not in MEMBERS]
    assert not outside, "the engine reads the expert runtime past its protocol:\n" + "\n".join(outside)


def test_the_probe_check_sees_a_probe():
    tree = ast.parse("ok = hasattr(context.offload_runtime, 'begin_step')\nrows = runtime.pinned\n"
                     "sets = context.expert_set_runtimes.values()")
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call))
    assert any(is_runtime(part) for part in ast.walk(call.args[0]))
    assert [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and is_runtime(n.value)] == ["pinned"]
