"""``extauthz envoy-config --rlqs``: Envoy's rate limit quota filter for the policy's
``enforce: envoy`` limiters (docs/rlqs.md), rendered beside ext_authz for the others.

One ``envoy.filters.http.rate_limit_quota`` filter per limiter (a request matches into one
bucket per filter: the first matched group wins), each streaming to the server's gRPC port:

* the bucket matcher: the limiter's ``applies_to`` (``:path`` prefix, ``:method``) and every
  header key part present (a request without it is not limited there: ``on_missing_key:
  skip``), as header matchers (per-route overrides do not work in 1.40, envoyproxy/envoy#46929);
* the bucket id: ``limiter: NAME`` plus one entry per key part (``header:NAME`` from the
  header, ``source_ip`` from the client address, ``method``), which the server's quota book
  groups streams by (:func:`extauthz.engine.quota_service.bucket_key`);
* ``DENY_ALL`` before the first assignment and after one expires: never allow-all;
* the deny response: 429, ``application/problem+json`` with the server's problem shape and
  ``Retry-After`` of the limiter's fill interval.

A ``worker_utilization`` shedder with ``envoy_deny_all`` gets a filter of its own, first: the
policy's classification as matchers (:func:`tier_matchers`), one bucket per tier, answered
DENY_ALL by the server while the shedder refuses that tier whole (:func:`shed_filter`).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterable
from typing import Any

from ..core.tiers import READ_METHODS, Tier
from ..engine.answers import PROBLEM_TYPE
from ..engine.quota_service import (
    CLASSIFICATION_KEY,
    LIMITER_KEY,
    REPORT_INTERVAL,
    SHEDDER_KEY,
    TIER_KEY,
    QuotaLimit,
    classification_id,
)
from ..policy import Policy
from ..policy.model import Matcher
from ..policy.schema import KEY_PARTS, RequestRateSpec, WorkerUtilizationSpec
from .blocks import HEALTHZ_PATH

Config = dict[str, Any]

#: the stream's domain (one server, one domain)
DOMAIN = "extauthz"
_FILTER = "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaFilterConfig"
_SETTINGS = "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3.RateLimitQuotaBucketSettings"
_HEADER_INPUT = "type.googleapis.com/envoy.type.matcher.v3.HttpRequestHeaderMatchInput"
_SOURCE_IP_INPUT = "type.googleapis.com/envoy.extensions.matching.common_inputs.network.v3.SourceIPInput"
_DENY_ALL = {"fallback_rate_limit": {"blanket_rule": "DENY_ALL"}}
_ALLOW_ALL = {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}}


def envoy_limiters(policy: Policy) -> list[RequestRateSpec]:
    """The limiters Envoy enforces, in policy order."""
    return [s for s in policy.limiters if isinstance(s, RequestRateSpec) and s.enforce == "envoy"]


def _header(name: str) -> Config:
    return {"name": f"header:{name}", "typed_config": {"@type": _HEADER_INPUT, "header_name": name}}


def _single(name: str, match: Config) -> Config:
    return {"single_predicate": {"input": _header(name), "value_match": match}}


def _any_of(predicates: list[Config]) -> Config:
    return predicates[0] if len(predicates) == 1 else {"or_matcher": {"predicate": predicates}}


def _methods(methods: Iterable[str]) -> Config:
    """``:method`` is one of ``methods`` (upper case), in any case: the server reads a
    request's method upper-cased (``post`` over HTTP/2 is POST to the classifier and to a
    limiter's ``applies_to``), so Envoy's exact match must ignore case too."""
    return _any_of([_single(":method", {"exact": m, "ignore_case": True}) for m in sorted(methods)])


def checked(matchers: list[Config]) -> Config:
    """A quota filter's ``bucket_matchers``: ``matchers`` under one matcher that leaves out
    Envoy's own health route (:data:`~extauthz.envoy.blocks.HEALTHZ_PATH`, which the route
    matches with the query string removed, and answers without a check). A request without a
    bucket passes the filter: neither a shed tier's DENY_ALL nor a limiter's empty bucket
    refuses a health probe the check never sees (a load balancer would take an overloaded
    Envoy out for it)."""
    health = _single(":path", {"safe_regex": {"google_re2": {}, "regex": re.escape(HEALTHZ_PATH) + r"(\?.*)?"}})
    return {"matcher_list": {"matchers": [{"predicate": {"not_matcher": health},
                                           "on_match": {"matcher": {"matcher_list": {"matchers": matchers}}}}]}}


#: the methods a limiter's ``method`` key part names in Envoy, as the check does (upper case,
#: whatever case the request used): RFC 9110's and PATCH; any other method is :data:`OTHER_METHOD`
NAMED_METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
#: the ``method`` entry of a bucket id for every method outside :data:`NAMED_METHODS` (one
#: bucket for all: Envoy can name a method only by a matcher of its own)
OTHER_METHOD = "other"
#: the value of every header key part of the one bucket shared by requests whose key headers
#: hold a comma (a value no comma-free header has)
SHARED_VALUE = ","


def bucket_id(spec: RequestRateSpec, method: str = OTHER_METHOD, shared: bool = False) -> Config:
    """The bucket id builder: the limiter's name and one value per key part; a ``method``
    part is ``method``, named by the matcher that matched (:func:`quota_filter`): Envoy's own
    ``:method`` keeps the request's case, so ``get``, ``gEt``... over HTTP/2 were each a bucket
    of their own, each with the limiter's whole rate, where the check upper-cases them to one.
    ``shared``: the header parts are :data:`SHARED_VALUE` (a key header holding a comma)."""
    builder: Config = {LIMITER_KEY: {"string_value": spec.name}}
    for part in spec.key or ():
        kind = next(f for f in KEY_PARTS if getattr(part, f) is not None)
        if kind == "header":
            assert part.header is not None
            builder[f"header:{part.header.lower()}"] = ({"string_value": SHARED_VALUE} if shared
                                                        else {"custom_value": _header(part.header.lower())})
        elif kind == "source_ip":
            builder["source_ip"] = {"custom_value": {"name": "source_ip",
                                                     "typed_config": {"@type": _SOURCE_IP_INPUT}}}
        else:  # method (the policy refuses the others)
            builder["method"] = {"string_value": method}
    return builder


def _predicate(spec: RequestRateSpec, comma_free: bool = False) -> Config:
    """The limiter's scope, each header key part present with a value (``comma_free``: a
    value without a comma)."""
    applies = spec.applies_to
    predicates = [_single(":path", {"prefix": applies.path_prefix or "/"})]
    if applies.methods:
        predicates.append(_methods(applies.methods))
    value = "[^,]+" if comma_free else ".+"
    for part in spec.key or ():
        if part.header is not None:  # present, with a value
            predicates.append(_single(part.header.lower(), {"safe_regex": {"google_re2": {}, "regex": value}}))
    return predicates[0] if len(predicates) == 1 else {"and_matcher": {"predicate": predicates}}


def deny_response(spec: RequestRateSpec) -> Config:
    """429 with the server's problem shape (answers.denial's fields Envoy can know)."""
    retry = QuotaLimit(spec.rate / spec.cost, spec.burst / spec.cost).interval
    body = json.dumps({"type": PROBLEM_TYPE + "rate_exceeded", "title": "Too Many Requests", "status": 429,
                       "detail": f"Refused by '{spec.name}' in Envoy. Retry after {retry} s.",
                       "limiter": spec.name, "retry_after": retry}, separators=(",", ":"))
    return {
        "http_status": {"code": "TooManyRequests"},
        "http_body": base64.b64encode(body.encode()).decode("ascii"),  # BytesValue: base64 in YAML
        "response_headers_to_add": [
            {"header": {"key": "content-type", "value": "application/problem+json"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
            {"header": {"key": "retry-after", "value": str(retry)},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
        ],
    }


def quota_filter(spec: RequestRateSpec, cluster: str) -> Config:
    """One limiter's ``rate_limit_quota`` filter, streaming to ``cluster``."""
    def settings(method: str, shared: bool) -> Config:
        return {
            "@type": _SETTINGS,
            "bucket_id_builder": {"bucket_id_builder": bucket_id(spec, method, shared)},
            "reporting_interval": f"{REPORT_INTERVAL:g}s",  # Envoy 1.40 reports every 5 s anyway
            "deny_response_settings": deny_response(spec),
            "no_assignment_behavior": _DENY_ALL,
            "expired_assignment_behavior": _DENY_ALL,
        }

    def on(method: str, shared: bool) -> Config:
        return {"action": {"name": spec.name, "typed_config": settings(method, shared)}}

    # key headers without a comma: their values; with one (a header repeated, "k,k"), one
    # bucket for all, as the check's AMBIGUOUS: Envoy reads a value whole, and "k,k", "k,k,k"...
    # were each a bucket with the whole rate where the check keys "k,k" as k (stricter here)
    headers = any(part.header is not None for part in spec.key or ())
    variants = [(_predicate(spec, comma_free=True), False), (_predicate(spec), True)] if headers else [
        (_predicate(spec), False)]
    matchers: list[Config] = []
    if any(part.method for part in spec.key or ()):  # a matcher per method names it (any case)
        named = sorted(spec.applies_to.methods) if spec.applies_to.methods else NAMED_METHODS
        matchers += [{"predicate": {"and_matcher": {"predicate": [_methods([m]), predicate]}},
                      "on_match": on(m, shared)} for m in named for predicate, shared in variants]
        if spec.applies_to.methods:
            variants = []  # no other method is in scope
    matchers += [{"predicate": predicate, "on_match": on(OTHER_METHOD, shared)} for predicate, shared in variants]
    return {"name": f"extauthz.rlqs.{spec.name}", "typed_config": {
        "@type": _FILTER, "rlqs_server": {"envoy_grpc": {"cluster_name": cluster}},
        "domain": DOMAIN, "bucket_matchers": checked(matchers)}}


def quota_filters(policy: Policy, cluster: str) -> list[Config]:
    """Every pushed shedder's filter, then every ``enforce: envoy`` limiter's (none: the
    policy has none): a request a shed tier refuses takes no limiter's token."""
    return ([shed_filter(policy, spec, cluster) for spec in envoy_shedders(policy)]
            + [quota_filter(spec, cluster) for spec in envoy_limiters(policy)])


# -- shedders pushed to Envoy (envoy_deny_all)


def envoy_shedders(policy: Policy) -> list[WorkerUtilizationSpec]:
    """The shedders whose whole-shed tiers Envoy refuses (``envoy_deny_all``), in policy order."""
    return [s for s in policy.limiters if isinstance(s, WorkerUtilizationSpec) and s.envoy_deny_all]


def _always() -> Config:
    return _single(":path", {"prefix": "/"})


def _rule_predicate(m: Matcher) -> Config:
    predicates = []
    if m.path_prefix is not None:
        predicates.append(_single(":path", {"prefix": m.path_prefix}))
    if m.methods is not None:
        predicates.append(_methods(m.methods))
    predicates += [_single(name, {"exact": value}) for name, value in m.headers]
    if not predicates:
        return _always()
    return predicates[0] if len(predicates) == 1 else {"and_matcher": {"predicate": predicates}}


def tier_matchers(policy: Policy) -> list[tuple[Config, Tier]]:
    """The policy's classification as Envoy matchers, first match wins as in the classifier
    (:meth:`~extauthz.policy.classify.Classifier.context`): the test-mode header, each rule
    (methods, path prefix, headers), then the method default. The loader refuses a policy
    with a shedder pushed to Envoy whose tiers come from elsewhere (an identity prefix,
    filter or route metadata, hosts); route metadata and context extensions a hand-written
    Envoy route adds are not seen here (docs/rlqs.md)."""
    out: list[tuple[Config, Tier]] = []
    if policy.test_header:  # the classifier compares the value lowercased to "true"
        out.append((_single(policy.test_header, {"safe_regex": {"google_re2": {}, "regex": "(?i)true"}}),
                    Tier.TEST))
    out += [(_rule_predicate(rule.matcher), rule.tier) for rule in policy.rules]
    out.append((_methods(READ_METHODS), Tier.GET))
    out.append((_always(), Tier.POST))
    return out


def shed_response(spec: WorkerUtilizationSpec, tier: Tier) -> Config:
    """503 with the check's shedding problem shape (answers.denial's fields Envoy can know)."""
    retry = max(1, math.ceil(spec.sample_interval))
    body = json.dumps({"type": f"{PROBLEM_TYPE}shedding_{tier.value}", "title": "Service Unavailable",
                       "status": 503,
                       "detail": (f"The API is overloaded and is shedding {tier.value} traffic (load shedder "
                                  f"'{spec.name}', all of it now). Retry later with backoff."),
                       "limiter": spec.name, "tier": tier.value, "retry_after": retry}, separators=(",", ":"))
    return {
        "http_status": {"code": "ServiceUnavailable"},
        "http_body": base64.b64encode(body.encode()).decode("ascii"),
        "response_headers_to_add": [
            {"header": {"key": "content-type", "value": "application/problem+json"},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
            {"header": {"key": "retry-after", "value": str(retry)},
             "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
        ],
    }


def shed_filter(policy: Policy, spec: WorkerUtilizationSpec, cluster: str) -> Config:
    """One shedder's ``rate_limit_quota`` filter: one bucket per tier (``shedder: NAME``,
    ``tier: T``), which the server answers DENY_ALL while the shedder refuses that tier
    whole and ALLOW_ALL otherwise (critical: always). ALLOW_ALL before an assignment and
    after one expires: a server away lifts the push, and the check's shedder goes on."""
    matchers = []
    rendered_from = classification_id(policy)
    for predicate, tier in tier_matchers(policy):
        settings = {
            "@type": _SETTINGS,
            "bucket_id_builder": {"bucket_id_builder": {
                SHEDDER_KEY: {"string_value": spec.name}, TIER_KEY: {"string_value": tier.value},
                CLASSIFICATION_KEY: {"string_value": rendered_from}}},
            "reporting_interval": f"{REPORT_INTERVAL:g}s",
            "deny_response_settings": shed_response(spec, tier),
            "no_assignment_behavior": _ALLOW_ALL,
            "expired_assignment_behavior": _ALLOW_ALL,
        }
        matchers.append({"predicate": predicate,
                         "on_match": {"action": {"name": f"{spec.name}.{tier.value}", "typed_config": settings}}})
    return {"name": f"extauthz.rlqs-shed.{spec.name}", "typed_config": {
        "@type": _FILTER, "rlqs_server": {"envoy_grpc": {"cluster_name": cluster}},
        "domain": DOMAIN, "bucket_matchers": checked(matchers)}}
