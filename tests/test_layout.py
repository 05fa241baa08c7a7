"""The package's layout: imports flow one way (no cycle, module- or function-level), files stay small."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "ascend_graph"
MAX_LINES = 400


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports anywhere in its body (TYPE_CHECKING blocks excepted)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):  # an ancestor is already running
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules) for p in paths}
    for mod in modules:  # importing a submodule runs its packages' __init__ first
        parent = mod.rpartition(".")[0]
        while parent:
            if parent != mod:
                for importer, targets in graph.items():
                    if mod in targets and not importer.startswith(parent + ".") and importer != parent:
                        targets.add(parent)
            parent = parent.rpartition(".")[0]
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    cycle = _cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_planted_cycle() -> None:
    graph = import_graph()
    graph["ascend_graph.kv_cache"] = graph["ascend_graph.kv_cache"] | {"ascend_graph.models.deepseek"}
    assert _cycle(graph) is not None


def test_no_source_file_is_over_the_size_limit() -> None:
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines())
             for pattern in ("*.py", "*.c", "*.h") for p in PACKAGE.rglob(pattern)}
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines: {over}"
