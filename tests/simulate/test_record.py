"""The recorder: lines, durations from the access log, sampling by identity, rotation."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import yaml

from extauthz.commands.simulate.replay import run_now
from extauthz.commands.simulate.traffic import BadLines, TrafficFile, read_traffic
from extauthz.core.clock import ManualClock
from extauthz.core.context import RawRequest
from extauthz.engine.engine import Engine
from extauthz.engine.storegate import StoreGate
from extauthz.observe.record import Recorder, RotatingWriter, pending_ttl, redact_path
from extauthz.policy import load_policy
from extauthz.server.app import ServerConfig
from extauthz.server.workers import child_config
from extauthz.store.memory import MemoryStore

POLICY = {"version": 1, "identity": [{"header": "x-api-key"}], "limiters": [
    {"name": "rate", "type": "request_rate", "rate": 1, "burst": 2},
    {"name": "shadow-conc", "type": "concurrent_requests", "limit": 1, "mode": "shadow", "lease_ttl": 30},
]}


def setup(tmp_path: Path, **kw: Any) -> tuple[Engine, Recorder, ManualClock]:
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(POLICY))
    policy = load_policy([tmp_path / "p.yaml"])
    clock = ManualClock(1_732_420_000.0)
    rec = Recorder(tmp_path / "rec", clock=clock, pending_ttl=pending_ttl(policy), **kw)
    engine = Engine(StoreGate(MemoryStore(clock), clock=clock), policy, observer=rec)
    return engine, rec, clock


def check(engine: Engine, key: str, rid: str, path: str = "/v1/x") -> None:
    raw = RawRequest("GET", path, "api.example.com", {"x-api-key": key}, request_id=rid)
    run_now(engine.check(raw))


def read_all(directory: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(directory.glob("record-*.jsonl.gz")):
        out += [json.loads(x) for x in gzip.decompress(f.read_bytes()).splitlines()]
    return out


async def test_lines_carry_decision_and_duration(tmp_path: Path) -> None:
    engine, rec, clock = setup(tmp_path)
    for i in range(3):
        check(engine, "sk_live_secret", f"r{i}")
    clock.advance(0.25)
    for i in range(3):
        rec.finished(f"r{i}", 0.2 + i / 10)
    await rec.flush()
    lines = read_all(tmp_path / "rec")
    assert [x["decision"] for x in lines] == ["allowed", "allowed", "refused"]
    assert lines[2]["limiter"] == "rate" and lines[2]["status"] == 429
    assert lines[1]["would_refuse"] == ["shadow-conc"]
    assert [x["duration"] for x in lines] == [0.2, 0.3, 0.4]
    assert lines[0]["path"] == "/v1/x" and lines[0]["host"] == "api.example.com"
    assert lines[0]["tier"] == "get" and lines[0]["plan"] is None
    text = "".join(json.dumps(x) for x in lines)
    assert "sk_live_secret" not in text  # hashed, never raw
    # and it is a traffic file for simulate
    reqs = list(read_traffic([TrafficFile(p) for p in (tmp_path / "rec").iterdir()], bad=BadLines()))
    assert [r.recorded for r in reqs] == ["allowed", "allowed", "rate"]
    assert reqs[0].identity == lines[0]["identity"]


async def test_rate_limit_descriptors_are_not_recorded(tmp_path: Path) -> None:
    # simulate replays checked requests; a descriptor (ShouldRateLimit) would replay as one
    (tmp_path / "d.yaml").write_text(yaml.safe_dump({"version": 1, "limiters": [
        {"name": "per-ip", "type": "quota", "limit": 5, "period": "minute",
         "match": {"domain": "edge", "descriptor": [{"key": "remote_address"}]}}]}))
    policy = load_policy([tmp_path / "d.yaml"])
    clock = ManualClock(1_732_420_000.0)
    rec = Recorder(tmp_path / "rec", clock=clock, pending_ttl=pending_ttl(policy))
    engine = Engine(StoreGate(MemoryStore(clock), clock=clock), policy, observer=rec)
    raw = RawRequest("", "", descriptor={"remote_address": "10.0.0.1"}, descriptor_target="per-ip")
    _, decision = run_now(engine.check(raw))
    assert [v.limiter for v in decision.verdicts] == ["per-ip"]  # decided, and so observed
    await rec.flush()
    assert read_all(tmp_path / "rec") == []


async def test_missing_access_log_entry_written_without_duration_after_ttl(tmp_path: Path) -> None:
    engine, rec, clock = setup(tmp_path)
    check(engine, "k", "lost")
    await rec.flush()
    assert read_all(tmp_path / "rec") == []  # still waiting for its end
    clock.advance(59.0)
    await rec.flush()
    assert read_all(tmp_path / "rec") == []
    clock.advance(2.0)  # past the longest lease TTL (60 s)
    await rec.flush()
    (line,) = read_all(tmp_path / "rec")
    assert line["duration"] is None and rec.without_duration == 1
    rec.finished("lost", 0.1)  # too late: nothing twice
    await rec.flush()
    assert len(read_all(tmp_path / "rec")) == 1


async def test_sampling_keeps_every_request_of_a_sampled_identity(tmp_path: Path) -> None:
    engine, rec, clock = setup(tmp_path, sample=0.5)
    for user in range(40):
        for i in range(3):
            check(engine, f"user{user}", f"{user}-{i}")
            rec.finished(f"{user}-{i}", 0.01)
        clock.advance(10)
    await rec.flush()
    lines = read_all(tmp_path / "rec")
    per_user: dict[str, int] = {}
    for x in lines:
        per_user[x["identity"]] = per_user.get(x["identity"], 0) + 1
    assert set(per_user.values()) == {3}
    assert 8 <= len(per_user) <= 32
    assert rec.unsampled == 3 * (40 - len(per_user))


def test_rotation_bounds_the_total(tmp_path: Path) -> None:
    writer = RotatingWriter(tmp_path / "rec", max_bytes=40_000, file_bytes=8_000)
    for batch in range(60):
        writer.write([{"time": batch, "n": i, "pad": f"{batch * 1000 + i:x}" * 8} for i in range(200)])
    files = writer.files()
    assert len(files) >= 2 and writer.files_deleted > 0
    assert sum(p.stat().st_size for p in files) <= 40_000 + 8_000
    assert writer.current in files


def test_serve_record_options_parse() -> None:
    import argparse

    import pytest

    from extauthz.commands.cli import build_parser, main
    from extauthz.core.settings import size as _size

    assert _size("500M") == 500 << 20 and _size("2G") == 2 << 30 and _size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        _size("lots")
    args = build_parser().parse_args(["serve", "--record", "/tmp/r", "--record-max-bytes", "1M",
                                      "--record-sample", "0.25"])
    assert (args.record_dir, args.record_max_bytes, args.record_sample) == ("/tmp/r", 1 << 20, 0.25)
    assert main(["serve", "--record", "/tmp/r", "--record-sample", "0"]) == 2


def _noise(rng: random.Random, n: int) -> list[dict[str, Any]]:
    """Lines that do not compress: a file's size follows the lines written."""
    return [{"n": i, "pad": rng.randbytes(48).hex()} for i in range(n)]


def test_no_write_takes_the_directory_past_the_bound(tmp_path: Path) -> None:
    """The current file counts, and a write that would pass the bound rotates first; a flush
    bigger than a file is written in pieces (a 200 KiB bound once held a 429 KB file)."""
    rng = random.Random(20)
    writer = RotatingWriter(tmp_path / "rec", max_bytes=200 << 10)
    for n in (10, 400, 40, 4000, 3, 2500, 100, 100, 100):  # 4,000 lines: ~430 KB compressed
        writer.write(_noise(rng, n))
        sizes = [p.stat().st_size for p in writer.files()]
        assert sum(sizes) <= 200 << 10, sizes
        assert max(sizes) <= writer.file_bytes, sizes
        assert writer.current in writer.files()
    assert writer.files_deleted > 0 and writer.lines_dropped == 0
    kept = read_all(tmp_path / "rec")
    assert kept[-300:] == [{"n": i % 100, "pad": x["pad"]} for i, x in enumerate(kept[-300:])]  # newest whole


def test_a_line_larger_than_a_file_is_dropped_and_counted(tmp_path: Path) -> None:
    writer = RotatingWriter(tmp_path / "rec", max_bytes=4096)
    writer.write([{"pad": random.Random(1).randbytes(4096).hex()}, {"n": 1}])
    assert writer.lines_dropped == 1
    assert read_all(tmp_path / "rec") == [{"n": 1}]


async def test_recorded_paths_are_redacted_by_default(tmp_path: Path) -> None:
    engine, rec, _ = setup(tmp_path)
    check(engine, "sk_live_a", "r1", path="/v1/keys/sk_live_SECRET;session=s3cr3t")
    check(engine, "sk_live_a", "r2", path="/v1/customers/cus_NffrFeUfNV2Hib/sources")
    check(engine, "sk_live_b", "r3", path="/v1/payment_methods/42")
    await rec.close()
    raw = b"".join(gzip.decompress(f.read_bytes()) for f in (tmp_path / "rec").iterdir())
    assert [x["path"] for x in read_all(tmp_path / "rec")] == [
        "/v1/keys/{id}", "/v1/customers/{id}/sources", "/v1/payment_methods/{id}"]
    assert b"SECRET" not in raw and b"s3cr3t" not in raw and b"NffrFeUfNV2Hib" not in raw


async def test_raw_paths_when_asked(tmp_path: Path) -> None:
    engine, rec, _ = setup(tmp_path, redact_paths=False)
    check(engine, "sk_live_a", "r1", path="/v1/keys/sk_live_SECRET;session=s3cr3t")
    await rec.close()
    assert [x["path"] for x in read_all(tmp_path / "rec")] == ["/v1/keys/sk_live_SECRET;session=s3cr3t"]


def test_redact_path_keeps_route_names() -> None:
    assert [redact_path(p) for p in (
        "/v1/charges", "/v1/payment_methods", "/v1/oauth2/token", "/healthz", "/", "",
        "/v1/x;a=1/y;b=2", "/v1/users/a@b.example", "/v1/items/550e8400-e29b-41d4-a716-446655440000",
        "/v1/charges/ch_3MmlLrLkdIwHu7ix0snN0B15/refund",
    )] == ["/v1/charges", "/v1/payment_methods", "/v1/oauth2/token", "/healthz", "/", "",
           "/v1/x/y", "/v1/users/{id}", "/v1/items/{id}", "/v1/charges/{id}/refund"]


def test_workers_never_delete_each_others_files(tmp_path: Path) -> None:
    """--workers 2 --record DIR: each worker writes and bounds its own directory, so one
    worker's rotation never deletes the file another is writing; together they keep the bound."""
    config = ServerConfig(record_dir=str(tmp_path / "rec"), record_max_bytes=40_000)
    children = [child_config(config, i, workers=2) for i in range(2)]
    assert [c.record_dir for c in children] == [str(tmp_path / "rec" / f"worker-{i}") for i in range(2)]
    writers = [RotatingWriter(c.record_dir, c.record_max_bytes) for c in children]
    rng = random.Random(2)
    for _ in range(20):
        for w in writers:
            w.write(_noise(rng, 40))
            assert all(x.current is not None and x.current.exists() for x in writers if x.bytes_written)
    assert sum(p.stat().st_size for p in (tmp_path / "rec").rglob("record-*")) <= 40_000
    assert child_config(config, 0).record_dir == str(tmp_path / "rec")  # one worker: DIR itself
