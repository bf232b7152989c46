"""Imports go one way: million_app -> models -> million_jax -> pallas_kernels, with no cycles.

Every ``.py`` file of the four packages is parsed with ``ast``; every import statement counts,
including function-local ones and relative ones (``from . import x``). Two checks:

* package direction: a file of package P imports only packages at or below P in ``LAYERS``;
* no cycle among files: an edge goes from a file to the file of the module it imports
  (``from a.b import c`` is ``a/b/c.py`` when ``c`` is a submodule, else ``a/b.py`` or
  ``a/b/__init__.py``). Importing ``a.b.c`` does not count as importing ``a/__init__`` or
  ``a/b/__init__``: Python runs those too, but the dependency of interest is the target.
"""
from __future__ import annotations

import ast
import pathlib
from typing import Iterable, Mapping

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "million_jax", "models", "million_app")  # bottom to top
RANK = {pkg: i for i, pkg in enumerate(LAYERS)}

Graph = Mapping[str, Iterable[str]]


# ---------------------------------------------------------------------------- scanning
def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file of the packages in ``LAYERS``."""
    found = {}
    for pkg in LAYERS:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, known: set[str]) -> str:
    """``name`` if it is a known module, else its longest known prefix, else ``name`` itself."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in known:
            return ".".join(parts[:n])
    return name


def imports_of(source: str, module: str, is_package: bool,
               known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in ``source``, at any depth.

    ``module`` is the dotted name of the file (``is_package`` for an ``__init__.py``), used to
    resolve relative imports. ``from a import b`` names ``a.b`` when that is a known module,
    else ``a``. Unknown (third-party) modules are returned as written.
    """
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, _resolve(a.name, known)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                if node.level - 1 >= len(pkg):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top")
                parts = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in known else _resolve(base, known)))
    return out


def scan(root: pathlib.Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """Module -> [(line, imported module)] over the four packages."""
    files = module_files(root)
    known = set(files)
    return {mod: imports_of(path.read_text(), mod, path.name == "__init__.py", known)
            for mod, path in files.items()}


# ---------------------------------------------------------------------------- cycles
def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative; nodes sorted)."""
    nodes = sorted(set(graph) | {w for ws in graph.values() for w in ws})
    succ = {v: sorted(set(graph.get(v, ()))) for v in nodes}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps = []
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(succ[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                comps.append(sorted(comp))
    return comps


def find_cycles(graph: Graph) -> list[list[str]]:
    """One concrete cycle (a -> ... -> a) per strongly connected component that has one."""
    cycles = []
    for comp in strongly_connected(graph):
        members = set(comp)
        start = comp[0]
        if len(comp) == 1 and start not in set(graph.get(start, ())):
            continue
        # breadth-first search inside the component for the shortest way back to start
        parent: dict[str, str] = {}
        frontier = [start]
        end = None
        while frontier and end is None:
            nxt = []
            for v in frontier:
                for w in sorted(set(graph.get(v, ()))):
                    if w == start:
                        end = v
                        break
                    if w in members and w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if end is not None:
                    break
            frontier = nxt
        path = [end]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append(path[::-1] + [start])
    return cycles


# ---------------------------------------------------------------------------- the checks
def test_self_check_finds_cycles_and_resolves_imports():
    """The checker itself can fail: a synthetic cycle is found, a DAG passes."""
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": ["a"]}) == [["a", "a"]]
    assert find_cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    known = {"p", "p.q", "p.q.r", "p.s"}
    src = ("import os\nfrom . import r\nfrom .r import X\nfrom .. import s\n"
           "def f():\n    from p.q import r, Y\n    import p.q.r\n")
    assert imports_of(src, "p.q.t", False, known) == [
        (1, "os"), (2, "p.q.r"), (3, "p.q.r"), (4, "p.s"), (6, "p.q.r"), (6, "p.q"), (7, "p.q.r")]
    assert imports_of("from . import r\n", "p.q", True, known) == [(1, "p.q.r")]


def test_scan_sees_every_package_and_local_imports():
    found = scan()
    for pkg in LAYERS:
        assert any(m == pkg or m.startswith(pkg + ".") for m in found), pkg
    # function-local: cli imports commands inside main()
    assert "million_app.commands" in {t for _, t in found["million_app.cli"]}


def test_package_direction():
    problems = set()
    for mod, imports in scan().items():
        own = mod.split(".")[0]
        for line, target in imports:
            top = target.split(".")[0]
            if top in RANK and RANK[top] > RANK[own]:
                problems.add(f"{mod}:{line} imports {target} ({own} is below {top})")
    bad = sorted(problems)
    assert not bad, ("imports must go " + " -> ".join(reversed(LAYERS)) + ":\n  "
                     + "\n  ".join(bad))


def test_no_import_cycles():
    found = scan()
    graph = {m: sorted({t for _, t in imps if t in found}) for m, imps in found.items()}
    cycles = find_cycles(graph)
    tangles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not cycles, ("import cycles:\n  " + "\n  ".join(" -> ".join(c) for c in cycles)
                        + "\nmodules caught in them:\n  " + "\n  ".join(map(", ".join, tangles)))

