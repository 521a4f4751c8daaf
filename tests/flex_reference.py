"""FlexAttention's contract in plain PyTorch, with an (L x L) score matrix: the reference the FlexAttention paths'
gradients are tested with (FlexAttention has no backward on a CPU)."""

import torch

Tensor = torch.Tensor


def dense_attend(q: Tensor, k: Tensor, v: Tensor, block_mask, score_mod=None) -> tuple[Tensor, Tensor]:
    """``performer_hf.modeling.hybrid_flex.flex_attend``'s contract (differentiable on any device). Reads the block
    mask's ``mask_mod`` on every pair, not its tiles."""
    B, H, L, _ = q.shape
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))  # grouped-query heads: one per query head
    scores = (q @ k.transpose(-2, -1)).float()  # (B, H, L, L)
    b, h, i, j = (torch.arange(n, device=q.device) for n in (B, H, L, L))
    keep = block_mask.mask_mod(b[:, None, None, None], h[None, :, None, None], i[:, None], j[None, :])
    if score_mod is not None:
        scores = score_mod(scores, None, None, None, None)
    scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, L)
    weights = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return (weights @ v.float()).to(v.dtype), lse
