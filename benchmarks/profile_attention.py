"""Where an attention call's time goes: torch.profiler's top operators for one converted model's attention.

Builds the models of ``model_speed.py`` (default conversion and plain FAVOR+), takes layer 0's attention
function and profiles ``--reps`` forward + backward calls on (1, 12, L, 32) tensors after a warm-up (``--mode
inference``: forward calls without gradients).
Prints, per arm, the operators with the most self device time (CPU time on a CPU), their call counts
and the number of kernel launches per call: the figures that say whether a path is bound by launches,
by memory traffic or by arithmetic. Nothing is written; this is a diagnostic, not a study.

``--part model`` profiles the whole training step of ``model_speed.py`` instead (``--mode inference``: its inference
forward, a decoder's cache included, as users call it; ``--batch-tokens`` tokens per batch; the source arms ``sdpa``
and ``flash`` too), and counts the host's waits for the device (synchronisations and
device-to-host copies), which stall a GPU's queue where a step that should be device-bound is not.

    python benchmarks/profile_attention.py --device cuda --dtype bfloat16 --length 16384
    python benchmarks/profile_attention.py --part model --models decoder --arms sdpa hybrid --length 512 \
        --device cuda --dtype bfloat16 --batch-tokens 16384
    python benchmarks/profile_attention.py --quick      # smoke test: 256 tokens, one call, encoder and decoder
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

import harness
import model_speed
import torch
from torch.profiler import ProfilerActivity, profile


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--models", nargs="+", choices=model_speed.MODELS, default=list(model_speed.MODELS))
    parser.add_argument("--part", choices=("attention", "model"), default="attention")
    parser.add_argument("--mode", choices=model_speed.MODES, default="train", help="train: forward and backward")
    parser.add_argument("--arms", nargs="+", choices=("sdpa", "flash", "hybrid", "favor"), default=["hybrid", "favor"])
    positive = harness.at_least(1)
    parser.add_argument(
        "--batch-tokens", type=harness.at_least(0), default=0, help="--part model: tokens per batch; 0: batch 1"
    )
    parser.add_argument("--length", type=positive, default=4096)
    parser.add_argument("--reps", type=positive, default=3)
    parser.add_argument("--rows", type=positive, default=15, help="operators shown per arm")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 256 tokens, one call, no llama (--length 256 --reps 1 --models encoder decoder where they "
        "are not given: a flag given wins, as in the studies)",
    )
    parser.add_argument("--out-dir", help="unused (nothing is written); taken so that every study takes it")
    args = parser.parse_args(argv)
    if args.quick:  # the smoke test's settings stand in for the defaults, as harness.parser's quick_flags do
        quick = {"length": 256, "reps": 1, "models": [kind for kind in model_speed.MODELS if kind != "llama"]}
        args = parser.parse_args(argv, namespace=argparse.Namespace(**quick))
    logging.basicConfig(level=logging.WARNING)
    if args.part == "model":
        profile_steps(args)
        return
    args.arms = [arm for arm in args.arms if arm not in model_speed.SOURCE_ARMS]
    activities, sort_by = _activities(args.device)
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
            step = model_speed.attention_step(arm, call, qkv, MODES[args.mode], args.device)
            step.work()  # warm-up
            with profile(activities=activities) as prof:
                for _ in range(args.reps):
                    step.work()
                model_speed.synchronize(args.device)
            events = prof.key_averages()
            launches = sum(
                e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
            )
            print(
                f"\n=== {kind} {arm}: L={args.length}, {MODES[args.mode].replace('_', ' + ')}, {args.reps} calls, "
                f"{launches / args.reps:.0f} kernel launches per call ==="
            )
            print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))


def _activities(device: str):
    """The profiler's activities and the table's sort key on ``device``."""
    if device == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA], "self_cuda_time_total"
    return [ProfilerActivity.CPU], "self_cpu_time_total"


MODES = {"train": "forward_backward", "inference": "forward"}  # model_speed's attention steps, by mode
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def profile_steps(args) -> None:
    """``--part model``: ``--reps`` training steps (or inference forwards) of every arm's whole model after a
    warm-up."""
    activities, sort_by = _activities(args.device)
    for kind in args.models:
        with tempfile.TemporaryDirectory() as workdir:
            models = model_speed.build_models(kind, args.length, args.arms, Path(workdir))
        batch = max(1, args.batch_tokens // args.length) if args.batch_tokens else 1
        for arm, model in models.items():
            model.to(args.device, getattr(torch, args.dtype))
            inputs = model_speed.make_batch(kind, model.config.vocab_size, batch, args.length, args.device)
            step = model_speed.model_step(arm, model, args.mode, inputs, args.device)
            step.work()  # warm-up
            with profile(activities=activities) as prof:
                for _ in range(args.reps):
                    step.work()
                model_speed.synchronize(args.device)
            events = prof.key_averages()
            launches = sum(
                e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC")
            )
            waits = {e.key: e.count // args.reps for e in events if e.key in HOST_WAITS}
            print(
                f"\n=== {kind} {arm}: L={args.length} x {batch}, {args.mode}, {args.reps} steps, "
                f"{launches / args.reps:.0f} kernel launches and host waits {waits} per step ==="
            )
            print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))
            model.cpu()


if __name__ == "__main__":
    main()
