"""Load policy files: YAML with line numbers, strict validation, merge, compile.

This is the one validator. The server, ``extauthz check-policies`` and the tests all call
:func:`load_policy`; every problem is reported with the file, the dotted field path and
the line.

Files are parsed with libyaml (``yaml.CSafeLoader``) where PyYAML has it: the nodes carry
the same marks, so every issue keeps its line. A file libyaml finds broken is parsed again
with the pure-Python loader, whose messages are the ones documented (and richer); only
broken files pay for it. A file larger than ``max_bytes`` is refused before it is parsed.
"""

from __future__ import annotations

import difflib
import hashlib
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from ..core.errors import PolicyError, PolicyIssue
from ..core.settings import POLICY_MAX_BYTES
from .descriptors import DescriptorTable
from .model import Policy, compile_policy, descriptor_targets
from .schema import LIMITER_TYPES, PolicyFile, WorkerUtilizationSpec

YAML_SUFFIXES = (".yaml", ".yml")
#: the default bound on one policy file's size (``serve --policy-max-bytes``): a Kubernetes
#: ConfigMap holds at most 1 MiB, and real policies are a few KiB.
MAX_FILE_BYTES = POLICY_MAX_BYTES
#: the parser: libyaml where PyYAML was built with it (several times faster)
FAST_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_PathKey = tuple[str | int, ...]


def format_path(path: Sequence[str | int]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def policy_files(paths: Iterable[Path]) -> list[Path]:
    """The YAML files a set of paths names: files as given, directories' top-level files.

    Hidden entries are skipped, so a Kubernetes ConfigMap mount (``..data`` symlinks) is
    read once, through its visible symlinks.
    """
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(
                sorted(
                    p for p in path.iterdir()
                    if p.suffix in YAML_SUFFIXES and not p.name.startswith(".") and p.is_file()
                )
            )
        else:
            files.append(path)
    return files


MAX_NODES = 100_000
MAX_DEPTH = 64


class _TooBig(Exception):
    def __init__(self, message: str, line: int) -> None:
        super().__init__(message)
        self.line = line


def _reader_line(text: str, exc: yaml.YAMLError) -> int:
    position = getattr(exc, "position", None)
    return text.count("\n", 0, position) + 1 if isinstance(position, int) else 1


def _first_line(exc: Exception) -> str:
    return str(exc).split("\n", 1)[0].rstrip(":")


class _Document:
    """A parsed YAML document: plain data plus the line of every key and item."""

    def __init__(self, file: str, text: str, loader_class: type[yaml.SafeLoader] = yaml.SafeLoader) -> None:
        self.file = file
        self.lines: dict[_PathKey, int] = {}
        self.issues: list[PolicyIssue] = []
        #: the YAML itself is broken (not its structure)
        self.syntax_error = False
        self._nodes = 0
        self.data: Any = None
        try:
            loader = loader_class(text)
        except yaml.YAMLError as exc:  # e.g. a character YAML does not allow
            self.syntax_error = True
            self.issues.append(PolicyIssue(file, "", _reader_line(text, exc), f"YAML syntax error: {_first_line(exc)}"))
            return
        try:
            node = loader.get_single_node()
            self.data = None if node is None else self._build(loader, node, ())
        except yaml.MarkedYAMLError as exc:
            self.syntax_error = True
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            problem = exc.problem or str(exc)
            if exc.context and exc.context_mark is not None:
                problem += f" ({exc.context} started on line {exc.context_mark.line + 1})"
            self.issues.append(PolicyIssue(file, "", line, f"YAML syntax error: {problem}"))
        except yaml.YAMLError as exc:  # ReaderError: a character YAML does not allow
            self.syntax_error = True
            self.issues.append(PolicyIssue(file, "", _reader_line(text, exc), f"YAML syntax error: {_first_line(exc)}"))
        except _TooBig as exc:
            self.issues.append(PolicyIssue(file, "", exc.line, str(exc)))
        except RecursionError:
            self.issues.append(PolicyIssue(file, "", 1, "the document is nested too deeply"))
        finally:
            loader.dispose()

    def _build(self, loader: yaml.SafeLoader, node: yaml.Node, path: _PathKey) -> Any:
        self._nodes += 1
        if self._nodes > MAX_NODES:  # aliases can expand a small file exponentially
            raise _TooBig(f"the document expands to more than {MAX_NODES} values (YAML aliases?)",
                          node.start_mark.line + 1)
        if len(path) > MAX_DEPTH:
            raise _TooBig(f"the document is nested deeper than {MAX_DEPTH} levels", node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            loader.flatten_mapping(node)
            out: dict[str, Any] = {}
            for key_node, value_node in node.value:
                key = loader.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if not isinstance(key, str):
                    self.issues.append(
                        PolicyIssue(self.file, format_path(path), line, f"key {key!r} is not a string")
                    )
                    continue
                if key in out:
                    self.issues.append(
                        PolicyIssue(
                            self.file, format_path((*path, key)), line,
                            f"duplicate key '{key}' (first on line {self.lines[(*path, key)]})",
                        )
                    )
                    continue
                self.lines[(*path, key)] = line
                out[key] = self._build(loader, value_node, (*path, key))
            return out
        if isinstance(node, yaml.SequenceNode):
            items = []
            for i, item in enumerate(node.value):
                self.lines[(*path, i)] = item.start_mark.line + 1
                items.append(self._build(loader, item, (*path, i)))
            return items
        return loader.construct_object(node, deep=True)

    def line_of(self, path: _PathKey) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return 1


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's annotation holds (through Optional, lists, dicts, unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _field_names(loc: Sequence[str | int]) -> list[str]:
    """The field names the model at pydantic's raw ``loc`` (before :func:`_clean_loc`) accepts."""
    models: list[type[BaseModel]] = [PolicyFile]
    for part in loc:
        if isinstance(part, int):
            continue  # a list item or a dict value: the models stay
        fields = [m.model_fields[part] for m in models if part in m.model_fields]
        if fields:
            models = [m for f in fields for m in _models(f.annotation)]
        else:  # a discriminator tag (limiters[i].request_rate) or a dict key (plans.free)
            tagged = [m for m in models if part in typing.get_args(
                m.model_fields["type"].annotation if "type" in m.model_fields else None)]
            models = tagged or models
    return sorted({f.alias or name for m in models for name, f in m.model_fields.items()})


def _message(err: dict[str, Any]) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        loc = err["loc"]
        close = difflib.get_close_matches(str(loc[-1]), _field_names(loc[:-1]), n=1)
        return f"unknown field (did you mean '{close[0]}'?)" if close else "unknown field"
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":
        tag = err.get("ctx", {}).get("tag")
        return f"unknown limiter type {tag!r} (expected one of: {', '.join(LIMITER_TYPES)})"
    if kind == "union_tag_not_found":
        return f"'type' is missing (one of: {', '.join(LIMITER_TYPES)})"
    if kind == "literal_error":
        return f"{err['msg']} (got {err.get('input')!r})"
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    return msg


def _clean_loc(loc: Sequence[str | int]) -> _PathKey:
    """Drop the discriminator tags pydantic inserts after ``limiters[i]``."""
    out: list[str | int] = []
    for i, part in enumerate(loc):
        if (
            isinstance(part, str) and part in LIMITER_TYPES and i >= 2
            and loc[i - 2] == "limiters" and isinstance(loc[i - 1], int)
        ):
            continue
        out.append(part)
    return tuple(out)


def parse_file(file: str, text: str) -> tuple[PolicyFile | None, _Document, list[PolicyIssue]]:
    doc = _Document(file, text, FAST_LOADER)
    if doc.syntax_error and FAST_LOADER is not yaml.SafeLoader:
        doc = _Document(file, text)  # the documented messages (libyaml words them differently)
    issues = list(doc.issues)
    if issues:
        return None, doc, issues
    if not isinstance(doc.data, dict):
        return None, doc, [PolicyIssue(file, "", 1, "a policy file is a mapping with 'version: 1'")]
    try:
        return PolicyFile.model_validate(doc.data), doc, []
    except ValidationError as exc:
        for err in exc.errors():
            loc = _clean_loc(err["loc"])
            issues.append(PolicyIssue(file, format_path(loc), doc.line_of(loc), _message(dict(err))))
        return None, doc, issues


_SINGLETONS = ("identity", "plan", "test_mode", "classification", "ratelimit_headers")


class _Oversized(Exception):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the file is larger than {max_bytes} bytes (--policy-max-bytes); not parsed")


def read_bounded(path: Path, max_bytes: int) -> bytes:
    """The file's bytes, or :class:`_Oversized` past ``max_bytes`` (read no further)."""
    with path.open("rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise _Oversized(max_bytes)
    return raw


def _descriptor_issues(parsed: Sequence[tuple[str, PolicyFile, _Document]]) -> list[PolicyIssue]:
    """Descriptors two targets match alike (envoyproxy/ratelimit's "duplicate descriptor
    composite key"), names in ``replaces`` no target has, and an unlimited entry's name
    that a limiter or another entry has."""
    issues: list[PolicyIssue] = []
    table = DescriptorTable()
    first: dict[str, str] = {}  # target name -> its file
    entries: list[tuple[str, _Document, str, list[str]]] = []  # file, doc, where, replaces
    for file, model, doc in parsed:
        placed = [("limiters", i) for i, spec in enumerate(model.limiters) if spec.match]
        placed += [("unlimited", i) for i in range(len(model.unlimited))]
        targets = descriptor_targets(model.limiters, model.unlimited)
        for (section, i), (match, target) in zip(placed, targets, strict=True):
            where = f"{section}[{i}]"
            line = doc.line_of((section, i, "match"))
            if target.unlimited and target.name and (
                    target.name in first or any(s.name == target.name for _, m, _ in parsed for s in m.limiters)):
                issues.append(PolicyIssue(file, f"{where}.name", doc.line_of((section, i, "name")),
                                          f"duplicate name '{target.name}' (a limiter or an "
                                          "unlimited entry has it)"))
            if target.name:
                first.setdefault(target.name, file)
            shape = ", ".join(e.key if e.value is None else f"{e.key}={e.value}" for e in match.descriptor)
            clash = table.add(match.domain, [(e.key, e.value) for e in match.descriptor], target)
            if clash is not None:
                issues.append(PolicyIssue(
                    file, f"{where}.match", line,
                    f"duplicate descriptor: domain '{match.domain}' [{shape}] is matched by "
                    f"'{clash.name or 'an unlimited entry'}' already"))
            entries.append((file, doc, where, sorted(target.replaces)))
    for file, doc, where, replaces in entries:
        for name in replaces:
            if name not in first:
                section, _, rest = where.partition("[")
                issues.append(PolicyIssue(
                    file, f"{where}.replaces", doc.line_of((section, int(rest[:-1]), "replaces")),
                    f"replaces '{name}': no limiter with 'match' (or unlimited entry) has that name"))
    return issues


def _envoy_tier_issues(parsed: Sequence[tuple[str, PolicyFile, _Document]]) -> list[PolicyIssue]:
    """With a shedder pushed to Envoy (``envoy_deny_all``), every tier source the policy sets
    must be one Envoy's quota filter matchers can read (request headers, method, path): each
    other one is refused where it is written (docs/rlqs.md, "Shedders in Envoy")."""
    pushed = [spec.name for _, model, _ in parsed for spec in model.limiters
              if isinstance(spec, WorkerUtilizationSpec) and spec.envoy_deny_all]
    if not pushed:
        return []
    why = (f"the shedder '{pushed[0]}' pushes DENY_ALL to Envoy (envoy_deny_all), whose quota filter "
           "tells tiers apart by request headers, method and path only: ")
    issues: list[PolicyIssue] = []
    for file, model, doc in parsed:
        test = model.test_mode
        if test is not None and test.key_prefix is not None:
            issues.append(PolicyIssue(file, "test_mode.key_prefix", doc.line_of(("test_mode", "key_prefix")),
                                      why + "an identity prefix is read by this server (use test_mode.header)"))
        if test is not None and test.metadata is not None:
            issues.append(PolicyIssue(file, "test_mode.metadata", doc.line_of(("test_mode", "metadata")),
                                      why + "filter metadata is not a matcher input (use test_mode.header)"))
        rules = model.classification
        if rules is None:
            continue
        for field in ("route_metadata", "route_metadata_namespace"):
            if getattr(rules, field) is not None:
                issues.append(PolicyIssue(file, f"classification.{field}", doc.line_of(("classification", field)),
                                          why + "route metadata is not a matcher input (classify by rules)"))
        for i, rule in enumerate(rules.rules):
            if rule.match.hosts is not None:
                issues.append(PolicyIssue(
                    file, f"classification.rules[{i}].match.hosts",
                    doc.line_of(("classification", "rules", i, "match", "hosts")),
                    why + "hosts are matched by this server's host rules (match on a header instead)"))
    return issues


def load_policy(paths: Sequence[Path | str], *, max_bytes: int = MAX_FILE_BYTES) -> Policy:
    """Load, validate, merge and compile a policy. Raises :class:`PolicyError`.

    A file larger than ``max_bytes`` is an issue of its own, found before any parsing."""
    resolved = [Path(p) for p in paths]
    issues: list[PolicyIssue] = []
    for p in resolved:
        if not p.exists():
            issues.append(PolicyIssue(str(p), "", None, "no such file or directory"))
    files = policy_files(p for p in resolved if p.exists())
    if not files and not issues:
        issues.append(PolicyIssue(", ".join(map(str, resolved)), "", None, "no policy files (*.yaml, *.yml)"))
    digest = hashlib.sha256()
    parsed: list[tuple[str, PolicyFile, _Document]] = []
    for f in files:
        try:
            raw = read_bounded(f, max_bytes)
        except OSError as exc:
            issues.append(PolicyIssue(str(f), "", None, f"cannot read: {exc.strerror}"))
            continue
        except _Oversized as exc:
            issues.append(PolicyIssue(str(f), "", None, str(exc)))
            continue
        digest.update(f.name.encode() + b"\0" + raw + b"\0")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            issues.append(PolicyIssue(str(f), "", None, "not UTF-8 text"))
            continue
        model, doc, file_issues = parse_file(str(f), text)
        issues.extend(file_issues)
        if model is not None:
            parsed.append((str(f), model, doc))

    # Merge: singleton sections in one file only; limiter names unique across files.
    owner: dict[str, str] = {}
    names: dict[str, tuple[str, int | None]] = {}
    for file, model, doc in parsed:
        for section in _SINGLETONS:
            if getattr(model, section) is None:
                continue
            if section in owner:
                issues.append(PolicyIssue(
                    file, section, doc.line_of((section,)),
                    f"'{section}' is already set in {owner[section]}; it may appear in one file only",
                ))
            else:
                owner[section] = file
        for i, spec in enumerate(model.limiters):
            line = doc.line_of(("limiters", i, "name"))
            if spec.name in names:
                first_file, first_line = names[spec.name]
                issues.append(PolicyIssue(
                    file, f"limiters[{i}].name", line,
                    f"duplicate limiter name '{spec.name}' (first in {first_file}:{first_line})",
                ))
            else:
                names[spec.name] = (file, line)
    # Plans need the top-level section saying where a request's plan comes from.
    if "plan" not in owner:
        for file, model, doc in parsed:
            for i, spec in enumerate(model.limiters):
                if spec.plans:
                    issues.append(PolicyIssue(
                        file, f"limiters[{i}].plans", doc.line_of(("limiters", i, "plans")),
                        "plans need a top-level 'plan' section (where a request's plan comes from)",
                    ))
    issues.extend(_descriptor_issues(parsed))
    issues.extend(_envoy_tier_issues(parsed))
    if issues:
        raise PolicyError(issues)
    return compile_policy([m for _, m, _ in parsed], version=digest.hexdigest()[:12],
                          sources=tuple(f for f, _, _ in parsed))
