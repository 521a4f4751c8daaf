"""Optimal positive random features (FAVOR++, Likhosherstov et al., NeurIPS 2022, arXiv 2205.15317).

Generalised exponential random features for the softmax kernel ``exp(x . y)``, with
``w ~ N(0, I_d)`` and one real parameter ``A < 1/8``::

    f(w, x) = (1 - 4A)^(d/4) * exp(A |w|^2 + sqrt(1 - 4A) w . x - |x|^2 / 2)

``E_w[f(w, x) f(w, y)] = exp(x . y)`` for every ``A < 1/4`` (a Gaussian integral), the features
are positive and bounded in ``w`` when ``A < 0``, and ``A = 0`` is FAVOR+ (Lemma 1 of the
Performer paper). The second moment of one sample is::

    E[f^2(w, x) f^2(w, y)] = (1 - 4A)^d (1 - 8A)^(-d/2) exp(2 (1 - 4A) |x + y|^2 / (1 - 8A) - |x|^2 - |y|^2)

Averaging its logarithm over all query/key pairs leaves one statistic,
``rho = mean_{i,j} |x_i + y_j|^2 / d = (mean |x|^2 + mean |y|^2 + 2 mean(x) . mean(y)) / d``,
and setting the derivative in ``A`` to zero gives ``16 A^2 + (4 rho - 2) A - rho = 0``, whose
root below ``1/8`` is the closed form::

    A* = (1 - 2 rho - sqrt((2 rho + 1)^2 + 8 rho)) / 16        (always <= 0)

In bidirectional attention ``rho`` may come from the sequence itself; in causal attention it
must not look at future positions, so callers fix ``A`` per layer and head (e.g. at conversion).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def optimal_parameter(rho: Tensor | float) -> Tensor:
    """The variance-minimising ``A*`` for the statistic ``rho = mean |x + y|^2 / d`` (any shape)."""
    rho = rho if torch.is_tensor(rho) else torch.tensor(float(rho), dtype=torch.float64)
    # checked eagerly; a compiled model's rho is its own statistic (a mean of squares): the check would break the graph
    if not torch.compiler.is_compiling() and bool((rho < 0).any()):
        raise ValueError("rho = mean |x + y|^2 / d is a mean of squared norms and cannot be negative.")
    return (1 - 2 * rho - torch.sqrt((2 * rho + 1) ** 2 + 8 * rho)) / 16


def pair_statistic(x: Tensor, y: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
    """``rho = mean_{i,j} |x_i + y_j|^2 / d`` per (batch, head), over real tokens only.

    Args:
        x: ``(B, H, Lq, d)`` scaled queries; y: ``(B, H, Lk, d)`` scaled keys.
        key_padding_mask: ``(B, Lk)``, True for real tokens; applied to the keys (and to the
            queries when ``Lq == Lk``, i.e. self-attention).
    Returns:
        ``(B, H)``.
    """
    d = x.shape[-1]
    if key_padding_mask is None:
        wx = x.new_full(x.shape[:-1], 1.0 / x.shape[-2])  # (B, H, Lq)
        wy = y.new_full(y.shape[:-1], 1.0 / y.shape[-2])
    else:
        keep = key_padding_mask.to(y.dtype)[:, None, :]  # (B, 1, Lk)
        wy = (keep / keep.sum(-1, keepdim=True).clamp_min(1)).expand(y.shape[:-1])
        wx = wy if x.shape[-2] == y.shape[-2] else x.new_full(x.shape[:-1], 1.0 / x.shape[-2])
    mean_sq_x = (x.pow(2).sum(-1) * wx).sum(-1)  # (B, H)
    mean_sq_y = (y.pow(2).sum(-1) * wy).sum(-1)
    mean_x = (x * wx.unsqueeze(-1)).sum(-2)  # (B, H, d)
    mean_y = (y * wy.unsqueeze(-1)).sum(-2)
    return (mean_sq_x + mean_sq_y + 2 * (mean_x * mean_y).sum(-1)) / d


def optimal_exp_form(projection: Tensor, a: Tensor | float) -> tuple[Tensor, Tensor]:
    """FAVOR++'s features as exponential features ``exp(x D^T + bias - |x|^2 / 2) / sqrt(m)`` (the form
    :func:`.favor_attention.causal_exp_sums` takes): ``D = sqrt(1 - 4A) W`` and
    ``bias_r = A |w_r|^2 + (d / 4) log(1 - 4A)``.

    Args:
        projection: ``(m, d)``, rows ``w_r`` (Gaussian marginals: any coupling of draw_projection
            with ``row_norms="chi"`` keeps the estimator unbiased).
        a: the parameter ``A`` (``< 1/8``): a float or a tensor broadcastable to ``(B, H)``.
    Returns:
        ``D``: (m, d), or (.., m, d) for a tensor ``A`` of shape (..); ``bias``: (1, m) or (.., 1, m).
    """
    m, d = projection.shape
    a = torch.as_tensor(a, dtype=projection.dtype, device=projection.device)
    # checked eagerly; a compiled model's A is its validated config's or the closed form's (<= 0), and the check
    # would break the graph
    if not torch.compiler.is_compiling() and bool((a >= 0.125).any()):
        raise ValueError(f"The FAVOR++ parameter A must be below 1/8 (finite variance); got max {float(a.max())}.")
    a = a.reshape(*a.shape, 1, 1)  # (.., 1, 1)
    shrink = 1 - 4 * a
    directions = torch.sqrt(shrink) * projection  # (.., m, d)
    bias = a * projection.pow(2).sum(-1) + (d / 4) * torch.log(shrink)  # (.., 1, m)
    return directions, bias


def optimal_log_features(x: Tensor, projection: Tensor, a: Tensor | float) -> Tensor:
    """Log of the FAVOR++ features ``f(w_r, x) / sqrt(m)`` for every row ``w_r`` of the projection.

    Args:
        x: ``(B, H, L, d)`` scaled queries or keys.
        projection, a: as for :func:`optimal_exp_form`.
    Returns:
        ``(B, H, L, m)``: ``log f`` such that ``sum_r exp(lf_r(x) + lf_r(y))`` estimates ``exp(x . y)``.
    """
    directions, bias = optimal_exp_form(projection.to(x.dtype), a)
    m = projection.shape[0]
    return x @ directions.transpose(-2, -1) + bias - 0.5 * math.log(m) - 0.5 * x.pow(2).sum(-1, keepdim=True)


__all__ = ["optimal_exp_form", "optimal_log_features", "optimal_parameter", "pair_statistic"]
