"""The tests are laid out like the package (docs/design.md, "Tests"): ``tests/unit/test_X.py``
and ``tests/store/redis/test_X.py`` name a module that exists, except the short list of
cross-module files below; ``bench/`` and ``testinfra/`` never import ``tests`` (the Redis
topologies both use live in ``testinfra/``), and the package imports neither."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

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
