#!/usr/bin/env bash
# Creates .venv (if missing) and installs elastic_train with its dev, hf, ft, track and lora extras.
# The CPU build of torch is installed first: a bare `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
python -m pip install -q -e ".[dev,hf,ft,track,lora]"
