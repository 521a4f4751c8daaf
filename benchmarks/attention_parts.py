"""Where the hybrid's and FAVOR+'s attention time goes on a GPU, part by part, against flash attention.

One attention call of the encoder's shape ((1, 12, L, 32), bfloat16, random queries, keys and values), timed
forward + backward (training) and forward alone (inference), median of ``--reps`` after a warm-up, per arm:

    flash                 SDPA's flash kernel, dense: the reference every ratio divides
    favor                 plain FAVOR+ (``favor_attention``, the model's default projection width 256)
    favor, compiled       the same function under ``torch.compile`` (what fusing its elementwise work gains)
    hybrid                the converter's bidirectional hybrid preset (``exact_max_length`` off); its profile
                          splits the device time into FlexAttention's kernels, matrix products and the rest
    flex: hybrid mask     FlexAttention alone over the hybrid's own block mask (captured from the call above)
    flex: same tiles, no mask_mod / as full tiles   the same tiles with a trivial ``mask_mod``, and as full tiles
                          (no ``mask_mod`` at all): what the mask's per-score lookups cost, and the tiles' floor
    flex: dense           FlexAttention with no block mask (its efficiency against flash at this head size)
    hybrid, tile routing  window 257, 1 global, 4 blocks of 128 keys per 128 queries: a support cut to the tiles
                          (the first H200 run, before full tiles)
    hybrid, tiled         model_speed.py's tiled support (window 257, 16 blocks of 64 keys per 128 queries), whose
                          filled tiles FlexAttention reads whole; eager and compiled
    hybrid, compiled      the hybrid under ``torch.compile``, as the model runs it on CUDA: traced, the default's
                          fine routing takes the PyTorch backend (each query block's candidates gathered), the tiled
                          support FlexAttention's (``hybrid_backends._traced_backend``)
    compiled: far field   the default's polynomial far field alone (its state over all keys, applied to every
                          query), compiled: its share of the compiled hybrid
    compiled: routing     the default's routing alone (each query block's key blocks), compiled; it has no
                          backward, so its training time is its forward's. On CUDA in its Triton kernel
                          (``hybrid_routing_triton``); ``... in PyTorch``: through PyTorch's steps, as before it
    causal favor          causal FAVOR+ (the decoder's; its scan also serves the decoder default's far field), against
                          ``flash, causal``; then its Triton scan's launch settings varied (``favor_exp_triton``'s
                          segments per walk, features per walk's program, features per step of a chunk's
                          program): which the GPU prefers

``--arms`` runs the named arms only (flash always: every ratio divides its time), e.g. the compiled ones at 32K.
``--head-dim 64`` takes the decoder's (GPT-2's) head size, whose 65 value columns the kernels pad to 128.

Random inputs route to random blocks, so the hybrid's mask is at least as dense as on text (routing_granularity.py
measures the real MiniLM's). Each row is logged as it is measured (a run cut short keeps what it printed). On a CPU
(forward only, float32) only flash, FAVOR+ and the hybrid run: the rest are questions about the GPU.

    python benchmarks/attention_parts.py --device cuda --lengths 8192 32768 --out-dir benchmarks/results/...
    python benchmarks/attention_parts.py --device cuda --lengths 32768 --head-dim 64 --arms "causal favor" \
        "causal favor, short segments" "causal favor, long segments" "causal favor, 32 features per program"
    python benchmarks/attention_parts.py --quick    # smoke test on the CPU: inference at 512 tokens
"""

from __future__ import annotations

import functools
import json
import logging
import statistics
import time

import harness
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from performer_hf.favor import HybridSpec, draw_projection, favor_attention, hybrid_attention
from performer_hf.modeling import favor_exp_triton, hybrid_flex, hybrid_routing
from performer_hf.modeling.attention_methods import ATTENTION_METHODS
from performer_hf.modeling.far_field_polynomial import quadratic_apply, quadratic_state
from performer_hf.modeling.favor_hybrid import _prepare
from performer_hf.modeling.hybrid_selection import ExtraKeys, Selection

logger = logging.getLogger("benchmarks.attention_parts")

HEADS, HEAD_DIM, FEATURES = 12, 32, 256  # the encoder's (MiniLM's) head size by default


def hybrid_preset(**changes) -> HybridSpec:
    """The converter's bidirectional hybrid preset as a spec (its exact dispatch aside), with ``changes``."""
    preset = ATTENTION_METHODS["hybrid"].presets["bidirectional"]
    names = {field: name for name, field in HybridSpec.config_fields().items()}
    settings = {names[field]: value for field, value in preset.items() if field in names}
    return HybridSpec(**{**settings, **changes})


# favor_exp_triton's launch settings tried on the causal scan (read at each call; each compiles its kernels anew)
SCAN_SETTINGS = {
    "causal favor, short segments": dict(TARGET_PROGRAMS=4096, MIN_SEGMENT=128),
    "causal favor, long segments": dict(TARGET_PROGRAMS=256, MIN_SEGMENT=2048),
    "causal favor, 32 features per program": dict(FEATURES_PER_PROGRAM=32),
    "causal favor, 128 features per program": dict(FEATURES_PER_PROGRAM=128),
    "causal favor, chunks over 32 features a step": dict(SUM_FEATURES=32),
}
TILE_ROUTING = dict(local_window=257, query_block_size=128, route_group_size=0, routed_blocks=4, route_block_size=128)
TILED = dict(local_window=257, query_block_size=128, route_group_size=0, routed_blocks=16, route_block_size=64)


class MaskCapture:
    """Keeps the last ``BlockMask`` that ``hybrid_flex.support_mask`` built (patched while active)."""

    def __enter__(self):
        self.original, self.mask = hybrid_flex.support_mask, None

        def capture(selection, *args):
            self.mask = self.original(selection, *args)
            return self.mask

        hybrid_flex.support_mask = capture
        return self

    def __exit__(self, *exc):
        hybrid_flex.support_mask = self.original


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(call, inputs, train: bool, reps: int, device: str) -> float:
    """Median seconds of ``call(*inputs)`` (forward + backward when ``train``), after one warm-up call."""

    def once():
        if train:
            out = call(*inputs)
            out.backward(torch.ones_like(out))
        else:
            with torch.no_grad():
                call(*inputs)

    once()
    times = []
    for _ in range(reps):
        _synchronize(device)
        start = time.perf_counter()
        once()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_split(call, inputs) -> dict[str, float]:
    """One forward + backward under the profiler: device milliseconds in FlexAttention's kernels, in matrix
    products and in everything else, and the kernel launches."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = call(*inputs)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    split = {"flex_ms": 0.0, "matmul_ms": 0.0, "other_ms": 0.0, "launches": 0}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.lower()
        part = "flex_ms" if "flex" in name else "matmul_ms" if any(w in name for w in ("gemm", "gemv")) else "other_ms"
        split[part] += event.device_time_total / 1e3
        split["launches"] += 1
    return split


def arms(device: str, length: int, inputs, projection):
    """(name, call, split) for every arm; flex-only arms need the hybrid's captured mask."""
    spec = hybrid_preset()
    capture = MaskCapture()

    def flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v)

    def favor(q, k, v):
        return favor_attention(q, k, v, projection)

    def hybrid(q, k, v):
        with capture:
            return hybrid_attention(q, k, v, spec=spec, projection=projection)

    def hybrid_uncaptured(q, k, v):
        return hybrid_attention(q, k, v, spec=spec, projection=projection)

    def tile_routing(q, k, v):
        return hybrid_attention(q, k, v, spec=hybrid_preset(**TILE_ROUTING), projection=projection)

    def tiled(q, k, v):
        return hybrid_attention(q, k, v, spec=hybrid_preset(**TILED), projection=projection)

    def flash_causal(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION if device == "cuda" else SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    yield "flash", flash, False
    yield "flash, causal", flash_causal, False
    yield "favor", favor, False
    yield "causal favor", functools.partial(favor_attention, projection=projection, causal=True), False
    yield "hybrid", hybrid, device == "cuda"
    if device == "cuda" and capture.mask is not None:
        yield from flex_arms(capture.mask)
    if device != "cuda":  # the CPU smoke run: the arms above (each other support compiles its CPU kernel anew)
        return
    yield "hybrid, tile routing", tile_routing, True
    yield "hybrid, tiled", tiled, True
    yield "favor, compiled", torch.compile(favor), False
    yield "hybrid, compiled", torch.compile(hybrid_uncaptured), False
    yield "hybrid, tiled, compiled", torch.compile(tiled), False
    yield "compiled: far field", torch.compile(far_field_part), False
    yield "compiled: routing", torch.compile(functools.partial(routing_part, spec=spec)), False
    in_pytorch = functools.partial(routing_in_pytorch, torch.compile(routing_part), spec)
    yield "compiled: routing in PyTorch", in_pytorch, False
    for name, settings in SCAN_SETTINGS.items():
        yield name, functools.partial(causal_favor_with, settings, projection), False


def causal_favor_with(settings: dict, projection, q, k, v):
    """Causal FAVOR+ with ``favor_exp_triton``'s module settings ``settings`` for this call."""
    saved = {name: getattr(favor_exp_triton, name) for name in settings}
    for name, value in settings.items():
        setattr(favor_exp_triton, name, value)
    try:
        return favor_attention(q, k, v, projection, causal=True)
    finally:
        for name, value in saved.items():
            setattr(favor_exp_triton, name, value)


def far_field_part(q, k, v):
    """The polynomial far field of ``poly2`` (``1 + t + t^2 / 4``, the default's) over all keys, in float32 as the
    hybrid runs it: its state from the keys and values, applied to every query. -> (B, H, L, dv + 1)"""
    values1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).float()
    scale = q.shape[-1] ** -0.5
    return quadratic_apply(q.float() * scale, quadratic_state(k.float() * scale, values1, 0.25))


def routing_part(q, k, v, spec: HybridSpec):
    """Each query block's routed key blocks (what the hybrid computes before its exact part) as a number that a
    training step can call backward on (routing has no gradient)."""
    options = dict.fromkeys(
        ("scaling", "key_padding_mask", "query_center", "key_center", "far_field_parameter", "far_field_gain")
    )
    call = _prepare(q, k, v, None, spec, False, options)
    chosen, _ = Selection(call.x, call.keys, ExtraKeys(None, None), spec, False, 0, with_feats=False).routes
    return chosen.float().mean() + 0 * q.float().mean()


def _never(*args) -> bool:
    return False


def routing_in_pytorch(routing, spec: HybridSpec, q, k, v):
    """``routing`` (:func:`routing_part`, compiled) through routing's PyTorch steps, not its Triton kernel."""
    kernel_serves, hybrid_routing.kernel_serves = hybrid_routing.kernel_serves, _never
    try:
        return routing(q, k, v, spec)
    finally:
        hybrid_routing.kernel_serves = kernel_serves


def flex_arms(mask):
    """FlexAttention alone over the hybrid's mask, its tiles without the per-score mask, and dense."""
    from torch.nn.attention.flex_attention import BlockMask

    def everything(b, h, q_idx, kv_idx):
        return q_idx >= 0

    tiles = (mask.kv_num_blocks, mask.kv_indices)
    seq = mask.seq_lengths
    plain = BlockMask.from_kv_blocks(*tiles, BLOCK_SIZE=hybrid_flex.TILE, mask_mod=everything, seq_lengths=seq)
    none = torch.zeros_like(mask.kv_num_blocks)
    full = BlockMask.from_kv_blocks(
        none, mask.kv_indices, *tiles, BLOCK_SIZE=hybrid_flex.TILE, mask_mod=everything, seq_lengths=seq
    )
    for name, block_mask in (
        ("flex: hybrid mask", mask),
        ("flex: same tiles, no mask_mod", plain),
        ("flex: same tiles, full", full),
        ("flex: dense", None),
    ):

        def call(q, k, v, block_mask=block_mask):
            return hybrid_flex.flex_attend(q * q.shape[-1] ** -0.5, k, v, block_mask)[0]

        yield name, call, False


def measure(args) -> dict:
    modes = ("train", "inference") if args.device == "cuda" else ("inference",)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    rows = []
    for length in args.lengths:
        generator = torch.Generator().manual_seed(0)
        shape = (1, HEADS, length, args.head_dim)
        tensors = [torch.randn(shape, generator=generator).to(args.device, dtype) for _ in range(3)]
        projection = draw_projection(FEATURES, args.head_dim, generator=generator).to(args.device)
        flash_times = {}
        for name, call, split in arms(args.device, length, tensors, projection):
            if args.arms and name not in args.arms and not name.startswith("flash"):
                continue
            reference = name if name.startswith("flash") else "flash, causal" if name.startswith("causal") else "flash"
            row = {"length": length, "arm": name}
            try:
                for mode in modes:
                    inputs = [t.detach().requires_grad_(mode == "train") for t in tensors]
                    row[mode] = timed(call, inputs, mode == "train", args.reps, args.device)
                    if name.startswith("flash"):
                        flash_times[name, mode] = row[mode]
                    row[f"{mode}_vs_flash"] = flash_times[reference, mode] / row[mode]
                if split:
                    row.update(device_split(call, [t.detach().requires_grad_() for t in tensors]))
            except Exception as error:  # an arm that fails (memory, compilation) is reported, the rest go on
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            logger.info("%s", json.dumps(row))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    settings = {"device": device, "torch": torch.__version__, "dtype": str(dtype), "head_dim": args.head_dim}
    return {**settings, "modes": list(modes), "rows": rows}


def markdown(result: dict) -> str:
    modes = result.get("modes", ["train", "inference"])
    names = {"train": "forward + backward", "inference": "forward"}
    lines = [
        f"# One attention call's parts on {result['device']} (torch {result['torch']})",
        "",
        f"One call of (1 x {HEADS} heads x L x {result.get('head_dim', HEAD_DIM)}), {result.get('dtype', 'bfloat16')}, "
        "random inputs; median milliseconds; ratio = flash's time / the arm's (above 1: faster than flash; causal "
        "arms against causal flash). The "
        "hybrid rows' device time, forward + backward: FlexAttention's kernels, matrix products, the rest (kernel "
        "launches).",
        "",
        "| L | arm | " + " | ".join(f"{names[m]} ms | vs flash" for m in modes) + " | flex / matmul / other ms |",
        "|---|---|" + "---|---|" * len(modes) + "---|",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"| {row['length']} | {row['arm']} | {row['error'][:80]} |" + " |" * (2 * len(modes)))
            continue
        cells = [f"{row[m] * 1e3:.2f} | {row[f'{m}_vs_flash']:.2f}x" for m in modes]
        split = (
            f"{row['flex_ms']:.1f} / {row['matmul_ms']:.1f} / {row['other_ms']:.1f} ({row['launches']})"
            if "flex_ms" in row
            else ""
        )
        lines.append(f"| {row['length']} | {row['arm']} | " + " | ".join(cells) + f" | {split} |")
    return "\n".join(lines) + "\n"


def plot(result: dict):
    plt = harness.pyplot()
    from matplotlib.ticker import NullFormatter

    mode = result.get("modes", ["train"])[0]
    lengths = sorted({row["length"] for row in result["rows"]})
    figure, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4), squeeze=False)
    for axis, length in zip(axes[0], lengths, strict=True):
        rows = [r for r in result["rows"] if r["length"] == length and "error" not in r]
        axis.barh([r["arm"] for r in rows], [r[f"{mode}_vs_flash"] for r in rows])
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(NullFormatter())
        axis.set_title(f"L = {length}: flash / arm ({mode})")
        axis.invert_yaxis()
    return figure


def main(argv=None) -> dict:
    parser = harness.parser(__doc__, quick="512 tokens, one run per arm", quick_flags={"lengths": [512], "reps": 1})
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--lengths", nargs="+", type=harness.at_least(1), default=[8192, 32768])
    parser.add_argument("--reps", type=harness.at_least(1), default=5)
    parser.add_argument("--arms", nargs="+", help="only these arms (and flash), by their names in the table")
    parser.add_argument(
        "--head-dim", type=harness.at_least(1), default=HEAD_DIM, help="32: the encoder's (MiniLM); 64: GPT-2's"
    )
    return harness.main("attention_parts", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
