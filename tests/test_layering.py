"""The import structure the design asks for: kernels/ stand alone (the services import them,
never the other way), and no module imports itself back through another."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("radixserve", "services", "shared", "kernels", "loadtest")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports(path: Path, everywhere: bool) -> set[str]:
    """Modules named by the file's imports: at its top level (outside `if TYPE_CHECKING`),
    or, with `everywhere`, in any function too."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list) and (everywhere or isinstance(node, ast.If | ast.Try)):
                    visit([n for n in inner if isinstance(n, ast.stmt | ast.ExceptHandler)])  # type: ignore[misc]
            if isinstance(node, ast.ExceptHandler):
                visit(node.body)

    visit(tree.body)
    return found


def test_kernels_never_import_the_services() -> None:
    offenders = {
        name: sorted(i for i in imports(path, everywhere=True) if i.split(".")[0] != "kernels")
        for name, path in modules().items()
        if name.startswith("kernels")
    }
    project = {
        name: [i for i in found if i.split(".")[0] in PACKAGES] for name, found in offenders.items()
    }
    assert {n: f for n, f in project.items() if f} == {}


def test_no_import_cycles() -> None:
    mods = modules()
    graph = {
        name: {i for i in imports(path, everywhere=False) if i in mods and i != name}
        for name, path in mods.items()
    }
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def walk(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                walk(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    assert cycles == []


def test_the_model_configuration_does_not_import_the_models() -> None:
    found = imports(ROOT / "services/executor/model_config.py", everywhere=True)
    assert not any(i.startswith("services.executor.models") for i in found)
