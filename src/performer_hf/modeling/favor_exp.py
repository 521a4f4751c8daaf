"""FAVOR+ sums for exponential features as autograd functions that walk the sequence a slab at a time.

Features of the form ``phi(x) = exp(x D^T + bias - |x|^2 / 2) / sqrt(m')`` (FAVOR+'s positive and hyperbolic
random features, FAVOR++, :class:`ExpFeatures`) run here, bidirectionally (:func:`bidirectional_exp_sums`) and
causally (:func:`causal_exp_sums`, also the hybrid's causal far field). Forward keeps for backward only the inputs,
the causal chunk start states and the shifts; backward recomputes the features slab by slab and runs the chunk scan
in reverse. On CPU, elementwise passes over fresh ``(L, m)`` buffers (a page fault per 4 KiB of every new large
allocation), not the matmuls, dominated the time of the plain autograd version, which
:mod:`.favor_attention` keeps for the other feature maps and the tests compare against.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .causal_scan import EMPTY_SHIFT, scan_backward, scan_forward, scan_weights
from .compiled_lengths import chunking, needs_padding, padded, spans
from .favor_exp_triton import bidirectional_exp_sums as triton_bidirectional_exp_sums
from .favor_exp_triton import causal_exp_sums as triton_causal_exp_sums
from .favor_exp_triton import exp_key_state as triton_exp_key_state
from .favor_exp_triton import serves as triton_serves
from .slabs import max_slab_chunks, slab_elements

Tensor = torch.Tensor

# Positions per causal chunk. Chosen from benchmarks/speed.py measurements (2-core CPU, fp32,
# 8 heads, head_dim 64, m = 256): the intra-chunk product costs C * m per position and the
# chunk state m * (d + 1), and smaller chunks mean more, smaller matmuls.
DEFAULT_CHUNK_SIZE = 128


class ExpFeatures(NamedTuple):
    """Exponential features ``phi(x) = exp(x D^T + bias - |x|^2 / 2) / sqrt(m')``.

    Attributes:
        directions: D, (m', d), or per head (.., H, m', d).
        bias: (.., H, 1, m') or None (FAVOR++'s per-feature terms).
        stabilizer: added to the normalised query features, so that no normaliser is zero.
    """

    directions: Tensor
    bias: Tensor | None = None
    stabilizer: float = 0.0


class _ScanSettings(NamedTuple):
    stabilizer: float
    chunk: int  # positions per chunk
    slab: int  # positions per slab, a multiple of chunk


class ScanResult(NamedTuple):
    """What :func:`causal_exp_sums` returns.

    Attributes:
        sums: (B, H, L, dv + 1), query i's relative to ``exp(q_shifts_i + shifts_i)``; its stabilizer relative to
            query i's largest feature, through which the stabilizer's gradient goes.
        q_shifts, shifts: (B, H, L) the query and key shifts (constants for autograd).
        kv, shift: the state after the last position, (B, H, m', dv + 1) relative to ``exp(shift)`` (B, H).
    """

    sums: Tensor
    q_shifts: Tensor
    shifts: Tensor
    kv: Tensor
    shift: Tensor


def exp_log_features(x: Tensor, directions: Tensor, bias=None, keep: Tensor | None = None, row=None) -> Tensor:
    """log phi(x) = x D^T + bias - |x|^2 / 2 + row - log sqrt(m'): (B, H, S, d) -> (B, H, S, m'), -inf where not
    kept. ``directions`` D: (m', d) or per head (.., H, m', d); ``bias``: (.., H, 1, m') or None; ``keep``:
    (B, 1, S, 1) bool or None; ``row``: (B, H, S, 1) or None."""
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


def _add_stabilizer_grad(g: Tensor, phi: Tensor, grad_phi_sum: Tensor, stabilizer: float) -> Tensor:
    """The stabilizer's share of d loss / d log phi of queries, added into ``g`` (B, H, S, m') in place.

    The queries' features are ``exp(log phi_r - shift) + stabilizer * exp(max_s log phi_s - shift)``: the stabilizer
    is relative to each query's largest feature. With the shift held constant (the sums are relative to it), that
    largest log-feature gets ``stabilizer * sum_r d loss / d phi_r`` (``grad_phi_sum`` (B, H, S, 1), overwritten);
    through ``g`` it reaches the queries, directions and bias. ``phi``: the features relative to the largest
    (:func:`_exp_query_features`), overwritten: ``floor`` keeps their 1 at the largest and zeroes the rest (exact ties
    share, as autograd's ``amax`` splits its gradient), at a third of the cost of ``max``'s indices on CPU.
    """
    top = phi.floor_()  # (B, H, S, m'): 1 at each query's largest feature, 0 elsewhere
    return g.addcmul_(top, grad_phi_sum.mul_(stabilizer).div_(top.sum(dim=-1, keepdim=True)))


def _exp_input_grad(g: Tensor, x: Tensor, directions: Tensor) -> Tensor:
    """d loss / d x from g = d loss / d log phi: sum_r g_r (D_r - x), the shift held constant."""
    grad_x = g @ directions  # (B, H, S, d)
    return grad_x.sub_(g.sum(dim=-1, keepdim=True) * x)


def _exp_directions_grad(g: Tensor, x: Tensor, directions: Tensor) -> Tensor:
    """d loss / d D from g = d loss / d log phi: sum over positions of g_r x. -> the shape of ``directions``"""
    if directions.dim() == 2:
        return g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return (g.transpose(-2, -1) @ x).sum_to_size(directions.shape)  # per head


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
        for a, b in spans(Lk, slab):
            log_phi = exp_log_features(k[:, :, a:b], directions, keep=None if keep is None else keep[:, :, a:b])
            new_shift = torch.maximum(shift, log_phi.amax(dim=(-2, -1), keepdim=True))
            kv.mul_(torch.exp(shift - new_shift))
            kv.add_(log_phi.sub_(new_shift).exp_().transpose(-2, -1) @ v1[:, :, a:b])
            shift = new_shift
        out1 = q.new_empty(*q.shape[:-1], v1.shape[-1])
        for a, b in spans(q.shape[2], slab):
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
        # (B, H, dv + 1, 1): g1 kv_rows = sum_r d loss / d phi_r, the stabilizer's gradient
        kv_rows = kv.sum(dim=-2, keepdim=True).transpose(-2, -1)
        for a, b in spans(q.shape[2], slab):
            x, g1 = q[:, :, a:b], grad_out1[:, :, a:b]
            phi, _ = _exp_query_features(x, directions)  # without the stabilizer
            g = g1 @ kv.transpose(-2, -1)  # (B, H, S, m'): d loss / d phi
            grad_kv.add_((phi + stabilizer if stabilizer else phi).transpose(-2, -1) @ g1)
            g.mul_(phi)  # d loss / d log phi
            if stabilizer:
                _add_stabilizer_grad(g, phi, g1 @ kv_rows, stabilizer)
            grad_q[:, :, a:b] = _exp_input_grad(g, x, directions)
            if want_directions:
                grad_directions.add_(_exp_directions_grad(g, x, directions))
        for a, b in spans(k.shape[2], slab):
            x, v1_slab = k[:, :, a:b], v1[:, :, a:b]
            phi = exp_log_features(x, directions, keep=None if keep is None else keep[:, :, a:b]).sub_(shift).exp_()
            grad_v1[:, :, a:b] = phi @ grad_kv
            g = (v1_slab @ grad_kv.transpose(-2, -1)).mul_(phi)  # d loss / d log phi
            grad_k[:, :, a:b] = _exp_input_grad(g, x, directions)
            if want_directions:
                grad_directions.add_(_exp_directions_grad(g, x, directions))
        return grad_q, grad_k, grad_v1, grad_directions, None, None, None


class _CausalExp(torch.autograd.Function):
    """Chunked causal FAVOR+ for exponential features, a slab of chunks at a time.

    Features: ``phi(x) = exp(x D^T + bias - |x|^2 / 2 + row) / sqrt(m')`` with directions D (m', d) or per head
    (.., H, m', d), an optional per-feature ``bias`` (.., H, 1, m') (FAVOR++) and, for keys, an optional per-key
    ``key_row`` (B, H, L, 1) (hybrid attention's centering term). Queries are normalised by their row max, then get
    the stabilizer (its gradient: :func:`_add_stabilizer_grad`).

    Inside a slab everything is batched over its chunks: exact masked (C, C) products within each
    chunk, and each chunk's start state (m' x (dv + 1), relative to the running key shift) from a
    short scan. Forward keeps the chunk start states (L / C of them) and the shifts; backward
    recomputes features slab by slab and runs the scan in reverse for the state gradient, so
    that neither pass holds anything of size (L, m') beyond one slab.

    ``settings``: (stabilizer, chunk, slab); tensors: q, k (B, H, L, d), v1 (B, H, L, dv + 1) with L a multiple of
    ``chunk`` and ``slab`` a multiple of ``chunk``; directions, bias, key_row as above; kv0 (B, H, m', dv + 1);
    shift0 (B, H); keep (B, 1, L, 1) or None
    -> (out1 (B, H, L, dv + 1) relative to exp(query shift + key shift), kv (B, H, m', dv + 1) and its shift
    (B, H), and, not differentiable, the key shifts s (B, H, L) and the query shifts (B, H, L): query i's
    features are ``exp(query shift_i)`` times those used)
    """

    @staticmethod
    def forward(ctx, settings: _ScanSettings, *tensors):
        q, k, v1, directions, bias, key_row, kv0, shift0, keep = tensors
        stabilizer, chunk, slab = settings
        B, H, L, _ = q.shape
        m, d1, C = directions.shape[-2], v1.shape[-1], chunk
        out1 = q.new_empty(B, H, L, d1)
        shifts = q.new_empty(B, H, L)  # s_j: running max of the key log-features over positions <= j
        q_shifts = q.new_empty(B, H, L)  # log max_r phi_r(q_i): what each query's features are relative to
        log_root_m = 0.5 * math.log(m)
        starts = []  # per slab (B, H, G, m', d + 1): the state each chunk starts from
        future = ~torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        kv, prev = kv0, shift0
        for a, b in spans(L, slab):
            G = (b - a) // C
            xq = q[:, :, a:b]
            phi_q, top = _exp_query_features(xq, directions, bias)
            q_shifts[:, :, a:b] = (top - 0.5 * xq.pow(2).sum(dim=-1, keepdim=True)).squeeze(-1) - log_root_m
            if stabilizer:
                phi_q.add_(stabilizer)
            log_phi = exp_log_features(
                k[:, :, a:b],
                directions,
                bias,
                keep=None if keep is None else keep[:, :, a:b],
                row=None if key_row is None else key_row[:, :, a:b],
            )
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
            weights = scan_weights(begins)
            chunk_starts, kv = scan_forward(weights, kv, chunk_kv)  # (B, H, G, m', d + 1), (B, H, m', d + 1)
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
        want_directions, want_bias, want_row = (ctx.needs_input_grad[i] for i in (4, 5, 6))
        grad_q, grad_k, grad_v1 = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v1)
        grad_directions = torch.zeros_like(directions) if want_directions else None
        grad_bias = torch.zeros_like(bias) if want_bias else None
        grad_row = torch.empty_like(key_row) if want_row else None
        # d loss / d (the state after the slab processed next, going backwards), relative to its shift
        state_grad = q.new_zeros(B, H, m, d1) if grad_kv is None else grad_kv
        future = ~torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # each slab's chunk start states, from the last slab back (not popped: traced, torch 2.11's dynamo holds
        # them as a tuple, whose pop broke the graph)
        for (a, b), chunk_starts in zip(reversed(spans(L, slab)), reversed(starts), strict=True):
            G = (b - a) // C
            xq, xk = q[:, :, a:b], k[:, :, a:b]
            phi_q, _ = _exp_query_features(xq, directions, bias)  # without the stabilizer
            phi_q1 = phi_q + stabilizer if stabilizer else phi_q  # as used in the forward
            s = shifts[:, :, a:b]
            log_phi = exp_log_features(
                xk,
                directions,
                bias,
                keep=None if keep is None else keep[:, :, a:b],
                row=None if key_row is None else key_row[:, :, a:b],
            )
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
            after, state_grad = scan_backward(scan_weights(begins), reads, state_grad)

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

            grad_phi_sum = grad_phi_q.sum(dim=-1, keepdim=True).view(B, H, b - a, 1) if stabilizer else None
            g_q = grad_phi_q.mul_(qc).view(B, H, b - a, m)  # d loss / d log phi
            if stabilizer:
                _add_stabilizer_grad(g_q, phi_q, grad_phi_sum, stabilizer)
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
        return None, grad_q, grad_k, grad_v1, grad_directions, grad_bias, grad_row, state_grad, None, None


def pad_to_chunks(tensors: list[Tensor | None], mask: Tensor | None, length: int, chunk: int, count: int):
    """Pad the sequence axis (2) of ``tensors`` to ``count`` chunks of ``chunk`` (:func:`.chunking`) with keys that are
    masked out."""
    pad = count * chunk - length
    if not needs_padding(pad):
        return tensors, mask
    tensors = [None if t is None else padded(t, (0, 0, 0, pad)) for t in tensors]
    mask = torch.ones(tensors[0].shape[0], length, dtype=torch.bool, device=tensors[0].device) if mask is None else mask
    return tensors, F.pad(mask, (0, pad), value=False)


def bidirectional_exp_sums(
    q: Tensor, k: Tensor, v1: Tensor, features: ExpFeatures, mask: Tensor | None, precision: str = "pytorch"
) -> Tensor:
    """``phi(q_i) . sum_j phi(k_j) [v_j, 1]`` over the real keys (:class:`_BidirectionalExp`; on CUDA the Triton
    kernels of :mod:`.favor_exp_triton` where they serve the call, their products in ``precision``).

    q: (B, H, Lq, d), k: (B, H, Lk, d), v1: (B, H, Lk, dv + 1), mask: (B, Lk) or None -> (B, H, Lq, dv + 1),
    each query's row relative to its own scale (it cancels in the attention ratio). Directions (m', d), no bias."""
    if triton_serves(q, v1.shape[-1], features.directions, features.bias):
        directions, bias, stabilizer = features
        return triton_bidirectional_exp_sums(q, k, v1, directions, bias, stabilizer, mask, precision)
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, Lk, 1)
    slab = _slab_size(q.shape[0] * q.shape[1], features.directions.shape[-2], q.device)
    return _BidirectionalExp.apply(q, k, v1, features.directions, keep, features.stabilizer, slab)


class ScanKeys(NamedTuple):
    """The keys of :func:`causal_exp_sums`: k (B, H, L, d), v1 (B, H, L, dv + 1) (values with a ones column), and
    optionally ``row`` (B, H, L, 1), a per-key term added to the keys' log-features (hybrid attention's centering),
    and ``mask`` (B, L) bool, False for keys left out."""

    k: Tensor
    v1: Tensor
    row: Tensor | None = None
    mask: Tensor | None = None


def _wants_grad(*tensors: Tensor | None) -> bool:
    """Whether autograd records a function of ``tensors`` (None entries skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def exp_key_state(keys: ScanKeys, features: ExpFeatures, precision: str = "pytorch") -> tuple[Tensor, Tensor]:
    """The state of a causal call after its every key, without its sums: ``sum_j phi(k_j) [v_j, 1]`` relative to
    the largest key log-feature, as :func:`causal_exp_sums` returns it (its ``kv`` and ``shift``) beside them. A
    decoding cache's state: on CUDA the Triton kernels compute it where they serve the call and no gradient is asked
    for, holding the features in registers where PyTorch writes an (L, m') buffer.

    keys: the :class:`ScanKeys` -> (kv (B, H, m', dv + 1), shift (B, H))."""
    (k, v1, row, mask), (directions, bias, _) = keys, features
    # (a decoding step's one key stays in PyTorch: compiled, fused with the step's other operators)
    if not _wants_grad(k, v1, row, directions) and k.shape[2] > 1 and triton_serves(k, v1.shape[-1], directions, bias):
        return triton_exp_key_state(k, v1, directions, bias, row, mask, precision)
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, L, 1)
    log_phi = exp_log_features(k, directions, bias, keep, row)  # (B, H, L, m')
    shift = log_phi.detach().amax(dim=(-2, -1)).nan_to_num(neginf=EMPTY_SHIFT).clamp_min(EMPTY_SHIFT)  # (B, H)
    return torch.exp(log_phi - shift[..., None, None]).transpose(-2, -1) @ v1, shift


def causal_exp_sums(
    q: Tensor,
    keys: ScanKeys,
    features: ExpFeatures,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    state=None,
    precision: str = "pytorch",
) -> ScanResult:
    """Causal sums ``sum_{j <= i} phi(q_i) . phi(k_j) [v_j, 1]`` of exponential features (:class:`_CausalExp`; on
    CUDA the Triton kernels of :mod:`.favor_exp_triton` where they serve the call).

    Args:
        q: (B, H, L, d) queries; keys: their :class:`ScanKeys`.
        features: the :class:`ExpFeatures`.
        chunk_size: positions per chunk of the scan (in PyTorch; the Triton kernels take their own).
        state: (kv (B, H, m', dv + 1), shift (B, H)) before position 0 (a ``FavorState``), or None.
        precision: how the Triton kernels' matrix products take float32
            (:func:`.far_field_triton.float32_precision` of the attention's input dtype).
    """
    if q.shape[2] == 1 and not _wants_grad(q, *keys, *features[:2], *(state or ())):
        return _causal_exp_step(q, keys, features, state)
    if triton_serves(q, keys.v1.shape[-1], features.directions, features.bias):
        directions, bias, stabilizer = features
        args = (keys.row, keys.mask, state, precision)
        return ScanResult(*triton_causal_exp_sums(q, keys.k, keys.v1, directions, bias, stabilizer, *args))
    B, H, L, _ = q.shape
    C, N = chunking(L, chunk_size)
    (q, k, v1, key_row), mask = pad_to_chunks([q, keys.k, keys.v1, keys.row], keys.mask, L, C, N)
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, N * C, 1)
    if state is None:
        kv0 = q.new_zeros(B, H, features.directions.shape[-2], v1.shape[-1])
        shift0 = q.new_full((B, H), EMPTY_SHIFT)
    else:
        kv0, shift0 = state[0].to(q.dtype), state[1].to(q.dtype)
    settings = _ScanSettings(features.stabilizer, C, _slab_size(B * H, features.directions.shape[-2], q.device, C))
    out1, kv, shift, shifts, q_shifts = _CausalExp.apply(
        settings, q, k, v1, features.directions, features.bias, key_row, kv0, shift0, keep
    )
    return ScanResult(out1[:, :, :L], q_shifts[:, :, :L], shifts[:, :, :L], kv, shift)


def _causal_exp_step(q: Tensor, keys: ScanKeys, features: ExpFeatures, state) -> ScanResult:
    """:func:`causal_exp_sums` of one position (a decoding step, no gradient): the state rescaled to the new key's
    shift plus that key's term, then the query's sums from it; no chunks, no scan.

    q: (B, H, 1, d), keys: one key's :class:`ScanKeys`, state: (kv (B, H, m', dv + 1), shift (B, H)) or None."""
    directions, bias, stabilizer = features
    B, H = q.shape[:2]
    m = directions.shape[-2]
    if state is None:
        kv0, shift0 = q.new_zeros(B, H, m, keys.v1.shape[-1]), q.new_full((B, H), EMPTY_SHIFT)
    else:
        kv0, shift0 = state[0].to(q.dtype), state[1].to(q.dtype)
    keep = None if keys.mask is None else keys.mask[:, None, :, None]  # (B, 1, 1, 1)
    log_phi = exp_log_features(keys.k, directions, bias, keep, keys.row)  # (B, H, 1, m')
    shift = log_phi.amax(dim=(-2, -1)).nan_to_num_(neginf=EMPTY_SHIFT).maximum(shift0)  # (B, H)
    phi_k = log_phi.sub_(shift[..., None, None]).exp_()  # (B, H, 1, m'), entries <= 1
    kv = phi_k.transpose(-2, -1) @ keys.v1  # the state relative to the new shift: (B, H, m', dv + 1)
    kv.addcmul_(kv0, torch.exp(shift0 - shift)[..., None, None])
    phi_q, top = _exp_query_features(q, directions, bias)  # (B, H, 1, m'), (B, H, 1, 1)
    q_shift = top.squeeze(-1) - 0.5 * q.pow(2).sum(dim=-1) - 0.5 * math.log(m)  # (B, H, 1)
    if stabilizer:
        phi_q.add_(stabilizer)
    return ScanResult(phi_q @ kv, q_shift, shift.unsqueeze(-1), kv, shift)
