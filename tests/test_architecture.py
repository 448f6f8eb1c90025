"""The layout is the architecture: each folder of `vismmoe_kt` is one stage and imports point down.

Read from the source (nothing is imported): every `import` / `from ... import` of a module, at any
depth (imports inside functions count too), resolved to the room (top-level folder or module) it
names. A room may import only the rooms listed for it below; `apps` may import anything and nothing
imports `apps`. The packages beside `vismmoe_kt` below it (`cpu_kernels/`) are one room each, on the
lowest floor: they import nothing of `vismmoe_kt`. `benchmarks/` sits above the whole package: it may
import any of `vismmoe_kt` (and the standard and third-party libraries, nothing else of the
repository), and nothing in `vismmoe_kt` imports it. Outside `models/`, no code names a Hugging Face
attribute path: the family's adapter is asked instead.
"""

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vismmoe_kt"
BENCHMARKS = ROOT / "benchmarks"
BESIDE = ("cpu_kernels", "kernel_launch")  # top-level packages of the repository below vismmoe_kt: each is one room

# room -> the rooms it may import (besides itself); the order is the floors, lowest first
ALLOWED = {
    "cpu_kernels": set(),  # the CPU expert backends: nothing of vismmoe_kt, not even its errors
    "kernel_launch": set(),  # Triton launches without the JIT's per-call Python: nothing of vismmoe_kt
    "errors": set(),
    "routing": set(),
    "vision": {"errors"},
    "lb": {"errors"},
    "predictor": {"errors"},
    "runtime": {"errors", "cpu_kernels", "kernel_launch"},
    "models": {"errors"},
    "core": {"errors", "models", "runtime", "cpu_kernels"},
    "parallel": {"errors", "runtime", "lb", "core"},
    "engine": {"errors", "core", "models", "vision", "kernel_launch"},
    "operators": {"errors", "core", "models", "runtime", "lb", "vision", "parallel", "engine", "predictor",
                  "routing", "cpu_kernels"},
    "demo": {"errors", "models", "runtime"},
    "apps": None,  # anything
    "__init__": {"core", "engine"},  # the public API: load, generate, stats
    "__main__": {"apps"},             # `python -m vismmoe_kt` is the command line
}

# attribute names of Hugging Face modules (the model's structure) that only an adapter may name
HF_ATTRIBUTES = {
    "language_model", "self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "embed_tokens",
    "rotary_emb", "get_rope_index", "rope_deltas", "_deepstack_process", "visual", "lm_head", "gate_up_proj",
    "down_proj", "act_fn", "blocks", "variance_epsilon", "spatial_merge_size", "q_proj", "k_proj", "qkv",
}


def receiver(node: ast.Attribute) -> str:
    value = node.value
    return value.id if isinstance(value, ast.Name) else value.attr if isinstance(value, ast.Attribute) else ""


def names_hf_part(node: ast.Attribute) -> bool:
    """`x.mlp`, `layer.self_attn`, `model.visual`: yes; our own objects' fields (`self.lm_head`, a
    tuple's `data.visual`): no."""
    if receiver(node) == "self":
        return False
    if node.attr == "visual":  # also a common field name: the tower is `<something>.model.visual`
        return receiver(node).endswith("model")
    return True


@functools.cache
def modules() -> list[tuple[Path, ast.AST]]:
    return [(path.relative_to(PACKAGE), ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            for path in sorted(PACKAGE.rglob("*.py"))]


@functools.cache
def benchmark_modules() -> list[tuple[Path, ast.AST]]:
    """benchmarks/'s modules (not results/: raw records of past runs)."""
    return [(path.relative_to(ROOT), ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            for path in sorted(BENCHMARKS.rglob("*.py")) if path.relative_to(BENCHMARKS).parts[0] != "results"]


def absolute_imports(tree: ast.AST):
    """(line, top-level name) of every absolute import in this file, `importlib.import_module("x.y")` included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module.split(".")[0]
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name.split(".")[0]) for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
            yield node.lineno, str(node.args[0].value).split(".")[0]


@functools.cache
def beside_modules() -> list[tuple[Path, ast.AST]]:
    """The modules of the packages in BESIDE, their paths relative to the repository."""
    root = PACKAGE.parent
    return [(path.relative_to(root), ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
            for name in BESIDE for path in sorted((root / name).rglob("*.py"))]


def room_of(rel: Path) -> str:
    return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.name != "__init__.py" else "__init__"


def imported_rooms(rel: Path, tree: ast.AST, package: str = "vismmoe_kt"):
    """(line, room) of every import of a vismmoe_kt module or a BESIDE package in this file (`rel`:
    its path inside `package`)."""
    here = [package, *rel.parts[:-1]]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                target = base + (node.module.split(".") if node.module else [])
                names = [alias.name for alias in node.names] if not node.module and len(target) == 1 else []
            elif (node.module or "").split(".")[0] in ("vismmoe_kt", *BESIDE):
                target = node.module.split(".")
                names = [alias.name for alias in node.names] if len(target) == 1 else []
            else:
                continue
            if target[0] in BESIDE:
                yield node.lineno, target[0]
                continue
            if len(target) > 1:
                yield node.lineno, target[1]
            for name in names:  # `from .. import errors` names rooms directly
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in BESIDE:
                    yield node.lineno, parts[0]
                elif parts[0] == "vismmoe_kt" and len(parts) > 1:
                    yield node.lineno, parts[1]


def test_every_room_is_known():
    rooms = {room_of(rel) for rel, _ in modules()} | {rel.parts[0] for rel, _ in beside_modules()}
    assert rooms == set(ALLOWED), f"rooms without a rule: {rooms - set(ALLOWED)}; rules without a room: {set(ALLOWED) - rooms}"


def test_imports_point_down():
    wrong = []
    for rel, tree in modules():
        room = room_of(rel)
        allowed = ALLOWED[room]
        for line, target in imported_rooms(rel, tree):
            if target == room or (allowed is None and target != "__init__"):
                continue
            if (target == "apps" and room != "__main__") or allowed is None or target not in allowed:
                wrong.append(f"vismmoe_kt/{rel}:{line} ({room}) imports {target}")
    for rel, tree in beside_modules():
        room = rel.parts[0]
        wrong += [f"{rel}:{line} ({room}) imports {target}" for line, target in
                  imported_rooms(Path(*rel.parts[1:]), tree, room) if target != room and target not in ALLOWED[room]]
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_cpu_kernels_import_nothing_of_vismmoe_kt():
    """The CPU expert backends are a floor of their own: vismmoe_kt builds on them, never the reverse
    (read per import, so a lazy import inside a function is caught too)."""
    found = [f"{rel}:{node.lineno}" for rel, tree in beside_modules() if rel.parts[0] == "cpu_kernels"
             for node in ast.walk(tree)
             if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vismmoe_kt" for a in node.names)
             or isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "vismmoe_kt"
             or isinstance(node, ast.ImportFrom) and node.level > len(rel.parts) - 1]
    assert [rel for rel, _ in beside_modules() if rel.parts[0] == "cpu_kernels"], "cpu_kernels/ was not read"
    assert not found, "cpu_kernels imports vismmoe_kt:\n" + "\n".join(found)


def test_the_rules_themselves_point_down():
    """The table is a layering: no two rooms may import each other (directly or around a loop)."""
    graph = {room: (allowed or set()) for room, allowed in ALLOWED.items() if room != "apps"}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))
    assert not [room for room in graph if reaches(room, room)]


def test_nothing_in_the_package_imports_benchmarks():
    wrong = [f"vismmoe_kt/{rel}:{line}" for rel, tree in modules() for line, name in absolute_imports(tree)
             if name == "benchmarks"]
    assert not wrong, "the package imports benchmarks/ (it sits above the package):\n" + "\n".join(wrong)


def test_benchmarks_import_only_the_package_and_libraries():
    """Besides `vismmoe_kt` and itself, no name that resolves inside the repository: its other top-level
    entries (scripts/, tests/, ...) and the modules of tests/ and scripts/ (importable from there)."""
    local = {p.name.removesuffix(".py") for p in ROOT.iterdir() if not p.name.startswith(".")}
    local |= {p.stem for folder in ("tests", "scripts") for p in (ROOT / folder).rglob("*.py")}
    local -= {"vismmoe_kt", "benchmarks", *BESIDE}  # the packages below vismmoe_kt are part of it
    assert benchmark_modules() and {"tests", "scripts", "conftest"} <= local
    wrong = [f"{rel}:{line} imports {name}" for rel, tree in benchmark_modules()
             for line, name in absolute_imports(tree) if name in local]
    wrong += [f"{rel}:{node.lineno} imports past benchmarks/" for rel, tree in benchmark_modules()
              for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level >= len(rel.parts)]
    assert not wrong, "benchmarks/ importing the repository outside vismmoe_kt:\n" + "\n".join(wrong)


def hugging_face_paths(tree: ast.AST):
    """(line, attribute) of every Hugging Face attribute path this file names."""
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in HF_ATTRIBUTES and names_hf_part(node):
            name = node.attr
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in HF_ATTRIBUTES:
            name = node.args[1].value
        if name:
            yield node.lineno, name


def test_no_hugging_face_attribute_paths_outside_models():
    found = [f"vismmoe_kt/{rel}:{line} .{name}" for rel, tree in modules() if rel.parts[0] != "models"
             for line, name in hugging_face_paths(tree)]
    found += [f"{rel}:{line} .{name}" for rel, tree in benchmark_modules() + beside_modules()
              for line, name in hugging_face_paths(tree)]
    assert not found, "Hugging Face attribute paths outside models/ (ask the adapter):\n" + "\n".join(found)


@pytest.mark.parametrize("method", [m for m in vars(__import__("vismmoe_kt.models.base", fromlist=["x"]).ModelAdapter)
                                    if not m.startswith("_") and callable(getattr(
                                        __import__("vismmoe_kt.models.base", fromlist=["x"]).ModelAdapter, m))])
def test_every_adapter_method_serves_the_package(method):
    """An adapter method that only tests call is a promise nobody keeps: each one is used outside models/."""
    users = [rel for rel, tree in modules() if rel.parts[0] != "models"
             and any(isinstance(n, ast.Attribute) and n.attr == method for n in ast.walk(tree))]
    inside = [rel for rel, tree in modules() if rel.parts[0] == "models"  # a method other methods build on
              and any(isinstance(n, ast.Attribute) and n.attr == method and isinstance(n.value, ast.Name)
                      and n.value.id == "self" for n in ast.walk(tree))]
    assert users or inside, f"ModelAdapter.{method} is called nowhere in the package"
