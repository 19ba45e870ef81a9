#!/usr/bin/env bash
# The whole suite (unit, dist, slow, ray and chaos tiers) on two pytest-xdist workers that take
# whole modules, costliest first (tests/conftest.py): a Ray test spends much of its time waiting
# (health checks, a group's shutdown, a node's start) and the other worker fills those waits, so
# the suite takes about 27 minutes here (2026-12-07, 856 tests), far less than in one process.
# TEST_WORKERS=1: one process.
# Fast tiers alone: scripts/test.sh -m "unit or dist".
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=1
n="${TEST_WORKERS:-2}"
workers=()
if [ "$n" -gt 1 ]; then
  workers=(-n "$n" --dist loadfile --no-loadscope-reorder)
fi
exec .venv/bin/python -m pytest -q -ra --durations=15 "${workers[@]}" "$@"
