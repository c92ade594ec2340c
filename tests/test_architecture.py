"""The package's structure: no import cycle, the layers and the families of synchronisers read from
the folders, and fusion planning that knows no synchroniser."""

import ast
import importlib
import inspect
import pkgutil
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
    assert "gc_strategy.sync.modes" in graph["gc_strategy.integrations.lightning"]
    assert "gc_strategy.communicators" in graph["gc_strategy.algos.base"]
    assert "gc_strategy.fusion.plans" in graph["gc_strategy.sync.every_step.autotune"]


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
    """``gc_strategy.fusion`` imports only its own modules: no synchronizer, roles or collectives."""
    graph = _imports()
    for module, targets in graph.items():
        if module.startswith("gc_strategy.fusion"):
            outside = sorted(t for t in targets if not t.startswith("gc_strategy.fusion"))
            assert not outside, f"{module} imports {outside}"


def test_the_core_imports_and_synchronises_without_lightning():
    """With Lightning hidden (``None`` in ``sys.modules``: what an environment without it gives), the
    synchroniser, its roles, DiLoCo, checkpoints and the Accelerate adapter import and a step
    synchronises; the strategy's name says that it needs Lightning."""
    import subprocess
    import sys

    script = """
import sys
for name in ("lightning", "pytorch_lightning", "lightning_fabric"):
    sys.modules[name] = None
import torch
import gc_strategy
from gc_strategy import GradientSynchronizer, build_components
import gc_strategy.integrations.accelerate, gc_strategy.integrations.checkpoint, gc_strategy.sync.diloco.synchronizer
import gc_strategy.sync.sharded.synchronizer, gc_strategy.sync.sharded.diloco
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
roles = build_components("topk", "residual", density=0.5)
sync = GradientSynchronizer(model, roles)
for _ in range(3):
    model.zero_grad()
    with sync.forward_pass():
        loss = model(torch.randn(4, 8)).square().sum()
    loss.backward()
assert all(p.grad is not None for p in model.parameters())
try:
    gc_strategy.GCFusedStrategy
except ImportError as error:
    print(error)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning") and sys.modules[m]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "GCFusedStrategy needs Lightning" in done.stdout
    assert done.stdout.strip().endswith("[]")  # no Lightning module was imported


def _sync_classes() -> dict[str, type]:
    """Every synchroniser and sync mode the ``sync`` package defines, read from its folders."""
    from gc_strategy import sync
    from gc_strategy.sync.base import Synchronizer
    from gc_strategy.sync.modes import SyncMode

    found = {}
    for info in pkgutil.walk_packages(sync.__path__, "gc_strategy.sync."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (
                inspect.isclass(value)
                and value.__module__ == module.__name__
                and issubclass(value, (Synchronizer, SyncMode))
                and value not in (Synchronizer, SyncMode)
            ):
                found[name] = value
    return found


def test_the_synchronisers_and_modes_are_read_from_the_folders():
    classes = _sync_classes()
    expected = {"GradientSynchronizer", "DiLoCoSynchronizer", "ShardedSynchronizer", "ShardedDiLoCo"}
    expected |= {"FaultTolerantSynchronizer", "FaultTolerantDiLoCo", "RoundSynchronizer", "EveryStep", "DiLoCo"}
    assert expected <= set(classes), sorted(expected - set(classes))


def test_no_module_outside_sync_names_a_concrete_synchronizer_or_mode():
    """No module outside ``sync/`` names a synchroniser or a sync mode that ``sync/`` defines (as an
    import, a name or an attribute): a mode builds its synchroniser, and the integrations call
    :class:`gc_strategy.sync.base.Synchronizer`'s methods. The package's ``__init__`` re-exports the
    public names alone."""
    concrete = set(_sync_classes())
    sync = PACKAGE / "sync"
    modules = sorted(p for p in PACKAGE.rglob("*.py") if sync not in p.parents and p != PACKAGE / "__init__.py")
    assert PACKAGE / "integrations" / "lightning.py" in modules
    for path in modules:
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.Attribute):
                named.add(node.attr)
            elif isinstance(node, ast.alias):
                named.add(node.asname or node.name)
        assert not named & concrete, f"{path.relative_to(PACKAGE)} names {sorted(named & concrete)}"


def test_every_synchroniser_a_mode_builds_implements_the_interface():
    """Each synchroniser without a subclass of its own implements every method of the interface."""
    from gc_strategy.sync.base import Synchronizer

    classes = [c for c in _sync_classes().values() if issubclass(c, Synchronizer)]
    leaves = [c for c in classes if not any(other is not c and issubclass(other, c) for other in classes)]
    assert leaves and not [c.__name__ for c in leaves if inspect.isabstract(c)]


def test_sync_holds_the_interface_the_modes_and_the_families_each_a_layer():
    """``sync/`` holds the interface (``base.py``), the modes (``modes.py``) and one folder per family
    of :data:`gc_strategy.sync.FAMILIES`; a family imports the interface and the families before it,
    never a later one nor the modes; the interface imports no family."""
    from gc_strategy.sync import FAMILIES

    sync = PACKAGE / "sync"
    files = {p.name for p in sync.iterdir() if p.is_file() and p.suffix == ".py"}
    assert files == {"__init__.py", "base.py", "modes.py"}
    assert {p.name for p in sync.iterdir() if p.is_dir() and (p / "__init__.py").exists()} == set(FAMILIES)

    def family(module: str) -> int | None:
        parts = module.split(".")
        return FAMILIES.index(parts[2]) if len(parts) > 3 and parts[2] in FAMILIES else None

    wrong = []
    for module, targets in _imports().items():
        if not module.startswith("gc_strategy.sync."):
            continue
        own = family(module)
        for target in targets:
            if module == "gc_strategy.sync.base" and family(target) is not None:
                wrong.append((module, target))
            elif own is not None and (target == "gc_strategy.sync.modes" or (family(target) or -1) > own):
                wrong.append((module, target))
    assert not wrong, wrong


#: the layers above the base (the top-level modules, ``algos/``, ``kernels/``, ``fusion/``), lowest
#: first, by folder; the documented entry points ``gc_strategy.accelerate`` and ``gc_strategy.advise``
#: re-export from the top
BASE = {"algos", "kernels", "fusion"}
LAYERS = [{"sync"}, {"integrations"}, {"tools", "pufferfish"}]
ENTRY_POINTS = {"gc_strategy.accelerate", "gc_strategy.advise"}


def _layer(module: str) -> int:
    if module in ENTRY_POINTS:
        return len(LAYERS)
    folder = module.split(".")[1]
    return next((i + 1 for i, folders in enumerate(LAYERS) if folder in folders), 0)


def test_every_folder_is_a_layer_and_nothing_imports_upward():
    """Each folder of the package is the base or one layer; a module imports its own layer and
    those below it, never one above (the tools and Pufferfish's Lightning warm-up at the top, the
    integrations below them, the synchronisers below those)."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == BASE | set().union(*LAYERS), folders
    graph = _imports()
    graph.pop("gc_strategy")  # the package's __init__ imports its public names; no module imports it
    upward = [
        (module, target) for module, targets in graph.items() for target in targets if _layer(target) > _layer(module)
    ]
    assert not upward, upward


def test_no_runtime_module_imports_the_tools():
    graph = _imports()
    graph.pop("gc_strategy")
    tools = {module for module in graph if module.startswith("gc_strategy.tools")}
    assert "gc_strategy.tools.advise" in tools
    for module, targets in graph.items():
        if module not in tools and module != "gc_strategy.advise":
            assert not targets & tools, f"{module} imports {sorted(targets & tools)}"


def test_ranks_are_forked_in_one_place():
    """``gc_strategy.tools.ranks.run_ranks`` is the one helper that forks gloo ranks: the advisor's
    measurements, the benchmarks and the tests use it."""
    root = PACKAGE.parent
    forking = sorted(
        str(path.relative_to(root))
        for folder in ("gc_strategy", "benchmarks", "tests")
        for path in (root / folder).rglob("*.py")
        if path != Path(__file__).resolve() and 'get_context("fork")' in path.read_text()
    )
    assert forking == ["gc_strategy/tools/ranks.py"], forking


def test_the_engines_main_class_and_the_runtimes_modules_stay_small():
    """The synchroniser's main class within 300 lines, every runtime module (the tools apart) within 450."""
    synchronizer = ast.parse((PACKAGE / "sync" / "every_step" / "synchronizer.py").read_text())
    (main,) = [
        node for node in synchronizer.body if isinstance(node, ast.ClassDef) and node.name == "GradientSynchronizer"
    ]
    assert main.end_lineno - main.lineno + 1 <= 300
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name != "tools":
            assert len(path.read_text().splitlines()) <= 450, path.relative_to(PACKAGE)


def test_the_roles_are_bound_in_one_place():
    """Outside :meth:`gc_strategy.components.Components.bind` no runtime module binds a compressor or a
    communicator itself: every synchroniser binds its roles as one bundle (the tools apart: the
    advisor sizes payloads for a world it has no group for)."""
    binding = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "tools":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "bind":
                owner = node.func.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name.endswith(("compressor", "communicator")):
                    binding.append((str(path.relative_to(PACKAGE)), node.lineno))
    assert [where for where, _ in binding] == ["components.py", "components.py"], binding


def test_no_module_reads_another_objects_private_attributes_of_the_package():
    """A private name the package's own classes define (``self._x = ...``, ``def _x``) is read
    through ``self`` (or ``cls``, ``super()``) only: collaborators ask each other's public API.
    Private names of torch, Lightning and Accelerate that the package depends on are not its own."""
    trees = {path: ast.parse(path.read_text()) for path in PACKAGE.rglob("*.py")}
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                own.add(node.name)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr.startswith("_"):
                    own.add(node.attr)
    # the LightningModule's own (read where Lightning has no public accessor), not the package's
    lightning = {"_trainer", "_device_mesh"}
    own = {name for name in own if not name.startswith("__")} - lightning
    reads = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in own:
                continue
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            reads.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert not reads, reads
