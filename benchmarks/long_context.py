"""Forward time and peak memory at long context: FAVOR+ vs exact softmax attention, same weights shape.

Model: 6 layers, hidden 384, 12 heads (MiniLM-L6 size), fp32, batch 1, inference (``torch.no_grad``).
Each (kernel, direction, length) runs in its own subprocess, so that the memory figure is that
forward's alone: ``peak_delta_mb`` is the process's peak RSS (``ru_maxrss``) after the forwards minus
its RSS just before the first one (model and inputs already built). The child runs under an
address-space limit (``--memory-limit-gb``), so a configuration that would exhaust the shared
machine fails with an allocation error, which is recorded, instead of invoking the OOM killer.

Exact attention is PyTorch's ``scaled_dot_product_attention`` (the path the Performer's
``attention_kernel="exact"`` takes); on CPU it runs a fused kernel that never stores the L x L
matrix, so its memory stays linear too and its time is what grows quadratically.

Writes benchmarks/results/long_context.{json,png,md}.

    python benchmarks/long_context.py                          # L = 1024 4096 16384, 3 repeats
    python benchmarks/long_context.py --lengths 1024 --repeats 1   # quick look
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS, HIDDEN, HEADS, VOCAB = 6, 384, 12, 30522
KERNELS = {"performer": "softmax", "exact": "exact"}
logger = logging.getLogger("benchmarks.long_context")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def child(args) -> None:
    """Build one model, run ``repeats`` forwards at ``length``, print one JSON line."""
    limit = int(args.memory_limit_gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    from performer_hf import PerformerConfig, PerformerModel

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = PerformerConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN, max_position_embeddings=args.length, attention_kernel=KERNELS[args.kernel],
        nb_features=args.nb_features, is_decoder=args.direction == "causal",
        layer_norm_position="pre" if args.direction == "causal" else "post",
    )  # fmt: skip
    model = PerformerModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, VOCAB, (1, args.length), generator=torch.Generator().manual_seed(0))
    record = {"rss_before_mb": _rss_mb(), "times_s": []}
    try:
        with torch.no_grad():
            for _ in range(args.repeats):
                start = time.perf_counter()
                out = model(input_ids=ids, use_cache=False).last_hidden_state
                record["times_s"].append(time.perf_counter() - start)
                del out
        record["ok"] = True
    except (RuntimeError, MemoryError) as error:  # allocation failures under the address-space limit
        record.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    record.update(peak_rss_mb=peak_mb, peak_delta_mb=peak_mb - record["rss_before_mb"])
    print("RESULT" + json.dumps(record))


def run_config(args, kernel: str, direction: str, length: int) -> dict:
    argv = [
        sys.executable, __file__, "--child", "--kernel", kernel, "--direction", direction, "--length", str(length),
        "--repeats", str(args.repeats), "--nb-features", str(args.nb_features),
        "--memory-limit-gb", str(args.memory_limit_gb), "--threads", str(args.threads or 0),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True)
    if "RESULT" not in proc.stdout:
        return {"ok": False, "error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    record = json.loads(proc.stdout.split("RESULT", 1)[1])
    if record["times_s"]:
        record["time_s_median"] = statistics.median(record["times_s"])
    return record


def write_outputs(args, results: list[dict]) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": "forward time and peak memory at long context",
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "dtype": "float32", "batch": 1},
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "child"},
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "floor": f"the {max(args.lengths)}-token forward runs on this machine (fp32, batch 1)",
        "results": results,
    }
    (args.out_dir / "long_context.json").write_text(json.dumps(payload, indent=2) + "\n")

    lines = [
        f"# Long-context forward ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, fp32, batch 1, no_grad)",
        "",
        f"Median of {args.repeats} forwards; memory = peak RSS minus RSS before the first forward, one subprocess "
        f"per row. FAVOR+: softmax kernel, m = {args.nb_features}. Shared 2-core CPU, 1-minute load average "
        f"{args.load_average['start']:.1f} at the start, {args.load_average['end']:.1f} at the end.",
        "",
        "| attention | direction | L | forward (s) | peak memory delta (MB) | status |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        time_cell = f"{r['time_s_median']:.2f}" if "time_s_median" in r else "-"
        mem_cell = f"{r['peak_delta_mb']:.0f}" if "peak_delta_mb" in r else "-"
        status = "ok" if r["ok"] else f"failed: {r['error'][:80]}"
        lines.append(f"| {r['kernel']} | {r['direction']} | {r['length']} | {time_cell} | {mem_cell} | {status} |")
    (args.out_dir / "long_context.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    for kernel in args.kernels:
        for direction in args.directions:
            rows = [r for r in results if r["kernel"] == kernel and r["direction"] == direction and r["ok"]]
            if not rows:
                continue
            label = f"{kernel} ({direction})"
            style = "-" if kernel == "performer" else "--"
            ax_t.plot([r["length"] for r in rows], [r["time_s_median"] for r in rows], style, marker="o", label=label)
            ax_m.plot([r["length"] for r in rows], [r["peak_delta_mb"] for r in rows], style, marker="o", label=label)
    for ax, ylabel in ((ax_t, "forward time (s)"), (ax_m, "peak RSS delta (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.suptitle("6 x 384 x 12 forward, fp32, batch 1, CPU")
    fig.tight_layout()
    fig.savefig(args.out_dir / "long_context.png", dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--directions", nargs="+", default=["bidirectional", "causal"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nb-features", type=int, default=256)
    parser.add_argument("--memory-limit-gb", type=float, default=16.0, help="address-space cap of each child")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the JSON / PNG / markdown go")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's choice)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernel", help=argparse.SUPPRESS)
    parser.add_argument("--direction", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    load_before = os.getloadavg()[0]
    results = []
    for length in args.lengths:
        for direction in args.directions:
            for kernel in args.kernels:
                record = {"kernel": kernel, "direction": direction, "length": length}
                record.update(run_config(args, kernel, direction, length))
                logger.info(
                    "%-9s %-13s L=%-6d %s", kernel, direction, length,
                    f"{record['time_s_median']:.2f} s, +{record['peak_delta_mb']:.0f} MB" if record["ok"]
                    else record["error"],
                )  # fmt: skip
                results.append(record)
    args.load_average = {"start": load_before, "end": os.getloadavg()[0]}
    write_outputs(args, results)
    logger.info("%s", (args.out_dir / "long_context.md").read_text())


if __name__ == "__main__":
    main()
