#!/usr/bin/env bash
# Install from scratch (idempotent) and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
python -m pytest -q "$@"
