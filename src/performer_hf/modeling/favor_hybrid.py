"""Hybrid attention: exact softmax on a sparse support plus a linear-time far field, one normaliser.

For query ``i`` with support ``E(i)`` (a local window, a few global tokens and, bidirectionally,
routed key blocks) and a linear-attention kernel ``kappa(x, y) = phi_q(x) . phi_k(y) ~ exp(x . y)``::

    out_i = (sum_{j in E(i)} exp(l_ij) v_j + sum_{j notin E(i)} kappa_ij v_j) / (the same sums with v = 1)

with exact logits ``l_ij = x_i . y_j`` (``x``, ``y``: queries and keys times ``sqrt(scaling)``).
The result is one attention distribution over all visible keys: exact where attention mass is
large (BigBird's window and global tokens; Scatterbrain's sparse part), approximated elsewhere.
Nothing of size ``L x L`` is formed: time and memory are linear in ``L`` (routing scores
``L / query_block_size`` block means against ``L / route_block_size`` key-block means: quadratic, but
``query_block_size * route_block_size`` times smaller than the logit matrix; with ``route_group_size`` G it
scores groups of G key blocks first, G times fewer, and then only the chosen groups' blocks).

The parts, one module each:

- **selection** (:mod:`.hybrid_selection`, :mod:`.hybrid_routing`): each block of queries' exact support as
  candidate sets: its window, the global tokens and (bidirectional) its routed key blocks;
- **exact part** (:mod:`.hybrid_exact`): softmax's un-normalised sums over the support;
- **far field** (:mod:`.hybrid_far_field`, its kernels in :mod:`.far_fields`): the kernel's sums over the
  complement: bidirectionally a state over all keys minus the kernel on the support (as in Scatterbrain, Chen et
  al., NeurIPS 2021), causally a scan of the keys lagged past each window (:mod:`.hybrid_causal`);
- **merge** (:func:`.merge`): both under one shift, one division.

A backend computes them (:mod:`.hybrid_backends`: PyTorch everywhere, compiled C++ for bidirectional polynomial
far fields on the CPU), chosen by one function of the call.

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

import dataclasses
from collections.abc import Callable

import torch

from .compiled_lengths import pin_length
from .far_fields import FarField, get_far_field
from .favor_attention import check_attention_inputs, check_scaling, scrub_padded_queries
from .favor_optimal import optimal_parameter, pair_statistic
from .hybrid_backends import choose_backend
from .hybrid_causal import decoding_step, extra_keys, lagged_far_field, next_state, prefill_far_state
from .hybrid_exact import divide, global_rows
from .hybrid_far_field import BidirectionalFar
from .hybrid_keys import FarContext, HybridCall, key_side, keys_by_feature, slice_keys
from .hybrid_selection import ExtraKeys, Selection
from .hybrid_spec import HybridSpec, HybridState

Tensor = torch.Tensor


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


def _log_gain(gain: Tensor | float | list[float] | None, like: Tensor) -> Tensor | float:
    """A far-field gain given as a float, (H,) or (B, H) -> its log (1 or B, 1 or H, 1, 1), in ``like``'s dtype;
    0 for None."""
    if gain is None:
        return 0.0
    gain = torch.as_tensor(gain, device=like.device).to(like.dtype)
    # checked eagerly; a compiled model's gains are its validated config's or learned as logs: the check would break
    # the graph
    if not torch.compiler.is_compiling() and bool((gain <= 0).any()):
        raise ValueError(f"far_field_gain must be positive (a factor on the far-field kernel); got {gain.tolist()}.")
    while gain.dim() < 2:
        gain = gain.unsqueeze(0)
    return gain.log()[..., None, None]


def _check(q, k, v, projection, far: FarField, key_padding_mask, scaling) -> None:
    """Shapes of the tensor inputs and the logit scale (the settings are checked by :class:`HybridSpec`)."""
    check_attention_inputs("hybrid_attention (self-attention)", q, k, v, key_padding_mask, self_attention=True)
    check_scaling("hybrid_attention", scaling)
    if far.uses_projection and (projection is None or projection.dim() != 2 or projection.shape[1] != q.shape[-1]):
        raise ValueError(
            f"far_field={far.name!r} needs a projection of shape (nb_features, head_dim={q.shape[-1]}); got "
            f"{None if projection is None else tuple(projection.shape)}. Draw it with draw_projection()."
        )


def _far_field_parameter(far: FarField, given, x: Tensor, centred: Callable[[], tuple[Tensor, Tensor]], mask, causal):
    """FAVOR++'s A per (batch, head) for far fields that take it: the given one, or (bidirectional only) the
    closed-form optimum from the sequence's centred queries and keys (``centred()``, made only then); None for other
    far fields."""
    if not far.uses_parameter:
        return None
    if given is not None:
        parameter = torch.as_tensor(given, dtype=x.dtype, device=x.device)
        return parameter.expand(x.shape[0], x.shape[1]) if parameter.dim() else parameter
    if causal:
        raise ValueError(
            f"far_field={far.name!r} in causal attention needs a fixed far_field_parameter (A per head): "
            "the closed-form optimum from the sequence's statistics would read future tokens."
        )
    return optimal_parameter(pair_statistic(*centred(), mask)).to(x.dtype)  # (B, H)


def _prepare(q, k, v, projection, spec: HybridSpec, causal: bool, options: dict, with_keys: bool = True) -> HybridCall:
    """The call's inputs in the compute dtype, scaled, centred, with the far field's context (``options``: the
    keyword arguments of :func:`hybrid_attention` that are tensors or numbers); ``with_keys``: the call's prepared
    keys too (a decoding step reads the raw ones)."""
    far = get_far_field(spec.far_field)
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, L, d = q.shape
    scaling = options["scaling"]
    root = (d**-0.5 if scaling is None else scaling) ** 0.5
    padding = options["key_padding_mask"]
    mask = torch.ones(B, L, dtype=torch.bool, device=q.device) if padding is None else padding.to(q.device, torch.bool)
    padded = None if padding is None else ~mask[:, None, :, None]  # (B, 1, L, 1)
    if padded is not None:  # padded tokens may hold anything (inf, NaN): keys and values zeroed before any product;
        # a padded query keeps its own output (as before), less what would reach the real ones (scrubbed)
        k, v = k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
        q = scrub_padded_queries(q, padded)
    x, y = q.to(dtype) * root, k.to(dtype) * root
    real_x = x if padded is None else x.masked_fill(padded, 0.0)  # the queries the statistics read
    if projection is not None:
        projection = projection.to(device=q.device, dtype=dtype)

    # Centres a (queries) and c (keys): exp(x.y) = exp(x.c + a.y - a.c) exp((x - a).(y - c)).
    zero = x.new_zeros(1, 1, 1, d)
    query_center, key_center = options["query_center"], options["key_center"]
    if query_center is not None:
        a = _as_center(query_center, x)
    else:
        a = _masked_mean(real_x, mask) if spec.center else zero
    c = _as_center(key_center, y) if key_center is not None else (_masked_mean(y, mask) if spec.center else zero)
    parameter = _far_field_parameter(far, options["far_field_parameter"], x, lambda: (real_x - a, y - c), mask, causal)
    exp_form = None if far.exp_form is None else far.exp_form(projection, parameter)  # directions, bias
    ctx = FarContext(root, a, c, far, projection, parameter, dtype, exp_form)
    # Causal: the support's keys need no far-field features (the far field never holds them); bidirectional: the
    # random-feature far fields subtract their kernel on the support.
    keys = None
    if with_keys and not causal and far.quadratic is None:
        keys, key_log = keys_by_feature(k, v, mask, ctx)
        ctx = ctx._replace(key_log=key_log)
    elif with_keys:
        keys = key_side(k, v, mask, ctx, with_features=False)
    log_gain = _log_gain(options["far_field_gain"], x)  # (.., H or 1, 1, 1)
    return HybridCall(k, v, mask, x, x @ c.transpose(-2, -1), keys, ctx, log_gain, spec, padding is not None)


def _bidirectional(call: HybridCall) -> Tensor:
    """Numerator|denominator (B, H, L, dv + 1) of bidirectional hybrid attention, relative to a per-query shift."""
    backend = choose_backend(call, causal=False)
    far = BidirectionalFar(call, backend.polynomial).queries()
    globals_ = slice_keys(call.keys, 0, min(call.spec.num_global_tokens, call.x.shape[2]))
    extra = ExtraKeys(None, globals_ if call.spec.num_global_tokens else None)
    with_feats = call.ctx.far.quadratic is None
    return backend.support_sums(
        Selection(call.x, call.keys, extra, call.spec, False, 0, with_feats), far, call.ctx.far.quadratic
    )


def _decoding(state: HybridState | None, q: Tensor) -> bool:
    """Whether a causal call is a decoding step: one token after a state (:func:`.decoding_step`)."""
    return state is not None and q.shape[2] == 1


def _causal(call: HybridCall, state: HybridState | None, return_state: bool):
    """Numerator|denominator (B, H, L, dv + 1) of causal hybrid attention after ``state``, and the far-field
    state (kv, shift) after the call (None unless ``return_state``)."""
    if _decoding(state, call.x):  # no scan, no query blocks
        return decoding_step(call, state)
    far, final = lagged_far_field(call, state, with_state=return_state)
    offset = 0 if state is None else state.length
    selection = Selection(call.x, call.keys, extra_keys(call, state), call.spec, True, offset, with_feats=False)
    backend = choose_backend(call, causal=True)
    return backend.support_sums(selection, far, call.ctx.far.quadratic), final


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
        far_field: a far-field kernel of :data:`.FAR_FIELDS`: ``"softmax"``, ``"softmax_hyperbolic"``,
            ``"softmax_opt"`` (FAVOR++), ``"taylor2"`` or ``"poly2"``.
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
    _check(q, k, v, projection, get_far_field(spec.far_field), key_padding_mask, scaling)
    if q.device.type != "cpu":  # compiled on a GPU, one graph per length: not yet run there with a symbolic length
        pin_length(q.shape[2])
    stateful = initial_state is not None or return_state
    spec.check_direction(causal, query_center is not None and key_center is not None, stateful)
    if initial_state is not None:
        spec.check_state(initial_state, k, v, projection)
    options = {
        "scaling": scaling,
        "key_padding_mask": key_padding_mask,
        "query_center": query_center,
        "key_center": key_center,
        "far_field_parameter": far_field_parameter,
        "far_field_gain": far_field_gain,
    }
    call = _prepare(q, k, v, projection, spec, causal, options, with_keys=not (causal and _decoding(initial_state, q)))
    if causal:
        sums, far_state = _causal(call, initial_state, return_state)
    else:
        sums = _bidirectional(call)
    out = divide(sums)
    if not causal and spec.num_global_tokens:
        out = global_rows(call.x, call.keys, out, spec.num_global_tokens)
    out = out.to(q.dtype)
    if not return_state:
        return out
    return out, next_state(initial_state, far_state, call)


def hybrid_prefill_state(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    projection: Tensor | None,
    spec: HybridSpec,
    *,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
    scaling: float | None = None,
    query_center: Tensor | None = None,
    key_center: Tensor | None = None,
    far_field_parameter: Tensor | float | None = None,
    far_field_gain: Tensor | float | list[float] | None = None,
    initial_state: HybridState | None = None,
) -> HybridState:
    """The decoding state after a causal call (from the first token, or after ``initial_state``), without its
    output: what ``hybrid_attention(..., causal=True, return_state=True)`` returns beside it. The far field holds the
    keys that left the window (their features' sums, one matrix product), the buffer the window's last keys, and the
    global tokens; the queries are not read. A prefill's output can then come from a call that returns no state
    (compiled, at a bucketed length, where a state would hold the padding). Arguments as :func:`hybrid_attention`'s."""
    if not causal:
        raise ValueError("hybrid_prefill_state is the state of causal attention: call it with causal=True.")
    options = {
        "scaling": scaling,
        "key_padding_mask": key_padding_mask,
        "query_center": query_center,
        "key_center": key_center,
        "far_field_parameter": far_field_parameter,
        "far_field_gain": far_field_gain,
    }
    spec.check_direction(True, query_center is not None and key_center is not None, True)
    if initial_state is not None:
        spec.check_state(initial_state, k, v, projection)
    call = _prepare(q, k, v, projection, spec, True, options)
    return next_state(initial_state, prefill_far_state(call, initial_state), call)
