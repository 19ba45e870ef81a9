#!/usr/bin/env bash
# Run the benchmark scripts in benchmarks/ one after another and collect the JSON line each prints
# last into benchmarks/results.jsonl, with "script", "seconds" and "finished_at" added.
#
#   benchmarks/run_all.sh                    every benchmarks/*.py, whoever added it
#   benchmarks/run_all.sh padding memory     only these (names without .py)
#
# Skipped: names starting with "_" (helpers) and scripts that hold the line "# run_all: skip" (e.g.
# a baseline that another benchmark launches itself). results.jsonl: the lines of the scripts run
# now are replaced, every other line stays (other scripts', and those a benchmark appends itself). A script that fails, or whose
# last line of stdout is not a JSON object, gets an {"error": ...} line; the exit status is then 1.
#
# The whole run holds /tmp/et_ray.lock, so that it never overlaps the Ray tests (each would distort
# the other's numbers). Do not wrap this script in `flock /tmp/et_ray.lock`: it takes the lock itself.
# PYTHON=... picks the interpreter (default: .venv/bin/python if present, else python3).
set -uo pipefail

LOCK=/tmp/et_ray.lock
if [[ -z "${ET_BENCH_LOCK_HELD:-}" ]]; then
    export ET_BENCH_LOCK_HELD=1
    exec flock "$LOCK" "$0" "$@"
fi

cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
RESULTS=benchmarks/results.jsonl
NEW=$(mktemp)
LOG=$(mktemp)
trap 'rm -f "$NEW" "$LOG"' EXIT

if [[ $# -gt 0 ]]; then
    scripts=()
    for name in "$@"; do scripts+=("benchmarks/${name%.py}.py"); done
else
    scripts=(benchmarks/*.py)
fi

status=0
for script in "${scripts[@]}"; do
    if [[ ! -f "$script" ]]; then
        echo "!!! $script: no such benchmark" >&2
        status=1
        continue
    fi
    [[ $(basename "$script") == _* ]] && continue
    grep -qx "# run_all: skip" "$script" && { echo "=== $script: skipped (# run_all: skip)"; continue; }
    echo "=== $script ($(date -u +%H:%M:%S))"
    start=$(date +%s)
    "$PYTHON" "$script" | tee "$LOG"  # stdout only; stderr goes straight to the terminal
    rc=${PIPESTATUS[0]}
    seconds=$(( $(date +%s) - start ))
    if ! "$PYTHON" - "$script" "$rc" "$seconds" "$LOG" >>"$NEW" <<'EOF'
import datetime, json, sys
script, rc, seconds, log = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
lines = [line for line in open(log, errors="replace").read().splitlines() if line.strip()]
try:
    record = json.loads(lines[-1]) if lines else None
except ValueError:
    record = None
failed = rc != 0 or not isinstance(record, dict)
if failed:
    record = {"error": f"exit status {rc}" if rc != 0 else "last line of stdout is not a JSON object"}
record.update(script=script, seconds=seconds,
              finished_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
print(json.dumps(record))
sys.exit(1 if failed else 0)
EOF
    then
        echo "!!! $script failed (see above)" >&2
        status=1
    fi
done

# Merge: this run's lines replace earlier lines of the same scripts; every other line stays as it
# was, in its place: those of other scripts, and those a benchmark appended itself (with no
# "script" key: gpu.py's cases, recovery's, sharding's), which one line per script would drop.
"$PYTHON" - "$RESULTS" "$NEW" <<'EOF'
import json, os, sys
results, new = sys.argv[1], sys.argv[2]

def records(path):
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path) if line.strip()]

fresh = records(new)
ran = {record["script"] for record in fresh}
kept = [record for record in records(results) if record.get("script") not in ran]
with open(results, "w") as out:
    for record in kept + fresh:
        out.write(json.dumps(record) + "\n")
EOF
echo "=== $(wc -l <"$NEW") result line(s) from this run; $RESULTS holds $(wc -l <"$RESULTS")"
exit $status
