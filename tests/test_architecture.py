"""The package's structure: no import cycle, and fusion planning that knows no synchroniser."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gc_strategy"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """``{module: the gc_strategy modules it imports}``, every import statement counted (also those
    inside functions and ``if TYPE_CHECKING:``)."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                submodules = [f"{target}.{alias.name}" for alias in node.names]
                # ``from . import x`` imports the submodule x; ``from .m import y``, the module m
                candidates = submodules if all(m in modules for m in submodules) else [target]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            found.update(c for c in candidates if c in modules and c != name)
        graph[name] = found
    return graph


def test_the_graph_is_read_from_the_sources():
    graph = _imports()
    assert "gc_strategy.engine" in graph["gc_strategy.strategy"]
    assert "gc_strategy.communicators" in graph["gc_strategy.algos.base"]
    assert "gc_strategy.fusion.plans" in graph["gc_strategy.autotune"]


def test_no_import_cycle_in_the_package():
    graph = _imports()
    graph.pop("gc_strategy")  # the package's __init__ imports its public names; no module imports it
    state: dict[str, str] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, f"import cycles: {cycles}"


def test_fusion_is_pure_planning():
    """``gc_strategy.fusion`` imports only its own modules: no engine, roles or collectives."""
    graph = _imports()
    for module, targets in graph.items():
        if module.startswith("gc_strategy.fusion"):
            outside = sorted(t for t in targets if not t.startswith("gc_strategy.fusion"))
            assert not outside, f"{module} imports {outside}"
