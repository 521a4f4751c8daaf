"""Plain O(L^2) references for testing and studies: exact softmax attention and the FAVOR
estimator written with explicit features. Deliberately simple; never used on a hot path."""

from __future__ import annotations

import torch

from .modeling.favor_features import feature_map

Tensor = torch.Tensor


def _visibility(q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """Boolean (B, 1, Lq, Lk) matrix: may query i see key j?"""
    B, Lq, Lk = q.shape[0], q.shape[2], k.shape[2]
    visible = torch.ones(B, 1, Lq, Lk, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
    if key_padding_mask is not None:
        visible = visible & key_padding_mask.to(torch.bool)[:, None, None, :]
    return visible


def exact_attention(q, k, v, *, causal=False, key_padding_mask=None, scaling=None) -> Tensor:
    """softmax(q k^T * scaling) v with an explicit (B, H, Lq, Lk) matrix."""
    scaling = q.shape[-1] ** -0.5 if scaling is None else scaling
    logits = (q.double() @ k.double().transpose(-2, -1)) * scaling  # (B, H, Lq, Lk)
    logits = logits.masked_fill(~_visibility(q, k, causal, key_padding_mask), float("-inf"))
    return (torch.softmax(logits, dim=-1) @ v.double()).to(q.dtype)


def explicit_feature_attention(
    q, k, v, projection, *, causal=False, kernel="softmax", key_padding_mask=None, scaling=None
) -> Tensor:
    """The FAVOR estimator phi(q) phi(k)^T, normalised row by row, with an explicit matrix."""
    scale = (q.shape[-1] ** -0.5 if scaling is None else scaling) ** 0.5
    phi_q = feature_map(q.double() * scale, projection.double(), kernel)  # (B, H, Lq, m)
    phi_k = feature_map(k.double() * scale, projection.double(), kernel)  # (B, H, Lk, m)
    weights = phi_q @ phi_k.transpose(-2, -1)  # (B, H, Lq, Lk): estimates exp(q k^T * scaling)
    weights = weights * _visibility(q, k, causal, key_padding_mask)
    return ((weights @ v.double()) / weights.sum(dim=-1, keepdim=True)).to(q.dtype)
