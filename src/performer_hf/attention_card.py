"""What model cards say about a checkpoint's attention: one place for the three card writers
(conversion, zoo, training)."""

from __future__ import annotations

import statistics

from .modeling.attention_methods import ATTENTION_METHODS
from .modeling.configuration_performer import PerformerConfig

# what each attention_kernel computes
KERNEL_DESCRIPTIONS = {
    "softmax": "FAVOR+ positive random features (unbiased softmax kernel)",
    "softmax_hyperbolic": "FAVOR+ hyperbolic positive random features (softmax kernel)",
    "softmax_trig": "trigonometric random features (softmax kernel)",
    "softmax_opt": "FAVOR++ optimal positive random features (Likhosherstov et al., 2022)",
    "taylor2": "deterministic second-order Taylor kernel 1 + t + t^2/2",
    "poly2": "deterministic second-order polynomial kernel (1 + t/2)^2",
    "relu": "generalized attention with ReLU features",
    "elu": "elu + 1 features",
    "exact": "exact softmax attention (no approximation)",
}


def method_description(config: PerformerConfig) -> str:
    """What replaces softmax attention, as the attention-method registry describes it, and the inputs that
    keep exact attention (``exact_max_length``)."""
    description = ATTENTION_METHODS[config.attention_method].description
    if config.exact_max_length and config.attention_method != "exact":
        exact = (
            f"the first {config.exact_max_length} positions attend exactly (softmax)"
            if config.is_decoder
            else f"inputs of at most {config.exact_max_length} tokens keep exact softmax attention"
        )
        description += f" ({exact}: faster there, and the quality the approximation aims for)"
    return description


def hybrid_lines(config: PerformerConfig) -> list[str]:
    """The hybrid-attention settings as card bullet points."""
    routed = (
        f"{config.routed_blocks} blocks of {config.route_block_size} keys per block of {config.query_block_size} "
        "queries, chosen by the mean logit between the blocks (bidirectional only)"
        + (
            f"; only the blocks of the {config.routed_blocks} groups of {config.route_group_size} blocks that may "
            "hold the best ones are scored"
            if config.route_group_size
            else ""
        )
        if config.routed_blocks
        else "none"
    )
    if isinstance(config.far_field_parameter, list):
        parameter = "per layer and head, calibrated or learned at conversion"
    elif config.far_field_parameter is not None:
        parameter = f"{config.far_field_parameter}"
    else:
        parameter = "closed-form optimum from each sequence's statistics"
    lines = [
        f"- exact local window: {config.local_window} tokens" if config.local_window else "- exact local window: none",
        f"- global tokens (exact for every query): {config.num_global_tokens}",
        f"- routed exact key blocks: {routed}",
        "- centred queries and keys before the far field: "
        + (
            "yes (per-sequence means bidirectionally; fixed per-layer centres, calibrated at conversion, when causal)"
            if config.center_features
            else "no"
        ),  # fmt: skip
    ]
    if config.attention_kernel == "softmax_opt":
        lines.append(f"- FAVOR++ parameter A: {parameter}")
    if isinstance(config.far_field_gain, list):
        gains = sorted(gain for row in config.far_field_gain for gain in row)
        lines.append(
            "- far-field gain per layer and head (learned by attention transfer): "
            f"median {statistics.median(gains):.3g}, from {gains[0]:.3g} to {gains[-1]:.3g}"
        )
    elif config.far_field_gain is not None:
        lines.append(f"- far-field gain: {config.far_field_gain}")
    return lines


def transfer_summary(transfer: dict) -> str:
    """What attention transfer did, from its record in ``conversion_report.json`` (``text``, ``steps``,
    ``tokens``, ``relative_error_first`` / ``relative_error_last`` per layer)."""
    first, last = (
        sum(errors.values()) / len(errors)
        for errors in (transfer["relative_error_first"], transfer["relative_error_last"])
    )
    return (
        "Attention transfer at conversion: the attention's small learnable parts (its feature projection; the "
        f"hybrid's centres, FAVOR++ parameters and far-field gains) were trained for {transfer['steps']} steps on "
        f"{transfer['tokens']:,} tokens of {transfer['text']} to match the source's attention outputs, every other "
        f"weight frozen (mean relative error per layer {first:.4f} -> {last:.4f})."
    )
