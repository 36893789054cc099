"""Plans (policy ``plan`` + per-limiter ``plans``) and live overrides, on the engine with
the embedded store and an injected clock. The same cases on every store live in
tests/store/test_limiters_on_stores.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from extauthz.control.overrides import (
    MAX_OVERRIDES,
    MAX_TTL,
    Override,
    OverrideError,
    compile_overrides,
    make_override,
    parse_numbers,
    parse_overrides,
    validate_numbers,
    with_override,
    without_override,
)
from extauthz.control.switches import Switches
from extauthz.core.clock import ManualClock
from extauthz.core.verdict import Mode
from extauthz.engine.answers import denial, ratelimit_headers
from extauthz.engine.state import Panel
from extauthz.observe.metrics import Metrics
from extauthz.policy import load_policy
from extauthz.policy.classify import hash_identity
from testinfra.probes import engine_parts

from ..conftest import ROOT
from .helpers import engine_for, get, policy_from

PLANS: dict[str, Any] = {
    "plan": {"from": [{"header": "x-plan"}], "default": "free"},
    "limiters": [
        {"name": "user-rate", "type": "request_rate", "rate": 100, "burst": 500,
         "plans": {"free": {"rate": 10, "burst": 50}, "enterprise": {"rate": 1000, "burst": 5000}}},
        {"name": "user-concurrency", "type": "concurrent_requests", "limit": 2,
         "plans": {"enterprise": {"limit": 4}}},
    ],
}

#: the rate limiter alone (no leases held between checks).
RATE_ONLY: dict[str, Any] = {**PLANS, "limiters": PLANS["limiters"][:1]}


def on_plan(plan: str | None, key: str = "sk_live_alice") -> Any:
    return get(key=key, headers={"x-plan": plan} if plan is not None else {})


def headers(decision: Any) -> dict[str, str]:
    return dict(ratelimit_headers(decision))


def test_the_issue_example_compiles(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, PLANS)
    assert policy.plan_default == "free"
    assert policy.plan_names == {"free", "enterprise"}
    assert [s.label for s in policy.plan_sources] == ["header:x-plan"]
    assert "x-plan" in policy.needed_headers  # the edge copies the plan header


async def test_plan_from_a_header_sets_the_numbers(tmp_path: Path) -> None:
    engine, _ = engine_for(policy_from(tmp_path, PLANS), ManualClock())
    ctx, d = await engine.check(on_plan("enterprise"))
    assert (ctx.plan, ctx.plan_source) == ("enterprise", "header:x-plan")
    assert headers(d)["ratelimit-policy"] == ('"user-rate";q=5000;w=5, '
                                              '"user-concurrency";q=4;qu="concurrent-requests"')
    assert headers(d)["ratelimit"].startswith('"user-rate";r=4999;')
    ctx, d = await engine.check(on_plan("Enterprise ", key="sk_live_bob"))  # trimmed, any case
    assert ctx.plan == "enterprise"


async def test_default_plan_without_a_value(tmp_path: Path) -> None:
    engine, _ = engine_for(policy_from(tmp_path, PLANS), ManualClock())
    ctx, d = await engine.check(on_plan(None))
    assert (ctx.plan, ctx.plan_source) == ("free", "default")
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=50;w=5')
    # free is not listed by user-concurrency: its own limit applies
    assert '"user-concurrency";q=2;' in headers(d)["ratelimit-policy"]


async def test_unknown_plan_uses_the_default_and_is_counted(tmp_path: Path) -> None:
    metrics = Metrics()
    engine, _ = engine_for(policy_from(tmp_path, PLANS), ManualClock(), observer=metrics)
    ctx, d = await engine.check(on_plan("platinum"))
    assert (ctx.plan, ctx.plan_source) == ("free", "unknown")
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=50;')
    await engine.check(on_plan("gold"))
    await engine.check(on_plan("free"))  # known: not counted
    assert engine.snapshot.classifier.unknown_plans == 2
    collector = Panel(engine_parts(engine))  # the engine's own state as a collector
    metrics.registry.register(collector)
    assert metrics.registry.get_sample_value("extauthz_plan_unknown_total") == 2
    engine.set_switches(Switches(global_mode=Mode.SHADOW))  # a new snapshot keeps the count
    assert metrics.registry.get_sample_value("extauthz_plan_unknown_total") == 2
    # the plan is a label of the decisions metric
    assert metrics.registry.get_sample_value("extauthz_decisions_total", {
        "limiter": "user-rate", "tier": "get", "plan": "free", "outcome": "allowed"}) == 3


async def test_request_rate_plan_numbers(tmp_path: Path) -> None:
    clock = ManualClock()
    engine, _ = engine_for(policy_from(tmp_path, RATE_ONLY), clock)
    free = [(await engine.check(on_plan("free", key="sk_live_f")))[1].allowed for _ in range(51)]
    assert sum(free) == 50 and not free[-1]
    clock.advance(1.0)
    assert sum([(await engine.check(on_plan("free", key="sk_live_f")))[1].allowed
                for _ in range(11)]) == 10  # refilled at the plan's 10/s
    # the refusal tells the customer its own numbers
    _, d = await engine.check(on_plan("free", key="sk_live_f"))
    ctx = engine.context(on_plan("free", key="sk_live_f"))
    body = json.loads(denial(ctx, d).body)
    assert body["limit"] == 50 and "bursts of up to 50 requests, refilled at 10 per second" in body["detail"]
    assert "(plan free)" in body["detail"]
    retry = dict(denial(ctx, d).headers)["retry-after"]
    assert retry == "1"  # one token at 10/s: 0.1 s, rounded up to a whole second


async def test_concurrent_requests_plan_numbers(tmp_path: Path) -> None:
    engine, _ = engine_for(policy_from(tmp_path, PLANS), ManualClock())
    ent = [(await engine.check(on_plan("enterprise", key="sk_live_e")))[1] for _ in range(5)]
    assert [d.allowed for d in ent] == [True] * 4 + [False]
    assert ent[-1].denied_by is not None and ent[-1].denied_by.limit == 4
    free = [(await engine.check(on_plan("free", key="sk_live_f")))[1].allowed for _ in range(3)]
    assert free == [True, True, False]  # free is not listed: the limiter's own limit 2


async def test_a_plan_change_carries_the_tokens_capped_at_the_new_burst(tmp_path: Path) -> None:
    engine, store = engine_for(policy_from(tmp_path, RATE_ONLY), ManualClock())
    for _ in range(100):
        await engine.check(on_plan("enterprise"))
    key = engine.keys.bucket("user-rate", engine.context(on_plan(None)).identity)
    assert store.tokens(key) == pytest.approx(4900)
    _, d = await engine.check(on_plan("free"))  # next request: free's burst caps the bucket
    assert d.allowed and store.tokens(key) == pytest.approx(49)
    _, d = await engine.check(on_plan("enterprise"))  # back: the tokens are not refilled
    assert d.allowed and store.tokens(key) == pytest.approx(48)


def test_without_a_plan_section_every_request_has_the_empty_plan(tmp_path: Path) -> None:
    policy = policy_from(tmp_path, {"limiters": [{"name": "r", "type": "request_rate", "rate": 1, "burst": 2}]})
    engine, _ = engine_for(policy, ManualClock())
    ctx = engine.context(on_plan("enterprise"))
    assert (ctx.plan, ctx.plan_source) == ("", "")
    assert "x-plan" not in policy.needed_headers


def test_plans_in_another_file_of_the_directory(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("version: 1\nplan: {from: [{header: x-plan}], default: free}\n")
    (tmp_path / "b.yaml").write_text("version: 1\nlimiters:\n  - {name: r, type: request_rate, rate: 1, "
                                     "burst: 5, plans: {pro: {burst: 50}}}\n")
    assert load_policy([tmp_path]).plan_names == {"free", "pro"}


def test_the_plans_fixture_is_valid() -> None:
    policy = load_policy([ROOT / "tests" / "fixtures" / "policies" / "plans"])
    assert policy.plan_default == "free" and {"free", "pro", "enterprise"} <= policy.plan_names


# -- overrides ----------------------------------------------------------------------------

SALT = b"fleet-salt"


def override(limiter: str = "user-rate", key: str = "sk_live_alice", now: float = 0.0,
             ttl: float = 3600.0, **numbers: Any) -> Override:
    return make_override(limiter, hash_identity(key, "header:x-api-key", SALT),
                         numbers or {"rate": 1000, "burst": 3000}, ttl=ttl, reason="launch",
                         by="ops", source="header:x-api-key", now=now)


async def test_an_override_wins_over_the_plan_and_shows_in_the_headers(tmp_path: Path) -> None:
    clock = ManualClock()
    engine, _ = engine_for(policy_from(tmp_path, PLANS), clock, salt=SALT)
    engine.set_overrides([override(now=clock.wall())])
    _, d = await engine.check(on_plan("enterprise"))
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=3000;w=3')
    _, d = await engine.check(on_plan("enterprise", key="sk_live_bob"))  # others keep their plan
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=5000;')


async def test_numbers_an_override_does_not_set_are_the_plans(tmp_path: Path) -> None:
    clock = ManualClock()
    engine, _ = engine_for(policy_from(tmp_path, PLANS), clock, salt=SALT)
    engine.set_overrides([override(now=clock.wall(), burst=80)])
    _, d = await engine.check(on_plan("free"))
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=80;w=8')  # burst 80, free's 10/s
    _, d = await engine.check(on_plan("enterprise", key="sk_live_alice"))
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=80;w=1')  # enterprise's 1000/s


async def test_an_override_expires_at_its_ttl_and_survives_a_reload(tmp_path: Path) -> None:
    clock = ManualClock()
    engine, _ = engine_for(policy_from(tmp_path, PLANS), clock, salt=SALT)
    engine.set_overrides([override(now=clock.wall(), ttl=10.0, limit=9, limiter="user-concurrency")])
    engine.set_policy(policy_from(tmp_path, PLANS, name="again.yaml"))  # a reload keeps it
    _, d = await engine.check(on_plan("free"))
    assert '"user-concurrency";q=9;' in headers(d)["ratelimit-policy"]
    clock.advance(10.0)
    engine.set_overrides(engine.overrides)  # what the poller does once the expiry passed
    _, d = await engine.check(on_plan("free"))
    assert '"user-concurrency";q=2;' in headers(d)["ratelimit-policy"]


def test_an_override_for_a_missing_limiter_is_reported_not_applied(tmp_path: Path) -> None:
    clock = ManualClock()
    engine, _ = engine_for(policy_from(tmp_path, PLANS), clock, salt=SALT)
    gone, wrong = override("old-rate", now=clock.wall()), override("user-concurrency", now=clock.wall())
    engine.set_overrides([gone, wrong])
    report = engine.snapshot.overrides_not_applied
    assert report[("old-rate", gone.identity)] == "the policy has no limiter named 'old-rate'"
    assert report[("user-concurrency", wrong.identity)] == (
        "burst, rate are not concurrent_requests fields (concurrent_requests: limit)")
    assert engine.context(on_plan("free")).overrides == {}


async def test_an_override_hashed_for_an_identity_rule_the_policy_lacks_is_reported_not_applied(
        tmp_path: Path) -> None:
    # the policy names customers by a Bearer token; the override was hashed for x-api-key
    # (the CLI's default --source): it could never match a request, so it must not say "applied"
    bearer = {**PLANS, "identity": [{"header": "Authorization", "strip_prefix": "Bearer "}]}
    clock = ManualClock()
    engine, _ = engine_for(policy_from(tmp_path, bearer), clock, salt=SALT)
    wrong = override(now=clock.wall())
    right = make_override("user-rate", hash_identity("sk_live_bob", "header:authorization", SALT),
                          {"burst": 70}, ttl=60.0, source="header:authorization", now=clock.wall())
    engine.set_overrides([wrong, right])
    assert engine.snapshot.overrides_not_applied == {("user-rate", wrong.identity): (
        "hashed for the identity rule header:x-api-key, which the policy does not have (its "
        "identity rules: header:authorization): set it again with --source header:authorization")}
    _, d = await engine.check(get(key="", headers={"authorization": "Bearer sk_live_bob"}))
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=70;')


@pytest.mark.parametrize(("pairs", "message"), [
    (["rate=10", "burst=5", "cost=6"], "cost (6) is larger than burst (5): no request could ever pass"),
    (["limit=0"], "limit: Input should be greater than or equal to 1"),
    (["rate=fast"], "rate: bad rate 'fast': use a number per second or '100/s', '6000/m'"),
    (["limit=5", "rate=1"], "rate: not a number of this limiter kind (request_rate: rate, burst, cost; "
                            "concurrent_requests, quota: limit)"),
    (["burst=-1"], "burst: Input should be greater than 0"),
])
def test_override_numbers_follow_the_policy_rules(pairs: list[str], message: str) -> None:
    with pytest.raises(OverrideError) as err:
        validate_numbers(parse_numbers(pairs))
    assert str(err.value) == message


def test_override_numbers_parse() -> None:
    assert validate_numbers(parse_numbers(["rate=100/s", "burst=500"])) == {"rate": 100.0, "burst": 500.0}
    with pytest.raises(OverrideError, match="expected NAME=VALUE"):
        parse_numbers(["rate"])
    with pytest.raises(OverrideError, match="rate is given twice"):
        parse_numbers(["rate=1", "rate=2"])
    with pytest.raises(OverrideError, match="the TTL is at most 30 days"):
        override(ttl=MAX_TTL + 1)


def test_the_number_of_overrides_is_bounded() -> None:
    entries = [override(key=f"sk_{i}") for i in range(MAX_OVERRIDES)]
    with pytest.raises(OverrideError, match=f"{MAX_OVERRIDES} overrides are live"):
        with_override(entries, override(key="sk_new"), now=0.0)
    # changing one that exists still works at the bound, and expired ones do not count
    assert len(with_override(entries, override(key="sk_1", burst=9), now=0.0)) == MAX_OVERRIDES
    assert len(with_override(entries, override(key="sk_new", now=7200.0), now=7200.0)) == 1
    kept, found = without_override(entries, "user-rate", entries[0].identity, now=0.0)
    assert found and len(kept) == MAX_OVERRIDES - 1


def test_stored_overrides_round_trip_and_never_hold_the_raw_identity() -> None:
    o = override()
    text = json.dumps({"overrides": [o.to_dict()]})
    assert parse_overrides(text) == [o]
    assert "sk_live_alice" not in text
    with pytest.raises(ValueError):
        parse_overrides('{"overrides": [{"limiter": 1}]}')
    table, report = compile_overrides([o], [], now=0.0)
    assert table == {} and report


def test_the_json_schema_knows_plans() -> None:
    import jsonschema
    import yaml

    from extauthz.policy.jsonschema import policy_json_schema

    schema = policy_json_schema()
    doc = yaml.safe_load((ROOT / "tests" / "fixtures" / "policies" / "plans" / "api.yaml").read_text())
    jsonschema.validate(doc, schema)
    bad = {**doc, "limiters": [{**doc["limiters"][0], "plans": {"free": {"limit": 3}}}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    fleet = {**doc, "limiters": [{"name": "f", "type": "fleet_usage", "capacity": 9, "plans": {"x": {}}}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(fleet, schema)


async def test_an_override_that_cannot_be_compiled_never_stops_a_snapshot_or_a_switch(tmp_path: Path) -> None:
    # An entry that bypassed validation (read from a store written by an older version, or a
    # bug): compiling it raised OverflowError, so the override change, every later kill
    # switch change and every reload failed. It must be left out, reported, and nothing else.
    clock = ManualClock()
    engine, _ = engine_for(policy_from(tmp_path, PLANS), clock, salt=SALT)
    good = override(now=clock.wall())
    bad = Override(limiter="user-concurrency", identity=good.identity, source="header:x-api-key",
                   numbers={"limit": float("inf")}, reason="", by="", set_at=0.0, expires_at=3600.0)
    engine.set_overrides([good, bad])
    assert engine.snapshot.overrides_not_applied == {
        ("user-concurrency", good.identity): "OverflowError: cannot convert float infinity to integer"}
    _, d = await engine.check(on_plan("enterprise"))
    assert headers(d)["ratelimit-policy"].startswith('"user-rate";q=3000;')  # the good one applies

    engine.set_switches(Switches(global_mode=Mode.OFF))
    _, d = await engine.check(on_plan("enterprise"))
    assert d.verdicts == ()  # the switch applied
    engine.set_switches(Switches())
    engine.set_policy(policy_from(tmp_path, PLANS, name="again.yaml"))  # and a reload
    assert ("user-concurrency", good.identity) in engine.snapshot.overrides_not_applied


def test_stored_overrides_with_numbers_out_of_bounds_are_kept_listed_and_never_applied() -> None:
    now = 1000.0
    entry = {"limiter": "user-rate", "identity": "a" * 24, "source": "header:x-api-key", "reason": "",
             "by": "", "set_at": now, "expires_at": now + 60}
    text = ('{"overrides": [' + json.dumps({**entry, "numbers": {"rate": 5}})[:-1]
            + ', "ignored": 1}, ' + json.dumps({**entry, "identity": "b" * 24, "numbers": "@"})
            .replace('"@"', '{"burst": Infinity, "rate": 5}') + "]}")
    good, bad = parse_overrides(text)
    assert good.refused == "" and good.numbers == {"rate": 5}
    assert bad.refused == "stored numbers refused: burst: Input should be a finite number"
    assert bad.numbers == {"rate": 5.0}  # what can be shown as JSON
    assert "refused" not in good.to_dict() and bad.to_dict()["refused"] == bad.refused
    json.dumps([good.to_dict(), bad.to_dict()], allow_nan=False)  # JSON, no Infinity
    _, not_applied = compile_overrides([good, bad], [], now)
    assert not_applied[("user-rate", "b" * 24)] == bad.refused
    for broken in ('{"overrides": [' + json.dumps({**entry, "expires_at": "@"}).replace('"@"', "Infinity") + "]}",
                   '{"overrides": ' + "[" * 50_000 + "]" * 50_000 + "}"):
        with pytest.raises(ValueError):  # the whole value is malformed: the poll keeps what it has
            parse_overrides(broken)


@pytest.mark.parametrize(("numbers", "kind", "message"), [
    ({"limit": 5}, "request_rate", "limit is not a request_rate field (request_rate: rate, burst, cost)"),
    ({"rate": 5, "speed": 1}, "concurrent_requests",
     "rate, speed are not concurrent_requests fields (concurrent_requests: limit)"),
    ({"limit": float("inf")}, None, "limit: Input should be a finite number"),
    ({"burst": float("nan")}, None, "burst: Input should be a finite number"),
    ({"rate": 1e-310}, None, "rate: Input should be greater than or equal to 0.000001"),
    ({"rate": 2e9}, None, "rate: Input should be less than or equal to 1000000000"),
    ({"rate": 1e-5, "burst": 1000}, None, "burst (1000) / rate (1e-05/s): the bucket would take 1e+08 s"),
    ({"limit": 2 * 10**9}, None, "limit: Input should be less than or equal to 1000000000"),
])
def test_override_numbers_are_finite_bounded_and_of_the_limiters_kind(
        numbers: dict[str, Any], kind: str | None, message: str) -> None:
    with pytest.raises(OverrideError) as err:
        validate_numbers(numbers, kind)
    assert message in str(err.value)


def test_a_whole_limit_stays_an_integer() -> None:
    assert validate_numbers({"limit": 2}) == {"limit": 2}
    assert type(validate_numbers({"limit": 2.0}, "concurrent_requests")["limit"]) is int
