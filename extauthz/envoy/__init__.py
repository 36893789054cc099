"""Envoy knowledge in one package: what each protocol sends and each edge reads
(:mod:`.headers`), the access-log and fluentd record shapes (:mod:`.records`), and the one
config generator (:mod:`.config`, with its protocol targets such as :mod:`.ext_authz`, the
building blocks in :mod:`.blocks` and the rate limit quota filter in :mod:`.rlqs`). The server
imports this package, never the other way.

``configs`` is data only: the shipped ``envoy/*.yaml`` (``package-dir`` in pyproject.toml).
"""
