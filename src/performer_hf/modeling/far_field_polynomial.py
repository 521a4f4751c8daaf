"""The polynomial far fields of hybrid attention: ``kappa(u, w) = 1 + t + c2 t^2`` of ``t = u . w`` (``taylor2``:
``c2 = 1/2``, the "Based" kernel of Arora et al., 2024; ``poly2``: ``c2 = 1/4``, ``(1 + t / 2)^2``, never negative).

Deterministic (no projection), with features ``[1, u, (sqrt(g_ab) u_a u_b)_{a <= b}]`` of width
``1 + d + d (d + 1) / 2``; their values on a query's exact support follow from the exact logits for free. The
bidirectional state over all keys is built here slab by slab (:func:`quadratic_state`, :func:`quadratic_apply`; in
the compiled CPU kernels of :mod:`.hybrid_compiled` on a CPU), in one of two ways that give the same sums, by device:

- on a CPU, without features: outer products of keys and values, ``d (dv + 1)`` wide, whose matrix products are
  cache-friendly (eager PyTorch there: 3.2x faster forward and backward than explicit features, 4K tokens);
- on accelerators, from the features (:func:`pair_products`), ``F = 1 + d + d (d + 1) / 2`` wide, as the CPU kernels
  hold them: about half the width, and under ``torch.compile`` 2.2x fewer bytes read and written for the state and
  the sums, forward and backward (inductor's count, 12 heads x 4K tokens x 32 dims: 1.51 against 3.25 GB), which
  is what a GPU's time follows;
- on CUDA with Triton, for the head dims its tiles take, in the kernels of :mod:`.far_field_triton`, which keep the
  features in registers (:func:`.far_field_triton.serves`).
"""

from __future__ import annotations

import torch

from .far_field_triton import quadratic_apply as triton_apply
from .far_field_triton import quadratic_state as triton_state
from .far_field_triton import serves as triton_serves
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


def from_features(device: torch.device) -> bool:
    """Whether the bidirectional state is built from explicit features on ``device`` (accelerators), not from outer
    products (a CPU)."""
    return device.type != "cpu"


class _PairProducts(torch.autograd.Function):
    """(..., d) -> (..., d (d + 1) / 2): ``u_a u_b`` for the pairs ``a <= b``, row by row (``a``, then ``b``). Both
    directions gather: backward takes each ``u_c``'s gradient as ``sum_b G_cb u_b`` from the symmetric (d, d) matrix
    ``G`` of the pairs' gradients (its diagonal doubled), where autograd's own backward of a gather adds into ``u``
    atomically on a GPU."""

    @staticmethod
    def forward(ctx, u: Tensor) -> Tensor:
        first, second = torch.triu_indices(u.shape[-1], u.shape[-1], device=u.device)
        ctx.save_for_backward(u)
        return u[..., first] * u[..., second]

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (u,) = ctx.saved_tensors
        d = u.shape[-1]
        first, second = torch.triu_indices(d, d, device=u.device)
        pair = torch.empty(d, d, dtype=torch.long, device=u.device)  # (d, d): the pair of (a, b), either order
        pair[first, second] = torch.arange(first.numel(), device=u.device)
        pair[second, first] = pair[first, second]
        doubled = torch.eye(d, dtype=grad.dtype, device=u.device) + 1  # d (u_a^2) / d u_a = 2 u_a
        symmetric = grad[..., pair.flatten()].unflatten(-1, (d, d)) * doubled  # (..., d, d)
        return (symmetric @ u.unsqueeze(-1)).squeeze(-1)


def pair_products(u: Tensor) -> Tensor:
    """(..., d) -> (..., d (d + 1) / 2): ``u_a u_b`` for ``a <= b``, in the order of ``torch.triu_indices``."""
    return _PairProducts.apply(u)


def _key_features(w: Tensor, c2: float) -> Tensor:
    """(..., d) -> (..., F): ``[1, w, (g_ab w_a w_b)_{a <= b}]``, ``g_aa = c2``, ``g_ab = 2 c2`` (the compiled CPU
    kernels' key features: with the query features ``[1, u, (u_a u_b)_{a <= b}]``, the kernel ``1 + t + c2 t^2``)."""
    d = w.shape[-1]
    first, second = torch.triu_indices(d, d, device=w.device)
    weights = torch.where(first == second, c2, 2 * c2).to(w.dtype)  # (d (d + 1) / 2,)
    return torch.cat([torch.ones_like(w[..., :1]), w, pair_products(w) * weights], dim=-1)


def _query_features(u: Tensor) -> Tensor:
    """(..., d) -> (..., F): ``[1, u, (u_a u_b)_{a <= b}]``."""
    return torch.cat([torch.ones_like(u[..., :1]), u, pair_products(u)], dim=-1)


def _feature_width(d: int) -> int:
    return 1 + d + d * (d + 1) // 2


def _feature_slab_state(w: Tensor, wv1: Tensor, c2: float) -> Tensor:
    """(B, H, s, d), (B, H, s, dv + 1) -> (B, H, F, dv + 1): sum_j key_features(w_j) wv1_j^T."""
    return _key_features(w, c2).transpose(-2, -1) @ wv1


def quadratic_state(w: Tensor, wv1: Tensor, c2: float, precision: str = "pytorch") -> tuple[Tensor, Tensor] | Tensor:
    """State of the kernel ``1 + t + c2 t^2`` over all keys, for :func:`quadratic_apply` on the same device.

    w: (B, H, S, d) centred keys; wv1: (B, H, S, dv + 1) their weighted values ``exp(klog - s) [v, 1]``.

    On a CPU, without materialising features: ``linear`` (B, H, 1 + d, dv + 1) ``= [1, w]^T wv1`` and ``quadratic``
    (B, H, d, d (dv + 1)) ``= c2 sum_j w_j (w_j (x) wv1_j)``: row ``a``, column ``(b, e)`` holds
    ``c2 sum_j w_ja w_jb wv1_je``. On accelerators (:func:`from_features`): (B, H, F, dv + 1)
    ``= sum_j key_features(w_j) wv1_j^T``, the compiled CPU kernels' state. Where the Triton kernels serve:
    (B, H, 1 + d + d^2, dv + 1) (:func:`.far_field_triton.quadratic_state`, its products in ``precision``).
    """
    B, H, S, d = w.shape
    if triton_serves(w, wv1.shape[-1]):
        return triton_state(w, wv1, c2, precision)
    if from_features(w.device):
        sizes = slab_sizes(S, B * H * _feature_width(d), "far", w.device)
        state = 0
        for w_s, wv1_s in zip(w.split(sizes, dim=2), wv1.split(sizes, dim=2), strict=True):
            state = state + recomputed(_feature_slab_state, w_s, wv1_s, c2)
        return state
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


def _feature_slab_sums(u: Tensor, state: Tensor) -> Tensor:
    """(B, H, s, d), (B, H, F, dv + 1) -> (B, H, s, dv + 1): query_features(u) @ state."""
    return _query_features(u) @ state


def quadratic_apply(u: Tensor, state: tuple[Tensor, Tensor] | Tensor, precision: str = "pytorch") -> Tensor:
    """u: (B, H, n, d) centred queries -> (B, H, n, dv + 1) kernel sums ``sum_j (1 + t + c2 t^2) wv1_j``, from the
    :func:`quadratic_state` of the keys (built on the same device; ``precision``: the Triton kernels')."""
    B, H, n, d = u.shape
    if not isinstance(state, tuple) and state.shape[-2] == 1 + d + d * d:  # the Triton kernels' state
        return triton_apply(u, state, precision)
    if from_features(u.device):
        sizes = slab_sizes(n, B * H * _feature_width(d), "far", u.device)
        return torch.cat([recomputed(_feature_slab_sums, u_s, state) for u_s in u.split(sizes, dim=2)], dim=2)
    linear, quadratic = state
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
