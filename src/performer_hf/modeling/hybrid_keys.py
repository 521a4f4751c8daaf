"""The exact support of hybrid attention: key sets (keys, values, log-scales, far-field features and mask),
the local window's offsets, and content-based routing of key blocks to query blocks."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .hybrid_far_field import FarContext, far_features

Tensor = torch.Tensor

NEG_INF = float("-inf")


class Keys(NamedTuple):
    """Scaled keys with everything the hybrid sums read; sequence axis 2 (mask: axis 1)."""

    y: Tensor  # (B, H, S, d)
    values1: Tensor  # (B, H, S, dv + 1): [v, 1], zero for padded keys
    klog: Tensor  # (B, H, S, 1): log scale of the far-field features (-inf for padded keys)
    mask: Tensor  # (B, S) bool
    feats: Tensor | None  # (B, H, S, D): far-field features (|.| <= 1 for the exponential kernels)


def key_side(k, v, mask, ctx: FarContext, with_features: bool) -> Keys:
    """Keys (B, H, S, d), values (B, H, S, dv) and their mask (B, S) prepared for the support and the far field;
    without features, ``klog`` is the centering term ``a . y - a . c`` alone."""
    root, a, c, far, projection, parameter, dtype = ctx
    y = k.to(dtype) * root
    rk = y @ a.transpose(-2, -1) - (a * c).sum(-1, keepdim=True)  # (B, H, S, 1): a . y_j - a . c
    keep = mask[:, None, :, None]  # (B, 1, S, 1)
    feats = None
    if not with_features:  # the log-scale of the centering factor alone
        klog = rk
    else:
        feats, klog = far_features(far, y - c, projection, parameter, rk)
        feats = feats * keep
    v = v.to(dtype) * keep
    values1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1) * keep
    return Keys(y, values1, klog.masked_fill(~keep, NEG_INF), mask, feats)


def _map_keys(fn, keys: Keys, mask_fn) -> Keys:
    feats = None if keys.feats is None else fn(keys.feats, 0.0)
    return Keys(fn(keys.y, 0.0), fn(keys.values1, 0.0), fn(keys.klog, NEG_INF), mask_fn(keys.mask), feats)


def slice_keys(keys: Keys, start: int, stop: int) -> Keys:
    return _map_keys(lambda t, _: t[:, :, start:stop], keys, lambda m: m[:, start:stop])


def pad_keys(keys: Keys, before: int, after: int) -> Keys:
    """Add empty (masked) keys on both sides of the sequence axis."""
    if not before and not after:
        return keys
    return _map_keys(lambda t, fill: F.pad(t, (0, 0, before, after), value=fill), keys,
                     lambda m: F.pad(m, (before, after), value=False))  # fmt: skip


def cat_keys(first: Keys, second: Keys) -> Keys:
    feats = None if first.feats is None else torch.cat([first.feats, second.feats], dim=2)
    return Keys(*(torch.cat([f, s], dim=2) for f, s in zip(first[:3], second[:3], strict=True)),
                 torch.cat([first.mask, second.mask], dim=1), feats)  # fmt: skip


def window_offsets(local_window: int, causal: bool) -> tuple[int, int]:
    """(left, right): query i computes keys i - left ... i + right exactly (right = -1: none)."""
    if not local_window:
        return 0, -1
    if causal:
        return local_window - 1, 0
    left = (local_window - 1) // 2
    return left, local_window - 1 - left


def key_block_means(keys: Keys, block_k: int) -> tuple[Tensor, Tensor]:
    """Block statistics for routing: (B, H, Nk, d) the mean of the real keys of each key block (0 where it
    has none) and (B, Nk) whether it has any."""
    B, H, S, d = keys.y.shape
    keep = keys.mask.view(B, 1, S // block_k, block_k, 1).to(keys.y.dtype)
    total = (keys.y.detach().view(B, H, S // block_k, block_k, d) * keep).sum(3)
    count = keep.sum(3)  # (B, 1, Nk, 1)
    return total / count.clamp_min(1), count[:, 0, :, 0] > 0


def route_scores(xq: Tensor, q_mask: Tensor, key_blocks: tuple[Tensor, Tensor], first_block: int, block_k: int,
                  left: int, right: int) -> Tensor:  # fmt: skip
    """(B, H, n, Nk) routing scores of a slab of query blocks: the mean logit between each query block and key block.

    The mean of ``x_i . y_j`` over the real queries ``i`` of a query block and the real keys ``j`` of
    a key block is the dot product of the two block means.
    xq: (B, H, n, bq, d); q_mask: (B, n, bq); key_blocks: from :func:`_key_block_means`.
    Key blocks overlapping the query block's window span, and blocks without real keys, score ``-inf``.
    """
    key_means, has_keys = key_blocks
    n, bq = xq.shape[2:4]
    Nk = key_means.shape[2]
    keep = q_mask[:, None, :, :, None].to(xq.dtype)  # (B, 1, n, bq, 1)
    mean_q = (xq.detach() * keep).sum(3) / keep.sum(3).clamp_min(1)  # (B, H, n, d)
    q_start = (torch.arange(n, device=xq.device) + first_block) * bq
    k_start = torch.arange(Nk, device=xq.device) * block_k
    overlaps = (k_start[None, :] <= (q_start[:, None] + bq - 1 + right)) & (
        (k_start[None, :] + block_k - 1) >= (q_start[:, None] - left)
    )  # (n, Nk)
    excluded = overlaps | ~has_keys[:, None, :]  # (B, n, Nk)
    return (mean_q @ key_means.transpose(-2, -1)).masked_fill_(excluded[:, None], NEG_INF)


def route(xq: Tensor, q_mask: Tensor, key_blocks: tuple[Tensor, Tensor], first_block: int, block_k: int, left: int,
           right: int, nb_routed: int) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Top ``nb_routed`` key blocks for a slab of query blocks by :func:`_route_scores`.

    Returns the chosen key blocks (B, H, n, t) and whether each choice is real (B, H, n, t)
    (False when fewer than ``nb_routed`` blocks qualify).
    """
    scores = route_scores(xq, q_mask, key_blocks, first_block, block_k, left, right)
    top = scores.topk(min(nb_routed, scores.shape[-1]), dim=-1, sorted=False)  # (B, H, n, t)
    return top.indices, torch.isfinite(top.values)


def gather_blocks(t: Tensor, blocks: Tensor, block_k: int) -> Tensor:
    """t (B, H, S, X), blocks (B, H, n, t) -> (B, H, n, t * block_k, X): the rows of the chosen key blocks."""
    B, H, S, X = t.shape
    Nk = S // block_k
    rows = t.reshape(B * H * Nk, block_k * X)
    offsets = (torch.arange(B * H, device=t.device) * Nk).view(B, H, 1, 1)
    picked = rows.index_select(0, (blocks + offsets).flatten())  # (B * H * n * t, block_k * X)
    return picked.view(*blocks.shape[:3], blocks.shape[3] * block_k, X)


def lagged_far_keys(keys: Keys, local_window: int, num_global_tokens: int) -> Keys:
    """The keys a causal far field reads when it leaves out the exact support: position i holds key
    i - local_window (query i's scan then reads keys j <= i - local_window, those outside its window), and
    the first num_global_tokens keys are left out (masked)."""
    L = keys.y.shape[2]
    is_global = torch.arange(L, device=keys.y.device) < num_global_tokens  # (L,)
    far_keys = keys._replace(klog=keys.klog.masked_fill(is_global[:, None], NEG_INF))
    return slice_keys(pad_keys(far_keys, local_window, 0), 0, L)
