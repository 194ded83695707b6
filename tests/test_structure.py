"""The shape of harvest's code: no import cycle among its modules, and no module or function
too long to read in one sitting (limits from issue 19: 500 lines a module, 60 a function)."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "harvest"
MODULE_LINES = 500
FUNCTION_LINES = 60
# Migrations are frozen history: a revision is never rewritten once released.
FROZEN = PACKAGE / "migrations" / "versions"


def parse(path: Path) -> ast.Module:
    """``path`` parsed. CPython 3.11 before 3.11.8 may raise "AST constructor recursion depth
    mismatch" (gh-106905) in a process where deep recursion happened before (this suite's
    Hypothesis tests nest payloads to the limit): then the file is parsed in a fresh process."""
    try:
        return ast.parse(path.read_text())
    except SystemError:
        code = (
            "import ast, pickle, sys\n"
            "sys.stdout.buffer.write(pickle.dumps(ast.parse(open(sys.argv[1]).read())))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, check=True
        )
        tree: ast.Module = pickle.loads(done.stdout)  # our own child's output
        return tree


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imported_at_import_time(name: str, path: Path, known: set[str]) -> set[str]:
    """The harvest modules ``name`` imports when it is imported: module-level statements,
    including those inside if/try/with at that level; not function bodies (deferred imports
    run later, once both modules exist) nor ``if TYPE_CHECKING:`` blocks."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name in known)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in known else base)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                handlers = [s for h in getattr(node, "handlers", []) for s in h.body]
                visit(
                    [
                        *node.body,
                        *getattr(node, "orelse", []),
                        *getattr(node, "finalbody", []),
                        *handlers,
                    ]
                )

    visit(parse(path).body)
    return (found & known) - {name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_harvests_modules() -> None:
    found = modules()
    graph = {name: imported_at_import_time(name, path, set(found)) for name, path in found.items()}
    assert sum(len(edges) for edges in graph.values()) > 100  # the graph was really read
    assert cycles(graph) == []


def _long_functions(path: Path) -> list[str]:
    tree = parse(path)
    return [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} "
        f"({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > FUNCTION_LINES
    ]


def test_no_module_over_the_limit() -> None:
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in modules().values()
        if FROZEN not in path.parents and (n := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert long == {}


def test_no_function_over_the_limit() -> None:
    long = [
        line
        for path in modules().values()
        if FROZEN not in path.parents
        for line in _long_functions(path)
    ]
    assert long == []
