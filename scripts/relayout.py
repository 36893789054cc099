#!/usr/bin/env python3
"""Move the package's top-level modules into its layers (issue 30; docs/design.md, "Layers").

    python3 scripts/relayout.py            # git mv, rewrite imports and names, report
    python3 scripts/relayout.py --dry-run  # say what would move, change nothing

``MOVES`` maps each old module (or package) to its new name. An entry whose source is not in
the tree is skipped (another branch moved or removed it; a second run finds every source
gone), so the script is idempotent and runs on a tree with other branches merged. What it does:

1. ``git mv`` each source to its new place and adds the new packages' ``__init__.py``;
2. rewrites ``from X import ...`` statements (read with ``ast``): relative ones in
   ``extauthz/`` resolved from where the module was and written from where it is, absolute
   ones (``from extauthz import reload``) in every Python file; a statement is split when
   its names now live in different packages; and the root facade's ``_HOMES`` strings;
3. rewrites, on every other line, dotted names (``extauthz.engine.Engine``; not a logger's
   name quoted whole, ``"extauthz.reload"``: operators' log filters name them) and paths
   (``extauthz/engine.py``, and ``server/portfile.py`` for a module that was in a
   subpackage) in ``extauthz/``, ``tests/``, ``bench/``, ``testinfra/``, ``scripts/``,
   ``docs/``, ``helm/``, ``README.md``, ``pyproject.toml`` and ``Containerfile``; adds the
   new packages to pyproject's list; writes docs/design.md's map (:data:`DESIGN_MAP`);
4. reports what it left: top-level modules of no layer, and bare ``NAME.py`` mentions of a
   moved top-level module (``engine.py``: which one is meant needs a reader).

Then: ``ruff check --fix`` (import order), ``pip install -e .`` (the entry point moved),
``tests/unit/test_layout.py`` and the tests.
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = "extauthz"

#: old module or package -> new name (the basename kept, so tests/unit/test_X.py still names
#: a module); entries for modules that other branches may add or remove are harmless
MOVES: dict[str, str] = {
    # core: the types, settings and small tools every layer uses
    "extauthz.backoff": "extauthz.core.backoff",
    "extauthz.clock": "extauthz.core.clock",
    "extauthz.context": "extauthz.core.context",
    "extauthz.cork": "extauthz.core.cork",
    "extauthz.errors": "extauthz.core.errors",
    "extauthz.runner": "extauthz.core.runner",
    "extauthz.settings": "extauthz.core.settings",
    "extauthz.throttle": "extauthz.core.throttle",
    "extauthz.tiers": "extauthz.core.tiers",
    "extauthz.verdict": "extauthz.core.verdict",
    "extauthz.server.portfile": "extauthz.core.portfile",
    # policy: classify applies the policy to a request
    "extauthz.classify": "extauthz.policy.classify",
    # observe: the traffic recorder is an observer (serve --record-dir)
    "extauthz.simulate.record": "extauthz.observe.record",
    # control: the stored documents the engine applies, who changed them, the control path
    "extauthz.changelog": "extauthz.control.changelog",
    "extauthz.control": "extauthz.control.control",
    "extauthz.documents": "extauthz.control.documents",
    "extauthz.inspect": "extauthz.control.inspect",
    "extauthz.overrides": "extauthz.control.overrides",
    "extauthz.switches": "extauthz.control.switches",
    "extauthz.server.admintokens": "extauthz.control.admintokens",
    # engine: snapshots and the decision, the store's protection, release, the answers
    "extauthz.answers": "extauthz.engine.answers",
    "extauthz.breaker": "extauthz.engine.breaker",
    "extauthz.engine": "extauthz.engine.engine",
    "extauthz.overload": "extauthz.engine.overload",
    "extauthz.release": "extauthz.engine.release",
    "extauthz.reload": "extauthz.engine.reload",
    "extauthz.tickets": "extauthz.engine.tickets",
    "extauthz.observe.state": "extauthz.engine.state",
    "extauthz.quota_service": "extauthz.engine.quota_service",  # issue 33: the RLQS quota book
    "extauthz.storegate": "extauthz.engine.storegate",    # issue 30's StoreGate, if top level
    "extauthz.gate": "extauthz.engine.gate",
    "extauthz.grantbook": "extauthz.engine.grantbook",
    # commands: what `extauthz` runs
    "extauthz.cli": "extauthz.commands.cli",
    "extauthz.demo": "extauthz.commands.demo",
    "extauthz.k8s": "extauthz.commands.k8s",
    "extauthz.opscli": "extauthz.commands.opscli",
    "extauthz.pictures": "extauthz.commands.pictures",
    "extauthz.ratelimit_config": "extauthz.commands.ratelimit_config",  # issue 32: import ratelimit-config
    "extauthz.simulate": "extauthz.commands.simulate",
}

#: the new packages' docstrings (their __init__.py, written when missing)
PACKAGES: dict[str, str] = {
    "extauthz.core": "Core: the types, settings and small tools every layer uses (no package imports above it).",
    "extauthz.control": "Control: the stored documents the engine applies (switches, overrides), who changed\n"
                        "them (the change log), one customer's view, and the control path the admin\n"
                        "routes and the operator commands use.",
    "extauthz.engine": "The engine: snapshots and the decision, the store's protection, release, the answers\n"
                       "both doors give, policy reload, and the state /status reports.",
    "extauthz.commands": "The ``extauthz`` commands: serve, the operator commands, simulate, pictures, k8s.",
}

#: docs/design.md's map in the new layout (written in place of the old one, whose section runs
#: to the end of its first code block); edit it for modules other branches added
DESIGN_MAP = """\
## Layers and the module map

The package is a stack of layers. A module imports from its own layer and the layers below
it, never from one above, and no chain of imports comes back to where it started:
`tests/unit/test_layout.py` holds the table and reads every import (function-level and
`TYPE_CHECKING` ones too). What other code may import is `extauthz.__all__`
(`extauthz/__init__.py`, pinned by `tests/unit/test_exported_members.py`): the engine, the
policy loader, the verdict types, the stores and the errors; everything else is internal.

| layer (lowest first) | package | what it holds |
|---|---|---|
| core | `core/`, `proto/` | types, settings and small tools every layer uses; protobuf classes |
| store | `store/` | the Store contract, memory and Redis, keys, the limiting rules once |
| policy | `policy/` | the policy format: schema, loader, compiled Policy, classify |
| limiters | `limiters/` | one module per limiter kind behind one Limiter protocol |
| observe | `observe/` | observers: metrics, decision log, traces, shadow, traffic recorder |
| control | `control/` | switches and overrides (stored documents), the change log, Control |
| engine | `engine/` | snapshots and the decision, breakers, release, answers, reload, state |
| envoy | `envoy/` | what Envoy sends and is told: header lists, record shapes, the one config generator |
| server | `server/` | the doors and the process: the only code that imports grpc and aiohttp |
| devtools | `devtools/` | a local Envoy + upstream stack for the demo, tests and benchmarks |
| commands | `commands/` | the `extauthz` commands (`__main__.py`: `python -m extauthz`) |

```
core/       settings (every serve option once: flag, EXTAUTHZ_* variable, default; Settings
            checks itself; parse_listen, off), context (RawRequest, RequestContext), verdict,
            errors, tiers, clock, runner (every background loop), backoff, throttle, cork,
            portfile (the admin URL file)
store/      base (Store protocol, ops), keys (every key), algorithms (the rules; lua/check.lua
            mirrors them), memory, redis_events; redis/: url, wire, batcher, conn, cluster, store
policy/     schema (strict, bounded), loader (file/path/line errors), model (Policy, frozen),
            jsonschema, classify (identity, tier, plan, limiter keys -> RequestContext),
            descriptors (Envoy rate limit descriptors: envoyproxy/ratelimit's lookup)
limiters/   base (Limiter, PerCustomer, FleetWide), request_rate, concurrent, quota, fleet,
            worker (the worker shedder and its sampler), refusals, grants (batched grants)
observe/    base (Observer), setup (Observability), metrics, logs, tracing, shadow,
            edge_metrics, recent_refusals, record (`serve --record`)
control/    documents (Document, Board), switches, overrides, changelog, inspect
            (customer_view), control (Control, AdminControl, StoreControl), admintokens
engine/     engine (Engine: snapshots; decide, THE fail-open place), storegate (StoreGate:
            the store call behind breakers, deadline, blame, abandoned answers; builds the
            GrantBook), breaker, overload (LoopLag, the check budget), release (Releaser, THE
            release path), answers (what both edges send), tickets (lease tickets), reload
            (PolicyWatcher), state (Panel and the Parts of /status and /metrics),
            quota_service (RLQS: divide, QuotaBook; docs/rlqs.md)
envoy/      headers (what each protocol sends, each edge reads), records (access-log and
            fluentd shapes), frame (Options, Build, the Target protocol), config (THE
            generator: bootstrap, TARGETS), ext_authz (grpc and http targets), ratelimit (the rate limit service's filter), rlqs (the quota
            filter), blocks (clusters, strips, timeouts); configs/: envoy/*.yaml as shipped
server/     app (Server: builds everything once from one Settings), flow (CheckFlow, Door),
            traced (check_flow), services + edge (the gRPC door: Check, access log, RLQS),
            rls (ShouldRateLimit), grpc_h2 (gRPC on the event loop, the default), http +
            httpmap (the HTTP door), fluentd, leases, panel (/status), opsports, fleetstate
            (ReplicaControl), admin, adminauth, ports, tls, workers
devtools/   client, envoy_config, envoy_process, stack, upstream
commands/   cli (`extauthz`, serve), opscli (switch, report, status, override, history,
            hash, inspect), k8s, demo, pictures, ratelimit_config (`import
            ratelimit-config`); simulate/: cli, identities, traffic,
            replay, advice, report
lua/        the Lua scripts (shipped as extauthz.lua); peek.lua is read-only
```

The old flat names map to these by `scripts/relayout.py`'s `MOVES` (each module keeps its
name: `extauthz/engine.py` is `extauthz/engine/engine.py`, `settings.py` is
`core/settings.py`). Each module's docstring says what it owns.
"""

#: top-level modules that stay where they are
STAYS = {"extauthz.__main__"}

TEXT_ROOTS = ("extauthz", "tests", "bench", "testinfra", "scripts", "docs", "helm")
TEXT_FILES = ("README.md", "pyproject.toml", "Containerfile")
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".toml", ".txt", ".yaml", ".yml", ".sh", ".cfg", ".ini", ".json", ""}
SKIP_PARTS = {".venv", "__pycache__", ".git", "extauthz_wire", ".mypy_cache", ".ruff_cache", ".pytest_cache"}
SELF = Path(__file__).resolve()


def source_of(name: str, root: Path = ROOT) -> Path | None:
    """The file or package directory of module ``name``, when it is in the tree."""
    base = root.joinpath(*name.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base
    return None


def movable(old: str, new: str, root: Path = ROOT) -> bool:
    """Whether ``old`` is still to move: its source is in the tree, and it is not the new
    package of the same name (``extauthz/control/`` once ``control.py`` went into it)."""
    source = source_of(old, root)
    if source is None or (source.is_dir() and new.startswith(old + ".")):
        return False
    return not target_of(new, source, root).exists()


def target_of(name: str, source: Path, root: Path = ROOT) -> Path:
    base = root.joinpath(*name.split("."))
    return base if source.is_dir() else base.with_suffix(".py")


def mapped(name: str, moves: dict[str, str]) -> str:
    """``name`` under its longest moved prefix (``extauthz.engine.Engine`` -> ...)."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        head = ".".join(parts[:cut])
        if head in moves:
            return ".".join([moves[head], *parts[cut:]])
    return name


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def relative(target: str, package: str) -> str:
    """``target`` as a relative module from inside ``package``."""
    t, p = target.split("."), package.split(".")
    common = 0
    while common < min(len(t), len(p)) and t[common] == p[common]:
        common += 1
    return "." * (len(p) - common + 1) + ".".join(t[common:])


def rewrite_imports(text: str, old: str | None, new: str | None, is_package: bool,
                    moves: dict[str, str], known: set[str]) -> list[tuple[int, int, str]]:
    """``from X import ...`` statements for the moved modules, and the lines they took (which
    the dotted-name pass then leaves alone: ``extauthz.engine`` is an old module and a new
    package). Relative imports (a module of the package that was ``old`` and is ``new``) are
    resolved from the old place and written from the new one; absolute ones (``from extauthz
    import reload``) are written absolute. ``known``: every module before the move."""
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []  # (first line, last line, replacement)
    old_pkg = (old if is_package else old.rpartition(".")[0]) if old else ""
    new_pkg = (new if is_package else new.rpartition(".")[0]) if new else ""
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if old is None:
                continue
            base = old_pkg.split(".")[: len(old_pkg.split(".")) - node.level + 1]
            source = ".".join([*base, *([node.module] if node.module else [])])
        elif node.module == PKG or (node.module or "").startswith(PKG + "."):
            source = node.module or ""
        else:
            continue
        groups: dict[str, list[str]] = {}
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in known:  # a module imported from its package
                home, name = mapped(sub, moves).rpartition(".")[::2]
                shown = alias.asname or (alias.name if name != alias.name else None)
            else:
                home, name, shown = mapped(source, moves), alias.name, alias.asname
            groups.setdefault(home, []).append(name if shown in (None, name) else f"{name} as {shown}")
        assert node.end_lineno is not None
        if list(groups) == [source] and (not node.level or new_pkg == old_pkg):
            edits.append((node.lineno, node.end_lineno, ""))  # unchanged, and left alone
            continue

        def written(home: str, level: int = node.level) -> str:
            return relative(home, new_pkg) if level else home

        first = lines[node.lineno - 1]
        match = re.match(r"(\s*)from\s+(\.*[\w.]*)\s+import\b", first)
        if match is None:
            raise SystemExit(f"{new or old}: cannot read the import on line {node.lineno}")
        if len(groups) == 1:  # one home: change only "from X", names and layout kept
            (home,) = groups
            edits.append((node.lineno, node.end_lineno,
                           first[: match.start(2)] + written(home) + first[match.end(2):]))
            continue
        indent = match.group(1)
        body = "".join(f"{indent}from {written(home)} import {', '.join(names)}\n"
                       for home, names in groups.items())
        edits.append((node.lineno, node.end_lineno, body))
    return edits


def rewritten(text: str, edits: list[tuple[int, int, str]], other: Callable[[str], str]) -> str:
    """``text`` with the import ``edits`` made (a replacement ending in a newline replaces
    the statement's lines, one without replaces its first line only, "" keeps it) and
    ``other`` applied to every line no import statement took."""
    lines = text.splitlines(keepends=True)
    by_first = {first: (last, replacement) for first, last, replacement in edits}
    out: list[str] = []
    n = 1
    while n <= len(lines):
        if n in by_first:
            last, replacement = by_first[n]
            if replacement.endswith("\n") and replacement.count("\n") > 1:
                out.append(replacement)
            else:
                out.append(replacement or lines[n - 1])
                out.extend(lines[n: last])
            n = last + 1
            continue
        out.append(other(lines[n - 1]))
        n += 1
    return "".join(out)


def rewrite_homes(text: str, moves: dict[str, str]) -> str:
    """The root facade's ``_HOMES`` values: ``".engine"`` is relative to ``extauthz``."""
    def one(match: re.Match[str]) -> str:
        new = mapped(PKG + match.group(2), moves)
        return f"{match.group(1)}{relative(new, PKG)}{match.group(3)}"
    return re.sub(r'(:\s*")(\.[\w.]+)(")', one, text)


def path_rules(moves: dict[str, str], packages: set[str]) -> list[tuple[re.Pattern[str], str]]:
    """(pattern, replacement) for the paths of the moved modules: ``extauthz/OLD`` always,
    ``OLD`` alone when it has a directory (``server/portfile.py``)."""
    rules = []
    for old, new in sorted(moves.items(), key=lambda item: -len(item[0])):
        old_rel = "/".join(old.split(".")[1:]) + ("/" if old in packages else ".py")
        new_rel = "/".join(new.split(".")[1:]) + ("/" if old in packages else ".py")
        bare = "?" if "/" in old_rel.rstrip("/") else ""
        pattern = re.compile(rf"(?<![\w./-])((?:{PKG}/){bare})" + re.escape(old_rel) + r"(?![\w])")
        rules.append((pattern, rf"\g<1>{new_rel}"))
    return rules


def kept_names(root: Path = ROOT) -> set[str]:
    """Names that look like modules but are not: the package's logger names
    (``getLogger("extauthz.reload")``: an operator's log filters name them) and any other
    whole string of the package that is an old module's name (the fluentd tag
    ``"extauthz.release"``: the package never names a module in a string)."""
    found: set[str] = set()
    for path in (root / PKG).rglob("*.py"):
        if "extauthz_wire" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                    and re.fullmatch(rf"{PKG}(\.\w+)+", node.value):
                found.add(node.value)
    return found


#: (file, line) where a kept name was rewritten unquoted (a reader decides: docs' `tag ...`)
REWRITTEN_KEPT: list[str] = []


def rewrite_text(text: str, moves: dict[str, str], rules: list[tuple[re.Pattern[str], str]],
                 loggers: frozenset[str] = frozenset()) -> str:
    def one(match: re.Match[str]) -> str:
        before, after = text[match.start() - 1: match.start()], text[match.end(): match.end() + 1]
        name, new = match.group(0), mapped(match.group(0), moves)
        if name in loggers and new != name:
            if (before in ("'", '"') and after == before) or text[: match.start()].endswith("tag `"):
                return name  # a logger's or tag's name, quoted whole or called a tag: kept
            REWRITTEN_KEPT.append(f"{name} in: {text.strip()[:90]}")
        return new

    text = re.sub(rf"(?<![\w.]){PKG}(?:\.\w+)+", one, text)
    for pattern, replacement in rules:
        text = pattern.sub(replacement, text)
    return text


def text_files(root: Path) -> list[Path]:
    found = [root / name for name in TEXT_FILES if (root / name).is_file()]
    for top in TEXT_ROOTS:
        for path in sorted((root / top).rglob("*")):
            if (path.is_file() and not SKIP_PARTS.intersection(path.parts) and path.resolve() != SELF
                    and path.suffix in TEXT_SUFFIXES):
                found.append(path)
    return found


def git(*args: str, root: Path = ROOT) -> None:
    subprocess.run(["git", *args], cwd=root, check=True)


def add_packages_to_pyproject(text: str, packages: list[str]) -> str:
    """pyproject's ``packages = [...]`` with ``packages`` added (the list is written out, not
    discovered: ``extauthz.lua`` lives in ``lua/``)."""
    match = re.search(r"^packages = \[(.*?)\]", text, re.S | re.M)
    if match is None:
        return text
    listed = re.findall(r'"([\w.]+)"', match.group(1))
    if set(packages) <= set(listed):
        return text
    lines, line = [], ""
    for name in sorted({*listed, *packages}):
        item = f'"{name}", '
        if line and len(line) + len(item) > 98:
            lines.append(line.rstrip())
            line = ""
        line += item
    lines.append(line.rstrip())
    return text[: match.start()] + "packages = [\n" + "".join(f"  {x}\n" for x in lines) + "]" + text[match.end():]


def relayout(root: Path = ROOT, dry_run: bool = False) -> int:
    known = {module_name(p, root) for p in (root / PKG).rglob("*.py")
             if "extauthz_wire" not in p.parts}
    active = {old: new for old, new in MOVES.items() if movable(old, new, root)}
    skipped = sorted(set(MOVES) - set(active))
    packages = {old for old in active if (root.joinpath(*old.split(".")) / "__init__.py").is_file()}
    for old in skipped:
        print(f"skip {old}: not in the tree")
    order = sorted(active.items(), key=lambda item: (-item[0].count("."), item[0]))  # inner first
    moved: dict[Path, str] = {}  # new file -> its old module name
    for old, new in order:
        source = source_of(old, root)
        assert source is not None
        target = target_of(new, source, root)
        print(f"move {source.relative_to(root)} -> {target.relative_to(root)}")
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        for path in files:
            if module_name(path, root) != old and mapped(module_name(path, root), active) != \
                    mapped(module_name(path, root), {old: new}):
                continue  # moved on its own (simulate/record.py out of simulate/)
            moved[target / path.relative_to(source) if source.is_dir() else target] = module_name(path, root)
    if dry_run:
        return 0
    for package, doc in PACKAGES.items():
        init = root.joinpath(*package.split(".")) / "__init__.py"
        if not init.exists() and any(new.startswith(package + ".") for new in active.values()):
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""{doc}"""\n')
            git("add", str(init.relative_to(root)), root=root)
    for old, new in order:
        source = source_of(old, root)
        assert source is not None
        target = target_of(new, source, root)
        target.parent.mkdir(parents=True, exist_ok=True)
        git("mv", str(source.relative_to(root)), str(target.relative_to(root)), root=root)
    # imports (relative ones from where each module was to where it is), then every other
    # line's dotted names and paths
    rules = path_rules(active, packages)
    loggers = frozenset(kept_names(root))
    for path in text_files(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        edits: list[tuple[int, int, str]] = []
        if path.suffix == ".py":
            inside = (root / PKG) in path.parents
            here = module_name(path, root) if inside else None
            was = moved.get(path, here) if here else None
            edits = rewrite_imports(text, was, here, path.name == "__init__.py", active, known)
        fixed = rewritten(text, edits, lambda line: rewrite_text(line, active, rules, loggers))
        if path == root / PKG / "__init__.py":
            fixed = rewrite_homes(fixed, active)
        if fixed != text:
            path.write_text(fixed)
    pyproject = root / "pyproject.toml"
    if pyproject.is_file():
        new_packages = sorted({module_name(p.parent / "__init__.py", root)
                               for p in (root / PKG).rglob("__init__.py") if "extauthz_wire" not in p.parts})
        pyproject.write_text(add_packages_to_pyproject(pyproject.read_text(), new_packages))
    write_design_map(root)
    return report(root)


def write_design_map(root: Path = ROOT) -> None:
    """Put :data:`DESIGN_MAP` in place of docs/design.md's old module map (once)."""
    path = root / "docs" / "design.md"
    if not path.is_file():
        return
    text = path.read_text()
    start = text.find("## Layers and the module map\n")
    if start < 0 or "| layer (lowest first) |" in text:
        return
    fence = text.find("```\n", start)
    end = text.find("```\n", fence + 4) if fence >= 0 else -1
    if end < 0:
        print("docs/design.md: the module map's code block not found; map not written")
        return
    rest = text[end + 4:].lstrip("\n")
    path.write_text(text[:start] + DESIGN_MAP + "\n" + rest)


def report(root: Path = ROOT) -> int:
    """What the moves left for a reader: top-level modules that are in no layer, and bare
    ``NAME.py`` mentions of a moved top-level module."""
    left = sorted(f"extauthz.{p.stem}" for p in (root / PKG).glob("*.py")
                  if p.stem != "__init__" and f"extauthz.{p.stem}" not in STAYS)
    for name in left:
        print(f"left at the top level: {name} (add it to MOVES)")
    bare = sorted({old.split(".")[1] for old in MOVES if old.count(".") == 1})
    pattern = re.compile(rf"(?<![\w./-])({'|'.join(bare)})\.py\b")
    mentions: dict[str, int] = {}
    for path in text_files(root):
        if path.suffix != ".py":
            continue
        for match in pattern.finditer(path.read_text(errors="replace")):
            key = f"{path.relative_to(root)}: {match.group(0)}"
            mentions[key] = mentions.get(key, 0) + 1
    for key, count in sorted(mentions.items()):
        print(f"review a bare mention: {key}" + (f" (x{count})" if count > 1 else ""))
    for line in REWRITTEN_KEPT:
        print(f"review a logger or tag name rewritten as a module: {line}")
    return 1 if left else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="say what would move, change nothing")
    args = parser.parse_args(argv)
    return relayout(ROOT, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
