"""The backends of hybrid attention: who computes the far field's state and the support sums (the exact part, the
far field's complement and their merge), behind one signature, and :func:`choose_backend`, the one place that picks.

- :data:`PYTORCH`: every setting, on every device; slab by slab over the query blocks, each slab recomputed in
  backward (:func:`.recomputed`), so that training keeps no slab's temporaries. It is the reference the others
  are tested against.
- :class:`CompiledCpuBackend`: the C++ kernels of :mod:`.hybrid_compiled` (forward and backward) for bidirectional
  attention with a polynomial far field on the CPU.
- :class:`TritonBackend`: the Triton kernels of :mod:`.hybrid_triton` (forward and backward, the CPU kernels'
  contract) for bidirectional attention with a polynomial far field on CUDA devices, eager or compiled;
- :class:`.FlexBackend`: FlexAttention (:mod:`.hybrid_flex`, compiled Triton kernels) on CUDA devices, for causal
  calls and the bidirectional calls the Triton kernels do not take.

A backend that cannot serve a setting says why once in the log, and the PyTorch backend serves it.
"""

from __future__ import annotations

import functools
import logging

import torch

from .cpu_kernels import hybrid_kernels, kernels_enabled
from .far_field_polynomial import POLYNOMIAL
from .far_field_triton import float32_precision
from .hybrid_compiled import compiled_polynomial, fused_sums, support_inputs
from .hybrid_exact import CandidateSet, exact_logits, exact_sums, merge
from .hybrid_far_field import FarQueries
from .hybrid_flex import TILE, FlexBackend, flex_available, flex_enabled
from .hybrid_keys import HybridCall
from .hybrid_selection import Selection
from .hybrid_triton import serves as triton_serves
from .hybrid_triton import support_sums as triton_support_sums
from .slabs import recomputed

logger = logging.getLogger(__name__)

Tensor = torch.Tensor


def _slab_sums(xq: Tensor, far: FarQueries, sets: list[CandidateSet], quadratic: float | None) -> Tensor:
    """The merged sums of a slab of query blocks xq (B, H, n, bq, d): the exact part on each query's support and
    the far field over the rest, under one shift. -> (B, H, n, bq, dv + 1)"""
    logits = exact_logits(xq, sets)
    return merge(exact_sums(logits, sets), far.complement(logits, sets, quadratic))


class TorchBackend:
    """Hybrid attention in PyTorch: any device, dtype and setting."""

    polynomial = POLYNOMIAL  # the polynomial far field's (state, apply)

    def support_sums(self, selection: Selection, far: FarQueries, quadratic: float | None) -> Tensor:
        """Numerator|denominator (B, H, L, dv + 1) of hybrid attention, relative to a per-query shift."""
        blocking = selection.blocking
        if not selection.nb_candidates:
            return far.complement([], [], quadratic).sums
        sets_by_slab = selection.candidate_sets()
        slabs = zip(blocking.blocked(selection.x), far.split(blocking.blocked), sets_by_slab, strict=True)
        return blocking.unblocked([recomputed(_slab_sums, xq, far_s, sets, quadratic) for xq, far_s, sets in slabs])


class CompiledCpuBackend:
    """Bidirectional hybrid attention with a polynomial far field in the compiled CPU kernels."""

    def __init__(self, kernels):
        self.kernels = kernels
        self.polynomial = compiled_polynomial(kernels)

    def support_sums(self, selection: Selection, far: FarQueries, quadratic: float) -> Tensor:
        return fused_sums(self.kernels, selection, far, quadratic)


class TritonBackend:
    """Bidirectional hybrid attention with a polynomial far field in the Triton kernels (CUDA), their matrix products
    in ``precision`` (:func:`.far_field_triton.float32_precision`), the far field's too where its kernels serve."""

    def __init__(self, precision: str):
        self.precision = precision
        state, apply = POLYNOMIAL
        self.polynomial = (functools.partial(state, precision=precision), functools.partial(apply, precision=precision))

    def support_sums(self, selection: Selection, far: FarQueries, quadratic: float) -> Tensor:
        tensors, geometry = support_inputs(selection, far)
        return triton_support_sums(*tensors, _routes(selection), geometry, quadratic, self.precision)


def _routes(selection: Selection) -> Tensor:
    """(B, H, N, t) the routed key blocks of each of the N = ceil(L / query_block_size) query blocks, -1 for none."""
    B, H, L = selection.x.shape[:3]
    N = -(-L // selection.spec.query_block_size)
    if not selection.spec.routed_blocks:
        return torch.empty(B, H, N, 0, dtype=torch.int32, device=selection.x.device)
    chosen, real = selection.routes  # (B, H, blocks padded to the routing period, t)
    return torch.where(real, chosen, -1)[:, :, :N]


PYTORCH = TorchBackend()
_EXPLAINED: set[str] = set()


def _served_by_pytorch(reason: str, instead_of: str = "the compiled CPU kernels") -> TorchBackend:
    if reason not in _EXPLAINED:
        _EXPLAINED.add(reason)
        logger.info("Hybrid attention runs in PyTorch, not in %s: %s.", instead_of, reason)
    return PYTORCH


def _triton_backend(call: HybridCall, causal: bool) -> TritonBackend | None:
    """The Triton kernels for a bidirectional call with a polynomial far field that they serve, else None."""
    if causal or call.ctx.far.quadratic is None:
        return None
    if not triton_serves(call.x, call.keys.values1.shape[-1], call.spec.query_block_size):
        return None
    return TritonBackend(float32_precision(call.k.dtype))


def _cuda_backend(call: HybridCall, causal: bool) -> TorchBackend | TritonBackend | FlexBackend:
    """Bidirectional calls with a polynomial far field: the Triton kernels where they serve the call
    (``PERFORMER_HF_TRITON=0`` turns them off). Else FlexAttention where it serves the call (``PERFORMER_HF_FLEX=0``
    turns it off), else PyTorch."""
    spec, flex = call.spec, "FlexAttention"
    triton = _triton_backend(call, causal)
    if triton is not None:
        return triton
    if not flex_enabled():
        return PYTORCH
    if not flex_available():
        return _served_by_pytorch("it needs torch >= 2.9 with Triton", flex)
    if not causal and call.ctx.far.quadratic is None:
        return _served_by_pytorch(f"it serves the polynomial far fields, not far_field={call.ctx.far.name!r}", flex)
    if call.k.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return _served_by_pytorch(f"it serves float32, bfloat16 and float16 models, not {call.k.dtype}", flex)
    if TILE % spec.query_block_size or TILE % spec.route_block_size:
        return _served_by_pytorch(f"its query and key blocks must divide {TILE}", flex)
    return FlexBackend((call.ctx.a, call.ctx.c), call.k.dtype, key_padding=call.key_padding)


def _traced_backend(call: HybridCall, causal: bool) -> TorchBackend | TritonBackend | FlexBackend:
    """The backend traced into a compiled graph: PyTorch (the CPU kernels are opaque to tracing), or on CUDA the
    Triton kernels (custom operators: one graph), or FlexAttention where its ``mask_mod`` looks little up: supports
    without routed blocks (a window and global keys: it compares positions) or routed per tile of queries
    (``query_block_size`` = ``TILE``: the blocks a query tile routes fill key tiles, which it reads whole). Finer
    routing, the default's, looks up a bit per score, which costs more than the PyTorch backend's gathers of each
    query block's few candidates: on an H200 at 32K tokens, FlexAttention over the default's mask took 81 ms forward
    and backward, the whole call compiled through PyTorch 39 ms (``benchmarks/results/attention_parts_h200``)."""
    if call.x.device.type != "cuda":
        return PYTORCH
    triton = _triton_backend(call, causal)
    if triton is not None:
        return triton
    if call.spec.routed_blocks and call.spec.query_block_size != TILE:
        return PYTORCH  # (before _cuda_backend, which may log why: a graph break)
    return _cuda_backend(call, causal)


def choose_backend(call: HybridCall, causal: bool) -> TorchBackend | CompiledCpuBackend | TritonBackend | FlexBackend:
    """The backend for a call: by its device, dtype and direction, and the settings (the far field, the value
    width, the length). On a CPU the compiled kernels, on CUDA the Triton
    kernels or FlexAttention, when they serve the call; else PyTorch. Traced (compiled), see :func:`_traced_backend`."""
    x, far = call.x, call.ctx.far
    if torch.compiler.is_compiling():  # traced into the caller's graph (device_compile, torch.export)
        return _traced_backend(call, causal)
    if x.device.type == "cuda":
        return _cuda_backend(call, causal)
    if x.device.type != "cpu" or not kernels_enabled():
        return PYTORCH
    if causal:
        return _served_by_pytorch("the compiled kernels are bidirectional only")
    if far.quadratic is None:
        return _served_by_pytorch(f"they serve the polynomial far fields, not far_field={far.name!r}")
    if x.dtype not in (torch.float32, torch.float64) or x.shape[2] >= 1 << 24:
        return _served_by_pytorch("they serve float32 / float64 inputs of fewer than 2^24 positions")
    kernels = hybrid_kernels()  # None (after one warning) where the build failed
    if kernels is None:
        return PYTORCH
    if call.keys.values1.shape[-1] > kernels.max_value_width:
        return _served_by_pytorch(f"value heads wider than {kernels.max_value_width - 1}")
    return CompiledCpuBackend(kernels)
