"""Throwaway infrastructure shared by the tests and the benchmarks: real Redis topologies
(``testinfra.redis_servers``).

A top-level package of the repository, next to ``tests/`` and ``bench/``, so that both import
it and ``bench/`` does not depend on ``tests/``. Not in the wheel (``pyproject.toml`` lists
the shipped packages): it kills processes at exit, pauses masters with SIGSTOP and may start
containers, none of which belongs in a server install. Importable from the repository root
(``python -m pytest``, ``python -m bench.<name>``), like ``tests`` and ``bench``.
"""
