"""The paper's worked examples (docs: ../shared/paper/DIGEST.md) as test vectors."""

from __future__ import annotations

import pytest

from cpmemory.core.distance import context_distance
from cpmemory.core.index import ContextIndex
from cpmemory.core.ordering import reorder, reorder_batch
from cpmemory.core.scheduling import schedule

C1, C2, C3 = [2, 1, 3], [2, 6, 1], [4, 1, 0]
C6, C7, C8 = [2, 1, 4], [5, 7, 8], [1, 2, 9]


@pytest.fixture()
def fig5_index() -> ContextIndex:
    return ContextIndex.build([C1, C2, C3], request_ids=["C1", "C2", "C3"])


def test_distance_example_position_term_breaks_the_tie() -> None:
    a, b, c, d = [3, 5, 1, 7], [2, 6, 3, 5], [3, 5, 8, 9], [2, 6, 4, 0]
    plain = {name: 1 - len(set(b) & set(other)) / 4 for name, other in (("A", a), ("C", c), ("D", d))}
    assert plain == {"A": 0.5, "C": 0.5, "D": 0.5}
    with_positions = {name: context_distance(b, other) for name, other in (("A", a), ("C", c), ("D", d))}
    assert min(with_positions, key=with_positions.__getitem__) == "D"
    assert with_positions["D"] == pytest.approx(0.5)
    assert with_positions["A"] == pytest.approx(0.5 + 0.001 * 2)  # 3 and 5 both shifted by two slots


def test_distance_of_contexts_sharing_nothing_is_one() -> None:
    assert context_distance([1, 2], [3, 4]) == 1.0
    assert context_distance([], []) == 1.0


def test_fig5_tree_has_the_intersections(fig5_index: ContextIndex) -> None:
    fig5_index.check_integrity()
    c5 = fig5_index.search([1])  # the root cluster
    assert c5.path == (0,)
    c1, c2, c3 = (fig5_index.lookup(name) for name in ("C1", "C2", "C3"))
    assert c1 is not None and c2 is not None and c3 is not None
    assert c1.path[:2] == c2.path[:2] == (0, 0)  # C1 and C2 under C4
    assert c3.path == (0, 1)
    rendering = fig5_index.render()
    assert "{1}" in rendering and "{1, 2}" in rendering  # C5 = {1}, C4 = {1, 2}


def test_fig5_search_path_of_c6(fig5_index: ContextIndex) -> None:
    found = fig5_index.search(C6)
    assert found.path == (0, 0)  # stops at C4: C1 and C2 are equidistant
    assert found.prefix == (1, 2)
    inserted = fig5_index.insert(C6, "C6")
    assert inserted.path == (0, 0, 2)
    fig5_index.check_integrity()


def test_fig6_reorders(fig5_index: ContextIndex) -> None:
    results = {
        name: fig5_index.insert(context, name) for name, context in (("C6", C6), ("C7", C7), ("C8", C8))
    }
    ordered = {}
    for name, context in (("C1", C1), ("C2", C2), ("C3", C3), ("C6", C6), ("C7", C7), ("C8", C8)):
        found = fig5_index.lookup(name)
        assert found is not None
        ordered[name] = reorder(context, found.prefix)
    assert ordered == {
        "C1": [1, 2, 3],
        "C2": [1, 2, 6],
        "C3": [1, 4, 0],
        "C6": [1, 2, 4],
        "C7": [5, 7, 8],
        "C8": [1, 2, 9],
    }
    assert reorder(C6, results["C6"].prefix) == [1, 2, 4]
    assert results["C7"].path == (1,) and results["C7"].prefix == ()
    fig5_index.check_integrity()


def test_fig7_schedule(fig5_index: ContextIndex) -> None:
    paths = [
        fig5_index.insert(context, name).path
        for name, context in (("C6", C6), ("C3b", C3), ("C7", C7), ("C8", C8))
    ]
    # the baseline order C6, C3, C7, C8 (C3 searched again under a new request id)
    order = schedule(paths)
    assert [("C6", "C3", "C7", "C8")[i] for i in order] == ["C6", "C8", "C3", "C7"]


def test_fig7_schedule_from_the_paper_paths() -> None:
    assert schedule([(0, 0, 2), (0, 1), (1,), (0, 0, 3)]) == [0, 3, 1, 2]


def test_reorder_batch_runs_the_offline_pipeline() -> None:
    batch = reorder_batch([C1, C2, C3])
    assert batch.contexts == [[1, 2, 3], [1, 2, 6], [1, 4, 0]]
    assert schedule(batch.search_paths)[0] in (0, 1)  # the deepest paths (C1, C2) run first
