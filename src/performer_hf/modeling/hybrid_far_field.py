"""The far-field kernels of hybrid attention: what approximates ``exp(x . y)`` for the keys outside a
query's exact support (see :mod:`.favor_hybrid`), as a registry of :class:`FarField` entries.

- ``"softmax"``: positive random features ``exp(w . u - |u|^2 / 2) / sqrt(m)`` (FAVOR+);
- ``"softmax_hyperbolic"``: ``[exp(w . u), exp(-w . u)] exp(-|u|^2 / 2) / sqrt(2m)``;
- ``"softmax_opt"``: optimal positive random features (FAVOR++, :mod:`.favor_optimal`);
- ``"taylor2"`` / ``"poly2"``: the deterministic polynomials ``1 + t + t^2 / 2`` and ``(1 + t / 2)^2`` of
  ``t = u . w``, with features of width ``1 + d + d (d + 1) / 2``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .causal_scan import EMPTY_SHIFT, causal_scan
from .favor_attention import EXP_KERNEL_DIRECTIONS
from .favor_features import FEATURE_MAPS
from .favor_optimal import optimal_exp_form, optimal_log_features
from .slabs import recomputed, slab_sizes

Tensor = torch.Tensor

# (u, projection, parameter) -> (base, log): u (B, H, L, d); base (B, H, L, D) or None;
# log (B, H, L, D) or None. phi(u) = base * exp(log); missing parts mean ones / zeros.
FarFeatureFn = Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor | None, Tensor | None]]
# (projection, parameter) -> (directions, bias): the exponential kernels' features as
# exp(u D^T + bias - |u|^2 / 2) / sqrt(rows of D) (see favor_attention.causal_exp_sums).
ExpFormFn = Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class FarField:
    """A far-field kernel of the hybrid attention.

    Attributes:
        name: registry key (the ``far_field`` argument).
        features: ``(u, projection, parameter) -> (base, log)`` for centred queries or keys.
        quadratic: for the polynomial kernels ``1 + t + quadratic * t^2`` of ``t = u . w``: their
            values on the support follow from the exact logits, and bidirectional attention builds
            their state without materialising features. ``None``: random features, whose values on
            the support come from feature dot products.
        uses_projection: whether a random projection is required.
        uses_parameter: whether the kernel has a per-head parameter (FAVOR++'s ``A``).
        exp_form: for the exponential kernels, ``(projection, parameter) -> (directions, bias)`` with the same
            features as ``features``, for the fused causal scan; None for the polynomials.
    """

    name: str
    features: FarFeatureFn
    quadratic: float | None = None
    uses_projection: bool = True
    uses_parameter: bool = False
    exp_form: ExpFormFn | None = None


def _random_features(name: str) -> FarFeatureFn:
    """FAVOR+'s own positive random features (:mod:`.favor_features`) as a far field (no parameter)."""
    compute = FEATURE_MAPS[name].compute

    def features(u: Tensor, projection: Tensor, _parameter) -> tuple[None, Tensor]:
        return compute(u, projection)  # (None, log-features (B, H, L, m'))

    return features


def _random_exp_form(name: str) -> ExpFormFn:
    directions_of = EXP_KERNEL_DIRECTIONS[name]
    return lambda projection, _parameter: (directions_of(projection), None)


def _optimal_features(u: Tensor, projection: Tensor, parameter: Tensor) -> tuple[None, Tensor]:
    return None, optimal_log_features(u, projection, parameter)  # (B, H, L, m)


def _products(u: Tensor, a: int) -> Tensor:
    """(..., d) -> (..., d - a): u_a * u_b for b >= a."""
    return u[..., a:] * u[..., a : a + 1]


def _quadratic_weights(d: int, a: int, c2: float, like: Tensor) -> Tensor:
    """(d - a,): c2 for the square u_a^2, 2 c2 for each cross term u_a u_b (b > a)."""
    weights = torch.full((d - a,), 2 * c2, dtype=like.dtype, device=like.device)
    weights[0] = c2
    return weights


def _quadratic_features(c2: float) -> FarFeatureFn:
    """Features ``[1, u, q(u)]`` of ``1 + t + c2 t^2`` with ``q(u) . q(w) = c2 (u . w)^2``.

    ``q`` holds ``sqrt(weight) * u_a u_b`` for the ``d (d + 1) / 2`` pairs ``a <= b``: width ``1 + d + d (d + 1) / 2``.
    """

    def features(u: Tensor, _projection, _parameter) -> tuple[Tensor, None]:
        d = u.shape[-1]
        quadratic = [_products(u, a) * _quadratic_weights(d, a, c2, u).sqrt() for a in range(d)]
        return torch.cat([torch.ones_like(u[..., :1]), u, *quadratic], dim=-1), None  # (B, H, L, D)

    return features


FAR_FIELDS: dict[str, FarField] = {
    ff.name: ff
    for ff in (
        FarField("softmax", _random_features("softmax"), exp_form=_random_exp_form("softmax")),
        FarField(
            "softmax_hyperbolic",
            _random_features("softmax_hyperbolic"),
            exp_form=_random_exp_form("softmax_hyperbolic"),
        ),
        FarField("softmax_opt", _optimal_features, uses_parameter=True, exp_form=optimal_exp_form),
        FarField("taylor2", _quadratic_features(0.5), quadratic=0.5, uses_projection=False),
        FarField("poly2", _quadratic_features(0.25), quadratic=0.25, uses_projection=False),
    )
}


def get_far_field(name: str) -> FarField:
    """Look up a far-field kernel by name, with an error that lists the valid names."""
    try:
        return FAR_FIELDS[name]
    except KeyError:
        raise ValueError(f"Unknown far_field {name!r}; choose one of {sorted(FAR_FIELDS)}.") from None


class FarContext(NamedTuple):
    """What maps keys (and queries) to far-field features: shared by every key set of one call."""

    root: float  # q and k are scaled by root (sqrt of the logit scale)
    a: Tensor  # (.., 1 or H, 1, d) query centre
    c: Tensor  # (.., 1 or H, 1, d) key centre
    far: FarField
    projection: Tensor | None
    parameter: Tensor | None
    dtype: torch.dtype


def far_features(far: FarField, u: Tensor, projection, parameter, row_log: Tensor) -> tuple[Tensor, Tensor]:
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


def quadratic_state(w: Tensor, wv1: Tensor, c2: float) -> tuple[Tensor, Tensor]:
    """State of the kernel ``1 + t + c2 t^2`` over all keys, without materialising features.

    w: (B, H, S, d) centred keys; wv1: (B, H, S, dv + 1) their weighted values ``exp(klog - s) [v, 1]``.
    Returns ``linear`` (B, H, 1 + d, dv + 1) ``= [1, w]^T wv1`` and ``quadratic`` (B, H, d, d (dv + 1))
    ``= c2 sum_j w_j (w_j (x) wv1_j)``: row ``a``, column ``(b, e)`` holds ``c2 sum_j w_ja w_jb wv1_je``.
    """
    B, H, S, d = w.shape
    d1 = wv1.shape[-1]
    linear = torch.cat([wv1.sum(dim=-2, keepdim=True), w.transpose(-2, -1) @ wv1], dim=-2)
    quadratic = 0
    sizes = slab_sizes(S, B * H * d * d1, "far", w.device)
    for w_s, wv1_s in zip(w.split(sizes, dim=2), wv1.split(sizes, dim=2), strict=True):
        quadratic = quadratic + recomputed(_quadratic_slab_state, w_s, wv1_s)
    return linear, quadratic * c2


def _quadratic_slab_state(w: Tensor, wv1: Tensor) -> Tensor:
    """(B, H, s, d), (B, H, s, dv + 1) -> (B, H, d, d (dv + 1)): sum_j w_j (w_j (x) wv1_j)."""
    outer = (w.unsqueeze(-1) * wv1.unsqueeze(-2)).flatten(-2)  # (B, H, s, d (dv + 1))
    return w.transpose(-2, -1) @ outer


def quadratic_apply(u: Tensor, state: tuple[Tensor, Tensor]) -> Tensor:
    """u: (B, H, n, d) centred queries -> (B, H, n, dv + 1) kernel sums ``sum_j (1 + t + c2 t^2) wv1_j``."""
    linear, quadratic = state
    B, H, n, d = u.shape
    d1 = linear.shape[-1]
    sums = []
    for u_s in u.split(slab_sizes(n, B * H * d * d1, "far", u.device), dim=2):
        sums.append(linear[..., :1, :] + u_s @ linear[..., 1:, :] + recomputed(_quadratic_slab_sums, u_s, quadratic))
    return torch.cat(sums, dim=2)


def _quadratic_slab_sums(u: Tensor, quadratic: Tensor) -> Tensor:
    """(B, H, s, d), (B, H, d, d (dv + 1)) -> (B, H, s, dv + 1): sum_ab u_a u_b quadratic[a, (b, :)]."""
    d = u.shape[-1]
    per_dim = (u @ quadratic).unflatten(-1, (d, -1))  # (B, H, s, d, dv + 1): sum_a u_a quadratic[a]
    return (u.unsqueeze(-2) @ per_dim).squeeze(-2)  # sum_b u_b per_dim[b]


def causal_far_sums(qf, kf, klog, v1, chunk_size: int, far_kv: Tensor | None, far_shift: Tensor | None):
    """Causal far-field sums (:func:`.causal_scan`): query i reads every key j <= i, scaled to the running
    shift s_i.

    qf: (B, H, L, D); kf: (B, H, L, D); klog: (B, H, L, 1); v1: (B, H, L, dv + 1)
    -> (F (B, H, L, dv + 1), shifts s (B, H, L), final state kv (B, H, D, dv + 1), final shift (B, H)).
    """
    B, H = qf.shape[:2]
    prev = qf.new_full((B, H), EMPTY_SHIFT) if far_shift is None else far_shift.to(qf.dtype)
    row = klog.squeeze(-1).detach().nan_to_num(neginf=EMPTY_SHIFT)  # (B, H, L)
    shifts = torch.cummax(torch.maximum(row, prev.unsqueeze(-1)), dim=-1).values  # (B, H, L): s_j
    kfs = kf * torch.exp(klog - shifts.unsqueeze(-1))  # (B, H, L, D), relative to s_j
    out, kv, shift = causal_scan(qf, kfs, v1, shifts, chunk_size, far_kv, prev)
    return out, shifts, kv, shift


def causal_far_state(kf, klog, v1) -> tuple[Tensor, Tensor]:
    """The state :func:`causal_far_sums` ends with after every key, in one pass: kv (B, H, D, dv + 1) relative to
    the shift (B, H), the largest key log-scale."""
    row = klog.squeeze(-1).detach().nan_to_num(neginf=EMPTY_SHIFT)  # (B, H, L)
    shift = row.amax(dim=-1).clamp_min(EMPTY_SHIFT)  # (B, H)
    kv = (kf * torch.exp(klog - shift[..., None, None])).transpose(-2, -1) @ v1  # (B, H, D, dv + 1)
    return kv, shift
