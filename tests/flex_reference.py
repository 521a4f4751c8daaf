"""FlexAttention's contract in plain PyTorch, with an (L x L) score matrix: the reference the FlexAttention paths'
gradients are tested with (FlexAttention has no backward on a CPU); and the error that bfloat16 sets for attention
on a GPU, which the compiled paths are held to."""

import torch
import torch.nn.functional as F

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


def sdpa_bfloat16_errors(q: Tensor, k: Tensor, v: Tensor, grad: Tensor, causal: bool) -> list[float]:
    """Relative L2 errors of SDPA's output and its gradients for q, k, v in bfloat16 against float32, on CUDA, with
    ``grad`` the output's gradient: what bfloat16's rounding costs exact attention on these inputs."""

    def run(dtype):
        inputs = [t.detach().to("cuda", dtype).requires_grad_() for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*inputs, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        (out.float() * grad.to("cuda")).sum().backward()
        return [t.detach().float() for t in (out, *(i.grad for i in inputs))]

    pairs = zip(run(torch.bfloat16), run(torch.float32), strict=True)
    return [((low - high).norm() / high.norm()).item() for low, high in pairs]


def bfloat16_tolerances(rounded: list[Tensor], exact: list[Tensor], sdpa_errors: list[float]) -> list[float]:
    """Per tensor (output and gradients), the relative error a bfloat16 run may have against float32: twice what
    rounding the inputs to bfloat16 costs the same method computed in float32 (``rounded`` against ``exact``: a
    selection of keys by score can change with it), twice what bfloat16 costs SDPA, and at least 3%."""
    rounding = [((r - e).norm() / e.norm()).item() for r, e in zip(rounded, exact, strict=True)]
    return [max(3e-2, 2 * a, 2 * b) for a, b in zip(rounding, sdpa_errors, strict=True)]
