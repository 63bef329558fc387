"""The shape of the package: no import circle among pagedopt's modules, and no module over 500
lines.

The import graph is read from the sources with ``ast``: every import statement of a module counts,
at its top, inside functions and under ``if TYPE_CHECKING:`` alike; relative imports are resolved;
``from package import name`` is an import of the submodule ``package.name`` when there is one, of
the package (its ``__init__``) when ``name`` is bound there, and of neither when ``name`` is a
compiled extension (``pagedopt._C``); importing ``a.b.c`` also imports the packages ``a.b`` and
``a`` that the importing module is not already inside.

pagedopt/optim/ (the step pipeline, docs/ARCHITECTURE.md) has its own pair of checks, so that a
failure says which side of the package broke the rule.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 500
OPTIM = "pagedopt.optim"  # the step pipeline, checked on its own


# ---------------------------------------------------------------------------------------------
# the graph
# ---------------------------------------------------------------------------------------------
def modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, whether it is a package's __init__)} of every .py file of
    ``package`` under ``root``."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _bound_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level, in ``if``/``try``/``with`` blocks too, not in
    functions or classes (what ``from module import name`` can take from it)."""
    names = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                todo.append(child)
            else:
                names.update(n.id for n in ast.walk(child)
                             if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    return names


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path = ROOT, package: str = "pagedopt") -> dict[str, set[str]]:
    """{module: the modules of ``package`` it imports} (see the module docstring)."""
    mods = modules(root, package)
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, (path, _) in mods.items()}
    bound = {name: _bound_names(tree) for name, tree in trees.items() if mods[name][1]}

    def resolve(importer: str, target: str, edges: set[str]) -> None:
        while target and target not in mods:  # an attribute of a module: the module
            target = target.rpartition(".")[0]
        if not target:
            return
        edges.add(target)
        inside = set(_ancestors(importer)) | ({importer} if mods[importer][1] else set())
        edges.update(a for a in _ancestors(target) if a in mods and a not in inside)

    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package:
                        resolve(name, alias.name, edges)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name if mods[name][1] else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                if base.split(".")[0] != package:
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    if sub in mods:
                        resolve(name, sub, edges)
                    elif base not in bound or alias.name in bound[base] or alias.name == "*":
                        resolve(name, base, edges)
                    # else: a compiled extension module (pagedopt._C), no source to follow
        edges.discard(name)  # a module importing itself finds itself in sys.modules: no circle
        graph[name] = edges
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each sorted): the modules that
    import one another, directly or not. Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per circle (:func:`circles`)."""
    return [_cycle_in(graph, component) for component in circles(graph)]


def _cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest cycle through the component's first module, staying inside the component."""
    members, first = set(component), component[0]
    parent: dict[str, Optional[str]] = {first: None}
    frontier = [first]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child == first:
                    path = [node]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [first]
                if child in members and child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {first} in {component}")  # cannot happen in a component


def _in_optim(name: str) -> bool:
    return name == OPTIM or name.startswith(OPTIM + ".")


def _describe(graph: dict[str, set[str]], found: list[list[str]]) -> str:
    """Each circle as one of its cycles, and all its modules when the cycle leaves some out."""
    out = []
    for component in found:
        cycle = _cycle_in(graph, component)
        rest = "" if len(cycle) - 1 == len(component) else f" (the circle holds {', '.join(component)})"
        out.append(" -> ".join(cycle) + rest)
    return "; ".join(out)


# ---------------------------------------------------------------------------------------------
# the checker itself, on packages written here
# ---------------------------------------------------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_sees_imports_in_functions_and_type_checking_blocks(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from .a import A\n",
        "pkg/sub/a.py": "class A:\n    def f(self):\n        from . import b\n        return b\n",
        "pkg/sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "pkg/sub/c.py": "from ..sub.a import A as _A\n",
        "pkg/d.py": "import pkg.sub.c\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.sub.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.sub.a"}  # relative import resolved; no edge to its own package
    assert graph["pkg.d"] == {"pkg.sub.c", "pkg.sub"}  # importing pkg.sub.c runs pkg/sub/__init__.py too
    assert cycles(graph) == [["pkg.sub.a", "pkg.sub.b", "pkg.sub.c", "pkg.sub.a"]]


def test_the_checker_tells_a_package_name_from_a_compiled_submodule(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from .x import X\nVALUE = 1\n",
        "pkg/x.py": "from . import _C\nX = 2\n",  # _C: an extension module, not bound in __init__
        "pkg/y.py": "from . import VALUE\n",  # a name of the package's __init__
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.x"] == set() and graph["pkg.y"] == {"pkg"}
    assert cycles(graph) == []
    _write(tmp_path, {"pkg/x.py": "from . import VALUE\nX = 2\n"})
    assert cycles(import_graph(tmp_path, "pkg")) == [["pkg", "pkg.x", "pkg"]]


def test_the_checker_counts_lines(tmp_path):
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/long.py": "x = 1\n" * (MAX_LINES + 1),
                      "pkg/ok.py": "x = 1\n" * MAX_LINES})
    assert _long_modules(tmp_path, "pkg") == {"pkg/long.py": MAX_LINES + 1}


# ---------------------------------------------------------------------------------------------
# pagedopt
# ---------------------------------------------------------------------------------------------
def test_no_import_circle_outside_optim():
    graph = import_graph()
    found = [c for c in circles(graph) if not all(_in_optim(m) for m in c)]
    assert not found, f"import circle(s) in pagedopt: {_describe(graph, found)}"


def test_no_import_circle_in_optim():
    graph = import_graph()
    found = [c for c in circles(graph) if all(_in_optim(m) for m in c)]
    assert not found, f"import circle(s) in pagedopt/optim: {_describe(graph, found)}"


def _long_modules(root: Path = ROOT, package: str = "pagedopt") -> dict[str, int]:
    """{path relative to root: lines} of the modules over MAX_LINES lines."""
    out = {}
    for path, _ in modules(root, package).values():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            out[path.relative_to(root).as_posix()] = n
    return out


def test_no_module_over_500_lines_outside_optim():
    long = {p: n for p, n in _long_modules().items() if not p.startswith("pagedopt/optim/")}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_module_over_500_lines_in_optim():
    long = {p: n for p, n in _long_modules().items() if p.startswith("pagedopt/optim/")}
    assert not long, f"modules of pagedopt/optim over {MAX_LINES} lines: {long}"
