"""Causal hybrid attention: the far field lagged past each query's window, and the constant-size decoding state.

Query ``i`` computes exactly its window (itself and the ``local_window - 1`` keys before it) and the global tokens;
its far field reads every other earlier key. A call scans the keys as they leave the window (:class:`LeavingKeys`),
so that its far field never holds a key of the query's support and nothing is subtracted: with an exponential far
field in the fused scan of :func:`.causal_exp_sums` (features one slab at a time), from the first token or from a
state, and otherwise in the chunked scan of :func:`.causal_far_sums`. A single token after a state takes
:func:`decoding_step`: the state's far field plus exact softmax on the window buffer and the global tokens, no scan.
"""

from __future__ import annotations

import torch

from .causal_scan import EMPTY_SHIFT
from .far_field_triton import float32_precision
from .favor_exp import ExpFeatures, ScanKeys, causal_exp_sums, exp_key_state
from .hybrid_exact import CandidateSet, PartialSums, exact_logits, exact_sums, merge
from .hybrid_far_field import FarQueries, add_keys, add_states, causal_far_sums
from .hybrid_keys import NEG_INF, HybridCall, Keys, cat_keys, key_rows, key_side, pad_keys, slice_keys
from .hybrid_selection import ExtraKeys
from .hybrid_spec import HybridState

Tensor = torch.Tensor


class LeavingKeys:
    """The keys that leave the exact window during a causal call, for the far field.

    The state's far field holds the keys before its window buffer (every later query reads them), the buffer the
    last ``local_window - 1`` keys. During a call of L tokens, the buffer's keys and then the call's own leave the
    window, one per query: the key at position ``i - local_window`` leaves at query ``i``. Indices below count the
    buffer's keys, then the call's: the first ``read`` leaving keys are read by this call's queries, the rest (up to
    ``count``; at most one) join the state after the call. The global tokens never enter the far field, and no key
    on a query's support needs far-field features.
    """

    def __init__(self, state: HybridState | None, call: HybridCall):
        self.state, self.call = state, call
        self.window, self.length = call.spec.local_window, call.k.shape[2]
        self.buffered = 0 if state is None else state.keys.shape[2]  # positions start - buffered, ..., start - 1
        self.start = 0 if state is None else state.length  # the position of this call's first token
        # (branches, not max / min: with a symbolic length a compiled graph's sizes then stay plain sums, where
        # inductor could not prove max(0, min(L - w, L - w + 1)) + w equal to L)
        reach = self.buffered + self.length - self.window  # leaving keys this call's queries read, where positive
        self.read = reach if reach > 0 else 0
        self.count = (reach + 1 if reach >= 0 else 0) if self.window else self.read

    def keys(self, first: int, stop: int, features: bool) -> Keys:
        """The leaving keys ``[first, stop)`` (with far-field features when ``features``; otherwise ``klog`` is the
        centering term alone), -inf log-scale for the global tokens."""
        k, v, mask = self._raw(first, stop)
        part = key_side(k, v, mask, self.call.ctx, features)
        first_position = first + self.start - self.buffered
        leading_globals = min(max(self.call.spec.num_global_tokens - first_position, 0), stop - first)
        if not leading_globals:
            return part
        is_global = torch.arange(stop - first, device=k.device) < leading_globals  # (n,)
        return part._replace(klog=part.klog.masked_fill(is_global[:, None], NEG_INF))  # (.., 1): never far

    def _raw(self, first: int, stop: int):
        """Raw keys, values (B, H, n, d / dv) and mask (B, n) at ``[first, stop)`` of (the buffer, this call)."""
        b, state, call = self.buffered, self.state, self.call
        parts = []
        if first < b:
            end = min(stop, b)
            keys, values = state.keys[:, :, first:end].to(call.k.dtype), state.values[:, :, first:end].to(call.v.dtype)
            parts.append((keys, values, state.key_mask[:, first:end]))
        if stop > b or not parts:
            lo, hi = max(first - b, 0), max(stop - b, 0)
            parts.append((call.k[:, :, lo:hi], call.v[:, :, lo:hi], call.mask[:, lo:hi]))
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

    def add_to(self, far: tuple[Tensor, Tensor], first: int, stop: int) -> tuple[Tensor, Tensor]:
        """The far-field state ``far`` (kv (B, H, D, dv + 1), shift (B, H)) with the leaving keys ``[first, stop)``
        added: an exponential far field's as the fused scan holds them (:func:`.exp_key_state`, their features never
        stored), the others' from their features."""
        if stop <= first:
            return far
        if self.call.ctx.exp_form is not None:
            return add_states(far, exp_key_state(*_scan_form(self.call, self.keys(first, stop, False))))
        return add_keys(*far, self.keys(first, stop, True))


def extra_keys(call: HybridCall, state: HybridState | None) -> ExtraKeys:
    """The window buffer and the global keys a causal call's queries may compute exactly besides their own call's:
    those of the preceding tokens (decoding), then this call's first ones."""
    spec, ctx, L = call.spec, call.ctx, call.k.shape[2]
    offset = 0 if state is None else state.length
    prefix = None
    if state is not None and spec.local_window > 1:
        prefix = key_side(state.keys, state.values, state.key_mask, ctx, with_features=False)
    globals_ = None
    if spec.num_global_tokens:
        globals_ = slice_keys(call.keys, 0, max(0, min(spec.num_global_tokens - offset, L)))
        if state is not None and state.global_keys.shape[2]:
            old = key_side(state.global_keys, state.global_values, state.global_mask, ctx, with_features=False)
            globals_ = cat_keys(old, globals_)
    return ExtraKeys(prefix, globals_)


def lagged_far_field(call: HybridCall, state: HybridState | None, with_state: bool):
    """The causal far field of every query of the call over the keys lagged past its window: its
    :class:`.FarQueries` and, ``with_state``, the far-field state after the call (kv (B, H, D, dv + 1), shift (B, H)),
    else None."""
    ctx, spec = call.ctx, call.spec
    u = call.x - ctx.a
    leaving = LeavingKeys(state, call)
    fused = ctx.exp_form is not None  # features per slab, never stored
    rows = leaving.rows(features=not fused)
    if fused:
        keys, features, precision = _scan_form(call, rows)
        previous = None if state is None else (state.far_kv, state.far_shift)
        scan = causal_exp_sums(u, keys, features, spec.chunk_size, previous, precision=precision)
        # The queries' centering factor exp(rq) stays out of the scan: in the far field's scale, and (a factor of
        # value 1) in its gradient.
        rq_const = call.rq.detach()
        far_sum, scale, shifts = scan.sums * torch.exp(call.rq - rq_const), scan.q_shifts.unsqueeze(-1), scan.shifts
        scale, final = scale + rq_const, (scan.kv, scan.shift)
    else:
        qf, scale = ctx.features(u, call.rq)  # (B, H, L, D), (B, H, L, 1)
        previous = None if state is None else (state.far_kv, state.far_shift)
        far_sum, shifts, *final = causal_far_sums(qf, rows.feats, rows.klog, rows.values1, spec.chunk_size, previous)
    far = FarQueries(None, call.rq, scale + call.log_gain, shifts.unsqueeze(-1), far_sum, None, excludes_support=True)
    return far, leaving.add_to(tuple(final), leaving.read, leaving.count) if with_state else None


def _scan_form(call: HybridCall, keys: Keys) -> tuple[ScanKeys, ExpFeatures, str]:
    """An exponential far field's ``keys`` (without features; ``klog`` the centering term) as its fused scan takes
    them: the keys around the centre, the features' directions and bias, and the products' precision."""
    ctx = call.ctx
    directions, bias = ctx.exp_form
    scan_keys = ScanKeys(keys.y - ctx.c, keys.values1, keys.klog, keys.mask)
    return scan_keys, ExpFeatures(directions, bias), float32_precision(call.k.dtype)


def prefill_far_state(call: HybridCall, state: HybridState | None = None) -> tuple[Tensor, Tensor]:
    """The far-field state after a causal call (after ``state``, or from the first token), without its sums: the
    state's and every key that left the window, (kv (B, H, D, dv + 1), shift (B, H)). An exponential far field's keys
    as the fused scan holds them (on CUDA in the kernels, without their (L, D) features: :func:`.exp_key_state`), the
    others' from their features."""
    ctx, (B, H) = call.ctx, call.k.shape[:2]
    leaving = LeavingKeys(state, call)
    if state is not None:
        return leaving.add_to((state.far_kv, state.far_shift), 0, leaving.count)
    if leaving.count and ctx.exp_form is not None:
        return exp_key_state(*_scan_form(call, leaving.keys(0, leaving.count, False)))  # klog: the centering alone
    keys = leaving.keys(0, leaving.count, True)  # (B, H, n, .), with features
    empty = keys.values1.new_zeros(B, H, keys.feats.shape[-1], keys.values1.shape[-1])  # (B, H, D, dv + 1)
    return add_keys(empty, keys.values1.new_full((B, H), EMPTY_SHIFT), keys)


def decoding_step(call: HybridCall, state: HybridState) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One causal token after ``state``, what the scan computes for a single query: the state's far field (plus the
    key that leaves the window at this query, if any) and exact softmax on the global tokens outside the window,
    the window buffer and this token, one set of keys. Returns its numerator|denominator (B, H, 1, dv + 1) relative
    to a shift, and the far-field state (kv, shift) after the token."""
    ctx = call.ctx
    leaving = LeavingKeys(state, call)
    # the key that leaves the window at this query (with no window: this token itself), if any
    far_kv, far_shift = leaving.add_to((state.far_kv, state.far_shift), 0, leaving.read)
    qf, q_scale = ctx.features(call.x - ctx.a, call.rq)  # (B, H, 1, D), (B, H, 1, 1)
    parts = [PartialSums(qf @ far_kv, q_scale + call.log_gain + far_shift[..., None, None])]
    k, v, mask = _exact_keys(call, state)  # (B, H, C, d / dv), (B, C)
    if k.shape[2]:
        y, values1 = key_rows(k, v, mask, ctx)
        exact = [CandidateSet([y.unsqueeze(2), values1.unsqueeze(2)], mask[:, None, None, None, :])]  # one block
        sums, shift = exact_sums(exact_logits(call.x.unsqueeze(2), exact), exact)  # (B, H, 1, 1, .)
        parts.append(PartialSums(sums.squeeze(2), shift.squeeze(2)))
    return merge(*parts), leaving.add_to((far_kv, far_shift), leaving.read, leaving.count)  # the key leaving next


def _exact_keys(call: HybridCall, state: HybridState) -> tuple[Tensor, Tensor, Tensor]:
    """The raw keys, values (B, H, C, d / dv) and mask (B, C) a decoding step computes exactly: the global tokens
    outside its window (before it: positions below ``length - left``; with no window, this token too if global),
    then the window buffer and this token."""
    spec, k, v, mask = call.spec, call.k, call.v, call.mask
    left, right = spec.offsets(causal=True)
    first_inside = state.length - left if right >= 0 else state.length + 1  # the window's first position
    global_keys, global_values, global_mask = _global_tokens(state, call)  # this token's too if global
    outside = min(global_keys.shape[2], max(0, first_inside))
    keys, values, masks = [], [], []
    if outside:
        keys.append(global_keys[:, :, :outside].to(k.dtype))
        values.append(global_values[:, :, :outside].to(v.dtype))
        masks.append(global_mask[:, :outside])
    if spec.local_window:
        keys += [state.keys.to(k.dtype), k]
        values += [state.values.to(v.dtype), v]
        masks += [state.key_mask, mask]
    if not keys:
        return k[:, :, :0], v[:, :, :0], mask[:, :0]
    return torch.cat(keys, dim=2), torch.cat(values, dim=2), torch.cat(masks, dim=1)


def next_state(state: HybridState | None, far: tuple[Tensor, Tensor], call: HybridCall) -> HybridState:
    """The state after the call: its far field ``far`` (kv, shift), and this call's raw keys/values appended to
    the window buffer and to the global prefix."""
    k, v, mask, spec = call.k, call.v, call.mask, call.spec
    B, H, L, d = k.shape
    if state is None:
        empty_k, empty_v, empty_m = k.new_zeros(B, H, 0, d), v.new_zeros(B, H, 0, v.shape[-1]), mask.new_zeros(B, 0)
        state = HybridState(*far, empty_k, empty_v, empty_m, empty_k, empty_v, empty_m, 0)
    # the buffer keeps the last local_window - 1 keys: what leaves it is dropped before the concatenation, so that the
    # buffer is a tensor of its own whose strides do not follow the call's length (a compiled step guards on them)
    keep, held = max(spec.local_window - 1, 0), state.keys.shape[2]
    old, fresh = min(held, max(0, held + L - keep)), max(0, L - keep)  # the old and the new keys that leave
    global_keys, global_values, global_mask = _global_tokens(state, call)
    return HybridState(
        far_kv=far[0],
        far_shift=far[1],
        keys=torch.cat([state.keys[:, :, old:], k[:, :, fresh:].to(state.keys.dtype)], dim=2),
        values=torch.cat([state.values[:, :, old:], v[:, :, fresh:].to(state.values.dtype)], dim=2),
        key_mask=torch.cat([state.key_mask[:, old:], mask[:, fresh:]], dim=1),
        global_keys=global_keys,
        global_values=global_values,
        global_mask=global_mask,
        length=state.length + L,
    )


def _global_tokens(state: HybridState, call: HybridCall) -> tuple[Tensor, Tensor, Tensor]:
    """The global tokens' raw keys, values (B, H, G, d / dv) and mask (B, G) after the call, in the state's dtype:
    the state's, then the call's first tokens while fewer than ``num_global_tokens`` came before."""
    keys, values, mask = state.global_keys, state.global_values, state.global_mask
    if new := max(0, min(call.spec.num_global_tokens - state.length, call.k.shape[2])):
        keys = torch.cat([keys, call.k[:, :, :new].to(keys.dtype)], dim=2)
        values = torch.cat([values, call.v[:, :, :new].to(values.dtype)], dim=2)
        mask = torch.cat([mask, call.mask[:, :new]], dim=1)
    return keys, values, mask
