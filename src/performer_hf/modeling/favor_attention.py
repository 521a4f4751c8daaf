"""FAVOR+ attention: bidirectional and causal linear attention with random features.

Shapes follow the HF convention ``(batch, heads, seq, head_dim)``; ``m`` is the feature width.
All arithmetic is done in float32 (float64 for float64 inputs) and the output is cast back
to the input dtype.

Numerical safety without leaking the future:
- query features are shifted by their own row max (a per-query constant: cancels exactly);
- key features are shifted by ``s_j``, the running max of the key log-features over
  positions ``<= j``. Query ``i`` sees every key ``j <= i`` rescaled to the common shift
  ``s_i`` through the factor ``exp(s_j - s_i) <= 1`` (the online-softmax trick), so no
  position after ``i`` influences output ``i``, not even through a stabilizer;
- bidirectional attention uses one shift per (batch, head): the max over all real keys.
Shifts are constants for autograd (``detach``): they cancel in the attention ratio.

The causal prefix sums run chunk by chunk: exact masked products inside a chunk and a
running ``(m, d + 1)`` state across chunks. Nothing of size ``L x m x d`` is ever stored.

Speed and memory: for the exponential kernels (``softmax``, ``softmax_hyperbolic``: features
``exp(w.x - |x|^2 / 2)``) both directions run as autograd functions (:class:`_BidirectionalExp`,
:class:`_CausalExp`) that walk the sequence a slab of positions at a time and keep for backward
only the inputs, the chunk start states and the shifts; backward recomputes the features slab
by slab and runs the chunk scan in reverse. On CPU, elementwise passes over fresh ``(L, m)``
buffers (a page fault per 4 KiB of every new large allocation), not the matmuls, dominated
the time of the plain autograd version. The other kernels (relu, elu, softmax_trig) take that
plain autograd path, which computes the same quantities.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .causal_scan import EMPTY_SHIFT, causal_scan
from .favor_features import get_feature_map
from .slabs import max_slab_chunks, slab_elements

Tensor = torch.Tensor
ShiftFn = Callable[[Tensor], Tensor]

# Positions per causal chunk. Chosen from benchmarks/speed.py measurements (2-core CPU, fp32,
# 8 heads, head_dim 64, m = 256): the intra-chunk product costs C * m per position and the
# chunk state m * (d + 1), and smaller chunks mean more, smaller matmuls.
DEFAULT_CHUNK_SIZE = 128


class FavorState(NamedTuple):
    """Recurrent state of causal FAVOR+ after a prefix of the sequence.

    Attributes:
        kv: ``(B, H, m, d + 1)``: ``sum_j phi(k_j) [v_j, 1]^T``, expressed relative to ``shift``;
            the last column is the normaliser ``sum_j phi(k_j)``.
        shift: ``(B, H)``: the running max of the key log-features (``-1e30`` when empty).
    """

    kv: Tensor
    shift: Tensor


# --------------------------------------------------------------------------------------------
# Shifts: detached functions of the log-features (..., L, m) -> a tensor broadcastable to them.


def _row_shift(log_features: Tensor) -> Tensor:
    """Per-row max (queries): (B, H, L, m) -> (B, H, L, 1)."""
    return log_features.amax(dim=-1, keepdim=True)


def _global_shift(log_features: Tensor) -> Tensor:
    """One max over all real keys per (batch, head): (B, H, L, m) -> (B, H, 1, 1); 0 if none."""
    shift = log_features.amax(dim=(-2, -1), keepdim=True)
    return torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))


def _running_shift(prev_shift: Tensor) -> ShiftFn:
    """Running max over positions <= j, continuing from ``prev_shift`` (B, H): -> (B, H, L, 1)."""

    def shift_of(log_features: Tensor) -> Tensor:
        row_max = log_features.amax(dim=-1).nan_to_num(neginf=EMPTY_SHIFT)  # (B, H, L)
        row_max = row_max.maximum(prev_shift.unsqueeze(-1))
        return torch.cummax(row_max, dim=-1).values.unsqueeze(-1)

    return shift_of


# --------------------------------------------------------------------------------------------
# Features


def _softmax_directions(projection: Tensor) -> Tensor:
    return projection  # exp(w.x - |x|^2 / 2) / sqrt(m)


def _hyperbolic_directions(projection: Tensor) -> Tensor:
    return torch.cat([projection, -projection], dim=0)  # [exp(w.x), exp(-w.x)] ... / sqrt(2m)


# Kernels whose features are exp(x P^T - |x|^2 / 2) / sqrt(rows of P), by the rows P they use.
# They must agree with favor_features (the tests compare against the registry's references).
EXP_KERNEL_DIRECTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "softmax": _softmax_directions,
    "softmax_hyperbolic": _hyperbolic_directions,
}


def _exp_log_features(x: Tensor, directions: Tensor, keep: Tensor | None, bias=None, row=None) -> Tensor:
    """log phi(x) = x D^T + bias - |x|^2 / 2 + row - log sqrt(m'): (B, H, S, d) -> (B, H, S, m'), -inf where not
    kept. ``directions`` D: (m', d) or per head (.., H, m', d); ``bias``: (.., H, 1, m') or None; ``row``: (B, H, S, 1)
    or None."""
    log_phi = x @ directions.transpose(-2, -1)
    if bias is not None:
        log_phi.add_(bias)
    per_row = 0.5 * x.pow(2).sum(dim=-1, keepdim=True) + 0.5 * math.log(directions.shape[-2])
    log_phi.sub_(per_row if row is None else per_row - row)
    if keep is not None:
        log_phi.masked_fill_(~keep, float("-inf"))  # padded keys: zero features
    return log_phi


def _exp_query_features(x: Tensor, directions: Tensor, bias=None) -> tuple[Tensor, Tensor]:
    """phi(x) / max_r phi_r(x), and max_r (x D_r + bias_r): (B, H, S, d) -> ((B, H, S, m'), (B, H, S, 1)).

    The per-query terms |x|^2 / 2 and log sqrt(m') cancel in the normalised features, so only x D^T is needed;
    ``log max_r phi_r(x)`` is the returned max minus them.
    """
    log_phi = x @ directions.transpose(-2, -1)
    if bias is not None:
        log_phi.add_(bias)
    top = log_phi.amax(dim=-1, keepdim=True)
    return log_phi.sub_(top).exp_(), top


def _exp_input_grad(g: Tensor, x: Tensor, directions: Tensor) -> Tensor:
    """d loss / d x from g = d loss / d log phi: sum_r g_r (D_r - x), the shift held constant."""
    grad_x = g @ directions  # (B, H, S, d)
    return grad_x.sub_(g.sum(dim=-1, keepdim=True) * x)


def _exp_directions_grad(g: Tensor, x: Tensor, directions: Tensor) -> Tensor:
    """d loss / d D from g = d loss / d log phi: sum over positions of g_r x. -> the shape of ``directions``"""
    if directions.dim() == 2:
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return (g.transpose(-2, -1) @ x).sum_to_size(directions.shape)  # per head


def _spans(length: int, size: int) -> list[tuple[int, int]]:
    """(start, stop) ranges of ``size`` positions covering ``range(length)``."""
    return [(start, min(start + size, length)) for start in range(0, length, size)]


def _slab_size(batch_heads: int, width: int, device: torch.device, chunk: int = 1) -> int:
    """Positions per slab: one (B, H, S, m') buffer holds about the device's ``"features"`` budget of
    entries (:mod:`.slabs`), and a causal slab at most ``max_slab_chunks(device)`` chunks."""
    chunks = max(1, slab_elements(device, "features") // (batch_heads * width * chunk))
    if chunk > 1:
        chunks = min(chunks, max_slab_chunks(device))
    return chunks * chunk


class _BidirectionalExp(torch.autograd.Function):
    """Bidirectional FAVOR+ for exponential features, slab by slab over the sequence.

    Forward keeps only ``kv = phi(K)^T [V, 1]`` (m' x (dv + 1)) and its shift; backward
    recomputes the features slab by slab. Nothing of size (L, m') outlives a slab, which keeps
    every buffer small enough to be reused by the allocator (fresh large buffers cost a page
    fault per 4 KiB on CPU) and in cache.

    q: (B, H, Lq, d), k: (B, H, Lk, d), v1: (B, H, Lk, dv + 1), directions: (m', d),
    keep: (B, 1, Lk, 1) or None -> (B, H, Lq, dv + 1)
    """

    @staticmethod
    def forward(ctx, q, k, v1, directions, keep, stabilizer, slab):
        B, H, Lk, _ = k.shape
        m = directions.shape[0]
        kv = q.new_zeros(B, H, m, v1.shape[-1])
        shift = q.new_full((B, H, 1, 1), EMPTY_SHIFT)  # online max over all real keys
        for a, b in _spans(Lk, slab):
            log_phi = _exp_log_features(k[:, :, a:b], directions, None if keep is None else keep[:, :, a:b])
            new_shift = torch.maximum(shift, log_phi.amax(dim=(-2, -1), keepdim=True))
            kv.mul_(torch.exp(shift - new_shift))
            kv.add_(log_phi.sub_(new_shift).exp_().transpose(-2, -1) @ v1[:, :, a:b])
            shift = new_shift
        out1 = q.new_empty(*q.shape[:-1], v1.shape[-1])
        for a, b in _spans(q.shape[2], slab):
            phi_q, _ = _exp_query_features(q[:, :, a:b], directions)
            if stabilizer:
                phi_q.add_(stabilizer)
            out1[:, :, a:b] = phi_q @ kv
        ctx.save_for_backward(q, k, v1, directions, kv, shift)
        ctx.keep, ctx.stabilizer, ctx.slab = keep, stabilizer, slab
        return out1

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out1):
        q, k, v1, directions, kv, shift = ctx.saved_tensors
        keep, stabilizer, slab = ctx.keep, ctx.stabilizer, ctx.slab
        want_directions = ctx.needs_input_grad[3]
        grad_q, grad_k, grad_v1 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v1)
        grad_kv = torch.zeros_like(kv)
        grad_directions = torch.zeros_like(directions) if want_directions else None
        for a, b in _spans(q.shape[2], slab):
            x, g1 = q[:, :, a:b], grad_out1[:, :, a:b]
            phi, _ = _exp_query_features(x, directions)  # without the stabilizer
            g = g1 @ kv.transpose(-2, -1)  # (B, H, S, m'): d loss / d phi
            grad_kv.add_((phi + stabilizer if stabilizer else phi).transpose(-2, -1) @ g1)
            g.mul_(phi)  # d loss / d log phi
            grad_q[:, :, a:b] = _exp_input_grad(g, x, directions)
            if want_directions:
                grad_directions.add_(_exp_directions_grad(g, x, directions))
        for a, b in _spans(k.shape[2], slab):
            x, v1_slab = k[:, :, a:b], v1[:, :, a:b]
            phi = _exp_log_features(x, directions, None if keep is None else keep[:, :, a:b]).sub_(shift).exp_()
            grad_v1[:, :, a:b] = phi @ grad_kv
            g = (v1_slab @ grad_kv.transpose(-2, -1)).mul_(phi)  # d loss / d log phi
            grad_k[:, :, a:b] = _exp_input_grad(g, x, directions)
            if want_directions:
                grad_directions.add_(_exp_directions_grad(g, x, directions))
        return grad_q, grad_k, grad_v1, grad_directions, None, None, None


def _scan_weights(shifts: Tensor) -> Tensor:
    """The chunk scan of a slab as a (G + 1) x (G + 1) lower-triangular matrix per (batch, head).

    ``shifts`` (B, H, G + 1): p_0 = the shift of the state entering the slab, p_r (r >= 1) = the
    shift at the end of chunk r - 1. Entry [r, c] = exp(p_c - p_r) for c <= r (<= 1: shifts only
    grow), 0 above the diagonal. Column 0 weighs the entering state, column c >= 1 the summary
    of chunk c - 1; row r < G gives the state before chunk r, row G the state after the slab.
    """
    G1 = shifts.shape[-1]
    future = ~torch.ones(G1, G1, dtype=torch.bool, device=shifts.device).tril()
    return (shifts.unsqueeze(-2) - shifts.unsqueeze(-1)).masked_fill_(future, float("-inf")).exp_()


def _scan_forward(weights: Tensor, state: Tensor, summaries: Tensor) -> tuple[Tensor, Tensor]:
    """state (B, H, m', d + 1), summaries (B, H, G, m', d + 1) -> (start of each chunk, state after)."""
    B, H, G = summaries.shape[:3]
    flat, state_flat = summaries.view(B, H, G, -1), state.reshape(B, H, 1, -1)
    starts = (weights[:, :, :G, 1:] @ flat).addcmul_(weights[:, :, :G, :1], state_flat)
    after = (weights[:, :, G:, 1:] @ flat).addcmul_(weights[:, :, G:, :1], state_flat)
    return starts.view(summaries.shape), after.view(state.shape)


def _scan_backward(weights: Tensor, start_grads: Tensor, after_grad: Tensor) -> tuple[Tensor, Tensor]:
    """The adjoint of _scan_forward: -> (gradients of the summaries, gradient of the entering state)."""
    B, H, G = start_grads.shape[:3]
    flat, after_flat = start_grads.view(B, H, G, -1), after_grad.reshape(B, H, 1, -1)
    summary_grads = (weights[:, :, :G, 1:].transpose(-2, -1) @ flat).addcmul_(
        weights[:, :, G, 1:].unsqueeze(-1), after_flat
    )
    state_grad = (weights[:, :, :G, 0].unsqueeze(-2) @ flat).addcmul_(weights[:, :, G:, 0:1], after_flat)
    return summary_grads.view(start_grads.shape), state_grad.view(after_grad.shape)


class _CausalExp(torch.autograd.Function):
    """Chunked causal FAVOR+ for exponential features, a slab of chunks at a time.

    Features: ``phi(x) = exp(x D^T + bias - |x|^2 / 2 + row) / sqrt(m')`` with directions D (m', d) or per head
    (.., H, m', d), an optional per-feature ``bias`` (.., H, 1, m') (FAVOR++) and, for keys, an optional per-key
    ``key_row`` (B, H, L, 1) (hybrid attention's centering term). Queries are normalised by their row max.

    Inside a slab everything is batched over its chunks: exact masked (C, C) products within each
    chunk, and each chunk's start state (m' x (dv + 1), relative to the running key shift) from a
    short scan. Forward keeps the chunk start states (L / C of them) and the shifts; backward
    recomputes features slab by slab and runs the scan in reverse for the state gradient, so
    that neither pass holds anything of size (L, m') beyond one slab.

    q, k: (B, H, L, d), v1: (B, H, L, dv + 1) with L a multiple of ``chunk`` and ``slab``
    a multiple of ``chunk``; kv0: (B, H, m', dv + 1); shift0: (B, H); keep: (B, 1, L, 1) or None
    -> (out1 (B, H, L, dv + 1) relative to exp(query shift + key shift), kv (B, H, m', dv + 1) and its shift
    (B, H), and, not differentiable, the key shifts s (B, H, L) and the query shifts (B, H, L): query i's
    features are ``exp(query shift_i)`` times those used)
    """

    @staticmethod
    def forward(ctx, q, k, v1, directions, bias, key_row, kv0, shift0, keep, stabilizer, chunk, slab):
        B, H, L, _ = q.shape
        m, d1, C = directions.shape[-2], v1.shape[-1], chunk
        out1 = q.new_empty(B, H, L, d1)
        shifts = q.new_empty(B, H, L)  # s_j: running max of the key log-features over positions <= j
        q_shifts = q.new_empty(B, H, L)  # log max_r phi_r(q_i): what each query's features are relative to
        log_root_m = 0.5 * math.log(m)
        starts = []  # per slab (B, H, G, m', d + 1): the state each chunk starts from
        future = ~torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        kv, prev = kv0, shift0
        for a, b in _spans(L, slab):
            G = (b - a) // C
            xq = q[:, :, a:b]
            phi_q, top = _exp_query_features(xq, directions, bias)
            q_shifts[:, :, a:b] = (top - 0.5 * xq.pow(2).sum(dim=-1, keepdim=True)).squeeze(-1) - log_root_m
            if stabilizer:
                phi_q.add_(stabilizer)
            log_phi = _exp_log_features(k[:, :, a:b], directions, None if keep is None else keep[:, :, a:b], bias,
                                        None if key_row is None else key_row[:, :, a:b])  # fmt: skip
            row_max = torch.maximum(log_phi.amax(dim=-1).nan_to_num_(neginf=EMPTY_SHIFT), prev.unsqueeze(-1))
            s = torch.cummax(row_max, dim=-1).values  # (B, H, S)
            shifts[:, :, a:b] = s
            phi_k = log_phi.sub_(s.unsqueeze(-1)).exp_()  # entries <= 1
            qc, kc = phi_q.view(B, H, G, C, m), phi_k.view(B, H, G, C, m)
            vc, sc = v1[:, :, a:b].view(B, H, G, C, d1), s.view(B, H, G, C)

            # Intra-chunk: key j rescaled to query i's shift by exp(s_j - s_i) <= 1.
            decay = (sc.unsqueeze(-2) - sc.unsqueeze(-1)).masked_fill_(future, float("-inf")).exp_()
            out = (qc @ kc.transpose(-2, -1)).mul_(decay) @ vc  # (B, H, G, C, d + 1)

            # Chunk summaries relative to each chunk's last shift, then all start states at once.
            ends = sc[..., -1]  # (B, H, G)
            chunk_kv = kc.transpose(-2, -1) @ (vc * torch.exp(sc - ends.unsqueeze(-1)).unsqueeze(-1))
            begins = torch.cat([prev.unsqueeze(-1), ends], dim=-1)  # (B, H, G + 1): shift before chunk r
            weights = _scan_weights(begins)
            chunk_starts, kv = _scan_forward(weights, kv, chunk_kv)  # (B, H, G, m', d + 1), (B, H, m', d + 1)
            starts.append(chunk_starts)
            prev = ends[..., -1]

            # Inter-chunk: each query reads its chunk's start state, rescaled to its own shift.
            to_query = torch.exp(begins[..., :G].unsqueeze(-1) - sc).unsqueeze(-1)  # (B, H, G, C, 1)
            out.add_((qc @ chunk_starts).mul_(to_query))
            out1[:, :, a:b] = out.view(B, H, b - a, d1)
        ctx.save_for_backward(q, k, v1, directions, bias, key_row, shifts, shift0, *starts)
        ctx.keep, ctx.stabilizer, ctx.chunk, ctx.slab = keep, stabilizer, chunk, slab
        ctx.mark_non_differentiable(prev, shifts, q_shifts)
        return out1, kv, prev, shifts, q_shifts

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out1, grad_kv, _grad_shift, _grad_shifts, _grad_q_shifts):
        q, k, v1, directions, bias, key_row, shifts, shift0, *starts = ctx.saved_tensors
        keep, stabilizer, C, slab = ctx.keep, ctx.stabilizer, ctx.chunk, ctx.slab
        B, H, L, _ = q.shape
        m, d1 = directions.shape[-2], v1.shape[-1]
        want_directions, want_bias, want_row = (ctx.needs_input_grad[i] for i in (3, 4, 5))
        grad_q, grad_k, grad_v1 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v1)
        grad_directions = torch.zeros_like(directions) if want_directions else None
        grad_bias = torch.zeros_like(bias) if want_bias else None
        grad_row = torch.empty_like(key_row) if want_row else None
        # d loss / d (the state after the slab processed next, going backwards), relative to its shift
        state_grad = q.new_zeros(B, H, m, d1) if grad_kv is None else grad_kv
        future = ~torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        for a, b in reversed(_spans(L, slab)):
            G = (b - a) // C
            xq, xk = q[:, :, a:b], k[:, :, a:b]
            phi_q, _ = _exp_query_features(xq, directions, bias)  # without the stabilizer
            phi_q1 = phi_q + stabilizer if stabilizer else phi_q  # as used in the forward
            s = shifts[:, :, a:b]
            log_phi = _exp_log_features(xk, directions, None if keep is None else keep[:, :, a:b], bias,
                                        None if key_row is None else key_row[:, :, a:b])  # fmt: skip
            phi_k = log_phi.sub_(s.unsqueeze(-1)).exp_()
            qc, q1c, kc = (t.view(B, H, G, C, m) for t in (phi_q, phi_q1, phi_k))
            vc, sc = v1[:, :, a:b].view(B, H, G, C, d1), s.view(B, H, G, C)
            gc = grad_out1[:, :, a:b].reshape(B, H, G, C, d1)
            prev = shift0 if a == 0 else shifts[:, :, a - 1]
            ends = sc[..., -1]
            begins = torch.cat([prev.unsqueeze(-1), ends], dim=-1)  # (B, H, G + 1)
            to_query = torch.exp(begins[..., :G].unsqueeze(-1) - sc).unsqueeze(-1)  # (B, H, G, C, 1)
            to_end = torch.exp(sc - ends.unsqueeze(-1)).unsqueeze(-1)  # (B, H, G, C, 1)
            decay = (sc.unsqueeze(-2) - sc.unsqueeze(-1)).masked_fill_(future, float("-inf")).exp_()

            # The scan backwards: from how each chunk reads its start state, and the gradient of the
            # state after the slab, to the gradient of each chunk summary and of the state before.
            reads = (q1c * to_query).transpose(-2, -1) @ gc  # (B, H, G, m', d + 1)
            after, state_grad = _scan_backward(_scan_weights(begins), reads, state_grad)
            chunk_starts = starts.pop()

            # Intra-chunk and inter-chunk terms of the three gradients.
            dscores = (gc @ vc.transpose(-2, -1)).mul_(decay)  # (B, H, G, C, C)
            grad_phi_q = dscores @ kc
            grad_phi_q.add_((gc @ chunk_starts.transpose(-2, -1)).mul_(to_query))
            grad_phi_k = dscores.transpose(-2, -1) @ q1c
            grad_phi_k.add_((vc @ after.transpose(-2, -1)).mul_(to_end))
            scores = (q1c @ kc.transpose(-2, -1)).mul_(decay)
            grad_v = scores.transpose(-2, -1) @ gc
            grad_v.add_((kc @ after).mul_(to_end))
            grad_v1[:, :, a:b] = grad_v.view(B, H, b - a, d1)

            g_q = grad_phi_q.mul_(qc).view(B, H, b - a, m)  # d loss / d log phi
            g_k = grad_phi_k.mul_(kc).view(B, H, b - a, m)
            grad_q[:, :, a:b] = _exp_input_grad(g_q, xq, directions)
            grad_k[:, :, a:b] = _exp_input_grad(g_k, xk, directions)
            if want_directions:
                grad_directions.add_(_exp_directions_grad(g_q, xq, directions))
                grad_directions.add_(_exp_directions_grad(g_k, xk, directions))
            if want_bias:
                grad_bias.add_((g_q.sum(dim=-2, keepdim=True) + g_k.sum(dim=-2, keepdim=True)).sum_to_size(bias.shape))
            if want_row:
                grad_row[:, :, a:b] = g_k.sum(dim=-1, keepdim=True)
        return (grad_q, grad_k, grad_v1, grad_directions, grad_bias, grad_row, state_grad) + (None,) * 5


def _features(
    x: Tensor, projection: Tensor, kernel: str, *, keep: Tensor | None, shift_of: ShiftFn, stabilizer: float = 0.0
) -> tuple[Tensor, Tensor | None]:
    """Features of any registered map, through autograd: (B, H, L, d) -> ((B, H, L, m'), shift or None).

    ``keep`` (B, 1, L, 1) zeroes the features of padded keys. The shift (detached) is ``None``
    for maps without an exponential part (relu, elu), which need none.
    """
    base, log_scale = get_feature_map(kernel).compute(x, projection)
    shift = None
    if log_scale is None:
        features = base if keep is None else base * keep
    else:
        if keep is not None:
            log_scale = log_scale.masked_fill(~keep, float("-inf"))
        shift = shift_of(log_scale.detach())
        features = torch.exp(log_scale - shift)
        features = features if base is None else base * features
    return (features + stabilizer if stabilizer else features), shift


def _divide_or_zero(out1: Tensor) -> Tensor:
    """(…, d + 1) numerator|denominator -> (…, d).

    A query that sees no key at all (causal, before the first real token of a left-padded row)
    has 0 / 0: it gets a zero output and zero gradients. Positive kernels never reach an exact
    zero otherwise (the stabilizer keeps each visible key's weight above zero).
    """
    numerator, denominator = out1[..., :-1], out1[..., -1:]
    return numerator / torch.where(denominator == 0, torch.ones_like(denominator), denominator)


# --------------------------------------------------------------------------------------------
# Attention


def _bidirectional(q: Tensor, k: Tensor, v1: Tensor, projection: Tensor, kernel: str, mask: Tensor | None) -> Tensor:
    """q: (B, H, Lq, d), k: (B, H, Lk, d), v1: (B, H, Lk, dv + 1) -> (B, H, Lq, dv + 1)."""
    stabilizer = get_feature_map(kernel).query_stabilizer
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, Lk, 1)
    if kernel in EXP_KERNEL_DIRECTIONS:
        directions = EXP_KERNEL_DIRECTIONS[kernel](projection)  # (m', d)
        slab = _slab_size(q.shape[0] * q.shape[1], directions.shape[0], q.device)
        return _BidirectionalExp.apply(q, k, v1, directions, keep, stabilizer, slab)
    qf, _ = _features(q, projection, kernel, keep=None, shift_of=_row_shift, stabilizer=stabilizer)
    kf, _ = _features(k, projection, kernel, keep=keep, shift_of=_global_shift)  # (B, H, Lk, m)
    kv = kf.transpose(-2, -1) @ v1  # (B, H, m, dv + 1)
    return qf @ kv


def _causal(
    q: Tensor,
    k: Tensor,
    v1: Tensor,
    projection: Tensor,
    kernel: str,
    mask: Tensor | None,
    chunk_size: int,
    state: FavorState | None,
) -> tuple[Tensor, FavorState]:
    """Chunked causal linear attention.

    q, k: (B, H, L, d), v1: (B, H, L, dv + 1) -> ((B, H, L, dv + 1), FavorState)
    """
    stabilizer = get_feature_map(kernel).query_stabilizer
    if kernel in EXP_KERNEL_DIRECTIONS:
        directions = EXP_KERNEL_DIRECTIONS[kernel](projection)  # (m', d)
        out1, _, _, state = causal_exp_sums(q, k, v1, directions, mask=mask, stabilizer=stabilizer,
                                            chunk_size=chunk_size, state=state)  # fmt: skip
        return out1, state
    L = q.shape[2]
    C = min(chunk_size, L)
    q, k, v1, mask = _pad_to_chunks(q, k, v1, mask, C)
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, N * C, 1)
    out1, state = _causal_generic(q, k, v1, projection, kernel, keep, stabilizer, C, state)
    return out1[:, :, :L], state


def _pad_to_chunks(q, k, v1, mask, C: int):
    """Pad the sequence axis to a multiple of C with keys that are masked out."""
    B, _, L, _ = q.shape
    pad = -(-L // C) * C - L
    if pad:
        q, k, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v1))
        mask = q.new_ones(B, L, dtype=torch.bool) if mask is None else mask
        mask = F.pad(mask, (0, pad), value=False)
    return q, k, v1, mask


def causal_exp_sums(
    q: Tensor,
    k: Tensor,
    v1: Tensor,
    directions: Tensor,
    *,
    bias: Tensor | None = None,
    key_row: Tensor | None = None,
    mask: Tensor | None = None,
    stabilizer: float = 0.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    state: FavorState | None = None,
) -> tuple[Tensor, Tensor, Tensor, FavorState]:
    """Causal sums ``sum_{j <= i} phi(q_i) . phi(k_j) [v_j, 1]`` of exponential features (:class:`_CausalExp`),
    ``phi(x) = exp(x D^T + bias - |x|^2 / 2 (+ key_row for keys)) / sqrt(m')``.

    Args:
        q, k: (B, H, L, d); v1: (B, H, L, dv + 1).
        directions: D, (m', d) or per head (.., H, m', d); bias: (.., H, 1, m') or None; key_row: (B, H, L, 1)
            or None; mask: (B, L) bool, False for keys left out; stabilizer: added to the normalised query features.
        state: the :class:`FavorState` before position 0, or None.

    Returns:
        The sums (B, H, L, dv + 1), query i's relative to ``exp(q_shift_i + s_i)``; q_shift (B, H, L) and
        s (B, H, L) (constants for autograd); the state after the last position.
    """
    B, H, L, _ = q.shape
    C = min(chunk_size, L)
    if key_row is not None:
        key_row = F.pad(key_row, (0, 0, 0, -(-L // C) * C - L))
    q, k, v1, mask = _pad_to_chunks(q, k, v1, mask, C)
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, N * C, 1)
    if state is None:
        kv0 = q.new_zeros(B, H, directions.shape[-2], v1.shape[-1])
        shift0 = q.new_full((B, H), EMPTY_SHIFT)
    else:
        kv0, shift0 = state.kv.to(q.dtype), state.shift.to(q.dtype)
    slab = _slab_size(B * H, directions.shape[-2], q.device, chunk=C)
    out1, kv, shift, shifts, q_shifts = _CausalExp.apply(
        q, k, v1, directions, bias, key_row, kv0, shift0, keep, stabilizer, C, slab
    )
    return out1[:, :, :L], q_shifts[:, :, :L], shifts[:, :, :L], FavorState(kv=kv, shift=shift)


def _causal_generic(q, k, v1, projection, kernel, keep, stabilizer, C, state):
    """The chunked scan (:func:`.causal_scan`) for any feature map, through autograd (lengths already a
    multiple of C)."""
    B, H = q.shape[:2]
    prev_kv, prev_shift = (None, q.new_full((B, H), EMPTY_SHIFT)) if state is None else state
    qf, _ = _features(q, projection, kernel, keep=None, shift_of=_row_shift, stabilizer=stabilizer)
    kf, shifts = _features(k, projection, kernel, keep=keep, shift_of=_running_shift(prev_shift.to(q.dtype)))
    shifts = None if shifts is None else shifts.view(B, H, -1)  # (B, H, L)
    out, kv, shift = causal_scan(qf, kf, v1, shifts, C, prev_kv, prev_shift)
    return out, FavorState(kv=kv, shift=shift)


def check_attention_inputs(name: str, q, k, v, key_padding_mask, self_attention: bool) -> None:
    """Shapes of q, k, v and the key mask of the attention function ``name``; ``self_attention``: one
    key per query (as many queries as keys)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{name} expects q, k, v of shape (batch, heads, seq, head_dim); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    matched = q.shape[:3] == k.shape[:3] if self_attention else q.shape[:2] == k.shape[:2]
    if not matched or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        need = (
            "as many queries as keys: q, k (B, H, L, d) and v (B, H, L, dv)"
            if self_attention
            else "q (B, H, Lq, d), k (B, H, Lk, d), v (B, H, Lk, dv)"
        )
        raise ValueError(f"q, k, v disagree: need {need}; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}.")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq) = {(k.shape[0], k.shape[2])}; "
            f"got {tuple(key_padding_mask.shape)}."
        )


def _check_inputs(q, k, v, projection, causal, key_padding_mask, state, return_state):
    check_attention_inputs("favor_attention", q, k, v, key_padding_mask, self_attention=causal)
    if projection.dim() != 2 or projection.shape[1] != q.shape[-1]:
        raise ValueError(
            f"projection must have shape (nb_features, head_dim={q.shape[-1]}); got {tuple(projection.shape)}. "
            "Draw it with draw_projection(nb_features, head_dim)."
        )
    if (state is not None or return_state) and not causal:
        raise ValueError("initial_state / return_state only apply to causal attention (causal=True).")


def favor_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor,
    *,
    causal: bool = False,
    kernel: str = "softmax",
    key_padding_mask: Tensor | None = None,
    scaling: float | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: FavorState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, FavorState]:
    """FAVOR+ approximation of ``softmax(q k^T * scaling) v`` in linear time and memory.

    Args:
        q: ``(B, H, Lq, d)`` queries.
        k: ``(B, H, Lk, d)`` keys.
        v: ``(B, H, Lk, dv)`` values.
        projection: ``(m, d)`` random projection from :func:`draw_projection` (ignored by ``"elu"``).
        causal: query ``i`` attends to keys ``j <= i`` only (prefix sums, computed in chunks).
        kernel: feature map name: ``"softmax"``, ``"softmax_hyperbolic"``, ``"softmax_trig"``,
            ``"relu"`` or ``"elu"``.
        key_padding_mask: ``(B, Lk)``, True/1 for real tokens; padded keys get zero features.
        scaling: logit scale; defaults to ``d ** -0.5``. q and k are each multiplied by its root.
        chunk_size: positions per chunk of the causal scan (memory/speed trade-off only).
        initial_state: causal only: the :class:`FavorState` of the preceding tokens (decoding).
        return_state: causal only: also return the state after the last position.

    Returns:
        ``(B, H, Lq, dv)`` in the dtype of ``q``; with ``return_state`` a tuple ``(out, state)``.
    """
    _check_inputs(q, k, v, projection, causal, key_padding_mask, initial_state, return_state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    out_dtype = q.dtype
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = (q.shape[-1] ** -0.5 if scaling is None else scaling) ** 0.5
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    q, k = q * scale, k * scale
    projection = projection.to(compute_dtype)
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool)

    if mask is not None:
        v = v.masked_fill(~mask[:, None, :, None], 0.0)  # padded values may hold anything
    v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # (B, H, Lk, dv + 1)

    # The kernels compute in compute_dtype on purpose; autocast must not lower their matmuls
    # (the autograd functions' saved tensors would disagree in dtype with their backward).
    with torch.autocast(q.device.type, enabled=False):
        if causal:
            out1, state = _causal(q, k, v1, projection, kernel, mask, chunk_size, initial_state)
        else:
            out1, state = _bidirectional(q, k, v1, projection, kernel, mask), None
        out = _divide_or_zero(out1).to(out_dtype)
    return (out, state) if return_state else out
