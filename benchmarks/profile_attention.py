"""Where an attention call's time goes: torch.profiler's top operators for one converted model's attention.

Builds the models of ``model_speed.py`` (default conversion and plain FAVOR+), takes layer 0's attention
function and profiles ``--reps`` forward + backward calls on (1, 12, L, 32) tensors after a warm-up.
Prints, per arm, the operators with the most self device time (CPU time on a CPU), their call counts
and the number of kernel launches per call: the figures that say whether a path is bound by launches,
by memory traffic or by arithmetic. Nothing is written; this is a diagnostic, not a study.

    python benchmarks/profile_attention.py --device cuda --dtype bfloat16 --length 16384
    python benchmarks/profile_attention.py --quick      # smoke test: 256 tokens, one call, encoder and decoder
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import model_speed
import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--models", nargs="+", choices=model_speed.MODELS, default=list(model_speed.MODELS))
    parser.add_argument("--arms", nargs="+", choices=("hybrid", "favor"), default=["hybrid", "favor"])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=15, help="operators shown per arm")
    parser.add_argument("--quick", action="store_true", help="smoke test: 256 tokens, one call, no llama")
    parser.add_argument("--out-dir", help="unused (nothing is written); taken so that every study takes it")
    args = parser.parse_args(argv)
    if args.quick:
        args.length, args.reps = 256, 1
        args.models = [kind for kind in args.models if kind != "llama"]
    logging.basicConfig(level=logging.WARNING)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sort_by = "self_cuda_time_total" if args.device == "cuda" else "self_cpu_time_total"
    for kind in args.models:
        with tempfile.TemporaryDirectory() as workdir:
            models = model_speed.build_models(kind, 64, args.arms, Path(workdir))
        for arm, model in models.items():
            module = model_speed.first_attention(model).to(args.device)
            call = model_speed.AttentionCall(module, causal=kind == "decoder")
            g = torch.Generator().manual_seed(0)
            qkv = [
                torch.randn(1, model_speed.HEADS, args.length, model_speed.HIDDEN // model_speed.HEADS, generator=g)
                .to(args.device, getattr(torch, args.dtype))
                .requires_grad_()
                for _ in range(3)
            ]
            call(*qkv).float().sum().backward()  # warm-up
            with profile(activities=activities) as prof:
                for _ in range(args.reps):
                    call(*qkv).float().sum().backward()
                if args.device == "cuda":
                    torch.cuda.synchronize()
            events = prof.key_averages()
            launches = sum(
                e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
            )
            print(
                f"\n=== {kind} {arm}: L={args.length}, forward + backward, {args.reps} calls, "
                f"{launches / args.reps:.0f} kernel launches per call ==="
            )
            print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
