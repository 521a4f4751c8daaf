"""The key side of hybrid attention: what maps queries and keys to far-field features (:class:`FarContext`), and
key sets with everything the exact part and the far field read (:class:`Keys`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .far_fields import FarField
from .favor_exp import exp_log_features
from .hybrid_spec import HybridSpec

Tensor = torch.Tensor

NEG_INF = float("-inf")


class FarContext(NamedTuple):
    """What maps keys (and queries) to far-field features: shared by every key set of one call."""

    root: float  # q and k are scaled by root (sqrt of the logit scale)
    a: Tensor  # (.., 1 or H, 1, d) query centre
    c: Tensor  # (.., 1 or H, 1, d) key centre
    far: FarField
    projection: Tensor | None
    parameter: Tensor | None  # FAVOR++'s A, (B, H), or None
    dtype: torch.dtype
    exp_form: tuple[Tensor, Tensor | None] | None = None  # an exponential far field's (directions, bias), once a call
    # bidirectional random features: each feature's largest log over the keys (B, H, 1, D), by which the keys'
    # features are normalised feature by feature (:func:`features_by_column`) and which the queries' carry
    key_log: Tensor | None = None

    def features(self, u: Tensor, row_log: Tensor) -> tuple[Tensor, Tensor]:
        """Far-field features of centred rows u (B, H, L, d) as (normalised features, per-row log scale).

        Returns ``feats`` (B, H, L, D) with ``phi(u) * exp(row_log) = feats * exp(scale)`` (times ``exp(key_log)``
        feature by feature, where the keys' features are normalised by it) and ``scale`` (B, H, L, 1): the row max
        of the log-features (so that ``|feats| <= 1`` for the exponential kernels; polynomial kernels keep their
        base features as they are).
        """
        base, log = self._features(u)
        if self.key_log is not None:  # (.., 1, D), or (.., 1, 1) for base features alone
            row_log = row_log + self.key_log if log is None else row_log
            log = None if log is None else log + self.key_log
        if log is None:
            return base, row_log
        log = log + row_log
        scale = log.detach().amax(dim=-1, keepdim=True).nan_to_num(0.0, 0.0, 0.0)  # (B, H, L, 1), 0 where not finite
        feats = torch.exp(log - scale)
        return (feats if base is None else base * feats), scale

    def features_by_column(self, u: Tensor, row_log: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        """Far-field features of centred keys u (B, H, S, d) whose mask (B, S) holds the real ones, normalised
        feature by feature: ``feats`` (B, H, S, D) = ``phi(u) * exp(row_log) / exp(key_log)`` (<= 1 for the
        exponential kernels), zero for padded keys, and ``key_log`` (B, H, 1, D), each feature's largest log over the
        real keys ((B, H, 1, 1) for base features alone). Each feature's sum over the keys then keeps its largest
        term at 1, whichever keys and queries it weighs most: with one shift for all (the largest key's), a query's
        features could all fall on keys 1e-60 below it, 0 in float32."""
        base, log = self._features(u)
        log = row_log if log is None else log + row_log  # (B, H, S, D or 1)
        log = log.masked_fill(~mask[:, None, :, None], NEG_INF)
        key_log = log.detach().amax(dim=2, keepdim=True).nan_to_num(0.0, 0.0, 0.0)  # 0 where no key
        feats = torch.exp(log - key_log)
        return (feats if base is None else base * feats), key_log

    def _features(self, u: Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The far field's (base, log) features of u (:data:`.FarFeatureFn`)."""
        if self.exp_form is not None:
            return None, exp_log_features(u, *self.exp_form)  # as far.features, the form computed once
        return self.far.features(u, self.projection, self.parameter)


class Keys(NamedTuple):
    """Scaled keys with everything the hybrid sums read; sequence axis 2 (mask: axis 1)."""

    y: Tensor  # (B, H, S, d)
    values1: Tensor  # (B, H, S, dv + 1): [v, 1], zero for padded keys
    klog: Tensor  # (B, H, S, 1): log scale of the far-field features (-inf for padded keys)
    mask: Tensor  # (B, S) bool
    feats: Tensor | None  # (B, H, S, D): far-field features (|.| <= 1 for the exponential kernels)

    def fields(self, with_feats: bool) -> list[Tensor]:
        """The per-key tensors a candidate set carries: y, values1, klog (and the features)."""
        return [self.y, self.values1, self.klog] + ([self.feats] if with_feats else [])


def key_rows(k: Tensor, v: Tensor, mask: Tensor, ctx: FarContext) -> tuple[Tensor, Tensor]:
    """What the exact part reads of keys (B, H, S, d), values (B, H, S, dv) and their mask (B, S): the keys scaled
    (B, H, S, d) and the values with the normaliser's column, zero for masked keys (B, H, S, dv + 1)."""
    y = k.to(ctx.dtype) * ctx.root
    values1 = F.pad(v.to(ctx.dtype), (0, 1), value=1.0) * mask[:, None, :, None]
    return y, values1


def keys_by_feature(k, v, mask, ctx: FarContext) -> tuple[Keys, Tensor]:
    """Keys (B, H, S, d), values (B, H, S, dv) and their mask (B, S) prepared for the support and a bidirectional
    random-feature far field: their features normalised feature by feature (:meth:`FarContext.features_by_column`),
    so ``klog`` is 0 (-inf for padded keys); and ``key_log`` (B, H, 1, D), which the queries' features carry."""
    y, values1 = key_rows(k, v, mask, ctx)
    u = y - ctx.c
    feats, key_log = ctx.features_by_column(u, u @ ctx.a.transpose(-2, -1), mask)
    klog = torch.zeros_like(y[..., :1]).masked_fill(~mask[:, None, :, None], NEG_INF)  # (B, H, S, 1)
    return Keys(y, values1, klog, mask, feats), key_log


def key_side(k, v, mask, ctx: FarContext, with_features: bool) -> Keys:
    """Keys (B, H, S, d), values (B, H, S, dv) and their mask (B, S) prepared for the support and the far field;
    without features, ``klog`` is the centering term ``a . y - a . c`` alone."""
    y, values1 = key_rows(k, v, mask, ctx)
    keep = mask[:, None, :, None]  # (B, 1, S, 1)
    feats = None
    if not with_features:  # the log-scale of the centering factor alone: (B, H, S, 1), a . y_j - a . c
        klog = y @ ctx.a.transpose(-2, -1) - (ctx.a * ctx.c).sum(-1, keepdim=True)
    else:
        u = y - ctx.c
        feats, klog = ctx.features(u, u @ ctx.a.transpose(-2, -1))
        feats = feats * keep
    return Keys(y, values1, klog.masked_fill(~keep, NEG_INF), mask, feats)


def _map_keys(fn, keys: Keys, mask_fn) -> Keys:
    feats = None if keys.feats is None else fn(keys.feats, 0.0)
    return Keys(fn(keys.y, 0.0), fn(keys.values1, 0.0), fn(keys.klog, NEG_INF), mask_fn(keys.mask), feats)


def slice_keys(keys: Keys, start: int, stop: int) -> Keys:
    return _map_keys(lambda t, _: t[:, :, start:stop], keys, lambda m: m[:, start:stop])


def pad_keys(keys: Keys, before: int, after: int) -> Keys:
    """Add empty (masked) keys on both sides of the sequence axis."""
    if not before and not after:
        return keys
    return _map_keys(
        lambda t, fill: F.pad(t, (0, 0, before, after), value=fill),
        keys,
        lambda m: F.pad(m, (before, after), value=False),
    )


def cat_keys(first: Keys, second: Keys) -> Keys:
    feats = None if first.feats is None else torch.cat([first.feats, second.feats], dim=2)
    tensors = (torch.cat([f, s], dim=2) for f, s in zip(first[:3], second[:3], strict=True))
    return Keys(*tensors, torch.cat([first.mask, second.mask], dim=1), feats)


class HybridCall(NamedTuple):
    """The prepared inputs of one call of hybrid attention, which its parts read."""

    k: Tensor  # (B, H, L, d) raw keys (for the decoding state)
    v: Tensor  # (B, H, L, dv) raw values
    mask: Tensor  # (B, L) bool, True for real tokens
    x: Tensor  # (B, H, L, d) queries times the root of the logit scale
    rq: Tensor  # (B, H, L, 1) the queries' centering log-weights x . c
    keys: Keys | None  # this call's keys (with far-field features where the far field subtracts its kernel); None
    # in a decoding step, which reads the raw ones
    ctx: FarContext
    log_gain: Tensor | float  # the far field's log gain, (1 or B, 1 or H, 1, 1), or 0
    spec: HybridSpec
    key_padding: bool  # whether a key padding mask was given (else every key is real)
