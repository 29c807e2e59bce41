"""GapTracker: what a store reports to the shared decision state after a failed call or a cleared engine cache."""
from __future__ import annotations

from cpmemory.stores import decisions
from cpmemory.stores.decisions import RESET, GapTracker


class SteppedClock:
    """A monotonic clock the test moves forward (seconds): nothing sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nothing_to_report_until_a_call_fails() -> None:
    gaps = GapTracker()
    assert gaps.argument("t") == ""
    gaps.reported("t", "")  # nothing carried: nothing changes
    assert gaps.argument("t") == ""


def test_after_a_failure_each_tenant_reports_once_with_the_time_since() -> None:
    clock = SteppedClock()
    gaps = GapTracker(clock)
    gaps.failed()
    clock.now += 0.02
    first = gaps.argument("t")
    assert first == "20"  # milliseconds since the failure
    clock.now += 0.005
    assert gaps.argument("t") == "25"  # not reported yet: still due, and the time since grows
    gaps.reported("t", first)
    assert gaps.argument("t") == ""
    assert gaps.argument("u") != ""  # another tenant still has to hear of it
    gaps.failed()  # a new failure: every tenant reports again
    assert gaps.argument("t") != ""


def test_a_cleared_cache_resets_one_tenant_at_once_or_reports_for_all() -> None:
    gaps = GapTracker()
    gaps.distrust("t")
    assert gaps.argument("t") == RESET and gaps.argument("u") == ""
    gaps.reported("t", RESET)
    assert gaps.argument("t") == ""
    gaps.distrust(None)  # every tenant's cache: like a failure now
    assert gaps.argument("t").isdigit() and gaps.argument("u").isdigit()


def test_the_reported_tenants_are_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(decisions, "MAX_TRACKED_TENANTS", 3)
    gaps = GapTracker()
    gaps.failed()
    for tenant in ("a", "b", "c"):
        gaps.reported(tenant, gaps.argument(tenant))
    assert gaps.argument("a") == ""
    gaps.reported("d", gaps.argument("d"))  # full: forgotten, so "a" reports again (the script deduplicates)
    assert gaps.argument("a") != "" and gaps.argument("d") == ""
