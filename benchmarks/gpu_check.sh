#!/usr/bin/env bash
# Issue 30's GPU check in one command, on a CUDA machine, first correctness, then speed: about 9.5 minutes (each part
# within its time limit; the first calls of each length compile the attention), so that a session's 15 minutes of
# device time hold the machine's start and a short second run.
#
#   1. tests/modeling/test_hybrid_flex.py and test_sparse_flex.py, whose CUDA tests run the compiled FlexAttention
#      paths forward and backward in float32 and bfloat16 against the float32 CPU path, and test_device_compile.py,
#      whose CUDA tests run every compiled attention call (FAVOR+ and the hybrid, encoder and decoder) against eager
#      (the CPU tests run too; inductor's compilations take most of its time), test_far_field_triton.py, the far
#      field's Triton kernels compiled for the GPU against float64 PyTorch, eager, compiled and in the hybrid, and
#      test_hybrid_triton.py, the support sums' Triton kernels against the CPU kernels and, at 4K tokens in float32
#      and bfloat16, the hybrid through them against the float32 CPU path, and the CUDA tests of
#      test_favor_exp_triton.py, FAVOR+'s Triton kernels (the causal scan, which also serves the decoder's far field,
#      and the bidirectional sums) likewise at 4K: the converter's causal preset and plain FAVOR+ both ways (its
#      other tests, in the interpreter on a CPU, would compile some 20 variants of each kernel here);
#   2. benchmarks/model_speed.py --check: every arm's logits on the GPU in bfloat16 against float32 on the CPU, then
#      the whole models' training step and inference against the source held to flash attention, 512 to 32K
#      tokens (16,384 tokens per batch; an arm that runs out of memory or past the time cap stops there, and a model
#      starts no new length past its budget, so that its results are written inside the time limit): the
#      encoder of the Performer family (results in family/), its decoder (decoder/), the Llama converted in place
#      (in_place/; speed only). Every timed output is checked for NaN and inf. The longest length goes first: each
#      length compiles the attention calls anew (a graph per length bucket), and 32K is where the floors are.
#
# Results go to $OUT (the device tool's folder) or benchmarks/results. The device image has its own torch and Triton
# but an older transformers and no network: carry transformers' wheel, fetched here first:
#
#   echo /.whl/ >> .git/info/exclude && python3 -m pip download --no-deps -d .whl "transformers==5.24.0"
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=590)
#
# PERFORMER_HF_FLEX=0 runs the same on the PyTorch backend (the figures before FlexAttention).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site"
fi
# the CPU only gives float32 references here: its PyTorch path, no C++ build
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PERFORMER_HF_CPU_KERNELS=0
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_check.log"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/gpu_check.log"
# device time is scarce: the speed runs even when a test fails, and the script's status says so at the end
tests=0
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/modeling/test_hybrid_flex.py tests/modeling/test_sparse_flex.py \
  tests/modeling/test_device_compile.py tests/modeling/test_far_field_triton.py tests/modeling/test_hybrid_triton.py \
  "tests/modeling/test_favor_exp_triton.py::test_cuda_kernels_match_the_cpu_in_float32_and_bfloat16" \
  2>&1 | tee -a "$out/gpu_check.log" || tests=$?
# the encoder and GPT-2 decoder (their default: hybrid; the encoder's tiled support too), then the Llama converted in
# place (its default: sparse)
mkdir -p "$out/family" "$out/decoder" "$out/in_place"
timeout 150 python3 benchmarks/model_speed.py --device cuda --dtype bfloat16 --batch-tokens 16384 --check \
  --models encoder --arms flash hybrid tiled favor --lengths 32768 8192 2048 512 \
  --reps 3 --time-cap 5 --budget 105 --out-dir "$out/family" 2>&1 | tee -a "$out/gpu_check.log" || true
timeout 110 python3 benchmarks/model_speed.py --device cuda --dtype bfloat16 --batch-tokens 16384 --check \
  --models decoder --arms flash hybrid favor --lengths 32768 8192 2048 512 \
  --reps 3 --time-cap 5 --budget 70 --out-dir "$out/decoder" 2>&1 | tee -a "$out/gpu_check.log" || true
# (the Llama's --check, run twice, spent this part's time: its sparse selection's error on random weights is the
# CPU's in bf16 too, benchmarks/README.md)
timeout 60 python3 benchmarks/model_speed.py --device cuda --dtype bfloat16 --batch-tokens 16384 \
  --models llama --arms sdpa flash sparse --lengths 2048 8192 32768 \
  --reps 3 --time-cap 5 --budget 25 --out-dir "$out/in_place" 2>&1 | tee -a "$out/gpu_check.log" || true
if [ "$tests" != 0 ]; then echo "the GPU tests FAILED (status $tests): see above" | tee -a "$out/gpu_check.log"; fi
exit "$tests"
