"""Label-free calibration at conversion: fixed per-layer statistics of the queries and keys.

Hybrid attention reads two statistics of the scaled queries ``x = q d^-1/4`` and keys ``y = k d^-1/4``
that bidirectional attention may take from each sequence, but that causal attention must fix
beforehand (a statistic of the whole sequence would let a position read later ones):

- the centres ``a = mean x`` and ``c = mean y`` per layer and head (``center_features``), stored in
  the attention modules' ``query_center`` / ``key_center`` buffers;
- FAVOR++'s parameter ``A`` per layer and head (``attention_kernel="softmax_opt"``), starting from the
  closed form of :func:`performer_hf.modeling.favor_optimal.optimal_parameter` for the statistic
  ``rho = mean |u + w|^2 / d`` of the centred queries and keys, then chosen per head among a few
  multiples of it by attention-output error against exact attention; stored in
  ``config.far_field_parameter``.

Both are measured on the real tokens of a little text run through the exact-attention twin of the
converted model (the same weights as the source, so the source is the teacher): each layer sees the
queries and keys the source model produces there.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..modeling.far_fields import get_far_field
from ..modeling.favor_hybrid import fixed_centres
from ..modeling.favor_optimal import optimal_parameter
from ..modeling.layers_performer import PerformerAttention
from ..modeling.method_exact import exact_attention
from ..modeling.method_hybrid import hybrid_method
from ..modeling.modeling_performer import PerformerPreTrainedModel
from .fidelity import approximation_only

logger = logging.getLogger(__name__)


def _attention_modules(model: nn.Module) -> list[PerformerAttention]:
    return [module for module in model.modules() if isinstance(module, PerformerAttention)]


@torch.no_grad()
def attention_inputs(exact: nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the hidden states ``(B, L, hidden)`` entering the attention of ``exact`` (the converted
    model with ``attention_kernel="exact"``, in eval mode) on ``batch``."""
    captured: list[torch.Tensor] = []

    def hook(module: PerformerAttention, args, kwargs):
        captured.append(args[0] if args else kwargs["hidden_states"])

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in _attention_modules(exact)]
    try:
        exact(**batch, use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
    return captured


def _heads(module: PerformerAttention, hidden: torch.Tensor) -> list[torch.Tensor]:
    """q, k, v: (B, H, L, d) of ``module`` for ``hidden`` (B, L, hidden)."""
    return [module._split_heads(layer(hidden)) for layer in (module.query, module.key, module.value)]


def _head_errors(candidate: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(H,) relative errors over the real tokens; candidate, reference (B, H, L, d), mask (B, L)."""
    keep = mask[:, None, :, None].to(reference.dtype)
    diff = ((candidate - reference) * keep).pow(2).sum(dim=(0, 2, 3))
    return (diff / (reference * keep).pow(2).sum(dim=(0, 2, 3)).clamp_min(1e-30)).sqrt()


# Candidate FAVOR++ parameters, as multiples of the closed-form A* (0: plain FAVOR+ features).
PARAMETER_FACTORS = (1.0, 0.5, 2.0, 0.0)


def _select_parameter(module: PerformerAttention, qkv, mask, causal: bool, closed_form: torch.Tensor):
    """Per head, the candidate ``A`` (:data:`PARAMETER_FACTORS` times ``closed_form`` (H,)) whose
    attention output is closest to exact attention on the sample. Returns (A per head, its errors)."""
    q, k, v = qkv
    reference, _ = exact_attention(module, q, k, v, mask, causal)  # (B, H, L, d)
    errors = []
    for factor in PARAMETER_FACTORS:
        module.far_field_parameter = (factor * closed_form).tolist()
        errors.append(_head_errors(hybrid_method(module, q, k, v, mask, causal)[0], reference, mask))
    errors = torch.stack(errors)  # (F, H)
    best = errors.argmin(dim=0)  # (H,)
    factors = torch.tensor(PARAMETER_FACTORS, dtype=closed_form.dtype)[best]
    heads = torch.arange(errors.shape[1])
    return (factors * closed_form).tolist(), errors[best, heads].tolist()


@torch.no_grad()
def calibrate(
    model: nn.Module, exact: nn.Module, batch: dict[str, torch.Tensor], causal: bool, parameter: bool = True
) -> dict:
    """Set ``model``'s fixed centres (if ``causal`` and ``center_features``: bidirectional attention centres each
    sequence by its own means) and FAVOR++ ``A`` (if ``"softmax_opt"`` and ``parameter``).

    The centres are the means of the scaled queries and keys over the sample's real tokens. For ``A``
    each head starts from the closed form of its statistic ``rho`` and keeps whichever of
    :data:`PARAMETER_FACTORS` times it gives the lowest attention-output error against exact
    attention on the sample (label-free: the source is the teacher; the projection is the model's own).

    Args:
        model: the converted hybrid Performer (modified in place: buffers, ``config.far_field_parameter``
            and the attention modules' copies of it).
        exact: its exact-attention twin with the same weights.
        batch: ``input_ids``, ``attention_mask`` (and ``token_type_ids``) of sample text.
        causal: whether the model attends causally (the errors are measured that way).
        parameter: calibrate ``A`` (False keeps a ``far_field_parameter`` the user chose).
    Returns:
        What was set, for the conversion report: ``{"centres": bool, "far_field_parameter": list | None,
        "far_field_error": per-layer lists of per-head errors or None, "num_tokens": int}``.
    """
    config = model.config
    if "token_type_ids" in batch and config.type_vocab_size == 0:
        batch = {k: v for k, v in batch.items() if k != "token_type_ids"}
    mask = batch["attention_mask"].bool()  # (B, L)
    optimise = parameter and get_far_field(config.attention_kernel).uses_parameter
    centres = causal and config.center_features
    parameters, errors = [], []
    with approximation_only(model):  # A is chosen for the far field, which short inputs would skip
        for module, hidden in zip(_attention_modules(model), attention_inputs(exact, batch), strict=True):
            qkv = _heads(module, hidden)
            a, c = fixed_centres(*qkv[:2], mask)  # (H, d)
            if centres:
                module.query_center.copy_(a)
                module.key_center.copy_(c)
            elif not config.center_features:
                a = c = torch.zeros_like(a)
            if optimise:
                root = module.head_dim**-0.25
                x, y = (t.transpose(1, 2)[mask] * root for t in qkv[:2])  # (N, H, d): scaled, real tokens
                u, w = (x - a).double(), (y - c).double()  # (N, H, d)
                # rho = mean_{i,j} |u_i + w_j|^2 / d = (mean |u|^2 + mean |w|^2 + 2 mean u . mean w) / d
                rho = u.pow(2).sum(-1).mean(0) + w.pow(2).sum(-1).mean(0) + 2 * (u.mean(0) * w.mean(0)).sum(-1)
                row, error = _select_parameter(module, qkv, mask, causal, optimal_parameter(rho / u.shape[-1]))
                module.far_field_parameter = row
                parameters.append(row)
                errors.append(error)
    if optimise:
        config.far_field_parameter = parameters
        for module in model.modules():  # what its attention modules now run (the config's A, set in both)
            if isinstance(module, PerformerPreTrainedModel):
                module.record_attention_settings()
    num_tokens = int(mask.sum())
    logger.info(
        "calibrated on %d tokens: %s%s",
        num_tokens,
        "centres" if centres else "",
        ", FAVOR++ A per layer and head" if optimise else "",
    )
    return {
        "centres": bool(centres),
        "far_field_parameter": parameters if optimise else None,
        "far_field_error": errors if optimise else None,
        "num_tokens": num_tokens,
    }
