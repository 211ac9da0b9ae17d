"""Package layering: lower packages never import higher ones, no package cycle, no string imports.

Every import is found by walking the syntax tree of every module, imports inside functions
included. Packages of one layer may import each other as long as no cycle forms.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megarl"

LAYERS: dict[str, int] = {
    **dict.fromkeys(("algo", "config", "parallel"), 0),
    **dict.fromkeys(("models", "planner"), 1),
    **dict.fromkeys(("checkpoint", "rollout", "data", "reward", "tracking", "tools"), 2),
    "trainer": 3,
    **dict.fromkeys(("commands", "cli", "train"), 4),
}


def _package_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    return rel.parts[0]


def _imported_packages(tree: ast.AST) -> list[tuple[str, int]]:
    """(top-level megarl package, line) of every import of megarl code in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "megarl":
                names = [f"megarl.{a.name}" for a in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"relative import at line {node.lineno}: use absolute imports")
        else:
            continue
        found += [(n.split(".")[1], node.lineno) for n in names if n.startswith("megarl.")]
    return found


def _edges() -> dict[str, set[tuple[str, str]]]:
    edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent == PACKAGE and path.name == "__init__.py":
            continue
        src = _package_of(path)
        for dst, line in _imported_packages(ast.parse(path.read_text(), str(path))):
            if dst != src:
                edges[src].add((dst, f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return edges


def test_every_package_has_a_layer():
    packages = {_package_of(p) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    packages |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert packages <= set(LAYERS), f"add {sorted(packages - set(LAYERS))} to LAYERS"


def test_lower_layers_never_import_higher_ones():
    wrong = [
        f"{where}: {src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]})"
        for src, targets in _edges().items()
        for dst, where in targets
        if LAYERS[dst] > LAYERS[src]
    ]
    assert not wrong, "\n".join(sorted(wrong))


def _fail_on_cycle(graph: dict[str, set[str]], what: str) -> None:
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail(f"{what} cycle: " + " -> ".join([*stack, node, nxt]))
            if nxt not in state:
                visit(nxt, [*stack, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def test_no_package_cycle():
    _fail_on_cycle(
        {src: {dst for dst, _ in targets} for src, targets in _edges().items()}, "package"
    )


def _module_graph() -> dict[str, set[str]]:
    """megarl module -> the megarl modules it imports (``from megarl.a import b`` names the
    module ``megarl.a.b`` when that is a module, else ``megarl.a``), imports inside functions and
    under ``TYPE_CHECKING`` included."""
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found |= {
                    f"{node.module}.{a.name}"
                    if f"{node.module}.{a.name}" in modules
                    else node.module
                    for a in node.names
                }
        graph[name] = {m for m in found if m in modules and m not in (name, "megarl")}
    return graph


def test_no_module_cycle():
    """No two megarl modules import each other, directly or round a longer loop."""
    _fail_on_cycle(_module_graph(), "module")


# Imports of a module named at run time by the *user* (not megarl's own wiring), and the import
# hooks' finder, which looks up the two third-party modules it wraps as the path finder does.
USER_NAMED_IMPORTS = {
    "megarl/reward/loader.py": "custom_reward_function.path as a dotted module",
    "megarl/config/choices.py": "trainer.logger's optional extras, found without importing them",
    "megarl/config/transformer_overrides.py": "DeepEP for the flex dispatcher, found unimported",
    "megarl/parallel/import_hooks.py": "PathFinder.find_spec for the modules it wraps",
    "megarl/tools/registry.py": "tool and interaction class_name as a dotted path",
    "megarl/rollout/vllm_vision.py": "torchvision, found without importing it",
}


def test_no_string_imports():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                fn = node.func
                name = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
                rel = str(path.relative_to(PACKAGE.parent))
                if name in ("import_module", "__import__", "find_spec") and (
                    rel not in USER_NAMED_IMPORTS
                ):
                    offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    assert not offenders, "\n".join(offenders)


def test_the_walk_sees_imports_inside_functions():
    tree = ast.parse("def f():\n    from megarl import trainer\n    import megarl.models.gpt\n")
    assert sorted(p for p, _ in _imported_packages(tree)) == ["models", "trainer"]


def test_megatron_models_and_optimizers_are_built_only_in_models():
    """One builder: ``GPTModel(`` and ``get_megatron_optimizer(`` appear only in megarl/models."""
    found = []
    for path in sorted(PACKAGE.parent.glob("*/**/*.py")):
        rel = path.relative_to(PACKAGE.parent)
        if rel.parts[0] not in ("megarl", "tests", "tools") or rel.parts[:2] == (
            "megarl",
            "models",
        ):
            continue
        text = path.read_text()
        found += [
            f"{rel}: {name}" for name in ("GPTModel(", "get_megatron_optimizer(") if name in text
        ]
    found = [f for f in found if not f.startswith("tests/test_import_layers.py")]
    assert not found, "\n".join(found)
