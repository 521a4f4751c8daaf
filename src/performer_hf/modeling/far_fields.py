"""The registry of hybrid attention's far-field kernels: what approximates ``exp(x . y)`` for the keys outside a
query's exact support (:mod:`.favor_hybrid`). Every other place (the config's choices, the CLI, model cards, the
converter) reads it.

A far field is a feature function ``phi`` with ``phi(u) . phi(w) ~ exp(u . w)`` on centred queries and keys; the
optional fields tell the attention code about faster ways to the same sums. Adding one: its module (the feature
function, e.g. :mod:`.far_field_polynomial`), one entry in :data:`FAR_FIELDS`, and its tests (the dense reference
in ``tests/hybrid_reference.py`` takes any registered kernel through its features).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .far_field_polynomial import quadratic_features
from .favor_features import FEATURE_MAPS
from .favor_optimal import optimal_exp_form, optimal_log_features

Tensor = torch.Tensor

# (u, projection, parameter) -> (base, log): u (B, H, L, d); base (B, H, L, D) or None;
# log (B, H, L, D) or None. phi(u) = base * exp(log); missing parts mean ones / zeros.
FarFeatureFn = Callable[[Tensor, Tensor | None, Tensor | None], tuple[Tensor | None, Tensor | None]]
# (projection, parameter) -> (directions, bias): the exponential kernels' features as
# exp(u D^T + bias - |u|^2 / 2) / sqrt(rows of D) (see favor_exp.ExpFeatures).
ExpFormFn = Callable[[Tensor, Tensor | None], tuple[Tensor, Tensor | None]]


@dataclass(frozen=True)
class FarField:
    """A far-field kernel of hybrid attention.

    Attributes:
        name: registry key (the ``far_field`` argument, ``PerformerConfig.attention_kernel``).
        description: what it computes, as model cards say it.
        features: ``(u, projection, parameter) -> (base, log)`` for centred queries or keys.
        quadratic: for the polynomial kernels ``1 + t + quadratic * t^2`` of ``t = u . w``: their values on the
            support follow from the exact logits, bidirectional attention builds their state without
            materialising features, and the compiled CPU kernels serve them. ``None``: values from features.
        uses_projection: whether a random projection is required.
        uses_parameter: whether the kernel has a per-head parameter (FAVOR++'s ``A``).
        exp_form: for the exponential kernels, ``(projection, parameter) -> (directions, bias)`` with the same
            features as ``features``, for the fused causal scan; None otherwise.
    """

    name: str
    description: str
    features: FarFeatureFn
    quadratic: float | None = None
    uses_projection: bool = True
    uses_parameter: bool = False
    exp_form: ExpFormFn | None = None


def _random_features(name: str) -> FarField:
    """One of FAVOR+'s exponential feature maps (:mod:`.favor_features`) as a far field (no parameter)."""
    feature_map = FEATURE_MAPS[name]

    def features(u: Tensor, projection: Tensor, _parameter) -> tuple[None, Tensor]:
        return feature_map.compute(u, projection)  # (None, log-features (B, H, L, m'))

    def exp_form(projection: Tensor, _parameter) -> tuple[Tensor, None]:
        return feature_map.exp_directions(projection), None

    return FarField(name, feature_map.description, features, exp_form=exp_form)


def _optimal_features(u: Tensor, projection: Tensor, parameter: Tensor) -> tuple[None, Tensor]:
    return None, optimal_log_features(u, projection, parameter)  # (B, H, L, m)


def _polynomial(name: str, c2: float, description: str) -> FarField:
    return FarField(name, description, quadratic_features(c2), quadratic=c2, uses_projection=False)


FAR_FIELDS: dict[str, FarField] = {
    far.name: far
    for far in (
        _random_features("softmax"),
        _random_features("softmax_hyperbolic"),
        FarField(
            "softmax_opt",
            "FAVOR++ optimal positive random features (Likhosherstov et al., 2022)",
            _optimal_features,
            uses_parameter=True,
            exp_form=optimal_exp_form,
        ),
        _polynomial("taylor2", 0.5, "deterministic second-order Taylor kernel 1 + t + t^2/2"),
        _polynomial("poly2", 0.25, "deterministic second-order polynomial kernel (1 + t/2)^2"),
    )
}


def get_far_field(name: str) -> FarField:
    """Look up a far-field kernel by name, with an error that lists the valid names."""
    try:
        return FAR_FIELDS[name]
    except KeyError:
        raise ValueError(f"Unknown far_field {name!r}; choose one of {sorted(FAR_FIELDS)}.") from None
