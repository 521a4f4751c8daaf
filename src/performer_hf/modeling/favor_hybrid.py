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
(routing scores ``L / query_block_size`` block means against ``L / route_block_size`` key-block means:
quadratic, but ``query_block_size * route_block_size`` times smaller than the logit matrix; with
``route_group_size`` G it scores groups of G key blocks first, G times fewer, and then only the chosen groups'
blocks, a fixed number per query block).

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

On the CPU, bidirectional attention with a polynomial far field runs in compiled kernels
(:mod:`.hybrid_compiled`, forward and backward): the far-field state and sums in register tiles without
materialising features, the routing's top-k, and the support sums in one pass per block of queries
instead of a dozen (queries x candidates) temporaries. Other far fields, causal attention and GPUs use
the PyTorch code below, which the kernels are tested against; in training it recomputes each slab in
backward (:func:`.slabs.recomputed`), so that no slab's temporaries are kept. A causal pass from the first
token with an exponential far field (FAVOR+, FAVOR++) scans its far field in the fused chunked scan of
causal FAVOR+ (:func:`.favor_attention.causal_exp_sums`), whose features live one slab at a time.

Numerics mirror :mod:`.favor_attention`: query features are shifted by their own row max, key
features by the max over keys (bidirectional) or by a running max over positions ``<= j``
(causal), so causal outputs never depend on later positions.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .favor_attention import causal_exp_sums, check_attention_inputs
from .favor_optimal import optimal_parameter, pair_statistic
from .hybrid_compiled import compiled_far_apply, compiled_far_state, fused_sums, support_kernels
from .hybrid_far_field import (
    FarContext,
    FarField,
    causal_far_state,
    causal_far_sums,
    far_features,
    get_far_field,
    quadratic_apply,
    quadratic_state,
)
from .hybrid_keys import (
    NEG_INF,
    Keys,
    cat_keys,
    gather_blocks,
    key_blocks,
    key_side,
    pad_keys,
    route,
    slice_keys,
    window_offsets,
)
from .slabs import recomputed, slab_sizes

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- decoding state
@dataclass(frozen=True)
class HybridSpec:
    """The settings of hybrid attention (``PerformerConfig``'s hybrid fields); see :func:`hybrid_attention`
    for each field's meaning. Validated on construction."""

    far_field: str = "softmax"
    local_window: int = 0
    num_global_tokens: int = 0
    routed_blocks: int = 0
    route_block_size: int = 8
    route_group_size: int = 0
    query_block_size: int = 16
    center: bool = False
    chunk_size: int = 128

    def __post_init__(self):
        get_far_field(self.far_field)  # an unknown name raises, listing the far fields
        for name, low in (("local_window", 0), ("num_global_tokens", 0), ("routed_blocks", 0), ("route_block_size", 1),
                          ("route_group_size", 0), ("query_block_size", 1), ("chunk_size", 1)):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")

    def covers(self, length: int, causal: bool) -> bool:
        """Whether every query of a ``length``-token input computes every key it sees exactly (its window or
        the global tokens reach them all): hybrid attention is then exact softmax attention."""
        left, right = window_offsets(self.local_window, causal)
        # how far every query's window reaches on its shorter side (-1: no window, not even the query itself)
        reach = -1 if right < 0 else (left if causal else min(left, right))
        # keys past the first num_global_tokens must all lie within that reach of every later query
        return length <= self.num_global_tokens + reach + 1

    def check_direction(self, causal: bool, fixed_centres: bool, stateful: bool) -> None:
        """Refuse settings that would read future tokens in causal attention, or a state without it."""
        if causal and self.routed_blocks:
            raise ValueError(
                "routed_blocks is bidirectional only: routing a block of queries reads all of their "
                "queries and keys, which would leak future tokens in causal attention. Use routed_blocks=0."
            )
        if causal and self.center and not fixed_centres:
            raise ValueError(
                "center=True computes centres from the whole sequence, which leaks the future in causal "
                "attention; pass fixed query_center and key_center (e.g. measured at conversion) instead."
            )
        if stateful and not causal:
            raise ValueError("initial_state / return_state only apply to causal attention (causal=True).")


class HybridState(NamedTuple):
    """Recurrent state of causal hybrid attention after a prefix of ``length`` tokens.

    Constant size in the prefix length: the far-field state plus the last ``local_window - 1``
    keys and values (a ring buffer in effect) and the ``num_global_tokens`` first ones.

    Attributes:
        far_kv: ``(B, H, D, dv + 1)``: ``sum_j phi_k(y_j) [v_j, 1]^T`` over the previous keys outside the next
            query's exact support (those before the buffer, except the global tokens), relative to ``far_shift``.
            A decoding step reads it as its far field, adds the one key that leaves the window, and never
            evaluates the far-field kernel on its support.
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
def fixed_centres(q: Tensor, k: Tensor, key_padding_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal hybrid attention's fixed centres (``query_center``, ``key_center``): the mean query and key per head
    ``(H, d)`` over the real tokens of q, k ``(B, H, L, d)``, in units of q and k times ``d ** -0.25``."""
    B, _, L, d = q.shape
    real = torch.ones(B, L, dtype=torch.bool, device=q.device) if key_padding_mask is None else key_padding_mask
    real = real[:, -L:].bool()  # (B, L): the queries' own tokens
    x, y = (t.transpose(1, 2)[real] * d**-0.25 for t in (q, k))  # (N, H, d): scaled, real tokens
    return x.mean(0), y.mean(0)


def _masked_mean(t: Tensor, mask: Tensor) -> Tensor:
    """(B, H, L, d) -> (B, H, 1, d): mean over real positions (zeros where there are none)."""
    keep = mask[:, None, :, None].to(t.dtype)  # (B, 1, L, 1)
    return (t * keep).sum(dim=-2, keepdim=True) / keep.sum(dim=-2, keepdim=True).clamp_min(1)


def _as_center(center: Tensor, like: Tensor) -> Tensor:
    """A centre given as (d,), (H, d) or (B, H, d) -> (B or 1, H or 1, 1, d) in ``like``'s dtype."""
    center = center.to(device=like.device, dtype=like.dtype)
    while center.dim() < 3:
        center = center.unsqueeze(0)
    return center.unsqueeze(-2)


def _log_gain(gain: Tensor | float | list[float], like: Tensor) -> Tensor:
    """A far-field gain given as a float, (H,) or (B, H) -> its log (1 or B, 1 or H, 1, 1), in ``like``'s dtype."""
    gain = torch.as_tensor(gain, device=like.device).to(like.dtype)
    if bool((gain <= 0).any()):
        raise ValueError(f"far_field_gain must be positive (a factor on the far-field kernel); got {gain.tolist()}.")
    while gain.dim() < 2:
        gain = gain.unsqueeze(0)
    return gain.log()[..., None, None]


def _divide_clamped(out1: Tensor) -> Tensor:
    """(..., dv + 1) numerator|denominator -> (..., dv); 0 where nothing was visible."""
    return out1[..., :-1] / out1[..., -1:].clamp_min(torch.finfo(out1.dtype).tiny)


# ----------------------------------------------------------------------------- far field sums
def _exact_and_far_sums(xq, far_scale, far_sum, groups) -> Tensor:
    """Hybrid numerator|denominator for a slab of query blocks whose far sums leave out the exact support
    (see :func:`_support_sums` for the shapes): exact softmax weights on the support plus the far field,
    relative to a per-query shift. -> (B, H, n, bq, dv + 1)"""
    exact = [(xq @ fields[0].transpose(-2, -1)).masked_fill(~support, NEG_INF) for fields, support in groups]
    shift = far_scale
    for ex in exact:
        shift = torch.maximum(shift, ex.detach().amax(dim=-1, keepdim=True))  # (B, H, n, bq, 1)
    sums = torch.exp(far_scale - shift) * far_sum
    for ex, (fields, _) in zip(exact, groups, strict=True):
        sums = sums + torch.exp(ex - shift) @ fields[1]  # (B, H, n, bq, dv + 1)
    return sums


def _support_sums(xq, qf, rq, far_scale, key_shift, far_sum, groups, quadratic) -> Tensor:
    """Bidirectional hybrid numerator|denominator for a slab of query blocks.

    xq: (B, H, n, bq, d); qf: (B, H, n, bq, D) query features (random-feature kernels) or None;
    rq: (B, H, n, bq, 1) the queries' centering log-weights; far_scale: (B, H, n, bq, 1) log of the far
    field's scale (query shift + key shift s); key_shift: (B, H, n, bq, 1) s, the same for every query;
    far_sum: (B, H, n, bq, dv + 1) kernel sums over all visible keys
    relative to exp(far_scale); groups: candidate key sets ``([y, values1, klog(, feats)], support)``
    with tensors (B, H, n, C, X) and support (B, H, n, bq, C): is key c in E(i)?
    Returns (B, H, n, bq, dv + 1) relative to a per-query shift.
    """
    logits = [xq @ fields[0].transpose(-2, -1) for fields, _ in groups]  # (B, H, n, bq, C) each
    exact = [lg.masked_fill(~support, NEG_INF) for lg, (_, support) in zip(logits, groups, strict=True)]
    shift = far_scale
    for ex in exact:
        shift = torch.maximum(shift, ex.detach().amax(dim=-1, keepdim=True))  # (B, H, n, bq, 1)
    far_weight = torch.exp(far_scale - shift)
    numerator = kernel_mass = 0
    for lg, ex, (fields, support) in zip(logits, exact, groups, strict=True):
        klog = fields[2].transpose(-2, -1).clamp_min(torch.finfo(lg.dtype).min)  # (B, H, n, 1, C); finite
        if quadratic is not None:
            t = (lg - rq - klog).masked_fill(~support, 0.0)  # (x_i - a) . (y_j - c), from the exact logits
            pair = torch.addcmul(1 + t, t, t, value=quadratic)
        else:
            pair = qf @ fields[3].transpose(-2, -1)
        pair = (pair * torch.exp(klog - key_shift[..., :1, :])).masked_fill(~support, 0.0)  # a per-key factor
        weights = torch.addcmul(torch.exp(ex - shift), far_weight, pair, value=-1)  # exact minus kernel on E(i)
        numerator = numerator + weights @ fields[1]  # (B, H, n, bq, dv + 1)
        kernel_mass = kernel_mass + pair.sum(dim=-1, keepdim=True)
    # far field = all keys minus the support; its mass cannot be negative (rounding)
    values = numerator[..., :-1] + far_weight * far_sum[..., :-1]
    mass = numerator[..., -1:] + far_weight * torch.maximum(far_sum[..., -1:], kernel_mass)
    return torch.cat([values, mass], dim=-1)


def _check(q, k, v, projection, far: FarField, key_padding_mask) -> None:
    """Shapes of the tensor inputs (the settings are checked by :class:`HybridSpec`)."""
    check_attention_inputs("hybrid_attention (self-attention)", q, k, v, key_padding_mask, self_attention=True)
    if far.uses_projection and (projection is None or projection.dim() != 2 or projection.shape[1] != q.shape[-1]):
        raise ValueError(
            f"far_field={far.name!r} needs a projection of shape (nb_features, head_dim={q.shape[-1]}); got "
            f"{None if projection is None else tuple(projection.shape)}. Draw it with draw_projection()."
        )


def hybrid_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor | None = None,
    spec: HybridSpec | None = None,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    scaling: float | None = None,
    query_center: Tensor | None = None,
    key_center: Tensor | None = None,
    far_field_parameter: Tensor | float | None = None,
    far_field_gain: Tensor | float | list[float] | None = None,
    initial_state: HybridState | None = None,
    return_state: bool = False,
    **settings,
) -> Tensor | tuple[Tensor, HybridState]:
    """Exact softmax attention on a sparse support plus a linear-time far field (see module docs).

    The settings come as a :class:`HybridSpec` (``spec``) or as its fields by keyword (``far_field=``,
    ``local_window=``, ...; over ``spec`` when both are given).

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
            exactly the ``routed_blocks`` key blocks of ``route_block_size`` keys with the largest mean
            logit against its queries (content-based routing; the window's blocks are not candidates).
        route_group_size: ``G`` > 0: routing scores only the key blocks of the ``routed_blocks`` groups of
            ``G`` consecutive key blocks ranked best by an upper bound on their best block's score
            (group mean and radius): its quadratic term (one bound per query block and group) is ``G``
            times smaller, the rest linear in the length; ``0``: every key block is scored. The two agree
            while the key blocks form no more than ``routed_blocks`` groups.
        center: centre queries and keys by their means over the sequence before the far-field
            kernel (bidirectional only; see module docs). ``query_center`` / ``key_center``
            (``(d,)``, ``(H, d)`` or ``(B, H, d)``, in units of the scaled queries/keys) fix the
            centres instead (required for causal centering).
        far_field_parameter: FAVOR++'s ``A`` (float or ``(H,)`` / ``(B, H)``); when ``None`` it is
            the closed-form optimum from the sequence's statistics (bidirectional only).
        far_field_gain: a positive factor on the far-field kernel (float or ``(H,)`` / ``(B, H)``): the far
            field's weight against the exact support (``None``: 1). Attention transfer learns it per head.
        chunk_size: positions per chunk of the causal prefix-sum scan (speed/memory only).
        query_center, key_center: fixed centres (see ``center``).
        initial_state: causal only: the :class:`HybridState` of the preceding tokens (decoding).
        return_state: causal only: also return the state after the last position.

    Returns:
        ``(B, H, L, dv)`` in the dtype of ``q``; with ``return_state`` a tuple ``(out, state)``.
    """
    if spec is None:
        spec = HybridSpec(**settings)
    elif settings:  # a model passes its spec alone: no copy (and no re-validation) per layer and call
        spec = dataclasses.replace(spec, **settings)
    far = get_far_field(spec.far_field)
    _check(q, k, v, projection, far, key_padding_mask)
    spec.check_direction(causal, query_center is not None and key_center is not None, stateful=
                         initial_state is not None or return_state)  # fmt: skip
    local_window, num_global_tokens = spec.local_window, spec.num_global_tokens
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
    a = _as_center(query_center, x) if query_center is not None else (_masked_mean(x, mask) if spec.center else zero)
    c = _as_center(key_center, y) if key_center is not None else (_masked_mean(y, mask) if spec.center else zero)
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

    # (the compiled kernels read the queries' centering weights as the far field's scale: no gain there)
    compiled = not causal and far.quadratic is not None and far_field_gain is None
    kernels = support_kernels(q, k, v) if compiled else None
    state = initial_state
    ctx = FarContext(root, a, c, far, projection, parameter, dtype)
    # Causal: the support's keys need no far-field features (the far field never holds them); bidirectional: the
    # random-feature far fields subtract their kernel on the support.
    keys = key_side(k, v, mask, ctx, with_features=not causal and far.quadratic is None)
    log_gain = 0.0 if far_field_gain is None else _log_gain(far_field_gain, x)  # (.., H or 1, 1, 1)

    # Keys a query may compute exactly besides its own sequence: the window buffer and the first
    # num_global_tokens keys of the preceding tokens (decoding), then this call's first ones.
    offset = 0 if state is None else state.length
    left, right = window_offsets(local_window, causal)
    prefix = None
    if state is not None and left:
        prefix = key_side(state.keys, state.values, state.key_mask, ctx, with_features=False)
    globals_ = None
    if num_global_tokens:
        globals_ = slice_keys(keys, 0, max(0, min(num_global_tokens - offset, L)))
        if state is not None and state.global_keys.shape[2]:
            old = key_side(state.global_keys, state.global_values, state.global_mask, ctx, with_features=False)
            globals_ = cat_keys(old, globals_)

    far_kv = far_shift = None
    if causal and state is not None and L == 1:  # a decoding step: no scan, no query blocks
        out1, far_kv, far_shift = _decoding_step(x, rq, keys, (prefix, globals_), state, k, v, mask, ctx, spec,
                                                 log_gain)  # fmt: skip
    else:
        if causal:
            # A pass from the start with an exponential far field scans fused (features per slab, never stored)
            fused_scan = state is None and far.exp_form is not None
            leaving = _LeavingKeys(state, k, v, mask, ctx, spec)
            rows = leaving.rows(features=not fused_scan)
            if fused_scan:
                far_side, far_kv, far_shift = _fused_causal_far(far, x - a, rq, rows, ctx, spec)
            else:
                qf, q_scale = far_features(far, x - a, projection, parameter, rq)  # (B, H, L, D), (B, H, L, 1)
                far_sum, shifts, far_kv, far_shift = causal_far_sums(
                    qf, rows.feats, rows.klog, rows.values1, spec.chunk_size,
                    None if state is None else state.far_kv, None if state is None else state.far_shift,
                )  # fmt: skip
                far_side = _CausalFar(q_scale, shifts.unsqueeze(-1), far_sum)
            if return_state:
                far_kv, far_shift = _with_keys(far_kv, far_shift, leaving.after())
        else:
            far_side = _BidirectionalFar(far, x - a, rq, keys, c, projection, parameter, kernels)
        far_side.log_gain = log_gain
        if kernels is not None:
            out1 = fused_sums(kernels, x, far_side, keys, spec)
        else:
            out1 = _hybrid_sums(x, rq, far_side, keys, (prefix, globals_), spec, causal, offset)
    out = _divide_clamped(out1)
    if not causal and num_global_tokens:
        out = _global_rows(x, keys, out, num_global_tokens)
    out = out.to(out_dtype)
    if not return_state:
        return out
    return out, _next_state(state, far_kv, far_shift, k, v, mask, local_window, num_global_tokens)


class _CausalFar:
    """Far-field quantities of causal attention, precomputed for the whole sequence by the chunked scan, which
    reads only the keys outside each query's exact support (``excludes_support``). ``log_gain``: the far field's
    log gain (broadcast to (B, H, L, 1)), part of the query-side scale."""

    excludes_support = True
    log_gain: Tensor | float = 0.0

    def __init__(self, q_scale, key_shift, far_sum):
        self.q_scale, self.key_shift, self.far_sum = q_scale, key_shift, far_sum

    def query_side(self):
        """-> (None, q_scale, key_shift, far_sum), each (B, H, L, X)."""
        return None, self.q_scale + self.log_gain, self.key_shift, self.far_sum


class _LeavingKeys:
    """The keys that leave the exact window during a causal call, for the far field.

    Query ``i`` computes exactly its window (itself and the ``local_window - 1`` keys before it) and the global
    tokens; its far field reads every other earlier key. The state's far field holds the keys before its window
    buffer (every later query reads them), the buffer the last ``local_window - 1`` keys. During a call of L
    tokens, the buffer's keys and then the call's own leave the window, one per query: the key at position
    ``i - local_window`` leaves at query ``i``. Indices below count the buffer's keys, then the call's: the first
    ``read`` leaving keys are read by this call's queries, the rest (up to ``count``; at most one) join the state
    after the call. The global tokens never enter the far field, and no key on a query's support needs far-field
    features.

    k, v (B, H, L, d / dv), mask (B, L): this call's.
    """

    def __init__(self, state: HybridState | None, k, v, mask, ctx: FarContext, spec: HybridSpec):
        self.state, self.k, self.v, self.mask, self.ctx, self.spec = state, k, v, mask, ctx, spec
        self.window, self.length = spec.local_window, k.shape[2]
        self.buffered = 0 if state is None else state.keys.shape[2]  # positions start - buffered, ..., start - 1
        self.start = 0 if state is None else state.length  # the position of this call's first token
        self.count = max(0, self.buffered + self.length - max(self.window - 1, 0))
        self.read = max(0, min(self.count, self.length - self.window + self.buffered))

    def keys(self, first: int, stop: int, features: bool) -> Keys:
        """The leaving keys ``[first, stop)`` (with far-field features when ``features``; otherwise ``klog`` is the
        centering term alone), -inf log-scale for the global tokens."""
        k, v, mask = self._raw(first, stop)
        part = key_side(k, v, mask, self.ctx, features)
        is_global = (
            torch.arange(first, stop, device=k.device) + self.start - self.buffered < self.spec.num_global_tokens
        )
        return part._replace(klog=part.klog.masked_fill(is_global[:, None], NEG_INF))  # (.., 1): never far

    def _raw(self, first: int, stop: int):
        """Raw keys, values (B, H, n, d / dv) and mask (B, n) at ``[first, stop)`` of (the buffer, this call)."""
        b, state = self.buffered, self.state
        parts = []
        if first < b:
            end = min(stop, b)
            buffer = (state.keys[:, :, first:end], state.values[:, :, first:end], state.key_mask[:, first:end])
            parts.append((buffer[0].to(self.k.dtype), buffer[1].to(self.v.dtype), buffer[2]))
        if stop > b or not parts:
            lo, hi = max(first - b, 0), max(stop - b, 0)
            parts.append((self.k[:, :, lo:hi], self.v[:, :, lo:hi], self.mask[:, lo:hi]))
        if len(parts) == 1:
            return parts[0]
        (old_k, old_v, old_mask), (k, v, mask) = parts
        return torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2), torch.cat([old_mask, mask], dim=1)

    def rows(self, features: bool) -> Keys:
        """L rows for the inclusive scan from the state: row ``t`` holds the key that leaves at query ``t`` (empty
        where none), so that query ``t`` reads exactly its far field."""
        # row t holds leaving key (buffered + t - window): the read keys, after window - buffered empty rows
        read = self.keys(0, self.read, features)
        return slice_keys(pad_keys(read, self.window - self.buffered, 0), 0, self.length)

    def after(self) -> Keys:
        """The keys that join the state after the call (with features)."""
        return self.keys(self.read, self.count, True)


def _decoding_step(x, rq, keys: Keys, extra_keys, state: HybridState, k, v, mask, ctx: FarContext,
                   spec: HybridSpec, log_gain) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """One causal token after ``state`` (what :func:`_hybrid_sums` and the scan compute, for a single query): the
    state's far field (plus the key that leaves the window at this query, if any) and exact softmax on the window
    buffer, this token and the global tokens outside the window.

    x, rq: (B, H, 1, d), (B, H, 1, 1) the scaled query and its centering log-weight; ``keys``: this token's (no
    features); ``extra_keys``: (the window buffer, the global keys), each :class:`Keys` or None; k, v, mask: this
    token's raw key, value (B, H, 1, d / dv) and mask (B, 1).
    Returns the numerator|denominator (B, H, 1, dv + 1) relative to a shift, and the far-field state after the token.
    """
    prefix, globals_ = extra_keys
    leaving = _LeavingKeys(state, k, v, mask, ctx, spec)
    far_kv, far_shift = state.far_kv, state.far_shift
    if leaving.read:  # the key that leaves the window at this query (with no window: this token itself)
        far_kv, far_shift = _with_keys(far_kv, far_shift, leaving.keys(0, leaving.read, True))
    qf, q_scale = far_features(ctx.far, x - ctx.a, ctx.projection, ctx.parameter, rq)  # (B, H, 1, D), (B, H, 1, 1)
    far_sum = qf @ far_kv  # (B, H, 1, dv + 1) relative to exp(q_scale + far_shift)
    far_scale = q_scale + far_shift[..., None, None] + log_gain
    groups = []
    if spec.local_window:  # the buffer (the last local_window - 1 keys) and this token
        window = keys if prefix is None else cat_keys(prefix, keys)
        groups.append(([window.y, window.values1], window.mask[:, None, None, :]))  # (B, 1, 1, C)
    if globals_ is not None:
        left, right = window_offsets(spec.local_window, True)
        key_pos = torch.arange(globals_.y.shape[2], device=x.device)  # (G,)
        outside = ~_in_window(torch.tensor(state.length, device=x.device), key_pos, left, right)
        groups.append(([globals_.y, globals_.values1], (globals_.mask & outside)[:, None, None, :]))
    groups = [([t.unsqueeze(2) for t in fields], support.unsqueeze(2)) for fields, support in groups]  # n = 1 block
    sums = _exact_and_far_sums(x.unsqueeze(2), far_scale.unsqueeze(2), far_sum.unsqueeze(2), groups)
    if leaving.count > leaving.read:  # the key that leaves the window at the next token
        far_kv, far_shift = _with_keys(far_kv, far_shift, leaving.after())
    return sums.squeeze(2), far_kv, far_shift


def _with_keys(kv: Tensor, shift: Tensor, keys: Keys) -> tuple[Tensor, Tensor]:
    """A causal far-field state (kv (B, H, D, dv + 1) relative to shift (B, H)) with ``keys`` (features) added."""
    if not keys.y.shape[2]:
        return kv, shift
    added, added_shift = causal_far_state(keys.feats, keys.klog, keys.values1)
    merged = torch.maximum(shift, added_shift)  # (B, H)
    scale = torch.exp(added_shift - merged)[..., None, None], torch.exp(shift - merged)[..., None, None]
    return added * scale[0] + kv * scale[1], merged


def _fused_causal_far(far: FarField, u: Tensor, rq: Tensor, rows: Keys, ctx: FarContext, spec: HybridSpec):
    """The causal far field of exponential features over the keys lagged past each query's exact support, in
    one fused scan (:func:`.causal_exp_sums`): u (B, H, L, d) centred queries, rq (B, H, L, 1) their centering
    log-weights; ``rows`` (:meth:`_LeavingKeys.rows`) without features (their ``klog`` is the centering term, -inf
    where empty). -> (the :class:`_CausalFar`, the scan's final state kv (B, H, D, dv + 1) and shift (B, H))"""
    directions, bias = far.exp_form(ctx.projection, ctx.parameter)
    out1, q_shift, shifts, state = causal_exp_sums(
        u, rows.y - ctx.c, rows.values1, directions, bias=bias, key_row=rows.klog, mask=rows.mask,
        chunk_size=spec.chunk_size,
    )  # fmt: skip
    # The queries' centering factor exp(rq) stays out of the scan: in the far field's scale, and (a factor of
    # value 1) in its gradient.
    rq_const = rq.detach()
    far_side = _CausalFar(q_shift.unsqueeze(-1) + rq_const, shifts.unsqueeze(-1), out1 * torch.exp(rq - rq_const))
    return far_side, state.kv, state.shift


class _BidirectionalFar:
    """Far-field state over all keys (one key shift per batch and head); query sums on demand by slab.

    With ``kernels`` (:mod:`.cpu_kernels`), the polynomial far field's state and sums are compiled.
    """

    excludes_support = False  # the state holds every key: the support's share is subtracted per candidate
    log_gain: Tensor | float = 0.0  # as _CausalFar's

    def __init__(self, far: FarField, u: Tensor, rq: Tensor, keys: Keys, c: Tensor, projection, parameter,
                 kernels=None):  # fmt: skip
        self.quadratic, self.kernels = far.quadratic, kernels
        shift = keys.klog.amax(dim=(-2, -1), keepdim=True).detach()  # (B, H, 1, 1)
        self.shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        weighted = keys.values1 * torch.exp(keys.klog - self.shift)  # (B, H, S, dv + 1); padded keys -> 0
        self.u, self.rq = u, rq
        if self.quadratic is not None and kernels is not None:
            self.state = compiled_far_state(kernels, (keys.y - c).contiguous(), weighted.contiguous(), self.quadratic)
            self.qf = None
        elif self.quadratic is not None:
            self.state = quadratic_state(keys.y - c, weighted, self.quadratic)
            self.qf = None
        else:
            self.state = keys.feats.transpose(-2, -1) @ weighted  # (B, H, D, dv + 1)
            self.qf, self.q_scale = far_features(far, u, projection, parameter, rq)  # (B, H, L, D), (B, H, L, 1)

    def query_side(self):
        """-> (qf or None, q_scale, key_shift, far_sum), each (B, H, L, X)."""
        key_shift = self.shift.expand(*self.rq.shape[:3], 1)
        q_scale = (self.rq if self.quadratic is not None else self.q_scale) + self.log_gain
        if self.quadratic is not None and self.kernels is not None:
            return None, q_scale, key_shift, compiled_far_apply(self.kernels, self.u.contiguous(), self.state)
        if self.quadratic is not None:
            return None, q_scale, key_shift, quadratic_apply(self.u, self.state)
        return self.qf, q_scale, key_shift, self.qf @ self.state


def _key_fields(keys: Keys, with_feats: bool) -> list[Tensor]:
    """The per-key tensors a candidate set carries: y, values1, klog (and the features)."""
    return [keys.y, keys.values1, keys.klog] + ([keys.feats] if with_feats else [])


def _hybrid_sums(x, rq, far_side, keys: Keys, extra_keys, spec: HybridSpec, causal: bool, offset: int) -> Tensor:
    """Numerator|denominator (B, H, L, dv + 1) of the hybrid attention, relative to a per-query shift.

    ``extra_keys``: (the window buffer of earlier tokens, the global keys), each a :class:`Keys` or None.

    The queries are processed by blocks of ``block_q``, in slabs of blocks; block ``n`` reads its
    window keys ``[n * block_q - left, (n + 1) * block_q + right)``, the global keys and its routed
    key blocks: one candidate set of C keys per block, with a (block_q, C) support mask. Every per-block
    tensor is built once for all blocks (views, one gather) and split into slabs, so that backward
    gathers each gradient once instead of writing a full-size one per slab.
    """
    B, H, L, d = x.shape
    prefix, globals_ = extra_keys
    far = get_far_field(spec.far_field)
    left, right = window_offsets(spec.local_window, causal)
    routed, block_k, block_q = spec.routed_blocks, spec.route_block_size, spec.query_block_size
    period = math.lcm(block_q, block_k) if routed else block_q
    pad = -(-L // period) * period - L
    N = (L + pad) // block_q
    keys_p = pad_keys(keys, 0, pad)
    with_feats = far.quadratic is None and not far_side.excludes_support
    nb_global = 0 if globals_ is None else globals_.y.shape[2]
    width = block_q + left + right if right >= 0 else 0
    nb_cand = width + nb_global + routed * block_k
    widest = max(d, keys.values1.shape[-1], keys.feats.shape[-1] if with_feats else 1)
    sizes = slab_sizes(N, B * H * block_q * max(nb_cand, 1) * widest, "blocks", x.device)  # query blocks per slab
    starts = list(itertools.accumulate(sizes[:-1], initial=0))  # each slab's first query block

    def by_slab(t):  # (B, H, N, ...) -> its slabs along the block axis
        return t.split(sizes, dim=2)

    def blocked(t):  # (B, H, L, X) -> slabs of (B, H, n, block_q, X)
        return None if t is None else by_slab(F.pad(t, (0, 0, 0, pad)).view(B, H, N, block_q, -1))

    qf, q_scale, key_shift, far_sum = (blocked(t) for t in far_side.query_side())
    if not nb_cand:
        return torch.cat(far_sum, dim=2).flatten(2, 3)[:, :, :L]
    xq, rq_q = blocked(x), blocked(rq)
    groups_by_slab = [[] for _ in sizes]  # per slab, per candidate set: ([y, values1, klog(, feats)], support)
    if width:  # the window context: buffered keys (decoding) or nothing before, nothing after
        before = prefix if prefix is not None else slice_keys(keys, 0, 0)
        window = cat_keys(pad_keys(before, left - before.y.shape[2], 0), pad_keys(keys_p, 0, right))
        band = torch.arange(width, device=x.device)[None, :] - torch.arange(block_q, device=x.device)[:, None]
        band = (band >= 0) & (band <= left + right)  # (block_q, width): i - left <= j <= i + right
        support = band & window.mask.unfold(1, width, block_q)[:, None, :, None, :]  # (B, 1, N, block_q, width)
        fields = [by_slab(t.unfold(2, width, block_q).transpose(-2, -1)) for t in _key_fields(window, with_feats)]
        for slab, (*part, support_s) in enumerate(zip(*fields, by_slab(support), strict=True)):  # (B, H, n, C, X)
            groups_by_slab[slab].append((part, support_s))
    if routed:
        blocks = key_blocks(pad_keys(keys, 0, -L % block_k), block_k, spec.route_group_size)  # as hybrid_compiled
        q_mask = F.pad(keys.mask, (0, pad), value=False).view(B, N, block_q).split(sizes, dim=1)
        routes = [route(xq_s, q_mask_s, blocks, n0, block_k, left, right, routed)
                  for xq_s, q_mask_s, n0 in zip(xq, q_mask, starts, strict=True)]  # fmt: skip
        chosen = torch.cat([chosen_s for chosen_s, _ in routes], dim=2)  # (B, H, N, t)
        chosen_real = torch.cat([real for _, real in routes], dim=2)
        fields = [by_slab(gather_blocks(t, chosen, block_k)) for t in _key_fields(keys_p, with_feats)]
        key_pos = (chosen.unsqueeze(-1) * block_k + torch.arange(block_k, device=x.device)).flatten(-2)
        real = keys_p.mask.gather(1, key_pos.flatten(1)).view(key_pos.shape)  # (B, H, N, R): real keys
        real = real & chosen_real.repeat_interleave(block_k, dim=-1)  # ... of blocks that qualified
        pos = (torch.arange(N * block_q, device=x.device) + offset).view(N, block_q, 1)  # absolute
        key_pos = key_pos.unsqueeze(-2)  # (B, H, N, 1, R)
        support = real.unsqueeze(-2) & ~_in_window(pos, key_pos, left, right) & (key_pos >= nb_global)
        for slab, (*part, support_s) in enumerate(zip(*fields, by_slab(support), strict=True)):  # (B, H, n, C, X)
            groups_by_slab[slab].append((part, support_s))
    outputs = []
    for slab, (n0, n) in enumerate(zip(starts, sizes, strict=True)):
        groups = groups_by_slab[slab]
        if nb_global:
            part = [t.unsqueeze(2).expand(-1, -1, n, -1, -1) for t in _key_fields(globals_, with_feats)]
            pos = (torch.arange(n0 * block_q, (n0 + n) * block_q, device=x.device) + offset).view(n, block_q, 1)
            key_pos = torch.arange(nb_global, device=x.device)  # (G,)
            support = globals_.mask[:, None, None, None, :] & ~_in_window(pos, key_pos, left, right)
            groups.append((part, support & (key_pos <= pos) if causal else support))  # (B, 1, n, block_q, G)
        groups = [([t.expand(B, H, n, *t.shape[3:]) for t in part], support.expand(B, H, n, block_q, -1))
                  for part, support in groups]  # fmt: skip
        far_scale = q_scale[slab] + key_shift[slab]
        if far_side.excludes_support:
            outputs.append(recomputed(_exact_and_far_sums, xq[slab], far_scale, far_sum[slab], groups))
        else:
            qf_s = None if qf is None else qf[slab]
            outputs.append(recomputed(_support_sums, xq[slab], qf_s, rq_q[slab], far_scale, key_shift[slab],
                                      far_sum[slab], groups, far.quadratic))  # fmt: skip
    return torch.cat(outputs, dim=2).flatten(2, 3)[:, :, :L]


def _in_window(query_pos: Tensor, key_pos: Tensor, left: int, right: int) -> Tensor:
    """Whether each key lies in each query's window: i - left <= j <= i + right (broadcast shapes)."""
    gap = query_pos - key_pos
    return (gap >= -right) & (gap <= left)


def _global_rows(x, keys: Keys, out, g: int) -> Tensor:
    """The first g queries attend exactly to every real key (bidirectional global tokens)."""
    g = min(g, x.shape[2])
    logits = (x[:, :, :g] @ keys.y.transpose(-2, -1)).masked_fill(~keys.mask[:, None, None, :], NEG_INF)
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
