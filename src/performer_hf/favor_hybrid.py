"""Hybrid attention: exact softmax on a sparse support plus a linear-time far field, one normaliser.

For query ``i`` with support ``E(i)`` (a local window, a few global tokens and, bidirectionally,
routed key blocks) and a linear-attention kernel ``kappa(x, y) = phi_q(x) . phi_k(y) ~ exp(x . y)``::

    out_i = (sum_{j in E(i)} exp(l_ij) v_j + sum_{j notin E(i)} kappa_ij v_j) / (the same sums with v = 1)

with exact logits ``l_ij = x_i . y_j`` (``x``, ``y``: queries and keys times ``sqrt(scaling)``).
The result is one attention distribution over all visible keys: exact where attention mass is
large (BigBird's window and global tokens; Scatterbrain's sparse part), approximated elsewhere.
As in Scatterbrain (Chen et al., NeurIPS 2021), the far sum is the kernel sum over *all* visible
keys, ``phi_q(x_i) . sum_j phi_k(y_j) [v_j, 1]`` (a linear-attention state), minus the kernel values
on the support, so nothing of size ``L x L`` is formed: time and memory are linear in ``L``
(routing adds a ``(L / query_block_size) x L`` score matrix, a small fraction of ``L x L``).

Far-field kernels (``far_field``):

- ``"softmax"``: positive random features ``exp(w . u - |u|^2 / 2) / sqrt(m)`` (FAVOR+);
- ``"softmax_hyperbolic"``: ``[exp(w . u), exp(-w . u)] exp(-|u|^2 / 2) / sqrt(2m)``;
- ``"softmax_opt"``: optimal positive random features (FAVOR++, :mod:`.favor_optimal`);
- ``"taylor2"``: the deterministic second-order Taylor kernel ``1 + t + t^2 / 2`` of ``t = u . w``
  (at least 1/2 for every pair), as in the "Based" linear attention of Arora et al. (2024);
- ``"poly2"``: ``(1 + t / 2)^2 = 1 + t + t^2 / 4``, the ``n = 2`` term of ``exp(t) = lim (1 + t / n)^n``:
  a square, so never negative, and closer to ``exp`` than Taylor for ``t < -1`` (keys pointing away
  from the query, which make up most of the far field).

The two polynomial kernels are deterministic (no projection), with features of width
``1 + d + d (d + 1) / 2``, and their values on the support follow from the exact logits for free.

Centering (``center=True`` or explicit ``query_center`` / ``key_center``): with query and key
centres ``a`` and ``c``, ``exp(x . y) = exp(x . c + a . y - a . c) exp((x - a) . (y - c))``; the
first factor is one scalar per query and one per key and is kept exactly, only the second factor
(smaller arguments, hence far smaller estimator variance) goes through the kernel. Centres from the
sequence itself are allowed bidirectionally; causal attention needs fixed centres.

Numerics mirror :mod:`.favor_attention`: query features are shifted by their own row max, key
features by the max over keys (bidirectional) or by a running max over positions ``<= j``
(causal), so causal outputs never depend on later positions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .favor_optimal import optimal_log_features, optimal_parameter, pair_statistic

Tensor = torch.Tensor

_EMPTY_SHIFT = -1e30  # "no key seen yet": finite, so that differences of shifts stay defined
_NEG_INF = float("-inf")
# Upper bound on the elements of one (batch, heads, query blocks, block, candidates, feature) slab
# of the support computation; larger inputs are processed in several slabs of query blocks.
_SLAB_ELEMENTS = 1 << 24


# ----------------------------------------------------------------------------- far-field kernels
# (u, projection, parameter) -> (base, log): u (B, H, L, d); base (B, H, L, D) or None;
# log (B, H, L, D) or None. phi(u) = base * exp(log); missing parts mean ones / zeros.
FarFeatureFn = Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor | None, Tensor | None]]


@dataclass(frozen=True)
class FarField:
    """A far-field kernel of the hybrid attention.

    Attributes:
        name: registry key (the ``far_field`` argument).
        features: ``(u, projection, parameter) -> (base, log)`` for centred queries or keys.
        pair_value: closed form ``t = u . w -> kernel(u, w)`` for kernels that are a function of
            the inner product (evaluated on the support from the exact logits at no extra cost);
            ``None``: the support's kernel values come from feature dot products.
        uses_projection: whether a random projection is required.
        uses_parameter: whether the kernel has a per-head parameter (FAVOR++'s ``A``).
    """

    name: str
    features: FarFeatureFn
    pair_value: Callable[[Tensor], Tensor] | None = None
    uses_projection: bool = True
    uses_parameter: bool = False


def _half_sq_norm(u: Tensor) -> Tensor:
    return 0.5 * u.pow(2).sum(dim=-1, keepdim=True)  # (..., L, 1)


def _positive_features(u: Tensor, projection: Tensor, _parameter) -> tuple[None, Tensor]:
    m = projection.shape[0]
    return None, u @ projection.T - _half_sq_norm(u) - 0.5 * math.log(m)  # (B, H, L, m)


def _hyperbolic_features(u: Tensor, projection: Tensor, _parameter) -> tuple[None, Tensor]:
    m = projection.shape[0]
    logits = u @ projection.T  # (B, H, L, m)
    return None, torch.cat([logits, -logits], dim=-1) - _half_sq_norm(u) - 0.5 * math.log(2 * m)


def _optimal_features(u: Tensor, projection: Tensor, parameter: Tensor) -> tuple[None, Tensor]:
    return None, optimal_log_features(u, projection, parameter)  # (B, H, L, m)


def _quadratic(c2: float) -> tuple[FarFeatureFn, Callable[[Tensor], Tensor]]:
    """The kernel ``1 + t + c2 t^2`` of ``t = u . w`` (positive for ``c2 >= 1/4``), as features and closed form.

    Features ``[1, u, q(u)]`` with ``q_aa = sqrt(c2) u_a^2`` and ``q_ab = sqrt(2 c2) u_a u_b`` (a < b), so that
    ``q(u) . q(w) = c2 (u . w)^2``: width ``1 + d + d (d + 1) / 2``.
    """

    def features(u: Tensor, _projection, _parameter) -> tuple[Tensor, None]:
        d = u.shape[-1]
        rows, cols = torch.triu_indices(d, d, device=u.device)  # the d (d + 1) / 2 pairs a <= b
        weight = torch.full((rows.shape[0],), (2 * c2) ** 0.5, dtype=u.dtype, device=u.device)
        weight[rows == cols] = c2**0.5
        quadratic = u[..., rows] * u[..., cols] * weight  # (B, H, L, d (d + 1) / 2)
        return torch.cat([torch.ones_like(u[..., :1]), u, quadratic], dim=-1), None  # (B, H, L, D)

    def pair_value(t: Tensor) -> Tensor:
        return 1 + t + c2 * t * t

    return features, pair_value


FAR_FIELDS: dict[str, FarField] = {
    ff.name: ff
    for ff in (
        FarField("softmax", _positive_features),
        FarField("softmax_hyperbolic", _hyperbolic_features),
        FarField("softmax_opt", _optimal_features, uses_parameter=True),
        FarField("taylor2", *_quadratic(0.5), uses_projection=False),
        FarField("poly2", *_quadratic(0.25), uses_projection=False),
    )
}


def get_far_field(name: str) -> FarField:
    """Look up a far-field kernel by name, with an error that lists the valid names."""
    try:
        return FAR_FIELDS[name]
    except KeyError:
        raise ValueError(f"Unknown far_field {name!r}; choose one of {sorted(FAR_FIELDS)}.") from None


# ----------------------------------------------------------------------------- decoding state
class HybridState(NamedTuple):
    """Recurrent state of causal hybrid attention after a prefix of ``length`` tokens.

    Constant size in the prefix length: the far-field state plus the last ``local_window - 1``
    keys and values (a ring buffer in effect) and the ``num_global_tokens`` first ones.

    Attributes:
        far_kv: ``(B, H, D, dv + 1)``: ``sum_j phi_k(y_j) [v_j, 1]^T`` over all previous keys,
            relative to ``far_shift``.
        far_shift: ``(B, H)``: running max of the key log-features (``-1e30`` when empty).
        keys, values: ``(B, H, local_window - 1, d)`` / ``(.., dv)``: the most recent raw keys/values.
        key_mask: ``(B, local_window - 1)``: True where the buffer holds a real token.
        global_keys, global_values: ``(B, H, G, d)`` / ``(.., dv)``: the first ``G <= num_global_tokens``
            raw keys/values (``G`` grows until the prefix is ``num_global_tokens`` long).
        global_mask: ``(B, G)``: True for real tokens.
        length: tokens consumed so far (the absolute position of the next token).
    """

    far_kv: Tensor
    far_shift: Tensor
    keys: Tensor
    values: Tensor
    key_mask: Tensor
    global_keys: Tensor
    global_values: Tensor
    global_mask: Tensor
    length: int


# ----------------------------------------------------------------------------- helpers
def _masked_mean(t: Tensor, mask: Tensor | None) -> Tensor:
    """(B, H, L, d) -> (B, H, 1, d): mean over real positions (zeros where there are none)."""
    if mask is None:
        return t.mean(dim=-2, keepdim=True)
    keep = mask[:, None, :, None].to(t.dtype)  # (B, 1, L, 1)
    return (t * keep).sum(dim=-2, keepdim=True) / keep.sum(dim=-2, keepdim=True).clamp_min(1)


def _as_center(center: Tensor, like: Tensor) -> Tensor:
    """A centre given as (d,), (H, d) or (B, H, d) -> (B or 1, H or 1, 1, d) in ``like``'s dtype."""
    center = center.to(device=like.device, dtype=like.dtype)
    while center.dim() < 3:
        center = center.unsqueeze(0)
    return center.unsqueeze(-2)


def _features(far: FarField, u: Tensor, projection, parameter, row_log: Tensor):
    """Far-field features as (normalised features, per-row log scale).

    Returns ``feats`` (B, H, L, D) with ``phi(u) * exp(row_log) = feats * exp(scale)`` and
    ``scale`` (B, H, L, 1): the row max of the log-features (so that ``|feats| <= 1`` for the
    exponential kernels; polynomial kernels keep their base features as they are).
    """
    base, log = far.features(u, projection, parameter)
    if log is None:
        return base, row_log
    log = log + row_log
    scale = log.amax(dim=-1, keepdim=True).detach()  # (B, H, L, 1)
    scale = torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))
    feats = torch.exp(log - scale)
    return (feats if base is None else base * feats), scale


def _normalise(out1: Tensor) -> Tensor:
    """(..., dv + 1) numerator|denominator -> (..., dv); 0 where nothing was visible."""
    return out1[..., :-1] / out1[..., -1:].clamp_min(torch.finfo(out1.dtype).tiny)


# ----------------------------------------------------------------------------- far field sums
def _bidirectional_far(qf: Tensor, kf: Tensor, klog: Tensor, v1: Tensor) -> tuple[Tensor, Tensor]:
    """Far-field kernel sums over all keys.

    qf: (B, H, Lq, D); kf: (B, H, Lk, D); klog: (B, H, Lk, 1) (-inf for padded keys); v1: (B, H, Lk, dv + 1)
    -> (F (B, H, Lq, dv + 1) relative to the key shift s, s (B, H, 1, 1)).
    """
    shift = klog.amax(dim=(-2, -1), keepdim=True).detach()  # (B, H, 1, 1)
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    kfs = kf * torch.exp(klog - shift)  # (B, H, Lk, D); padded keys -> 0
    state = kfs.transpose(-2, -1) @ v1  # (B, H, D, dv + 1)
    return qf @ state, shift


def _causal_far(qf, kf, klog, v1, chunk_size: int, far_kv: Tensor | None, far_shift: Tensor | None):
    """Chunked causal far-field sums: query i reads every key j <= i, scaled to the running shift s_i.

    qf: (B, H, L, D); kf: (B, H, L, D); klog: (B, H, L, 1); v1: (B, H, L, dv + 1)
    -> (F (B, H, L, dv + 1), shifts s (B, H, L), final state kv (B, H, D, dv + 1), final shift (B, H)).
    """
    B, H, L, D = qf.shape
    d1 = v1.shape[-1]
    kv = qf.new_zeros(B, H, D, d1) if far_kv is None else far_kv.to(qf.dtype)
    prev = qf.new_full((B, H), _EMPTY_SHIFT) if far_shift is None else far_shift.to(qf.dtype)
    row = klog.squeeze(-1).detach().nan_to_num(neginf=_EMPTY_SHIFT)  # (B, H, L)
    shifts = torch.cummax(torch.maximum(row, prev.unsqueeze(-1)), dim=-1).values  # (B, H, L): s_j
    kfs = kf * torch.exp(klog - shifts.unsqueeze(-1))  # (B, H, L, D), relative to s_j

    C = min(chunk_size, L)
    N = -(-L // C)
    pad = N * C - L
    if pad:
        qf, kfs, v1 = (F.pad(t, (0, 0, 0, pad)) for t in (qf, kfs, v1))
        shifts_p = F.pad(shifts, (0, pad), mode="replicate")
    else:
        shifts_p = shifts
    qc, kc, vc = qf.view(B, H, N, C, D), kfs.view(B, H, N, C, D), v1.view(B, H, N, C, d1)
    sc = shifts_p.view(B, H, N, C)

    tril = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()  # (C, C)
    decay = torch.exp((sc.unsqueeze(-2) - sc.unsqueeze(-1)).masked_fill(~tril, _NEG_INF))  # [i, j] = e^(s_j - s_i)
    out = ((qc @ kc.transpose(-2, -1)) * decay) @ vc  # (B, H, N, C, dv + 1): inside each chunk
    chunk_end = sc[..., -1]  # (B, H, N)
    chunk_kv = (kc * torch.exp(sc - chunk_end.unsqueeze(-1)).unsqueeze(-1)).transpose(-2, -1) @ vc  # (B,H,N,D,d1)

    starts, start_shifts = [], []
    for chunk_kv_n, end_n in zip(chunk_kv.unbind(2), chunk_end.unbind(2), strict=True):
        starts.append(kv)
        start_shifts.append(prev)
        kv = kv * torch.exp(prev - end_n)[..., None, None] + chunk_kv_n
        prev = end_n
    start_kv = torch.stack(starts, dim=2)  # (B, H, N, D, dv + 1)
    start_shift = torch.stack(start_shifts, dim=2)  # (B, H, N)
    out = out + (qc @ start_kv) * torch.exp(start_shift.unsqueeze(-1) - sc).unsqueeze(-1)
    return out.reshape(B, H, N * C, d1)[:, :, :L], shifts, kv, prev


# ----------------------------------------------------------------------------- the support
@dataclass
class _Candidates:
    """Keys that some queries of a query block compute exactly: one group of the support.

    keys: (B|1, H|1, Nq|1, C, d); values1: (.., C, dv + 1); feats: (.., C, D) or None;
    klog: (.., C, 1); support: (B|1, H|1, Nq, bq, C) bool: is key c in E(i) for query i?
    """

    keys: Tensor
    values1: Tensor
    feats: Tensor | None
    klog: Tensor
    support: Tensor


def _unfold_blocks(t: Tensor, block: int, width: int, nb_blocks: int) -> Tensor:
    """(B, H, S, X) -> (B, H, nb_blocks, width, X): rows [n * block, n * block + width) of t."""
    windows = t.unfold(2, width, block)[:, :, :nb_blocks]  # (B, H, N, X, width)
    return windows.transpose(-2, -1)


def _support_sums(xq, qf, far_scale, key_shift, rq, cands: list[_Candidates], far: FarField):
    """Exact sums on the support and the far-field kernel sums on it, for a slab of query blocks.

    xq: (B, H, N, bq, d) scaled queries; qf: (B, H, N, bq, D) query features (feature-dot kernels);
    far_scale: (B, H, N, bq, 1): log of the far field's scale (query shift + key shift s_i);
    key_shift: (B, H, N, bq, 1): s_i; rq: (B, H, N, bq, 1): the queries' centering log-weights.
    Returns (exact, kernel, shift): (B, H, N, bq, dv + 1) sums relative to exp(shift) and to
    exp(far_scale) respectively, and the common log shift (B, H, N, bq, 1).
    """
    logits = [xq @ c.keys.transpose(-2, -1) for c in cands]  # (B, H, N, bq, C) each
    shift = far_scale
    for lg, c in zip(logits, cands, strict=True):
        top = lg.detach().masked_fill(~c.support, _NEG_INF).amax(dim=-1, keepdim=True)
        shift = torch.maximum(shift, top)
    exact = kernel = 0
    for lg, c in zip(logits, cands, strict=True):
        weights = torch.exp(lg.masked_fill(~c.support, _NEG_INF) - shift)  # (B, H, N, bq, C)
        exact = exact + weights @ c.values1
        klog = c.klog.transpose(-2, -1)  # (.., 1, C)
        key_scale = torch.exp((klog - key_shift).masked_fill(~c.support, _NEG_INF))  # (B, H, N, bq, C)
        if far.pair_value is not None:
            t = (lg - rq - klog).masked_fill(~c.support, 0.0)  # u_i . w_j from the exact logits
            pair = far.pair_value(t)
        else:
            pair = qf @ c.feats.transpose(-2, -1)  # (B, H, N, bq, C)
        kernel = kernel + (pair * key_scale) @ c.values1
    return exact, kernel, shift


def _route(x, y, mask, block_q: int, block_k: int, left: int, right: int, nb_routed: int) -> Tensor:
    """Top key blocks per query block, by the log-sum-exp of the block-mean query's logits.

    x: (B, H, Lp, d), y: (B, H, Lp, d) (Lp a multiple of block_q and block_k); mask (B, Lp) bool.
    Key blocks overlapping the query block's window span, and blocks without real keys, are never
    chosen. Returns the chosen key blocks' first positions (B, H, Nq, t) and whether each choice is
    real (B, H, Nq, t) (False when fewer than ``nb_routed`` blocks qualify).
    """
    B, H, Lp, d = x.shape
    Nq, Nk = Lp // block_q, Lp // block_k
    keep_q = mask[:, None, :, None].to(x.dtype)  # (B, 1, Lp, 1)
    xq = (x * keep_q).view(B, H, Nq, block_q, d).sum(3)
    xq = xq / keep_q.view(B, 1, Nq, block_q).sum(-1, keepdim=True).clamp_min(1)  # (B, H, Nq, d)
    scores = (xq @ y.transpose(-2, -1)).masked_fill(~mask[:, None, None, :], _NEG_INF)  # (B, H, Nq, Lp)
    scores = torch.logsumexp(scores.view(B, H, Nq, Nk, block_k), dim=-1)  # (B, H, Nq, Nk)
    q_start = torch.arange(Nq, device=x.device) * block_q
    k_start = torch.arange(Nk, device=x.device) * block_k
    overlaps = (k_start[None, :] <= (q_start[:, None] + block_q - 1 + right)) & (
        (k_start[None, :] + block_k - 1) >= (q_start[:, None] - left)
    )  # (Nq, Nk)
    scores = scores.masked_fill(overlaps, _NEG_INF)
    top = scores.detach().topk(min(nb_routed, Nk), dim=-1)  # (B, H, Nq, t)
    return top.indices * block_k, torch.isfinite(top.values)


# ----------------------------------------------------------------------------- entry point
def _check(q, k, v, projection, far, causal, key_padding_mask, local_window, num_global_tokens, routed_blocks,
           route_block_size, query_block_size, center, query_center, key_center, initial_state, return_state,
           chunk_size):  # fmt: skip
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "hybrid_attention expects q, k, v of shape (batch, heads, seq, head_dim); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if q.shape[:3] != k.shape[:3] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "hybrid_attention is self-attention: need q, k (B, H, L, d) and v (B, H, L, dv); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if far.uses_projection and (projection is None or projection.dim() != 2 or projection.shape[1] != q.shape[-1]):
        raise ValueError(
            f"far_field={far.name!r} needs a projection of shape (nb_features, head_dim={q.shape[-1]}); got "
            f"{None if projection is None else tuple(projection.shape)}. Draw it with draw_projection()."
        )
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq) = {(k.shape[0], k.shape[2])}; "
            f"got {tuple(key_padding_mask.shape)}."
        )
    for name, value, low in (("local_window", local_window, 0), ("num_global_tokens", num_global_tokens, 0),
                             ("routed_blocks", routed_blocks, 0), ("route_block_size", route_block_size, 1),
                             ("query_block_size", query_block_size, 1), ("chunk_size", chunk_size, 1)):  # fmt: skip
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    if causal and routed_blocks:
        raise ValueError(
            "routed_blocks is bidirectional only: routing a block of queries reads all of their "
            "queries and keys, which would leak future tokens in causal attention. Use routed_blocks=0."
        )
    if causal and center and (query_center is None or key_center is None):
        raise ValueError(
            "center=True computes centres from the whole sequence, which leaks the future in causal "
            "attention; pass fixed query_center and key_center (e.g. measured at conversion) instead."
        )
    if (initial_state is not None or return_state) and not causal:
        raise ValueError("initial_state / return_state only apply to causal attention (causal=True).")


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor | None = None,
    *,
    far_field: str = "softmax",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scaling: float | None = None,
    local_window: int = 0,
    num_global_tokens: int = 0,
    routed_blocks: int = 0,
    route_block_size: int = 8,
    query_block_size: int = 16,
    center: bool = False,
    query_center: Tensor | None = None,
    key_center: Tensor | None = None,
    far_field_parameter: Tensor | float | None = None,
    chunk_size: int = 128,
    initial_state: HybridState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, HybridState]:
    """Exact softmax attention on a sparse support plus a linear-time far field (see module docs).

    Args:
        q, k: ``(B, H, L, d)`` queries and keys; v: ``(B, H, L, dv)`` values (self-attention).
        projection: ``(m, d)`` random projection (:func:`draw_projection`) for the random-feature
            far fields; unused by ``"taylor2"`` and ``"poly2"``.
        far_field: ``"softmax"``, ``"softmax_hyperbolic"``, ``"softmax_opt"`` (FAVOR++), ``"taylor2"`` or ``"poly2"``.
        causal: query ``i`` sees keys ``j <= i`` only.
        key_padding_mask: ``(B, L)``, True/1 for real tokens.
        scaling: logit scale; defaults to ``d ** -0.5``.
        local_window: ``w``: every query computes exactly the ``w`` keys around it (bidirectional:
            ``(w - 1) // 2`` before and the rest after; causal: itself and the ``w - 1`` before).
            ``0``: no window. A window covering the whole sequence gives exact attention.
        num_global_tokens: ``g``: the first ``g`` keys are exact for every query, and (bidirectional)
            the first ``g`` queries attend exactly to every key (BigBird's global tokens).
        routed_blocks: bidirectional only: each block of ``query_block_size`` queries also computes
            exactly the ``routed_blocks`` key blocks of ``route_block_size`` keys with the largest
            log-sum-exp of logits against the block's mean query (content-based routing).
        center: centre queries and keys by their means over the sequence before the far-field
            kernel (bidirectional only; see module docs). ``query_center`` / ``key_center``
            (``(d,)``, ``(H, d)`` or ``(B, H, d)``, in units of the scaled queries/keys) fix the
            centres instead (required for causal centering).
        far_field_parameter: FAVOR++'s ``A`` (float or ``(H,)`` / ``(B, H)``); when ``None`` it is
            the closed-form optimum from the sequence's statistics (bidirectional only).
        chunk_size: positions per chunk of the causal prefix-sum scan (speed/memory only).
        initial_state: causal only: the :class:`HybridState` of the preceding tokens (decoding).
        return_state: causal only: also return the state after the last position.

    Returns:
        ``(B, H, L, dv)`` in the dtype of ``q``; with ``return_state`` a tuple ``(out, state)``.
    """
    far = get_far_field(far_field)
    _check(q, k, v, projection, far, causal, key_padding_mask, local_window, num_global_tokens, routed_blocks,
           route_block_size, query_block_size, center, query_center, key_center, initial_state, return_state,
           chunk_size)  # fmt: skip
    out_dtype = q.dtype
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, L, d = q.shape
    root = (d**-0.5 if scaling is None else scaling) ** 0.5
    x, y = q.to(dtype) * root, k.to(dtype) * root
    mask = (
        torch.ones(B, L, dtype=torch.bool, device=q.device)
        if key_padding_mask is None
        else key_padding_mask.to(device=q.device, dtype=torch.bool)
    )
    if projection is not None:
        projection = projection.to(device=q.device, dtype=dtype)

    # Centres a (queries) and c (keys): exp(x.y) = exp(x.c + a.y - a.c) exp((x - a).(y - c)).
    zero = x.new_zeros(1, 1, 1, d)
    a = _as_center(query_center, x) if query_center is not None else (_masked_mean(x, mask) if center else zero)
    c = _as_center(key_center, y) if key_center is not None else (_masked_mean(y, mask) if center else zero)
    rq = x @ c.transpose(-2, -1)  # (B, H, L, 1): x_i . c

    parameter = None
    if far.uses_parameter:
        if far_field_parameter is not None:
            parameter = torch.as_tensor(far_field_parameter, dtype=dtype, device=q.device)
            parameter = parameter.expand(B, H) if parameter.dim() else parameter
        elif causal:
            raise ValueError(
                f"far_field={far.name!r} in causal attention needs a fixed far_field_parameter (A per head): "
                "the closed-form optimum from the sequence's statistics would read future tokens."
            )
        else:
            parameter = optimal_parameter(pair_statistic(x - a, y - c, mask)).to(dtype)  # (B, H)

    qf, q_scale = _features(far, x - a, projection, parameter, rq)  # (B, H, L, D), (B, H, L, 1)
    keys = _key_side(k, v, mask, root, a, c, far, projection, parameter, dtype)  # y, v1, kf, klog, mask

    state = initial_state
    if causal:
        far_sum, shifts, far_kv, far_shift = _causal_far(
            qf, keys.feats, keys.klog, keys.values1, chunk_size,
            None if state is None else state.far_kv, None if state is None else state.far_shift,
        )  # fmt: skip
        key_shift = shifts.unsqueeze(-1)  # (B, H, L, 1): s_i
    else:
        far_sum, key_shift = _bidirectional_far(qf, keys.feats, keys.klog, keys.values1)
        key_shift = key_shift.expand(B, H, L, 1)
    left, right = _window_offsets(local_window, causal)
    offset = 0 if state is None else state.length

    # Keys a query may compute exactly besides its own sequence: the window buffer and the first
    # num_global_tokens keys of the preceding tokens (decoding), then this call's first ones.
    prefix = None
    if state is not None and left:
        prefix = _key_side(state.keys, state.values, state.key_mask, root, a, c, far, projection, parameter, dtype)
    globals_ = None
    if num_global_tokens:
        new = max(0, min(num_global_tokens - offset, L))
        globals_ = _slice_keys(keys, 0, new)
        if state is not None and state.global_keys.shape[2]:
            old = _key_side(state.global_keys, state.global_values, state.global_mask, root, a, c, far, projection,
                            parameter, dtype)  # fmt: skip
            globals_ = _cat_keys(old, globals_)

    out1 = _hybrid_sums(
        x, qf, q_scale, key_shift, rq, far_sum, keys, prefix, globals_, far, causal, left, right, offset,
        routed_blocks, route_block_size, query_block_size,
    )  # fmt: skip
    out = _normalise(out1)
    if not causal and num_global_tokens:
        out = _global_rows(x, keys, out, num_global_tokens)
    out = out.to(out_dtype)
    if not return_state:
        return out
    return out, _next_state(state, far_kv, far_shift, k, v, mask, local_window, num_global_tokens)


class _Keys(NamedTuple):
    """Scaled keys with everything the hybrid sums read; sequence axis 2 (mask: axis 1)."""

    y: Tensor  # (B, H, S, d)
    values1: Tensor  # (B, H, S, dv + 1): [v, 1], zero for padded keys
    feats: Tensor  # (B, H, S, D): far-field features, |.| <= 1 for the exponential kernels
    klog: Tensor  # (B, H, S, 1): their log scale (-inf for padded keys)
    mask: Tensor  # (B, S) bool


def _key_side(k, v, mask, root, a, c, far, projection, parameter, dtype) -> _Keys:
    y = k.to(dtype) * root
    rk = y @ a.transpose(-2, -1) - (a * c).sum(-1, keepdim=True)  # (B, H, S, 1): a . y_j - a . c
    feats, klog = _features(far, y - c, projection, parameter, rk)
    keep = mask[:, None, :, None]  # (B, 1, S, 1)
    klog = klog.masked_fill(~keep, _NEG_INF)  # padded keys vanish from the far field
    feats = feats * keep
    v = v.to(dtype) * keep
    return _Keys(y, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1), feats, klog, mask)


def _slice_keys(keys: _Keys, start: int, stop: int) -> _Keys:
    return _Keys(*(t[:, :, start:stop] for t in keys[:4]), keys.mask[:, start:stop])


def _cat_keys(first: _Keys, second: _Keys) -> _Keys:
    return _Keys(*(torch.cat([f, s], dim=2) for f, s in zip(first[:4], second[:4], strict=True)),
                 torch.cat([first.mask, second.mask], dim=1))  # fmt: skip


def _pad_keys(keys: _Keys, before: int, after: int) -> _Keys:
    """Add empty (masked) keys on both sides of the sequence axis."""
    if not before and not after:
        return keys
    y, values1, feats, klog = (F.pad(t, (0, 0, before, after)) for t in keys[:4])
    klog = F.pad(keys.klog, (0, 0, before, after), value=_NEG_INF)
    return _Keys(y, values1, feats, klog, F.pad(keys.mask, (before, after), value=False))


def _window_offsets(local_window: int, causal: bool) -> tuple[int, int]:
    """(left, right): query i computes keys i - left ... i + right exactly (right = -1: none)."""
    if not local_window:
        return 0, -1
    if causal:
        return local_window - 1, 0
    left = (local_window - 1) // 2
    return left, local_window - 1 - left


def _gather_positions(t: Tensor, key_pos: Tensor) -> Tensor:
    """t (B, H, S, X), key_pos (B, H, n, R) -> (B, H, n, R, X)."""
    flat = key_pos.flatten(2).unsqueeze(-1).expand(-1, -1, -1, t.shape[-1])  # (B, H, n * R, X)
    return t.gather(2, flat).view(*key_pos.shape, t.shape[-1])


def _hybrid_sums(x, qf, q_scale, key_shift, rq, far_sum, keys: _Keys, prefix, globals_, far: FarField, causal: bool,
                 left: int, right: int, offset: int, routed: int, block_k: int, block_q: int) -> Tensor:  # fmt: skip
    """Numerator|denominator (B, H, L, dv + 1) of the hybrid attention, relative to a per-query shift.

    The queries are processed by blocks of ``block_q``; block ``n`` reads its window keys
    ``[n * block_q - left, (n + 1) * block_q + right)``, the global keys and its routed key blocks.
    """
    B, H, L, d = x.shape
    period = math.lcm(block_q, block_k) if routed else block_q
    Lp = -(-L // period) * period
    N = Lp // block_q
    pad = Lp - L

    def by_block(t):  # (B, H, L, X) -> (B, H, N, block_q, X)
        return F.pad(t, (0, 0, 0, pad)).view(B, H, N, block_q, t.shape[-1])

    xq, far_scale_q, key_shift_q, rq_q, far_sum_q = map(by_block, (x, q_scale + key_shift, key_shift, rq, far_sum))
    qf_q = by_block(qf) if far.pair_value is None else None
    keys_p = _pad_keys(keys, 0, pad)
    positions = torch.arange(Lp, device=x.device).view(N, block_q, 1) + offset  # absolute query positions
    nb_global = globals_.y.shape[2] if globals_ is not None else 0

    def in_window(query_pos, key_pos):  # -> (.., n, block_q, C)
        gap = query_pos - key_pos
        return (gap >= -right) & (gap <= left)

    width = block_q + left + right
    if right >= 0:  # the window context: buffered keys (decoding) or nothing before, nothing after
        before = prefix if prefix is not None else _slice_keys(keys, 0, 0)
        window = _cat_keys(_pad_keys(before, left - before.y.shape[2], 0), _pad_keys(keys_p, 0, right))
        band = torch.arange(width, device=x.device)[None, :] - torch.arange(block_q, device=x.device)[:, None]
        band = (band >= 0) & (band <= left + right)  # (block_q, width): i - left <= j <= i + right
    routed_starts = None
    if routed:
        routed_starts, routed_real = _route(
            xq.view(B, H, Lp, d), keys_p.y, keys_p.mask, block_q, block_k, left, right, routed
        )

    nb_candidates = (width if right >= 0 else 0) + nb_global + routed * block_k
    per_block = block_q * nb_candidates * max(d, qf.shape[-1] if qf_q is not None else 1)
    slab = max(1, _SLAB_ELEMENTS // max(1, B * H * per_block))
    outputs = []
    for n0 in range(0, N, slab):
        n1 = min(N, n0 + slab)
        pos = positions[n0:n1]  # (n, block_q, 1)
        cands = []
        if right >= 0:
            lo, hi = n0 * block_q, n1 * block_q + left + right
            part = [_unfold_blocks(t[:, :, lo:hi], block_q, width, n1 - n0) for t in window[:4]]
            support = band & window.mask[:, lo:hi].unfold(1, width, block_q)[:, None, :, None, :]  # (B,1,n,bq,width)
            cands.append(_Candidates(*part, support))
        if nb_global:
            key_pos = torch.arange(nb_global, device=x.device)  # (G,)
            support = globals_.mask[:, None, None, None, :] & ~in_window(pos, key_pos)  # (B, 1, n, block_q, G)
            if causal:
                support = support & (key_pos <= pos)
            cands.append(_Candidates(*(t.unsqueeze(2) for t in globals_[:4]), support))
        if routed:
            starts = routed_starts[:, :, n0:n1]  # (B, H, n, t)
            key_pos = (starts.unsqueeze(-1) + torch.arange(block_k, device=x.device)).flatten(-2)  # (B, H, n, R)
            real = _gather_positions(keys_p.mask[:, None, :, None].expand(B, H, Lp, 1), key_pos).squeeze(-1)
            real = real & routed_real[:, :, n0:n1].repeat_interleave(block_k, dim=-1)  # (B, H, n, R)
            key_pos = key_pos.unsqueeze(-2)  # (B, H, n, 1, R)
            support = real.unsqueeze(-2) & ~in_window(pos, key_pos) & (key_pos >= nb_global)  # (B, H, n, bq, R)
            feats = _gather_positions(keys_p.feats, key_pos.squeeze(-2)) if qf_q is not None else None
            gathered = (_gather_positions(t, key_pos.squeeze(-2)) for t in (keys_p.y, keys_p.values1))
            cands.append(_Candidates(*gathered, feats, _gather_positions(keys_p.klog, key_pos.squeeze(-2)), support))
        rows = slice(n0, n1)
        far_scale = far_scale_q[:, :, rows]
        exact, kernel, shift = 0, 0, far_scale
        if cands:
            qf_rows = None if qf_q is None else qf_q[:, :, rows]
            exact, kernel, shift = _support_sums(
                xq[:, :, rows], qf_rows, far_scale, key_shift_q[:, :, rows], rq_q[:, :, rows], cands, far
            )
        far_part = torch.exp(far_scale - shift) * (far_sum_q[:, :, rows] - kernel)
        far_part = torch.cat([far_part[..., :-1], far_part[..., -1:].clamp_min(0)], dim=-1)  # no negative mass
        outputs.append(exact + far_part)
    return torch.cat(outputs, dim=2).view(B, H, Lp, -1)[:, :, :L]


def _global_rows(x, keys: _Keys, out, g: int) -> Tensor:
    """The first g queries attend exactly to every real key (bidirectional global tokens)."""
    g = min(g, x.shape[2])
    logits = (x[:, :, :g] @ keys.y.transpose(-2, -1)).masked_fill(~keys.mask[:, None, None, :], _NEG_INF)
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # (B, H, g, L)
    return torch.cat([weights @ keys.values1[..., :-1], out[:, :, g:]], dim=2)


def _next_state(state, far_kv, far_shift, k, v, mask, local_window: int, num_global_tokens: int) -> HybridState:
    """Append this call's raw keys/values to the window buffer and to the global prefix."""
    B, H, L, d = k.shape
    length = 0 if state is None else state.length
    if state is None:
        empty_k, empty_v, empty_m = k.new_zeros(B, H, 0, d), v.new_zeros(B, H, 0, v.shape[-1]), mask.new_zeros(B, 0)
        state = HybridState(far_kv, far_shift, empty_k, empty_v, empty_m, empty_k, empty_v, empty_m, 0)
    keep = max(local_window - 1, 0)
    keys = torch.cat([state.keys, k.to(state.keys.dtype)], dim=2)
    values = torch.cat([state.values, v.to(state.values.dtype)], dim=2)
    key_mask = torch.cat([state.key_mask, mask], dim=1)
    start = max(0, keys.shape[2] - keep)
    new = max(0, min(num_global_tokens - length, L))
    return HybridState(
        far_kv=far_kv,
        far_shift=far_shift,
        keys=keys[:, :, start:],
        values=values[:, :, start:],
        key_mask=key_mask[:, start:],
        global_keys=torch.cat([state.global_keys, k[:, :, :new].to(state.global_keys.dtype)], dim=2),
        global_values=torch.cat([state.global_values, v[:, :, :new].to(state.global_values.dtype)], dim=2),
        global_mask=torch.cat([state.global_mask, mask[:, :new]], dim=1),
        length=length + L,
    )
