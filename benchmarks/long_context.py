"""Forward time and peak memory at long context: FAVOR+ vs exact softmax attention, same weights shape.

Model: 6 layers, hidden 384, 12 heads (MiniLM-L6 size), fp32, batch 1, inference (``torch.no_grad``).
Each (kernel, direction, length) runs in its own subprocess, so that the memory figure is that
forward's alone: ``peak_delta_mb`` is the peak RSS during the forwards minus the RSS just before the
first one (model and inputs already built), measured by the harness's probe (benchmarks/harness.py:
VmHWM after a reset through ``/proc/self/clear_refs``). The child runs under an address-space limit
(``--memory-limit-gb``), so a configuration that would exhaust the shared machine fails with an
allocation error, which is recorded, instead of invoking the OOM killer.

Exact attention is PyTorch's ``scaled_dot_product_attention`` (the path the Performer's
``attention_kernel="exact"`` takes); on CPU it runs a fused kernel that never stores the L x L
matrix, so its memory stays linear too and its time is what grows quadratically.

Writes long_context.{json,png,md} to --out-dir.

    python benchmarks/long_context.py                                    # L = 1024 4096 16384, 3 repeats
    python benchmarks/long_context.py --quick --out-dir /tmp/long_context   # smoke test: L = 1024, one direction
"""

from __future__ import annotations

import logging
import statistics
import time

import harness

LAYERS, HIDDEN, HEADS, VOCAB = 6, 384, 12, 30522
KERNELS = {"performer": "softmax", "exact": "exact"}
logger = logging.getLogger("benchmarks.long_context")


def child(kernel: str, direction: str, length: int, repeats: int, nb_features: int, threads: int) -> dict:
    """In a fresh process: build one model, run ``repeats`` forwards at ``length``; times and peak memory."""
    import torch

    from performer_hf import PerformerConfig, PerformerModel

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = PerformerConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=4 * HIDDEN,
        max_position_embeddings=length,
        attention_kernel=KERNELS[kernel],
        nb_features=nb_features,
        is_decoder=direction == "causal",
        layer_norm_position="pre" if direction == "causal" else "post",
    )
    model = PerformerModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    record = {"times_s": []}
    with harness.PeakMemory() as memory:
        try:
            with torch.no_grad():
                for _ in range(repeats):
                    start = time.perf_counter()
                    out = model(input_ids=ids, use_cache=False).last_hidden_state
                    record["times_s"].append(time.perf_counter() - start)
                    del out
            record["ok"] = True
        except (RuntimeError, MemoryError) as error:  # allocation failures under the address-space limit
            record.update(ok=False, error=f"{type(error).__name__}: {str(error)[:300]}")
    record.update(
        rss_before_mb=memory.before / 2**20, peak_rss_mb=memory.peak / 2**20, peak_delta_mb=memory.extra / 2**20
    )
    return record


def run_config(args, kernel: str, direction: str, length: int) -> dict:
    """One (kernel, direction, length) in a fresh process under the memory cap, with its median time."""
    record = harness.in_fresh_process(
        __file__,
        memory_cap_gb=args.memory_limit_gb,
        kernel=kernel,
        direction=direction,
        length=length,
        repeats=args.repeats,
        nb_features=args.nb_features,
        threads=args.threads,
    )
    if record.get("times_s"):
        record["time_s_median"] = statistics.median(record["times_s"])
    return record


def measure(args) -> dict:
    """Every (length, direction, kernel), each in its own process."""
    results = []
    for length in args.lengths:
        for direction in args.directions:
            for kernel in args.kernels:
                record = {"kernel": kernel, "direction": direction, "length": length}
                record.update(run_config(args, kernel, direction, length))
                logger.info(
                    "%-9s %-13s L=%-6d %s",
                    kernel,
                    direction,
                    length,
                    f"{record['time_s_median']:.2f} s, +{record['peak_delta_mb']:.0f} MB"
                    if record["ok"]
                    else record["error"],
                )
                results.append(record)
    return {
        "benchmark": "forward time and peak memory at long context",
        "model": {"layers": LAYERS, "hidden": HIDDEN, "heads": HEADS, "dtype": "float32", "batch": 1},
        "settings": vars(args),
        "floor": f"the {max(args.lengths)}-token forward runs on this machine (fp32, batch 1)",
        "results": results,
    }


def markdown(payload: dict) -> str:
    """Forward time, peak memory delta and status per configuration."""
    settings, results = payload["settings"], payload["results"]
    load = harness.environment(payload)["load_average"]
    lines = [
        f"# Long-context forward ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, fp32, batch 1, no_grad)",
        "",
        f"Median of {settings['repeats']} forwards; memory = peak RSS minus RSS before the first forward, one "
        f"subprocess per row. FAVOR+: softmax kernel, m = {settings['nb_features']}. Shared 2-core CPU, 1-minute "
        f"load average {load['before'][0]:.1f} at the start, {load['after'][0]:.1f} at the end.",
        "",
        "| attention | direction | L | forward (s) | peak memory delta (MB) | status |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        time_cell = f"{r['time_s_median']:.2f}" if "time_s_median" in r else "-"
        mem_cell = f"{r['peak_delta_mb']:.0f}" if "peak_delta_mb" in r else "-"
        status = "ok" if r["ok"] else f"failed: {r['error'][:80]}"
        lines.append(f"| {r['kernel']} | {r['direction']} | {r['length']} | {time_cell} | {mem_cell} | {status} |")
    return "\n".join(lines) + "\n"


def plot(payload: dict):
    """Forward time and peak memory delta vs length per kernel and direction, log-log."""
    settings, results = payload["settings"], payload["results"]
    fig, (ax_t, ax_m) = harness.pyplot().subplots(1, 2, figsize=(10, 4))
    for kernel in settings["kernels"]:
        for direction in settings["directions"]:
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
    return fig


def main(argv=None) -> dict:
    parser = harness.parser(
        __doc__,
        quick="L = 1024, 1 repeat, bidirectional only",
        # each configuration is a fresh process (9 s, its imports mostly): one direction's pair
        quick_flags={"lengths": [1024], "repeats": 1, "directions": ["bidirectional"]},
        threads=0,
    )
    parser.add_argument("--lengths", type=harness.at_least(1), nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--directions", nargs="+", default=["bidirectional", "causal"])
    parser.add_argument("--repeats", type=harness.at_least(1), default=3)
    parser.add_argument("--nb-features", type=harness.at_least(1), default=256)
    parser.add_argument("--memory-limit-gb", type=float, default=16.0, help="address-space cap of each child")
    return harness.main("long_context", parser, measure, markdown, plot, child=child, argv=argv)


if __name__ == "__main__":
    main()
