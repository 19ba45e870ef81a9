#!/usr/bin/env bash
# Creates .venv (if missing) and installs elastic_train with its dev, hf, ft, track and lora extras.
# torch is installed first, the CPU build on a machine without a GPU: a bare `torch` requirement
# would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if nvidia-smi -L >/dev/null 2>&1; then  # a GPU machine: PyPI's torch is the CUDA build
    python -m pip install -q "torch==2.13.0"
  else  # the CPU build: a wheel on this disk (pip's find-links) where there is one, else torch's CPU index
    python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || python -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
python -m pip install -q -e ".[dev,hf,ft,track,lora]"
