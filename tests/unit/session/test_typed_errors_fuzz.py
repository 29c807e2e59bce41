"""Every public facade entry point raises only cpmemory.errors types on bad input (hypothesis over junk values)."""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cpmemory.errors import CpMemoryError
from cpmemory.facade import CpMemory

junk = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3), st.binary(max_size=3),
    st.lists(st.one_of(st.none(), st.integers(), st.text(max_size=2), st.tuples(st.integers(), st.none())), max_size=3),
    st.dictionaries(st.text(max_size=2), st.one_of(st.none(), st.integers(), st.text(max_size=2)), max_size=2),
    st.just(object()), st.just([{"role": "user"}]), st.just([{"role": 5, "content": "x"}]),
    st.just([{"role": "user", "content": [5]}]), st.just([("a", "x"), ("a", 5)]),
)

CALLS = [
    lambda m, v: m.prepare(v, "q", []),
    lambda m, v: m.prepare("c", v, []),
    lambda m, v: m.prepare("c", "q", v),
    lambda m, v: m.prepare("c", "q", [("a", "x")], history=v),
    lambda m, v: m.prepare("c", "q", [("a", "x")], tenant=v),
    lambda m, v: m.prepare("c", "q", [("a", "x")], system_prompt=v),
    lambda m, v: m.prepare("c", "q", [("a", "x")], prompt_order=v),
    lambda m, v: m.commit(v, "answer"),
    lambda m, v: m.commit(m.prepare("c", "q", [("a", "x")]), v),
    lambda m, v: m.abort(v),
    lambda m, v: m.plan_batch(v),
    lambda m, v: m.plan_batch([[("a", "x")]], tenant=v),
    lambda m, v: m.evict(v),
    lambda m, v: m.state(v),
    lambda m, v: m.forget(v),
    lambda m, v: m.index_size(v),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(CALLS))), junk)
def test_bad_input_raises_only_typed_errors(which: int, value: Any) -> None:
    with contextlib.suppress(CpMemoryError):  # anything else (TypeError, KeyError, ...) fails the test
        CALLS[which](CpMemory(), value)
