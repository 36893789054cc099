"""Lease tickets (extauthz/engine/tickets.py) and the key-space check they rely on."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from extauthz.engine.tickets import MAX_LEASE_KEYS, REASONS, LeaseTickets
from extauthz.observe.edge_metrics import EdgeCollector
from extauthz.policy.classify import hash_identity
from extauthz.store.keys import Keys

KEYS = Keys("extauthz")
USER = KEYS.user_leases("user-concurrency", hash_identity("sk_live_alice", "header:x-api-key"))
FLEET = [KEYS.fleet_leases("fleet", "other"), KEYS.fleet_leases("workers", "all")]
LEASE_ID = "00112233445566aa"


def test_keys_the_limiters_build_are_lease_keys() -> None:
    assert all(KEYS.is_lease_key(k) for k in [USER, *FLEET, KEYS.fleet_leases("fleet", "critical")])


@pytest.mark.parametrize("key", [
    "jobs:queue", "job-42", KEYS.bucket("user-rate", "a" * 24), KEYS.shed_state("w"), KEYS.switches,
    KEYS.shadow_log, Keys("other").user_leases("c", "a" * 24), USER + "x" * 70, USER + "\n",
    KEYS.fleet_leases("fleet", "gold"), "extauthz:{u:" + "A" * 24 + "}:cc:c", "",
])
def test_other_keys_are_not(key: str) -> None:
    assert not KEYS.is_lease_key(key)


def test_a_ticket_binds_the_lease_id_and_every_key() -> None:
    t = LeaseTickets(KEYS, "s3cret")
    keys = [USER, *FLEET]
    ticket = t.make(LEASE_ID, keys)
    assert len(ticket) == 32 and t.check(LEASE_ID, keys, ticket) is None
    assert LeaseTickets(KEYS, "s3cret").check(LEASE_ID, keys, ticket) is None  # another replica
    assert LeaseTickets(KEYS, "other").check(LEASE_ID, keys, ticket) == "bad_ticket"
    assert LeaseTickets(KEYS).check(LEASE_ID, keys, ticket) == "bad_ticket"  # random secret
    assert t.check("00112233445566ab", keys, ticket) == "bad_ticket"
    assert t.check(LEASE_ID, keys[:2], ticket) == "bad_ticket"
    assert t.check(LEASE_ID, list(reversed(keys)), ticket) == "bad_ticket"
    assert t.check(LEASE_ID, keys, ticket.upper()) == "bad_ticket"
    assert t.check(LEASE_ID, keys, "é" * 32) == "bad_ticket"
    assert t.check(LEASE_ID, keys, "") == "no_ticket"
    assert t.check(LEASE_ID, [*keys, "jobs:queue"], ticket) == "foreign_key"
    assert t.check("job-42", keys, ticket) == "malformed"
    assert t.check(LEASE_ID, [], ticket) == "malformed"
    assert t.check(LEASE_ID, [USER] * (MAX_LEASE_KEYS + 1), ticket) == "malformed"
    # the key separator keeps ("ab", "c") and ("a", "bc") apart
    assert t.make(LEASE_ID, ["ab", "c"]) != t.make(LEASE_ID, ["a", "bc"])
    # any secret length works (BLAKE2b keys are at most 64 bytes)
    assert LeaseTickets(KEYS, "x" * 500).make(LEASE_ID, keys) != LeaseTickets(KEYS, "x" * 499).make(LEASE_ID, keys)


def test_rejections_are_exported_by_reason() -> None:
    registry = CollectorRegistry()
    registry.register(EdgeCollector(lambda: None, lambda: {"bad_ticket": 3}, REASONS))
    text = generate_latest(registry).decode()
    assert 'extauthz_release_rejected_total{reason="bad_ticket"} 3.0' in text
    assert 'extauthz_release_rejected_total{reason="foreign_key"} 0.0' in text
    assert "extauthz_tls_enabled 0.0" in text
