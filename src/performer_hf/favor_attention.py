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

The causal prefix sums run chunk by chunk: exact masked products inside a chunk and a
running ``(m, d + 1)`` state across chunks. Nothing of size ``L x m x d`` is ever stored.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .favor_features import get_feature_map

Tensor = torch.Tensor

# Stand-in for "no key seen yet" in the running shift: finite, so that differences stay defined.
_EMPTY_SHIFT = -1e30
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


def _query_features(q: Tensor, projection: Tensor, kernel: str) -> Tensor:
    """phi(q) up to a per-query constant: (B, H, L, d) -> (B, H, L, m)."""
    fmap = get_feature_map(kernel)
    base, log_scale = fmap.compute(q, projection)
    if log_scale is None:
        features = base
    else:
        log_scale = log_scale - log_scale.amax(dim=-1, keepdim=True).detach()
        features = torch.exp(log_scale) if base is None else base * torch.exp(log_scale)
    return features + fmap.query_stabilizer if fmap.query_stabilizer else features


def _key_log_features(k: Tensor, projection: Tensor, kernel: str, mask: Tensor | None):
    """phi(k) as (base, log_scale), with padded keys removed: log = -inf or base = 0."""
    base, log_scale = get_feature_map(kernel).compute(k, projection)
    if mask is not None:
        keep = mask[:, None, :, None]  # (B, 1, L, 1)
        if log_scale is not None:
            log_scale = log_scale.masked_fill(~keep, float("-inf"))
        else:
            base = base * keep
    return base, log_scale


def _combine(base: Tensor | None, log_scale: Tensor, shift: Tensor) -> Tensor:
    scaled = torch.exp(log_scale - shift)
    return scaled if base is None else base * scaled


def _normalise(out1: Tensor) -> Tensor:
    """(…, d + 1) numerator|denominator -> (…, d); 0 where no key was visible."""
    numerator, denominator = out1[..., :-1], out1[..., -1:]
    return numerator / denominator.clamp_min(torch.finfo(out1.dtype).tiny)


def _bidirectional(qf: Tensor, k_base, k_log, v1: Tensor) -> Tensor:
    """qf: (B, H, Lq, m), v1: (B, H, Lk, d + 1) -> (B, H, Lq, d + 1)."""
    if k_log is None:
        kf = k_base
    else:
        shift = k_log.amax(dim=(-2, -1), keepdim=True).detach()  # (B, H, 1, 1)
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        kf = _combine(k_base, k_log, shift)  # (B, H, Lk, m)
    kv = kf.transpose(-2, -1) @ v1  # (B, H, m, d + 1)
    return qf @ kv


def _causal(qf: Tensor, k_base, k_log, v1: Tensor, chunk_size: int, state: FavorState | None):
    """Chunked causal linear attention.

    qf: (B, H, L, m), v1: (B, H, L, d + 1) -> ((B, H, L, d + 1), FavorState)
    """
    B, H, L, m = qf.shape
    d1 = v1.shape[-1]
    if state is None:
        kv = qf.new_zeros(B, H, m, d1)
        prev_shift = qf.new_full((B, H), _EMPTY_SHIFT)
    else:
        kv, prev_shift = state.kv.to(qf.dtype), state.shift.to(qf.dtype)

    if k_log is None:
        kf = k_base  # (B, H, L, m)
        shifts = prev_shift.unsqueeze(-1).expand(B, H, L)  # constant: no rescaling needed
    else:
        row_max = k_log.amax(dim=-1).detach()  # (B, H, L)
        row_max = row_max.nan_to_num(neginf=_EMPTY_SHIFT).maximum(prev_shift.unsqueeze(-1))
        shifts = torch.cummax(row_max, dim=-1).values  # (B, H, L): s_j, max over positions <= j
        kf = _combine(k_base, k_log, shifts.unsqueeze(-1))  # (B, H, L, m), entries <= 1

    # Split into N chunks of C positions; the tail is padded with empty keys.
    C = min(chunk_size, L)
    N = -(-L // C)
    pad = N * C - L
    if pad:
        qf = torch.nn.functional.pad(qf, (0, 0, 0, pad))
        kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
        v1 = torch.nn.functional.pad(v1, (0, 0, 0, pad))
        shifts = torch.nn.functional.pad(shifts, (0, pad), mode="replicate")
    qc = qf.view(B, H, N, C, m)
    kc = kf.view(B, H, N, C, m)
    vc = v1.view(B, H, N, C, d1)
    sc = shifts.reshape(B, H, N, C)

    # Intra-chunk: exact masked products, key j rescaled to query i's shift by exp(s_j - s_i).
    causal_mask = torch.ones(C, C, dtype=torch.bool, device=qf.device).tril()  # (C, C)
    log_decay = sc.unsqueeze(-2) - sc.unsqueeze(-1)  # (B, H, N, C, C): [i, j] = s_j - s_i
    decay = torch.exp(log_decay.masked_fill(~causal_mask, float("-inf")))
    scores = (qc @ kc.transpose(-2, -1)) * decay  # (B, H, N, C, C)
    out = scores @ vc  # (B, H, N, C, d + 1)

    # Per-chunk summaries, relative to the shift at the chunk's last position.
    chunk_shift = sc[..., -1]  # (B, H, N)
    to_chunk_end = torch.exp(sc - chunk_shift.unsqueeze(-1)).unsqueeze(-1)  # (B, H, N, C, 1)
    chunk_kv = (kc * to_chunk_end).transpose(-2, -1) @ vc  # (B, H, N, m, d + 1)

    # Exclusive scan over chunks: the state each chunk starts from, and its shift.
    # (unbind, not indexing: the backward of each index would write a full-size zero gradient)
    states, state_shifts = [], []
    for chunk_kv_n, chunk_shift_n in zip(chunk_kv.unbind(2), chunk_shift.unbind(2), strict=True):
        states.append(kv)
        state_shifts.append(prev_shift)
        kv = kv * torch.exp(prev_shift - chunk_shift_n)[..., None, None] + chunk_kv_n
        prev_shift = chunk_shift_n
    start_kv = torch.stack(states, dim=2)  # (B, H, N, m, d + 1)
    start_shift = torch.stack(state_shifts, dim=2)  # (B, H, N)

    # Inter-chunk: each query reads its chunk's start state, rescaled to its own shift.
    to_query = torch.exp(start_shift.unsqueeze(-1) - sc).unsqueeze(-1)  # (B, H, N, C, 1)
    out = out + (qc @ start_kv) * to_query
    out = out.reshape(B, H, N * C, d1)[:, :, :L]
    return out, FavorState(kv=kv, shift=prev_shift)


def _check_inputs(q, k, v, projection, causal, key_padding_mask, state, return_state):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "favor_attention expects q, k, v of shape (batch, heads, seq, head_dim); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "q, k, v disagree: need q (B, H, Lq, d), k (B, H, Lk, d), v (B, H, Lk, dv); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if projection.dim() != 2 or projection.shape[1] != q.shape[-1]:
        raise ValueError(
            f"projection must have shape (nb_features, head_dim={q.shape[-1]}); got {tuple(projection.shape)}. "
            "Draw it with draw_projection(nb_features, head_dim)."
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs as many queries as keys; got {q.shape[2]} and {k.shape[2]}.")
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
        raise ValueError(
            f"key_padding_mask must have shape (batch, seq) = {(k.shape[0], k.shape[2])}; "
            f"got {tuple(key_padding_mask.shape)}."
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

    qf = _query_features(q, projection, kernel)  # (B, H, Lq, m)
    k_base, k_log = _key_log_features(k, projection, kernel, mask)
    if mask is not None:
        v = v * mask[:, None, :, None]
    v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # (B, H, Lk, dv + 1)

    if causal:
        out1, state = _causal(qf, k_base, k_log, v1, chunk_size, initial_state)
    else:
        out1, state = _bidirectional(qf, k_base, k_log, v1), None
    out = _normalise(out1).to(out_dtype)
    return (out, state) if return_state else out
