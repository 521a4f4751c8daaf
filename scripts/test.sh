#!/usr/bin/env bash
# Install from scratch (idempotent) and run the test suite, against the newest transformers in the
# declared range; TRANSFORMERS=oldest runs it against the oldest (in .venv-oldest). CI runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
if [ "${TRANSFORMERS:-newest}" = oldest ]; then . .venv-oldest/bin/activate; else . .venv/bin/activate; fi
python -c "import transformers; print(f'transformers {transformers.__version__}')"
python -m pytest -q "$@"
