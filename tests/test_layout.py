"""The package's wings and the one way their imports run (see each wing's __init__ docstring).

Read from the source (every import, function-level ones too), so a lazy `import ray` in a pure
wing fails here as surely as one at the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "elastic_train"
# Lowest first: a wing may import itself and the wings before it, never one after it.
ORDER = ["config", "data", "observe", "training", "recovery", "preflight", "cluster", "top"]
PURE = ["config", "data", "observe", "training", "recovery", "preflight"]  # no Ray in these
# Ray Data tasks import plan and rowgroups; `elastic-train report` imports report and summary
NO_TORCH = ["config", "data.plan", "data.rowgroups", "observe.report", "observe.summary"]


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(p for p in parts if p != "__init__") or "__init__"


def _wing(module: str) -> str:
    head = module.split(".")[0]
    return head if head in ORDER else "top"


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, absolute (function-level imports included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            if node.module == "elastic_train":  # `from elastic_train import api`
                out |= {f"elastic_train.{a.name}" for a in node.names}
    return out


MODULES = {_module(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _ours(names: set[str]) -> set[str]:
    """Our modules among `names`, without the `elastic_train.` prefix (only those that exist)."""
    found = set()
    for name in names:
        if name.startswith("elastic_train."):
            rest = name.removeprefix("elastic_train.")
            if rest in MODULES:
                found.add(rest)
    return found


@pytest.mark.parametrize("wing", PURE)
def test_pure_wings_import_no_ray(wing):
    bad = {m: sorted(i for i in imports if i == "ray" or i.startswith("ray."))
           for m, imports in MODULES.items() if _wing(m) == wing}
    assert not {m: i for m, i in bad.items() if i}, f"Ray imported in wing {wing}/: {bad}"


@pytest.mark.parametrize("prefix", NO_TORCH)
def test_light_modules_import_no_torch(prefix):
    bad = {m: sorted(i for i in imports if i == "torch" or i.startswith("torch."))
           for m, imports in MODULES.items() if m == prefix or m.startswith(prefix + ".")}
    assert not {m: i for m, i in bad.items() if i}, f"torch imported: {bad}"


def test_arrows_run_one_way_between_wings():
    upward = [f"{m} -> {o}" for m, imports in MODULES.items() for o in _ours(imports)
              if ORDER.index(_wing(o)) > ORDER.index(_wing(m))]
    assert not upward, f"imports against the wing order {ORDER}: {upward}"


def test_no_import_circles():
    graph = {m: _ours(imports) - {m} for m, imports in MODULES.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path + [m, n]
            if n not in state and (found := visit(n, path + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m, [])
            assert cycle is None, f"import circle: {' -> '.join(cycle)}"


def test_every_wing_says_what_it_owns():
    for wing in ORDER[:-1]:
        init = PACKAGE / wing / "__init__.py"
        assert init.is_file() and ast.get_docstring(ast.parse(init.read_text())), f"{wing}/__init__.py"
