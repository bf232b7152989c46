"""Imports go one way: benchmarks -> million_app -> models -> million_jax -> pallas_kernels,
with no cycles, between packages or between the files of one package.

Every ``.py`` file of the five folders is parsed with ``ast``; every import statement counts,
including function-local ones, ``if TYPE_CHECKING:`` ones and relative ones
(``from . import x``). Two checks:

* layer direction: a file of folder P imports only folders at or below P in ``LAYERS``
  (``benchmarks`` is the top: it may import everything, nothing imports it);
* no cycle among files: an edge goes from a file to the file of the module it imports
  (``from a.b import c`` is ``a/b/c.py`` when ``c`` is a submodule, else ``a/b.py`` or
  ``a/b/__init__.py``). Importing ``a.b.c`` does not count as importing ``a/__init__`` or
  ``a/b/__init__``: Python runs those too, but the dependency of interest is the target.
  A script run as ``python benchmarks/x.py`` has ``benchmarks/`` on ``sys.path``, so its
  bare ``import _results`` is an edge to the sibling ``benchmarks/_results.py``.

The checker runs on the repository and, in the self-checks, on small synthetic trees under
``tmp_path`` with a planted cycle and a planted upward import, so it is shown to fail.
"""
from __future__ import annotations

import ast
import pathlib
import textwrap
from typing import Iterable, Mapping, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "million_jax", "models", "million_app", "benchmarks")  # bottom to top

Graph = Mapping[str, Iterable[str]]
Scan = Mapping[str, Sequence[tuple[int, str]]]


# ---------------------------------------------------------------------------- scanning
def module_files(root: pathlib.Path = ROOT,
                 layers: Sequence[str] = LAYERS) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every .py file under the folders in ``layers``."""
    found = {}
    for pkg in layers:
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


def _absolute(name: str, package: list[str], known: set[str]) -> str:
    """An absolute import ``name`` as written, or the sibling module it names in a script.

    ``name``'s top part is not a known top-level module but ``<package>.<top>`` is: the
    script-style sibling import (``import _results`` from ``benchmarks/decode_cpu.py``).
    """
    top = name.split(".")[0]
    tops = {k.split(".")[0] for k in known}
    if top not in tops and package and ".".join(package + [top]) in known:
        return ".".join(package + [name])
    return name


def imports_of(source: str, module: str, is_package: bool,
               known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in ``source``, at any depth.

    ``module`` is the dotted name of the file (``is_package`` for an ``__init__.py``), used to
    resolve relative imports and script-style sibling imports. ``from a import b`` names
    ``a.b`` when that is a known module, else ``a``. Unknown (third-party) modules are
    returned as written.
    """
    pkg = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, _resolve(_absolute(a.name, pkg, known), known)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 >= len(pkg):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top")
                parts = pkg[:len(pkg) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = _absolute(node.module or "", pkg, known)
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in known else _resolve(base, known)))
    return out


def scan(root: pathlib.Path = ROOT, layers: Sequence[str] = LAYERS) -> dict[str, list[tuple[int, str]]]:
    """Module -> [(line, imported module)] over the folders in ``layers``."""
    files = module_files(root, layers)
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


def direction_problems(found: Scan, layers: Sequence[str] = LAYERS) -> list[str]:
    """'file:line imports target (P is below Q)' for every import that goes up ``layers``."""
    rank = {pkg: i for i, pkg in enumerate(layers)}
    problems = set()
    for mod, imports in found.items():
        own = mod.split(".")[0]
        for line, target in imports:
            top = target.split(".")[0]
            if top in rank and rank[top] > rank[own]:
                problems.add(f"{mod}:{line} imports {target} ({own} is below {top})")
    return sorted(problems)


def cycle_problems(found: Scan) -> list[str]:
    """One 'a -> b -> a' line per import cycle among the scanned files, then the files caught."""
    graph = {m: sorted({t for _, t in imps if t in found}) for m, imps in found.items()}
    cycles = find_cycles(graph)
    if not cycles:
        return []
    tangles = [c for c in strongly_connected(graph) if len(c) > 1]
    return ([" -> ".join(c) for c in cycles]
            + ["modules caught in them: " + ", ".join(c) for c in tangles])


# ---------------------------------------------------------------------------- self-checks
def test_self_check_finds_cycles_and_resolves_imports():
    """The checker itself can fail: a synthetic cycle is found, a DAG passes."""
    assert find_cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": ["a"]}) == [["a", "a"]]
    assert find_cycles({"a": ["b", "c"], "b": ["c"], "c": []}) == []
    known = {"p", "p.q", "p.q.r", "p.s", "p.q.sib"}
    src = ("import os\nfrom . import r\nfrom .r import X\nfrom .. import s\n"
           "def f():\n    from p.q import r, Y\n    import p.q.r\n")
    assert imports_of(src, "p.q.t", False, known) == [
        (1, "os"), (2, "p.q.r"), (3, "p.q.r"), (4, "p.s"), (6, "p.q.r"), (6, "p.q"), (7, "p.q.r")]
    assert imports_of("from . import r\n", "p.q", True, known) == [(1, "p.q.r")]
    # script-style sibling imports; a known top-level name is never taken for a sibling
    assert imports_of("import sib\nfrom sib import f\nimport p\nimport numpy\n", "p.q.t", False,
                      known) == [(1, "p.q.sib"), (2, "p.q.sib"), (3, "p"), (4, "numpy")]


def _tree(root: pathlib.Path, files: Mapping[str, str]) -> pathlib.Path:
    """Write ``{relative path: source}`` under ``root`` (sources dedented)."""
    for rel, src in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))
    return root


_CLEAN = {
    "low/__init__.py": "",
    "low/core.py": "import numpy\n",
    "top/__init__.py": "",
    "top/run/__init__.py": "from . import settings  # noqa\n",
    "top/run/settings.py": "import dataclasses\n",
    "top/run/cli.py": "from .settings import S\nfrom .runner import run\nfrom low.core import f\n",
    "top/run/runner.py": "from .settings import S\nfrom .rows import row\n",
    "top/run/rows.py": ("from typing import TYPE_CHECKING\nfrom .settings import S\n"
                        "if TYPE_CHECKING:\n    from .state import State\n"),
    "top/run/state.py": "from .settings import S\n",
    "top/script.py": "import helper\n",
    "top/helper.py": "import os\n",
}


def test_self_check_clean_tree_passes(tmp_path):
    found = scan(_tree(tmp_path, _CLEAN), ("low", "top"))
    assert set(found) == {"low", "low.core", "top", "top.run", "top.run.settings", "top.run.cli",
                          "top.run.runner", "top.run.rows", "top.run.state", "top.script",
                          "top.helper"}
    assert found["top.script"] == [(1, "top.helper")]
    assert direction_problems(found, ("low", "top")) == []
    assert cycle_problems(found) == []


def test_self_check_fails_on_planted_cycles(tmp_path):
    # rows <-> runner through a TYPE_CHECKING import; cli <-> its package through a
    # function-local import; two scripts importing each other as siblings
    planted = dict(_CLEAN)
    planted["top/run/rows.py"] += "if TYPE_CHECKING:\n    from .runner import Runner\n"
    planted["top/run/__init__.py"] += "def main():\n    from .cli import main\n"
    planted["top/run/cli.py"] += "from .. import run as _package\n"
    planted["top/helper.py"] += "import script\n"
    problems = cycle_problems(scan(_tree(tmp_path, planted), ("low", "top")))
    assert sorted(problems) == [
        "modules caught in them: top.helper, top.script",
        "modules caught in them: top.run, top.run.cli",
        "modules caught in them: top.run.rows, top.run.runner",
        "top.helper -> top.script -> top.helper",
        "top.run -> top.run.cli -> top.run",
        "top.run.rows -> top.run.runner -> top.run.rows",
    ]


def test_self_check_fails_on_planted_upward_import(tmp_path):
    planted = dict(_CLEAN)
    planted["low/core.py"] += "def f():\n    from top.run import settings\n"
    found = scan(_tree(tmp_path, planted), ("low", "top"))
    assert direction_problems(found, ("low", "top")) == [
        "low.core:3 imports top.run.settings (low is below top)"]
    assert cycle_problems(found) == []
    # with the layers the other way round, that import is allowed and cli's is the upward one
    assert direction_problems(found, ("top", "low")) == [
        "top.run.cli:3 imports low.core (top is below low)"]


# ---------------------------------------------------------------------------- the checks
def test_scan_sees_every_layer_and_local_imports():
    found = scan()
    for pkg in LAYERS:
        assert any(m == pkg or m.startswith(pkg + ".") for m in found), pkg
    # function-local: cli imports commands inside main()
    assert "million_app.commands" in {t for _, t in found["million_app.cli"]}
    # the benchmarks package and the scripts beside it, with their sibling imports
    assert "benchmarks.gpu_e2e.runner" in {t for _, t in found["benchmarks.gpu_e2e.cli"]}
    assert "benchmarks._results" in {t for _, t in found["benchmarks.decode_cpu"]}


def test_layer_direction():
    bad = direction_problems(scan())
    assert not bad, ("imports must go " + " -> ".join(reversed(LAYERS)) + ":\n  "
                     + "\n  ".join(bad))


def test_no_import_cycles():
    bad = cycle_problems(scan())
    assert not bad, "import cycles:\n  " + "\n  ".join(bad)
