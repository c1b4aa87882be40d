"""The import graph of pallas_kernels has no cycle, and the names jaxspec imports stay put.

``module_graph`` and ``import_cycles`` are small and reusable: give ``module_graph`` any set of
package folders (e.g. ``jaxspec`` too) and check ``import_cycles`` is empty. Every import
counts, at module level and inside functions: ``import a.b`` is an edge to ``a.b``;
``from a import b`` an edge to ``a.b`` when that is a module, else to ``a``; relative imports
are resolved against the importing module's package. Only modules of the given packages are
nodes.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def module_names(package_dirs) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under the package folders (a
    package's ``__init__.py`` is the package's own name)."""
    modules = {}
    for pkg_dir in package_dirs:
        pkg_dir = Path(pkg_dir)
        for path in sorted(pkg_dir.rglob("*.py")):
            parts = path.relative_to(pkg_dir.parent).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _imported(node, module: str, is_package: bool, modules) -> set[str]:
    """The modules of ``modules`` one import statement names."""
    found = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:  # `import a.b.c` where c is not a module
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
        return found
    if node.level:  # relative: against the importing module's package
        package = module if is_package else module.rpartition(".")[0]
        parts = package.split(".")
        if node.level > 1:
            parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            found.add(sub)
        elif base in modules:
            found.add(base)
    return found


def module_graph(package_dirs) -> dict[str, set[str]]:
    """Import edges (module -> the modules it imports) among the modules of the packages,
    counting imports anywhere in a file (module level, functions, classes, branches)."""
    modules = module_names(package_dirs)
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, path.name == "__init__.py", modules)
        edges.discard(module)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of the graph: one list of modules per strongly connected component of more
    than one module (Tarjan's algorithm, iterative), each in a cycle's order."""
    index, low, on_stack, stack, comps = {}, {}, set(), [], []
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
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
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
                if len(comp) > 1:
                    comps.append(_cycle_through(graph, set(comp)))
    return comps


def _cycle_through(graph, comp: set[str]) -> list[str]:
    """One cycle inside a strongly connected component, as ``[a, b, ..., a]``."""
    first = min(comp)
    parent, frontier = {first: None}, [first]
    while frontier:  # breadth-first back to `first` inside the component
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == first:  # back at the start: the parents lead from v to first
                    path = [v]
                    while parent[path[-1]] is not None:
                        path.append(parent[path[-1]])
                    return path[::-1] + [first]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return sorted(comp)  # pragma: no cover - a component always holds a cycle


# --- the package -------------------------------------------------------------------------

def test_pallas_kernels_has_no_import_cycle():
    graph = module_graph([ROOT / "pallas_kernels"])
    assert "pallas_kernels.dispatch" in graph and len(graph) >= 10
    cycles = import_cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_kernels_do_not_import_the_router():
    """Backend choice lives in dispatch: no kernel module imports it (or the entry modules
    that re-export it)."""
    graph = module_graph([ROOT / "pallas_kernels"])
    routers = {"pallas_kernels.dispatch", "pallas_kernels.decode_attention",
               "pallas_kernels.prefix_attention", "pallas_kernels"}
    for kernel in ("triton_core", "triton_decode", "triton_prefix", "hopper", "tpu",
                   "reference", "contracts", "common", "merge", "splits"):
        assert not graph[f"pallas_kernels.{kernel}"] & routers, kernel


# --- the finder itself --------------------------------------------------------------------

def test_cycle_finder_on_graphs():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert import_cycles({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) == []  # diamond
    (cycle,) = import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()})
    assert cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"} and len(cycle) == 4
    for u, v in zip(cycle, cycle[1:]):  # a real path of the graph
        assert v in {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}}[u]
    cycles = import_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}})
    assert sorted(sorted(set(c)) for c in cycles) == [["a", "b"], ["c", "d", "e"]]


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / rel.split("/")[0]


def test_function_level_and_relative_imports_count(tmp_path):
    pkg = _write_package(tmp_path, {
        "pkg/__init__.py": "from .a import f\n",
        "pkg/a.py": "def f():\n    from . import b\n    return b\n",
        "pkg/b.py": "import os\nfrom .sub.c import g\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "def g():\n    if True:\n        from ..a import f\n",
        "pkg/sub/d.py": "from pkg import f, sub\nimport pkg.sub.c\n",
    })
    graph = module_graph([pkg])
    assert graph["pkg"] == {"pkg.a"}
    assert graph["pkg.a"] == {"pkg.b"}                     # inside a function
    assert graph["pkg.b"] == {"pkg.sub.c"}                 # os is not a node
    assert graph["pkg.sub.c"] == {"pkg.a"}                 # `..` from a module of pkg.sub
    assert graph["pkg.sub.d"] == {"pkg", "pkg.sub", "pkg.sub.c"}  # f: a name of pkg
    (cycle,) = import_cycles(graph)
    assert set(cycle) == {"pkg.a", "pkg.b", "pkg.sub.c"}


# --- the names jaxspec imports -------------------------------------------------------------

def test_entry_points_survive_importing_their_modules():
    """``pallas_kernels.decode_attention`` is both a module and the entry-point function (and
    so is ``prefix_attention``). Loading a submodule binds it as an attribute of the package,
    so importing the module (as jaxspec does for ``resolve_num_new``) must not turn the
    package's attribute into the module, whenever it happens."""
    import importlib
    import types

    import pallas_kernels
    from pallas_kernels import dispatch
    for name in ("decode_attention", "prefix_attention"):
        module = importlib.import_module(f"pallas_kernels.{name}")
        assert isinstance(module, types.ModuleType)
        assert getattr(pallas_kernels, name) is getattr(dispatch, name), name
        assert getattr(module, name) is getattr(dispatch, name), name
    from pallas_kernels import decode_attention, prefix_attention
    assert callable(decode_attention) and callable(prefix_attention)


@pytest.mark.parametrize("module,names", [
    ("pallas_kernels", ["decode_attention", "decode_attention_reference", "prefix_attention",
                        "prefix_attention_reference", "multi_level_prefix_attention",
                        "merge_attention_states", "merge_stacked", "target_platform",
                        "DecodeAttentionBlockSizes", "PrefixAttentionBlockSizes",
                        "HopperBlockSizes", "TPUDecodeBlockSizes", "TPUPrefixBlockSizes",
                        "tpu_decode_attention", "tpu_prefix_attention",
                        "tpu_prefix_attention_pkld", "decode_route", "prefix_route"]),
    ("pallas_kernels.decode_attention", ["decode_attention", "decode_attention_reference",
                                         "resolve_num_new", "DecodeAttentionBlockSizes",
                                         "HOPPER_MIN_ROWS"]),
    ("pallas_kernels.prefix_attention", ["prefix_attention", "prefix_attention_reference",
                                         "multi_level_prefix_attention",
                                         "PrefixAttentionBlockSizes", "HOPPER_MIN_ROWS"]),
    ("pallas_kernels.merge", ["merge_partials", "merge_stacked", "merge_attention_states"]),
])
def test_public_names(module, names):
    import importlib
    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"
