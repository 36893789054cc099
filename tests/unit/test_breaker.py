"""The circuit breaker (extauthz/breaker.py) on an injected clock."""

from __future__ import annotations

from extauthz.clock import ManualClock


def test_breaker_opens_on_failure_rate_not_on_a_few_late_answers(clock: ManualClock) -> None:
    from extauthz.breaker import Breaker

    b = Breaker(clock, threshold=5, ratio=0.5, window=1.0, open_for=1.0)
    for i in range(100):  # 10% failures on a busy host: stays closed
        assert b.allow()
        b.failure() if i % 10 == 0 else b.success()
    assert b.state == "closed"
    clock.advance(1.0)
    for _ in range(5):  # a dead store: every call fails
        assert b.allow()
        b.failure()
    assert b.state == "open" and not b.allow()
    clock.advance(1.0)
    assert b.state == "half_open" and b.allow() and not b.allow()  # one probe at a time
    b.failure()
    assert b.state == "open"
    clock.advance(1.0)
    assert b.allow()
    b.success()
    assert b.state == "closed" and b.allow()

