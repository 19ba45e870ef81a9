#!/usr/bin/env bash
# The whole suite (unit, dist, slow, ray and chaos tiers) on two pytest-xdist workers, each taking
# whole modules, costliest first (tests/conftest.py orders them). Fast tiers alone:
# scripts/test.sh -m "unit or dist"; one process: scripts/test.sh -n 0; more: TEST_WORKERS=4.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=1
exec .venv/bin/python -m pytest -q -ra --durations=15 \
  -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
