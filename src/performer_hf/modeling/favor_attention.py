"""FAVOR+ attention: bidirectional and causal linear attention with random features.

Shapes follow the HF convention ``(batch, heads, seq, head_dim)``; ``m`` is the feature width.
All arithmetic is done in float32 (float64 for float64 inputs) and the output is cast back
to the input dtype.

Numerical safety without leaking the future:
- query features are shifted by their own row max ``m_i``, then the map's ``query_stabilizer`` is added:
  ``exp(log phi_r(q_i) - m_i) + stabilizer``, so that no normaliser is zero. The stabilizer is relative to the
  query's largest feature, so the output depends on ``m_i`` and its gradient goes through ``m_i`` (to the query's
  largest log-feature);
- key features are shifted by ``s_j``, the running max of the key log-features over
  positions ``<= j``. Query ``i`` sees every key ``j <= i`` rescaled to the common shift
  ``s_i`` through the factor ``exp(s_j - s_i) <= 1`` (the online-softmax trick), so no
  position after ``i`` influences output ``i``, not even through a stabilizer;
- bidirectional attention uses one shift per (batch, head): the max over all real keys.
The key shifts are constants for autograd (``detach``): each query's numerator and normaliser carry the same factor
``exp(-s_i)`` (``exp(-s)`` bidirectionally), which cancels exactly in the attention ratio.

The causal prefix sums run chunk by chunk: exact masked products inside a chunk and a
running ``(m, d + 1)`` state across chunks. Nothing of size ``L x m x d`` is ever stored.

Speed and memory: the feature maps with an exponential form (``softmax``, ``softmax_hyperbolic``: their
``FeatureMap.exp_directions``) run in the slabbed autograd functions of :mod:`.favor_exp`, which keep for
backward only the inputs, the chunk start states and the shifts. The other maps (relu, elu, softmax_trig) take
the plain autograd path below, which computes the same quantities.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .causal_scan import EMPTY_SHIFT, causal_scan
from .compiled_lengths import chunking
from .far_field_triton import float32_precision
from .favor_exp import (
    DEFAULT_CHUNK_SIZE,
    ExpFeatures,
    ScanKeys,
    bidirectional_exp_sums,
    causal_exp_sums,
    pad_to_chunks,
)
from .favor_features import FeatureMap, feature_map, get_feature_map

Tensor = torch.Tensor
ShiftFn = Callable[[Tensor], Tensor]


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
# Shifts: functions of the log-features (..., L, m) -> a tensor broadcastable to them. The keys' are detached (they
# cancel exactly in the attention ratio); the queries' row max is not (the stabilizer added after it is relative to it).


def _row_shift(log_features: Tensor) -> Tensor:
    """Per-row max (queries), differentiable: (B, H, L, m) -> (B, H, L, 1)."""
    return log_features.amax(dim=-1, keepdim=True)


def _global_shift(log_features: Tensor) -> Tensor:
    """One max over all real keys per (batch, head), detached: (B, H, L, m) -> (B, H, 1, 1); 0 if none."""
    shift = log_features.detach().amax(dim=(-2, -1), keepdim=True)
    return torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))


def _running_shift(prev_shift: Tensor) -> ShiftFn:
    """Running max over positions <= j, continuing from ``prev_shift`` (B, H), detached: -> (B, H, L, 1)."""

    def shift_of(log_features: Tensor) -> Tensor:
        row_max = log_features.detach().amax(dim=-1).nan_to_num(neginf=EMPTY_SHIFT)  # (B, H, L)
        row_max = row_max.maximum(prev_shift.unsqueeze(-1))
        return torch.cummax(row_max, dim=-1).values.unsqueeze(-1)

    return shift_of


def _features(
    x: Tensor, projection: Tensor, kernel: str, *, keep: Tensor | None, shift_of: ShiftFn, stabilizer: float = 0.0
) -> tuple[Tensor, Tensor | None]:
    """Features of any registered map, through autograd: (B, H, L, d) -> ((B, H, L, m'), shift or None).

    ``keep`` (B, 1, L, 1) zeroes the features of padded keys. The shift (``shift_of``'s: detached for keys, not for
    queries) is ``None`` for maps without an exponential part (relu, elu), which need none.
    """
    base, log_scale = get_feature_map(kernel).compute(x, projection)
    shift = None
    if log_scale is None:
        features = base if keep is None else base * keep
    else:
        if keep is not None:
            log_scale = log_scale.masked_fill(~keep, float("-inf"))
        shift = shift_of(log_scale)
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


def _exp_features(feature_map: FeatureMap, projection: Tensor) -> ExpFeatures | None:
    """The map's exponential form for :mod:`.favor_exp`, or None for maps without one."""
    if feature_map.exp_directions is None:
        return None
    return ExpFeatures(feature_map.exp_directions(projection), None, feature_map.query_stabilizer)


def _bidirectional(
    q: Tensor, k: Tensor, v1: Tensor, projection: Tensor, kernel: str, mask: Tensor | None, precision: str
) -> Tensor:
    """q: (B, H, Lq, d), k: (B, H, Lk, d), v1: (B, H, Lk, dv + 1) -> (B, H, Lq, dv + 1) (``precision``: the Triton
    kernels' float32 products, where they run)."""
    feature_map = get_feature_map(kernel)
    features = _exp_features(feature_map, projection)
    if features is not None:
        return bidirectional_exp_sums(q, k, v1, features, mask, precision)
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, Lk, 1)
    qf, _ = _features(q, projection, kernel, keep=None, shift_of=_row_shift, stabilizer=feature_map.query_stabilizer)
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
    precision: str,
) -> tuple[Tensor, FavorState]:
    """Chunked causal linear attention (``precision``: the Triton kernels' float32 products, where they run).

    q, k: (B, H, L, d), v1: (B, H, L, dv + 1) -> ((B, H, L, dv + 1), FavorState)
    """
    features = _exp_features(get_feature_map(kernel), projection)
    if features is not None:
        scan = causal_exp_sums(q, ScanKeys(k, v1, mask=mask), features, chunk_size, state, precision)
        return scan.sums, FavorState(scan.kv, scan.shift)
    L = q.shape[2]
    C, N = chunking(L, chunk_size)
    (q, k, v1), mask = pad_to_chunks([q, k, v1], mask, L, C, N)
    keep = None if mask is None else mask[:, None, :, None]  # (B, 1, N * C, 1)
    out1, state = _causal_generic(q, k, v1, projection, kernel, keep, C, N, state)
    return out1[:, :, :L], state


def _causal_generic(q, k, v1, projection, kernel, keep, C, N, state):
    """The chunked scan (:func:`.causal_scan`) for any feature map, through autograd (lengths already N chunks of
    C)."""
    B, H = q.shape[:2]
    prev_kv, prev_shift = (None, q.new_full((B, H), EMPTY_SHIFT)) if state is None else state
    stabilizer = get_feature_map(kernel).query_stabilizer
    qf, _ = _features(q, projection, kernel, keep=None, shift_of=_row_shift, stabilizer=stabilizer)
    kf, shifts = _features(k, projection, kernel, keep=keep, shift_of=_running_shift(prev_shift.to(q.dtype)))
    shifts = None if shifts is None else shifts.view(B, H, -1)  # (B, H, L)
    out, kv, shift = causal_scan(qf, kf, v1, shifts, C, prev_kv, prev_shift, chunks=N)
    return out, FavorState(kv=kv, shift=shift)


def check_attention_inputs(name: str, q, k, v, key_padding_mask, self_attention: bool) -> None:
    """Shapes of q, k, v and the key mask of the attention function ``name``; ``self_attention``: one
    key per query (as many queries as keys)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"{name} expects q, k, v of shape (batch, heads, seq, head_dim); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}."
        )
    if not (q.is_floating_point() and k.is_floating_point() and v.is_floating_point()):
        raise ValueError(
            f"{name} takes floating-point q, k, v (the output has q's dtype); got {q.dtype}, {k.dtype}, {v.dtype}. "
            "Convert them, e.g. q.float()."
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
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise ValueError(
            f"{name} got no {'query' if q.shape[2] == 0 else 'key'} (q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}): pass at least one token."
        )


def check_scaling(name: str, scaling: float | None) -> None:
    """The logit scale of the attention function ``name``: None (``head_dim ** -0.5``) or a positive, finite number
    (queries and keys are multiplied by its root)."""
    if scaling is not None and not 0 < scaling < math.inf:
        raise ValueError(f"{name} takes a positive, finite scaling (the logit scale) or None, got {scaling}.")


def refuse_other_state(name: str, differences: list[tuple[str, object, object]], fix: str) -> None:
    """Refuse a causal ``initial_state`` that was built for other calls of the attention function ``name``:
    ``differences`` holds (what, the state's, this call's) for each thing a state is made for; ``fix`` says what to
    pass instead."""
    wrong = [f"{what} is {held}, this call needs {need}" for what, held, need in differences if held != need]
    if wrong:
        raise ValueError(f"initial_state does not continue this {name} call: its {'; its '.join(wrong)}. {fix}")


@functools.cache
def feature_width(kernel: str, rows: int, head_dim: int) -> int:
    """How many features the map ``kernel`` gives with a projection of ``rows`` rows of width ``head_dim``: what a
    causal state holds per value column. Read from the map itself, on zeros on the CPU, once per shape."""
    probe = torch.zeros(1, head_dim, dtype=torch.float64)
    return feature_map(probe, torch.zeros(rows, head_dim, dtype=torch.float64), kernel).shape[-1]


def _check_state(state: FavorState, q: Tensor, v: Tensor, projection: Tensor, kernel: str) -> None:
    """The causal ``state`` continues this call: built for the same batch and heads, feature map and projection
    (its features) and value width. Shapes alone, read eagerly (a traced graph takes its state as it comes)."""
    if torch.compiler.is_compiling():
        return
    B, H = q.shape[:2]
    width = feature_width(kernel, *projection.shape)
    differences = [
        ("batch x heads", tuple(state.kv.shape[:2]), (B, H)),
        (f"features (kernel={kernel!r} with {projection.shape[0]} projection rows)", state.kv.shape[-2], width),
        ("value width + 1", state.kv.shape[-1], v.shape[-1] + 1),
    ]
    fix = "Continue a state with the batch, heads, kernel, projection and values it was built with, or start anew."
    refuse_other_state("favor_attention", differences, fix)


def _check_inputs(q, k, v, projection, kernel, causal, key_padding_mask, state, return_state, scaling):
    check_attention_inputs("favor_attention", q, k, v, key_padding_mask, self_attention=causal)
    check_scaling("favor_attention", scaling)
    if projection.dim() != 2 or projection.shape[1] != q.shape[-1]:
        raise ValueError(
            f"projection must have shape (nb_features, head_dim={q.shape[-1]}); got {tuple(projection.shape)}. "
            "Draw it with draw_projection(nb_features, head_dim)."
        )
    if (state is not None or return_state) and not causal:
        raise ValueError("initial_state / return_state only apply to causal attention (causal=True).")
    if state is not None:
        _check_state(state, q, v, projection, kernel)


# A padded query's entries beyond this magnitude (or not finite) are zeroed before any product: its own features
# would overflow (the polynomial far fields square its logits: 1e20 did in float32), and in the backward pass their
# inf times its output's zero gradient is NaN in the key sums every real query shares. Far above a real query's
# entries, so that ordinary padding keeps its outputs.
PADDED_QUERY_LIMIT = 1e4


def scrub_padded_queries(q: Tensor, padded: Tensor) -> Tensor:
    """``q`` (B, H, L, d) with the entries of its padded rows (``padded``: (B, 1, L, 1), True at padding) that are not
    finite or exceed :data:`PADDED_QUERY_LIMIT` in magnitude zeroed: padded tokens may hold anything."""
    return q.masked_fill(padded & ~(q.abs() <= PADDED_QUERY_LIMIT), 0.0)


def _prepared(q, k, v, projection, scaling: float | None, key_padding_mask: Tensor | None, causal: bool):
    """The inputs in the compute dtype (float64 stays float64, the rest computes in float32): q and k scaled by the
    root of the logit scale (padded keys zeroed; causally, padded queries scrubbed), the values with a ones column
    (padded ones zeroed), the projection, the mask as bool.
    -> q, k (B, H, L, d), v1 (B, H, Lk, dv + 1), projection (m, d), mask (B, Lk) or None"""
    compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = (q.shape[-1] ** -0.5 if scaling is None else scaling) ** 0.5
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    mask = None if key_padding_mask is None else key_padding_mask.to(torch.bool)
    if mask is not None:  # padded tokens may hold anything: their keys' features are left out, yet 0 * inf is NaN
        padded = ~mask[:, None, :, None]  # (B, 1, Lk, 1)
        k, v = k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
        if causal:  # self-attention: the padded tokens' own queries (bidirectionally q may be another sequence's)
            q = scrub_padded_queries(q, padded)
    v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # (B, H, Lk, dv + 1)
    return q * scale, k * scale, v1, projection.to(compute_dtype), mask


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
        key_padding_mask: ``(B, Lk)``, True/1 for real tokens; padded keys get zero features and may hold
            anything. Causally (self-attention) the padded tokens' queries may too; bidirectionally ``q`` may be
            another sequence's, so the queries are used as given.
        scaling: logit scale; defaults to ``d ** -0.5``. q and k are each multiplied by its root.
        chunk_size: positions per chunk of the causal scan (memory/speed trade-off only).
        initial_state: causal only: the :class:`FavorState` of the preceding tokens (decoding).
        return_state: causal only: also return the state after the last position.

    Returns:
        ``(B, H, Lq, dv)`` in the dtype of ``q``; with ``return_state`` a tuple ``(out, state)``.
    """
    _check_inputs(q, k, v, projection, kernel, causal, key_padding_mask, initial_state, return_state, scaling)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    out_dtype = q.dtype
    q, k, v1, projection, mask = _prepared(q, k, v, projection, scaling, key_padding_mask, causal)

    # The kernels compute in compute_dtype on purpose; autocast must not lower their matmuls
    # (the autograd functions' saved tensors would disagree in dtype with their backward).
    with torch.autocast(q.device.type, enabled=False):
        precision = float32_precision(out_dtype)
        if causal:
            out1, state = _causal(q, k, v1, projection, kernel, mask, chunk_size, initial_state, precision)
        else:
            out1, state = _bidirectional(q, k, v1, projection, kernel, mask, precision), None
        out = _divide_or_zero(out1).to(out_dtype)
    return (out, state) if return_state else out
