#!/usr/bin/env bash
# Install from scratch (idempotent), lint, and run the test suite (with a --quick smoke run of every study in
# benchmarks/, tests/test_studies.py), against the newest transformers and torch in the declared ranges;
# TRANSFORMERS=oldest runs the suite without the study smoke runs against the oldest (in .venv-oldest). CI runs both.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
studies=()
if [ "${TRANSFORMERS:-newest}" = oldest ]; then
  . .venv-oldest/bin/activate
  studies=(-m "not studies")  # the studies' smoke runs are the newest end's; the library is tested at both ends
else
  . .venv/bin/activate
fi
python -c "import transformers; print(f'transformers {transformers.__version__}')"
# the linter and the formatter ruff is configured with (pyproject.toml): a finding fails the run
python -m ruff check .
python -m ruff format --check .
# on every core (pytest-xdist; at most 4 workers, each holding its own models), the tests spread as workers go idle
python -m pytest -q --numprocesses logical --maxprocesses 4 --dist worksteal "${studies[@]}" "$@"
