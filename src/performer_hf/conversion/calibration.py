"""Label-free calibration at conversion: fixed per-layer statistics of the queries and keys.

Hybrid attention reads two statistics of the scaled queries ``x = q d^-1/4`` and keys ``y = k d^-1/4``
that bidirectional attention may take from each sequence, but that causal attention must fix
beforehand (a statistic of the whole sequence would let a position read later ones):

- the centres ``a = mean x`` and ``c = mean y`` per layer and head (``center_features``), stored in
  the attention modules' ``query_center`` / ``key_center`` buffers;
- FAVOR++'s parameter ``A`` per layer and head (``attention_kernel="softmax_opt"``), the closed form
  of :func:`performer_hf.favor_optimal.optimal_parameter` for the statistic ``rho = mean |u + w|^2 / d``
  of the centred queries and keys, stored in ``config.far_field_parameter``.

Both are measured on the real tokens of a little text run through the exact-attention twin of the
converted model (the same weights as the source, so the source is the teacher): each layer sees the
queries and keys the source model produces there.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..favor_optimal import optimal_parameter
from ..modeling_performer import PerformerAttention

logger = logging.getLogger(__name__)


def _attention_modules(model: nn.Module) -> list[PerformerAttention]:
    return [module for module in model.modules() if isinstance(module, PerformerAttention)]


@torch.no_grad()
def scaled_queries_and_keys(exact: nn.Module, batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, the scaled queries and keys of the real tokens of ``batch``: ``(N, H, d)`` each.

    ``exact`` is the converted model with ``attention_kernel="exact"`` (eval mode).
    """
    mask = batch["attention_mask"].bool()  # (B, L)
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []

    def hook(module: PerformerAttention, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]  # (B, L, hidden)
        root = module.head_dim**-0.25
        q, k = (module._split_heads(layer(hidden)) * root for layer in (module.query, module.key))  # (B, H, L, d)
        captured.append((q.transpose(1, 2)[mask], k.transpose(1, 2)[mask]))  # (N, H, d) each

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in _attention_modules(exact)]
    try:
        exact(**batch, use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
    return captured


@torch.no_grad()
def calibrate(model: nn.Module, exact: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    """Set ``model``'s fixed centres (if ``center_features``) and FAVOR++ ``A`` (if ``"softmax_opt"``).

    Args:
        model: the converted hybrid Performer (modified in place: buffers, ``config.far_field_parameter``
            and the attention modules' copies of it).
        exact: its exact-attention twin with the same weights.
        batch: ``input_ids``, ``attention_mask`` (and ``token_type_ids``) of sample text.
    Returns:
        What was set, for the conversion report: ``{"centres": bool, "far_field_parameter": list | None,
        "num_tokens": int}``.
    """
    config = model.config
    if "token_type_ids" in batch and config.type_vocab_size == 0:
        batch = {k: v for k, v in batch.items() if k != "token_type_ids"}
    statistics = scaled_queries_and_keys(exact, batch)
    modules = _attention_modules(model)
    parameters = []
    for module, (x, y) in zip(modules, statistics, strict=True):
        a, c = x.mean(0), y.mean(0)  # (H, d)
        if config.center_features:
            module.query_center.copy_(a)
            module.key_center.copy_(c)
        else:
            a = c = torch.zeros_like(a)
        u, w = (x - a).double(), (y - c).double()  # (N, H, d)
        # rho = mean_{i,j} |u_i + w_j|^2 / d = (mean |u|^2 + mean |w|^2 + 2 mean u . mean w) / d
        rho = (u.pow(2).sum(-1).mean(0) + w.pow(2).sum(-1).mean(0) + 2 * (u.mean(0) * w.mean(0)).sum(-1)) / u.shape[-1]
        parameters.append(optimal_parameter(rho).tolist())  # (H,)
    far_field_parameter = None
    if config.attention_kernel == "softmax_opt":
        far_field_parameter = parameters
        config.far_field_parameter = parameters
        for module, row in zip(modules, parameters, strict=True):
            module.far_field_parameter = row
    num_tokens = int(batch["attention_mask"].sum())
    logger.info(
        "calibrated on %d tokens: %s%s", num_tokens, "centres" if config.center_features else "",
        ", FAVOR++ A per layer and head" if far_field_parameter is not None else "",
    )  # fmt: skip
    return {"centres": bool(config.center_features), "far_field_parameter": far_field_parameter,
            "num_tokens": num_tokens}  # fmt: skip
