#!/usr/bin/env bash
# The whole suite (unit, dist, slow, ray, chaos tiers). Fast tiers alone: scripts/test.sh -m "unit or dist"
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=1
exec .venv/bin/python -m pytest -q -ra --durations=15 "$@"
