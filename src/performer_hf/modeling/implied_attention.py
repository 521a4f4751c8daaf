"""The attention matrix a linear-attention method implies (paper, Appendix C.4), for ``output_attentions=True``.

FAVOR+, the hybrid and the sparse method never form the (L x L) matrix, but each is linear in its values with a
normaliser that does not depend on them: ``out = A v`` for a row-stochastic ``A`` built from the queries and keys.
Their output for the identity matrix as values is therefore ``A`` itself, row i the weights query i gives each key.
That costs what exact attention costs, so it is computed for inputs of at most :data:`IMPLIED_ATTENTION_MAX_LENGTH`
keys, and for a forward over the whole sequence (decoding states keep no keys).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

IMPLIED_ATTENTION_MAX_LENGTH = 1024


def implied_attention(
    attend: Callable[[torch.Tensor], torch.Tensor], values: torch.Tensor, past: int = 0
) -> torch.Tensor:
    """The attention matrix (B, H, Lq, Lk) of the method ``attend`` runs: its output for identity values.

    Args:
        attend: values (B, Hv, Lk, Lk) -> context (B, H, Lq, Lk), the method on the call's queries and keys.
        values: the call's values (B, Hv, Lk, D): their batch, heads, length, dtype and device.
        past: keys of the call that earlier calls cached (decoding): refused.

    Raises:
        ValueError: keys beyond :data:`IMPLIED_ATTENTION_MAX_LENGTH`, or a decoding call.
    """
    batch, heads, length, _ = values.shape
    if past:
        raise ValueError(
            "output_attentions with linear attention returns the attention matrix a forward over the whole sequence "
            f"implies; this call decodes after {past} cached tokens, whose keys the method's state does not keep. "
            "Run model(input_ids, output_attentions=True, use_cache=False) on the whole sequence instead."
        )
    if length > IMPLIED_ATTENTION_MAX_LENGTH:
        raise ValueError(
            f"output_attentions with linear attention computes the implied attention matrix for inputs of at most "
            f"{IMPLIED_ATTENTION_MAX_LENGTH} tokens (an (L x L) cost the method otherwise avoids); this input has "
            f"{length}. Pass a shorter input to inspect attention, or leave output_attentions off."
        )
    identity = torch.eye(length, dtype=values.dtype, device=values.device).expand(batch, heads, length, length)
    return attend(identity)
