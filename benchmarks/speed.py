"""Attention-only speed and memory vs sequence length: FAVOR+ against exact SDPA and performer-pytorch.

One attention call on (batch 1, 8 heads, L, head_dim 64) float32 tensors, m = 256 features:

    favor                  performer_hf.favor.favor_attention, bidirectional (softmax kernel)
    favor_causal           the same, causal=True (chunked prefix sums)
    sdpa / sdpa_causal     torch.nn.functional.scaled_dot_product_attention (is_causal for the causal one)
    identity               out = v: attention that costs nothing (the paper's Fig. 3 "OPT" line)
    performer_pytorch      performer-pytorch's FastAttention (causal=False), the peer we replace
    performer_pytorch_causal  FastAttention(causal=True): its CPU path stores L x m x d prefix sums

Time: "forward" runs under torch.no_grad; "forward_backward" runs the call on inputs that require
grad and back-propagates out.sum(). Every method runs in this one process; the repetitions are
interleaved (method after method, round after round) so that a load change on the machine hits
all of them alike, and the median is reported. The first run of each configuration is a warm-up
unless it took longer than --warmup-cap seconds (then it counts as a sample).

Peak memory: each (method, length, mode) runs once more in a fresh subprocess that imports only
torch and the method's module and builds the inputs; the harness's probe (benchmarks/harness.py:
``VmHWM - VmRSS`` after resetting the high-water mark through ``/proc/self/clear_refs``) then
measures the extra resident memory the call needed at its peak (activations, saved tensors,
gradients, the allocator's scratch), excluding the inputs. The subprocess runs under an
address-space limit (--memory-cap-gb): a configuration that would need more fails with an
allocation error and is recorded as skipped, with its time not measured.

Skipped, and recorded as such: lengths above a method's cap (exact SDPA beyond 16K tokens,
performer-pytorch causal beyond 8K: its L x m x d prefix sums reach 34 s and 5 GB at 8K on a
2-core machine), and every longer length once a method's median passes --time-cap seconds.

Writes speed.json, speed.png and speed.md to --out-dir (tables of times, ratios, memory and the
issue-2 floors at L = 8192).

    python benchmarks/speed.py                 # full run: L = 1K .. 32K (tens of minutes on 2 cores)
    python benchmarks/speed.py --quick         # smoke test: L = 256, FAVOR+ and SDPA; 1 repetition; one memory probe
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import harness

BATCH, HEADS, HEAD_DIM, NB_FEATURES = 1, 8, 64, 256
MODES = ("forward", "forward_backward")
FLOOR_LENGTH = 8192
logger = logging.getLogger("benchmarks.speed")


@dataclass(frozen=True)
class Method:
    name: str
    label: str
    causal: bool
    max_length: int | None = None  # longer lengths are skipped


METHODS = {
    m.name: m
    for m in (
        Method("favor", "FAVOR+ (ours)", causal=False),
        Method("favor_causal", "FAVOR+ causal (ours)", causal=True),
        Method("sdpa", "exact SDPA", causal=False, max_length=16384),
        Method("sdpa_causal", "exact SDPA causal", causal=True, max_length=16384),
        Method("identity", "identity (out = v)", causal=False),
        Method("performer_pytorch", "performer-pytorch", causal=False),
        Method("performer_pytorch_causal", "performer-pytorch causal", causal=True, max_length=8192),
    )
}
# (ours, baseline) pairs whose time ratios the report shows
COMPARISONS = [
    ("favor", "sdpa"),
    ("favor", "performer_pytorch"),
    ("favor_causal", "sdpa_causal"),
    ("favor_causal", "performer_pytorch_causal"),
    ("identity", "favor"),
]


# ---- building and running one attention call ---------------------------------------------------


def build(method: str) -> Callable:
    """The attention call ``fn(q, k, v) -> out`` of a method, with its projection drawn once."""
    import torch
    import torch.nn.functional as F

    if method in ("favor", "favor_causal"):
        from performer_hf.favor import draw_projection, favor_attention

        W = draw_projection(NB_FEATURES, HEAD_DIM, generator=torch.Generator().manual_seed(0))
        causal = method == "favor_causal"
        return lambda q, k, v: favor_attention(q, k, v, W, causal=causal)
    if method in ("sdpa", "sdpa_causal"):
        causal = method == "sdpa_causal"
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if method == "identity":
        return lambda q, k, v: v
    if method in ("performer_pytorch", "performer_pytorch_causal"):
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()):  # its causal path prints a CUDA-extension notice
            from performer_pytorch import FastAttention

            return FastAttention(dim_heads=HEAD_DIM, nb_features=NB_FEATURES, causal=method.endswith("causal"))
    raise ValueError(f"unknown method {method!r}; choose from {sorted(METHODS)}")


def make_inputs(length: int, requires_grad: bool):
    import torch

    g = torch.Generator().manual_seed(length)
    return [torch.randn(BATCH, HEADS, length, HEAD_DIM, generator=g).requires_grad_(requires_grad) for _ in range(3)]


def run_once(fn: Callable, inputs, mode: str) -> None:
    import torch

    if mode == "forward":
        with torch.no_grad():
            fn(*inputs)
        return
    for t in inputs:
        t.grad = None
    fn(*inputs).sum().backward()


# ---- peak memory, one subprocess per configuration ----------------------------------------------


def _kernels_without_package_init() -> None:
    """Make ``performer_hf.favor`` importable without running ``performer_hf/__init__.py``, which
    imports transformers: a memory subprocess then starts in about a second instead of several."""
    import importlib.util
    import types

    spec = importlib.util.find_spec("performer_hf")
    package = types.ModuleType("performer_hf")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules.setdefault("performer_hf", package)


def memory_child(method: str, length: int, mode: str) -> dict:
    """In a fresh process: the peak extra resident memory of one call, inputs excluded."""
    _kernels_without_package_init()
    try:
        fn = build(method)
        inputs = make_inputs(length, requires_grad=mode == "forward_backward")
        with harness.PeakMemory() as memory:
            run_once(fn, inputs, mode)
    except (RuntimeError, MemoryError) as error:  # allocation failure under the address-space cap
        return {"ok": False, "error": f"{type(error).__name__}: {str(error)[:200]}"}
    return {"ok": True, "peak_mb": memory.extra / 2**20, "memory_probe": memory.method}


def measure_memory(method: str, length: int, mode: str, args) -> dict:
    """Peak memory of one configuration, measured by :func:`memory_child` in a fresh process."""
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    return harness.in_fresh_process(
        __file__, memory_cap_gb=args.memory_cap_gb, env=env, method=method, length=length, mode=mode
    )


# ---- the benchmark ------------------------------------------------------------------------------


def run_benchmark(args) -> list[dict]:
    fns = {name: build(name) for name in args.methods}
    records: dict[tuple[str, int, str], dict] = {}
    stopped: dict[tuple[str, str], str] = {}  # (method, mode) -> why longer lengths are skipped

    for length in args.lengths:
        for mode in MODES:
            live = []
            for name in args.methods:
                rec = {"method": name, "length": length, "mode": mode, "times_s": [], "skipped": None}
                records[(name, length, mode)] = rec
                cap = METHODS[name].max_length
                if cap is not None and length > cap and not args.no_caps:
                    rec["skipped"] = f"length above the method's cap of {cap}"
                elif (name, mode) in stopped:
                    rec["skipped"] = stopped[(name, mode)]
                # a quick run probes the first configuration's memory alone (each probe: a fresh process, 9 s)
                probed = any("memory_probe" in other for other in records.values())
                if rec["skipped"] is None and not args.no_memory and not (args.quick and probed):
                    mem = measure_memory(name, length, mode, args)
                    if mem["ok"]:
                        rec["peak_mb"] = mem["peak_mb"]
                        rec["memory_probe"] = mem["memory_probe"]
                    else:
                        rec["skipped"] = f"over the {args.memory_cap_gb:g} GiB memory cap ({mem['error'][:80]})"
                        stopped[(name, mode)] = rec["skipped"]
                if rec["skipped"] is None:
                    live.append(name)
                else:
                    logger.info("%-26s L=%-6d %-16s skipped: %s", name, length, mode, rec["skipped"])

            inputs = make_inputs(length, requires_grad=mode == "forward_backward")
            warm = {}
            for name in live:  # warm-up; a slow first run counts as a sample
                start = time.perf_counter()
                run_once(fns[name], inputs, mode)
                elapsed = time.perf_counter() - start
                warm[name] = elapsed
                if elapsed > args.warmup_cap:
                    records[(name, length, mode)]["times_s"].append(elapsed)
            for _ in range(args.reps):
                for name in live:
                    rec = records[(name, length, mode)]
                    if len(rec["times_s"]) >= args.reps:
                        continue
                    start = time.perf_counter()
                    run_once(fns[name], inputs, mode)
                    rec["times_s"].append(time.perf_counter() - start)
            for name in live:
                rec = records[(name, length, mode)]
                rec["median_s"] = statistics.median(rec["times_s"])
                rec["warmup_s"] = warm[name]
                logger.info(
                    "%-26s L=%-6d %-16s %8.3f s  (runs %s)  peak %s MB",
                    name,
                    length,
                    mode,
                    rec["median_s"],
                    " ".join(f"{t:.3f}" for t in rec["times_s"]),
                    f"{rec['peak_mb']:.0f}" if "peak_mb" in rec else "-",
                )
                if rec["median_s"] > args.time_cap:
                    stopped[(name, mode)] = f"a shorter length already took over {args.time_cap:g} s"
            del inputs
    return list(records.values())


# ---- reporting ----------------------------------------------------------------------------------


def _value(results, key: str, method: str, length: int, mode: str):
    """``key`` ("median_s", "peak_mb") of one configuration's record; None where it was not measured."""
    return next((r.get(key) for r in results if (r["method"], r["length"], r["mode"]) == (method, length, mode)), None)


def _table(header: list[str], rows: dict) -> list[str]:
    """A Markdown table with L in the first column: ``rows`` maps every L to its cells."""
    body = [f"| {L} | " + " | ".join(cells) + " |" for L, cells in rows.items()]
    return ["| L | " + " | ".join(header) + " |", "|---|" + "---|" * len(header), *body, ""]


def floors(results) -> list[dict]:
    """The issue-2 floors, evaluated on this run (None where a figure is missing)."""
    L, fb = FLOOR_LENGTH, "forward_backward"
    out = []
    for ours, base, target in (
        ("favor", "sdpa", 3.0),
        ("favor", "performer_pytorch", 1.5),
        ("favor_causal", "sdpa_causal", 2.0),
        ("favor_causal", "performer_pytorch_causal", 10.0),
    ):
        a, b = _value(results, "median_s", ours, L, fb), _value(results, "median_s", base, L, fb)
        value = None if a is None or b is None else b / a
        out.append(
            {
                "floor": f"{ours} forward+backward at L={L}: {base} time / ours >= {target:g}",
                "value": value,
                "target": target,
                "met": None if value is None else value >= target,
            }
        )
    peak_16k = _value(results, "peak_mb", "favor_causal", 16384, fb)
    out.append(
        {
            "floor": "favor_causal forward+backward peak memory at L=16384 < 2048 MB",
            "value": peak_16k,
            "target": 2048.0,
            "met": None if peak_16k is None else peak_16k < 2048.0,
        }
    )
    peaks = [(r["length"], r.get("peak_mb")) for r in results if r["method"] == "favor_causal" and r["mode"] == fb]
    peaks = sorted(p for p in peaks if p[1] is not None)
    growth = [b / a for (_, a), (_, b) in zip(peaks, peaks[1:], strict=False)]
    doubling = [l2 / l1 for (l1, _), (l2, _) in zip(peaks, peaks[1:], strict=False)]
    linear = bool(growth) and all(g <= 1.25 * x for g, x in zip(growth, doubling, strict=True))
    out.append(
        {
            "floor": "favor_causal forward+backward peak memory grows linearly in L (each step's growth "
            "<= 1.25 x the length ratio)",
            "value": growth,
            "target": doubling,
            "met": None if not growth else linear,
        }
    )
    return out


def markdown(payload: dict) -> str:
    """Tables of times, baseline / ours ratios and peak memory per L, and the issue-2 floors."""
    results, cfg = payload["results"], payload["config"]
    methods, lengths = cfg["methods"], cfg["lengths"]
    environment = harness.environment(payload)
    machine, load = environment["machine"], environment["load_average"]
    lines = [
        f"# Attention speed and memory (batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, m = {NB_FEATURES}, fp32)",
        "",
        f"Machine: {machine.get('cpu', '?')}, {machine['cpu_count']} cores, torch {machine['torch']} "
        f"({machine['torch_threads']} threads); load average {load['before']} at the start, {load['after']} at "
        f"the end. Median of {cfg['reps']} interleaved runs; '-' = skipped (see speed.json for why).",
        "",
    ]
    labels = [METHODS[m].label for m in methods]
    for mode in MODES:
        lines += [f"## {mode.replace('_', ' + ')} time (s)", ""]
        times = {L: [_value(results, "median_s", m, L, mode) for m in methods] for L in lengths}
        lines += _table(labels, {L: ["-" if c is None else f"{c:.3f}" for c in cells] for L, cells in times.items()})
    comparisons = [(a, b) for a, b in COMPARISONS if a in methods and b in methods]
    for mode in MODES:
        lines += [f"## {mode.replace('_', ' + ')}: time ratios (baseline / ours; > 1 means ours is faster)", ""]
        ratios = {L: [] for L in lengths}
        for L in lengths:
            for a, b in comparisons:
                ta, tb = _value(results, "median_s", a, L, mode), _value(results, "median_s", b, L, mode)
                ratios[L].append("-" if ta is None or tb is None else f"{tb / ta:.2f}x")
        lines += _table([f"{b} / {a}" for a, b in comparisons], ratios)
    for mode in MODES:
        lines += [f"## {mode.replace('_', ' + ')}: peak extra memory (MB)", ""]
        peaks = {L: [_value(results, "peak_mb", m, L, mode) for m in methods] for L in lengths}
        lines += _table(labels, {L: ["-" if c is None else f"{c:.0f}" for c in cells] for L, cells in peaks.items()})
    lines += ["## Floors (issue 2)", "", "| floor | measured | met |", "|---|---|---|"]
    for f in payload["floors"]:
        value = f["value"]
        if isinstance(value, float):
            shown = f"{value:.2f}"
        elif isinstance(value, list):
            shown = ", ".join(f"{v:.2f}" for v in value)
        else:
            shown = "-"
        lines.append(f"| {f['floor']} | {shown} | {'-' if f['met'] is None else ('yes' if f['met'] else 'NO')} |")
    lines += ["", f"Peak memory: {payload['memory_method']}", ""]
    return "\n".join(lines)


def plot(payload: dict):
    """Time and peak memory vs L per method, forward and forward + backward, log-log."""
    results, methods = payload["results"], payload["config"]["methods"]
    fig, axes = harness.pyplot().subplots(2, 2, figsize=(12, 9))
    for row, (key, ylabel) in enumerate((("median_s", "time (s)"), ("peak_mb", "peak extra memory (MB)"))):
        for col, mode in enumerate(MODES):
            ax = axes[row][col]
            for name in methods:
                pts = sorted(
                    (r["length"], r[key]) for r in results if r["method"] == name and r["mode"] == mode and r.get(key)
                )
                if not pts:
                    continue
                style = "-" if name.startswith("favor") else (":" if name == "identity" else "--")
                ax.plot(*zip(*pts, strict=True), style, marker="o", label=METHODS[name].label)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sequence length L")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{mode.replace('_', ' + ')}")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"Attention on CPU: batch {BATCH}, {HEADS} heads, head_dim {HEAD_DIM}, m = {NB_FEATURES}, fp32")
    return fig


def measure(args) -> dict:
    """Every (method, length, mode): times, peak memory or why it was skipped; and the floors."""
    results = run_benchmark(args)
    return {
        "benchmark": "attention speed and peak memory vs sequence length",
        "config": {
            "batch": BATCH,
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "nb_features": NB_FEATURES,
            "dtype": "float32",
            "lengths": args.lengths,
            "methods": args.methods,
            "reps": args.reps,
            "quick": args.quick,
            "time_cap_s": args.time_cap,
            "memory_cap_gb": args.memory_cap_gb,
        },
        "memory_method": "one fresh subprocess per configuration: VmHWM (reset through /proc/self/clear_refs "
        "just before the call) minus VmRSS before the call, i.e. the extra resident memory at the call's peak, "
        "inputs excluded; ru_maxrss delta where clear_refs is unavailable.",
        "results": results,
        "floors": floors(results),
    }


def main(argv=None) -> dict:
    parser = harness.parser(
        __doc__,
        quick="L = 256, 1 run each: FAVOR+ and SDPA; the first configuration's memory",
        quick_flags={"lengths": [256], "reps": 1, "methods": ["favor", "sdpa"]},  # a Performer arm and the baseline
        threads=0,
    )
    parser.add_argument(
        "--lengths", type=harness.at_least(1), nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--reps", type=harness.at_least(1), default=3, help="timed runs per configuration (median reported)"
    )
    parser.add_argument("--warmup-cap", type=float, default=5.0, help="a first run longer than this is a sample")
    parser.add_argument("--time-cap", type=float, default=120.0, help="skip longer lengths past this median (s)")
    parser.add_argument("--memory-cap-gb", type=float, default=12.0, help="address-space cap of a memory subprocess")
    parser.add_argument("--no-caps", action="store_true", help="ignore the per-method length caps")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    return harness.main("speed", parser, measure, markdown, plot, child=memory_child, argv=argv)


if __name__ == "__main__":
    main()
