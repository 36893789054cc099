#!/usr/bin/env bash
# The benchmark, from a fresh checkout: installs the load tools and Redis (Debian packages),
# the project with its bench extra, then runs the harness (several minutes; all options:
# `bench/run.sh --help`). Writes docs/benchmarks.md and docs/benchmarks.png.
#
#   bench/run.sh                 # full run: every configuration, 3 interleaved rounds
#   bench/run.sh --smoke         # a few seconds per configuration (what CI runs)
#   bench/run.sh --only r,d,b --rounds 5   # a named subset, N interleaved rounds
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v wrk >/dev/null || ! command -v h2load >/dev/null || ! command -v redis-server >/dev/null; then
  bash scripts/install-system-deps.sh
fi
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,bench]'
exec .venv/bin/python -m bench.harness "$@"
