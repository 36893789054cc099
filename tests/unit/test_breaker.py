"""The circuit breaker (extauthz/engine/breaker.py) on an injected clock."""

from __future__ import annotations

from extauthz.core.clock import ManualClock


def test_breaker_opens_on_failure_rate_not_on_a_few_late_answers(clock: ManualClock) -> None:
    from extauthz.engine.breaker import Breaker

    b = Breaker(clock, threshold=5, ratio=0.5, window=1.0, open_for=1.0)
    for i in range(100):  # 10% failures on a busy host: stays closed
        assert b.allow()
        b.failure() if i % 10 == 0 else b.success()
    assert b.state == "closed"
    clock.advance(2.0)  # a whole window later: the busy one is no longer in the last second
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



def test_a_burst_of_late_answers_right_after_the_window_rolls_keeps_it_closed(clock: ManualClock) -> None:
    """Issue 29: the checks of one merged script call share its reply, so they are late
    together. A fixed window judged the ratio on the calls since it began: 32 late answers
    just after it rolled over were "every call failed" and opened the breaker for a second
    under load that Redis carried. Over the last second they are 32 of 1,032 calls."""
    from extauthz.engine.breaker import Breaker

    b = Breaker(clock, threshold=10, ratio=0.5, window=1.0, open_for=1.0)
    for _ in range(1000):  # a healthy second under load
        assert b.allow()
        b.success()
        clock.advance(0.001)
    clock.advance(0.001)  # the window rolls over
    for _ in range(32):  # one merged call answered late: all its checks time out
        assert b.allow()
        b.failure()
    assert b.state == "closed"
    # a store that goes on failing still opens it, once half the last second's calls failed
    n = 32
    while b.state == "closed":
        assert b.allow()
        b.failure()
        clock.advance(0.0005)
        n += 1
    assert 100 < n < 1000
    assert b.state == "open" and not b.allow()
