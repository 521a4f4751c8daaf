"""The memory traffic of the attention calls that CUDA runs compiled, counted on a CPU.

On a GPU the compiled attention calls (``device_compile``) are bound by memory traffic and kernel launches, not
arithmetic: on an H200 the whole compiled hybrid call took 39 ms forward and backward at 32K tokens
(``results/attention_parts_h200``). Without a GPU, inductor's own account of the graph it generates says where that
traffic goes: each attention call of the encoder's shape (1 x 12 heads x L x 32, bfloat16) is compiled here by
inductor for the CPU, as CUDA traces it (the accelerators' slab budgets, and the forms their code takes), and run
forward and backward; inductor counts the bytes every generated kernel and matrix product reads and writes
(``num_bytes_accessed``, its ``inductor_metrics`` log) and the kernels it generates.

Arms:

    favor                  plain FAVOR+ (256 features) as CUDA runs it: its sums in the Triton kernels
                           (``favor_exp_triton``; opaque operators: their inputs and outputs count)
    favor, PyTorch         the same in PyTorch (``favor_exp._BidirectionalExp``)
    hybrid, Triton         the default bidirectional hybrid (``hybrid_attention``, the converter's preset) as CUDA
                           runs it: its support sums (the exact part and the far field's share there) and its far
                           field in Triton kernels (``hybrid_triton``, ``far_field_triton``; opaque operators: their
                           inputs and outputs count, not what they re-read)
    hybrid                 the same with its support sums in PyTorch (the candidates gathered), its far field in the
                           Triton kernels
    hybrid, PyTorch far field  the same with the far field in PyTorch (explicit features)
    far field              its polynomial far field alone (``attention_parts.far_field_part``): the state over all
                           keys, applied to every query, in the Triton kernels (opaque operators: their inputs and
                           outputs count)
    far field, PyTorch     the same in PyTorch, explicit features (``far_field_polynomial.from_features``)
    far field, CPU form    the same in PyTorch as on a CPU (outer products)
    routing                its routing alone (each query block's key blocks)
    causal favor           causal FAVOR+ (256 features) as CUDA runs it: its scan in the Triton kernels
                           (``favor_exp_triton``; opaque operators: their inputs and outputs count)
    causal favor, PyTorch scan  the same with the PyTorch scan (``favor_exp._CausalExp``)
    causal hybrid          the converter's causal preset (a window of 64, a global token, a FAVOR++ far field lagged
                           past the window, fixed centres), its far field's scan in the Triton kernels; traced on a
                           CPU its exact part gathers each query block's candidates in PyTorch (on CUDA:
                           FlexAttention over the window's tiles)
    causal hybrid, PyTorch scan  the same with the PyTorch scan

Without CUDA the Triton kernels run in Triton's interpreter (set here): most of the study's time, which is about
15 minutes at 4K tokens on two CPU cores. The count grows linearly with the length (at 4K and 8K: twice as many bytes
for every arm, the same kernels).

Caveats: inductor's CPU code generation fuses as its GPU one mostly does, not always (a concatenation of many slices,
for one, stays many kernels on the CPU); and the count leaves out what a kernel re-reads from cache. Bytes are a
proxy for a GPU's time, for comparing forms of one computation, not a timing.

    python benchmarks/compiled_traffic.py                     # 4K tokens, about 15 minutes
    python benchmarks/compiled_traffic.py --quick             # smoke test: the far field at 256 tokens
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

if not torch.cuda.is_available():  # the Triton kernels in Triton's interpreter: read when they are defined, at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import harness  # noqa: E402
from attention_parts import FEATURES, HEAD_DIM, HEADS, far_field_part, hybrid_preset, routing_part  # noqa: E402

from performer_hf.favor import HybridSpec, draw_projection, favor_attention, hybrid_attention  # noqa: E402
from performer_hf.modeling import far_field_polynomial, favor_exp, hybrid_backends, slabs  # noqa: E402
from performer_hf.modeling.attention_methods import ATTENTION_METHODS  # noqa: E402
from performer_hf.modeling.far_field_triton import float32_precision  # noqa: E402

logger = logging.getLogger("benchmarks.compiled_traffic")

ARMS = (
    "favor",
    "favor, PyTorch",
    "hybrid, Triton",
    "hybrid",
    "hybrid, PyTorch far field",
    "far field",
    "far field, PyTorch",
    "far field, CPU form",
    "routing",
    "causal favor",
    "causal favor, PyTorch scan",
    "causal hybrid",
    "causal hybrid, PyTorch scan",
)
TRITON_ARMS = ("hybrid, Triton", "hybrid", "far field")  # the arms whose far field runs in the Triton kernels
SCAN_ARMS = ("favor", "causal favor", "causal hybrid")  # the arms whose FAVOR+ sums run in the Triton kernels


def causal_preset() -> HybridSpec:
    """The converter's causal hybrid preset as a spec (its exact prefix aside)."""
    preset = ATTENTION_METHODS["hybrid"].presets["causal"]
    return HybridSpec(**{name: preset[field] for name, field in HybridSpec.config_fields().items() if field in preset})


def calls(projection):
    spec, causal_spec = hybrid_preset(), causal_preset()
    centre = torch.zeros(HEADS, HEAD_DIM)  # fixed centres (calibrated at conversion): any serve here

    def causal_favor(q, k, v):
        return favor_attention(q, k, v, projection, causal=True)

    def causal_hybrid(q, k, v):
        kwargs = dict(query_center=centre, key_center=centre, far_field_parameter=-0.05)
        return hybrid_attention(q, k, v, projection, causal_spec, causal=True, **kwargs)

    return {
        "favor": lambda q, k, v: favor_attention(q, k, v, projection),
        "favor, PyTorch": lambda q, k, v: favor_attention(q, k, v, projection),
        "hybrid, Triton": lambda q, k, v: hybrid_attention(q, k, v, spec=spec),
        "hybrid": lambda q, k, v: hybrid_attention(q, k, v, spec=spec),
        "hybrid, PyTorch far field": lambda q, k, v: hybrid_attention(q, k, v, spec=spec),
        "far field": far_field_part,
        "far field, PyTorch": far_field_part,
        "far field, CPU form": far_field_part,
        "routing": lambda q, k, v: routing_part(q, k, v, spec),
        "causal favor": causal_favor,
        "causal favor, PyTorch scan": causal_favor,
        "causal hybrid": causal_hybrid,
        "causal hybrid, PyTorch scan": causal_hybrid,
    }


@contextlib.contextmanager
def as_on_cuda(arm: str):
    """The accelerators' slab budgets, far-field form (the Triton kernels for float32 rows, or PyTorch's features, or
    the CPU's outer products, by arm) and, for ``hybrid, Triton``, the Triton support sums, for tracing on a CPU."""
    kind, form, triton = slabs._kind, far_field_polynomial.from_features, far_field_polynomial.triton_serves
    traced, scan = hybrid_backends._traced_backend, favor_exp.triton_serves
    slabs._kind = lambda device: "accelerator"
    far_field_polynomial.from_features = lambda device: arm != "far field, CPU form"
    far_field_polynomial.triton_serves = lambda x, width: arm in TRITON_ARMS and x.dtype == torch.float32
    favor_exp.triton_serves = lambda q, *features: arm in SCAN_ARMS and q.dtype == torch.float32
    if arm == "hybrid, Triton":
        precision = float32_precision(torch.bfloat16)
        hybrid_backends._traced_backend = lambda call, causal: hybrid_backends.TritonBackend(precision)
    try:
        yield
    finally:
        slabs._kind, far_field_polynomial.from_features, far_field_polynomial.triton_serves = kind, form, triton
        hybrid_backends._traced_backend, favor_exp.triton_serves = traced, scan


def traffic(call, length: int, arm: str) -> dict:
    """Compile ``call`` with inductor (static shapes), run it forward and backward once on (1, 12, length, 32)
    bfloat16 inputs: inductor's bytes read and written and its kernels, every graph (forward, backward) together."""
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics

    generator = torch.Generator().manual_seed(length)
    inputs = [
        torch.randn(1, HEADS, length, HEAD_DIM, generator=generator, dtype=torch.bfloat16).requires_grad_()
        for _ in range(3)
    ]
    torch._dynamo.reset()
    metrics.reset()
    start = time.perf_counter()
    with as_on_cuda(arm), inductor_config.patch(fx_graph_cache=False):
        out = torch.compile(call, dynamic=False)(*inputs)
        out.backward(torch.ones_like(out))
    return {
        "gigabytes": metrics.num_bytes_accessed / 1e9,
        "kernels": metrics.generated_kernel_count,
        "seconds": time.perf_counter() - start,
    }


def _count_bytes():
    """Have inductor count each graph's bytes (it does while its ``inductor_metrics`` log is on), without printing
    that log."""
    from torch._inductor import compile_fx

    torch._logging.set_logs(inductor_metrics=True)
    compile_fx.inductor_metrics_log.propagate = False


def measure(args) -> dict:
    _count_bytes()
    projection = draw_projection(FEATURES, HEAD_DIM, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    arm_calls = calls(projection)
    rows = []
    for length in args.lengths:
        for arm in args.arms:
            row = {"length": length, "arm": arm, **traffic(arm_calls[arm], length, arm)}
            logger.info("%s at %d: %.3f GB, %d kernels", arm, length, row["gigabytes"], row["kernels"])
            rows.append(row)
    return {"torch": torch.__version__, "rows": rows}


def markdown(result: dict) -> str:
    lengths = sorted({row["length"] for row in result["rows"]})
    arms = list(dict.fromkeys(row["arm"] for row in result["rows"]))
    by = {(row["arm"], row["length"]): row for row in result["rows"]}
    lines = [
        f"# Memory traffic of the compiled attention calls (inductor's count on a CPU, torch {result['torch']})",
        "",
        f"One call of the encoder's shape (1 x {HEADS} heads x L x {HEAD_DIM}, bfloat16), forward and backward, "
        "compiled as CUDA traces it: gigabytes its generated kernels and matrix products read and write, and its "
        "kernels. A proxy for a GPU's time, not a timing (see the study's docstring).",
        "",
        "| arm | " + " | ".join(f"GB at {n} | kernels at {n}" for n in lengths) + " |",
        "|---|" + "---|---|" * len(lengths),
    ]
    for arm in arms:
        cells = [
            f"{by[arm, n]['gigabytes']:.2f} | {by[arm, n]['kernels']}" if (arm, n) in by else "- | -" for n in lengths
        ]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict):
    plt = harness.pyplot()
    lengths = sorted({row["length"] for row in result["rows"]})
    arms = list(dict.fromkeys(row["arm"] for row in result["rows"]))
    figure, axis = plt.subplots(figsize=(7, 4))
    for arm in arms:
        rows = sorted((r for r in result["rows"] if r["arm"] == arm), key=lambda r: r["length"])
        axis.plot([r["length"] for r in rows], [r["gigabytes"] for r in rows], marker="o", label=arm)
    axis.set_xscale("log", base=2)
    axis.set_xticks(lengths, [str(n) for n in lengths])
    axis.set_xlabel("tokens")
    axis.set_ylabel("GB read and written (forward + backward)")
    axis.set_title("Compiled attention calls: inductor's byte count")
    axis.legend()
    return figure


def main(argv=None) -> dict:
    parser = harness.parser(
        __doc__,
        quick="the far field in PyTorch at 256 tokens",
        quick_flags={"lengths": [256], "arms": ["far field, PyTorch"]},  # (the Triton kernels: their tests)
    )
    parser.add_argument("--lengths", nargs="+", type=harness.at_least(1), default=[4096])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    return harness.main("compiled_traffic", parser, measure, markdown, plot, argv=argv)


if __name__ == "__main__":
    main()
