"""The package's shape, read with ``ast`` (nothing is imported): the module-level import graph of ``megarl/`` and of
its subpackages (``TYPE_CHECKING`` imports aside), its cycles, the imports of megarl's own modules left inside
functions, and the functions over a length.

    python tests/package_shape.py          # levels of the subpackage graph, cycles, counts
    python tests/package_shape.py -v       # and every import inside a function, every long function
"""

from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "megarl")
LONG = 60
"""Lines (``def`` to the last line) a function may have."""


@dataclass
class Shape:
    modules: dict[str, str]
    """Dotted module name -> file."""
    imports: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    """Module -> the megarl modules it imports at module level."""
    inner: list[tuple[str, int, list[str]]] = field(default_factory=list)
    """(module, line, imported modules) of each import statement of megarl modules inside a function."""
    long: list[tuple[int, str]] = field(default_factory=list)
    """(lines, module.function) of the functions over ``LONG`` lines."""
    functions: dict[str, ast.FunctionDef] = field(default_factory=dict)
    """module.function (top level) -> its AST."""

    def package(self, module: str) -> str:
        """The subpackage a module belongs to (``megarl.rl``), or the module itself at the top (``megarl.faults``)."""
        top = ".".join(module.split(".")[:2])
        return top if os.path.basename(self.modules.get(top, "")) == "__init__.py" else module

    def package_imports(self) -> dict[str, set[str]]:
        """Subpackage -> the subpackages its modules import at module level (the root package's ``__init__`` is
        imported before anything anyway: left out)."""
        graph = defaultdict(set)
        for a, targets in self.imports.items():
            for b in targets:
                pa, pb = self.package(a), self.package(b)
                if pa != pb and pb != "megarl":
                    graph[pa].add(pb)
        return graph


def read_shape(root: str = ROOT) -> Shape:
    base = os.path.dirname(root)
    modules = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(d, f), base)[:-3].replace(os.sep, ".")
                modules[name.removesuffix(".__init__")] = os.path.join(d, f)
    shape = Shape(modules)
    for module, path in modules.items():
        tree = ast.parse(open(path).read())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                shape.functions[f"{module}.{node.name}"] = node
        _walk(shape, module, tree, in_function=False)
    return shape


def _walk(shape: Shape, module: str, node: ast.AST, in_function: bool) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            continue
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = child.end_lineno - child.lineno + 1
            if lines > LONG:
                shape.long.append((lines, f"{module}.{child.name}"))
            _walk(shape, module, child, in_function=True)
            continue
        targets = [t for t in _imported(child, shape.modules, module) if t and t != module]
        targets += [p for t in targets for p in _parents(t, shape.modules) if not module.startswith(p + ".")]
        if targets and in_function:
            shape.inner.append((module, child.lineno, targets))
        elif targets:
            shape.imports[module].update(targets)
        _walk(shape, module, child, in_function)


def _parents(module: str, modules: dict[str, str]) -> list[str]:
    """The packages whose ``__init__`` importing ``module`` runs first (the root's aside: it runs for every one)."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts))) if p in modules]


def _resolve(name: str, modules: dict[str, str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imported(node: ast.AST, modules: dict[str, str], here: str) -> list[str | None]:
    """The megarl modules an import statement loads (``from p import name``: ``p.name`` when it is a module)."""
    if isinstance(node, ast.Import):
        return [_resolve(a.name, modules) for a in node.names if a.name.split(".")[0] == "megarl"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = here if modules[here].endswith("__init__.py") else here.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    if base.split(".")[0] != "megarl":
        return []
    return [_resolve(f"{base}.{a.name}", modules) for a in node.names]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(graph) | {t for ts in graph.values() for t in ts}):
        if v not in index:
            visit(v)
    return found


def levels(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's height in an acyclic graph: 0 for a node that imports nothing of megarl."""
    level = {}

    def height(n):
        if n not in level:
            level[n] = 1 + max((height(t) for t in graph.get(n, ())), default=-1)
        return level[n]

    for n in set(graph) | {t for ts in graph.values() for t in ts}:
        height(n)
    return level


def main(verbose: bool) -> None:
    shape = read_shape()
    graph = shape.package_imports()
    print(f"{len(shape.modules)} modules, {sum(map(len, shape.imports.values()))} module-level import arrows")
    print(f"module cycles: {cycles(shape.imports) or 'none'}")
    package_cycles = cycles(graph)
    print(f"subpackage cycles: {package_cycles or 'none'}")
    if not package_cycles:
        for n, level in sorted(levels(graph).items(), key=lambda x: (-x[1], x[0])):
            below = " ".join(sorted(t.removeprefix("megarl.") for t in graph.get(n, ())))
            print(f"  {level}  {n.removeprefix('megarl.'):10s} -> {below}")
    print(f"imports of megarl modules inside functions: {len(shape.inner)}")
    for module, line, targets in shape.inner if verbose else ():
        print(f"  {module}:{line} -> {', '.join(sorted(set(targets)))}")
    print(f"functions over {LONG} lines: {len(shape.long)}")
    for lines, name in sorted(shape.long, reverse=True) if verbose else ():
        print(f"  {lines:4d} {name}")


if __name__ == "__main__":
    main("-v" in sys.argv)
