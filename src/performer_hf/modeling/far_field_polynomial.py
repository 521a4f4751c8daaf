"""The polynomial far fields of hybrid attention: ``kappa(u, w) = 1 + t + c2 t^2`` of ``t = u . w`` (``taylor2``:
``c2 = 1/2``, the "Based" kernel of Arora et al., 2024; ``poly2``: ``c2 = 1/4``, ``(1 + t / 2)^2``, never negative).

Deterministic (no projection), with features ``[1, u, (sqrt(g_ab) u_a u_b)_{a <= b}]`` of width
``1 + d + d (d + 1) / 2``; their values on a query's exact support follow from the exact logits for free, and the
bidirectional state over all keys is built here slab by slab without materialising features
(:func:`quadratic_state`, :func:`quadratic_apply`; compiled on the CPU by :mod:`.hybrid_compiled`).
"""

from __future__ import annotations

import torch

from .slabs import recomputed, slab_sizes

Tensor = torch.Tensor


def _products(u: Tensor, a: int) -> Tensor:
    """(..., d) -> (..., d - a): u_a * u_b for b >= a."""
    return u[..., a:] * u[..., a : a + 1]


def _quadratic_weights(d: int, a: int, c2: float, like: Tensor) -> Tensor:
    """(d - a,): c2 for the square u_a^2, 2 c2 for each cross term u_a u_b (b > a)."""
    weights = torch.full((d - a,), 2 * c2, dtype=like.dtype, device=like.device)
    weights[0] = c2
    return weights


def quadratic_features(c2: float):
    """The far-field feature function (``FarField.features``) of ``1 + t + c2 t^2``: features ``[1, u, q(u)]``
    with ``q(u) . q(w) = c2 (u . w)^2``.

    ``q`` holds ``sqrt(weight) * u_a u_b`` for the ``d (d + 1) / 2`` pairs ``a <= b``: width ``1 + d + d (d + 1) / 2``.
    """

    def features(u: Tensor, _projection, _parameter) -> tuple[Tensor, None]:
        d = u.shape[-1]
        quadratic = [_products(u, a) * _quadratic_weights(d, a, c2, u).sqrt() for a in range(d)]
        return torch.cat([torch.ones_like(u[..., :1]), u, *quadratic], dim=-1), None  # (B, H, L, D)

    return features


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


POLYNOMIAL = (quadratic_state, quadratic_apply)  # the polynomial far field's (state, apply), in PyTorch
