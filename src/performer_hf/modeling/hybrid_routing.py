"""Content-based routing of key blocks to query blocks (bidirectional hybrid attention): block statistics, the
routing groups' upper bounds, the top-k choice, and gathering the chosen blocks' rows."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .hybrid_keys import NEG_INF, Keys
from .hybrid_routing_triton import route_blocks as routes_in_kernel
from .hybrid_routing_triton import serves as kernel_serves

Tensor = torch.Tensor


class KeyBlocks(NamedTuple):
    """Block statistics for routing (:func:`key_blocks`)."""

    means: Tensor  # (B, H, Nk, d): the mean of each key block's real keys (0 where it has none)
    has_keys: Tensor  # (B, Nk) bool: whether the block has a real key
    group_size: int  # key blocks per routing group (Nk a multiple of it: blocks without keys pad); 0: no groups
    group_means: Tensor | None  # (B, H, Ng, d): the mean of each group's block means (blocks with keys)
    group_radii: Tensor | None  # (B, H, Ng): the largest distance from that mean to one of them
    group_has_keys: Tensor | None  # (B, Ng) bool: whether the group has a block with keys


def key_blocks(keys: Keys, block_k: int, group_size: int = 0) -> KeyBlocks:
    """Routing statistics of the key blocks of ``block_k`` keys (S a multiple of ``block_k``), and of their
    groups of ``group_size`` consecutive blocks when ``group_size`` > 0 (see :func:`route`)."""
    B, H, S, d = keys.y.shape
    keep = keys.mask.view(B, 1, S // block_k, block_k, 1).to(keys.y.dtype)
    total = (keys.y.detach().view(B, H, S // block_k, block_k, d) * keep).sum(3)
    count = keep.sum(3)  # (B, 1, Nk, 1)
    means, has_keys = total / count.clamp_min(1), count[:, 0, :, 0] > 0
    if not group_size:
        return KeyBlocks(means, has_keys, 0, None, None, None)
    pad = -means.shape[2] % group_size
    means, has_keys = F.pad(means, (0, 0, 0, pad)), F.pad(has_keys, (0, pad))
    in_group = has_keys.view(B, 1, -1, group_size, 1)  # (B, 1, Ng, G, 1)
    grouped = means.view(B, H, -1, group_size, d)  # (B, H, Ng, G, d)
    group_means = (grouped * in_group).sum(3) / in_group.sum(3).clamp_min(1)  # (B, H, Ng, d)
    spread = (grouped - group_means.unsqueeze(3)).norm(dim=-1, keepdim=True)  # (B, H, Ng, G, 1)
    group_radii = (spread * in_group).amax(dim=(3, 4))  # (B, H, Ng)
    return KeyBlocks(means, has_keys, group_size, group_means, group_radii, in_group[:, 0, :, :, 0].any(-1))


class QueryBlocks(NamedTuple):
    """What routing reads of a slab of query blocks (:func:`query_blocks`)."""

    means: Tensor  # (B, H, n, d): the mean of each query block's real queries (0 where it has none)
    window_lo: Tensor  # (n, 1): the first key of each query block's window span
    window_hi: Tensor  # (n, 1): its last key; -1 without a window (``right < 0``): no key block meets the span


def query_blocks(xq: Tensor, q_mask: Tensor, first_block: int, left: int, right: int) -> QueryBlocks:
    """xq (B, H, n, bq, d) and q_mask (B, n, bq), the query blocks ``first_block, ...``, with the window's
    ``left`` / ``right`` offsets."""
    n, bq = xq.shape[2:4]
    keep = q_mask[:, None, :, :, None].to(xq.dtype)  # (B, 1, n, bq, 1)
    means = (xq.detach() * keep).sum(3) / keep.sum(3).clamp_min(1)  # (B, H, n, d)
    start = ((torch.arange(n, device=xq.device) + first_block) * bq)[:, None]  # (n, 1)
    # (without a window, every key block is a candidate: the query block's own too)
    return QueryBlocks(means, start - left, start + bq - 1 + right if right >= 0 else torch.full_like(start, -1))


def group_bounds(queries: QueryBlocks, blocks: KeyBlocks, block_k: int, nb_groups: int) -> Tensor | None:
    """(B, H, n, Ng) an upper bound on each routing group's best block score against each query block, by which
    routing keeps ``nb_groups`` groups; None when there are no more groups than that (every block is then a
    candidate, as without groups).

    ``q . m_b <= q . c + |q| r`` for every block mean ``m_b`` of a group with centre ``c`` and radius ``r``.
    Groups without keys, and groups whose every block overlaps the query block's window span, have ``-inf``."""
    if not _grouped(blocks, nb_groups):
        return None
    Ng, size = blocks.group_means.shape[2], blocks.group_size
    mean_q = queries.means
    bound = mean_q @ blocks.group_means.transpose(-2, -1)  # (B, H, n, Ng)
    bound = bound + mean_q.norm(dim=-1, keepdim=True) * blocks.group_radii.unsqueeze(2)
    group_start = torch.arange(Ng, device=mean_q.device) * size * block_k  # (Ng,): the first key of each group
    first_overlaps = group_start + block_k - 1 >= queries.window_lo  # (n, Ng)
    inside = first_overlaps & (group_start + (size - 1) * block_k <= queries.window_hi)  # ... and so does its last
    return bound.masked_fill_(inside | ~blocks.group_has_keys[:, None, None, :], NEG_INF)


def route_scores(
    queries: QueryBlocks, blocks: KeyBlocks, block_k: int, groups: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Routing scores of a slab of query blocks: the mean logit between each query block and its candidate
    key blocks, (B, H, n, C), and the candidates (B, H, n, C): the blocks of ``groups`` ((B, H, n, g), chosen
    by :func:`group_bounds`), or None for every key block (C = Nk).

    The mean of ``x_i . y_j`` over the real queries ``i`` of a query block and the real keys ``j`` of
    a key block is the dot product of the two block means.
    Key blocks overlapping the query block's window span, and blocks without real keys, score ``-inf``.
    """
    mean_q = queries.means  # (B, H, n, d)
    if groups is None:
        candidates = None
        k_start = torch.arange(blocks.means.shape[2], device=mean_q.device) * block_k  # (Nk,)
        scores = mean_q @ blocks.means.transpose(-2, -1)  # (B, H, n, Nk)
        has_keys = blocks.has_keys[:, None, None, :]  # (B, 1, 1, Nk)
    else:
        B, H, n, _ = mean_q.shape
        size = blocks.group_size
        within = torch.arange(size, device=mean_q.device)
        candidates = (groups.unsqueeze(-1) * size + within).flatten(-2)  # (B, H, n, C): the groups' blocks
        scores = _candidate_scores(mean_q, blocks, groups)  # (B, H, n, C)
        has_keys = blocks.has_keys[:, None, None, :].expand(B, H, n, -1).gather(-1, candidates)
        k_start = candidates * block_k
    overlaps = (k_start <= queries.window_hi) & (k_start + block_k - 1 >= queries.window_lo)
    return scores.masked_fill_(overlaps | ~has_keys, NEG_INF), candidates


def _scores_every_block(blocks: KeyBlocks, nb_groups: int) -> bool:
    """Whether routing with groups scores its candidate blocks (``nb_groups`` groups' blocks) through one product
    with every block's mean, its candidates' columns picked from it: (n, Nk) scores per head, where gathering the
    candidates' means first takes (n, C, d). The smaller: on an H200 at 32K tokens (12 heads, 24 groups of 16 blocks of
    8 keys, d = 32) the gathered means were 1.2 GB, written by one kernel and read by a matrix-vector product (1.0 ms
    of each call's forward), where every block's score is 0.4 GB from one product."""
    candidates = nb_groups * blocks.group_size
    return blocks.means.shape[2] <= candidates * blocks.means.shape[-1]


def _candidate_scores(mean_q: Tensor, blocks: KeyBlocks, groups: Tensor) -> Tensor:
    """The scores (B, H, n, C) of the blocks of each query block's routing groups (B, H, n, g): the dot products of
    the query block's mean (B, H, n, d) with theirs, through every block's score or the gathered means
    (:func:`_scores_every_block`)."""
    size = blocks.group_size
    if _scores_every_block(blocks, groups.shape[-1]):
        every = mean_q @ blocks.means.transpose(-2, -1)  # (B, H, n, Nk), Nk a multiple of the group size
        by_group = every.view(*every.shape[:3], -1, size)  # (B, H, n, Ng, G)
        picked = by_group.gather(3, groups.unsqueeze(-1).expand(*groups.shape, size))  # (B, H, n, g, G)
        return picked.flatten(-2)
    means = gather_blocks(blocks.means, groups, size)  # (B, H, n, C, d)
    return (means @ mean_q.unsqueeze(-1)).squeeze(-1)


def _grouped(blocks: KeyBlocks, nb_routed: int) -> bool:
    """Whether routing keeps groups: with routing groups, more of them than ``nb_routed``."""
    return bool(blocks.group_size) and blocks.group_means.shape[2] > nb_routed


def _in_kernel(blocks: KeyBlocks, nb_routed: int) -> bool:
    """Whether routing with these blocks takes :mod:`.hybrid_routing_triton`'s kernel: with groups, where it serves."""
    return _grouped(blocks, nb_routed) and kernel_serves(blocks.means, nb_routed, blocks.group_size)


def route_width(blocks: KeyBlocks, nb_routed: int) -> int:
    """Elements per query block (and head) of :func:`route_scores`' temporaries, for sizing slabs (the kernel's:
    its choices alone)."""
    if _in_kernel(blocks, nb_routed):
        return 2 * nb_routed
    if _grouped(blocks, nb_routed):
        candidates = nb_routed * blocks.group_size
        every = _scores_every_block(blocks, nb_routed)
        scores = blocks.means.shape[2] if every else candidates * blocks.means.shape[-1]  # or the gathered means
        return blocks.group_means.shape[2] + scores + candidates
    return blocks.means.shape[2]


def route(
    xq: Tensor, q_mask: Tensor, blocks: KeyBlocks, first_block: int, block_k: int, left: int, right: int, nb_routed: int
) -> tuple[Tensor, Tensor]:
    """Top ``nb_routed`` key blocks for a slab of query blocks (xq (B, H, n, bq, d), q_mask (B, n, bq)) by
    :func:`route_scores`.

    Returns the chosen key blocks (B, H, n, t) and whether each choice is real (B, H, n, t)
    (False when fewer than ``nb_routed`` blocks qualify; such a choice names block 0).
    With routing groups (``blocks.group_size``), the candidates are the blocks of the ``nb_routed`` groups
    with the highest :func:`group_bounds`: the bounds are quadratic in the length, but ``group_size`` times
    fewer than the scores of every block; the candidates' scores are a fixed number per query block. On CUDA, in one
    Triton kernel where it serves (:mod:`.hybrid_routing_triton`).
    """
    queries = query_blocks(xq, q_mask, first_block, left, right)
    if _in_kernel(blocks, nb_routed):
        geometry = [first_block, xq.shape[3], block_k, left, right]
        stats = (blocks.group_means, blocks.group_radii, blocks.group_has_keys, blocks.means, blocks.has_keys)
        return routes_in_kernel(queries.means, *stats, geometry, nb_routed)
    bounds = group_bounds(queries, blocks, block_k, nb_routed)
    groups = None if bounds is None else bounds.topk(nb_routed, dim=-1, sorted=False).indices
    scores, candidates = route_scores(queries, blocks, block_k, groups)
    top = scores.topk(min(nb_routed, scores.shape[-1]), dim=-1, sorted=False)  # (B, H, n, t)
    real = torch.isfinite(top.values)
    chosen = top.indices if candidates is None else candidates.gather(-1, top.indices)
    return chosen.masked_fill_(~real, 0), real


def gather_blocks(t: Tensor, blocks: Tensor, block_k: int) -> Tensor:
    """t (B, H, S, X), blocks (B, H, n, t) -> (B, H, n, t * block_k, X): the rows of the chosen key blocks."""
    B, H, S, X = t.shape
    Nk = S // block_k
    rows = t.reshape(B * H * Nk, block_k * X)
    offsets = (torch.arange(B * H, device=t.device) * Nk).view(B, H, 1, 1)
    picked = rows.index_select(0, (blocks + offsets).flatten())  # (B * H * n * t, block_k * X)
    return picked.view(*blocks.shape[:3], blocks.shape[3] * block_k, X)
