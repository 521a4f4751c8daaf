"""What model cards say about a checkpoint's attention: one place for the three card writers
(conversion, zoo, training)."""

from __future__ import annotations

from .modeling.attention_methods import ATTENTION_METHODS
from .modeling.configuration_performer import PerformerConfig


def reads_kernel(config: PerformerConfig) -> bool:
    """Whether the config's method reads ``attention_kernel`` (FAVOR+'s feature map, the hybrid's far field): not
    exact attention, nor the sparse method (exact softmax on its support, nothing read outside it)."""
    return ATTENTION_METHODS[config.attention_method].kernels is not None


def states_kernel(config: PerformerConfig) -> bool:
    """Whether a card and a report state ``attention_kernel`` and the random features' settings: every method that
    reads a kernel, and exact attention (``attention_kernel="exact"`` names it); not the sparse method."""
    return reads_kernel(config) or config.attention_method == "exact"


def kernel_description(config: PerformerConfig) -> str:
    """What the config's ``attention_kernel`` computes, from the registry of its method's kernels (FAVOR+'s
    feature maps, the hybrid's far fields)."""
    if config.attention_method == "exact":
        return "exact softmax attention (no approximation)"
    if not reads_kernel(config):
        return "none: exact softmax on the method's support, no kernel for the keys outside it"
    return ATTENTION_METHODS[config.attention_method].kernels[config.attention_kernel].description


def uses_projection(config: PerformerConfig) -> bool:
    """Whether the attention reads the random projection (``nb_features``, coupling, seed): not the deterministic
    far fields, nor exact or sparse attention."""
    return (
        reads_kernel(config)
        and ATTENTION_METHODS[config.attention_method].kernels[config.attention_kernel].uses_projection
    )


def method_lines(config: PerformerConfig) -> list[str]:
    """The method's own settings as card bullet points (the hybrid's support and far field), if it lists any."""
    card_lines = ATTENTION_METHODS[config.attention_method].card_lines
    return [] if card_lines is None else card_lines(config)


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
    accelerator = config.accelerator_exact_max_length
    if accelerator is not None and accelerator != config.exact_max_length and config.attention_method != "exact":
        description += (
            f"; on GPUs and other accelerators, inputs of at most {accelerator} tokens keep exact attention"
            if accelerator
            else "; on GPUs and other accelerators, no input keeps exact attention"
        )
    return description


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
