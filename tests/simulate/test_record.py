"""The recorder: lines, durations from the access log, sampling by identity, rotation."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import yaml

from extauthz.clock import ManualClock
from extauthz.context import RawRequest
from extauthz.engine import Engine
from extauthz.policy import load_policy
from extauthz.simulate.record import Recorder, RotatingWriter, pending_ttl
from extauthz.simulate.replay import run_now
from extauthz.simulate.traffic import BadLines, TrafficFile, read_traffic
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
    engine = Engine(MemoryStore(clock), policy, clock=clock, observer=rec)
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

    from extauthz.cli import _size, build_parser, main

    assert _size("500M") == 500 << 20 and _size("2G") == 2 << 30 and _size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        _size("lots")
    args = build_parser().parse_args(["serve", "--record", "/tmp/r", "--record-max-bytes", "1M",
                                      "--record-sample", "0.25"])
    assert (args.record, args.record_max_bytes, args.record_sample) == ("/tmp/r", 1 << 20, 0.25)
    assert main(["serve", "--record", "/tmp/r", "--record-sample", "0"]) == 2
