#!/usr/bin/env bash
# Install (idempotent), then run the main job offline: convert the real all-MiniLM-L6-v2 into a
# Performer (the default hybrid attention, positions extended to 8192), print the fidelity report and
# compare speed and memory with the source model at 8K tokens. Extra arguments go to `performer-hf demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
HF_HUB_OFFLINE=1 performer-hf demo "$@"
