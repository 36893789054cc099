"""extauthz/core/settings.py: each option once, and the docs, README and chart naming only options
that exist, with the defaults the settings declare."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from extauthz.commands.cli import build_parser
from extauthz.core import settings
from extauthz.core.settings import Settings, default_text, off, options, worker_env, worker_handover

from ..conftest import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHART = ROOT / "helm" / "extauthz"
#: EXTAUTHZ_* names that are not serve options, and who reads them
NOT_OPTIONS = {
    "EXTAUTHZ_ADMIN_URL": "the operator commands' admin URL (settings.admin_url, for opscli.py)",
    "EXTAUTHZ_EVENT_LOOP": "serve's event loop, asyncio or uvloop (settings.event_loop, for server/app.py)",
    "EXTAUTHZ_SKIP_MIN_DEPS": "scripts/test: skip the run under the minimum dependency versions",
}
#: chart values that differ from the server's default on purpose
CHART_DIFFERS = {"EXTAUTHZ_POLICIES": "the ConfigMap's mount path"}


def _serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def _first(text: str) -> str:
    """The leading value of a stated default: '1M, a ConfigMap's limit' -> '1M'."""
    return text.strip().strip("`").split(",")[0].split()[0].strip("`")


def test_every_field_is_an_option_or_says_why_it_is_internal() -> None:
    fields = dataclasses.fields(Settings)
    for f in fields:
        assert ("option" in f.metadata) != ("internal" in f.metadata), f.name
        assert f.metadata.get("internal", "x"), f.name
    flags = [o.flag for o in options().values()]
    assert len(flags) == len(set(flags)) >= 30
    assert {o.env for o in options().values()} >= {
        "EXTAUTHZ_POLICY_MAX_BYTES", "EXTAUTHZ_HTTP_MAX_CONNECTIONS", "EXTAUTHZ_RECORD_PATHS",
        "EXTAUTHZ_ADMIN_TOKEN_FILE", "EXTAUTHZ_ADMIN_HOSTS", "EXTAUTHZ_HTTP_PATH_PREFIX",
        "EXTAUTHZ_WORKERS", "EXTAUTHZ_WORKER_PORTS", "EXTAUTHZ_LOG_LEVEL", "EXTAUTHZ_LOG_FORMAT"}


def test_serve_parser_is_generated_with_every_flag_its_variable_and_default() -> None:
    parser = _serve_parser()
    by_flag = {a.option_strings[0]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(by_flag) == {o.flag for o in options().values()}
    text = parser.format_help()
    for name, opt in options().items():
        help_text = str(by_flag[opt.flag].help)
        assert f"[{opt.env}" in help_text, opt.flag
        shown = default_text(name)
        if shown is not None:
            assert f"default {shown}]" in help_text, opt.flag
        assert opt.flag in text


def test_no_flags_and_no_variables_give_the_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for opt in options().values():
        monkeypatch.delenv(opt.env, raising=False)
    config = settings.from_args(build_parser().parse_args(["serve", "--admin-url-file", "off"]))
    assert config == dataclasses.replace(Settings(), admin_listen_optional=True)


def test_variables_are_parsed_like_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXTAUTHZ_POLICIES", "a,b")
    monkeypatch.setenv("EXTAUTHZ_STORE_DEADLINE_MS", "7.5")
    monkeypatch.setenv("EXTAUTHZ_RECORD_MAX_BYTES", "2G")
    monkeypatch.setenv("EXTAUTHZ_WORKER_PORTS", "yes")
    monkeypatch.setenv("EXTAUTHZ_WORKERS", "3")
    monkeypatch.setenv("EXTAUTHZ_LOG_FORMAT", "text")
    monkeypatch.setenv("EXTAUTHZ_ADMIN_LISTEN", "127.0.0.1:9102")
    monkeypatch.setenv("EXTAUTHZ_ADMIN_HOSTS", "Admin.Example, other")
    config = settings.from_args(build_parser().parse_args(["serve", "--workers", "4"]))
    assert (config.policies, config.store_deadline_ms, config.record_max_bytes) == (["a", "b"], 7.5, 2 << 30)
    assert (config.worker_ports, config.workers, config.log_format) == (True, 4, "text")
    assert (config.admin_listen, config.admin_listen_optional) == ("127.0.0.1:9102", False)
    assert config.admin_hosts == ("admin.example", "other")


@pytest.mark.parametrize("argv", [["--store-deadline-ms", "nan"], ["--store-deadline-ms", "0"],
                                  ["--log-format", "xml"], ["--workers", "two"],
                                  ["--check-budget-ms", "1"], ["--check-budget-ms", "19.9"]])
def test_a_bad_value_is_refused_naming_the_flag(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert argv[0] in capsys.readouterr().err


@pytest.mark.parametrize(("given", "message"), [
    ({"record_sample": 0.0}, "--record-sample must be in (0, 1], not 0.0"),
    ({"record_sample": float("nan")}, "--record-sample must be in (0, 1], not nan"),
    ({"http_path_prefix": "auth"}, "--http-path-prefix: an HTTP path prefix is a path such as /auth"),
    ({"workers": 0}, "--workers must be at least 1"),
])
def test_an_in_process_settings_checks_itself(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings(**given)
    assert Settings(record_sample=1.0, http_path_prefix="/auth/", workers=1).record_sample == 1.0


@pytest.mark.parametrize(("given", "message"), [
    ({"store_deadline_ms": 0.0}, "--store-deadline-ms: bad milliseconds '0.0': must be positive and finite"),
    ({"store_deadline_ms": float("nan")}, "--store-deadline-ms: bad milliseconds 'nan'"),
    ({"check_budget_ms": 5.0}, "--check-budget-ms: bad milliseconds '5.0': at least 20"),
    ({"check_budget_ms": float("inf")}, "--check-budget-ms: bad milliseconds 'inf'"),
    ({"memory_max_keys": 0}, "--memory-max-keys: bad count '0': must be at least 1"),
    ({"http_max_connections": -1}, "--http-max-connections: bad count '-1': must be at least 1"),
    ({"policy_max_bytes": 0}, "--policy-max-bytes: bad size '0': must be positive"),
])
def test_an_in_process_settings_is_held_to_each_options_range(given: dict[str, Any], message: str) -> None:
    """Issue 30: ``Settings`` checks itself: the ranges serve's parsers hold a flag to
    (positive, finite, within the check budget's bounds) hold an in-process ``Settings(...)``
    and a worker's hand-over too, not only the command line."""
    with pytest.raises(ValueError, match=re.escape(message)):
        Settings(**given)
    with pytest.raises(ValueError, match=re.escape(message.partition(":")[0])):
        worker_handover(worker_env(Settings(), 7) | {settings.WORKER_CONFIG_ENV: json.dumps(given)})


def test_every_value_a_flag_refuses_an_in_process_settings_refuses() -> None:
    """For each option with a parser, a number the parser refuses as text is refused by
    ``Settings`` as a value, naming the flag (and the defaults pass)."""
    checked = 0
    for name, opt in options().items():
        if opt.parse is None:
            continue
        default = getattr(Settings(), name)
        kind = type(default) if default is not None else int
        for text in ("0", "-1", "nan", "inf", "19", "1e9"):
            if kind is int and not text.lstrip("-").isdigit():
                continue  # refused for its form, which a number value does not have
            try:
                opt.parse(text)
            except argparse.ArgumentTypeError:
                with pytest.raises(ValueError, match=re.escape(opt.flag)):
                    Settings(**{name: kind(text)})
                checked += 1
    assert checked >= 10


def test_the_command_line_refuses_what_settings_refuse(capsys: pytest.CaptureFixture[str]) -> None:
    from extauthz.commands.cli import main

    assert main(["serve", "--record-sample", "1.5"]) == 2
    assert "--record-sample must be in (0, 1], not 1.5" in capsys.readouterr().err


def test_every_extauthz_variable_is_read_in_settings() -> None:
    """A name a read uses (a whole string ``EXTAUTHZ_*``) is in the settings module only, the
    workers' hand-over (server/workers.py) included."""
    where: dict[str, set[str]] = {}
    for path in sorted((ROOT / "extauthz").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(r"EXTAUTHZ_[A-Z0-9_]+", node.value):
                where.setdefault(node.value, set()).add(path.relative_to(ROOT / "extauthz").as_posix())
    outside = {name: sorted(files) for name, files in where.items()
               if any(not f.endswith("settings.py") for f in files)}
    assert outside == {}
    assert {"EXTAUTHZ_EVENT_LOOP", "EXTAUTHZ_ADMIN_URL", "EXTAUTHZ_WORKER_CONFIG",
            "EXTAUTHZ_WORKER_READY_FD"} <= set(where)


def test_off_is_parsed_once() -> None:
    assert [off(v) for v in (None, "", " ", "off", "OFF", "none", " Off ")] == [None] * 7
    assert off("0.0.0.0:9003") == "0.0.0.0:9003"


def test_the_workers_receive_the_one_settings_object() -> None:
    from extauthz.server import workers

    source = Path(workers.__file__).read_text()
    assert set(re.findall(r"EXTAUTHZ_[A-Z_]+", source)) == set()
    config = Settings(log_level="debug", log_format="text", workers=2, worker_ports=True, redis_url="redis://x")
    child = workers.child_config(config, 1, own_ports=True, workers=2)
    assert (child.log_level, child.log_format) == ("debug", "text")
    # handed over as one Settings (checked again on arrival) and the ready pipe
    received, fd = worker_handover(worker_env(child, 7))
    assert (received, fd) == (child, 7)
    bad = worker_env(child, 7) | {"EXTAUTHZ_WORKER_CONFIG": json.dumps({"workers": 0})}
    with pytest.raises(ValueError, match="workers"):
        worker_handover(bad)
    with pytest.raises(ValueError, match="not started as a worker of extauthz serve --workers"):
        worker_handover({})


# -- the docs, the README and the chart ----------------------------------------------------


def test_docs_name_only_variables_that_exist() -> None:
    known = {o.env for o in options().values()} | set(NOT_OPTIONS)
    for path in [*DOCS, *CHART.glob("templates/*"), CHART / "values.yaml"]:
        for name in re.findall(r"EXTAUTHZ_[A-Z_]*[A-Z]", path.read_text()):
            assert name in known, f"{path.relative_to(ROOT)} names {name}, which nothing reads"


def test_option_tables_pair_flags_with_their_variables_and_defaults() -> None:
    by_flag = {o.flag: (name, o) for name, o in options().items()}
    rows = 0
    for path in DOCS:
        for line in path.read_text().splitlines():
            if not line.startswith("|") or "EXTAUTHZ_" not in line:
                continue
            flag = re.match(r"\|\s*`(--[a-z-]+)", line)
            if flag is None:
                continue
            rows += 1
            assert flag.group(1) in by_flag, f"{path.name}: {flag.group(1)} is no serve option"
            name, opt = by_flag[flag.group(1)]
            assert re.findall(r"EXTAUTHZ_[A-Z_]*[A-Z]", line)[0] == opt.env, line
            stated = re.search(r"\(default ([^)]+)\)|Default: ([^.|]+)", line)
            if stated is not None:
                assert _first(stated.group(1) or stated.group(2)) == _first(default_text(name) or ""), line
    assert rows >= 6  # docs/http.md's table at least


def test_readme_serve_options_exist_with_their_defaults() -> None:
    text = (ROOT / "README.md").read_text()
    paragraph = text[text.index("Serve options:"):]
    paragraph = paragraph[:paragraph.index("\n\n")]
    by_flag = {o.flag: name for name, o in options().items()}
    flags = re.findall(r"`(--[a-z-]+)", paragraph)
    assert len(flags) >= 15
    for flag in flags:
        assert flag in by_flag, f"README's serve options name {flag}"
    for flag, stated in re.findall(r"`(--[a-z-]+)[^`]*`\s*\(?,?\s*\(?default (?!from)`?([^`,;)]+)", paragraph):
        assert _first(stated) == _first(default_text(by_flag[flag]) or ""), (flag, stated)


def _values() -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "values.yaml").read_text()))


def _value(values: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        values = values[part]
    return values


def test_chart_variables_carry_the_server_defaults() -> None:
    """The chart's defaults (values.yaml, passed through templates/deployment.yaml) are the
    server's, and docs/helm.md states the chart's."""
    values = _values()
    env_of = {o.env: name for name, o in options().items()}
    template = (CHART / "templates" / "deployment.yaml").read_text()
    pairs = re.findall(r"- name: (EXTAUTHZ_[A-Z_]+)\n\s+value: (.*)", template)
    checked = 0
    for env, expr in pairs:
        assert env in env_of, env
        ref = re.fullmatch(r'\{\{ \.Values\.([\w.]+) .*\}\}|"0\.0\.0\.0:\{\{ \$grpcPort \}\}"', expr.strip())
        if ref is None or env in CHART_DIFFERS:
            continue
        value = _value(values, ref.group(1)) if ref.group(1) else f"0.0.0.0:{values['server']['grpcPort']}"
        if value in (None, ""):
            continue
        assert str(value) == default_text(env_of[env]), (env, value)
        checked += 1
    assert checked >= 5
    for line in (ROOT / "docs" / "helm.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) != 3 or not cells[0].startswith("`server."):
            continue
        keys = re.findall(r"`(server\.\w+)`", cells[0])
        stated = [s.strip().strip("`") for s in cells[1].split(",")]
        if len(keys) == len(stated) and all(s and not s.startswith("unset") for s in stated):
            for key, s in zip(keys, stated, strict=True):
                assert str(_value(values, key)) == s, (key, s)
