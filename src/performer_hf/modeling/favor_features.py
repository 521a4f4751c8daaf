"""Feature maps ``phi`` for kernelized attention, kept in a registry by name.

Every map is written as ``phi(x) = base(x) * exp(log_scale(x))`` so that the attention code
can subtract a max from ``log_scale`` before exponentiating (the shift cancels in the
attention ratio) and stay finite for large-norm queries and keys. ``base`` or ``log_scale``
may be ``None`` (meaning ones / zeros).

Inputs ``x`` are queries or keys already multiplied by ``sqrt(scaling)``, so that
``phi(q) . phi(k)`` estimates ``exp(q . k)`` for the softmax-kernel maps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor
# (x, projection) -> (base, log_scale); x: (..., L, d), projection: (m, d)
FeatureFn = Callable[[Tensor, Tensor], tuple[Tensor | None, Tensor | None]]

RELU_EPSILON = 1e-3


@dataclass(frozen=True)
class FeatureMap:
    """A named feature map and the facts the attention code needs about it.

    Attributes:
        name: registry key (the ``kernel`` argument of ``favor_attention``).
        compute: ``(x, projection) -> (base, log_scale)``.
        description: what the map computes, as model cards say it.
        query_stabilizer: added to each query feature after the per-query max shift, so that
            the attention normaliser can never be zero (relative to the largest feature: the output depends on that
            max, and its gradient goes through it).
        uses_projection: whether the map reads the random projection at all.
        nonnegative: whether the features are guaranteed >= 0 (a valid attention distribution).
        exp_directions: for maps of the form ``exp(x D^T - |x|^2 / 2) / sqrt(rows of D)``, the rows ``D`` as a
            function of the projection: FAVOR+ then runs them in its slabbed autograd functions
            (:mod:`.favor_exp`); ``None`` for other maps.
    """

    name: str
    compute: FeatureFn
    description: str
    query_stabilizer: float = 0.0
    uses_projection: bool = True
    nonnegative: bool = True
    exp_directions: Callable[[Tensor], Tensor] | None = None


def _half_sq_norm(x: Tensor) -> Tensor:
    return 0.5 * x.pow(2).sum(dim=-1, keepdim=True)  # (..., L, 1)


def _softmax_positive(x: Tensor, projection: Tensor) -> tuple[None, Tensor]:
    # Lemma 1: exp(w.x - |x|^2 / 2) / sqrt(m)
    m = projection.shape[0]
    logits = x @ projection.T  # (..., L, m)
    return None, logits - _half_sq_norm(x) - 0.5 * math.log(m)


def _softmax_hyperbolic(x: Tensor, projection: Tensor) -> tuple[None, Tensor]:
    # [exp(w.x), exp(-w.x)] * exp(-|x|^2 / 2) / sqrt(2m)
    m = projection.shape[0]
    logits = x @ projection.T  # (..., L, m)
    both = torch.cat([logits, -logits], dim=-1)  # (..., L, 2m)
    return None, both - _half_sq_norm(x) - 0.5 * math.log(2 * m)


def _softmax_trig(x: Tensor, projection: Tensor) -> tuple[Tensor, Tensor]:
    # [sin(w.x), cos(w.x)] * exp(|x|^2 / 2) / sqrt(m): unbiased but not positive
    m = projection.shape[0]
    logits = x @ projection.T  # (..., L, m)
    base = torch.cat([torch.sin(logits), torch.cos(logits)], dim=-1) / math.sqrt(m)  # (..., L, 2m)
    return base, _half_sq_norm(x)


def _relu(x: Tensor, projection: Tensor) -> tuple[Tensor, None]:
    # Generalized attention with f = ReLU (the paper's "Performer-ReLU")
    m = projection.shape[0]
    return F.relu(x @ projection.T) / math.sqrt(m) + RELU_EPSILON, None


def _elu(x: Tensor, projection: Tensor) -> tuple[Tensor, None]:
    # elu(x) + 1, the Linear Transformer of Katharopoulos et al. (2020); ignores the projection
    return F.elu(x) + 1.0, None


def _hyperbolic_directions(projection: Tensor) -> Tensor:
    return torch.cat([projection, -projection], dim=0)  # (2m, d): [exp(w.x), exp(-w.x)]


FEATURE_MAPS: dict[str, FeatureMap] = {
    fm.name: fm
    for fm in (
        FeatureMap(
            "softmax",
            _softmax_positive,
            "FAVOR+ positive random features (unbiased softmax kernel)",
            query_stabilizer=1e-6,
            exp_directions=lambda projection: projection,
        ),
        FeatureMap(
            "softmax_hyperbolic",
            _softmax_hyperbolic,
            "FAVOR+ hyperbolic positive random features (softmax kernel)",
            query_stabilizer=1e-6,
            exp_directions=_hyperbolic_directions,
        ),
        FeatureMap("softmax_trig", _softmax_trig, "trigonometric random features (softmax kernel)", nonnegative=False),
        FeatureMap("relu", _relu, "generalized attention with ReLU features"),
        FeatureMap("elu", _elu, "elu + 1 features", uses_projection=False),
    )
}


def get_feature_map(kernel: str) -> FeatureMap:
    """Look up a feature map by name, with an error that lists the valid names."""
    try:
        return FEATURE_MAPS[kernel]
    except KeyError:
        raise ValueError(f"Unknown FAVOR kernel {kernel!r}; choose one of {sorted(FEATURE_MAPS)}.") from None


def feature_map(x: Tensor, projection: Tensor, kernel: str = "softmax") -> Tensor:
    """Explicit features ``phi(x)`` of shape ``(..., L, m')``, without any shift.

    ``phi(q) @ phi(k).T`` estimates the kernel matrix (``exp(q k^T)`` for the softmax maps).
    Meant for references and studies; ``favor_attention`` uses a numerically safer path.
    """
    base, log_scale = get_feature_map(kernel).compute(x, projection)
    if log_scale is None:
        return base
    scale = torch.exp(log_scale)
    return scale if base is None else base * scale
