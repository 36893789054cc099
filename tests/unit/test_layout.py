"""The tests are laid out like the package (docs/design.md, "Tests"): ``tests/unit/test_X.py``
and ``tests/store/redis/test_X.py`` name a module that exists, except the short list of
cross-module files below; ``bench/`` and ``testinfra/`` never import ``tests`` (the Redis
topologies both use live in ``testinfra/``), and the package imports neither.

The package's layers (docs/design.md, "Layers"): every module of ``extauthz`` belongs to one
layer (its longest prefix in ``LAYERS``); a module imports from its own layer and the layers
below it, never from one above, and no chain of imports comes back to where it started (a
circle), inside a layer or across. Imports are read with ``ast``, not by importing:
module-level and function-level imports both count, and so do imports under ``if
TYPE_CHECKING:`` (a type is a dependency too: an upward type becomes a ``Protocol`` in the
lower layer). ``from PKG import NAME`` is an import of ``PKG.NAME`` when that is a module,
else of ``PKG``; the packages a dotted import passes through (their ``__init__``) are not
counted. The root ``extauthz`` (the public facade) is in no layer: it names each public
name's home and imports it when first used, so any module may take ``__version__`` from it;
its imports still count for circles."""

from __future__ import annotations

import ast
import re
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: tests/unit files that test a behaviour spanning several modules, or no module, with why.
CROSS_MODULE = {
    "test_build_image_usage": "scripts/build-image's command line",
    "test_doc_examples": "the policy examples in docs/policy.md through the loader",
    "test_exported_members": "the public surface, extauthz/__init__.py's __all__",
    "test_identity_auth": "identity from authentication: the edge and the classifier",
    "test_imports": "import hygiene: what a server on the embedded store loads (no redis-py), "
                    "what the command line loads (no pydantic, no aiohttp)",
    "test_layout": "this file",
    "test_plans": "plans and live overrides: policy, overrides and the engine",
    "test_plans_metadata": "a plan from a verified claim: the edge and the classifier",
    "test_quota_shed": "shedders pushed to Envoy: the worker shedder, the quota book, its answers on the wire",
    "test_readme": "README.md as a new user follows it: the walkthrough, installs, the test command",
    "test_route_metadata": "the tier from the route's metadata: the edge and the classifier",
}


def module_names(package: Path) -> set[str]:
    """Every module and subpackage name under ``package`` (``extauthz/store/redis/conn.py``
    gives ``conn``, ``extauthz/policy/`` gives ``policy``)."""
    names = {p.stem for p in package.rglob("*.py") if p.stem != "__init__"}
    return names | {p.parent.name for p in package.rglob("__init__.py")}


def unnamed_tests(directory: Path, modules: set[str], allowed: Collection[str] = ()) -> list[str]:
    """The ``test_X.py`` files of ``directory`` whose X is no module and not allowed."""
    return sorted(p.name for p in directory.glob("test_*.py")
                  if p.stem.removeprefix("test_") not in modules and p.stem not in allowed)


def imports_of(root: Path, top: str) -> list[str]:
    """``file:line`` of every import of package ``top`` (or a module in it) under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if any(name == top or name.startswith(top + ".") for name in names):
                found.append(f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def test_every_unit_test_file_names_a_module_or_says_why_not() -> None:
    assert unnamed_tests(ROOT / "tests" / "unit", module_names(ROOT / "extauthz"), set(CROSS_MODULE)) == []


def test_the_cross_module_list_holds_only_existing_files_that_name_no_module() -> None:
    modules = module_names(ROOT / "extauthz")
    for stem in CROSS_MODULE:
        assert (ROOT / "tests" / "unit" / f"{stem}.py").exists(), stem
        assert stem.removeprefix("test_") not in modules, f"{stem} names a module: drop it from the list"


def test_the_redis_store_tests_are_one_file_per_module() -> None:
    modules = module_names(ROOT / "extauthz" / "store" / "redis") | {"lua"}  # lua/: the scripts
    assert len(list((ROOT / "tests" / "store" / "redis").glob("test_*.py"))) > 1
    assert unnamed_tests(ROOT / "tests" / "store" / "redis", modules) == []


def test_bench_and_testinfra_do_not_import_tests_and_the_package_imports_neither() -> None:
    assert imports_of(ROOT / "bench", "tests") == []
    assert imports_of(ROOT / "testinfra", "tests") == []
    assert imports_of(ROOT / "extauthz", "tests") == []
    assert imports_of(ROOT / "extauthz", "testinfra") == []


def test_the_checks_find_what_they_look_for(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/alpha.py"):
        (tmp_path / name).write_text("")
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "run.py").write_text(
        "import os\nfrom tests.infra.redis_servers import start_single\nimport tests_extra\n")
    (tmp_path / "bench" / "ok.py").write_text("from . import tests\nfrom testinfra import redis_servers\n")
    assert imports_of(tmp_path / "bench", "tests") == ["bench/run.py:2"]
    (tmp_path / "unit").mkdir()
    for name in ("test_alpha.py", "test_sub.py", "test_beta.py", "test_gamma.py", "helpers.py"):
        (tmp_path / "unit" / name).write_text("")
    assert module_names(tmp_path / "pkg") == {"alpha", "sub", "pkg"}
    assert unnamed_tests(tmp_path / "unit", module_names(tmp_path / "pkg"), {"test_gamma"}) == ["test_beta.py"]


# -- layers ------------------------------------------------------------------------------------

PACKAGE = ROOT / "extauthz"

#: the layers, lowest first: (name, the module prefixes it holds, under ``extauthz.``)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("core", "proto")),               # types, settings, small tools; protobuf classes
    ("store", ("store",)),                     # Store: memory and Redis, keys, the algorithms
    ("policy", ("policy",)),                   # the policy format, classify (request -> context)
    ("limiters", ("limiters",)),               # one module per limiter kind
    ("observe", ("observe",)),                 # observers: metrics, logs, traces, shadow, record
    ("control", ("control",)),                 # switches, overrides, the change log, Control
    ("engine", ("engine",)),                   # the engine, release, answers, reload, state
    ("envoy", ("envoy",)),                     # what Envoy is told and sends
    ("server", ("server",)),                   # the doors and the process (grpc, aiohttp)
    ("devtools", ("devtools",)),               # a local stack for demos, tests, benchmarks
    ("commands", ("commands", "__main__")),    # the `extauthz` commands
)

ROOT_MODULE = "extauthz"

#: upward imports allowed for a while (none: issue 30 removed the last, the envoy package's
#: imports of server code); each must still occur, so an entry goes when its import does
PENDING: frozenset[tuple[str, str]] = frozenset()


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package (generated protobuf code left out) -> its file."""
    found: dict[str, Path] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        if "extauthz_wire" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        found[".".join(parts)] = path
    return found


def module_imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package modules ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            subs = [f"{module}.{alias.name}" for alias in node.names]
            targets = [s for s in subs if s in known]
            if len(targets) < len(subs):
                targets.append(module)
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(module_imports(name, path, known)) for name, path in known.items()}


def layer_of(module: str) -> int:
    best, found = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in (f"extauthz.{p}" for p in prefixes):
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    if found < 0:
        raise LookupError(f"{module} is in no layer: add it to LAYERS (and to docs/design.md)")
    return found


def upward_imports() -> list[tuple[str, str]]:
    return sorted((src, dst) for src, targets in graph().items() if src != ROOT_MODULE
                  for dst in targets if dst != ROOT_MODULE and layer_of(dst) > layer_of(src))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, rest = work[-1]
            for nxt in rest:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def test_every_module_is_in_a_layer() -> None:
    missing = []
    for name in modules():
        if name == ROOT_MODULE:
            continue
        try:
            layer_of(name)
        except LookupError:
            missing.append(name)
    assert missing == []


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    found = [edge for edge in upward_imports() if edge not in PENDING]
    assert found == [], "\n".join(
        f"{src} ({LAYERS[layer_of(src)][0]}) imports {dst} ({LAYERS[layer_of(dst)][0]})"
        for src, dst in found)


def test_every_pending_exception_still_occurs() -> None:
    edges = graph()
    stale = sorted(edge for edge in PENDING if edge[1] not in edges.get(edge[0], set()))
    assert stale == [], "these imports are gone: remove them from PENDING"


def test_no_import_circles() -> None:
    assert circles(graph()) == []


# -- the reader itself, on small trees -------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        path = tmp_path / "extauthz" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    known = modules(tmp_path / "extauthz")
    return {name: set(module_imports(name, path, known)) for name, path in known.items()}


def test_function_level_and_type_checking_imports_count(tmp_path: Path) -> None:
    edges = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "def f():\n    from .b import g\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n",
    })
    assert edges["extauthz.a"] == {"extauthz.b"}
    assert edges["extauthz.b"] == {"extauthz.a"}
    assert circles(edges) == [["extauthz.a", "extauthz.b"]]


def test_a_submodule_import_is_not_an_import_of_its_package(tmp_path: Path) -> None:
    edges = _tree(tmp_path, {
        "__init__.py": "",
        "pkg/__init__.py": "from .mod import X\n",
        "pkg/mod.py": "from . import other\nimport extauthz.pkg.other as o\nX = 1\n",
        "pkg/other.py": "from ..pkg.mod import X\n",
    })
    assert edges["extauthz.pkg"] == {"extauthz.pkg.mod"}
    assert edges["extauthz.pkg.mod"] == {"extauthz.pkg.other"}
    assert circles(edges) == [["extauthz.pkg.mod", "extauthz.pkg.other"]]


@pytest.mark.parametrize(("module", "layer"), [
    ("extauthz.core.settings", "core"), ("extauthz.store.redis.wire", "store"),
    ("extauthz.server.app", "server"), ("extauthz.commands.simulate.cli", "commands"),
])
def test_a_module_is_in_the_layer_of_its_longest_prefix(module: str, layer: str) -> None:
    assert LAYERS[layer_of(module)][0] == layer


# -- Envoy knowledge in one package ------------------------------------------------------------

#: where Envoy config may be written: the generator's package (docs/design.md "Envoy knowledge")
ENVOY_PACKAGE = PACKAGE / "envoy"
#: the trees whose code must get its Envoy config from that package (its options, never a YAML
#: edit after the fact); tests/ may hand-write a minimal config to check one piece against Envoy
ENVOY_CLIENTS = ("extauthz", "bench", "testinfra", "scripts")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants in ``tree`` (modules, classes, functions)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _reads(tree: ast.AST) -> set[int]:
    """The ids of the string constants in ``tree`` that read config rather than write it: a
    subscript's key read (``f["typed_config"]["@type"]``) and a comparison's operands
    (``== "type.googleapis.com/..."``, ``in (...)``)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            found.add(id(node.slice))
        elif isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                found.update(id(n) for n in ast.walk(operand) if isinstance(n, ast.Constant))
    return found


#: data files that could hold a hand-written Envoy config
_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


def _is_python(path: Path) -> bool:
    """A Python file: ``.py``, or an executable script without a suffix whose first line
    names python (scripts/gen-constraints-min)."""
    if path.suffix == ".py":
        return True
    if path.suffix or not path.is_file():
        return False
    with path.open("rb") as f:
        first = f.readline(200)
    return first.startswith(b"#!") and b"python" in first


def envoy_config_written(root: Path, trees: Collection[str], package: Path) -> list[str]:
    """``file:line`` of every string constant outside ``package`` (docstrings and reads aside)
    that writes Envoy config: a typed config's ``@type`` key or an Envoy type URL; and of
    every line of a YAML or JSON file there that holds one."""
    found: list[tuple[str, int]] = []
    for name in trees:
        for path in sorted((root / name).rglob("*")):
            if path.is_relative_to(package) or "proto" in path.relative_to(root).parts[:2]:
                continue
            if path.suffix in _CONFIG_SUFFIXES and path.is_file():
                found += [(path.relative_to(root).as_posix(), n) for n, line in enumerate(
                    path.read_text().splitlines(), 1) if "@type" in line or "type.googleapis.com/envoy." in line]
                continue
            if not _is_python(path):
                continue
            tree = ast.parse(path.read_text(), str(path))
            skip = _docstrings(tree) | _reads(tree)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                        and (node.value == "@type" or "type.googleapis.com/envoy." in node.value)):
                    found.append((path.relative_to(root).as_posix(), node.lineno))
    return [f"{name}:{line}" for name, line in sorted(found)]


def test_envoy_config_is_written_only_in_the_envoy_package() -> None:
    """Issue 30: one config generator, whose test and benchmark variants are its options: a
    listener appended to its output (bench/stack.py's rate limit row did) is Envoy knowledge
    outside ``extauthz/envoy/``."""
    assert envoy_config_written(ROOT, ENVOY_CLIENTS, ENVOY_PACKAGE) == []


def test_the_envoy_config_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    (tmp_path / "pkg" / "envoy").mkdir(parents=True)
    (tmp_path / "bench" / "edit.py").write_text(
        '"""Reads type.googleapis.com/envoy.x in its docstring."""\n'
        'config["listeners"].append({"typed_config": {\n'
        '    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})\n'
        'url = ("type.googleapis.com/"\n       "envoy.config.listener.v3.Listener")\n')
    (tmp_path / "bench" / "reads.py").write_text(
        'name = manager["typed_config"]["stat_prefix"]\n'
        'routers = [f for f in filters if f["typed_config"]["@type"]\n'
        '           == "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"]\n'
        'found = url in ("type.googleapis.com/envoy.config.listener.v3.Listener",)\n')
    (tmp_path / "pkg" / "envoy" / "blocks.py").write_text('TYPE = {"@type": "type.googleapis.com/envoy.x"}\n')
    # a hand-written config beside the code, and a script without a suffix
    (tmp_path / "bench" / "policies").mkdir()
    (tmp_path / "bench" / "policies" / "p.yaml").write_text("version: 1\nlimiters: []\n")
    (tmp_path / "bench" / "envoy.yaml").write_text(
        "listeners:\n- filters:\n  - typed_config:\n      '@type': type.googleapis.com/envoy.x.Router\n")
    (tmp_path / "bench" / "tool").write_text('#!/usr/bin/env python3\nx = {"@type": 1}\n')
    (tmp_path / "bench" / "run.sh").write_text('#!/bin/sh\necho "@type"\n')
    assert envoy_config_written(tmp_path, ["bench", "pkg"], tmp_path / "pkg" / "envoy") == [
        "bench/edit.py:3", "bench/edit.py:3", "bench/edit.py:4", "bench/envoy.yaml:4", "bench/tool:2"]


# -- product code the package uses -------------------------------------------------------------

#: methods the package defines for a library to call, never by name in the package: asyncio
#: protocols, httptools' parser callbacks, pickle's hooks, logging's and http.server's
HOOKS = frozenset({"connection_made", "connection_lost", "data_received", "eof_received", "pause_writing",
                   "resume_writing", "on_message_begin", "on_url", "on_header", "on_headers_complete",
                   "persistent_id", "persistent_load", "prepare", "log_message"})
#: what the package defines and never names itself, and why it stays in the package (anything
#: else only the tests or benchmarks use moves to them: testinfra/probes.py, bench/)
USED_OUTSIDE = {
    "advance": "ManualClock's step (core/clock.py): the injected clock of every test timeline; "
               "simulate's replay sets its time instead",
    "child_main": "the policy-load child's entry, run by name in a subprocess (engine/reload.py _CHILD)",
    "clear_huffman_cache": "empties hpackd's module cache (benchmarks and tests start from it empty): "
                           "only the module holds it",
    "inbound_window": "h2conn's receive window and unacknowledged bytes as one view (tests check "
                      "the WINDOW_UPDATE arithmetic by it)",
    "table_bytes": "hpackd's dynamic table size (RFC 7541 4.1) as a view (tests compare it with hpack's)",
    "sending": "a grant table's store calls on their way as a view (tests wait on it; drain() "
               "waits on the same set)",
}


def entry_points(pyproject: Path) -> set[str]:
    """The functions ``pyproject`` names as its scripts and entry points (``module:function``):
    the installer's code calls them, by name."""
    import tomllib

    project = tomllib.loads(pyproject.read_text()).get("project", {})
    targets = [*project.get("scripts", {}).values(), *project.get("gui-scripts", {}).values(),
               *(t for group in project.get("entry-points", {}).values() for t in group.values())]
    return {t.partition(":")[2].split(".")[-1].split()[0] for t in targets if ":" in t}


def unused_definitions(package: Path, skip: Collection[str] = ("proto", "devtools"),
                       called_by_name: Collection[str] = ()) -> list[str]:
    """``file:line name`` of every function, class, method and module constant of
    ``package`` (outside ``skip``: generated code; devtools/, the tests' and demos' stack)
    that no code of the package names (a name, an attribute, an import, the package's own
    ``__all__``: its public API), :data:`HOOKS`, dunders and decorated-by-a-call methods
    (pydantic's validators) and ``called_by_name`` (:func:`entry_points`) aside."""
    used: set[str] = set(called_by_name)
    defined: list[tuple[str, str, int]] = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
                used.add(node.id)
            elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
                used.add(node.attr)
            elif isinstance(node, ast.ImportFrom):
                used.update(alias.name for alias in node.names)
            elif (path == package / "__init__.py" and isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
                # the package's public API (lazily imported by name): used by its users
                used.update(c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant))
        rel = path.relative_to(package.parent).as_posix()
        if path.relative_to(package).parts[0] in skip:
            continue
        bodies = [tree.body, *(n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]
        for body in bodies:
            for node in body:
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    if not any(isinstance(d, ast.Call) for d in node.decorator_list):
                        defined.append((node.name, rel, node.lineno))
                elif body is tree.body and isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    defined += [(t.id, rel, node.lineno) for t in targets if isinstance(t, ast.Name)]
    return sorted(f"{rel}:{line} {name}" for name, rel, line in defined
                  if name not in used and name not in HOOKS and not name.startswith("__"))


def test_product_code_is_used_by_the_package() -> None:
    """Issue 30: product code that only the tests or benchmarks use moves to them (after it,
    MemoryStore.flushall had come back for the quota ledger's tests); what stays says why."""
    unused = unused_definitions(PACKAGE, called_by_name=entry_points(ROOT / "pyproject.toml"))
    assert [u for u in unused if u.rpartition(" ")[2] not in USED_OUTSIDE] == []
    stale = set(USED_OUTSIDE) - {u.rpartition(" ")[2] for u in unused}
    assert stale == set(), "the package uses these now: drop them from USED_OUTSIDE"


def test_the_unused_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    package = tmp_path / "extauthz"
    (package / "store").mkdir(parents=True)
    (package / "proto").mkdir()
    (package / "store" / "memory.py").write_text(
        "LIMIT = 3\nUNUSED = 4\n\n\nclass Store:\n    def check(self):\n        return LIMIT\n\n"
        "    def flushall(self):\n        pass\n\n    def data_received(self, data):\n        pass\n\n"
        "    @model_validator(mode='after')\n    def _valid(self):\n        return self\n")
    (package / "store" / "use.py").write_text("from .memory import Store\n\n\ndef go(s: Store):\n"
                                               "    return s.check()\n")
    (package / "proto" / "gen.py").write_text("def generated():\n    pass\n")
    # the public API, imported lazily by name (extauthz/__init__.py): its users name it
    (package / "__init__.py").write_text('__all__ = ["Public"]\n_HOMES = {"Public": ".store.api"}\n\n\n'
                                         'def __getattr__(name):\n    return _HOMES[name]\n')
    (package / "store" / "api.py").write_text("class Public:\n    pass\n\n\nclass Private:\n    pass\n")
    # a console script's function: the installer's wrapper calls it by name
    (package / "cli.py").write_text("def run():\n    pass\n")
    (tmp_path / "pyproject.toml").write_text('[project.scripts]\ntool = "extauthz.cli:run"\n')
    assert entry_points(tmp_path / "pyproject.toml") == {"run"}
    assert "extauthz/cli.py:1 run" in unused_definitions(package)
    assert unused_definitions(package, called_by_name=entry_points(tmp_path / "pyproject.toml")) == [
        "extauthz/store/api.py:5 Private", "extauthz/store/memory.py:2 UNUSED", "extauthz/store/memory.py:9 flushall",
        "extauthz/store/use.py:4 go"]


# -- what every limiter kind declares, read as attributes --------------------------------------


def common_spec_fields() -> set[str]:
    """The fields every member of the policy's ``LimiterSpec`` union declares."""
    from typing import get_args

    from extauthz.policy.schema import LimiterSpec

    kinds = get_args(get_args(LimiterSpec)[0])
    return set.intersection(*(set(kind.model_fields) for kind in kinds))


#: the fields every limiter kind declares whose names any object may have (an argparse
#: namespace's ``key``, an exception's ``name``): a getattr of one is a spec's only when its
#: object is named as one (``spec``, ``self.spec``, ``limiter_spec``)
GENERIC_NAMES = frozenset({"name", "type", "mode", "key"})


def _names_a_spec(node: ast.expr) -> bool:
    """Whether an expression's last name ends in ``spec`` (``spec``, ``self.spec``,
    ``limiter_spec``, ``specs[i]``; not ``inspect``)."""
    while isinstance(node, ast.Subscript | ast.Call):
        node = node.value if isinstance(node, ast.Subscript) else node.func
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return re.search(r"spec(s)?$", name.lower()) is not None


def getattr_of(package: Path, fields: Collection[str]) -> list[str]:
    """``file:line`` of every ``getattr(x, "FIELD", ...)`` in ``package`` whose FIELD is one of
    ``fields`` (an attribute every object it is asked of has: mypy should see the read); of a
    :data:`GENERIC_NAMES` field, only when ``x`` names a spec."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in fields
                    and (node.args[1].value not in GENERIC_NAMES or _names_a_spec(node.args[0]))):
                found.append(f"{path.relative_to(package.parent).as_posix()}:{node.lineno}")
    return found


def test_what_every_limiter_kind_declares_is_read_as_an_attribute() -> None:
    """Capabilities as types (issue 30: limiters declare ``grants`` and ``holds_leases`` as
    attributes mypy sees): a field every limiter kind's spec declares (``key``, ``match``,
    ``plans``, ...) is read as ``spec.FIELD``, never by ``getattr`` with a default, which hides
    a misspelt name from mypy (``match``, added by issue 32, was read so in six places, ``key``
    and ``plans`` in four more)."""
    fields = common_spec_fields()
    assert {"key", "match", "plans", "name"} <= fields
    assert getattr_of(PACKAGE, fields) == []


def test_the_getattr_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    package = tmp_path / "extauthz"
    package.mkdir()
    (package / "a.py").write_text('x = getattr(spec, "match", None)\ny = getattr(spec, "replaces", None)\n'
                                  'z = spec.match\nw = getattr(spec, name)\n'
                                  'v = getattr(self.limiter_spec, "key", None)\n'
                                  'u = getattr(args, "key", None) or getattr(exc, "name", "")\n'
                                  't = getattr(args, "match", None)\n'
                                  's = getattr(inspected, "name", "") or getattr(specs[0], "key", None)\n')
    assert getattr_of(package, {"match", "key", "name"}) == ["extauthz/a.py:1", "extauthz/a.py:5", "extauthz/a.py:7",
                                                            "extauthz/a.py:8"]


# -- the module map and the paths the docs name ---------------------------------------------

#: the Markdown files whose relative links and ``extauthz/...`` paths must exist
DOCS = ("README.md", "envoy/README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")))
#: paths the docs write on purpose that are no file: design.md's old flat name beside its new one
NO_FILE = {"extauthz/engine.py"}


def unmapped_modules(design: str, package: Path) -> list[str]:
    """The modules of ``package`` that docs/design.md's module map (the code block after
    "Layers") does not name in their package's entry (generated protobuf modules aside)."""
    block = design[design.index("```\ncore/"):]
    block = block[:block.index("```", 4)]
    entries: dict[str, str] = {}
    current = ""
    for line in block.splitlines()[1:]:
        head = line.split(" ", 1)[0]
        if head.endswith("/") and not line.startswith(" "):
            current = head.rstrip("/")
        entries[current] = entries.get(current, "") + " " + line
    missing = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if len(parts) < 2 or path.stem == "__init__" or parts[0] == "proto":
            continue
        words = set(re.findall(r"\w+", entries.get(parts[0], "")))
        if path.stem not in words:
            missing.append(path.relative_to(package.parent).as_posix())
    return missing


def missing_paths(root: Path, docs: Collection[str]) -> list[str]:
    """``doc: target`` for every relative Markdown link and every ``extauthz/...`` path (.py,
    .lua) that names no file (placeholders in capitals and :data:`NO_FILE` aside)."""
    missing = []
    for doc in docs:
        path = root / doc
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text):
            if not (path.parent / target).exists():
                missing.append(f"{doc}: {target}")
        for named in set(re.findall(r"extauthz/[\w/]+\.(?:py|lua)", text)) - NO_FILE:
            if not re.search(r"/[A-Z]+\.", named) and not (root / named).exists():
                missing.append(f"{doc}: {named}")
    return sorted(missing)


def test_the_module_map_names_every_module() -> None:
    assert unmapped_modules((ROOT / "docs" / "design.md").read_text(), ROOT / "extauthz") == []


def test_every_path_the_docs_name_exists() -> None:
    assert missing_paths(ROOT, DOCS) == []


def test_the_map_and_path_checks_find_what_they_look_for(tmp_path: Path) -> None:
    package = tmp_path / "extauthz"
    (package / "core").mkdir(parents=True)
    (package / "core" / "clock.py").write_text("")
    (package / "core" / "tiers.py").write_text("")
    assert unmapped_modules("```\ncore/  clock (the clock), other\n```\n", package) == ["extauthz/core/tiers.py"]
    (tmp_path / "a.md").write_text("[x](extauthz/core/clock.py) [y](extauthz/gone.py) `extauthz/old.py` "
                                   "`extauthz/core/X.py` [z](https://e.org/a.py)")
    assert missing_paths(tmp_path, ["a.md"]) == ["a.md: extauthz/gone.py", "a.md: extauthz/gone.py",
                                                 "a.md: extauthz/old.py"]
