"""RecentRefusals (extauthz/observe/recent_refusals.py): bounded per identity and in identities,
the least recently refused forgotten first; allowed decisions keep nothing."""

from __future__ import annotations

import pytest

from extauthz.core.clock import ManualClock
from extauthz.core.context import RequestContext
from extauthz.core.tiers import Tier
from extauthz.core.verdict import Decision, Kind, Outcome, Verdict
from extauthz.observe.recent_refusals import RecentRefusals


def ctx(identity: str) -> RequestContext:
    return RequestContext(tier=Tier.GET, identity=identity, identity_source="header:x-api-key", test_mode=False,
                          method="GET", path="/", host="h", tier_source="default")


def decision(outcome: Outcome) -> Decision:
    v = Verdict("user-rate", Kind.RATE_LIMITER, outcome, reason="rate_exceeded", retry_after=2.0)
    return Decision(allowed=outcome is not Outcome.DENIED, tier=Tier.GET, verdicts=(v,),
                    denied_by=v if outcome is Outcome.DENIED else None)


def note(ring: RecentRefusals, identity: str, outcome: Outcome) -> None:
    ring.decided(ctx(identity), decision(outcome), None)  # type: ignore[arg-type]  # the policy is not read


def test_bounded_per_identity_and_in_identities() -> None:
    ring = RecentRefusals(clock=ManualClock(), per_identity=3, identities=2)
    for _ in range(5):
        note(ring, "a", Outcome.DENIED)
    note(ring, "a", Outcome.ALLOWED)
    assert [(r["limiter"], r["status"]) for r in ring.of("a")] == [("user-rate", 429)] * 3
    note(ring, "b", Outcome.SHADOW_DENIED)
    assert [(r["outcome"], r["status"]) for r in ring.of("b")] == [("shadow_denied", 200)]
    note(ring, "a", Outcome.DENIED)  # a: refused most recently
    note(ring, "c", Outcome.DENIED)
    assert ring.of("b") == [] and len(ring.of("a")) == 3 and len(ring.of("c")) == 1


def test_every_row_carries_the_answer_the_request_got() -> None:
    """A shadow limiter's would-deny on a request another limiter refused said status 200:
    the request got 429. Every row has the decision's status, and ``enforced``."""
    ring = RecentRefusals(clock=ManualClock())
    shadow = Verdict("dark", Kind.RATE_LIMITER, Outcome.SHADOW_DENIED, reason="rate_exceeded")
    hard = Verdict("user-rate", Kind.RATE_LIMITER, Outcome.DENIED, reason="rate_exceeded", retry_after=1.0)
    both = Decision(allowed=False, tier=Tier.GET, verdicts=(shadow, hard), denied_by=hard)
    ring.decided(ctx("a"), both, None)  # type: ignore[arg-type]
    assert [(r["limiter"], r["status"], r["enforced"]) for r in ring.of("a")] == [
        ("dark", 429, False), ("user-rate", 429, True)]
    note(ring, "b", Outcome.SHADOW_DENIED)  # nothing else refused it: it got 200
    assert [(r["status"], r["enforced"]) for r in ring.of("b")] == [(200, False)]


def test_the_inspect_help_says_the_ring_size(monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The help said "the last 20 per identity" in a literal: it follows the one constant."""
    from extauthz.commands import opscli
    from extauthz.commands.cli import main
    from extauthz.core.settings import RECENT_REFUSALS_PER_IDENTITY
    from extauthz.observe import recent_refusals

    assert recent_refusals.PER_IDENTITY == RECENT_REFUSALS_PER_IDENTITY
    monkeypatch.setattr(opscli, "RECENT_REFUSALS_PER_IDENTITY", 7)
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "the last 7 per identity" in " ".join(capsys.readouterr().out.split())
