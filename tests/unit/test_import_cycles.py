"""No import cycle between modules of the library or of the research benchmarks (function-level imports included).

The import-linter contract ``no module cycles`` (``make lint``) checks siblings at every depth; this test checks the
module graph itself, so a cycle through modules of different subpackages is caught too.
"""
from __future__ import annotations

import grimp
import pytest

PACKAGES = ("cpmemory", "cpmemory_benchmarks")


def module_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    cycles: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[module] = min(low[module], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    graph = grimp.ImportGraph()
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d"), ("p.e", "p.d")):
        graph.add_import(importer=importer, imported=imported)
    assert module_cycles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_module_cycles() -> None:
    pytest.importorskip("cpmemory_benchmarks")
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    assert module_cycles(graph) == []
